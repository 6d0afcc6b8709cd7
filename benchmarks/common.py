"""Shared pieces: profiles, statistics, the daemon subprocess, cache builders, machine facts."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

KiB = 1024
MiB = 1024**2
GiB = 1024**3

#: Model fingerprint every case saves under.
MODEL = "bench-model"
#: Cap on every wait for the daemon or a child process.
WAIT = 120.0


# ---------------------------------------------------------------- profiles


@dataclass(frozen=True)
class Shape:
    """A KV cache shape: layers x (keys + values) x kv heads x head dim, bf16."""

    layers: int
    kv_heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


LLAMA3_8B = Shape(32, 8, 128)
TINY_SHAPE = Shape(4, 2, 64)


@dataclass(frozen=True)
class Profile:
    name: str
    shape: Shape
    tokens: tuple[int, ...]  # cache sizes of the hot-path and load cases
    hot_idle_n: int  # save() calls with the daemon idle (flush between), largest cache
    hot_idle_n_other: int  # the same for the other caches, which carry no target
    hot_stream_n: int  # save() calls every stream_pace_s, no flush between
    stream_pace_s: float
    sync_reps: int  # runs of each synchronous baseline and of mlx-vlm's APC
    special_tokens: int  # size of the PromptCacheState and hybrid caches
    gen_prompt: int
    gen_decode: int
    gen_runs: int  # per mode (with / without saves)
    cow_samples: int
    disk_tokens: int
    disk_reps: int
    load_reps: int
    resume_lengths: tuple[int, ...]
    resume_reps: int
    mem_total: int  # bytes of saves handed to the daemon
    mem_save_tokens: int
    mem_max_pending: int
    mem_clients: int
    clients_n: int
    clients_tokens: int
    clients_duration_s: float
    requests_tokens: int = 4096  # the cache saved as fast as save() returns (case 8)
    requests_duration_s: float = 10.0
    # Rounds of case 8's requests at least, idle and flooded: its medians are
    # of at least this many samples (in 10 s the flood gave 3 of its flushes).
    requests_min_rounds: int = 5
    gen_save_every: int = 16

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = {**asdict(self.shape), "bytes_per_token": self.shape.bytes_per_token}
        return d


FULL = Profile(
    name="full", shape=LLAMA3_8B, tokens=(256, 1024, 4096),
    # The nearest-rank p99 of 100 calls is their second slowest, of 200 the
    # third (of fewer than 100, the slowest). Idle, each call waits for the
    # last to be durable: 200 of the 512 MiB cache took 300-400 s on days this
    # disk wrote 0.25-0.34 GiB/s (the full run 939-983 s), so idle series are
    # 100 calls; streaming (no wait for the disk) keeps 200. The smaller caches,
    # whose figures are reported but judged by no target, get 50 idle calls
    # (about 65 s of the 902 s run at f8e5a1e).
    hot_idle_n=100, hot_idle_n_other=50, hot_stream_n=200, stream_pace_s=0.05, sync_reps=5,
    special_tokens=1024,
    # 25 pairs: one pair's ratio spreads 0.75-1.17 on this shared machine, so
    # with 15 the median's error (about 2.5%) was as large as the cost measured.
    gen_prompt=256, gen_decode=256, gen_runs=25, cow_samples=8,
    disk_tokens=4096, disk_reps=7, load_reps=7,
    resume_lengths=(256, 1024, 2048), resume_reps=5,
    mem_total=4 * GiB, mem_save_tokens=1024, mem_max_pending=512 * MiB, mem_clients=2,
    clients_n=4, clients_tokens=512, clients_duration_s=10.0,
)
QUICK = Profile(
    name="quick", shape=LLAMA3_8B, tokens=(256, 4096),
    hot_idle_n=8, hot_idle_n_other=8, hot_stream_n=12, stream_pace_s=0.05, sync_reps=5,
    special_tokens=512,
    # Under 2 minutes with room to spare on this 2-core machine when it is busy
    # (117.8 s at nice 10 on 2026-12-04 with 7 runs and 3 s floods).
    gen_prompt=128, gen_decode=128, gen_runs=5, cow_samples=5,
    disk_tokens=4096, disk_reps=5, load_reps=5,
    resume_lengths=(256, 512), resume_reps=5,
    mem_total=1 * GiB, mem_save_tokens=512, mem_max_pending=256 * MiB, mem_clients=2,
    clients_n=4, clients_tokens=256, clients_duration_s=2.0,
    requests_tokens=1024, requests_duration_s=2.0,
)
#: Smoke-test sizes: every code path, nothing worth reading.
TINY = Profile(
    name="tiny", shape=TINY_SHAPE, tokens=(256, 512),
    hot_idle_n=3, hot_idle_n_other=2, hot_stream_n=3, stream_pace_s=0.01, sync_reps=2,
    special_tokens=256,
    gen_prompt=32, gen_decode=32, gen_runs=2, cow_samples=2,
    disk_tokens=512, disk_reps=2, load_reps=2,
    resume_lengths=(64,), resume_reps=2,
    mem_total=16 * MiB, mem_save_tokens=256, mem_max_pending=2 * MiB, mem_clients=2,
    clients_n=2, clients_tokens=256, clients_duration_s=0.5,
    requests_tokens=512, requests_duration_s=0.5, requests_min_rounds=2,
)


# ---------------------------------------------------------------- statistics


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q% of samples <= it.
    With fewer than 100 samples, p99 is the maximum."""
    xs = sorted(samples)
    if not xs:
        return float("nan")
    k = max(1, math.ceil(q / 100.0 * len(xs)))
    return xs[k - 1]


def paired_median(base: list[float], other: list[float]) -> float:
    """The median of ``other[r] / base[r]``: runs r of the two ran back to back."""
    return float(np.median([b / a for a, b in zip(base, other, strict=True)]))


def summarize(samples: Sequence[float]) -> dict[str, Any]:
    xs = [float(x) for x in samples]
    if not xs:
        return {"n": 0, "median": None, "p99": None, "min": None, "max": None, "samples": []}
    return {
        "n": len(xs),
        "median": float(np.median(xs)),
        "p99": percentile(xs, 99),
        "min": min(xs),
        "max": max(xs),
        "samples": xs,
    }


def med(stats: dict[str, Any] | None) -> float | None:
    return None if not stats else stats.get("median")


def fmt_s(x: float | None) -> str:
    """Seconds, printed in a readable unit."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    if x < 1.0:
        return f"{x * 1e3:.3g} ms" if x < 0.1 else f"{x * 1e3:.0f} ms"
    return f"{x:.2f} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.0f} MiB" if n % MiB == 0 else f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.0f} KiB"


# ---------------------------------------------------------------- garbage collection


class GcWatch:
    """Records the Python garbage collector's pauses (perf_counter windows, generation)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []
        self._start: float | None = None

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        elif self._start is not None:
            self.pauses.append((self._start, now, int(info.get("generation", 0))))
            self._start = None

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def within(self, t0: float, t1: float) -> tuple[float, int]:
        """Seconds of collection inside [t0, t1] and the oldest generation collected (-1: none)."""
        total, gen = 0.0, -1
        for a, b, g in self.pauses:
            if a >= t0 and b <= t1:
                total += b - a
                gen = max(gen, g)
        return total, gen


def steal_seconds() -> float | None:
    """CPU time the hypervisor has taken from this machine's CPUs so far (the
    "steal" column of /proc/stat, all CPUs together), or None where there is
    none to read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _switches() -> tuple[int, int] | None:
    """(voluntary, involuntary) context switches of the calling thread so far."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return None
    use = resource.getrusage(who)
    return use.ru_nvcsw, use.ru_nivcsw


def _run_delay() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core
    (the run_delay of Linux's schedstat), or None where it cannot be read."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class CallClock:
    """Wall time of calls, and where each call's time went: the calling
    thread's CPU time, its wait for a core (run queue), and what neither
    explains. A guest kernel that accounts steal (paravirt time accounting,
    as here: /proc/stat's steal advances) leaves out of a thread's CPU time
    what the hypervisor took, so in a call that never blocked (no voluntary
    switch) the remainder is time the virtual CPU was taken away while the
    thread ran (and, on a kernel that accounts interrupt time apart, time in
    interrupts). Where the counters cannot be read (not Linux), ``waited``
    and ``stolen`` hold None."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    preempted: list[int | None] = field(default_factory=list)
    waited: list[float | None] = field(default_factory=list)
    #: None where the call blocked (the remainder may then be a wait for the
    #: GIL or a lock as well) or the counters are missing.
    stolen: list[float | None] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, timed; its result."""
        r0 = _run_delay()
        s0 = _switches()
        # The CPU clock inside the wall clock's window: read outside it, the
        # thread's CPU time came out about 1 us above its wall time in most
        # calls (the clocks' own cost), a negative remainder.
        t0 = time.perf_counter()
        c0 = time.thread_time()
        out = fn(*args)
        c1 = time.thread_time()
        t1 = time.perf_counter()
        s1 = _switches()
        r1 = _run_delay()
        wall, cpu = t1 - t0, c1 - c0
        self.wall.append(wall)
        self.cpu.append(cpu)
        self.windows.append((t0, t1))
        self.preempted.append(None if s0 is None or s1 is None else s1[1] - s0[1])
        # The counters are read outside the timed window, so a wait there
        # counts against the remainder: the steal found is a lower bound.
        waited = None if r0 is None or r1 is None else r1 - r0
        self.waited.append(waited)
        blocked = s0 is None or s1 is None or s1[0] != s0[0]
        self.stolen.append(None if waited is None or blocked
                           else max(0.0, wall - cpu - waited))
        return out

    def without_steal(self) -> list[float]:
        """Each call's wall time less the time the hypervisor took in it."""
        return [w - (s or 0.0) for w, s in zip(self.wall, self.stolen, strict=True)]

    def steal_summary(self) -> dict[str, Any]:
        """How often the hypervisor took the core inside a call, and the
        calls' times with that taken out."""
        known = [s for s in self.stolen if s is not None]
        waits = [w for w in self.waited if w is not None]
        return {
            "calls": len(self.wall),
            "calls_measured": len(known),
            "calls_with_steal": sum(1 for s in known if s > STEAL_NOISE_S),
            "max_stolen_s": max(known, default=None),
            "calls_waiting_for_a_core": sum(1 for w in waits if w > STEAL_NOISE_S),
            "max_wait_for_a_core_s": max(waits, default=None),
            "wall_without_steal": summarize(self.without_steal()) if known else None,
        }


def spin(n: int) -> int:
    """Pure Python work: no memory traffic beyond the processor's caches, no I/O, no lock,
    no GIL let go. The hot path's control call (see `calibrate_spin`)."""
    total = 0
    for i in range(n):
        total += i
    return total


def calibrate_spin(target_s: float) -> int:
    """The loop count for which `spin` takes about ``target_s`` here, now
    (median of 15 calls), so the control call lasts about as long as a
    ``save()`` and meets the same chances of being preempted."""
    n = 10_000
    for _ in range(3):
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            spin(n)
            times.append(time.perf_counter() - t0)
        n = max(1, round(n * target_s / statistics.median(times)))
    return n


#: Steal or a run-queue wait below this, inside one call, is reading noise.
STEAL_NOISE_S = 100e-6


def slow_calls(wall: Sequence[float], cpu: Sequence[float],
               preempted: Sequence[int | None],
               clock: CallClock | None = None) -> dict[str, Any]:
    """Calls whose wall time exceeds twice the median CPU time of a call: how
    many, how many of them the OS preempted, and the most CPU any of them used
    (a slow call with little CPU waited, for a core or for the GIL, or lost
    its core to the hypervisor: ``clock`` tells which, where it was kept)."""
    limit = 2 * statistics.median(cpu) if cpu else 0.0
    slow = [i for i, w in enumerate(wall) if w > limit]
    known = [preempted[i] for i in slow if preempted[i] is not None]
    out = {
        "limit_s": limit,
        "count": len(slow),
        "preempted": sum(1 for p in known if p > 0) if len(known) == len(slow) else None,
        "max_cpu_s": max((cpu[i] for i in slow), default=None),
        "max_wall_s": max((wall[i] for i in slow), default=None),
        # The slowest call's own CPU time, and the slow calls' CPU and wall
        # time together (how much of the tail was work, how much waiting).
        "slowest_cpu_s": cpu[max(slow, key=lambda i: wall[i])] if slow else None,
        "cpu_sum_s": sum(cpu[i] for i in slow),
        "wall_sum_s": sum(wall[i] for i in slow),
    }
    if clock is not None:
        stolen = [clock.stolen[i] for i in slow if clock.stolen[i] is not None]
        waited = [clock.waited[i] for i in slow if clock.waited[i] is not None]
        out["stolen"] = sum(1 for s in stolen if s > STEAL_NOISE_S)
        out["max_stolen_s"] = max(stolen, default=None)
        out["waited_for_a_core"] = sum(1 for w in waited if w > STEAL_NOISE_S)
        out["max_waited_s"] = max(waited, default=None)
        out["blocked"] = sum(1 for i in slow
                             if clock.waited[i] is not None and clock.stolen[i] is None)
    return out


def gc_summary(watch: GcWatch, windows: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """What the collector did inside a list of call windows."""
    found = [watch.within(a, b) for a, b in windows]
    gen2 = [t for t, g in found if g == 2]
    return {
        "calls": len(windows),
        "calls_with_a_collection": sum(1 for _, g in found if g >= 0),
        "calls_with_a_gen2_collection": len(gen2),
        "max_gen2_pause_s": max(gen2) if gen2 else None,
        "max_pause_s": max((t for t, _ in found), default=0.0),
    }


# ---------------------------------------------------------------- interrupts


class _Interrupts:
    """Ctrl-C and SIGTERM as the run takes them (see ``take_interrupts``)."""

    came = threading.Event()
    cleaning = 0  # depth of clean-ups running (``cleaning_up``)


def take_interrupts() -> None:
    """Take SIGTERM (timeout(1), a cancelled CI job) as Ctrl-C: killed
    outright, a run left its kvkeeper serve running on a temporary root.
    None raises KeyboardInterrupt while a clean-up runs: a second signal
    10 ms after the first cut the clean-ups short and left the daemon
    running (2 of 3 runs). ``check_interrupted`` raises it again where it
    was swallowed (inside a garbage collector's callback, the hot path's
    GcWatch: the run went on to the end, 1 run in 14), and so does the next
    signal. A signal ignored at the start (``cmd &`` in a script) stays so."""
    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum: int, frame: object) -> None:
        _Interrupts.came.set()
        if not _Interrupts.cleaning:
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, interrupt)


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if Ctrl-C or SIGTERM came (and no clean-up runs)."""
    if _Interrupts.came.is_set() and not _Interrupts.cleaning:
        raise KeyboardInterrupt


@contextlib.contextmanager
def cleaning_up(clean_up: Callable[[], None]) -> Iterator[None]:
    """Run the body, then ``clean_up()`` however the body ends, with Ctrl-C
    and SIGTERM recorded rather than raised until it is done (then raised).
    The clean-up counts as begun as the body ends, not in a ``finally``'s
    first line, where a signal could still skip it."""
    begun = False
    try:
        yield
        _Interrupts.cleaning += 1
        begun = True
    finally:
        if not begun:
            _Interrupts.cleaning += 1
        try:
            clean_up()
        finally:
            _Interrupts.cleaning -= 1
        check_interrupted()


# ---------------------------------------------------------------- housekeeping


def free_memory() -> None:
    gc.collect()
    mx.clear_cache()


#: Every temporary directory and daemon the run made: its last clean-up
#: (``clean_up_the_rest``) removes and stops what a case's own clean-up did
#: not reach (a signal while mlx-vlm's disk tier was made or closed left
#: its directory).
_MADE_DIRS: list[Path] = []
_DAEMONS: list[DaemonProcess] = []


def short_tmpdir(prefix: str = "kvkb-") -> Path:
    """A 0700 directory under /tmp, short enough for a unix socket path."""
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))
    _MADE_DIRS.append(d)
    os.chmod(d, 0o700)
    return d


def clean_up_the_rest() -> None:
    """Stop every daemon the run started and remove every temporary
    directory it made, those a clean-up already saw to included."""
    for daemon in _DAEMONS:
        daemon.stop()
    for d in _MADE_DIRS:
        remove_tree(d)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to forget the (clean) cached pages of one file; False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def token_ids(n: int, seed: int = 0, vocab: int = 1000) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


# ---------------------------------------------------------------- caches


def kv_cache(shape: Shape, tokens: int, seed: int = 0, fill: int | None = None) -> list[Any]:
    """mlx-lm KVCache layers holding ``fill`` (default ``tokens``) random bf16 tokens.

    KVCache grows 256 tokens at a time and kvkeeper drops the spare rows, so with
    ``tokens`` a multiple of 256 the saved bytes are exactly tokens x bytes/token.
    """
    from mlx_lm.models.cache import KVCache

    n = tokens if fill is None else fill
    mx.random.seed(seed)
    # Random normal values once; every layer's keys and values are shifted copies
    # (generating 512 MiB of random numbers on the CPU takes seconds).
    base = mx.random.normal((1, shape.kv_heads, n, shape.head_dim), dtype=mx.bfloat16)
    layers = []
    for i in range(shape.layers):
        c = KVCache()
        k = base + mx.array(0.01 * (2 * i), dtype=mx.bfloat16)
        v = base * mx.array(-1.0, dtype=mx.bfloat16) + mx.array(0.01 * (2 * i + 1), dtype=mx.bfloat16)
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        layers.append(c)
    return layers


def vlm_mirror(layers: Sequence[Any]) -> list[Any]:
    """The same arrays in mlx-vlm's KVCache class (what mlx-vlm's APC harvests)."""
    from mlx_vlm.models.cache import KVCache

    out = []
    for c in layers:
        v = KVCache()
        v.keys, v.values, v.offset = c.keys, c.values, c.offset
        out.append(v)
    return out


def prompt_cache_state(shape: Shape, tokens: int, seed: int = 0) -> Any:
    """An mlx-vlm PromptCacheState: mlx-vlm KVCache layers plus token ids."""
    from mlx_vlm.generate import PromptCacheState

    state = PromptCacheState()
    state.cache = vlm_mirror(kv_cache(shape, tokens, seed))
    state.token_ids = token_ids(tokens, seed)
    return state


def hybrid_cache(shape: Shape, tokens: int, seed: int = 0, *, vlm: bool = False) -> list[Any]:
    """A hybrid (Qwen3-Next-like) cache: every 4th layer attention (KVCache), the
    others linear attention (ArraysCache of a bf16 conv state and an fp32 recurrent state)."""
    if vlm:
        from mlx_vlm.models.cache import ArraysCache, KVCache
    else:
        from mlx_lm.models.cache import ArraysCache, KVCache

    mx.random.seed(seed)
    conv_dim = 8 * shape.kv_heads * shape.head_dim
    layers: list[Any] = []
    for i in range(shape.layers):
        if i % 4 == 3:
            c = KVCache()
            k = mx.random.normal((1, shape.kv_heads, tokens, shape.head_dim), dtype=mx.bfloat16)
            v = mx.random.normal((1, shape.kv_heads, tokens, shape.head_dim), dtype=mx.bfloat16)
            c.update_and_fetch(k, v)
            mx.eval(c.keys, c.values)
        else:
            c = ArraysCache(2)
            c[0] = mx.random.normal((1, 3, conv_dim), dtype=mx.bfloat16)
            c[1] = mx.random.normal((1, 4 * shape.kv_heads, shape.head_dim, shape.head_dim),
                                    dtype=mx.float32)
            mx.eval(c[0], c[1])
        layers.append(c)
    return layers


def hybrid_to_vlm(layers: Sequence[Any]) -> list[Any]:
    """The same arrays in mlx-vlm's classes."""
    from mlx_vlm.models.cache import ArraysCache, KVCache

    out: list[Any] = []
    for c in layers:
        if hasattr(c, "keys"):
            v = KVCache()
            v.keys, v.values, v.offset = c.keys, c.values, c.offset
        else:
            v = ArraysCache(len(c.cache))
            for j, a in enumerate(c.cache):
                v[j] = a
        out.append(v)
    return out


def layers_of(cache: Any) -> list[Any]:
    return list(cache.cache) if hasattr(cache, "cache") and not isinstance(cache, list) else list(cache)


def state_arrays(cache: Any) -> dict[str, mx.array]:
    """The flattened state arrays of a cache: what a synchronous saver writes."""
    from mlx.utils import tree_flatten

    return {k: v for k, v in tree_flatten([c.state for c in layers_of(cache)])
            if isinstance(v, mx.array)}


def cache_nbytes(cache: Any) -> int:
    return sum(a.nbytes for a in state_arrays(cache).values())


# ---------------------------------------------------------------- the tiny model


def tiny_model(seed: int = 0) -> Any:
    """A real mlx-lm llama, shrunk (4 layers, hidden 256, 4 heads, 2 KV heads), random bf16 weights."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=1000,
        max_position_embeddings=8192,
    )
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    model.eval()
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------- the daemon


@dataclass
class RssSampler:
    """Samples a process's RSS every ``interval`` seconds on a thread."""

    pid: int
    interval: float = 0.005
    peak: int = 0
    samples: int = 0
    series: list[tuple[float, int]] = field(default_factory=list)
    keep_series: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> RssSampler:
        import psutil

        proc = psutil.Process(self.pid)
        t0 = time.monotonic()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    rss = proc.memory_info().rss
                except (psutil.Error, OSError):
                    return
                self.samples += 1
                if rss > self.peak:
                    self.peak = rss
                if self.keep_series:
                    self.series.append((time.monotonic() - t0, rss))
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, name="kvkb-rss", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


def vm_hwm(pid: int) -> int | None:
    """The kernel's peak-RSS mark of a process (Linux), in bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss(pid: int) -> int | None:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # noqa: BLE001 - informational only
        return None


class DaemonProcess:
    """``kvkeeper serve`` as a real subprocess, on its own temporary root and socket."""

    def __init__(self, base: Path, *, max_pending_bytes: int = GiB) -> None:
        self.base = base
        self.root = base / "root"
        self.socket = base / "run" / "kv.sock"
        self.log_path = base / "daemon.log"
        self.max_pending_bytes = max_pending_bytes
        self.proc: subprocess.Popen[bytes] | None = None
        _DAEMONS.append(self)

    def start(self) -> DaemonProcess:
        (self.base / "run").mkdir(mode=0o700, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvkeeper.cli", "serve", "--root", str(self.root),
                 "--socket", str(self.socket), "--max-pending-bytes", str(self.max_pending_bytes),
                 # A temporary store: keeping free space on /tmp is not its job
                 # (on a small tmpfs the default 5 GiB would be refused at start).
                 "--log-level", "warning", "--min-free-bytes", "0"],
                stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + WAIT
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvkeeper serve exited {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvkeeper serve did not bind within the timeout")
            time.sleep(0.02)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def client(self, **kw: Any) -> Any:
        from kvkeeper import Client

        kv = Client(self.socket, timeout=WAIT, connect_timeout=10.0, **kw)
        if not kv.connected:
            kv.close()
            raise RuntimeError(f"cannot connect to the daemon at {self.socket}: {self.log()}")
        return kv

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- machine facts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_dirty() -> bool | None:
    """Whether kvkeeper/ differs from the commit (the run measured uncommitted code)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "kvkeeper"],
                             capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _filesystem(path: Path) -> str | None:
    """Device and type of the file system holding ``path`` (Linux)."""
    try:
        best = ("", "")
        p = str(path.resolve())
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, f"{fstype} on {dev} (mounted at {mnt})")
        return best[1] or None
    except OSError:
        return None


def machine_info(tmp: Path) -> dict[str, Any]:
    import psutil

    import kvkeeper

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "mlx_vlm": _version("mlx-vlm"),
        "pyzmq": _version("pyzmq"),
        "kvkeeper": kvkeeper.__version__,
        "git_commit": _git_commit(),
        "git_dirty_kvkeeper": _git_dirty(),
        "mlx_device": str(mx.default_device()),
        "filesystem": _filesystem(tmp),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def dumps(obj: Any) -> str:
    def default(o: Any) -> Any:
        if isinstance(o, Path):
            return str(o)
        if isinstance(o, np.generic):
            return o.item()
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    return json.dumps(obj, indent=1, default=default, allow_nan=False)
