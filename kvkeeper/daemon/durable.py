"""One file replaced atomically and durably: a tmp file beside the target is
written (its writeback started early on Linux), fsynced (F_FULLFSYNC on
macOS), renamed over the target, and the directory fsynced, so a reader (or
a crash) sees the complete old or the complete new version.

Plain synchronous code; the writer actor calls it from a worker thread.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvkeeper.daemon import faults
from kvkeeper.logs import get_logger

# The store's logger: its events (dir_fsync_unsupported) keep the name they had.
log = get_logger("kvkeeper.store")

TMP_SUFFIX = ".tmp"

_IOV_MAX = min(getattr(os, "sysconf", lambda _n: 1024)("SC_IOV_MAX") or 1024, 1024)
_F_FULLFSYNC = getattr(__import__("fcntl"), "F_FULLFSYNC", None)
#: F_FULLFSYNC refused by the file system: fsync instead. (ENOTSUP and
#: EOPNOTSUPP are one number on Linux, 45 and 102 on macOS.)
_FULLFSYNC_REFUSED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOTTY})
_fullfsync_warned: set[int] = set()  # st_dev of the file systems warned about
_counter = itertools.count()


def full_fsync(fd: int) -> None:
    """Flush a file to stable storage. On macOS plain fsync leaves data in the
    drive's cache; F_FULLFSYNC flushes that too. Where F_FULLFSYNC is missing or
    refused (some file systems), fall back to fsync."""
    if _F_FULLFSYNC is not None:
        import fcntl

        try:
            fcntl.fcntl(fd, _F_FULLFSYNC)
            return
        except OSError as exc:
            if exc.errno not in _FULLFSYNC_REFUSED:
                raise
            dev = os.fstat(fd).st_dev
            if dev not in _fullfsync_warned:  # once per file system, as dir_fsync_unsupported
                _fullfsync_warned.add(dev)
                # (SMB, exFAT, NFS on macOS.) The README promises F_FULLFSYNC:
                # say where the weaker guarantee applies.
                log.warning("event=full_fsync_unsupported error=%s: this file system refuses "
                            "F_FULLFSYNC, so fsync is used, and a power cut may lose writes "
                            "the drive had only cached; saves go on", exc.strerror or exc)
    os.fsync(fd)


#: A directory's fsync answers these on file systems that cannot sync
#: directories (some network and FUSE ones). A rename there is as durable as
#: the file system makes it, whatever kvkeeper does; failing every save on it
#: instead would keep nothing at all. (PostgreSQL ignores the same answers.)
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})
_dir_fsync_warned: set[int] = set()  # st_dev of the file systems warned about


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename, a new file, an
    unlink) durable, where its file system can."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        faults.dir_fsync_refused()
        full_fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
        dev = os.fstat(fd).st_dev
        if dev not in _dir_fsync_warned:  # once per file system: it says so at every save
            _dir_fsync_warned.add(dev)
            log.warning("event=dir_fsync_unsupported path=%s error=%s: this file system "
                        "cannot sync directories, so a power cut may undo the latest "
                        "renames there; saves go on", path, exc.strerror or exc)
    finally:
        os.close(fd)


def _libc(name: str, *argtypes: Any) -> Any:
    """A libc function, or None where there is none (not Linux)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


# Not Linux: the final fsync does all the writing back.
_sync_file_range = _libc("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_uint)

_SYNC_FILE_RANGE_WRITE = 2
#: Bytes written before the kernel is asked to start writing them back.
WRITEBACK_BYTES = 8 * 1024 * 1024


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range back now, without waiting:
    the disk works while the rest of the save still arrives, and the final
    fsync has less left to do. Where there is no way to ask, nothing."""
    if _sync_file_range is not None:
        # Advisory: an error here shows again, and counts, at the fsync.
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, bufs: Sequence[memoryview | bytes | bytearray],
              on_full: Callable[[int], bool] | None = None) -> int:
    """writev every byte of ``bufs``. Loops on short writes (a full disk or
    RLIMIT_FSIZE gives a short count first and an error on the next call).
    On ENOSPC, ``on_full(bytes written so far)`` may make room: the write
    goes on where it stopped while it answers True."""
    pending = [memoryview(b).cast("B") for b in bufs if len(b)]
    total = 0
    i = 0  # the first buffer not wholly written (no pop(0): quadratic in the count)
    while i < len(pending):
        try:
            n = os.writev(fd, pending[i : i + _IOV_MAX])
        except OSError as exc:
            if exc.errno == errno.ENOSPC and on_full is not None and on_full(total):
                continue
            raise
        total += n
        while n and i < len(pending):
            if n >= len(pending[i]):
                n -= len(pending[i])
                i += 1
            else:
                pending[i] = pending[i][n:]
                n = 0
    return total


#: Times a file's write that met ENOSPC may make room and go on.
ROOM_TRIES = 2


# Linux's: elsewhere (macOS) there is no syncfs, and APFS frees at the unlink.
_syncfs = _libc("syncfs", ctypes.c_int) if sys.platform == "linux" else None


def settle_frees(path: Path) -> None:
    """Commit the file system of ``path``: btrfs hands an unlinked file's
    blocks back at its transaction's commit, XFS in the background, ZFS at
    its next transaction group, and the same under overlayfs (a container's
    disk), which syncs the layer below. It waits for every dirty page of that
    file system, other programs' too: called only when free space did not
    show what an unlink freed. Linux's syncfs; elsewhere nothing."""
    if _syncfs is None:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _syncfs(fd)  # advisory: a failure only leaves the frees for later
    finally:
        os.close(fd)


class PendingFile:
    """A new version of one entry, written to a tmp file beside the target."""

    def __init__(self, final: Path, header_bytes: int, data_bytes: int = 0,
                 key: tuple[str, str] = ("", ""),
                 on_gone: Callable[[Path], None] | None = None) -> None:
        self.final = final
        self.key = key  # (model, cache id): a hashed file name does not give them back
        # Told the tmp path once it is renamed or removed: a rescan meanwhile
        # (gc) indexed it, and the index must not go on counting it.
        self._on_gone = on_gone
        self.renamed = False  # in place, and served, from then on
        self.tmp = final.with_name(f".{final.name}.{os.getpid()}.{next(_counter)}{TMP_SUFFIX}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd: int | None = os.open(self.tmp, flags, 0o600)
        faults.crash_point("tmp_created")
        self.nbytes = 0
        self.identity = (0, 0)  # (inode, mtime_ns) once fsynced: what the index records
        self._written_back = 0
        self.fsync_seconds = 0.0
        self._half = header_bytes + data_bytes // 2
        self.size = header_bytes + data_bytes
        self._header_bytes = header_bytes
        #: Given the bytes still to write and whether it is the file's first
        #: time, makes room after ENOSPC (see ``write_all``); at most
        #: ``ROOM_TRIES`` times for the file.
        self.on_full: Callable[[int, bool], bool] | None = None
        self._room_tries = ROOM_TRIES

    def append(self, bufs: Sequence[memoryview | bytes | bytearray]) -> None:
        assert self._fd is not None
        if faults.ACTIVE:
            bufs = self._faulty(bufs)
        self.nbytes += write_all(self._fd, bufs, self._make_room)
        if self.nbytes - self._written_back >= WRITEBACK_BYTES:
            start_writeback(self._fd, self._written_back, self.nbytes - self._written_back)
            self._written_back = self.nbytes

    def _make_room(self, written: int) -> bool:
        if self.on_full is None or not self._room_tries:
            return False
        self._room_tries -= 1
        # And the header's again: the commit writes it over its first
        # version, which a copy-on-write file system (btrfs) puts elsewhere.
        return self.on_full(self.size - self.nbytes - written + self._header_bytes,
                            self._room_tries == ROOM_TRIES - 1)

    def _faulty(self, bufs: Sequence[memoryview | bytes | bytearray]
                ) -> Sequence[memoryview | bytes | bytearray]:
        n = sum(len(b) for b in bufs)
        faults.slow_write(n)
        if faults.ACTIVE.get("crash_at") == "half_written" and self.nbytes < self._half <= self.nbytes + n:
            # Write exactly up to the middle of the data, then die.
            flat = b"".join(bytes(b) for b in bufs)[: self._half - self.nbytes]
            assert self._fd is not None
            write_all(self._fd, [flat])
            faults.crash_point("half_written")
        return bufs

    def commit(self, header: bytes, lock: threading.Lock,
               on_renamed: Callable[[], None]) -> None:
        """Put the final header in place, then fsync -> rename -> fsync(dir).
        ``on_renamed`` runs right after the rename, both under ``lock``. A
        failure before the rename removes the tmp file and leaves the old
        version; once renamed (``renamed``), the new version is in place even
        if the directory's fsync then fails."""
        assert self._fd is not None
        try:
            view = memoryview(header)
            off = 0
            while off < len(view):
                off += os.pwrite(self._fd, view[off:], off)
            t0 = time.perf_counter()
            if not faults.skip("no_fsync"):
                full_fsync(self._fd)
            self.fsync_seconds = time.perf_counter() - t0
            faults.crash_point("fsynced")
            st = os.fstat(self._fd)
            self.identity = (st.st_ino, st.st_mtime_ns)
            # Let go of the number first: a close that fails has freed it all
            # the same (Linux), and abort() closing it again could close what
            # another thread was given meanwhile (ZeroMQ's socket).
            fd, self._fd = self._fd, None
            os.close(fd)
            with lock:
                os.rename(self.tmp, self.final)
                self.renamed = True
                on_renamed()
            if self._on_gone is not None:
                self._on_gone(self.tmp)
        except BaseException:
            self.abort()
            raise
        faults.crash_point("renamed")
        faults.slow_step("renamed_delay")
        t0 = time.perf_counter()
        if not faults.skip("no_dir_fsync"):
            faults.io_error("dir_fsync")
            fsync_dir(self.final.parent)
        self.fsync_seconds += time.perf_counter() - t0
        faults.crash_point("dir_fsynced")

    def abort(self) -> None:
        """Close and remove the tmp file. Never raises: it runs on the way out
        of a failed write, whose error is the one to report (a disk gone
        read-only after a write's EIO failed the unlink too, and the unlink's
        error replaced it, logged as an internal error). A tmp file left is
        logged; the next start sweeps it."""
        faults.slow_abort()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("event=tmp_not_removed path=%s error=%s", self.tmp,
                      exc.strerror or exc)
            return
        if self._on_gone is not None:
            self._on_gone(self.tmp)
