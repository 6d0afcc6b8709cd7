"""kvkeeper.client.codec: cache layers <-> zero-copy tensor runs + layers JSON."""

from __future__ import annotations

import gc
import json
import re
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as L
import mlx_vlm.models.cache as V
import numpy as np
import pytest

from kvkeeper.client.codec import (
    LAYERS_FORMAT,
    LAYERS_VERSION,
    CacheSnapshot,
    CodecError,
    capture_cache,
    encode_capture,
    mlx_dtype,
    mlx_dtype_name,
    restore_cache,
    snapshot_cache,
)
from kvkeeper.protocol.dtypes import DTYPE_SIZES

from .legacy_describe import MLX_LM_OLD_API
from .tiny import (
    arrays_from_snapshot,
    greedy_decode,
    prefill,
    prompt,
    tiny_deepseek_v41,
    tiny_lfm2,
    tiny_llama,
)

H, D = 2, 64


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_llama()


@pytest.fixture(scope="module")
def lfm2() -> Any:
    return tiny_lfm2()


# ---------------------------------------------------------------------------
# helpers


def raw(a: mx.array) -> bytes:
    """Row-major bytes of an array (bf16 through uint16: numpy has no bf16)."""
    u = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return np.array(a.view(u)).tobytes()


def canon(x: Any) -> Any:
    """A comparable form of a state tree: container types kept, arrays as (dtype, shape, bytes)."""
    if isinstance(x, mx.array):
        return ("array", str(x.dtype), tuple(x.shape), raw(x))
    if isinstance(x, tuple):
        return ("tuple", tuple(canon(v) for v in x))
    if isinstance(x, list):
        return ("list", tuple(canon(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, canon(v)) for k, v in x.items()))
    if isinstance(x, float) and x != x:
        return ("float", "nan")
    return (type(x).__name__, x)


def assert_kept_prefix(orig: Any, got: Any, where: str = "state") -> None:
    """`got` is `orig` with some arrays cut to their first rows of axis -2; everything else equal."""
    assert type(got) is type(orig), where
    if isinstance(orig, (list, tuple)):
        assert len(got) == len(orig), where
        for i, (o, g) in enumerate(zip(orig, got, strict=True)):
            assert_kept_prefix(o, g, f"{where}.{i}")
    elif isinstance(orig, mx.array):
        assert got.dtype == orig.dtype, where
        assert got.shape[:-2] == orig.shape[:-2] and got.shape[-1] == orig.shape[-1], where
        assert raw(got) == raw(orig[..., : got.shape[-2], :]), where
    else:
        assert got == orig, where


def roundtrip(cache: list[Any]) -> tuple[CacheSnapshot, list[Any]]:
    snap = snapshot_cache(cache)
    return snap, restore_cache(arrays_from_snapshot(snap), snap.layers)


def fill(c: Any, t: int = 37) -> Any:
    c.update_and_fetch(
        mx.random.normal((1, H, t, D)).astype(mx.bfloat16),
        mx.random.normal((1, H, t, D)).astype(mx.bfloat16),
    )
    return c


def grow(c: Any) -> Any:
    one = mx.zeros((1, H, 1, D), dtype=mx.bfloat16)
    c.update_and_fetch(one, one)
    return c


def joined(snap: CacheSnapshot) -> list[bytes]:
    return [b"".join(t.runs) for t in snap.tensors]


def addr(view: Any) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def buffer_addr(a: mx.array) -> int:
    u = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    return int(np.asarray(memoryview(a.view(u))).ctypes.data)


# ---------------------------------------------------------------------------
# dtypes


def test_dtype_table_both_ways() -> None:
    names = [
        "BOOL",
        "U8",
        "I8",
        "U16",
        "I16",
        "F16",
        "BF16",
        "U32",
        "I32",
        "F32",
        "U64",
        "I64",
        "F64",
        "C64",
    ]
    for name in names:
        dt = mlx_dtype(name)
        assert mlx_dtype_name(dt) == name
        assert dt.size == DTYPE_SIZES[name]
    with pytest.raises(CodecError):
        mlx_dtype("F8")
    with pytest.raises(CodecError):
        mlx_dtype_name("float32")  # type: ignore[arg-type]


def test_every_dtype_and_odd_shapes_roundtrip() -> None:
    c = L.ArraysCache(size=7)
    c[0] = mx.array([[True, False], [False, True]])
    c[1] = mx.arange(24, dtype=mx.int8).reshape(2, 3, 4)
    c[2] = mx.random.normal((3, 5)).astype(mx.float16)
    c[3] = mx.array(7, dtype=mx.int64)  # 0-d
    c[4] = mx.zeros((2, 0, 3), dtype=mx.float32)  # zero-size
    c[5] = mx.array([1 + 2j, 3 - 4j], dtype=mx.complex64)
    c[6] = mx.array(np.array([2**64 - 1, 5], dtype=np.uint64))
    snap, (got,) = roundtrip([c])
    assert [t.dtype for t in snap.tensors] == ["BOOL", "I8", "F16", "I64", "F32", "C64", "U64"]
    assert snap.tensors[3].shape == () and snap.tensors[4].runs == ()
    assert canon(got.state) == canon(c.state)
    assert snap.nbytes == sum(t.nbytes for t in snap.tensors) == sum(a.nbytes for a in c.cache)


# ---------------------------------------------------------------------------
# round trips, leaf for leaf, for every cache class of both packages


def _arrays(mod: ModuleType) -> Any:
    a = mod.ArraysCache(size=2)
    a[0] = mx.random.normal((1, 3, 8))
    a[1] = None
    return a


CASES: dict[str, Callable[[ModuleType], list[Any]]] = {
    "kv": lambda m: [fill(m.KVCache()), fill(m.KVCache(), 1)],
    "kv-empty": lambda m: [m.KVCache()],
    "rotating": lambda m: [
        fill(m.RotatingKVCache(max_size=32, keep=4)),
        fill(m.RotatingKVCache(64)),
        grow(fill(m.RotatingKVCache(max_size=300))),  # 293-row buffer, 38 rows live
    ],
    "quantized": lambda m: [
        fill(m.QuantizedKVCache(group_size=32, bits=8)),
        fill(m.QuantizedKVCache(group_size=64, bits=4)),
    ],
    "chunked": lambda m: [fill(m.ChunkedKVCache(chunk_size=16))],
    "concatenate": lambda m: [fill(m.ConcatenateKVCache())],
    "arrays": lambda m: [_arrays(m), fill(m.KVCache())],
    "cachelist": lambda m: [
        m.CacheList(fill(m.KVCache()), fill(m.RotatingKVCache(max_size=16))),
        m.CacheList(m.CacheList(fill(m.KVCache(), 3)), _arrays(m)),
    ],
}

# mlx-lm classes whose state carries spare capacity past the offset.
TRIMMED = {"KVCache", "QuantizedKVCache", "ChunkedKVCache", "RotatingKVCache"}


def _flatten_layers(cache: list[Any]) -> list[Any]:
    out = []
    for c in cache:
        out.append(c)
        if type(c).__name__ == "CacheList":
            out.extend(_flatten_layers(list(c.caches)))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mod", [L, V], ids=["mlx_lm", "mlx_vlm"])
def test_roundtrip_leaf_for_leaf(mod: ModuleType, case: str) -> None:
    mx.random.seed(1)
    cache = CASES[case](mod)
    if mod is L and case == "kv-empty" and MLX_LM_OLD_API:
        # mlx-lm 0.31's KVCache cannot give the state of an empty layer (nor save it).
        with pytest.raises(CodecError, match="cannot read the state of KVCache"):
            snapshot_cache(cache)
        return
    snap, got = roundtrip(cache)
    assert len(got) == len(cache)
    for o, g in zip(_flatten_layers(cache), _flatten_layers(got), strict=True):
        assert type(g) is type(o)
        if hasattr(o, "meta_state"):
            assert canon(g.meta_state) == canon(o.meta_state)
        if type(o).__name__ == "CacheList":
            continue  # checked through its children (and below, whole)
        if mod is L and MLX_LM_OLD_API and type(o).__name__ == "ChunkedKVCache":
            # mlx-lm 0.31 trims its front by its buffer's size: kept whole.
            assert mx.array_equal(g.keys, o.keys).item() and g.offset == o.offset
        elif mod is L and type(o).__name__ in TRIMMED and o.keys is not None:
            assert_kept_prefix(o.state, g.state)
            keys = g.keys[0] if isinstance(g.keys, tuple) else g.keys
            assert keys.shape[-2] == o.offset - getattr(o, "start_position", 0)
        else:
            assert canon(g.state) == canon(o.state)
    if mod is V:
        # mlx-vlm states are already cut to the offset: nothing is dropped at all.
        assert canon([c.state for c in got]) == canon([c.state for c in cache])
    # The JSON records class and module of every layer, children included.
    doc = json.loads(snap.layers)
    # Version 1 unless a layer needs a newer reader (attrs: see below), as
    # mlx-lm 0.31's ChunkedKVCache with spare rows does.
    spare = mod is L and MLX_LM_OLD_API and case == "chunked"
    assert doc["format"] == LAYERS_FORMAT and doc["version"] == (2 if spare else 1)
    assert [e["class"] for e in doc["layers"]] == [type(c).__name__ for c in cache]
    assert {e["module"] for e in doc["layers"]} == {mod.__name__}


def _batch(cls: Any, *args: Any) -> Any:
    c = cls(*args)
    k = _rows_of(2, 5)
    c.update_and_fetch(k, k)
    return c


def _qsa() -> Any:
    from mlx_vlm.models.qwen4_exp.language import QSAKVCache

    c = fill(QSAKVCache())
    c.update_indexer(mx.ones((1, 37, 8)), mx.arange(37)[None])
    c.index_block_ratio = 4  # a scalar leaf inside an mlx-vlm state
    return c


MORE_CASES: dict[str, Callable[[], Any]] = {
    "lm-batch-kv": lambda: _batch(L.BatchKVCache, [1, 0]),
    "lm-batch-rotating": lambda: _batch(L.BatchRotatingKVCache, 16, [1, 0]),
    "vlm-batch-kv": lambda: _batch(V.BatchKVCache, [1, 0]),
    "vlm-buffered-rotating": lambda: fill(V.BufferedRotatingKVCache(max_size=32, keep=4)),
    "vlm-simple": lambda: fill(V.SimpleKVCache()),
    "vlm-model-specific": _qsa,
}


@pytest.mark.parametrize("case", sorted(MORE_CASES))
def test_roundtrip_other_classes(case: str) -> None:
    # Classes whose layout the codec knows nothing about: state kept as is.
    mx.random.seed(5)
    c = MORE_CASES[case]()
    snap, (got,) = roundtrip([c])
    assert type(got) is type(c)
    assert json.loads(snap.layers)["layers"][0]["module"] == type(c).__module__
    assert canon(got.state) == canon(c.state)
    if hasattr(c, "meta_state"):
        assert canon(got.meta_state) == canon(c.meta_state)


_PADDED_BATCHES: dict[str, Callable[[], Any]] = {
    "lm-kv": lambda: L.BatchKVCache([1, 0]),
    "lm-rotating": lambda: L.BatchRotatingKVCache(16, [1, 0]),
    "vlm-kv": lambda: V.BatchKVCache([1, 0]),
    "vlm-rotating": lambda: V.BatchRotatingKVCache(16, [1, 0]),
    "vlm-quantized": lambda: V.BatchQuantizedKVCache([1, 0]),
}


def _rows_of(batch: int, t: int) -> mx.array:
    return mx.random.normal((batch, H, t, D)).astype(mx.bfloat16)


@pytest.mark.parametrize("case", sorted(_PADDED_BATCHES))
def test_restored_batch_caches_finalize_filter_and_mask_as_the_original(case: str) -> None:
    """The right padding a batch cache holds from prepare() to finalize()
    is an attribute its state leaves out, and a layer rebuilt without
    __init__ had none: finalize() and filter() (and mlx-vlm's rotating
    make_mask()) raised AttributeError. Restored, it has none pending, as
    the original after finalize(), and goes on alike. (mlx-vlm's rotating
    one also came back believing it had wrapped, its meta_state setter
    taking bool("False"), and its mask then let the padding be attended.)"""
    mx.random.seed(3)
    c = _PADDED_BATCHES[case]()
    c.update_and_fetch(_rows_of(2, 5), _rows_of(2, 5))
    _, (got,) = roundtrip([c])
    more = _rows_of(2, 1)
    for cache in (c, got):
        cache.finalize()
        cache.update_and_fetch(more, more)
    assert canon(got.make_mask(1, return_array=True)) == canon(c.make_mask(1, return_array=True))
    for cache in (c, got):
        cache.filter(mx.array([1]))
    assert canon(got.state) == canon(c.state)
    if hasattr(c, "meta_state"):
        assert canon(got.meta_state) == canon(c.meta_state)


@pytest.mark.parametrize("case", sorted(_PADDED_BATCHES))
def test_save_refuses_a_batch_cache_between_prepare_and_finalize(case: str) -> None:
    """Between prepare(right_padding=...) and finalize() the padding rows
    sit at the end of the shorter prompts; saved without the padding they
    would be restored as tokens. Refused then, saved after finalize()."""
    mx.random.seed(4)
    c = _PADDED_BATCHES[case]()
    c.prepare(lengths=[3, 5], right_padding=[2, 0])
    c.update_and_fetch(_rows_of(2, 5), _rows_of(2, 5))
    with pytest.raises(CodecError, match=r"layer 0: .*between prepare\(\) and finalize\(\)"):
        snapshot_cache([c])
    c.finalize()
    _, (got,) = roundtrip([c])
    assert canon(got.state) == canon(c.state)


def test_a_batch_cache_saved_under_the_other_mlx_lm_api_is_refused_plainly() -> None:
    """mlx-lm 0.31 and 0.32 disagree on a batch cache's state, and kvkeeper
    converts only the single-sequence classes: a load under the other API
    is refused, once, saying so (not "malformed ... layer 0: ..." twice)."""
    c = _PADDED_BATCHES["lm-kv"]()
    c.update_and_fetch(_rows_of(2, 5), _rows_of(2, 5))
    snap = snapshot_cache([c])
    doc = json.loads(snap.layers)
    layer = doc["layers"][0]
    if MLX_LM_OLD_API:
        del layer["meta_state"]  # as 0.32 saves it
    else:
        layer["meta_state"] = ""  # as 0.31 saves it
    with pytest.raises(CodecError) as got:
        restore_cache(arrays_from_snapshot(snap), json.dumps(doc))
    assert re.fullmatch(r"layer 0: a BatchKVCache saved by mlx-lm 0\.3[12] or (earlier|later) "
                        r"cannot be rebuilt by this mlx-lm", str(got.value)), str(got.value)


def test_save_refuses_batch_caches_with_padding_pending_elsewhere() -> None:
    """mlx-vlm's BatchQSAKVCache keeps its right padding in the BatchKVCache
    it wraps, and BatchPoolingCache its pending lengths in a field its
    meta_state setter resets: saved between prepare() and finalize(), they
    came back without them (the padding rows as tokens). Refused then."""
    from mlx_vlm.models.qwen4_exp.language import BatchQSAKVCache

    mx.random.seed(8)
    qsa = BatchQSAKVCache([0, 0])
    qsa.prepare(lengths=[3, 5], right_padding=[2, 0])
    qsa.update_and_fetch(_rows_of(2, 5), _rows_of(2, 5))
    pool = V.BatchPoolingCache(4, [0, 0])
    pool.prepare(lengths=[3, 5])
    as_array = V.BatchPoolingCache(4, [0, 0])
    as_array.prepare(lengths=mx.array([3, 5]))  # int32 scalars: 2**31 does not fit
    for cache, where in ((qsa, "kv_cache._right_padding"), (pool, "_lengths"),
                         (as_array, "_lengths")):
        with pytest.raises(CodecError, match=rf"between prepare\(\) and finalize\(\): what "
                                             rf"it holds for the batched prefill \({where}\)"):
            snapshot_cache([cache])
        cache.finalize()
        _, (got,) = roundtrip([cache])
        assert canon(got.state) == canon(cache.state)


@pytest.mark.parametrize("field", ["left_padding", "lengths"])
def test_save_refuses_an_mlx_vlm_arrays_cache_holding_a_batchs_padding(field: str) -> None:
    """mlx-vlm's ArraysCache keeps left_padding and lengths out of its state
    (mlx-lm's keeps them in): saved, it came back with neither, and its mask
    was gone ([[F, F, T], [T, T, T]] became None), with no error."""
    arrays = V.ArraysCache(2)
    arrays[0], arrays[1] = mx.ones((2, 3)), mx.ones((2, 4))
    setattr(arrays, field, mx.array([2, 0] if field == "left_padding" else [3, 1]))
    with pytest.raises(CodecError, match=r"ArraysCache holds a batch's left_padding or "
                                         r"lengths outside its state.*one sequence"):
        snapshot_cache([arrays])
    setattr(arrays, field, None)
    _, (got,) = roundtrip([arrays])
    assert canon(got.state) == canon(arrays.state) and got.make_mask(3) is None


def test_a_minimax_m3_batch_cache_is_refused_at_save() -> None:
    """Its state setter needs the BatchKVCache its __init__ makes: saved, it
    was a file whose every load failed. Refused at save, saying what to
    save instead; a load of such a file names the layer."""
    from mlx_vlm.models.minimax_m3_vl.language import MiniMaxM3BatchKVCache, MiniMaxM3KVCache

    mx.random.seed(6)
    single = MiniMaxM3KVCache()
    single.update_and_fetch(_rows_of(1, 5), _rows_of(1, 5))
    batch = single.to_batch([0])
    with pytest.raises(CodecError, match=r"layer 0: .*MiniMaxM3BatchKVCache: kvkeeper cannot "
                                         r"rebuild it: .*extract\(i\)"):
        snapshot_cache([batch])
    # As 0.2.2 wrote it (its state as any class's).
    snap = snapshot_cache([fill(L.KVCache())])
    doc = json.loads(snap.layers)
    doc["layers"][0].update(module=MiniMaxM3BatchKVCache.__module__,
                            **{"class": "MiniMaxM3BatchKVCache"})
    with pytest.raises(CodecError, match=r"^layer 0: .*MiniMaxM3BatchKVCache: kvkeeper cannot "
                                         r"rebuild it: .*extract\(i\)"):
        restore_cache(arrays_from_snapshot(snap), json.dumps(doc))
    assert type(batch.extract(0)) is MiniMaxM3KVCache  # what the message says to save


def _rows(n: int, seed: int) -> mx.array:
    mx.random.seed(seed)
    return _rows_of(1, n)


def _vlm_chunked_trimmed() -> Any:
    c = V.ChunkedKVCache(chunk_size=16)
    c.update_and_fetch(_rows(40, 1), _rows(40, 2))
    c.maybe_trim_front()  # as Llama 4's attention does after each update
    for i in range(5):
        c.update_and_fetch(_rows(1, 10 + i), _rows(1, 20 + i))
        c.maybe_trim_front()
    return c


def _vlm_buffered_wrapped() -> Any:
    c = V.BufferedRotatingKVCache(max_size=32, keep=4, buffer_size=8)
    c.update_and_fetch(_rows(40, 1), _rows(40, 2))
    for i in range(5):  # with keep > 0 it is a ring, wrapped by now
        c.update_and_fetch(_rows(1, 10 + i), _rows(1, 20 + i))
    return c


@pytest.mark.parametrize("make", [_vlm_chunked_trimmed, _vlm_buffered_wrapped],
                         ids=["vlm-chunked-front-trimmed", "vlm-buffered-rotating-wrapped"])
def test_vlm_caches_whose_state_loses_position_restore_exactly(make: Callable[[], Any]) -> None:
    """mlx-vlm's own state of these two loses where the live rows are: a
    ChunkedKVCache past its chunk came back with the row count as offset
    (wrong logits, then a failed broadcast), a wrapped keep > 0
    BufferedRotatingKVCache with only the rows before its write index (the
    next update failed). The restored layer must go on exactly as the original."""
    c = make()
    snap, (got,) = roundtrip([c])
    assert (got.offset, got.start_position) == (c.offset, c.start_position)
    for i in range(40):
        want = c.update_and_fetch(_rows(1, 100 + i), _rows(1, 200 + i))
        have = got.update_and_fetch(_rows(1, 100 + i), _rows(1, 200 + i))
        if isinstance(c, V.ChunkedKVCache):
            c.maybe_trim_front()
            got.maybe_trim_front()
        assert all(mx.array_equal(a, b).item() for a, b in zip(want, have, strict=True)), i
    assert got.offset == c.offset


def _same_steps(a: Any, b: Any, steps: int, seed: int, trim_front: bool = False) -> None:
    """Feed both layers the same rows, one at a time, and compare what each returns."""
    for i in range(steps):
        if trim_front:  # as Llama 4's attention does before each update
            a.maybe_trim_front()
            b.maybe_trim_front()
        k = _rows(1, seed + i)
        want, have = a.update_and_fetch(k, k), b.update_and_fetch(k, k)
        assert all(mx.array_equal(x, y).item() for x, y in zip(want, have, strict=True)), i
        assert (a.offset, getattr(a, "start_position", 0)) == (b.offset,
                                                               getattr(b, "start_position", 0))


def test_a_trimmed_mlx_lm_concatenate_cache_keeps_its_offset() -> None:
    """mlx-lm's ConcatenateKVCache trims only its offset and keeps its rows
    (the next update appends after them); its setter takes the offset from the
    rows, so restored it came back untrimmed: 13 instead of 10, the positions
    of every later token wrong (other logits, no error)."""
    c = L.ConcatenateKVCache()
    c.update_and_fetch(_rows(13, 1), _rows(13, 1))
    assert c.trim(3) == 3 and c.offset == 10 and c.keys.shape[-2] == 13
    snap, (got,) = roundtrip([c])
    assert json.loads(snap.layers)["layers"][0]["attrs"] == {"offset": 10}
    assert got.offset == 10 and mx.array_equal(got.keys, c.keys).item()
    _same_steps(c, got, 3, seed=50)
    # Untrimmed, nothing is recorded: a file older kvkeepers read.
    whole = L.ConcatenateKVCache()
    whole.update_and_fetch(_rows(4, 2), _rows(4, 2))
    assert json.loads(roundtrip([whole])[0].layers)["version"] == 1
    # Empty, mlx-lm's setter cannot take its state: refused, not saved unusable.
    with pytest.raises(CodecError, match="empty mlx-lm ConcatenateKVCache"):
        snapshot_cache([L.ConcatenateKVCache()])


def test_an_mlx_lm_chunked_cache_goes_on_as_the_original_past_its_chunk() -> None:
    """A 300-token prefill, then decode steps past the 512-token chunk.
    mlx-lm 0.31's ChunkedKVCache trims its front by the size of its buffer,
    spare rows included: restored with its live rows only, it trimmed 46
    tokens early (other logits, no error). mlx-lm 0.32 trims by the tokens it
    holds; either restores to go on exactly as the original."""
    c = L.ChunkedKVCache(chunk_size=512)
    c.update_and_fetch(_rows(300, 1), _rows(300, 1))
    for i in range(2):
        c.maybe_trim_front()
        c.update_and_fetch(_rows(1, 10 + i), _rows(1, 10 + i))
    snap, (got,) = roundtrip([c])
    assert (got.offset, got.start_position) == (c.offset, c.start_position) == (302, 0)
    _same_steps(c, got, 260, seed=100, trim_front=True)
    assert c.start_position > 0  # past the chunk: the front was trimmed


def test_layer_attrs_need_the_newer_reader_and_are_checked() -> None:
    snap = snapshot_cache([fill(L.KVCache()), _vlm_chunked_trimmed()])
    doc = json.loads(snap.layers)
    # Only a description that needs attrs is version 2: older readers refuse
    # it instead of restoring a wrong offset, and still read every other file.
    assert doc["version"] == 2 and doc["layers"][1]["attrs"] == {"offset": 45}
    arrays = arrays_from_snapshot(snap)
    for attrs in ({"offset": -1}, {"offset": True}, {"offset": "45"}, {"keys": 1}, [45]):
        doc["layers"][1]["attrs"] = attrs
        with pytest.raises(CodecError, match="layer 1"):
            restore_cache(arrays, json.dumps(doc))


def test_capacity_is_dropped_and_json_layout() -> None:
    mx.random.seed(2)
    lm, vlm = fill(L.KVCache()), fill(V.KVCache())
    assert lm.keys.shape[2] == 256  # mlx-lm 0.32 keeps the whole allocation in its state
    snap = snapshot_cache([lm, vlm])
    doc = json.loads(snap.layers)
    e_lm, e_vlm = doc["layers"]
    tensors = [{"$": "tensor", "name": "t0", "dtype": "BF16", "shape": [1, H, 37, D]},
               {"$": "tensor", "name": "t1", "dtype": "BF16", "shape": [1, H, 37, D]}]
    assert e_lm == {
        "class": "KVCache",
        "module": "mlx_lm.models.cache",
        # mlx-lm 0.31 and earlier: the offset is the row count, meta_state "".
        **({"state": {"$": "tuple", "items": tensors}, "meta_state": ""} if MLX_LM_OLD_API
           else {"state": {"$": "tuple", "items": [*tensors, 37]}}),
    }
    # mlx-vlm protocol: meta_state recorded, state without scalars.
    assert e_vlm["module"] == "mlx_vlm.models.cache" and e_vlm["meta_state"] == ""
    assert [i["name"] for i in e_vlm["state"]["items"]] == ["t2", "t3"]
    assert [t.name for t in snap.tensors] == ["t0", "t1", "t2", "t3"]
    assert all(t.shape == (1, H, 37, D) and t.nbytes == H * 37 * D * 2 for t in snap.tensors)
    assert snap.nbytes == 4 * H * 37 * D * 2


def test_containers_scalars_and_dicts_survive() -> None:
    # ArraysCache.from_state accepts anything, so it can carry every node kind.
    c = L.ArraysCache(size=3)
    c.cache = [
        {"a": mx.arange(3), "b": float("nan"), "c": float("-inf"), 4: None},
        (1, 2.5, True, "s", None, (), []),
        [mx.ones((2, 2)), (mx.zeros((1,)),)],
    ]
    c.lengths = mx.array([3])
    _, (got,) = roundtrip([c])
    assert canon(got.state) == canon(c.state)
    items = got.cache  # the first part of mlx-lm 0.32's state, all of 0.31's
    assert type(items[1][5]) is tuple and type(items[1][6]) is list


def test_restored_mlx_lm_cache_keeps_working_across_a_step() -> None:
    mx.random.seed(3)
    c = fill(L.KVCache(), 250)
    _, (r,) = roundtrip([c])
    assert r.keys.shape[2] == 250
    k = mx.random.normal((1, H, 10, D)).astype(mx.bfloat16)
    a, b = c.update_and_fetch(k, k), r.update_and_fetch(k, k)
    assert raw(a[0]) == raw(b[0]) and raw(a[1]) == raw(b[1]) and r.offset == c.offset == 260


# ---------------------------------------------------------------------------
# model output after a restore


def _check_model(
    model: Any,
    make: Callable[[], list[Any]],
    *,
    n_prompt: int = 40,
    steps_before: int = 0,
    expect_drop: bool = False,
) -> None:
    """Prefill (and decode `steps_before` tokens), snapshot, restore: the model
    must then give bit-identical logits and the same 10 greedy tokens."""
    cache = make()
    logits = prefill(model, prompt(n_prompt), cache)
    nxt = int(mx.argmax(logits).item())
    if steps_before:
        nxt = greedy_decode(model, cache, nxt, steps_before)[-1]
    snap = snapshot_cache(cache)
    held = sum(a.nbytes for a in _state_arrays(cache))
    # mlx-lm 0.31 and earlier slice their states to the offset themselves.
    assert (snap.nbytes < held) == (expect_drop and not MLX_LM_OLD_API), (snap.nbytes, held)
    restored = restore_cache(arrays_from_snapshot(snap), snap.layers)
    assert [type(c) for c in restored] == [type(c) for c in cache]
    a = prefill(model, [nxt], cache)
    b = prefill(model, [nxt], restored)
    assert mx.array_equal(a, b).item(), "next-token logits differ after restore"
    first = int(mx.argmax(a).item())
    assert greedy_decode(model, cache, first, 10) == greedy_decode(model, restored, first, 10)


def _layers(cls: Callable[[], Any]) -> Callable[[], list[Any]]:
    return lambda: [cls() for _ in range(4)]


# name: (cache factory, decode steps before the snapshot, spare capacity dropped?)
MODEL_CASES: dict[str, tuple[Callable[[], list[Any]], int, bool]] = {
    "lm-kv": (_layers(L.KVCache), 0, True),
    # concat prefill gives an exact-size buffer; the first decode step grows it
    "lm-rotating-concat": (_layers(lambda: L.RotatingKVCache(max_size=64, keep=4)), 0, False),
    "lm-rotating-grown": (_layers(lambda: L.RotatingKVCache(max_size=300, keep=4)), 2, True),
    "lm-rotating-wrapped": (_layers(lambda: L.RotatingKVCache(max_size=32, keep=4)), 5, False),
    "lm-quantized": (_layers(lambda: L.QuantizedKVCache(group_size=64, bits=8)), 0, True),
    "lm-chunked": (_layers(lambda: L.ChunkedKVCache(chunk_size=256)), 0, True),
    "lm-concatenate": (_layers(L.ConcatenateKVCache), 0, False),
    "vlm-kv": (_layers(V.KVCache), 0, False),
    "vlm-rotating-wrapped": (_layers(lambda: V.RotatingKVCache(max_size=32, keep=4)), 5, False),
    "vlm-quantized": (_layers(lambda: V.QuantizedKVCache(group_size=64, bits=8)), 0, False),
    "vlm-chunked": (_layers(lambda: V.ChunkedKVCache(chunk_size=256)), 0, False),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_llama_output_identical_after_restore(llama: Any, case: str) -> None:
    make, steps_before, expect_drop = MODEL_CASES[case]
    _check_model(llama, make, steps_before=steps_before, expect_drop=expect_drop)


def test_llama_output_identical_across_a_256_step(llama: Any) -> None:
    # The original crosses its 256-row allocation during decoding; the restored
    # cache (exactly 250 rows) reallocates at once. Same outputs either way.
    _check_model(llama, _layers(L.KVCache), n_prompt=250, expect_drop=True)


def test_a_cache_quantized_by_mlx_lms_kv_bits_saves_its_live_rows_only(llama: Any) -> None:
    """mlx-lm's kv_bits path quantizes a KVCache with to_quantized, whose
    keys and values are the lists mx.quantize returns, not tuples: their
    whole allocation was saved (a 29-token cache: 256 rows a layer, 283,656
    bytes against 36,808 for the same cache built as QuantizedKVCache)."""
    cache = [L.KVCache() for _ in range(4)]
    nxt = int(mx.argmax(prefill(llama, prompt(40), cache)).item())
    cache = [c.to_quantized(group_size=64, bits=8) for c in cache]
    assert type(cache[0].keys) is list and cache[0].keys[0].shape[-2] == 256
    snap = snapshot_cache(cache)
    assert {t.shape[-2] for t in snap.tensors} == {40}
    restored = restore_cache(arrays_from_snapshot(snap), snap.layers)
    assert [type(c) for c in restored] == [type(c) for c in cache]
    a, b = prefill(llama, [nxt], cache), prefill(llama, [nxt], restored)
    assert mx.array_equal(a, b).item(), "next-token logits differ after restore"
    first = int(mx.argmax(a).item())
    assert greedy_decode(llama, cache, first, 10) == greedy_decode(llama, restored, first, 10)


def test_lfm2_hybrid_output_identical_after_restore(lfm2: Any) -> None:
    cache = lfm2.make_cache()
    assert {type(c).__name__ for c in cache} == {"ArraysCache", "KVCache"}
    _check_model(lfm2, lfm2.make_cache, expect_drop=True)
    _check_model(lfm2, lfm2.make_cache, steps_before=3, expect_drop=True)


def test_corrupted_restore_changes_output(llama: Any) -> None:
    # The output checks above have teeth: other values in the cache change the logits.
    cache = [L.KVCache() for _ in range(4)]
    prefill(llama, prompt(40), cache)
    snap = snapshot_cache(cache)
    arrays = arrays_from_snapshot(snap)
    arrays["t1"] = arrays["t1"].at[..., 3:6, :].multiply(-1)  # layer 0 values, 3 rows
    restored = restore_cache(arrays, snap.layers)
    assert not mx.array_equal(prefill(llama, [1], cache), prefill(llama, [1], restored)).item()


# ---------------------------------------------------------------------------
# snapshot isolation: the runs never change after snapshot_cache returns


def test_mlx_updates_cache_buffers_in_place() -> None:
    # The hazard itself (DESIGN.md): a bare memoryview sees later updates.
    c = fill(L.KVCache(), 10)
    mx.eval(c.keys)
    view = memoryview(c.keys).cast("B")
    before = bytes(view)
    c.update_and_fetch(mx.ones((1, H, 1, D), mx.bfloat16), mx.ones((1, H, 1, D), mx.bfloat16))
    mx.eval(c.keys)
    assert bytes(view) != before


def _isolation(model: Any, cache: list[Any], before: Callable[[], None] | None = None) -> None:
    snap = snapshot_cache(cache)
    frozen = [bytes(b) for b in joined(snap)]
    expected = [raw(a) for a in arrays_from_snapshot(snap).values()]
    assert frozen == expected
    # save() only captures; the I/O thread encodes later, while the loop goes on.
    captured = capture_cache(cache)
    live = [raw(a) for a in _state_arrays(cache)]
    if before is not None:
        before()
    greedy_decode(model, cache, 3, 25)
    late = encode_capture(captured)
    assert joined(snap) == frozen, "snapshot changed under the generation loop"
    assert joined(late) == frozen, "a capture encoded after the decode steps changed"
    assert late.layers == snap.layers
    assert [raw(a) for a in _state_arrays(cache)] != live  # the cache did move on


def _state_arrays(cache: list[Any]) -> list[mx.array]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


def test_isolation_kv_decode_after_snapshot(llama: Any) -> None:
    cache = [L.KVCache() for _ in range(4)]
    prefill(llama, prompt(40), cache)
    _isolation(llama, cache)


def test_isolation_trimmed_kv_rewrites_saved_rows(llama: Any) -> None:
    # Trim after the snapshot: the decode writes rows 30.. which are inside
    # the saved region [0, 50).
    for mod in (L, V):
        cache = [mod.KVCache() for _ in range(4)]
        prefill(llama, prompt(50), cache)
        snap = snapshot_cache(cache)
        frozen = joined(snap)
        captured = capture_cache(cache)
        old_rows = raw(cache[0].keys[..., 30:50, :])
        for c in cache:
            c.trim(20)
        greedy_decode(llama, cache, 3, 25)
        assert raw(cache[0].keys[..., 30:50, :]) != old_rows  # really rewritten
        assert joined(snap) == frozen, mod.__name__
        late = encode_capture(captured)
        assert joined(late) == frozen and late.layers == snap.layers, mod.__name__


def test_isolation_rotating_wraps_into_saved_buffer(llama: Any) -> None:
    # Fill past max_size and decode a few steps so the buffer is the final
    # max_size ring being written in place; then snapshot and keep decoding:
    # every write lands inside the saved buffer.
    for mod in (L, V):
        cache = [mod.RotatingKVCache(max_size=32, keep=4) for _ in range(4)]
        prefill(llama, prompt(40), cache)
        greedy_decode(llama, cache, 5, 3)
        assert cache[0].keys.shape[2] == 32
        _isolation(llama, cache)


def test_isolation_lfm2_hybrid(lfm2: Any) -> None:
    cache = lfm2.make_cache()
    prefill(lfm2, prompt(40), cache)
    _isolation(lfm2, cache)


def test_runs_keep_buffers_alive(llama: Any) -> None:
    cache = [L.KVCache() for _ in range(4)]
    prefill(llama, prompt(40), cache)
    snap = snapshot_cache(cache)
    frozen = [bytes(b) for b in joined(snap)]
    del cache
    gc.collect()
    # Churn the allocator so freed buffers would be reused and overwritten.
    for i in range(5):
        junk = mx.full((1, H, 256, D), float(i), dtype=mx.bfloat16) + 1
        mx.eval(junk)
        greedy_decode(llama, [L.KVCache() for _ in range(4)], i, 3)
    assert joined(snap) == frozen


# ---------------------------------------------------------------------------
# zero copy


def ballast() -> Any:
    """A 10 MiB layer: a cache past CAPTURE_COPY_MAX_BYTES, whose capture
    shares its buffers (a smaller one is copied whole in save())."""
    c = L.KVCache()
    c.keys = c.values = mx.zeros((1, 8, 2560, 128), dtype=mx.bfloat16)
    c.offset = 2560
    mx.eval(c.keys)
    return c


def test_runs_point_into_mlx_buffers() -> None:
    mx.random.seed(4)
    lm, vlm = fill(L.KVCache(), 37), fill(V.KVCache(), 37)
    snap = snapshot_cache([lm, vlm, ballast()])
    for t, a in zip(snap.tensors[:4], [lm.keys, lm.values, vlm.keys, vlm.values], strict=True):
        # (1, H, 256, D) buffer, 37 rows kept: one run per head, at the head's start.
        assert len(t.runs) == H
        base = buffer_addr(a)
        assert [addr(r) for r in t.runs] == [base + h * 256 * D * 2 for h in range(H)]
        assert all(len(r) == 37 * D * 2 for r in t.runs)
        assert all(r.format == "B" and r.ndim == 1 and r.c_contiguous for r in t.runs)


def test_a_strided_bf16_buffer_goes_as_runs_of_its_own_memory() -> None:
    # Every head's first 300 of 512 rows, sliced out of one bf16 buffer: a
    # strided array whose format numpy cannot read; still no copy.
    full = mx.random.normal((1, H, 512, D)).astype(mx.bfloat16)
    mx.eval(full)
    c = L.ConcatenateKVCache()
    c.keys, c.values = full[..., :300, :], full[..., :300, :]
    mx.eval(c.keys, c.values)
    snap = snapshot_cache([c, ballast()])
    base = buffer_addr(full)
    for t in snap.tensors[:2]:
        assert [addr(r) for r in t.runs] == [base + h * 512 * D * 2 for h in range(H)]
    assert joined(snap)[:2] == [raw(c.keys), raw(c.values)]


def test_a_small_cache_is_captured_as_a_copy() -> None:
    """Up to CAPTURE_COPY_MAX_BYTES the capture copies (so the cache's next
    update need not): no run points into the cache's buffers, and the bytes
    are the same."""
    mx.random.seed(5)
    lm = fill(L.KVCache(), 37)
    snap = snapshot_cache([lm])
    for t, a in zip(snap.tensors, [lm.keys, lm.values], strict=True):
        lo, hi = buffer_addr(a), buffer_addr(a) + a.nbytes
        assert not any(lo <= addr(r) < hi for r in t.runs)
    assert joined(snap) == [raw(lm.keys[..., :37, :]), raw(lm.values[..., :37, :])]


def test_a_small_cache_in_big_buffers_copies_only_its_rows() -> None:
    """A cache small enough to be copied, in buffers with much spare capacity
    (a short prompt, or a cache trimmed back): the copy holds its rows alone.
    It copied the whole buffers, on the generation loop's thread."""
    big = L.KVCache()
    big.keys = mx.random.normal((1, 8, 4096, 128)).astype(mx.bfloat16)  # 8 MiB each
    big.values = -big.keys
    big.offset = 9
    mx.eval(big.keys, big.values)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    snap = snapshot_cache([big])
    live = 2 * 8 * 9 * 128 * 2
    assert snap.nbytes == live
    # (The peak also holds MLX's own small allocations.)
    assert mx.get_peak_memory() - before < live + 2**20
    for t, a in zip(snap.tensors, [big.keys, big.values], strict=True):
        lo, hi = buffer_addr(a), buffer_addr(a) + a.nbytes
        assert not any(lo <= addr(r) < hi for r in t.runs)
    assert joined(snap) == [raw(big.keys[..., :9, :]), raw(big.values[..., :9, :])]


def test_snapshot_of_a_big_cache_copies_nothing() -> None:
    # 16 layers of (1, 8, 4096, 128) bf16 keys + values: 256 MiB of buffers.
    cache = []
    for i in range(16):
        c = L.KVCache()
        c.keys = mx.full((1, 8, 4096, 128), i, dtype=mx.bfloat16)
        c.values = mx.full((1, 8, 4096, 128), -i, dtype=mx.bfloat16)
        c.offset = 4000
        cache.append(c)
    mx.eval([c.state for c in cache])
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        snap = snapshot_cache(cache)
        timings.append(time.perf_counter() - t0)
    print(f"\nsnapshot of {snap.nbytes / 2**20:.0f} MiB: {min(timings) * 1e3:.2f} ms (best of 3)")
    assert snap.nbytes == 32 * 8 * 4000 * 128 * 2
    for t, a in zip(snap.tensors, [x for c in cache for x in (c.keys, c.values)], strict=True):
        base = buffer_addr(a)
        assert [addr(r) for r in t.runs] == [base + h * 4096 * 128 * 2 for h in range(8)]


def test_many_tiny_blocks_are_compacted() -> None:
    # A transposed view splits into 16-byte blocks: one compact copy instead.
    c = L.ConcatenateKVCache()
    k = mx.random.normal((1, 2048, 4, 8)).astype(mx.bfloat16).transpose(0, 2, 1, 3)
    c.update_and_fetch(k, k)
    snap = snapshot_cache([c])
    assert [len(t.runs) for t in snap.tensors] == [1, 1]
    assert joined(snap) == [raw(k), raw(k)]


# ---------------------------------------------------------------------------
# hostile or broken descriptions


def _layers_with(first: dict[str, Any]) -> tuple[dict[str, mx.array], str]:
    snap = snapshot_cache([fill(L.KVCache(), 4)])
    doc = json.loads(snap.layers)
    doc["layers"][0].update(first)
    return arrays_from_snapshot(snap), json.dumps(doc)


HOSTILE = [
    ("os", "system"),
    ("builtins", "eval"),
    ("builtins", "object"),
    ("mlx_lm.modelsX.y", "KVCache"),
    ("mlx_lm.models", "KVCache"),
    ("mlx_lm.models.", "KVCache"),
    ("mlx_lm.models..cache", "KVCache"),
    ("mlx_lm.models.cache os", "KVCache"),
    ("xmlx_lm.models.cache", "KVCache"),
    ("mlx_lm.models.cache", "os"),
    ("mlx_lm.models.cache", "mx"),
    ("mlx_lm.models.cache", "deque"),
    ("mlx_lm.models.cache", "create_causal_mask"),
    ("mlx_lm.models.cache", "__class__"),
    ("mlx_lm.models.cache", "_BaseCache"),
    ("mlx_lm.models.cache", "KVCache.__init__"),
    ("mlx_vlm.models.cache", "CacheMemory"),
    ("mlx_lm.models.llama", "Model"),  # an nn.Module: has a (read-only) state
    ("mlx_lm.models.cache.os", "system"),
    ("mlx_lm.models.no_such_module_kvk", "KVCache"),
    (None, "KVCache"),
    ("mlx_lm.models.cache", 3),
]


@pytest.mark.parametrize(("module", "name"), HOSTILE)
def test_hostile_classes_are_refused_without_imports(module: Any, name: Any) -> None:
    arrays, layers = _layers_with({"module": module, "class": name})
    before = set(sys.modules)
    with pytest.raises(CodecError):
        restore_cache(arrays, layers)
    assert set(sys.modules) == before


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(version=LAYERS_VERSION + 1),
        lambda d: d.update(format="other"),
        lambda d: d.update(layers={}),
        lambda d: d["layers"][0].pop("state"),
        lambda d: d["layers"][0]["state"]["items"][0].update(name="t9"),
        lambda d: d["layers"][0]["state"]["items"][0].update(dtype="F32"),
        lambda d: d["layers"][0]["state"]["items"][0].update(shape=[1, 2, 5, 64]),
        lambda d: d["layers"][0]["state"].update({"$": "set"}),
        lambda d: d["layers"][0]["state"]["items"].pop(),  # KVCache refuses a 2-tuple
        lambda d: d["layers"][0].update(children=[], **{"class": "KVCache"}),
    ],
)
def test_broken_descriptions_raise_codec_error(mutate: Callable[[dict[str, Any]], None]) -> None:
    snap = snapshot_cache([fill(L.KVCache(), 4)])
    doc = json.loads(snap.layers)
    mutate(doc)
    with pytest.raises(CodecError):
        restore_cache(arrays_from_snapshot(snap), json.dumps(doc))


def test_not_json_and_too_deep() -> None:
    with pytest.raises(CodecError):
        restore_cache({}, "{not json")
    deep = "[" * 100_000 + "]" * 100_000
    doc = f'{{"format":"{LAYERS_FORMAT}","version":{LAYERS_VERSION},"layers":{deep}}}'
    with pytest.raises(CodecError):
        restore_cache({}, doc)


class _ForeignCache:
    """A cache class outside the trusted packages: restore could never find it."""

    @property
    def state(self) -> Any:
        return (mx.zeros((1,)), 0)


def test_str_and_int_subclasses_are_saved_as_plain_values() -> None:
    # The layers JSON is built on the client's I/O thread after save() returned:
    # values msgspec would refuse there must already be plain (str enums, ...).
    import enum

    class Name(str):
        pass

    class Mode(str, enum.Enum):
        FULL = "full"

    class Level(enum.IntEnum):
        TWO = 2

    c = L.ArraysCache(size=4)
    c[0] = mx.ones((1, 2))
    c[1] = Name("plain")
    c[2] = Mode.FULL
    c[3] = Level.TWO
    snap, (got,) = roundtrip([c])
    assert got.cache[1:] == ["plain", "full", 2]
    assert [type(v) for v in got.cache[1:]] == [str, str, int]


def test_snapshot_refuses_what_restore_could_not_rebuild() -> None:
    with pytest.raises(CodecError, match="not inside"):
        snapshot_cache([_ForeignCache()])
    c = L.ArraysCache(size=1)
    c[0] = object()
    with pytest.raises(CodecError, match="cannot encode"):
        snapshot_cache([c])
    # mlx-vlm: the state of an empty quantized or chunked layer raises; the
    # refusal says why instead of only passing the AttributeError on.
    for empty in (V.QuantizedKVCache(), V.ChunkedKVCache(8)):
        with pytest.raises(CodecError, match=r"cannot read the state of .*: the layer is empty "
                           r"\(no tokens yet\)"):
            snapshot_cache([empty])
    # A layer whose state fails while it holds tokens is not called empty.
    broken = V.ChunkedKVCache(8)
    broken.update_and_fetch(_rows(4, 1), _rows(4, 1))
    broken.keys = "not rows"
    with pytest.raises(CodecError, match="cannot read the state of ChunkedKVCache") as raised:
        snapshot_cache([broken])
    assert "empty" not in str(raised.value)
    # mlx-lm 0.32's DeepSeek V4.1 layer: a read-only state and no from_state.
    # It was saved (flush True), and every load of it was a miss. A class of
    # that shape in a module of its own stands in for it under mlx-lm 0.31.
    stand_in = ModuleType("mlx_lm.models._kvkeeper_test_layer")

    class LayerCache:
        @property
        def state(self) -> tuple[mx.array]:
            return (mx.zeros((1, 2, 4)),)

    LayerCache.__module__, LayerCache.__qualname__ = stand_in.__name__, "LayerCache"
    stand_in.LayerCache = LayerCache  # type: ignore[attr-defined]
    sys.modules[stand_in.__name__] = stand_in
    try:
        with pytest.raises(CodecError, match="cannot rebuild it"):
            snapshot_cache([LayerCache()])
    finally:
        del sys.modules[stand_in.__name__]


# ---------------------------------------------------------------------------
# mlx-lm 0.32's DeepSeek V4.1 LayerCache, which kvkeeper rebuilds itself

# The real model under mlx-lm 0.32; 0.31 (the newest for Python 3.10) has none.
DEEPSEEK_V41 = not MLX_LM_OLD_API
needs_deepseek = pytest.mark.skipif(not DEEPSEEK_V41, reason="mlx-lm 0.31 has no DeepSeek V4.1")


@pytest.fixture(scope="module")
def deepseek() -> Any:
    return tiny_deepseek_v41()


@needs_deepseek
@pytest.mark.parametrize("n_prompt, steps_before", [(5, 0), (40, 0), (40, 3)])
def test_deepseek_v41_output_identical_after_restore(
    deepseek: Any, n_prompt: int, steps_before: int
) -> None:
    """Its window, compressed groups, index keys and open group come back:
    the restored cache gives bit-identical logits and the same tokens. Before,
    save() refused it (mlx-lm's own load_prompt_cache cannot rebuild it)."""
    cache = deepseek.make_cache()
    nxt = int(mx.argmax(prefill(deepseek, prompt(n_prompt), cache)).item())
    if steps_before:
        nxt = greedy_decode(deepseek, cache, nxt, steps_before)[-1]
    fields = {name for c in cache for name, v in vars(c).items() if v is not None}
    assert n_prompt < 8 or fields >= {"window", "compress_kv", "index_k", "pending_kv"}
    snap = snapshot_cache(cache)
    doc = json.loads(snap.layers)
    # Older readers know versions 1 and 2: they refuse the file instead of
    # failing on the class.
    assert doc["version"] == 3 == LAYERS_VERSION
    restored = restore_cache(arrays_from_snapshot(snap), snap.layers)
    assert [type(c) for c in restored] == [type(c) for c in cache]
    assert [(c.window_size, c.offset) for c in restored] == [(8, n_prompt + steps_before)] * 8
    a, b = prefill(deepseek, [nxt], cache), prefill(deepseek, [nxt], restored)
    assert mx.array_equal(a, b).item(), "next-token logits differ after restore"
    first = int(mx.argmax(a).item())
    assert greedy_decode(deepseek, cache, first, 12) == greedy_decode(deepseek, restored, first, 12)


@needs_deepseek
def test_deepseek_v41_checks_have_teeth_and_bad_descriptions_are_refused(deepseek: Any) -> None:
    cache = deepseek.make_cache()
    prefill(deepseek, prompt(30), cache)
    snap = snapshot_cache(cache)
    arrays = arrays_from_snapshot(snap)
    doc = json.loads(snap.layers)
    # Each saved field matters: changed, the next logits change. Layer 3
    # pools 4 tokens (7 groups, 2 open: two more tokens close the group)
    # and indexes them; layer 1 pools 16.
    want = prefill(deepseek, [1, 2], restore_cache(arrays, snap.layers))
    for layer, field in [(3, f) for f in ("window", "compress_kv", "index_k", "pending_kv",
                                          "pending_gate")] + [(1, "compress_kv"), (1, "index_k")]:
        (name,) = [v["name"] for k, v in doc["layers"][layer]["state"]["items"] if k == field]
        bent = dict(arrays, **{name: arrays[name] * -1})
        got = prefill(deepseek, [1, 2], restore_cache(bent, snap.layers))
        assert not mx.array_equal(want, got).item(), (layer, field)

    def with_state(mutate: Callable[[dict[str, Any]], None]) -> str:
        return _state_edited(snap.layers, 3, mutate)

    for mutate in (
        lambda st: st.update(offset=5),  # fewer tokens than the window holds
        lambda st: st.update(offset=-1),
        lambda st: st.update(window_size=0),
        lambda st: st.update(window_size=True),
        lambda st: st.update(offset=30.0),
        lambda st: st.pop("index_k"),
        lambda st: st.update(extra=1),
        lambda st: st.update(window=None),
        lambda st: st.update(pending_kv=[1, 2]),
        lambda st: st.update(offset=1 << 31),
        lambda st: st.update(pending_gate=None),  # the open group's gates gone
        lambda st: st.update(pending_kv=st["index_k"], pending_gate=st["index_k"]),  # dim 16
        lambda st: st.update(pending_kv=st["window"]),  # 8 rows against the gates' 2
    ):
        with pytest.raises(CodecError, match="layer 3"):
            restore_cache(arrays, with_state(mutate))
    # Layer 3's window of the wrong kind or batch size, its reference to match.
    for bad_array in (mx.zeros((1, 8, 32), dtype=mx.int32), mx.zeros((2, 8, 32))):
        bad, name = _retyped(doc, 3, bad_array)
        with pytest.raises(CodecError, match="layer 3"):
            restore_cache(dict(arrays, **{name: bad_array}), json.dumps(bad))
    bad = json.loads(snap.layers)
    bad["layers"][0]["attrs"] = {"offset": 30}
    with pytest.raises(CodecError, match="layer 0"):
        restore_cache(arrays, json.dumps(bad))
    bad = json.loads(snap.layers)
    bad["layers"][0]["state"] = {"$": "tuple", "items": []}
    with pytest.raises(CodecError, match="layer 0"):
        restore_cache(arrays, json.dumps(bad))


def _retyped(doc: dict[str, Any], layer: int, array: mx.array) -> tuple[dict[str, Any], str]:
    """``doc`` with the reference to ``layer``'s window made to match
    ``array``, and the window's tensor name."""
    bad = json.loads(json.dumps(doc))
    ref = next(v for k, v in bad["layers"][layer]["state"]["items"] if k == "window")
    ref.update(dtype=mlx_dtype_name(array.dtype), shape=list(array.shape))
    return bad, ref["name"]


@needs_deepseek
def test_deepseek_v41_with_fields_kvkeeper_does_not_know_is_refused(deepseek: Any) -> None:
    """A later mlx-lm adding a field would have it dropped without a word:
    save() refuses such a layer, and so does a load into such a class."""
    from mlx_lm.models import deepseek_v41

    cache = deepseek.make_cache()
    prefill(deepseek, prompt(12), cache)
    snap = snapshot_cache(cache)
    cache[2].lengths = mx.array([12])
    with pytest.raises(CodecError, match=r"layer 2: LayerCache has the fields .*lengths"):
        snapshot_cache(cache)
    original = deepseek_v41.LayerCache.__init__

    def newer(self: Any, window_size: int) -> None:
        original(self, window_size)
        self.lengths = None

    def other_arguments(self: Any, window_size: int, batch_size: int) -> None:
        original(self, window_size)

    for init, message in ((newer, r"layer 0: .*another mlx-lm version"),
                          # Was a TypeError out of load() (and a Session), not a miss.
                          (other_arguments, r"layer 0: LayerCache rejected its state: TypeError")):
        deepseek_v41.LayerCache.__init__ = init  # type: ignore[method-assign]
        try:
            with pytest.raises(CodecError, match=message):
                restore_cache(arrays_from_snapshot(snap), snap.layers)
        finally:
            deepseek_v41.LayerCache.__init__ = original  # type: ignore[method-assign]


# ---------------------------------------------------------------------------
# mlx-vlm's TurboQuantKVCache, which kvkeeper rebuilds itself


def _state_edited(layers: str, layer: int, mutate: Callable[[dict[str, Any]], None]) -> str:
    """The layers description with ``layer``'s built state (a dict node) as
    ``mutate`` leaves it."""
    bad = json.loads(layers)
    state = dict(bad["layers"][layer]["state"]["items"])
    mutate(state)
    bad["layers"][layer]["state"]["items"] = [[k, v] for k, v in state.items()]
    return json.dumps(bad)


def _turbo(bits: float = 3.5, t: int = 37, heads: int = H, **kw: Any) -> Any:
    from mlx_vlm.turboquant import TurboQuantKVCache

    c = TurboQuantKVCache(bits=bits, **kw)
    shape = (1, heads, t, D)
    c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    return c


@pytest.mark.parametrize("kw, t, trim", [
    ({"bits": 3.5}, 37, 0), ({"bits": 4}, 300, 0), ({"bits": 2}, 37, 5), ({"bits": 3.5}, 1, 0),
    ({"bits": 3.5, "key_bits": 2.5}, 37, 3),  # a split codec: channels picked from the keys
], ids=["3.5", "4-grown", "2-trimmed", "3.5-one-row", "split"])
def test_turboquant_restores_its_quantized_state_and_goes_on_alike(
        kw: dict[str, float], t: int, trim: int) -> None:
    """Its from_state skipped __init__ (no codecs: AttributeError at the next
    update), and save() refused its module. The restored cache holds the
    same quantized rows and codecs (a split codec's channels too): it
    dequantizes as the original did, and quantizes the next rows alike."""
    mx.random.seed(7)
    c = _turbo(t=t, seed=11, **kw)
    c.trim(trim)
    snap = snapshot_cache([c])
    live, seen = canon(c.state), c.dequantize()
    theirs = canon(c.prefix_cache_snapshot())  # mlx-vlm's own persistence contract
    # The snapshot is the cache as it was: the original goes on first.
    for _ in range(3):
        c.update_and_fetch(mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D)))
    (r,) = restore_cache(arrays_from_snapshot(snap), snap.layers)
    assert json.loads(snap.layers)["version"] == 3
    assert (r.offset, r.bits, r.key_bits, r.value_bits, r.seed) == (t - trim, c.bits, c.key_bits,
                                                                     c.value_bits, 11)
    assert canon(r.state) == live
    assert canon(r.prefix_cache_snapshot()) == theirs
    # Before any update (mlx-vlm's prefix cache, dequantize_for_apc).
    assert all(mx.array_equal(x, y).item() for x, y in zip(r.dequantize(), seen, strict=True))
    c.trim(3)
    mx.random.seed(8)
    new = [(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))) for n in (1, 5, 1)]
    for k, v in new:
        c.update_and_fetch(k, v)
        r.update_and_fetch(k, v)
        assert canon(c.state) == canon(r.state)
        a, b = c.dequantize(), r.dequantize()
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


def test_an_empty_turboquant_cache_restores_empty() -> None:
    from mlx_vlm.turboquant import TurboQuantKVCache

    snap = snapshot_cache([TurboQuantKVCache(bits=3.5)])
    (r,) = restore_cache(arrays_from_snapshot(snap), snap.layers)
    assert r.empty() and r.offset == 0 and snap.nbytes == 0
    k = mx.random.normal((1, H, 4, D))
    r.update_and_fetch(k, k)
    assert r.offset == 4


def test_turboquant_that_cannot_be_saved_whole_is_refused() -> None:
    mx.random.seed(7)
    # A codebook of 9 bits takes about a second to make, each bit more 2.5x as long.
    big = _turbo()
    big.value_bits = 9.0
    with pytest.raises(CodecError, match=r"layer 0: .*kvkeeper saves at most 8 bits"):
        snapshot_cache([big])
    # mlx-vlm takes a negative seed (its generate never makes one); a load
    # refuses it, so save() does: never a save that no load can use.
    with pytest.raises(CodecError, match=r"layer 0: meta_state .* is out of range"):
        snapshot_cache([_turbo(3.5, seed=-5)])
    c = _turbo()
    c.lengths = None  # a field a later mlx-vlm might add
    with pytest.raises(CodecError, match=r"layer 0: TurboQuantKVCache has the fields .*another "
                                         r"mlx-vlm version"):
        snapshot_cache([c])
    from mlx_vlm.turboquant import BatchTurboQuantKVCache, HybridQuantKVCache

    # Their module gives kvkeeper only the class it builds itself.
    for cls in (BatchTurboQuantKVCache, HybridQuantKVCache):
        with pytest.raises(CodecError, match="cannot rebuild it"):
            snapshot_cache([cls.__new__(cls)])


def test_turboquant_descriptions_that_break_its_state_are_refused() -> None:
    mx.random.seed(7)
    snap = snapshot_cache([_turbo(3.5, key_bits=2.5)])
    arrays = arrays_from_snapshot(snap)

    def with_state(mutate: Callable[[dict[str, Any]], None]) -> str:
        return _state_edited(snap.layers, 0, mutate)

    def meta(i: int, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda st: st["meta_state"]["items"].__setitem__(i, value)

    def codec(name: str, i: int, value: Any) -> Callable[[dict[str, Any]], None]:
        return lambda st: st[name]["items"].__setitem__(i, value)

    for mutate in (
        meta(0, "36"),  # an offset the rows do not have
        meta(0, "-1"),
        meta(0, "x"),
        meta(0, 37),
        meta(4, "3.0"),  # 3-bit values: 8 words a row where 6 belong
        meta(3, "16.0"),  # minutes to make its codebook
        meta(2, "-1"),
        codec("value_codec", 0, 32),  # half the channels
        codec("key_codec", 1, None),  # a split codec's low channels gone
        lambda st: st.update(values=None),
        lambda st: st.pop("key_codec"),
        lambda st: st.update(extra=1),
        lambda st: st.update(keys=st["values"]),  # a split codec's rows are two states
        meta(4, "4.5"),  # fractional bits with a whole-bit codec (it would run 4)
        # A split codec's channels: the low half twice, the high never.
        lambda st: st["key_codec"]["items"].__setitem__(2, st["key_codec"]["items"][1]),
    ):
        with pytest.raises(CodecError, match="layer 0"):
            restore_cache(arrays, with_state(mutate))
    # Values of another cache with twice the heads: each side fits its codec,
    # and the next update could not broadcast one against the other.
    two = snapshot_cache([_turbo(3.5), _turbo(3.5, heads=2 * H)])
    values = dict(json.loads(two.layers)["layers"][1]["state"]["items"])["values"]
    bad = _state_edited(two.layers, 0, lambda st: st.update(values=values))
    with pytest.raises(CodecError, match="layer 0: the packed rows disagree on batch and heads"):
        restore_cache(arrays_from_snapshot(two), bad)
    bad = json.loads(snap.layers)
    bad["layers"][0]["meta_state"] = {"$": "tuple", "items": ["37"]}
    with pytest.raises(CodecError, match="layer 0"):
        restore_cache(arrays, json.dumps(bad))
    # Other classes of that module are never imported from a description.
    bad = json.loads(snap.layers)
    bad["layers"][0]["class"] = "HybridQuantKVCache"
    with pytest.raises(CodecError, match="is not a cache class"):
        restore_cache(arrays, json.dumps(bad))


def test_a_static_prefix_cache_whose_rows_disagree_with_its_offset_is_refused() -> None:
    from mlx_vlm.models.cache import StaticPrefixKVCache

    _, (empty,) = roundtrip([StaticPrefixKVCache(max_size=16)])  # nothing to give back
    assert empty.decoder_state == (None, None) and empty.meta_state[0] == "16"
    c = StaticPrefixKVCache(max_size=8)
    c.update_and_fetch(_rows_of(1, 5), _rows_of(1, 5))
    snap = snapshot_cache([c])
    for meta in (["4", "256", "5", "0"], ["8", "256", "6", "0"]):  # max_size < rows; offset
        doc = json.loads(snap.layers)
        doc["layers"][0]["meta_state"] = {"$": "tuple", "items": meta}
        with pytest.raises(CodecError, match=r"^layer 0: a StaticPrefixKVCache's keys and values "
                                             r"\(.*\) are not offset \d+ rows within max_size"):
            restore_cache(arrays_from_snapshot(snap), json.dumps(doc))
