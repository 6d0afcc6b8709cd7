"""Case 5, resume: time to the first token of a continued conversation, restoring
the cache from kvkeeper (verified load) + one decode step, against re-prefilling
the same tokens, on the tiny mlx-lm model."""

from __future__ import annotations

import gc
import time
from typing import Any

import mlx.core as mx

from benchmarks.common import (
    MODEL,
    WAIT,
    cache_nbytes,
    free_memory,
    summarize,
    tiny_model,
    token_ids,
)


def _one_length(ctx: Any, model: Any, n: int) -> dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    prof, kv = ctx.profile, ctx.kv
    key = f"resume-{n}"
    toks = token_ids(n, seed=41 + n)
    nxt = (toks[-1] + 1) % 1000  # the continuation's first new token
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([toks]), cache=cache))
    nbytes = cache_nbytes(cache)
    if not (kv.save(MODEL, key, cache, toks) and kv.flush(WAIT)):
        raise RuntimeError("resume: the save was not written")
    # The token the continuation produces, from the live cache.
    want = int(mx.argmax(model(mx.array([[nxt]]), cache=cache)[0, -1]).item())
    del cache

    def prefill() -> int:
        # As mlx-lm's generate_step prefills: the conversation into the
        # cache (its state evaluated), then one step with the new token.
        # Through the model at once, the output layer ran on every position:
        # 15-20 % more at 1024 tokens (an audit).
        c = make_prompt_cache(model)
        model(mx.array([toks]), cache=c)
        mx.eval([layer.state for layer in c])
        logits = model(mx.array([[nxt]]), cache=c)[0, -1]
        return int(mx.argmax(logits).item())

    def restore() -> int:
        got = kv.load(MODEL, key)
        if got is None:
            raise RuntimeError("resume: load missed")
        logits = model(mx.array([[nxt]]), cache=got.cache)[0, -1]
        return int(mx.argmax(logits).item())

    # The live cache's prefill above warmed the same kernels (one token
    # fewer): a second one would add 12 s at 2048 tokens here and nothing else.
    restore()  # warm-up
    pre, res, restored = [], [], set()
    for r in range(prof.resume_reps):
        for which in (("prefill", "restore") if r % 2 == 0 else ("restore", "prefill")):
            gc.collect()
            t0 = time.perf_counter()
            if which == "prefill":
                prefill()
                pre.append(time.perf_counter() - t0)
            else:
                restored.add(restore())
                res.append(time.perf_counter() - t0)
    kv.delete(MODEL, key)
    p, q = summarize(pre), summarize(res)
    return {
        "tokens": n,
        "cache_bytes": nbytes,
        "reprefill": p,
        "restore_plus_step": q,
        "ratio_reprefill_over_restore": p["median"] / q["median"],
        "restored_token_matches_live_cache": restored == {want},
    }


def run(ctx: Any) -> dict[str, Any]:
    prof = ctx.profile
    model = tiny_model()
    lengths = []
    for n in prof.resume_lengths:
        ctx.log(f"  resume: {n} tokens")
        lengths.append(_one_length(ctx, model, n))
        free_memory()
    return {"model": "mlx-lm llama: 4 layers, hidden 256, bf16, random weights",
            "lengths": lengths}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    return [{
        "case": "5 resume",
        "target": "report the re-prefill / restore ratio per length (no fixed target)",
        "measured": {str(x["tokens"]): x["ratio_reprefill_over_restore"] for x in res["lengths"]},
        "met": None,
    }]
