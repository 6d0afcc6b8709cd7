"""The store's bookkeeping at its edges: long and hashed names, and a
directory fsync that fails after the new file is already in place."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from safetensors import safe_open

from kvkeeper.client.client import Client
from kvkeeper.daemon.faults import ENV
from kvkeeper.daemon.store import Budget, Store, StoredEntry
from kvkeeper.protocol import safetensors as st

from .conftest import (
    WAIT,
    RunningDaemon,
    daemon_log,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
)
from .faultkit import (
    FP,
    MiB,
    entry_path,
    filled,
    limit_file_size,
    small_tmpfs,
    version_of,
)
from .test_cli_checks import cli

LONG_MODEL = "m-" + "0123456789abcdef" * 2  # the shape of model_fingerprint()


def test_an_entry_with_a_hashed_file_name_is_listed_by_its_key(
    client: Client, daemon: RunningDaemon
) -> None:
    model, cache_id = "M" * 300, "Session/" + "x" * 400  # both too long for a file name
    assert client.save(model, cache_id, filled(1, 3), [3])
    assert client.flush(timeout=WAIT)
    path = entry_path(daemon.root, cache_id, model=model)
    assert path.name.startswith("_z") and path.parent.name.startswith("_z")
    listed = client.entries(model)
    assert [(e.model, e.cache_id, e.tokens) for e in listed] == [(model, cache_id, 1)]
    assert client.delete(model, cache_id)
    assert client.entries(model) == []


def test_copies_under_names_the_daemon_does_not_give_are_not_entries(
    client: Client, daemon: RunningDaemon
) -> None:
    """An entry's file copied by hand to "a_2Fb" or "a_ 2fb" (names int()
    reads as the escape of "a/b"): each was listed as one more entry of its
    key (evictable, and `rm` deleted one file while `ls` went on listing the
    key), though README counts files under names the daemon does not give
    as foreign: listed, never deleted. An mlx-lm cache under "Notes" was
    an evictable legacy file."""
    from mlx_lm.models.cache import save_prompt_cache

    assert client.save(FP, "a/b", filled(0.25, 3), [3]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "a/b")
    assert path.name == "a_2fb.safetensors"
    copies = [path.with_name("a_2Fb.safetensors"), path.with_name("a_ 2fb.safetensors")]
    for copy in copies:
        copy.write_bytes(path.read_bytes())
    notes = path.with_name("Notes.safetensors")
    save_prompt_cache(str(notes), filled(0.25, 4))
    # Places the daemon does give stay its own: a copy at another key's
    # place is that key's (damaged) entry, an mlx-lm cache at a hashed
    # place an evictable legacy file.
    other = entry_path(daemon.root, "c")
    other.write_bytes(path.read_bytes())
    hashed = entry_path(daemon.root, "x" * 300)
    save_prompt_cache(str(hashed), filled(0.25, 5))
    # A hashed place its header does not name: whose it is cannot be told
    # (taken for the header's key, a/b was listed twice).
    unvouched = entry_path(daemon.root, "y" * 300)
    unvouched.write_bytes(path.read_bytes())
    client.gc()  # re-reads the root
    assert sorted(e.cache_id for e in client.entries()) == ["a/b", "c"]
    kinds = {Path(e.path).name: e.kind for e in client.entries(everything=True)}
    assert kinds == {path.name: "entry", other.name: "entry", hashed.name: "legacy",
                     unvouched.name: "foreign", notes.name: "foreign",
                     **{c.name: "foreign" for c in copies}}
    assert client.delete(FP, "a/b") and [e.cache_id for e in client.entries()] == ["c"]
    assert all(c.exists() for c in [*copies, notes])


def test_a_damaged_file_with_a_long_key_is_moved_aside(
    client: Client, daemon: RunningDaemon
) -> None:
    # Each component fits a file name (190 bytes is not hashed); together
    # they do not fit the name of the moved file.
    cache_id = "c" * 190
    assert client.save(LONG_MODEL, cache_id, filled(1, 5), [5])
    assert client.flush(timeout=WAIT)
    path = entry_path(daemon.root, cache_id, model=LONG_MODEL)
    with open(path, "r+b") as f:  # damage the last byte in place (same inode)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert client.load(LONG_MODEL, cache_id) is None
    assert not path.exists()
    moved = list((daemon.root / "quarantine").iterdir())
    assert len(moved) == 1 and len(moved[0].name.encode()) <= 255
    assert client.stats().get("internal_errors", 0) == 0


def test_a_failed_directory_fsync_still_indexes_the_file_it_put_in_place(
    short_dir: Path,
) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: "io_error=dir_fsync"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save("fp", "k", filled(1, 4), [4])
            # Not durable (the directory's fsync failed), so the flush says so...
            assert kv.flush(timeout=WAIT) is False
            path = entry_path(root, "k", model="fp")
            # ...but the file was renamed into place and is served.
            assert version_of(path, "fp") == 4
            with safe_open(str(path), "np") as f:
                assert len(list(f.keys())) == 8
            assert [(e.model, e.cache_id) for e in kv.entries("fp")] == [("fp", "k")]
            assert kv.stats()["disk_used_bytes"] == path.stat().st_size
    finally:
        assert stop_process(proc) == 0


def test_a_budget_pass_that_fails_after_the_commit_leaves_the_save_written(
    short_dir: Path,
) -> None:
    """Applying the disk budget after a save's commit can fail part way
    (statvfs with EIO, say; here EIO after each eviction): the save is
    durable and served, so its flush says True (before: saves_failed +1 and
    flush False for a file in place), and the entries already evicted are
    counted (a helper's find: they were not)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    budget = int(2.5 * 2**20)  # room for two of the 1 MiB saves
    # No free-space floor: this machine's free space must not add evictions.
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         env={ENV: "io_error=evicted"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            sizes = {}
            for v, key in enumerate("abcd", 1):
                assert kv.save("fp", key, filled(1, v), [v])
                assert kv.flush(timeout=WAIT) is True, key
                sizes[key] = entry_path(root, key, model="fp").stat().st_size
            stats = kv.stats()
            assert stats["saves_written"] == 4 and stats.get("saves_failed", 0) == 0
            # c's pass evicted a, then failed; d's evicted b, then failed.
            assert stats["evictions"] == 2
            assert stats["bytes_evicted"] == sizes["a"] + sizes["b"]
            assert sorted(e.cache_id for e in kv.entries("fp")) == ["c", "d"]
            for v, key in ((3, "c"), (4, "d")):
                assert version_of(entry_path(root, key, model="fp"), "fp") == v
            assert stats["disk_used_bytes"] == sizes["c"] + sizes["d"]
    finally:
        assert stop_process(proc) == 0
    assert daemon_log(proc).count("event=budget_failed") == 2


def test_a_gc_whose_budget_pass_crashes_says_so(short_dir: Path) -> None:
    """A bug in a gc's budget pass (RuntimeError after its first eviction):
    the gc was answered as done, "evicted nothing" or the one, exit 0 (a
    review). It now fails with the crash named, exit 1."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-free-bytes", "0", env={ENV: "bug=evicted"})
    try:
        with Client(sock, timeout=WAIT) as kv:
            for v, key in enumerate("ab", 1):
                assert kv.save(FP, key, filled(1, v), [v]) and kv.flush(timeout=WAIT)
        assert stop_process(proc) == 0
        size = entry_path(root, "b").stat().st_size
        # A budget of one entry from the start: the scan's pass crashes too (logged).
        proc = serve_process(root, sock, "--min-free-bytes", "0", "--max-disk-bytes",
                             str(size + 4096), env={ENV: "bug=evicted"})
        (root / "notes.bin").write_bytes(b"n" * 8192)  # over it again: b goes, then the bug
        r = cli("gc", "--socket", str(sock))
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert r.stderr.startswith("kvkeeper: gc failed: applying the disk budget crashed "
                                   "(an internal error; the daemon's log has its traceback)"), \
            r.stderr
        assert "it evicted 1 entry first" in r.stderr, r.stderr
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["internal_errors"] >= 1
    finally:
        assert stop_process(proc) == 0
    assert "event=gc_crashed" in daemon_log(proc)


@pytest.mark.parametrize("fault", ["bug=listing", "io_error=listing"])
def test_a_listing_that_fails_in_the_daemon_is_answered_at_once(fault: str,
                                                                short_dir: Path) -> None:
    """An answer that raised in the daemon (a bug, or an I/O error no listing
    meets otherwise) was logged and never sent: the client waited out its
    timeout, then said the daemon did not answer (DaemonTimedOut, "no
    daemon" from ls, exit 3). It is now answered as an internal error."""
    from kvkeeper.client.client import DaemonError

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: fault})
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "a", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
            with pytest.raises(DaemonError) as caught:
                kv.entries()
            assert caught.value.code == "internal"
            assert caught.value.message.startswith("the daemon failed answering it: "), \
                caught.value.message
            assert "injected" in caught.value.message and "at listing" in caught.value.message
            assert kv.load(FP, "a") is not None  # it goes on serving
            assert kv.stats()["internal_errors"] == 1
        r = cli("ls", "--socket", str(sock))
        assert r.returncode == 1 and "the daemon failed answering it" in r.stderr, \
            (r.stdout, r.stderr)
    finally:
        assert stop_process(proc) == 0
    assert "event=internal_error answer=_list" in daemon_log(proc)


def test_evictions_before_a_budget_pass_fails_are_counted(short_dir: Path) -> None:
    """As above, for the other budget passes: the one that makes room before
    a write (a full disk), the start-up scan's and a gc's. Entries they
    evicted before failing are gone: they are counted now (they were not)."""
    with small_tmpfs(short_dir, "8m") as mnt:
        root, sock = mnt / "root", short_dir / "run" / "kv.sock"
        faulty = {ENV: "io_error=evicted"}
        proc = serve_process(root, sock, "--min-free-bytes", "0", env=faulty)
        try:
            with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
                sizes = {}
                for v, key in enumerate("abc", 1):
                    assert kv.save(FP, key, filled(2, v), [v]) and kv.flush(timeout=WAIT) is True
                    sizes[key] = entry_path(root, key).stat().st_size
                # d needs room on the full disk: a goes, then the pass fails, and d with it.
                assert kv.save(FP, "d", filled(2, 4), [4])
                assert kv.flush(timeout=WAIT) is False
                stats = kv.stats()
                assert (stats["evictions"], stats["bytes_evicted"]) == (1, sizes["a"])
                assert not entry_path(root, "a").exists()
        finally:
            assert stop_process(proc) == 0
        # Over a budget of one entry at start: the scan evicts b, then fails.
        proc = serve_process(root, sock, "--min-free-bytes", "0",
                             "--max-disk-bytes", str(sizes["c"] + 4096), env=faulty)
        try:
            with Client(sock, timeout=WAIT) as kv:
                stats = kv.stats()
                assert (stats["evictions"], stats["bytes_evicted"]) == (1, sizes["b"])
                (root / "notes.bin").write_bytes(b"n" * 8192)  # over it again: c goes
                # The gc that failed says so (before: "evicted 1" and exit 0,
                # or "evicted nothing" for a failure before its first).
                r = cli("gc", "--socket", str(sock))
                assert r.returncode == 1, (r.stdout, r.stderr)
                assert r.stderr.startswith("kvkeeper: gc failed: applying the disk budget "
                                           "failed: ") and "injected I/O error" in r.stderr
                assert r.stderr.rstrip().endswith(
                    "; it evicted 1 entry first (the daemon's log names them)"), r.stderr
                stats = kv.stats()
                assert (stats["evictions"], stats["bytes_evicted"]) == (2, sizes["b"] + sizes["c"])
                assert kv.entries() == []
        finally:
            assert stop_process(proc) == 0
    log = daemon_log(proc)
    assert "event=scan_failed" in log and "event=gc_failed" in log


@pytest.mark.parametrize("code", [22, 95], ids=["EINVAL", "ENOTSUP"])
def test_a_file_system_that_cannot_sync_directories_still_keeps_saves(
    short_dir: Path, code: int
) -> None:
    """Some network and FUSE file systems answer a directory's fsync with
    EINVAL or ENOTSUP: every save there must not fail for it (EIO still
    fails it: the test above). The log says so once, not at every save."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: f"dir_fsync_errno={code}"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for v, (model, key) in enumerate([("fp", "a"), ("fp", "b"), ("fp2", "a")], 1):
                assert kv.save(model, key, filled(0.25, v, layers=1), [v])
                assert kv.flush(timeout=WAIT) is True
            for v, (model, key) in enumerate([("fp", "a"), ("fp", "b"), ("fp2", "a")], 1):
                assert version_of(entry_path(root, key, model=model), model) == v
            assert kv.stats()["saves_failed"] == 0
    finally:
        assert stop_process(proc) == 0
    log = daemon_log(proc)
    assert log.count("event=dir_fsync_unsupported") == 1, log


@pytest.mark.parametrize("name", ["EINVAL", "ENOTSUP", "EOPNOTSUPP", "ENOTTY", "EIO"])
def test_full_fsync_falls_back_to_fsync_where_f_fullfsync_is_refused(
        short_dir: Path, name: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """macOS's F_FULLFSYNC branch (never run on Linux before), with the fcntl
    call answering as a file system that refuses it: EINVAL, ENOTSUP,
    EOPNOTSUPP or ENOTTY fall back to fsync; EIO is raised. (EOPNOTSUPP is
    ENOTSUP's number on Linux, 102 against 45 on macOS, where it failed
    every save: this test cannot show that difference here.)"""
    import errno
    import fcntl

    from kvkeeper.daemon import durable

    code = getattr(errno, name)
    asked: list[int] = []

    def refuse(fd: int, cmd: int, *arg: object) -> int:
        asked.append(cmd)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(durable, "_F_FULLFSYNC", 51)  # macOS's number
    monkeypatch.setattr(fcntl, "fcntl", refuse)
    monkeypatch.setattr(durable, "_fullfsync_warned", set())
    fd = os.open(short_dir / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if name != "EIO":
            with caplog.at_level(logging.WARNING, logger="kvkeeper.store"):
                durable.full_fsync(fd)
                durable.full_fsync(fd)
            # Said once, for the file system (it was silent: the README
            # promises F_FULLFSYNC on macOS).
            said = [r.getMessage() for r in caplog.records]
            assert sum("event=full_fsync_unsupported" in x for x in said) == 1, said
        else:
            with pytest.raises(OSError) as raised:
                durable.full_fsync(fd)
            assert raised.value.errno == code
    finally:
        os.close(fd)
    assert asked == [51] * (1 if name == "EIO" else 2)


def test_a_directory_fsync_failing_at_start_is_reported_in_one_line(short_dir: Path) -> None:
    """EIO from the root's fsync at start (a failing disk): exit 2 with the
    reason, not a traceback."""
    root, sock = short_dir / "root", short_dir / "kv.sock"
    env = {**os.environ, ENV: "dir_fsync_errno=5"}
    done = subprocess.run([sys.executable, "-m", "kvkeeper", "serve", "--root", str(root),
                           "--socket", str(sock)], env=env, capture_output=True, text=True,
                          timeout=WAIT)
    assert done.returncode == 2, done
    assert f"kvkeeper: cannot fsync {root}: injected: Input/output error" in done.stderr
    assert "Traceback" not in done.stderr


def _age(path: Path, *, used: float, modified: float) -> None:
    os.utime(path, (used, modified))


def test_the_daemons_own_reads_do_not_count_as_uses(short_dir: Path) -> None:
    """Least recently used first, across a restart and a gc, both of which
    read every header under the root."""
    from .conftest import start_daemon

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    d = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for key in ("used", "never"):
                assert kv.save("fp", key, filled(1, 1), [1])
            assert kv.flush(timeout=WAIT)
    finally:
        assert d.stop() == 0
    now = time.time()
    # "used" was written long ago and loaded recently; "never" was written
    # later and never loaded (its atime is not after its mtime, so on a
    # relatime mount the next read of it would move its atime to now).
    _age(entry_path(root, "used", model="fp"), used=now - 100, modified=now - 2000)
    never = entry_path(root, "never", model="fp")
    _age(never, used=now - 1000, modified=now - 1000)
    before = never.stat().st_atime_ns
    d = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            kv.gc()
            kv.gc()
            assert [e.cache_id for e in kv.entries("fp")] == ["never", "used"]
    finally:
        assert d.stop() == 0
    assert never.stat().st_atime_ns == before


def test_reading_a_header_puts_the_atime_back_where_o_noatime_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # macOS has no O_NOATIME: the fallback restores the access time.
    monkeypatch.setattr(st, "_O_NOATIME", 0)
    path = tmp_path / "x.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((4,))})
    _age(path, used=1_000_000, modified=2_000_000)  # atime <= mtime: relatime reads move it
    with st.open_file(path, keep_atime=True) as (_, header):
        assert "a" in header.tensors
    assert path.stat().st_atime == 1_000_000 and path.stat().st_mtime == 2_000_000


def _three_entries(short_dir: Path) -> Path:
    """Entries a, b and c of model fp (0.25 MiB each), written by a daemon
    that is then stopped; returns its root."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    d = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for key in ("a", "b", "c"):
                assert kv.save("fp", key, filled(0.25, 1), [1])
            assert kv.flush(timeout=WAIT)
    finally:
        assert d.stop() == 0
    return root


def _indexed(store: Store, order: str) -> Store:
    """``store`` opened and indexed, its entries of model fp used in
    ``order`` (one letter an id), 10 ms apart."""
    store.open()
    store.sweep()
    assert store.rescan()
    for key in order:
        assert store.find("fp", key) is not None
        time.sleep(0.01)
    return store


def test_an_entry_loaded_while_eviction_runs_is_kept(short_dir: Path) -> None:
    """Eviction sorts its candidates, then deletes them one by one; a load
    answered in between makes its entry the newest, so it must be spared."""
    root = _three_entries(short_dir)

    class LoadedMidEviction(Store):
        """Short of free space by one byte; the first look at a candidate
        after the candidates are sorted is where a load of "a" lands."""

        checks = 0

        def free_bytes(self, where: Path | None = None) -> int:
            return 0

        def _still_indexed(self, entry: StoredEntry) -> bool:
            self.checks += 1
            if self.checks == 1:
                assert self.find("fp", "a") is not None
            return super()._still_indexed(entry)

    store = _indexed(LoadedMidEviction(root, Budget(None, 1)), "abc")  # "a" used longest ago
    evicted = store.enforce_budget()
    assert [e.cache_id for e in evicted] == ["b"]
    assert [e.cache_id for e in store.entries("fp")] == ["c", "a"]
    assert version_of(entry_path(root, "a", model="fp"), "fp") == 1


def test_an_entry_whose_save_comes_while_eviction_runs_still_goes_last(
        short_dir: Path) -> None:
    """A save of "c" is queued (the key protected) after eviction took its
    candidates: "c" is kept for last, but still evicted when the budget needs
    it. It was dropped from the pass: the store stayed over its budget, and
    the log blamed foreign files."""
    root = _three_entries(short_dir)
    size = entry_path(root, "a", model="fp").stat().st_size

    class SavedMidEviction(Store):
        """The first check after the candidates are taken is where the save
        of "c" lands."""

        checks = 0

        def _still_indexed(self, entry: StoredEntry) -> bool:
            self.checks += 1
            if self.checks == 1:
                self.protect("fp", "c")
            return super()._still_indexed(entry)

    store = _indexed(SavedMidEviction(root, Budget(size, 0)), "bca")  # "b" used longest ago
    evicted = store.enforce_budget(keep=entry_path(root, "a", model="fp"))
    assert [e.cache_id for e in evicted] == ["b", "c"]
    assert store.usage() == size == _bytes_under(root)


def test_file_names_that_are_not_utf8_are_listed_not_fatal(short_dir: Path) -> None:
    """A file whose name is not UTF-8 under the root (a copy with a Latin-1
    name, another program's file): listing it made the reply fail to encode,
    and the error stopped the daemon at once, without a drain."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("m1", "a", filled(1, 3), [3]) and kv.flush(timeout=WAIT)
            entry = entry_path(root, "a", model="m1")
            odd_entry = os.fsencode(entry.parent) + b"/\xff.safetensors"
            with open(entry, "rb") as src, open(odd_entry, "wb") as dst:
                dst.write(src.read())
            (root / "other").mkdir()
            with open(os.fsencode(root / "other") + b"/caf\xe9.txt", "wb") as f:
                f.write(b"not ours")
            kv.gc()  # looks at the disk again
            # The copy is under a name the daemon does not give: foreign.
            assert [Path(e.path).name for e in kv.entries("m1")] == ["a.safetensors"]
            everything = kv.entries(everything=True)
            assert any(e.path.endswith("/\\xff.safetensors") and e.kind == "foreign"
                       for e in everything)
            assert any(e.path.endswith("other/caf\\xe9.txt") for e in everything)
            assert kv.save("m1", "b", filled(1, 4), [4]) and kv.flush(timeout=WAIT)
        assert proc.poll() is None
    finally:
        assert stop_process(proc) == 0
    assert version_of(entry_path(root, "b", model="m1"), "m1") == 4


@pytest.mark.parametrize("what", ["root", "root-made-a-file", "socket"])
def test_a_daemon_whose_root_or_socket_is_removed_exits_for_a_new_one(
    short_dir: Path, what: str
) -> None:
    """The root removed (to clear the store): every save failed from then on,
    and its lock went with it, so a second daemon could take the same root.
    The socket removed (a /tmp cleaner): no client could reach the daemon,
    which still held the root. Either way it now drains and exits 1, and a
    new daemon takes the place."""
    import shutil

    root, sock = short_dir / "root", short_dir / "run" / "s"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("fp", "k", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
        if what.startswith("root"):
            shutil.rmtree(root)
            if what == "root-made-a-file":  # the lock file's path now fails with ENOTDIR
                root.write_text("not a directory")
        else:
            sock.unlink()
        assert proc.wait(WAIT) == 1
        log = daemon_log(proc)
        assert "event=place_gone" in log, log
        assert ("lock file" if what.startswith("root") else "socket") in log
        if what == "root-made-a-file":
            root.unlink()
        proc = serve_process(root, sock)
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("fp", "k", filled(0.1, 2), [2]) and kv.flush(timeout=WAIT)
        assert version_of(entry_path(root, "k", model="fp"), "fp") == 2
    finally:
        stop_process(proc)


def test_a_store_cleared_with_its_root_kept_takes_saves_again(
    client: Client, daemon: RunningDaemon
) -> None:
    """`rm -rf <root>/*` clears the store but keeps the root and its lock
    file (a dot file): the daemon stayed up, and every save failed with
    ENOENT from then on (its sessions directory was gone), while the listing
    kept the removed entries."""
    import shutil

    assert client.save("fp", "a", filled(0.1, 1), [1]) and client.flush(timeout=WAIT)
    for p in daemon.root.iterdir():
        if not p.name.startswith("."):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert client.save("fp", "b", filled(0.1, 2), [2]) and client.flush(timeout=WAIT)
    assert version_of(entry_path(daemon.root, "b", model="fp"), "fp") == 2
    assert [e.cache_id for e in client.entries()] == ["b"]
    assert client.load("fp", "a") is None


def _bytes_under(root: Path) -> int:
    """Every regular file the daemon counts: all under the root but the files
    directly in it (its lock)."""
    total = 0
    for dirpath, _, names in os.walk(root):
        if Path(dirpath) != root:
            total += sum(os.lstat(os.path.join(dirpath, n)).st_size for n in names)
    return total


BUDGET = 500_000


def test_the_budget_evicts_in_order_of_use_and_counts_every_byte(short_dir: Path) -> None:
    """80 random saves, loads, deletes and damaged files against a budget
    of about three entries. After each: the daemon's count of bytes equals what is on disk;
    the entries left are the most recently used ones (a suffix of the order
    of use, the newest save always kept); a file moved aside goes before any
    entry. (The daemon keeps this order and count as they change, not by
    summing and sorting the index at each save.)"""
    rng = random.Random(20261204)
    root = short_dir / "root"
    rd = start_daemon(root, short_dir / "kv.sock", max_disk_bytes=BUDGET)
    used: list[str] = []  # keys in the order of their last use, oldest first
    quarantine = root / "quarantine"
    damaged = quarantine_went_first = 0

    def aside() -> int:
        return len(os.listdir(quarantine)) if quarantine.exists() else 0

    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for step in range(80):
                op = rng.choice(["save", "save", "save", "load", "load", "delete", "damage"])
                key = f"k{rng.randrange(8)}"
                if op == "damage" and used:
                    key = rng.choice(used)
                aside_before = aside()
                if op == "save":
                    mib = rng.choice([0.05, 0.1, 0.2, 0.3])
                    assert kv.save(FP, key, filled(mib, step), [step]) and kv.flush(timeout=WAIT)
                    used = [k for k in used if k != key] + [key]
                elif op == "load":
                    got = kv.load(FP, key)
                    assert (got is not None) == (key in used), (step, key, used)
                    if got is not None:
                        used = [k for k in used if k != key] + [key]
                elif op == "delete":
                    assert kv.delete(FP, key) == (key in used), (step, key, used)
                    used = [k for k in used if k != key]
                elif key in used:  # damage: the next load misses and moves it aside
                    path = entry_path(root, key)
                    with open(path, "r+b") as f:
                        f.truncate(path.stat().st_size // 2)
                    assert kv.load(FP, key) is None
                    used = [k for k in used if k != key]
                    damaged += 1
                    deadline = time.monotonic() + WAIT
                    while os.path.lexists(path):
                        assert time.monotonic() < deadline, "damaged file was not moved aside"
                        time.sleep(0.01)
                kv.ping()  # after every use the loads reported
                left = [k for k in used if entry_path(root, k).exists()]
                gone = [k for k in used if k not in left]
                assert left == used[len(gone):], (step, op, key, used, left)  # oldest went
                if op == "save":
                    assert left[-1] == key
                if gone:
                    # Entries went only after every file moved aside had gone.
                    assert aside() == 0, step
                if op == "save" and aside() < aside_before:
                    quarantine_went_first += 1  # evicted: the save needed room
                used = left
                stats = kv.stats()
                assert stats["disk_used_bytes"] == _bytes_under(root), (step, op, key)
                if len(left) > 1:
                    assert stats["disk_used_bytes"] <= BUDGET, (step, stats["disk_used_bytes"])
            # The sequence took every path: evictions, a file moved aside and
            # evicted, loads that found and missed.
            assert stats["evictions"] >= 10 and damaged >= 2 and quarantine_went_first >= 1, \
                (stats, damaged, quarantine_went_first)
    finally:
        assert rd.stop() == 0


def test_a_file_dated_back_by_hand_is_evicted_as_the_oldest(short_dir: Path) -> None:
    """An entry whose file changed by hand since it was indexed (here: dated
    back a day, as `touch -d yesterday` does) is counted anew at the next
    eviction and not evicted then; after that it takes its place in the order
    by its file's times: first to go. (It was put last, as if just used, and
    entries used seconds ago went before it.)"""
    root = short_dir / "root"
    rd = start_daemon(root, short_dir / "kv.sock", max_disk_bytes=int(4.5 * 0.1 * 2**20))
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for k in "abcd":
                assert kv.save(FP, k, filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
            yesterday = time.time() - 86400
            os.utime(entry_path(root, "a"), (yesterday, yesterday))
            left = []
            for k in "efg":
                assert kv.save(FP, k, filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
                left.append("".join(x for x in "abcdefg" if entry_path(root, x).exists()))
            assert left == ["acde", "cdef", "defg"], left
    finally:
        assert rd.stop() == 0


def test_the_count_of_bytes_is_never_read_half_made(short_dir: Path) -> None:
    """`stats` while `gc` re-reads a root of 10,000 files: disk_used_bytes is
    the whole count every time (it was read while the index was being
    rebuilt: 0, or a part of it)."""
    root = short_dir / "root"
    (root / "sessions" / "other").mkdir(parents=True)
    os.chmod(root, 0o700)
    for i in range(10_000):
        (root / "sessions" / "other" / f"f{i}").write_bytes(b"z" * 100)
    rd = start_daemon(root, short_dir / "kv.sock")
    seen: list[float] = []
    try:
        with Client(rd.socket, timeout=WAIT) as kv, Client(rd.socket, timeout=WAIT) as poller:
            for _ in range(4):
                done = threading.Event()
                gc = threading.Thread(target=lambda done=done: (kv.gc(), done.set()))
                gc.start()
                while not done.is_set():
                    seen.append(poller.stats()["disk_used_bytes"])
                gc.join(WAIT)
                assert not gc.is_alive()
    finally:
        assert rd.stop() == 0
    assert len(seen) > 20 and set(seen) == {1_000_000}, (len(seen), sorted(set(seen))[:5])


def test_the_start_up_sweep_removes_only_the_writers_own_tmp_files(short_dir: Path) -> None:
    """A crash leaves ``.<entry file>.<pid>.<n>.tmp`` behind: swept at start.
    The sweep took every ``.*.tmp`` of a model directory, another program's
    ``.notes.tmp`` too, where the README says such files are never deleted."""
    root = _three_entries(short_dir)
    model_dir = entry_path(root, "a", model="fp").parent
    ours = model_dir / ".a.safetensors.4242.7.tmp"
    theirs = [model_dir / n for n in (".notes.tmp", "notes.tmp", ".a.safetensors.tmp",
                                      ".a.safetensors.x.7.tmp", ".a.safetensors.backup")]
    for f in (ours, *theirs):
        f.write_bytes(b"x" * 100)
    d = start_daemon(root, short_dir / "run" / "kv.sock")
    try:
        with Client(d.socket, timeout=WAIT) as kv:
            foreign = {e.path for e in kv.entries(everything=True) if e.kind == "foreign"}
    finally:
        assert d.stop() == 0
    assert not ours.exists() and all(f.exists() for f in theirs)
    assert foreign == {str(f) for f in theirs}


def test_files_in_the_root_itself_count_against_the_budget(short_dir: Path) -> None:
    """``--max-disk-bytes`` is over everything under the root: a file put in
    the root itself was neither counted nor listed (only files below it
    were), so the store could grow past its budget without end. The lock
    files (the root's, and the socket's when the socket is in the root) are
    the daemon's own: neither."""
    root = _three_entries(short_dir)
    size = entry_path(root, "a", model="fp").stat().st_size
    big = root / "big-notes.bin"
    big.write_bytes(b"n" * (size * 3 // 2))
    d = start_daemon(root, root / "kv.sock", max_disk_bytes=3 * size)
    try:
        assert (root / "kv.sock.lock").exists() and (root / ".kvkeeper.lock").exists()
        with Client(d.socket, timeout=WAIT) as kv:
            listed = {(e.path, e.kind) for e in kv.entries(everything=True)}
            used = kv.stats()["disk_used_bytes"]
    finally:
        assert d.stop() == 0
    # a and b went (the oldest); c and the foreign file are counted, and fit.
    assert listed == {(str(big), "foreign"), (str(entry_path(root, "c", model="fp")), "entry")}
    assert used == big.stat().st_size + size
    # The socket named through a link to the root's parent: its lock is
    # still the daemon's own.
    (short_dir / "alias").symlink_to(short_dir, target_is_directory=True)
    d = start_daemon(root, short_dir / "alias" / "root" / "kv.sock", max_disk_bytes=3 * size)
    try:
        with Client(d.socket, timeout=WAIT) as kv:
            assert {e.path for e in kv.entries(everything=True)} == {
                str(big), str(entry_path(root, "c", model="fp"))}
    finally:
        assert d.stop() == 0


def test_an_entry_removed_by_hand_is_neither_listed_nor_counted(short_dir: Path) -> None:
    """``rm`` of a file the user removed by hand said "no such entry" while
    ``ls`` went on listing it (and the budget counting it) until a gc."""
    root = _three_entries(short_dir)
    d = start_daemon(root, short_dir / "run" / "kv.sock")
    try:
        with Client(d.socket, timeout=WAIT) as kv:
            size = entry_path(root, "a", model="fp").stat().st_size
            assert kv.stats()["disk_used_bytes"] == 3 * size
            entry_path(root, "a", model="fp").unlink()
            assert [e.cache_id for e in kv.entries("fp")] == ["b", "c"]
            assert kv.stats()["disk_used_bytes"] == 2 * size
            entry_path(root, "b", model="fp").unlink()
            assert not kv.delete("fp", "b")
            assert kv.stats()["disk_used_bytes"] == size
            entry_path(root, "c", model="fp").unlink()
            assert kv.load("fp", "c") is None
            assert kv.stats()["disk_used_bytes"] == 0
            assert kv.entries(everything=True) == []
    finally:
        assert d.stop() == 0


def test_a_file_put_back_while_a_gc_reads_the_root_stays_indexed(short_dir: Path) -> None:
    """A listing that found a's file gone while a gc's rescan ran told the
    rescan so, and the rescan then left out the file it read after it was
    put back: listed and counted again only at the next gc."""
    root = _three_entries(short_dir)
    sock, go = short_dir / "run" / "kv.sock", short_dir / "go"
    a = entry_path(root, "a", model="fp")
    go.touch()  # the start-up scan goes through; the gc's waits before its first file
    proc = serve_process(root, sock, env={ENV: f"scan_hold={go},scan_hold_after=0"})
    try:
        with Client(sock, timeout=WAIT) as kv:
            go.unlink()
            answer: list[object] = []
            asker = threading.Thread(target=lambda: answer.append(kv.gc()), daemon=True)
            asker.start()
            time.sleep(0.5)  # the gc's rescan waits before it reads a file
            os.rename(a, short_dir / "a.bak")
            assert [e.cache_id for e in kv.entries("fp")] == ["b", "c"]
            os.rename(short_dir / "a.bak", a)
            go.touch()
            asker.join(WAIT)
            assert answer, "the gc was not answered"
            assert sorted(e.cache_id for e in kv.entries("fp")) == ["a", "b", "c"]
            assert kv.stats()["disk_used_bytes"] == 3 * a.stat().st_size
    finally:
        assert stop_process(proc) == 0


def test_a_models_directory_goes_with_its_last_file(short_dir: Path) -> None:
    """A model's directory stayed once its last file went (deleted, evicted,
    moved aside, or a first save of the model that failed): a daemon that
    saw 6,000 models kept 6,000 empty directories, and a path in memory for
    each (a long-run review). Now it goes with its last file; a directory
    holding anything else stays; a save of the model makes it again; and a
    start removes those an earlier daemon left empty."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    sessions = root / "sessions"

    def model_dir(model: str) -> Path:
        return entry_path(root, "k", model=model).parent

    budget = int(2.5 * MiB)  # the 1 MiB saves of c, d and e do not all fit
    # Files over 2 MiB stop short (EFBIG): a first save of "f" fails.
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         preexec_fn=limit_file_size(2 * MiB))
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for v, model in enumerate("ab", 1):
                assert kv.save(model, "k", filled(0.25, v), [v])
            assert kv.flush(timeout=WAIT)
            assert kv.delete("a", "k")
            assert not model_dir("a").exists() and model_dir("b").is_dir()
            assert kv.save("a", "k", filled(0.25, 3), [3]) and kv.flush(timeout=WAIT)
            assert version_of(entry_path(root, "k", model="a"), "a") == 3
            path = entry_path(root, "k", model="a")
            data = bytearray(path.read_bytes())
            data[-100] ^= 0x01
            path.write_bytes(bytes(data))
            assert kv.load("a", "k") is None
            wait_for(lambda: not model_dir("a").exists(), "a's directory gone with its file")
            assert len(os.listdir(root / "quarantine")) == 1
            # c is the least recently used when e comes: evicted, after the
            # file moved aside (evicted first; its directory stays).
            assert kv.save("c", "k", filled(1, 4), [4]) and kv.flush(timeout=WAIT)
            assert kv.load("b", "k") is not None
            for v, model in enumerate("de", 5):
                assert kv.save(model, "k", filled(1, v), [v]) and kv.flush(timeout=WAIT)
            assert kv.stats()["evictions"] == 2
            assert not model_dir("c").exists() and (root / "quarantine").is_dir()
            notes = model_dir("d") / "notes.txt"
            notes.write_text("another program's")
            assert kv.delete("d", "k")
            assert notes.exists()
            assert kv.save("f", "k", filled(2.2, 7), [7])
            assert kv.flush(timeout=WAIT) is False
            assert kv.stats()["saves_failed"] == 1
            assert not model_dir("f").exists()
    finally:
        assert stop_process(proc) == 0
    assert sorted(p.name for p in sessions.iterdir()) == sorted(
        model_dir(m).name for m in "bde")
    left_empty = sessions / "old-model"
    left_empty.mkdir()
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert sorted((e.model, e.cache_id) for e in kv.entries()) == [("b", "k"), ("e", "k")]
    finally:
        assert stop_process(proc) == 0
    assert sorted(p.name for p in sessions.iterdir()) == sorted(
        model_dir(m).name for m in "bde")


def test_the_start_up_scan_leaves_the_directories_it_empties_to_a_restart(
    short_dir: Path,
) -> None:
    """The start-up scan evicts beside the writer. Removing a directory it
    emptied could pull it from under the writer, between finding it and
    making a save's tmp file in it (the save failed), or between a delete's
    unlink and the directory's fsync (the delete was reported failed): a
    review's finds. The scan leaves such directories; the next start
    removes those still empty. Here the writer waits a second once it
    found x's directory (``begin_delay``) while the scan evicts x's and w's
    only files."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for model, key in (("x", "old"), ("w", "old"), ("y", "a"), ("y", "b")):
                assert kv.save(model, key, filled(0.5, 1), [1])
            assert kv.flush(timeout=WAIT)
    finally:
        assert stop_process(proc) == 0
    for age, model in ((2, "x"), (1, "w")):  # the first two to go
        then = time.time() - 86400 * age
        os.utime(entry_path(root, "old", model=model), (then, then))
    proc = serve_process(root, sock, "--max-disk-bytes", str(int(1.2 * MiB)),
                         "--min-free-bytes", "0", indexed=False,
                         env={ENV: f"scan_hold={go},begin_delay=1"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save("x", "new", filled(0.05, 2), [2])
            wait_for(lambda: kv.stats().get("saves_received") == 1, "the save received")
            time.sleep(0.1)
            go.touch()
            assert kv.flush(timeout=WAIT) is True
            assert kv.stats()["evictions"] == 2
            assert sorted((e.model, e.cache_id) for e in kv.entries()) == [
                ("x", "new"), ("y", "a"), ("y", "b")]
        assert version_of(entry_path(root, "new", model="x"), "x") == 2
    finally:
        assert stop_process(proc) == 0
    w_dir = entry_path(root, "old", model="w").parent
    assert w_dir.is_dir() and not list(w_dir.iterdir())
    proc = serve_process(root, sock)
    assert stop_process(proc) == 0
    assert not w_dir.exists()


def test_a_listing_larger_than_a_request_may_be_still_arrives(short_dir: Path) -> None:
    """A listing passing the 32 MiB a request may be (about 100,000 entries
    with ids of a usual length) was
    dropped by the client, and `ls` waited out its timeout and said the
    daemon did not answer (exit 3). Here 70,000 other files with long paths."""
    from kvkeeper.protocol.messages import MAX_HEADER_BYTES

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("m1", "a", filled(0.05, 3), [3]) and kv.flush(timeout=WAIT)
            stem = "x" * 240
            for d in range(4):
                other = root / "other" / f"{d}{stem}"
                other.mkdir(parents=True)
                for i in range(17_500):
                    (other / f"{stem}{i:06d}").touch()
            kv.gc()
            r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "ls", "--all", "--json",
                                "--socket", str(sock)], capture_output=True, text=True,
                               timeout=WAIT * 4)
            assert r.returncode == 0, r.stderr[-2000:]
            import json

            listed = json.loads(r.stdout)
            assert len(listed) == 70_001
            # The paths alone, in the reply, pass what a request may be.
            assert sum(len(e["path"]) for e in listed) > MAX_HEADER_BYTES
            assert sum(e["cache_id"] == "a" for e in listed) == 1
    finally:
        assert stop_process(proc) == 0


def test_the_daemon_keeps_its_socket_s_files_from_looking_unused(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temp-directory cleaners delete files left unused for days (macOS's
    for the default socket's directory after 3): the socket went, and the
    daemon exited with every client's saves dropped until a new one ran. The
    daemon now sets the times of its socket, the socket's lock file and
    their directory to now, hourly (here every 0.3 s)."""
    from kvkeeper.daemon import app

    monkeypatch.setattr(app, "REFRESH_INTERVAL", 0.3)
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        places = [rd.socket, rd.socket.with_name("kv.sock.lock"), rd.socket.parent]
        old = time.time() - 30 * 86400
        for place in places:
            os.utime(place, (old, old), follow_symlinks=False)
        wait_for(lambda: all(os.lstat(p).st_mtime > old + 86400 and
                             os.lstat(p).st_atime > old + 86400 for p in places),
                 "the times set to now")
        with Client(rd.socket, timeout=WAIT) as kv:
            assert kv.ping() is not None  # the daemon is still the one listening there
    finally:
        assert rd.stop() == 0


def _deep_tree(top: Path, levels: int) -> Path:
    """``top/a/a/.../a``, ``levels`` deep, made through descriptors (each
    path stays short); returns the deepest directory."""
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir("a", dir_fd=fd)
            inner = os.open("a", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    return top.joinpath(*["a"] * levels)


def _remove_deep_tree(deepest: Path, top: Path) -> None:
    # Bottom up, without recursion (shutil.rmtree recurses up to Python 3.11).
    for f in deepest.iterdir():
        f.unlink()
    d = deepest
    while d != top:
        os.rmdir(d)
        d = d.parent


def test_a_tree_deeper_than_the_recursion_limit_leaves_the_budget_on(short_dir: Path) -> None:
    """A tree 1,100 levels deep under the root (paths of 2,200 bytes): before,
    os.walk raised RecursionError, so the start-up scan and every gc crashed
    (internal_errors), nothing was ever evicted, ls listed none of the entries
    there, and export --root ended with a traceback."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    budget = int(3.5 * MiB)
    d = start_daemon(root, sock, max_disk_bytes=budget)
    with Client(sock, timeout=WAIT) as kv:
        for i, key in enumerate("abc"):
            assert kv.save(FP, key, filled(1, i), [i]) and kv.flush(timeout=WAIT)
    assert d.stop() == 0
    (root / "junk").mkdir()
    deepest = _deep_tree(root / "junk", 1100)
    (deepest / "notes").write_bytes(b"x" * 1000)
    try:
        d = start_daemon(root, sock, max_disk_bytes=budget)
        try:
            with Client(sock, timeout=WAIT) as kv:
                assert sorted(e.cache_id for e in kv.entries(FP)) == ["a", "b", "c"]
                assert kv.save(FP, "d", filled(1, 3), [3]) and kv.flush(timeout=WAIT)
                assert sorted(e.cache_id for e in kv.entries(FP)) == ["b", "c", "d"]
                listed = {e.path for e in kv.entries(everything=True) if e.kind == "foreign"}
                assert str(deepest / "notes") in listed, listed
                kv.gc()
                stats = kv.stats()
                assert stats["internal_errors"] == 0 and stats["evictions"] == 1, stats
                assert stats["disk_used_bytes"] == sum(
                    entry_path(root, k).stat().st_size for k in "bcd") + 1000
        finally:
            assert d.stop() == 0
        r = cli("export", "--root", str(root), FP, "b", str(short_dir / "b.safetensors"))
        assert r.returncode == 0, r.stderr
        assert mx.load(str(short_dir / "b.safetensors"))
    finally:
        _remove_deep_tree(deepest, root / "junk")


def test_a_gc_keeps_the_order_of_use_other_readers_moved(short_dir: Path) -> None:
    """Entries a, b, c, then a loaded: b, c and a in the order of use. Another
    program reads b and c (a backup: their access times move, as on a
    relatime mount for files not read since written), then a gc: before,
    the gc took the order from the access times again, and the next save
    evicted a, the entry used last (a review)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    d = start_daemon(root, sock, max_disk_bytes=int(3.4 * MiB))
    try:
        with Client(sock, timeout=WAIT) as kv:
            for i, key in enumerate("abc"):
                assert kv.save(FP, key, filled(1, i), [i]) and kv.flush(timeout=WAIT)
            assert kv.load(FP, "a") is not None
            assert [e.cache_id for e in kv.entries(FP)] == ["b", "c", "a"]
            later = time.time() + 60
            for key in "bc":
                path = entry_path(root, key)
                os.utime(path, ns=(int(later * 1e9), path.stat().st_mtime_ns))
            kv.gc()
            assert [e.cache_id for e in kv.entries(FP)] == ["b", "c", "a"]
            assert kv.save(FP, "d", filled(1, 3), [3]) and kv.flush(timeout=WAIT)
            assert sorted(e.cache_id for e in kv.entries(FP)) == ["a", "c", "d"]
    finally:
        assert d.stop() == 0


def test_a_damaged_file_on_a_model_s_own_disk_is_moved_aside_there(short_dir: Path) -> None:
    """A tmpfs mounted at a model's directory (the README's way to keep one
    model on another disk): rename into ``<root>/quarantine/`` fails with
    EXDEV, and the damaged file stayed at its place, a miss and
    ``quarantine_failed`` at every load (a review). Now it is moved aside
    beside its place, listed as quarantined, kept over a restart, and
    evicted before the live entries."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    budget = int(2.5 * MiB)
    d = start_daemon(root, sock, max_disk_bytes=budget)
    d.stop()
    model_dir = entry_path(root, "a").parent
    with small_tmpfs(model_dir.parent, "16m", name=model_dir.name):
        d = start_daemon(root, sock, max_disk_bytes=budget)
        try:
            with Client(sock, timeout=WAIT) as kv:
                for i, key in enumerate("ab"):
                    assert kv.save(FP, key, filled(1, i), [i]) and kv.flush(timeout=WAIT)
                path = entry_path(root, "a")
                with open(path, "r+b") as f:
                    f.seek(-64, os.SEEK_END)
                    f.write(b"\xff" * 64)
                assert kv.load(FP, "a") is None
                assert not path.exists()
                [aside] = [p for p in model_dir.iterdir() if p.name.endswith(".quarantined")]
                assert aside.name.startswith("a.safetensors.")
                assert kv.stats()["files_quarantined"] == 1
                listed = [(e.kind, e.model, e.cache_id) for e in kv.entries(everything=True)]
                assert sorted(listed) == [("entry", FP, "b"), ("quarantine", FP, "a")]
        finally:
            assert d.stop() == 0
        d = start_daemon(root, sock, max_disk_bytes=budget)
        try:
            with Client(sock, timeout=WAIT) as kv:
                listed = [(e.kind, e.model, e.cache_id) for e in kv.entries(everything=True)]
                assert sorted(listed) == [("entry", FP, "b"), ("quarantine", FP, "a")]
                # Over the budget: the file moved aside goes first.
                assert kv.save(FP, "c", filled(1, 2), [2]) and kv.flush(timeout=WAIT)
                assert not aside.exists()
                assert sorted(e.cache_id for e in kv.entries(FP)) == ["b", "c"]
        finally:
            assert d.stop() == 0



def test_a_save_whose_write_crashes_is_told_to_its_client(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """k's second save needs room first (--min-free-bytes on a 6 MiB tmpfs):
    the pass evicts a and then crashes (RuntimeError: a bug, not the disk).
    The save failed as "internal error", but its client was not told: its
    loads read the first version as settled until a flush (a review). It is
    now told at once, as for a write that failed."""
    with small_tmpfs(short_dir, "6m") as mnt:
        root, sock = mnt / "root", short_dir / "run" / "kv.sock"
        args = ("--min-free-bytes", str(3 * MiB + MiB // 2), "--min-write-interval", "0")
        proc = serve_process(root, sock, *args)
        try:
            with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
                for key in "ak":
                    assert kv.save(FP, key, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            assert stop_process(proc) == 0
            proc = serve_process(root, sock, *args, env={ENV: "bug=evicted"})
            with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
                assert kv.save(FP, "k", filled(1, 2), [2])
                wait_for(lambda: kv.stats()["internal_errors"] >= 1, "the write to crash")
                with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                    got = kv.load(FP, "k")
                assert got is not None and got.token_ids == [1]
                said = caplog.text
                assert "event=load_may_be_stale" in said, said
                assert "writing it failed: internal error" in said, said
                assert kv.stats()["client_saves_refused"] == 1
                assert kv.flush(timeout=WAIT) is False
            assert version_of(entry_path(root, "k"), FP) == 1
            assert not entry_path(root, "a").exists()
        finally:
            assert stop_process(proc) == 0
        assert "event=job_crashed" in daemon_log(proc)


def test_a_budget_pass_that_crashes_after_a_commit_leaves_the_save_written(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """k's new version is committed, and the disk budget's pass after it
    evicts a and then crashes (RuntimeError: a bug, not the disk). The save
    was failed as "internal error" though its file was in place and served
    (a review): its client was told it failed, and its flush said False. It
    is written, as when the pass fails with an I/O error; the crash is
    counted and logged."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-free-bytes", "0", "--min-write-interval", "0")
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for key in "ak":
                assert kv.save(FP, key, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
        assert stop_process(proc) == 0
        size = entry_path(root, "k").stat().st_size
        proc = serve_process(root, sock, "--min-free-bytes", "0", "--min-write-interval", "0",
                             "--max-disk-bytes", str(2 * size + 4096),
                             env={ENV: "bug=evicted"})
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                assert kv.save(FP, "k", filled(1.5, 2), [2])
                assert kv.flush(timeout=WAIT) is True
                got = kv.load(FP, "k")
            assert got is not None and got.token_ids == [2]
            assert "save_refused" not in caplog.text and "may_be_stale" not in caplog.text
            stats = kv.stats()
            assert stats["internal_errors"] == 1 and stats["saves_failed"] == 0
        assert version_of(entry_path(root, "k"), FP) == 2
        assert not entry_path(root, "a").exists()
    finally:
        assert stop_process(proc) == 0
    assert "event=budget_crashed" in daemon_log(proc)
