"""The daemon answers while it indexes the store at start.

It used to bind its socket only after reading the header of every file under
the root (20,000 entries: 1.2 s with the files in the page cache, 4-28 s
without), and clients found no daemon meanwhile: every save made then was
dropped. ``scan_delay`` (faults) holds the scan after it has read every file
and before it replaces the index, so what a request would see of a half-done
scan shows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from kvkeeper.client.client import Client

from .conftest import WAIT, serve_process, start_daemon, stop_process
from .faultkit import FP, MiB, entry_path, filled, version_of

SLOW_SCAN = {"KVKEEPER_TEST_FAULTS": "scan_delay=4"}


def _holds(path: Path, version: int) -> bool:
    """Read with MLX's own reader: every tensor holds ``version``."""
    arrays = mx.load(str(path))
    return bool(arrays) and all(mx.all(a == version).item() for a in arrays.values())


def _store(root: Path, socket: Path, names: list[str], mib: float = 0.25) -> None:
    """Entries ``names`` (entry i holds version i + 1), written by a daemon
    that is then stopped."""
    rd = start_daemon(root, socket)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for i, name in enumerate(names):
                assert kv.save(FP, name, filled(mib, i + 1, layers=1), [i + 1])
            assert kv.flush(timeout=WAIT)
    finally:
        assert rd.stop() == 0


def test_saves_loads_and_ls_during_the_start_up_scan(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    names = ["e0", "e1", "e2", "e3", "e4"]
    _store(root, sock, names)
    proc = serve_process(root, sock, env=SLOW_SCAN, indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["store_indexing"] == 1  # answering, and not done
            assert kv.save(FP, "new", filled(0.25, 7, layers=1), [7])
            assert kv.save(FP, "e0", filled(0.25, 8, layers=1), [8])  # replaces a file
            got = kv.load(FP, "e1", verify=False)  # lazy, read before the scan ends
            assert got is not None and got.token_ids == [2]
            assert mx.all(got.cache[0].state[0] == 2).item()
            ls = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "ls", "--socket",
                                 str(sock)], capture_output=True, text=True, timeout=WAIT)
            assert ls.returncode == 0, ls.stderr
            # Not the part of the store read so far (nothing, until the scan is done).
            assert all(name in ls.stdout for name in names[1:]), ls.stdout
            assert kv.flush(timeout=WAIT) is True
            stats = kv.stats()
            assert stats["store_indexing"] == 0
            assert stats["saves_written"] == 2 and stats["client_saves_dropped"] == 0
            assert stats["client_saves_lost"] == 0
            assert _holds(entry_path(root, "new"), 7) and _holds(entry_path(root, "e0"), 8)
            on_disk = sum(f.stat().st_size for f in (root / "sessions").rglob("*") if f.is_file())
            assert stats["disk_used_bytes"] == on_disk
            assert {e.cache_id for e in kv.entries()} == {*names, "new"}
    finally:
        assert stop_process(proc) == 0


@pytest.mark.parametrize("fault, cut_short", [("scan_delay=600", False),
                                               ("scan_file_delay=200", True)])
def test_sigterm_during_the_start_up_scan_writes_the_saves_taken(
        short_dir: Path, fault: str, cut_short: bool) -> None:
    """SIGTERM during the scan: the drain writes the saves waiting behind it
    at once, instead of after the whole scan (here 600 s). Stopped part way
    through the files, the scan is cut short (and the budget left for the
    next start); stopped after it read them all, it is whole."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    _store(root, sock, ["old", "older"])
    proc = serve_process(root, sock, env={"KVKEEPER_TEST_FAULTS": fault}, indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["store_indexing"] == 1  # SIGTERM comes during the scan
            assert kv.save(FP, "x", filled(0.25, 5, layers=1), [5])
            # Sent whole: a save still on its way when the drain begins is
            # for the client to keep (tested apart).
            deadline = time.monotonic() + WAIT
            while kv.stats()["saves_received"] < 1:
                assert time.monotonic() < deadline, "the save did not reach the daemon"
                time.sleep(0.02)
            assert stop_process(proc) == 0  # within WAIT, not 600 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
    log = proc.log_path.read_text()  # type: ignore[attr-defined]
    assert ("event=scan_cut_short" in log) is cut_short, log
    assert "event=not_saved_at_exit" not in log, log
    assert _holds(entry_path(root, "x"), 5) and version_of(entry_path(root, "x")) == 5
    assert version_of(entry_path(root, "old")) == 1
    proc = serve_process(root, sock)  # the next start indexes all three
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert {e.cache_id for e in kv.entries()} == {"old", "older", "x"}
    finally:
        assert stop_process(proc, signal.SIGTERM) == 0


def test_a_load_during_the_scan_counts_as_a_use(short_dir: Path) -> None:
    """An entry loaded after the scan read its file's times, before the scan
    ended, is kept as used: the scan's times were older than the load."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    _store(root, sock, ["a", "b", "c"])
    sizes = {n: entry_path(root, n).stat().st_size for n in "abc"}
    assert len(set(sizes.values())) == 1, sizes
    now = time.time()
    for age, name in ((300, "a"), (200, "b"), (100, "c")):  # "a" used longest ago
        os.utime(entry_path(root, name), (now - age, now - age))
    # Room for the three and not for a fourth: one goes when "d" is written.
    budget = 4 * sizes["a"] - 1
    assert budget >= MiB
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         env=SLOW_SCAN, indexed=False)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["store_indexing"] == 1
            got = kv.load(FP, "a")
            assert got is not None and got.token_ids == [1]
            assert kv.save(FP, "d", filled(0.25, 4, layers=1), [4])
            assert kv.flush(timeout=WAIT) is True
            assert entry_path(root, "d").stat().st_size == sizes["a"]
            assert kv.stats()["evictions"] == 1
            assert {e.cache_id for e in kv.entries()} == {"a", "c", "d"}
            assert not entry_path(root, "b").exists()
            assert _holds(entry_path(root, "a"), 1)
    finally:
        assert stop_process(proc) == 0
