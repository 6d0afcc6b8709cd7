"""The benchmark suite itself runs end to end (tiny sizes) and writes its three outputs.

No timing is asserted: only that every case ran and reported what the report needs.
"""

from __future__ import annotations

import json
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


def test_a_run_stopped_by_sigterm_stops_its_daemon_and_removes_its_root(tmp_path: Path) -> None:
    """timeout(1) or a cancelled CI job sends SIGTERM: the run died at once
    and left its kvkeeper serve running on a temporary root for good."""
    import os
    import re
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "benchmarks", "--tiny", "--out", str(tmp_path / "bench")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pid = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # (the run's own log: ends if it exits)
            if m := re.search(r"daemon pid (\d+), root (\S+)", line):
                pid, root = int(m[1]), Path(m[2])
            if "case hot_path" in line:
                break
        assert pid is not None and root.is_dir(), "the run never started its daemon"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT)
        assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err[-3000:])
        deadline = time.monotonic() + WAIT
        while _alive(pid):
            assert time.monotonic() < deadline, "its daemon still runs"
            time.sleep(0.05)
        assert not root.exists() and not root.parent.exists()
        assert not (tmp_path / "bench" / "results.json").exists()
    finally:
        proc.kill()
        proc.wait(WAIT)
        if pid is not None and _alive(pid):
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
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                           preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only, on Linux
        time.sleep(0.2)  # the hog is running

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
    busy_wall, sleep_wall = clock.wall
    assert clock.cpu[0] >= 0.05
    # Sharing one core with the hog, the spinning call waited for it.
    assert clock.waited[0] is not None and clock.waited[0] > 0.01, clock
    assert clock.stolen[0] is not None and clock.stolen[0] <= busy_wall
    assert clock.stolen[1] is None and sleep_wall >= 0.05  # blocked: not claimed as steal
