"""Case 2, cost to generation: decode throughput of a real (tiny) mlx-lm model with
a write-behind save every 16 tokens against no saves, and what the first decode
step after a save pays (the copy a snapshot can cause), also at the Llama-3-8B shape."""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from benchmarks.common import (
    MODEL,
    WAIT,
    free_memory,
    kv_cache,
    paired_median,
    summarize,
    tiny_model,
    token_ids,
)


def _decode_run(model: Any, prompt: list[int], n: int, kv: Any | None, every: int) -> dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    mx.eval(logits)
    token = int(mx.argmax(logits).item())
    seq = list(prompt) + [token]
    steps, after_save, saves, oks = [], [], [], []
    just_saved = False
    t_start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        token = int(mx.argmax(logits).item())
        dt = time.perf_counter() - t0
        (after_save if just_saved else steps).append(dt)
        just_saved = False
        seq.append(token)
        if kv is not None and (i + 1) % every == 0:
            s0 = time.perf_counter()
            oks.append(kv.save(MODEL, "generation", cache, seq))
            saves.append(time.perf_counter() - s0)
            just_saved = True
    wall = time.perf_counter() - t_start
    return {"tokens_per_s": n / wall, "wall_s": wall, "steps": steps, "after_save": after_save,
            "saves": saves, "handed_off": sum(bool(o) for o in oks), "tokens": seq[len(prompt):]}


def _daemon_cpu(ctx: Any) -> float:
    import psutil

    t = psutil.Process(ctx.daemon.pid).cpu_times()
    return t.user + t.system


def _timed(runs: list[dict[str, Any]]) -> float:
    """Seconds the runs took, each with its closing flush()."""
    return sum(x["wall_s"] + x["flush_s"] for x in runs)


def _tiny_model_case(ctx: Any) -> dict[str, Any]:
    prof, kv = ctx.profile, ctx.kv
    model = tiny_model()
    prompt = token_ids(prof.gen_prompt, seed=11)
    _decode_run(model, prompt, prof.gen_decode, None, prof.gen_save_every)  # warm-up
    _decode_run(model, prompt, prof.gen_decode, kv, prof.gen_save_every)
    kv.flush(WAIT)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "save": []}
    daemon_cpu = {"off": 0.0, "save": 0.0}
    before = kv.stats()
    for r in range(prof.gen_runs):
        order = ("off", "save") if r % 2 == 0 else ("save", "off")
        for mode in order:
            c0 = _daemon_cpu(ctx)
            run = _decode_run(model, prompt, prof.gen_decode,
                              kv if mode == "save" else None, prof.gen_save_every)
            # The next run starts with the daemon idle. The last save of a
            # run is sent, written and fsynced here, after the decode's
            # clock stopped: timed too, so that the run's whole cost can
            # be judged (with the fsync's wait in it: an upper bound).
            f0 = time.perf_counter()
            kv.flush(WAIT)
            run["flush_s"] = time.perf_counter() - f0
            run["tokens_per_s_through_flush"] = prof.gen_decode / (run["wall_s"] + run["flush_s"])
            daemon_cpu[mode] += _daemon_cpu(ctx) - c0
            runs[mode].append(run)
    after = kv.stats()
    counters = {k: after.get(k, 0) - before.get(k, 0)
                for k in ("saves_received", "saves_written", "saves_superseded", "saves_held")}
    same_tokens = all(x["tokens"] == runs["off"][0]["tokens"] for x in runs["off"] + runs["save"])
    off_tps = [x["tokens_per_s"] for x in runs["off"]]
    on_tps = [x["tokens_per_s"] for x in runs["save"]]
    off_flushed = [x["tokens_per_s_through_flush"] for x in runs["off"]]
    on_flushed = [x["tokens_per_s_through_flush"] for x in runs["save"]]
    res = {
        "model": "mlx-lm llama: 4 layers, hidden 256, 4 heads, 2 KV heads, bf16, random weights",
        "prompt_tokens": prof.gen_prompt,
        "decode_tokens": prof.gen_decode,
        "save_every": prof.gen_save_every,
        "runs_per_mode": prof.gen_runs,
        "tokens_per_s_no_saves": summarize(off_tps),
        "tokens_per_s_with_saves": summarize(on_tps),
        # Run r of each mode ran back to back (order alternated): the ratio of
        # each such pair is measured side by side, and the machine's slow
        # spells (whole runs 20% slower) hit both sides of a pair alike.
        "ratio": paired_median(off_tps, on_tps),
        "ratio_of_medians": summarize(on_tps)["median"] / summarize(off_tps)["median"],
        # The same pairs with each run's closing flush() counted in.
        "ratio_through_flush": paired_median(off_flushed, on_flushed),
        "tokens_per_s_through_flush_no_saves": summarize(off_flushed),
        "tokens_per_s_through_flush_with_saves": summarize(on_flushed),
        "flush_no_saves": summarize([x["flush_s"] for x in runs["off"]]),
        "flush_with_saves": summarize([x["flush_s"] for x in runs["save"]]),
        "step_no_saves": summarize([s for x in runs["off"] for s in x["steps"]]),
        "step_with_saves_other": summarize([s for x in runs["save"] for s in x["steps"]]),
        "step_first_after_save": summarize([s for x in runs["save"] for s in x["after_save"]]),
        "save_call": summarize([s for x in runs["save"] for s in x["saves"]]),
        "saves_handed_off": sum(x["handed_off"] for x in runs["save"]),
        "saves_attempted": sum(len(x["saves"]) for x in runs["save"]),
        "same_tokens_in_every_run": same_tokens,
        # What the daemon did with them: a save of a cache written less than
        # --min-write-interval ago is held, and replaced by the next one.
        "daemon_counters": counters,
        # Saves the client never sent: a newer one came within its send interval.
        "client_saves_coalesced": after.get("client_saves_coalesced", 0)
        - before.get("client_saves_coalesced", 0),
        # CPU the daemon process used while the runs of each mode ran, as a share of one core.
        "daemon_cpu_share_no_saves": daemon_cpu["off"] / _timed(runs["off"]),
        "daemon_cpu_share_with_saves": daemon_cpu["save"] / _timed(runs["save"]),
    }
    kv.delete(MODEL, "generation")
    return res


def _step(cache: list[Any], k1: mx.array, v1: mx.array) -> float:
    """One decode step's cache update at every layer (what attention writes), evaluated."""
    t0 = time.perf_counter()
    for c in cache:
        c.update_and_fetch(k1, v1)
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return time.perf_counter() - t0


def _wait_sent(kv: Any, timeout: float = WAIT) -> float:
    """Wait until the client holds no save in flight (the daemon has every byte)."""
    t0 = time.perf_counter()
    while kv.stats()["client_inflight_bytes"] > 0 and time.perf_counter() - t0 < timeout:
        time.sleep(0.001)
    return time.perf_counter() - t0


def _big_cache_cow(ctx: Any) -> dict[str, Any]:
    """At the Llama-3-8B shape: the cache update right after save() (bytes still
    in flight, so MLX must copy the buffers the snapshot holds) against a plain one."""
    prof, kv = ctx.profile, ctx.kv
    shape = prof.shape
    tokens = max(prof.tokens)
    fill = tokens - 4 * prof.cow_samples - 4  # room to grow without reallocating
    cache = kv_cache(shape, tokens, seed=5, fill=fill)
    toks = token_ids(tokens, seed=5)  # the first offset of them go with each save
    mx.random.seed(6)
    k1 = mx.random.normal((1, shape.kv_heads, 1, shape.head_dim), dtype=mx.bfloat16)
    v1 = mx.random.normal((1, shape.kv_heads, 1, shape.head_dim), dtype=mx.bfloat16)
    mx.eval(k1, v1)
    _step(cache, k1, v1)  # warm-up
    # A one-layer cache: saving it makes the client drop whatever it still holds of
    # the previous save (see the "after a small save" row).
    small = kv_cache(type(shape)(1, 1, 64), 256, seed=7)
    small_toks = token_ids(small[0].offset, seed=7)

    # Checked: a save dropped or refused would read as "no copy" (an audit).
    def save(key: str, c: Any, ids: list[int]) -> None:
        if not kv.save(MODEL, key, c, ids[:c[0].offset]):
            raise RuntimeError(f"copy-on-write: the save of {key} was dropped")

    def flush() -> None:
        if not kv.flush(WAIT):
            raise RuntimeError("copy-on-write: a save was not written")

    plain, after, after_sent, after_small, sent = [], [], [], [], []
    for _ in range(prof.cow_samples):
        plain.append(_step(cache, k1, v1))
        save("cow", cache, toks)
        after.append(_step(cache, k1, v1))
        flush()
        save("cow", cache, toks)
        sent.append(_wait_sent(kv))
        after_sent.append(_step(cache, k1, v1))
        flush()
        save("cow", cache, toks)
        _wait_sent(kv)
        flush()
        save("cow-small", small, small_toks)
        _wait_sent(kv)
        flush()
        after_small.append(_step(cache, k1, v1))
    res = {
        "tokens": fill,
        "capacity_tokens": tokens,
        "cache_bytes": sum(c.keys.nbytes + c.values.nbytes for c in cache),
        "step_plain": summarize(plain),
        "step_right_after_save": summarize(after),
        "step_after_save_fully_sent": summarize(after_sent),
        "step_after_save_sent_then_small_save": summarize(after_small),
        "save_to_fully_sent": summarize(sent),
    }
    kv.delete(MODEL, "cow")
    kv.delete(MODEL, "cow-small")
    del cache, small
    free_memory()
    return res


def run(ctx: Any) -> dict[str, Any]:
    ctx.log("  generation: tiny model, decode with and without saves")
    tiny = _tiny_model_case(ctx)
    free_memory()
    ctx.log("  generation: first cache update after a save, Llama-3-8B shape")
    big = _big_cache_cow(ctx)
    return {"tiny_model": tiny, "big_cache_update": big}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    t = res["tiny_model"]
    return [{
        "case": "2 cost to generation",
        "target": f"decode throughput with a save every {t['save_every']} tokens >= 0.97x without "
                  "(median of the runs' side-by-side ratios), also with each run's "
                  "closing flush() counted in",
        "measured": {"ratio": t["ratio"], "ratio_of_medians": t.get("ratio_of_medians"),
                     "ratio_through_flush": t.get("ratio_through_flush"),
                     "tokens_per_s_no_saves": t["tokens_per_s_no_saves"]["median"],
                     "tokens_per_s_with_saves": t["tokens_per_s_with_saves"]["median"]},
        # An older results.json has no flush figure: judged on the decode alone.
        "met": bool(min(t["ratio"], t.get("ratio_through_flush", t["ratio"])) >= 0.97),
    }]
