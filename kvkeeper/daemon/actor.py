"""The single writer: one task that owns every change to the store.

The server hands it jobs through a bounded mailbox and never waits for it.
Jobs for one key run in the order they arrived; a newer save of a key replaces
an older one that has not started writing (write-behind during streaming makes
many, only the newest matters), and takes its place in the mailbox when it
waits there with no job of its key behind it: a key saved faster than it is
written holds one place in line, not one per save. A save starts writing as
soon as it reaches the head of the mailbox, while its bytes are still
arriving, so receiving and writing overlap. Blocking disk work runs in a worker thread, so the event loop
keeps answering loads and stats while a large file is written.

A save of a key written less than ``min_write_interval`` ago is held aside
until that interval is over, so that a loop saving every few tokens gets one
write (and one fsync) per interval instead of one per save: any newer save of
the key replaces the held one. A flush, a load of the key, memory pressure and
shutdown end the wait at once, so nobody who asks for a save ever waits for it.
Only saves of up to HOLD_MAX_BYTES are held. While a save is held, a job of
its key that is not a save (moving a damaged file aside, which checks it is
still the file the client read) may run before it.

A save whose bytes stop coming part way (its client is paused, or slower
than the disk) does not hold up the others: once less than PARK_BELOW_BYTES
of it have come in PARK_AFTER while other jobs wait (a trickle of tiny
frames holds the writer as surely as none), it is parked, its tmp file kept open,
and goes back into the mailbox when its bytes come again (or after the stall
timeout, to fail). Jobs of its key taken meanwhile keep their order: a newer
save or a delete of the key replaces it (its tmp file is removed), moving a
damaged file aside runs before it as it may before a held save.

A save replaced by another client's newer save (or a delete) is answered for
by that newer job: the first client's flush waits for it, and counts it
failed if it fails, so a flush that returned True means the key holds that
save or a newer one.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvkeeper.daemon.durable import PendingFile
from kvkeeper.daemon.stats import Stats
from kvkeeper.daemon.store import LeftInPlace, Store, StoredEntry
from kvkeeper.logs import get_logger
from kvkeeper.protocol.messages import ErrorCode
from kvkeeper.protocol.pacing import HOLD_MAX_BYTES, Pacer
from kvkeeper.protocol.safetensors import (
    MAX_WRITTEN_HEADER,
    TOKEN_COUNT_KEY,
    Layout,
    TensorHasher,
)

log = get_logger("kvkeeper.actor")
#: A piece of a save's data as held: a frame's buffer, or small frames copied together.
Chunk = memoryview | bytearray

#: How long a save being written may go without bytes before it makes way for
#: other jobs waiting behind it (it is parked, not failed: see the docstring).
PARK_AFTER = 0.5
#: ... or with fewer bytes than this in that time: a live client sends
#: hundreds of MiB in it, a stalled one nothing, or frames of a few bytes.
PARK_BELOW_BYTES = 1024 * 1024

Key = tuple[str, str]  # (model, cache id)
#: How the notice of a save its writer could not write begins (``kvkeeper
#: import`` reads the reason after it).
WRITE_FAILED = "writing it failed: "
_MAX_TALLIES = 10_000
#: What a dict's slot for one item takes, its share of the table included.
_DICT_SLOT_BYTES = 64
#: Save data arriving in messages smaller than this is copied into buffers of
#: up to this size (kvkeeper's own client sends 8 MiB messages, and joins
#: small frames itself).
_SMALL_DATA = 64 * 1024


class Outcome(enum.Enum):
    WRITTEN = "written"
    SUPERSEDED = "superseded"
    FAILED = "failed"
    DELETED = "deleted"


@dataclass(eq=False)
class Job:
    key: Key
    peer: bytes
    done: anyio.Event = field(default_factory=anyio.Event)
    outcome: Outcome | None = None
    detail: str = ""
    # Other clients whose saves this job replaced: their flushes wait for it,
    # and its failure is theirs too, charged to the stamp of the first of
    # their saves it replaced (see Tally).
    heirs: dict[bytes, int] = field(default_factory=dict)
    # Of those clients (and, for a delete, of its own client), the number
    # each gave the newest of its saves this job replaced: its failure is
    # told to them by it too (see WriterActor._tell_lost).
    heir_saves: dict[bytes, int] = field(default_factory=dict)
    # The job that replaced this one: whoever waits for this job waits for
    # that one too (and for whatever replaces it in turn).
    replaced_by: Job | None = None
    # The stamp of the first save of its own client this job replaced (None:
    # none): a delete that then fails leaves that save neither written nor
    # deleted.
    replaced_own: int | None = None
    # ``jobs_taken`` once this job was taken: a flush covers the jobs taken
    # before it came (see Tally).
    stamp: int = 0

    @property
    def own_stamp(self) -> int:
        """The stamp its own client's failure is charged at: that of the
        first of the client's saves it answers for (itself, or one it
        replaced), so that a flush which covered that save reports it."""
        return self.stamp if self.replaced_own is None else min(self.stamp, self.replaced_own)


@dataclass(eq=False)
class SaveJob(Job):
    """One save: its layout, and the bytes received but not yet written."""

    save_id: int = 0
    layout: Layout | None = None  # let go once the save is resolved
    metadata: dict[str, str] = field(default_factory=dict)
    total: int = 0  # data bytes (the layout's, kept past it)
    chunks: deque[list[Chunk]] = field(default_factory=deque)
    received: int = 0
    reserved: int = 0  # bytes of the pending budget this save still holds
    broken: str | None = None  # why its stream ended early
    started: bool = False
    arrived: anyio.Event = field(default_factory=anyio.Event)
    # Set when someone waits for this save (or it is finished): it is not held.
    hurry: anyio.Event = field(default_factory=anyio.Event)
    last_activity: float = field(default_factory=time.monotonic)
    file: _FileWriter | None = None  # once started: kept while it is parked
    starved_since: float | None = None  # since when the writer has had no bytes of it
    # The writer's window for PARK_BELOW_BYTES: since when, and job.received then.
    pace_since: float | None = None
    pace_from: int = 0
    parked_at: int = -1  # job.received when it was last parked
    protected: Path | None = None  # its key's file, kept from eviction until it is resolved
    # Its place in the mailbox while it waits there (its own, or that of the
    # save it replaced): a newer save of its key may take it over.
    place: Place | None = None

    def __post_init__(self) -> None:
        if self.layout is not None:
            self.total = self.layout.total

    def tmp_file(self) -> PendingFile | None:
        """The tmp file a started (possibly parked) save has open, if any."""
        return self.file.pending if self.file is not None else None

    @property
    def metadata_bytes(self) -> int:
        # Encoded: a character of a stored conversation may take 4 bytes.
        return sum(len(k.encode()) + len(v.encode()) for k, v in self.metadata.items())

    @property
    def metadata_memory(self) -> int:
        """What the decoded metadata takes in memory: its str objects, as
        they are (a str holds every character in the width of its widest:
        one emoji in 4 MiB of ASCII makes it 16 MiB), and a dict slot an
        item."""
        return sum(sys.getsizeof(k) + sys.getsizeof(v) + _DICT_SLOT_BYTES
                   for k, v in self.metadata.items())


@dataclass(eq=False)
class Place:
    """A place in the writer's mailbox, and the job in it. A newer save of the
    key takes over a waiting save's place (see WriterActor.submit_save): the
    save replaced is let go at once, where a flood of saves each held on to
    its own place, and the next, until the writer came to skip them."""

    job: Job


@dataclass(eq=False)
class DeleteJob(Job):
    """Delete an entry; or, with ``reason`` set, move its unusable file aside."""

    existed: bool = False
    reason: str | None = None
    ino: int | None = None
    mtime_ns: int | None = None


@dataclass(eq=False)
class GcJob(Job):
    evicted: list[StoredEntry] = field(default_factory=list)
    #: Why it did not finish (None: it did).
    failed: str | None = None


class GcFailed(Exception):
    """A gc (or the start-up scan it waited for) that failed part way;
    ``evicted`` went before it. Answered "evicted nothing" before, exit 0."""

    def __init__(self, reason: str, evicted: list[StoredEntry]) -> None:
        super().__init__(reason)
        self.evicted = evicted


#: Failures kept apart for the flushes to come (see Tally.fail): past this
#: many, the older half is counted as reported.
_MAX_UNREPORTED = 4096
#: And of every client together: past this many (about 40 MB), the least
#: recently used tallies count theirs as reported (clients gone for good
#: never flush again: 10,000 tallies of 4,096 held 1.5 GB).
_MAX_UNREPORTED_ALL = 1 << 20


@dataclass
class Tally:
    """What happened to one client's saves, since it connected."""

    written: int = 0
    superseded: int = 0
    failed: int = 0  # failed, or refused before it reached the writer
    # The stamps of the saves whose failures no flush has reported yet, and
    # how many were reported (see failed_up_to).
    unreported: list[int] = field(default_factory=list)
    reported: int = 0

    def fail(self, stamp: int) -> None:
        """A failure, of the save taken as ``jobs_taken`` reached ``stamp``."""
        self.failed += 1
        self.unreported.append(stamp)
        if len(self.unreported) > _MAX_UNREPORTED:
            # Bounded for a client that fails and never flushes. Counted at
            # once, they may go to a flush sent before their saves: one that
            # says False, with the next flush then not saying so again.
            self.unreported.sort()
            half = len(self.unreported) // 2
            self.reported += half
            del self.unreported[:half]

    def fold(self) -> int:
        """Count every unreported failure as reported; returns how many."""
        n = len(self.unreported)
        self.reported += n
        self.unreported = []
        return n

    def failed_up_to(self, covered: int) -> int:
        """The running total of failures a flush reports: those of the saves
        taken up to ``covered`` (its mark). A failure of a save that came
        after the flush, even one already known (a refusal, a quick failure
        while the flush waited), is left to the next flush: had this one
        reported it, the flush that covers the save would say True."""
        keep = [stamp for stamp in self.unreported if stamp > covered]
        self.reported += len(self.unreported) - len(keep)
        self.unreported = keep
        return self.reported


class WriterActor:
    def __init__(
        self,
        store: Store,
        stats: Stats,
        *,
        max_pending_bytes: int,
        mailbox_size: int = 4096,
        stall_timeout: float = 10.0,
        min_write_interval: float = 0.0,
    ) -> None:
        self.store = store
        self.stats = stats
        self.max_pending_bytes = max_pending_bytes
        self.stall_timeout = stall_timeout
        self.pending_bytes = 0
        self.accepting = True
        self.draining = False  # set before accepting ends: saves are no longer held
        send, recv = anyio.create_memory_object_stream[Place](mailbox_size)
        self._send: MemoryObjectSendStream[Place] = send
        self._recv: MemoryObjectReceiveStream[Place] = recv
        # Held and parked saves go back into the mailbox through their own
        # sender, which stays open after stop_accepting() until the last one
        # is back (see _close_resend).
        self._resend: MemoryObjectSendStream[Place] = send.clone()
        self._waiting: dict[Key, SaveJob] = {}  # saves that have not started writing
        self._held: dict[Key, SaveJob] = {}  # of those, the ones waiting out their interval
        self._parked: dict[Key, SaveJob] = {}  # started saves waiting for their bytes
        self._away = 0  # hold and park tasks not yet done putting their save back
        self._writes = Pacer(min_write_interval)  # when each key's last write ended
        self._latest: dict[Key, Job] = {}  # newest unfinished job per key
        self._by_peer: dict[bytes, set[Job]] = {}
        self._tally: dict[bytes, Tally] = {}
        #: Told (peer, the client's save number, the notice's text) when a
        #: save is lost in the writer: it could not write it, it stalled, or
        #: a job that replaced it failed (not a stream the server broke: that
        #: client is told by the server, or gone).
        self.on_write_failed: Callable[[bytes, int, str], None] | None = None
        # A gc whose scan has not begun yet: later requests share it (each
        # one rescanning the whole root: a flood of them held every save up
        # for minutes, when the scans ran on the writer's turn).
        self._next_gc: GcJob | None = None
        self._gc_scan = anyio.Lock()  # one gc reads the root at a time
        self._aside: TaskGroup | None = None  # run()'s group, for the gcs' scans
        self.current: Job | None = None
        #: Set once the start-up scan is done (beside the writer's first
        #: jobs): a listing waits for it, where it would show a part of the
        #: store.
        self.indexed = anyio.Event()
        # Set when the drain begins: it cuts the start-up scan short, and ends
        # a gc's evictions.
        self._stop_indexing = threading.Event()
        self._scan_evicted: list[StoredEntry] = []  # a gc asked during the scan answers them
        self._scan_failed: str | None = None  # and this, if it failed
        #: Jobs taken in so far, of every client (never reset): a flush
        #: started when it was N covers every request that came when it was
        #: at most N.
        self.jobs_taken = 0
        self._fails_unchecked = 0  # failures since the last look at all tallies (_fail)
        self.finished = anyio.Event()
        self._writing = anyio.CancelScope()  # cancelled when the drain is cut short

    # ------------------------------------------------------------ server side
    # These never block: the server calls them from its receive loop.

    def submit_save(self, job: SaveJob) -> tuple[ErrorCode, str] | None:
        """Queue a save; returns (code, reason) when it is refused instead."""
        if not self.accepting:
            return "shutting_down", "the daemon is shutting down"
        # The metadata (token ids, up to 32 MiB) is held until the save is
        # done, like its data, and goes into the file's header: the disk
        # budget counts its text, the memory budget the objects that hold it
        # (counted as text, 5M items of 4 bytes held 430 MB, and one emoji
        # makes a str 4 bytes a character). The decoded tensor table counts
        # in memory too: 65,536 tensors of long names held 37 MB a save for
        # its whole life, outside the budget.
        on_disk = job.total + job.metadata_bytes
        need = job.total + job.metadata_memory \
            + (job.layout.table_bytes if job.layout is not None else 0)
        disk = self.store.budget.max_disk_bytes
        if disk is not None and on_disk > disk:
            return "too_large", (f"save of {on_disk} bytes (data and metadata) exceeds max "
                                 f"disk bytes ({disk})")
        if need > self.max_pending_bytes:
            return "too_large", (
                f"save of {need} bytes (data, metadata and its tensor table) exceeds the "
                f"daemon's max pending bytes ({self.max_pending_bytes})"
            )
        old = self._waiting.get(job.key)
        room = self.max_pending_bytes - self.pending_bytes + (old.reserved if old else 0)
        if need > room:
            self._release_held()  # their memory is needed: write them now
            return "busy", (
                f"{self.pending_bytes} bytes already pending of {self.max_pending_bytes}"
            )
        # Replacing a save that waits in the mailbox with no job of its key
        # behind it (a move aside must still run first), it takes that save's
        # place: each save of a key written slower than it is saved took a
        # place until the writer came to skip it, and a flood of them filled
        # the mailbox (other clients' saves were refused as busy).
        place = old.place if old is not None and self._latest.get(job.key) is old else None
        if place is None:
            place = Place(job)
            try:
                self._send.send_nowait(place)
            except anyio.WouldBlock:
                return "busy", "the writer's mailbox is full"
        else:
            assert old is not None
            old.place = None
            place.job = job
        job.place = place
        # From here until it is resolved (queued, held, written, parked): if
        # it fails, the key's file is all the key has. Before the save it
        # replaces lets go, so that the key is never unprotected between.
        job.protected = self.store.protect(*job.key)
        if old is not None:
            self._supersede(old, job)
        job.reserved = need
        self.pending_bytes += need
        self._enqueued(job)
        self._waiting[job.key] = job
        if job.total == 0:
            job.arrived.set()
        if self.pending_bytes > self.max_pending_bytes // 2:
            self._release_held()  # memory is getting short: write them now
        return None

    def add_data(self, job: SaveJob, bufs: list[Chunk], nbytes: int) -> None:
        """Bytes for a queued save (dropped if it was superseded meanwhile)."""
        if nbytes == 0:
            return  # empty frames: no progress, not even for the stall timeout
        job.received += nbytes
        job.last_activity = time.monotonic()
        if job.done.is_set():
            return
        if nbytes < _SMALL_DATA:
            # Copied together: each ZeroMQ frame held costs some 500 bytes
            # beside its data, and each buffer a step of the writer; a save
            # sent as 1-byte frames (the protocol allows it) held 680 times
            # its counted size, and kept the writer busy for minutes.
            # (Only a chunk not yet taken: the writer takes them from the front.)
            tail = job.chunks[-1] if job.chunks else None
            if tail is not None and len(tail) == 1 and type(tail[0]) is bytearray \
                    and len(tail[0]) + nbytes <= _SMALL_DATA:
                for buf in bufs:
                    tail[0] += buf
            else:
                job.chunks.append([bytearray().join(bufs)])
        else:
            job.chunks.append(bufs)
        job.arrived.set()

    def break_stream(self, job: SaveJob, reason: str) -> None:
        """The client will send no more bytes for this save: fail it."""
        if job.done.is_set():
            return
        job.broken = reason
        if job.started:
            job.arrived.set()  # the writer sees it and aborts the tmp file
        else:
            self._resolve(job, Outcome.FAILED, reason)
            self._tell_lost(job, reason, saver=False)

    def submit_delete(self, job: DeleteJob) -> tuple[ErrorCode, str] | None:
        if self.draining:
            # (The mailbox stays open to late saves for a while: not to these.)
            return "shutting_down", "the daemon is shutting down"
        try:
            self._send.send_nowait(Place(job))
        except anyio.WouldBlock:
            return "busy", "the writer's mailbox is full"
        except anyio.ClosedResourceError:
            return "shutting_down", "the daemon is shutting down"
        old = self._waiting.get(job.key)
        if old is not None and job.reason is None:
            self._supersede(old, job)
        self._enqueued(job)
        return None

    def has_pending(self, key: Key) -> bool:
        """Whether a job of ``key`` received so far is not finished yet."""
        # A key with a save still waiting always has a newest job (_resolve hands it on).
        return key in self._latest

    def entry_after_jobs(self, key: Key) -> bool | None:
        """Whether ``key`` has an entry once its jobs received so far are
        done: True after a save, False after a delete; with no job, or a
        move aside (it moves the file only if that is still the one judged),
        True if a save of the key waits (held or parked: a move aside does
        not replace it), else None: then the disk says."""
        job = self._latest.get(key)
        if isinstance(job, SaveJob):
            return True
        if isinstance(job, DeleteJob) and job.reason is None:
            return False
        if isinstance(self._waiting.get(key), SaveJob) or isinstance(self._parked.get(key),
                                                                    SaveJob):
            return True
        return None

    async def settled(self, key: Key) -> None:
        """Return once every job of ``key`` received so far is finished, or
        replaced by a job that is."""
        # The waiting save may be held, a started one parked, and jobs after
        # them may finish first.
        for job in (self._parked.get(key), self._waiting.get(key), self._latest.get(key)):
            if job is not None:
                await _outcome_of(job)

    async def flush(self, peer: bytes) -> Tally:
        """Wait for every job ``peer`` sent so far; return its running tally.

        The tally is cumulative, never reset: a client whose flush timed out
        still sees, at its next flush, a failure the lost answer reported."""
        jobs = list(self._by_peer.get(peer, ()))
        for job in jobs:
            if isinstance(job, SaveJob):
                job.hurry.set()
        for job in jobs:
            # A job replaced by another client's while this flush waits must
            # be answered for by the replacement (see the module docstring).
            await _outcome_of(job)
        return replace(self._used_tally(peer) or Tally(), unreported=[])

    def failed_up_to(self, peer: bytes, covered: int) -> int:
        """``peer``'s failures for its flush that came as ``jobs_taken`` was
        ``covered``: see Tally.failed_up_to."""
        tally = self._used_tally(peer)
        return 0 if tally is None else tally.failed_up_to(covered)

    async def collect(self) -> list[StoredEntry]:
        """Re-read the root and apply the disk budget now (``kvkeeper gc``).
        The root is read beside the writer; the evictions wait for its turn."""
        if self.draining or self._aside is None:
            return []
        if not self.indexed.is_set():
            # Asked during the start-up scan: it reads the root anyway, and
            # ends with the budget applied; waiting for it on the writer's
            # turn held every save up meanwhile.
            await self.indexed.wait()
            if self._scan_failed is not None:
                raise GcFailed(self._scan_failed, self._scan_evicted)
            return self._scan_evicted
        job = self._next_gc
        if job is None:
            job = self._next_gc = GcJob(key=("", ""), peer=b"")
            self._aside.start_soon(self._scan_for, job)
        await job.done.wait()
        if job.failed is not None:
            raise GcFailed(job.failed, job.evicted)
        return job.evicted

    def begin_drain(self) -> None:
        """The daemon stops: hold no save from now on (those held are
        written now); the saves still taken are those the server lets in."""
        self.draining = True
        self._stop_indexing.set()
        self._release_held()

    def stop_accepting(self) -> None:
        """Refuse new saves from now on; finish those already received."""
        if not self.accepting:
            return
        self.draining = True
        self.accepting = False
        self._send.close()
        self._release_held()
        self._close_resend()

    async def stop_writing(self) -> None:
        """The drain is cut short: stop now. A write under way ends with its
        current slice (a worker thread is not interrupted); no other job
        starts. Returns once the writer is done, so that ``unfinished`` is
        what was not written (it went on taking jobs while the last replies
        went out, and wrote saves the log had named as lost)."""
        self._writing.cancel()
        await self.finished.wait()

    # ------------------------------------------------------------ the writer

    async def run(self) -> None:
        """Process jobs until the mailbox is closed and drained."""
        try:
            with self._writing:
                async with self._recv, anyio.create_task_group() as away:
                    self._aside = away
                    await self._sweep()
                    away.start_soon(self._index_store)
                    try:
                        await self._work(away)
                    finally:
                        self._stop_indexing.set()  # the scan must not hold up the exit
        finally:
            self._aside = None  # a gc asked from now on starts nothing (see collect)
            # The drain was cut short: no parked save's tmp file is left
            # behind (closing and unlinking cannot wait for a thread here).
            for job in self._parked.values():
                if (tmp := job.tmp_file()) is not None:
                    tmp.abort()
            self.finished.set()

    async def _work(self, away: TaskGroup) -> None:
        while True:
            self._close_resend()
            try:
                job = (await self._recv.receive()).job
            except anyio.EndOfStream:
                return
            if isinstance(job, SaveJob):
                job.place = None
            if job.done.is_set():
                continue  # superseded while it waited
            self.current = job
            try:
                await self._take(job, away)
            except Exception:  # noqa: BLE001 - a bug in one job must not stop the writer
                self.stats.inc("internal_errors")
                log.exception("event=job_crashed key=%s", job.key)
                if not job.done.is_set():
                    self._resolve(job, Outcome.FAILED, "internal error")
                    # Told as a failed write is: its client (and those whose
                    # saves it replaced) would read the older file as settled.
                    # Not a save whose stream the server broke: the client
                    # was told, or is told by the refusal of its next bytes,
                    # or is gone.
                    self._tell_lost(job, _INTERNAL,
                                    saver=not (isinstance(job, SaveJob) and job.broken))
                job.done.set()
            finally:
                self.current = None

    async def _sweep(self) -> None:
        """Remove the tmp files a crash left behind, before the first write."""
        try:
            swept = await anyio.to_thread.run_sync(self.store.sweep)
            if swept:
                log.info("event=swept_tmp count=%d", len(swept))
        except OSError as exc:
            log.error("event=sweep_failed error=%s", exc)

    async def _index_store(self) -> None:
        """Index the store, beside the writer's jobs. The daemon used to bind
        its socket only once this was done, and every save made meanwhile
        was dropped (20,000 entries, page cache cold: 5 s here, 28 s once);
        saves held back until it was done held their clients' loads of
        those keys. Nothing is evicted until it is done (see Store.rescan);
        a drain cuts it short, and the budget then waits for the next start."""
        began = time.monotonic()
        try:
            # A drain cuts the scan short; one that begins after its last file
            # still ends its evictions (gc evicts nothing from the drain's start).
            complete = await anyio.to_thread.run_sync(functools.partial(
                self.store.rescan_and_enforce, self._stop_indexing, self._scan_evicted,
                writers_turn=False))
            if not complete:
                log.warning("event=scan_cut_short reason=draining: nothing is evicted "
                            "until the next start")
        except OSError as exc:
            # Serving (with the disk budget off) beats a supervisor's restart
            # loop; a gc scans again.
            log.error("event=scan_failed error=%s: nothing is evicted until a gc", exc)
            self._scan_failed = f"the start-up scan of the store failed: {exc}"
        except Exception:  # noqa: BLE001 - as for a job: the writer goes on
            self.stats.inc("internal_errors")
            log.exception("event=scan_crashed: nothing is evicted until a gc")
            self._scan_failed = _CRASHED.format("the start-up scan of the store")
        finally:
            # Those that went before a failure too: they are gone.
            self._count_evictions(self._scan_evicted)
            self.indexed.set()
        log.info("event=indexed files=%d disk_used_bytes=%d seconds=%.2f", self.store.count(),
                 self.store.usage(), time.monotonic() - began)

    async def _take(self, job: Job, away: TaskGroup) -> None:
        """Do one job from the mailbox: hold it, write it (or park it), delete."""
        parked = self._parked.get(job.key)
        if parked is not None and parked is not job:
            await self._overtake(parked, job)
            if job.done.is_set():
                return  # replaced or failed while the parked save's tmp file went
        if (isinstance(job, SaveJob) and not job.started
                and (due := self._hold_until(job)) is not None):
            self._held[job.key] = job
            self._away += 1
            self.stats.inc("saves_held")
            away.start_soon(self._hold, job, due)
        elif isinstance(job, SaveJob):
            if not await self._write(job):
                self._parked[job.key] = job
                self._away += 1
                away.start_soon(self._park, job)
        elif isinstance(job, DeleteJob):
            await self._delete(job)
        elif isinstance(job, GcJob):
            await self._gc(job)

    async def _overtake(self, parked: SaveJob, job: Job) -> None:
        """``job`` of a parked save's key is taken first: a newer save or a
        delete replaces the parked save, whose result it would undo anyway;
        moving a damaged file aside goes first and leaves it parked."""
        if isinstance(job, DeleteJob) and job.reason is not None:
            return
        # Replaced before the tmp file goes: meanwhile ``job`` itself may be
        # replaced in turn, and must pass the parked save's client on.
        del self._parked[parked.key]
        tmp = parked.tmp_file()  # before it is resolved: that lets go of it
        self._supersede(parked, job)
        parked.arrived.set()  # its park task ends
        if tmp is not None:
            await anyio.to_thread.run_sync(tmp.abort)

    async def _park(self, job: SaveJob) -> None:
        """Wait until a parked save's bytes come again (or it broke, or was
        replaced), or its stall timeout is over, then put it back in line."""
        assert job.starved_since is not None
        deadline = job.starved_since + self.stall_timeout
        with anyio.move_on_after(deadline - time.monotonic()):
            await job.arrived.wait()
        await self._put_back(job)

    async def _put_back(self, job: SaveJob) -> None:
        """Return a held or parked save to the mailbox, unless it is done."""
        place = None
        try:
            if not job.done.is_set():
                job.hurry.set()  # its turn has come: it is not held again
                # Before it is in: a newer save may take its place while it
                # waits for room.
                place = job.place = Place(job)
                await self._resend.send(place)
        except anyio.ClosedResourceError:
            # A bug (see _close_resend), but not one to lose a save silently
            # over or to stop the writer with: the save fails, and says so.
            self.stats.inc("internal_errors")
            log.error("event=save_not_requeued model=%s id=%s", *job.key)
            if self._parked.get(job.key) is job:
                del self._parked[job.key]
            if (tmp := job.tmp_file()) is not None:
                tmp.abort()
            # (Or the save that took its place, if one did.)
            lost = job if place is None else place.job
            if not lost.done.is_set():
                self._resolve(lost, Outcome.FAILED, _NOT_REQUEUED)
                self._tell_lost(lost, _NOT_REQUEUED, saver=True)
        finally:
            self._away -= 1
            self._close_resend()

    def _close_resend(self) -> None:
        # Once accepting ended, the mailbox closes (ending run) when no save
        # can come back to it: none held or parked, and the writer idle on an
        # empty mailbox (a save in hand or still queued may yet be parked).
        if (not self.accepting and not self._away and self.current is None
                and not self._queued()):
            self._resend.close()

    def _queued(self) -> int:
        """Jobs in the mailbox, not yet taken by the writer."""
        return self._recv.statistics().current_buffer_used

    def _hold_until(self, job: SaveJob) -> float | None:
        """When a save may be written, if that is later than now."""
        if (job.hurry.is_set() or self.draining or job.total > HOLD_MAX_BYTES
                or self.pending_bytes > self.max_pending_bytes // 2):
            return None
        return self._writes.due(job.key, time.monotonic())

    async def _hold(self, job: SaveJob, due: float) -> None:
        with anyio.move_on_after(due - time.monotonic()):
            await job.hurry.wait()
        if self._held.get(job.key) is job:
            del self._held[job.key]
        await self._put_back(job)

    def _release_held(self) -> None:
        for job in self._held.values():
            job.hurry.set()

    async def _scan_for(self, job: GcJob) -> None:
        """A gc's first half, beside the writer: re-read the root. On the
        writer's turn, a rescan of 10,000 entries held every save up for
        about a second; the store takes in what the writer changes meanwhile
        (see Store.rescan). Then the evictions queue for the writer's turn."""
        queued = False
        try:
            async with self._gc_scan:
                if self._next_gc is job:
                    self._next_gc = None  # begun: a request from now on needs a scan of its own
                # The drain cuts it short, and from its start nothing is evicted.
                complete = await anyio.to_thread.run_sync(self.store.rescan,
                                                          self._stop_indexing)
            if not complete or self.draining:
                log.warning("event=gc_cut_short reason=draining: nothing was evicted")
            else:
                # A full mailbox holds saves, each of which applies the
                # budget once written: the scan's index is in place for them.
                with contextlib.suppress(anyio.WouldBlock, anyio.ClosedResourceError):
                    self._send.send_nowait(Place(job))
                    queued = True  # its evictions: _gc, on the writer's turn
        except OSError as exc:
            log.error("event=gc_failed error=%s", exc)
            job.failed = f"reading the store failed: {exc}"
        except Exception:  # noqa: BLE001 - as for a job: the writer goes on
            self.stats.inc("internal_errors")
            log.exception("event=gc_crashed")
            job.failed = _CRASHED.format("reading the store")
        finally:
            if self._next_gc is job:
                self._next_gc = None  # cut off before it began: not to be shared
            if not queued:
                job.done.set()

    async def _gc(self, job: GcJob) -> None:
        """A gc's second half, on the writer's turn: apply the disk budget
        over the index its scan rebuilt."""
        if self.draining:
            # Asked before the drain began, its turn came during it: as one
            # asked during the drain, it evicts nothing (collect's check).
            log.warning("event=gc_cut_short reason=draining: nothing was evicted")
            job.done.set()
            return
        try:
            await anyio.to_thread.run_sync(functools.partial(
                self.store.enforce_budget, no_evictions=self._stop_indexing,
                into=job.evicted))
        except OSError as exc:
            log.error("event=gc_failed error=%s", exc)
            job.failed = f"applying the disk budget failed: {exc}"
        except Exception:  # noqa: BLE001 - as for a job: the writer goes on
            # (Left to the job's handler, the gc was answered as done: "evicted
            # nothing", exit 0; a review.)
            self.stats.inc("internal_errors")
            log.exception("event=gc_crashed")
            job.failed = _CRASHED.format("applying the disk budget")
        finally:
            self._count_evictions(job.evicted)  # those before a failure too
        job.done.set()

    async def _delete(self, job: DeleteJob) -> None:
        model, cache_id = job.key
        try:
            if job.reason is None:
                deleted = await anyio.to_thread.run_sync(self.store.delete, model, cache_id)
                # A save of the key it replaced counts: the delete comes "after
                # any pending save", which would have made the entry.
                discarded = job.replaced_own is not None or bool(job.heirs)
                job.existed = deleted or discarded
                # Apart, as loads are: a script counting what rm removed
                # read "deletes" 2 after two deletes of entries never saved.
                self.stats.inc("deletes" if job.existed else "deletes_missing")
                if job.existed:
                    # The one trace of a conversation's cache gone by request
                    # (rm, Client.delete), beside the evictions' own lines.
                    log.info("event=deleted model=%s id=%s file_deleted=%s "
                             "pending_save_discarded=%s", model, cache_id,
                             str(deleted).lower(), str(discarded).lower())
            else:
                moved = await anyio.to_thread.run_sync(
                    self.store.quarantine, model, cache_id, job.ino, job.mtime_ns, job.reason
                )
                job.existed = moved is not None
                self.stats.inc("files_quarantined", int(job.existed))
            self._resolve(job, Outcome.DELETED)
        except OSError as exc:
            # The store's own refusals say everything in their text; "[Errno
            # 17]" only misled.
            why = exc.strerror if isinstance(exc, LeftInPlace) and exc.strerror \
                else _describe(exc)
            log.error("event=%s model=%s id=%s error=%s",
                      "delete_failed" if job.reason is None else "quarantine_failed",
                      model, cache_id, why)
            self._resolve(job, Outcome.FAILED, why)
            # The saves it replaced are lost with it: their clients read the
            # older file as settled (a review; the deleting client's own too,
            # whose delete() raised).
            self._tell_lost(job, why, saver=False)

    async def _write(self, job: SaveJob) -> bool:
        """Write a save as its bytes come; False if it was parked instead."""
        assert job.layout is not None
        model, cache_id = job.key
        if self._waiting.get(job.key) is job:
            del self._waiting[job.key]
        if self._parked.get(job.key) is job:
            del self._parked[job.key]
        job.started = True
        job.pace_since = None  # a fresh window each time it is taken
        if job.file is None:
            job.file = _FileWriter(self.store, job, self._count_evictions)
        file = job.file
        try:
            while True:
                if job.chunks:
                    # Views of the joined small data too: slicing a bytearray
                    # (the hashing does, at tensor ends) would copy it.
                    batch, taken = [], 0
                    while job.chunks and taken < WRITE_SLICE_BYTES:
                        views = [memoryview(buf) if type(buf) is bytearray else buf
                                 for buf in job.chunks.popleft()]
                        for i, view in enumerate(views):
                            room = WRITE_SLICE_BYTES - taken
                            if len(view) > room:
                                # One message may hold far more (a raw client's
                                # frames go up to the memory budget): the rest
                                # goes back first, as views, which receive()
                                # never appends small frames to.
                                if room:
                                    batch.append(view[:room])
                                job.chunks.appendleft([view[room:], *views[i + 1:]])
                                taken = WRITE_SLICE_BYTES
                                break
                            batch.append(view)
                            taken += len(view)
                    if job.received != job.parked_at:  # new bytes, not those parked with it
                        job.starved_since = None
                elif job.broken:
                    raise StreamBroken(job.broken)
                elif file.written >= job.total:
                    batch = []  # a save with no data bytes: open and commit only
                else:
                    if not await self._await_bytes(job):
                        return False
                    continue
                n = sum(len(buf) for buf in batch)
                last = file.written + n >= job.total
                if last and job.broken:
                    # A guard: the server breaks a stream only before its last
                    # byte, but a stream marked broken is never committed.
                    raise StreamBroken(job.broken)
                await file.write(batch, n, last=last)
                job.reserved -= n
                self.pending_bytes -= n
                if last:
                    break
        except (OSError, StreamBroken, ValueError) as exc:
            if file.pending is not None:
                await anyio.to_thread.run_sync(file.pending.abort)
            log.error(
                "event=save_failed model=%s id=%s error=%s", model, cache_id, _describe(exc)
            )
            self._resolve(job, Outcome.FAILED, _describe(exc))
            # Its client is told but where the server broke its stream (the
            # client was told, or is by the refusal of its next bytes, or is
            # gone), whatever then failed: an I/O error
            # on the bytes queued before the break was told a second time.
            # A stalled one is alive, and its loads read the older file as
            # settled (a review).
            self._tell_lost(job, _describe(exc), saver=not job.broken)
            return True
        except BaseException:
            # A bug or a cancellation (drain cut short): no tmp file is left
            # behind for the next start to sweep. Closing and unlinking it
            # cannot wait for a worker thread here.
            if file.pending is not None:
                file.pending.abort()
            elif file.committed is not None:
                # Cancelled while its commit's thread ended: it is in.
                self._resolve(job, Outcome.WRITTEN)
            raise
        done = file.committed
        assert done is not None
        self._writes.went(job.key, time.monotonic())
        self.stats.inc("bytes_written", job.total)
        self.stats.sample("write_seconds", time.monotonic() - file.began)
        self.stats.sample("fsync_seconds", done.fsync_seconds)
        log.debug(
            "event=saved model=%s id=%s bytes=%d seconds=%.3f",
            model,
            cache_id,
            job.total,
            time.monotonic() - file.began,
        )
        self._resolve(job, Outcome.WRITTEN)
        return True

    def _count_evictions(self, evicted: list[StoredEntry]) -> None:
        self.stats.inc("evictions", len(evicted))
        self.stats.inc("bytes_evicted", sum(e.nbytes for e in evicted))

    async def _await_bytes(self, job: SaveJob) -> bool:
        """Wait for more of a started save's bytes; False when it should be
        parked (others are waiting and fewer than PARK_BELOW_BYTES of it have
        come in the last PARK_AFTER). Raises StreamBroken after the stall
        timeout."""
        now = time.monotonic()
        if job.starved_since is None:
            job.starved_since = now
        if job.pace_since is None:
            # From its last bytes, not from now: each save silent since long
            # before the writer took it held the writer a whole PARK_AFTER
            # (20 begun and silent: a save behind them waited 9.9 s).
            job.pace_since, job.pace_from = min(now, job.last_activity), job.received
        deadline = job.starved_since + self.stall_timeout
        if now >= deadline:
            raise StreamBroken(f"no bytes for {self.stall_timeout:g} s "
                               f"({job.received} of {job.total} received)")
        job.arrived = anyio.Event()
        until = min(deadline, now + PARK_AFTER)
        if self._queued():
            until = min(until, max(now, job.pace_since + PARK_AFTER))
        with anyio.move_on_after(until - now):
            await job.arrived.wait()
        now = time.monotonic()
        if not self._queued() or now - job.pace_since < PARK_AFTER:
            return True
        if job.received >= job.total or job.broken:
            return True  # nothing more to wait for: finish it (or fail it) now
        if job.received - job.pace_from >= PARK_BELOW_BYTES:
            job.pace_since, job.pace_from = now, job.received
            return True
        log.info("event=save_parked model=%s id=%s received=%d total=%d",
                 *job.key, job.received, job.total)
        self.stats.inc("saves_parked")
        # The park waits for bytes that come from now on: those already
        # queued are written when it is taken again, and the stall timeout
        # counts from their arrival, not from that write (a save whose bytes
        # stopped right here lived on for up to two timeouts).
        job.arrived = anyio.Event()
        job.parked_at = job.received
        if job.chunks:
            job.starved_since = job.last_activity
        return False

    # ------------------------------------------------------------ bookkeeping

    def _supersede(self, old: SaveJob, new: Job) -> None:
        """``new`` replaces ``old``, and answers for it to every client that
        was waiting for it (see the module docstring)."""
        replaced = dict(old.heirs)
        replaced[old.peer] = min(old.own_stamp, replaced.get(old.peer, old.own_stamp))
        own = replaced.pop(new.peer, None)
        if own is not None:
            new.replaced_own = own if new.replaced_own is None else min(new.replaced_own, own)
        for peer, stamp in replaced.items():
            new.heirs[peer] = min(stamp, new.heirs.get(peer, stamp))
            self._by_peer.setdefault(peer, set()).add(new)
        saves = {**old.heir_saves, old.peer: old.save_id}  # old is newer than those it replaced
        if isinstance(new, SaveJob):
            saves.pop(new.peer, None)  # told of the new job's failure as its own save's
        for peer, number in saves.items():
            # The newest of each client's: a parked save overtaken after a
            # newer one of its client was replaced told the older number,
            # and that client, having sent a newer save, marked nothing (a
            # review).
            new.heir_saves[peer] = max(number, new.heir_saves.get(peer, number))
        old.replaced_by = new
        self._resolve(old, Outcome.SUPERSEDED)

    def _tell_lost(self, job: Job, why: str, *, saver: bool) -> None:
        """``job`` failed: tell the clients whose saves it replaced (their
        saves are lost with it) and, with ``saver``, its own client, each
        of the save of theirs it was (see ``on_write_failed``)."""
        if self.on_write_failed is None:
            return
        replaced_by = "save" if isinstance(job, SaveJob) else "delete"
        for peer, save_id in job.heir_saves.items():
            self.on_write_failed(peer, save_id,
                                 f"the {replaced_by} that replaced it failed: {why}")
        if saver and isinstance(job, SaveJob):
            self.on_write_failed(job.peer, job.save_id, f"{WRITE_FAILED}{why}")

    def _enqueued(self, job: Job) -> None:
        self._latest[job.key] = job
        self._by_peer.setdefault(job.peer, set()).add(job)
        self.jobs_taken += 1
        job.stamp = self.jobs_taken

    def _resolve(self, job: Job, outcome: Outcome, detail: str = "") -> None:
        if job.done.is_set():
            return
        job.outcome = outcome
        job.detail = detail
        if isinstance(job, SaveJob):
            job.hurry.set()  # ends its hold, if it is held
            self.pending_bytes -= job.reserved
            job.reserved = 0
            # Its memory goes with its reservation: the server keeps the job
            # of a peer's last stream (to drop the bytes still coming), for
            # as long as that peer sends nothing else.
            job.chunks.clear()
            job.metadata = {}
            # The decoded tensor table may be far larger than its bytes on
            # the wire (65,536 long names: 35 MB), and budgeted for none of it.
            job.layout = None
            job.file = None
            if job.protected is not None:
                self.store.unprotect(job.protected)
                job.protected = None
            if self._waiting.get(job.key) is job:
                del self._waiting[job.key]
            self.stats.inc(f"saves_{outcome.value}")
            tally = self._tally_of(job.peer)
            if outcome is Outcome.WRITTEN:
                tally.written += 1
            elif outcome is Outcome.SUPERSEDED:
                tally.superseded += 1
            else:
                self._fail(job.peer, job.own_stamp)
        if outcome is Outcome.FAILED:
            for peer, stamp in job.heirs.items():  # their save was replaced by a job that failed
                self._fail(peer, stamp)
            if job.replaced_own is not None and not isinstance(job, SaveJob):
                # (A failed save counts itself.)
                self._fail(job.peer, job.own_stamp)
        if self._latest.get(job.key) is job:
            # A held or parked save may still be waiting behind a job that
            # overtook it (moving a damaged file aside): it is the newest
            # unfinished now.
            behind = self._waiting.get(job.key) or self._parked.get(job.key)
            if behind is not None and behind is not job:
                self._latest[job.key] = behind
            else:
                del self._latest[job.key]
        for peer in {job.peer, *job.heirs}:
            peer_jobs = self._by_peer.get(peer)
            if peer_jobs is not None:
                peer_jobs.discard(job)
                if not peer_jobs:
                    del self._by_peer[peer]
        job.done.set()

    def unfinished(self) -> list[Job]:
        """The newest unfinished job of each key (for the drain-timeout log)."""
        return list(self._latest.values())

    def note_refused(self, peer: bytes) -> None:
        """A save of ``peer`` the server turned away: it will not be written, and
        the peer's next flush says so even if the refusal's reply was lost."""
        # Stamped as a job: a flush that came before it does not report it.
        self.jobs_taken += 1
        self._fail(peer, self.jobs_taken)

    def _fail(self, peer: bytes, stamp: int) -> None:
        """A failure for ``peer``'s tally (see Tally.fail), the failures kept
        for every client bounded together (looked at once in a while: the
        sum walks every tally)."""
        self._tally_of(peer).fail(stamp)
        self._fails_unchecked += 1
        if self._fails_unchecked < _MAX_UNREPORTED:
            return
        self._fails_unchecked = 0
        kept = sum(len(t.unreported) for t in self._tally.values())
        for who, tally in list(self._tally.items()):  # least recently used first
            if kept <= _MAX_UNREPORTED_ALL // 2:
                break
            # Not of a client with jobs: a flush of its may be waiting for
            # them, and folded failures of saves after that flush's mark would
            # go to it (False for sound saves, then True for the failed ones).
            # A flush that comes later covers every stamp folded.
            if who not in self._by_peer:
                kept -= tally.fold()

    def peers(self) -> set[bytes]:
        """The clients whose saves the writer took: those with jobs, and
        those it keeps a tally for."""
        return {*self._by_peer, *self._tally}

    def _tally_of(self, peer: bytes) -> Tally:
        tally = self._used_tally(peer)
        if tally is None:
            if len(self._tally) >= _MAX_TALLIES:  # bound the clients remembered
                self._forget_a_tally()
            tally = self._tally[peer] = Tally()
        return tally

    def _used_tally(self, peer: bytes) -> Tally | None:
        """``peer``'s tally, if it has one, made the most recently used: the
        dict's order is recency (taken out and put back at every use)."""
        tally = self._tally.pop(peer, None)
        if tally is not None:
            self._tally[peer] = tally
        return tally

    def _forget_a_tally(self) -> None:
        """Make room for one more client's tally. A client compares its
        tally's ``failed`` with the last one it saw: one forgotten with no
        failure in it comes back as the same 0, so the least recently used of
        those goes, unless its client has jobs still running. Only when every
        tally has a failure does the least recently used go all the same:
        memory stays bounded. (Its client's next failure then starts the
        total again, maybe at the number the client last saw: kvkeeper's
        client also says False for a save it was told was refused, but a
        failure told by the total alone, a save cut off with its connection,
        would be missed.)"""
        for peer, tally in self._tally.items():
            if tally.failed == 0 and peer not in self._by_peer:
                del self._tally[peer]
                return
        del self._tally[next(iter(self._tally))]

    def gauges(self) -> dict[str, float]:
        budget = self.store.budget
        return {
            "pending_bytes": float(self.pending_bytes),
            # The writer's share of --max-pending-bytes (the rest is what
            # ZeroMQ may queue before the server reads it).
            "writer_max_pending_bytes": float(self.max_pending_bytes),
            "queue_depth": float(self._queued()),
            "held_saves": float(len(self._held)),
            "parked_saves": float(len(self._parked)),
            "disk_used_bytes": float(self.store.usage()),
            # 1 while the start-up scan runs: until it is done,
            # disk_used_bytes counts only the files written since the start.
            "store_indexing": 0.0 if self.indexed.is_set() else 1.0,
            "max_disk_bytes": float(budget.max_disk_bytes or 0),
            "min_free_bytes": float(budget.min_free_bytes),
            "below_min_free": 1.0 if self.store.short_of_min_free else 0.0,
        }


async def _outcome_of(job: Job) -> None:
    """Wait until ``job`` is finished and, if it was replaced, until its
    replacement is (following the chain); saves on the way are not held."""
    while True:
        if isinstance(job, SaveJob):
            job.hurry.set()
        await job.done.wait()
        if job.replaced_by is None:
            return
        job = job.replaced_by


_INTERNAL = "internal error (the daemon's log has its traceback)"
_NOT_REQUEUED = "internal error: the writer had closed its mailbox"
_CRASHED = "{} crashed (an internal error; the daemon's log has its traceback)"


class StreamBroken(Exception):
    """A save whose bytes stopped coming or did not add up."""


#: At most this many bytes go to the disk thread in one call, which a drain's
#: timeout cannot cut short: taking every byte received made a 160 MiB save
#: on a 20 MiB/s disk outlive a 1 s --drain-timeout by 6.6 s (the service
#: managers kill the daemon 10 s after theirs).
WRITE_SLICE_BYTES = 32 * 1024 * 1024

#: Below this many bytes a batch is hashed in the thread that writes it: a
#: second worker thread costs more (a hand-off each way) than hashing it.
PARALLEL_HASH_BYTES = 4 * 1024 * 1024


class _FileWriter:
    """One save's file, written batch by batch off the event loop.

    Each ``write`` of a batch under PARALLEL_HASH_BYTES is one trip to a
    worker thread that opens the file if it is not open yet, writes and
    hashes the batch, and on the last batch commits it, so a small save that
    arrived whole costs one trip. Larger batches are hashed in a second
    thread at the same time as they are written (both release the GIL for
    large buffers), and the commit takes a trip of its own.
    """

    def __init__(self, store: Store, job: SaveJob,
                 on_evicted: Callable[[list[StoredEntry]], None]) -> None:
        assert job.layout is not None
        self.store, self.job, self.layout = store, job, job.layout
        self.hasher = TensorHasher(job.layout.sizes)
        self.pending: PendingFile | None = None
        self.committed: PendingFile | None = None
        # Counted as they go, on the event loop: the save may yet fail, be
        # parked and replaced, or be cut off by the drain; they are gone all
        # the same.
        self.evicted: list[StoredEntry] = []
        self._may_evict = True  # see _room_after_full: one round of evictions a file
        self._on_evicted = on_evicted
        self.written = 0
        self.began = time.monotonic()

    async def write(self, batch: list[Chunk], nbytes: int, *, last: bool) -> None:
        try:
            await self._write(batch, nbytes, last)
        finally:
            if self.evicted:
                evicted, self.evicted = self.evicted, []
                self._on_evicted(evicted)

    async def _write(self, batch: list[Chunk], nbytes: int, last: bool) -> None:
        if nbytes < PARALLEL_HASH_BYTES:
            await anyio.to_thread.run_sync(self._step, batch, True, last)
            self.written += nbytes
            return
        errors: list[BaseException] = []

        def guarded(fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the group
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, guarded, self._hash, batch)
            await anyio.to_thread.run_sync(guarded, self._step, batch, False, False)
        if errors:
            raise errors[0]
        self.written += nbytes
        if last:
            await anyio.to_thread.run_sync(self._commit)

    def _hash(self, batch: list[Chunk]) -> None:
        for buf in batch:
            self.hasher.update(buf)

    def _step(self, batch: list[Chunk], hash_too: bool, last: bool) -> None:
        if self.pending is None:
            model, cache_id = self.job.key
            header = self.layout.header(self.job.metadata)
            # submit_save checked data and metadata against the disk budget;
            # the exact size needs the encoded header (escapes, tensor table).
            if len(header) - 8 > MAX_WRITTEN_HEADER:
                raise ValueError(f"the file's header would be {len(header) - 8} bytes (token "
                                 f"ids, metadata and tensor names as JSON), over the "
                                 f"{MAX_WRITTEN_HEADER} readers take")
            disk = self.store.budget.max_disk_bytes
            if disk is not None and len(header) + self.job.total > disk:
                raise ValueError(f"the file would take {len(header) + self.job.total} bytes, "
                                 f"over max disk bytes ({disk})")
            # The tmp file first: a directory it cannot be made in (a mode
            # changed by hand) must not cost the entries evicted for it. But
            # a full disk may not take it either (ext4 has no block for a new
            # model's directory, nor an inode left): then room first, and
            # once more.
            size = len(header) + self.job.total
            for tries_left in (2, 1, 0):  # a new model's directory and the file
                try:
                    self.pending = self.store.begin(model, cache_id, len(header),
                                                    self.job.total)
                    break
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    before = len(self.evicted)
                    try:
                        if tries_left:  # (into: counted even if it fails part way)
                            self.store.make_room(model, cache_id, size, need_inode=True,
                                                 into=self.evicted)
                        if self.store.out_of_inodes(self.store.path_for(model, cache_id)) \
                                or (len(self.evicted) == before and not tries_left):
                            # No inode yet (an eviction of a file open
                            # elsewhere frees none): begin would fail alike.
                            # Nothing evicted here, but inodes free: the
                            # start-up scan's pass freed them meanwhile.
                            raise
                    except BaseException:  # giving up: a new model's directory, left empty
                        self.store.drop_model_dir(model)
                        raise
            # (Again after a retry: the new model's directory took a block.)
            self.store.make_room(model, cache_id, size, into=self.evicted)
            assert self.pending is not None  # begin() made it, or the loop raised
            self.pending.on_full = self._room_after_full
            self.pending.append([header])
        if hash_too:
            self._hash(batch)
        if batch:
            self.pending.append(batch)
        if last:
            self._commit()

    def _room_after_full(self, left: int, first: bool) -> bool:
        """``PendingFile.on_full``: room for the rest of a write that met
        ENOSPC, with one round of evictions at most for the file. They go to
        the batch's list (a new one each batch), counted in the stats with
        the others."""
        model, cache_id = self.job.key
        before = len(self.evicted)
        room = self.store.room_after_full(model, cache_id, left, first,
                                          may_evict=self._may_evict, into=self.evicted)
        if len(self.evicted) > before:
            self._may_evict = False
        return room

    def _commit(self) -> None:
        assert self.pending is not None
        # Built while the tmp file is still ours to remove (see _write's
        # handlers); from then on commit cleans up after itself on failure.
        final = self.layout.header(self.job.metadata, self.hasher.hexdigests())
        done, self.pending = self.pending, None
        self.evicted += self.store.commit(done, final, self.job.metadata.get(TOKEN_COUNT_KEY))
        self.committed = done


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        # The file, when the error names one: "Permission denied" alone did
        # not say which directory to mend.
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror} (errno {exc.errno}){where}"
    return str(exc) or type(exc).__name__
