"""The safetensors layout, written and read without MLX.

A file is: 8-byte little-endian header length, a JSON header (per tensor
``dtype``, ``shape``, ``data_offsets``; strings in ``__metadata__``), padded
with spaces so the data starts 8-byte aligned, then the raw bytes of every
tensor back to back in header order.

The daemon writes the header first, before any tensor bytes have arrived, and
learns the per-tensor checksums only at the end. So the checksums go in with a
fixed-width placeholder, and the final header, of exactly the same length, is
written over it before the file is made durable.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import stat
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgspec
import xxhash

from kvkeeper.protocol.dtypes import DTYPE_SIZES
from kvkeeper.protocol.legacy_formats import detect_legacy
from kvkeeper.protocol.messages import TensorSpec

#: Metadata keys. ``kvkeeper.format`` marks a file as ours.
FORMAT_KEY = "kvkeeper.format"
FORMAT = "kvkeeper/1"
MODEL_KEY = "kvkeeper.model"
CACHE_ID_KEY = "kvkeeper.cache_id"
SAVED_AT_KEY = "kvkeeper.saved_at"
TOKENS_KEY = "kvkeeper.token_ids"
TOKEN_COUNT_KEY = "kvkeeper.token_count"
LAYERS_KEY = "kvkeeper.layers"
USER_KEY = "kvkeeper.user"
CHECKSUMS_KEY = "kvkeeper.checksums"
#: Keys only the daemon sets; a client's values for them are replaced.
DAEMON_KEYS = frozenset({FORMAT_KEY, MODEL_KEY, CACHE_ID_KEY, SAVED_AT_KEY, CHECKSUMS_KEY})

CHECKSUM_ALGO = "xxh3_64"
_PLACEHOLDER = "0" * 16
#: Largest header a reader accepts before it gives up on a file.
MAX_FILE_HEADER = 256 * 1024 * 1024
#: Largest header the daemon writes: what the safetensors package reads (its
#: limit), so every file kvkeeper writes can be opened by it, by mx.load and
#: by kvkeeper's reader. Escaping can make a header far larger on disk than
#: on the wire (a control character takes 6 bytes of JSON).
MAX_WRITTEN_HEADER = 100_000_000


class LayoutError(ValueError):
    """A declared tensor layout or a file header that cannot be right."""


class TableError(LayoutError):
    """A file whose header reads (JSON, metadata of strings) but whose tensor
    table kvkeeper cannot take: a dtype it does not know (``F8_E4M3``
    weights), sizes that disagree with the file (cut short). ``metadata``
    says whose file it is: a damaged cache, or another program's."""

    def __init__(self, message: str, metadata: dict[str, str]) -> None:
        super().__init__(message)
        self.metadata = metadata


class UnknownDtypeError(TableError):
    """A tensor table that holds a dtype kvkeeper does not know, and is
    otherwise sound: every tensor within the file, the tensors tiling it.
    ``header`` is the header as read, for :meth:`header_vouched` and the
    data's checksums (which go by bytes, not by dtype)."""

    def __init__(self, message: str, header: FileHeader) -> None:
        super().__init__(message, header.metadata)
        self.header = header

    def header_vouched(self) -> bool:
        """Whether the header's own checksum passes: the header is as its
        writer made it (a newer kvkeeper's dtype), not damaged."""
        try:
            recorded = msgspec.json.decode(self.metadata[CHECKSUMS_KEY])
            return (isinstance(recorded, dict) and recorded.get("header") is not None
                    and self.header.checksums is not None)
        except (KeyError, ValueError, msgspec.DecodeError, RecursionError):
            return False  # (LayoutError is a ValueError; RecursionError: "[[[...")


#: MLX shapes are int32.
MAX_DIM = 2**31 - 1


def tensor_nbytes(spec: TensorSpec) -> int:
    """Byte size of a declared tensor; raises LayoutError for unknown dtypes
    and for dimensions no MLX array can have."""
    size = DTYPE_SIZES.get(spec.dtype)
    if size is None:
        raise LayoutError(f"unknown dtype {spec.dtype!r}")
    if any(d > MAX_DIM for d in spec.shape):
        raise LayoutError(f"tensor {spec.name!r} has a dimension over {MAX_DIM}")
    if math.prod(d for d in spec.shape if d) * size >= 2**63:
        # Empty (a 0 in it), but the safetensors package multiplies the
        # others first and fails on the overflow: a file it cannot open.
        raise LayoutError(f"tensor {spec.name!r}: its dimensions multiply past 2**63 bytes")
    return math.prod(spec.shape) * size


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a save lands, and the header that says so."""

    specs: tuple[TensorSpec, ...]
    sizes: tuple[int, ...]
    total: int  # data bytes
    #: About what the decoded tensor table takes in memory (about 250 bytes a
    #: tensor beside its name: 65,536 long names are 33 MB for 17 on the wire).
    table_bytes: int = 0

    @classmethod
    def of(cls, specs: Sequence[TensorSpec]) -> Layout:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise LayoutError("duplicate tensor names")
        if "__metadata__" in names:
            raise LayoutError("a tensor may not be named __metadata__")
        sizes = tuple(tensor_nbytes(s) for s in specs)
        table = sum(256 + len(s.name.encode()) + 32 * len(s.shape) for s in specs)
        return cls(tuple(specs), sizes, sum(sizes), table)

    def header(self, metadata: Mapping[str, str], checksums: Sequence[str] | None = None) -> bytes:
        """Length prefix + JSON header, padded to 8 bytes. Without ``checksums``
        the placeholder takes their place; with them the result is the same length."""
        sums = list(checksums) if checksums is not None else [_PLACEHOLDER] * len(self.specs)
        if any(len(s) != len(_PLACEHOLDER) for s in sums):
            raise LayoutError("checksums must be 16 hex digits")
        meta = {k: v for k, v in metadata.items() if k != CHECKSUMS_KEY}
        tensors: dict[str, Any] = {}
        offset = 0
        for spec, size in zip(self.specs, self.sizes, strict=True):
            tensors[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        meta[CHECKSUMS_KEY] = msgspec.json.encode({
            "algo": CHECKSUM_ALGO,
            "header": header_digest(meta, tensors),
            "tensors": dict(zip([s.name for s in self.specs], sums, strict=True)),
        }).decode()
        raw = msgspec.json.encode({"__metadata__": meta, **tensors})
        raw += b" " * (-(8 + len(raw)) % 8)
        return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class FileHeader:
    """A parsed file header: tensors by name, metadata, and where data starts."""

    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_start: int

    @functools.cached_property
    def checksums(self) -> dict[str, str] | None:
        """Every tensor's recorded checksum, or None for a file that has none
        (another program's). Raises LayoutError when the header itself fails
        its own checksum: the data's checksums cannot vouch for the token ids,
        the layer description or the tensor table (a flipped digit there is a
        different conversation, or another dtype, over the very same bytes)."""
        raw = self.metadata.get(CHECKSUMS_KEY)
        if raw is None:
            return None
        try:
            obj = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise LayoutError("checksums metadata is not JSON") from None
        except RecursionError:  # "[[[..." 2000 deep: a traceback from load() and verify
            raise LayoutError("checksums metadata is nested too deeply") from None
        if not isinstance(obj, dict) or obj.get("algo") != CHECKSUM_ALGO:
            raise LayoutError("unknown checksum algorithm")
        # A damaged field name must not pass for a file written before the
        # header had a checksum (kvkeeper 0.2.1 and older: no "header").
        if not set(obj) <= _CHECKSUM_FIELDS:
            raise LayoutError("checksums metadata has unknown fields")
        sums = obj.get("tensors")
        if not isinstance(sums, dict):
            raise LayoutError("checksums metadata has no tensors")
        digest = obj.get("header")
        if digest is not None and digest != header_digest(self.metadata, self.tensors):
            raise LayoutError("header checksum mismatch (metadata or tensor table damaged)")
        return sums


def read_header(f: BinaryIO, file_size: int | None = None) -> FileHeader:
    """Read and check a safetensors header (never the tensor bytes)."""
    if file_size is None:
        file_size = os.fstat(f.fileno()).st_size
    n = _header_length(f.read(8), file_size)
    raw = f.read(n)
    if len(raw) != n:
        raise LayoutError("truncated header")
    return _parse_header(raw, file_size)


#: What read_file_header reads at once: the whole header of a cache of a few
#: thousand tokens (4096 tokens and 64 tensors: 32 KiB).
_FIRST_READ = 64 * 1024


#: Errors reading a file that may pass, or be this process's view alone (a
#: network file system's hiccup, a stale handle): on their word alone the
#: daemon moved a sound file aside, and every client lost it (the disk
#: budget deletes quarantined files first). A file that stays unreadable is
#: replaced at its key's next save, and `verify` reports it as a file it
#: could not read (``verify --repair`` moved it aside too, before 0.2.11).
MAY_PASS = frozenset({errno.EIO, errno.ESTALE})

#: How cache files are opened for reading. O_NONBLOCK: opening a FIFO named
#: like a cache file would otherwise wait for a writer, forever, before the
#: regular-file check after it could refuse it (reads of a regular file
#: ignore the flag).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def read_file_header(path: str | os.PathLike[str]) -> FileHeader:
    """``open_file``'s checks and header for a reader that wants nothing else:
    one ``pread`` for most files, no file object (a lazy load's every call)."""
    fd = os.open(path, _READ_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LayoutError("not a regular file")
        head = os.pread(fd, _FIRST_READ, 0)
        n = _header_length(head[:8], info.st_size)
        raw: memoryview | bytes = memoryview(head)[8 : 8 + n]
        if len(raw) < n:
            raw = head[8:] + os.pread(fd, n - len(raw), len(head))
            if len(raw) != n:
                raise LayoutError("truncated header")
    finally:
        os.close(fd)
    return _parse_header(raw, info.st_size)


def _header_length(prefix: bytes, file_size: int) -> int:
    if len(prefix) != 8:
        raise LayoutError("file shorter than a safetensors header")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_FILE_HEADER or 8 + n > file_size:
        raise LayoutError(f"header length {n} does not fit a file of {file_size} bytes "
                          f"(not a safetensors file, or a truncated one)")
    return int(n)


def _parse_header(raw: bytes | memoryview, file_size: int) -> FileHeader:
    n = len(raw)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise LayoutError(f"header is not JSON: {exc}") from None
    except RecursionError:  # e.g. [[[...]]] thousands deep
        raise LayoutError("header is nested too deeply") from None
    if not isinstance(body, dict):
        raise LayoutError("header is not a JSON object")
    meta = body.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise LayoutError("__metadata__ must map strings to strings")
    data_len = file_size - 8 - n
    end = 0
    spans = []
    unknown: str | None = None  # the first tensor of a dtype kvkeeper does not know
    # Every lazy load runs this loop once per tensor: plain loops, no generators
    # (a third of the time it took with them).
    for name, t in body.items():
        try:
            shape, (a, b), dtype = t["shape"], t["data_offsets"], t["dtype"]
            # Any JSON may sit in a file under the root: only plain integers
            # (no bools, strings or floats) may reach the arithmetic below.
            if type(shape) is not list or type(a) is not int or type(b) is not int \
                    or type(dtype) is not str:
                raise ValueError
            want = 1
            for d in shape:
                if type(d) is not int or d < 0:
                    raise ValueError
                want *= d
        except (KeyError, TypeError, ValueError):
            # Not a TableError: a damaged "__metadata__" key (a flipped bit)
            # reads as a tensor of no shape, and as metadata of no cache.
            raise LayoutError(f"tensor {name!r} has a malformed entry") from None
        size = DTYPE_SIZES.get(dtype)
        if size is None:
            # Its size cannot be told; the rest of the layout still can (a
            # file cut short with such a tensor in it is damage all the same).
            unknown = unknown or f"tensor {name!r} has a dtype kvkeeper does not read ({dtype!r})"
            want = b - a
        else:
            want *= size
        if not (0 <= a <= b <= data_len) or b - a != want:
            raise TableError(f"tensor {name!r} lies outside the file or has the wrong size",
                             meta)
        if b > end:
            end = b
        spans.append((a, b))
    if end != data_len:
        raise TableError(f"file holds {data_len} data bytes, header describes {end}", meta)
    # Each byte one tensor's, as every writer lays them out: two tensors
    # over the same bytes read alike (a legacy file, which has no
    # checksums, gave layer 0's values as layer 1's keys). Written in
    # order, they sort in one pass.
    spans.sort()
    at = 0
    for a, b in spans:
        if a != at:
            raise TableError("tensors overlap or leave bytes no tensor holds", meta)
        at = b
    if unknown is not None:
        raise UnknownDtypeError(unknown, FileHeader(body, meta, 8 + n))
    return FileHeader(body, meta, 8 + n)


_CHECKSUM_FIELDS = frozenset({"algo", "header", "tensors"})


def is_cache(metadata: Mapping[str, str]) -> bool:
    """Whether a header's metadata is a cache's: kvkeeper's own, or one of
    the two older formats (any other safetensors file is another program's)."""
    return written_by_kvkeeper(metadata) or detect_legacy(metadata) is not None


def written_by_kvkeeper(metadata: Mapping[str, str]) -> bool:
    """Whether a header's metadata is one the daemon wrote: its format name,
    or, that name damaged, its checksums entry (which nothing else writes):
    such a file is a damaged cache, not another program's file to keep."""
    return metadata.get(FORMAT_KEY) == FORMAT or CHECKSUMS_KEY in metadata


def header_digest(metadata: Mapping[str, str], tensors: Mapping[str, Any]) -> str:
    """Checksum of a header's metadata (but the checksums entry) and tensor
    table, over a canonical form: sorted, so the writer's dicts and a
    reader's parse of the file agree whatever their order."""
    canon = msgspec.json.encode([
        sorted((k, v) for k, v in metadata.items() if k != CHECKSUMS_KEY),
        sorted((name, t["dtype"], t["shape"], t["data_offsets"]) for name, t in tensors.items()),
    ])
    return xxhash.xxh3_64_hexdigest(canon)


def checksum(buf: bytes | memoryview) -> str:
    """Checksum of one tensor's bytes, as stored in the header."""
    return xxhash.xxh3_64_hexdigest(buf)


class TensorHasher:
    """Per-tensor checksums of a byte stream that arrives in arbitrary pieces."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self._sizes = list(sizes)
        self._digests: list[str] = []
        self._h = xxhash.xxh3_64()
        self._idx = -1
        self._left = 0
        self._next()

    def _next(self) -> None:
        # Start the next tensor, closing zero-sized ones on the way.
        while True:
            self._idx += 1
            if self._idx >= len(self._sizes):
                return
            self._left = self._sizes[self._idx]
            if self._left:
                return
            self._digests.append(xxhash.xxh3_64_hexdigest(b""))

    def update(self, data: memoryview | bytes | bytearray) -> None:
        buf = memoryview(data)  # slices of it copy nothing
        while len(buf):
            if self._idx >= len(self._sizes):
                raise LayoutError("more bytes than the declared tensors hold")
            take = min(self._left, len(buf))
            self._h.update(buf[:take])
            buf = buf[take:]
            self._left -= take
            if self._left == 0:
                self._digests.append(self._h.hexdigest())
                self._h.reset()
                self._next()

    def hexdigests(self) -> list[str]:
        if len(self._digests) != len(self._sizes):
            raise LayoutError("stream ended before every tensor was complete")
        return list(self._digests)


_O_NOATIME: int = getattr(os, "O_NOATIME", 0)  # Linux only; elsewhere the atime is put back


#: Errors opening or reading a file that say nothing about the file: this
#: process is out of descriptors or memory, may not read it, or was
#: interrupted; or the file went meanwhile. Others (a symlink at its place, a
#: read error) are the file's.
_NOT_THE_FILES = frozenset({errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE,
                            errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOENT})


def says_nothing_of_the_file(exc: OSError) -> bool:
    """Whether ``exc``, met opening or reading a file, is the reader's
    trouble rather than the file's (so the file must not be called damaged)."""
    return exc.errno in _NOT_THE_FILES


def why_not_opened(path: str | os.PathLike[str], exc: OSError) -> str:
    """What an OSError met opening or reading the file at ``path`` says, for
    people: its reason alone (a directory's, from fdopen, named the
    descriptor: "Is a directory: 14"), a symlink named as one (O_NOFOLLOW's
    ELOOP reads "Too many levels of symbolic links" for one link)."""
    if exc.errno == errno.ELOOP and os.path.islink(path):
        return "it is a symlink (never followed: give the file it points to)"
    return exc.strerror or str(exc)


@contextmanager
def open_file(path: str | os.PathLike[str], *,
              keep_atime: bool = False) -> Iterator[tuple[BinaryIO, FileHeader]]:
    """Open a cache file without following a symlink, insist on a regular
    file, and read its header. Raises OSError or LayoutError.

    ``keep_atime``: reading leaves the file's access time as it was. The
    store keeps each entry's last use there (for eviction), so the daemon's
    own reads (scans, checks) must not count as uses; on a ``relatime``
    mount, the Linux default, a first read after a write would."""
    with open_bytes(path, keep_atime=keep_atime) as (f, info):
        yield f, read_header(f, info.st_size)


@contextmanager
def open_bytes(path: str | os.PathLike[str], *,
               keep_atime: bool = False) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """``open_file`` without the header: the file and its fstat."""
    flags = _READ_FLAGS
    noatime = _O_NOATIME if keep_atime else 0
    try:
        fd = os.open(path, flags | noatime)
    except PermissionError:
        if not noatime:
            raise
        fd = os.open(path, flags)  # O_NOATIME is for the file's owner only
        noatime = 0
    try:
        f = os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        # A directory's IsADirectoryError (the reason verify gives): fdopen
        # leaves a descriptor it was given open when it fails, one a call.
        os.close(fd)
        raise
    with f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LayoutError("not a regular file")
        try:
            yield f, info
        finally:
            if keep_atime and not noatime:
                _restore_atime(fd, info)


def _restore_atime(fd: int, before: os.stat_result) -> None:
    # Through the descriptor: the path may name a newer file by now.
    if os.utime not in os.supports_fd:
        return
    try:
        if os.fstat(fd).st_atime_ns != before.st_atime_ns:
            os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError:
        pass  # not ours to change: the order of use is only a hint


def verify_data(f: BinaryIO, header: FileHeader, progress: Any = None) -> None:
    """Check every tensor of a kvkeeper file against its checksum by reading it
    (no MLX needed), on a file ``open_file`` opened. ``progress(nbytes)`` is
    called as bytes are read. Raises LayoutError (or OSError) saying what."""
    sums = header.checksums
    if sums is None or set(sums) != set(header.tensors):
        raise LayoutError("checksums missing or not covering every tensor")
    buf = bytearray(8 * 1024 * 1024)
    view = memoryview(buf)
    ordered = sorted(header.tensors.items(), key=lambda kv: kv[1]["data_offsets"][0])
    for name, t in ordered:
        a, b = t["data_offsets"]
        f.seek(header.data_start + a)
        h = xxhash.xxh3_64()
        left = b - a
        while left:
            n = f.readinto(view[: min(left, len(buf))])  # type: ignore[attr-defined]
            if not n:
                raise LayoutError(f"tensor {name!r} is cut short")
            h.update(view[:n])
            left -= n
            if progress is not None:
                progress(n)
        if h.hexdigest() != sums[name]:
            raise LayoutError(f"checksum mismatch in tensor {name!r}")
