"""The daemon's life: checks, single-instance lock, bind, one task group, drain.

The store is indexed after binding, beside the writer (see
``WriterActor.run``), so a long start-up scan leaves no client without a
daemon, and no save waiting for it.

Order matters: the lock is taken before binding, because a second ZeroMQ bind
on an ``ipc://`` path silently takes the socket over from the first daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import secrets
import signal
import socket
import stat
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import zmq
import zmq.asyncio

from kvkeeper import config
from kvkeeper.cpupolicy import batch_this_thread, check_cpu_policy, restore_this_thread
from kvkeeper.daemon.actor import DeleteJob, SaveJob, WriterActor
from kvkeeper.daemon.fdlimit import raise_fd_limit
from kvkeeper.daemon.server import MONITOR_EVENTS, Server
from kvkeeper.daemon.stats import Stats
from kvkeeper.daemon.store import Budget, Store, check_sessions_dir
from kvkeeper.logs import get_logger
from kvkeeper.protocol.messages import MAX_HEADER_BYTES
from kvkeeper.protocol.naming import LOCK_NAME, SESSIONS_DIR
from kvkeeper.settings import MIN_PENDING_BYTES, memory_share, usable_memory

log = get_logger("kvkeeper.daemon")

GiB = 1024**3
RCVHWM = 8
#: Replies queued per client before more are dropped (beside the 1000 the
#: client's socket takes).
REPLY_HWM = 100_000
#: The largest message a client sends (kvkeeper.client.client.CHUNK_BYTES).
CHUNK_BYTES = 8 * 1024 * 1024


@dataclass
class DaemonConfig:
    root: Path = field(default_factory=config.default_root)
    socket: Path = field(default_factory=config.default_socket)
    max_pending_bytes: int = field(default_factory=lambda: memory_share(1 * GiB))
    max_disk_bytes: int | None = 20 * GiB
    min_free_bytes: int = 5 * GiB
    drain_timeout: float = 20.0
    stall_timeout: float = 10.0
    min_write_interval: float = 0.25
    cpu_policy: str = "batch"  # see kvkeeper.cpupolicy


def config_from_settings(values: dict[str, Any]) -> DaemonConfig:
    """The daemon's configuration from resolved settings (kvkeeper.settings)."""
    return DaemonConfig(
        root=values["root"],
        socket=values["socket"],
        max_pending_bytes=values["max_pending_bytes"],
        max_disk_bytes=values["max_disk_bytes"] or None,
        min_free_bytes=values["min_free_bytes"],
        drain_timeout=values["drain_timeout"],
        min_write_interval=values["min_write_interval"],
        stall_timeout=values["stall_timeout"],
        cpu_policy=values["cpu_policy"],
    )


class AlreadyRunning(config.ConfigError):
    """Another daemon holds the lock of this root or socket; ``holder`` is
    what its lock file says of it (see lock_holder)."""

    def __init__(self, message: str, holder: str = "unknown") -> None:
        super().__init__(message)
        self.holder = holder


def held_by(holder: str, path: Path) -> AlreadyRunning:
    """The error for the lock file at ``path``, which ``holder`` holds: a
    daemon ("pid N, root R, socket S") or a command ("kvkeeper verify
    --repair, pid N"; it was called a daemon)."""
    command, _, pid = holder.partition(", ")
    running = (f"{command} is running ({pid})" if command.startswith("kvkeeper ")
               else f"another kvkeeper daemon is running ({holder})")
    return AlreadyRunning(f"{running}; lock file {path}", holder)


class SocketPathTaken(config.ConfigError):
    """Something other than a socket is where the daemon's socket goes."""


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket a dead daemon left at ``path``; refuse anything else.

    Called with the locks held, so no daemon that still has its lock file
    owns a socket there; one whose lock file went (a /tmp cleaner) still
    answers a connection, and is refused (its socket was taken from it,
    its clients sent to another root). A file, directory or symlink there
    is someone's data or a wrong --socket: never delete it."""
    if _check_socket_place(path):
        _refuse_a_live_socket(path)
        path.unlink()


def _refuse_a_live_socket(path: Path) -> None:
    """Raise AlreadyRunning if a process accepts connections on the socket
    at ``path`` (see ``_clear_stale_socket``)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return  # nobody listens: a dead daemon's socket
    except OSError as exc:
        # A listener whose backlog is full (a stopped daemon) says EAGAIN, or
        # keeps the connect waiting: taken for dead, its socket was unlinked.
        raise AlreadyRunning(f"cannot tell whether a process listens on socket {path} "
                             f"({exc.strerror or exc}): stop it first, or remove the "
                             f"socket if none does") from None
    finally:
        probe.close()
    raise AlreadyRunning(f"a process is listening on socket {path} (a kvkeeper daemon "
                         f"whose lock file was removed?): stop it first")


def _check_socket_place(path: Path) -> bool:
    """Whether a socket is at ``path`` (False: nothing is); raises
    SocketPathTaken for anything else there."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISSOCK(mode):
        return True
    kind = ("a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode)
            else "a regular file" if stat.S_ISREG(mode) else "another kind of file")
    raise SocketPathTaken(f"socket path {str(path)!r} is {kind}, not a socket; "
                          f"move it away or choose another --socket")


def check_places(cfg: DaemonConfig) -> None:
    """Refuse what ``Daemon.run`` would refuse about the root and the socket,
    making, locking and removing nothing: ``install-service`` must not
    write a service that fails at every start. Raises ConfigError."""
    sock = Path(os.path.abspath(cfg.socket))
    config.check_socket_path(sock)
    # Both looked at before either is made: refused for one, the daemon
    # leaves no new directory behind for the other.
    config.check_private_dir(cfg.root, "root directory")
    config.check_private_dir(cfg.socket.parent, "socket directory")
    if _check_socket_place(sock) and not _lock_held(lock_paths(cfg)[0]):
        # A daemon whose lock file went (a /tmp cleaner) still answers: serve
        # refuses to take its socket, so --print-config and install-service
        # must too. (One that holds its lock is check_not_held's to name.)
        _refuse_a_live_socket(sock)
    sessions = Path(os.path.abspath(cfg.root)) / SESSIONS_DIR
    check_sessions_dir(sessions)
    if os.path.isdir(sessions):
        config.check_writable(sessions, "store directory")
    for lock in lock_paths(cfg):
        if os.path.lexists(lock) and not os.access(lock, os.R_OK | os.W_OK):
            raise _unusable_lock(lock, PermissionError(errno.EACCES, "Permission denied"))
    # The file system the store is (or will be made) on: sessions/'s, the root's.
    where = sessions
    while not where.exists():
        where = where.parent
    fs = os.statvfs(where)
    # A disk of no size (ramfs: 0 blocks) is never short: the store keeps
    # nothing free there, so the default must not be refused.
    if fs.f_blocks and cfg.min_free_bytes > fs.f_blocks * fs.f_frsize:
        # Evicting could never get there: every entry would go at start.
        raise config.ConfigError(
            f"min_free_bytes ({cfg.min_free_bytes}) is more than the whole file system "
            f"of {where} ({fs.f_blocks * fs.f_frsize} bytes): lower it (0 for none)")


class _SignalInbox:
    """The drain signals, delivered to the event loop (``received``) by
    handlers of the daemon's own, and ignored from its close on. anyio's
    receiver, on asyncio's loop.add_signal_handler, closed by putting back
    SIG_DFL and Python's default SIGINT handler, and only then could they be
    ignored: a signal between the two (one every 5 ms after the drain, as a
    test sends them) killed the daemon, or ended it as interrupted, exit 130
    (a CI run). Here each handler turns into SIG_IGN in one step. A signal
    taken by another thread wakes the loop through the wakeup descriptor,
    as asyncio's own handling does."""

    def __init__(self, wanted: list[signal.Signals], loop: asyncio.AbstractEventLoop) -> None:
        self._wanted, self._loop = wanted, loop
        self._send, self.received = anyio.create_memory_object_stream[int](64)
        self._over = False
        self._old_wakeup = -1

    def __enter__(self) -> _SignalInbox:
        # Made here, not in __init__, and undone step by step when a step
        # fails: a with-statement whose __enter__ raises never calls __exit__.
        with contextlib.ExitStack() as undo:
            self._wake_r, self._wake_w = socket.socketpair()
            undo.callback(self._wake_w.close)
            undo.callback(self._wake_r.close)
            for s in (self._wake_r, self._wake_w):
                s.setblocking(False)
            self._old_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(),
                                                    warn_on_full_buffer=False)
            undo.callback(signal.set_wakeup_fd, self._old_wakeup)
            self._loop.add_reader(self._wake_r.fileno(), self._woken)
            undo.callback(self._loop.remove_reader, self._wake_r.fileno())
            for signum in self._wanted:
                # None: a handler set outside Python, which cannot be put back.
                old = signal.signal(signum, self._handler)
                undo.callback(signal.signal, signum, signal.SIG_DFL if old is None else old)
            undo.pop_all()
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        if not self._over:
            self._loop.call_soon_threadsafe(self._deliver, signum)

    def _deliver(self, signum: int) -> None:
        with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError,
                                 anyio.BrokenResourceError):
            self._send.send_nowait(signum)

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass

    def __exit__(self, *exc: object) -> None:
        self._over = True
        for signum in self._wanted:
            signal.signal(signum, signal.SIG_IGN)
        self._loop.remove_reader(self._wake_r.fileno())
        signal.set_wakeup_fd(self._old_wakeup)
        self._wake_r.close()
        self._wake_w.close()
        self._send.close()
        self.received.close()


def _drain_signals() -> list[signal.Signals]:
    """The signals that make the daemon drain: SIGTERM, and SIGINT and SIGHUP
    unless they were ignored when the daemon started: `nohup kvkeeper serve`
    asks to outlive the terminal, and a shell script's `kvkeeper serve &`
    runs with SIGINT ignored (Ctrl-C on the script is not for it); a
    handler would undo that."""
    return [signal.SIGTERM, *(s for s in (signal.SIGINT, signal.SIGHUP)
                              if signal.getsignal(s) is not signal.SIG_IGN)]


#: How often the daemon checks that its root and socket are still in place.
WATCH_INTERVAL = 2.0
#: How often the socket, its lock file and their directory get their times
#: set to now: temp-directory cleaners delete what has not been used for
#: days (macOS's for the default socket's directory, /var/folders/.../T,
#: after 3; systemd-tmpfiles' for /tmp after 10), and a socket removed so
#: made the daemon exit and every client drop its saves until a new one ran.
REFRESH_INTERVAL = 3600.0


class LockUnusable(config.ConfigError):
    """A lock file that cannot be opened for writing, or made."""


def _unusable_lock(path: Path, exc: OSError) -> LockUnusable:
    why = exc.strerror or str(exc)
    if not os.path.lexists(path):
        return LockUnusable(f"cannot create lock file {str(path)!r}: {why} (its directory "
                            f"must be writable)")
    hint = (" (no daemon can hold a lock file it cannot write: remove it, or chmod 600 it)"
            if exc.errno in (errno.EACCES, errno.EPERM) else "")
    return LockUnusable(f"cannot open lock file {str(path)!r} to write it: {why}{hint}")


class _Lock:
    """An flock on a file that also names its holder, for the error message."""

    def __init__(self, path: Path, holder: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _unusable_lock(path, exc) from None
        try:
            # A few tries over 50 ms: install-service's look at the lock holds
            # it for microseconds; a daemon that runs holds it for good.
            for wait in (0.01, 0.04, 0.0):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if not wait or exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    time.sleep(wait)
        except OSError as exc:
            other = os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise held_by(other, path) from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.write(fd, holder.encode())
        except OSError as exc:  # a full disk (ENOSPC): a line, not a traceback
            os.close(fd)
            raise LockUnusable(f"cannot write lock file {str(path)!r}: "
                               f"{exc.strerror or exc}") from None
        self.fd = fd

    def release(self) -> None:
        os.close(self.fd)  # closing drops the flock; a stale file is harmless

    def still_in_place(self) -> bool:
        """Whether the lock file is still at its path (not removed with its
        directory, nor replaced): else another daemon could lock the path.
        Raises OSError when it cannot tell."""
        return _is_at(self.path, os.fstat(self.fd))


def lock_paths(cfg: DaemonConfig) -> list[Path]:
    """The lock files a daemon with ``cfg`` takes: its socket's, then its root's."""
    sock = Path(os.path.abspath(cfg.socket))
    return [sock.parent / f"{sock.name}.lock", Path(os.path.abspath(cfg.root)) / LOCK_NAME]


def lock_holder(path: Path) -> str | None:
    """What the lock file at ``path`` says of the process that holds it (a
    daemon's "pid N, root R, socket S", "kvkeeper verify --repair, pid N";
    "unknown" when it says nothing), or None when no process holds it.
    Creates nothing: a lock that is free is taken, shared, for an instant
    (a daemon starting then tries again, see _Lock). Raises OSError when the
    file is there but cannot be opened (the daemon could not either)."""
    try:
        # (Non-blocking: a FIFO there blocked the open for ever.)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None  # no daemon ever took it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return os.read(fd, 4096).decode(errors="replace").strip() or "unknown"
            raise
        return None
    finally:
        os.close(fd)  # and with it the shared lock


def check_not_held(cfg: DaemonConfig) -> None:
    """Raise AlreadyRunning when a process holds the socket's or the root's
    lock (what ``Daemon.run`` would then refuse), creating nothing."""
    for path in lock_paths(cfg):
        try:
            holder = lock_holder(path)
        except OSError as exc:
            raise _unusable_lock(path, exc) from None
        if holder is not None:
            raise held_by(holder, path)


def _lock_held(path: Path) -> bool:
    """Whether a process holds the lock at ``path``; True when that cannot
    be told (what then holds it is for `check_not_held` to say)."""
    try:
        return lock_holder(path) is not None
    except OSError:
        return True


def holder_pid(holder: str) -> int | None:
    """The pid a lock holder's text (`lock_holder`) names, if any."""
    found = re.search(r"\bpid ([0-9]+)\b", holder)
    return int(found.group(1)) if found else None


def holder_socket(holder: str) -> str | None:
    """The socket a daemon's lock holder text names (its last field), if a
    socket is there: its root may hold ", socket " too, and the text is
    read up to 4 KiB."""
    _, said, path = holder.rpartition(", socket ")
    try:
        return path if said and stat.S_ISSOCK(os.stat(path).st_mode) else None
    except (OSError, ValueError):  # (ValueError: a NUL in it)
        return None


def _refresh_times(paths: list[Path]) -> None:
    """Set the access and modification times of ``paths`` to now (symlinks
    not followed); a path that is gone or refuses is left to the watch."""
    for path in paths:
        try:
            os.utime(path, follow_symlinks=False)
        except (OSError, NotImplementedError):
            pass


def _is_at(path: Path, held: os.stat_result) -> bool:
    """Whether ``held`` (device, inode) is the file at ``path``; raises
    OSError when that cannot be told (a network file system's error)."""
    try:
        at_path = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)


class Daemon:
    """One daemon. ``run()`` blocks until stopped (SIGTERM/SIGINT/SIGHUP or ``stop()``)
    and returns the process exit code: 0 once every received save is settled
    (written, or failed and reported to its client as for any failure), 1
    when the drain timeout left some unwritten (each is logged by key), or
    when the daemon stopped itself because its root or socket was removed."""

    def __init__(self, cfg: DaemonConfig) -> None:
        check_cpu_policy(cfg.cpu_policy)
        if cfg.max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be more than 0, not {cfg.max_pending_bytes!r}")
        if cfg.max_pending_bytes < MIN_PENDING_BYTES:
            raise ValueError(f"max_pending_bytes must be at least {MIN_PENDING_BYTES}, not "
                             f"{cfg.max_pending_bytes!r}")
        if not 0 < cfg.stall_timeout < float("inf"):
            raise ValueError(f"stall_timeout must be a finite number of seconds > 0, "
                             f"not {cfg.stall_timeout!r}")
        self.cfg = cfg
        self.ready = threading.Event()
        self.stats = Stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: anyio.Event | None = None
        self._stop_requested = False
        self._gone: str | None = None  # why the daemon stopped itself: its root or socket went
        self.server: Server | None = None

    def stop(self) -> None:
        """Ask the daemon to drain and exit; safe from any thread."""
        self._stop_requested = True
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def run(self, *, handle_signals: bool = True, exiting: bool = False) -> int:
        cfg = self.cfg
        old_umask = os.umask(0o077)
        locks: list[_Lock] = []
        # Before any thread starts: the daemon's threads all inherit it.
        policy = batch_this_thread() if cfg.cpu_policy == "batch" else None
        # _main ignores the drain signals from its cleanup on. A process that
        # goes on after run() gets its own handlers back; one that exits
        # (``exiting``: the kvkeeper command) keeps them ignored to the end,
        # or a signal in its last milliseconds (an impatient user, a
        # supervisor repeating itself) killed it.
        wanted = _drain_signals() if handle_signals else []
        handlers = {} if exiting else {s: signal.getsignal(s) for s in wanted}
        try:
            check_places(cfg)
            # Nothing made for a root or socket another daemon holds (a new
            # socket directory was left behind); the locks below still decide.
            check_not_held(cfg)
            # The socket's lock first: a daemon already serving this socket
            # is refused before a new root is made for nothing.
            sock_dir = config.private_dir(cfg.socket.parent, "socket directory")
            sock_path = sock_dir / cfg.socket.name
            root = Path(os.path.abspath(cfg.root))
            # install-service reads the pid back (holder_pid).
            holder = f"pid {os.getpid()}, root {root}, socket {sock_path}"
            sock_lock_path, root_lock_path = lock_paths(cfg)
            locks.append(_Lock(sock_lock_path, holder))
            if _check_socket_place(sock_path):
                _refuse_a_live_socket(sock_path)  # before a new root is made for nothing
            root = config.private_dir(cfg.root, "root directory")
            root_lock = _Lock(root_lock_path, holder)
            locks.append(root_lock)
            _clear_stale_socket(sock_path)
            store = Store(root, Budget(cfg.max_disk_bytes, cfg.min_free_bytes),
                          own_files=(sock_lock_path,))
            store.open()  # its files are indexed once the socket is bound (WriterActor.run)
            return anyio.run(self._main, store, sock_path, wanted, root_lock,
                             backend="asyncio")
        finally:
            for lock in reversed(locks):
                lock.release()
            os.umask(old_umask)
            restore_this_thread(policy)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    async def _main(self, store: Store, sock_path: Path, wanted: list[signal.Signals],
                    root_lock: _Lock) -> int:
        cfg = self.cfg
        self._loop = asyncio.get_running_loop()
        self._stop = anyio.Event()
        if self._stop_requested:
            self._stop.set()
        # --max-pending-bytes bounds every save byte the daemon holds: what
        # ZeroMQ may queue before the server reads it, and what the writer has
        # accepted but not yet written. The writer gets the rest.
        zmq_share = min(RCVHWM * CHUNK_BYTES, cfg.max_pending_bytes // 4)
        self.stats.gauges["max_pending_bytes"] = float(cfg.max_pending_bytes)  # as configured
        memory = usable_memory()
        # (Past the default too: the default's floor, 1 GiB, is more than a
        # small container has, and was not given.)
        if memory is not None and cfg.max_pending_bytes > max(memory, memory_share(GiB)):
            # Allowed (swap, a machine it moves to), but a typo (100000T for
            # 100000M) must not pass unseen: the bound is gone in effect.
            log.warning("event=pending_over_memory max_pending_bytes=%d memory_bytes=%d: more "
                        "than this machine (or container) has: saves in flight are bounded "
                        "by the memory alone", cfg.max_pending_bytes, memory)
        # Tells this run from a restart with the same pid (a container's pid 1,
        # a daemon run twice in one process): a client's flush must not vouch
        # for saves the previous run never wrote. 52 bits: exact as a float.
        self.stats.gauges["boot_id"] = float(secrets.randbits(52) | 1)
        actor = WriterActor(store, self.stats,
                            max_pending_bytes=cfg.max_pending_bytes - zmq_share,
                            stall_timeout=cfg.stall_timeout,
                            min_write_interval=cfg.min_write_interval)
        # Before ZeroMQ starts: past the limit it aborts the process (fdlimit).
        fd_limit = raise_fd_limit()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A client that reconnects keeps its identity; its new pipe takes over.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A few messages of up to 8 MiB (their share of the budget is above):
        # enough for the receive loop to keep libzmq reading the socket.
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        # Replies past it are dropped (a ROUTER cannot wait): a client whose
        # I/O thread reads late (GIL-starved by request threads saving in a
        # loop) lost refusals, its counts fell short. A client may have as
        # many messages on the way here (its SNDHWM); replies are small.
        sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, max(cfg.max_pending_bytes, MAX_HEADER_BYTES))
        monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        if hasattr(zmq, "IPC_FILTER_UID"):
            try:
                sock.setsockopt(zmq.IPC_FILTER_UID, os.getuid())
            except zmq.ZMQError:
                pass  # libzmq built without it; the 0700 directory still guards
        bound: os.stat_result | None = None
        # Open until the sockets are closed and the socket file removed: a
        # second signal after the drain (while the last replies go out) found
        # the default handlers back, and killed the daemon by that signal.
        signals = contextlib.ExitStack()
        receiver = signals.enter_context(_SignalInbox(wanted, self._loop)).received \
            if wanted else None
        try:
            sock.bind(config.endpoint(sock_path))
            os.chmod(sock_path, 0o600)
            bound = os.lstat(sock_path)
            log.info("event=listening socket=%s root=%s pid=%d max_pending_bytes=%d "
                     "fd_limit=%s", sock_path, store.root, os.getpid(), cfg.max_pending_bytes,
                     fd_limit if fd_limit is not None else "none")
            async with anyio.create_task_group() as tg:
                self.server = Server(sock, actor, store, self.stats, tg, monitor)
                tg.start_soon(actor.run)
                tg.start_soon(self.server.run)
                tg.start_soon(self.server.watch_connections)
                if receiver is not None:
                    tg.start_soon(self._signals, receiver)
                assert bound is not None
                tg.start_soon(self._watch_places, root_lock, sock_path, bound)
                self.ready.set()
                await self._stop.wait()
                drained = await self._drain(actor)
                await self.server.let_replies_out(settled=drained)
                tg.cancel_scope.cancel()
        finally:
            try:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
                ctx.term()
                try:
                    # Only our own: a socket put in its place is another daemon's.
                    if bound is None or _is_at(sock_path, bound):
                        sock_path.unlink()
                except OSError:
                    pass  # gone, or not ours to tell: left as it is
            finally:
                # Done: the signals are ignored until run() ends, which gives
                # back the handlers it found (unless the process exits); in a
                # finally of its own, or a failure above left the inbox's
                # handlers calling into a closed loop.
                signals.close()
        return 0 if drained and self._gone is None else 1

    async def _watch_places(self, root_lock: _Lock, sock_path: Path,
                            bound: os.stat_result) -> None:
        """Stop (exit 1, for the supervisor to start a new daemon) when the
        root's lock file or the socket is no longer where it was. A root
        removed (to clear the store) failed every save from then on, and its
        lock went with it, so a second daemon could take the same root; a
        socket removed (a /tmp cleaner) left a daemon no client could reach,
        holding the root, and every save dropped."""
        assert self._stop is not None
        warned = False
        # The wall clock: macOS's monotonic one stands still while the Mac
        # sleeps, and a cleaner run missed meanwhile comes at the wake-up.
        refreshed = time.time()
        while not self._stop.is_set():
            await anyio.sleep(min(WATCH_INTERVAL, REFRESH_INTERVAL))
            if not 0 <= time.time() - refreshed < REFRESH_INTERVAL:
                refreshed = time.time()
                _refresh_times([sock_path, lock_paths(self.cfg)[0], sock_path.parent])
            gone = None
            try:
                if not root_lock.still_in_place():
                    gone = (f"the root's lock file {root_lock.path} was removed or replaced "
                            f"(the root removed?): another daemon could take the root")
                elif not _is_at(sock_path, bound):
                    gone = f"the socket {sock_path} was removed or replaced: no client can reach us"
            except OSError as exc:  # cannot tell (EIO, ESTALE): not a reason to stop
                if not warned:
                    log.warning("event=place_check_failed error=%s: logged once", exc)
                    warned = True
            if gone is not None:
                log.error("event=place_gone reason=%s: draining and exiting 1 (a supervisor "
                          "starts a new daemon)", gone)
                self._gone = gone
                self._stop.set()

    async def _signals(self, signals: AsyncIterator[int]) -> None:
        assert self._stop is not None
        # Listening goes on through the drain: a second Ctrl-C or SIGTERM (an
        # impatient user, a supervisor repeating itself) must not cut short
        # the writes the first one promised. --drain-timeout bounds the wait;
        # SIGKILL remains the way to give up on them. SIGHUP (the terminal of a
        # daemon run from a shell closing) drains too: by default it killed
        # the daemon at once, losing every save received and not yet written.
        # (See _drain_signals for SIGHUP under nohup.)
        async for signum in signals:
            name = signal.Signals(signum).name
            if self._stop.is_set():
                log.warning("event=signal_ignored signal=%s reason=draining "
                            "drain_timeout=%.1f: SIGKILL stops at once, losing what is "
                            "not written yet", name, self.cfg.drain_timeout)
                continue
            log.info("event=signal signal=%s", name)
            self._stop.set()

    async def _drain(self, actor: WriterActor) -> bool:
        """Tell the clients, take the saves they sent before they knew
        (within LATE_SAVES_WINDOW), then refuse new saves and let the writer
        finish every save taken. Returns False when the drain timeout cut it
        short."""
        assert self.server is not None
        actor.begin_drain()
        self.server.announce_drain(self.stats.gauges["boot_id"])
        log.info("event=draining pending_bytes=%d", actor.pending_bytes)
        with anyio.move_on_after(self.cfg.drain_timeout):
            # Saves a client sent before it read the notice are still on their
            # way: refused, they were lost (the client no longer holds them).
            # Each client's answer comes behind them; a window bounds the wait.
            reason = await self.server.late_saves()
            actor.stop_accepting()
            log.info("event=drain_saves_closed reason=%s", reason)
            await actor.finished.wait()
        if actor.accepting:
            # The drain timeout came first, while a client had not answered.
            actor.stop_accepting()
            log.info("event=drain_saves_closed reason=drain_timeout")
            if not actor.unfinished():
                # Every save taken is written: the writer ends in a few turns,
                # and the drain did all it had to (not a timeout, exit 1).
                with anyio.move_on_after(1.0):
                    await actor.finished.wait()
        if actor.finished.is_set():
            log.info("event=drained")
            return True
        await actor.stop_writing()
        if not actor.unfinished():
            # The timeout came while the last write was under way, which
            # stop_writing lets finish: every save taken is written, and the
            # drain did all it had to (it exited 1, logging drain_timeout
            # and no key, on a slow disk with a single SIGTERM).
            log.info("event=drained")
            return True
        for job in actor.unfinished():
            # A delete or a move aside can be the newest job of a key, having
            # replaced its save: the log must not call it a save.
            model, cache_id = job.key
            if isinstance(job, SaveJob):
                log.error("event=not_saved_at_exit model=%s id=%s", model, cache_id)
            elif isinstance(job, DeleteJob) and job.reason is None:
                log.error("event=not_deleted_at_exit model=%s id=%s", model, cache_id)
            else:
                log.error("event=not_moved_aside_at_exit model=%s id=%s", model, cache_id)
        log.error("event=drain_timeout seconds=%.1f pending_bytes=%d",
                  self.cfg.drain_timeout, actor.pending_bytes)
        return False
