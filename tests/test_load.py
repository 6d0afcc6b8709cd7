"""Many clients, a daemon that goes away and comes back, a disk slower than
the saves: memory stays bounded and every save is accounted for."""

from __future__ import annotations

import multiprocessing
import resource
import signal
import threading
import time
from pathlib import Path

import pytest

from kvkeeper.client.client import Client
from kvkeeper.daemon.faults import ENV

from .conftest import WAIT, daemon_log, serve_process, start_daemon, stop_process
from .faultkit import FP, entry_path, filled, version_of
from .loadkit import FP as LOAD_FP
from .loadkit import client_worker


def accounted(stats: dict[str, float]) -> None:
    """Every save the daemon received ended one way or another."""
    assert stats["saves_received"] == (stats["saves_written"] + stats["saves_superseded"]
                                       + stats["saves_refused"] + stats["saves_failed"]), stats


def test_eight_client_processes(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(8) as pool:
            results = pool.starmap_async(
                client_worker, [(i, str(sock), 4.0, 100 + i) for i in range(8)]
            ).get(timeout=180)
        for r in results:
            assert r["errors"] == [], r["errors"][:3]
            assert r["own_reads"] > 0
        with Client(sock, timeout=WAIT) as kv:
            assert kv.flush(timeout=WAIT)
            stats = kv.stats()
            for i, r in enumerate(results):
                got = kv.load(LOAD_FP, f"private-{i}")
                if r["confirmed_private"] is not None and not r["deleted_last"]:
                    assert got is not None and got.token_ids == [r["confirmed_private"]]
                if r["deleted_last"]:
                    assert got is None
            shared = kv.load(LOAD_FP, "shared")
            sent = {v for r in results for v in r["shared_sent"]}
            assert shared is not None and shared.token_ids[0] in sent
        accounted(stats)
        assert sum(r["ops"] for r in results) > 100
    finally:
        assert stop_process(proc) == 0


def test_daemon_down_and_back_under_a_live_client(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    rd = start_daemon(root, sock)
    kv = Client(sock, timeout=WAIT)
    try:
        assert kv.save(FP, "k", filled(4, 1), [1]) and kv.flush(timeout=WAIT)
        rd.stop()
        deadline = time.monotonic() + WAIT
        while kv.connected:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        big = filled(100, 2, layers=1)  # 100 MiB
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times = []
        for _ in range(100):
            t0 = time.perf_counter()
            assert kv.save(FP, "big", big, [2]) is False
            times.append(time.perf_counter() - t0)
        times.sort()
        # A hang detector, not a speed target (that is the benchmark's job).
        assert times[-1] < 0.5, times[-5:]
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 64 * 1024  # KiB
        got = kv.load(FP, "k")  # from the file
        assert got is not None and got.token_ids == [1]
        rd = start_daemon(root, sock)
        deadline = time.monotonic() + WAIT
        while not kv.connected:
            assert time.monotonic() < deadline, "client did not reconnect"
            time.sleep(0.01)
        assert kv.save(FP, "big", big, [2]) and kv.flush(timeout=WAIT)
        assert version_of(entry_path(root, "big")) == 2
        print(f"daemon down: save() p50 {times[50] * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us")
    finally:
        kv.close()
        if rd.thread.is_alive():
            rd.stop()


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.parametrize("max_pending_mib", [48])
def test_slow_disk_keeps_memory_bounded(short_dir: Path, max_pending_mib: int) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    # 40 ms per MiB: 25 MiB/s, far slower than the saves come.
    proc = serve_process(root, sock, "--max-pending-bytes", f"{max_pending_mib}M",
                         env={ENV: "write_delay=0.04"})
    try:
        base = vm_kib(proc.pid, "VmRSS")
        caches = [filled(12, v) for v in range(1, 5)]
        sent = 0
        # The daemon's own gauge of what its writer holds, sampled by a client
        # of its own all through the saves and the flush: RSS alone cannot
        # tell the budget from the allocator's slack.
        gauges: list[dict[str, float]] = []
        done = threading.Event()

        def sample() -> None:
            with Client(sock, timeout=WAIT) as mon:
                while not done.is_set():
                    gauges.append(mon.stats())
                    done.wait(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with Client(sock, timeout=60, max_inflight_bytes=64 * 2**20) as kv:
                for i in range(40):
                    v = i + 1
                    c = caches[i % 4]
                    if kv.save(FP, f"k{i % 4}", c, [v]):
                        sent += 1
                    time.sleep(0.01)
                assert kv.flush(timeout=120) is False  # some were refused: flush says so
                stats = kv.stats()
        finally:
            done.set()
            sampler.join(WAIT)
        assert not sampler.is_alive()
        accounted(stats)
        assert stats["saves_received"] == sent
        assert stats["saves_superseded"] + stats["saves_refused"] > 0
        assert stats["client_saves_dropped"] + sent == 40
        # Every save not written is counted once as why: dropped by the
        # client, or superseded, refused or failed in the daemon.
        assert stats["saves_failed"] == 0 and stats["client_saves_lost"] == 0, stats
        assert stats["client_saves_sent"] + stats["client_saves_coalesced"] == sent, stats
        assert stats["client_saves_refused"] == stats["saves_refused"], stats
        assert 40 - stats["saves_written"] == (stats["client_saves_dropped"]
                                               + stats["client_saves_coalesced"]
                                               + stats["saves_superseded"]
                                               + stats["saves_refused"]), stats
        # Refused for the memory budget, not for anything else.
        log = daemon_log(proc)
        assert log.count("event=save_refused code=busy ") == stats["saves_refused"], log[-2000:]
        # The daemon reports no peak of its pending bytes, only the gauge now:
        # every sample stays within the writer's share of the budget, and that
        # share within --max-pending-bytes (ZeroMQ's queue has the rest).
        limit = max_pending_mib * 2**20
        assert all(g["max_pending_bytes"] == limit for g in gauges)
        share = gauges[0]["writer_max_pending_bytes"]
        assert 0 < share < limit and all(g["writer_max_pending_bytes"] == share for g in gauges)
        pending = [g["pending_bytes"] for g in gauges]
        assert max(pending) <= share, (max(pending), share)
        # The samples saw the pressure: at least one 12 MiB save waiting.
        assert max(pending) >= 12 * 2**20, max(pending)
        assert stats["pending_bytes"] == 0, stats
        peak = vm_kib(proc.pid, "VmHWM")
        assert peak - base < (max_pending_mib + 100) * 1024, (base, peak)
        print(f"slow disk: daemon RSS {base // 1024} MiB at start, peak {peak // 1024} MiB; "
              f"pending peak sampled {max(pending) / 2**20:.1f} of {share / 2**20:.1f} MiB "
              f"in {len(gauges)} samples; {stats}")
    finally:
        assert stop_process(proc) == 0


def test_a_full_inflight_budget_drops_saves_and_counts_them(short_dir: Path) -> None:
    # A stopped daemon reads nothing, so what was handed off stays in flight.
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    stopped = False
    try:
        with Client(sock, timeout=WAIT, max_inflight_bytes=24 * 2**20) as kv:
            proc.send_signal(signal.SIGSTOP)
            stopped = True
            assert kv.save(FP, "a", filled(12, 1), [1]) is True
            # Exactly full now: each reserved its bytes in save(), and a stopped
            # daemon takes too few of them for either to be sent whole.
            assert kv.save(FP, "b", filled(12, 2), [2]) is True
            assert kv.save(FP, "c", filled(1, 3), [3]) is False  # no room, not even 1 MiB
            assert kv.save(FP, "c", filled(1, 3), [3]) is False
            proc.send_signal(signal.SIGCONT)
            stopped = False
            assert kv.flush(WAIT) is True
            s = kv.stats()
            assert (s["client_saves_dropped"], s["saves_written"]) == (2, 2)
            assert version_of(entry_path(root, "b")) == 2 and not entry_path(root, "c").exists()
    finally:
        if stopped:
            proc.send_signal(signal.SIGCONT)
        assert stop_process(proc) == 0
