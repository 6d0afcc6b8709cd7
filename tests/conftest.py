"""Fixtures: a real daemon on a real ipc:// socket in a short /tmp directory.

macOS caps a unix socket path at 104 bytes, so sockets live under /tmp, not
under pytest's long tmp_path.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvkeeper.client.client import Client
from kvkeeper.daemon.app import Daemon, DaemonConfig

WAIT = 30.0  # cap on every wait in the tests


def wait_for(cond: Callable[[], bool], what: str | Callable[[], str], *,
             every: float = 0.02) -> None:
    """Poll ``cond`` every ``every`` seconds until it holds; fail after WAIT
    seconds, naming ``what`` (a callable: said as it is at that time)."""
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, \
            f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(every)


def line_from(proc: subprocess.Popen[str]) -> str:
    """The next line a child process prints, stripped; fails after WAIT
    seconds (a child stuck before it must fail the test, not hang it)."""
    stdout = proc.stdout
    assert stdout is not None
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(WAIT)  # (a reader still waiting ends when the child is killed)
    assert got, f"no line from the child in {WAIT:.0f} s"
    return got[0].strip()


def drain_past_the_notice(kv: Client, proc: subprocess.Popen[bytes], *,
                          received: int) -> None:
    """SIGTERM the daemon once it has received ``received`` saves, and return
    once the client has read the daemon's notice that it drains."""
    wait_for(lambda: kv.stats()["saves_received"] == received, "the daemon to take them")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: kv.client_stats()["client_drain_notices"] == 1, "the drain notice")


def dealer(ctx: Any, socket: Path, timeout: float = WAIT) -> Any:
    """A raw ZeroMQ DEALER socket of ``ctx`` connected to the daemon at
    ``socket`` (a ``recv`` waits at most ``timeout`` seconds)."""
    import zmq

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    s.connect(f"ipc://{socket}")
    return s


@contextmanager
def dealers(socket: Path, n: int, timeout: float = WAIT) -> Iterator[list[Any]]:
    """``n`` raw ZeroMQ DEALER sockets connected to the daemon at ``socket``
    (a ``recv`` waits at most ``timeout`` seconds), closed at the end."""
    import zmq

    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(n):
            socks.append(dealer(ctx, socket, timeout))
        yield socks
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvk-", dir="/tmp"))
    os.chmod(d, 0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class RunningDaemon:
    daemon: Daemon
    thread: threading.Thread
    root: Path
    socket: Path
    exit_code: list[int]

    def stop(self) -> int:
        self.daemon.stop()
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "daemon did not stop"
        return self.exit_code[0]


def start_daemon(root: Path, socket: Path, *, indexed: bool = True,
                 **kw: object) -> RunningDaemon:
    """An in-process daemon on a thread (signals stay with pytest's main thread).
    Returns once it has indexed the store (``indexed``), or as soon as it
    answers.

    The disk budget is off unless a test sets it: how full this machine's disk
    is must not decide what the other tests see."""
    kw.setdefault("max_disk_bytes", None)
    kw.setdefault("min_free_bytes", 0)
    d = Daemon(DaemonConfig(root=root, socket=socket, **kw))  # type: ignore[arg-type]
    code: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            code.append(d.run(handle_signals=False))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
            d.ready.set()

    t = threading.Thread(target=run, name="kvkeeper-test-daemon", daemon=True)
    t.start()
    assert d.ready.wait(WAIT), "daemon did not start"
    if errors:
        raise errors[0]
    if indexed:
        wait_for(lambda: scan_done(socket) or not t.is_alive(), "the start-up scan")
    return RunningDaemon(d, t, root, socket, code)


@pytest.fixture
def daemon(short_dir: Path) -> Iterator[RunningDaemon]:
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        yield rd
    finally:
        if rd.thread.is_alive():
            rd.stop()


@pytest.fixture
def client(daemon: RunningDaemon) -> Iterator[Client]:
    kv = Client(daemon.socket, timeout=WAIT)
    assert kv.connected
    try:
        yield kv
    finally:
        kv.close()


def _ask(socket: Path, request: Any, timeout: float) -> Any:
    """One request to the daemon on ``socket``: its reply, or None when none
    comes within ``timeout`` seconds."""
    import zmq

    from kvkeeper.protocol import messages as m

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{socket}")
        s.send(m.encode(request))
        if not s.poll(int(timeout * 1000)):
            return None
        return m.decode_reply(s.recv())
    finally:
        s.close(linger=0)
        ctx.term()


def ping(socket: Path, timeout: float = 1.0) -> bool:
    """Whether a daemon answers on ``socket`` within ``timeout`` seconds."""
    from kvkeeper.protocol import messages as m

    return isinstance(_ask(socket, m.Ping(v=m.PROTOCOL_VERSION, req=1), timeout), m.Pong)


def scan_done(socket: Path, timeout: float = 1.0) -> bool:
    """Whether the daemon on ``socket`` has indexed its store: its stats say
    ``store_indexing`` 0, or do not have it (a daemon without that gauge
    indexed the store before it bound its socket)."""
    from kvkeeper.protocol import messages as m

    reply = _ask(socket, m.GetStats(v=m.PROTOCOL_VERSION, req=1), timeout)
    return isinstance(reply, m.Stats) and reply.counters.get("store_indexing", 0) == 0


def serve_process(
    root: Path,
    socket: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
    preexec_fn: object = None,
    indexed: bool = True,
    answering: bool = True,
) -> subprocess.Popen[bytes]:
    """``kvkeeper serve`` as a real subprocess; returns once it has indexed
    the store (``indexed``), or as soon as it answers a ping, or at once
    (not ``answering``).

    Its log goes to ``<socket dir>/../serve-<n>.log`` (``proc.log_path``), never
    to a pipe nobody reads."""
    log_path = socket.parent.parent / f"serve-{time.monotonic_ns()}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "kvkeeper.cli", "serve", "--root", str(root),
         "--socket", str(socket), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        preexec_fn=preexec_fn,  # type: ignore[arg-type]
    )
    log.close()
    proc.log_path = log_path  # type: ignore[attr-defined]
    deadline = time.monotonic() + WAIT
    while answering and not (socket.exists() and (scan_done(socket, 0.5) if indexed else ping(socket, 0.5))):
        if proc.poll() is not None:
            raise AssertionError(f"kvkeeper serve exited {proc.returncode}: "
                                 f"{log_path.read_text(errors='replace')}")
        assert time.monotonic() < deadline, "kvkeeper serve did not answer"
        time.sleep(0.05)
    return proc


def daemon_log(proc: subprocess.Popen[bytes]) -> str:
    """What a daemon started by :func:`serve_process` has logged so far."""
    log_path: Path = proc.log_path  # type: ignore[attr-defined]  # set by serve_process
    return log_path.read_text(errors="replace")


def wait_for_log(proc: subprocess.Popen[bytes], text: str, what: str, *, count: int = 1) -> None:
    """Wait until the daemon's log holds ``text`` ``count`` times (a step
    begun, a fault's hold reached); fails after WAIT seconds, naming ``what``
    and showing the log's end."""
    wait_for(lambda: daemon_log(proc).count(text) >= count,
             lambda: f"{what}; exit status {proc.poll()}; the log ends:\n{daemon_log(proc)[-1500:]}")


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(WAIT)
