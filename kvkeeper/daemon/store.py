"""The disk: where an entry's file lives, durable atomic replace, listing.

Plain synchronous code; the writer actor calls it from a worker thread. Files
are only ever replaced whole: a tmp file in the same directory is written,
made durable, renamed over the target, and the directory is made durable, so a
reader (or a crash) sees the complete old or the complete new version.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvkeeper.daemon import faults
from kvkeeper.protocol import naming
from kvkeeper.protocol.safetensors import (
    CACHE_ID_KEY,
    FORMAT,
    FORMAT_KEY,
    MODEL_KEY,
    TOKEN_COUNT_KEY,
    LayoutError,
    read_header,
)

log = logging.getLogger("kvkeeper.store")

TMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"
_IOV_MAX = min(getattr(os, "sysconf", lambda _n: 1024)("SC_IOV_MAX") or 1024, 1024)
_F_FULLFSYNC = getattr(__import__("fcntl"), "F_FULLFSYNC", None)
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
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOTTY):
                raise
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, bufs: Sequence[memoryview | bytes]) -> int:
    """writev every byte of ``bufs``. Loops on short writes (a full disk or
    RLIMIT_FSIZE gives a short count first and an error on the next call)."""
    pending = [memoryview(b).cast("B") for b in bufs if len(b)]
    total = 0
    while pending:
        n = os.writev(fd, pending[:_IOV_MAX])
        total += n
        while n and pending:
            if n >= len(pending[0]):
                n -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][n:]
                n = 0
    return total


class PendingFile:
    """A new version of one entry, written to a tmp file beside the target."""

    def __init__(self, final: Path, header: bytes, data_bytes: int = 0) -> None:
        self.final = final
        self.tmp = final.with_name(f".{final.name}.{os.getpid()}.{next(_counter)}{TMP_SUFFIX}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd: int | None = os.open(self.tmp, flags, 0o600)
        faults.crash_point("tmp_created")
        self.nbytes = 0
        self._half = len(header) + data_bytes // 2
        try:
            self.append([header])
        except BaseException:
            self.abort()
            raise

    def append(self, bufs: Sequence[memoryview | bytes]) -> None:
        assert self._fd is not None
        if faults.ACTIVE:
            bufs = self._faulty(bufs)
        self.nbytes += write_all(self._fd, bufs)

    def _faulty(self, bufs: Sequence[memoryview | bytes]) -> Sequence[memoryview | bytes]:
        n = sum(len(b) for b in bufs)
        faults.slow_write(n)
        if faults.ACTIVE.get("crash_at") == "half_written" and self.nbytes < self._half <= self.nbytes + n:
            # Write exactly up to the middle of the data, then die.
            flat = b"".join(bytes(b) for b in bufs)[: self._half - self.nbytes]
            assert self._fd is not None
            write_all(self._fd, [flat])
            faults.crash_point("half_written")
        return bufs

    def commit(self, header: bytes) -> None:
        """Put the final header in place, then fsync -> rename -> fsync(dir).
        A failure anywhere removes the tmp file and leaves the old version."""
        assert self._fd is not None
        try:
            view = memoryview(header)
            off = 0
            while off < len(view):
                off += os.pwrite(self._fd, view[off:], off)
            if not faults.skip("no_fsync"):
                full_fsync(self._fd)
            faults.crash_point("fsynced")
            os.close(self._fd)
            self._fd = None
            os.rename(self.tmp, self.final)
        except BaseException:
            self.abort()
            raise
        faults.crash_point("renamed")
        if not faults.skip("no_dir_fsync"):
            fsync_dir(self.final.parent)
        faults.crash_point("dir_fsynced")

    def abort(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


@dataclass(frozen=True)
class StoredEntry:
    model: str
    cache_id: str
    tokens: int
    nbytes: int
    last_used: float
    path: Path


class Store:
    """Whole-session files under ``root/sessions/<model>/<cache id>.safetensors``.

    The narrow interface (begin a put, find, delete, entries, sweep) is what a
    second layout (token blocks) will implement beside this one.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sessions = root / naming.SESSIONS_DIR
        self._last_used: dict[Path, float] = {}

    # -- paths
    def path_for(self, model: str, cache_id: str) -> Path:
        return self.sessions / naming.entry_relpath(model, cache_id)

    def _model_dir(self, model: str) -> Path:
        d = self.sessions / naming.encode_component(model, "model")
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, f"{d} is not a directory (refusing a symlink)") from None
        return d

    # -- lifecycle
    def open(self) -> list[Path]:
        """Create the layout and remove tmp files a crash left behind."""
        os.makedirs(self.sessions, mode=0o700, exist_ok=True)
        if os.path.islink(self.sessions):
            raise OSError(errno.ELOOP, f"{self.sessions} is a symlink")
        removed = []
        for model_dir in self.sessions.iterdir():
            if model_dir.is_symlink() or not model_dir.is_dir():
                continue
            for f in model_dir.iterdir():
                if f.name.startswith(".") and f.name.endswith(TMP_SUFFIX):
                    try:
                        f.unlink()
                        removed.append(f)
                    except OSError as exc:
                        log.warning("event=sweep_failed path=%s error=%s", f, exc)
        return removed

    # -- put / find / delete
    def begin(self, model: str, cache_id: str, header: bytes, data_bytes: int) -> PendingFile:
        self._model_dir(model)
        return PendingFile(self.path_for(model, cache_id), header, data_bytes)

    def find(self, model: str, cache_id: str) -> Path | None:
        """The entry's file if it is a regular file (never through a symlink)."""
        path = self.path_for(model, cache_id)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            log.warning("event=not_a_file path=%s", path)
            return None
        self._last_used[path] = time.time()
        return path

    def delete(self, model: str, cache_id: str) -> bool:
        path = self.path_for(model, cache_id)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        self._last_used.pop(path, None)
        fsync_dir(path.parent)
        return True

    def quarantine(
        self, model: str, cache_id: str, ino: int | None, mtime_ns: int | None, reason: str
    ) -> Path | None:
        """Move an entry's unusable file (or whatever non-file sits at its path) to
        ``<root>/quarantine/``, unless it was replaced since it was judged
        (``ino``/``mtime_ns`` differ). Returns where it went."""
        path = self.path_for(model, cache_id)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if ino is not None and (st.st_ino, st.st_mtime_ns) != (ino, mtime_ns):
            return None  # a newer version took its place: keep it
        qdir = self.root / QUARANTINE_DIR
        os.makedirs(qdir, mode=0o700, exist_ok=True)
        dest = qdir / f"{path.parent.name}.{path.name}.{time.time_ns()}"
        os.rename(path, dest)
        self._last_used.pop(path, None)
        fsync_dir(path.parent)
        log.warning("event=quarantined model=%s id=%s reason=%s moved_to=%s",
                    model, cache_id, reason, dest)
        return dest

    def entries(self, model: str | None = None) -> list[StoredEntry]:
        """Every readable entry, from headers only (no tensor bytes are read)."""
        if model is not None:
            dirs = [self.sessions / naming.encode_component(model, "model")]
        else:
            dirs = sorted(p for p in self.sessions.iterdir() if not p.is_symlink())
        out = []
        for d in dirs:
            if not d.is_dir() or d.is_symlink():
                continue
            for f in sorted(d.iterdir()):
                if f.name.startswith(".") or not f.name.endswith(naming.SUFFIX):
                    continue
                entry = self._entry(f)
                if entry is not None:
                    out.append(entry)
        return out

    def _entry(self, path: Path) -> StoredEntry | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                meta = read_header(f, st.st_size).metadata
        except (OSError, LayoutError) as exc:
            log.info("event=unreadable_entry path=%s error=%s", path, exc)
            return None
        if meta.get(FORMAT_KEY) != FORMAT:
            return None
        try:
            tokens = int(meta.get(TOKEN_COUNT_KEY, "0"))
        except ValueError:
            tokens = 0
        return StoredEntry(
            model=meta.get(MODEL_KEY, ""),
            cache_id=meta.get(CACHE_ID_KEY, ""),
            tokens=tokens,
            nbytes=st.st_size,
            last_used=max(st.st_mtime, self._last_used.get(path, 0.0)),
            path=path,
        )


if sys.platform == "win32":  # pragma: no cover - the daemon needs POSIX file semantics
    raise ImportError("kvkeeper's store runs on macOS and Linux")
