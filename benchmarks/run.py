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
import sys
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
    check_interrupted,
    clean_up_the_rest,
    cleaning_up,
    machine_info,
    remove_tree,
    short_tmpdir,
    steal_seconds,
    take_interrupts,
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
        check_interrupted()  # one swallowed (in a gc callback) stops the run here
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
                        "(into --out, else where a run of its mode writes them; a full "
                        "run's of some cases needs --out)")
    return p


def _targets(name: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    return CASES[name].targets(res)


def _paths(out: Path | None) -> dict[str, Path]:
    """Where the report, the raw figures and the plot go (made if need be):
    into ``out``, or the committed full run's places."""
    if out is not None:
        out = out.resolve()
        paths = {"md": out / "BENCHMARKS.md", "json": out / "results.json",
                 "png": out / "save_latency.png"}
    else:
        paths = {"md": REPO / "BENCHMARKS.md", "json": REPO / "benchmarks" / "results.json",
                 "png": REPO / "benchmarks" / "save_latency.png"}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    return paths


def _redraw(source: Path, out: Path | None) -> int:
    """--from-json: the report and plot of ``source``'s figures, into ``out``;
    without it, where a run of that mode writes them (the committed report
    only for a full run of every case)."""
    try:
        doc = json.loads(source.read_text())
        mode, cases = doc["mode"], set(doc["cases"])
    except OSError as exc:
        print(f"--from-json {source}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # JSONDecodeError is a ValueError; the others: not a run's results.json.
        print(f"--from-json {source}: not a results.json written by a run "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    if mode not in ("full", "quick", "tiny"):
        print(f"--from-json {source}: not a results.json written by a run (mode {mode!r})",
              file=sys.stderr)
        return 2
    if out is None and mode != "full":
        out = REPO / "benchmarks" / mode
    if out is None and cases != set(CASES):
        print(f"--from-json {source}: its run has only some of the cases: give --out DIR, so "
              f"that BENCHMARKS.md keeps the full run", file=sys.stderr)
        return 2
    paths = _paths(out)
    try:
        report.write(doc, paths, write_json=False)
        summary = report.summary_text(doc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"--from-json {source}: not a results.json written by a run "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(summary)
    print(f"\nwrote {paths['md']}, {paths['png']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = TINY if args.tiny else QUICK if args.quick else FULL
    names = list(CASES) if not args.cases else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases: {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    if args.from_json is not None:
        return _redraw(args.from_json, args.out)
    if args.out is None and profile is not FULL:
        # The committed report is the full run's: a quick look beside it.
        args.out = REPO / "benchmarks" / profile.name
    if set(names) != set(CASES) and args.out is None:
        # The committed report holds every case: a subset would replace it with less.
        print("--cases runs only some of the cases: give --out DIR for its report, so that "
              "BENCHMARKS.md and benchmarks/results.json keep the full run", file=sys.stderr)
        return 2
    paths = _paths(args.out)

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # Drops and refusals are expected under load (case 6): counted, not logged.
    logging.getLogger("kvkeeper").setLevel(logging.ERROR)

    take_interrupts()
    # From the package's import: the imports of MLX and the rest count too.
    started = benchmarks.STARTED
    started_at = dt.datetime.now(dt.timezone.utc)
    results: dict[str, Any] = {}
    runtimes: dict[str, float] = {}
    steal: dict[str, float | None] = {}
    base: Path | None = None
    daemon: DaemonProcess | None = None
    kv = None
    sampler = None
    daemon_code: int | None = None
    daemon_log = ""

    def clean_up() -> None:
        nonlocal daemon_code, daemon_log
        if sampler is not None:
            sampler.stop()
        if kv is not None:
            kv.close()
        if daemon is not None:
            daemon_code = daemon.stop()
            daemon_log = daemon.log()
        if base is not None:
            remove_tree(base)
        clean_up_the_rest()

    with cleaning_up(clean_up):
        base = short_tmpdir()
        daemon = DaemonProcess(base, max_pending_bytes=GiB)
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

    targets: list[dict[str, Any]] = []
    for name, res in results.items():
        if "error" in res:
            continue
        try:
            targets.extend(_targets(name, res))
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
