"""Case 1, the hot path: what ``client.save()`` costs the generation loop, against
saving synchronously in-process (the reference approach and mlx-lm's
``save_prompt_cache``) and against mlx-vlm's APC hand-off."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks import apc
from benchmarks.common import (
    MODEL,
    WAIT,
    CallClock,
    GcWatch,
    cache_nbytes,
    calibrate_spin,
    free_memory,
    gc_summary,
    hybrid_cache,
    hybrid_to_vlm,
    kv_cache,
    layers_of,
    prompt_cache_state,
    slow_calls,
    spin,
    state_arrays,
    summarize,
    token_ids,
    vlm_mirror,
)

#: How long the control call lasts: about a ``save()`` here (its median was
#: 0.35-0.6 ms in the full runs). The control is pure Python with no I/O, no
#: lock and no let-go of the GIL, timed under the same conditions as
#: ``save()``; what it suffers is what this machine does to any such call.
CONTROL_S = 450e-6


def reference_save(cache: Any, tokens: list[int], target: Path) -> None:
    """The synchronous baseline, reimplemented minimally after the reference:
    flatten the state arrays, ``mx.save_safetensors`` to a sibling, ``os.replace``."""
    layers = layers_of(cache)
    meta = {
        "classes": json.dumps([type(c).__name__ for c in layers]),
        "token_ids": json.dumps(tokens),
    }
    tmp = target.with_name(f".{target.stem}.tmp.{os.getpid()}{target.suffix}")
    mx.save_safetensors(str(tmp), state_arrays(cache), meta)
    os.replace(tmp, target)


def mlx_lm_save(cache: Any, tokens: list[int], target: Path) -> None:
    from mlx_lm.models.cache import save_prompt_cache

    save_prompt_cache(str(target), layers_of(cache), {"token_ids": json.dumps(tokens)})


def _kvk_idle(kv: Any, key: str, cache: Any, tokens: list[int], clock: CallClock,
              out: dict[str, list], control: CallClock, spin_n: int | None) -> None:
    ok = clock.call(kv.save, MODEL, key, cache, tokens)
    t0 = clock.windows[-1][0]
    flushed = kv.flush(WAIT)
    out["durable"].append(time.perf_counter() - t0)
    out["ok"].append(bool(ok) and bool(flushed))
    if spin_n is not None:  # right after a flush, as the next save() will be
        control.call(spin, spin_n)


def _sync_round(cache: Any, tokens: list[int], d: Path, out: dict[str, list],
                mlx_lm_first: bool) -> None:
    """One run of each synchronous saver. Each runs while the page cache
    still writes back what the ones before it wrote (they never fsync): the
    order alternates between rounds, so neither pays it every time."""
    def reference() -> None:
        ref = d / "reference.safetensors"
        ref.unlink(missing_ok=True)
        t0 = time.perf_counter()
        reference_save(cache, tokens, ref)  # the rename creates the file
        t1 = time.perf_counter()
        reference_save(cache, tokens, ref)  # the rename replaces a file
        t2 = time.perf_counter()
        out["reference_new"].append(t1 - t0)
        out["reference_replace"].append(t2 - t1)

    def mlx_lm() -> None:
        target = d / "mlx_lm.safetensors"
        # A new file every run (it writes in place: the first run of five
        # made a file, the others overwrote it).
        target.unlink(missing_ok=True)
        try:
            t3 = time.perf_counter()
            mlx_lm_save(cache, tokens, target)
            out["mlx_lm"].append(time.perf_counter() - t3)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out.setdefault("mlx_lm_error", []).append(f"{type(exc).__name__}: {exc}")

    for saver in ((mlx_lm, reference) if mlx_lm_first else (reference, mlx_lm)):
        saver()


def _apc_round(layers: list[Any], tokens: list[int], restore: bool, out: dict[str, list]) -> None:
    try:
        r = apc.measure(layers, tokens, restore=restore)
    except Exception as exc:  # noqa: BLE001 - mlx-vlm is a peer, its failure is a finding
        r = {"error": f"{type(exc).__name__}: {exc}"}
    out["apc"].append(r)


def _apc_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in rounds if "error" not in r]
    res: dict[str, Any] = {
        "rounds": rounds,
        "errors": sorted({r["error"] for r in rounds if "error" in r}),
    }
    if good:
        res["strategy"] = good[0].get("strategy")
        res["committed_all"] = all(r.get("committed") for r in good)
        res["disk_write_failures"] = sum(r.get("disk_write_failures") or 0 for r in good)
        res["file_bytes"] = good[0].get("file_bytes")
        for k in ("handoff_s", "written_s", "next_request_wait_s", "restore_s"):
            vals = [r[k] for r in good if k in r]
            if vals:
                res[k] = summarize(vals)
        if any("restore_error" in r for r in good):
            res["restore_errors"] = sorted({r["restore_error"] for r in good if "restore_error" in r})
    return res


def _stream(kv: Any, key: str, cache: Any, tokens: list[int], n: int, pace: float,
            gcw: GcWatch, spin_n: int) -> dict[str, Any]:
    """save() every ``pace`` seconds without waiting for the disk (write-behind),
    and the control call halfway between two saves."""
    before = kv.stats()
    clock = CallClock()
    control = CallClock()
    oks = []
    for _ in range(n):
        oks.append(bool(clock.call(kv.save, MODEL, key, cache, tokens)))
        time.sleep(pace / 2)
        control.call(spin, spin_n)
        time.sleep(pace / 2)
    flushed = kv.flush(WAIT)
    after = kv.stats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "saves_received", "saves_written", "saves_superseded", "saves_refused", "saves_failed",
        "client_saves_dropped", "client_saves_lost", "client_saves_coalesced")}
    return {"save": summarize(clock.wall), "save_cpu": summarize(clock.cpu),
            "slow_calls": slow_calls(clock.wall, clock.cpu, clock.preempted, clock),
            "steal": clock.steal_summary(),
            "gc": gc_summary(gcw, clock.windows), "handed_off": sum(oks), "dropped": len(oks) - sum(oks),
            "flush_ok": bool(flushed), "pace_s": pace, "counters": delta,
            "control": _control(control)}


def _control(clock: CallClock) -> dict[str, Any]:
    return {"call": summarize(clock.wall), "cpu": summarize(clock.cpu),
            "slow_calls": slow_calls(clock.wall, clock.cpu, clock.preempted, clock)}


def idle_rounds(calls: int, rounds: int) -> list[int]:
    """How many of ``calls`` idle save() calls each of ``rounds`` rounds
    makes, spread evenly (8 over 5 rounds: 1 2 1 2 2). Filling each round in
    turn left the last rounds none: their synchronous saves were measured
    with no save() beside them."""
    return [calls * (r + 1) // rounds - calls * r // rounds for r in range(rounds)]


def _measure_cache(ctx: Any, label: str, cache: Any, tokens: list[int], *, idle_n: int,
                   apc_layers: list[Any] | None, apc_restore: bool,
                   spin_n: int | None) -> dict[str, Any]:
    """``spin_n``: the control's loop count, for the caches also measured
    streaming; None for the others."""
    prof, kv = ctx.profile, ctx.kv
    key = f"hot-{label}"
    d = ctx.scratch / f"sync-{label}"
    d.mkdir(exist_ok=True)
    idle = CallClock()
    control = CallClock()
    raw: dict[str, list] = {"durable": [], "ok": [],
                            "reference_new": [],
                            "reference_replace": [], "mlx_lm": [], "apc": []}
    # Warm-up (first-call costs of every path), not recorded.
    kv.save(MODEL, key, cache, tokens)
    kv.flush(WAIT)
    reference_save(cache, tokens, d / "warmup.safetensors")
    gcw = ctx.gc_watch
    for r, calls in enumerate(idle_rounds(idle_n, prof.sync_reps)):
        # Side by side: each round does kvkeeper, then the synchronous saves
        # (their order alternating) and APC. Each group starts with no dirty
        # pages of another's (untimed sync): the synchronous saves leave
        # 1.5 GiB unsynced at 512 MiB, whose writeback slowed APC's write
        # behind them to 469-633 ms from 369-419 ms (an audit).
        os.sync()
        for _ in range(calls):
            _kvk_idle(kv, key, cache, tokens, idle, raw, control, spin_n)
        _sync_round(cache, tokens, d, raw, mlx_lm_first=r % 2 == 1)
        if apc_layers is not None:
            offset = 1000 * (r + 1)
            os.sync()
            _apc_round(apc_layers, [t + offset for t in tokens], apc_restore, raw)
    res: dict[str, Any] = {
        "label": label,
        "tokens": len(tokens),
        "bytes": cache_nbytes(cache),
        "kvkeeper_save_idle": summarize(idle.wall),
        "kvkeeper_save_idle_cpu": summarize(idle.cpu),
        "kvkeeper_save_idle_gc": gc_summary(gcw, idle.windows),
        "kvkeeper_save_idle_slow": slow_calls(idle.wall, idle.cpu, idle.preempted, idle),
        "kvkeeper_save_idle_steal": idle.steal_summary(),
        "kvkeeper_save_to_durable": summarize(raw["durable"]),
        "kvkeeper_all_ok": all(raw["ok"]),
        "sync_reference_new_file": summarize(raw["reference_new"]),
        "sync_reference_replace": summarize(raw["reference_replace"]),
        "sync_mlx_lm_save_prompt_cache": summarize(raw["mlx_lm"]),
    }
    if raw.get("mlx_lm_error"):
        res["sync_mlx_lm_error"] = raw["mlx_lm_error"][0]
    if apc_layers is not None:
        res["mlx_vlm_apc"] = _apc_summary(raw["apc"])
    if spin_n is not None:
        res["control_idle"] = _control(control)
        res["kvkeeper_stream"] = _stream(kv, key, cache, tokens, prof.hot_stream_n,
                                         prof.stream_pace_s, gcw, spin_n)
    # What save() is made of: the capture (on the caller's thread) and the
    # encoding that the client's I/O thread does afterwards, each in-process.
    from kvkeeper.client.codec import capture_cache, encode_capture

    caps, encs = CallClock(), []
    for _ in range(max(5, prof.sync_reps)):
        cap = caps.call(capture_cache, layers_of(cache))
        t1 = time.perf_counter()
        snap = encode_capture(cap)
        encs.append(time.perf_counter() - t1)
        del cap, snap
    res["capture_only"] = summarize(caps.wall)
    res["capture_only_cpu"] = summarize(caps.cpu)
    res["encode_only"] = summarize(encs)
    kv.delete(MODEL, key)
    for f in d.iterdir():
        f.unlink()
    return res


def run(ctx: Any) -> dict[str, Any]:
    with GcWatch() as gcw:
        ctx.gc_watch = gcw
        return _run(ctx)


def _run(ctx: Any) -> dict[str, Any]:
    prof = ctx.profile
    shape = prof.shape
    sizes = []
    spin_n = calibrate_spin(CONTROL_S)
    for t in prof.tokens:
        cache = kv_cache(shape, t, seed=t)
        toks = token_ids(t, seed=t)
        ctx.log(f"  hot path: {t} tokens")
        idle_n = prof.hot_idle_n if t == max(prof.tokens) else prof.hot_idle_n_other
        sizes.append(_measure_cache(ctx, f"kv{t}", cache, toks, idle_n=idle_n,
                                    apc_layers=vlm_mirror(cache), apc_restore=False,
                                    spin_n=spin_n))
        del cache
        free_memory()
    special = []
    t = prof.special_tokens
    ctx.log(f"  hot path: mlx-vlm PromptCacheState, {t} tokens")
    pcs = prompt_cache_state(shape, t, seed=7)
    special.append({"kind": "mlx-vlm PromptCacheState (mlx-vlm KVCache layers)",
                    **_measure_cache(ctx, f"pcs{t}", pcs, list(pcs.token_ids),
                                     idle_n=prof.hot_idle_n_other, apc_layers=None,
                                     apc_restore=False, spin_n=None)})
    del pcs
    free_memory()
    ctx.log(f"  hot path: hybrid ArraysCache + KVCache, {t} tokens")
    hyb = hybrid_cache(shape, t, seed=8)
    special.append({"kind": "hybrid: mlx-lm ArraysCache (3 of 4 layers) + KVCache (1 of 4)",
                    **_measure_cache(ctx, f"hybrid{t}", hyb, token_ids(t, seed=8),
                                     idle_n=prof.hot_idle_n_other,
                                     apc_layers=hybrid_to_vlm(hyb), apc_restore=False,
                                     spin_n=None)})
    del hyb
    free_memory()
    return {"sizes": sizes, "special": special,
            "control": {"target_s": CONTROL_S, "loops": spin_n}}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    big = max(res["sizes"], key=lambda s: s["bytes"])
    sync = {k: big[k]["median"] for k in ("sync_reference_new_file", "sync_reference_replace",
                                          "sync_mlx_lm_save_prompt_cache") if big[k]["median"]}
    fastest = min(sync.values()) if sync else None
    p99_idle = big["kvkeeper_save_idle"]["p99"]
    p99_stream = big["kvkeeper_stream"]["save"]["p99"]
    p99 = max(x for x in (p99_idle, p99_stream) if x is not None)
    # Beside the verdict, not in it: the same calls with the time the
    # hypervisor took from them taken out (this machine is a shared VM).
    clean = [((s or {}).get("wall_without_steal") or {}).get("p99")
             for s in (big.get("kvkeeper_save_idle_steal"), big["kvkeeper_stream"].get("steal"))]
    out = [{
        "case": "1 hot path",
        "target": "p99 of save() <= 1/100 of the synchronous median (fastest synchronous baseline)",
        "size_bytes": big["bytes"],
        "measured": {"save_p99_s": p99, "save_p99_idle_s": p99_idle,
                     "save_p99_streaming_s": p99_stream,
                     "save_p99_without_steal_s": (max(clean) if None not in clean else None),
                     "save_p99_without_steal_idle_s": clean[0],
                     "save_p99_without_steal_streaming_s": clean[1],
                     "sync_medians_s": sync, "limit_s": fastest / 100 if fastest else None,
                     # A save() that is not written (refused, dropped) proves nothing.
                     "all_written": big["kvkeeper_all_ok"]},
        "met": bool(fastest and p99 <= fastest / 100 and big["kvkeeper_all_ok"]),
    }]
    apc_res = big.get("mlx_vlm_apc", {})
    handoff_s = apc_res.get("handoff_s") or {}
    handoff = handoff_s.get("median")
    out.append({
        "case": "1 hot path",
        "target": "p99 of save() below mlx-vlm APC's hand-off (median of commit())",
        "size_bytes": big["bytes"],
        "measured": {"save_p99_s": p99, "apc_handoff_median_s": handoff,
                     # Beside the verdict: idle against idle (mlx-vlm is timed
                     # idle only, too few calls for a p99: its slowest).
                     "save_p99_idle_s": p99_idle, "apc_handoff_max_s": handoff_s.get("max"),
                     "apc_handoff_n": handoff_s.get("n"),
                     "apc_errors": apc_res.get("errors"), "all_written": big["kvkeeper_all_ok"]},
        "met": None if handoff is None else bool(p99 < handoff and big["kvkeeper_all_ok"]),
    })
    # Case 6's accounting again, where saves share a key: the memory case
    # gives each save its own, so there only refusals explain the unwritten.
    st = big["kvkeeper_stream"]
    c = st["counters"]
    attempts = st["handed_off"] + st["dropped"]
    not_written = int(attempts - c["saves_written"])
    explained = int(c["client_saves_dropped"] + c["client_saves_lost"]
                    + c["client_saves_coalesced"] + c["saves_superseded"]
                    + c["saves_refused"] + c["saves_failed"])
    out.append({
        "case": "6 memory",
        "target": "dropped + lost + coalesced + superseded + refused + failed = every save "
                  "not written (hot-path stream: saves of one key)",
        "size_bytes": big["bytes"],
        "measured": {"not_written": not_written, "explained_by_counters": explained,
                     "counters": {k: int(v) for k, v in c.items()}},
        "met": not_written == explained,
    })
    return out
