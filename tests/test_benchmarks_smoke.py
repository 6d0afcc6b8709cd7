"""The benchmark suite itself runs end to end (tiny sizes) and writes its three outputs.

No timing is asserted: only that every case ran and reported what the report needs.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("psutil")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parent.parent
WAIT = 60.0
CASES = {"hot_path", "generation", "disk", "load", "resume", "memory", "clients", "requests"}


def test_benchmarks_tiny_run_writes_every_output(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--tiny", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    doc = json.loads((out / "results.json").read_text())
    assert doc["mode"] == "tiny"
    assert set(doc["cases"]) == CASES
    for name, res in doc["cases"].items():
        assert "error" not in res, (name, res.get("traceback"))
    for key in ("cpu", "cores", "ram_bytes", "os", "python", "mlx", "mlx_lm", "mlx_vlm"):
        assert doc["machine"][key], key

    hot = doc["cases"]["hot_path"]
    for size in hot["sizes"]:
        for key in ("kvkeeper_save_idle", "kvkeeper_save_to_durable", "sync_reference_new_file",
                    "sync_reference_replace", "sync_mlx_lm_save_prompt_cache", "kvkeeper_stream"):
            assert key in size, key
        assert size["kvkeeper_save_idle"]["n"] > 0
        assert size["kvkeeper_all_ok"]
        assert size["mlx_vlm_apc"]["handoff_s"]["n"] > 0, size["mlx_vlm_apc"]
        for steal in (size["kvkeeper_save_idle_steal"], size["kvkeeper_stream"]["steal"]):
            assert steal["calls"] > 0
        # The control call, timed under the same conditions as save().
        for control in (size["control_idle"], size["kvkeeper_stream"]["control"]):
            assert control["call"]["n"] > 0 and control["call"]["median"] > 0
    assert {s["label"][:3] for s in hot["special"]} == {"pcs", "hyb"}
    # The counters account for the hot-path stream's saves too (one key: the
    # coalesced and superseded ones), in the order of cases.
    streamed = [t for t in doc["targets"] if "hot-path stream" in t["target"]]
    assert len(streamed) == 1 and streamed[0]["met"], streamed
    assert [t["case"] for t in doc["targets"]] == sorted(
        (t["case"] for t in doc["targets"]), key=lambda c: int(c.split()[0]))
    gen = doc["cases"]["generation"]
    assert gen["tiny_model"]["ratio"] > 0
    assert gen["tiny_model"]["same_tokens_in_every_run"]
    assert doc["cases"]["disk"]["all_ok"]
    for size in doc["cases"]["load"]["sizes"]:
        for key in ("kvkeeper_lazy", "direct_lazy", "kvkeeper_verified", "direct_eval",
                    "mlx_vlm_apc_restore"):
            assert size[key]["n"] > 0, key
    for length in doc["cases"]["resume"]["lengths"]:
        assert length["restored_token_matches_live_cache"]
    mem = doc["cases"]["memory"]
    assert mem["accounted"], mem
    assert mem["rss_peak_bytes"] > 0
    clients = doc["cases"]["clients"]
    assert clients["loads"] > 0 and clients["load_misses"] == 0
    requests = doc["cases"]["requests"]
    for kind in ("ping", "load_miss", "load_other", "load_flooded", "flush"):
        assert requests["flood"][kind]["n"] > 0 and requests["idle"][kind]["n"] > 0, kind
    assert requests["saves_true"] > 0 and requests["flush_after_ok"]

    cases_with_targets = {t["case"] for t in doc["targets"]}
    assert len(cases_with_targets) == 8
    for t in doc["targets"]:
        assert set(t) >= {"case", "target", "measured", "met"}

    md = (out / "BENCHMARKS.md").read_text()
    for heading in ("## Machine", "## Targets", "## 1. Hot path", "## 7. Many clients",
                    "## 8. Requests behind saves"):
        assert heading in md
    assert "**Control.**" in md
    assert (out / "save_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("case", "at", "delays"), [
    ("hot_path", "case hot_path\n", [0.0]),  # inside a case
    # Two signals 10 ms apart as the run ends: the second cut its clean-up short.
    ("hot_path", "case hot_path done", [0.0, 0.01]),
    ("memory", "memory: pushing", [0.02]),  # the memory case's own daemon
])
def test_a_run_stopped_by_sigterm_stops_its_daemons_and_removes_their_roots(
        tmp_path: Path, case: str, at: str, delays: list[float]) -> None:
    """timeout(1) or a cancelled CI job sends SIGTERM: the run died at once
    and left its kvkeeper serve running on a temporary root for good; then a
    SIGTERM in its clean-ups, or in the memory case, did the same."""
    import os
    import re
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "benchmarks", "--tiny", "--cases", case, "--out",
         str(tmp_path / "bench")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    daemons: dict[int, Path] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # (the run's own log: ends if it exits)
            if m := re.search(r"daemon pid (\d+), root (\S+)", line):
                daemons[int(m[1])] = Path(m[2])
            if at in line + "\n":
                break
        else:
            raise AssertionError(f"the run never said {at!r}")
        for delay in delays:
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT)
        assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err[-3000:])
        assert len(daemons) == (2 if case == "memory" else 1), daemons
        deadline = time.monotonic() + WAIT
        while any(_alive(pid) for pid in daemons):
            assert time.monotonic() < deadline, "a daemon still runs"
            time.sleep(0.05)
        assert not any(root.parent.exists() for root in daemons.values())
        assert not (tmp_path / "bench" / "results.json").exists()
    finally:
        proc.kill()
        proc.wait(WAIT)
        for pid in daemons:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_every_idle_round_of_the_hot_path_makes_save_calls() -> None:
    """Quick mode's 8 idle save() calls over 5 rounds went 2, 2, 2, 2, 0: its
    last round timed the synchronous savers with no save() beside them."""
    from benchmarks.common import FULL, QUICK
    from benchmarks.hot_path import idle_rounds

    for prof in (FULL, QUICK):
        for calls in (prof.hot_idle_n, prof.hot_idle_n_other):
            rounds = idle_rounds(calls, prof.sync_reps)
            assert sum(rounds) == calls and min(rounds) >= 1, (prof.name, rounds)
            assert max(rounds) - min(rounds) <= 1, (prof.name, rounds)


def test_from_json_of_a_tiny_run_leaves_the_committed_report(tmp_path: Path) -> None:
    """--from-json of a tiny run's figures, no --out: it replaced the
    committed full-run BENCHMARKS.md and plot with a tiny-mode report."""
    import shutil

    repo = tmp_path / "repo"  # a copy: the real checkout's files are not to be touched
    shutil.copytree(REPO / "benchmarks", repo / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__", "quick", "tiny"))
    (repo / "BENCHMARKS.md").write_text("the full run's\n")
    doc = json.loads((repo / "benchmarks" / "results.json").read_text())
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({**doc, "mode": "tiny"}))
    subset = tmp_path / "subset.json"
    subset.write_text(json.dumps({**doc, "cases": {"disk": doc["cases"]["disk"]}}))
    plot = (repo / "benchmarks" / "save_latency.png").read_bytes()
    run = [sys.executable, "-m", "benchmarks", "--from-json"]
    proc = subprocess.run([*run, str(tiny)], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(tiny mode)" in (repo / "benchmarks" / "tiny" / "BENCHMARKS.md").read_text()
    proc = subprocess.run([*run, str(subset)], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "give --out" in proc.stderr, proc.stderr[-3000:]
    assert (repo / "BENCHMARKS.md").read_text() == "the full run's\n"
    assert (repo / "benchmarks" / "save_latency.png").read_bytes() == plot


def test_from_json_refuses_what_is_not_a_run_s_results(tmp_path: Path) -> None:
    """--from-json of a missing file, of text that is not JSON, or of JSON
    that is not a run's results: exit 2 with the reason (before: a
    traceback), and no report written."""
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "empty.json").write_text("{}")
    for name, needle in (("missing.json", "No such file"), ("text.json", "not a results.json"),
                         ("empty.json", "not a results.json")):
        out = tmp_path / f"out-{name}"
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks", "--from-json", str(tmp_path / name),
             "--out", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 2, (name, proc.stderr[-3000:])
        assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (out / "BENCHMARKS.md").exists()


def test_call_clock_tells_a_wait_for_the_core_from_a_block() -> None:
    """The hot path's per-call clock: a call sharing its core with a busy
    process waits on the run queue (and did not block); a sleeping call
    blocks, and then no steal is claimed for it."""
    import os
    import time

    from benchmarks.common import CallClock

    if not hasattr(os, "sched_setaffinity") or not Path("/proc/thread-self/schedstat").exists():
        clock = CallClock()
        clock.call(time.sleep, 0.01)
        assert clock.waited == [None] and clock.stolen == [None]
        return
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "print(flush=True)\nwhile True: pass"],
                           stdout=subprocess.PIPE, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only, on Linux
        # The hog is spinning once it has said so (a fixed 0.2 s stood for
        # this: a slow interpreter start left the spin below the core).
        assert hog.stdout is not None
        assert select.select([hog.stdout], [], [], WAIT)[0], "the hog did not start"

        def spin() -> None:
            end = time.thread_time() + 0.05  # 50 ms of this thread's CPU
            while time.thread_time() < end:
                pass

        clock = CallClock()
        clock.call(spin)
        clock.call(time.sleep, 0.05)
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait(WAIT)
        if hog.stdout is not None:
            hog.stdout.close()
    busy_wall, sleep_wall = clock.wall
    assert clock.cpu[0] >= 0.05
    # Sharing one core with the hog, the spinning call waited for it.
    assert clock.waited[0] is not None and clock.waited[0] > 0.01, clock
    assert clock.stolen[0] is not None and clock.stolen[0] <= busy_wall
    assert clock.stolen[1] is None and sleep_wall >= 0.05  # blocked: not claimed as steal
