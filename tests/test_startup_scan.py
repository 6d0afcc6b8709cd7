"""The daemon answers, and writes, while it indexes the store at start.

It used to bind its socket only after reading the header of every file under
the root (20,000 entries: 1.2 s with the files in the page cache, 4-28 s
without), and clients found no daemon meanwhile: every save made then was
dropped. The ``scan_hold`` fault holds the scan (after it read every file, or
``scan_hold_after`` files) until the test makes a file, so what a request
sees during the scan is what it would see during a long one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from kvkeeper.client.client import Client
from kvkeeper.protocol import messages as m

from .conftest import (
    WAIT,
    daemon_log,
    dealers,
    scan_done,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
)
from .faultkit import FP, MiB, entry_path, filled, tmp_files, version_of
from .test_protocol_edge import V, ask, begin
from .test_store_edges import _bytes_under


def _holds(path: Path, version: int) -> bool:
    """Read with MLX's own reader: every tensor holds ``version``."""
    arrays = mx.load(str(path))
    return bool(arrays) and all(mx.all(a == version).item() for a in arrays.values())


def _store(root: Path, socket: Path, names: list[str], mib: float = 0.25) -> int:
    """Entries ``names`` (entry i holds version i + 1), written by a daemon
    that is then stopped; returns the size of one (all the same)."""
    rd = start_daemon(root, socket)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for i, name in enumerate(names):
                assert kv.save(FP, name, filled(mib, i + 1, layers=1), [i + 1])
            assert kv.flush(timeout=WAIT)
    finally:
        assert rd.stop() == 0
    sizes = {entry_path(root, n).stat().st_size for n in names}
    assert len(sizes) == 1, sizes
    return sizes.pop()


def _held(go: Path, after: int | None = None) -> dict[str, str]:
    faults = f"scan_hold={go}" + ("" if after is None else f",scan_hold_after={after}")
    return {"KVKEEPER_TEST_FAULTS": faults}


def test_saves_loads_and_ls_during_the_start_up_scan(short_dir: Path) -> None:
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    names = ["e0", "e1", "e2", "e3", "e4"]
    _store(root, sock, names)
    proc = serve_process(root, sock, env=_held(go), indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["store_indexing"] == 1  # answering, and not done
            assert kv.save(FP, "new", filled(0.25, 7, layers=1), [7])
            assert kv.save(FP, "e0", filled(0.25, 8, layers=1), [8])  # replaces a file
            assert kv.delete(FP, "e2") is True  # an entry the scan has read
            got = kv.load(FP, "e1", verify=False)  # an entry the scan has not indexed
            assert got is not None and got.token_ids == [2]
            assert mx.all(got.cache[0].state[0] == 2).item()
            # Written during the scan, not after it: the saving client's own
            # load (read-your-writes) does not wait for the scan.
            got = kv.load(FP, "new")
            assert got is not None and got.token_ids == [7]
            assert kv.flush(timeout=WAIT) is True
            stats = kv.stats()
            assert stats["store_indexing"] == 1 and stats["saves_written"] == 2
            assert _holds(entry_path(root, "new"), 7) and _holds(entry_path(root, "e0"), 8)
            # A listing waits for the scan: before it is done, the index holds
            # only the two files written since the start.
            listed: list[set[str]] = []
            with Client(sock, timeout=WAIT) as other:
                lister = threading.Thread(
                    target=lambda: listed.append({e.cache_id for e in other.entries()}))
                lister.start()
                time.sleep(1.0)
                assert not listed, listed
                go.touch()
                lister.join(WAIT)
            assert listed == [{"e0", "e1", "e3", "e4", "new"}]
            wait_for(lambda: scan_done(sock), "the scan")
            stats = kv.stats()
            assert stats["client_saves_dropped"] == 0 and stats["client_saves_lost"] == 0
            assert stats["disk_used_bytes"] == _bytes_under(root)
        ls = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "ls", "--socket", str(sock)],
                            capture_output=True, text=True, timeout=WAIT)
        assert ls.returncode == 0 and "e2" not in ls.stdout, ls
        assert all(n in ls.stdout for n in ["e0", "e1", "e3", "e4", "new"]), ls
    finally:
        assert stop_process(proc) == 0


def test_sigterm_during_the_start_up_scan(short_dir: Path) -> None:
    """The drain stops the scan: the daemon exits at once (the scan is held
    for up to 600 s), with what it was sent written."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    _store(root, sock, ["old", "older"])
    proc = serve_process(root, sock, env=_held(go), indexed=False)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.stats()["store_indexing"] == 1
            assert kv.save(FP, "x", filled(0.25, 5, layers=1), [5])
            assert kv.flush(timeout=WAIT) is True
            assert kv.save(FP, "x", filled(0.25, 6, layers=1), [6])
            wait_for(lambda: kv.stats()["saves_received"] == 2, "the second save sent")
            assert stop_process(proc) == 0  # within WAIT, not 600 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
    log = daemon_log(proc)
    assert "event=not_saved_at_exit" not in log and "scan_failed" not in log, log
    assert _holds(entry_path(root, "x"), 6) and version_of(entry_path(root, "x")) == 6
    assert version_of(entry_path(root, "old")) == 1
    proc = serve_process(root, sock)  # the next start indexes all three
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert {e.cache_id for e in kv.entries()} == {"old", "older", "x"}
    finally:
        assert stop_process(proc, signal.SIGTERM) == 0


def test_a_scan_cut_short_evicts_nothing(short_dir: Path) -> None:
    """Saves past the budget (room for 3) during a scan cut short by SIGTERM
    after it read 2 of 4 entries, most of them written after the cut. From
    a part of the store, the budget evicted the oldest of what it held:
    saves written during the scan, whichever entries it happened to read
    first, however recently used. Now nothing goes until a scan is whole."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    size = _store(root, sock, ["a", "b", "c", "d"], mib=0.5)
    budget = 3 * size - 1
    assert budget >= MiB
    # A slow disk (1 s a MiB): most of the saves are written after the cut.
    env = {"KVKEEPER_TEST_FAULTS": f"scan_hold={go},scan_hold_after=2,write_delay=1"}
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         "--min-write-interval", "0", env=env, indexed=False)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for i, name in enumerate("wxyz"):
                assert kv.save(FP, name, filled(0.5, 5 + i, layers=1), [5 + i])
            wait_for(lambda: kv.stats()["saves_received"] == 4, "the saves sent")
            assert stop_process(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
    log = daemon_log(proc)
    assert "event=scan_cut_short" in log and "event=evicted" not in log, log
    assert all(entry_path(root, n).exists() for n in "abcdwxyz")
    assert all(_holds(entry_path(root, n), 5 + i) for i, n in enumerate("wxyz"))


def test_a_load_during_the_scan_counts_as_a_use(short_dir: Path) -> None:
    """An entry loaded after the scan read its file's times, before the scan
    ended, is kept as used: the scan's times were older than the load. The
    budget is applied once the scan is done."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    size = _store(root, sock, ["a", "b", "c"])
    now = time.time()
    for age, name in ((300, "a"), (200, "b"), (100, "c")):  # "a" used longest ago
        os.utime(entry_path(root, name), (now - age, now - age))
    # Room for the three and not for a fourth: one goes once "d" is written.
    budget = 4 * size - 1
    assert budget >= MiB
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         env=_held(go), indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["store_indexing"] == 1
            got = kv.load(FP, "a")
            assert got is not None and got.token_ids == [1]
            assert kv.save(FP, "d", filled(0.25, 4, layers=1), [4])
            assert kv.flush(timeout=WAIT) is True
            assert entry_path(root, "d").stat().st_size == size
            assert kv.stats()["evictions"] == 0  # not before the scan is whole
            go.touch()
            wait_for(lambda: scan_done(sock), "the scan")
            assert kv.stats()["evictions"] == 1
            assert {e.cache_id for e in kv.entries()} == {"a", "c", "d"}
            assert not entry_path(root, "b").exists()
            assert _holds(entry_path(root, "a"), 1)
    finally:
        assert stop_process(proc) == 0


def test_a_file_the_scan_cannot_stat_is_skipped(short_dir: Path) -> None:
    """A file whose path is longer than PATH_MAX (its directory's is not):
    its lstat fails (ENAMETOOLONG). That failure stopped the whole scan: the
    daemon did not start, or served with nothing indexed and the budget
    off. Now that file is skipped, and the rest indexed."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    _store(root, sock, ["a", "b"])
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        depth = 0  # the directory's path ends 3900-4000 bytes long, the file's past 4096
        while len(os.fsencode(root)) + depth * 101 < 3900:
            os.mkdir("d" * 100, 0o700, dir_fd=fd)
            inner = os.open("d" * 100, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, depth = inner, depth + 1
        os.close(os.open("f" * 250, os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert {e.cache_id for e in kv.entries()} == {"a", "b"}
            # (Not the file past PATH_MAX: it cannot be lstat'ed, and is empty.)
            assert kv.stats()["disk_used_bytes"] == _bytes_under(root / "sessions")
    finally:
        assert stop_process(proc) == 0
    log = daemon_log(proc)
    assert "event=unreadable_file" in log and "scan_failed" not in log, log


def test_a_gc_during_the_scan_shares_it(short_dir: Path) -> None:
    """A gc asked for during the start-up scan is answered once the scan is
    done, with what the scan's own pass of the budget evicted; meanwhile the
    writer goes on (the gc waited on the writer's turn, and held every save
    up until the scan was done)."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    size = _store(root, sock, ["a", "b", "c"], mib=0.5)
    now = time.time()
    for age, name in ((300, "a"), (200, "b"), (100, "c")):  # "a" used longest ago
        os.utime(entry_path(root, name), (now - age, now - age))
    budget = 2 * size
    assert budget >= MiB
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         env=_held(go), indexed=False)
    try:
        evicted: list[list[str]] = []
        with Client(sock, timeout=WAIT) as kv, Client(sock, timeout=WAIT) as other:
            collector = threading.Thread(
                target=lambda: evicted.append([e.cache_id for e in other.gc().entries]))
            collector.start()
            time.sleep(1.0)
            assert not evicted, evicted  # waiting for the scan
            assert kv.save(FP, "x", filled(0.5, 9, layers=1), [9])
            assert kv.flush(timeout=WAIT) is True
            assert _holds(entry_path(root, "x"), 9)
            go.touch()
            collector.join(WAIT)
            assert evicted == [["a", "b"]]  # the oldest, until b, c and x fit
            assert {e.cache_id for e in kv.entries()} == {"c", "x"}
            stats = kv.stats()
            assert stats["evictions"] == 2 and stats["disk_used_bytes"] == _bytes_under(root)
    finally:
        assert stop_process(proc) == 0


def test_the_order_of_use_spans_the_scan_and_what_came_meanwhile(short_dir: Path) -> None:
    """A save written during the scan, then a load of an old entry: the
    entry is the one used last. The files put meanwhile were ordered after
    everything the scan read, so the budget evicted the entry just loaded."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    size = _store(root, sock, ["e"], mib=0.5)
    now = time.time()
    os.utime(entry_path(root, "e"), (now - 300, now - 300))
    budget = 2 * size - 1  # room for one
    assert budget >= MiB
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         env=_held(go, after=0), indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "s", filled(0.5, 2, layers=1), [2])
            assert kv.flush(timeout=WAIT) is True
            time.sleep(0.05)  # the load comes later than the save, by the clock
            got = kv.load(FP, "e")
            assert got is not None and got.token_ids == [1]
            go.touch()
            wait_for(lambda: scan_done(sock), "the scan")
            assert {e.cache_id for e in kv.entries()} == {"e"}
            assert kv.stats()["evictions"] == 1 and not entry_path(root, "s").exists()
    finally:
        assert stop_process(proc) == 0


def test_the_store_cleared_during_the_scan(short_dir: Path) -> None:
    """`rm -rf <root>/sessions` while the start-up scan runs, then a save:
    the scan's index listed the entries removed (and counted their bytes)
    until a gc. The daemon's rescan for the cleared store now waits for the
    start-up scan, then reads the store as it is."""
    import shutil

    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    _store(root, sock, ["e1", "e2", "e3"])
    proc = serve_process(root, sock, env=_held(go), indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            shutil.rmtree(root / "sessions")
            assert kv.save(FP, "new", filled(0.25, 7, layers=1), [7])
            time.sleep(0.5)  # the save waits for the scan (the writer's rescan does)
            go.touch()
            assert kv.flush(timeout=WAIT) is True
            wait_for(lambda: scan_done(sock), "the scan")
            assert {e.cache_id for e in kv.entries()} == {"new"}
            assert kv.stats()["disk_used_bytes"] == _bytes_under(root)
            assert _holds(entry_path(root, "new"), 7)
    finally:
        assert stop_process(proc) == 0


def test_the_scans_budget_pass_keeps_the_old_file_of_a_key_being_saved(
    short_dir: Path,
) -> None:
    """A save of the least recently used key is being written when the scan's
    pass of the budget comes. It evicted that key's file, and when the save
    then failed (its client stopped sending) nothing of the key was left."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    size = _store(root, sock, ["k", "a", "b", "c"], mib=0.5)
    proc = serve_process(root, sock, "--max-disk-bytes", str(3 * size), "--min-free-bytes",
                         "0", "--stall-timeout", "2", env=_held(go), indexed=False)
    try:
        with dealers(sock, 1) as (slow,):
            slow.send(begin(save=1, model=FP, cache_id="k",
                            tensors=[m.TensorSpec("t0", "U8", [MiB])]))
            slow.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), b"n" * (MiB // 2)])
            wait_for(lambda: tmp_files(root) != [], "the save's tmp file")
            go.touch()
            wait_for(lambda: scan_done(sock), "the scan")
            assert [n for n in "kabc" if not entry_path(root, n).exists()] == ["a"]
            # Told at once that its save failed, then the flush says so.
            told = ask(slow, m.encode(m.Flush(v=V, req=1)))
            assert isinstance(told, m.SaveRefused) and told.message.startswith(
                "writing it failed: no bytes for 2 s"), told
            assert m.decode_reply(slow.recv()) == m.Flushed(
                v=V, req=1, written=0, superseded=0, failed=1)
        assert _holds(entry_path(root, "k"), 1)
    finally:
        assert stop_process(proc) == 0


def test_the_scans_eviction_never_unlinks_a_save_renamed_meanwhile(short_dir: Path) -> None:
    """The scan's pass of the budget judged the old file of a key being saved,
    then lost the CPU (``evict_delay``); the save's rename came meanwhile,
    and its entry was indexed only after the directory's fsync
    (``renamed_delay``). The pass then unlinked the new file: the flush said
    True, and the key had no file."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    size = _store(root, sock, ["k"], mib=2)
    faults = f"scan_hold={go},write_delay=4,evict_delay=2,renamed_delay=3"
    proc = serve_process(root, sock, "--max-disk-bytes", str(size // 2), "--min-free-bytes",
                         "0", "--min-write-interval", "0", env={"KVKEEPER_TEST_FAULTS": faults},
                         indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(0.25, 2, layers=1), [2])  # written in about 1 s
            wait_for(lambda: tmp_files(root) != [], "the save's tmp file")
            go.touch()  # the pass judges k's old file at once, and acts on it 2 s later
            assert kv.flush(timeout=WAIT)
        assert _holds(entry_path(root, "k"), 2)
    finally:
        assert stop_process(proc) == 0
