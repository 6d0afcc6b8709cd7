"""A client process for the many-clients test (importable by multiprocessing)."""

from __future__ import annotations

import random
import time
from pathlib import Path

FP = "load-model"


def client_worker(idx: int, sock: str, seconds: float, seed: int) -> dict:
    """Mix saves, loads and deletes on a private key and a shared one.

    Returns what it checked and what the daemon confirmed, so the parent can
    verify nothing confirmed was lost."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvkeeper.client.client import Client

    rng = random.Random(seed)

    def cache(version: int) -> list[KVCache]:
        c = KVCache()
        x = mx.full((1, 4, rng.choice([16, 64, 256]), 64), float(version % 256), dtype=mx.bfloat16)
        c.update_and_fetch(x, x)
        return [c]

    private = f"private-{idx}"
    out = {"ops": 0, "own_reads": 0, "confirmed_private": None, "deleted_last": False,
           "shared_sent": [], "errors": []}
    last_private = None
    with Client(Path(sock), timeout=30) as kv:
        deadline = time.monotonic() + seconds
        v = idx * 1_000_000
        while time.monotonic() < deadline:
            v += 1
            op = rng.random()
            out["ops"] += 1
            if op < 0.45:
                if kv.save(FP, private, cache(v), [v]):
                    last_private = v
                    out["deleted_last"] = False
                    got = kv.load(FP, private)  # read-your-writes
                    if got is None or got.token_ids != [v]:
                        out["errors"].append(f"own write v{v} read back as {got and got.token_ids}")
                    out["own_reads"] += 1
            elif op < 0.75:
                if kv.save(FP, "shared", cache(v), [v]):
                    out["shared_sent"].append(v)
                got = kv.load(FP, "shared")
                if got is not None and got.token_ids is None:
                    out["errors"].append("shared entry without token ids")
            elif op < 0.85:
                kv.delete(FP, private)
                out["deleted_last"] = True
                last_private = None
                if kv.load(FP, private) is not None:
                    out["errors"].append("deleted entry still loads")
            else:
                if kv.flush(timeout=30):
                    out["confirmed_private"] = last_private
        if kv.flush(timeout=30):
            out["confirmed_private"] = last_private
    return out
