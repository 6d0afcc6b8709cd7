"""Write the kvkeeper 0.2.0 fixtures in this directory (run once, by hand).

kvkeeper 0.2.0 (57f3415, the commit before 59a24c2) saved two mlx-vlm caches in a
way no later version does and no version can restore exactly: a
ChunkedKVCache whose front was trimmed (no record of its offset) and a
wrapped BufferedRotatingKVCache with keep > 0 (only the rows up to its
write index). 0.2.2 refuses those two entries; the other two files are
the same classes in states 0.2.0 saved correctly, which must still load.

    git worktree add /tmp/v020 57f3415
    cd /tmp/v020 && PYTHONPATH=/tmp/v020 python -m kvkeeper serve --root /tmp/r020 --socket /tmp/s020 &
    PYTHONPATH=/tmp/v020 python <this file> /tmp/s020
    cp /tmp/r020/sessions/fp-test/*.safetensors <this directory>

``build`` is imported by the tests, which rebuild each original to compare.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx_vlm.models.cache as V

MODEL = "fp-test"


def rows(n: int, seed: int) -> mx.array:
    mx.random.seed(seed)
    return mx.random.normal((1, 2, n, 64)).astype(mx.bfloat16)


def _chunked_trimmed() -> Any:
    c = V.ChunkedKVCache(chunk_size=16)
    c.update_and_fetch(rows(40, 1), rows(40, 2))
    c.maybe_trim_front()
    for i in range(5):
        c.update_and_fetch(rows(1, 10 + i), rows(1, 20 + i))
        c.maybe_trim_front()
    return c


def _buffered_wrapped() -> Any:
    c = V.BufferedRotatingKVCache(max_size=32, keep=4, buffer_size=8)
    c.update_and_fetch(rows(40, 1), rows(40, 2))
    for i in range(5):
        c.update_and_fetch(rows(1, 10 + i), rows(1, 20 + i))
    return c


def _filled(c: Any) -> Any:
    c.update_and_fetch(rows(37, 1), rows(37, 1001))
    return c


#: cache id -> (a builder of the one-layer cache, whether 0.2.2 must refuse it).
CASES = {
    "vlm-chunked-trimmed": (_chunked_trimmed, True),
    "vlm-buffered-wrapped": (_buffered_wrapped, True),
    "vlm-chunked": (lambda: _filled(V.ChunkedKVCache(chunk_size=256)), False),
    "vlm-buffered": (lambda: _filled(V.BufferedRotatingKVCache(max_size=64, keep=4)), False),
}


def build(cache_id: str) -> list[Any]:
    """The cache as it was saved (a fresh build: the same seeds, the same rows)."""
    return [CASES[cache_id][0]()]


def main(socket: str) -> None:
    import kvkeeper
    from kvkeeper import Client

    assert kvkeeper.__version__ == "0.2.0", kvkeeper.__version__
    with Client(socket=socket) as kv:
        for cache_id in CASES:
            layers = build(cache_id)
            assert kv.save(MODEL, cache_id, layers, list(range(layers[0].offset)))
        assert kv.flush(60)


if __name__ == "__main__":
    main(sys.argv[1])
