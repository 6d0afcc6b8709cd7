"""What kvkeeper knows of the cache classes of mlx-lm and mlx-vlm.

The codec (``kvkeeper.client.codec``) walks any cache generically; the
knowledge of particular classes lives here, on both sides of a save:

* finding a class again by name on restore (``resolve_cache_class``: only
  inside ``mlx_lm.models.`` and ``mlx_vlm.models.``, and in
  ``mlx_vlm.turboquant`` only the class kvkeeper builds; nothing is ever
  pickled or evaluated) and rebuilding a layer with the protocol its class
  speaks (``rebuild_layer``, ``rebuild_composite``), with the mends some
  classes' setters need;
* reading a layer's state for a save (``layer_class``): which rows are spare
  capacity to leave out (``Prefix``), which classes lose a counter their
  setter cannot tell (saved as attributes), which are refused while a batched
  prefill is pending, and the two classes kvkeeper saves field by field and
  builds itself (``BUILDERS``);
* the entries an older kvkeeper wrote that cannot restore exactly
  (``LOSSY_OLD_ENTRIES``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvkeeper.settings import physical_memory

__all__ = [
    "BUILDERS",
    "BUILT_ONLY_MODULES",
    "LOSSY_OLD_ENTRIES",
    "MISSING",
    "TRUSTED_MODULE_PREFIXES",
    "CodecError",
    "OverMemory",
    "Prefix",
    "is_composite_class",
    "layer_class",
    "rebuild_composite",
    "rebuild_layer",
    "resolve_cache_class",
]


class CodecError(ValueError):
    """A cache, a layers description or a set of arrays cannot be encoded or decoded.

    A ValueError: to ``save()`` a cache it cannot describe is a bad argument."""


class OverMemory(CodecError):
    """Rebuilding a layer would make more bytes than this machine's memory:
    a count a file's padding comes from (a StaticPrefixKVCache's max_size)
    is damaged, or the file is another machine's."""


#: Cache classes are only ever imported from modules under these prefixes.
TRUSTED_MODULE_PREFIXES = ("mlx_lm.models.", "mlx_vlm.models.")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
#: Modules outside those packages from which only the classes kvkeeper builds
#: itself (``BUILDERS``) are taken.
BUILT_ONLY_MODULES = frozenset({"mlx_vlm.turboquant"})
_MODULE_RE = re.compile(rf"(?:mlx_lm|mlx_vlm)\.models(?:\.{_IDENT})+|mlx_vlm\.turboquant")
_CLASS_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

# ---------------------------------------------------------------------------
# class resolution (shared with the legacy decoders)


def _check_trusted_module(module: object) -> str:
    if not isinstance(module, str) or not _MODULE_RE.fullmatch(module):
        raise CodecError(
            f"cache class module {module!r} is not inside {' or '.join(TRUSTED_MODULE_PREFIXES)}"
            f" (or {', '.join(sorted(BUILT_ONLY_MODULES))})"
        )
    return module


def _looks_like_cache_class(cls: object) -> bool:
    """A class defined in the trusted packages that can be rebuilt from a state.

    Needs ``from_state`` or a settable ``state`` property (nn.Module, which
    has a read-only ``state``, and plain helpers do not qualify), or to be
    one kvkeeper builds itself (``BUILDERS``), the only kind taken from
    ``BUILT_ONLY_MODULES``.
    """
    module = getattr(cls, "__module__", None)
    if not isinstance(cls, type) or not isinstance(module, str):
        return False
    if module in BUILT_ONLY_MODULES:
        return (module, cls.__qualname__) in BUILDERS
    if not module.startswith(TRUSTED_MODULE_PREFIXES):
        return False
    try:
        state = inspect.getattr_static(cls, "state")
    except AttributeError:
        return False
    settable = isinstance(state, property) and state.fset is not None
    return (settable or callable(getattr(cls, "from_state", None))
            or (cls.__module__, cls.__qualname__) in BUILDERS)


def resolve_cache_class(module: str, name: str) -> type:
    """Import `module` (only under mlx_lm.models. / mlx_vlm.models., or one of
    ``BUILT_ONLY_MODULES``) and return its cache class `name`.

    Raises CodecError for a module outside those (checked before any import),
    a name that is not a plain public identifier, or an attribute that is not
    a cache class (see ``_looks_like_cache_class``).
    Classes found are remembered (a load resolves one per layer); refusals are not.
    """
    if type(module) is str and type(name) is str:
        found = _RESOLVED.get((module, name))
        if found is not None:
            return found
    _check_trusted_module(module)
    if not isinstance(name, str) or not _CLASS_RE.fullmatch(name):
        raise CodecError(f"bad cache class name {name!r}")
    found = _resolve_checked(module, name)
    _RESOLVED[(module, name)] = found
    return found


# Classes already found, by (module, name): one dict lookup per layer of a load
# instead of two regular expressions and a cache lookup (48 us of a 32-layer
# lazy load). Only real classes get in, so it stays as small as the packages.
_RESOLVED: dict[tuple[str, str], type] = {}


def _resolve_checked(module: str, name: str) -> type:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # an import error of any kind means "not restorable"
        raise CodecError(f"cannot import cache module {module!r}: {exc}") from exc
    cls = getattr(mod, name, None)
    if not _looks_like_cache_class(cls):
        raise CodecError(f"{module}.{name} is not a cache class")
    assert isinstance(cls, type)
    return cls


def is_composite_class(cls: type) -> bool:
    """True for caches made of other caches (CacheList in mlx-lm and mlx-vlm)."""
    return cls.__name__ == "CacheList"


@functools.lru_cache(maxsize=256)
def _from_state_arity(cls: type) -> int | None:
    """How many positional arguments `cls.from_state` takes (None: no from_state).
    Cached: inspect.signature was 40% of a lazy load's time, once per layer."""
    from_state = getattr(cls, "from_state", None)
    if not callable(from_state):
        return None
    try:
        params = inspect.signature(from_state).parameters.values()
    except (TypeError, ValueError):
        return 1
    n = 0
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return 2
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            n += 1
    return n


MISSING: Any = object()


def _is_empty(x: Any) -> bool:
    return x is None or (isinstance(x, (str, list, tuple, dict)) and len(x) == 0)


def rebuild_layer(cls: type, state: Any, meta_state: Any = MISSING, *,
                  where: str | None = None) -> Any:
    """Rebuild one cache layer with the protocol its class speaks.

    ``from_state(state, meta_state)`` (mlx-vlm, mlx-lm 0.31 and earlier) or
    ``from_state(state)`` (mlx-lm 0.32), chosen by the arity of the class's
    from_state; without a from_state, ``__new__`` plus the
    ``state``/``meta_state`` setters. Raises CodecError when the class
    refuses the state, its message starting with ``where`` if given.
    """
    try:
        mend, padding = _rebuild_fixes(cls)
        obj = _rebuild_layer(cls, state, meta_state)
        if mend is not None and meta_state is not MISSING:
            mend(obj, meta_state)
    except CodecError as exc:
        if where is None:
            raise
        # Of its own class: OverMemory is damage in a file with no checksums.
        raise type(exc)(f"{where}: {exc}") from exc.__cause__
    if padding is not None and not hasattr(obj, padding):
        setattr(obj, padding, None)  # none pending: a layer is saved only so
    return obj


_Mend = Callable[[Any, Any], None]


@functools.lru_cache(maxsize=256)
def _rebuild_fixes(cls: type) -> tuple[_Mend | None, str | None]:
    """(meta_state mend, pending-padding attribute to give a None) of ``cls``;
    raises CodecError for a class known not to be rebuildable. Cached: a
    load rebuilds one class again and again (refusals are not cached)."""
    key = (cls.__module__, cls.__name__)
    why = _UNREBUILDABLE.get(key)
    if why is not None:
        raise CodecError(f"{key[0]}.{key[1]}: kvkeeper cannot rebuild it: {why}")
    return _META_MENDS.get(key), _PENDING_PADDING.get(key)


def _mend_rotated(obj: Any, meta: Any) -> None:
    # mlx-lm 0.31's and mlx-vlm's setters take bool("False"): every restored
    # cache believed it had wrapped (mlx-vlm's then left its padding unmasked).
    if isinstance(meta, (list, tuple)) and len(meta) == 4 and meta[3] in ("True", "False"):
        obj.rotated = meta[3] == "True"


def _mend_static_prefix(obj: Any, meta: Any) -> None:
    # mlx-vlm's StaticPrefixKVCache (diffusion_gemma's static decoder) gives
    # its rows up to the offset as its state, and its setter takes those
    # rows as the whole fixed allocation. The decoder attends over
    # max_size rows with a mask max_size wide: restored short, the mask hid
    # the prompt's keys instead of the empty rows (logits differed, no
    # error). The empty rows come back as zeros, as the cache makes them.
    keys, values = obj.keys, obj.values
    if keys is None and values is None:
        return
    if not (type(keys) is mx.array and type(values) is mx.array and keys.ndim == values.ndim == 4
            and keys.shape[-2] == values.shape[-2] == obj.offset <= obj.max_size < 1 << 31):
        raise CodecError(f"a StaticPrefixKVCache's keys and values "
                         f"({getattr(keys, 'shape', keys)!r}, {getattr(values, 'shape', values)!r})"
                         f" are not offset {obj.offset!r} rows within max_size {obj.max_size!r}")
    if obj.max_size > obj.offset:
        # A lazy load checks no header checksum: a damaged max_size of 2**30
        # padded a few rows to 256 GiB of zeros, and evaluating them ended
        # the process (SIGSEGV).
        padding = (obj.max_size - obj.offset) * sum(
            a.shape[0] * a.shape[1] * a.shape[3] * a.itemsize for a in (keys, values))
        memory = physical_memory()
        if memory is not None and padding > memory:
            raise OverMemory(f"a StaticPrefixKVCache of max_size {obj.max_size} would add "
                             f"{padding} bytes of empty rows, more than this machine's "
                             f"memory ({memory})")
        rows_after = [(0, 0), (0, 0), (0, obj.max_size - obj.offset), (0, 0)]
        obj.keys, obj.values = mx.pad(keys, rows_after), mx.pad(values, rows_after)


#: Fixes for meta_state setters that restore a field wrongly.
_META_MENDS: dict[tuple[str, str], _Mend] = {
    ("mlx_lm.models.cache", "BatchRotatingKVCache"): _mend_rotated,
    ("mlx_vlm.models.cache", "BatchRotatingKVCache"): _mend_rotated,
    ("mlx_vlm.models.cache", "StaticPrefixKVCache"): _mend_static_prefix,
}


#: Classes that look rebuildable and are not: a save would be a file no
#: load can use. Why, and what to save instead.
_UNREBUILDABLE: dict[tuple[str, str], str] = {
    ("mlx_vlm.models.minimax_m3_vl.language", "MiniMaxM3BatchKVCache"):
        "its state setter needs the BatchKVCache its __init__ makes (save each "
        "sequence's MiniMaxM3KVCache, from extract(i), instead)",
}

#: Batch caches hold the right padding of a batched prefill (prompts of
#: different lengths) from prepare() to finalize() in this attribute, which
#: their state leaves out; rebuilt without __init__ they had no such
#: attribute at all, and finalize(), filter() (and mlx-vlm's rotating
#: make_mask()) raised AttributeError. save() refuses a layer with padding
#: pending; a rebuilt layer has none.
_PENDING_PADDING: dict[tuple[str, str], str] = {
    ("mlx_lm.models.cache", "BatchKVCache"): "_right_padding",
    ("mlx_lm.models.cache", "BatchRotatingKVCache"): "_lengths",
    ("mlx_vlm.models.cache", "BatchKVCache"): "_right_padding",
    ("mlx_vlm.models.cache", "BatchRotatingKVCache"): "_lengths",
    ("mlx_vlm.models.cache", "BatchQuantizedKVCache"): "_right_padding",
}

_IDLE_POOL_LENGTH = 2**31  # mlx-vlm's BatchPoolingCache: "no length pending"
_BATCH_ROWS = "left_padding or lengths"  # mlx-vlm's ArraysCache: kept for a batch's life

#: Batch caches that keep what a batched prefill pends elsewhere, and
#: rebuild without it (no error): (where, is it pending). Refused by save()
#: in between.
_PENDING_ELSEWHERE: dict[tuple[str, str], tuple[str, Callable[[Any], bool]]] = {
    ("mlx_vlm.models.qwen4_exp.language", "BatchQSAKVCache"): (
        "kv_cache._right_padding",
        lambda layer: getattr(getattr(layer, "kv_cache", None), "_right_padding", None)
        is not None),
    ("mlx_vlm.models.cache", "BatchPoolingCache"): (
        "_lengths",
        # int(): prepare() given lengths as an array makes them array scalars.
        lambda layer: any(int(n) != _IDLE_POOL_LENGTH for n in getattr(layer, "_lengths", ()))),
    # mlx-vlm's ArraysCache (unlike mlx-lm's) keeps a batch's left padding and
    # lengths out of its state: restored, its masks were gone (no error).
    ("mlx_vlm.models.cache", "ArraysCache"): (
        _BATCH_ROWS,
        lambda layer: getattr(layer, "_left_padding", None) is not None
        or getattr(layer, "_lengths", None) is not None),
}


def _pending_check(key: tuple[str, str]) -> tuple[str, Callable[[Any], bool]] | None:
    attr = _PENDING_PADDING.get(key)
    if attr is not None:
        return attr, lambda layer: getattr(layer, attr, None) is not None
    return _PENDING_ELSEWHERE.get(key)


def _rebuild_layer(cls: type, state: Any, meta_state: Any) -> Any:
    has_meta = meta_state is not MISSING
    try:
        arity = _from_state_arity(cls)
        if arity is not None and arity >= 2:
            try:
                return cls.from_state(state, meta_state if has_meta else None)  # type: ignore[attr-defined]
            except Exception as first:
                if not has_meta:
                    raise
                # Some mlx-vlm state setters read fields only meta_state sets
                # (BufferedRotatingKVCache uses offset): try the other order.
                try:
                    obj = cls.__new__(cls)  # type: ignore[call-overload]  # mypy takes cls for a metaclass
                    obj.meta_state = meta_state
                    obj.state = state
                    obj.meta_state = meta_state
                    return obj
                except Exception:
                    raise first from None
        if arity is None:
            obj = cls.__new__(cls)  # type: ignore[call-overload]  # mypy takes cls for a metaclass
            obj.state = state
        else:
            obj = cls.from_state(state)  # type: ignore[attr-defined]
        if has_meta:
            if hasattr(cls, "meta_state"):
                obj.meta_state = meta_state
            elif not _is_empty(meta_state):
                # e.g. gezel's writer stored {} for mlx-lm caches: nothing to set.
                raise CodecError(
                    f"{cls.__module__}.{cls.__name__} has no meta_state, got {meta_state!r}"
                )
    except CodecError:
        raise
    except Exception as exc:  # the class's own validation, whatever it raises
        raise CodecError(f"{cls.__module__}.{cls.__name__} rejected its state: {exc!r}") from exc
    return obj


def rebuild_composite(cls: type, children: Sequence[Any], children_type: type = tuple) -> Any:
    """Rebuild a CacheList-like cache from already rebuilt children.

    Done here rather than through the class's from_state because both
    packages' CacheList resolve child class names through their module's
    globals(), which cannot reach model-specific caches and trusts the file.
    """
    if not is_composite_class(cls):
        raise CodecError(f"{cls.__module__}.{cls.__name__} is not a composite cache")
    obj = cls.__new__(cls)  # type: ignore[call-overload]  # mypy takes cls for a metaclass
    obj.caches = children_type(children)
    return obj


# ---------------------------------------------------------------------------
# reading a layer's state for a save


class Prefix:
    """A state leaf to save only partly: the first `length` rows of axis -2."""

    __slots__ = ("array", "length")

    def __init__(self, array: mx.array, length: int) -> None:
        self.array = array
        self.length = length


def _seq_len(x: Any) -> int | None:
    """Rows on axis -2 of an array, or of a tuple or list of arrays that agree
    (mlx-lm's quantized keys: a tuple when built by QuantizedKVCache, the
    list mx.quantize returns when KVCache.to_quantized made them); else None."""
    if type(x) is mx.array:
        shape = x.shape
        return shape[-2] if len(shape) >= 2 else None
    if (type(x) is tuple or type(x) is list) and x:
        lens = {_seq_len(p) if type(p) is mx.array else None for p in x}
        return lens.pop() if len(lens) == 1 else None
    return None


def _cut(parts: tuple[Any, ...], valid: Any) -> tuple[Any, ...] | None:
    """`parts` (arrays, or tuples or lists of arrays) cut to `valid` rows of
    axis -2, or None if that does not apply."""
    if type(valid) is not int or valid < 0:
        return None
    cap = _seq_len(parts[0])
    if cap is None or valid >= cap:
        return None
    out = []
    for p in parts:
        if _seq_len(p) != cap:
            return None
        out.append(Prefix(p, valid) if type(p) is mx.array
                   else type(p)([Prefix(a, valid) for a in p]))
    return tuple(out)


def _trim_kv(state: Any) -> Any:
    # mlx-lm KVCache: (keys, values, offset); rows past offset are spare capacity.
    if isinstance(state, tuple) and len(state) == 3:
        cut = _cut(state[:2], state[2])
        if cut is not None:
            return (*cut, state[2])
    return state


def _trim_quantized(state: Any) -> Any:
    # mlx-lm QuantizedKVCache: ((wq, scales, biases), (...), offset, group_size, bits).
    if isinstance(state, tuple) and len(state) == 5:
        cut = _cut(state[:2], state[2])
        if cut is not None:
            return (*cut, *state[2:])
    return state


def _trim_chunked(state: Any) -> Any:
    # mlx-lm ChunkedKVCache: (keys, values, offset, chunk_size, start_position);
    # the buffer holds tokens start_position..offset at rows 0..offset-start.
    if isinstance(state, tuple) and len(state) == 5:
        off, start = state[2], state[4]
        if type(off) is int and type(start) is int:
            cut = _cut(state[:2], off - start)
            if cut is not None:
                return (*cut, *state[2:])
    return state


def _trim_rotating(state: Any) -> Any:
    # mlx-lm RotatingKVCache: (keys, values, offset, keep, max_size, _idx). Before
    # it wraps, rows offset.. are spare capacity (grown 256 at a time); once the
    # write index and offset part ways every row may be live, so keep it all.
    if isinstance(state, tuple) and len(state) == 6 and state[2] == state[5]:
        cut = _cut(state[:2], state[2])
        if cut is not None:
            return (*cut, *state[2:])
    return state


# Only classes whose state layout is known exactly; anything else (subclasses
# included) is saved as its state says.
_TRIMMERS: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("mlx_lm.models.cache", "KVCache"): _trim_kv,
    ("mlx_lm.models.cache", "QuantizedKVCache"): _trim_quantized,
    ("mlx_lm.models.cache", "ChunkedKVCache"): _trim_chunked,
    ("mlx_lm.models.cache", "RotatingKVCache"): _trim_rotating,
}

#: What a layer's state reader gives: the state to save, and the attributes
#: (name -> int) restore sets on the rebuilt layer, or None.
_Read = tuple[Any, "dict[str, int] | None"]


def _read_chunked_with_meta(layer: Any) -> _Read:
    # mlx-vlm's ChunkedKVCache keeps tokens start_position..offset at rows
    # 0..offset-start_position, but its state setter takes the offset from the
    # rows it is given and meta_state holds only (chunk_size, start_position):
    # once the front is trimmed, a restore put the offset back at the row count
    # (wrong positions, then a failed broadcast). Save the live rows, and the
    # offset as an attribute.
    keys, values, offset, start = layer.keys, layer.values, layer.offset, layer.start_position
    if (type(keys) is not mx.array or type(values) is not mx.array
            or type(offset) is not int or type(start) is not int):
        return layer.state, None
    cut = _cut((keys, values), offset - start)
    # Before any trim the row count is the offset: no attrs, a version 1 entry.
    return (cut if cut is not None else (keys, values)), ({"offset": offset} if start else None)


def _read_old_lm_chunked(layer: Any) -> _Read:
    # mlx-lm 0.31's ChunkedKVCache trims its front by the size of its buffer,
    # spare rows included, not by the tokens it holds: restored without those
    # rows it trimmed at other steps than the original (other logits, no
    # error). Save the whole buffer, and the offset its setter cannot tell.
    keys, values, offset = layer.keys, layer.values, layer.offset
    if type(keys) is not mx.array or type(values) is not mx.array or type(offset) is not int:
        return layer.state, None
    return (keys, values), (None if keys.shape[-2] == offset else {"offset": offset})


def _read_lm_concatenate(layer: Any) -> _Read:
    # mlx-lm's ConcatenateKVCache trims only its offset and keeps the rows (its
    # next update appends after them); its setter takes the offset from the
    # rows, so a trimmed one came back untrimmed. Record the offset.
    keys, offset = layer.keys, layer.offset
    if keys is None:
        # Saved, it was a file no load could use.
        raise CodecError("an empty mlx-lm ConcatenateKVCache cannot be rebuilt (mlx-lm's "
                         "state setter needs its keys): save it after its first update")
    if type(keys) is not mx.array or type(offset) is not int or keys.shape[-2] == offset:
        return layer.state, None
    return layer.state, {"offset": offset}


def _read_vlm_buffered_rotating(layer: Any) -> _Read:
    # mlx-vlm BufferedRotatingKVCache with keep > 0 runs RotatingKVCache's ring,
    # whose live rows lie past _idx once it wraps; its own state keeps rows
    # up to _idx only. Save what RotatingKVCache saves (meta_state restores _idx).
    if not layer.keep:
        return layer.state, None
    return super(type(layer), layer).state, None


# mlx-lm 0.32's DeepSeek V4.1 LayerCache: its state leaves out the window size
# and cannot be set, and it has no from_state (mlx-lm's own load_prompt_cache
# cannot rebuild it). kvkeeper saves its fields by name and builds it itself,
# only while they are exactly these: a field added by a later mlx-lm would
# otherwise be lost without a word.
_DSV41_ARRAYS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")
_DSV41_FIELDS = ("window_size", "offset", *_DSV41_ARRAYS)
_DSV41_NAMES = frozenset(_DSV41_FIELDS)


def _known_fields(obj: Any, fields: frozenset[str]) -> dict[str, Any]:
    have = getattr(obj, "__dict__", None)
    if type(have) is not dict or have.keys() != fields:
        names = sorted(have) if isinstance(have, dict) else None
        package = type(obj).__module__.partition(".")[0].replace("_", "-")
        raise CodecError(f"{type(obj).__qualname__} has the fields {names}, kvkeeper knows "
                         f"{sorted(fields)} (another {package} version?)")
    return have


def _read_deepseek_v41(layer: Any) -> _Read:
    fields = _known_fields(layer, _DSV41_NAMES)
    size, offset = fields["window_size"], fields["offset"]
    if type(size) is not int or type(offset) is not int:
        raise CodecError(f"window_size {size!r} and offset {offset!r} are not both int")
    return {name: fields[name] for name in _DSV41_FIELDS}, None


def _build_deepseek_v41(cls: type, state: Any) -> Any:
    _check_deepseek_v41(state)
    obj = cls(state["window_size"])
    _known_fields(obj, _DSV41_NAMES)  # this mlx-lm's LayerCache is the one described
    for name in _DSV41_FIELDS[1:]:
        setattr(obj, name, state[name])
    return obj


def _check_deepseek_v41(state: Any) -> None:
    """Refuse a LayerCache state that breaks what the class's own code keeps
    true (broken, it shows later as NaN or a failed reshape). Only those: a
    pipeline stage's first layer also holds fields of earlier layers."""
    if type(state) is not dict or state.keys() != _DSV41_NAMES:
        raise CodecError(f"a LayerCache state holds {list(_DSV41_FIELDS)}")
    size, offset = state["window_size"], state["offset"]
    if (type(size) is not int or type(offset) is not int
            or not (0 < size < 1 << 31 and 0 <= offset < 1 << 31)):
        raise CodecError(f"window_size {size!r} or offset {offset!r} is out of range")
    arrays = {name: state[name] for name in _DSV41_ARRAYS if state[name] is not None}
    for name, a in arrays.items():
        if type(a) is not mx.array or a.ndim != 3 or not mx.issubdtype(a.dtype, mx.floating):
            raise CodecError(f"{name} is not a 3-dimensional float array or null")
    if len({a.shape[0] for a in arrays.values()}) > 1:
        raise CodecError("the arrays disagree on the batch size")
    # window, compress_kv and the open group hold rows of one head dimension.
    if len({a.shape[2] for name, a in arrays.items() if name != "index_k"}) > 1:
        raise CodecError("the arrays disagree on the head dimension")
    kv, gate = state["pending_kv"], state["pending_gate"]
    if (kv is None) != (gate is None) or (kv is not None and kv.shape != gate.shape):
        raise CodecError("pending_kv and pending_gate disagree")
    # The model takes the window's row count for the tokens it holds before
    # the offset: the two must agree, as update_window keeps them.
    rows = 0 if state["window"] is None else state["window"].shape[1]
    if rows != min(offset, size):
        raise CodecError(f"a window of {rows} rows for offset {offset} and window_size {size}")


# mlx-vlm's TurboQuantKVCache (kv_bits=3.5, or kv_quant_scheme="turboquant"):
# its from_state skips __init__, leaving no codecs (AttributeError at the next
# update), and it lives outside mlx_vlm.models. It has a persistence contract
# of its own, prefix_cache_snapshot / prefix_cache_restore (mlx-vlm's prefix
# cache uses it): the packed rows cut to the offset, the scalars as strings,
# and each codec as (dim, low channels, high channels), which rebuilds a
# fractional (split) codec's channel choice too. kvkeeper saves that and
# hands it back, and checks what it builds.
_TQ_FIELDS = frozenset({"bits", "key_bits", "value_bits", "seed", "offset", "keys", "values",
                        "key_codec", "value_codec", "_cached_state", "_cached_state_offset",
                        "_shadow_keys", "_shadow_values"})
_TQ_SNAPSHOT = frozenset({"meta_state", "keys", "values", "key_codec", "value_codec"})
_TQ_MAX_BITS = 8  # a codebook of more takes seconds to minutes to make


def _read_turboquant(layer: Any) -> _Read:
    fields = _known_fields(layer, _TQ_FIELDS)
    if fields["_shadow_keys"] is not None or fields["_shadow_values"] is not None:
        raise CodecError("TurboQuantKVCache holds shadow keys, which kvkeeper does not save")
    bits = [fields[name] for name in ("bits", "key_bits", "value_bits")]
    if not all(type(b) in (int, float) and b <= _TQ_MAX_BITS for b in bits):
        raise CodecError(f"TurboQuantKVCache bits {bits}: kvkeeper saves at most "
                         f"{_TQ_MAX_BITS} bits")
    # What prefix_cache_snapshot returns (a test holds the two equal), made
    # from the memoized state: that method cuts the rows afresh each call,
    # 4 slices a layer (534 us of 32 layers against 33 us).
    keys, values = layer.state
    snapshot = {"meta_state": layer.meta_state, "keys": keys, "values": values,
                "key_codec": _tq_codec(fields["key_codec"]),
                "value_codec": _tq_codec(fields["value_codec"])}
    # What a load would refuse is refused now, while save() can say so.
    offset = _check_turboquant(snapshot)
    _check_sides(((keys, fields["key_codec"]), (values, fields["value_codec"])), offset)
    return snapshot, None


def _tq_codec(codec: Any) -> tuple[int, Any, Any] | None:
    """A codec as prefix_cache_snapshot gives it: (dim, low channels, high
    channels), the channels None but for a split codec."""
    if codec is None:
        return None
    name = type(codec).__name__
    if name == "_SplitCodec":
        return codec.dim, codec.low_idx, codec.high_idx
    if name == "_TurboQuantMSECodec":
        return codec.dim, None, None
    raise CodecError(f"TurboQuantKVCache with a {name}, which kvkeeper does not know")


def _build_turboquant(cls: type, state: Any) -> Any:
    offset = _check_turboquant(state)
    obj = cls.__new__(cls)  # type: ignore[call-overload]  # mypy takes cls for a metaclass
    obj.prefix_cache_restore(state)
    _known_fields(obj, _TQ_FIELDS)  # this mlx-vlm's TurboQuantKVCache is the one described
    _check_sides(((obj.keys, obj.key_codec), (obj.values, obj.value_codec)), offset)
    return obj


def _check_turboquant(state: Any) -> int:
    """Refuse what prefix_cache_restore would take and the next update could
    not use (or would spend minutes on: a codebook of 16 bits), or would use
    to make garbage; return the offset. Run on save and on load alike."""
    if type(state) is not dict or state.keys() != _TQ_SNAPSHOT:
        raise CodecError(f"a TurboQuantKVCache state holds {sorted(_TQ_SNAPSHOT)}")
    meta = state["meta_state"]
    if type(meta) is not tuple or len(meta) != 5 or not all(type(m) is str for m in meta):
        raise CodecError(f"meta_state {meta!r} is not 5 strings")
    try:
        offset, seed, bits = int(meta[0]), int(meta[2]), [float(meta[i]) for i in (1, 3, 4)]
    except ValueError:
        raise CodecError(f"meta_state {meta!r} is not numbers") from None
    if not (0 <= offset < 1 << 31 and seed >= 0 and all(1 <= b <= _TQ_MAX_BITS for b in bits)):
        raise CodecError(f"meta_state {meta!r} is out of range")
    if (state["keys"] is None) != (state["values"] is None) or (
            state["keys"] is None and offset):
        raise CodecError(f"keys and values are both saved or neither, and neither only "
                         f"when empty (offset {offset})")
    for name, side_bits in (("key_codec", bits[1]), ("value_codec", bits[2])):
        codec = state[name]
        if codec is None:
            if state["keys"] is not None:
                raise CodecError(f"rows without a {name}")
            continue
        if type(codec) is not tuple or len(codec) != 3 or type(codec[0]) is not int \
                or not 0 < codec[0] <= 1 << 16:
            raise CodecError(f"{name} {codec!r} is not (dim, low, high)")
        dim, low, high = codec
        if low is None and high is None:
            if not side_bits.is_integer():
                raise CodecError(f"{name}: {side_bits} bits with a whole-bit codec")
            continue
        if side_bits.is_integer() or not all(
                type(x) is mx.array and x.ndim == 1 and x.dtype == mx.int32 for x in (low, high)):
            raise CodecError(f"{name}: {side_bits} bits with channels {low!r}, {high!r}")
        # Each channel once, in one half or the other.
        picked = np.sort(np.concatenate([np.array(low), np.array(high)]))
        if not np.array_equal(picked, np.arange(dim)):
            raise CodecError(f"{name}: its channels are not each of 0..{dim - 1} once")
    return offset


def _check_sides(sides: Sequence[tuple[Any, Any]], offset: int) -> None:
    """The packed rows of keys and values agree with the codecs that decode
    them, and with each other on batch and heads."""
    heads: set[tuple[int, ...]] = set()
    for part, codec in sides:
        if part is not None:
            _check_packed(part, codec, offset, heads)
    if len(heads) > 1:
        raise CodecError(f"the packed rows disagree on batch and heads: {sorted(heads)}")


def _check_packed(part: Any, codec: Any, offset: int, heads: set[tuple[int, ...]]) -> None:
    low, high = getattr(codec, "low_codec", None), getattr(codec, "high_codec", None)
    if low is not None and high is not None:  # a split codec: one state per half
        _check_packed(part.low, low, offset, heads)
        _check_packed(part.high, high, offset, heads)
        return
    norms, indices = part.norms, part.indices
    if (type(norms) is not mx.array or type(indices) is not mx.array or norms.ndim != 3
            or indices.ndim != 4 or indices.dtype != mx.uint32
            or not mx.issubdtype(norms.dtype, mx.floating)):
        raise CodecError("the packed rows are not 3-dimensional float norms and 4-dimensional "
                         "uint32 indices")
    words = (codec.dim * codec.bits + 31) // 32
    if indices.shape != (*norms.shape, words) or norms.shape[2] != offset:
        raise CodecError(f"norms {norms.shape} and indices {indices.shape} for offset {offset}, "
                         f"a codec of {codec.bits} bits on {codec.dim} channels")
    heads.add(norms.shape[:2])


_READERS: dict[tuple[str, str], Callable[[Any], _Read]] = {
    ("mlx_lm.models.cache", "ConcatenateKVCache"): _read_lm_concatenate,
    ("mlx_vlm.models.cache", "ChunkedKVCache"): _read_chunked_with_meta,
    ("mlx_vlm.models.cache", "BufferedRotatingKVCache"): _read_vlm_buffered_rotating,
    ("mlx_lm.models.deepseek_v41", "LayerCache"): _read_deepseek_v41,
    ("mlx_vlm.turboquant", "TurboQuantKVCache"): _read_turboquant,
}

#: The readers of mlx-lm 0.31's classes (``meta_state`` and states cut to the offset).
_OLD_LM_READERS: dict[str, Callable[[Any], _Read]] = {
    "ChunkedKVCache": _read_old_lm_chunked,
    "ConcatenateKVCache": _read_lm_concatenate,
}

#: Classes kvkeeper rebuilds itself from their saved fields: (class, state)
#: -> layer, raising CodecError (or whatever the class raises) for a state it
#: cannot build. Each also has a reader above.
BUILDERS: dict[tuple[str, str], Callable[[type, Any], Any]] = {
    ("mlx_lm.models.deepseek_v41", "LayerCache"): _build_deepseek_v41,
    ("mlx_vlm.turboquant", "TurboQuantKVCache"): _build_turboquant,
}


# Entries kvkeeper 0.2.0 wrote that restore wrong, and that no later writer
# makes (0.2.1 records the offset of a front-trimmed mlx-vlm ChunkedKVCache,
# and saves the whole ring of a wrapped BufferedRotatingKVCache with keep >
# 0): each reason, or None for an entry that restores as saved. A wrong cache
# must never reach the model, so such an entry is refused.
def _lossy_vlm_chunked(state: Any, meta: Any, entry: dict[str, Any]) -> str | None:
    if "attrs" in entry or type(meta) is not tuple or len(meta) != 2:
        return None
    start = _int_or_none(meta[1])
    if not start:
        return None
    return (f"a ChunkedKVCache whose front was trimmed (start_position {start}), written by "
            f"kvkeeper 0.2.0, which did not record its offset: it cannot be restored exactly")


def _lossy_vlm_buffered(state: Any, meta: Any, entry: dict[str, Any]) -> str | None:
    if type(meta) is not tuple or len(meta) < 3 or type(state) is not tuple or not state:
        return None
    keep, max_size, offset = (_int_or_none(m) for m in meta[:3])
    keys = state[0]
    if not keep or max_size is None or offset is None or type(keys) is not mx.array:
        return None
    held, live = keys.shape[-2], min(offset, max_size)
    if held >= live:
        return None
    return (f"a BufferedRotatingKVCache (keep {keep}) whose ring had wrapped, written by "
            f"kvkeeper 0.2.0, which kept {held} of its {live} rows: it cannot be restored")


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


LOSSY_OLD_ENTRIES: dict[tuple[str, str], Callable[[Any, Any, dict[str, Any]], str | None]] = {
    ("mlx_vlm.models.cache", "ChunkedKVCache"): _lossy_vlm_chunked,
    ("mlx_vlm.models.cache", "BufferedRotatingKVCache"): _lossy_vlm_buffered,
}


def _read_state(layer: Any) -> _Read:
    return layer.state, None


def _trimmed_reader(trim: Callable[[Any], Any]) -> Callable[[Any], _Read]:
    return lambda layer: (trim(layer.state), None)


@functools.lru_cache(maxsize=256)
def layer_class(cls: type) -> tuple[str, str, Callable[[Any], _Read]]:
    """(module, name, state reader) of a cache class that restore can find
    again by name; raises CodecError otherwise. Cached: it runs once per layer
    per save."""
    module, name = cls.__module__, cls.__qualname__
    try:
        _check_trusted_module(module)
    except CodecError as exc:
        raise CodecError(f"{name}: {exc}") from None
    if getattr(sys.modules.get(module), name, None) is not cls:
        raise CodecError(f"{module}.{name} cannot be found again by name")
    if not _looks_like_cache_class(cls):
        # Restore refuses it: saved, it would be a file no load can use.
        raise CodecError(f"{module}.{name} has no from_state and no settable state: "
                         f"kvkeeper cannot rebuild it")
    _rebuild_fixes(cls)  # a class known not to rebuild is refused now
    if hasattr(cls, "meta_state") and module == "mlx_lm.models.cache":
        # mlx-lm 0.31 and earlier: states without counters, sliced to the
        # offset already; two classes' states lose their offset (readers above).
        read = _OLD_LM_READERS.get(name, _read_state)
    else:
        trim = _TRIMMERS.get((module, name))
        read = _READERS.get((module, name)) or (_trimmed_reader(trim) if trim else _read_state)
    pending = _pending_check((module, name))
    return module, name, read if pending is None else _no_padding_pending(read, *pending)


def _no_padding_pending(read: Callable[[Any], _Read], attr: str,
                        is_pending: Callable[[Any], bool]) -> Callable[[Any], _Read]:
    def checked(layer: Any) -> _Read:
        if is_pending(layer):
            if attr == _BATCH_ROWS:
                raise CodecError(f"{type(layer).__name__} holds a batch's {attr} outside its "
                                 f"state, which a restore would leave out: save the cache of "
                                 f"one sequence")
            raise CodecError(f"{type(layer).__name__} is between prepare() and finalize(): "
                             f"what it holds for the batched prefill ({attr}) is not part "
                             f"of its state (save it after finalize())")
        return read(layer)
    return checked


