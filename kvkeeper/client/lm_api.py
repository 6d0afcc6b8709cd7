"""Between mlx-lm's two cache APIs.

mlx-lm 0.31 and earlier (the newest Python 3.10 can install) give a layer as
``state`` (its arrays, sliced to the offset) plus ``meta_state`` (its counters
as strings) and rebuild it with ``from_state(state, meta_state)``. mlx-lm 0.32
dropped ``meta_state``: the counters travel inside ``state``, arrays keep their
spare capacity, and ``from_state(state)`` rebuilds. A layer saved under one
(a kvkeeper entry or an mlx-lm prompt-cache file) is rebuilt under the other
here, for the classes whose layout both versions are known to have; anything
else is a CodecError (unusable here, not damaged).
"""

from __future__ import annotations

from typing import Any

from kvkeeper.client.cache_classes import CodecError, rebuild_layer

__all__ = ["BadCounter", "rebuild_from_new", "rebuild_from_old"]


class BadCounter(CodecError):
    """A counter of an mlx-lm 0.32 state (an offset, a size) that is not an
    int (NaN, 200.5, None, a bool): mlx-lm 0.32 keeps it as it is, and a
    legacy file's own checks call it damage; turned into 0.31's strings it
    raised ValueError, or passed as int() made it."""


def _count(value: Any, where: str, name: str) -> int:
    # Only an int, as mlx-lm 0.32 keeps its counters: int() made 200.5, True
    # and "200" counters of 200, 1 and 200 here, where 0.32 kept them as
    # given and the file's own checks called them damage.
    if type(value) is not int:
        what = "a whole number" if name in ("group_size", "bits") else "a token count"
        raise BadCounter(f"{where}: {name} {value!r} is not {what}")
    return value

_KV_LIKE = ("KVCache", "ConcatenateKVCache", "RotatingKVCache", "QuantizedKVCache",
            "ChunkedKVCache")


def rebuild_from_new(cls: type, state: Any, where: str) -> Any:
    """An mlx-lm layer of class ``cls`` saved as mlx-lm 0.32 gives it."""
    if not hasattr(cls, "meta_state"):
        return rebuild_layer(cls, state, where=where)
    try:
        old, meta, attrs = _old_state(cls.__name__, state, where)
    except CodecError:
        raise  # says where and what already
    except (AttributeError, IndexError, TypeError, ValueError) as exc:
        raise CodecError(f"{where}: malformed {cls.__name__} state: {exc}") from None
    obj = rebuild_layer(cls, old, meta, where=where)
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


def rebuild_from_old(cls: type, state: Any, meta: Any, where: str) -> Any:
    """An mlx-lm layer of class ``cls`` saved as mlx-lm 0.31 gives it."""
    if hasattr(cls, "meta_state"):
        return rebuild_layer(cls, state, meta, where=where)
    try:
        new = _new_state(cls.__name__, state, meta, where)
    except (AttributeError, IndexError, TypeError) as exc:
        raise CodecError(f"{where}: malformed {cls.__name__} state: {exc}") from None
    return rebuild_layer(cls, new, where=where)


def _old_state(name: str, state: Any, where: str) -> tuple[Any, Any, dict[str, Any]]:
    """An mlx-lm 0.32 state as mlx-lm 0.31 takes it: (state, meta_state, and
    the attributes its setters do not set)."""
    if not isinstance(state, (list, tuple)):
        raise CodecError(f"{where}: malformed {name} state")
    if name == "KVCache":
        keys, values, offset = state
        # 0.32 keeps the spare capacity; 0.31's setter takes the offset from the rows.
        return (keys, values), "", {"offset": _count(offset, where, "offset")}
    if name == "ConcatenateKVCache":
        return tuple(state), "", {}
    if name == "RotatingKVCache":
        keys, values, offset, keep, max_size, idx = state
        counters = {"keep": keep, "max_size": max_size, "offset": offset, "_idx": idx}
        return (keys, values), [str(_count(x, where, n)) for n, x in counters.items()], {}
    if name == "QuantizedKVCache":
        keys, values, offset, group_size, bits = state
        counters = {"offset": offset, "group_size": group_size, "bits": bits}
        return ((tuple(keys), tuple(values)),
                [str(_count(x, where, n)) for n, x in counters.items()], {})
    if name == "ChunkedKVCache":
        keys, values, offset, chunk_size, start = state
        return ((keys, values),
                [str(_count(chunk_size, where, "chunk_size")),
                 str(_count(start, where, "start_position"))],
                {"offset": _count(offset, where, "offset")})
    if name == "ArraysCache":
        cache, left_padding, lengths = state
        return list(cache), "", {"left_padding": left_padding, "lengths": lengths}
    raise CodecError(f"{where}: a {name} saved by mlx-lm 0.32 or later cannot be rebuilt by "
                     "this mlx-lm")


def _int_fields(meta: Any, n: int, where: str) -> list[int]:
    if not (isinstance(meta, (list, tuple)) and len(meta) == n):
        raise CodecError(f"{where}: meta_state {meta!r} is not {n} numbers")
    try:
        return [int(x) for x in meta]
    except (TypeError, ValueError):
        raise CodecError(f"{where}: meta_state {meta!r} is not {n} numbers") from None


def _new_state(name: str, state: Any, meta: Any, where: str) -> Any:
    """The mlx-lm 0.32 state of an mlx-lm 0.31 layer (state, meta_state)."""
    if not isinstance(state, (list, tuple)):
        raise CodecError(f"{where}: malformed {name} state")
    if name == "ArraysCache":
        return list(state), None, None  # a slot never written is None
    if any(s is None for s in state):
        raise CodecError(f"{where}: malformed {name} state")
    if name in _KV_LIKE and len(state) != 2:
        raise CodecError(f"{where}: {name} state is not (keys, values)")
    if name == "KVCache":
        keys, values = state
        if values.shape[-1] == 0 < keys.shape[-1]:
            # Loaded, it failed at the model's first step (a concatenate of
            # mismatched shapes): a miss instead, and a fresh prefill.
            raise CodecError(f"{where}: a KVCache whose values are 0 wide is DeepSeek V3.2's "
                             "indexer (GLM's DSA models use it too) as mlx-lm 0.31 and "
                             "earlier keep it; mlx-lm 0.32 "
                             "changed that indexer (it keeps the keys as values, and "
                             "computes it otherwise) and cannot use it")
        return keys, values, keys.shape[-2]
    if name == "ConcatenateKVCache":
        return tuple(state)
    if name == "RotatingKVCache":
        keep, max_size, offset, idx = _int_fields(meta, 4, where)
        return state[0], state[1], offset, keep, max_size, idx
    if name == "QuantizedKVCache":
        offset, group_size, bits = _int_fields(meta, 3, where)
        return tuple(state[0]), tuple(state[1]), offset, group_size, bits
    if name == "ChunkedKVCache":
        chunk_size, start = _int_fields(meta, 2, where)
        return state[0], state[1], state[0].shape[-2], chunk_size, start
    raise CodecError(f"{where}: a {name} saved by mlx-lm 0.31 or earlier cannot be "
                     "rebuilt by this mlx-lm")
