"""Entry point: ``python -m benchmarks [--quick] [--tiny] [--out DIR] [--cases a,b]``.

Starts a real ``kvkeeper serve`` subprocess on a temporary root, runs every case,
prints a summary and writes BENCHMARKS.md, results.json and save_latency.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchmarks
from benchmarks import clients, disk, generation, hot_path, load, memory, report, requests, resume
from benchmarks.common import (
    FULL,
    QUICK,
    TINY,
    DaemonProcess,
    GiB,
    Profile,
    RssSampler,
    machine_info,
    remove_tree,
    short_tmpdir,
    steal_seconds,
)

REPO = Path(__file__).resolve().parent.parent

CASES = {
    "hot_path": hot_path,
    "generation": generation,
    "disk": disk,
    "load": load,
    "resume": resume,
    "memory": memory,
    "clients": clients,
    "requests": requests,
}


@dataclass
class Context:
    profile: Profile
    daemon: DaemonProcess
    kv: Any
    scratch: Path
    started: float
    gc_watch: Any = None

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {msg}", flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark kvkeeper against synchronous saves, the disk, mlx-vlm's APC and "
                    "a real generation loop. Writes BENCHMARKS.md, results.json and "
                    "save_latency.png.")
    p.add_argument("--quick", action="store_true", help="fewer sizes and runs (under 2 minutes)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny caches and 2 runs per figure: a smoke test of the suite itself")
    p.add_argument("--out", type=Path, default=None,
                   help="write the outputs into this directory (default: BENCHMARKS.md at "
                        "the repository root, results.json and save_latency.png in "
                        "benchmarks/ for the full run; benchmarks/quick/ or benchmarks/tiny/ "
                        "for --quick and --tiny, so that they do not replace its report)")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated subset of: {', '.join(CASES)} (default: all); in "
                        f"full mode a subset needs --out, so the full report is not replaced")
    p.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                   help="run nothing: redraw BENCHMARKS.md and the plot from a results.json "
                        "(with --out, those two go into that directory)")
    return p


def _targets(name: str, res: dict[str, Any], results: dict[str, Any]) -> list[dict[str, Any]]:
    mod = CASES[name]
    if name == "load":
        return load.targets(res, results.get("hot_path"))
    return mod.targets(res)


def _terminate_as_interrupt() -> None:
    """Take SIGTERM (timeout(1), a CI job cancelled) as Ctrl-C: the clean-ups
    run (the daemons and client processes stopped, the temp roots removed);
    killed outright, the run left them behind. Once only: a second SIGTERM
    must not cut the clean-ups short."""
    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = TINY if args.tiny else QUICK if args.quick else FULL
    names = list(CASES) if not args.cases else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases: {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    if args.out is None and profile is not FULL and args.from_json is None:
        # The committed report is the full run's: a quick look beside it.
        args.out = REPO / "benchmarks" / profile.name
    if set(names) != set(CASES) and args.out is None and args.from_json is None:
        # The committed report holds every case: a subset would replace it with less.
        print("--cases runs only some of the cases: give --out DIR for its report, so that "
              "BENCHMARKS.md and benchmarks/results.json keep the full run", file=sys.stderr)
        return 2
    if args.out is not None:
        out = args.out.resolve()
        paths = {"md": out / "BENCHMARKS.md", "json": out / "results.json",
                 "png": out / "save_latency.png"}
    else:
        paths = {"md": REPO / "BENCHMARKS.md", "json": REPO / "benchmarks" / "results.json",
                 "png": REPO / "benchmarks" / "save_latency.png"}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json is not None:
        try:
            doc = json.loads(args.from_json.read_text())
            report.write(doc, paths, write_json=False)
            summary = report.summary_text(doc)
        except OSError as exc:
            print(f"--from-json {args.from_json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # JSONDecodeError is a ValueError; the others: not a run's results.json.
            print(f"--from-json {args.from_json}: not a results.json written by a run "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        print(summary)
        print(f"\nwrote {paths['md']}, {paths['png']}")
        return 0

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Drops and refusals are expected under load (case 6): counted, not logged.
    logging.getLogger("kvkeeper").setLevel(logging.ERROR)

    _terminate_as_interrupt()
    # From the package's import: the imports of MLX and the rest count too.
    started = benchmarks.STARTED
    started_at = dt.datetime.now(dt.timezone.utc)
    base = short_tmpdir()
    results: dict[str, Any] = {}
    runtimes: dict[str, float] = {}
    steal: dict[str, float | None] = {}
    daemon = DaemonProcess(base, max_pending_bytes=GiB)
    kv = None
    sampler = None
    try:
        machine = machine_info(base)
        daemon.start()
        sampler = RssSampler(daemon.pid, interval=0.05).start()
        kv = daemon.client()
        ctx = Context(profile, daemon, kv, base / "scratch", started)
        ctx.scratch.mkdir()
        ctx.log(f"kvkeeper benchmarks, {profile.name} mode; daemon pid {daemon.pid}, "
                f"root {daemon.root}")
        for name in names:
            ctx.log(f"case {name}")
            stolen0 = steal_seconds()
            t0 = time.monotonic()
            try:
                results[name] = CASES[name].run(ctx)
            except Exception as exc:  # noqa: BLE001 - one broken case must not lose the others
                results[name] = {"error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()}
                ctx.log(f"case {name} FAILED: {type(exc).__name__}: {exc}")
            runtimes[name] = time.monotonic() - t0
            stolen1 = steal_seconds()
            steal[name] = None if stolen0 is None or stolen1 is None else stolen1 - stolen0
            ctx.log(f"case {name} done in {runtimes[name]:.1f} s")
    finally:
        if sampler is not None:
            sampler.stop()
        if kv is not None:
            kv.close()
        daemon_code = daemon.stop()
        daemon_log = daemon.log()
        remove_tree(base)

    targets: list[dict[str, Any]] = []
    for name, res in results.items():
        if "error" in res:
            continue
        try:
            targets.extend(_targets(name, res, results))
        except Exception as exc:  # noqa: BLE001
            results[name]["targets_error"] = f"{type(exc).__name__}: {exc}"
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc = {
        "schema": 1,
        "mode": profile.name,
        "command": "python -m benchmarks" + (" --quick" if args.quick else "")
                   + (" --tiny" if args.tiny else "")
                   + (f" --cases {','.join(names)}" if set(names) != set(CASES) else ""),
        "started_at": started_at.isoformat(timespec="seconds"),
        "runtime_s": time.monotonic() - started,
        "case_runtimes_s": runtimes,
        # Host interference: on a shared virtual machine the hypervisor may run
        # other guests on these CPUs, which shows in the tail of every timing.
        "case_steal_s": steal,
        "machine": machine,
        "profile": profile.as_dict(),
        "daemon": {"rss_peak_bytes": sampler.peak if sampler else None,
                   "exit_code": daemon_code,
                   "log_tail": daemon_log[-2000:] if daemon_code not in (0, None) else ""},
        "cases": results,
        # In the order (a case may add a target to a later one's).
        "targets": sorted(targets, key=lambda t: int(t["case"].split()[0])),
    }
    report.write(doc, paths)
    print()
    print(report.summary_text(doc))
    print(f"\nwrote {paths['md']}, {paths['json']}, {paths['png']} "
          f"in {doc['runtime_s']:.0f} s")
    failed = [n for n, r in results.items() if "error" in r]
    if failed:
        print(f"cases that failed: {failed}", file=sys.stderr)
        return 1
    return 0
