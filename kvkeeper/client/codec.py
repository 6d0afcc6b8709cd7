"""MLX prompt-cache layers <-> tensors plus a JSON description of the layers.

`capture_cache` runs inside the generation loop, so it must cost close to
nothing: it leaves the JSON and the byte runs to `encode_capture`, which the
client runs on its I/O thread, and it copies no tensor data, but of a cache of
at most ``CAPTURE_COPY_MAX_BYTES`` (see there), which it copies whole with
``mx.array``. Each tensor is exported as a few contiguous byte runs that point
straight into MLX's own buffers (the cache's, or that copy's). Two facts make
sharing the cache's buffers safe:

* MLX updates a cache buffer in place (``keys[..., a:b, :] = x``) only when no
  other array shares that buffer. A memoryview does not count as sharing; a
  second array handle does. So for every exported tensor the capture takes a
  new handle on the same buffer (``array.__copy__``, which shares the array
  rather than its data, in about 50 ns), and the runs keep that handle alive.
  The cache's next in-place update then finds the buffer shared and writes
  into a copy instead; the snapshot keeps seeing the old bytes.
* Non-contiguous views (``keys[..., :offset, :]``) are not copied either: the
  strided layout is turned into one run per contiguous block.

The layout of the JSON string (``layers``), format version 3 (each
description is written with the lowest version its layers need: 1 without
"attrs" or built layers, 2 with "attrs", 3 with a built layer; older
readers take the lower ones)::

    {"format": "kvkeeper.layers", "version": 1 | 2 | 3, "layers": [LAYER, ...]}

    LAYER = {"class": "KVCache", "module": "mlx_lm.models.cache",
             "state": NODE,                  # what from_state gets back
             "meta_state": NODE,             # only for classes that have one
             "attrs": {"offset": int}}       # set after from_state (version 2)
          | {"class": "CacheList", "module": "...",
             "children": [LAYER, ...], "children_type": "tuple" | "list"}
          | {"class": "LayerCache", "module": "mlx_lm.models.deepseek_v41",
             "state": {"$": "dict", "items": [["window_size", int], ...]}}
                                             # its fields by name (version 3)
          | {"class": "TurboQuantKVCache", "module": "mlx_vlm.turboquant",
             "state": {"$": "dict", "items": [["meta_state", ...], ["keys", ...],
                       ["values", ...], ["key_codec", ...], ["value_codec", ...]]}}
                                 # its prefix_cache_snapshot (version 3)

    NODE  = null | true | false | int | float | str
          | [NODE, ...]                                   # a list
          | {"$": "tuple", "items": [NODE, ...]}
          | {"$": "dict", "items": [[NODE, NODE], ...]}
          | {"$": "float", "value": "nan" | "inf" | "-inf"}
          | {"$": "tensor", "name": "t0", "dtype": "BF16", "shape": [1, 8, 37, 128]}

Tensors are named ``t0``, ``t1``, ... in the order they are met (layers in
order; state before meta_state; children in order).

Two cache protocols are in use and both are detected by looking at the class:
mlx-lm 0.32 caches keep every scalar in ``state`` and rebuild with
``from_state(state)``; mlx-vlm 0.7 caches also have ``meta_state`` and rebuild
with ``from_state(state, meta_state)``.

Two classes that cannot be rebuilt either way are saved and built again by
kvkeeper itself (``_BUILDERS``), only while their fields are exactly the
ones kvkeeper knows: mlx-lm 0.32's DeepSeek V4.1 ``LayerCache`` field by
field (a read-only ``state`` that leaves out its window size, no
``from_state``), and mlx-vlm's ``TurboQuantKVCache`` through its own
``prefix_cache_snapshot`` / ``prefix_cache_restore`` (its ``from_state``
leaves it without codecs).

Classes are resolved on restore only inside ``mlx_lm.models.`` and
``mlx_vlm.models.``, and in ``mlx_vlm.turboquant`` only the class kvkeeper
builds: nothing is ever pickled or evaluated.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import mlx.core as mx
import msgspec
import numpy as np

from kvkeeper.client.rawbuffer import as_unsigned
from kvkeeper.protocol.dtypes import DTYPE_SIZES
from kvkeeper.protocol.pacing import CAPTURE_COPY_MAX_BYTES

__all__ = [
    "BUILT_ONLY_MODULES",
    "LAYERS_FORMAT",
    "LAYERS_VERSION",
    "MLX_UNREADABLE_DTYPES",
    "TRUSTED_MODULE_PREFIXES",
    "CacheCapture",
    "CacheSnapshot",
    "CodecError",
    "TensorSnapshot",
    "capture_cache",
    "check_cache",
    "encode_capture",
    "is_composite_class",
    "mlx_dtype",
    "mlx_dtype_name",
    "rebuild_composite",
    "rebuild_layer",
    "resolve_cache_class",
    "restore_cache",
    "snapshot_cache",
]

LAYERS_FORMAT = "kvkeeper.layers"
#: Bump when the JSON layout changes; restore refuses versions it does not know.
#: 2 adds a layer's "attrs" (set after it is rebuilt); 3 adds the layers
#: kvkeeper builds itself (``_BUILDERS``). Each description is written with the
#: lowest version its layers need, so older readers take every other file.
LAYERS_VERSION = 3
_ATTRS_VERSION = 2
_BUILT_VERSION = 3
#: The attributes a layer's "attrs" may set: plain non-negative integers.
_SETTABLE_ATTRS = frozenset({"offset"})
#: Cache classes are only ever imported from modules under these prefixes.
TRUSTED_MODULE_PREFIXES = ("mlx_lm.models.", "mlx_vlm.models.")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
#: Modules outside those packages from which only the classes kvkeeper builds
#: itself (``_BUILDERS``) are taken.
BUILT_ONLY_MODULES = frozenset({"mlx_vlm.turboquant"})
_MODULE_RE = re.compile(rf"(?:mlx_lm|mlx_vlm)\.models(?:\.{_IDENT})+|mlx_vlm\.turboquant")
_CLASS_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

# A layout that splits into many tiny blocks (say a transposed view) would make
# thousands of runs; past this point one compact copy is cheaper for everyone.
_MAX_RUNS = 1024
_MIN_AVG_RUN = 4096


class CodecError(ValueError):
    """A cache, a layers description or a set of arrays cannot be encoded or decoded.

    A ValueError: to ``save()`` a cache it cannot describe is a bad argument."""


@dataclass(frozen=True)
class TensorSnapshot:
    """One tensor of a snapshot, as zero-copy byte runs into MLX buffers.

    ``runs`` are 1-D, C-contiguous, format "B" memoryviews; joined in order
    they are the tensor's row-major bytes. They keep the MLX arrays they
    point into alive.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    runs: tuple[memoryview, ...]
    nbytes: int


@dataclass(frozen=True)
class CacheSnapshot:
    """A prompt cache frozen at `snapshot_cache` time: tensors plus the layers JSON."""

    tensors: tuple[TensorSnapshot, ...]
    layers: str
    nbytes: int


# ---------------------------------------------------------------------------
# dtypes

_DTYPES: dict[str, mx.Dtype] = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "F32": mx.float32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "F64": mx.float64,
    "C64": mx.complex64,
}
_DTYPE_NAMES: dict[mx.Dtype, str] = {v: k for k, v in _DTYPES.items()}
#: Dtypes MLX holds in memory but whose safetensors files ``mx.load`` refuses
#: ("unsupported dtype F64"): a save of one would be written, then never load.
MLX_UNREADABLE_DTYPES = frozenset({"F64"})
# What a save may hold. The unreadable ones are left out rather than tested
# for, so the lookup per tensor stays one dict.get on the generation loop.
_SAVABLE_NAMES: dict[mx.Dtype, str] = {
    v: k for k, v in _DTYPES.items() if k not in MLX_UNREADABLE_DTYPES
}
assert set(_DTYPES) <= set(DTYPE_SIZES)
assert all(_DTYPES[n].size == DTYPE_SIZES[n] for n in _DTYPES)

def mlx_dtype_name(dtype: mx.Dtype) -> str:
    """The safetensors name ("BF16", "F32", ...) of an MLX dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except (KeyError, TypeError):
        raise CodecError(f"unsupported MLX dtype {dtype!r}") from None


def mlx_dtype(name: str) -> mx.Dtype:
    """The MLX dtype of a safetensors dtype name ("BF16", "F32", ...)."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CodecError(f"unsupported dtype name {name!r}") from None


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
    one kvkeeper builds itself (``_BUILDERS``), the only kind taken from
    ``BUILT_ONLY_MODULES``.
    """
    module = getattr(cls, "__module__", None)
    if not isinstance(cls, type) or not isinstance(module, str):
        return False
    if module in BUILT_ONLY_MODULES:
        return (module, cls.__qualname__) in _BUILDERS
    if not module.startswith(TRUSTED_MODULE_PREFIXES):
        return False
    try:
        state = inspect.getattr_static(cls, "state")
    except AttributeError:
        return False
    settable = isinstance(state, property) and state.fset is not None
    return (settable or callable(getattr(cls, "from_state", None))
            or (cls.__module__, cls.__qualname__) in _BUILDERS)


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


_MISSING: Any = object()


def _is_empty(x: Any) -> bool:
    return x is None or (isinstance(x, (str, list, tuple, dict)) and len(x) == 0)


def rebuild_layer(cls: type, state: Any, meta_state: Any = _MISSING, *,
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
        if mend is not None and meta_state is not _MISSING:
            mend(obj, meta_state)
    except CodecError as exc:
        if where is None:
            raise
        raise CodecError(f"{where}: {exc}") from exc.__cause__
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
    has_meta = meta_state is not _MISSING
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
                    obj = cls.__new__(cls)
                    obj.meta_state = meta_state
                    obj.state = state
                    obj.meta_state = meta_state
                    return obj
                except Exception:
                    raise first from None
        if arity is None:
            obj = cls.__new__(cls)
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
    obj = cls.__new__(cls)
    obj.caches = children_type(children)
    return obj


# ---------------------------------------------------------------------------
# snapshot


class _Prefix:
    """A state leaf to save only partly: the first `length` rows of axis -2."""

    __slots__ = ("array", "length")

    def __init__(self, array: mx.array, length: int) -> None:
        self.array = array
        self.length = length


@dataclass(slots=True)
class _Pending:
    """One tensor met by the walk: its description as of capture time, the
    array it came from, and (after capture) the handle that pins its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: mx.array
    length: int | None
    handle: mx.array | None = None
    view: memoryview | None = None  # of `handle`, taken by encode_capture


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
        out.append(_Prefix(p, valid) if type(p) is mx.array
                   else type(p)([_Prefix(a, valid) for a in p]))
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
    obj = cls.__new__(cls)
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
_BUILDERS: dict[tuple[str, str], Callable[[type, Any], Any]] = {
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


_LOSSY_OLD_ENTRIES: dict[tuple[str, str], Callable[[Any, Any, dict[str, Any]], str | None]] = {
    ("mlx_vlm.models.cache", "ChunkedKVCache"): _lossy_vlm_chunked,
    ("mlx_vlm.models.cache", "BufferedRotatingKVCache"): _lossy_vlm_buffered,
}


def _read_state(layer: Any) -> _Read:
    return layer.state, None


def _trimmed_reader(trim: Callable[[Any], Any]) -> Callable[[Any], _Read]:
    return lambda layer: (trim(layer.state), None)


@functools.lru_cache(maxsize=256)
def _layer_class(cls: type) -> tuple[str, str, Callable[[Any], _Read]]:
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


class _NodeProblem(Exception):
    """A value that a cache state (saving) or the layers JSON (loading) must
    not hold. ``path`` grows as it unwinds, so the location costs nothing
    unless there is a problem."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.path: list[str] = []

    def located(self, where: str, part: str) -> CodecError:
        """The CodecError to raise, saying where the value is ("layer 3.state.1")."""
        return CodecError(f"{'.'.join([where, part, *reversed(self.path)])}: {self.problem}")


def _unsavable(dtype: mx.Dtype) -> NoReturn:
    """Raise the _NodeProblem for a tensor of ``dtype``, which a save cannot hold."""
    try:
        name = mlx_dtype_name(dtype)
    except CodecError as exc:
        raise _NodeProblem(str(exc)) from None
    raise _NodeProblem(f"{dtype} tensors cannot be saved: mx.load cannot read {name} "
                       f"safetensors files back (cast the cache to float32)")


def _each(fn: Callable[[Any], Any], values: Any) -> list[Any]:
    """``[fn(v) for v in values]``, adding the index to a _NodeProblem's path."""
    out: list[Any] = []
    try:
        for v in values:
            out.append(fn(v))
    except _NodeProblem as exc:
        exc.path.append(str(len(out)))
        raise
    return out


class _Encoder:
    """Walks cache layers into the JSON-ready description and the list of
    tensors to export. Runs on the caller's thread inside ``save()``, so the
    common shapes (tuples of arrays and ints) take the shortest path, and the
    location of a bad value is only worked out when there is one."""

    def __init__(self) -> None:
        self.pending: list[_Pending] = []
        self.version = 1  # raised by a layer that needs a newer reader

    def tensor(self, array: mx.array, length: int | None) -> dict[str, Any]:
        name = f"t{len(self.pending)}"
        dtype = _SAVABLE_NAMES.get(array.dtype) or _unsavable(array.dtype)
        shape = list(array.shape)
        if length is not None:
            shape[-2] = length
        self.pending.append(_Pending(name, dtype, tuple(shape), array, length))
        return {"$": "tensor", "name": name, "dtype": dtype, "shape": shape}

    def node(self, value: Any) -> Any:
        t = type(value)
        if t is mx.array:
            return self.tensor(value, None)
        if value is None or t is int or t is bool or t is str:
            return value
        if t is tuple:
            return {"$": "tuple", "items": _each(self.node, value)}
        if t is _Prefix:
            return self.tensor(value.array, value.length)
        if t is list:
            return _each(self.node, value)
        if t is dict:  # the states kvkeeper's own readers give
            return self.mapping(value)
        if t is float and math.isfinite(value):
            return value
        if isinstance(value, tuple):  # NamedTuples (TurboQuant's packed rows)
            return {"$": "tuple", "items": _each(self.node, value)}
        if isinstance(value, str):
            return str.__str__(value)  # a subclass as the plain str it holds
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {"$": "float", "value": repr(value)}
        if isinstance(value, mx.array):
            return self.tensor(value, None)
        if isinstance(value, list):
            return _each(self.node, value)
        if isinstance(value, dict):
            return self.mapping(value)
        raise _NodeProblem(f"cannot encode a {type(value).__qualname__} in a cache state")

    def mapping(self, value: dict[Any, Any]) -> dict[str, Any]:
        items = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise _NodeProblem(f"dict key {k!r} is not a scalar")
            try:
                items.append([k if type(k) is str else self.node(k), self.node(v)])
            except _NodeProblem as exc:
                exc.path.append(str(k))
                raise
        return {"$": "dict", "items": items}

    def layer(self, layer: Any, where: str) -> dict[str, Any]:
        if isinstance(layer, (list, tuple)):
            # The cache wrapped once more ([cache]) is the likely mistake.
            raise CodecError(f"{where} is a {type(layer).__name__}, not a cache layer (a "
                             f"KVCache, ...): the cache is a list of layers, not nested in "
                             f"another list")
        try:
            module, name, read = _layer_class(type(layer))
        except CodecError as exc:
            raise CodecError(f"{where}: {exc}") from None
        entry: dict[str, Any] = {"class": name, "module": module}

        children = getattr(layer, "caches", None)
        if isinstance(children, (list, tuple)) and is_composite_class(type(layer)):
            entry["children"] = [self.layer(c, f"{where}.{i}") for i, c in enumerate(children)]
            entry["children_type"] = "list" if isinstance(children, list) else "tuple"
            return entry

        built = (module, name) in _BUILDERS  # its reader's state says everything
        try:
            state, attrs = read(layer)
            meta = _MISSING if built else getattr(layer, "meta_state", _MISSING)
        except CodecError as exc:  # a reader of ours
            raise CodecError(f"{where}: {exc}") from None
        except Exception as exc:  # e.g. an empty mlx-vlm QuantizedKVCache
            if _says_empty(layer):
                # The class's own state property fails on its None rows: say
                # what the caller can do rather than pass on the AttributeError.
                raise CodecError(
                    f"{where}: cannot read the state of {name}: the layer is empty (no "
                    f"tokens yet) and {module}.{name} gives no state before its first "
                    f"update; save the cache after the prefill ({exc!r})") from exc
            raise CodecError(f"{where}: cannot read the state of {name}: {exc!r}") from exc
        part = "state"
        try:
            entry["state"] = self.node(state)
            if meta is not _MISSING:
                part = "meta_state"
                entry["meta_state"] = self.node(meta)
        except _NodeProblem as exc:
            raise exc.located(where, part) from None
        if attrs is not None:
            entry["attrs"] = attrs
            self.version = max(self.version, _ATTRS_VERSION)
        if built:
            self.version = max(self.version, _BUILT_VERSION)
        return entry


def _says_empty(layer: Any) -> bool:
    """Whether the layer's own ``empty()`` says it holds no tokens (False
    when it has none, or it raises)."""
    try:
        return layer.empty() is True
    except Exception:
        return False


def _byte_runs(nd: np.ndarray) -> tuple[memoryview, ...]:
    """Zero-copy contiguous byte runs that together are `nd`'s row-major bytes.

    `nd` is a (possibly strided) view on an MLX buffer with non-negative strides.
    """
    if nd.size == 0:
        return ()
    itemsize = nd.itemsize
    shape, strides = nd.shape, nd.strides
    # The longest C-contiguous tail of axes is one block; the axes before it
    # enumerate the blocks.
    block, k = itemsize, nd.ndim
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == block):
        block *= shape[k - 1]
        k -= 1
    starts = np.zeros(1, dtype=np.int64)
    for n, s in zip(shape[:k], strides[:k], strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    if len(starts) > _MAX_RUNS and block < _MIN_AVG_RUN:
        # Pathological layout: one private copy (isolated by construction).
        return (memoryview(np.ascontiguousarray(nd)).cast("B"),)
    # One flat byte view from the first element to the last spans every block;
    # as_strided keeps `nd` (and through it the MLX handle) alive.
    extent = int(sum((n - 1) * s for n, s in zip(shape, strides, strict=True))) + itemsize
    span = np.lib.stride_tricks.as_strided(
        nd, shape=(extent // itemsize,), strides=(itemsize,), writeable=False
    )
    flat = memoryview(span).cast("B")
    runs: list[memoryview] = []
    run_start, run_end = -1, -1
    for start in starts.tolist():
        if start == run_end:  # adjacent blocks merge into one run
            run_end += block
            continue
        if run_end >= 0:
            runs.append(flat[run_start:run_end])
        run_start, run_end = start, start + block
    runs.append(flat[run_start:run_end])
    return tuple(runs)


def _export(p: _Pending) -> TensorSnapshot:
    mv = p.view
    assert mv is not None
    if mv.c_contiguous:  # (a length is only ever set on arrays of 2 or more dims)
        return _export_contiguous(p.name, p.dtype, mv, p.length)
    # numpy cannot read every MLX buffer format (bf16 is "bfloat16"): the
    # same memory as unsigned integers of the same size, strides and all.
    nd = as_unsigned(p.handle)
    if p.length is not None:
        nd = nd[..., : p.length, :]
    if any(s < 0 for s in nd.strides):
        nd = np.ascontiguousarray(nd)  # MLX caches never do this; stay correct if one does
    runs = _byte_runs(nd)
    nbytes = sum(len(r) for r in runs)
    if nbytes != nd.size * DTYPE_SIZES[p.dtype]:
        raise CodecError(f"{p.name}: exported {nbytes} bytes for shape {nd.shape} {p.dtype}")
    return TensorSnapshot(p.name, p.dtype, tuple(int(n) for n in nd.shape), runs, nbytes)


def _export_contiguous(name: str, dtype: str, mv: memoryview, length: int | None) -> TensorSnapshot:
    """The common case without numpy: a C-contiguous buffer, whole or cut to
    its first ``length`` rows of axis -2 (one run per outer index): a slice of
    a memoryview costs next to nothing."""
    shape = list(mv.shape)
    flat = mv.cast("B")  # keeps `mv`, and through it the MLX handle, alive
    if length is None or length == shape[-2]:
        runs: tuple[memoryview, ...] = (flat,) if len(flat) else ()
    else:
        row = shape[-1] * mv.itemsize
        stride, block = shape[-2] * row, length * row
        outer = math.prod(shape[:-2])
        runs = tuple(flat[o * stride : o * stride + block] for o in range(outer)) if block else ()
        shape[-2] = length
    return TensorSnapshot(name, dtype, tuple(shape), runs, sum(len(r) for r in runs))


@dataclass(frozen=True, slots=True)
class CacheCapture:
    """The part of a snapshot taken on the caller's thread: the layers
    description (as JSON-ready objects) and one evaluated MLX handle per
    tensor. From here on nothing the generation loop does to the cache
    changes it; `encode_capture` turns it into byte runs on any thread."""

    description: dict[str, Any]
    pending: tuple[_Pending, ...]
    nbytes: int


def check_cache(layers: Sequence[Any]) -> None:
    """Raise the CodecError ``capture_cache`` would raise for ``layers``, if
    any, without capturing: it only walks the layers' states (no handles are
    taken, nothing is evaluated)."""
    enc = _Encoder()
    for i, layer in enumerate(layers):
        enc.layer(layer, f"layer {i}")


def capture_cache(layers: Sequence[Any]) -> CacheCapture:
    """Freeze a prompt cache (list of mlx-lm / mlx-vlm cache layers), copying
    its data only when it is small (``CAPTURE_COPY_MAX_BYTES``).

    Otherwise takes a new MLX handle on every tensor's buffer and evaluates them: from
    then on MLX copies instead of writing those buffers in place (one copy per
    buffer, in the next update, and only if it would have written in place),
    so the capture shows the cache exactly as it is now. Spare capacity of
    known mlx-lm caches (rows past the offset) is left out. Raises CodecError
    for a layer it cannot describe, or a tensor that could not be loaded back
    (see ``MLX_UNREADABLE_DTYPES``). This is all of ``save()``'s work on the
    generation loop's thread; the rest happens in `encode_capture`.
    """
    enc = _Encoder()
    entries = [enc.layer(layer, f"layer {i}") for i, layer in enumerate(layers)]
    sizes = [math.prod(p.shape) * DTYPE_SIZES[p.dtype] for p in enc.pending]
    nbytes = sum(sizes)
    # A small cache is copied now: a shared buffer would make the cache's next
    # update copy it instead, on this same thread, and the steps after it
    # were slower too while the capture lived (see CAPTURE_COPY_MAX_BYTES).
    copy = nbytes <= CAPTURE_COPY_MAX_BYTES
    handles = []
    try:
        for p, size in zip(enc.pending, sizes, strict=True):
            if size:
                p.handle = mx.array(p.source) if copy else p.source.__copy__()
                handles.append(p.handle)
            # The cache's own array object may be rebound by the next update; the
            # handle (and the description recorded above) is all that is kept.
            p.source = None  # type: ignore[assignment]
        # Computes whatever is still lazy in the cache (a few microseconds when
        # nothing is): the I/O thread must only ever read finished buffers. The
        # memoryviews are taken there too: each one lets go of the GIL (MLX's
        # buffer export), and every let-go is a chance for another thread to
        # keep save() waiting for it (up to the 5 ms switch interval).
        mx.eval(handles)
    except RuntimeError as exc:
        if "in current thread" not in str(exc):
            raise
        # MLX's streams are per thread: work left pending by another thread
        # (a generation loop's last step, a lazy load) cannot be run here.
        raise CodecError(
            f"the cache holds arrays still to be computed on another thread's MLX stream "
            f"({exc}): evaluate them there first (mx.eval), or save from that thread "
            f"(a cache from load(verify=False) is lazy: load it verified, or evaluate it, "
            f"to hand it to another thread)") from None
    description = {"format": LAYERS_FORMAT, "version": enc.version, "layers": entries}
    return CacheCapture(description, tuple(enc.pending), nbytes)


def _take_views(pending: Sequence[_Pending]) -> None:
    """A memoryview of every evaluated handle. No MLX operation runs here: on
    the I/O thread one would make MLX start a stream for that thread, which
    outlives it (one leaked thread per client)."""
    for p in pending:
        if p.handle is not None:
            p.view = memoryview(p.handle)


def encode_capture(capture: CacheCapture) -> CacheSnapshot:
    """The byte runs and layers JSON of a capture. Safe on another thread
    than the one that captured: it only reads evaluated handles, and runs
    no MLX operation."""
    _take_views(capture.pending)
    layers = msgspec.json.encode(capture.description).decode()
    tensors = [
        _export(p) if p.view is not None else TensorSnapshot(p.name, p.dtype, p.shape, (), 0)
        for p in capture.pending
    ]
    nbytes = sum(t.nbytes for t in tensors)
    if nbytes != capture.nbytes:
        raise CodecError(f"exported {nbytes} bytes, captured {capture.nbytes}")
    return CacheSnapshot(tuple(tensors), layers, nbytes)


def snapshot_cache(layers: Sequence[Any]) -> CacheSnapshot:
    """`capture_cache` and `encode_capture` in one call: the cache's tensors as
    zero-copy byte runs that never change, plus the layers JSON."""
    return encode_capture(capture_cache(layers))


# ---------------------------------------------------------------------------
# restore


class _Decoder:
    def __init__(self, arrays: Mapping[str, mx.array],
                 table: Mapping[str, Any] | None) -> None:
        self.arrays = arrays
        self.table = table

    def tensor(self, ref: dict[str, Any]) -> mx.array:
        name, dtype, shape = ref.get("name"), ref.get("dtype"), ref.get("shape")
        if type(name) is not str or type(shape) is not list:
            raise _NodeProblem(f"malformed tensor reference {ref!r}")
        array = self.arrays.get(name)
        if array is None:
            raise _NodeProblem(f"tensor {name!r} is missing")
        if type(array) is not mx.array:
            raise _NodeProblem(f"tensor {name!r} is not an mx.array")
        if self.table is not None:
            # The file's own entry, which the array was made from: plain
            # dicts, where asking the array costs two calls into MLX.
            entry = self.table.get(name)
            if type(entry) is dict and entry.get("dtype") == dtype and entry.get("shape") == shape:
                return array
        have = _DTYPE_NAMES.get(array.dtype)
        if have != dtype or list(array.shape) != shape:
            raise _NodeProblem(f"tensor {name!r} is {have} {list(array.shape)}, "
                           f"expected {dtype} {shape}")
        return array

    def node(self, node: Any) -> Any:
        # JSON decodes to exactly these types: no subclasses to allow for.
        t = type(node)
        if node is None or t is int or t is str or t is float or t is bool:
            return node
        if t is list:
            return self.items(node)
        if t is not dict:
            raise _NodeProblem(f"unexpected JSON value {node!r}")
        kind = node.get("$")
        if kind == "tensor":
            return self.tensor(node)
        items = node.get("items")
        if kind == "tuple" and type(items) is list:
            return tuple(self.items(items))
        if kind == "dict" and type(items) is list:
            out: dict[Any, Any] = {}
            for item in items:
                if not (type(item) is list and len(item) == 2):
                    raise _NodeProblem(f"malformed dict item {item!r}")
                key = self.node(item[0])
                if not (key is None or isinstance(key, (bool, int, float, str))):
                    raise _NodeProblem(f"dict key {key!r} is not a scalar")
                try:
                    out[key] = self.node(item[1])
                except _NodeProblem as exc:
                    exc.path.append(str(key))
                    raise
            return out
        if kind == "float" and node.get("value") in ("nan", "inf", "-inf"):
            return float(node["value"])
        raise _NodeProblem(f"unknown node {node!r}")

    def items(self, nodes: list[Any]) -> list[Any]:
        """``node`` of each of ``nodes``; a layer's state is mostly tensors and
        ints, taken here without a call each."""
        out: list[Any] = []
        try:
            for v in nodes:
                t = type(v)
                if t is int:
                    out.append(v)
                elif t is dict and v.get("$") == "tensor":
                    out.append(self.tensor(v))
                else:
                    out.append(self.node(v))
        except _NodeProblem as exc:
            exc.path.append(str(len(out)))
            raise
        return out

    def part(self, entry: dict[str, Any], part: str, where: str) -> Any:
        try:
            return self.node(entry[part])
        except _NodeProblem as exc:
            raise exc.located(where, part) from None

    def layer(self, entry: Any, where: str) -> Any:
        if type(entry) is not dict:
            raise CodecError(f"{where}: layer entry is not an object")
        cls = resolve_cache_class(entry.get("module"), entry.get("class"))  # type: ignore[arg-type]
        if "children" in entry:
            children = entry["children"]
            kind = entry.get("children_type", "tuple")
            if type(children) is not list or kind not in ("tuple", "list"):
                raise CodecError(f"{where}: malformed children")
            built = [self.layer(c, f"{where}.{i}") for i, c in enumerate(children)]
            return rebuild_composite(cls, built, list if kind == "list" else tuple)
        if "state" not in entry:
            raise CodecError(f"{where}: layer entry has no state")
        state = self.part(entry, "state", where)
        meta = self.part(entry, "meta_state", where) if "meta_state" in entry else _MISSING
        lossy = _LOSSY_OLD_ENTRIES.get((cls.__module__, cls.__qualname__))
        why = lossy(state, meta, entry) if lossy is not None else None
        if why is not None:
            raise CodecError(f"{where}: {why}")
        build = _BUILDERS.get((cls.__module__, cls.__qualname__))
        if build is not None:
            if meta is not _MISSING or "attrs" in entry:
                raise CodecError(f"{where}: {cls.__qualname__} has no meta_state or attrs")
            try:
                return build(cls, state)
            except CodecError as exc:
                raise CodecError(f"{where}: {exc}") from None
            except Exception as exc:  # the class's own refusal, or a later version's contract
                raise CodecError(f"{where}: {cls.__qualname__} rejected its state: {exc!r}") \
                    from exc
        if cls.__module__ == "mlx_lm.models.cache" and (
                hasattr(cls, "meta_state") != (meta is not _MISSING)):
            # Saved under the other mlx-lm cache API (0.31 or earlier against 0.32).
            from kvkeeper.client import lm_api

            obj = (lm_api.rebuild_from_new(cls, state, where) if meta is _MISSING
                   else lm_api.rebuild_from_old(cls, state, meta, where))
        else:
            obj = rebuild_layer(cls, state, meta, where=where)
        if "attrs" in entry:
            _set_attrs(obj, entry["attrs"], where)
        return obj


def _set_attrs(obj: Any, attrs: Any, where: str) -> None:
    """Set a rebuilt layer's recorded attributes (see ``_READERS``)."""
    if type(attrs) is not dict:
        raise CodecError(f"{where}: attrs is not an object")
    for name, value in attrs.items():
        if name not in _SETTABLE_ATTRS or type(value) is not int or value < 0:
            raise CodecError(f"{where}: cannot set {name!r} to {value!r}")
        setattr(obj, name, value)


def restore_cache(arrays: Mapping[str, mx.array], layers: str,
                  table: Mapping[str, Any] | None = None) -> list[Any]:
    """Rebuild the cache layers described by `layers` from `arrays` (name -> mx.array).

    `layers` is the JSON string of a `CacheSnapshot`; `arrays` holds at least
    every tensor it references, with the recorded dtype and shape (extra
    arrays are ignored). `table`, when given, is the safetensors tensor table
    the arrays were loaded from (name -> {"dtype", "shape", ...}): a reference
    that matches its entry there needs no question to the array itself.
    Raises CodecError for anything malformed, unknown or mismatched; never
    imports outside mlx_lm.models. / mlx_vlm.models. (and ``BUILT_ONLY_MODULES``).
    """
    entries = _LAYER_LISTS.get(layers) if type(layers) is str else None
    if entries is None:
        entries = _layer_list(layers)
        if type(layers) is str:
            with _LAYER_LISTS_LOCK:
                if len(_LAYER_LISTS) >= _MAX_LAYER_LISTS:
                    del _LAYER_LISTS[next(iter(_LAYER_LISTS))]  # the oldest
                _LAYER_LISTS[layers] = entries
    dec = _Decoder(arrays, table)
    try:
        return [dec.layer(e, f"layer {i}") for i, e in enumerate(entries)]
    except RecursionError:
        raise CodecError("layers description is nested too deeply") from None


#: The layer lists of the descriptions loaded last, by the description: a
#: server loads the same entries again and again (a shared system prompt, a
#: session reopened), and decoding the JSON was 50 us of a 32-layer lazy
#: load. Only ever read once decoded (the decoder builds new containers).
_LAYER_LISTS: dict[str, list[Any]] = {}
_MAX_LAYER_LISTS = 32
_LAYER_LISTS_LOCK = threading.Lock()


def _layer_list(layers: str | bytes) -> list[Any]:
    """The decoded layer entries of a layers description, its header checked."""
    try:
        doc = msgspec.json.decode(layers)
    except (TypeError, ValueError, RecursionError, msgspec.DecodeError) as exc:
        raise CodecError(f"layers description is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != LAYERS_FORMAT:
        raise CodecError("not a kvkeeper layers description")
    version = doc.get("version")
    if type(version) is not int or not 1 <= version <= LAYERS_VERSION:
        raise CodecError(f"unsupported layers format version {version!r} (know {LAYERS_VERSION})")
    entries = doc.get("layers")
    if not isinstance(entries, list):
        raise CodecError("layers description has no layer list")
    return entries
