"""Wire messages: one msgspec tagged union per direction.

Every ZeroMQ message is ``[header, *raw frames]``. The header is msgpack of one
of the structs below; tensors never travel inside msgpack: a ``SaveData``
header says how many raw frames follow it, and those frames hold the tensor
bytes, in order, exactly as they land in the file.

A save is a stream: one ``SaveBegin`` (the whole layout, no data), then
``SaveData`` messages of a few MiB each. Sending many small messages instead
of one huge multipart message is what lets the daemon write as bytes arrive
(measured in the design brief: 6x the throughput that way).
"""

from __future__ import annotations

import itertools
import os
from typing import Annotated, Literal

import msgspec

PROTOCOL_VERSION = 1

#: The first kvkeeper whose daemon takes ``SaveBegin.create`` (an older one
#: refuses the field as malformed; its Pong says its version).
CREATE_SINCE = (0, 2, 4)


def version_tuple(text: str) -> tuple[int, ...]:
    """``"0.32.2"`` as ``(0, 32, 2)``: each part's leading digits (0 for none)."""
    return tuple(int("".join(itertools.takewhile(str.isdigit, part)) or 0)
                 for part in text.split("."))

#: Largest header frame the daemon accepts (token ids of a long conversation
#: travel in the save's metadata).
MAX_HEADER_BYTES = 32 * 1024 * 1024
#: Largest reply a client accepts. Larger than a request's: a listing (ls,
#: gc) of about 100,000 entries passed MAX_HEADER_BYTES, and the client
#: dropped it and waited out its timeout. The daemon is the user's own.
MAX_REPLY_BYTES = 1024 * 1024 * 1024
#: A cache id or model fingerprint, in UTF-8 bytes.
MAX_ID_BYTES = 1024
MAX_TENSORS = 65_536
MAX_DIMS = 8
MAX_FRAMES_PER_MESSAGE = 256
#: Entries of a save header's metadata. kvkeeper's client sends a handful
#: (the user's metadata travels as one JSON string in it); a raw client's 3.5
#: million tiny ones in one 25 MiB header held the daemon 5.9 s and took
#: 634 MiB before any budget refused them.
MAX_METADATA_ENTRIES = 65_536

# Generous at decode time so that an over-long id gets the precise "bad_id" answer.
_Id = Annotated[str, msgspec.Meta(max_length=64 * 1024)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]

ErrorCode = Literal[
    "malformed",  # undecodable header or fields of the wrong type
    "version",  # protocol version this daemon does not speak
    "frames",  # frame count or byte size disagrees with the header
    "dtype",  # unknown tensor dtype
    "bad_id",  # empty, oversized or undecodable model or cache id
    "too_large",  # a save larger than the daemon's pending-bytes budget
    "busy",  # the pending-bytes budget or the mailbox is full right now
    "shutting_down",  # the daemon is draining and takes no new saves
    "unknown_save",  # data for a save the daemon does not know (refused or expired)
    "exists",  # a save made only to create its entry: the key has one, or a save on its way
    "forbidden",  # a peer of another user
    "internal",  # the daemon could not do what was asked (a bug, or the disk); the message says why
]


class _Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True):
    v: int


# ---------------------------------------------------------------- client -> daemon


class TensorSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One tensor of a save: name in the file, safetensors dtype name, shape."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    shape: Annotated[list[_Count], msgspec.Meta(max_length=MAX_DIMS)]


class Ping(_Msg, tag="ping"):
    req: int


class SaveBegin(_Msg, tag="save"):
    """Starts a save stream. ``save`` numbers the stream within one client.
    ``create``: only if, as this arrives, the key has no entry once the
    jobs received before it are done (a pending delete leaves none, a
    pending save one), else refused as ``exists`` (``import`` without
    ``--replace``: a live conversation's first save still on its way was
    replaced by the backup). A later save of the key still replaces it."""

    save: int
    model: _Id
    cache_id: _Id
    tensors: Annotated[list[TensorSpec], msgspec.Meta(max_length=MAX_TENSORS)]
    metadata: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_METADATA_ENTRIES)] = {}
    create: bool = False


class SaveData(_Msg, tag="data"):
    """Followed by ``frames`` raw frames: the next bytes of save ``save``."""

    save: int
    frames: Annotated[int, msgspec.Meta(ge=1, le=MAX_FRAMES_PER_MESSAGE)]


class Load(_Msg, tag="load"):
    req: int
    model: _Id
    cache_id: _Id


class Delete(_Msg, tag="delete"):
    req: int
    model: _Id
    cache_id: _Id


class ListEntries(_Msg, tag="list"):
    """``everything``: also legacy, quarantined and foreign files under the root."""

    req: int
    model: _Id | None = None
    everything: bool = False


class Gc(_Msg, tag="gc"):
    """Re-read the root and apply the disk budget now."""

    req: int


class GetStats(_Msg, tag="stats"):
    req: int


class Quarantine(_Msg, tag="quarantine"):
    """The client found the file of an entry unusable (``reason``): move it aside,
    if it is still the file the client read (same inode and mtime)."""

    req: int
    model: _Id
    cache_id: _Id
    ino: int
    mtime_ns: int
    reason: Annotated[str, msgspec.Meta(max_length=4096)]


class Used(_Msg, tag="used"):
    """The client read an entry's file itself (inode ``ino``): count it as a use
    for eviction, as a Load would. No reply."""

    model: _Id
    cache_id: _Id
    ino: int


class Flush(_Msg, tag="flush"):
    """Answered once every save this client sent before it is resolved. A
    ``req`` of DRAIN_ANSWER or more answers a ``Draining`` notice: everything
    the client sent before it read the notice came ahead of it."""

    req: int


#: The least ``req`` of a Flush that answers a drain notice (a client's own
#: request numbers stay below it). Any daemon answers it as a flush; one
#: that drains stops taking this client's saves once it reads it.
DRAIN_ANSWER = 1 << 62

#: A kvkeeper client's ZeroMQ routing id is this and 13 random bytes, for the
#: client's life (a leading zero byte is reserved by ZeroMQ). Only such peers
#: are sent a probe: a Pong for request 0, which no client asks, to be ignored.
CLIENT_ID_PREFIX = b"kvk"


def new_client_id() -> bytes:
    return CLIENT_ID_PREFIX + os.urandom(13)


def is_client_id(peer: bytes) -> bool:
    """Whether ``peer`` is a kvkeeper client's routing id (see new_client_id)."""
    return len(peer) == 16 and peer.startswith(CLIENT_ID_PREFIX)


Request = (
    Ping | SaveBegin | SaveData | Load | Used | Delete | ListEntries | GetStats | Flush
    | Quarantine | Gc
)


# ---------------------------------------------------------------- daemon -> client


class Pong(_Msg, tag="pong"):
    req: int
    pid: int
    root: str
    version: str
    max_save_bytes: int


class SaveRefused(_Msg, tag="refused"):
    """A save the daemon did not take (or gave up on): nothing of it was written."""

    save: int
    code: ErrorCode
    message: str


class Found(_Msg, tag="found"):
    """Answer to Load: the file to open (``None``: no entry). Any pending write
    of that key is on disk before this is sent (read-your-writes)."""

    req: int
    path: str | None


class Deleted(_Msg, tag="deleted"):
    """Answer to Delete (``existed``) and to Quarantine (``existed``: moved aside)."""

    req: int
    existed: bool


class Entry(msgspec.Struct, forbid_unknown_fields=True):
    """A file under the root. ``kind``: entry, legacy, quarantine or foreign."""

    model: str
    cache_id: str
    tokens: int
    nbytes: int
    last_used: float
    path: str
    kind: str = "entry"
    saved_at: float = 0.0


class Evicted(_Msg, tag="evicted"):
    """Answer to Gc: what went, and where the budget stands now."""

    req: int
    entries: list[Entry]
    disk_used_bytes: int
    free_bytes: int


class Entries(_Msg, tag="entries"):
    req: int
    entries: list[Entry]


class Stats(_Msg, tag="stats"):
    req: int
    counters: dict[str, float]


class Flushed(_Msg, tag="flushed"):
    """Every save this client sent before it is resolved. The counts are running
    totals for this client's connection, so that a flush whose answer was lost
    (a timeout) hides nothing from the next one. ``failed`` counts refused
    saves too, of the saves sent before this flush only: one sent after it
    that failed while it waited is left to the next flush."""

    req: int
    written: int
    superseded: int
    failed: int


class Draining(_Msg, tag="draining"):
    """The one reply sent unasked: when the daemon begins to drain before it
    exits, to each client whose saves it has taken (and to one whose first
    save it reads in the drain's first seconds); it takes the client's saves
    until its answer, and refuses those that come later. A client keeps its
    next saves for the next daemon, and asks for a ``Flush`` (with a ``req``
    of DRAIN_ANSWER or more): answered once the drain has settled the saves it read, it
    lets the client vouch for them after the restart (``pid`` and
    ``boot_id`` name this run, as ``Pong`` and the stats do)."""

    pid: int
    boot_id: float


class Error(_Msg, tag="error"):
    req: int | None
    code: ErrorCode
    message: str


Reply = (
    Pong | SaveRefused | Found | Deleted | Entries | Stats | Flushed | Evicted | Draining
    | Error
)


class _VersionOnly(msgspec.Struct):
    v: int


class SaveOnly(msgspec.Struct):
    """What ``begun_save`` reads of a header that did not decode: its save
    number left raw (as an object, a 31 MiB array of empty maps took 4.4 s
    and 2.3 GiB to build) and read as an int alone (``number``)."""

    op: str = ""
    save: msgspec.Raw = msgspec.Raw(b"")

    @property
    def number(self) -> int | None:
        try:
            return msgspec.msgpack.decode(self.save, type=int)
        except msgspec.DecodeError:
            return None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)
_op_decoder = msgspec.msgpack.Decoder(SaveOnly)


class DecodeFailure(Exception):
    """A header that is not a valid message; ``code`` is the error code to answer."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder, buf: bytes | memoryview,  # type: ignore[no-untyped-def]
            limit: int = MAX_HEADER_BYTES):
    if len(buf) > limit:
        raise DecodeFailure("malformed", f"header of {len(buf)} bytes exceeds {limit}")
    try:
        return decoder.decode(buf)
    except msgspec.DecodeError as exc:
        # Tell a peer of another protocol version that, rather than which field failed.
        try:
            v = _version_decoder.decode(buf).v
        except Exception:  # noqa: BLE001 - any failure here means plain malformed
            v = PROTOCOL_VERSION
        if v != PROTOCOL_VERSION:
            raise DecodeFailure(
                "version", f"protocol version {v} not supported (speaks {PROTOCOL_VERSION})"
            ) from None
        raise DecodeFailure("malformed", str(exc)) from None
    except (RecursionError, MemoryError, ValueError, TypeError) as exc:
        raise DecodeFailure("malformed", f"undecodable header: {type(exc).__name__}") from None


def decode_request(buf: bytes | memoryview) -> Request:
    """Decode and version-check a client header; raises DecodeFailure."""
    msg = _decode(_request_decoder, buf)
    if msg.v != PROTOCOL_VERSION:
        raise DecodeFailure(
            "version", f"protocol version {msg.v} not supported (speaks {PROTOCOL_VERSION})"
        )
    return msg


def begun_save(buf: bytes | memoryview) -> SaveOnly | None:
    """For a header ``decode_request`` refused: its op and save number if it
    says it begins a save (a map whose op is "save": its sender counts it
    among its saves, and sends its data next), else None; None too for one
    nested too deep to be read past (msgspec's RecursionError)."""
    said = _save_op(buf)
    return said if said is not None and said.op == SaveBegin.__struct_config__.tag else None


def data_of_save(buf: bytes | memoryview) -> int | None:
    """For a header ``decode_request`` refused: the number of the save it
    says it brings bytes of (a map whose op is "data"), else None."""
    said = _save_op(buf)
    return said.number if said is not None and said.op == SaveData.__struct_config__.tag \
        else None


def _save_op(buf: bytes | memoryview) -> SaveOnly | None:
    if len(buf) > MAX_HEADER_BYTES:
        return None
    try:
        return _op_decoder.decode(buf)
    except Exception:  # noqa: BLE001 - anything else: not a save's header
        return None


def decode_reply(buf: bytes | memoryview) -> Reply:
    """Decode a daemon header; raises DecodeFailure."""
    return _decode(_reply_decoder, buf, MAX_REPLY_BYTES)
