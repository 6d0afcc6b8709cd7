"""The client the generation loop imports: ``save()`` returns at once,
``load()`` returns a usable cache.

    with Client() as kv:
        kv.save(model_fp, session_id, cache, token_ids)   # True: handed off
        got = kv.load(model_fp, session_id)               # None on a miss
        kv.flush(timeout=30)                              # all of it durable
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import itertools
import os
import stat
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from kvkeeper import __version__, config, settings
from kvkeeper.client import mlx_part
from kvkeeper.client.channel import (
    ALL_KEYS,
    CLOSED_BY_OTHERS,
    FORKED,
    Channel,
    ClosedHere,
    DaemonShuttingDown,
    DaemonTimedOut,
    DaemonUnavailable,
    PendingReply,
    SaveTooLarge,
)
from kvkeeper.client.tokens import token_id_list
from kvkeeper.logs import get_logger
from kvkeeper.protocol import messages as m
from kvkeeper.protocol import naming
from kvkeeper.protocol import safetensors as st

if TYPE_CHECKING:
    from kvkeeper.client.codec import CacheCapture
    from kvkeeper.client.reader import CacheFileError, LoadedCache
    from kvkeeper.writebehind import WriteBehind

log = get_logger("kvkeeper.client")

GiB = 1024**3
#: Frames and messages of a save stream stay around this size: many messages
#: of a few MiB let the daemon write while it receives (see protocol.messages).
CHUNK_BYTES = 8 * 1024 * 1024
#: A message carrying at most this many bytes in several frames sends them as
#: one copied frame: each zero-copy frame costs pyzmq a tracker and a trip
#: through its garbage-collector thread (about 20 us of Python, GIL held),
#: more than copying 64 KiB; and a copy lets the cache's buffers go at once.
JOIN_BYTES = 2 * 1024 * 1024
#: A save's user metadata as JSON, at most: a quarter of the header the daemon
#: takes (messages.MAX_HEADER_BYTES), the rest left for token ids and layers.
MAX_METADATA_BYTES = 8 * 1024 * 1024
#: Keys with unsettled saves a client remembers one by one; past that, a
#: stand-in for every key makes all loads ask the daemon until a flush.
_MAX_UNSETTLED = 100_000

__all__ = ["Client", "DaemonError", "DaemonShuttingDown", "DaemonTimedOut", "DaemonUnavailable"]

_clients: weakref.WeakSet[Client] = weakref.WeakSet()
#: Saves queued for the bookkeeping (see Client._saves_made) past which a
#: save takes them in itself.
_SAVES_TAKEN_IN_AT = 1024


def _fresh_locks_in_child() -> None:
    # Another thread of the parent may have held a client's lock, or been in
    # its flush, at the fork: the child's copy would never be released, and a
    # drop (it takes the lock) or a flush would wait for ever instead of
    # failing at once as the child's channel does.
    for kv in list(_clients):
        kv._lock = threading.RLock()
        kv._flushing = threading.RLock()
        kv._close_lock = threading.RLock()
        kv._close_running = False
        if kv._closed:
            # A close() the parent was making: no thread here will finish it,
            # and the child's channel is dead already.
            kv._close_done.set()


os.register_at_fork(after_in_child=_fresh_locks_in_child)


def _codec():  # type: ignore[no-untyped-def]
    # MLX is imported on a first save or load, not with this module: the
    # commands that only talk to the daemon (stats, ls, rm, gc) work in an
    # install without the mlx extra.
    return mlx_part("codec")


class Client:
    """A connection to the kvkeeper daemon. Thread-safe.

    ``socket`` (a path, or the ``ipc://`` endpoint kvkeeper prints) defaults to
    ``$KVKEEPER_SOCKET``, the config file's or the per-user default;
    ``root`` (where ``load()`` reads files itself when the daemon is down)
    defaults to what the daemon reports, else ``$KVKEEPER_ROOT``, the config
    file's or the per-user default. A ``ValueError`` if the socket, given or
    found, cannot be used (another transport than a local socket, a path too
    long), or if the config file it is looked up in does not parse; also for
    a ``root`` whose ``~`` names no user.
    ``max_inflight_bytes`` bounds what saves may hold before the daemon has
    taken their bytes (default: a quarter of this machine's memory, or of
    its cgroup's limit in a container, at least 2 GiB); a save that does
    not fit is dropped, never waited for. A save (of up to 64 MiB) of a
    cache this client sent less than ``min_send_interval`` seconds ago waits in the
    client until then, and a newer save of the cache replaces it: ``flush()``,
    a ``load()`` or ``delete()`` of the cache, ``close()`` (also at a normal
    interpreter exit) and a save taking the in-flight budget past half send it
    at once (0 sends every save as it comes). ``timeout`` caps every wait for
    the daemon (a ``load()``'s waits together). ``cpu_policy`` "batch" (on
    Linux) runs the client's background threads under SCHED_BATCH, so they
    never take a core from the generation loop when they wake up; "normal"
    leaves them under the caller's policy (see :mod:`kvkeeper.cpupolicy`). The caller's own thread
    is never changed.
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        root: str | os.PathLike[str] | None = None,
        max_inflight_bytes: int | None = None,
        min_send_interval: float = 0.25,
        timeout: float = 10.0,
        connect_timeout: float = 1.0,
        cpu_policy: str = "batch",
    ) -> None:
        _check_path_argument("socket", socket)
        _check_path_argument("root", root)
        # Absolute, as the daemon binds it: ZeroMQ takes a relative "@name"
        # for Linux's abstract namespace, where no kvkeeper daemon listens.
        self.socket_path = _absolute("socket", config.socket_path(socket) if socket is not None
                                     else settings.client_path("socket"))
        try:
            config.check_socket_path(self.socket_path)
        except config.ConfigError as exc:  # ZeroMQ would fail later, on the I/O thread
            raise ValueError(str(exc)) from None
        if root is not None and not os.fspath(root):
            raise ValueError("root is empty")
        # Absolute too: loads read it from whatever directory is current then.
        self._root_override = (_absolute("root", config.expanded(root))
                               if root is not None else None)
        # A relative $KVKEEPER_ROOT names a directory under this one, also
        # when first read later (with a socket given, at the first load).
        try:
            self._made_in: str | None = os.getcwd()
        except FileNotFoundError:
            self._made_in = None
        # Resolved now when the socket came from the settings too (a config
        # file that cannot be used has just raised for it); with a socket
        # given, only when it is needed, and the config file cannot fail it.
        self._configured_root = (_settings_root(settings.client_path, self._made_in)
                                 if root is None and socket is None else None)
        min_send_interval = _check_seconds("min_send_interval", min_send_interval, zero_ok=True)
        timeout = _check_seconds("timeout", timeout)
        connect_timeout = _check_seconds("connect_timeout", connect_timeout, zero_ok=True)
        if max_inflight_bytes is None:
            max_inflight_bytes = settings.memory_share(2 * GiB)
        budget = _whole_bytes(max_inflight_bytes)
        if budget is None:
            raise ValueError(f"max_inflight_bytes must be a whole number of bytes > 0 (0 would "
                             f"drop every save), not {max_inflight_bytes!r}")
        max_inflight_bytes = budget
        self.timeout: float = timeout
        # Reentrant: a signal handler's call may interrupt this thread inside
        # a section that holds it (a SIGTERM handler's last save waited for
        # ever with a plain lock; saves now queue their keys without it, see
        # _saves_made).
        self._lock: threading.RLock = threading.RLock()
        self._dropped: int = 0
        self._lost_seen: int = 0
        self._failed_seen: int = 0
        self._warned: set[str] = set()
        # The root's lstat when it was last judged, and why it is not read
        # with the daemon down (see _not_private).
        self._root_judged: tuple[tuple[object, ...], str | None] | None = None
        self._throttle: _Throttle = _Throttle()
        self._closed: bool = False
        self._close_done: threading.Event = threading.Event()  # a close() returned or was cut short
        # Held by the close() under way; reentrant, and ``_close_running``
        # while it runs, so that a signal handler's close() on its thread
        # returns at once, and a close() after one cut short by Ctrl-C on
        # this thread (where the lock may not have been let go) runs.
        self._close_lock: threading.RLock = threading.RLock()
        self._close_running: bool = False
        self._close_finished: bool = False  # the channel is closed: nothing left to do
        # Keys this client saved whose saves no flush, load or delete has
        # waited for since, with the number of the last: a load of one of
        # them must ask the daemon first. A save only numbers itself and
        # queues its key (one call each, no lock): a signal handler's save
        # that interrupted this thread's bookkeeping would otherwise change
        # the table under it (a flush's pruning dropped the handler's key,
        # and a load then read the file before that save was written).
        # The readers take the queue in, under the lock (_take_in_saves).
        self._unsettled: dict[tuple[str, str], int] = {}
        self._save_numbers = itertools.count(1)
        self._saves_made: collections.deque[tuple[tuple[str, str], int]] = collections.deque()
        # The daemon run that answered the last flush that returned (its pid
        # and boot id, and channel.connections then).
        self._flush_daemon: tuple[int, float] | None = None  # (pid, boot id)
        self._flush_conn: int = -1
        # The number the channel gave the request of the last flush that
        # returned: the saves sent after it are the next flush's to answer for.
        self._flushed_seq: int = 0
        # One flush at a time: each reply carries running totals, and a reply
        # taken in after a later one would set them back (a failure would be
        # reported twice, or by the wrong flush).
        # (Reentrant only to tell a signal handler's flush() inside this
        # thread's own: see flush.)
        self._flushing: threading.RLock = threading.RLock()
        if "mlx.core" in sys.modules:
            # A program that uses MLX will save: import the codec now (8-9 ms
            # here) rather than in its first save(), inside the generation
            # loop. Without MLX loaded (the commands: ls, rm) it stays unloaded.
            with contextlib.suppress(ImportError):  # numpy missing: save() says so
                _codec()
        # The daemon's latest refusal of a save (kvkeeper import says it).
        self._refusals = _RefusalLog()
        # What the daemon connected said of itself, asked on each connection.
        self._daemon = _DaemonSaid()
        self._channel: Channel = Channel(
            config.endpoint(self.socket_path),
            max_inflight_bytes=max_inflight_bytes,
            min_send_interval=min_send_interval,
            # Not methods: the channel must not keep this client alive.
            on_refused=self._refusals,
            on_pong=self._daemon,
            # As serve's --cpu-policy and KVKEEPER_CPU_POLICY take it.
            cpu_policy=cpu_policy.lower() if isinstance(cpu_policy, str) else cpu_policy,
        )
        # A client dropped without close() would keep its I/O thread, ZeroMQ's
        # threads and a dozen descriptors for the life of the process (one
        # client per request, never closed, ran a server out of descriptors):
        # once it is collected its channel closes in the background, after
        # sending what it holds. At exit the exit hook closes it instead.
        self._finalizer: weakref.finalize[Any, Any] = weakref.finalize(self, _close_dropped, self._channel)
        self._finalizer.atexit = False
        _clients.add(self)
        # With IMMEDIATE set, a save before the connection is up would be dropped:
        # connect now, so the first save after construction goes through.
        # Which daemon answers is asked within the same connect_timeout: a
        # daemon busy decoding a huge message held the constructor up to
        # twice ``timeout``. Not learnt here, the first flush asks.
        t0 = time.monotonic()
        if self._channel.connected.wait(connect_timeout):
            try:
                conn = self._channel.connections
                self._flush_daemon = self._daemon_run(
                    connect_timeout - (time.monotonic() - t0))
                self._flush_conn = conn
            except DaemonUnavailable:
                pass

    # ------------------------------------------------------------ context manager

    def __enter__(self) -> Client:
        if self._closed:
            raise RuntimeError("client is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Give saves already handed off up to ``timeout`` to reach the daemon
        (one restarted meanwhile included; not to be written: use ``flush()``
        for that), confirmed by a ping's
        answer, then disconnect. After it, ``save()``, ``load()`` and the
        other calls raise RuntimeError (``client_stats()`` still answers). A
        normal interpreter exit does this for clients still open (their
        connections close; a ``save()`` after that is dropped), and so does
        dropping a client, in the background. A close() cut short (Ctrl-C)
        is finished by the next close(), or in the background once the
        client is dropped, else at exit. One on the client's own I/O thread
        (a ``__del__`` run by a garbage collection there) is handed to
        another thread, as if under way. One from a signal handler that
        interrupted this thread's close() returns once what was handed off
        has left (or its timeout is over), leaving the rest to that close."""
        # Checked first: a bad one found half way through left the client
        # marked closed with its I/O thread running.
        timeout = _check_seconds("timeout", timeout, zero_ok=True)
        self._closed = True
        if self._channel.on_io_thread():
            # A __del__ that a garbage collection ran on the client's I/O
            # thread: waiting there, for that very thread or for a close under
            # way, stalled it and lost the save it was sending. Another thread
            # closes the client (later close() calls wait for it).
            _close_in_background(functools.partial(self.close, timeout))
            return
        if not self._close_lock.acquire(blocking=False):
            # Another thread's close() under way: the channel's close waits
            # for it to end (in its timeout, or this one's if longer; from a
            # signal handler that interrupted this thread inside the channel,
            # it only starts the close). Waiting for the lock under this
            # call's timeout alone, a close(0.2) beside a close(3) returned
            # with 48 MiB still unsent (a review); waiting for it without
            # one, such a handler waited for that close, which waited for
            # the channel's lock this thread held: both hung (a review).
            self._channel.close(timeout)
            return
        nested = self._close_running  # a signal handler's, inside this thread's close()
        try:
            if self._close_finished:
                return
            if nested:
                # Waiting for the close under way could never end: the
                # channel gives what was handed off this call's timeout.
                self._channel.close(timeout)
                return
            try:
                self._close_running = True
                # Cut short (Ctrl-C), it raises and the next close() runs it
                # again (it returned at once, and the connection and its
                # thread stayed until exit); the client dropped meanwhile is
                # closed in the background.
                self._channel.close(timeout)
                self._finalizer.detach()
                self._close_finished = True
            finally:
                self._close_running = False
        finally:
            self._close_lock.release()
            if not nested:
                self._close_done.set()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (once it has returned, saves and loads
        raise RuntimeError; a save while it runs is dropped, reason "closed")."""
        return self._closed

    @property
    def connected(self) -> bool:
        """Whether the daemon is connected right now."""
        return self._channel.connected.is_set()

    @property
    def root(self) -> Path:
        """The store root whose files ``load()`` reads directly: while the daemon
        is up, when no save of the key through this client is pending (counted as
        ``loads_direct``); when it is down, for every load."""
        said = self._daemon.said
        root = self._root_override or (said.root if said else None) or self._configured_root
        if root is None:
            try:
                root = _settings_root(settings.client_path, self._made_in)
            except settings.SettingsError as exc:
                # Where serve would fail too, a load with the daemon down must
                # miss, not read the built-in store (maybe another daemon's):
                # $KVKEEPER_ROOT as given, else (the config file at fault) a
                # root where no store is.
                log.warning("event=root_unknown reason=%s", exc)
                root = (_settings_root(lambda _: config.default_root(), self._made_in)
                        if os.environ.get(config.ENV_ROOT) else _NO_STORE)
            self._configured_root = root
        return root

    # ------------------------------------------------------------ save

    def save(
        self,
        model: str,
        cache_id: str,
        cache: Any,
        token_ids: Sequence[int] | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        create: bool = False,
    ) -> bool:
        """Hand a snapshot of ``cache`` to the daemon and return at once.

        ``cache`` is a list of cache layers, or an object with ``.cache`` and
        ``.token_ids`` (mlx-vlm's ``PromptCacheState``). What gets written is
        the cache as it is now, even if generation goes on changing it.
        Returns True when the save was handed off, False when it was dropped:
        the daemon not running, too much already in flight, a cache larger
        than the daemon takes or than the client's in-flight budget, a client
        closing or used in a forked child; drops are counted in ``stats()``
        and logged once per reason. Raises ValueError for bad arguments,
        whether or not the save would have been dropped: among them a layer
        it cannot describe, or a float64 tensor (``mx.load`` cannot read
        those back).

        ``create=True``: written only if, when the daemon takes it in, the
        key has no entry and no save of it is on its way; else the daemon
        refuses it (``exists``: ``flush()`` returns False). A later save of
        the key replaces it as usual; it never replaces an unsent save of
        its key here, it goes after it. A daemon before kvkeeper 0.2.4
        refuses every such save (``malformed``). TypeError when ``create``
        is not True or False.
        """
        if self._close_done.is_set():
            raise RuntimeError("client is closed")
        # A save while close() runs on another thread (a server's request
        # threads at shutdown) is dropped below, reason "closed", not raised.
        layers, token_ids = _unpack(cache, token_ids)
        model, cache_id = naming.check_key(model, cache_id)
        meta = check_metadata(metadata)
        # Checked here: the header is encoded on the I/O thread, after save()
        # returned True, and the daemon refuses anything but a bool.
        config.check_flag("create", create)
        # A save about to be dropped (daemon down, or no room for any save)
        # skips the capture but not the layers' check (a walk, no evaluation):
        # a bad cache is the caller's mistake, and must not pass for a drop.
        # With no connection, a daemon restarted since has its saves wait
        # for the connection ZeroMQ makes within 0.2 s, rather than dropped.
        connected = self._channel.connected.is_set() or self._channel.daemon_returning()
        closing = self._channel.closing_elsewhere
        if (closing or not connected
                or self._channel.inflight_bytes >= self._channel.max_inflight_bytes):
            _codec().check_cache(layers)
            if self._channel.forked:
                return self._drop("forked", FORKED)
            if closing:
                # close() runs on another thread (a server's request threads at
                # shutdown), or the exit hook closed every client: the daemon may
                # be up. Taken, saves kept coming while close() waited for the
                # bytes in flight, and it waited out its whole timeout.
                return self._drop("closed", CLOSED_BY_OTHERS)
            if connected:
                return self._drop_inflight()
            # (A daemon stopped or hung is down until it answers: "no daemon
            # at" it read as if nothing were there.)
            return self._drop("daemon_down", f"no kvkeeper daemon connected at "
                                             f"{self.socket_path} (none runs there, or it "
                                             f"does not answer)")
        # Only the capture (which checks the layers) runs here; the JSON, the
        # byte runs and the messages are built on the I/O thread (_messages).
        cap = _codec().capture_cache(layers)
        # (Another daemon's limit, were it said on an earlier connection.)
        said = self._daemon.said
        limit = said.max_save_bytes if said and said.conn == self._channel.connections else None
        # Over both limits, the smaller is named (raising the other would not
        # let it through): past max_inflight_bytes, send_save() says so below.
        if limit is not None and cap.nbytes > limit <= self._channel.max_inflight_bytes:
            return self._drop("too_large", f"a save of {cap.nbytes} bytes exceeds the largest "
                                           f"save the daemon takes ({limit} bytes: its "
                                           f"--max-pending-bytes less ZeroMQ's share)")
        # Messages are only known once built; the I/O thread then corrects the
        # reservation to the real count. Bytes are what bound a save here.
        estimate = 2 + 2 * -(-cap.nbytes // CHUNK_BYTES)
        refused = self._channel.send_save(
            (model, cache_id),
            functools.partial(self._messages, model, cache_id, cap, token_ids, meta, create),
            cap.nbytes, estimate, create=create,
        )
        if refused == "full":
            return self._drop_inflight(cap.nbytes)
        if refused is not None:
            return self._drop("closed", "the client's connection was closed meanwhile")
        self._saves_made.append(((model, cache_id), next(self._save_numbers)))
        if len(self._saves_made) > _SAVES_TAKEN_IN_AT:
            # A client that never loads or flushes would keep every save's
            # entry: taken in here, each key's newest only stays. (Never from
            # a signal handler inside the lock, nor waiting for another
            # thread's turn.)
            owned = self._lock._is_owned()  # type: ignore[attr-defined]
            if not owned and self._lock.acquire(blocking=False):
                try:
                    self._take_in_saves()
                finally:
                    self._lock.release()
        return True

    def write_behind(
        self,
        model: str,
        cache_id: str,
        *,
        every_tokens: int | None = 64,
        every_seconds: float | None = 2.0,
        save_first: bool = True,
        metadata: Mapping[str, str] | None = None,
    ) -> WriteBehind:
        """A helper a streaming loop calls once per token (``step(cache,
        token_ids)``, then ``close()``); see :mod:`kvkeeper.writebehind`.
        Raises RuntimeError once the client is closed (its every save would
        be dropped)."""
        from kvkeeper.writebehind import WriteBehind

        if self._close_done.is_set():
            raise RuntimeError("client is closed")

        return WriteBehind(self, model, cache_id, every_tokens=every_tokens,
                           every_seconds=every_seconds, save_first=save_first,
                           metadata=metadata)

    def _messages(
        self,
        model: str,
        cache_id: str,
        cap: CacheCapture,
        token_ids: list[int] | None,
        user: dict[str, str],
        create: bool,
    ) -> list[list[bytes | memoryview]]:
        """The save stream of a capture: a SaveBegin, then SaveData messages of
        at most CHUNK_BYTES. Runs on the channel's I/O thread."""
        snap = _codec().encode_capture(cap)
        save_id = self._channel.next_save_id()
        self._refusals.sent(save_id, (model, cache_id))
        meta = {
            st.LAYERS_KEY: snap.layers,
            st.TOKENS_KEY: msgspec.json.encode(token_ids).decode(),
            st.TOKEN_COUNT_KEY: str(len(token_ids or ())),
        }
        if user:
            meta[st.USER_KEY] = msgspec.json.encode(user).decode()
        begin = m.SaveBegin(
            v=m.PROTOCOL_VERSION,
            save=save_id,
            model=model,
            cache_id=cache_id,
            tensors=[m.TensorSpec(t.name, t.dtype, list(t.shape)) for t in snap.tensors],
            metadata=meta,
            create=create,
        )
        header = m.encode(begin)
        if len(header) > m.MAX_HEADER_BYTES:
            # The daemon could not take it (ZeroMQ would drop the connection,
            # and the saves queued behind it): counted lost, with this reason.
            raise SaveTooLarge(f"the save's header is {len(header)} bytes (token ids, "
                               f"metadata, layers); the daemon takes at most "
                               f"{m.MAX_HEADER_BYTES}")
        messages: list[list[bytes | memoryview]] = [[header]]
        frames: list[memoryview | bytes] = []
        size = 0

        def cut() -> None:
            nonlocal frames, size
            if frames:
                if len(frames) > 1 and size <= JOIN_BYTES:
                    frames = [b"".join(frames)]
                head = m.encode(m.SaveData(v=m.PROTOCOL_VERSION, save=save_id, frames=len(frames)))
                messages.append([head, *frames])
                frames, size = [], 0

        for tensor in snap.tensors:
            for run in tensor.runs:
                for off in range(0, len(run), CHUNK_BYTES):
                    piece = run[off : off + CHUNK_BYTES]
                    if size + len(piece) > CHUNK_BYTES or len(frames) >= m.MAX_FRAMES_PER_MESSAGE:
                        cut()
                    frames.append(piece)
                    size += len(piece)
        cut()
        return messages

    def _drop_inflight(self, nbytes: int | None = None) -> bool:
        limit = self._channel.max_inflight_bytes
        if nbytes is not None and nbytes > limit:
            # No wait would let it through: say so, rather than blame the
            # saves in flight (there may be none).
            return self._drop("larger_than_inflight",
                              f"a save of {nbytes} bytes is larger than max_inflight_bytes "
                              f"({limit}); a save that size is always dropped")
        inflight = self._channel.inflight_bytes
        if nbytes is not None and inflight + nbytes <= limit:
            # The bytes fit: the cap on messages in flight (ZeroMQ's queue) did not.
            return self._drop("inflight", "too many messages already in flight "
                                          "(many small saves not yet sent)")
        then = (" reach" if nbytes is None
                else f"; this save of {nbytes} bytes would pass")
        return self._drop("inflight", f"{inflight} bytes already in "
                                      f"flight{then} max_inflight_bytes ({limit})")

    def _drop(self, reason: str, message: str) -> bool:
        with self._lock:
            self._dropped += 1
        self._warn_once(reason, "event=save_dropped reason=%s detail=%s: logged once per reason",
                        reason, message)
        return False

    # ------------------------------------------------------------ load

    def load(
        self, model: str, cache_id: str, *, verify: bool = True
    ) -> LoadedCache | None:
        """Return the saved cache, or None when there is none (or it is unusable:
        wrong model, failed checksum, unknown class; the reason is logged).

        Every save of this key made through this client is written first
        (read-your-writes); so is any save of it the daemon has received by
        then, when this client has one pending too. Saves made through other
        clients are certain to be seen once their ``flush()`` has returned.
        When the daemon is down, or goes away while the load waits, reads the
        file directly (logged when this client's last save of the key may not
        be in it); while it drains before exiting, with a save of the key
        kept here for the next daemon, returns what the draining one has
        (logged). Raises DaemonTimedOut (a DaemonUnavailable) when the
        daemon does not answer within ``timeout`` while a save of the key
        made through this client may still be unwritten (the file may be
        older than it), DaemonUnavailable when another thread closes the
        client while the load waits for such a save, and at once in a child
        process forked after this client was made. After the
        connection to the daemon was lost since the last flush, a load of a
        key saved meanwhile returns what the daemon has, logged as possibly
        older (``event=load_may_be_stale``) until a flush tells; so does a
        load of a key whose last save the daemon refused. With the daemon
        down, a root ``serve`` would refuse as not private is not read.
        ``verify`` checks every tensor's checksum (reads the whole file) and the
        header's (token ids, metadata); off, the arrays stay lazy (each is read
        from the file when first evaluated), and neither is checked.
        """
        if self._closed:
            raise RuntimeError("client is closed")
        model, cache_id = naming.check_key(model, cache_id)
        # verify="no" would be true: checked, where a lazy load was asked for.
        config.check_flag("verify", verify)
        if self._channel.forked:
            # Not a read of the file instead, as with no daemon: a verified
            # read evaluates MLX arrays, which can hang in a forked child.
            raise DaemonUnavailable(FORKED)
        key = (model, cache_id)
        # One timeout for every wait of the load (who the daemon is, the
        # file, moving a damaged file aside): a stalled daemon used to cost
        # a timeout per request.
        deadline = time.monotonic() + self.timeout
        direct_ok = self._can_read_directly(key, deadline)  # first: it may learn a new root
        guess = _entry_path(self.root, model, cache_id)
        if direct_ok:
            # Nothing of ours to wait for: read the daemon's file without asking
            # it (a round trip is 0.2-0.7 ms, a lazy read about as long), and
            # tell it afterwards, so the load still counts for eviction. A
            # missing or odd file is for the daemon to judge.
            direct = _read(guess, verify, model, cache_id)
            if direct.ident is not None and stat.S_ISREG(direct.ident.st_mode):
                self._channel.notify(m.Used(v=m.PROTOCOL_VERSION, model=model,
                                            cache_id=cache_id, ino=direct.ident.st_ino))
                return self._conclude(model, cache_id, direct, deadline)
        mark, untracked = self._unsettled_mark(key)
        if mark is not None:
            unwritten = (f"a save of {model}/{cache_id} made through this client may not "
                         f"be written yet")
        elif untracked:
            unwritten = (f"this client has saves of over {_MAX_UNSETTLED} keys no flush() "
                         f"has waited for, and no longer tracks which keys: one of "
                         f"{model}/{cache_id} may be among them, unwritten")
        else:
            unwritten = None
        try:
            pending = self._channel.send_request(
                lambda req: m.Load(v=m.PROTOCOL_VERSION, req=req, model=model, cache_id=cache_id),
                release=key, wait=_left(deadline),
            )
        except DaemonUnavailable as exc:
            _raise_if_in_doubt(exc, unwritten, self._channel.connected.is_set())
            return self._read_instead(model, cache_id, exc, unwritten,
                                      lambda: _read(guess, verify, model, cache_id), deadline)
        # A lazy read costs about as much as the daemon's answer (which comes
        # after any save of this key it holds is written): do it meanwhile, at
        # the path the daemon keeps the key at, and keep it if the answer names
        # that very file, unchanged. A verified read is far longer than the
        # answer, and would be wasted whenever a newer version is on its way.
        early = None if verify else _read(guess, verify, model, cache_id)
        kept = False
        try:
            try:
                reply = self._reply(self._channel.wait(pending, _left(deadline)))
            except DaemonShuttingDown as exc:
                # Our save of the key waits for the next daemon. The draining
                # one still answers with what it has (a save of the key it
                # received is written first), which the file may not hold yet.
                kept = True
                unwritten = unwritten or "a save of it waits in this client"
                log.warning("event=load_before_save model=%s id=%s reason=%s: %s", model,
                            cache_id, exc, unwritten)
                reply = self._request(lambda req: m.Load(
                    v=m.PROTOCOL_VERSION, req=req, model=model, cache_id=cache_id),
                    _left(deadline))
        except DaemonUnavailable as exc:
            _raise_if_in_doubt(exc, unwritten, self._channel.connected.is_set())
            # (The early read only if no newer file replaced it meanwhile:
            # the daemon may have died right after writing our save.)
            return self._read_instead(
                model, cache_id, exc, unwritten,
                lambda: early if early is not None and early.still_current()
                else _read(guess, verify, model, cache_id), deadline)
        if not kept:
            lost = self._lost_since_flush(pending, key) if unwritten else None
            if lost is None:
                self._settled(key, mark)
            else:
                # The daemon answered for what it has; a save of ours sent to
                # one that went away may be gone. Until a flush says, every
                # load of the key asks, and says so.
                log.warning("event=load_may_be_stale model=%s id=%s reason=%s: %s since the "
                            "last flush, and %s: the file may be older than it", model,
                            cache_id, lost, _LOST_BECAUSE[lost], unwritten)
        if not isinstance(reply, m.Found) or not reply.path:
            return None
        path = Path(reply.path)
        if early is None or path != guess or not early.still_current():
            early = _read(path, verify, model, cache_id)
        return self._conclude(model, cache_id, early, deadline)

    def _lost_since_flush(self, pending: PendingReply, key: tuple[str, str]) -> str | None:
        """Why saves handed off since the last flush that returned may be lost
        for all the daemon answering ``pending`` knows (None: they are not):
        one was lost on its way (half sent when a connection ended), the
        daemon refused ``key``'s last save (busy, too large), a connection
        ended before the daemon read them, or one ended with saves sent on
        it and no drain answering for them (the daemon may have been
        restarted), or the answer came on a later connection than the request
        went on. A flush tells which, with a round trip or two more. (Which
        keys a loss took is not known: any key saved since the last flush is
        in doubt.)"""
        if self._channel.counters.saves_lost > self._lost_seen:
            return "save_lost"
        if self._refusals.refused(key):
            return "save_refused"
        if self._channel.unread_losses(since=self._flushed_seq, before=pending):
            return "connection_lost"
        if self._channel.connections != pending.conn or any(
                end.vouched() is None for end in self._channel.ended_with_saves(
                    since=self._flushed_seq, before=pending)):
            return "daemon_restarted"
        return None

    def _read_instead(self, model: str, cache_id: str, why: DaemonUnavailable,
                      unwritten: str | None, read: Callable[[], _Attempt],
                      deadline: float) -> LoadedCache | None:
        """load()'s answer from the file ``read()`` reads, the daemon being
        gone; ``unwritten`` says why a save of ours may be missing from it."""
        # Throttled: with the daemon down a while, every load of a key saved
        # since comes here (4,800 lines in a few seconds of a helper's run).
        if unwritten and (quiet := self._throttle.let_through("load_from_file")) is not None:
            log.warning("event=load_from_file model=%s id=%s reason=%s not_logged_since=%d: the "
                        "file may be older than this client's saves: %s", model, cache_id, why,
                        quiet, unwritten)
        if not _holds_a_store(self.root):
            # Every load would be a silent miss: say once where it looked.
            # (In the format, not an argument: the log quotes arguments with spaces.)
            whose = ("given as Client(root=...)" if self._root_override is not None
                     else "the root the daemon would use; Client(root=...) names another")
            self._warn_once("no_store", f"event=load_from_file reason=%s: no store at %s to "
                            f"read instead ({whose}); loads miss until the daemon is back",
                            why, self.root)
            # Not read all the same: a sessions/ made meanwhile, in a root
            # not judged, was read (a rename loop in a 777 root: 553 loads
            # of 394,725).
            return None
        if (refused := self._not_private()) is not None:
            # With no daemon to vouch for it, a store others can write in
            # (or not ours) may hold anyone's file under the key: what serve
            # refuses, a read refuses too, before reading a byte of it.
            self._warn_once("root_refused", "event=load_from_file reason=%s: not reading the "
                            "store itself: %s; loads miss until the daemon is back", why, refused)
            return None
        return self._conclude(model, cache_id, read(), deadline)

    def _not_private(self) -> str | None:
        """Why the root is no store to read with the daemon down (one serve
        refuses: a symlink, not ours, open to others; a read-only one is
        read), else None. Judged again only when the root's lstat changes
        (the judgement, two realpaths and more, was 48 us of each load)."""
        root = self.root
        try:
            st = os.lstat(root)
        except OSError:
            return None  # nothing there: the read misses anyway
        ident = (root, st.st_dev, st.st_ino, st.st_mode, st.st_uid)
        judged = self._root_judged
        if judged is None or judged[0] != ident:
            try:
                config.check_ours(root, "root directory", writable=False)
                judged = (ident, None)
            except config.ConfigError as exc:
                judged = (ident, str(exc))
            self._root_judged = judged
        return judged[1]

    def _warn_once(self, what: str, fmt: str, *args: object) -> None:
        """Log ``fmt`` the first time ``what`` happens to this client."""
        with self._lock:
            first = what not in self._warned
            self._warned.add(what)
        if first:
            log.warning(fmt, *args)

    def _can_read_directly(self, key: tuple[str, str], deadline: float) -> bool:
        """Whether a load of ``key`` may skip the daemon: it is connected, this
        client has no save of the key it has not waited for, and the root was
        named by the daemon on this very connection (not an older daemon's)."""
        mark, untracked = self._unsettled_mark(key)
        if not self._channel.connected.is_set() or mark is not None or untracked:
            return False
        # Half the time left at most: one that never answers took it all,
        # and the load's own request got 0 s.
        said = self._daemon_here(min(_left(deadline) / 2, 2.0))
        # The Used notice is new in this version: an older daemon would refuse it.
        return said is not None and self.root == said.root and said.version == __version__

    def _daemon_here(self, timeout: float) -> _DaemonFacts | None:
        """What the daemon on this very connection said of itself (not an
        older daemon's), asked now within ``timeout`` if it has not said
        yet; None when it does not answer."""
        said = self._daemon.said
        if said is None or said.conn != self._channel.connections:
            try:
                self.ping(timeout)
            except DaemonUnavailable:
                return None
            said = self._daemon.said
        return said

    def _settled(self, key: tuple[str, str], mark: int | None) -> None:
        """The daemon answered for every save of ``key`` up to ``mark``."""
        nested = self._lock._is_owned()  # type: ignore[attr-defined]
        with self._lock:
            if nested or mark is None:
                return  # (see _unsettled_mark: left for the next call)
            self._take_in_saves()
            if self._unsettled.get(key) == mark:
                self._unsettled.pop(key, None)

    def _unsettled_mark(self, key: tuple[str, str]) -> tuple[int | None, bool]:
        """The number of this client's last save of ``key`` that no flush,
        load or delete has waited for (None: none), and whether the client no
        longer tells keys apart (past _MAX_UNSETTLED). The saves queued since
        are entered first, but by a call made inside the client's lock on
        the same thread (a signal handler's, a finalizer's): the table is the
        interrupted section's to change (a handler's change was lost with
        the table a flush was replacing), so such a call reads the queue too."""
        nested = self._lock._is_owned()  # type: ignore[attr-defined]
        with self._lock:
            if not nested:
                self._take_in_saves()
            mark = self._unsettled.get(key)
            if nested:
                queued = [n for k, n in list(self._saves_made) if k == key]
                if queued:
                    mark = max([mark or 0, *queued])
            return mark, ALL_KEYS in self._unsettled

    def _take_in_saves(self) -> None:
        """Enter the saves made since into ``_unsettled`` (lock held, and not
        by a call nested in a section holding it: see _unsettled_mark)."""
        made = self._saves_made
        while made:  # (only the lock's first holder takes them out)
            key, n = made[0]
            if len(self._unsettled) >= _MAX_UNSETTLED:
                # Past this many keys, every load asks the daemon until a flush
                # covering them all: the largest number entered, or this one
                # (numbers may be queued out of order: a smaller one here let a
                # flush settle a newer save of another thread's).
                top = max([n, *self._unsettled.values()])
                self._unsettled.clear()
                self._unsettled[ALL_KEYS] = top
            # The largest: numbers are taken, then queued, in two steps.
            self._unsettled[key] = max(n, self._unsettled.get(key, 0))
            # Let go of only once entered: a Ctrl-C in between leaves it to
            # the next call (entering it twice changes nothing).
            made.popleft()

    def _conclude(self, model: str, cache_id: str, attempt: _Attempt,
                  deadline: float) -> LoadedCache | None:
        """What load() returns for a read: the cache, or None with the reason
        logged (and a damaged file reported to the daemon, whose answer is
        waited for until ``deadline``: the request goes out either way)."""
        if attempt.error is None:
            return attempt.loaded
        exc = attempt.error
        log.warning("event=load_miss model=%s id=%s reason=%s", model, cache_id, exc,
                    extra={"kvkeeper_reason": str(exc)})  # as said, not as quoted for the log
        if exc.damaged and attempt.ident is not None:
            self._report_damaged(model, cache_id, attempt.ident, str(exc), deadline)
        return None

    def _report_damaged(self, model: str, cache_id: str, ident: os.stat_result,
                        reason: str, deadline: float) -> None:
        """Ask the daemon to move a bad file aside (it is the only writer)."""
        wait = _left(deadline)
        try:
            reply = self._request(lambda req: m.Quarantine(
                v=m.PROTOCOL_VERSION, req=req, model=model, cache_id=cache_id,
                ino=ident.st_ino, mtime_ns=ident.st_mtime_ns, reason=reason[:4000]), wait)
            if isinstance(reply, m.Deleted) and reply.existed:
                # Into the daemon's root, which Client(root=...) may not be.
                said = self._daemon.said
                where = (said.root if said else self.root) / naming.QUARANTINE_DIR
                # (The answer does not say the file's new name: its directory.)
                log.info("event=moved_aside model=%s id=%s: the daemon moved the file into %s/",
                         model, cache_id, where, extra={"kvkeeper_moved_to": str(where)})
        except DaemonTimedOut:
            # Sent all the same: the daemon moves the file when it gets to it.
            log.info("event=quarantine_requested model=%s id=%s: not waited for (%s)",
                     model, cache_id, "the load's timeout was spent" if wait == 0
                     else f"no answer within {wait:.3g} s")
        except (DaemonUnavailable, DaemonError, RuntimeError) as exc:
            # (RuntimeError: the client closed meanwhile, by another thread.)
            log.info("event=quarantine_not_done model=%s id=%s error=%s", model, cache_id, exc)

    # ------------------------------------------------------------ the rest

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until every save handed off so far is resolved.

        Returns True when every save handed off since the last ``flush()`` that
        returned was written (or replaced by a newer save of the same key, from
        any client, that was, or by a delete that was done), False when any of
        them, or what replaced it, was refused, lost or failed (the log says
        which), or when the daemon was restarted after some of them were sent
        to it without draining (saves the old one had not written are gone,
        and the new one cannot tell; those still waiting in the client go to
        the new one), or a connection ended before the daemon had read the
        saves sent on it. A daemon that drained answered a flush of the
        client's own once it had settled them: that answer counts. Raises
        DaemonUnavailable when the daemon is down or goes away while the flush
        waits, its subclass DaemonTimedOut when it does not answer in
        ``timeout`` seconds (it may still be up: ``flush(0)`` always ends so,
        an answer taking a round trip), and its subclass
        DaemonShuttingDown at once when the daemon drains before exiting
        while saves wait here for the next one; the saves it covered
        are then answered for by the next flush that returns; DaemonError
        when the daemon refuses it (busy: too many requests waiting) or
        fails answering it (internal). Flushes from several threads take
        turns; the wait for a turn counts in ``timeout``.
        """
        t0 = time.monotonic()
        timeout = _check_seconds("timeout", timeout, zero_ok=True)
        if self._channel.forked:
            # The parent's flush may have held the turn at the fork: the
            # child's requests fail at once, and so does this one.
            raise DaemonUnavailable(FORKED)
        if self._flushing._is_owned():  # type: ignore[attr-defined]
            # A signal handler's flush() on the thread whose flush() it
            # interrupted: it would wait out its timeout for the turn that
            # flush holds, and hold that one up as long.
            raise RuntimeError("flush() from a signal handler that interrupted this thread's "
                               "own flush(): it cannot end before that one does")
        if not self._flushing.acquire(timeout=timeout):
            raise DaemonTimedOut(f"another flush of this client did not end within "
                                 f"{timeout} s")
        try:
            return self._flush(max(0.0, timeout - (time.monotonic() - t0)))
        finally:
            self._flushing.release()

    def _flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        # Every save handed off so far has a smaller number, every later one
        # a larger.
        mark = next(self._save_numbers)
        if self._closed:
            raise RuntimeError("client is closed")
        pending = self._channel.send_request(
            lambda req: m.Flush(v=m.PROTOCOL_VERSION, req=req), release=ALL_KEYS, wait=timeout)
        reply = self._reply(self._channel.wait(pending, _left(deadline)))
        assert isinstance(reply, m.Flushed)
        restarted = False
        # The connection the flush went on: the channel may be on a later one
        # by now, whose daemon must not answer for this one's.
        conn = pending.conn
        run = self._flush_daemon
        if conn != self._flush_conn:
            # Reconnected since the last flush: to the same daemon, or to a new
            # one, which knows nothing of what the old one had not written and
            # counts its totals from zero. Its pid and boot id tell which.
            # Within what is left of the flush's timeout (it took up to
            # three times that: the flush, then a ping and a stats request
            # with the whole timeout each), but at least a second of it (or
            # all of a shorter timeout): a flush answered just in time must
            # not then fail for want of a round trip.
            run = self._daemon_run(max(deadline - time.monotonic(), min(timeout, 1.0)))
            # Never having learnt which daemon took the saves before (the
            # client was made before one answered) counts as a restart: only
            # saves sent on this connection are then vouched for.
            restarted = self._flush_daemon is None or run != self._flush_daemon
            if self._channel.connections != conn:
                # Asked on a later connection: which daemon answered the flush
                # is not known, so the next flush counts as after a restart.
                restarted, run = True, None
        with self._lock:
            # Running totals: what went wrong since the last flush that returned
            # (the daemon counts refusals with failures: their replies can be lost).
            lost_total = pending.lost
            lost = lost_total - self._lost_seen
            failed_seen = 0 if restarted else self._failed_seen
            # A smaller total also means a new daemon (one this check missed).
            failed = _added_since(reply.failed, failed_seen)
            # Saves sent since the last flush on an earlier connection may have
            # gone to a daemon that went away: nothing can confirm them (those
            # still waiting in the client then went to this one, which
            # answers for them). The same daemon, on a new connection,
            # answers for every save it read on the old one; those the old
            # one took with it unread are the channel's to say.
            unread = self._channel.unread_losses(since=self._flushed_seq, before=pending)
            unvouched = False
            if restarted:
                # Saves sent on earlier connections went to a daemon that
                # went away: only one that drained (its flush answered once
                # the drain had settled them) answers for them, with its
                # failures since the last flush.
                for end in self._channel.ended_with_saves(since=self._flushed_seq,
                                                          before=pending):
                    vouched = end.vouched()
                    if vouched is None:
                        unvouched = True
                        continue
                    drained, total = vouched
                    failed += _added_since(
                        total, self._failed_seen if drained == self._flush_daemon else 0)
            unconfirmed = unread > 0 or unvouched
        if unconfirmed:
            log.warning("event=flush_unconfirmed reason=%s: the connection to the daemon was "
                        "lost since the last flush (%s); saves handed off before may be lost",
                        "daemon_restarted" if restarted else "connection_lost",
                        "it was restarted" if restarted else
                        "the connection ended before the daemon read the last saves")
        refused = self._refusals.any_up_to(pending.last_save)
        answer = failed == 0 and lost == 0 and not unconfirmed and not refused
        nested = self._lock._is_owned()  # type: ignore[attr-defined]
        with self._lock:
            # The answer settled these keys, whatever comes next; but for a
            # flush nested in a section holding the lock (a signal handler's
            # inside a load's): the table is that section's (they stay, and
            # their loads ask the daemon until the next flush).
            if not nested:
                self._take_in_saves()
                self._unsettled = {k: n for k, n in self._unsettled.items() if n > mark}
        # Stored last, by plain assignments with no call between them
        # (Python raises a pending KeyboardInterrupt at calls, the end of a
        # with block included): a flush cut short before (Ctrl-C, even in
        # the log line above, or in the pruning) leaves the next one to
        # report the same losses, failures and restart. One landing after
        # them (at flush()'s release of its turn, or as the caller takes
        # the answer) loses this answer: Python hands no value back
        # atomically. Only flushes, which take turns, use these.
        self._lost_seen = lost_total
        self._failed_seen = reply.failed
        self._flush_daemon, self._flush_conn = run, conn
        self._flushed_seq = pending.seq
        # Past the stored answer: cut short here, a reported refusal is
        # reported again by the next flush (False), as for a flush that
        # raised. (Not those of saves sent after the flush.)
        self._refusals.forget(up_to=pending.last_save)
        return answer

    def delete(self, model: str, cache_id: str) -> bool:
        """Delete an entry (after any pending save of it); True if it existed,
        or a save of it was on its way (which the delete replaces)."""
        model, cache_id = naming.check_key(model, cache_id)
        mark, _ = self._unsettled_mark((model, cache_id))
        reply = self._request(
            lambda req: m.Delete(v=m.PROTOCOL_VERSION, req=req, model=model, cache_id=cache_id),
            release=(model, cache_id),
        )
        assert isinstance(reply, m.Deleted)
        self._settled((model, cache_id), mark)
        return reply.existed

    def entries(self, model: str | None = None, *, everything: bool = False) -> list[m.Entry]:
        """Every stored entry (of one model, if given), least recently used first:
        id, tokens, bytes, saved, last used. ``everything`` adds the files under
        the root that are not entries (``kind``: legacy, quarantine, foreign)."""
        if model is not None:
            naming.check_id(model, "model")
            model = naming.plain(model)
        # The daemon cannot decode another value, and its answer names no
        # request: the call would wait out its timeout.
        config.check_flag("everything", everything)
        reply = self._request(lambda req: m.ListEntries(
            v=m.PROTOCOL_VERSION, req=req, model=model, everything=everything))
        assert isinstance(reply, m.Entries)
        return reply.entries

    def gc(self) -> m.Evicted:
        """Re-read the root and apply the daemon's disk budget now. The
        reply's ``entries`` went; ``free_bytes`` is -1 where the store's disk
        has no size (ramfs) or cannot be looked at."""
        reply = self._request(lambda req: m.Gc(v=m.PROTOCOL_VERSION, req=req))
        assert isinstance(reply, m.Evicted)
        return reply

    def stats(self) -> dict[str, float]:
        """The daemon's counters, plus this client's own under ``client_*``.
        Counts and sizes are ints; times (``*_seconds*``, ``uptime_s``) floats."""
        reply = self._request(lambda req: m.GetStats(v=m.PROTOCOL_VERSION, req=req))
        assert isinstance(reply, m.Stats)
        out = {name: _number(name, value) for name, value in reply.counters.items()}
        out.update(self.client_stats())
        return out

    def client_stats(self) -> dict[str, int]:
        """This client's own counters (``client_*``); asks no daemon, and works
        after ``close()``."""
        c = self._channel.counters
        return {
            "client_saves_sent": c.saves_sent,
            "client_saves_dropped": self._dropped,
            "client_saves_lost": c.saves_lost,
            "client_saves_refused": c.saves_refused,
            "client_saves_coalesced": c.saves_coalesced,
            "client_drain_notices": c.drain_notices,
            "client_bytes_sent": c.bytes_sent,
            "client_inflight_bytes": self._channel.inflight_bytes,
            "client_held_saves": self._channel.held_saves,
        }

    def _daemon_run(self, timeout: float) -> tuple[int, float]:
        """Which run of which daemon answers: its pid and boot id, both asked
        within ``timeout`` in all. A pid alone does not tell a restart (a
        container's pid 1 is always 1); a daemon older than the boot id
        reports 0 for it."""
        timeout = max(0.0, timeout)
        deadline = time.monotonic() + timeout
        # Half for the ping at most: one not answered took it all, and the
        # second request was given 0 s.
        pid = self.ping(timeout / 2).pid
        reply = self._request(lambda req: m.GetStats(v=m.PROTOCOL_VERSION, req=req),
                              _left(deadline))
        assert isinstance(reply, m.Stats)
        return pid, reply.counters.get("boot_id", 0.0)

    def ping(self, timeout: float | None = None) -> m.Pong:
        """Ask the daemon who it is; raises DaemonUnavailable."""
        if timeout is not None:
            timeout = _check_seconds("timeout", timeout, zero_ok=True)
        # (What it says of the daemon the channel records, with the
        # connection the ping went on.)
        reply = self._request(lambda req: m.Ping(v=m.PROTOCOL_VERSION, req=req), timeout)
        assert isinstance(reply, m.Pong)
        return reply

    def _request(self, make: Any, timeout: float | None = None, *,
                 release: tuple[str, str] | None = None) -> m.Reply:
        if self._closed:
            raise RuntimeError("client is closed")
        return self._reply(self._channel.request(
            make, self.timeout if timeout is None else timeout, release=release))

    @staticmethod
    def _reply(reply: m.Reply) -> m.Reply:
        if isinstance(reply, m.Error):
            if reply.code == "shutting_down":
                # A delete the draining daemon refuses: unavailable, as
                # for a request behind a save kept for the next daemon, so
                # code riding out a restart catches both alike.
                raise DaemonShuttingDown(reply.message)  # "the daemon is shutting down"
            raise DaemonError(reply.code, reply.message)
        return reply


class _Throttle:
    """Lets one log line per reason through at once, then at most one per
    LOG_EVERY_SECONDS, with the count of those held back since (a daemon
    shutting down refuses every save; a daemon down for a while makes every
    load read the file: the counts are in ``stats()``)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self._lock = threading.RLock()  # (as Client._lock: a signal handler may log too)

    def let_through(self, reason: str) -> int | None:
        """The lines of ``reason`` held back since the last one, or None when
        this one is held back too."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < LOG_EVERY_SECONDS:
                self._quiet[reason] = self._quiet.get(reason, 0) + 1
                return None
            self._last[reason] = now
            return self._quiet.pop(reason, 0)


class _DaemonFacts(NamedTuple):
    root: Path
    version: str
    max_save_bytes: int
    conn: int  # the channel's connection it was said on


class _DaemonSaid:
    """What the daemon said of itself last (a Pong: the channel asks on each
    new connection, ping() too), in one piece; set on the channel's I/O
    thread, as it takes the Pongs in, in order. Holds nothing of the client:
    the channel must not keep it alive."""

    said: _DaemonFacts | None = None

    def __call__(self, pong: m.Pong, conn: int) -> None:
        self.said = _DaemonFacts(Path(pong.root), pong.version, pong.max_save_bytes, conn)


class _RefusalLog(_Throttle):
    """Logs the daemon's refusals of saves, throttled per code, and keeps the
    latest, and the keys whose last save was refused (a load of one may find
    an older file). Holds nothing of the client: the channel must not keep
    it alive."""

    last: m.SaveRefused | None = None
    #: Saves sent whose refusal could still come: the newest this many (an
    #: older one's refusal names no key, and marks none); keys marked at most.
    KEPT = 4096

    def __init__(self) -> None:
        super().__init__()
        self._sent: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
        # Key -> (its newest save number sent, how many of its saves are in
        # _sent): a refusal asks whether a newer save of its key went since
        # at once (scanning _sent took 0.24 ms a refusal, 1 s of the I/O
        # thread for a queue's 4096).
        self._newest: dict[tuple[str, str], tuple[int, int]] = {}
        # Key -> the number of its save refused; neither saved again nor
        # reported by a flush since.
        self._refused: dict[tuple[str, str], int] = {}
        # The numbers of the saves refused that no flush has reported (a
        # heap): a flush covering one says False whatever the daemon's
        # totals say (see any_up_to).
        self._unreported: list[int] = []

    def sent(self, save_id: int, key: tuple[str, str]) -> None:
        """A save of ``key`` is built as ``save_id``: its fate is to be told,
        not an older save's (on the I/O thread, as refusals are taken in:
        from save(), a refusal of this very save could come first)."""
        with self._lock:  # (a flush's forget() runs on another thread)
            self._refused.pop(key, None)
        self._sent[save_id] = key
        self._newest[key] = (save_id, self._newest.get(key, (0, 0))[1] + 1)
        if len(self._sent) > self.KEPT:
            self._untrack(self._sent.popitem(last=False)[1])

    def _untrack(self, key: tuple[str, str]) -> None:
        newest, count = self._newest[key]
        if count > 1:
            self._newest[key] = (newest, count - 1)
        else:
            del self._newest[key]

    def refused(self, key: tuple[str, str]) -> bool:
        """Whether ``key``'s last save is one the daemon refused."""
        return key in self._refused

    def forget(self, up_to: int) -> None:
        """A flush reported the refusals of saves numbered up to ``up_to``."""
        with self._lock:
            self._refused = {k: n for k, n in self._refused.items() if n > up_to}
            while self._unreported and self._unreported[0] <= up_to:
                heapq.heappop(self._unreported)

    def any_up_to(self, last: int) -> bool:
        """Whether a save numbered up to ``last`` was refused since the last
        flush that returned. The daemon's running total of a client's
        failures tells a flush as much, but the daemon keeps 10,000 clients'
        totals: once 10,000 others had each had a failure, it forgot this
        one's, began it again at 1, which was the total this client last
        saw, and the flush said True for a save refused (a review)."""
        with self._lock:
            return bool(self._unreported) and self._unreported[0] <= last

    def __call__(self, reply: m.SaveRefused) -> None:
        self.last = reply
        with self._lock:
            heapq.heappush(self._unreported, reply.save)
            if len(self._unreported) > 2 * self.KEPT:
                # A client that never flushes: the oldest are kept, which the
                # next flush covers (the daemon's totals tell of the rest).
                self._unreported = heapq.nsmallest(self.KEPT, self._unreported)
        key = self._sent.pop(reply.save, None)
        newer = False
        if key is not None:
            # A newer save of the key sent since (a write's failure is told
            # once it is tried, after later saves may have gone): that one
            # is the key's last.
            newer = self._newest[key][0] > reply.save
            self._untrack(key)
        if key is not None and not newer:
            with self._lock:
                # The newest of its saves refused: an older one's failure,
                # told later, must not make a flush that reports only that
                # one clear the mark of a newer one (a review).
                self._refused[key] = max(self._refused.get(key, 0), reply.save)
                if len(self._refused) > self.KEPT:
                    del self._refused[next(iter(self._refused))]
        quiet = self.let_through(reply.code)
        if quiet is not None:
            model, cache_id = key or ("?", "?")
            # A field of its own: appended to detail, it broke the line's logfmt.
            log.warning("event=save_refused model=%s id=%s code=%s detail=%s "
                        "not_logged_since=%d", model, cache_id, reply.code, reply.message, quiet)


def _number(name: str, value: float) -> float:
    """A daemon counter as it travelled (every one a float): whole counts
    and sizes back to int (a script comparing saves_written to 3 must not
    meet 3.0), times left floats."""
    if "seconds" in name or name.endswith("_s") or not float(value).is_integer():
        return value
    return int(value)


#: At most one log line per refusal code (and per throttled event) in this many seconds.
LOG_EVERY_SECONDS = 60.0


def _close_in_background(close: Callable[[], None]) -> None:
    """Run ``close`` on a thread of its own. Not a daemon thread (said
    outright: this often runs on the client's I/O thread, which is one): an
    exit meanwhile waits for it, at most the close timeout and 5 s, as it
    would for the exit hook's close."""
    try:
        threading.Thread(target=close, name="kvkeeper-client-close", daemon=False).start()
    except RuntimeError:  # the interpreter is exiting: the exit hook closes the channel
        pass


def _close_dropped(channel: Channel) -> None:
    if channel.forked:
        return  # a forked child's copy: there is nothing of it to close
    # (Often on the client's I/O thread, as it lets go of the last save
    # holding the client.)
    _close_in_background(channel.close)
    # After the close has started: under -W error the warning raises.
    warnings.warn("a kvkeeper Client was dropped without close(); closing it in the background",
                  ResourceWarning, stacklevel=1)


@dataclass
class _Attempt:
    """One read of a cache file: the file's identity when the read began, and
    the cache, or the reason there is none (``error``); neither when there is
    no file."""

    path: Path
    ident: os.stat_result | None = None
    loaded: LoadedCache | None = None
    error: CacheFileError | None = None

    def still_current(self) -> bool:
        """Whether the path still names the file this attempt read (files are
        only ever replaced by a rename, so a new version is a new inode)."""
        try:
            now = os.lstat(self.path)
        except OSError:
            return self.ident is None
        return self.ident is not None and _same_file(self.ident, now)


@functools.lru_cache(maxsize=1024)
def _entry_path(root: Path, model: str, cache_id: str) -> Path:
    # Escaping each byte of the ids in Python and joining paths was about
    # 75 us of a lazy load; a server loads the same few keys again and again.
    return naming.entry_path(root, model, cache_id)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    # Not ctime: the daemon records each load in the atime, which moves it.
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (
        b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def _read(path: Path, verify: bool, model: str, cache_id: str) -> _Attempt:
    """Read the cache file at ``path``, again while it was replaced mid-read
    (at most ``_READ_ATTEMPTS`` reads)."""
    mlx_part("reader")  # without MLX, says which extra is missing
    from kvkeeper.client.reader import CacheFileError, cannot_open, read_file

    for d in (path.parent.parent, path.parent):  # sessions/, the model's directory
        try:
            parent = os.lstat(d)
        except FileNotFoundError:
            return _Attempt(path)
        except OSError as exc:
            return _Attempt(path, error=cannot_open(path, exc))
        if not stat.S_ISDIR(parent.st_mode):
            # A symlink planted there leads out of the store (the daemon
            # refuses it too, and moves nothing out of it).
            return _Attempt(path, error=CacheFileError(
                f"{d} is a symlink or not a directory: not followed", damaged=False))
    attempt = _Attempt(path)
    for _ in range(_READ_ATTEMPTS):
        try:
            attempt.ident = os.lstat(path)
            attempt.loaded = read_file(path, verify, model, cache_id,
                                       stat.S_ISREG(attempt.ident.st_mode))
            attempt.error = None
            return attempt
        except FileNotFoundError:
            return _Attempt(path)  # no file (or deleted meanwhile): a plain miss
        except OSError as exc:  # the lstat: no permission to the directory, ...
            return _Attempt(path, error=cannot_open(path, exc))  # no file known to report
        except CacheFileError as exc:
            attempt.error = exc
            if not exc.replaced:
                return attempt
    return attempt


#: How often a read is tried while the file keeps being replaced under it.
#: Each replace is a whole newer version, but verified reads racing saves of
#: their key that land every few ms (0.25 MiB, flushed one by one) met two
#: replaces in a row on a loaded machine: 1 load of 3,589 missed with 2 tries.
_READ_ATTEMPTS = 5


def _holds_a_store(root: Path) -> bool:
    """Whether ``root`` has a store's sessions/ (True when that cannot be
    told: a root this user may not enter is not "no store")."""
    try:
        return (root / naming.SESSIONS_DIR).is_dir()
    except OSError:  # Python before 3.14 raises EACCES from is_dir()
        return True


def _absolute(name: str, path: Path) -> Path:
    """``path`` made absolute; ValueError for a relative one when the
    working directory was removed (os.getcwd's bare "[Errno 2]")."""
    try:
        return Path(os.path.abspath(path))
    except FileNotFoundError:
        raise ValueError(f"{name} {str(path)!r} is relative, and the current directory was "
                         f"removed: give an absolute path") from None


def _check_path_argument(name: str, value: object) -> None:
    """A socket or root given to Client() is a path of text (or None)."""
    if value is None:
        return
    if not (isinstance(value, (str, os.PathLike)) and isinstance(os.fspath(value), str)):
        raise TypeError(f"{name} must be a path (str or os.PathLike of str) or None, not "
                        f"{type(value).__name__}")
    if "\0" in os.fspath(value):
        # No file can have it: every later save and load raised os.stat's
        # "embedded null byte" from inside the client.
        raise ValueError(f"{name} {os.fspath(value)!r} holds a NUL character")


class DaemonError(Exception):
    """A typed error reply from the daemon."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of a save's user metadata; raises ValueError for what ``save()``
    refuses: a key or value that is not a str, a ``kvkeeper.*`` key, text that
    is not valid Unicode, or more than MAX_METADATA_BYTES as JSON."""
    if metadata is not None and not isinstance(metadata, Mapping):
        # dict() would take pairs, and fail on a str with a puzzling message.
        raise ValueError(f"metadata must be a mapping of str to str, not "
                         f"{type(metadata).__name__}")
    meta = dict(metadata or {})
    # Each refusal says what is wrong with it: "values str: ['a']" read as
    # the key being at fault.
    bad = [f"key {k!r} is {type(k).__name__}, not str" for k in meta if not isinstance(k, str)]
    bad += [f"key {k!r} is kvkeeper's own (kvkeeper.*)" for k in meta
            if isinstance(k, str) and k.startswith("kvkeeper.")]
    bad += [f"the value of {k!r} is {type(v).__name__}, not str" for k, v in meta.items()
            if not isinstance(v, str)]
    if bad:
        raise ValueError(f"metadata must map str keys (not 'kvkeeper.*') to str values: "
                         f"{'; '.join(bad)}")
    # Exact str: a subclass (an enum's member, say) cannot be encoded.
    meta = {naming.plain(k): naming.plain(v) for k, v in meta.items()}
    if meta:
        try:  # the header is UTF-8: a lone surrogate would fail on the I/O thread
            size = len(msgspec.json.encode(meta))
        except UnicodeEncodeError as exc:
            raise ValueError(f"metadata must be valid Unicode text: {exc}") from None
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is {size} bytes as JSON; the limit is "
                             f"{MAX_METADATA_BYTES}")
    return meta


def _added_since(total: int, seen: int) -> int:
    """What a daemon's running total for this client added since ``seen``:
    all of it when it is smaller (another daemon run, counting from 0)."""
    return total - seen if total >= seen else total


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` time), at least 0."""
    return max(0.0, deadline - time.monotonic())


def _whole_bytes(value: Any) -> int | None:
    """``value``, a Real (numpy's numbers and a Fraction too, compared
    exactly), as a whole number > 0; else None."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    try:
        n = int(value)  # type: ignore[call-overload]  # every Real converts; the stubs say not
    except (OverflowError, ValueError):  # inf, nan
        return None
    return n if n == value and n > 0 else None


def _check_seconds(name: str, value: Any, *, zero_ok: bool = False) -> float:
    # Real: numpy's numbers too. TIMEOUT_MAX: past it threading's waits raise
    # OverflowError, from the middle of a call.
    ok = (not isinstance(value, bool) and isinstance(value, Real)
          and (0 <= value if zero_ok else 0 < value) and value <= threading.TIMEOUT_MAX)  # type: ignore[operator]  # the stubs give Real no order
    if not ok:
        raise ValueError(f"{name} must be a number of seconds {'>= 0' if zero_ok else '> 0'} "
                         f"and at most {threading.TIMEOUT_MAX:.0f}, not {value!r}")
    return float(value)  # threading's waits take no numpy scalar


#: load_may_be_stale's reasons (see Client._lost_since_flush), said.
_LOST_BECAUSE = {
    "save_lost": "a save was lost on its way to the daemon (see event=save_lost)",
    "save_refused": "the daemon refused the last save of it (see event=save_refused)",
    "connection_lost": "the connection to the daemon ended before it read the last saves",
    "daemon_restarted": "the connection to the daemon was lost (it may have been restarted)",
}


#: The root of a client that cannot know its own: the default as written,
#: unexpanded (a relative path no store is at), where direct reads miss.
_NO_STORE = Path("~/.cache/kvkeeper")


def _raise_if_in_doubt(exc: DaemonUnavailable, unwritten: str | None, connected: bool) -> None:
    """Raise ``exc``, saying what is ``unwritten``, where a load must not read
    the file instead: the daemon is up but did not answer in time (a big
    save on a slow disk, or the drain's), or the client was closed under the
    load (by another thread, or at exit) while the daemon wrote. The file
    may be older than this client's last save of the key, and
    read-your-writes was promised. (With the daemon gone the file is all
    there is until a new one writes that save, if it still waits here.)"""
    if unwritten and (isinstance(exc, ClosedHere)
                      or (isinstance(exc, DaemonTimedOut) and connected)):
        # Of its own type: code retrying a busy daemon catches DaemonTimedOut.
        raise type(exc)(f"{exc}; {unwritten}") from None


def _settings_root(find: Callable[[str], Path], made_in: str | None) -> Path:
    """The root ``find("root")`` gives, a relative one under ``made_in`` (the
    directory current when the client was made); where the default root
    needs a home directory there is none of (HOME unset, no password entry),
    _NO_STORE: loads that would read the files miss (the daemon's own root
    is used while it is up)."""
    try:
        root = find("root")
    except config.ConfigError as exc:
        if isinstance(exc, settings.SettingsError):
            raise
        log.warning("event=root_unknown reason=%s", exc)
        return _NO_STORE
    if root.is_absolute() or str(root).startswith("~"):
        return root  # (~user naming no user: kept as given, where no store is)
    if made_in is None:
        log.warning("event=root_unknown variable=%s: a relative path, and the directory "
                    "current when the client was made had been removed", config.ENV_ROOT)
        return _NO_STORE
    # As Client(root=) is made absolute: a relative $KVKEEPER_ROOT was read
    # from whatever directory was current at each load.
    return Path(os.path.normpath(os.path.join(made_in, root)))


def _unpack(cache: Any, token_ids: Sequence[int] | None) -> tuple[list[Any], list[int] | None]:
    if isinstance(cache, (list, tuple)):
        layers = list(cache)
    elif hasattr(cache, "cache"):
        layers = list(cache.cache or [])
        if token_ids is None:
            token_ids = getattr(cache, "token_ids", None)
    else:
        raise ValueError("cache must be a list of cache layers or have a .cache attribute")
    if not layers:
        raise ValueError("cache has no layers")
    return layers, None if token_ids is None else token_id_list(token_ids)

