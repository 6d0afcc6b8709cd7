"""The client's socket, owned by one I/O thread.

ZeroMQ sockets are not thread-safe, and the generation loop must never wait on
the daemon, so a single background thread owns the DEALER socket: callers hand
it work through a queue and a wake-up pipe. Saves and requests share the one
socket. A request that must see a save made before it (a load or delete of
its key, a flush: every save) reaches the daemon after it; other requests may
pass saves still waiting (see below).

What the client holds in flight is bounded in bytes, not in messages: a save
is taken whole or not at all, and its bytes stay reserved until ZeroMQ has
handed the last of them to the kernel (the frames are sent without copying, so
until then they still point into the cache's arrays).

Only about ``PIPE_BYTES`` of save data are handed to ZeroMQ at a time (one
save at a time, message by message): what ZeroMQ holds cannot be passed, so a
request queued behind a full budget waited for all of it (a ping behind 512 MiB
of saves: 1.6 s median). The rest waits in the I/O thread's backlog, which a
request passes unless it must see a save there: a load or delete of a key goes
just after that key's last save, a flush after everything. A newer save of a
key takes the place of one not yet started in the backlog, whatever its size,
unless a request made since must see that one (a save made after a delete is
not deleted).

A save of a cache sent less than ``min_send_interval`` ago waits in the I/O
thread until that interval is over (a small one as a copy of its bytes, see
``DETACH_MAX_BYTES``), and a newer save of the cache replaces it: a loop
saving every few tokens then sends (and the daemon receives) one save per
interval, not one per call. A request that must see
the cache's saves (flush, a load or delete of it) and closing send the waiting
save first, so nothing that asks for a save waits for the interval.

When the connection ends, the save ZeroMQ was sending part of is lost (the
rest would reach a daemon that never saw it begin), and so is what ZeroMQ
had taken whole that the daemon had not read (counted sent: a flush says
so); requests waiting for a reply fail at once, and the saves not begun,
waiting or held, stay for the next connection: a daemon restarted by its
service manager writes them. So do the saves made once a daemon told to
stop said it drains, or refused one (it refuses every save that comes while
it drains); told so, the client asks it for a flush, whose answer vouches
for the saves it drained (``ConnectionEnd``). With no connection, a save is
dropped by the client unless a daemon is coming back (``daemon_returning``):
a socket made less than a second ago at its path, which ZeroMQ connects to
within 0.2 s.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import itertools
import os
import socket
import stat
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq
import zmq.utils.garbage  # noqa: F401 - registers pyzmq's atexit handler before ours
from zmq.utils.monitor import parse_monitor_message

from kvkeeper.config import socket_path
from kvkeeper.cpupolicy import batch_this_thread, check_cpu_policy
from kvkeeper.logs import get_logger
from kvkeeper.protocol import messages as m
from kvkeeper.protocol.pacing import CAPTURE_COPY_MAX_BYTES, HOLD_MAX_BYTES, Pacer

log = get_logger("kvkeeper.client")

Key = tuple[str, str]  # (model, cache id)
#: A request's ``release`` that sends every save waiting out the interval.
ALL_KEYS: Key = ("", "")  # no real key is empty (naming.check_key)
#: ZeroMQ's send queue counts messages; keep well under its high-water mark so
#: that a save, once started, never meets a full queue half way (many tiny
#: saves could otherwise fit the byte budget but not the queue).
_SNDHWM = 100_000
_MAX_INFLIGHT_MESSAGES = _SNDHWM // 2
#: Save bytes handed to ZeroMQ and not yet sent on, at most (a message more
#: when it is under). A request sent now waits behind these alone: 32 MiB at
#: the 0.3 GiB/s this disk took them is about 0.1 s.
PIPE_BYTES = 32 * 1024 * 1024
#: How long after it was made a socket at the daemon's path (a daemon
#: restarted since the connection ended) is taken for a daemon about to be
#: connected to. ZeroMQ tries the path again every 0.2 s at most
#: (RECONNECT_IVL_MAX), and until it does, saves were dropped and requests
#: failed with the daemon up: a final save of a turn made just after a
#: restart was lost. An older socket nobody answered on is a dead daemon's.
RETURN_GRACE = 1.0


def _socket_at(path: str) -> tuple[int, int, int] | None:
    """Which socket file is at ``path`` (device, inode, change time in ns: a
    daemon that binds makes a new one, and a freed inode may be handed out
    again), or None when none is."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _listened_on(path: str) -> bool:
    """Whether something listens at the socket file ``path``: a connection to
    it is taken, or waits for room (a dead daemon's file refuses it). One
    socket() and connect(), closed at once (the daemon's ZeroMQ drops a
    connection that never says hello)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        probe.connect(path)
    except BlockingIOError:  # a full backlog (Linux): a listener all the same
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _libc_write() -> Callable[[int, bytes, int], int] | None:
    """write(2) called without releasing the GIL (ctypes.PyDLL), or None."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write


_write_holding_gil = _libc_write()


#: Channels not closed yet (each one's I/O thread keeps it alive): at a normal
#: interpreter exit, saves waiting out the send interval or on their way still
#: go to the daemon, as close() sends them.
_open_channels: weakref.WeakSet[Channel] = weakref.WeakSet()


def _close_open_channels() -> None:
    # At once, not one after another: each may wait its timeout for a
    # daemon that does not answer.
    started = []
    for channel in list(_open_channels):
        t = threading.Thread(target=_close_at_exit, args=(channel,), daemon=True)
        try:
            t.start()
        except RuntimeError:  # Python 3.12+ starts no thread from an exit hook
            _close_at_exit(channel)
        else:
            started.append(t)
    for t in started:
        t.join(30.0)  # a close takes at most its 5 s and the I/O thread's 5 s


#: The process whose multiprocessing finalizers hold _close_at_worker_end.
_finalizer_pid = 0


def _close_at_multiprocessing_exit() -> None:
    """Have a multiprocessing worker started with the fork or forkserver
    method close its open channels as it ends: it ends through os._exit(),
    and the atexit hook never ran (every save a worker's client still held
    was lost, each save() having returned True). Added once in each worker
    (it empties the finalizers it inherits as it starts); not in the main
    process, whose atexit hook runs after the program's own exit handlers
    (a finalizer there closed the clients before them)."""
    global _finalizer_pid, _after_fork_pid
    process = sys.modules.get("multiprocessing.process")
    util = sys.modules.get("multiprocessing.util")
    if process is None or util is None or _finalizer_pid == os.getpid():
        return
    if process.parent_process() is None:
        if getattr(process.current_process(), "_inheriting", False) \
                and _after_fork_pid != os.getpid():
            # Made as a worker starts, before it is one (a module imported
            # as the worker's function is unpickled): the finalizers are
            # emptied after that, the functions registered here then run.
            util.register_after_fork(_AFTER_FORK, _added_after_fork)
            _after_fork_pid = os.getpid()
        return
    # Below every other finalizer's priority: the last to run.
    util.Finalize(None, _close_at_worker_end, exitpriority=-(2**31))
    _finalizer_pid = os.getpid()


class _AfterForkToken:
    pass


#: The process that has _added_after_fork registered, and the object it is
#: registered with (multiprocessing keeps that by a weak reference).
_after_fork_pid = 0
_AFTER_FORK = _AfterForkToken()


def _added_after_fork(_: object) -> None:
    _close_at_multiprocessing_exit()


#: Where multiprocessing runs a worker that then ends through os._exit():
#: (function, file name).
_ENDS_IN_OS_EXIT = {("_launch", "popen_fork.py"), ("_serve_one", "forkserver.py")}


def _close_at_worker_end() -> None:
    frame: types.FrameType | None = sys._getframe()
    while frame is not None:
        code = frame.f_code
        if (code.co_name, os.path.basename(code.co_filename)) in _ENDS_IN_OS_EXIT:
            break
        frame = frame.f_back
    else:
        return  # a spawned worker: its exit runs the atexit hook, after its own handlers
    # The worker's next step, taken now (it returns at once when the worker
    # takes it): its threads' exit callbacks (a ThreadPoolExecutor's), the
    # main thread marked stopped, and every non-daemon thread joined, those
    # they start too. Closed before that, the clients dropped what those
    # threads went on saving; joined before it, a worker whose thread waits
    # for one of those steps hung.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    finally:
        _close_open_channels()  # (also when a thread-exit callback raised)


def _close_at_exit(channel: Channel) -> None:
    try:
        channel.close()
    except Exception:  # noqa: BLE001 - the other channels still get their turn
        log.exception("event=close_failed_at_exit")


def _orphan_in_child() -> None:
    # A forked child inherits the channels but not their I/O threads: each
    # one is marked dead (its saves are dropped, its requests fail at once),
    # and its exit must not wait for a thread that is not there.
    channels = list(_open_channels)
    for channel in channels:
        channel._orphan()
    _open_channels.clear()
    if channels:
        # So are libzmq's connections to the daemons: while the child lived,
        # a daemon saw the parent's client connected after it closed, and
        # waited for its answer at its drain. (No thread here uses them.)
        # One pass over the descriptors for every channel.
        for fd in _fds_connected_to({os.fspath(socket_path(c.endpoint)) for c in channels}):
            with contextlib.suppress(OSError):
                os.close(fd)


os.register_at_fork(after_in_child=_orphan_in_child)


def _fds_connected_to(paths: set[str]) -> list[int]:
    """This process's descriptors of Unix sockets connected to a socket at
    one of ``paths``: in a forked child, its copies of libzmq's connections
    to the daemon. Where descriptors cannot be listed, none."""
    listing = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"  # Linux; macOS
    try:
        fds = [int(name) for name in os.listdir(listing)]
    except (OSError, ValueError):
        return []
    want = {os.path.realpath(path) for path in paths}
    found = []
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=fd)
        except OSError:
            continue  # (the listing's own descriptor, closed since)
        try:
            peer = s.getpeername() if s.family == socket.AF_UNIX else None
        except OSError:
            peer = None  # not connected
        finally:
            s.detach()  # the descriptor stays open: it is only looked at here
        if isinstance(peer, str) and peer and os.path.realpath(peer) in want:
            found.append(fd)
    return found


# atexit runs its handlers last registered first, and once pyzmq's garbage
# collector has run its own, no zero-copy frame can be sent. pyzmq imports that
# module (which registers the handler) at its first zero-copy send, after this
# import: importing it here first makes ours run before it. (atexit also waits
# for non-daemon threads, which may still be saving, to end first.)
atexit.register(_close_open_channels)


class DaemonUnavailable(ConnectionError):
    """The daemon is not running or did not answer in time."""


class DaemonTimedOut(DaemonUnavailable):
    """The daemon did not answer in time; it may still be up (and busy)."""


class ClosedHere(DaemonUnavailable):
    """This client's connection was closed in this process (``close()`` on
    another thread, the exit hook): the daemon may well be up and at work
    on what the request waited for."""


class DaemonShuttingDown(DaemonUnavailable):
    """The daemon is draining before it exits: a request that must follow a
    save this client keeps for the next daemon fails with this at once."""


Messages = list[list[bytes | memoryview]]


class SaveTooLarge(ValueError):
    """A save's header passes what the daemon takes (``MAX_HEADER_BYTES``),
    found only when the I/O thread encodes it: a limit of the user's data,
    not a failure of kvkeeper's, so it is logged without a traceback."""


@dataclass(eq=False)
class _Save:
    build: Callable[[], Messages] | None  # run on the I/O thread, then dropped
    nbytes: int
    count: int  # messages reserved in the budget (an estimate until built)
    key: Key
    messages: Messages = field(default_factory=list)
    due: float = 0.0  # while held: when it may be sent
    piped: int = 0  # messages handed to ZeroMQ so far
    create: bool = False  # only creates its entry: never sent in place of an unsent save

    def let_go(self) -> None:
        """Drop the capture and the frames: the cache's buffers are the
        caller's alone again."""
        self.messages.clear()
        self.build = None


#: Held saves up to this size are copied at once (``Channel._detach``), but
#: those the capture copied already (``CAPTURE_COPY_MAX_BYTES``). A
#: larger copy outlasts a decode step, so the step copies the buffers too: a
#: review measured 32 MiB saved every 4 ms step at the same step times with
#: twice the client's CPU, 8 MiB at 4.3 ms steps against 5.1 ms.
DETACH_MAX_BYTES = 8 * 1024 * 1024


def _copy(frame: bytes | memoryview) -> bytes | memoryview:
    """A frame's bytes in memory of their own. ``np.empty`` leaves the memory
    unwritten and numpy copies without the GIL, which the generation loop's
    thread may want meanwhile (``bytearray(n)`` zeroes n bytes holding it)."""
    if isinstance(frame, bytes):
        return frame
    # Imported here: numpy comes with the mlx extra, which saves need, and
    # the commands (ls, rm, stats) must run in an install without it.
    import numpy as np

    out = np.empty(len(frame), np.uint8)
    out[:] = np.frombuffer(frame, np.uint8)
    return out.data


@dataclass(eq=False)
class _Request:
    header: bytes | None  # None: nothing to send, only the release
    req: int
    # The key whose saves it must see (ALL_KEYS: every save), sent first; None:
    # it may pass saves still waiting.
    release: Key | None = None
    future: Future[m.Reply] = field(default_factory=Future)
    sent: bool = False  # the I/O thread's: handed to a connection (which may die with it)
    seq: int = 0  # the I/O thread's: Channel._sent when it went
    conn: int = 0  # the I/O thread's: Channel.connections when it went
    # The I/O thread's: ``counters.saves_lost`` when it went. Every save
    # handed off before it was sent, or lost, by then; a flush counts these
    # losses only (a save handed off after it, and lost while it waited,
    # is the next flush's).
    lost: int = 0
    # The I/O thread's: the number of the last save built when it went (the
    # saves a flush covers are those numbered up to it).
    last_save: int = 0


def _some_keys(keys: list[Key], shown: int = 20) -> str:
    """``model/id,...`` of at most ``shown`` keys, and how many more."""
    text = ",".join(f"{model}/{cache_id}" for model, cache_id in keys[:shown])
    return text + (f",+{len(keys) - shown} more" if len(keys) > shown else "")


#: Why a request of a client whose close() began elsewhere fails.
CLOSED_BY_OTHERS = ("the client's connection was closed (by close() on another thread, or at "
                    "interpreter exit)")
#: Why a request fails at once when its thread is inside this client's own
#: call, holding its lock (see send_request).
INTERRUPTED_OWN_CALL = ("a request made while this thread is inside the same client's own "
                        "call (from a signal handler, or a finalizer the garbage collector "
                        "ran there): it cannot be answered before that call goes on")
#: Why a request of a client made before a fork fails in the child.
FORKED = "this Client was made before the process forked; make a new one in the child"


#: A request on its way: what ``Channel.send_request`` returns.
PendingReply = _Request


@dataclass(eq=False)
class _DrainFlush:
    """The flush a client asks for when its daemon says it drains: answered
    once the drain has settled every save it read, it vouches for the saves
    sent before it on that connection (after the restart, which the new
    daemon cannot)."""

    pid: int  # the draining daemon's run
    boot_id: float
    request: _Request | None = None  # None: not sent yet (a save is half sent)


@dataclass(eq=False)
class ConnectionEnd:
    """A connection that ended with saves sent on it."""

    conn: int  # its number (``Channel.connections`` while it lasted)
    last_save: int  # the number (``Channel._sent``) of the last save sent on it
    drain: _DrainFlush | None  # asked for on it when its daemon drained

    def vouched(self) -> tuple[tuple[int, float], int] | None:
        """When the draining daemon answered for every save sent on this
        connection: its run (pid, boot id) and its ``failed`` total for this
        client then; else None (they may be lost)."""
        flush = self.drain.request if self.drain is not None else None
        if (flush is None or not flush.sent or flush.conn != self.conn
                or flush.seq <= self.last_save or not flush.future.done()
                or flush.future.exception() is not None):
            return None
        reply = flush.future.result()
        if not isinstance(reply, m.Flushed):
            return None
        assert self.drain is not None
        return (self.drain.pid, self.drain.boot_id), reply.failed


@dataclass(eq=False)
class _Slot:
    """A save's place in the backlog; a newer save of the key may take it."""

    save: _Save


@dataclass
class ChannelCounters:
    saves_sent: int = 0
    # Handed off, but never sent whole: the pipe broke, building failed, or the
    # channel closed with the save still queued, held or half sent.
    saves_lost: int = 0
    saves_refused: int = 0  # the daemon said no (busy, too large, ...)
    saves_coalesced: int = 0  # replaced by a newer save of the cache while waiting to be sent
    drain_notices: int = 0  # daemons that said they drain before they exit
    bytes_sent: int = 0


class Channel:
    def __init__(
        self,
        endpoint: str,
        *,
        max_inflight_bytes: int,
        min_send_interval: float = 0.0,
        on_refused: Callable[[m.SaveRefused], None] | None = None,
        on_pong: Callable[[m.Pong, int], None] | None = None,
        cpu_policy: str = "batch",
    ) -> None:
        self.endpoint = endpoint
        self._cpu_policy = check_cpu_policy(cpu_policy)
        self.max_inflight_bytes = max_inflight_bytes
        self.counters = ChannelCounters()
        self.connected = threading.Event()
        self.connections = 0  # handshakes so far: a change means maybe another daemon
        self._made = time.monotonic()
        self._listened: bool | None = None  # see daemon_returning (a first connection)
        self._path = os.fspath(socket_path(endpoint))
        # The socket file of the daemon connected to, and of the last one
        # that went away (the I/O thread's).
        self._live_socket: tuple[int, int, int] | None = None
        self._gone_socket: tuple[int, int, int] | None = None
        self._connections_ended = 0  # the I/O thread's
        # The I/O thread's: the daemon said it drains (then exits), or refused
        # a save as shutting down. Saves sent to it from then on would be
        # refused: they wait for the next daemon, as without a connection.
        self._daemon_leaving = False
        # The I/O thread's: the flush asked for on this connection once its
        # daemon said it drains, and the number (see _sent) of the last
        # message sent before the connection began.
        self._drain: _DrainFlush | None = None
        self._connection_began = 0
        # Connections that ended with saves sent on them (under _lock; a
        # flush answered by a restarted daemon looks at those before its
        # own: the daemon they went to answers for them only if it drained).
        self._ends: list[ConnectionEnd] = []
        self._on_refused = on_refused
        # Called on the I/O thread with each Pong, and the number of the
        # connection its ping went on. One is sent on each new connection:
        # what a client knew of the daemon (its root, its largest save) was
        # of the one before, maybe another daemon on the same socket. That
        # ping waiting for its answer, and its connection's number (the I/O
        # thread's).
        self._on_pong = on_pong
        self._hello: tuple[_Request, int] | None = None
        self._hello_due = False
        self._lock = threading.RLock()
        self._outbox: deque[_Save | _Request] = deque()
        self._waiting: dict[int, _Request] = {}
        self._inflight_bytes = 0
        self._inflight_messages = 0
        # The I/O thread's alone: saves waiting out the interval, and when each
        # key's last save was sent.
        self._held: dict[Key, _Save] = {}
        # The I/O thread's alone: what waits for room in ZeroMQ's pipe, in the
        # order it goes; the slot of each key a newer save may still take (no
        # request that must see the older one is behind it); the save being
        # handed over; and what ZeroMQ holds: each message's tracker, its
        # bytes, and on a save's last message the save.
        self._backlog: deque[_Slot | _Request] = deque()
        self._open: dict[Key, _Slot] = {}
        # False once the backlog may hold what _hold_backlog fails or
        # coalesces (a request, or a slot a newer save of its key replaces).
        self._backlog_settled = True
        self._piping: _Save | None = None
        self._piped: deque[tuple[zmq.MessageTracker, int, _Save | None]] = deque()
        self._piped_bytes = 0
        self._sends = Pacer(min_send_interval)
        self._req_ids = itertools.count(1)
        self._save_ids = itertools.count(1)
        self._last_save_id = 0  # the I/O thread's
        self._closing = threading.Event()
        self._close_claimed = False  # under _lock: only the first close() closes
        # Set once close() stops waiting for the saves in flight: a save after
        # that (a signal handler's, on close()'s own thread) is not waited for.
        self._saves_waited = False
        self._stopped = False  # under _lock: the I/O thread is gone, no request can be answered
        self._thread_closes_pipe = False  # under _lock: close() gave up waiting for the thread
        self._ended = threading.Event()  # the I/O thread has stopped and counted everything
        # The I/O thread's: messages sent so far (saves count once), the
        # number of the last save sent, and the last one a reply confirmed:
        # the daemon answers a request only after reading every message sent
        # before it on the connection. Saves get no reply of their own;
        # close() asks for one when they are not covered. (Notices of loads
        # are not waited for: one lost costs an eviction order, no data.)
        self._sent = 0
        self._sent_unanswered = 0
        self._confirmed = 0
        # Connections that ended with saves the daemon had not confirmed
        # reading: for each, the number of the first message not confirmed
        # (under _lock; flush() takes those sent before its own request).
        self._unread_losses: list[int] = []
        self._close_end = 0.0  # the close() under way: until when it gives
        self._closer: int | None = None  # and the thread it runs on
        self.forked = False  # this is a forked child's copy: it can never send
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kvkeeper-client-io", daemon=True)
        self._thread.start()
        _open_channels.add(self)
        _close_at_multiprocessing_exit()

    # ------------------------------------------------------------ caller side

    @property
    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    @property
    def held_saves(self) -> int:
        """Saves waiting out ``min_send_interval`` (their bytes count in flight)."""
        return len(self._held)

    def daemon_returning(self) -> bool:
        """Whether a daemon is about to be connected to, for a caller that saw
        none connected: a socket file made less than ``RETURN_GRACE`` ago is
        at the daemon's path, and not the one the last connection ended with
        (or, for ``RETURN_GRACE`` after the channel was made and until its
        first connection ends, a socket file something listens on). Judged by the
        socket's age, not by when this client first looked: a socket a
        daemon killed minutes ago left (its last restart's) was taken for
        one coming back, and every save for a second after. A stat of the
        path (microseconds), on the caller's thread."""
        found = _socket_at(self._path)
        if found is None or found == self._gone_socket:
            return False
        if self._connections_ended == 0 and time.monotonic() - self._made < RETURN_GRACE:
            # A new client's first connection, which ZeroMQ makes within
            # milliseconds: with connect_timeout=0, the first saves were
            # dropped as "no kvkeeper daemon" with the daemon up. Looked at
            # once: a dead daemon's socket must still drop them (held, they
            # were lost at close(), which waited its whole timeout). Made or
            # not (no connection has ended): asked "connections == 0", a
            # handshake landing after the caller saw none connected failed
            # its flush(), 8 times in 1,000 here.
            if self._listened is None:
                self._listened = _listened_on(self._path)
            if self._listened:
                return True
        return 0 <= time.time_ns() - found[2] < RETURN_GRACE * 1e9

    def next_save_id(self) -> int:
        """A number for a save being built (on the I/O thread)."""
        self._last_save_id = next(self._save_ids)
        return self._last_save_id

    def next_req_id(self) -> int:
        return next(self._req_ids)

    def send_save(self, key: Key, build: Callable[[], Messages], nbytes: int,
                  nmessages: int, *, create: bool = False) -> str | None:
        """Take room for a save of ``key`` in the in-flight budget (``nbytes``,
        and ``nmessages`` as estimated) and queue it; never blocks. The I/O
        thread calls ``build`` for the messages, so the caller's thread does
        not pay for them. Returns None when queued; "full" when the room is
        not there; "closed" when a close() began (e.g. the exit hook beside a
        worker thread): nothing queued then would be sent. ``create``: a save
        that only creates its entry, sent after any unsent save of its key
        rather than in its place."""
        item = _Save(build, nbytes, nmessages, key, create=create)
        with self._lock:
            if self._stopped or self._closing.is_set():
                return "closed"
            if (self._inflight_bytes + nbytes > self.max_inflight_bytes
                    or self._inflight_messages + nmessages > _MAX_INFLIGHT_MESSAGES):
                return "full"
            # Taken and queued with no Python call between, where a signal
            # handler's exception (Ctrl-C) could land: taken in one call and
            # queued in the next, the room of a save interrupted between them
            # was never given back.
            self._inflight_bytes += nbytes
            self._inflight_messages += nmessages
            self._outbox.append(item)
            self._wake(hand_over=False)
        return None

    def request(self, make: Callable[[int], m.Request], timeout: float, *,
                release: Key | None = None, closing: bool = False) -> m.Reply:
        """Send a request and wait for its reply; raises DaemonUnavailable.
        ``release`` and ``closing`` as for ``send_request``; a daemon coming
        back is waited for within ``timeout``."""
        t0 = time.monotonic()
        pending = self.send_request(make, release=release, closing=closing, wait=timeout)
        return self.wait(pending, max(0.0, timeout - (time.monotonic() - t0)))

    def send_request(self, make: Callable[[int], m.Request], *, release: Key | None = None,
                     closing: bool = False, wait: float = 0.0) -> PendingReply:
        """Send a request without waiting; ``wait`` collects the reply, so the
        caller can work while the daemon answers. Every save of ``release``
        made before it (``ALL_KEYS``: every save) reaches the daemon first,
        one waiting out the send interval included; with ``release`` None it
        may pass saves still waiting for room. ``closing``: close()'s own
        request. Raises DaemonUnavailable when the daemon is not connected,
        after waiting up to ``wait`` seconds (at most ``RETURN_GRACE``) for
        one coming back (``daemon_returning``)."""
        if not self.connected.is_set():
            if self.forked:
                raise DaemonUnavailable(FORKED)
            if self._close_claimed and not closing:
                # The daemon may well be up: say what happened to this client.
                raise ClosedHere(CLOSED_BY_OTHERS)
            if not (wait > 0 and self.daemon_returning()
                    and self.connected.wait(min(wait, RETURN_GRACE))):
                raise DaemonUnavailable(f"no kvkeeper daemon at {self.endpoint}")
        if self._lock._is_owned():  # type: ignore[attr-defined]
            # A signal handler that interrupted this thread inside the
            # channel's lock: the I/O thread needs that lock to send the
            # request and take in its reply, and waited out the timeout.
            raise RuntimeError(INTERRUPTED_OWN_CALL)
        req = self.next_req_id()
        item = _Request(m.encode(make(req)), req, release)
        with self._lock:
            if self._stopped:
                # Nobody would ever answer it: fail now, not after the timeout.
                raise ClosedHere(CLOSED_BY_OTHERS)  # (a forked child is never connected)
            self._waiting[req] = item
        self._push(item, hand_over=True)
        return item

    def on_io_thread(self) -> bool:
        """Whether this is the channel's own I/O thread (a ``__del__`` that a
        garbage collection runs there, say)."""
        return threading.current_thread() is self._thread

    @property
    def closing_elsewhere(self) -> bool:
        """Whether a close() began on another thread than this one, or one
        on this thread no longer waits for the saves in flight (it asks the
        daemon to confirm them, or is done: the exit hook's, which with
        Python 3.12 runs on the main thread, before a later exit hook
        saves), or the channel is a forked child's copy. A signal handler
        that interrupts close() on its own thread while that close() waits
        for the saves in flight still gets its save sent."""
        return self._close_claimed and (self._closer != threading.get_ident()
                                        or self._saves_waited or self._closing.is_set())

    def notify(self, msg: m.Request) -> None:
        """Send a message that gets no reply, if the daemon is connected; never
        blocks, and keeps the GIL (the caller goes on at once)."""
        if self.connected.is_set():
            # The I/O thread is woken (about 80 us of a lazy load, measured
            # cold) rather than left to its next idle pass (up to 0.2 s): a
            # use notice that late let another process's save evict the entry
            # just loaded, and died with a process ending in os._exit.
            self._push(_Request(m.encode(msg), 0), hand_over=False)

    def wait(self, pending: PendingReply, timeout: float) -> m.Reply:
        """The reply to a ``send_request``; raises DaemonUnavailable."""
        try:
            return pending.future.result(timeout=timeout)
        # Until Python 3.11 the futures' TimeoutError is not the builtin one.
        except (TimeoutError, concurrent.futures.TimeoutError):
            # Rounded: a caller's timeout less the time already spent on it
            # (flush's wait for its turn) read 0.1999898750011198 s.
            raise DaemonTimedOut(
                f"the daemon at {self.endpoint} did not answer within {round(timeout, 3):g} s"
            ) from None
        finally:
            with self._lock:
                self._waiting.pop(pending.req, None)

    def _orphan(self) -> None:
        """In a forked child: nothing here can reach the daemon any more."""
        self.forked = True
        # The parent's I/O thread may have held the lock at the fork: the
        # child's copy would then never be released.
        self._lock = threading.RLock()
        self._stopped = self._close_claimed = True
        self.connected.clear()
        self._closing.set()
        # The pipe is shared with the parent: a byte from here would wake its
        # I/O thread for nothing. The child's copies are closed.
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self._fail_waiting(FORKED)

    def close(self, timeout: float = 5.0) -> None:
        """Send the saves waiting out the send interval, give queued saves up
        to ``timeout`` to reach the daemon and the daemon to confirm it read
        them, then stop. A close() while another runs returns once that one
        is done. From a signal handler that interrupted this channel's own
        code (on the thread holding its lock), it only starts the close: the
        I/O thread ends it, without sending what is queued, once that code
        lets go."""
        if self._lock._is_owned():  # type: ignore[attr-defined]
            # Waiting here would wait for this very thread (a save interrupted
            # by a SIGTERM handler that closes the client): it hung for ever.
            claimed, self._close_claimed = self._close_claimed, True
            if not claimed:
                self._closer = threading.get_ident()
                self._thread_closes_pipe = True
                self._closing.set()
                self._wake()
            return
        with self._lock:
            claimed, self._close_claimed = self._close_claimed, True
            if not claimed:
                self._close_end = time.monotonic() + timeout
                self._closer = threading.get_ident()
        if claimed:
            if self.forked:
                return
            if self._closer != threading.get_ident():
                # E.g. the exit hook, while a dropped client's channel closes
                # in the background: the process must not end under that close.
                # One with more time than the close under way lends it that
                # time (a __del__'s close(timeout=30), after the client's
                # finalizer began its own with the default: the save was lost
                # at 5 s).
                with self._lock:
                    self._close_end = max(self._close_end, time.monotonic() + timeout)
                self._ended.wait(max(0.0, self._close_end - time.monotonic()) + 5.0)
            else:
                # From inside this thread's own close() (a signal handler):
                # waiting for that one could never end, but what was handed
                # off still gets this call's timeout to leave (returning at
                # once, a handler that exits next lost it).
                self._push(_Request(None, 0, ALL_KEYS), hand_over=True)
                self._wait_sent(time.monotonic() + timeout)
            return
        try:
            self._close()
        except BaseException:
            # Interrupted (Ctrl-C): unless the I/O thread was told to stop,
            # a later close() (the exit hook's) starts over; if it was, a
            # later close(), on this thread too, waits for it to end, and the
            # pipe is closed here or by the thread as it ends (it was left
            # open for good).
            with self._lock:
                if not self._closing.is_set():
                    self._close_claimed = False
                elif not self._ended.is_set():
                    self._thread_closes_pipe = True
                else:
                    self._close_pipe()
                    _open_channels.discard(self)
                self._closer = None
            raise
        _open_channels.discard(self)  # last: the exit hook waits for a close under way

    def _close(self) -> None:
        self._push(_Request(None, 0, ALL_KEYS), hand_over=True)  # nothing waits out the interval
        self._saves_waited = False  # (a close() interrupted by Ctrl-C may run again)
        self._wait_sent()
        # From here a save of this thread's (a signal handler's) would be
        # taken and then lost: it is dropped, reason "closed".
        self._saves_waited = True
        warned = self._unconfirmed
        if warned:
            if self.connected.is_set():
                warned = not self._confirm(self._close_end - time.monotonic())
            else:
                log.warning("event=client_close_unconfirmed reason=no_daemon: no daemon is "
                            "connected to confirm it read the last saves sent")
        with self._lock:  # send_save looks under it
            self._closing.set()
        self._wake()
        # The thread's loop is over and everything counted once _ended is set;
        # the pipe is polled in that loop only.
        self._ended.wait(timeout=5.0)
        with self._lock:
            if not self._ended.is_set():
                # It still polls the pipe: closing it now could hand its
                # descriptor number to another file. It closes them as it ends.
                self._thread_closes_pipe = True
                log.warning("event=client_close_slow: the I/O thread did not end within 5 s")
                return
            self._close_pipe()
        if self._unconfirmed and not warned:
            # A save another thread made while the daemon answered.
            log.warning("event=client_close_unconfirmed reason=saved_meanwhile: saves were "
                        "sent after the daemon confirmed the others")

    def _wait_sent(self, end: float | None = None) -> None:
        """Until every save handed off has left (or the I/O thread ended, or
        ``end``; by default the close under way's end, as later close() calls
        extend it). Saves waiting (reserved bytes) are waited for with no
        daemon too: the client reconnects by itself, and a daemon restarted by
        its service manager within the timeout still gets them."""
        pause = threading.Event()
        while (((self._outbox and self.connected.is_set()) or self._inflight_bytes)
               and not self._ended.is_set()
               and time.monotonic() < (self._close_end if end is None else end)):
            pause.wait(0.01)

    def ended_with_saves(self, since: int, before: PendingReply) -> list[ConnectionEnd]:
        """The connections before ``before``'s (a request already sent) that
        ended with saves sent after the save numbered ``since``: the caller
        reported on the older ones, and they are dropped here."""
        with self._lock:
            self._ends = [end for end in self._ends if end.last_save > since]
            return [end for end in self._ends if end.conn < before.conn]

    def unread_losses(self, since: int, before: PendingReply) -> int:
        """How many connections ended with saves sent before ``before`` (a
        request already sent) that the daemon had not confirmed reading,
        counting those after the save numbered ``since``: the caller reported
        the older ones (when a flush that returned was sent after them), and
        they are dropped here."""
        with self._lock:
            self._unread_losses = [n for n in self._unread_losses if n >= since]
            return sum(1 for n in self._unread_losses if n < before.seq)

    @property
    def _unconfirmed(self) -> bool:
        return self._sent_unanswered > self._confirmed

    def _confirm(self, timeout: float) -> bool:
        """Wait until the daemon has read everything sent. ZeroMQ calls a
        frame sent once it has taken it, and what its buffers (this side's or
        the daemon's) still hold when the connection closes is never read:
        without this, saves counted sent vanished at exit (up to 43 of 3,000
        small saves). The daemon answers a ping only after reading every
        message sent before it on the connection. False (logged) without it."""
        if timeout <= 0:
            log.warning("event=client_close_unconfirmed reason=no_time_left: no time left "
                        "to ask the daemon")
            return False
        try:
            self.request(lambda req: m.Ping(v=m.PROTOCOL_VERSION, req=req), timeout,
                         closing=True)
        except DaemonUnavailable as exc:
            log.warning("event=client_close_unconfirmed reason=%s", exc)
            return False
        return True

    def _close_pipe(self) -> None:
        # Under the lock that _push wakes under: a save() racing close() must
        # not write its byte to a descriptor number reused meanwhile. Each end
        # marked closed before it is: a Ctrl-C right after a close() would
        # have the next one close the number again (another file's by then).
        fd, self._wake_r = self._wake_r, -1
        if fd >= 0:
            os.close(fd)
        fd, self._wake_w = self._wake_w, -1
        if fd >= 0:
            os.close(fd)

    def _push(self, item: _Request, *, hand_over: bool) -> None:
        with self._lock:
            self._outbox.append(item)
            self._wake(hand_over=hand_over)

    def _wake(self, *, hand_over: bool = True) -> None:
        if self._wake_w < 0:
            return  # closed
        # os.write lets go of the GIL for the system call, and the I/O thread,
        # woken by that very write, takes it once it has a core (it runs
        # SCHED_BATCH): right for a request, whose caller waits for the
        # answer or works while it comes (load). Wrong for a save: the thread
        # would build the save's messages while save() waits to get the GIL
        # back (0.4 ms per 512 MiB save, measured). The byte goes to a
        # non-blocking pipe, so the GIL can stay with save().
        if not hand_over and _write_holding_gil is not None:
            _write_holding_gil(self._wake_w, b"x", 1)  # -1 when full: already awake
            return
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake (pipe full) or closing

    # ------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        # Before the first socket: ZeroMQ's threads (and pyzmq's garbage
        # collector, shared by the whole process, if this is the first
        # zero-copy send in it) start from this thread and inherit it.
        if self._cpu_policy == "batch":
            batch_this_thread()
        sock: zmq.Socket | None = None
        monitor: zmq.Socket | None = None
        try:
            # Set up inside the try: if it fails (a path too long for the
            # socket), the saves queued meanwhile are still counted and
            # close() is still told the thread has ended.
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # One identity for this client's life: the daemon tallies saves per peer
            # (for flush), and a reconnect to the same daemon keeps the tally.
            # (A leading zero byte is reserved by ZeroMQ.)
            sock.setsockopt(zmq.ROUTING_ID, m.new_client_id())
            # No daemon, no queueing: a send fails at once instead of piling up.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            # The in-flight budget (bytes and messages) bounds what is queued.
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            # Track every frame for real: below the threshold pyzmq would copy it and
            # report it sent at once, releasing its reservation early.
            sock.copy_threshold = 0
            # Saves made while no daemon is connected are dropped, so a restarted
            # daemon is looked for often: a failed ipc connect costs next to nothing.
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            )
            sock.connect(self.endpoint)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            while not self._closing.is_set():
                # Poll briefly while sends are in flight so their bytes are released
                # soon, and no longer than until the next held save is due.
                wait_ms = 2 if self._piped or self._piping else 200
                # (Without a daemon held saves wait for the reconnect, which the
                # monitor socket reports: no due time to wake up for.)
                if self._held and self.connected.is_set():
                    due = min(save.due for save in self._held.values())
                    wait_ms = min(wait_ms, max(0, int((due - time.monotonic()) * 1000) + 1))
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                # Replies first: those of a connection that ended came before
                # its end (and before any next connection's handshake), and
                # a daemon's word that it leaves must not stick to the next.
                if sock in events:
                    self._receive(sock)
                lost = monitor in events and self._monitor_events(monitor, sock)
                self._say_hello(sock)
                if lost:
                    # Replies still unread count (ZeroMQ drops them once it
                    # has ended the connection's pipe: the daemon keeps its
                    # connections a moment past its last reply for that).
                    self._receive(sock)
                    # The daemon that had them will never answer, and a caller
                    # waiting out its timeout would stall the generation loop
                    # (a load falls back to reading the file). Requests not
                    # sent yet fail too (``_pump``); saves not begun wait for
                    # the next connection.
                    self._fail_waiting(f"the daemon at {self.endpoint} went away",
                                       sent_only=True)
                    self._abandon_piping("connection_lost")
                self._reap()
                self._admit_outbox(sock)
                self._release_due()
                self._pump(sock)
                self._ask_drain_flush(sock)
        except zmq.ZMQError as exc:  # e.g. the socket could not be set up
            log.error("event=client_io_failed endpoint=%s error=%s", self.endpoint, exc)
        finally:
            # Saves not sent whole by now (no daemon, or close() timed out) never
            # will be: count them, and give their reservations back.
            with self._lock:
                # In the same hold of the lock as the last look at the outbox:
                # a save queued after it would be neither sent nor counted.
                self._stopped = True  # from here on saves and requests fail at once
                queued = [item for item in self._outbox if isinstance(item, _Save)]
                self._outbox.clear()
            unsent = [*queued, *self._held.values(),
                      *(slot.save for slot in self._backlog if isinstance(slot, _Slot))]
            if self._piping is not None:
                unsent.append(self._piping)  # not counted sent: its last message never went
            for tracker, _nbytes, save in self._piped:
                if save is None:
                    continue
                if tracker.done:
                    self._release_save(save)
                else:
                    # Counted sent when its frames were handed to ZeroMQ; they
                    # never left: it is lost instead.
                    self.counters.saves_sent -= 1
                    self.counters.bytes_sent -= save.nbytes
                    unsent.append(save)
            self._held.clear()
            self._backlog.clear()
            self._open.clear()
            self._backlog_settled = True
            self._piping = None
            self._piped.clear()
            self.counters.saves_lost += len(unsent)
            lost_keys = sorted({save.key for save in unsent})
            # In one hold of the lock: a thread still calling save() contends
            # for it, and each wait for it costs this thread a GIL hand-over.
            with self._lock:
                self._inflight_bytes -= sum(save.nbytes for save in unsent)
                self._inflight_messages -= sum(save.count for save in unsent)
            try:
                if monitor is not None:
                    assert sock is not None
                    sock.disable_monitor()
                    monitor.close(linger=0)
                if sock is not None:
                    sock.close(linger=0)
                self._ctx.term()
            finally:
                self.connected.clear()
                if self._closing.is_set():
                    self._fail_waiting(CLOSED_BY_OTHERS, error=ClosedHere)
                else:  # the I/O thread failed (event=client_io_failed)
                    self._fail_waiting(f"the client's connection to {self.endpoint} failed")
                if unsent:
                    # A shutdown that loses a conversation's last state says
                    # whose; before close() returns, and never in its way.
                    with contextlib.suppress(Exception):
                        log.warning("event=saves_lost_at_close count=%d keys=%s: not sent "
                                    "whole before the client closed (no daemon, or close()'s "
                                    "timeout)", len(unsent), _some_keys(lost_keys))
                with self._lock:
                    # Under the lock close() looks at _ended with: either it
                    # closes the pipe, or this thread does, never neither.
                    if self._thread_closes_pipe:
                        self._close_pipe()
                    self._ended.set()
            # Last, once close() may return: letting go of thousands of
            # captures takes seconds while a thread still calling save() holds
            # the GIL (each MLX array freed hands it over).
            for save in unsent:
                save.let_go()

    def _monitor_events(self, monitor: zmq.Socket, sock: zmq.Socket) -> bool:
        """Follow the connection's events; True when it was lost."""
        lost = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return lost
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._live_socket = _socket_at(self._path)
                self._connection_began = self._sent
                self._daemon_leaving = False
                self._drain = None
                self.connections += 1
                self._hello_due = self._on_pong is not None
                self.connected.set()
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                if self.connected.is_set():
                    # The ended connection's replies still queued, before
                    # its end is judged, and before a next connection's
                    # handshake read in the same batch: its daemon's word
                    # that it leaves must not stick to the next one.
                    self._receive(sock)
                    if self._sent_unanswered > self._connection_began:
                        with self._lock:
                            self._ends.append(ConnectionEnd(
                                self.connections, self._sent_unanswered, self._drain))
                    self._gone_socket = self._live_socket
                    self._connections_ended += 1
                self.connected.clear()
                lost = True
                if self._unconfirmed:
                    # What the daemon had not read yet died with the
                    # connection: ZeroMQ had already called it sent.
                    with self._lock:
                        self._unread_losses.append(self._confirmed + 1)
                    log.warning("event=saves_unconfirmed reason=connection_lost: the "
                                "connection to the daemon ended before it confirmed reading "
                                "the last saves sent; a flush() tells whether they were "
                                "written")
                    self._confirmed = self._sent_unanswered

    def _fail_waiting(self, reason: str, *, sent_only: bool = False,
                      error: type[DaemonUnavailable] = DaemonUnavailable) -> None:
        """Fail the requests waiting for a reply (with ``sent_only``, those
        already sent) with ``error``: no daemon will answer them."""
        with self._lock:
            items = [item for item in self._waiting.values() if item.sent or not sent_only]
        for item in items:
            if not item.future.done():
                item.future.set_exception(error(reason))

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = m.decode_reply(frames[0])
            except m.DecodeFailure as exc:
                log.warning("event=bad_reply error=%s", exc)
                continue
            if isinstance(reply, m.Draining):
                self.counters.drain_notices += 1
                self._daemon_leaving = True
                if self._drain is None:
                    self._drain = _DrainFlush(reply.pid, reply.boot_id)
                continue
            if isinstance(reply, m.Pong) and self._hello is not None \
                    and reply.req == self._hello[0].req:
                (hello, conn), self._hello = self._hello, None
                self._confirmed = max(self._confirmed, hello.seq)
                assert self._on_pong is not None
                self._on_pong(reply, conn)
                continue
            if isinstance(reply, m.SaveRefused):
                self.counters.saves_refused += 1
                if reply.code == "shutting_down":
                    self._daemon_leaving = True
                if self._on_refused is not None:
                    self._on_refused(reply)
                continue
            req = getattr(reply, "req", None)
            with self._lock:
                item = self._waiting.get(req) if req is not None else None
            drain = self._drain.request if self._drain is not None else None
            if item is None and drain is not None and drain.req == req:
                item = drain
            if item is not None and not item.future.done():
                self._confirmed = max(self._confirmed, item.seq)
                if isinstance(reply, m.Pong) and self._on_pong is not None:
                    # A caller's ping: recorded before the caller has it.
                    self._on_pong(reply, item.conn)
                item.future.set_result(reply)
            elif isinstance(reply, m.Error):
                log.warning("event=daemon_error code=%s message=%s", reply.code, reply.message)

    def _ask_drain_flush(self, sock: zmq.Socket) -> None:
        """Once the daemon said it drains, and the save being sent (if any)
        has gone whole, ask it for the flush that vouches for this
        connection's saves: the daemon answers it after reading everything
        sent before it, once the drain has settled those saves."""
        drain = self._drain
        if drain is None or drain.request is not None or self._piping is not None:
            return
        # Marked as the answer to the notice: a flush() of the caller's, sent
        # before the notice was read, would otherwise end the drain's wait for
        # the saves this client sent before it.
        req = m.DRAIN_ANSWER + self.next_req_id()
        drain.request = _Request(m.encode(m.Flush(v=m.PROTOCOL_VERSION, req=req)), req)
        self._send_request(sock, drain.request)

    def _say_hello(self, sock: zmq.Socket) -> None:
        """Ask a daemon just connected who it is, before the saves waiting
        for it go (between two messages: never inside a save's)."""
        if not self._hello_due or self._piping is not None or not self.connected.is_set():
            return
        self._hello_due = False
        req = self.next_req_id()
        hello = _Request(m.encode(m.Ping(v=m.PROTOCOL_VERSION, req=req)), req)
        self._hello = (hello, self.connections)
        self._send_request(sock, hello)

    def _admit_outbox(self, sock: zmq.Socket) -> None:
        """Take what the callers queued: requests go out now unless they must
        see a save still waiting, saves wait their turn in the backlog."""
        while True:
            with self._lock:
                # Past close()'s timeout, what is still queued is lost, not
                # sent while close() waits for this thread to end.
                if not self._outbox or self._closing.is_set():
                    return
                item = self._outbox.popleft()
            if isinstance(item, _Request):
                self._admit_request(sock, item)
            else:
                self._admit_save(item)
            # Each in turn: a save that finds room goes now, as it would
            # alone, not replaced by a newer one taken in the same pass.
            self._pump(sock)

    def _admit_save(self, save: _Save) -> None:
        if save.create:
            # Never in place of an unsent save of its key: the daemon is to
            # see that one first (it may be what makes the entry exist, and
            # the create refused), and the create is not held.
            older = self._held.pop(save.key, None)
            if older is not None and not self._into_open_slot(older):
                self._queue(older)
            self._queue(save)
            return
        older = self._held.pop(save.key, None)
        if older is not None:
            # Never sent: the newer save answers for it.
            self.counters.saves_coalesced += 1
            self._release_save(older)
        if self._into_open_slot(save):
            return
        due = self._hold_until(save)
        if due is None:
            self._queue(save)
            return
        if self._copy_to_hold(save) and not self._detach(save):
            self._release_save(save)  # counted lost
            return
        save.due = due
        self._held[save.key] = save

    def _into_open_slot(self, save: _Save) -> bool:
        """Put ``save`` in the place of its key's open slot, if there is one:
        nothing that must see the older save is behind it, so the newer one
        takes its place (and the daemon never reads the older one)."""
        slot = self._open.get(save.key)
        if slot is None:
            return False
        self.counters.saves_coalesced += 1
        self._release_save(slot.save)
        if slot.save.create:
            # A slot of the key the create was queued behind is now one
            # this save replaces.
            self._backlog_settled = False
        slot.save = save
        return True

    def _queue(self, save: _Save) -> None:
        """Put ``save`` at the end of the backlog as its key's open slot. A
        plain save goes into an open slot of its key instead
        (``_into_open_slot``): a key has two slots only with a request
        between them (which unsettles the backlog) or when the later one is
        a create save (which nothing is coalesced into)."""
        slot = _Slot(save)
        self._backlog.append(slot)
        self._open[save.key] = slot

    def _admit_request(self, sock: zmq.Socket, item: _Request) -> None:
        key = item.release
        if key is None:
            self._send_request(sock, item)
            return
        if key == ALL_KEYS:
            held, self._held = list(self._held.values()), {}
            at = len(self._backlog) if self._backlog or self._piping or held else -1
            self._open.clear()
        else:
            one = self._held.pop(key, None)
            held = [] if one is None else [one]
            at = self._after(key)
            if at < 0 and (held or (self._piping is not None and self._piping.key == key)):
                at = 0
            self._open.pop(key, None)
        if at < 0:
            self._send_request(sock, item)
            return
        # The held saves it releases go just before it, and stay its to see.
        entries: list[_Slot | _Request] = [*(_Slot(save) for save in held), item]
        for i, entry in enumerate(entries):
            self._backlog.insert(at + i, entry)
        self._backlog_settled = False

    def _after(self, key: Key) -> int:
        """Where a request that must see ``key``'s saves goes in the backlog:
        just after the last save of it, or request about it, there; -1 when
        there is none."""
        for i in range(len(self._backlog) - 1, -1, -1):
            entry = self._backlog[i]
            if (entry.save.key if isinstance(entry, _Slot) else entry.release) == key:
                return i + 1
        return -1

    def _send_request(self, sock: zmq.Socket, item: _Request) -> None:
        if item.header is None:
            return  # only a release: what it released is on its way
        try:
            sock.send(item.header, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            item.future.set_exception(DaemonUnavailable(f"cannot reach the daemon: {exc}"))
        else:
            item.sent = True
            self._sent += 1
            item.seq = self._sent
            item.conn = self.connections
            item.lost = self.counters.saves_lost
            item.last_save = self._last_save_id

    def _hold_until(self, save: _Save) -> float | None:
        """When ``save`` may be sent, if it is to wait: its key was sent less
        than the interval ago, it is small, and the budget is at most half used
        (a full budget would drop saves to keep one waiting)."""
        if save.nbytes > HOLD_MAX_BYTES or self._budget_half_used():
            return None
        return self._sends.due(save.key, time.monotonic())

    def _budget_half_used(self) -> bool:
        return (self._inflight_bytes > self.max_inflight_bytes // 2
                or self._inflight_messages > _MAX_INFLIGHT_MESSAGES // 2)

    def _release_due(self) -> None:
        """Queue the held saves whose interval is over (all of them when the
        budget is more than half used). Without a daemon they stay held (a
        newer save still replaces them) until it is back."""
        if not self._held or not self.connected.is_set():
            return
        if self._budget_half_used():
            due = list(self._held)
        else:
            now = time.monotonic()
            due = [k for k, save in self._held.items() if save.due <= now]
        for key in due:
            save = self._held.pop(key)
            # A slot of its key reopened meanwhile (a request behind it failed
            # without a daemon, or a save put back): the older save there is
            # not sent first.
            if not self._into_open_slot(save):
                self._queue(save)

    def _pump(self, sock: zmq.Socket) -> None:
        """Hand ZeroMQ what the backlog holds, in order, while its pipe has
        room: one save at a time (the daemon takes one save stream per
        client), and each request as it comes up."""
        while not self._closing.is_set():
            if self._piping is not None:
                if not self._pipe_more(sock, self._piping):
                    return  # the pipe is full
                continue
            if not self._backlog:
                return
            if not self.connected.is_set() or (
                    self._daemon_leaving and isinstance(self._backlog[0], _Slot)):
                # A daemon leaving still answers the requests no kept save
                # is ahead of (a flush behind the save it was sending when
                # told, which still went to it, failed "shutting down").
                self._hold_backlog()
                return
            if isinstance(self._backlog[0], _Slot) and self._piped_bytes >= PIPE_BYTES:
                return  # unstarted, a newer save of its key may still replace it
            entry = self._backlog.popleft()
            if isinstance(entry, _Request):
                self._send_request(sock, entry)
                continue
            save = entry.save
            if self._open.get(save.key) is entry:
                del self._open[save.key]
            if save.build is not None and not self._build(save):
                self._release_save(save)
                continue
            self._piping = save

    def _pipe_more(self, sock: zmq.Socket, save: _Save) -> bool:
        """Hand over ``save``'s next messages while there is room; False when
        the pipe is full before its last one. Only the last message handed
        here is tracked, for them all: ZeroMQ lets them go in order (a tracker
        per message costs the I/O thread CPU the generation loop may need)."""
        if self._piped_bytes >= PIPE_BYTES:
            return False
        batch = 0
        while True:
            i = save.piped
            msg = save.messages[i]
            nbytes = sum(len(frame) for frame in msg)
            last = i == len(save.messages) - 1
            full = self._piped_bytes + batch + nbytes >= PIPE_BYTES
            try:
                tracker = sock.send_multipart(msg, zmq.NOBLOCK, copy=False,
                                              track=last or full)
            except (zmq.ZMQError, RuntimeError) as exc:  # RuntimeError: pyzmq shutting down
                if i == 0 and isinstance(exc, zmq.Again):
                    # No connection any more (the monitor has not told yet),
                    # or ZeroMQ's queue is full of requests and notices: none
                    # of it went, so it waits at the head of the backlog.
                    self._put_back(save)
                    return False
                # Nothing more of this save goes out; the daemon drops the part it
                # got when this client's next save starts (or after its stall timeout).
                # EAGAIN after the first message: the connection went (with
                # IMMEDIATE there is no pipe left; SNDHWM is far off).
                gone = isinstance(exc, zmq.Again)
                self._abandon_piping("connection_lost" if gone else "send_failed",
                                     None if gone else exc)
                return True
            # From here ZeroMQ alone holds the frames, and lets each go once it
            # is sent: a tensor's snapshot handle dies with its last frame, so
            # layers already sent no longer make MLX copy them on the next
            # decode step.
            del msg
            save.messages[i] = []
            save.piped = i + 1
            if i == 0:
                self._sends.went(save.key, time.monotonic())  # the interval runs from a save that went
            batch += nbytes
            if last or full:
                assert tracker is not None  # asked for: track=True
                self._piped.append((tracker, batch, save if last else None))
                self._piped_bytes += batch
            if last:
                self.counters.saves_sent += 1
                self.counters.bytes_sent += save.nbytes
                self._sent += 1
                self._sent_unanswered = self._sent
                self._piping = None
                return True
            if full:
                return False
            # Hand the GIL back between messages: the caller of save() may be
            # waiting for it, and it should not wait for the whole save's sends.
            time.sleep(0)

    def _put_back(self, save: _Save) -> None:
        """Return a save none of which went to the head of the backlog, where
        a newer save of its key may replace it again unless a request that
        must see it is queued (every slot of a key not in ``_open`` has one,
        or a create save of its key, behind it)."""
        self._piping = None
        slot = _Slot(save)
        self._backlog.appendleft(slot)
        self._backlog_settled = False
        if save.key not in self._open and not any(
                isinstance(entry, _Request) and entry.release in (save.key, ALL_KEYS)
                for entry in self._backlog):
            self._open[save.key] = slot

    def _abandon_piping(self, reason: str, error: BaseException | None = None) -> None:
        """Count the save being handed over lost and let it go: a send failed,
        or the connection ended and the rest would reach a daemon that never
        saw it begin."""
        save, self._piping = self._piping, None
        if save is not None:
            self.counters.saves_lost += 1
            # The reason in the format: the log quotes an argument "a=b".
            fields = f"event=save_lost reason={reason} model=%s id=%s sent_messages=%d"
            args: list[object] = [*save.key, save.piped]
            if error is not None:
                fields += " error=%s"
                args.append(error)
            log.warning(fields, *args)
            self._release_save(save)

    def _hold_backlog(self) -> None:
        """Without a daemon (or with one shutting down): the saves in the
        backlog wait for the next one (as held saves do), the requests there
        fail now, since a caller waiting out its timeout would stall the
        generation loop."""
        if self._backlog_settled or len(self._open) == len(self._backlog):
            # Nothing to fail or coalesce: nothing was put in since the last
            # pass, or every entry is its key's open slot (each slot in
            # ``_open`` is in the backlog). Without this check each save made
            # meanwhile rebuilt the whole backlog: 3,000 saves of distinct
            # keys during a drain cost the process 4.1-5.6 s of CPU instead
            # of 3.4 s, 3,000 create saves of one key 1.41 s instead of 0.31.
            return
        leaving = self.connected.is_set()
        newest: dict[Key, _Slot] = {}
        kept: list[_Slot] = []
        dropped: set[int] = set()
        for entry in self._backlog:
            if isinstance(entry, _Slot):
                older = newest.get(entry.save.key)
                # A create save is never put in an older one's place: the
                # daemon is to see that one first (see _admit_save).
                if older is not None and not entry.save.create:
                    # The request between them is gone: nothing must see it.
                    self.counters.saves_coalesced += 1
                    self._release_save(older.save)
                    dropped.add(id(older))
                newest[entry.save.key] = entry
                kept.append(entry)
            elif entry.header is not None and not entry.future.done():
                entry.future.set_exception(
                    DaemonShuttingDown(f"the daemon at {self.endpoint} is shutting down")
                    if leaving else DaemonUnavailable(f"the daemon at {self.endpoint} went away"))
        self._backlog = deque(slot for slot in kept if id(slot) not in dropped)
        # With no request left behind them, a newer save of a key replaces
        # its slot again (the requests had taken the keys out).
        self._open = dict(newest)
        self._backlog_settled = True
        self._merge_held()

    def _merge_held(self) -> None:
        """Put each held save whose key has an open slot again in that slot's
        place at once: were the next daemon connected before the save came
        due, the older save there would go first, and be written for nothing.
        (That slot goes no sooner than the older save would have.)"""
        for key in [key for key in self._held if key in self._open]:
            self._into_open_slot(self._held.pop(key))

    def _reap(self) -> None:
        """Give back the room of what ZeroMQ has sent on, and each save's
        reservation once its last message went: at once, since a save kept
        one loop longer keeps the cache's buffers shared, and MLX would copy
        the whole cache on the next decode step."""
        while self._piped and self._piped[0][0].done:
            _tracker, nbytes, save = self._piped.popleft()
            self._piped_bytes -= nbytes
            if save is not None:
                self._release_save(save)

    def _build(self, save: _Save) -> bool:
        """Turn a queued save into its messages, and its message reservation
        from the caller's estimate into the real count."""
        build, save.build = save.build, None
        assert build is not None
        try:
            save.messages = build()
        except SaveTooLarge as exc:
            self.counters.saves_lost += 1
            log.warning("event=save_lost reason=header_too_large model=%s id=%s: %s",
                        *save.key, exc)
            return False
        except Exception:  # noqa: BLE001 - save() already returned True: count it, go on
            # save() checked the arguments and captured the cache; what fails
            # here is kvkeeper's own encoding, so the log has the traceback.
            self.counters.saves_lost += 1
            log.exception("event=save_lost reason=encode model=%s id=%s", *save.key)
            return False
        with self._lock:
            self._inflight_messages += len(save.messages) - save.count
        save.count = len(save.messages)
        return True

    def _copy_to_hold(self, save: _Save) -> bool:
        """Whether a save about to be held is copied first (``_detach``): not
        one the capture copied already, nor one whose copy would outlast a
        decode step (``DETACH_MAX_BYTES``), nor one a newer save of its key
        already waiting in the outbox replaces at once."""
        if not CAPTURE_COPY_MAX_BYTES < save.nbytes <= DETACH_MAX_BYTES:
            return False
        with self._lock:
            return not any(isinstance(item, _Save) and item.key == save.key
                           for item in self._outbox)

    def _detach(self, save: _Save) -> bool:
        """Build a save that is to wait, and copy its bytes out of MLX's
        buffers, so the capture's handles on the cache go now: while they
        live, each update of the cache copies the buffer instead of writing
        in place, on the generation loop's thread. False (counted lost)
        when building or copying failed."""
        if not self._build(save):
            return False
        try:
            save.messages = [[_copy(frame) for frame in msg] for msg in save.messages]
        except MemoryError:
            # As a failed build: save() already returned True, count it.
            self.counters.saves_lost += 1
            log.warning("event=save_lost reason=no_memory_for_copy model=%s id=%s nbytes=%d",
                        *save.key, save.nbytes)
            return False
        return True

    def _release_save(self, save: _Save) -> None:
        self._release(save.nbytes, save.count)
        save.let_go()

    def _release(self, nbytes: int, nmessages: int) -> None:
        with self._lock:
            self._inflight_bytes -= nbytes
            self._inflight_messages -= nmessages
