"""Requests against a client's queued saves: they pass the saves they need
not see, and wait for those they must (a load or delete of the key, a flush).

The daemon is held with SIGSTOP while the client queues, so what reaches it
before a request is fixed by the order the client sent things in, not by
timing: once resumed, it reads everything in that order."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvkeeper.client.client import Client

from .conftest import WAIT, serve_process, stop_process, wait_for
from .faultkit import FP, entry_path, filled, version_of

#: Each save is 32 MiB: the client hands ZeroMQ about that much at a time.
MIB = 32


@pytest.fixture
def served(short_dir: Path) -> Iterator[tuple[Any, Path, Path]]:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--max-pending-bytes", str(1 << 30))
    try:
        yield proc, root, sock
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_process(proc) == 0


@contextmanager
def stopped(proc: Any) -> Iterator[None]:
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


@contextmanager
def background() -> Iterator[Callable[..., Future[Any]]]:
    with ThreadPoolExecutor(4) as pool:
        yield pool.submit


def queue_saves(kv: Client, n: int, version: int = 1) -> None:
    for i in range(n):
        assert kv.save(FP, f"other-{i}", filled(MIB, version), [version])


def waiting_requests(kv: Client, n: int) -> None:
    # The only way to know a blocked call has handed its request over.
    wait_for(lambda: len(kv._channel._waiting) == n, f"{n} requests handed over")


def test_requests_pass_saves_of_other_keys(served: tuple[Any, Path, Path]) -> None:
    """A stats request, a ping and a load of a key with no save queued were
    queued behind every save handed off before them (with 512 MiB of saves, a
    ping waited 1.6 s): the daemon read all 8 saves before answering."""
    proc, root, sock = served
    with Client(socket=sock, timeout=WAIT) as kv, background() as run:
        with stopped(proc):
            queue_saves(kv, 8)
            stats = run(kv.stats)
            miss = run(kv.load, FP, "never-saved")
            waiting_requests(kv, 2)
        got = stats.result(WAIT)
        assert miss.result(WAIT) is None
        # The first save was in ZeroMQ's pipe already; the other seven waited.
        assert got["saves_received"] <= 2, got["saves_received"]
        assert kv.flush(timeout=WAIT) is True
        assert kv.stats()["saves_received"] == 8
    for i in range(8):
        assert version_of(entry_path(root, f"other-{i}")) == 1


def test_a_load_or_delete_still_sees_the_saves_of_its_key(
        served: tuple[Any, Path, Path]) -> None:
    """Passing queued saves must not pass those of the key asked about: a
    load returns the save just queued behind others, a delete removes it, and
    a save made after the delete is not taken back by it."""
    proc, root, sock = served
    with Client(socket=sock, timeout=WAIT) as kv, background() as run:
        with stopped(proc):
            queue_saves(kv, 4)
            assert kv.save(FP, "mine", filled(MIB, 7), [7])
            load = run(kv.load, FP, "mine")
            assert kv.save(FP, "gone", filled(MIB, 5), [5])
            delete = run(kv.delete, FP, "gone")
            waiting_requests(kv, 2)
            # Made after the delete: it must survive it, not take the place
            # of the save the delete was asked about.
            assert kv.save(FP, "gone", filled(MIB, 6), [6])
        got = load.result(WAIT)
        assert got is not None and got.token_ids == [7]
        delete.result(WAIT)  # (False: the save it cancelled was never written)
        assert kv.flush(timeout=WAIT) is True
    assert version_of(entry_path(root, "mine")) == 7
    assert version_of(entry_path(root, "gone")) == 6


def test_a_newer_save_replaces_a_queued_one_of_any_size(
        served: tuple[Any, Path, Path]) -> None:
    """A save too large to hold for the send interval went to ZeroMQ whole,
    so every one was sent and written even when a newer one of the same key
    was already queued behind it."""
    proc, root, sock = served
    with Client(socket=sock, timeout=WAIT) as kv:
        with stopped(proc):
            queue_saves(kv, 1)
            for version in (1, 2, 3):
                assert kv.save(FP, "conv", filled(MIB, version), [version])
            wait_for(lambda: kv.client_stats()["client_saves_coalesced"] == 2,
                     "the queued saves replaced")
        assert kv.flush(timeout=WAIT) is True
        s = kv.stats()
        assert (s["saves_received"], s["saves_written"]) == (2, 2)
    assert version_of(entry_path(root, "conv")) == 3


def test_a_flush_waits_for_every_queued_save(served: tuple[Any, Path, Path]) -> None:
    """A flush goes after everything queued before it, however the requests
    around it pass."""
    proc, root, sock = served
    with Client(socket=sock, timeout=WAIT) as kv, background() as run:
        with stopped(proc):
            queue_saves(kv, 6, version=9)
            flushed = run(kv.flush, WAIT)
            waiting_requests(kv, 1)
            stats = run(kv.stats)
            waiting_requests(kv, 2)
        assert stats.result(WAIT)["saves_received"] <= 2
        assert flushed.result(WAIT) is True
        for i in range(6):
            assert version_of(entry_path(root, f"other-{i}")) == 9
