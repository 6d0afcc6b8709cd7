"""Cache ids and model fingerprints to file names, losslessly.

The reference mapped ``a/b``, ``a b`` and ``a_b`` to one file. Here every id
maps to its own name on every file system we run on, including case-insensitive
APFS and HFS+: only ``[a-z0-9-]`` stand for themselves, every other UTF-8 byte
(upper case too, so ``Foo`` and ``foo`` differ, and ``.``, so no name is hidden
or ``..``) becomes ``_xx`` in lower-case hex. A name that would be too long for
one path component becomes ``_z`` + the SHA-256 of the id (``_z`` never comes
out of the escaping); the file's metadata keeps the original id, and readers
compare it, so even then two ids never share a file silently.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from kvkeeper.protocol.messages import MAX_ID_BYTES

SUFFIX = ".safetensors"
#: Whole-session files live under ``<root>/sessions/``; a later block layout gets
#: a directory of its own beside it.
SESSIONS_DIR = "sessions"
#: Where the daemon moves files it found damaged (``<root>/quarantine/``).
QUARANTINE_DIR = "quarantine"
#: The root's single-instance lock (``<root>/.kvkeeper.lock``): the one file
#: under the root that is neither an entry nor counted against the budget.
LOCK_NAME = ".kvkeeper.lock"
#: Longest encoded component; leaves room for the tmp prefix and suffixes
#: within the 255-byte limit of a file name.
MAX_COMPONENT = 200
_KEEP = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-")
_HASHED = re.compile(r"_z[0-9a-f]{64}")


class BadId(ValueError):
    """An id that cannot name an entry: empty, too long, or not text."""


def check_id(value: str, what: str = "id") -> bytes:
    """Validate an id and return its UTF-8 bytes; raises BadId."""
    if not isinstance(value, str):
        raise BadId(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise BadId(f"{what} is empty")
    try:
        # str's own encode: a subclass's override must not change the name.
        raw = str.encode(value, "utf-8")
    except UnicodeEncodeError:
        raise BadId(f"{what} is not valid Unicode text") from None
    if len(raw) > MAX_ID_BYTES:
        raise BadId(f"{what} is {len(raw)} bytes; the limit is {MAX_ID_BYTES}")
    return raw


def plain(value: str) -> str:
    """``value`` as an exact ``str``: a subclass may be unhashable or override
    ``__str__``/``__eq__``, and ids key dicts, name files and travel on the wire."""
    return value if type(value) is str else str.__str__(value)


def check_key(model: str, cache_id: str) -> tuple[str, str]:
    """Validate an entry's model fingerprint and cache id; raises BadId.
    Returns both as exact ``str`` (see :func:`plain`)."""
    check_id(model, "model")
    check_id(cache_id, "cache id")
    return plain(model), plain(cache_id)


def encode_component(value: str, what: str = "id") -> str:
    """File-name component for an id (see module docstring); raises BadId."""
    raw = check_id(value, what)
    out = "".join(chr(b) if b in _KEEP else f"_{b:02x}" for b in raw)
    if len(out) > MAX_COMPONENT:
        return "_z" + hashlib.sha256(raw).hexdigest()
    return out


def decode_component(name: str) -> str | None:
    """The id a component stands for, or None for a hashed or foreign name:
    one :func:`encode_component` does not give (``int()`` also reads "_2F",
    "_ 2f" or "_+2", which made copies of an entry under such names pass
    for more entries of its key)."""
    if name.startswith("_z"):
        return None
    out = bytearray()
    i = 0
    try:
        while i < len(name):
            ch = name[i]
            if ch == "_":
                out.append(int(name[i + 1 : i + 3], 16))
                i += 3
            elif ord(ch) in _KEEP:
                out.append(ord(ch))
                i += 1
            else:
                return None
        value = out.decode("utf-8")
        return value if encode_component(value) == name else None
    except (ValueError, IndexError, UnicodeDecodeError):  # BadId is a ValueError
        return None


def entry_relpath(model: str, cache_id: str) -> str:
    """Path of an entry's file relative to the sessions directory."""
    return f"{encode_component(model, 'model')}/{encode_component(cache_id, 'cache id')}{SUFFIX}"


def entry_path(root: Path, model: str, cache_id: str) -> Path:
    """Where an entry's file lives under a store root."""
    return root / SESSIONS_DIR / entry_relpath(model, cache_id)


def placed_key(path: Path, model: str | None, cache_id: str | None) -> tuple[str, str] | None:
    """``(model, cache_id)`` (what a file's header names) if an entry of that
    key lives at the file's own place (``<model>/<id>.safetensors``, hashed
    names included); else None."""
    if model is None or cache_id is None:
        return None
    try:
        place = Path(entry_relpath(model, cache_id))
    except ValueError:
        return None
    return (model, cache_id) if place == Path(path.parent.name, path.name) else None


def entry_place_key(path: Path) -> tuple[str | None, str | None] | None:
    """None unless ``path`` ends in names the daemon gives an entry's file
    (``<model>/<id>.safetensors``, hashed or not), whatever it holds; else
    the (model, cache id) those names stand for, None for a hashed one."""
    if not path.name.endswith(SUFFIX):
        return None
    parts = (path.parent.name, path.name.removesuffix(SUFFIX))
    decoded = tuple(decode_component(c) for c in parts)
    if any(d is None and not _HASHED.fullmatch(c) for c, d in zip(parts, decoded, strict=True)):
        return None
    return decoded[0], decoded[1]


def is_entry_place(path: Path) -> bool:
    """Whether ``path`` ends in names the daemon gives an entry's file."""
    return entry_place_key(path) is not None


def key_of(path: Path) -> tuple[str | None, str | None]:
    """(model, cache id) an entry's file name stands for; None where a name is
    hashed or foreign (the file's metadata still has the id)."""
    return decode_component(path.parent.name), decode_component(path.name.removesuffix(SUFFIX))
