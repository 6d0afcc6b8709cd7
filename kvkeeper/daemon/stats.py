"""Counters the daemon keeps and ``stats`` reports."""

from __future__ import annotations

import time
from collections import Counter, deque

#: Every counter, so that a reader sees zeros rather than missing keys.
COUNTERS = (
    "saves_received",
    "saves_written",
    "saves_superseded",
    "saves_refused",
    "saves_failed",
    "saves_cut_off",  # of the failed: their client died or hung up part way
    "saves_held",
    "saves_parked",  # times a save being written made way, its bytes not coming
    "bytes_received",
    "bytes_written",
    "loads_found",
    "loads_missing",
    "loads_direct",
    "deletes",  # of an entry, or of a save of it on its way
    "deletes_missing",  # of nothing
    "evictions",
    "bytes_evicted",
    "files_quarantined",
    "protocol_errors",
    "requests_refused",  # answered "busy": too many of the client's requests waited already
    "internal_errors",
    "forbidden_peers",
)
#: Every latency whose p50 and p99 are reported (0.0 until its first sample).
LATENCIES = ("write_seconds", "fsync_seconds")


class Stats:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.counts: Counter[str] = Counter({k: 0 for k in COUNTERS})
        self.gauges: dict[str, float] = {}
        self._samples: dict[str, deque[float]] = {k: deque(maxlen=1024) for k in LATENCIES}

    def inc(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def sample(self, name: str, value: float) -> None:
        """Keep the last 1024 values of a latency (one of ``LATENCIES``) for
        its percentiles."""
        self._samples[name].append(value)

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self.counts.items()}
        out.update(self.gauges)
        for name, values in self._samples.items():
            ordered = sorted(values) or [0.0]
            for p in (50, 99):
                out[f"{name}_p{p}"] = ordered[min(len(ordered) - 1, len(ordered) * p // 100)]
        out["uptime_s"] = time.monotonic() - self.started
        return out
