"""A save replaced by another job still answers to whoever waits for it.

Raw clients on a real daemon: one keeps the writer busy (a slow disk), so
the saves of the key under test wait in the mailbox, where a newer save, a
delete or a move aside can overtake or replace them. Files are read back
with the `safetensors` package.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from safetensors.numpy import load_file

from kvkeeper.daemon.faults import ENV
from kvkeeper.protocol import messages as m
from kvkeeper.protocol import naming

from .conftest import (
    WAIT,
    dealers,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
    wait_for_log,
)

V = m.PROTOCOL_VERSION


def save(s: zmq.Socket, save_id: int, cache_id: str, data: bytes, *,
         send_bytes: int | None = None) -> None:
    """A one-tensor save; ``send_bytes`` sends only that many of its bytes."""
    spec = m.TensorSpec("t", "U8", [len(data)])
    s.send(m.encode(m.SaveBegin(v=V, save=save_id, model="fp", cache_id=cache_id,
                                tensors=[spec], metadata={})))
    part = data if send_bytes is None else data[:send_bytes]
    if part:
        s.send_multipart([m.encode(m.SaveData(v=V, save=save_id, frames=1)), part])


def reply(s: zmq.Socket, timeout: float = WAIT) -> m.Reply:
    assert s.poll(int(timeout * 1000)), "no reply"
    return m.decode_reply(s.recv_multipart()[0])


def ask(s: zmq.Socket, msg: m.Request, timeout: float = WAIT) -> m.Reply:
    s.send(m.encode(msg))
    return reply(s, timeout)


def held(path: Path) -> bytes:
    return load_file(str(path))["t"].tobytes()


V1, V2, V3 = b"v1" * 8, b"v2" * 8, b"v3" * 8
BUSY = b"x" * (3 * 2**20)  # at 0.5 s per MiB: the writer is busy for 1.5 s


def slow_daemon(short_dir: Path):  # noqa: ANN201 - a Popen
    return serve_process(short_dir / "root", short_dir / "run" / "kv.sock",
                         "--min-write-interval", "0", env={ENV: "write_delay=0.5"})


@pytest.mark.parametrize("how", ["another client's", "its own newer save",
                                 "its own, then another client's"])
def test_a_flush_waits_for_the_save_that_replaced_its_own(short_dir: Path, how: str) -> None:
    """A's flush covers A's save of k, which is replaced before it is written
    (by B's save; by A's newer one; by A's, then that by B's), and the last
    replacement fails. (In the last two, the failure was charged after the
    flush, which said True with the key holding v1.)"""
    proc = slow_daemon(short_dir)
    path = naming.entry_path(short_dir / "root", "fp", "k")
    try:
        with dealers(short_dir / "run" / "kv.sock", 2) as (a, b):
            save(a, 1, "k", V1)
            assert ask(a, m.Flush(v=V, req=1)) == m.Flushed(v=V, req=1, written=1,
                                                            superseded=0, failed=0)
            save(b, 1, "busy", BUSY)
            time.sleep(0.2)
            save(a, 2, "k", V2)  # waits behind the busy save
            a.send(m.encode(m.Flush(v=V, req=2)))
            time.sleep(0.2)
            last = a if how == "its own newer save" else b
            if how == "its own, then another client's":
                save(a, 3, "k", V3)
                time.sleep(0.2)
            # The last newer save of k replaces the waiting one, and is then
            # abandoned half sent.
            save(last, 4, "k", b"v4" * 8, send_bytes=4)
            time.sleep(0.3)
            save(last, 5, "other", b"o")
            flushed = reply(a)
            if last is b:
                # A's newest save of k went with B's: A is told at once.
                assert isinstance(flushed, m.SaveRefused) and flushed.save == (
                    3 if how == "its own, then another client's" else 2) \
                    and flushed.message == ("the save that replaced it failed: the client "
                                            "abandoned it part way"), flushed
                flushed = reply(a)
            assert isinstance(flushed, m.Flushed)
            # The key still holds v1, and A's flush must say a save of A's
            # was not written.
            assert held(path) == V1
            assert flushed.failed == 1, flushed
            # Reported once: the next flush has nothing new to say.
            again = ask(a, m.Flush(v=V, req=3))
            assert isinstance(again, m.Flushed) and again.failed == 1, again
    finally:
        assert stop_process(proc) == 0


def test_a_load_waits_for_the_save_that_replaced_the_loaders_own(short_dir: Path) -> None:
    proc = slow_daemon(short_dir)
    try:
        with dealers(short_dir / "run" / "kv.sock", 2) as (a, b):
            save(a, 1, "k", V1)
            ask(a, m.Flush(v=V, req=1))
            save(b, 1, "busy", BUSY)
            time.sleep(0.2)
            save(a, 2, "k", V2)
            a.send(m.encode(m.Load(v=V, req=2, model="fp", cache_id="k")))
            time.sleep(0.2)
            save(b, 2, "k", V3)  # replaces A's v2 before it is written
            found = reply(a)
            assert isinstance(found, m.Found) and found.path is not None
            # Read-your-writes: A's own save, or the newer one that replaced it.
            assert held(Path(found.path)) == V3
    finally:
        assert stop_process(proc) == 0


def test_a_held_save_still_counts_after_its_file_is_moved_aside(short_dir: Path) -> None:
    # A 60 s write interval holds the second save; moving the damaged file
    # aside may run before it, and must not make the daemon forget it.
    d = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", min_write_interval=60.0)
    path = naming.entry_path(short_dir / "root", "fp", "k")
    try:
        with dealers(d.socket, 2) as (a, q):
            save(a, 1, "k", V1)
            ask(a, m.Flush(v=V, req=1))
            save(a, 2, "k", V2)
            wait_for(lambda: ask(a, m.GetStats(v=V, req=2)).counters.get(  # type: ignore[union-attr]
                "held_saves") == 1, "the daemon to hold save 2")
            st = os.stat(path)
            moved = ask(q, m.Quarantine(v=V, req=3, model="fp", cache_id="k", ino=st.st_ino,
                                        mtime_ns=st.st_mtime_ns, reason="test"))
            assert moved == m.Deleted(v=V, req=3, existed=True)
            found = ask(a, m.Load(v=V, req=4, model="fp", cache_id="k"))
            assert isinstance(found, m.Found) and found.path is not None
            assert held(Path(found.path)) == V2
    finally:
        assert d.stop() == 0


def test_a_failed_delete_of_a_clients_own_held_save_fails_its_flush(short_dir: Path) -> None:
    d = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", min_write_interval=60.0)
    path = naming.entry_path(short_dir / "root", "fp", "k")
    try:
        with dealers(d.socket, 1) as (a,):
            save(a, 1, "k", V1)
            ask(a, m.Flush(v=V, req=1))
            save(a, 2, "k", V2)  # held: the interval is 60 s
            # Something that unlink cannot remove sits where the file was.
            path.unlink()
            path.mkdir()
            (path / "x").write_bytes(b"")
            # The held save is lost with the delete that replaced it: told at
            # once (its loads would read v1 as settled), then the delete's error.
            told = ask(a, m.Delete(v=V, req=2, model="fp", cache_id="k"))
            assert isinstance(told, m.SaveRefused) and told.save == 2 \
                and told.message.startswith("the delete that replaced it failed: "), told
            deleted = reply(a)
            assert isinstance(deleted, m.Error), deleted
            flushed = ask(a, m.Flush(v=V, req=3))
            # v2 was neither written nor deleted: that is a failed save of A's.
            assert isinstance(flushed, m.Flushed) and flushed.failed == 1, flushed
            assert path.is_dir()
    finally:
        assert d.stop() == 0


def test_replaced_saves_keep_the_newest_bytes(short_dir: Path) -> None:
    """The chain of replacements ends at the newest save: three clients, each
    replacing the previous one's save while the writer is busy."""
    proc = slow_daemon(short_dir)
    path = naming.entry_path(short_dir / "root", "fp", "k")
    try:
        with dealers(short_dir / "run" / "kv.sock", 4) as (busy, *peers):
            save(busy, 1, "busy", BUSY)
            time.sleep(0.2)
            for i, s in enumerate(peers):
                save(s, 1, "k", np.full(16, i, np.uint8).tobytes())
            for s in peers:
                s.send(m.encode(m.Flush(v=V, req=1)))
            for s in peers:
                flushed = reply(s)
                assert isinstance(flushed, m.Flushed) and flushed.failed == 0
                # Each flush returned once the newest save was on disk.
                assert held(path) == np.full(16, 2, np.uint8).tobytes()
    finally:
        assert stop_process(proc) == 0


def test_a_delete_that_replaces_a_waiting_save_says_the_entry_existed(short_dir: Path) -> None:
    """A delete of a key whose first save waits behind another is done "after
    any pending save of it": the entry existed. It replaced the save instead
    of waiting for its write, and said False, as for a key never saved."""
    proc = slow_daemon(short_dir)
    try:
        with dealers(short_dir / "run" / "kv.sock", 2) as (a, b):
            save(b, 1, "busy", BUSY)
            time.sleep(0.2)
            save(a, 1, "k", V1)  # waits behind the busy save
            assert ask(a, m.Delete(v=V, req=1, model="fp", cache_id="k")) == m.Deleted(
                v=V, req=1, existed=True)
            assert ask(a, m.Delete(v=V, req=2, model="fp", cache_id="k")) == m.Deleted(
                v=V, req=2, existed=False)
            assert ask(a, m.Flush(v=V, req=3)) == m.Flushed(v=V, req=3, written=0,
                                                            superseded=1, failed=0)
        assert not naming.entry_path(short_dir / "root", "fp", "k").exists()
    finally:
        assert stop_process(proc) == 0



def test_a_flood_of_saves_of_one_key_leaves_room_for_other_clients(short_dir: Path) -> None:
    """Saves of one key, each replacing the last while the writer is busy,
    took a mailbox slot each until the writer came to skip them: 4,096 of
    them filled the daemon's mailbox, and another client's save was refused
    as "busy". A save that replaces one still waiting takes its place.

    The writer is held in its first save until the flood is in: behind a
    slow disk's 4 s instead, saves of k that came after it wrote 2 to 11 of
    them, in 5 runs of 35 on a loaded machine."""
    hold = short_dir / "go"
    proc = serve_process(short_dir / "root", short_dir / "run" / "kv.sock",
                         "--min-write-interval", "0", env={ENV: f"write_hold={hold}"})
    path = naming.entry_path(short_dir / "root", "fp", "k")
    n = 5000
    try:
        with dealers(short_dir / "run" / "kv.sock", 4) as (busy, a, b, watch):
            save(busy, 1, "busy", b"x" * 2**20)
            wait_for_log(proc, "event=fault_hold step=write", "the writer to be held")
            for i in range(1, n + 1):
                save(a, i, "k", i.to_bytes(4, "little") * 4)

            def received() -> float:
                stats = ask(watch, m.GetStats(v=V, req=1))
                assert isinstance(stats, m.Stats)
                return stats.counters["saves_received"]

            wait_for(lambda: received() == n + 1, "the daemon to read the flood")
            save(b, 1, "other", V1)
            hold.touch()
            flushed = ask(b, m.Flush(v=V, req=1), timeout=30)
            assert flushed == m.Flushed(v=V, req=1, written=1, superseded=0, failed=0)
            assert held(naming.entry_path(short_dir / "root", "fp", "other")) == V1
            flushed = ask(a, m.Flush(v=V, req=1), timeout=30)
            assert flushed == m.Flushed(v=V, req=1, written=1, superseded=n - 1, failed=0)
            assert held(path) == n.to_bytes(4, "little") * 4
            assert not a.poll(0)  # no save of the flood was refused
    finally:
        hold.touch()
        assert stop_process(proc) == 0
