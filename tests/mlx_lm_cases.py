"""Caches of every mlx-lm class the fixture writers save (the same code
builds them under mlx-lm 0.31 and 0.32)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

TOKENS = 37


def fill(layer: Any, seed: int, tokens: int = TOKENS, step: int = 1) -> Any:
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
