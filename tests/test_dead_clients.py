"""A client that dies part way through a save costs nobody else anything.

The daemon's single writer writes a save while its bytes arrive. When the
sending process is killed, no more bytes come; the save must fail as soon as
the daemon can tell (its connection closed and nothing of it is left to
read), not after the writer's stall timeout, which would keep its memory
and tmp file that long (other saves go by it: test_parked_saves.py). A
client that sends a whole save and exits at once must still get it written.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from kvkeeper.client.client import Client

from .conftest import (
    WAIT,
    daemon_log,
    line_from,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
)
from .faultkit import FP, entry_path, filled, tmp_files, version_of

MiB = 1024 * 1024

#: A raw client in its own process. Once connected (a ping answered) it
#: prints "ready" and waits for a line; then it sends SaveBegin for ``total``
#: float32 values and ``chunks`` chunks of ``per`` values each (value i at
#: index i), prints "sent", and either exits at once (``exit``), or waits to
#: be killed (``wait``), or closes its socket and waits on, alive (``close``;
#: ``reopen`` then connects anew).
CHILD = textwrap.dedent("""
    import sys, time, numpy as np, zmq
    from kvkeeper.protocol import messages as m
    sock_path, cache_id, total, chunks, per, how = sys.argv[1:]
    total, chunks, per = int(total), int(chunks), int(per)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect("ipc://" + sock_path)
    V = m.PROTOCOL_VERSION
    s.send(m.encode(m.Ping(v=V, req=1)))
    assert s.poll(30_000), "no pong"
    s.recv()
    print("ready", flush=True)
    sys.stdin.readline()
    s.send(m.encode(m.SaveBegin(v=V, save=1, model="fp", cache_id=cache_id,
                                tensors=[m.TensorSpec("t", "F32", [total])])))
    for i in range(chunks):
        part = np.arange(i * per, (i + 1) * per, dtype=np.float32)
        s.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), part.tobytes()])
    if how != "exit":
        time.sleep(1.0)  # for ZeroMQ's I/O thread to hand the bytes to the kernel
    if how in ("close", "reopen"):
        s.close(linger=0)  # what a Client does once close() has waited long enough
    if how == "reopen":  # and a new Client of the same process, likely on the same fd
        time.sleep(0.2)
        s = ctx.socket(zmq.DEALER)
        s.connect("ipc://" + sock_path)
        s.send(m.encode(m.Ping(v=V, req=2)))
        assert s.poll(30_000), "no pong"
        s.recv()
    print("sent", flush=True)
    if how == "exit":
        s.close(linger=-1)  # a normal exit: whatever was sent goes out first
        ctx.term()
    else:
        sys.stdin.read()  # until killed
""")


#: A live raw client streaming one save in many tiny messages at a steady
#: rate (value 0 throughout), then exiting once it has sent the last one.
STREAMER = textwrap.dedent("""
    import sys, time, numpy as np, zmq
    from kvkeeper.protocol import messages as m
    sock_path, n, per, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect("ipc://" + sock_path)
    V = m.PROTOCOL_VERSION
    s.send(m.encode(m.SaveBegin(v=V, save=1, model="fp", cache_id="live",
                                tensors=[m.TensorSpec("t", "F32", [n * per])])))
    part = np.zeros(per, dtype=np.float32).tobytes()
    hdr = m.encode(m.SaveData(v=V, save=1, frames=1))
    print("started", flush=True)
    t0 = time.monotonic()
    for i in range(n):
        s.send_multipart([hdr, part])
        time.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))
    # Answered once the daemon has read every message before it. Exiting
    # sooner lost the last few here: ZeroMQ seems to drop what a ROUTER queued
    # but not handed over from a peer whose connection ends (thousands of
    # tiny messages fill its queue; a kvkeeper client's 8 MiB ones do not).
    s.send(m.encode(m.Ping(v=V, req=1)))
    assert s.poll(30_000), "no pong"
    s.recv()
    s.close(linger=-1)
    ctx.term()
""")


#: A kvkeeper client process: ``n`` small saves of distinct caches, printing
#: how many save() handed off, then a normal exit with no flush() or close()
#: (the exit hook closes the client).
SAVER = textwrap.dedent("""
    import sys, mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from kvkeeper import Client
    sock_path, n = sys.argv[1], int(sys.argv[2])
    kv = Client(sock_path, timeout=30)
    assert kv.connected, "no daemon"
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 4, 8)), mx.ones((1, 1, 4, 8)))
    print(sum(kv.save("fp", f"k{i}", [c], [1, 2, 3, 4]) for i in range(n)), flush=True)
""")


def child(sock: Path, cache_id: str, total: int, chunks: int, per: int,
          how: str) -> subprocess.Popen[str]:
    """The CHILD client, connected and waiting for ``go()``."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(sock), cache_id, str(total),
                             str(chunks), str(per), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert line_from(proc) == "ready"
    return proc


def go(proc: subprocess.Popen[str]) -> None:
    """Let the CHILD send its save; returns once it has."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert line_from(proc) == "sent"


def test_a_killed_client_does_not_hold_up_the_writer(short_dir: Path) -> None:
    # A stall timeout far beyond the test's waits: only noticing the closed
    # connection can fail the dead save in time.
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=600)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            # 16 MiB declared, 1 MiB sent, then SIGKILL.
            dead = child(rd.socket, "dead", 4 * MiB, 1, MiB // 4, "wait")
            go(dead)
            wait_for(lambda: kv.stats()["bytes_received"] >= MiB, "the first MiB to arrive")
            # Not reaped until the end: a zombie counts as dead.
            dead.send_signal(signal.SIGKILL)
            assert kv.save(FP, "alive", filled(1, 7), [7])
            assert kv.flush(timeout=WAIT) is True
            assert dead.wait(WAIT) == -signal.SIGKILL
            assert version_of(entry_path(rd.root, "alive")) == 7
            # The other save went by the stalled one (parked); the dead
            # one is then cut off, not failed by the stall timeout.
            wait_for(lambda: kv.stats()["saves_failed"] == 1, "the dead save to fail")
            stats = kv.stats()
            assert stats["saves_cut_off"] == 1
            assert stats["saves_written"] == 1 and stats["pending_bytes"] == 0
        assert not entry_path(rd.root, "dead", model="fp").exists()
        assert tmp_files(rd.root) == []
    finally:
        assert rd.stop() == 0


@pytest.mark.parametrize("how", ["close", "reopen"])
def test_a_live_client_that_closed_its_connection_does_not_hold_up_the_writer(
    short_dir: Path, how: str
) -> None:
    # A daemon process of its own, so that its descriptors are its own: the
    # reopened connection is then likely to get the closed one's number.
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            # 16 MiB declared, 1 MiB sent, then the socket closed; the process lives on.
            gone = child(sock, "half", 4 * MiB, 1, MiB // 4, how)
            try:
                go(gone)
                assert kv.save(FP, "alive", filled(1, 5), [5])
                assert kv.flush(timeout=WAIT) is True
                assert gone.poll() is None  # still running
            finally:
                gone.kill()
                gone.wait(WAIT)
            assert version_of(entry_path(root, "alive")) == 5
            wait_for(lambda: kv.stats()["saves_failed"] == 1, "the abandoned save to fail")
            assert kv.stats()["saves_cut_off"] == 1  # not the 10 s stall timeout
        assert not entry_path(root, "half", model="fp").exists()
        assert tmp_files(root) == []
    finally:
        assert stop_process(proc) == 0


@pytest.mark.parametrize("round_", range(3))
def test_a_client_that_sends_a_whole_save_and_exits_gets_it_written(
    short_dir: Path, round_: int
) -> None:
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        # 48 MiB in 12 messages: more than the daemon's receive queue holds,
        # so some are still queued when the connection's close is reported.
        per = MiB
        proc = child(rd.socket, "whole", 12 * per, 12, per, "exit")
        go(proc)
        assert proc.wait(WAIT) == 0
        with Client(rd.socket, timeout=WAIT) as kv:
            wait_for(lambda: kv.stats()["saves_written"] == 1, "the save to be written")
            stats = kv.stats()
            assert stats["saves_failed"] == 0 and stats["saves_cut_off"] == 0
        path = entry_path(rd.root, "whole", model="fp")
        with safe_open(str(path), "np") as f:
            t = f.get_tensor("t")
        assert np.array_equal(t, np.arange(12 * per, dtype=np.float32))
    finally:
        assert rd.stop() == 0


def test_a_client_process_exiting_right_after_saving_gets_every_save_to_the_daemon(
    short_dir: Path,
) -> None:
    """Thousands of small saves, then exit. ZeroMQ had taken the last ones
    (the client counted them sent) when the connection closed, and they never
    reached the daemon: up to 43 of 3,000 in a round, about every other
    round, before close() waited for the daemon to answer a ping."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            n, rounds = 3000, 6
            for r in range(rounds):
                out = subprocess.run([sys.executable, "-c", SAVER, str(rd.socket), str(n)],
                                     stdout=subprocess.PIPE, text=True, timeout=WAIT)
                assert out.returncode == 0 and int(out.stdout) == n
                # A lost tail takes the round's last saves, whole or in part.
                handed = (r + 1) * n
                wait_for(lambda: kv.stats()["saves_received"] == handed,  # noqa: B023 - waited for here
                         f"round {r}'s saves to reach the daemon")
            # Each round saves the same keys anew: a save still waiting for the
            # writer is replaced by the next round's, or refused while the
            # writer's queue is full; none is left half received.
            def resolved() -> float:
                s = kv.stats()
                return s["saves_written"] + s["saves_superseded"] + s["saves_refused"]

            wait_for(lambda: resolved() == rounds * n, "every save resolved")
            stats = kv.stats()
            assert stats["saves_failed"] == stats["saves_cut_off"] == 0
        with safe_open(str(entry_path(rd.root, f"k{n - 1}", model="fp")), "np") as f:
            assert sorted(f.keys())  # written whole: its header and tensors read back
        assert len(list(rd.root.rglob("*.safetensors"))) == n
    finally:
        assert rd.stop() == 0


def test_a_save_whose_start_is_read_after_its_client_died_is_cut_off(
    short_dir: Path,
) -> None:
    """The daemon stopped (SIGSTOP) while the client sends part of a save and
    is killed: on resuming it reads the start, the part, and the close
    together, in whatever order its two sockets report them."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        dead = child(sock, "dead", 4 * MiB, 1, 16 * 1024, "wait")
        proc.send_signal(signal.SIGSTOP)
        try:
            go(dead)  # 64 KiB fits the socket's kernel buffer
            dead.send_signal(signal.SIGKILL)
            assert dead.wait(WAIT) == -signal.SIGKILL
        finally:
            proc.send_signal(signal.SIGCONT)
        with Client(sock, timeout=WAIT) as kv:
            wait_for(lambda: kv.stats()["saves_failed"] == 1, "the dead save to fail")
            assert kv.stats()["saves_cut_off"] == 1  # not the 10 s stall timeout
            assert kv.save(FP, "alive", filled(1, 3), [3])
            assert kv.flush(timeout=WAIT) is True
        assert tmp_files(root) == []
    finally:
        assert stop_process(proc) == 0
    log = daemon_log(proc)
    assert "died after sending 65536 of 16777216 bytes" in log



def test_a_save_whose_start_is_read_after_its_live_client_closed_is_cut_off(
    short_dir: Path,
) -> None:
    """The daemon stopped (SIGSTOP) while a client hands it a 48 MiB save and
    closes (close() gives up waiting), while other clients connect. On
    resuming, the daemon reads the save's start after the close: the
    connection's descriptor is closed, or already another connection's. The
    save is cut off, and another client's load of its key is answered
    (before: both waited for the 600 s stall timeout; with the default 10 s,
    such a load waited out its own timeout)."""
    import zmq

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--stall-timeout", "600")
    ctx = zmq.Context()
    others = []
    try:
        gone = Client(sock, timeout=WAIT)
        assert gone.connected
        proc.send_signal(signal.SIGSTOP)
        try:
            assert gone.save(FP, "half", filled(48, 1), [1])
            gone.close(1.0)  # gives up: the save is counted lost
            assert gone.client_stats()["client_saves_lost"] == 1
            for _ in range(3):  # likely given the closed one's number
                s = ctx.socket(zmq.DEALER)
                s.connect(f"ipc://{sock}")
                others.append(s)
        finally:
            proc.send_signal(signal.SIGCONT)
        with Client(sock, timeout=WAIT) as kv:
            assert kv.load(FP, "half") is None
            wait_for(lambda: kv.stats()["saves_failed"] == 1, "the closed save to fail")
            assert kv.stats()["saves_cut_off"] == 1
            assert kv.save(FP, "alive", filled(1, 3), [3])
            assert kv.flush(timeout=WAIT) is True
        assert tmp_files(root) == []
        assert not entry_path(root, "half").exists()
    finally:
        for s in others:
            s.close(linger=0)
        ctx.term()
        assert stop_process(proc) == 0
    log = daemon_log(proc)
    assert "closed its connection after sending" in log


def test_looking_for_dead_clients_never_stops_the_daemon_reading(short_dir: Path) -> None:
    """A connection closes while a live client streams a save in many small
    messages: the daemon starts looking for dead senders while that save
    arrives, and must go on reading it (no other connection opens meanwhile
    to wake the socket up), so the save is written whole."""
    from .conftest import ping

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=600)
    try:
        n, per = 40_000, 16  # 40,000 messages of 64 bytes at 8,000 a second
        live = subprocess.Popen([sys.executable, "-c", STREAMER, str(rd.socket), str(n),
                                 str(per), "8000"], stdout=subprocess.PIPE, text=True)
        assert line_from(live) == "started"
        assert ping(rd.socket, 5.0)  # a connection that closes
        path = entry_path(rd.root, "live", model="fp")
        wait_for(path.exists, "the live save to be written")
        assert live.wait(WAIT) == 0
        with safe_open(str(path), "np") as f:
            assert f.get_tensor("t").shape == (n * per,)
    finally:
        assert rd.stop() == 0


#: A client whose worker thread sends a save in two halves, pausing 3 s in
#: between; with "headless", its main thread ends meanwhile (pthread_exit)
#: while the process lives on.
HEADLESS = textwrap.dedent("""
    import ctypes, sys, threading, time, numpy as np, zmq
    from kvkeeper.protocol import messages as m

    def send():
        if sys.argv[2] == "on-cue":
            sys.stdin.readline()
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect("ipc://" + sys.argv[1])
        V = m.PROTOCOL_VERSION
        s.send(m.encode(m.SaveBegin(v=V, save=1, model="fp", cache_id="headless",
                                    tensors=[m.TensorSpec("t", "F32", [2048])])))
        half = np.arange(1024, dtype=np.float32)
        s.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)), half.tobytes()])
        print("half", flush=True)
        time.sleep(3.0)
        s.send_multipart([m.encode(m.SaveData(v=V, save=1, frames=1)),
                          (half + 1024).tobytes()])
        s.close(linger=-1)
        ctx.term()

    print("ready", flush=True)
    threading.Thread(target=send).start()
    time.sleep(0.2)
    if sys.argv[2] == "headless":
        ctypes.CDLL(None).pthread_exit(None)
""")


def pausing_save(sock: Path, root: Path, mode: str) -> None:
    """Run the HEADLESS client in ``mode``, with a connection of another
    closing while it pauses (or, "on-cue", just before it connects), and
    check that its save is written whole."""
    from .conftest import ping

    proc = subprocess.Popen([sys.executable, "-c", HEADLESS, str(sock), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert line_from(proc) == "ready"
        if mode == "on-cue":
            # The closed connection's descriptor is free: the client's own
            # connection is likely to get it, and must not be taken for it.
            assert ping(sock, 5.0)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert line_from(proc) == "half"
        else:
            assert line_from(proc) == "half"
            assert ping(sock, 5.0)  # a connection closes: the daemon looks for gone senders
        path = entry_path(root, "headless", model="fp")
        wait_for(path.exists, "the save to be written")
    finally:
        proc.kill()  # a process without its main thread may not exit by itself
        proc.wait(WAIT)
    with safe_open(str(path), "np") as f:
        assert np.array_equal(f.get_tensor("t"), np.arange(2048, dtype=np.float32))


@pytest.mark.parametrize("main_thread", ["headless", "running"])
def test_a_live_client_pausing_mid_save_is_not_cut_off(short_dir: Path, main_thread: str) -> None:
    """A client pauses 3 s between two halves of a save while another
    connection closes: its process lives (even if its main thread ended, which
    shows as a zombie) and its connection is open, so it is waited for."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", stall_timeout=600)
    try:
        pausing_save(rd.socket, rd.root, main_thread)
    finally:
        assert rd.stop() == 0


def test_a_client_on_a_reused_descriptor_is_not_taken_for_the_closed_one(
    short_dir: Path,
) -> None:
    """A connection closes, and the next one (a client that then pauses mid
    save) gets its descriptor number: the daemon, which records the closed
    descriptor, must see that it now carries a live client's connection.
    (A daemon process of its own, so that its descriptors are its own.)"""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        pausing_save(sock, root, "on-cue")
    finally:
        assert stop_process(proc) == 0
