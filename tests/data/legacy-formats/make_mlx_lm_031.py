"""Writes the mlx-lm-0.31/ fixtures: prompt-cache files in the layout
mlx-lm 0.31 and earlier wrote (metadata ``[meta_states, user, classes]``),
and their entries in MANIFEST.json, described as mlx-lm 0.31's own
load_prompt_cache restores them (see ``describe``).

Run with mlx-lm 0.31.x installed (Python 3.10 gets no later one), from the
repository root: ``python tests/data/legacy-formats/make_mlx_lm_031.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.legacy_describe import describe  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE / "mlx-lm-0.31"
TOKENS = 37


def fill(layer, seed: int, tokens: int = TOKENS, step: int = 1):  # noqa: ANN001, ANN201
    mx.random.seed(seed)
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        k = mx.random.normal((1, 2, n, 64)).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, n, 64)).astype(mx.bfloat16)
        layer.update_and_fetch(k, v)
    return layer


def arrays(seed: int) -> ArraysCache:
    mx.random.seed(seed)
    c = ArraysCache(size=2)
    c[0] = mx.random.normal((1, 3, 8))
    c[1] = mx.random.normal((1, 4, 16))
    return c


def chunked(seed: int) -> ChunkedKVCache:
    c = fill(ChunkedKVCache(chunk_size=16), seed)
    c.maybe_trim_front()
    return c


CASES = {
    "kv": lambda: [fill(KVCache(), 1), fill(KVCache(), 2)],
    # 37 tokens one at a time into 32 slots, 4 kept: wrapped.
    "rotating": lambda: [fill(RotatingKVCache(max_size=32, keep=4), 3), fill(KVCache(), 4)],
    "quantized": lambda: [fill(QuantizedKVCache(group_size=32, bits=8), 5),
                          fill(QuantizedKVCache(group_size=64, bits=4), 6)],
    "hybrid": lambda: [arrays(7), fill(KVCache(), 8)],
    "chunked": lambda: [chunked(9)],
    "cachelist": lambda: [CacheList(fill(KVCache(), 10), fill(RotatingKVCache(max_size=64), 11))],
}


def main() -> None:
    assert mlx_lm.__version__.startswith("0.31."), mlx_lm.__version__
    OUT.mkdir(exist_ok=True)
    manifest_path = HERE / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    for name, make in CASES.items():
        path = OUT / f"{name}.safetensors"
        user = {"note": f"fixture {name} (mlx-lm {mlx_lm.__version__})"}
        save_prompt_cache(str(path), make(), user)
        restored, meta = load_prompt_cache(str(path), return_metadata=True)
        manifest[f"mlx-lm-0.31/{name}.safetensors"] = {
            "format": "mlx-lm-prompt-cache",
            "layout": "mlx-lm 0.31",
            "metadata": meta,
            "classes": [type(c).__name__ for c in restored],
            "layers": [describe(c) for c in restored],
        }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
