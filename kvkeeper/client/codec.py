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

Which cache classes need what (rows of spare capacity left out, counters
their setters cannot tell kept as "attrs", the two classes kvkeeper builds
itself, where classes are looked up on restore: only in mlx-lm's and
mlx-vlm's packages, nothing is ever pickled or evaluated) lives in
``kvkeeper.client.cache_classes``; this module walks any cache the same way.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import mlx.core as mx
import msgspec
import numpy as np

from kvkeeper.client import lm_api
from kvkeeper.client.cache_classes import (
    BUILDERS,
    BUILT_ONLY_MODULES,
    LOSSY_OLD_ENTRIES,
    MISSING,
    TRUSTED_MODULE_PREFIXES,
    CodecError,
    Prefix,
    is_composite_class,
    layer_class,
    rebuild_composite,
    rebuild_layer,
    resolve_cache_class,
)
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
    "mlx_dtype",
    "mlx_dtype_name",
    "restore_cache",
    "snapshot_cache",
]

LAYERS_FORMAT = "kvkeeper.layers"
#: Bump when the JSON layout changes; restore refuses versions it does not know.
#: 2 adds a layer's "attrs" (set after it is rebuilt); 3 adds the layers
#: kvkeeper builds itself (``BUILDERS``). Each description is written with the
#: lowest version its layers need, so older readers take every other file.
LAYERS_VERSION = 3
_ATTRS_VERSION = 2
_BUILT_VERSION = 3
#: The attributes a layer's "attrs" may set: plain non-negative integers.
_SETTABLE_ATTRS = frozenset({"offset"})

# A layout that splits into many tiny blocks (say a transposed view) would make
# thousands of runs; past this point one compact copy is cheaper for everyone.
_MAX_RUNS = 1024
_MIN_AVG_RUN = 4096


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
# snapshot


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


class _Reused(Exception):
    """A tensor named a second time (see LayoutDamage): raised past every
    handler of _NodeProblem, which would call it a value this process
    cannot rebuild."""

    def __init__(self, name: str) -> None:
        self.name = name


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
        if t is Prefix:
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
            module, name, read = layer_class(type(layer))  # type: ignore[arg-type]  # a class is hashable
        except CodecError as exc:
            raise CodecError(f"{where}: {exc}") from None
        entry: dict[str, Any] = {"class": name, "module": module}

        children = getattr(layer, "caches", None)
        if isinstance(children, (list, tuple)) and is_composite_class(type(layer)):
            entry["children"] = [self.layer(c, f"{where}.{i}") for i, c in enumerate(children)]
            entry["children_type"] = "list" if isinstance(children, list) else "tuple"
            return entry

        built = (module, name) in BUILDERS  # its reader's state says everything
        try:
            state, attrs = read(layer)
            meta = MISSING if built else getattr(layer, "meta_state", MISSING)
        except CodecError as exc:  # a reader of ours
            raise CodecError(f"{where}: {exc}") from None
        except (AttributeError, TypeError, ValueError, LookupError, RuntimeError,
                ArithmeticError) as exc:  # e.g. an empty mlx-vlm QuantizedKVCache
            # (What a broken state property raises. Others, a signal
            # handler's TimeoutError say, are the caller's: taken for a bad
            # cache, a request's deadline read as a ValueError.)
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
            if meta is not MISSING:
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
        return (memoryview(np.ascontiguousarray(nd)).cast("B"),)  # type: ignore[arg-type]  # stubs lack the buffer protocol
    # One flat byte view from the first element to the last spans every block;
    # as_strided keeps `nd` (and through it the MLX handle) alive.
    extent = int(sum((n - 1) * s for n, s in zip(shape, strides, strict=True))) + itemsize
    span = np.lib.stride_tricks.as_strided(
        nd, shape=(extent // itemsize,), strides=(itemsize,), writeable=False
    )
    flat = memoryview(span).cast("B")  # type: ignore[arg-type]  # stubs lack the buffer protocol
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
    shape = list(mv.shape or ())
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
                if not copy:
                    p.handle = p.source.__copy__()
                elif p.length is None:
                    p.handle = mx.array(p.source)
                else:
                    # The live rows alone: a copy of the whole buffer, spare
                    # capacity and all, held up save() 5-12 ms for a 32-layer
                    # cache of 30 tokens (256 rows a layer), 220-430 ms for
                    # one trimmed to 8 rows of 8,192.
                    p.handle = mx.array(p.source[..., : p.length, :])
                    p.length = None
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
            p.view = memoryview(p.handle)  # type: ignore[arg-type]  # stubs lack the buffer protocol


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


class LayoutDamage(CodecError):
    """The layers description and the file's tensors disagree as no writer
    of kvkeeper's makes them (a tensor named twice, or one named nowhere):
    one flipped digit in a name ("t1" to "t0") served a layer's keys as its
    values, where no checksum covered the header (a lazy load, a file of
    0.2.1 or earlier)."""


class _Decoder:
    def __init__(self, arrays: Mapping[str, mx.array],
                 table: Mapping[str, Any] | None) -> None:
        self.arrays = arrays
        self.table = table
        self.used: set[str] = set()

    def tensor(self, ref: dict[str, Any]) -> mx.array:
        name, dtype, shape = ref.get("name"), ref.get("dtype"), ref.get("shape")
        if type(name) is not str or type(shape) is not list:
            raise _NodeProblem(f"malformed tensor reference {ref!r}")
        if name in self.used:
            raise _Reused(name)
        self.used.add(name)
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
        meta = self.part(entry, "meta_state", where) if "meta_state" in entry else MISSING
        lossy = LOSSY_OLD_ENTRIES.get((cls.__module__, cls.__qualname__))
        why = lossy(state, meta, entry) if lossy is not None else None
        if why is not None:
            raise CodecError(f"{where}: {why}")
        build = BUILDERS.get((cls.__module__, cls.__qualname__))
        if build is not None:
            if meta is not MISSING or "attrs" in entry:
                raise CodecError(f"{where}: {cls.__qualname__} has no meta_state or attrs")
            try:
                return build(cls, state)
            except CodecError as exc:
                raise CodecError(f"{where}: {exc}") from None
            except Exception as exc:  # the class's own refusal, or a later version's contract
                raise CodecError(f"{where}: {cls.__qualname__} rejected its state: {exc!r}") \
                    from exc
        if cls.__module__ == "mlx_lm.models.cache" and (
                hasattr(cls, "meta_state") != (meta is not MISSING)):
            # Saved under the other mlx-lm cache API (0.31 or earlier against 0.32).
            obj = (lm_api.rebuild_from_new(cls, state, where) if meta is MISSING
                   else lm_api.rebuild_from_old(cls, state, meta, where))
        else:
            obj = rebuild_layer(cls, state, meta, where=where)
        if "attrs" in entry:
            _set_attrs(obj, entry["attrs"], where)
        return obj


def _set_attrs(obj: Any, attrs: Any, where: str) -> None:
    """Set a rebuilt layer's recorded attributes (see ``cache_classes.layer_class``)."""
    if type(attrs) is not dict:
        raise CodecError(f"{where}: attrs is not an object")
    for name, value in attrs.items():
        if name not in _SETTABLE_ATTRS or type(value) is not int or value < 0:
            raise CodecError(f"{where}: cannot set {name!r} to {value!r}")
        setattr(obj, name, value)


def restore_cache(arrays: Mapping[str, mx.array], layers: str,
                  table: Mapping[str, Any] | None = None, *, strict: bool = False) -> list[Any]:
    """Rebuild the cache layers described by `layers` from `arrays` (name -> mx.array).

    `layers` is the JSON string of a `CacheSnapshot`; `arrays` holds at least
    every tensor it references, with the recorded dtype and shape (extra
    arrays are ignored, unless `strict`: the arrays are a whole file's).
    `table`, when given, is the safetensors tensor table
    the arrays were loaded from (name -> {"dtype", "shape", ...}): a reference
    that matches its entry there needs no question to the array itself.
    Raises CodecError for anything malformed, unknown or mismatched, and
    its LayoutDamage for a tensor named twice (or, `strict`, one named
    nowhere); never imports outside mlx_lm.models. / mlx_vlm.models. (and
    ``BUILT_ONLY_MODULES``).
    """
    entries = _LAYER_LISTS.get(layers) if type(layers) is str else None
    if entries is None:
        entries = _layer_list(layers)
        if type(layers) is str:
            with _LAYER_LISTS_LOCK:
                if len(_LAYER_LISTS) >= _MAX_LAYER_LISTS:
                    # The oldest (a signal handler's load may take it first).
                    _LAYER_LISTS.pop(next(iter(_LAYER_LISTS)), None)
                _LAYER_LISTS[layers] = entries
    dec = _Decoder(arrays, table)
    restored = []
    for i, e in enumerate(entries):
        try:
            restored.append(dec.layer(e, f"layer {i}"))
        except RecursionError:
            raise CodecError("layers description is nested too deeply") from None
        except _Reused as exc:
            raise LayoutDamage(f"layer {i}: tensor {exc.name!r} is named a second time in "
                               f"the layers description") from None
    if strict and len(dec.used) != len(arrays):
        unused = sorted(set(arrays) - dec.used)
        raise LayoutDamage(f"{len(unused)} of the file's tensors are in no layer "
                           f"({', '.join(map(repr, unused[:3]))}"
                           f"{', ...' if len(unused) > 3 else ''})")
    return restored


#: The layer lists of the descriptions loaded last, by the description: a
#: server loads the same entries again and again (a shared system prompt, a
#: session reopened), and decoding the JSON was 50 us of a 32-layer lazy
#: load. Only ever read once decoded (the decoder builds new containers).
_LAYER_LISTS: dict[str, list[Any]] = {}
_MAX_LAYER_LISTS = 32
# Reentrant: a signal handler's load() may come while its thread holds it
# (with a plain lock, it waited for ever).
_LAYER_LISTS_LOCK = threading.RLock()


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
