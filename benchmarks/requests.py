"""Case 8, requests behind saves: one thread saves a cache as fast as ``save()``
returns (the client's in-flight budget full, the disk the limit), another makes
requests through the same client. The latency of each kind of request, against
the same requests with nothing queued."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import MODEL, WAIT, kv_cache, summarize, token_ids

#: The flooded key, a key whose file exists, and one never saved.
FLOODED, OTHER, NEVER = "requests-flooded", "requests-other", "requests-never"
#: Between two requests: the flood gets the client to itself for a moment.
PAUSE_S = 0.05


def _kinds(kv: Any) -> dict[str, Callable[[], Any]]:
    return {
        "ping": kv.ping,
        "load_miss": lambda: kv.load(MODEL, NEVER),
        "load_other": lambda: kv.load(MODEL, OTHER, verify=False),
        "load_flooded": lambda: kv.load(MODEL, FLOODED, verify=False),
        "flush": lambda: kv.flush(WAIT),
    }


#: Requests that wait for no write are asked this often per round.
_FAST_PER_ROUND = 3


#: What each kind of request answers when it did its job: a load of a key
#: saved returns a cache, of one never saved None, and a flush True. Another
#: answer is counted (a load that missed is fast, but no load).
_EXPECTED: dict[str, Callable[[Any], bool]] = {
    "ping": lambda r: True,
    "load_miss": lambda r: r is None,
    "load_other": lambda r: r is not None,
    "load_flooded": lambda r: r is not None,
    "flush": lambda r: r is True,
}


def _rounds(kinds: dict[str, Callable[[], Any]], until: float,
            at_least: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each kind's latencies, and how many of its answers were not the
    expected one (see ``_EXPECTED``)."""
    took: dict[str, list[float]] = {k: [] for k in kinds}
    unexpected = dict.fromkeys(kinds, 0)
    n = 0
    while n < at_least or time.monotonic() < until:
        for name, request in kinds.items():
            for _ in range(1 if name in ("load_flooded", "flush") else _FAST_PER_ROUND):
                t0 = time.perf_counter()
                answer = request()
                took[name].append(time.perf_counter() - t0)
                unexpected[name] += not _EXPECTED[name](answer)
                time.sleep(PAUSE_S)
        n += 1
    return took, unexpected


def run(ctx: Any) -> dict[str, Any]:
    prof = ctx.profile
    shape = prof.shape
    nbytes = prof.requests_tokens * shape.bytes_per_token
    ctx.log(f"  requests: {prof.requests_duration_s:g} s of requests while one thread saves "
            f"{nbytes / 2**20:.0f} MiB as fast as save() returns")
    big = kv_cache(shape, prof.requests_tokens, seed=8)
    small = kv_cache(shape, 256, seed=9)
    ids = token_ids(prof.requests_tokens, seed=8)
    # A client of its own: the flood fills its budget, not the other cases'.
    kv = ctx.daemon.client()
    try:
        assert kv.save(MODEL, OTHER, small, token_ids(256, seed=9))
        assert kv.save(MODEL, FLOODED, big, ids)
        if not kv.flush(WAIT):
            raise RuntimeError("the entries to load were not written")
        kinds = _kinds(kv)
        idle, idle_unexpected = _rounds(kinds, 0.0, prof.requests_min_rounds)
        stop = threading.Event()
        handed = [0, 0]  # save() True, False

        def flood() -> None:
            while not stop.is_set():
                handed[0 if kv.save(MODEL, FLOODED, big, ids) else 1] += 1
                time.sleep(0.001)

        before = kv.client_stats()
        saver = threading.Thread(target=flood, name="flood", daemon=True)
        saver.start()
        try:
            time.sleep(min(1.0, prof.requests_duration_s))  # the budget fills up
            flooded, flood_unexpected = _rounds(kinds, time.monotonic() + prof.requests_duration_s,
                                                prof.requests_min_rounds)
        finally:
            stop.set()
            saver.join(WAIT)
        flushed = kv.flush(WAIT)
        # After the flush: every save handed off is sent, replaced or lost by now.
        after = kv.client_stats()
    finally:
        kv.close()
    return {
        "bytes_per_save": nbytes,
        "duration_s": prof.requests_duration_s,
        "pause_s": PAUSE_S,
        "idle": {k: summarize(v) for k, v in idle.items()},
        "flood": {k: summarize(v) for k, v in flooded.items()},
        # Answers other than the request's job (a load that missed, a flush
        # False): a flush during the flood answers False for a save refused.
        "unexpected_answers": {"idle": idle_unexpected, "flood": flood_unexpected},
        "saves_true": handed[0],
        "saves_false": handed[1],
        "client_counters": {k.removeprefix("client_"): after[k] - before[k] for k in after
                            if k.startswith("client_saves")},
        "flush_after_ok": flushed,
    }


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    flood, idle = res["flood"], res["idle"]
    return [{
        "case": "8 requests behind saves",
        "target": "report each request's latency through a client flooded with saves "
                  "(no fixed target)",
        "measured": {k: {"flood_median_s": flood[k]["median"], "idle_median_s": idle[k]["median"]}
                     for k in flood},
        "met": None,
    }]
