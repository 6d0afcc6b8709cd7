"""The ZeroMQ edge: receive, decode once, validate, route; never wait on disk.

Every message is ``[peer identity, header, *raw frames]`` on a ROUTER socket.
Anything invalid gets a typed error reply and nothing of it reaches the writer.
Saves go to the writer actor; loads, deletes, listings and flushes each get a
small task of their own, so one slow answer never holds up the receive loop.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import socket
import stat
import struct
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import anyio
import anyio.lowlevel
import msgspec
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup
from zmq.utils.monitor import parse_monitor_message

from kvkeeper import __version__
from kvkeeper.daemon.actor import DeleteJob, GcFailed, Key, SaveJob, WriterActor
from kvkeeper.daemon.stats import Stats
from kvkeeper.daemon.store import Store, StoredEntry
from kvkeeper.logs import get_logger
from kvkeeper.protocol import messages as m
from kvkeeper.protocol import naming
from kvkeeper.protocol.safetensors import (
    CACHE_ID_KEY,
    DAEMON_KEYS,
    FORMAT,
    FORMAT_KEY,
    MODEL_KEY,
    SAVED_AT_KEY,
    Layout,
    LayoutError,
)

log = get_logger("kvkeeper.server")
_MAX_STREAMS = 10_000
#: Frames of a message kept for handle(): the sender's identity, the
#: header, every data frame a header may declare, and one over (so a count
#: that disagrees is still told). The rest are read and let go at once.
_MAX_KEPT_FRAMES = 2 + m.MAX_FRAMES_PER_MESSAGE + 1
#: Frames let go between two turns of the event loop.
_DROPPED_PER_TURN = 10_000
#: Requests whose answer waits (a load behind a save, a delete, a list, a
#: gc, and a peer's flushes, which share one) a peer may have at once, and
#: all peers together: each is a task holding a few KiB, and a drain cut
#: short cancels them all. A kvkeeper client has a load at a time per thread.
MAX_WAITING_PER_PEER = 1024
MAX_WAITING = 16_384
#: Flushes a peer may have waiting (a client polling flush(0) while a slow
#: write goes on leaves one behind per call, each a few dozen bytes here).
MAX_FLUSHES_PER_PEER = 100_000
#: A long list of answers goes out in runs of this many, between which the
#: receive loop and the writer get their turn.
_ANSWER_RUN = 100
#: A peer's waiting flushes, answered in order by one task: (the writer's
#: jobs_taken when it came, its req).
_Flushes = deque[tuple[int, int]]
#: A save whose client process has died fails once nothing is left to read
#: and none of its bytes came for this long: its last messages may still be
#: read after the death is seen (this covers that read, not the client).
GONE_GRACE = 1.0
GONE_CHECK = 0.25
#: The event that has the server look for saves whose client died.
MONITOR_EVENTS = zmq.EVENT_DISCONNECTED
#: How long the connections outlive the last reply when the daemon stops: a
#: client reads a reply only while its connection lasts (its ZeroMQ socket,
#: ZMQ_IMMEDIATE, drops what it has not read when the connection ends), and
#: its I/O thread may be waiting for the GIL for a while.
REPLY_GRACE = 0.25
#: How long a drain goes on taking the saves of clients that have not
#: answered its notice yet, at most: they were sent before the client knew.
#: A client answers (asks for its flush) behind everything it sent before,
#: which closes the window for it at once; this bounds a client that never does.
LATE_SAVES_WINDOW = 2.0
#: And once every client told has answered: until nothing is left to read
#: and no save message came for this long (a client the daemon had taken no
#: save of, told only when its first save is read, may have a burst queued).
LATE_SAVES_QUIET = 0.1


@dataclass(slots=True)
class Stream:
    """The save a peer is sending now; ``job`` is None once it was refused."""

    save: int
    job: SaveJob | None
    pid: int | None = None  # the sending process, when the platform says
    # The connection its last message came on: the daemon's descriptor, and
    # that socket's inode (a descriptor number is reused; an inode is not
    # while the socket is open).
    conn: tuple[int, int] | None = None
    # When ZeroMQ was last asked whether the sender is still connected, and
    # whether it said not (see Server._reachable).
    probed: float = -float("inf")
    unreachable: bool = False


class Server:
    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        actor: WriterActor,
        store: Store,
        stats: Stats,
        tg: TaskGroup,
        monitor: zmq.asyncio.Socket | None = None,
    ) -> None:
        self.sock = sock
        # The same socket, for reads that never wait (see _receive).
        self._sock_now: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._frames_dropped = 0  # of the message being handled
        self.actor = actor
        actor.on_write_failed = self._tell_write_failed
        self.store = store
        self.stats = stats
        self.tg = tg
        self._uid = os.getuid()
        # Per peer, the save stream it is sending now. A client sends one save
        # at a time, so one slot per peer.
        self._streams: dict[bytes, Stream] = {}
        # ROUTER does not say which peer left; its monitor says which
        # descriptor's connection closed, and each save's stream knows its
        # sender's pid and the connection (descriptor, inode) its bytes last
        # came on.
        self.monitor = monitor
        self._dead: dict[SaveJob, float] = {}  # saves whose sender is gone: seen when
        self._closed_fds: dict[int, float] = {}  # descriptors whose connection closed: when
        self._reaping = False
        self._last_close = -float("inf")
        self._last_reply = -float("inf")
        self._waiting: dict[bytes, int] = {}  # per peer: requests whose answer waits
        self._waiting_total = 0
        # Listings (one lstat a file) in threads of their own: many at once
        # must not take every thread of the pool the writer's disk work uses.
        self._listing = anyio.CapacityLimiter(2)
        self._flushes: dict[bytes, _Flushes] = {}  # per peer with flushes waiting
        # Peers told of the drain whose flush (which the notice asks for) has
        # not been answered yet: the daemon gives them a moment before it exits.
        self._told_of_drain: set[bytes] = set()
        # Per peer: actor.jobs_taken just after its last save taken in the
        # drain; only a flush that came at or after it takes it off the list.
        self._late_jobs: dict[bytes, int] = {}
        # While the daemon drains: until when saves still on their way from
        # clients are taken (None: not draining), the clients told whose
        # answer has not come yet, when the last save message came, and
        # whether the window is closed (see late_saves).
        self._late_until: float | None = None
        self._late: set[bytes] = set()
        self._ever_told: set[bytes] = set()  # (_told_of_drain forgets those answered)
        self._last_save_message = -float("inf")
        self._late_closed = False
        self._notice: m.Draining | None = None  # (announce_drain makes it)
        self._probe = m.encode(m.Pong(v=m.PROTOCOL_VERSION, req=0, pid=os.getpid(),
                                      root=str(store.root), version=__version__,
                                      max_save_bytes=actor.max_pending_bytes))

    async def run(self) -> None:
        while True:
            frames = await self._receive()
            try:
                self.handle(frames)
            except Exception:  # noqa: BLE001 - one bad message must not stop the daemon
                self.stats.inc("internal_errors")
                log.exception("event=internal_error")
            # Let go before waiting for the next message: a refused one's
            # frames (hundreds of MiB) were held until another came.
            del frames
            # pyzmq hands over a message already waiting without going back
            # to the event loop: while one peer kept the socket readable
            # (a flood of costly headers) no other task ran, and another
            # client's flush waited 10.6 s, the flood's whole length.
            await anyio.lowlevel.checkpoint()

    async def _receive(self) -> list[zmq.Frame]:
        """The next message's frames, at most ``_MAX_KEPT_FRAMES``. Whole
        messages were taken (recv_multipart): one of two million empty
        frames, a few MB from a raw client, became two million frame objects
        (554 MiB) before its count was checked, and no other client was
        answered for 13 s."""
        frames = [await self.sock.recv(copy=False)]
        # ZeroMQ hands a message over whole: its other frames are here.
        sock, dropped = self._sock_now, 0
        while sock.get(zmq.RCVMORE):
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            if len(frames) < _MAX_KEPT_FRAMES:
                frames.append(frame)
                continue
            dropped += 1
            if dropped % _DROPPED_PER_TURN == 0:
                await anyio.lowlevel.checkpoint()  # other clients meanwhile
        self._frames_dropped = dropped  # (for the count a refusal gives)
        return frames

    # ------------------------------------------------------------ dispatch

    def handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.stats.inc("protocol_errors")
            return
        peer, header, data = frames[0].bytes, frames[1], frames[2:]
        if not self._same_user(header):
            self.stats.inc("forbidden_peers")
            self._reply(peer, m.Error(v=m.PROTOCOL_VERSION, req=None, code="forbidden",
                                      message="this daemon serves only its own user"))
            return
        try:
            msg = m.decode_request(header.buffer)
        except m.DecodeFailure as exc:
            self.stats.inc("protocol_errors")
            begun = m.begun_save(header.buffer)
            if begun is not None:
                # Refused like any save: the sender's next flush says False
                # (it said every save was written), once: its data, if its
                # number can be told, is dropped as a refused save's.
                self.stats.inc("saves_received")
                self.stats.inc("saves_refused")
                self.actor.note_refused(peer)
                if (number := begun.number) is not None:
                    self._track(peer, number, None)
                else:
                    self._end_stream(peer)
            elif (stream := self._streams.get(peer)) is not None and stream.job is not None \
                    and m.data_of_save(header.buffer) == stream.save:
                # Bytes of the save arriving whose header is bad (a frame
                # count over the limit): the save fails now, as with a count
                # that disagrees, instead of after its stall timeout, holding
                # its tmp file and memory meanwhile.
                del self._streams[peer]
                reason = f"a data header that is not valid: {exc}"
                self.actor.break_stream(stream.job, reason)
                self._refuse(peer, stream.save, exc.code, reason, count=False, tally=False)
                return
            self._reply(peer, m.Error(v=m.PROTOCOL_VERSION, req=None, code=exc.code,
                                      message=str(exc)))
            return
        if self._late_until is not None and isinstance(msg, m.SaveBegin | m.SaveData):
            self._last_save_message = time.monotonic()  # (the drain's quiet: see late_saves)
        if isinstance(msg, m.SaveData):
            self._save_data(peer, msg, header, data)
            return
        if data:
            if isinstance(msg, m.SaveBegin):
                self.stats.inc("saves_received")  # and refused: the counts add up
            self._error(peer, msg, "frames", f"{type(msg).__name__} takes no data frames, "
                                             f"got {len(data) + self._frames_dropped}")
            return
        match msg:
            case m.SaveBegin():
                self._save_begin(peer, msg, header)
            case m.Ping():
                self._reply(peer, m.Pong(v=m.PROTOCOL_VERSION, req=msg.req, pid=os.getpid(),
                                         root=str(self.store.root), version=__version__,
                                         max_save_bytes=self.actor.max_pending_bytes))
            case m.Load():
                key = self._key(peer, msg)
                if key is not None and self.actor.has_pending(key):
                    if self._room_to_wait(peer, msg):
                        self._start(peer, self._load, msg.req, key)
                elif key is not None:  # nothing to write first: answer now, no task
                    self._answer_load(peer, msg.req, key)
            case m.Used():
                key = self._key(peer, msg)
                if key is not None:
                    self.stats.inc("loads_direct")
                    found = self.store.find(*key)
                    if found is not None and found[1].st_ino == msg.ino:
                        self.store.record_use(*found)
            case m.Delete():
                key = self._key(peer, msg)
                if key is not None and self._room_to_wait(peer, msg):
                    job = DeleteJob(key=key, peer=peer)
                    refusal = self.actor.submit_delete(job)
                    if refusal is not None:
                        self._error(peer, msg, *refusal)
                    else:
                        self._start(peer, self._deleted, msg.req, job)
            case m.Quarantine():
                key = self._key(peer, msg)
                if key is not None and self._room_to_wait(peer, msg):
                    self._quarantine(peer, msg.req, DeleteJob(
                        key=key, peer=peer, reason=msg.reason, ino=msg.ino,
                        mtime_ns=msg.mtime_ns))
            case m.ListEntries():
                if msg.model is not None and self._check(peer, msg, msg.model, "model") is None:
                    return
                if self._room_to_wait(peer, msg):
                    self._start(peer, self._list, msg.req, msg.model, msg.everything)
            case m.GetStats():
                self._reply(peer, m.Stats(v=m.PROTOCOL_VERSION, req=msg.req,
                                          counters=self.counters()))
            case m.Flush():
                if msg.req >= m.DRAIN_ANSWER:
                    if peer not in self._ever_told:
                        # The answer to another daemon's drain notice, sent as
                        # that one went and this one came (the client's I/O
                        # thread slow meanwhile): answered here, it vouched
                        # for saves the other never wrote, and flush() said
                        # True (a review). Not this daemon's to vouch for.
                        self._reply(peer, m.Error(
                            v=m.PROTOCOL_VERSION, req=msg.req, code="internal",
                            message="this daemon told this client of no drain: it cannot "
                                    "answer for saves sent to another"))
                        return
                    # Sent behind this client's saves of before it knew of the drain.
                    self._late.discard(peer)
                flushes = self._flushes.get(peer)
                if flushes is None:
                    if not self._room_to_wait(peer, msg):
                        return
                    flushes = self._flushes[peer] = deque()
                    self._start(peer, self._flush, flushes)
                elif len(flushes) >= MAX_FLUSHES_PER_PEER:
                    self.stats.inc("requests_refused")
                    self._error(peer, msg, "busy", f"{len(flushes)} flushes of this "
                                                   f"client wait already")
                    return
                flushes.append((self.actor.jobs_taken, msg.req))
            case m.Gc():
                if self._room_to_wait(peer, msg):
                    self._start(peer, self._gc, msg.req)

    def counters(self) -> dict[str, float]:
        self.stats.gauges.update(self.actor.gauges())
        # Answered at once, as a ping is, past the request caps too (a
        # client's start asks it; taken through a worker thread and the caps,
        # a flood of requests made it, and Client(), fail "busy"); a statvfs
        # is as quick as the lstat a load of a missing key makes here.
        self.stats.gauges["free_bytes"] = float(self.store.free_gauge())
        out = self.stats.snapshot()
        out["internal_errors"] += self.store.budget_crashes
        return out

    # ------------------------------------------------------------ saves

    def _save_begin(self, peer: bytes, msg: m.SaveBegin, header: zmq.Frame) -> None:
        prev = self._streams.get(peer)
        self._end_stream(peer)
        self.stats.inc("saves_received")
        key = self._key(peer, msg)
        if key is None:
            self._track(peer, msg.save, None)
            return
        if prev is not None and prev.save == msg.save:
            # Its bytes could not be told from the last save's still on their
            # way: a raw client's tail of the one went into the other's file,
            # checksummed as received, and the flush said written.
            self._refuse(peer, msg.save, "malformed", f"save {msg.save} begun again: each "
                         f"save needs a number of its own", key=key)
            return
        try:
            layout = Layout.of(msg.tensors)
        except LayoutError as exc:
            code: m.ErrorCode = "dtype" if "dtype" in str(exc) else "malformed"
            self._refuse(peer, msg.save, code, str(exc), key=key)
            return
        metadata = {k: v for k, v in msg.metadata.items() if k not in DAEMON_KEYS}
        metadata.update({
            FORMAT_KEY: FORMAT,
            MODEL_KEY: msg.model,
            CACHE_ID_KEY: msg.cache_id,
            SAVED_AT_KEY: f"{time.time():.6f}",
        })
        job = SaveJob(key=key, peer=peer, save_id=msg.save, layout=layout, metadata=metadata)
        if self._late_until is not None and not self._late_save_taken(peer):
            self._refuse(peer, msg.save, "shutting_down", "the daemon is shutting down",
                         key=key)
            return
        after = self.actor.entry_after_jobs(key) if msg.create else False
        if after or (after is None and os.path.lexists(self.store.path_for(*key))):
            # Here, in the order saves arrive: checked by the client first,
            # a save received and not yet written was not seen; a delete
            # received and not yet done leaves no entry. (An lstat, as a
            # load of a missing key makes.)
            self._refuse(peer, msg.save, "exists", f"{key[0]} / {key[1]} is already in the "
                         f"store, or a save of it is on its way", key=key)
            return
        refusal = self.actor.submit_save(job)
        if refusal is not None:
            self._refuse(peer, msg.save, *refusal, key=key)
            return
        if self._late_until is not None:
            # A flush that came before this save does not vouch for it: the
            # exit waits for one that came after (an older client, whose
            # flushes carry no mark, asked early in the drain and then saved).
            self._told_of_drain.add(peer)
            self._late_jobs[peer] = self.actor.jobs_taken
        if job.total:
            self._track(peer, msg.save, job, _peer_pid(header), _connection(_source_fd(header)))

    def _save_data(self, peer: bytes, msg: m.SaveData, header: zmq.Frame,
                   data: list[zmq.Frame]) -> None:
        stream = self._streams.get(peer)
        if stream is None or stream.save != msg.save:
            self.stats.inc("protocol_errors")
            live = stream is not None and stream.job is not None and not stream.job.done.is_set()
            # Not counted as a refused save: this daemon never received its
            # start. Said once, then the rest is dropped quietly; but a stray
            # message must not take the slot of a save still arriving.
            self._refuse(peer, msg.save, "unknown_save", f"no save {msg.save} in progress",
                         count=False, track=not live)
            return
        job = stream.job
        if job is None:
            return  # the rest of a refused save
        nbytes = sum(len(f) for f in data)
        if len(data) != msg.frames or job.received + nbytes > job.total:
            del self._streams[peer]
            self.stats.inc("protocol_errors")
            reason = (f"header says {msg.frames} frames, got {len(data) + self._frames_dropped}"
                      if len(data) != msg.frames
                      else f"more bytes than the {job.total} declared")
            self.actor.break_stream(job, reason)
            self._refuse(peer, msg.save, "frames", reason, count=False, tally=False)
            return
        self.stats.inc("bytes_received", nbytes)
        if stream.pid is not None or stream.conn is not None:
            # A raw client that reconnected may go on on another connection
            # (kvkeeper's own sets IMMEDIATE: its queued messages die with one),
            # which may have the number of one recorded closed (inode 0).
            fd = _source_fd(header)
            if stream.conn is None or stream.conn[0] != fd or stream.conn[1] == 0:
                stream.conn = _connection(fd)
        self.actor.add_data(job, [f.buffer for f in data], nbytes)
        if job.received == job.total:
            del self._streams[peer]

    def _refuse(self, peer: bytes, save: int, code: m.ErrorCode, message: str,
                *, count: bool = True, tally: bool = True, track: bool = True,
                key: Key | None = None) -> None:
        """Turn a save away. ``count``: as a refused save in the stats (not for
        one this daemon never saw begin); ``tally``: in the client's flush
        totals (not for one the writer already failed); ``key``: the save's,
        when its header gave one (the log names it: a flush that said False
        is traced to a key by it)."""
        if count:
            self.stats.inc("saves_refused")
        if tally:
            self.actor.note_refused(peer)
        if key is not None:
            log.info("event=save_refused code=%s model=%s id=%s reason=%s", code, *key, message)
        else:
            log.info("event=save_refused code=%s reason=%s", code, message)
        if track:
            self._track(peer, save, None)
        self._reply(peer, m.SaveRefused(v=m.PROTOCOL_VERSION, save=save, code=code,
                                        message=message))

    def _tell_write_failed(self, peer: bytes, save: int, message: str) -> None:
        """Tell a client at once that its save was not written (the writer
        could not write it: a full disk, an I/O error; it stalled; or a job
        that replaced it failed): its next load of the key then says the
        file may be older than its saves, as for a refused save. Told at its
        next flush only, a load before it returned the older file as
        settled, and so did every later load (a review). Not counted again:
        the writer counted the failure, and the flush still reports it."""
        self._reply(peer, m.SaveRefused(v=m.PROTOCOL_VERSION, save=save, code="internal",
                                        message=message))

    def _end_stream(self, peer: bytes) -> None:
        """Forget the peer's current stream; a save of it still missing bytes
        will never get them, so it fails now instead of after its stall
        timeout (parked meanwhile, holding its memory and tmp file)."""
        prev = self._streams.pop(peer, None)
        if prev is not None and prev.job is not None and prev.job.received < prev.job.total:
            self.actor.break_stream(prev.job, "the client abandoned it part way")

    def _track(self, peer: bytes, save: int, job: SaveJob | None,
               pid: int | None = None, conn: tuple[int, int] | None = None) -> None:
        self._end_stream(peer)  # re-inserted below: the dict's order is recency
        if len(self._streams) >= _MAX_STREAMS:
            self._forget_a_stream()
        self._streams[peer] = Stream(save, job, pid, conn)
        if (pid is not None or conn is not None) and self._closed_lately():
            self._reap_soon()  # its start may have been read after its sender died

    def _forget_a_stream(self) -> None:
        """Make room for one more peer's slot. Peers that went away leave
        their last slot: the oldest slot of a save no longer arriving goes (a
        refused stream forgotten costs one more "unknown_save"). A save still
        arriving keeps its slot: forgotten, the rest of its bytes would be
        refused while it held its memory and tmp file until its stall
        timeout. Only when every slot is such a save does the oldest go, and
        that save fails now."""
        for peer, stream in self._streams.items():
            if stream.job is None or stream.job.done.is_set():
                del self._streams[peer]
                return
        self._end_stream(next(iter(self._streams)))

    # ------------------------------------------------------------ senders that are gone

    async def watch_connections(self) -> None:
        """Look for saves whose sender is gone part way whenever a connection
        closes, so that such a save fails within seconds instead of after its
        stall timeout: the writer parks it (see actor), but its memory and tmp
        file stay until it is failed."""
        if self.monitor is None:
            return
        while True:
            await self.monitor.poll()  # for POLLIN, the default
            closed = False
            while True:
                # (A Future, which the stubs do not say.)
                fut = cast("asyncio.Future[list[bytes]]",
                           self.monitor.recv_multipart(flags=zmq.NOBLOCK))
                if fut.exception() is not None:
                    break  # zmq.Again: no more events for now
                closed = True
                fd = int(parse_monitor_message(fut.result())["value"])
                self._closed_fds[fd] = time.monotonic()
            if closed:
                self._last_close = time.monotonic()
                self._reap_soon()

    def _closed_lately(self) -> bool:
        return time.monotonic() - self._last_close <= self.actor.stall_timeout

    def _reap_soon(self) -> None:
        if not self._reaping:
            self._reaping = True
            self.tg.start_soon(self._reap)

    async def _reap(self) -> None:
        """Fail the saves whose sender is gone, once no byte of theirs can
        still come: nothing is left to read, and none came for GONE_GRACE.
        Gone is a dead process, or a live one whose connection closed (a
        client closed with a save half sent): the descriptor its bytes came
        on closed, and does not hold that very socket now (it may hold a new
        one, even of the same process). A killed process may linger a moment
        (exiting, or a zombie until reaped), so this looks again every
        GONE_CHECK until no save is arriving, or the stall timeout since the
        last close is over."""
        try:
            while True:
                await anyio.sleep(GONE_CHECK)
                arriving = [s for s in self._streams.values()
                            if (s.pid is not None or s.conn is not None) and s.job is not None
                            and s.job.received < s.job.total and not s.job.done.is_set()]
                still = {s.job for s in arriving}
                self._dead = {job: t for job, t in self._dead.items() if job in still}
                now = time.monotonic()
                # Kept for a stall timeout, not cleared: a save whose start is
                # read after its connection's close needs the close still known.
                self._closed_fds = {fd: t for fd, t in self._closed_fds.items()
                                    if now - t <= self.actor.stall_timeout}
                if not arriving or not self._closed_lately():
                    return
                # .get, not .getsockopt: reading EVENTS consumes the socket's
                # wake-up, and only pyzmq's asyncio .get schedules the pending
                # receive again (getsockopt left the server deaf for seconds).
                if cast(int, self.sock.get(zmq.EVENTS)) & zmq.POLLIN:
                    continue  # their last messages may be among those queued
                for stream in arriving:
                    job, pid = stream.job, stream.pid
                    assert job is not None
                    why = self._gone(stream, now)
                    if why is None:
                        self._dead.pop(job, None)  # one uncertain look is not a trend
                        continue
                    since = self._dead.setdefault(job, now)
                    if now - max(since, job.last_activity) >= GONE_GRACE:
                        del self._dead[job], self._streams[job.peer]
                        self.stats.inc("saves_cut_off")
                        who = "its client" if pid is None else f"its client (pid {pid})"
                        self.actor.break_stream(
                            job, f"{who} {why} after sending {job.received} of {job.total} bytes")
        finally:
            self._reaping = False

    def _gone(self, stream: Stream, now: float) -> str | None:
        """Why ``stream``'s sender can send no more, or None if it may."""
        # No pid: macOS asks it of the connection, which may be closed by
        # the time the save's start is read; the connection still tells.
        assert stream.job is not None
        if stream.pid is not None and not _alive(stream.pid):
            return "died"
        if stream.unreachable:
            return "closed its connection"
        if stream.conn is not None and stream.conn[0] in self._closed_fds:
            fd, ino = stream.conn
            try:
                st = os.fstat(fd)  # no new descriptor: this must work at the fd limit too
            except OSError as exc:
                # Closed: gone. Anything else: cannot tell, so not gone.
                return "closed its connection" if exc.errno == errno.EBADF else None
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino != ino:
                return "closed its connection"
            # The same socket as when the save began, or another connection
            # given the closed one's number before the save's start was read
            # (then its inode was taken for the sender's, and the save waited
            # out its stall timeout): ZeroMQ knows whether the sender's is
            # there. Asked once a close, of a save idle for GONE_GRACE, and
            # only of kvkeeper clients (a live one ignores the answer; another
            # program's peer may not).
            if (stream.probed < self._last_close and m.is_client_id(stream.job.peer)
                    and now - stream.job.last_activity >= GONE_GRACE):
                stream.probed = now
                if not self._reachable(stream.job.peer):
                    stream.unreachable = True
                    return "closed its connection"
        return None

    def _reachable(self, peer: bytes) -> bool:
        """Whether ZeroMQ still has a connection to ``peer``, a kvkeeper
        client. It is sent a Pong for request 0, which no client asks (they
        ignore replies to requests they are not waiting for);
        ROUTER_MANDATORY refuses it with EHOSTUNREACH when the peer has none.
        A full pipe says nothing."""
        exc = self._send_now(peer, self._probe)
        return not (isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH)

    # ------------------------------------------------------------ other requests

    async def _load(self, peer: bytes, req: int, key: Key) -> None:
        await self.actor.settled(key)  # read-your-writes
        self._answer_load(peer, req, key)

    def _answer_load(self, peer: bytes, req: int, key: Key) -> None:
        found = self.store.find(*key)
        self.stats.inc("loads_found" if found else "loads_missing")
        if found is None:
            try:
                st = os.lstat(self.store.path_for(*key))
            except OSError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                # A directory or symlink where the entry's file should be. Moved
                # aside only if still there when the writer gets to it: a file
                # put back meanwhile is a good entry (quarantine/ is what the
                # disk budget deletes first).
                self._quarantine(None, req, DeleteJob(
                    key=key, peer=b"", reason="not a regular file", ino=st.st_ino,
                    mtime_ns=st.st_mtime_ns))
        self._reply(peer, m.Found(v=m.PROTOCOL_VERSION, req=req,
                                  path=str(found[0]) if found else None))
        if found is not None:
            self.store.record_use(*found)  # after the answer: the client need not wait for it

    async def _deleted(self, peer: bytes, req: int, job: DeleteJob) -> None:
        await job.done.wait()
        if job.detail:
            # "internal" is the one code older clients know for a request the
            # daemon could not carry out; the message says it was the disk.
            self._reply(peer, m.Error(v=m.PROTOCOL_VERSION, req=req, code="internal",
                                      message=f"{'delete' if job.reason is None else 'moving aside'} "
                                              f"failed: {job.detail}"))
        else:
            self._reply(peer, m.Deleted(v=m.PROTOCOL_VERSION, req=req, existed=job.existed))

    async def _list(self, peer: bytes, req: int, model: str | None, everything: bool) -> None:
        await self.actor.indexed.wait()  # not the part of the store read so far
        found = await anyio.to_thread.run_sync(
            functools.partial(self.store.listing, model, everything=everything),
            limiter=self._listing)
        self._reply(peer, m.Entries(v=m.PROTOCOL_VERSION, req=req,
                                    entries=[_entry(e) for e in found]))

    async def _gc(self, peer: bytes, req: int) -> None:
        try:
            evicted = await self.actor.collect()
        except GcFailed as exc:
            went = len(exc.evicted)
            first = (f"; it evicted {went} {'entry' if went == 1 else 'entries'} first "
                     f"(the daemon's log names them)") if went else ""
            self._reply(peer, m.Error(v=m.PROTOCOL_VERSION, req=req, code="internal",
                                      message=f"gc failed: {exc}{first}"))
            return
        # As stats has it: -1 on a disk of no size (ramfs said 0 B free).
        free = await anyio.to_thread.run_sync(self.store.free_gauge)
        self._reply(peer, m.Evicted(v=m.PROTOCOL_VERSION, req=req,
                                    entries=[_entry(e) for e in evicted],
                                    disk_used_bytes=self.store.usage(), free_bytes=free))

    async def _flush(self, peer: bytes, flushes: _Flushes) -> None:
        """Answer a peer's flushes: each wait covers every flush that came
        before it began; those that came later get the next one."""
        try:
            while flushes:
                taken = self.actor.jobs_taken
                tally = await self.actor.flush(peer)
                answered = 0
                while flushes and flushes[0][0] <= taken:
                    # Taken off the queue once answered: a request whose
                    # answer raised is still there for _counted to answer.
                    covered, req = flushes[0]
                    if covered >= self._late_jobs.get(peer, 0):
                        self._told_of_drain.discard(peer)
                    self._reply(peer, m.Flushed(
                        v=m.PROTOCOL_VERSION, req=req, written=tally.written,
                        superseded=tally.superseded,
                        failed=self.actor.failed_up_to(peer, covered)))
                    flushes.popleft()
                    answered += 1
                    if answered % _ANSWER_RUN == 0:
                        await anyio.lowlevel.checkpoint()
        finally:
            del self._flushes[peer]

    # ------------------------------------------------------------ helpers

    def _room_to_wait(self, peer: bytes, msg: m.Request) -> bool:
        """Whether one more request of ``peer`` may wait for its answer; if
        not, it is answered "busy" at once."""
        mine = self._waiting.get(peer, 0)
        if mine < MAX_WAITING_PER_PEER and self._waiting_total < MAX_WAITING:
            return True
        self.stats.inc("requests_refused")
        self._error(peer, msg, "busy",
                    f"{mine} requests of this client wait for their answers already "
                    f"(at most {MAX_WAITING_PER_PEER}; {MAX_WAITING} for all clients)"
                    if mine >= MAX_WAITING_PER_PEER else
                    f"{self._waiting_total} requests wait for their answers already "
                    f"(at most {MAX_WAITING} for all clients)")
        return False

    def _start(self, peer: bytes, answer: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``answer(peer, *args)`` as a task, counted against the caps."""
        self._waiting[peer] = self._waiting.get(peer, 0) + 1
        self._waiting_total += 1
        self.tg.start_soon(self._counted, peer, answer, args)

    async def _counted(self, peer: bytes, answer: Callable[..., Awaitable[None]],
                       args: tuple[Any, ...]) -> None:
        try:
            await answer(peer, *args)
        except Exception as exc:  # noqa: BLE001 - as in run(): in the task group, it stopped the daemon
            self.stats.inc("internal_errors")
            log.exception("event=internal_error answer=%s", answer.__name__)
            # The requests it was to answer are answered so: unanswered, each
            # client waited out its timeout (10 s), then said the daemon did
            # not answer. (A flush's are those still in its queue.)
            reqs = [req for _, req in args[0]] if isinstance(args[0], deque) else [args[0]]
            for req in reqs:
                self._reply(peer, m.Error(v=m.PROTOCOL_VERSION, req=req, code="internal",
                                          message=f"the daemon failed answering it: "
                                                  f"{type(exc).__name__}: {exc} (its log has "
                                                  f"the details)"))
        finally:
            self._waiting_total -= 1
            left = self._waiting[peer] - 1
            if left:
                self._waiting[peer] = left
            else:
                del self._waiting[peer]

    def _quarantine(self, peer: bytes | None, req: int, job: DeleteJob) -> None:
        refusal = self.actor.submit_delete(job)
        if refusal is not None:
            log.warning("event=quarantine_refused reason=%s", refusal[1])
            if peer is not None:
                self._reply(peer, m.Error(v=m.PROTOCOL_VERSION, req=req, code=refusal[0],
                                          message=refusal[1]))
        elif peer is not None:
            self._start(peer, self._deleted, req, job)

    def _key(self, peer: bytes,
             msg: m.SaveBegin | m.Load | m.Used | m.Delete | m.Quarantine) -> Key | None:
        # One error per message, even when both ids are bad.
        model = self._check(peer, msg, msg.model, "model")
        cache_id = model and self._check(peer, msg, msg.cache_id, "cache id")
        if model is None or cache_id is None:
            return None
        return model, cache_id

    def _check(self, peer: bytes, msg: m.Request, value: str, what: str) -> str | None:
        try:
            naming.check_id(value, what)
        except naming.BadId as exc:
            self.stats.inc("protocol_errors")
            self._error(peer, msg, "bad_id", str(exc))
            return None
        return value

    def _error(self, peer: bytes, msg: m.Request, code: m.ErrorCode, message: str) -> None:
        if isinstance(msg, m.SaveBegin | m.SaveData):
            self._refuse(peer, msg.save, code, message)
        else:
            self._reply(peer, m.Error(v=m.PROTOCOL_VERSION, req=getattr(msg, "req", None),
                                      code=code, message=message))

    def _same_user(self, header: zmq.Frame) -> bool:
        # Behind IPC_FILTER_UID (libzmq drops another uid's connections, on
        # Linux and macOS) and the 0700 socket directory. libzmq's
        # Peer-Address has the peer's ":uid:gid:pid" after the host on Linux;
        # on macOS it is empty for a unix socket (libzmq adds credentials only
        # once getnameinfo() has named the peer, which fails there), and
        # read alone it let every uid in (a review): there the connection's
        # socket is asked (LOCAL_PEERCRED; 7 us, so not where libzmq says).
        uid: int | None = None
        try:
            parts = str(header.get("Peer-Address")).split(":")
        except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
            parts = []
        if len(parts) == 4 and parts[1].isdigit():
            uid = int(parts[1])
        elif (fd := _source_fd(header)) is not None:
            uid = _socket_peer_uid(fd)
        return uid is None or uid == self._uid

    def announce_drain(self, boot_id: float) -> None:
        """Tell each client whose saves the writer took that the daemon
        drains (``Draining``): it keeps its next saves for the next daemon
        instead of sending them to be refused, and its flush, answered once
        the drain has settled its saves, vouches for them after the restart."""
        self._notice = m.Draining(v=m.PROTOCOL_VERSION, pid=os.getpid(), boot_id=boot_id)
        self._late_until = time.monotonic() + LATE_SAVES_WINDOW
        # Quiet counts from now: a daemon stopped (SIGSTOP) and resumed
        # handles the signal before its ZeroMQ thread has read what the kernel
        # holds for it, so nothing shows as waiting to be read yet.
        self._last_save_message = time.monotonic()
        for peer in {*self.actor.peers(), *self._streams}:
            self._tell_of_drain(peer)

    async def late_saves(self) -> str:
        """While the daemon drains, take the saves still on their way (see
        ``_late_save_taken``) until every client told has answered and none
        is left to read, or LATE_SAVES_WINDOW is over; then take no more.
        Returns why it ended."""
        assert self._late_until is not None
        try:
            while True:
                now = time.monotonic()
                if now >= self._late_until:
                    return "window_over"
                if (not self._late and now - self._last_save_message >= LATE_SAVES_QUIET
                        and not cast(int, self.sock.get(zmq.EVENTS)) & zmq.POLLIN):
                    return "every_client_answered"
                await anyio.sleep(0.01)
        finally:
            self._late_closed = True

    def _tell_of_drain(self, peer: bytes) -> bool:
        assert self._notice is not None
        if not self._reply(peer, self._notice):  # a peer gone
            return False
        self._told_of_drain.add(peer)
        self._ever_told.add(peer)
        self._late.add(peer)
        return True

    def _late_save_taken(self, peer: bytes) -> bool:
        """While the daemon drains, whether a save of ``peer`` that comes now
        is taken: one its client sent before it knew of the drain (refused,
        it was lost: the client no longer has it), within the window. A
        client not told yet (the writer had none of its saves) is told now."""
        assert self._late_until is not None
        if self._late_closed or time.monotonic() >= self._late_until:
            return False
        if peer in self._late:
            return True
        return peer not in self._ever_told and self._tell_of_drain(peer)

    async def let_replies_out(self, *, settled: bool) -> None:
        """Before the daemon closes its socket: with every job ``settled``
        (the drain ended in time), let the requests waiting for them, and the
        flushes the drain notices ask for, be answered, for up to
        REPLY_GRACE * 4, then wait until the last reply is REPLY_GRACE old, so
        that clients read it (a flush answered at the end of the drain came
        to nothing, and the next flush said False)."""
        if settled:
            # Their tasks are a few turns of the event loop from answering;
            # cancelled now, a flush of 15 or more saves, all written, was
            # never answered (the client: "the daemon went away"). A client
            # told of the drain asks for its flush a round trip later (an
            # older client or a raw one never does: it costs that wait).
            with anyio.move_on_after(REPLY_GRACE * 4):
                while self._waiting_total or self._told_of_drain:
                    await anyio.sleep(0.005)
        await anyio.sleep(max(0.0, self._last_reply + REPLY_GRACE - time.monotonic()))

    def _reply(self, peer: bytes, msg: m.Reply) -> bool:
        """Send ``msg`` to ``peer``; False when it could not go (the peer is
        gone, or its pipe is full)."""
        self._last_reply = time.monotonic()
        try:
            data = m.encode(msg)
        except (UnicodeEncodeError, msgspec.EncodeError, OverflowError) as exc:
            # A bug, but not one to stop the daemon (and lose what it has not
            # written) over: the client gets an error instead.
            self.stats.inc("internal_errors")
            log.error("event=reply_not_encoded type=%s error=%s", type(msg).__name__, exc)
            data = m.encode(m.Error(v=m.PROTOCOL_VERSION, req=getattr(msg, "req", None),
                                    code="internal", message=f"the reply could not be "
                                    f"encoded: {exc}"[:1000]))
        failure = self._send_now(peer, data)
        if failure is not None:
            # The peer went away (ROUTER_MANDATORY) or its pipe is full: its loss.
            log.debug("event=reply_dropped error=%s", failure)
            return False
        return True

    def _send_now(self, peer: bytes, data: bytes) -> BaseException | None:
        """Send ``data`` to ``peer`` without waiting; the error when it could
        not go (EHOSTUNREACH: no connection to the peer; EAGAIN: its pipe is
        full)."""
        # With NOBLOCK the asyncio socket completes the future at once.
        fut = cast("asyncio.Future[Any]", self.sock.send_multipart([peer, data], flags=zmq.NOBLOCK))
        return fut.exception() if fut.done() else None


def _peer_pid(header: zmq.Frame) -> int | None:
    """The sending process's pid, when the platform tells: on Linux ZeroMQ
    puts the connection's credentials in "Peer-Address" as host:uid:gid:pid;
    on macOS it leaves the pid out, so it is asked of the socket the message
    came from, which may have closed meanwhile (then None)."""
    try:
        parts = str(header.get("Peer-Address")).split(":")
        if len(parts) == 4 and parts[3].isdigit() and int(parts[3]) > 0:
            return int(parts[3])
    except Exception:  # noqa: BLE001 - no pid only means no early failure
        return None
    fd = _source_fd(header)
    return None if fd is None else _socket_peer_pid(fd)


def _connection(fd: int | None) -> tuple[int, int] | None:
    """Descriptor and socket inode of a connection; inode 0 (no socket's)
    when it is closed already (a save's start read after its sender closed
    the connection, e.g. while the daemon was stopped)."""
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
    except OSError as exc:
        return (fd, 0) if exc.errno == errno.EBADF else None
    return (fd, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _source_fd(header: zmq.Frame) -> int | None:
    """The daemon's descriptor of the connection a message came on."""
    try:
        return int(header.get(zmq.SRCFD))
    except Exception:  # noqa: BLE001 - older or newer libzmq without it: no early failure
        return None


_LOCAL_PEERPID = 2  # macOS <sys/un.h>, at level SOL_LOCAL (0)
_LOCAL_PEERCRED = 1  # macOS <sys/un.h>: a struct xucred, at level SOL_LOCAL (0)
#: struct xucred: u_int cr_version (XUCRED_VERSION 0), uid_t cr_uid, short
#: cr_ngroups, gid_t cr_groups[16].
_XUCRED_SIZE = 76
#: struct ucred (Linux): pid_t pid, uid_t uid, gid_t gid.
_UCRED = struct.Struct("=iII")


def _socket_peer_uid(fd: int) -> int | None:
    """The uid of the process at the other end of the unix socket ``fd``:
    SO_PEERCRED on Linux, LOCAL_PEERCRED on macOS; None where neither is,
    or if ``fd`` is not such a socket any more."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.family != socket.AF_UNIX:
                return None
            if sys.platform == "darwin":
                raw = s.getsockopt(0, _LOCAL_PEERCRED, _XUCRED_SIZE)
                version, uid = struct.unpack_from("=II", raw)
                return uid if version == 0 else None
            peercred = getattr(socket, "SO_PEERCRED", None)
            if peercred is None:
                return None
            raw = s.getsockopt(socket.SOL_SOCKET, peercred, _UCRED.size)
            return int(_UCRED.unpack(raw)[1])
    except (OSError, ValueError, struct.error):
        return None


def _socket_peer_pid(fd: int) -> int | None:
    """On macOS, the pid of the process at the other end of the unix socket
    ``fd`` (LOCAL_PEERPID); None elsewhere, or if ``fd`` is not such a
    socket any more."""
    if sys.platform == "darwin":
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.family != socket.AF_UNIX:
                    return None
                pid = int.from_bytes(s.getsockopt(0, _LOCAL_PEERPID, 4), sys.byteorder)
        except (OSError, ValueError):
            return None
        return pid or None
    return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` may still send: it exists and, where /proc
    tells, is not a zombie (dead, waiting for its parent to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # exists, but not ours to signal
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f if b":" in line)
        # The state is the main thread's: a process whose main thread ended
        # while others go on shows Z too, with more than one thread.
        return not (fields[b"State"].strip().startswith(b"Z")
                    and int(fields[b"Threads"]) <= 1)
    except (OSError, KeyError, ValueError):
        return True  # no /proc (macOS): existing is alive


def _entry(e: StoredEntry) -> m.Entry:
    return m.Entry(model=_text(e.model), cache_id=_text(e.cache_id), tokens=e.tokens,
                   nbytes=e.nbytes, last_used=e.last_used, path=_text(str(e.path)), kind=e.kind,
                   saved_at=e.saved_at)


def _text(s: str) -> str:
    """``s`` as UTF-8 can carry it: a file name that is not UTF-8 (Python keeps
    its bytes as lone surrogates) would fail the reply's encoding; its odd
    bytes are shown as \\xNN instead."""
    try:
        raw = s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = s.encode("utf-8", "backslashreplace")  # a lone surrogate from JSON
    return raw.decode("utf-8", "backslashreplace")
