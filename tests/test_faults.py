"""Crashes, kills, drains, full disks and I/O errors: nothing is lost or torn.

Each test drives a real daemon (mostly ``kvkeeper serve`` as a subprocess, so
it can be killed) with real MLX caches, and checks the files with kvkeeper's
verifying reader, whose checksums catch what safetensors readers accept.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvkeeper.client.client import Client
from kvkeeper.daemon import faults
from kvkeeper.daemon.faults import CRASH_POINTS, ENV

from .conftest import (
    WAIT,
    daemon_log,
    dealer,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
    wait_for_log,
)
from .faultkit import (
    FP,
    NO_DAC,
    entry_path,
    filled,
    limit_file_size,
    need_linux_root,
    run,
    small_disk,
    small_tmpfs,
    tmp_files,
    version_of,
)


def paths(short_dir: Path) -> tuple[Path, Path]:
    return short_dir / "root", short_dir / "run" / "kv.sock"


def test_a_lazy_load_whose_daemon_dies_answering_reads_the_file_it_left(
        short_dir: Path) -> None:
    """A lazy load reads the key's file while the daemon answers. The daemon
    killed right after renaming this client's save into place never answers:
    the load returned its early read, the version before that save."""
    root, sock = paths(short_dir)
    proc = serve_process(root, sock)
    with Client(sock, timeout=WAIT) as kv:
        assert kv.save(FP, "k", filled(2, 1), [1]) and kv.flush(timeout=WAIT)
    assert stop_process(proc) == 0
    # 1 s to write the new version (0.5 s per MiB): the early read comes first.
    proc = serve_process(root, sock, env={ENV: "crash_at=renamed,write_delay=0.5"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "k", filled(2, 2), [2])
            got = kv.load(FP, "k", verify=False)
            assert got is not None and got.token_ids == [2], got
            assert proc.wait(WAIT) == -signal.SIGKILL
    finally:
        stop_process(proc, signal.SIGKILL)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_at_each_step_of_a_replace(short_dir: Path, point: str) -> None:
    root, sock = paths(short_dir)
    proc = serve_process(root, sock)
    with Client(sock, timeout=WAIT) as kv:
        assert kv.save(FP, "k", filled(2, 1), [1])
        assert kv.flush(timeout=WAIT)
    assert stop_process(proc) == 0

    proc = serve_process(root, sock, env={ENV: f"crash_at={point}"})
    with Client(sock, timeout=WAIT) as kv:
        assert kv.save(FP, "k", filled(2, 2), [2])
        assert proc.wait(WAIT) == -signal.SIGKILL
    if point in ("tmp_created", "half_written", "fsynced"):
        assert tmp_files(root), "the kill should have left its tmp file behind"

    # Restart: it binds again (the dead daemon's lock is gone with it), sweeps
    # the tmp file, and the key holds the whole old or the whole new version.
    proc = serve_process(root, sock)
    try:
        assert tmp_files(root) == []
        expected = 2 if point in ("renamed", "dir_fsynced") else 1
        assert version_of(entry_path(root, "k")) == expected
        with Client(sock, timeout=WAIT) as kv:
            got = kv.load(FP, "k")
            assert got is not None and got.token_ids == [expected]
    finally:
        assert stop_process(proc) == 0


def test_an_eviction_is_logged_before_a_kill_can_hide_it(short_dir: Path) -> None:
    """The log said ``event=evicted`` only after the directory's fsync: a
    daemon killed between the unlink and that line left a file gone without
    a word, which reads as a confirmed save lost (a helper's crash review,
    14 of 14 kills in that gap). Here the daemon kills itself right after
    the unlink (``crash_at=evicted``)."""
    root, sock = paths(short_dir)
    budget = int(2.5 * 2**20)  # room for two of the 1 MiB saves
    proc = serve_process(root, sock, "--max-disk-bytes", str(budget), "--min-free-bytes", "0",
                         env={ENV: "crash_at=evicted"})
    with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
        for v, key in enumerate("abc", 1):
            assert kv.save(FP, key, filled(1, v), [v])
            if key != "c":
                assert kv.flush(timeout=WAIT) is True
        assert proc.wait(WAIT) == -signal.SIGKILL  # c's commit evicted a
    assert not entry_path(root, "a").exists()
    log = daemon_log(proc)
    assert f"event=evicted model={FP} id=a " in log, log[-2000:]


def test_a_move_aside_is_logged_before_a_kill_can_hide_it(short_dir: Path) -> None:
    """As for evictions: ``event=quarantined`` came after the two directory
    fsyncs, so a kill between left a file moved aside without its line.
    Here the daemon kills itself right after the move (``crash_at=quarantined``)."""
    root, sock = paths(short_dir)
    proc = serve_process(root, sock, env={ENV: "crash_at=quarantined"})
    with Client(sock, timeout=WAIT) as kv:
        assert kv.save(FP, "k", filled(0.25, 1), [1]) and kv.flush(timeout=WAIT)
        path = entry_path(root, "k")
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01
        path.write_bytes(bytes(data))
        assert kv.load(FP, "k") is None
        assert proc.wait(WAIT) == -signal.SIGKILL
    moved = list((root / "quarantine").iterdir())
    assert len(moved) == 1 and not path.exists()
    log = daemon_log(proc)
    assert f"event=quarantined model={FP} id=k " in log and str(moved[0]) in log, log[-2000:]


def test_random_kill_soak(short_dir: Path) -> None:
    """Saves of varied sizes to a few keys, SIGKILL at random moments, restart.
    KVKEEPER_SOAK_KILLS=30 (and KVKEEPER_SOAK_MAX_MIB=64) for the long run."""
    kills = int(os.environ.get("KVKEEPER_SOAK_KILLS", "5"))
    max_mib = float(os.environ.get("KVKEEPER_SOAK_MAX_MIB", "16"))
    rng = random.Random(20261130)
    root, sock = paths(short_dir)
    keys = ["alpha", "beta", "gamma"]
    sent: dict[str, set[int]] = {k: set() for k in keys}
    confirmed: dict[str, int] = {k: 0 for k in keys}
    version = 0
    survived = 0

    logs: list[Path] = []
    history: list[str] = []

    def check_store() -> None:
        try:
            _check_store()
        except AssertionError:
            for log in logs[-3:]:  # the daemons that made this state
                print(f"---- {log}\n{log.read_text(errors='replace')[-6000:]}")
            print("---- client\n" + "\n".join(history[-80:]))
            raise

    def _check_store() -> None:
        assert tmp_files(root) == []
        for key in keys:
            path = entry_path(root, key)
            if not path.exists():
                assert confirmed[key] == 0, f"{key}: confirmed v{confirmed[key]} lost"
                continue
            v = version_of(path)
            assert v in sent[key], f"{key}: holds v{v}, never sent"
            assert v >= confirmed[key], f"{key}: v{v} older than confirmed v{confirmed[key]}"

    for _ in range(kills):
        proc = serve_process(root, sock, "--log-level", "debug")
        logs.append(proc.log_path)  # type: ignore[attr-defined]
        check_store()
        killer = threading.Timer(rng.uniform(0.3, 1.5), proc.kill)
        killer.start()
        try:
            with Client(sock, timeout=5) as kv:
                # flush() answers for the saves handed off since the last flush
                # that returned (True or False): only those can it confirm.
                window: dict[str, int] = {}
                while proc.poll() is None:
                    key = rng.choice(keys)
                    version += 1
                    if kv.save(FP, key, filled(rng.uniform(1, max_mib), version), [version]):
                        sent[key].add(version)
                        window[key] = version
                        history.append(f"cycle {survived} sent {key} v{version}")
                    if rng.random() < 0.3:
                        try:
                            ok = kv.flush(timeout=5)
                        except Exception:  # noqa: BLE001 - the kill can land mid-flush
                            continue
                        history.append(f"cycle {survived} flush {ok} {window}")
                        if ok:
                            for k, v in window.items():
                                confirmed[k] = max(confirmed[k], v)
                        window = {}
        finally:
            killer.cancel()
            proc.kill()
            proc.wait(WAIT)
        survived += 1
    proc = serve_process(root, sock)
    try:
        check_store()
        assert any(confirmed.values()), "the soak confirmed nothing: it tested nothing"
    finally:
        stop_process(proc)
    assert survived == kills


def wait_received(sock: Path, n: int) -> None:
    with Client(sock, timeout=WAIT) as kv:
        wait_for(lambda: kv.stats()["saves_received"] >= n, "the daemon to receive the saves")


def serve_with_queued_saves(short_dir: Path, name: str, n: int, delay: float,
                            *extra: str) -> tuple[Path, subprocess.Popen[bytes]]:
    """``kvkeeper serve`` on a disk slowed to ``delay`` s per MiB, once it has
    received ``n`` saves of 4 MiB (``name0``... at versions 1...); returns the
    root and the process."""
    root, sock = paths(short_dir)
    proc = serve_process(root, sock, *extra, env={ENV: f"write_delay={delay}"})
    with Client(sock, timeout=WAIT) as kv:
        for i in range(n):
            assert kv.save(FP, f"{name}{i}", filled(4, i + 1), [i + 1])
    wait_received(sock, n)
    return root, proc


def test_sigterm_writes_every_received_save(short_dir: Path) -> None:
    # A slow disk (20 ms per MiB) keeps saves queued when SIGTERM arrives.
    root, proc = serve_with_queued_saves(short_dir, "q", 6, 0.02)
    t0 = time.monotonic()
    assert stop_process(proc) == 0
    assert time.monotonic() - t0 < 20  # the default drain timeout
    for i in range(6):
        assert version_of(entry_path(root, f"q{i}")) == i + 1
    assert not paths(short_dir)[1].exists()


def test_sighup_drains_like_sigterm(short_dir: Path) -> None:
    """A daemon run from a shell gets SIGHUP when the shell closes: by default
    it killed the daemon at once, losing the saves received and not written."""
    root, proc = serve_with_queued_saves(short_dir, "hup", 4, 0.05)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(WAIT) == 0
    for i in range(4):
        assert version_of(entry_path(root, f"hup{i}")) == i + 1
    assert "event=signal signal=SIGHUP" in daemon_log(proc)
    assert tmp_files(root) == []


@pytest.mark.parametrize("ignored", [signal.SIGHUP, signal.SIGINT])
def test_a_signal_ignored_at_start_stays_ignored(short_dir: Path, ignored: int) -> None:
    """`nohup kvkeeper serve` starts with SIGHUP ignored, to outlive the
    terminal, and a shell script's `kvkeeper serve &` with SIGINT ignored
    (Ctrl-C on the script is not for its background jobs): the daemon must
    not undo that (it armed SIGINT again, and drained on it)."""
    root, sock = paths(short_dir)
    proc = serve_process(root, sock, preexec_fn=lambda: signal.signal(ignored, signal.SIG_IGN))
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "n", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            proc.send_signal(ignored)
            time.sleep(0.5)  # a drain, had it started, would have ended the daemon by now
            assert proc.poll() is None
            assert kv.save(FP, "n", filled(1, 2), [2]) and kv.flush(timeout=WAIT)
    finally:
        assert stop_process(proc) == 0
    assert version_of(entry_path(root, "n")) == 2
    name = signal.Signals(ignored).name
    assert f"signal={name}" not in daemon_log(proc)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_second_signal_does_not_cut_the_drain_short(short_dir: Path, second: int) -> None:
    # 50 ms per MiB: the four saves take about 0.8 s to write.
    root, proc = serve_with_queued_saves(short_dir, "twice", 4, 0.05)
    proc.send_signal(signal.SIGINT)
    wait_for_log(proc, "event=draining", "the drain to start")
    proc.send_signal(second)
    assert proc.wait(WAIT) == 0
    for i in range(4):
        assert version_of(entry_path(root, f"twice{i}")) == i + 1
    assert "event=signal_ignored" in daemon_log(proc)
    assert tmp_files(root) == []


def test_a_drain_timeout_during_the_last_write_is_a_drain_done(short_dir: Path) -> None:
    """--drain-timeout 0.5 comes while the last save's commit (its rename,
    then 1 s before the directory's fsync) is under way, which the writer is
    let finish. Every save taken was written, and yet the daemon exited 1
    with `event=drain_timeout` and no key named (a chaos run's finding, on
    a slow disk with a single SIGTERM)."""
    root, sock = paths(short_dir)
    proc = serve_process(root, sock, "--drain-timeout", "0.5",
                         env={ENV: "renamed_delay=1.0"})
    with Client(sock, timeout=WAIT) as kv:
        assert kv.save(FP, "last", filled(1, 1), [1])
    wait_received(sock, 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(WAIT) == 0, daemon_log(proc)[-800:]
    log = daemon_log(proc)
    assert "event=drained" in log and "drain_timeout seconds" not in log, log
    assert version_of(entry_path(root, "last")) == 1
    assert tmp_files(root) == []


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_signals_after_the_drain_do_not_kill_the_daemon(short_dir: Path, second: int) -> None:
    """After `event=drained` the daemon lets the last replies out to its
    clients; a signal then (an impatient user, a supervisor repeating
    itself) found the default handlers back and killed it by that signal
    (exit -2 or -15, the socket file left), in 17 of 17 chaos trials."""
    root, sock = paths(short_dir)
    proc = serve_process(root, sock)
    sent = 0
    with Client(sock, timeout=WAIT) as kv:  # connected: the daemon lingers for it
        assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
        proc.send_signal(signal.SIGTERM)
        wait_for_log(proc, "event=drained", "the drain to end")
        deadline = time.monotonic() + WAIT
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(second)
            sent += 1
            time.sleep(0.005)
    assert proc.wait(WAIT) == 0, (sent, daemon_log(proc)[-600:])
    assert not sock.exists()
    assert version_of(entry_path(root, "k")) == 1


_SIGNAL_TRACE = """
import json, signal, sys, threading
from pathlib import Path
from kvkeeper.daemon.app import Daemon, DaemonConfig

real, calls = signal.signal, []

def traced(signum, handler):
    calls.append((int(signum), handler))
    return real(signum, handler)

signal.signal = traced
d = Daemon(DaemonConfig(root=Path(sys.argv[1]), socket=Path(sys.argv[2]),
                        max_disk_bytes=None, min_free_bytes=0))
threading.Timer(1.0, d.stop).start()
code = d.run(exiting=True)
drain = {int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGHUP)}
default = [(s, repr(h)) for s, h in calls
           if s in drain and (h is signal.SIG_DFL or h is signal.default_int_handler)]
print(json.dumps({"code": code, "calls": len(calls), "default": default,
                  "ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN}))
"""


def test_the_drain_signals_never_get_their_default_handlers_back_before_the_exit(
        short_dir: Path) -> None:
    """Deterministic half of the test above: closing anyio's signal receiver
    (asyncio's loop.add_signal_handler) put SIG_DFL and Python's default
    SIGINT handler back before they could be ignored, and a signal in
    between (the test above sends one every 5 ms) killed the daemon or ended
    it as interrupted (exit 130, a CI run). Every handler the daemon sets,
    traced: none is a default one, and the last is SIG_IGN."""
    import sys

    root, sock = paths(short_dir)
    r = subprocess.run([sys.executable, "-c", _SIGNAL_TRACE, str(root), str(sock)],
                       capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["code"] == 0 and got["calls"] >= 6, got
    assert got["default"] == [] and got["ignored"], got


@pytest.mark.parametrize(("n", "delay", "timeout"), [(4, 0.25, "0.5"), (12, 0.02, "0.2")])
def test_drain_timeout_logs_what_did_not_fit(short_dir: Path, n: int, delay: float,
                                             timeout: str) -> None:
    """1 s a save, or 80 ms: the writer went on taking saves while the last
    replies went out (0.25 s), so that the second case wrote saves the log
    had named as lost."""
    root, proc = serve_with_queued_saves(short_dir, "slow", n, delay, "--drain-timeout", timeout)
    assert stop_process(proc) == 1  # not everything was written: say so
    log = daemon_log(proc)
    unsaved = [f"slow{i}" for i in range(n) if not entry_path(root, f"slow{i}").exists()]
    assert unsaved, f"a disk this slow cannot write {n} saves in {timeout} s"
    for cache_id in unsaved:
        assert f"event=not_saved_at_exit model={FP} id={cache_id}" in log
    for i in range(n):
        if entry_path(root, f"slow{i}").exists():
            assert version_of(entry_path(root, f"slow{i}")) == i + 1
    # The writer went on while the last replies went out: saves logged as
    # lost were then written (the log was wrong), and the drain overran.
    logged = re.findall(rf"event=not_saved_at_exit model={FP} id=(\S+)", log)
    assert sorted(logged) == sorted(unsaved), log


def _gc_across_sigterm(kv: Client, proc: subprocess.Popen[bytes], ready: Callable[[], bool],
                       then: Callable[[], object] = lambda: None) -> list[object]:
    """What a gc evicted, asked before the daemon is sent SIGTERM, once
    ``ready`` says the daemon has it (``then`` runs right after the signal).
    (After a fixed 0.5 s, a gc late to come found the drain begun, and
    returned at once, unlogged.)"""
    answer: list[Any] = []
    asker = threading.Thread(target=lambda: answer.append(kv.gc()), daemon=True)
    asker.start()
    wait_for(ready, "the gc to reach the daemon")
    proc.send_signal(signal.SIGTERM)
    then()
    asker.join(WAIT)
    assert answer, "the gc was not answered"
    return list(answer[0].entries)


def _gc_across_the_drain_evicts_nothing(root: Path, sock: Path, proc: subprocess.Popen[bytes],
                                        ready: Callable[[], bool],
                                        then: Callable[[], object] = lambda: None,
                                        logged: str = "event=evictions_stopped") -> None:
    """A gc across SIGTERM (``_gc_across_sigterm``) evicts nothing of a, b
    and c, the daemon exits 0, and its log says why (``logged``)."""
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert _gc_across_sigterm(kv, proc, ready, then) == []
        assert proc.wait(WAIT) == 0
    finally:
        stop_process(proc, signal.SIGKILL)
    assert all(entry_path(root, key).exists() for key in "abc")
    assert logged in daemon_log(proc)


def test_a_gc_whose_turn_comes_during_the_drain_evicts_nothing(short_dir: Path) -> None:
    """From the drain's start gc evicts nothing, but a gc asked before it,
    its evictions queued behind a save being written, evicted during the
    drain all the same (here: the save itself, the one entry, which a file
    put in the root pushes over the budget; the save's own pass keeps it)."""
    MiB = 2**20
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    proc = serve_process(root, sock, "--min-write-interval", "0", "--min-free-bytes", "0",
                         "--max-disk-bytes", str(17 * MiB), env={ENV: f"write_hold={go}"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "x", filled(16, 2), [2])  # written once go is there
            wait_for_log(proc, "event=fault_hold step=write", "the writer to be held in the big save")
            # Seen only by a rescan: over the budget with it.
            (root / "notes.bin").write_bytes(b"n" * (2 * MiB))
            # The gc's rescan is done at once; its evictions queue behind the save.
            assert _gc_across_sigterm(kv, proc, lambda: kv.stats()["queue_depth"] >= 1,
                                      then=go.touch) == []
        assert proc.wait(WAIT) == 0
    finally:
        go.touch()
        stop_process(proc, signal.SIGKILL)
    assert version_of(entry_path(root, "x")) == 2
    assert "event=gc_cut_short reason=draining" in daemon_log(proc)


def test_a_gc_rescanning_when_the_drain_begins_evicts_nothing(short_dir: Path) -> None:
    """As above, with the gc already reading the root when SIGTERM comes (a
    large store's rescan takes seconds): its evictions once the rescan was
    done came during the drain."""
    MiB = 2**20
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    go.touch()  # the start-up scan goes through; the gc's waits for it
    proc = serve_process(root, sock, "--min-write-interval", "0", "--min-free-bytes", "0",
                         "--max-disk-bytes", str(MiB), env={ENV: f"scan_hold={go}"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for key in "abc":
                assert kv.save(FP, key, filled(0.25, 1), [1])
            assert kv.flush(timeout=WAIT)
        (root / "notes.bin").write_bytes(b"n" * (MiB // 2))  # over the budget with it
        go.unlink()
    except BaseException:
        stop_process(proc, signal.SIGKILL)
        raise
    # (The gc's rescan reads the root, and waits for go.)
    _gc_across_the_drain_evicts_nothing(
        root, sock, proc, lambda: "event=fault_hold step=scan" in daemon_log(proc),
        then=lambda: (time.sleep(0.3), go.touch()), logged="event=gc_cut_short reason=draining")


def test_saves_are_written_while_a_gc_reads_the_root(short_dir: Path) -> None:
    """A gc's rescan takes seconds on a large, cold store (10,000 entries:
    about 1 s here): it ran on the writer's turn, and every save waited for
    it. It now runs beside the writer. Here it would wait for ``go`` for
    600 s before its first file: a save made meanwhile is written and
    flushed, evicting to the budget as a save does, and the drain then cuts
    the gc short, within --drain-timeout."""
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    go.touch()  # the start-up scan goes through; the gc's waits for it
    proc = serve_process(root, sock, "--min-write-interval", "0", "--drain-timeout", "5",
                         "--min-free-bytes", "0", "--max-disk-bytes", str(2**20),  # one fits
                         env={ENV: f"scan_hold={go},scan_hold_after=0"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "old", filled(0.75, 1), [1]) and kv.flush(timeout=WAIT)
            go.unlink()
            answer: list[Any] = []
            asker = threading.Thread(target=lambda: answer.append(kv.gc()), daemon=True)
            asker.start()
            time.sleep(0.5)  # the gc's rescan waits for go
            assert kv.save(FP, "new", filled(0.75, 2), [2])
            assert kv.flush(timeout=WAIT)
            assert version_of(entry_path(root, "new")) == 2
            assert not entry_path(root, "old").exists()
            assert not answer, "the gc's rescan was let go"
            proc.send_signal(signal.SIGTERM)
            asker.join(WAIT)
            assert answer and list(answer[0].entries) == []
        assert proc.wait(WAIT) == 0
    finally:
        stop_process(proc, signal.SIGKILL)
    assert "event=gc_cut_short reason=draining" in daemon_log(proc)


def test_a_start_up_scan_the_drain_meets_after_its_last_file_evicts_nothing(
        short_dir: Path) -> None:
    """The start-up scan had read every file when SIGTERM came: its eviction
    pass then ran during the drain, and a gc that waited for the scan
    answered with what it evicted."""
    MiB = 2**20
    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    proc = serve_process(root, sock, "--min-write-interval", "0", "--min-free-bytes", "0")
    with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
        for key in "abc":
            assert kv.save(FP, key, filled(0.5, 1), [1])
        assert kv.flush(timeout=WAIT)
    assert stop_process(proc) == 0
    # Over a 1 MiB budget; the scan waits after its last file until the drain.
    proc = serve_process(root, sock, "--min-free-bytes", "0", "--max-disk-bytes", str(MiB),
                         env={ENV: f"scan_hold={go}"}, indexed=False)
    # Nothing tells when the gc, waiting for the scan, has come: 0.5 s. What
    # is checked holds either way (a gc come during the drain evicts nothing).
    _gc_across_the_drain_evicts_nothing(root, sock, proc, lambda: time.sleep(0.5) is None)


def test_a_client_that_never_answers_the_drain_notice_does_not_make_it_a_timeout(
        short_dir: Path) -> None:
    """The drain takes a client's saves until it answers the notice. A drain
    timeout shorter than that window, with every save taken already written,
    is a drain done (exit 0), not one the timeout cut short (exit 1)."""
    import zmq

    from kvkeeper.protocol import messages as m

    root, sock = paths(short_dir)
    proc = serve_process(root, sock, "--drain-timeout", "0.5", "--min-write-interval", "0")
    ctx = zmq.Context()
    try:
        raw = dealer(ctx, sock)
        raw.send(m.encode(m.SaveBegin(v=m.PROTOCOL_VERSION, save=1, model=FP, cache_id="raw",
                                      tensors=[m.TensorSpec("t", "U8", [4])])))
        raw.send_multipart([m.encode(m.SaveData(v=m.PROTOCOL_VERSION, save=1, frames=1)),
                            b"1234"])
        with Client(sock, timeout=WAIT) as kv:
            wait_for(lambda: kv.stats()["saves_written"] == 1, "the raw save")
        proc.send_signal(signal.SIGTERM)
        assert isinstance(m.decode_reply(raw.recv()), m.Draining)  # never answered
        assert proc.wait(WAIT) == 0
    finally:
        ctx.destroy(linger=0)
        stop_process(proc, signal.SIGKILL)
    log = daemon_log(proc)
    assert "event=drain_saves_closed reason=drain_timeout" in log and "event=drained" in log
    assert entry_path(root, "raw").exists()


def test_a_delete_cut_off_by_the_drain_timeout_is_not_logged_as_a_save(short_dir: Path) -> None:
    """A delete that replaced a queued save is that key's last job: if the
    drain timeout cuts it off, the log names a delete not done, not a save."""
    root, proc = serve_with_queued_saves(short_dir, "gone", 4, 0.25, "--drain-timeout", "0.5")
    sock = paths(short_dir)[1]
    answers: list[object] = []

    def delete_last() -> None:
        with Client(sock, timeout=WAIT) as kv:
            try:
                answers.append(kv.delete(FP, "gone3"))
            except Exception as exc:  # noqa: BLE001 - the drain's refusal is an answer too
                answers.append(exc)

    deleter = threading.Thread(target=delete_last)
    deleter.start()
    with Client(sock, timeout=WAIT) as kv:
        wait_for(lambda: kv.stats()["saves_superseded"] >= 1, "the delete to replace the save")
    assert stop_process(proc) == 1
    deleter.join(WAIT)
    assert not deleter.is_alive() and answers
    log = daemon_log(proc)
    assert not entry_path(root, "gone3").exists()
    assert f"event=not_deleted_at_exit model={FP} id=gone3" in log
    assert f"event=not_saved_at_exit model={FP} id=gone3" not in log


@pytest.mark.parametrize("sender", ["client", "one_message"])
def test_the_drain_timeout_bounds_a_big_save_being_written(short_dir: Path,
                                                          sender: str) -> None:
    """A save received whole is written a slice at a time, so a drain's
    timeout ends the daemon within a slice: SIGTERM with a 1 s timeout while
    a 256 MiB save is written at 0.1 s per MiB, sent by the client (8 MiB
    messages) or by a raw client as one message of one frame (before: the
    bytes received, then the message, went to the disk thread in one call,
    which nothing cancels: about 25 s, past the 10 s a service manager
    allows beyond the drain timeout)."""
    import zmq

    from kvkeeper.protocol import messages as m

    root, sock = paths(short_dir)
    proc = serve_process(root, sock, "--drain-timeout", "1", env={ENV: "write_delay=0.1"})
    ctx = zmq.Context()
    with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
        if sender == "client":
            assert kv.save(FP, "big", filled(256, 1), [1])
        else:
            total = 256 * 2**20
            raw = dealer(ctx, sock)
            raw.send(m.encode(m.SaveBegin(v=m.PROTOCOL_VERSION, save=1, model=FP,
                                          cache_id="big",
                                          tensors=[m.TensorSpec("t", "U8", [total])])))
            raw.send_multipart([m.encode(m.SaveData(v=m.PROTOCOL_VERSION, save=1, frames=1)),
                                b"\1" * total])
        wait_for(lambda: kv.stats()["bytes_received"] >= 256 * 2**20, "the save received")
        time.sleep(0.5)  # the writer inside its first slice
        t0 = time.monotonic()
        assert stop_process(proc) == 1
        took = time.monotonic() - t0
    ctx.destroy(linger=0)
    assert took < 10, took  # 1 s, then the slice being written (up to 3.2 s)
    log = daemon_log(proc)
    assert f"event=not_saved_at_exit model={FP} id=big" in log
    assert tmp_files(root) == []
    assert not entry_path(root, "big").exists()


def fault_round(kv: Client, root: Path, v_good: int, v_bad: int, mib_bad: float) -> None:
    """A save under a fault fails cleanly: counted, old file intact, no tmp left,
    loads keep working."""
    before = kv.stats()["saves_failed"]
    assert kv.save(FP, "k", filled(mib_bad, v_bad), [v_bad])
    assert kv.flush(timeout=WAIT) is False
    assert kv.stats()["saves_failed"] == before + 1
    assert tmp_files(root) == []
    assert version_of(entry_path(root, "k")) == v_good
    got = kv.load(FP, "k")
    assert got is not None and got.token_ids == [v_good]


def test_full_disk(short_dir: Path) -> None:
    with small_tmpfs(short_dir, "6m") as mnt:
        root = mnt / "root"
        rd = start_daemon(root, short_dir / "run" / "kv.sock")
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
                fault_round(kv, root, v_good=1, v_bad=2, mib_bad=8)  # ENOSPC
                assert kv.save(FP, "k", filled(1, 3), [3]) and kv.flush(timeout=WAIT)
                assert version_of(entry_path(root, "k")) == 3
        finally:
            assert rd.stop() == 0


@contextlib.contextmanager
def _four_saves_on_a_small_disk(short_dir: Path) -> Iterator[tuple[Path, Client]]:
    """A daemon keeping 4 MiB free on a 48 MiB tmpfs, with entries a, b, c, d
    of 10 MiB (versions 1-4) saved in that order: 8 MiB are free. Yields the
    mount and a client."""
    with small_tmpfs(short_dir, "48m") as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=4 * 2**20,
                          min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for i, k in enumerate("abcd"):
                    assert kv.save(FP, k, filled(10, i + 1), [i + 1]) and kv.flush(timeout=WAIT)
                yield mnt, kv
        finally:
            assert rd.stop() == 0


def test_a_full_disk_makes_room_for_the_next_save(short_dir: Path) -> None:
    """Only a commit evicted: on a disk whose free space was above
    --min-free-bytes but below the next save, every save failed with ENOSPC
    (a new key, a new version of a stored one), and nothing was ever evicted
    to make room; nor when another program filled the disk."""
    mib = 2**20
    with _four_saves_on_a_small_disk(short_dir) as (mnt, kv):
        root = mnt / "root"
        assert kv.stats()["evictions"] == 0  # 48 MiB, 8 MiB free: within the budget
        assert kv.save(FP, "e", filled(10, 5), [5]) and kv.flush(timeout=WAIT)
        assert version_of(entry_path(root, "e")) == 5
        assert not entry_path(root, "a").exists()  # the least recently used went
        # Another program fills the disk below the daemon's minimum.
        filler = mnt / "other-program.bin"
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(filler, "wb") as f:
            f.write(b"\0" * (free - 2 * mib))
        assert kv.save(FP, "c", filled(10, 6), [6]) and kv.flush(timeout=WAIT)
        assert version_of(entry_path(root, "c")) == 6
        s = kv.stats()
        assert s["saves_failed"] == 0 and s["evictions"] >= 2, s
        assert filler.exists()  # not the daemon's to delete
        assert [e.cache_id for e in kv.entries()][-1] == "c"


def test_evictions_that_free_no_space_stop(short_dir: Path) -> None:
    """An entry's unlink frees nothing while another link (a `cp -al` backup
    of the root) or an open descriptor keeps its blocks: a save on a full
    disk evicted every entry, one after the other, and still failed. Now an
    entry linked elsewhere is passed over, and a pass evicts the files whose
    sizes make up the shortfall, without reading the free space again: c
    goes, and frees nothing. The write then meets ENOSPC and makes one round
    of room for the bytes it lacks (room_after_full): d, which frees them,
    and e is written. With d held open too, that round frees nothing and the
    save fails there: c and d gone, a and b kept."""
    with _four_saves_on_a_small_disk(short_dir) as (mnt, kv):
        root = mnt / "root"
        for k in "ab":
            os.link(entry_path(root, k), mnt / f"backup-{k}")
        with open(entry_path(root, "c"), "rb"):  # a reader elsewhere keeps its blocks
            assert kv.save(FP, "e", filled(10, 5), [5])
            assert kv.flush(timeout=WAIT) is True
            assert kv.stats()["evictions"] == 2
            assert not entry_path(root, "c").exists() and not entry_path(root, "d").exists()
            assert [version_of(entry_path(root, k)) for k in "abe"] == [1, 2, 5]
        assert tmp_files(root) == []
    again = short_dir / "2"
    again.mkdir(mode=0o700)
    with _four_saves_on_a_small_disk(again) as (mnt, kv):
        root = mnt / "root"
        for k in "ab":
            os.link(entry_path(root, k), mnt / f"backup-{k}")
        with open(entry_path(root, "c"), "rb"), open(entry_path(root, "d"), "rb"):
            assert kv.save(FP, "e", filled(10, 5), [5])
            assert kv.flush(timeout=WAIT) is False
            assert kv.stats()["evictions"] == 2
            assert [version_of(entry_path(root, k)) for k in "ab"] == [1, 2]
        assert tmp_files(root) == []


def test_a_disk_that_frees_blocks_later_loses_no_more_than_the_save_needs(
        short_dir: Path) -> None:
    """XFS frees an unlinked file's blocks in the background: free space read
    again right after each eviction had not moved yet, so the budget went on
    evicting (a review: 5 entries for a save that needed 2). The pass now
    counts the sizes of the files it evicted."""
    mib = 2**20
    with small_disk(short_dir, 320, "xfs") as mnt:
        root = mnt / "root"
        rd = start_daemon(root, short_dir / "run" / "kv.sock", min_free_bytes=0,
                          min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
                with open(mnt / "other-program.bin", "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, free - 70 * mib)
                for i, k in enumerate("abcd"):
                    assert kv.save(FP, k, filled(15, i + 1), [i + 1]) and kv.flush(timeout=WAIT)
                assert kv.stats()["evictions"] == 0
                free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
                # Two of the 15 MiB entries make room; three or four were evicted.
                size = (free + 20 * mib) // mib
                assert kv.save(FP, "z", filled(size, 9), [9]) and kv.flush(timeout=WAIT)
                assert kv.stats()["evictions"] == 2
                assert [version_of(entry_path(root, k)) for k in "cdz"] == [3, 4, 9]
        finally:
            assert rd.stop() == 0


def test_min_free_holds_on_a_btrfs_subvolume(short_dir: Path) -> None:
    """sessions/ a btrfs subvolume (kept out of snapshots that way): it has
    a device number of its own, and was taken for a model's own disk, where
    --min-free-bytes does not apply: the disk filled past it, nothing
    evicted. It shares the pool's free space, so the budget holds."""
    mib = 2**20
    with small_disk(short_dir, 400, "btrfs") as mnt:
        root = mnt / "root"
        root.mkdir(mode=0o700)
        run("btrfs", "subvolume", "create", str(root / "sessions"))
        (root / "sessions").chmod(0o700)
        assert os.stat(root).st_dev != os.stat(root / "sessions").st_dev
        run("btrfs", "filesystem", "sync", str(mnt))
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        rd = start_daemon(root, short_dir / "run" / "kv.sock",
                          min_free_bytes=free - 50 * mib, min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for i in range(6):  # 120 MiB, where 50 MiB may be used
                    assert kv.save(FP, f"k{i}", filled(20, i + 1), [i + 1])
                    assert kv.flush(timeout=WAIT)
                    run("btrfs", "filesystem", "sync", str(mnt))
                assert kv.stats()["evictions"] >= 3
                assert entry_path(root, "k5").exists() and not entry_path(root, "k0").exists()
        finally:
            assert rd.stop() == 0


def test_a_nearly_full_btrfs_keeps_its_entries_and_takes_every_save(short_dir: Path) -> None:
    """btrfs hands an unlinked file's blocks back at its next commit, and near
    full gives a few MiB less than it says is free (a durability review): the
    pass before a write counted its evictions as free, the write met ENOSPC,
    and the next save evicted another entry and failed alike, until the store
    was empty (2 of 239 flushes True). A write that meets ENOSPC now commits
    the file system, evicts as if nothing were free, and goes on."""
    mib = 2**20
    with small_disk(short_dir, 300, "btrfs") as mnt:
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(mnt / "other", "wb") as f:  # another program's: 30 MiB left free
            for _ in range((free - 30 * mib) // mib):
                f.write(b"x" * mib)
            os.fsync(f.fileno())
        run("btrfs", "filesystem", "sync", str(mnt))
        root = mnt / "root"
        rd = start_daemon(root, short_dir / "run" / "kv.sock", min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for i in range(1, 13):
                    for k in ("a", "b", "c"):  # 3 x 8 MiB, and a new version's room
                        assert kv.save(FP, k, filled(8, i), [i])
                    assert kv.flush(timeout=WAIT), i
                stats = kv.stats()
                assert stats["saves_failed"] == 0 and stats["saves_written"] >= 12
                # Room for three and a new version's tmp file: a save may
                # evict the one before it, as on ext4.
                kept = {e.cache_id for e in kv.entries()}
                assert "c" in kept and len(kept) >= 2, kept
            assert [version_of(entry_path(root, k)) for k in sorted(kept)] == [12] * len(kept)
        finally:
            assert rd.stop() == 0


def _save_8_mib_then_fill(kv: Client, root: Path, mnt: Path) -> None:
    """Save k (8 MiB, version 2); once its tmp file is made (the pass before
    its write is done), fill the disk with another file to 6 MiB free: the
    rest of the write lacks 2 MiB. With write_delay set: written slowly."""
    assert kv.save(FP, "k", filled(8, 2), [2])
    wait_for(lambda: tmp_files(root) != [], "the save's tmp file")
    st = os.statvfs(mnt)
    (mnt / "filler").write_bytes(b"x" * (st.f_bavail * st.f_frsize - 6 * 2**20))


def test_a_write_that_meets_a_full_disk_makes_room_and_goes_on(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Another program fills the disk while a save is written, after the pass
    before it found room: the write meets ENOSPC, evicts the least recently
    used entry for the bytes it lacks (not for --min-free-bytes too: that is
    the pass after the commit's) and goes on where it stopped (before: the
    save failed). tmpfs frees at the unlink, as APFS does (macOS has no
    syncfs)."""
    mib = 2**20
    caplog.set_level(logging.INFO, logger="kvkeeper")
    monkeypatch.setitem(faults.ACTIVE, "write_delay", "0.1")  # 0.8 s for the 8 MiB
    with small_tmpfs(short_dir, "24m") as mnt:
        root = mnt / "root"
        rd = start_daemon(root, short_dir / "run" / "kv.sock", min_write_interval=0,
                          min_free_bytes=5 * mib)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for k in ("o1", "o2"):
                    assert kv.save(FP, k, filled(4, 1), [1]) and kv.flush(timeout=WAIT)
                _save_8_mib_then_fill(kv, root, mnt)
                assert kv.flush(timeout=WAIT) is True
                # o1 for the write; o2 by the pass after it, for --min-free-bytes.
                assert kv.stats()["evictions"] == 2
                assert {e.cache_id for e in kv.entries()} == {"k"}
            assert version_of(entry_path(root, "k")) == 2
            assert tmp_files(root) == []
        finally:
            assert rd.stop() == 0
    out = [r.getMessage() for r in caplog.records if "event=write_out_of_space" in r.getMessage()]
    assert len(out) == 1 and out[0].endswith(" evicted=1 room=1"), out


def test_a_write_that_meets_a_full_disk_stops_where_evictions_free_nothing(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, with every entry held open elsewhere (lazy loads; a btrfs
    snapshot keeps blocks alike): the first eviction frees nothing, and the
    write gives up there (a review: a second try evicted the next entry for
    nothing too)."""
    monkeypatch.setitem(faults.ACTIVE, "write_delay", "0.1")
    with small_tmpfs(short_dir, "24m") as mnt:
        root = mnt / "root"
        rd = start_daemon(root, short_dir / "run" / "kv.sock", min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv, \
                    contextlib.ExitStack() as held:
                for k in ("o1", "o2", "o3"):
                    assert kv.save(FP, k, filled(3, 1), [1]) and kv.flush(timeout=WAIT)
                    held.enter_context(open(entry_path(root, k), "rb"))  # noqa: SIM115
                _save_8_mib_then_fill(kv, root, mnt)
                assert kv.flush(timeout=WAIT) is False
                assert kv.stats()["evictions"] == 1
                assert {e.cache_id for e in kv.entries()} == {"o2", "o3"}
            assert tmp_files(root) == []
        finally:
            assert rd.stop() == 0


def test_a_model_on_a_disk_of_its_own_gets_room_there(short_dir: Path) -> None:
    """The README says: to keep one model elsewhere, mount its disk at its
    directory. Free space was read on the root's file system only: once the
    model's disk was full every save of it failed (ENOSPC), nothing evicted
    there. Now a save makes room on the disk it goes to, evicting that disk's
    entries only; --min-free-bytes stays the root's (8 MiB here, more than
    the whole 6 MiB model disk)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    model_dir = entry_path(root, "x", model="big").parent
    model_dir.parent.mkdir(mode=0o700, parents=True)  # (small_tmpfs makes the model's)
    root.chmod(0o700)
    with small_tmpfs(model_dir.parent, "6m", name=model_dir.name):
        rd = start_daemon(root, sock, min_free_bytes=8 * 2**20, min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for k in ("o1", "o2"):
                    assert kv.save(FP, k, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
                for i in range(5):
                    assert kv.save("big", f"s{i}", filled(2, i + 1), [i + 1])
                    assert kv.flush(timeout=WAIT), i
                s = kv.stats()
                assert s["saves_failed"] == 0 and s["evictions"] == 3, s
                assert sorted(p.name for p in model_dir.iterdir()) == \
                    ["s3.safetensors", "s4.safetensors"]
                assert [version_of(entry_path(root, f"s{i}", model="big"), "big")
                        for i in (3, 4)] == [4, 5]
                assert [version_of(entry_path(root, k)) for k in ("o1", "o2")] == [1, 1]
        finally:
            assert rd.stop() == 0


def test_disks_of_one_size_are_told_apart(short_dir: Path) -> None:
    """Models A and B each on a 16 MiB tmpfs of their own: told apart by
    their size alone, they were taken for one disk, and a save of A that
    did not fit evicted B's oldest entry (which freed nothing on A's) and
    failed with ENOSPC."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    dirs = {m: entry_path(root, "x", model=m).parent for m in "AB"}
    dirs["A"].parent.mkdir(mode=0o700, parents=True)
    root.chmod(0o700)
    with small_tmpfs(dirs["A"].parent, "16m", name=dirs["A"].name), \
            small_tmpfs(dirs["B"].parent, "16m", name=dirs["B"].name):
        rd = start_daemon(root, sock, min_free_bytes=0, min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for m in "BA":
                    for i in (1, 2, 3):
                        assert kv.save(m, f"{m}{i}", filled(4, i), [i]) and kv.flush(timeout=WAIT)
                assert kv.save("A", "A4", filled(6, 4), [4]) and kv.flush(timeout=WAIT)
                assert [entry_path(root, f"A{i}", model="A").exists() for i in (1, 2, 3, 4)] \
                    == [False, True, True, True]
                assert all(entry_path(root, f"B{i}", model="B").exists() for i in (1, 2, 3))
        finally:
            assert rd.stop() == 0


def _use_every_inode(kv: Client, mnt: Path) -> None:
    """Save small entries k0, k1... until the 16-inode tmpfs at ``mnt`` has no inode left."""
    saved = 0
    while os.statvfs(mnt).f_favail > 0:
        assert saved < 16, "the tmpfs has more inodes than asked for"
        assert kv.save(FP, f"k{saved}", filled(0.1, 1), [1])
        assert kv.flush(timeout=WAIT) is True
        saved += 1


def test_two_tmpfs_disks_with_equal_figures_are_still_two(short_dir: Path) -> None:
    """sessions/ a 16 MiB tmpfs holding B's entry, A on a 16 MiB tmpfs of its
    own holding as many pages and (with the next save's tmp file) as many
    inodes: equal statvfs figures made them one disk, and A's save evicted
    B's entry (freeing nothing on A's) and failed."""
    root = short_dir / "root"
    root.mkdir(mode=0o700)
    tok = 4096 / 2**20  # one token of one layer: 4 KiB
    with small_tmpfs(root, "16m", name="sessions") as sessions:
        a_dir = entry_path(root, "x", model="A").parent
        with small_tmpfs(sessions, "16m", name=a_dir.name):
            rd = start_daemon(root, short_dir / "run" / "kv.sock", min_free_bytes=0,
                              min_write_interval=0)
            try:
                with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                    for model, key, tokens in (("B", "b1", 2049), ("A", "a1", 1024),
                                               ("A", "a2", 1024), ("A", "a3", 2560)):
                        assert kv.save(model, key, filled(tokens * tok, 1, layers=1), [1])
                        assert kv.flush(timeout=WAIT), key
                    assert [entry_path(root, k, model=m).exists() for m, k in
                            (("B", "b1"), ("A", "a1"), ("A", "a2"), ("A", "a3"))] == \
                        [True, False, True, True]
            finally:
                assert rd.stop() == 0


def test_a_model_on_a_disk_with_no_size_keeps_every_entry(short_dir: Path) -> None:
    """A model's directory on a ramfs (statvfs: 0 blocks, 0 free) was taken
    for a disk of its own always short of room: each save evicted the rest."""
    root = short_dir / "root"
    a_dir = entry_path(root, "x", model="A").parent
    a_dir.parent.mkdir(mode=0o700, parents=True)
    root.chmod(0o700)
    with small_tmpfs(a_dir.parent, "ramfs", name=a_dir.name):
        rd = start_daemon(root, short_dir / "run" / "kv.sock", min_free_bytes=0,
                          min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for i in range(5):
                    assert kv.save("A", f"a{i}", filled(1, i), [i]) and kv.flush(timeout=WAIT)
                assert kv.stats()["evictions"] == 0
                assert all(entry_path(root, f"a{i}", model="A").exists() for i in range(5))
        finally:
            assert rd.stop() == 0


def test_inodes_the_start_up_pass_frees_meanwhile_let_the_save_in(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's tmp file could not be made (no inode); the writer's pass
    waited for the start-up scan's, which freed inodes for --max-disk-bytes,
    then evicted nothing itself: the save failed though its file could now
    be made."""
    mib = 2**20
    root = short_dir / "root"
    root.mkdir(mode=0o700)
    with small_tmpfs(root, "32m", inodes=16, name="sessions") as sessions:
        sock = short_dir / "run" / "kv.sock"
        rd = start_daemon(root, sock, min_free_bytes=0, min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                n = 0
                while os.statvfs(sessions).f_favail > 0:
                    assert kv.save(FP, f"k{n}", filled(1, n), [n]) and kv.flush(timeout=WAIT)
                    n += 1
        finally:
            assert rd.stop() == 0
        used = sum(p.stat().st_size for p in sessions.rglob("*") if p.is_file())
        hold = short_dir / "hold"
        monkeypatch.setitem(faults.ACTIVE, "scan_hold", str(hold))
        monkeypatch.setitem(faults.ACTIVE, "evict_delay", "2")
        rd = start_daemon(root, sock, indexed=False, min_free_bytes=0, min_write_interval=0,
                          max_disk_bytes=used - 3 * mib)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                hold.touch()  # the scan ends; its pass evicts, 2 s a file
                time.sleep(0.5)
                assert os.statvfs(sessions).f_favail == 0
                assert kv.save(FP, "new", filled(0.1, 99), [99])
                assert kv.flush(timeout=WAIT) is True
                assert version_of(entry_path(root, "new")) == 99
        finally:
            assert rd.stop() == 0


def test_a_new_model_on_a_sessions_disk_out_of_inodes_gets_room(short_dir: Path) -> None:
    """sessions/ a disk of its own, out of inodes: a new model's directory,
    not made yet, was taken to go on the root's disk, whose inodes were
    looked at: nothing was evicted, and its save failed with ENOSPC."""
    root = short_dir / "root"
    root.mkdir(mode=0o700)
    with small_tmpfs(root, "8m", inodes=16, name="sessions") as sessions:
        rd = start_daemon(root, short_dir / "run" / "kv.sock", min_free_bytes=0,
                          min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                _use_every_inode(kv, sessions)
                assert kv.save("new-model", "x", filled(0.1, 3), [3]) and kv.flush(timeout=WAIT)
                assert version_of(entry_path(root, "x", model="new-model"), "new-model") == 3
                assert kv.stats()["evictions"] >= 2  # an inode for the directory, one for the file
        finally:
            assert rd.stop() == 0


def test_a_save_that_cannot_fit_but_for_linked_files_evicts_nothing(short_dir: Path) -> None:
    """a, b and c hard-linked elsewhere: their unlinks free nothing, but they
    counted among what emptying the store would free, so a save that could
    never fit evicted d (the one entry that would) and failed anyway."""
    with _four_saves_on_a_small_disk(short_dir) as (mnt, kv):
        root = mnt / "root"
        for k in "abc":
            os.link(entry_path(root, k), mnt / f"backup-{k}")
        assert kv.save(FP, "e", filled(20, 5), [5])
        assert kv.flush(timeout=WAIT) is False
        assert kv.stats()["evictions"] == 0
        assert [version_of(entry_path(root, k)) for k in "abcd"] == [1, 2, 3, 4]


@pytest.mark.parametrize(("keys", "linked", "account", "kept_free"),
                         [("abcde", "", 33, 16), ("abcd", "a", 30, 10)])
def test_a_start_up_pass_over_both_budgets_keeps_min_free(
        short_dir: Path, keys: str, linked: str, account: int, kept_free: int) -> None:
    """A start-up pass over both budgets (4 MiB free, entries of 8 MiB):
    the entry evicted for --max-disk-bytes was counted as freed before the
    free space was read, which already showed it freed; or it was hard-linked
    elsewhere, and its unlink freed nothing. Either way the pass stopped
    short of --min-free-bytes, and said nothing."""
    mib = 2**20
    with small_tmpfs(short_dir, "64m") as mnt:
        root, sock = mnt / "root", short_dir / "run" / "kv.sock"
        rd = start_daemon(root, sock, min_free_bytes=0, min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for i, k in enumerate(keys):
                    assert kv.save(FP, k, filled(8, i + 1), [i + 1]) and kv.flush(timeout=WAIT)
        finally:
            assert rd.stop() == 0
        for k in linked:
            os.link(entry_path(root, k), mnt / f"backup-{k}")
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(mnt / "other-program.bin", "wb") as f:  # outside the root's account
            f.write(b"\0" * (free - 4 * mib))
        rd = start_daemon(root, sock, max_disk_bytes=account * mib,
                          min_free_bytes=kept_free * mib, min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                assert [e.cache_id for e in kv.entries()] == list(keys[2:])
            assert os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize >= kept_free * mib
        finally:
            assert rd.stop() == 0


def test_a_save_whose_file_cannot_be_made_evicts_nothing(short_dir: Path) -> None:
    """Room was made for a save (entries evicted) before its tmp file was
    made: a model directory it could not be made in (a symlink planted for
    it, a mode changed by hand) cost an entry, and nothing was written."""
    with _four_saves_on_a_small_disk(short_dir) as (mnt, kv):
        root = mnt / "root"
        planted = entry_path(root, "x", model="linked").parent
        (short_dir / "elsewhere").mkdir()
        planted.symlink_to(short_dir / "elsewhere", target_is_directory=True)
        # 10 MiB more would need an eviction (8 MiB free, 4 kept free).
        assert kv.save("linked", "x", filled(10, 9), [9])
        assert kv.flush(timeout=WAIT) is False
        assert kv.stats()["evictions"] == 0
        assert [version_of(entry_path(root, k)) for k in "abcd"] == [1, 2, 3, 4]
        assert tmp_files(root) == [] and list((short_dir / "elsewhere").iterdir()) == []


def test_a_full_ext4_makes_room_for_a_new_models_directory(short_dir: Path) -> None:
    """On a full ext4 a new model's directory has no block to go in: its
    mkdir failed with ENOSPC before any room was made, so every save of a
    new model failed for good. Now room is made, the file begun again, and
    room made again for the block the directory took: the save is written."""
    with small_disk(short_dir, 64) as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=0,
                          min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for i, k in enumerate("abc"):
                    assert kv.save(FP, k, filled(8, i + 1), [i + 1]) and kv.flush(timeout=WAIT)
                fd = os.open(mnt / "other-program.bin", os.O_WRONLY | os.O_CREAT, 0o600)
                try:  # filled to the last byte
                    for size in (2**20, 4096, 1):
                        with contextlib.suppress(OSError):
                            while True:
                                os.write(fd, b"\0" * size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                with pytest.raises(OSError) as full:  # no block for a new directory
                    (mnt / "probe").mkdir()
                assert full.value.errno == errno.ENOSPC
                assert kv.save("new-model", "x", filled(8, 9), [9])
                assert kv.flush(timeout=WAIT) is True
                assert kv.stats()["evictions"] >= 1
                assert version_of(entry_path(mnt / "root", "x", model="new-model"),
                                  "new-model") == 9
        finally:
            assert rd.stop() == 0


def test_a_disk_out_of_inodes_makes_room_for_the_next_save(short_dir: Path) -> None:
    """The budget counted bytes only: with no inode left, every save of a new
    key failed with ENOSPC (8 MiB free) and nothing was evicted. Now a tmp
    file the disk will not take makes room for an inode too."""
    with small_tmpfs(short_dir, "8m", inodes=16) as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=0,
                          min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                _use_every_inode(kv, mnt)
                root = mnt / "root"
                assert kv.save(FP, "new", filled(0.1, 2), [2])
                assert kv.flush(timeout=WAIT) is True
                assert kv.stats()["evictions"] == 1 and not entry_path(root, "k0").exists()
                assert version_of(entry_path(root, "new")) == 2
                # A new model needs two: its directory and the file.
                assert kv.save("new-model", "x", filled(0.1, 3), [3])
                assert kv.flush(timeout=WAIT) is True
                assert kv.stats()["evictions"] == 3
                assert version_of(entry_path(root, "x", model="new-model"), "new-model") == 3
                # Entries held open elsewhere free no inode when evicted: one
                # goes, and the save fails (before: every entry went).
                held = [open(p, "rb") for p in sorted((root / "sessions").rglob("*.safetensors"))]
                try:
                    assert kv.save(FP, "more", filled(0.1, 4), [4])
                    assert kv.flush(timeout=WAIT) is False
                    assert kv.stats()["evictions"] == 4
                    assert os.statvfs(mnt).f_favail == 0
                    # Nor does a save that would not fit with every entry gone.
                    assert kv.save(FP, "huge", filled(12, 5), [5])
                    assert kv.flush(timeout=WAIT) is False
                    assert kv.stats()["evictions"] == 4
                finally:
                    for f in held:
                        f.close()
        finally:
            assert rd.stop() == 0


def _begin_and_stall(ctx, socket: Path, cache_id: str, nbytes: int):  # noqa: ANN001, ANN202
    """A raw client that begins a save of ``nbytes``, sends 1 KiB of it and
    stops: the daemon opens its file (making room for it) and waits."""
    from kvkeeper.protocol import messages as m

    s = dealer(ctx, socket)
    s.send(m.encode(m.SaveBegin(v=m.PROTOCOL_VERSION, save=1, model=FP, cache_id=cache_id,
                                tensors=[m.TensorSpec("t", "U8", [nbytes])])))
    s.send_multipart([m.encode(m.SaveData(v=m.PROTOCOL_VERSION, save=1, frames=1)),
                      b"\0" * 1024])
    return s


def test_a_save_that_never_arrives_evicts_nothing_for_the_disk_budget(short_dir: Path) -> None:
    """Making room before a write evicted for --max-disk-bytes too: a save
    abandoned after its first kilobyte had already evicted entries for its
    declared 5 MiB (all four of them). The disk budget is an account, settled
    once a file is in; only free space is made before."""
    import zmq

    mib = 2**20
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", max_disk_bytes=6 * mib,
                      min_write_interval=0)
    ctx = zmq.Context()
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for i in range(4):
                assert kv.save(FP, f"e{i}", filled(1, i), [i]) and kv.flush(timeout=WAIT)
            s = _begin_and_stall(ctx, rd.socket, "big", 5 * mib)
            time.sleep(0.5)  # its file is open
            s.send(m_begin_tiny())  # a new save of the same client: the big one is abandoned
            wait_for(lambda: kv.stats()["saves_failed"] >= 1, "the big save to fail")
            assert {"e0", "e1", "e2", "e3"} <= {e.cache_id for e in kv.entries()}
            assert kv.stats()["evictions"] == 0
    finally:
        ctx.destroy(linger=0)
        assert rd.stop() == 0


def m_begin_tiny() -> bytes:
    from kvkeeper.protocol import messages as m

    return m.encode(m.SaveBegin(v=m.PROTOCOL_VERSION, save=2, model=FP, cache_id="tiny",
                                tensors=[m.TensorSpec("t", "U8", [0])]))


def test_room_made_for_a_save_replaced_while_parked_is_counted(short_dir: Path) -> None:
    """Entries evicted to make room for a save that was then parked and
    replaced by a newer save of its key were gone, and never counted in
    `evictions`."""
    import zmq

    mib = 2**20
    with small_tmpfs(short_dir, "48m") as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_free_bytes=4 * mib,
                          min_write_interval=0)
        ctx = zmq.Context()
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                for i, k in enumerate("abcd"):
                    assert kv.save(FP, k, filled(10, i + 1), [i + 1]) and kv.flush(timeout=WAIT)
                stalled = _begin_and_stall(ctx, rd.socket, "e", 10 * mib)  # room: "a" goes
                wait_for(lambda: not entry_path(mnt / "root", "a").exists(), "room for e")
                assert kv.save(FP, "e", filled(0.1, 9), [9]) and kv.flush(timeout=WAIT)
                assert version_of(entry_path(mnt / "root", "e")) == 9
                gone = {"a", "b", "c", "d"} - {e.cache_id for e in kv.entries()}
                assert gone and kv.stats()["evictions"] == len(gone), (gone, kv.stats())
                stalled.close()
        finally:
            ctx.destroy(linger=0)
            assert rd.stop() == 0


def test_file_size_limit_short_writes(short_dir: Path) -> None:
    root, sock = paths(short_dir)
    proc = serve_process(root, sock, preexec_fn=limit_file_size(3 * 2**20))
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            fault_round(kv, root, v_good=1, v_bad=2, mib_bad=4)  # EFBIG after a short write
            assert kv.save(FP, "k", filled(2, 3), [3]) and kv.flush(timeout=WAIT)
            assert version_of(entry_path(root, "k")) == 3
        assert "File too large" in daemon_log(proc)
    finally:
        assert stop_process(proc) == 0


@pytest.mark.parametrize("failpoint", ["posix/io/sync/fsync", "posix/io/dir/rename"])
def test_io_errors_from_libfiu(short_dir: Path, failpoint: str) -> None:
    need_linux_root()
    root, sock = paths(short_dir)
    ctl = str(short_dir / "fiu")
    proc = serve_process(root, sock, prefix=("fiu-run", "-x", "-f", ctl))

    def fiu(command: str) -> None:
        subprocess.run(["fiu-ctrl", "-f", ctl, "-c", f"{command} name={failpoint}",
                        str(proc.pid)], check=True, timeout=WAIT)

    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            mtime = entry_path(root, "k").stat().st_mtime_ns
            fiu("enable")
            fault_round(kv, root, v_good=1, v_bad=2, mib_bad=1)
            # Never retried as a success: the failed version stays failed.
            time.sleep(0.3)
            assert entry_path(root, "k").stat().st_mtime_ns == mtime
            fiu("disable")
            assert kv.save(FP, "k", filled(1, 3), [3]) and kv.flush(timeout=WAIT)
            assert version_of(entry_path(root, "k")) == 3
    finally:
        assert stop_process(proc) == 0


def _two_loads_of_the_first_version(kv: Client, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Load k twice: each returns version 1 and logs load_may_be_stale; the
    kvkeeper log lines said."""
    with caplog.at_level(logging.WARNING, logger="kvkeeper"):
        for _ in range(2):
            got = kv.load(FP, "k")
            assert got is not None and got.token_ids == [1]
    said = [r.getMessage() for r in caplog.records]
    stale = [line for line in said if "event=load_may_be_stale" in line]
    assert len(stale) == 2, said
    return said


def test_a_load_after_a_save_that_could_not_be_written_says_the_file_may_be_older(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """k's second save fails in the writer (ENOSPC on a 3 MiB tmpfs). Before,
    the client's next load of k returned the first version with nothing
    said, and took the key as settled: every later load read that file
    directly, and only a flush told (a review). The daemon now tells the
    client at once (a SaveRefused, "writing it failed"), as for a refusal."""
    with small_tmpfs(short_dir, "3m") as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_write_interval=0)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as kv:
                assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
                assert kv.save(FP, "k", filled(2.5, 2), [2])
                wait_for(lambda: kv.stats()["saves_failed"] == 1, "the write to fail")
                said = _two_loads_of_the_first_version(kv, caplog)
                assert sum("reason=save_refused" in line for line in said) == 2, said
                assert any("event=save_refused" in line and "writing it failed" in line
                           for line in said), said
                stats = kv.stats()
                assert stats["loads_direct"] == 0 and stats["client_saves_refused"] == 1
                assert stats["saves_refused"] == 0  # counted once, as failed
                assert kv.flush(timeout=WAIT) is False
                # Reported by that flush: the next load is settled again.
                with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                    caplog.clear()
                    assert kv.load(FP, "k") is not None
                assert "load_may_be_stale" not in caplog.text
        finally:
            assert rd.stop() == 0


def test_a_failed_write_told_after_a_newer_save_of_its_key_marks_nothing(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """k's 2.5 MiB save is held in its write, a newer save of k is sent, and
    only then does the held one fail (ENOSPC on a 3 MiB tmpfs). The newer
    one is k's last and is written: a load returns it with no
    load_may_be_stale, until and after the flush that reports the failure."""
    go = short_dir / "go"
    go.touch()
    with small_tmpfs(short_dir, "3m") as mnt:
        proc = serve_process(mnt / "root", short_dir / "run" / "kv.sock",
                             "--min-write-interval", "0", "--min-free-bytes", "0",
                             env={ENV: f"write_hold={go}"})
        try:
            with Client(short_dir / "run" / "kv.sock", timeout=WAIT, min_send_interval=0) as kv:
                assert kv.save(FP, "k", filled(0.5, 1), [1]) and kv.flush(timeout=WAIT)
                go.unlink()
                assert kv.save(FP, "k", filled(2.5, 2), [2])
                wait_for_log(proc, "event=fault_hold step=write", "the writer held in save 2")
                assert kv.save(FP, "k", filled(0.25, 3), [3])
                wait_for(lambda: kv.stats()["saves_received"] == 3, "save 3 to arrive")
                go.touch()
                wait_for(lambda: kv.client_stats()["client_saves_refused"] == 1,
                         "save 2's failure to be told")
                with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                    caplog.clear()
                    got = kv.load(FP, "k")
                    assert got is not None and got.token_ids == [3]
                    assert "load_may_be_stale" not in caplog.text, caplog.text
                    assert kv.flush(timeout=WAIT) is False  # save 2 failed
                    got = kv.load(FP, "k")
                    assert got is not None and got.token_ids == [3]
                assert "load_may_be_stale" not in caplog.text, caplog.text
        finally:
            go.touch()
            stop_process(proc, signal.SIGTERM)
        assert proc.wait(WAIT) == 0


def test_a_client_whose_save_a_stalled_save_replaced_is_told(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A's save of k waits behind a held write; a raw client's save of k
    replaces it, sends half its bytes and stalls: the stall timeout fails
    it, and A's save with it. Neither client was told (a stream's failure
    was never told): A's loads read the older file as settled, no word. Both
    are told now; A's load says the file may be older."""
    from kvkeeper.protocol import messages as m

    from .conftest import dealers
    from .test_protocol_edge import begin

    root, sock, go = short_dir / "root", short_dir / "run" / "kv.sock", short_dir / "go"
    go.touch()
    proc = serve_process(root, sock, "--min-write-interval", "0", "--min-free-bytes", "0",
                         "--stall-timeout", "1", env={ENV: f"write_hold={go}"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as a, \
                dealers(sock, 2) as (busy, stalled):
            assert a.save(FP, "k", filled(0.1, 1), [1]) and a.flush(timeout=WAIT)
            go.unlink()
            busy.send(begin(save=1, model=FP, cache_id="busy",
                            tensors=[m.TensorSpec("t0", "U8", [1024])]))
            busy.send_multipart([m.encode(m.SaveData(v=m.PROTOCOL_VERSION, save=1, frames=1)),
                                 b"b" * 1024])
            wait_for_log(proc, "event=fault_hold step=write", "the writer held")
            assert a.save(FP, "k", filled(0.1, 2), [2])
            wait_for(lambda: a.stats()["saves_received"] == 3, "A's second save")
            stalled.send(begin(save=1, model=FP, cache_id="k",
                               tensors=[m.TensorSpec("t0", "U8", [2048])]))
            stalled.send_multipart([m.encode(m.SaveData(v=m.PROTOCOL_VERSION, save=1,
                                                        frames=1)), b"s" * 1024])
            wait_for(lambda: a.stats()["saves_superseded"] == 1, "A's save replaced")
            go.touch()
            said = m.decode_reply(stalled.recv())
            assert isinstance(said, m.SaveRefused) and said.save == 1 \
                and said.message.startswith("writing it failed: no bytes for 1 s"), said
            wait_for(lambda: a.client_stats()["client_saves_refused"] == 1, "A to be told")
            with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                got = a.load(FP, "k")
            assert got is not None and got.token_ids == [1]
            assert "event=load_may_be_stale" in caplog.text, caplog.text
            assert a.flush(timeout=WAIT) is False
    finally:
        go.touch()
        assert stop_process(proc) == 0


def test_clients_whose_saves_a_failed_delete_replaced_are_told(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A save of k held by --min-write-interval, then a delete of k, which
    replaces it, fails (the file immutable: chattr +i; a file the daemon
    cannot tell from another program's is refused alike). The save was lost
    with no word to its client, whose loads read the older file as settled,
    whether another client deleted or its own delete() raised."""
    from kvkeeper.client.client import DaemonError

    need_linux_root()
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock", min_write_interval=60)
    path = entry_path(rd.root, "k")
    try:
        with Client(rd.socket, timeout=WAIT, min_send_interval=0) as a, \
                Client(rd.socket, timeout=WAIT, min_send_interval=0) as b:
            assert a.save(FP, "k", filled(0.1, 1), [1]) and a.flush(timeout=WAIT)
            run("chattr", "+i", str(path))
            for v, deleter in ((2, b), (3, a)):
                assert a.save(FP, "k", filled(0.1, v), [v])
                wait_for(lambda v=v: a.stats()["saves_held"] == v - 1, "the save held")
                with pytest.raises(DaemonError, match="delete failed"):
                    deleter.delete(FP, "k")
                wait_for(lambda v=v: a.client_stats()["client_saves_refused"] == v - 1,
                         "A to be told")
                with caplog.at_level(logging.WARNING, logger="kvkeeper"):
                    caplog.clear()
                    got = a.load(FP, "k")
                assert got is not None and got.token_ids == [1]
                assert "event=load_may_be_stale" in caplog.text, caplog.text
                assert a.flush(timeout=WAIT) is False
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=False)
        assert rd.stop() == 0


def test_a_client_whose_save_another_s_failed_save_replaced_is_told_too(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A's second save of k is held (a 60 s write interval), B's 2.5 MiB save
    of k replaces it and fails (ENOSPC on a 3 MiB tmpfs): A's save is lost
    with it, and A is told as B is (a review: only B was; A's load took the
    key as settled and the next read the older file directly)."""
    with small_tmpfs(short_dir, "3m") as mnt:
        rd = start_daemon(mnt / "root", short_dir / "run" / "kv.sock", min_write_interval=60)
        try:
            with Client(rd.socket, timeout=WAIT, min_send_interval=0) as a, \
                    Client(rd.socket, timeout=WAIT, min_send_interval=0) as b:
                assert a.save(FP, "k", filled(0.5, 1), [1]) and a.flush(timeout=WAIT)
                assert a.save(FP, "k", filled(0.5, 2), [2])
                wait_for(lambda: a.stats()["saves_received"] == 2, "A's held save")
                assert b.save(FP, "k", filled(2.5, 3), [3])
                assert b.flush(timeout=WAIT) is False
                wait_for(lambda: a.client_stats()["client_saves_refused"] == 1, "A told")
                _two_loads_of_the_first_version(a, caplog)
                assert a.stats()["loads_direct"] == 0
                assert a.flush(timeout=WAIT) is False
        finally:
            assert rd.stop() == 0


def test_a_delete_whose_directory_fsync_fails_is_still_a_delete(short_dir: Path) -> None:
    """The file unlinked, then the directory's fsync failing (EIO): before,
    the delete was reported failed (``kvkeeper rm`` exit 1), not counted,
    and a retry said there was no such entry (a review). Now it is done,
    its durability in doubt, as for an eviction."""
    need_linux_root()
    root, sock = paths(short_dir)
    ctl = str(short_dir / "fiu")
    proc = serve_process(root, sock, prefix=("fiu-run", "-x", "-f", ctl))
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            # EIO (failinfo): libfiu's own pick among fsync's errors may be
            # EINVAL, which the daemon takes for a disk that cannot sync a directory.
            subprocess.run(["fiu-ctrl", "-f", ctl, "-c",
                            "enable name=posix/io/sync/fsync,failinfo=5", str(proc.pid)],
                           check=True, timeout=WAIT)
            assert kv.delete(FP, "k") is True
            assert not entry_path(root, "k").exists()
            assert kv.stats()["deletes"] == 1
            assert kv.entries(FP) == []
        wait_for_log(proc, "event=delete_dir_fsync_failed", "the fsync's failure logged")
    finally:
        assert stop_process(proc) == 0


@pytest.mark.parametrize("failpoint", ["posix/io/rw/writev", "posix/io/sync/fsync",
                                       "posix/io/dir/rename"])
def test_a_failed_save_whose_tmp_file_cannot_be_removed_reports_its_own_error(
        short_dir: Path, failpoint: str) -> None:
    """A disk remounted read-only after an I/O error (ext4 errors=remount-ro):
    the fsync or rename fails with EIO, then the tmp file's unlink with EROFS.
    The unlink's error replaced the save's (logged as a crash of the writer,
    internal_errors 1), and the tmp file was not named as left behind."""
    need_linux_root()
    root, sock = paths(short_dir)
    ctl = str(short_dir / "fiu")
    proc = serve_process(root, sock, prefix=("fiu-run", "-x", "-f", ctl))

    def fiu(command: str) -> None:
        subprocess.run(["fiu-ctrl", "-f", ctl, "-c", command, str(proc.pid)], check=True,
                       timeout=WAIT)

    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            fiu(f"enable name={failpoint},failinfo={errno.EIO}")
            fiu(f"enable name=posix/io/dir/unlink,failinfo={errno.EROFS}")
            assert kv.save(FP, "k", filled(1, 2), [2]) and kv.flush(timeout=WAIT) is False
            fiu(f"disable name={failpoint}")
            fiu("disable name=posix/io/dir/unlink")
            assert kv.stats()["internal_errors"] == 0
            assert version_of(entry_path(root, "k")) == 1
            assert kv.save(FP, "k", filled(1, 3), [3]) and kv.flush(timeout=WAIT)
            assert version_of(entry_path(root, "k")) == 3
    finally:
        assert stop_process(proc) == 0
    log = daemon_log(proc)
    failed = [line for line in log.splitlines() if "event=save_failed" in line]
    assert len(failed) == 1 and "Input/output error" in failed[0], failed
    [left] = tmp_files(root) or [None]  # swept only at the next start
    assert left is not None and f"event=tmp_not_removed path={left}" in log, log[-3000:]
    assert "Read-only file system" in log and "job_crashed" not in log, log[-3000:]


def test_enospc_on_a_disk_far_from_full_evicts_nothing(short_dir: Path) -> None:
    """Every write fails with ENOSPC while the disk has plenty free (btrfs
    metadata exhausted, a quota; here libfiu): the save's second ENOSPC
    evicted entries "as if nothing were free", four of five, and the save
    failed all the same."""
    need_linux_root()
    root, sock = paths(short_dir)
    ctl = str(short_dir / "fiu")
    proc = serve_process(root, sock, "--min-write-interval", "0", "--min-free-bytes", "0",
                         prefix=("fiu-run", "-x", "-f", ctl))
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            for v, k in enumerate("abcde", start=1):
                assert kv.save(FP, k, filled(1, v), [v]) and kv.flush(timeout=WAIT)
            assert shutil.disk_usage(root).free > 1024 * 2**20  # far from full
            subprocess.run(["fiu-ctrl", "-f", ctl, "-c",
                            f"enable name=posix/io/rw/writev,failinfo={errno.ENOSPC}",
                            str(proc.pid)], check=True, timeout=WAIT)
            assert kv.save(FP, "new", filled(3, 9), [9]) and kv.flush(timeout=WAIT) is False
            subprocess.run(["fiu-ctrl", "-f", ctl, "-c", "disable name=posix/io/rw/writev",
                            str(proc.pid)], check=True, timeout=WAIT)
            assert kv.stats()["evictions"] == 0
            assert [version_of(entry_path(root, k)) for k in "abcde"] == [1, 2, 3, 4, 5]
            assert tmp_files(root) == []
    finally:
        assert stop_process(proc) == 0


_READ_WITH_AN_IO_ERROR = """
import os, subprocess, sys
from kvkeeper import Client
from tests.faultkit import FP, filled

sock, ctl = sys.argv[1:3]

def fiu(command):
    # (Not itself under libfiu's preload, which it inherits: it crashed there, 1 in 20.)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run(["fiu-ctrl", "-f", ctl, "-c", command, str(os.getpid())], check=True,
                   timeout=60, env=env)

with Client(sock, timeout=60) as kv:
    assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(60)
    fiu("enable name=posix/io/rw/pread,failinfo=5")
    first = kv.load(FP, "k")
    fiu("disable name=posix/io/rw/pread")
    second = kv.load(FP, "k")
    print(first is None, second is not None and second.token_ids == [1])
"""


_MLX_READ_WITH_AN_IO_ERROR = """
import sys, time
from kvkeeper import CacheFileError, read_cache_file

path = sys.argv[1]
assert read_cache_file(path, verify=False).token_ids == [1]  # every import made
print("READY", flush=True)
time.sleep(2)  # libfiu is told to fail read() meanwhile (reading a pipe would fail too)
try:
    read_cache_file(path, verify=False)
    print("read")
except CacheFileError as exc:
    print("damaged" if exc.damaged else "not-damaged", exc)
"""


def test_an_io_error_in_mlx_s_read_is_not_damage(short_dir: Path) -> None:
    """A lazy load reads the file first through MLX (read(), where kvkeeper's
    own header read uses pread): EIO there, with the header sound, was
    "MLX cannot read it", damage, and the daemon moved the file aside."""
    need_linux_root()
    root = _one_entry(short_dir)
    _, out, err = _run_reads_failing(short_dir, _MLX_READ_WITH_AN_IO_ERROR,
                                     str(entry_path(root, "k")))
    assert out.startswith("not-damaged") and "MLX cannot read it" in out, out + err


def _one_entry(short_dir: Path) -> Path:
    """A store root holding entry k (version 1), its daemon stopped."""
    root, sock = paths(short_dir)
    rd = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(1, 1), [1]) and kv.flush(timeout=WAIT)
    finally:
        assert rd.stop() == 0
    return root


def _run_reads_failing(short_dir: Path, script: str, *args: str,
                       env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``script`` under libfiu; once it prints READY, every read() of it
    fails EIO. Its exit status, stdout (after READY) and stderr."""
    ctl = str(short_dir / "fiu")
    proc = subprocess.Popen(["fiu-run", "-x", "-f", ctl, sys.executable, "-c", script, *args],
                            cwd=Path(__file__).resolve().parent.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        subprocess.run(["fiu-ctrl", "-f", ctl, "-c", f"enable name=posix/io/rw/read,"
                        f"failinfo={errno.EIO}", str(proc.pid)], check=True, timeout=WAIT)
        out, err = proc.communicate(timeout=WAIT)
    finally:
        proc.kill()
        proc.wait(WAIT)
    return proc.returncode, out, err


_VERIFY_WITH_AN_IO_ERROR = """
import contextlib, io, sys, time
from kvkeeper import cli

args = ["verify", "--root", sys.argv[1], "--repair", "--json"]
with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(args) == 0  # every import made, the file sound
print("READY", flush=True)
time.sleep(2)  # libfiu is told to fail read() meanwhile (reading a pipe would fail too)
sys.exit(cli.main(args))
"""


def test_verify_repair_leaves_a_file_it_could_not_read_for_an_io_error(
        short_dir: Path) -> None:
    """verify called a file it met EIO reading (a network file system's
    hiccup) bad, and --repair moved it aside, where the disk budget deletes
    first, though a load leaves such a file in place (a review). It is now
    a file verify could not read: reported, exit 1, left where it is. (No
    daemon is asked, a socket setting it cannot use given: ZeroMQ's own
    threads abort at an EIO of theirs.)"""
    need_linux_root()
    root = _one_entry(short_dir)
    status, out, err = _run_reads_failing(
        short_dir, _VERIFY_WITH_AN_IO_ERROR, str(root),
        env={**os.environ, "KVKEEPER_SOCKET": "tcp://127.0.0.1:1"})
    assert status == 1, (out, err)
    said = json.loads(out)
    assert said["bad"] == [] and said["moved_aside"] == [], said
    [unread] = said["could_not_read"]
    assert unread["path"] == str(entry_path(root, "k")), said
    assert unread["reason"].startswith("Input/output error (it may pass"), said
    assert version_of(entry_path(root, "k")) == 1
    assert not (root / "quarantine").exists() or not any((root / "quarantine").iterdir())


def test_a_read_error_in_one_client_does_not_move_a_sound_file_aside(short_dir: Path) -> None:
    """An I/O error reading an entry in one client process (a network file
    system's hiccup): the client called the file damaged, the daemon moved
    it to quarantine/ on its word, and every client lost a sound cache."""
    need_linux_root()
    root, sock = paths(short_dir)
    ctl = str(short_dir / "fiu")
    rd = start_daemon(root, sock)
    try:
        r = subprocess.run(["fiu-run", "-x", "-f", ctl, sys.executable, "-c",
                            _READ_WITH_AN_IO_ERROR, str(sock), ctl],
                           cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split() == ["True", "True"], r.stdout + r.stderr
        assert "Input/output error" in r.stderr, r.stderr
        assert entry_path(root, "k").exists() and not (root / "quarantine").exists()
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["files_quarantined"] == 0
    finally:
        assert rd.stop() == 0


def test_a_file_moved_to_quarantine_whose_fsync_failed_is_indexed_there(short_dir: Path) -> None:
    """A damaged entry was moved to quarantine/, and then the directories'
    fsync failed: the move was reported failed (``quarantine_failed``), not
    counted, and the index kept the entry and not the moved file, so the
    disk budget did not count it until a gc."""
    need_linux_root()
    root, sock = paths(short_dir)
    ctl = str(short_dir / "fiu")
    proc = serve_process(root, sock, prefix=("fiu-run", "-x", "-f", ctl))

    def damage_and_load(kv: Client, name: str) -> None:
        path = entry_path(root, name)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01
        path.write_bytes(bytes(data))
        assert kv.load(FP, name) is None
        wait_for(lambda: not path.exists(), "the move to quarantine/")

    try:
        with Client(sock, timeout=WAIT) as kv:
            for v, name in enumerate("ab", start=1):
                assert kv.save(FP, name, filled(0.25, v, layers=1), [v])
            assert kv.flush(timeout=WAIT)
            damage_and_load(kv, "a")  # quarantine/ is made, and fsynced, without faults
            # EIO: libfiu picks an errno at random otherwise, and EINVAL is a
            # file system that cannot sync directories (not a failure).
            subprocess.run(["fiu-ctrl", "-f", ctl, "-c",
                            "enable name=posix/io/sync/fsync,failinfo=5", str(proc.pid)],
                           check=True, timeout=WAIT)
            damage_and_load(kv, "b")
            subprocess.run(["fiu-ctrl", "-f", ctl, "-c", "disable name=posix/io/sync/fsync",
                            str(proc.pid)], check=True, timeout=WAIT)
            wait_for(lambda: kv.stats()["files_quarantined"] == 2, "the second move counted")
            moved = [e for e in kv.entries(everything=True) if e.kind == "quarantine"]
            assert len(moved) == 2
            assert kv.stats()["disk_used_bytes"] == sum(
                p.stat().st_size for p in (root / "quarantine").iterdir())
    finally:
        assert stop_process(proc) == 0
    log = daemon_log(proc)
    assert "event=quarantine_dir_fsync_failed" in log and "quarantine_failed" not in log


def test_a_key_whose_tmp_file_could_not_be_made_is_evicted_later(short_dir: Path) -> None:
    """A save of ``b`` failed at the creation of its tmp file (its directory
    read-only). The file of a key with a save on its way is evicted only
    after every other entry; that failed save must not leave ``b`` so for
    the daemon's life."""
    need_linux_root()
    root, sock = paths(short_dir)
    size = _entry_size(short_dir)
    proc = serve_process(root, sock, "--max-disk-bytes", str(3 * size), "--min-free-bytes",
                         "0", "--min-write-interval", "0", prefix=NO_DAC)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "a", filled(0.5, 1, layers=1), [1]) and kv.flush(timeout=WAIT)
            model_dir = entry_path(root, "a").parent
            model_dir.chmod(0o500)
            try:
                assert kv.save(FP, "b", filled(0.5, 2, layers=1), [2])
                assert kv.flush(timeout=WAIT) is False
            finally:
                model_dir.chmod(0o700)
            for v, name in enumerate("bcde", start=2):
                assert kv.save(FP, name, filled(0.5, v, layers=1), [v])
                assert kv.flush(timeout=WAIT) is True
            assert kv.stats()["evictions"] == 2
    finally:
        assert stop_process(proc) == 0
    assert [n for n in "abcde" if entry_path(root, n).exists()] == ["c", "d", "e"]


def _entry_size(short_dir: Path) -> int:
    """The size of the files this module's budget tests save (0.5 MiB, 1 layer)."""
    root, sock = short_dir / "sizing", short_dir / "run" / "sizing.sock"
    rd = start_daemon(root, sock)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            assert kv.save(FP, "x", filled(0.5, 1, layers=1), [1]) and kv.flush(timeout=WAIT)
    finally:
        assert rd.stop() == 0
    return entry_path(root, "x").stat().st_size


def test_a_daemon_run_in_process_gives_the_signals_back(short_dir: Path) -> None:
    """`kvkeeper.cli.main(["serve", ...])` from a program that goes on: the
    drain signals stayed ignored after it returned (Ctrl-C dead in that
    program, and a second run took SIGHUP for ignored, as under nohup)."""
    root, sock = paths(short_dir)
    script = f"""
import os, signal, threading, time
from kvkeeper.cli import main

def stop_when_up():
    while not os.path.exists({str(sock)!r}):
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)

for _ in range(2):
    threading.Thread(target=stop_when_up, daemon=True).start()
    code = main(["serve", "--root", {str(root)!r}, "--socket", {str(sock)!r}])
    print(code, signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
          signal.getsignal(signal.SIGHUP) == signal.SIG_DFL, flush=True)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=WAIT * 2, cwd=Path(__file__).resolve().parents[1])
    assert r.stdout.splitlines() == ["0 True True True"] * 2, (r.stdout, r.stderr[-800:])


def test_with_no_daemon_a_store_on_a_read_only_file_system_is_read(short_dir: Path) -> None:
    """A disk remounted read-only (after errors) is when reading the files
    with the daemon down matters most: the check that a store is private
    must not refuse it as one the daemon could not write."""
    with small_tmpfs(short_dir, "16m") as mnt:
        root, sock = mnt / "root", short_dir / "run" / "kv.sock"
        d = start_daemon(root, sock)
        with Client(sock, root=root, timeout=WAIT, connect_timeout=0.2) as kv:
            assert kv.save(FP, "k", filled(0.5, 1), [1]) and kv.flush(timeout=WAIT)
            assert d.stop() == 0
            wait_for(lambda: not kv.connected, "the client to see the daemon go")
            run("mount", "-o", "remount,ro", str(mnt))
            try:
                got = kv.load(FP, "k")
                assert got is not None and got.token_ids == [1]
            finally:
                run("mount", "-o", "remount,rw", str(mnt))
