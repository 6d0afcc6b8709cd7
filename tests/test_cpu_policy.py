"""The daemon's threads and the client's background threads run under
SCHED_BATCH on Linux (they must not preempt the generation loop when they
wake up); the caller's own thread, and a policy the user chose, are left
alone; without SCHED_BATCH everything works as before."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvkeeper.client.client import Client
from kvkeeper.daemon.app import Daemon, DaemonConfig

from .conftest import WAIT, serve_process, stop_process
from .test_cli_checks import _exec_start, cli, usage_error
from .test_cli_usage import small_cache

TOKENS = [1, 2, 3, 4, 5]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SCHED_BATCH and /proc are Linux's")


def policies(pid: int) -> dict[int, tuple[str, int]]:
    """(name, policy) of every thread of process ``pid``, read from the OS."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            out[int(tid)] = (name, os.sched_getscheduler(int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            pass  # ended meanwhile
    return out


def round_trip(kv: Client, key: str) -> None:
    assert kv.save("m", key, small_cache(), TOKENS)
    assert kv.flush(WAIT)
    loaded = kv.load("m", key)
    assert loaded is not None and loaded.token_ids == TOKENS


def daemon_policies(short_dir: Path, *extra: str, preexec_fn: object = None,
                    ) -> dict[int, tuple[str, int]]:
    """The threads of a ``kvkeeper serve`` process that has written and served a save."""
    sock = short_dir / "run" / "kv.sock"
    proc = serve_process(short_dir / "root", sock, *extra, preexec_fn=preexec_fn)
    try:
        with Client(sock, timeout=WAIT) as kv:
            round_trip(kv, "a")  # the disk worker threads exist from now on
        threads = policies(proc.pid)
    finally:
        code = stop_process(proc)
    assert code == 0
    assert len(threads) >= 3, threads  # main, ZeroMQ's, a disk worker at least
    return threads


def test_every_daemon_thread_runs_batch(short_dir: Path) -> None:
    threads = daemon_policies(short_dir)
    assert all(policy == os.SCHED_BATCH for _, policy in threads.values()), threads


def test_cpu_policy_normal_leaves_the_daemon_s_threads_alone(short_dir: Path) -> None:
    threads = daemon_policies(short_dir, "--cpu-policy", "normal")
    assert all(policy == os.SCHED_OTHER for _, policy in threads.values()), threads


def test_a_policy_the_user_chose_is_kept(short_dir: Path) -> None:
    threads = daemon_policies(short_dir, preexec_fn=lambda: os.sched_setscheduler(
        0, os.SCHED_IDLE, os.sched_param(0)))
    assert all(policy == os.SCHED_IDLE for _, policy in threads.values()), threads


def test_the_service_runs_with_the_cpu_policy_it_was_given(short_dir: Path) -> None:
    r = cli("install-service", "--print", "--platform", "linux",
            env={"KVKEEPER_CPU_POLICY": "normal"})
    assert r.returncode == 0, r.stderr
    cmd = _exec_start(r.stdout)
    assert cmd[cmd.index("--cpu-policy") + 1] == "normal"


def client_thread_policies(short_dir: Path, **kw: str) -> dict[int, tuple[str, int]]:
    """The client's I/O thread and ZeroMQ's threads it started, once a Client
    (made with ``kw``) has saved and loaded."""
    sock = short_dir / "run" / "kv.sock"
    proc = serve_process(short_dir / "root", sock)
    try:
        before = set(policies(os.getpid()))
        with Client(sock, timeout=WAIT, **kw) as kv:
            round_trip(kv, "a")
            io = [t.native_id for t in threading.enumerate() if t.name == "kvkeeper-client-io"]
            # Threads MLX starts for the caller (its first evaluation, its
            # file readers) are the caller's, not the client's.
            new = {tid: v for tid, v in policies(os.getpid()).items()
                   if tid not in before and (tid in io or v[0].startswith("ZMQbg"))}
    finally:
        code = stop_process(proc)
    assert code == 0
    assert len(io) == 1 and io[0] in new, (io, new)
    assert len(new) >= 3, new  # with ZeroMQ's I/O thread and reaper
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread
    return new


def test_client_background_threads_run_batch_and_the_caller_is_untouched(
        short_dir: Path) -> None:
    new = client_thread_policies(short_dir)
    assert all(policy == os.SCHED_BATCH for _, policy in new.values()), new


def test_a_client_with_cpu_policy_normal_leaves_its_threads_alone(short_dir: Path) -> None:
    new = client_thread_policies(short_dir, cpu_policy="normal")
    assert all(policy == os.SCHED_OTHER for _, policy in new.values()), new


def test_a_bad_cpu_policy_is_refused(short_dir: Path) -> None:
    with pytest.raises(ValueError, match="batch or normal"):
        Client(short_dir / "kv.sock", cpu_policy="low", connect_timeout=0)
    with pytest.raises(ValueError, match="batch or normal"):
        Daemon(DaemonConfig(root=short_dir / "root", socket=short_dir / "kv.sock",
                            cpu_policy="Batch"))
    r = cli("serve", "--print-config", "--cpu-policy", "fast")
    usage_error(r, "cpu_policy", "batch or normal")


@pytest.mark.parametrize("changed_to", [None, "SCHED_IDLE"])
def test_a_thread_that_ran_a_daemon_gets_its_policy_back(short_dir: Path,
                                                         changed_to: str | None) -> None:
    """... unless its policy was changed while the daemon ran: that one stays."""
    d = Daemon(DaemonConfig(root=short_dir / "root", socket=short_dir / "run" / "kv.sock",
                            max_disk_bytes=None, min_free_bytes=0))
    seen: dict[str, int] = {}

    def run() -> None:
        seen["code"] = d.run(handle_signals=False)
        seen["after"] = os.sched_getscheduler(0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert d.ready.wait(WAIT)
        assert os.sched_getscheduler(t.native_id) == os.SCHED_BATCH
        if changed_to is not None:
            os.sched_setscheduler(t.native_id, getattr(os, changed_to), os.sched_param(0))
    finally:
        d.stop()
        t.join(WAIT)
    assert not t.is_alive()
    after = os.SCHED_OTHER if changed_to is None else getattr(os, changed_to)
    assert seen == {"code": 0, "after": after}


def test_without_sched_batch_everything_works_under_the_default_policy(
        short_dir: Path) -> None:
    """What macOS sees: no SCHED_BATCH. A daemon and a client in one process
    save and load, and no thread's policy changes."""
    script = textwrap.dedent(f"""
        import os, threading
        from pathlib import Path
        del os.SCHED_BATCH
        from kvkeeper.client.client import Client
        from kvkeeper.daemon.app import Daemon, DaemonConfig
        from tests.test_cpu_policy import policies, round_trip

        d = Daemon(DaemonConfig(root=Path({str(short_dir / "root")!r}),
                                socket=Path({str(short_dir / "run" / "kv.sock")!r}),
                                max_disk_bytes=None, min_free_bytes=0))
        t = threading.Thread(target=d.run, kwargs={{"handle_signals": False}})
        t.start()
        assert d.ready.wait({WAIT})
        with Client(d.cfg.socket, timeout={WAIT}) as kv:
            round_trip(kv, "a")
            found = policies(os.getpid())
        d.stop()
        t.join({WAIT})
        assert not t.is_alive()
        print(sorted({{p for _, p in found.values()}}), len(found))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=WAIT * 2, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stderr
    policies_seen, nthreads = r.stdout.split()[:-1], int(r.stdout.split()[-1])
    assert policies_seen == [f"[{os.SCHED_OTHER}]"] and nthreads >= 4, r.stdout
