"""Entries saved under either mlx-lm cache API load under the one installed.

mlx-lm 0.31 (the newest Python 3.10 installs) gives a layer's counters in
meta_state, mlx-lm 0.32 inside its state. A user who upgrades keeps the caches
saved before: tests/data/kvkeeper-files holds entries saved through a real
daemon under each (make.py), with what the saving mlx-lm restored them to.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import kvkeeper
from kvkeeper.client.client import Client
from kvkeeper.client.codec import CodecError, restore_cache
from kvkeeper.protocol import naming

from .conftest import RunningDaemon
from .legacy_describe import MLX_LM_OLD_API, describe

ROOT = Path(__file__).parent / "data" / "kvkeeper-files"
MANIFEST = json.loads((ROOT / "MANIFEST.json").read_text())
MODEL = "fixture-model"
OTHER_API = "mlx-lm-0.32" if MLX_LM_OLD_API else "mlx-lm-0.31"


def test_both_apis_have_every_case() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.safetensors")}
    assert files == set(MANIFEST) and len(files) == 12
    assert {k.split("/")[0] for k in files} == {"mlx-lm-0.31", "mlx-lm-0.32"}


@pytest.mark.parametrize("rel", sorted(MANIFEST))
def test_an_entry_restores_as_the_mlx_lm_that_saved_it_restored_it(rel: str) -> None:
    name = Path(rel).stem
    got = kvkeeper.read_cache_file(ROOT / rel, model=MODEL, cache_id=name)
    assert got.token_ids == list(range(37))
    assert [describe(c) for c in got.cache] == MANIFEST[rel]["layers"]


@pytest.mark.parametrize("name", ["kv", "rotating", "quantized"])
def test_an_entry_of_the_other_api_keeps_working(name: str) -> None:
    layer = kvkeeper.read_cache_file(ROOT / OTHER_API / f"{name}.safetensors").cache[0]
    before, keys = layer.offset, layer.keys
    k = mx.ones((1, 2, 1, 64), dtype=mx.bfloat16)
    got, _ = layer.update_and_fetch(k, k)
    assert layer.offset == before + 1
    if name == "kv":
        assert mx.array_equal(got[..., :before, :], keys[..., :before, :]).item()
        assert mx.array_equal(got[..., before:, :], k).item()


def test_the_daemon_serves_an_entry_saved_under_the_other_api(
    client: Client, daemon: RunningDaemon
) -> None:
    for name in ("kv", "hybrid", "cachelist"):
        dest = naming.entry_path(daemon.root, MODEL, name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / OTHER_API / f"{name}.safetensors", dest)
    client.gc()  # the daemon learns of files put under its root by rescanning it
    for name in ("kv", "hybrid", "cachelist"):
        got = client.load(MODEL, name)
        assert got is not None, name
        want = MANIFEST[f"{OTHER_API}/{name}.safetensors"]["layers"]
        assert [describe(c) for c in got.cache] == want


def _layers_of(rel: str) -> tuple[dict[str, mx.array], dict[str, object]]:
    arrays, meta = mx.load(str(ROOT / rel), return_metadata=True)
    return arrays, json.loads(meta["kvkeeper.layers"])


def test_an_arrays_cache_slot_never_written_loads_under_either_api() -> None:
    """An ArraysCache slot a model has not written is None in its state; from
    an entry saved under mlx-lm 0.31 it was refused under 0.32 as a
    "malformed ArraysCache state"."""
    for rel in ("mlx-lm-0.31/hybrid.safetensors", "mlx-lm-0.32/hybrid.safetensors"):
        arrays, doc = _layers_of(rel)
        state = doc["layers"][0]["state"]
        slots = state if type(state) is list else state["items"][0]  # 0.32: (cache, ...)
        assert [s["name"] for s in slots] == ["t0", "t1"]
        slots[0] = None
        (arrays_cache, _kv) = restore_cache(arrays, json.dumps(doc))
        assert arrays_cache.cache[0] is None, rel
        assert mx.array_equal(arrays_cache.cache[1], arrays["t1"]).item(), rel


def test_deepseek_v32_indexer_keys_of_mlx_lm_031_are_a_miss_under_032() -> None:
    """DeepSeek V3.2's indexer keeps its keys in a KVCache whose values are 0
    wide under mlx-lm 0.31; mlx-lm 0.32 changed that indexer (the keys as
    values too, and computed otherwise), and such a layer loaded under it
    failed at the model's first step (a concatenate of mismatched shapes)."""
    arrays, doc = _layers_of("mlx-lm-0.31/kv.safetensors")
    values = doc["layers"][0]["state"]["items"][1]
    arrays[values["name"]] = mx.zeros((1, 2, 37, 0), dtype=mx.bfloat16)
    values["shape"] = [1, 2, 37, 0]
    if MLX_LM_OLD_API:
        (layer, _) = restore_cache(arrays, json.dumps(doc))
        assert layer.values.shape == (1, 2, 37, 0) and layer.offset == 37
    else:
        with pytest.raises(CodecError, match="layer 0: a KVCache whose values are 0 wide is "
                                             "DeepSeek V3.2's indexer"):
            restore_cache(arrays, json.dumps(doc))


@pytest.mark.parametrize("verify", [True, False])
def test_an_old_entry_naming_a_tensor_twice_is_damage(tmp_path: Path, verify: bool) -> None:
    """Entries of kvkeeper 0.2.1 and earlier carry no checksum of their
    header: one flipped bit in a tensor's name ("t1" to "t0") served layer
    0's keys as its values, verified or not (a review). A tensor named twice
    is damage: kvkeeper never writes one."""
    src = ROOT / "mlx-lm-0.32" / "kv.safetensors"
    data = src.read_bytes()
    bad = tmp_path / "kv.safetensors"
    bad.write_bytes(data.replace(b'\\"name\\":\\"t1\\"', b'\\"name\\":\\"t0\\"', 1))
    assert bad.read_bytes() != data
    with pytest.raises(kvkeeper.CacheFileError, match="layer 0: tensor 't0' is named a second time") as err:
        kvkeeper.read_cache_file(bad, verify=verify)
    assert err.value.damaged
    kvkeeper.read_cache_file(src, verify=verify)  # the file as saved still loads
