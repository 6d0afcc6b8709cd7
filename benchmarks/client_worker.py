"""One client process of case 7: saves and verified loads in a loop.

Run by ``benchmarks.clients``; speaks over stdin/stdout: prints ``READY`` once
its base entry is durable, starts on a ``GO`` line, prints one JSON line of
results at the end.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--timeout", type=float, default=120.0)
    a = p.parse_args(argv)

    import logging

    logging.getLogger("kvkeeper").setLevel(logging.ERROR)
    from benchmarks.common import MODEL, Shape, kv_cache, token_ids
    from kvkeeper import Client

    cache = kv_cache(Shape(a.layers, a.kv_heads, a.head_dim), a.tokens, seed=100 + a.index)
    toks = token_ids(a.tokens, seed=100 + a.index)
    base = f"w{a.index}-base"
    with Client(a.socket, timeout=a.timeout, connect_timeout=10.0) as kv:
        kv.save(MODEL, base, cache, toks)
        if not kv.flush(a.timeout):
            print(json.dumps({"error": "base save failed"}), flush=True)
            return 1
        print("READY", flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], a.timeout)
        if not ready or sys.stdin.readline().strip() != "GO":
            print(json.dumps({"error": "no GO"}), flush=True)
            return 1
        saves_ok = saves_dropped = misses = 0
        save_lat: list[float] = []
        load_lat: list[float] = []
        t0 = time.perf_counter()
        j = 0
        while time.perf_counter() - t0 < a.duration:
            s0 = time.perf_counter()
            ok = kv.save(MODEL, f"w{a.index}-k{j % 2}", cache, toks)
            save_lat.append(time.perf_counter() - s0)
            saves_ok += bool(ok)
            saves_dropped += not ok
            l0 = time.perf_counter()
            got = kv.load(MODEL, base, verify=True)
            load_lat.append(time.perf_counter() - l0)
            misses += got is None
            del got
            j += 1
        loop_s = time.perf_counter() - t0
        flushed = kv.flush(a.timeout)
        total_s = time.perf_counter() - t0
        stats = kv.stats()
    print(json.dumps({
        "index": a.index,
        "bytes_per_save": a.tokens * Shape(a.layers, a.kv_heads, a.head_dim).bytes_per_token,
        "saves_ok": saves_ok,
        "saves_dropped": saves_dropped,
        "saves_lost": stats.get("client_saves_lost", 0),
        "saves_refused": stats.get("client_saves_refused", 0),
        "saves_coalesced": stats.get("client_saves_coalesced", 0),
        "load_misses": misses,
        "save_latency_s": save_lat,
        "load_latency_s": load_lat,
        "loop_s": loop_s,
        "total_s": total_s,
        "flush_ok": bool(flushed),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
