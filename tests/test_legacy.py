"""kvkeeper.client.legacy: the gezel schema-3 and mlx-lm prompt-cache files users already have.

The fixtures in tests/data/legacy-formats were written by the formats' own
writers; MANIFEST.json says what each must restore to.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvkeeper.client.codec import CodecError, restore_cache, snapshot_cache
from kvkeeper.client.legacy import (
    GEZEL_SCHEMA3,
    MLX_LM_PROMPT_CACHE,
    LegacyCache,
    decode_legacy,
    detect_legacy,
)

from .legacy_describe import MLX_LM_OLD_API, describe
from .legacy_describe import digest as array_digest
from .tiny import arrays_from_snapshot

ROOT = Path(__file__).parent / "data" / "legacy-formats"
MANIFEST: dict[str, Any] = json.loads((ROOT / "MANIFEST.json").read_text())


def load(rel: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    return mx.load(str(ROOT / rel), return_metadata=True)


def digest(layers: list[Any]) -> list[list[Any]]:
    """Every leaf of [layer.state ...] as MANIFEST.json records it."""
    leaves: list[list[Any]] = []
    for path, v in tree_flatten([c.state for c in layers]):
        if isinstance(v, mx.array):
            leaves.append([path, *array_digest(v)])
        else:
            leaves.append([path, "scalar", None, v])
    return leaves


def test_manifest_covers_every_fixture() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.safetensors")}
    assert files == set(MANIFEST) and len(files) == 18


#: Files in the layout of mlx-lm 0.31 and earlier (written by its own
#: save_prompt_cache; tests/data/legacy-formats/make_mlx_lm_031.py).
#: Its ChunkedKVCache had trimmed its front: see the test after the next.
OLD_CHUNKED = "mlx-lm-0.31/chunked.safetensors"
OLD_MLX_LM = sorted(k for k, v in MANIFEST.items()
                    if v.get("layout") == "mlx-lm 0.31" and k != OLD_CHUNKED)
#: Every fixture a load restores.
READABLE = sorted(set(MANIFEST) - {OLD_CHUNKED})


@pytest.mark.parametrize("rel", OLD_MLX_LM)
def test_mlx_lm_031_file_restores_as_its_own_loader_did(rel: str) -> None:
    want = MANIFEST[rel]
    arrays, metadata = load(rel)
    assert detect_legacy(metadata) == MLX_LM_PROMPT_CACHE
    got = decode_legacy(arrays, metadata)
    assert got.format == MLX_LM_PROMPT_CACHE and got.metadata == want["metadata"]
    assert got.token_ids is None and got.model_fingerprint is None
    assert [type(c).__module__ for c in got.layers] == ["mlx_lm.models.cache"] * len(got.layers)
    assert [describe(c) for c in got.layers] == want["layers"]


def test_an_mlx_lm_031_chunked_cache_trimmed_at_the_front_is_refused() -> None:
    """mlx-lm 0.31 saves a ChunkedKVCache as its buffer up to the offset and
    (chunk_size, start_position), and its file no token count: once the front
    is trimmed, nothing tells the offset, and its own loader takes the row
    count for it (here 16 rows for 37 tokens, start_position 240: the positions of
    every later token wrong). A miss instead of that cache; the same layer
    before any trim still loads."""
    want = MANIFEST[OLD_CHUNKED]["layers"][0]["counters"]
    assert (want["offset"], want["start_position"]) == (16, 240)  # mlx-lm 0.31's own restore
    arrays, metadata = load(OLD_CHUNKED)
    with pytest.raises(CodecError, match=r"layer 0: a ChunkedKVCache whose front was trimmed "
                                         r"\(start_position 240\)"):
        decode_legacy(arrays, metadata)
    (layer,) = decode_legacy(arrays, {**metadata, "0.0.1": "0"}).layers
    assert (type(layer).__name__, layer.offset, layer.start_position) == ("ChunkedKVCache", 16, 0)


@pytest.mark.parametrize("tokens", [40, 300])
def test_a_cache_persist_chunked_cache_trimmed_at_the_front_takes_its_token_count(
        tokens: int) -> None:
    """mlx-vlm's ChunkedKVCache (state and meta_state as mlx-lm 0.31's) saved
    by cache_persist past its chunk: its state is its buffer cut at the
    offset, or the whole buffer once that is shorter (300 tokens here), but
    the file's token count is the offset. Restored with it, the cache goes on
    exactly as the original; a token count the rows cannot hold is refused."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models.cache import ChunkedKVCache

    c = ChunkedKVCache(chunk_size=16)
    for i in range(tokens):
        c.maybe_trim_front()
        c.update_and_fetch(_row(i), _row(i))
    rows = c.state[0].shape[2]
    assert c.start_position > 0 and (rows == tokens if tokens == 40 else rows < tokens)
    arrays = dict(tree_flatten([list(c.state)]))
    metadata = {"schema_version": "3", "model_fingerprint": "fp", "state_scalars": "{}",
                "token_ids": json.dumps(list(range(tokens))), "token_count": str(tokens),
                "classes": '["ChunkedKVCache"]', "class_modules": '["mlx_vlm.models.cache"]',
                "meta_state": json.dumps([list(c.meta_state)])}
    (got,) = decode_legacy(arrays, metadata).layers
    assert (got.offset, got.start_position) == (c.offset, c.start_position)
    start = c.start_position
    for i in range(60):
        c.maybe_trim_front()
        got.maybe_trim_front()
        want, have = c.update_and_fetch(_row(1000 + i), _row(1000 + i)), \
            got.update_and_fetch(_row(1000 + i), _row(1000 + i))
        assert all(mx.array_equal(a, b).item() for a, b in zip(want, have, strict=True)), i
    short = {**metadata, "token_ids": json.dumps(list(range(start - 1)))}
    with pytest.raises(CodecError, match="cannot hold"):
        decode_legacy(arrays, short)


def _row(seed: int) -> mx.array:
    return mx.random.normal((1, 2, 1, 8), key=mx.random.key(seed))


@pytest.mark.parametrize("rel", ["mlx-lm-0.31/kv.safetensors", "mlx-lm-0.31/rotating.safetensors",
                                 "mlx-lm-0.31/quantized.safetensors"])
def test_a_restored_mlx_lm_031_cache_keeps_working(rel: str) -> None:
    layer = decode_legacy(*load(rel)).layers[0]
    before = layer.offset
    k = mx.ones((1, 2, 1, 64), dtype=mx.bfloat16)
    keys, _ = layer.update_and_fetch(k, k)
    assert layer.offset == before + 1
    if rel.endswith("kv.safetensors"):
        stored = load(rel)[0]["0.0"]
        assert mx.array_equal(keys[..., :before, :], stored).item()
        assert mx.array_equal(keys[..., before:, :], k).item()


@pytest.mark.parametrize("rel", sorted(set(READABLE) - set(OLD_MLX_LM)))
def test_fixture_restores_to_manifest(rel: str) -> None:
    want = MANIFEST[rel]
    arrays, metadata = load(rel)
    assert detect_legacy(metadata) == want["format"]
    got = decode_legacy(arrays, metadata)
    assert isinstance(got, LegacyCache) and got.format == want["format"]
    assert [type(c).__name__ for c in got.layers] == want["classes"]
    package = "mlx_vlm." if want["format"] == GEZEL_SCHEMA3 else "mlx_lm."
    assert all(type(c).__module__.startswith(package) for c in got.layers)
    if "layers" in want:  # as mlx-lm's own loader restores it, under either API
        assert [describe(c) for c in got.layers] == want["layers"]
    if not (MLX_LM_OLD_API and want["format"] == MLX_LM_PROMPT_CACHE):
        assert digest(got.layers) == want["leaves"]  # the states as mlx-lm 0.32 gives them
    if want["format"] == GEZEL_SCHEMA3:
        assert got.token_ids == want["token_ids"]
        assert got.model_fingerprint == want["model_fingerprint"]
        assert got.metadata == metadata
    else:
        assert got.format == MLX_LM_PROMPT_CACHE
        assert got.token_ids is None and got.model_fingerprint is None
        assert got.metadata == want["metadata"]


@pytest.mark.parametrize("rel", ["gezel-schema3/fp-demo/kv.safetensors", "mlx-lm/kv.safetensors"])
def test_decoded_cache_keeps_working(rel: str) -> None:
    got = decode_legacy(*load(rel)).layers[0]
    before = np.array(got.state[0].view(mx.uint16))[..., :37, :]
    k = mx.ones((1, 2, 1, 64), dtype=mx.bfloat16)
    keys, _ = got.update_and_fetch(k, k)
    assert keys.shape == (1, 2, 38, 64) and got.offset == 38
    assert np.array_equal(np.array(keys.view(mx.uint16))[..., :37, :], before)


@pytest.mark.parametrize("rel", READABLE)
def test_legacy_to_kvkeeper_roundtrip(rel: str) -> None:
    # What an import does: decode the old file, snapshot, restore.
    layers = decode_legacy(*load(rel)).layers
    snap = snapshot_cache(layers)
    again = restore_cache(arrays_from_snapshot(snap), snap.layers)
    assert [type(c) for c in again] == [type(c) for c in layers]
    for (p1, a), (p2, b) in zip(
        tree_flatten([c.state for c in layers]), tree_flatten([c.state for c in again]), strict=True
    ):
        assert p1 == p2
        if isinstance(a, mx.array):
            # mlx-lm states carry spare capacity, which kvkeeper drops.
            kept = a[..., : b.shape[-2], :] if a.ndim >= 2 else a
            assert b.dtype == a.dtype and b.shape == kept.shape
            assert mx.array_equal(b, kept).item()
        else:
            assert a == b


def test_detect_rejects_other_metadata() -> None:
    assert detect_legacy({}) is None
    assert detect_legacy({"kvkeeper.layers": "{}"}) is None
    assert detect_legacy({"schema_version": "2", "classes": "[]", "class_modules": "[]"}) is None
    assert detect_legacy({"2.0": "", "1.0": "KVCache", "other": "x"}) is None
    # The mlx-lm 0.31 layout: classes under 2.<i>, numbered from 0, named as classes.
    assert detect_legacy({"2.0": "KVCache", "0.0": ""}) == MLX_LM_PROMPT_CACHE
    assert detect_legacy({"2.0": "KVCache", "0.0": "", "format": "pt"}) is None
    assert detect_legacy({"2.1": "KVCache", "0.0": ""}) is None
    assert detect_legacy({"2.0": "not a class", "0.0": ""}) is None
    with pytest.raises(CodecError, match="not a known legacy"):
        decode_legacy({}, {"format": "pt"})


def _gezel(**changes: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    arrays, metadata = load("gezel-schema3/fp-demo/rotating.safetensors")
    return arrays, {**metadata, **changes}


def _mlx_lm(**changes: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    arrays, metadata = load("mlx-lm/cachelist.safetensors")
    return arrays, {**metadata, **changes}


def _old(drop: tuple[str, ...] = (), **changes: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    arrays, metadata = load("mlx-lm-0.31/rotating.safetensors")
    return arrays, {k: v for k, v in {**metadata, **changes}.items() if k not in drop}


HOSTILE = [
    _gezel(classes='["system", "KVCache"]', class_modules='["os", "mlx_vlm.models.cache"]'),
    _gezel(classes='["eval", "KVCache"]', class_modules='["builtins", "builtins"]'),
    _gezel(classes='["KVCache", "mx"]'),
    _gezel(
        class_modules='["mlx_vlm.modelsX.cache", "mlx_lm.models.no_such_module"]',
        classes='["Foo", "Bar"]',
    ),
    _gezel(classes='["__class__", "KVCache"]'),
    _mlx_lm(**{"1.0": "os"}),
    _mlx_lm(**{"1.0": "__builtins__"}),
    _mlx_lm(**{"1.0": "tree_map"}),
    _old(**{"2.0": "os"}),
    _old(**{"2.1": "tree_map"}),
    _mlx_lm(**{"0.1.1": "system"}),  # user metadata does not name classes: still decodes
]


@pytest.mark.parametrize("case", range(len(HOSTILE)))
def test_hostile_class_names_are_refused_without_imports(case: int) -> None:
    arrays, metadata = HOSTILE[case]
    before = set(sys.modules)
    if case == len(HOSTILE) - 1:
        decode_legacy(arrays, metadata)
    else:
        with pytest.raises(CodecError):
            decode_legacy(arrays, metadata)
    assert set(sys.modules) == before


def test_hostile_cachelist_child_names_are_refused() -> None:
    # mlx-lm CacheList names its children inside the state: ((state, name), ...).
    arrays, metadata = load("mlx-lm/cachelist.safetensors")
    scalar = next(k for k, v in metadata.items() if v == "0.0.1")
    assert metadata[scalar[:-1] + "1"] == "string"
    arrays = dict(arrays)
    arrays["0.0.1"] = mx.array([ord(c) for c in "deque"])
    with pytest.raises(CodecError, match="deque"):
        decode_legacy(arrays, metadata)
    # ... and mlx-vlm's in meta_state.
    arrays, metadata = load("gezel-schema3/fp-demo/cachelist.safetensors")
    meta = json.loads(metadata["meta_state"])
    meta[0][0][0] = "create_causal_mask"
    with pytest.raises(CodecError, match="create_causal_mask"):
        decode_legacy(arrays, {**metadata, "meta_state": json.dumps(meta)})


@pytest.mark.parametrize(
    "broken",
    [
        _gezel(classes="[not json"),
        _gezel(classes='["RotatingKVCache"]'),
        _gezel(token_ids='["a"]'),
        _gezel(state_scalars='{"0.0": 1}'),  # a path that is also an array
        _gezel(meta_state='[["1"], ""]'),  # RotatingKVCache needs four meta values
        _mlx_lm(**{"2.1.1": "pickle"}),
        _mlx_lm(**{"2.9.0": "0.0.0.2"}),
        _old(**{"0.0.3": "nine"}),  # RotatingKVCache counters are numbers
        _old(drop=("0.0.3",)),  # ... four of them
        _old(drop=("0.1",)),  # every layer has a meta state ("" for none)
        _old(**{"0.2": ""}),  # ... and no more layers than classes
        _old(drop=("2.1",)),  # a class per layer of arrays
    ],
)
def test_broken_legacy_metadata_raises_codec_error(
    broken: tuple[dict[str, mx.array], dict[str, str]],
) -> None:
    with pytest.raises(CodecError):
        decode_legacy(*broken)


def test_a_layer_its_class_refuses_is_named() -> None:
    with pytest.raises(CodecError, match=r"^layer 0: mlx_vlm\.models\.cache\.RotatingKVCache "
                                         r"rejected its state"):
        decode_legacy(*_gezel(meta_state='[["1"], ""]'))


def test_missing_array_raises_codec_error() -> None:
    arrays, metadata = load("mlx-lm/kv.safetensors")
    del arrays["0.2"]  # offset scalar
    with pytest.raises(CodecError):
        decode_legacy(arrays, metadata)


def test_gezel_file_of_mlx_lm_caches() -> None:
    # cache_persist could write mlx-lm caches (meta_state {} and the scalars in
    # state_scalars) but not read them back (it called from_state(state, meta)).
    arrays, _ = load("mlx-lm/kv.safetensors")
    metadata = {
        "schema_version": "3",
        "classes": '["KVCache", "KVCache"]',
        "class_modules": '["mlx_lm.models.cache", "mlx_lm.models.cache"]',
        "meta_state": "[{}, {}]",
        "state_scalars": '{"0.2": 37, "1.2": 37}',
        "token_ids": "[1, 2, 3]",
        "model_fingerprint": "fp-x",
    }
    arrays = {k: v for k, v in arrays.items() if k not in ("0.2", "1.2")}
    got = decode_legacy(arrays, metadata)
    assert got.format == GEZEL_SCHEMA3 and got.token_ids == [1, 2, 3]
    want = MANIFEST["mlx-lm/kv.safetensors"]
    assert [describe(c) for c in got.layers] == want["layers"]
    if not MLX_LM_OLD_API:
        assert digest(got.layers) == want["leaves"]
    assert all(type(c).__module__ == "mlx_lm.models.cache" for c in got.layers)
    assert not any("meta_state" in vars(c) for c in got.layers)
    # A meta_state beside a state of mlx-lm 0.32's shape: refused either way.
    with pytest.raises(CodecError, match="rejected its state" if MLX_LM_OLD_API
                       else "no meta_state"):
        decode_legacy(arrays, {**metadata, "meta_state": '[["1"], {}]'})


def test_nested_exported_metadata_is_dropped_not_raised(tmp_path: Path) -> None:
    """An mlx-lm file whose kvkeeper_metadata is nested thousands deep: its
    metadata was parsed outside the legacy decoder's guard and RecursionError
    escaped read_cache_file; now the value is dropped and the cache opens."""
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    import kvkeeper

    c = KVCache()
    x = mx.ones((1, 2, 4, 8))
    c.update_and_fetch(x, x)
    path = tmp_path / "deep.safetensors"
    save_prompt_cache(str(path), [c], {"kvkeeper_model": "m", "kvkeeper_cache_id": "k",
                                       "kvkeeper_metadata": "[" * 100_000 + "]" * 100_000})
    got = kvkeeper.read_cache_file(path)
    assert got.model == "m" and got.cache[0].offset == 4
    assert "kvkeeper_metadata" not in got.metadata
