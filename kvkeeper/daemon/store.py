"""The store on disk: where an entry's file lives, the in-memory index of the
root, listing, deletes, quarantine and the disk budget's evictions.

Plain synchronous code; the writer actor calls it from a worker thread. Files
are only ever replaced whole, through ``durable.PendingFile``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import itertools
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvkeeper.config import ConfigError
from kvkeeper.daemon import faults
from kvkeeper.daemon.durable import TMP_SUFFIX, PendingFile, fsync_dir, settle_frees
from kvkeeper.logs import get_logger
from kvkeeper.protocol import naming
from kvkeeper.protocol.legacy_formats import GEZEL_SCHEMA3, detect_legacy
from kvkeeper.protocol.naming import QUARANTINE_DIR
from kvkeeper.protocol.safetensors import (
    CACHE_ID_KEY,
    MODEL_KEY,
    TOKEN_COUNT_KEY,
    LayoutError,
    TableError,
    is_cache,
    open_file,
    says_nothing_of_the_file,
    written_by_kvkeeper,
)
from kvkeeper.walk import walk

log = get_logger("kvkeeper.store")

class LeftInPlace(OSError):
    """The store will not touch a file (another program's, or one it cannot
    tell from another program's); its text says which and why."""


#: The names quarantine_path gives: "<dir>.<file>.safetensors.<ns>", dir and
#: file an entry's place (their components escape every "."), or
#: "_z<sha256>.<ns>", ns being time.time_ns() (19 digits until 2286).
_QUARANTINED = re.compile(r"([^.]+)\.([^.]+\.safetensors)\.[0-9]{19}")
_QUARANTINED_HASHED = re.compile(r"_z[0-9a-f]{64}\.[0-9]{19}")


def _quarantine_name(name: str) -> bool:
    """Whether ``name`` is one quarantine_path gives: a file in quarantine/
    under another (a user's copy, "weights.safetensors.<19 digits>") is not
    the daemon's to delete."""
    if _QUARANTINED_HASHED.fullmatch(name):
        return True
    found = _QUARANTINED.fullmatch(name)
    return found is not None and naming.is_entry_place(Path(found[1], found[2]))


#: A file moved aside in its own directory, where quarantine/ is on another
#: disk: "<entry file>.<ns>.quarantined".
_BESIDE_SUFFIX = ".quarantined"
_BESIDE = re.compile(r"([^.]+" + re.escape(naming.SUFFIX) + r")\.[0-9]{19}"
                     + re.escape(_BESIDE_SUFFIX))


def _beside_key(path: Path) -> tuple[str, str] | None:
    """(model, cache id) of a file quarantine_path moved aside beside its
    place ("" and "" for a hashed place), or None if ``path`` has no such name."""
    found = _BESIDE.fullmatch(path.name)
    if found is None:
        return None
    place = Path(path.parent.name, found[1])
    if not naming.is_entry_place(place):
        return None
    model, cache_id = naming.key_of(place)
    return (model, cache_id) if model and cache_id else ("", "")


#: The names PendingFile gives its tmp files: ``.<entry file>.<pid>.<n>.tmp``.
_OUR_TMP = re.compile(r"\..+" + re.escape(naming.SUFFIX) + r"\.[0-9]+\.[0-9]+"
                      + re.escape(TMP_SUFFIX))


def _quarantined_key(name: str) -> tuple[str, str]:
    """(model, cache id) a quarantined file's name records, or two "" where
    it records no entry's key (a hashed name, a file that was not an
    entry's). The components escape every ".", so the first one ends the
    model's."""
    model_dir, _, rest = name.partition(".")
    file_name = rest.rpartition(".")[0]  # less the time stamp
    if not model_dir or not file_name.endswith(naming.SUFFIX):
        return "", ""
    model, cache_id = naming.key_of(Path(model_dir) / file_name)
    if not model or not cache_id:
        return "", ""
    return model, cache_id


def real_dir(path: Path) -> None:
    """Raise ENOTDIR unless ``path`` is a directory and no symlink: one
    planted for a model's directory or ``quarantine/`` would take loads,
    deletes and moves out of the root (the last component of a path is
    never followed; the ones before it are, unless looked at)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{path} is a symlink (refused: the store keeps its "
                                     f"files in the root itself; move it aside)")
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{path} is not a directory (move it aside)")


def check_sessions_dir(sessions: Path) -> None:
    """Raise ConfigError if ``sessions`` is there and is a symlink or not a
    directory (the daemon refuses to start on it)."""
    if os.path.lexists(sessions) and (os.path.islink(sessions)
                                      or not os.path.isdir(sessions)):
        raise ConfigError(f"{sessions} is a symlink or not a directory; the store keeps "
                          f"its entries there (move it aside)")


@dataclass(frozen=True)
class StoredEntry:
    """One file under the root, as the in-memory index knows it.

    ``kind``: ``entry`` (a kvkeeper file), ``legacy`` (a cache file of an older
    format in an entry's place: counted, evictable), ``quarantine`` (moved
    aside as unusable: evicted first), ``foreign`` (anything else, including
    tmp files of a live writer: counted, never deleted). ``ino`` and
    ``mtime_ns`` identify the file indexed, so that a file put at its path
    by another program since is never evicted for it."""

    model: str
    cache_id: str
    tokens: int
    nbytes: int
    last_used: float
    path: Path
    kind: str = "entry"
    saved_at: float = 0.0
    ino: int = 0
    mtime_ns: int = 0

    def is_at(self, st: os.stat_result) -> bool:
        """Whether ``st`` (an lstat of its path) is still the file indexed."""
        return (stat.S_ISREG(st.st_mode) and (st.st_ino, st.st_mtime_ns, st.st_size)
                == (self.ino, self.mtime_ns, self.nbytes))


@dataclass
class Budget:
    """Disk limits: bytes under the root, and free bytes kept on the store's
    file system (that of ``sessions/``)."""

    max_disk_bytes: int | None = None
    min_free_bytes: int = 0


class Store:
    """Whole-session files under ``root/sessions/<model>/<cache id>.safetensors``.

    The narrow interface (begin a put, commit it, find, delete, entries, evict)
    is what a second layout (token blocks) will implement beside this one.
    An index of every file under the root is kept in memory, built at open
    from headers only, so the disk budget is enforced after every write
    without walking the tree. It is kept in the order of use, oldest first,
    with the bytes it counts summed as it changes: a save costs about the
    same with 20 entries or 20,000 (with 20,000, summing the index twice a
    save, and sorting it when the budget was reached, took the daemon's CPU
    per save from 1.3 ms to 5.7-6.6 ms).
    """

    def __init__(self, root: Path, budget: Budget | None = None,
                 own_files: Sequence[Path] = ()) -> None:
        """``own_files``: files under ``root`` that are the daemon's own (the
        socket's lock, were the socket put there), neither indexed nor
        counted, as the root's lock is not."""
        self.root = root
        own = [root / naming.LOCK_NAME, *own_files]
        self._own_names = {p.name for p in own}
        # Resolved: the socket may be named through a link to the root's parent.
        self._own = {os.path.realpath(p) for p in own}
        self.sessions = root / naming.SESSIONS_DIR
        self.budget = budget or Budget()
        self._lock = threading.Lock()
        # Changed only through _put, _drop and rescan, which keep the order
        # and the two counts.
        self._index: dict[Path, StoredEntry] = {}
        self._used = 0
        self._quarantined = 0
        # While a rescan runs (None otherwise), by path: the files put (their
        # entry) or removed (None) meanwhile, and the uses.
        self._meanwhile: dict[Path, StoredEntry | None] | None = None
        self._uses_meanwhile: dict[Path, float] | None = None
        self._whole = False  # a rescan has read every file: the budget may evict
        self._out_of_order = False  # see _still_indexed (under _lock)
        #: The last pass over the store's disk with no write to make room for
        #: (the start's, a save's once written, a gc's) left it with less than
        #: --min-free-bytes free (other files fill it: each save evicts the
        #: entries before it); ``stats`` says so as below_min_free.
        self.short_of_min_free = False
        #: Budget passes after a commit that raised a bug (counted as the
        #: daemon's internal errors).
        self.budget_crashes = 0
        self._evicting = threading.Lock()  # the start-up scan's eviction beside the writer's
        self._synced_dirs: set[Path] = set()  # see _synced
        self._scanning = threading.Lock()
        # Keys with a save on its way (see protect: evicted last), by their
        # file's path.
        self._protected: collections.Counter[Path] = collections.Counter()

    def _put(self, entry: StoredEntry) -> None:
        """Index ``entry`` as the most recently used file (lock held)."""
        self._drop(entry.path)
        self._index[entry.path] = entry
        self._used += entry.nbytes
        self._quarantined += entry.kind == "quarantine"
        if self._meanwhile is not None:
            self._meanwhile[entry.path] = entry

    def _drop(self, path: Path, *, change: bool = True) -> StoredEntry | None:
        """Forget ``path``; returns what was indexed there (lock held).
        ``change``: a change a rescan running must apply over what it read."""
        old = self._index.pop(path, None)
        if old is not None:
            self._used -= old.nbytes
            self._quarantined -= old.kind == "quarantine"
        if self._meanwhile is not None and change:
            self._meanwhile[path] = None
        return old

    def _forget_if_gone(self, path: Path) -> None:
        """Forget ``path`` if its file is gone (removed by hand: the index
        would list and count it until a rescan). Looked at again under the
        lock: a save may have renamed its file in, and indexed it, since."""
        with self._lock:
            if path in self._index and _gone(path):
                # Seen, not done by the daemon: a rescan running reads the
                # file again (a file put back meanwhile stays indexed, and one
                # still gone is forgotten at the next look).
                self._drop(path, change=False)

    # -- paths
    def path_for(self, model: str, cache_id: str) -> Path:
        return naming.entry_path(self.root, model, cache_id)

    def _model_dir(self, model: str) -> Path:
        d = self._model_dir_path(model)
        with contextlib.suppress(FileNotFoundError):  # made again (_sessions_again)
            real_dir(self.sessions)
        self._own_dir(d, parent_gone=self._sessions_again)
        return d

    def _real_model_dir(self, d: Path) -> None:
        """``real_dir`` for a model's directory and for ``sessions/`` above it:
        ``sessions/`` replaced by a symlink while the daemon ran (it is looked
        at only at start) took saves, loads and deletes out of the root."""
        real_dir(self.sessions)
        real_dir(d)

    def _model_dir_path(self, model: str) -> Path:
        return self.sessions / naming.encode_component(model, "model")

    def _own_dir(self, d: Path, parent_gone: Callable[[], None] | None = None) -> None:
        """Make directory ``d`` (mode 0700) unless it is there, never
        through a symlink, with its entry made durable (``_synced``);
        ``parent_gone`` makes its parent again if that is missing."""
        try:
            try:
                os.mkdir(d, 0o700)
            except FileNotFoundError:
                if parent_gone is None:
                    raise
                parent_gone()
                os.mkdir(d, 0o700)
            made = True
        except FileExistsError:
            real_dir(d)
            made = False
        self._synced(d, made)

    def _drop_dir_if_empty(self, d: Path) -> None:
        """Remove model directory ``d`` if nothing is left in it (its last
        entry deleted, evicted or quarantined, or a new model's first save
        failed): a daemon that saw thousands of models kept a directory, and
        a path in ``_synced_dirs``, for each. rmdir removes only an empty
        directory, so a tmp file or another program's file keeps it. Its
        removal is not fsynced: after a crash an empty directory may be back,
        which costs nothing. Only on the writer's turn, which makes and
        fills the directories: the start-up scan's evictions, in a thread of
        their own, leave theirs to the next start (removing them there
        pulled a directory from under the writer, between its finding the
        directory and making a file in it, or fsyncing it after a delete)."""
        if d.parent != self.sessions:
            return  # the quarantine directory, or a path outside the layout
        try:
            os.rmdir(d)
        except OSError:
            return  # not empty (the common case), gone, or not ours to remove
        self._synced_dirs.discard(d)

    def _synced(self, d: Path, made: bool) -> None:
        """Make the entry of directory ``d`` in its parent durable, as the
        files put in it will be: a file system that does not journal them in
        order could otherwise lose the directory, and fsynced files with it.
        Done when this run made ``d``, and at its first use in this run: an
        earlier run may have made it and then crashed, or failed, before the
        parent's fsync (every later save then found it there and skipped it)."""
        if made or d not in self._synced_dirs:
            fsync_dir(d.parent)
            self._synced_dirs.add(d)

    def _sessions_again(self) -> None:
        """The sessions directory is gone (``rm -rf <root>/*`` clears the
        store but leaves the root and its lock): make it again, and forget
        the entries that went with it (left as it was, every save failed
        until a restart). A root removed whole stops the daemon instead:
        see the place check in ``app``."""
        os.mkdir(self.sessions, 0o700)  # not through a symlink: mkdir makes it
        self._synced(self.sessions, True)
        log.warning("event=sessions_recreated path=%s: the store was cleared while the daemon "
                    "ran", self.sessions)
        self.rescan()

    # -- lifecycle
    def open(self) -> None:
        """Create the layout, or check the one there; ``sweep`` and
        ``rescan`` then deal with the files in it."""
        fresh = not os.path.lexists(self.sessions)
        check_sessions_dir(self.sessions)  # (a regular file: makedirs said only "File exists")
        try:
            os.makedirs(self.sessions, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {self.sessions}: {exc.strerror}") from None
        check_sessions_dir(self.sessions)  # made meanwhile by someone else
        try:
            self._synced(self.sessions, fresh)
        except OSError as exc:  # a disk failing at start: say so, not a traceback
            raise ConfigError(f"cannot fsync {self.root}: {exc.strerror or exc}") from None
        if fresh:
            try:
                # Resolved: fsync_dir follows no link, and the root's parent
                # is often one (macOS's /tmp is /private/tmp).
                fsync_dir(Path(os.path.realpath(self.root.parent)))
            except OSError:
                pass  # a parent this user may not read: the root is older then

    def sweep(self) -> list[Path]:
        """Remove the tmp files a crash left behind (before any write: the
        writer's own are named alike); returns them."""
        removed = []
        for model_dir in self.sessions.iterdir():
            if model_dir.is_symlink() or not model_dir.is_dir():
                continue
            try:
                names = list(model_dir.iterdir())
            except OSError as exc:
                # One unreadable directory must not keep the others unswept.
                log.warning("event=sweep_failed path=%s error=%s", model_dir, exc)
                continue
            for f in names:
                # Only the writer's own names: ".notes.tmp" is another program's.
                if _OUR_TMP.fullmatch(f.name):
                    try:
                        f.unlink()
                        removed.append(f)
                    except OSError as exc:
                        log.warning("event=sweep_failed path=%s error=%s", f, exc)
            self._drop_dir_if_empty(model_dir)  # left empty by an earlier run
        return removed

    def rescan(self, stop: threading.Event | None = None) -> bool:
        """Rebuild the index from what is on disk (headers only); False when
        ``stop`` cut it short.

        The writer may put and remove files while it runs (the start-up
        scan runs beside it), and the server's thread records uses: those
        are applied over what it read, which may predate them. Until a scan
        has been whole, nothing is evicted (from a part of the store, the
        entries used last could go first). A scan cut short after a whole
        one leaves that one's index, kept up to date meanwhile, in place."""
        with self._scanning:  # one at a time (_sessions_again's waits for the start-up one)
            return self._rescan(stop)

    def _rescan(self, stop: threading.Event | None) -> bool:
        with self._lock:
            self._meanwhile, self._uses_meanwhile = {}, {}
        found: list[StoredEntry] = []
        complete = True
        try:
            for dirpath, dirnames, filenames in walk(self.root, onerror=self._unlisted):
                dirnames[:] = [d for d in dirnames
                               if not os.path.islink(os.path.join(dirpath, d))]
                for name in filenames:
                    faults.hold_scan(stop, len(found))
                    if stop is not None and stop.is_set():
                        complete = False
                        break
                    entry = self._classify(Path(dirpath) / name)
                    if entry is not None:
                        found.append(entry)
                if not complete:
                    break
            faults.hold_scan(stop, None)
        except BaseException:
            with self._lock:
                self._meanwhile = self._uses_meanwhile = None
            raise
        with self._lock:  # one hold: a put between two would be lost
            changes, uses = self._meanwhile, self._uses_meanwhile
            assert changes is not None and uses is not None
            self._meanwhile = self._uses_meanwhile = None
            if not complete and self._whole:
                return False  # a part of the store would drop the rest from the budget
            merged = {e.path: e for e in found}
            for path, entry in merged.items():
                # A file indexed already (the same inode, mtime and size)
                # keeps the daemon's own order of use. Its atime, read
                # again, moves with any reader's (a backup, cp): a gc after
                # one made every entry it read newer than the one last
                # loaded, which the next save then evicted (a review).
                known = self._index.get(path)
                if known is not None and known.kind == entry.kind and (
                        known.ino, known.mtime_ns, known.nbytes) == (
                        entry.ino, entry.mtime_ns, entry.nbytes):
                    merged[path] = replace(entry, last_used=known.last_used)
            for path, changed in changes.items():
                if changed is None:
                    merged.pop(path, None)
                else:
                    merged[path] = changed
            for path, when in uses.items():
                if (entry := merged.get(path)) is not None and when > entry.last_used:
                    merged[path] = replace(entry, last_used=when)
            self._index = {}
            self._used = self._quarantined = 0
            # One order of use for all: a file put meanwhile is not newer than
            # an entry loaded after it.
            self._insert_in_order(list(merged.values()))
            self._whole = complete
        return complete

    def _unlisted(self, exc: OSError) -> None:
        """A directory the scan cannot list: its files stay unindexed."""
        if isinstance(exc, FileNotFoundError) and exc.filename is not None \
                and Path(exc.filename).parent == self.sessions:
            return  # a model's directory the writer removed once empty, while the scan ran
        log.warning("event=unreadable_dir path=%s error=%s", exc.filename, exc)

    def rescan_and_enforce(self, stop: threading.Event | None = None,
                           into: list[StoredEntry] | None = None, *,
                           writers_turn: bool = True) -> bool:
        """``rescan``, then apply the disk budget; returns whether the scan
        was whole. What went is appended to ``into`` as it goes (see
        ``enforce_budget``). ``stop`` (the drain's start) cuts the scan
        short, and then nothing is evicted; set after its last file, it stops
        the evictions (see ``enforce_budget``'s ``no_evictions``).
        ``writers_turn`` False: run beside the writer (the start-up scan),
        so model directories emptied are left (see ``_drop_dir_if_empty``)."""
        if not self.rescan(stop):
            return False
        self.enforce_budget(no_evictions=stop, into=into, writers_turn=writers_turn)
        return True

    def _used_at(self, entry: StoredEntry, when: float) -> None:
        """Move ``entry`` last in the order of use (lock held). Not a _put:
        a rescan running must not take the entry for a change of the file."""
        del self._index[entry.path]
        self._index[entry.path] = replace(entry, last_used=when)

    def _insert_in_order(self, entries: list[StoredEntry]) -> None:
        """Index ``entries`` last, in the order of their last use (lock held)."""
        entries.sort(key=_use_order)
        for entry in entries:
            self._put(entry)

    def _classify(self, path: Path) -> StoredEntry | None:
        entry = self._classify_file(path)
        if entry is not None and entry.kind == "foreign" and path.parent.parent == self.sessions:
            # Listed with the model whose directory holds it (``ls --all --model``).
            return replace(entry, model=naming.decode_component(path.parent.name) or "")
        return entry

    def _classify_file(self, path: Path) -> StoredEntry | None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            # One file (a path past PATH_MAX, an I/O error) must not leave
            # the whole store unindexed.
            log.warning("event=unreadable_file path=%s error=%s", path, exc)
            return None
        if not stat.S_ISREG(st.st_mode) or (
                path.name in self._own_names and os.path.realpath(path) in self._own):
            return None  # links, the lock files
        last_used = max(st.st_atime, st.st_mtime)
        ident = (st.st_ino, st.st_mtime_ns)  # StoredEntry.ino, .mtime_ns
        foreign = StoredEntry("", "", 0, st.st_size, last_used, path, "foreign", st.st_mtime,
                              *ident)
        if path.parent == self.root / QUARANTINE_DIR:
            # Only names quarantine_path gives: another file put there is not ours.
            if not _quarantine_name(path.name):
                return foreign
            return StoredEntry(*_quarantined_key(path.name), 0, st.st_size, st.st_mtime, path,
                               "quarantine", st.st_mtime, *ident)
        if path.parent.parent == self.sessions and (beside := _beside_key(path)) is not None:
            return StoredEntry(*beside, 0, st.st_size, st.st_mtime, path, "quarantine",
                               st.st_mtime, *ident)
        if path.parent.parent != self.sessions or path.name.startswith(".") \
                or not path.name.endswith(naming.SUFFIX):
            return foreign
        place = naming.entry_place_key(path)
        try:
            with open_file(path, keep_atime=True) as (_, header):
                meta = header.metadata
        except OSError as exc:  # cannot tell what it is (see someone_elses)
            log.info("event=unreadable_file path=%s error=%s", path, exc)
            return foreign
        except LayoutError as exc:
            log.info("event=unreadable_file path=%s error=%s", path, exc)
            if place is None or place[0] is None or place[1] is None or _theirs(exc):
                # (A hashed place: whose it is cannot be told.)
                return foreign
            # A cache cut short, or no safetensors at all, at an entry's place:
            # that entry's damaged file, as someone_elses judges it (a load
            # moves it aside, a save replaces it), not another program's
            # file kept forever.
            return StoredEntry(place[0], place[1], 0, st.st_size, last_used, path, "entry",
                               st.st_mtime, *ident)
        if place is None:
            # A copy made by hand under a name the daemon does not give (say
            # "a_2Fb" beside "a_2fb"): not an entry of any key, not ours to delete.
            return foreign
        model, cache_id = place  # None for a hashed name
        if written_by_kvkeeper(meta):
            here = naming.placed_key(path, meta.get(MODEL_KEY), meta.get(CACHE_ID_KEY))
            if here is None:
                if model is None or cache_id is None:
                    # A hashed place its header does not vouch for: whose
                    # place it is cannot be told (taking the header's key
                    # listed another entry twice), so never deleted.
                    return foreign
                # Damaged, or another key's file copied here: this place's
                # entry (a load of it finds the mismatch and moves it aside).
                here = (model, cache_id)
            return StoredEntry(*here, _int(meta.get(TOKEN_COUNT_KEY)), st.st_size, last_used,
                               path, "entry", st.st_mtime, *ident)
        if not is_cache(meta):
            return foreign  # safetensors, but no cache of a known format: not ours to delete
        # cache_persist's files record their count; mlx-lm's record no token ids.
        tokens = _int(meta.get("token_count")) if detect_legacy(meta) == GEZEL_SCHEMA3 else 0
        return StoredEntry(model or "", cache_id or "", tokens, st.st_size, last_used, path,
                           "legacy", st.st_mtime, *ident)

    def someone_elses(self, path: Path) -> bool:
        """Whether ``path`` is a whole safetensors file of no cache format
        (model weights, say): another program's, which the daemon never
        moves, replaces or deletes. A file it cannot read as safetensors at
        all is taken for a damaged cache. Raises LeftInPlace when the daemon
        cannot tell (no permission to read it, out of descriptors or
        memory): the caller must then leave the file as it is."""
        try:
            with open_file(path, keep_atime=True) as (_, header):
                return not is_cache(header.metadata)
        except OSError as exc:
            if exc.errno != errno.ENOENT and says_nothing_of_the_file(exc):
                # Guessing either way could replace, or send to quarantine
                # (which the disk budget empties first), another program's file.
                raise LeftInPlace(exc.errno, f"cannot tell whether {path} is a cache or "
                                             f"another program's file ({exc.strerror}); left "
                                             f"as it is") from exc
            return False
        except LayoutError as exc:
            return _theirs(exc)

    # -- put / find / delete
    def begin(self, model: str, cache_id: str, header_bytes: int, data_bytes: int
              ) -> PendingFile:
        """The tmp file of a new version of the entry, empty: the caller
        makes room for it (``make_room``), then appends the header and data.
        A failure removes a new model's directory again, except ENOSPC: the
        caller may make room and try again, and the directory then holds the
        inode or block its evictions freed (``drop_model_dir`` if it gives up)."""
        final = self.path_for(model, cache_id)
        self._model_dir(model)
        faults.slow_step("begin_delay")
        try:
            return PendingFile(final, header_bytes, data_bytes, (model, cache_id),
                               on_gone=self._forget)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                self._drop_dir_if_empty(final.parent)
            raise

    def drop_model_dir(self, model: str) -> None:
        """Remove the model's directory if it is empty (see ``begin``)."""
        self._drop_dir_if_empty(self._model_dir_path(model))

    def _forget(self, path: Path) -> None:
        """A tmp file renamed in or removed (``PendingFile``'s ``on_gone``)."""
        with self._lock:
            self._drop(path)
        self._drop_dir_if_empty(path.parent)  # a failed first save of a model

    def protect(self, model: str, cache_id: str) -> Path:
        """Evict the entry's file only after every other entry, until
        ``unprotect`` (one call each), while a save of it is on its way: if
        that save fails, the file is all the key has; if it is written, it
        replaces the file anyway. (Never evicting it would let the store
        grow past its budget while more keys are being saved than it has
        room for.) Returns the path to give ``unprotect``."""
        path = self.path_for(model, cache_id)
        with self._lock:
            self._protected[path] += 1
        return path

    def unprotect(self, path: Path) -> None:
        """Undo one ``protect`` (its save was written, failed or replaced)."""
        with self._lock:
            self._protected[path] -= 1
            if self._protected[path] <= 0:
                del self._protected[path]

    def commit(self, pending: PendingFile, header: bytes, tokens: str | None) -> list[StoredEntry]:
        """Make a put durable and visible, then apply the disk budget; returns
        the entries evicted for it (never the one just written). Raises
        LeftInPlace, and leaves both files as they were, when another
        program's safetensors file is at the entry's place."""
        # Read, not looked up in the index: a file may be put there any time.
        try:
            theirs = self.someone_elses(pending.final)
        except OSError:
            pending.abort()
            raise
        if theirs:
            pending.abort()
            raise LeftInPlace(
                errno.EEXIST, f"{pending.final} is another program's safetensors file (not a "
                              f"cache); move it away to save this entry")
        model, cache_id = pending.key

        def index_it() -> None:
            # Under the lock the rename took: an eviction (the start-up scan's,
            # in another thread) that judged the old file could otherwise
            # unlink the new one. The new file is served even if the
            # directory's fsync then fails: the index must know it.
            now = time.time()
            self._put(StoredEntry(model, cache_id, _int(tokens), pending.nbytes, now,
                                  pending.final, "entry", now, *pending.identity))

        pending.commit(header, self._lock, index_it)
        evicted: list[StoredEntry] = []
        try:
            self.enforce_budget(keep=pending.final, into=evicted)
        except OSError as exc:
            # The save is durable and served: failing it would have its client
            # count written bytes as lost. The next save applies the budget.
            log.error("event=budget_failed path=%s error=%s: the save is written; the disk "
                      "budget is applied again at the next save", pending.final, exc)
        except Exception:  # noqa: BLE001 - a bug: the save is written all the same
            # Raised on, the writer failed the save and told its client so
            # (a review); the file was in place and served.
            self.budget_crashes += 1
            log.exception("event=budget_crashed path=%s: the save is written; the disk "
                          "budget is applied again at the next save", pending.final)
        return evicted  # those that went before a failure too: they are gone

    def find(self, model: str, cache_id: str) -> tuple[Path, os.stat_result] | None:
        """The entry's file if it is a regular file (never through a symlink),
        with its lstat. Counts as a use for eviction; ``record_use`` then
        keeps that in the file's atime, so the order survives a restart."""
        path = self.path_for(model, cache_id)
        try:
            self._real_model_dir(path.parent)
            st = os.lstat(path)
        except FileNotFoundError:
            self._forget_if_gone(path)
            return None
        except OSError as exc:  # e.g. a file or symlink planted where the model's directory goes
            log.warning("event=entry_unreadable path=%s error=%s", path, exc)
            return None
        if not stat.S_ISREG(st.st_mode):
            log.warning("event=not_a_file path=%s", path)
            return None
        now = time.time()
        with self._lock:
            if self._uses_meanwhile is not None:
                self._uses_meanwhile[path] = now
            entry = self._index.get(path)
            if entry is not None:
                self._used_at(entry, now)
        return path, st

    def record_use(self, path: Path, st: os.stat_result) -> None:
        """Write a use found by ``find`` into the file's atime (mtime kept),
        unless the path names another file by now (a newer save renamed in)."""
        try:
            # O_NONBLOCK: a FIFO put in its place must not hang the writer.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                         | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return  # gone or not ours: the in-memory order still holds
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                times = (time.time_ns(), st.st_mtime_ns)
                if os.utime in os.supports_fd:
                    os.utime(fd, ns=times)
                else:  # no futimens: by name, which the check above just vouched for
                    os.utime(path, ns=times, follow_symlinks=False)
        except OSError:
            pass  # read-only or foreign-owned: the in-memory order still holds
        finally:
            os.close(fd)

    def delete(self, model: str, cache_id: str) -> bool:
        """Remove the entry's file; False if there was none. Raises
        LeftInPlace, leaving it, when another program's safetensors file
        is at the entry's place or the daemon cannot tell (see
        ``someone_elses``), as a save of it does."""
        path = self.path_for(model, cache_id)
        try:
            self._real_model_dir(path.parent)
        except FileNotFoundError:
            self._forget_if_gone(path)
            return False
        if self.someone_elses(path):
            raise LeftInPlace(
                errno.EEXIST, f"{path} is another program's safetensors file (not a cache); "
                              f"left in place")
        faults.slow_step("delete_delay")
        try:
            os.unlink(path)
        except FileNotFoundError:
            self._forget_if_gone(path)
            return False
        with self._lock:
            self._drop(path)
        try:
            fsync_dir(path.parent)
        except OSError as exc:
            # Deleted all the same (as an eviction or a move aside): reported
            # failed, it was not counted, and a retry said "no such entry".
            log.error("event=delete_dir_fsync_failed path=%s error=%s", path, exc)
        self._drop_dir_if_empty(path.parent)
        return True

    def quarantine(
        self, model: str, cache_id: str, ino: int | None, mtime_ns: int | None, reason: str
    ) -> Path | None:
        """Move an entry's unusable file (or whatever non-file sits at its path) to
        ``<root>/quarantine/``, unless it was replaced since it was judged
        (``ino``/``mtime_ns`` differ). Returns where it went."""
        def moved(dest: Path) -> None:
            log.warning("event=quarantined model=%s id=%s reason=%s moved_to=%s",
                        model, cache_id, reason, dest)

        return self.quarantine_path(self.path_for(model, cache_id), ino, mtime_ns, moved)

    def quarantine_path(self, path: Path, ino: int | None = None,
                        mtime_ns: int | None = None,
                        on_moved: Callable[[Path], None] | None = None) -> Path | None:
        """Move ``path`` (under this root) to ``<root>/quarantine/``, unless it
        is not the inode/mtime given, or another program's file (see
        ``someone_elses``: quarantined files are the first the budget deletes,
        and another program's must never be); returns where it went.
        ``on_moved`` is told where as soon as it is there, before the fsyncs
        (logged after them, a kill between left the move without its line,
        as with evictions)."""
        try:
            self._real_model_dir(path.parent)
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if ino is not None and (st.st_ino, st.st_mtime_ns) != (ino, mtime_ns):
            return None  # a newer version took its place: keep it
        if stat.S_ISREG(st.st_mode) and self.someone_elses(path):
            log.warning("event=not_quarantined path=%s reason=not_a_cache: another "
                        "program's safetensors file, left in place", path)
            return None
        qdir = self.root / QUARANTINE_DIR
        self._own_dir(qdir)
        name = f"{path.parent.name}.{path.name}.{time.time_ns()}"
        if len(os.fsencode(name)) > 255:  # two long components: over a file name's limit
            digest = hashlib.sha256(os.fsencode(f"{path.parent.name}/{path.name}")).hexdigest()
            name = f"_z{digest}.{time.time_ns()}"
        dest = qdir / name
        try:
            os.rename(path, dest)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            # The model's directory (or sessions/) on a disk of its own, as
            # the README allows: no rename leaves that disk, and the file
            # stayed at its place, logged quarantine_failed at every load (a
            # review). Moved aside beside it instead.
            beside = f"{path.name}.{time.time_ns()}{_BESIDE_SUFFIX}"
            if len(os.fsencode(beside)) > 255:  # past a file name's limit
                digest = hashlib.sha256(os.fsencode(path.name)).hexdigest()
                beside = f"_z{digest}{naming.SUFFIX}.{time.time_ns()}{_BESIDE_SUFFIX}"
            dest = path.parent / beside
            os.rename(path, dest)
        # Moved: the index must know it, whatever the fsyncs then say.
        key = _quarantined_key(name) if dest.parent == qdir else _beside_key(dest)
        with self._lock:
            self._drop(path)
            if stat.S_ISREG(st.st_mode):
                self._put(StoredEntry(*(key or ("", "")), 0, st.st_size, time.time(), dest,
                                      "quarantine", st.st_mtime, st.st_ino, st.st_mtime_ns))
        if on_moved is not None:
            on_moved(dest)
        faults.slow_step("moved_delay")
        faults.crash_point("quarantined")
        try:
            fsync_dir(path.parent)
            fsync_dir(qdir)
        except OSError as exc:  # moved all the same; only its durability is in doubt
            log.error("event=quarantine_dir_fsync_failed path=%s error=%s", dest, exc)
        self._drop_dir_if_empty(path.parent)
        return dest

    # -- listing and the budget
    def entries(self, model: str | None = None, *, everything: bool = False) -> list[StoredEntry]:
        """Indexed entries (of one model), oldest use first; ``everything`` adds
        legacy, quarantined and foreign files."""
        with self._lock:
            items = list(self._index.values())
        out = [e for e in items
               if (everything or e.kind == "entry") and (model is None or e.model == model)]
        return sorted(out, key=lambda e: (e.last_used, str(e.path)))

    def listing(self, model: str | None = None, *, everything: bool = False
                ) -> list[StoredEntry]:
        """``entries``, less (and forgetting) the files removed by hand since
        they were indexed: a listing must not show what ``delete`` would call
        gone. One lstat a file (20,000 entries: tens of ms; in a worker thread)."""
        faults.io_error("listing")
        listed = []
        for entry in self.entries(model, everything=everything):
            if _gone(entry.path):
                self._forget_if_gone(entry.path)
            else:
                listed.append(entry)
        return listed

    def _still_indexed(self, entry: StoredEntry) -> bool:
        """Whether the file at ``entry.path`` is the one indexed. If not (removed,
        or another file put there by hand since), the index is brought up to
        date with what is there now, which an eviction must not delete on the
        strength of what was there before: another program's file, say."""
        try:
            now = os.lstat(entry.path)
        except FileNotFoundError:
            now = None
        except OSError:
            return True  # cannot tell: the unlink reports what is wrong
        if now is not None and entry.is_at(now):
            return True
        fresh = self._classify(entry.path) if now is not None else None
        with self._lock:
            if self._index.get(entry.path) is entry:
                self._drop(entry.path)
                if fresh is not None:
                    # Counted anew, and put at its place in the order of use
                    # (its file's times: a file dated back by hand goes
                    # first) once the pass is over, by one sort for all: a
                    # sort for each made a pass over 10,000 files changed by
                    # hand (a backup put back with cp -a) take 4 minutes.
                    self._put(fresh)
                    self._out_of_order = True
        log.info("event=entry_changed path=%s now=%s: changed by hand since indexed, "
                 "counted as it is now, not evicted", entry.path,
                 "gone" if fresh is None else fresh.kind)
        return False

    def count(self) -> int:
        """Files indexed under the root (entries and the rest)."""
        with self._lock:
            return len(self._index)

    def usage(self) -> int:
        """Bytes of every file indexed under the root."""
        with self._lock:  # not half way through a _put or a rescan
            return self._used

    def free_bytes(self, where: Path | None = None) -> int:
        """Bytes free on the store's file system (``sessions/``'s, the root's
        unless a disk is mounted there), or ``where``'s."""
        st = os.statvfs(where or _made(self.sessions, self.root))
        return st.f_bavail * st.f_frsize

    def free_gauge(self) -> int:
        """Bytes free on the store's disk (``sessions/``'s) as ``stats``
        reports them: -1 where the disk has no size to fill (ramfs: nothing is
        kept free there) or cannot be looked at."""
        try:
            st = os.statvfs(_made(self.sessions, self.root))
        except OSError:
            return -1
        return st.f_bavail * st.f_frsize if st.f_blocks else -1

    def out_of_inodes(self, keep: Path | None = None) -> bool:
        """Whether the file system a file at ``keep`` goes on (see ``_disk_of``)
        has no inode left for a new file (one that counts them: f_files is 0
        where there is no such limit)."""
        return _no_inode(self._disk_of(keep)[0])

    def _disk_of(self, keep: Path | None) -> tuple[Path, bool]:
        """Where a pass for a file at ``keep`` frees space: a directory on the
        disk the file goes to (its model's, or the nearest one made: a new
        model's directory is made on that of ``sessions/``), and whether that
        is a disk of its own, other than the store's (``sessions/``'s), as the
        README advises to keep a model elsewhere (only the root's disk was
        ever looked at, and every save to a full model disk failed)."""
        store_disk = _made(self.sessions, self.root)
        if keep is None:
            return store_disk, False
        where = _made(keep.parent, self.sessions, self.root)
        try:
            return where, not _same_disk(where, store_disk)
        except OSError:  # removed meanwhile (by hand): made again on the store's
            return store_disk, False

    @staticmethod
    def _evictable(indexed: list[StoredEntry], keep: Path | None,
                   on_disk: Callable[[StoredEntry], bool], enough: int) -> int:
        """Bytes a free-space pass could free for a file at ``keep``: the
        entries, old caches and quarantined files on its disk, but those
        another link keeps (counted, a save that could not fit cost them),
        summed until ``enough`` (an lstat each)."""
        total = 0
        for e in indexed:
            if total >= enough:
                break
            if e.kind in ("entry", "legacy", "quarantine") and e.path != keep \
                    and on_disk(e) and not _linked_elsewhere(e.path):
                total += e.nbytes
        return total

    def make_room(self, model: str, cache_id: str, nbytes: int, *, need_inode: bool = False,
                  into: list[StoredEntry] | None = None) -> list[StoredEntry]:
        """Before a file of ``nbytes`` is written for the entry: evict so that
        ``min_free_bytes`` stay free with it written. (Only a commit evicted:
        on a disk too full for the next save every save failed with ENOSPC,
        and nothing was ever evicted.) Free space only: ``max_disk_bytes`` is
        an account, settled once the file is in (a save that never arrives
        whole must not have evicted entries for its declared size). The
        entry's current file is kept; it stays on disk meanwhile. ``need_inode``:
        its tmp file could not be made (ENOSPC), so an inode is needed too;
        ``into`` as for ``enforce_budget``."""
        return self.enforce_budget(keep=self.path_for(model, cache_id), writing=nbytes,
                                   need_inode=need_inode, into=into)

    def room_after_full(self, model: str, cache_id: str, left: int, first: bool, *,
                        may_evict: bool, into: list[StoredEntry] | None = None) -> bool:
        """A write of the entry's new version met ENOSPC with ``left`` bytes
        still to write, though ``make_room`` found room: the file system hands
        unlinked blocks back late (btrfs at its next commit, XFS in the
        background) or gives less than it says is free (btrfs, by a few MiB
        near full), or another program took the space meanwhile. On a nearly
        full btrfs every save then evicted an entry and failed, until the
        store was empty. The ``first`` time, go on if the disk has room for
        the rest, once its frees are committed. Else, when ``may_evict`` (the
        caller allows one such round a file), evict as if nothing were free,
        least recently used first, for the bytes the write lacks, and go on
        only if the disk then has room for them: an unlink that frees nothing
        (a file held open, or kept by a btrfs snapshot or another link) ends
        it there. Not on a disk far from full (see ``_NEAR_FULL``). Whether
        the write may go on."""
        keep = self.path_for(model, cache_id)
        where = self._disk_of(keep)[0]
        evicted: list[StoredEntry] = []
        room = first and self._room_for(where, left)
        if not room and may_evict and self.free_bytes(where) < 2 * left + _NEAR_FULL:
            evicted = self.enforce_budget(keep=keep, writing=left, into=into, none_free=True)
            room = bool(evicted) and self._room_for(where, left)
        log.info("event=write_out_of_space model=%s id=%s left=%d evicted=%d room=%d",
                 model, cache_id, left, len(evicted), room)
        return room

    def _room_for(self, where: Path, nbytes: int) -> bool:
        """Whether the disk of ``where`` has ``nbytes`` free, its frees
        committed first where they are not counted yet (``settle_frees``)."""
        if self.free_bytes(where) >= nbytes:
            return True
        settle_frees(where)
        return self.free_bytes(where) >= nbytes

    def enforce_budget(self, keep: Path | None = None, *, writing: int = 0,
                       no_evictions: threading.Event | None = None,
                       need_inode: bool = False,
                       into: list[StoredEntry] | None = None,
                       writers_turn: bool = True, none_free: bool = False) -> list[StoredEntry]:
        """Evict least recently used entries (quarantined files first) until the
        root is within ``max_disk_bytes`` and ``min_free_bytes`` are free,
        counting ``writing`` bytes less free (a file about to be written; it
        must fit even with ``min_free_bytes`` 0). Foreign files count but are
        never deleted; ``keep`` is never evicted, and protected entries (a
        save of them on its way) go last; nothing is evicted for a file that
        would not fit with every entry gone, nor once ``no_evictions`` is set
        (looked at before each one). ``none_free``: the disk is taken to have
        no byte free, whatever it says, and only ``writing`` bytes are made
        free, ``min_free_bytes`` aside (see ``room_after_full``). Returns the
        entries evicted; they are appended to ``into`` too, also when this
        raises part way (statvfs failing, say), so that a caller still has them."""
        evicted: list[StoredEntry] = []
        try:
            with self._evicting:
                try:
                    self._enforce_budget(keep, writing, no_evictions, need_inode, evicted,
                                         writers_turn, none_free)
                finally:
                    with self._lock:
                        if self._out_of_order:
                            self._out_of_order = False
                            self._index = dict(sorted(self._index.items(),
                                                      key=lambda item: _use_order(item[1])))
        finally:
            if into is not None:
                into += evicted
        return evicted

    def _enforce_budget(self, keep: Path | None, writing: int,
                        no_evictions: threading.Event | None,
                        need_inode: bool, evicted: list[StoredEntry],
                        writers_turn: bool, none_free: bool = False) -> None:
        b = self.budget
        with self._lock:
            if not self._whole:
                return  # not from a part of the store: see rescan
            used = self._used
        for_free_space = True
        # --min-free-bytes is the store's disk's (sessions/'s); a model's own
        # disk is only kept from failing a write (the default 5 GiB could be
        # more than the whole disk, and every save would evict the rest).
        where, own_disk = self._disk_of(keep)
        # (A none_free pass is for the room a write lacks, nothing more.)
        min_free = 0 if own_disk or none_free else b.min_free_bytes
        disks: dict[Path, bool] = {}

        def on_disk(e: StoredEntry) -> bool:
            """Whether ``e``'s file is on the disk this pass frees space on."""
            d = e.path.parent
            if d not in disks:
                try:
                    disks[d] = _same_disk(d, where)
                except OSError:
                    disks[d] = True  # cannot tell: the unlink says
            return disks[d]

        # Free space as the pass found it (read before any eviction), plus
        # the files it evicted from that disk: counted, not read again. An
        # unlink may free nothing (a file open elsewhere, a snapshot holding
        # it) or free it later (btrfs at its next commit, XFS in the
        # background): read after each eviction, such a disk lost every
        # entry, and the save still failed.
        wants_space = min_free > 0 or writing > 0
        start_free = self.free_bytes(where) if wants_space and not none_free else 0
        freed = 0
        if wants_space and _no_size(where):
            for_free_space = False  # ramfs, a tmpfs of size 0: no limit to keep to
        sized = for_free_space

        def free() -> int:
            return start_free + freed

        def note_shortage() -> None:
            # Not before a write: the file is not there yet, and may never be
            # (a save too big for the disk, which then fails).
            if not own_disk and not none_free and not writing:
                was = self.short_of_min_free
                self.short_of_min_free = sized and min_free > 0 and free() < min_free
                if self.short_of_min_free and not was and not evicted:
                    # Said as it begins, before any save evicts (the warning
                    # below comes with evictions): a daemon started on a disk
                    # short of the default 5 GiB said nothing until then.
                    log.warning("event=below_min_free free=%d min_free_bytes=%d evicted=0: "
                                "the disk has less free than --min-free-bytes, so each save "
                                "written evicts the entries saved before it; lower "
                                "--min-free-bytes or free space", free(), b.min_free_bytes)

        def pressure() -> str | None:
            if b.max_disk_bytes is not None and used > b.max_disk_bytes:
                return "max_disk_bytes"
            if for_free_space and wants_space and free() - writing < min_free:
                # The save's own file not fitting is no --min-free-bytes matter
                # (it said so with --min-free-bytes 0).
                return "min_free_bytes" if free() >= writing else "room_for_save"
            # The file about to be written could not be made: one entry, as
            # its unlink may free no inode (a file open elsewhere, a file
            # system that always says none are free).
            if need_inode and for_free_space and not evicted and _no_inode(where):
                return "inodes"
            return None

        if pressure() is None:
            note_shortage()
            return  # the common case after a write
        with self._lock:
            indexed = list(self._index.values())  # oldest use first
            quarantined = self._quarantined
            protected = set(self._protected)

        def entries(saving: bool) -> Iterator[tuple[StoredEntry, bool]]:
            return ((e, saving) for e in indexed if e.kind in ("entry", "legacy")
                    and e.path != keep and (e.path in protected) == saving)

        # Quarantined files first; then entries and old caches, oldest first,
        # those with a save on its way last (with those whose save came during
        # this pass: ``late``). Taken as needed: usually one goes.
        late: list[StoredEntry] = []
        candidates = itertools.chain(
            ((e, False) for e in (indexed if quarantined else ()) if e.kind == "quarantine"),
            entries(False), entries(True), ((e, True) for e in late))
        if writing and free() + self._evictable(indexed, keep, on_disk,
                                                writing - free()) < writing:
            # Emptying the store would not make room for it: its write fails
            # with ENOSPC either way, and the entries are worth keeping.
            for_free_space = False
            if not none_free:  # (there free is not read: room_after_full logs its own)
                log.warning("event=no_room bytes=%d free=%d: emptying the store would not make "
                            "room for it; nothing evicted", writing, free())
        stopped = False
        for victim, saving in candidates:
            reason = pressure()
            if reason is None:
                break
            if no_evictions is not None and no_evictions.is_set():
                stopped = True
                break
            # (Its blocks: free for this pass's disk only if no other link keeps them.)
            frees = on_disk(victim) and not _linked_elsewhere(victim.path)
            if reason != "max_disk_bytes" and not frees:
                # Its unlink would free no block there: it is on another disk,
                # or another link keeps them (a `cp -al` backup of the root).
                # Only the account evicts it.
                continue
            if not self._still_indexed(victim):
                # Changed by hand since it was indexed: re-counted, not evicted.
                used = self.usage()
                continue
            faults.slow_step("evict_delay")
            with self._lock:
                # A load answered since the sort made it the newest: keep it.
                # (A load racing the unlink itself still just misses.)
                if self._index.get(victim.path) is not victim:
                    continue
                if not saving and victim.path in self._protected:
                    late.append(victim)  # a save of it sent since: it goes last
                    continue
                try:
                    os.unlink(victim.path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.error("event=evict_failed path=%s error=%s", victim.path, exc)
                    continue
                self._drop(victim.path)
            # Logged as soon as it is gone: a daemon killed during the fsync
            # below left a file gone without a word (a helper's crash review:
            # 5 of 55 kills, up to 5 s after the unlink). A save of it on its
            # way means the budget had nothing else left to evict: if that
            # save fails, the entry is gone (said here).
            log.info("event=evicted model=%s id=%s bytes=%d kind=%s reason=%s save_pending=%d",
                     victim.model, victim.cache_id, victim.nbytes, victim.kind, reason, saving)
            faults.crash_point("evicted")
            try:
                fsync_dir(victim.path.parent)
            except FileNotFoundError:
                # Gone, file and all: in the start-up scan's pass, the writer
                # removed it once empty (on the writer's turn, someone else).
                pass
            except OSError as exc:  # gone all the same; only its durability is in doubt
                log.error("event=evict_dir_fsync_failed path=%s error=%s", victim.path, exc)
            if writers_turn:
                self._drop_dir_if_empty(victim.path.parent)
            used -= victim.nbytes
            if frees:
                freed += victim.nbytes
            evicted.append(victim)
            faults.io_error("evicted")
        if stopped:
            log.warning("event=evictions_stopped used=%d reason=%s: the daemon is draining; "
                        "the budget is applied again by the next save written, or at the "
                        "next start", used, reason)
        elif b.max_disk_bytes is not None and used > b.max_disk_bytes:
            log.warning("event=over_budget used=%d max_disk_bytes=%d: foreign files or the "
                        "newest entry alone exceed it", used, b.max_disk_bytes)
        note_shortage()
        if evicted and not stopped and min_free > 0 and free() - writing < min_free:
            # Entries went and the disk is still short: other files (or the
            # newest entry) fill it, and every save evicts the ones before it.
            log.warning("event=below_min_free free=%d min_free_bytes=%d evicted=%d: the "
                        "disk stays short; lower --min-free-bytes or free space",
                        free() - writing, b.min_free_bytes, len(evicted))


def _gone(path: Path) -> bool:
    """Whether nothing is at ``path``; not a file this user may not look at
    now (a model directory's mode changed for a moment): os.path.lexists
    said gone, and one listing forgot every entry there until a gc."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def _made(*dirs: Path) -> Path:
    """The first of ``dirs`` that is there (the last one, if none is)."""
    for d in dirs[:-1]:
        if os.path.isdir(d):
            return d
    return dirs[-1]


#: A write that meets ENOSPC again on a disk with more than twice the bytes
#: it lacks free, and this besides, is not short of space eviction can give
#: (btrfs near full gives a few MiB less than it says; this is something
#: else: its metadata exhausted, a quota, an injected fault). Evicting there
#: deleted four entries for a save that failed all the same.
_NEAR_FULL = 64 * 1024 * 1024


def _same_disk(a: Path, b: Path) -> bool:
    """Whether directories ``a`` and ``b`` draw on one disk's free space: one
    device, or one btrfs pool (a subvolume has a device number of its own;
    taken for a disk of its own, --min-free-bytes went unenforced). Told by
    equal file system figures, read one after the other: by size alone, two
    disks of one size (identical drives, tmpfs mounts of one size) were
    taken for one, and a save on one evicted the other's entries. Another
    program writing between the two reads makes one pool look like two: its
    entries are then passed over, this time. A ZFS dataset, whose figures
    are its own, is taken for a disk of its own."""
    if os.stat(a).st_dev == os.stat(b).st_dev:
        return True
    sa, sb = os.statvfs(a), os.statvfs(b)
    # Only where inodes are not counted (f_files 0: btrfs): equal figures of
    # two tmpfs mounts (of one size, as full) were taken for one disk.
    return sa.f_files == 0 and sa.f_blocks > 0 and _figures(sa) == _figures(sb)


def _figures(st: os.statvfs_result) -> tuple[int, ...]:
    return (st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree)


def _no_size(d: Path) -> bool:
    """Whether the file system of ``d`` has no size to fill (ramfs, a tmpfs of
    size 0: statvfs says 0 blocks, 0 free): a model's directory on one kept
    only its newest entry, each save evicting the rest."""
    try:
        return os.statvfs(d).f_blocks == 0
    except OSError:
        return False


def _no_inode(d: Path) -> bool:
    """Whether the file system of ``d`` has no inode left for a new file (one
    that counts them: f_files is 0 where there is no such limit)."""
    st = os.statvfs(d)
    return st.f_files > 0 and st.f_favail == 0


def _linked_elsewhere(path: Path) -> bool:
    try:
        return os.lstat(path).st_nlink > 1
    except OSError:
        return False  # the unlink tells


def _use_order(e: StoredEntry) -> tuple[float, str]:
    return e.last_used, str(e.path)


def _theirs(exc: LayoutError) -> bool:
    """Whether a file kvkeeper's reader refused is still another program's
    safetensors file: its header reads, and says no cache (weights of a
    dtype kvkeeper does not know, such as F8_E4M3). Anything else it
    refused is taken for a damaged cache."""
    return isinstance(exc, TableError) and not is_cache(exc.metadata)


_COUNT = re.compile(r"[0-9]{1,18}")


def _int(text: str | None) -> int:
    """A token count a header records, 0 unless it is one: the daemon
    answers listings with it, and msgpack carries no integer of 2**64 or
    more (a save or a file with 30 nines stopped the daemon at every ls)."""
    return int(text) if text and _COUNT.fullmatch(text) else 0


if sys.platform == "win32":  # pragma: no cover - the daemon needs POSIX file semantics
    raise ImportError("kvkeeper's store runs on macOS and Linux")
