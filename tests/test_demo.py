"""``kvkeeper demo`` as a user runs it: a subprocess, small settings."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvkeeper.client.client import Client
from kvkeeper.demo import MODEL_ID

from .conftest import WAIT, RunningDaemon, start_daemon

DEMO_TIMEOUT = 180.0  # a cap, not a timing assertion: the demo takes seconds


def run_demo(*args: str, env: dict[str, str] | None = None,
             prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "kvkeeper.cli", "demo", *args],
        capture_output=True, text=True, timeout=DEMO_TIMEOUT,
        env={**os.environ, **(env or {})},
    )


SECTIONS = ("Time to first token", "Decode throughput", "Write-behind",
            "Restored vs re-prefilled continuation")


def test_demo_with_a_private_daemon(short_dir: Path) -> None:
    out = short_dir / "demo.json"
    # No daemon at the default socket either way: --private must not look for one.
    proc = run_demo("--private", "--tokens", "64", "--prompt-tokens", "256", "--json", str(out),
                    env={"KVKEEPER_SOCKET": str(short_dir / "none.sock")})
    assert proc.returncode == 0, proc.stderr
    for section in SECTIONS:
        assert section in proc.stdout, (section, proc.stdout)
    assert "nothing here is canned" in proc.stdout

    rep = json.loads(out.read_text())
    assert rep["prompt_tokens"] == 256 and rep["stream_tokens"] == 64
    # Saved right after the prefill, maybe again on the 2 s timer; never all 64 tokens.
    assert 256 < rep["restored_tokens"] < 256 + 64
    assert rep["restored"]["prompt_tokens"] == 256 + 64 + 32 - rep["restored_tokens"]
    assert rep["cold"]["prompt_tokens"] == 256 + 64 + 32
    assert rep["lost_tokens"] == 256 + 64 - rep["restored_tokens"]
    assert rep["restored"]["ttft_s"] > 0 and rep["cold"]["ttft_s"] > 0
    assert all(tps > 0 for d in rep["decode"] for tps in d["tps"])
    # A private daemon: its counters are the demo's alone.
    assert rep["saves_dropped"] == 0 and rep["saves_failed"] == 0
    assert (rep["saves_written"] + rep["saves_superseded"] + rep["saves_coalesced"]
            == rep["saves_sent"])
    # The crashed stream saved at least once, the restored turn at its first
    # token and at its end; the decode rounds on top.
    assert rep["saves_sent"] >= 3 + sum(d["saves_sent"] for d in rep["decode"])
    assert rep["bytes_written"] > 0
    assert rep["decode_same_tokens"] is True  # saving never changes what is generated
    # The private daemon and its directory are gone.
    where = re.search(r"private daemon in (\S+)", proc.stdout)
    assert where is not None and not Path(where.group(1)).exists()


def test_the_demo_reports_what_the_restore_found_with_short_settings(short_dir: Path) -> None:
    """Saves every 8 tokens of a 40-token stream: the newest is still held
    (client interval, daemon write interval) when the restart reads the
    file. The report said 7 tokens were lost where 39 were (it counted the
    saves handed off)."""
    out = short_dir / "demo.json"
    proc = run_demo("--private", "--tokens", "40", "--prompt-tokens", "64", "--every-tokens",
                    "8", "--json", str(out), env={"KVKEEPER_SOCKET": str(short_dir / "none.sock")})
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert rep["lost_tokens"] == 64 + 40 - rep["restored_tokens"] > 0
    assert f"the last {rep['lost_tokens']} tokens were lost: not saved in time" in proc.stdout
    assert f"restored {rep['restored_tokens']} tokens" in proc.stdout
    # The first token's line says sooner or later by what was measured
    # (short settings can make the restore the slower: "0.4x sooner").
    cold, restored = rep["cold"]["ttft_s"], rep["restored"]["ttft_s"]
    said = re.search(r"restored from kvkeeper +[0-9.]+ s +([0-9.]+)x (sooner|later)",
                     proc.stdout)
    assert said is not None, proc.stdout
    assert said.group(2) == ("sooner" if restored <= cold else "later"), (cold, restored)
    assert float(said.group(1)) >= 1, said.group(0)


def test_the_first_token_comparison_says_later_when_the_restore_was_slower() -> None:
    """With a tiny model and a short prompt the load can take longer than the
    re-prefill: the demo printed "0.4x sooner"."""
    from kvkeeper.demo import than_reprefill

    assert than_reprefill(1.0, 0.05) == "20x sooner"
    assert than_reprefill(0.01, 0.025) == "2.5x later"
    assert than_reprefill(0.3, 0.3) == "1.0x sooner"


def test_demo_uses_a_running_daemon(daemon: RunningDaemon) -> None:
    proc = run_demo("--socket", str(daemon.socket), "--tokens", "32", "--prompt-tokens", "128")
    assert proc.returncode == 0, proc.stderr
    assert f"running daemon at {daemon.socket}" in proc.stdout
    for section in SECTIONS:
        assert section in proc.stdout
    with Client(daemon.socket, timeout=WAIT) as kv:
        stats = kv.stats()
        assert stats["saves_written"] >= 1 and stats["saves_failed"] == 0
        assert kv.entries(MODEL_ID) == []  # the demo cleans up after itself


def test_the_demo_s_try_of_its_json_path_leaves_a_symlink_there(short_dir: Path) -> None:
    """--json through a symlink to no file yet: the try of the path before
    the run removed the link (it saw nothing there), and the report then
    went to a plain file in its place; nor is the file the try made left."""
    link = short_dir / "report.json"
    link.symlink_to(short_dir / "target.json")
    r = run_demo("--socket", str(short_dir / "none.sock"), "--json", str(link))
    assert r.returncode == 3, r.stderr[-2000:]  # no daemon there: after the try
    assert link.is_symlink() and os.readlink(link) == str(short_dir / "target.json")
    assert not (short_dir / "target.json").exists()


def test_a_json_path_in_a_directory_not_searchable_is_a_usage_error(short_dir: Path) -> None:
    """pathlib's is_dir() lets EACCES through: --json in a directory this
    user may not search ended in a PermissionError traceback (exit 1)."""
    from .faultkit import NO_DAC, need_linux_root

    need_linux_root()
    shut = short_dir / "shut"
    shut.mkdir(mode=0o600)  # no search (x) for anyone without the right to pass it
    r = run_demo("--private", "--json", str(shut / "sub" / "x.json"), prefix=NO_DAC)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot be written: Permission denied" in r.stderr and "Traceback" not in r.stderr, \
        r.stderr


def test_demo_refuses_bad_settings_before_it_runs(short_dir: Path) -> None:
    """A model the settings cannot build, a negative seed, or a --json path
    that cannot be written, is a usage error at once (before: a traceback, or a crash after
    the whole run, its measurements lost)."""
    for args, needle in ((("--layers", "0"), "need --layers at least 1 (got 0)\n"),
                         (("--hidden", "7"), "need --hidden a multiple of 8, at least 8 (got 7)\n"),
                         # 0 is a multiple of 8: the message said only that.
                         (("--hidden", "0"), "need --hidden a multiple of 8, at least 8 (got 0)\n"),
                         (("--hidden", "0", "--layers", "0"),
                          "need --layers at least 1 (got 0), --hidden a multiple of 8, at least 8 "
                          "(got 0)\n"),
                         # (numpy's traceback before)
                         (("--seed", "-5"), "need --seed at least 0 (got -5)\n"),
                         # Its row's label no longer fit the table.
                         (("--every-tokens", "100000"),
                          "need --every-tokens from 1 to 99999 (got 100000)\n"),
                         (("--json", str(short_dir / "nope" / "x.json")), "existing directory"),
                         # No file can be made there, root or not (before: a
                         # traceback after the whole run).
                         (("--json", "/proc/kvkeeper-demo.json"), "cannot be written"),
                         (("--json", str(short_dir)), "existing directory")):
        r = run_demo("--private", "--tokens", "2", "--prompt-tokens", "64", *args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (short_dir / "nope").exists()


def _demo_stopped(args: list[str], ready: Callable[[subprocess.Popen[str]], bool],
                  env: dict[str, str] | None = None, times: int = 1,
                  signals: tuple[int, ...] = (signal.SIGTERM,),
                  gap: float = 0.05) -> tuple[int, str]:
    """Run the demo, send ``signals`` (the last of them up to ``times`` in
    all), ``gap`` seconds apart, once ``ready(process)`` says so; (status,
    stderr)."""
    child = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "demo", *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **(env or {})},
                             # Python's own SIGINT handler, where the tests run with it ignored.
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + DEMO_TIMEOUT
        while not ready(child):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        sent = list(signals) + [signals[-1]] * (times - len(signals))
        for i, sig in enumerate(sent):
            time.sleep(gap if i else 0)
            child.send_signal(sig)
        # (A cap: the clean-up closes clients holding saves, on a busy machine.)
        _, err = child.communicate(timeout=DEMO_TIMEOUT)
    finally:
        child.kill()
        child.wait(WAIT)
    return child.returncode, err


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT, signal.SIGINT),
                                     (signal.SIGINT, signal.SIGTERM)])
def test_a_demo_stopped_leaves_nothing_in_the_user_s_store(
        daemon: RunningDaemon, signals: tuple[int, ...]) -> None:
    """Its entry was deleted only at the end of a whole run: stopped midway
    (Ctrl-C, SIGTERM), the demo left it in the user's store. So did a
    second signal 10 ms after the first (two Ctrl-C, or Ctrl-C and SIGTERM):
    it cut the clean-up short, in 4 of 4 runs of a review (saves of every
    token of a wider model: a longer clean-up)."""
    with Client(daemon.socket, timeout=WAIT) as kv:
        status, err = _demo_stopped(
            ["--socket", str(daemon.socket), "--tokens", "2000", "--prompt-tokens", "512",
             "--hidden", "512", "--every-tokens", "1"],
            lambda _: bool(kv.entries(MODEL_ID)), signals=signals, gap=0.01)
        assert status in (130, 143) and "Traceback" not in err, (status, err)
        assert kv.entries(MODEL_ID) == []


@pytest.mark.parametrize("times", [1, 2])
def test_a_private_demo_stopped_stops_its_daemon(short_dir: Path, times: int) -> None:
    """SIGTERM killed the demo and left its private daemon running for good,
    with its temp dir. Twice: the second cut the clean-up short, and the
    directory was left."""
    store: list[Path] = []

    def ready(demo: subprocess.Popen[str]) -> bool:
        if not store:
            children = Path(f"/proc/{demo.pid}/task/{demo.pid}/children").read_text().split()
            for pid in children:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"--root" in argv:
                    store.append(Path(os.fsdecode(argv[argv.index(b"--root") + 1])))
        return bool(store) and any(store[0].rglob("*.safetensors"))

    status, err = _demo_stopped(["--private", "--tokens", "2000", "--prompt-tokens", "128"],
                                ready, env={"KVKEEPER_SOCKET": str(short_dir / "none.sock")},
                                times=times)
    assert status == 143 and "kvkeeper: terminated" in err, err
    assert not store[0].parent.exists()  # the daemon stopped, its directory removed


def test_a_budget_smaller_than_the_demo_is_not_blamed_on_entries(short_dir: Path) -> None:
    """An empty store whose whole disk budget is smaller than the demo's
    files: the refusal said "without evicting entries: its store holds 0 KiB
    of its 1.0 MiB disk budget", as if entries were in the way."""
    sock = short_dir / "run" / "kv.sock"
    d = start_daemon(short_dir / "root", sock, max_disk_bytes=2**20)
    try:
        proc = run_demo("--socket", str(sock))  # refused before the model is built
        assert proc.returncode == 1, proc.stderr
        said = " ".join(proc.stderr.split())
        assert "has no room for the demo's files (up to" in said, said
        assert "its whole disk budget is 1.0 MiB (--max-disk-bytes)" in said, said
        assert "evicting" not in said and "give --private" in said, said
    finally:
        d.stop()


def test_the_demo_says_what_it_does_on_a_terminal(short_dir: Path) -> None:
    """The report comes at the end; on a terminal the demo was silent until
    then (20-60 s). Each part of the run now says so on stderr as it
    begins, while the run goes on; stdout (the report) is unchanged, and
    stderr that is no terminal gets no such lines."""
    import pty

    parent, child_end = pty.openpty()
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvkeeper.cli", "demo", "--private", "--tokens", "32",
         "--prompt-tokens", "128"], stdout=subprocess.PIPE, stderr=child_end, text=True,
        env={**os.environ, "KVKEEPER_SOCKET": str(short_dir / "none.sock")})
    os.close(child_end)
    seen = ""
    try:
        deadline = time.monotonic() + DEMO_TIMEOUT
        while "kvkeeper demo: 5/5 " not in seen:
            assert time.monotonic() < deadline, seen
            if not select.select([parent], [], [], 1.0)[0]:
                continue  # (a demo that hangs silent fails at the deadline)
            try:
                seen += os.read(parent, 4096).decode(errors="replace")
            except OSError:  # EIO: the terminal's other end closed
                break
        running = demo.poll() is None  # (decoding rounds still to come)
        out, _ = demo.communicate(timeout=DEMO_TIMEOUT)
    finally:
        demo.kill()
        demo.wait(WAIT)
        os.close(parent)
    lines = [ln.strip() for ln in seen.splitlines() if ln.startswith("kvkeeper demo: ")]
    assert [ln.split()[2] for ln in lines[1:]] == ["1/5", "2/5", "3/5", "4/5", "5/5"], seen
    assert running, "the last part's line came only as the demo ended"
    assert demo.returncode == 0 and "Time to first token" in out, out
    assert "kvkeeper demo: 1/5" not in out, out
    quiet = run_demo("--private", "--tokens", "32", "--prompt-tokens", "128",
                     env={"KVKEEPER_SOCKET": str(short_dir / "none.sock")})
    assert quiet.returncode == 0 and "kvkeeper demo: 1/5" not in quiet.stderr, quiet.stderr


def test_the_demo_never_evicts_the_user_s_entries(short_dir: Path) -> None:
    """On a running daemon whose disk budget the demo's entry did not fit
    beside the user's, the daemon evicted the user's to write it, and the
    demo said nothing. Named with --socket, that daemon is now refused;
    found at the default socket, it is passed over for a private one."""
    from .faultkit import filled

    sock = short_dir / "run" / "kv.sock"
    # 2.25 MiB: room for the demo's 1.9 MiB alone, not beside the user's 0.5.
    d = start_daemon(short_dir / "root", sock, max_disk_bytes=2**21 + 2**18)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("mine", "precious", filled(0.5, 1), [1]) and kv.flush(timeout=WAIT)
            proc = run_demo("--socket", str(sock), "--tokens", "32", "--prompt-tokens", "128")
            assert proc.returncode == 1 and "without evicting entries" in proc.stderr, proc.stderr
            assert "give --private" in proc.stderr, proc.stderr
            proc = run_demo("--tokens", "32", "--prompt-tokens", "128",
                            env={"KVKEEPER_SOCKET": str(sock)})
            assert proc.returncode == 0, proc.stderr
            said = " ".join(proc.stdout.split())
            assert "private daemon in" in said and "without evicting entries" in said, proc.stdout
            assert f"running daemon at {sock} has no room" in said, proc.stdout
            assert [e.cache_id for e in kv.entries("mine")] == ["precious"]
            assert kv.stats()["evictions"] == 0
    finally:
        d.stop()


def test_the_demo_s_room_check_counts_its_largest_entry(short_dir: Path) -> None:
    """The check counted the conversation up to the continuation, not the
    decode rounds' growth past it: free space that passed it (twice that,
    the old file and the new) ran short, and the user's entry was evicted."""
    import argparse

    from kvkeeper.demo import entry_bytes

    from .faultkit import filled, small_tmpfs

    flags = ["--tokens", "400", "--prompt-tokens", "64", "--layers", "2", "--hidden", "64"]
    need = 2 * entry_bytes(argparse.Namespace(tokens=400, prompt_tokens=64, layers=2, hidden=64))
    with small_tmpfs(short_dir, "64m") as mnt:
        root, sock = mnt / "root", short_dir / "run" / "kv.sock"
        d = start_daemon(root, sock)
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("mine", "precious", filled(0.5, 1), [1]) and kv.flush(timeout=WAIT)
        assert d.stop() == 0
        # Just room, by the check: what is free less the demo's need is kept.
        d = start_daemon(root, sock, min_free_bytes=shutil.disk_usage(mnt).free - need)
        try:
            proc = run_demo("--socket", str(sock), *flags)
            assert proc.returncode == 0, proc.stderr
            with Client(sock, timeout=WAIT) as kv:
                assert kv.stats()["evictions"] == 0
                assert [e.cache_id for e in kv.entries("mine")] == ["precious"]
        finally:
            d.stop()


def test_the_demo_waits_for_no_store_it_cannot_size(short_dir: Path) -> None:
    """A daemon still indexing its store counts only what it has written
    since its start: the check took that for the store's size, and the scan
    then evicted the user's entry to make room for the demo's."""
    from .conftest import serve_process, stop_process

    hold = short_dir / "release"
    proc = serve_process(short_dir / "root", short_dir / "run" / "kv.sock",
                         "--max-disk-bytes", "100M", indexed=False,
                         env={"KVKEEPER_TEST_FAULTS": f"scan_hold={hold}"})
    try:
        r = run_demo("--socket", str(short_dir / "run" / "kv.sock"), "--tokens", "32",
                     "--prompt-tokens", "128")
        assert r.returncode == 1 and "still indexing" in r.stderr, r.stderr
    finally:
        hold.touch()
        assert stop_process(proc) == 0


def test_the_demo_runs_on_a_store_of_no_size(short_dir: Path) -> None:
    """A ramfs says 0 bytes free, and the daemon sets no floor there: the
    room check refused it ("0.0 MiB free, of which it keeps 0.0 MiB")."""
    from .faultkit import small_tmpfs

    with small_tmpfs(short_dir, "ramfs") as mnt:
        sock = short_dir / "run" / "kv.sock"
        d = start_daemon(mnt / "root", sock)
        try:
            r = run_demo("--socket", str(sock), "--tokens", "32", "--prompt-tokens", "128")
            assert r.returncode == 0, r.stderr
        finally:
            d.stop()


def test_the_demo_names_a_socket_path_that_is_no_socket(short_dir: Path) -> None:
    (short_dir / "plain").write_text("")
    r = run_demo("--socket", str(short_dir / "plain"))
    assert r.returncode == 3 and "it is not a socket" in r.stderr, r.stderr
    assert "start it" not in r.stderr, r.stderr


def test_the_demo_s_room_check_looks_at_the_disk_of_sessions(short_dir: Path) -> None:
    """The daemon keeps its free space on sessions/'s disk, which may be
    one of its own: the check looked at the root's (plenty free), and the
    daemon evicted the user's entry to keep its floor on the small one."""
    from .faultkit import filled, small_tmpfs

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    root.mkdir(mode=0o700)
    with small_tmpfs(root, "16m", name="sessions"):
        d = start_daemon(root, sock, min_free_bytes=12 * 2**20)
        try:
            with Client(sock, timeout=WAIT) as kv:
                assert kv.save("mine", "precious", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
                r = run_demo("--socket", str(sock), "--prompt-tokens", "1000", "--tokens", "100",
                             "--layers", "2")
                assert r.returncode == 1 and "of which it keeps 12.0 MiB" in r.stderr, r.stderr
                assert [e.cache_id for e in kv.entries("mine")] == ["precious"]
        finally:
            d.stop()


def test_the_demo_s_room_check_goes_by_what_the_daemon_sees(short_dir: Path) -> None:
    """A daemon with mounts of its own (a container, a service's private
    mounts) has its store on a disk the demo cannot see: the check looked at
    the store's path from here (plenty free), and the daemon evicted the
    user's entry to keep its floor on its small disk."""
    from .conftest import serve_process, stop_process
    from .faultkit import filled, need_linux_root

    need_linux_root()
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    root.mkdir(mode=0o700)
    # (The tmpfs is mounted in the daemon's own mount namespace alone.)
    mount_first = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs -o size=16m,mode=0700 tmpfs "$0" && exec "$@"', str(root))
    proc = serve_process(root, sock, "--min-free-bytes", str(12 * 2**20), prefix=mount_first)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("mine", "precious", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            assert not any(root.iterdir())  # not to be seen from here
            r = run_demo("--socket", str(sock), "--prompt-tokens", "1000", "--tokens", "100",
                         "--layers", "2")
            assert r.returncode == 1 and "of which it keeps 12.0 MiB" in r.stderr, r.stderr
            assert [e.cache_id for e in kv.entries("mine")] == ["precious"]
    finally:
        assert stop_process(proc) == 0
