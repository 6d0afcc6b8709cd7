"""The client's own counters account for every save ``save()`` handed off.

A save that returned True ends up sent, lost or coalesced, exactly once,
however ``close()`` and the daemon's state cut its way short.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import pytest

from kvkeeper.client.client import Client

from .conftest import WAIT, serve_process, stop_process
from .faultkit import FP, filled


def accounted(kv: Client) -> int:
    c = kv.client_stats()
    return int(c["client_saves_sent"] + c["client_saves_lost"] + c["client_saves_coalesced"])


def test_a_save_cut_short_by_close_counts_as_lost_not_also_sent(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        kv = Client(sock, timeout=WAIT, min_send_interval=0)
        assert kv.connected
        # A stopped daemon reads nothing: 64 MiB cannot all leave before
        # close() gives up on it.
        proc.send_signal(signal.SIGSTOP)
        try:
            assert kv.save(FP, "big", filled(64, 1), [1])
            kv.close(timeout=0.5)
        finally:
            proc.send_signal(signal.SIGCONT)
        c = kv.client_stats()
        assert c["client_saves_lost"] == 1, c
        assert c["client_saves_sent"] == 0 and c["client_bytes_sent"] == 0, c
    finally:
        assert stop_process(proc) == 0


def test_close_says_when_the_daemon_did_not_confirm_it_read_the_saves(
    short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A small save leaves at once, but a stopped daemon never answers the
    ping close() sends after it: close() gives up after its timeout and says
    so in the log."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        kv = Client(sock, timeout=WAIT, min_send_interval=0)
        assert kv.connected
        proc.send_signal(signal.SIGSTOP)
        try:
            assert kv.save(FP, "small", filled(0.01, 1), [1])
            with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                kv.close(timeout=1.0)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert "event=client_close_unconfirmed" in caplog.text
        assert kv.client_stats()["client_saves_sent"] == 1
    finally:
        assert stop_process(proc) == 0


def save_until_closed(kv: Client, started: threading.Event, handed: list[int]) -> None:
    """Save in a loop until the client is closed, counting the saves handed off."""
    cache = filled(0.05, 1)  # made here: MLX evaluates an array on its own thread's stream
    started.set()
    while True:
        try:
            handed[0] += kv.save(FP, "race", cache, [1])
        except RuntimeError as exc:
            assert "client is closed" in str(exc)
            return


def test_saves_racing_close_are_each_sent_lost_or_dropped(short_dir: Path) -> None:
    """A thread saves in a loop while another closes the client, as the exit
    hook does beside a worker thread: no save that returned True vanishes."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        for _ in range(12):
            kv = Client(sock, timeout=WAIT, min_send_interval=0)
            assert kv.connected
            handed, started = [0], threading.Event()
            t = threading.Thread(target=save_until_closed, args=(kv, started, handed))
            t.start()
            assert started.wait(WAIT)
            kv._channel.close(timeout=0.05)  # the exit hook's close: the Client is not marked
            kv.close()
            t.join(WAIT)
            assert not t.is_alive()
            assert handed[0] > 0
            assert accounted(kv) == handed[0], (kv.client_stats(), handed)
            assert kv._channel.inflight_bytes == 0
    finally:
        assert stop_process(proc) == 0


def test_concurrent_flushes_report_each_failure_once(short_dir: Path) -> None:
    """Threads sharing a client save and flush at once; some saves are too
    large for the disk budget and are refused. Every refusal makes some flush
    say False, and once they are all reported a flush says True."""
    from .conftest import start_daemon

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=2**20)
    falses: list[int] = []
    try:
        with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:

            def worker(i: int) -> None:
                small, big = filled(0.05, 1), filled(1.5, 2)  # on this thread's stream
                for j in range(12):
                    assert kv.save(FP, f"t{i}", big if j % 4 == 3 else small, [j])
                    if not kv.flush(timeout=WAIT):
                        falses.append(i)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT * 2)
                assert not t.is_alive()
            s = kv.stats()
            refused = s["saves_refused"]
            assert refused == 12
            # Every refusal reached this client and nothing else went wrong: the
            # other 36 were written or replaced by a newer save of their key.
            assert s["client_saves_refused"] == 12, s
            assert s["client_saves_sent"] == 48 and s["client_saves_lost"] == 0, s
            assert s["saves_written"] + s["saves_superseded"] == 36 and s["saves_failed"] == 0, s
            assert 1 <= len(falses) <= refused
            # Nothing new failed: a failure already reported is not reported again.
            assert kv.flush(timeout=WAIT) is True
            assert kv.flush(timeout=WAIT) is True
    finally:
        assert rd.stop() == 0


#: What each batch saves before its flush: small saves that fit, and saves
#: over the disk budget that the daemon refuses ("big"), or over the client's
#: in-flight budget that save() itself drops ("huge").
BATCHES = [
    ("small", "small", "small"),
    ("small", "big", "small"),
    ("small", "small"),
    ("big",),
    ("small",),
    ("big", "small", "big"),
    ("small", "huge", "small"),
    ("small",),
]

COUNTS = ("saves_received", "saves_written", "saves_superseded", "saves_refused",
          "saves_failed", "client_saves_sent", "client_saves_refused",
          "client_saves_dropped", "client_saves_lost", "client_saves_coalesced")


def test_each_refusal_is_reported_by_the_flush_of_its_batch(short_dir: Path) -> None:
    """One thread, batches of saves each closed by a flush: a flush says False
    exactly when its batch holds a refused save, and the next flush, of a batch
    without one, says True; the counters move by exactly the batch's saves."""
    from .conftest import start_daemon

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=2**20)
    try:
        with Client(rd.socket, timeout=WAIT, min_send_interval=0,
                    max_inflight_bytes=4 * 2**20) as kv:
            caches = {"small": filled(0.05, 1), "big": filled(1.5, 2), "huge": filled(6, 3)}
            before = {k: kv.stats()[k] for k in COUNTS}
            for n, batch in enumerate(BATCHES):
                for j, kind in enumerate(batch):
                    # Small saves use a key of their own in the batch: none
                    # replaces another, so each is written.
                    assert kv.save(FP, f"{kind}-{j}", caches[kind], [n]) is (kind != "huge")
                refused, small = batch.count("big"), batch.count("small")
                assert kv.flush(timeout=WAIT) is (refused == 0), (n, batch)
                after = {k: kv.stats()[k] for k in COUNTS}
                moved = {k: after[k] - before[k] for k in COUNTS}
                # A refusal is the daemon's (counted there and in this client,
                # whose flush reports it); a drop is save()'s own False, never
                # sent and never a flush's business.
                assert moved == {
                    "saves_received": small + refused, "saves_written": small,
                    "saves_superseded": 0, "saves_refused": refused, "saves_failed": 0,
                    "client_saves_sent": small + refused, "client_saves_refused": refused,
                    "client_saves_dropped": batch.count("huge"), "client_saves_lost": 0,
                    "client_saves_coalesced": 0,
                }, (n, batch, moved)
                before = after
                # Reported once: a flush with nothing handed off since says True.
                assert kv.flush(timeout=WAIT) is True, (n, batch)
    finally:
        assert rd.stop() == 0
