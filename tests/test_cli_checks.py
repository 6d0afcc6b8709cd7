"""The CLI refuses what it cannot do with a one-line message and the documented
exit status (2: usage), instead of a traceback or a silent wrong action."""

from __future__ import annotations

import errno
import json
import logging
import os
import plistlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache

import kvkeeper
from kvkeeper import settings
from kvkeeper.client.client import Client

from .conftest import WAIT, RunningDaemon, daemon_log, serve_process, stop_process, wait_for
from .faultkit import NO_DAC, entry_path, need_linux_root, run, small_tmpfs, tmp_files


def _own_env(*, tree: bool = False) -> dict[str, str]:
    """This process's environment without KVKEEPER_* settings or this
    machine's config file; with ``tree``, this tree first on PYTHONPATH."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVKEEPER_")}
    base["XDG_CONFIG_HOME"] = "/nonexistent-kvkeeper-test-config"
    if tree:
        base["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])
    return base


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = WAIT,
        umask: int = -1, run: tuple[str, ...] = ("-m", "kvkeeper.cli"),
        prefix: tuple[str, ...] = (), cwd: Path | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """The real CLI, with no KVKEEPER_* setting or config file of this machine's;
    ``run`` is how Python starts it, ``prefix`` what runs Python."""
    # (``-m`` finds this tree's package by its directory, not another cwd.)
    base = _own_env(tree=cwd is not None)
    # Undecodable output (a path given as bytes, printed as given) as escapes.
    return subprocess.run([*prefix, sys.executable, *run, *args], capture_output=True,
                          text=True, errors="backslashreplace", timeout=timeout,
                          env={**base, **(env or {})}, umask=umask, cwd=cwd)


def usage_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 with one ``kvkeeper: ...`` line that says each of ``needles``."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvkeeper: "), r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


def small_cache() -> list[KVCache]:
    c = KVCache()
    x = mx.zeros((1, 2, 5, 8))
    c.update_and_fetch(x, x)
    return [c]


# ------------------------------------------------------------------ rm


@pytest.mark.parametrize("argv", [["--model", "m1", "a"], ["a", "--model", "m1"],
                                  ["m1", "a", "--model", "m1"]])
def test_rm_refuses_an_id_together_with_model(argv: list[str], client: Client,
                                              daemon: RunningDaemon) -> None:
    for name in ("a", "b"):
        assert client.save("m1", name, small_cache(), [1, 2])
    assert client.flush(timeout=WAIT)
    r = cli("rm", "--socket", str(daemon.socket), *argv)
    usage_error(r, "rm MODEL ID", "rm --model FP")
    assert sorted(e.cache_id for e in client.entries()) == ["a", "b"]


# ------------------------------------------------------------------ non-finite settings


@pytest.mark.parametrize(("argv", "env", "toml"), [
    (["--drain-timeout", "nan"], {}, ""),
    (["--drain-timeout", "inf"], {}, ""),
    (["--min-write-interval", "nan"], {}, ""),
    ([], {"KVKEEPER_DRAIN_TIMEOUT": "nan"}, ""),
    ([], {"KVKEEPER_MAX_DISK_BYTES": "1e400"}, ""),
    ([], {}, "max_disk_bytes = inf\n"),
    ([], {}, "min_free_bytes = nan\n"),
    ([], {}, "drain_timeout = nan\n"),
], ids=lambda v: repr(v))
def test_non_finite_settings_are_refused(argv: list[str], env: dict[str, str], toml: str,
                                         short_dir: Path) -> None:
    cfg = short_dir / "kv.toml"
    cfg.write_text(toml)
    r = cli("serve", "--config", str(cfg), "--print-config", *argv, env=env)
    usage_error(r, "finite")


def test_print_config_escapes_control_characters_in_paths(short_dir: Path) -> None:
    """A tab or ESC in the root went to the terminal raw: the table's
    columns broke, and an escape sequence drove the terminal."""
    root = short_dir / "a\tb\x1b[31m"
    r = cli("serve", "--print-config", "--root", str(root), "--socket", "s\tk.sock",
            cwd=short_dir)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\t" not in r.stdout, r.stdout
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert lines["root"].split()[1] == f'"{short_dir}/a\\tb\\x1b[31m"', r.stdout
    assert f'"s\\tk.sock" (= "{short_dir}/s\\tk.sock")' in lines["socket"], r.stdout
    assert lines["root"].endswith("(flag --root)"), r.stdout
    # The config file a value came from: its path too.
    place = short_dir / "c\tx\x1b[31m"
    place.mkdir()
    (place / "kv.toml").write_text("drain_timeout = 7\n")
    r = cli("serve", "--print-config", "--root", str(short_dir / "r"), "--config",
            str(place / "kv.toml"))
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\t" not in r.stdout, r.stdout
    assert f'(config file "{short_dir}/c\\tx\\x1b[31m/kv.toml")' in r.stdout, r.stdout
    # And in the errors and the warning naming it (before: raw on stderr).
    said = repr(str(place / "kv.toml"))
    usage_error(cli("serve", "--print-config", "--config", str(place / "none.toml")),
                f"config file {str(place / 'none.toml')!r} does not exist")
    (place / "kv.toml").write_text("drain_timeot = 7\n")
    usage_error(cli("serve", "--print-config", "--config", str(place / "kv.toml")),
                f"config file {said}: unknown settings ['drain_timeot']")
    r = cli("ls", "--socket", str(short_dir / "none.sock"),
            env={"KVKEEPER_CONFIG": str(place / "kv.toml")})
    assert f"warning: config file {said}: unknown settings" in r.stderr, r.stderr
    assert "\x1b" not in r.stderr and "\t" not in r.stderr, r.stderr


@pytest.mark.parametrize(("argv", "env", "toml"), [
    ([], {"KVKEEPER_DRAIN_TIMEOUT": "5s"}, ""),
    ([], {}, 'min_write_interval = "1 s"\n'),
    (["--drain-timeout", "5s"], {}, ""),
])
def test_seconds_with_a_unit_say_so(argv: list[str], env: dict[str, str], toml: str,
                                    short_dir: Path) -> None:
    """"could not convert string to float: '5s'" was Python's, not ours; a
    flag got argparse's "invalid float value: '5s'"."""
    cfg = short_dir / "kv.toml"
    cfg.write_text(toml)
    r = cli("serve", "--config", str(cfg), "--print-config", *argv, env=env)
    assert r.returncode == 2 and "not a number of seconds: " in r.stderr \
        and "(a plain number: 5 or 0.5, no unit)" in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["1_000M", "\u0661\u0660\u0660M", "1_0.5G"])
def test_sizes_are_written_in_ascii_digits(value: str) -> None:
    """float() took these: --max-disk-bytes 1_000M was a budget of 1000 MiB,
    and Arabic-Indic digits read as 100."""
    for flag in ("--max-disk-bytes", "--max-pending-bytes", "--min-free-bytes"):
        r = cli("serve", "--print-config", flag, value)
        assert r.returncode == 2 and f"argument {flag}: not a byte size" in r.stderr, r.stderr


def test_a_size_says_ib_only_after_a_unit(short_dir: Path) -> None:
    """"5iB" (5GiB with the G lost) was read as 5 bytes; with a unit, "iB"
    and "B" are still taken, in any case."""
    for flag in ("--max-disk-bytes", "--min-free-bytes"):
        for value in ("5iB", "1024ib", "iB"):
            r = cli("serve", "--print-config", flag, value)
            assert r.returncode == 2 and f"argument {flag}: not a byte size: '{value}'" \
                in r.stderr, r.stderr
    cfg = short_dir / "kv.toml"
    cfg.write_text('min_free_bytes = "5iB"\n')
    r = cli("serve", "--config", str(cfg), "--print-config")
    assert r.returncode == 2 and "not a byte size: '5iB'" in r.stderr, r.stderr
    r = cli("serve", "--print-config", "--root", str(short_dir / "r"), "--min-free-bytes", "5b",
            "--max-disk-bytes", "2GiB", env={"KVKEEPER_MAX_PENDING_BYTES": "3 mib"})
    assert r.returncode == 0, r.stderr
    values = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines()}
    assert (values["min_free_bytes"], values["max_disk_bytes"], values["max_pending_bytes"]) \
        == ("5", str(2 * 1024**3), str(3 * 1024**2)), r.stdout


@pytest.mark.parametrize("value", ["1_0", "\u0661\u0665"])
def test_seconds_are_written_in_ascii_digits(value: str) -> None:
    """--drain-timeout 1_0 was 10 s, and Arabic-Indic digits read as 15."""
    r = cli("serve", "--print-config", "--drain-timeout", value)
    assert r.returncode == 2 and "not a number of seconds" in r.stderr, r.stderr
    r = cli("serve", "--print-config", env={"KVKEEPER_STALL_TIMEOUT": value})
    usage_error(r, "KVKEEPER_STALL_TIMEOUT", "not a number of seconds")


@pytest.mark.parametrize("platform", ["linux", "macos"])
def test_a_drain_timeout_past_a_day_is_refused(platform: str) -> None:
    """1e300 seconds: the LaunchAgent's plist failed to encode (a traceback),
    and systemd ignores a TimeoutStopSec it cannot parse (90 s instead)."""
    for argv in (("install-service", "--print", "--platform", platform),
                 ("serve", "--print-config")):
        usage_error(cli(*argv, "--drain-timeout", "1e300"), "at most 86400")
    r = cli("install-service", "--print", "--platform", platform, "--drain-timeout", "86400")
    assert r.returncode == 0 and "86410" in r.stdout, r.stderr


@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "-inf"])
def test_non_finite_size_flags_are_refused(value: str) -> None:
    r = cli("serve", "--print-config", f"--max-disk-bytes={value}")
    assert r.returncode == 2 and "finite" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_with_nan_drain_timeout_does_not_start(short_dir: Path) -> None:
    sock = short_dir / "run" / "k.sock"
    r = cli("serve", "--root", str(short_dir / "root"), "--socket", str(sock),
            "--drain-timeout", "nan")
    usage_error(r, "drain_timeout", "finite")
    assert not sock.exists()


def test_a_pending_budget_past_the_memory_is_said_at_start(short_dir: Path) -> None:
    """--max-pending-bytes 100000T (a typo of 100000M) was taken with no word:
    the daemon's bound on the saves it holds was gone in effect (a review).
    It is still taken (swap, a machine the config moves to), and said."""
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    proc = serve_process(root, sock, "--max-pending-bytes", "100000T")
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.stats()["max_pending_bytes"] == 100000 * 2**40
    finally:
        assert stop_process(proc) == 0
    said = daemon_log(proc)
    assert f"event=pending_over_memory max_pending_bytes={100000 * 2**40} " in said, said
    proc = serve_process(root, sock, "--max-pending-bytes", "64M")
    assert stop_process(proc) == 0
    assert "pending_over_memory" not in daemon_log(proc)


def test_the_default_pending_budget_in_a_small_container_is_not_called_a_typo(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The default budget is at least 1 GiB: in a container of 512 MiB it
    is over the memory, and was said as a typo at every start though
    nothing was given (a review). (The container's limit as Linux would
    show it, told to the settings that read it.)"""
    from .conftest import start_daemon

    monkeypatch.setattr(settings, "cgroup_memory_limit", lambda: 512 * 2**20)
    assert settings.memory_share(2**30) == 2**30
    with caplog.at_level(logging.WARNING, logger="kvkeeper"):
        rd = start_daemon(short_dir / "root", short_dir / "run" / "k.sock")
        try:
            with Client(rd.socket, timeout=WAIT) as kv:
                assert kv.stats()["max_pending_bytes"] == 2**30
        finally:
            assert rd.stop() == 0
    assert "pending_over_memory" not in caplog.text


def test_serve_refuses_sizes_past_what_a_daemon_can_hold(short_dir: Path) -> None:
    # 1e30 passed as a pending budget reached ZeroMQ's int64 option: a traceback.
    sock = short_dir / "run" / "k.sock"
    for flag in ("--max-pending-bytes", "--max-disk-bytes"):
        r = cli("serve", "--root", str(short_dir / "root"), "--socket", str(sock), flag,
                "100000000T")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"argument {flag}: a size must be at most" in r.stderr, r.stderr
    assert not sock.exists()
    # The limit itself is taken (through a float it became 2**63: "must be at
    # most 9223372036854775807 bytes, not '9223372036854775807'"), one more not.
    r = cli("serve", "--print-config", "--max-disk-bytes", str(2**63 - 1))
    assert r.returncode == 0 and str(2**63 - 1) in r.stdout, (r.stdout, r.stderr)
    r = cli("serve", "--print-config", "--max-disk-bytes", str(2**63))
    assert r.returncode == 2 and "at most" in r.stderr, r.stderr
    # Past 4300 digits int() refused with advice about Python itself.
    r = cli("serve", "--print-config", "--max-disk-bytes", "1" * 5000)
    assert r.returncode == 2 and "at most" in r.stderr and "set_int_max" not in r.stderr, r.stderr
    r = cli("serve", "--print-config", "--max-disk-bytes", "0" * 5000 + "2G")
    assert r.returncode == 0 and "max_disk_bytes" in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("what", ["a root that is not UTF-8", "a sessions symlink"])
def test_serve_refuses_a_root_it_cannot_serve_from_with_a_message(
    what: str, short_dir: Path
) -> None:
    """Both stopped serve with a traceback (exit 1): replies name files in
    UTF-8, and entries live under <root>/sessions only."""
    root = short_dir / "root"
    if what == "a sessions symlink":
        root.mkdir(mode=0o700)
        (short_dir / "elsewhere").mkdir()
        (root / "sessions").symlink_to(short_dir / "elsewhere")
    else:
        root = Path(os.fsdecode(os.fsencode(short_dir) + b"/r\xff"))
    r = cli("serve", "--root", str(root), "--socket", str(short_dir / "run" / "k.sock"),
            timeout=15)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvkeeper: ") and ("UTF-8" in last or "symlink" in last), last


@pytest.mark.parametrize("what", ["open to others", "a symlink", "under a file"])
def test_serve_refused_for_its_socket_directory_leaves_no_root_behind(
    what: str, short_dir: Path
) -> None:
    """The root was made first, then the socket directory refused: a new
    empty store left behind by a daemon that never ran."""
    run = short_dir / "run"
    if what == "open to others":
        run.mkdir(mode=0o700)
        run.chmod(0o755)
    elif what == "a symlink":
        (short_dir / "elsewhere").mkdir(mode=0o700)
        run.symlink_to(short_dir / "elsewhere")
    else:
        run.write_text("a file")
        run = run / "sub"
    root = short_dir / "new" / "root"
    r = cli("serve", "--root", str(root), "--socket", str(run / "k.sock"), timeout=15)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvkeeper: ") and "socket directory" in last, last
    assert not (short_dir / "new").exists()


# ------------------------------------------------------------------ the socket path


def _occupy(path: Path, kind: str, short_dir: Path) -> None:
    if kind == "file":
        path.write_text("precious")
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("precious")
    else:
        target = short_dir / "target"
        target.write_text("precious")
        path.symlink_to(target)


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_serve_refuses_a_socket_path_that_is_not_a_socket(kind: str, short_dir: Path) -> None:
    run = short_dir / "run"
    run.mkdir(mode=0o700)
    sock = run / "k.sock"
    _occupy(sock, kind, short_dir)
    # Before the fix the daemon deleted the file and served: the timeout ends it.
    r = cli("serve", "--root", str(short_dir / "root"), "--socket", str(sock), timeout=15)
    # After serve's banner line, the one line that says why.
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvkeeper: ") and str(sock) in last and "not a socket" in last
    if kind == "file":
        assert sock.read_text() == "precious"
    elif kind == "directory":
        assert (sock / "inside").read_text() == "precious"
    else:
        assert sock.is_symlink() and (short_dir / "target").read_text() == "precious"


def test_serve_replaces_a_stale_socket(short_dir: Path) -> None:
    run = short_dir / "run"
    run.mkdir(mode=0o700)
    sock = run / "k.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))  # a socket file nobody listens on, as a killed daemon leaves
    s.close()
    proc = serve_process(short_dir / "root", sock)
    assert stop_process(proc) == 0


# ------------------------------------------------------------------ verify --root


@pytest.mark.parametrize("kind", ["missing", "file", "not-a-store"])
def test_verify_refuses_a_root_that_is_not_a_store(kind: str, short_dir: Path) -> None:
    # A directory with no sessions/ in it (a mistyped root) said "0 files
    # verified ... all good", exit 0.
    root = short_dir / "root"
    if kind == "file":
        root.write_text("not a store")
    elif kind == "not-a-store":
        root.mkdir()
    r = cli("verify", "--root", str(root), "--socket", str(short_dir / "none.sock"))
    usage_error(r, str(root))
    assert "all good" not in r.stdout


def test_verify_refuses_a_daemon_s_root_it_cannot_see(short_dir: Path) -> None:
    """A daemon in another mount namespace (a container's, its socket
    shared): verify asked it for its root, found nothing there, and said
    "0 files checked ... all good", exit 0."""
    need_linux_root()
    hidden, sock = short_dir / "hidden", short_dir / "run" / "kv.sock"
    hidden.mkdir()
    # The daemon's root on a tmpfs of its own mount namespace.
    mount_then = ("unshare", "-m", "--propagation", "private", "sh", "-c",
                  'mount -t tmpfs kvk-hidden "$0" && exec "$@"', str(hidden))
    proc = serve_process(hidden / "root", sock, prefix=mount_then)
    try:
        r = cli("verify", "--socket", str(sock))
    finally:
        assert stop_process(proc) == 0
    assert r.returncode == 1 and "all good" not in r.stdout, (r.stdout, r.stderr)
    assert f"the daemon's root {hidden / 'root'} is not a kvkeeper store here" in r.stderr, \
        r.stderr
    assert list(hidden.iterdir()) == []


def test_verify_and_export_on_a_root_need_no_usable_socket_setting(
    client: Client, daemon: RunningDaemon
) -> None:
    # A socket setting they could not use stopped them (exit 2), though a
    # --root is all they need.
    assert client.save("m", "a", small_cache(), [1, 2]) and client.flush(timeout=WAIT)
    root, out = str(daemon.root), str(daemon.root.parent / "out.safetensors")
    for env in ({"KVKEEPER_SOCKET": "tcp://127.0.0.1:1"},
                {"KVKEEPER_CONFIG": str(daemon.root.parent / "missing.toml")}):
        r = cli("verify", "--root", root, "--json", env=env)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert json.loads(r.stdout)["checked"] == 1
        assert "no daemon asked" in r.stderr and root in r.stderr, r.stderr
        r = cli("export", "--root", root, "m", "a", out, env=env)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert kvkeeper.read_cache_file(Path(out)).token_ids == [1, 2]
        # Without --root they need the daemon's socket: still a usage error.
        usage_error(cli("verify", env=env))
        # And a --socket given is never ignored.
        r = cli("verify", "--root", root, "--socket", "tcp://127.0.0.1:1")
        assert r.returncode == 2 and "local socket only" in r.stderr, r.stderr


def test_export_without_a_daemon_or_a_store_says_so(short_dir: Path) -> None:
    # It said "no entry m / x", as if the store had been read.
    env = {"XDG_CACHE_HOME": str(short_dir / "cache"), "HOME": str(short_dir / "home"),
           "KVKEEPER_SOCKET": str(short_dir / "none.sock")}
    out = short_dir / "out.safetensors"
    r = cli("export", "m", "x", str(out), env=env)
    assert r.returncode == 1 and "no store at" in r.stderr, r.stdout + r.stderr
    assert "give --root" in r.stderr and not out.exists()


def test_stats_say_which_daemon_answered(daemon: RunningDaemon) -> None:
    """With several daemons (a root each), or one restarted since, the
    counters alone did not say whose they were: neither the table nor
    --json named a pid, a version, a root or a socket."""
    from kvkeeper import __version__

    r = cli("stats", "--json", "--socket", str(daemon.socket))
    got = json.loads(r.stdout)
    assert (got["pid"], got["version"], got["root"], got["socket"]) == (
        os.getpid(), __version__, str(daemon.root), str(daemon.socket)), r.stdout  # in-process
    assert "saves_written" in got
    # Whole, however narrow the output (rich cut a long root to the width).
    r = cli("stats", "--socket", str(daemon.socket), env={"COLUMNS": "20"})
    assert r.returncode == 0, r.stderr
    said = r.stdout.splitlines()
    assert said[0].strip() == f"kvkeeper daemon, pid {os.getpid()}, version {__version__}", said
    assert said[1].split() == ["root", str(daemon.root)], said
    assert said[2].split() == ["socket", str(daemon.socket)], said
    # Every counter by its whole name (the table cut "write_seconds_p50" and
    # "_p99" alike to "write_seconds_…").
    words = {line.split()[0] for line in said[3:] if line.strip()}
    assert set(got) - {"pid", "version", "root", "socket"} <= words, (sorted(got), said)
    assert "…" not in r.stdout, said


def test_stats_json_gives_counts_as_integers(client: Client, daemon: RunningDaemon) -> None:
    # The latencies were left out until the first write (a script that reads
    # them failed on a new daemon); now zeros, as the counters.
    r = cli("stats", "--json", "--socket", str(daemon.socket))
    got = json.loads(r.stdout)
    assert {k: got[k] for k in ("write_seconds_p50", "write_seconds_p99", "fsync_seconds_p50",
                                "fsync_seconds_p99", "saves_written")} == dict.fromkeys(
        ("write_seconds_p50", "write_seconds_p99", "fsync_seconds_p50", "fsync_seconds_p99",
         "saves_written"), 0), r.stdout
    # Every counter printed as a float ("saves_written": 1.0, "boot_id": ...0.0).
    assert client.save("m", "a", small_cache(), [1, 2]) and client.flush(timeout=WAIT)
    r = cli("stats", "--json", "--socket", str(daemon.socket))
    got = json.loads(r.stdout)
    assert got["saves_written"] == 1 and type(got["saves_written"]) is int, r.stdout
    assert type(got["boot_id"]) is int and type(got["max_pending_bytes"]) is int
    assert type(got["uptime_s"]) is float and type(got["write_seconds_p50"]) is float
    # So are Client.stats()'s (they were floats: "evictions 1.0").
    kinds = {k: type(v) for k, v in client.stats().items()}
    assert kinds["saves_written"] is kinds["disk_used_bytes"] is kinds["evictions"] is int
    assert kinds["uptime_s"] is kinds["fsync_seconds_p99"] is float


def test_a_reader_that_goes_away_is_no_traceback(daemon: RunningDaemon, short_dir: Path) -> None:
    """kvkeeper ls | head: the commands ended with a BrokenPipeError traceback,
    then with exit 1, which says the command failed; now 141, as a shell
    reports a command SIGPIPE ended."""
    long_socket = short_dir / ("s" * 120)
    for args in (["serve", "--print-config"], ["stats", "--json", "--socket", str(daemon.socket)],
                 ["ls", "--all", "--socket", str(daemon.socket)]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # gone before the first write: every write fails
        try:
            base = {k: v for k, v in os.environ.items() if not k.startswith("KVKEEPER_")}
            r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", *args], stdout=write_end,
                               stderr=subprocess.PIPE, text=True, timeout=WAIT, env=base)
        finally:
            os.close(write_end)
        assert r.returncode == 128 + signal.SIGPIPE and r.stderr == "", (args, r.stderr)
    # A socket path the platform cannot take: one line, exit 2, for every client command.
    from kvkeeper.config import MAX_SOCKET_PATH

    for command in ("stats", "ls", "gc", "verify"):
        usage_error(cli(command, "--socket", str(long_socket)), f"allows {MAX_SOCKET_PATH}")


# ------------------------------------------------------------------ bad ids, bad config


def test_piped_ls_shows_long_ids_whole(client: Client, daemon: RunningDaemon) -> None:
    """Piped, the table was folded to 80 columns: a long model or id was cut
    across two rows, and could be neither copied into rm nor grepped."""
    model = "mlx-community/Qwen3-8B-4bit@" + "3f2a" * 10
    cache_id = "conversation-" + "x" * 70
    assert client.save(model, cache_id, small_cache(), [1, 2, 3, 4, 5])
    assert client.flush(timeout=WAIT)
    r = cli("ls", "--socket", str(daemon.socket))
    assert r.returncode == 0, r.stderr
    row = [line for line in r.stdout.splitlines() if cache_id in line]
    assert len(row) == 1 and model in row[0], r.stdout


def test_bad_ids_are_one_line_errors(daemon: RunningDaemon, short_dir: Path) -> None:
    sock = str(daemon.socket)
    usage_error(cli("ls", "--socket", sock, "--model", ""), "model is empty")
    usage_error(cli("rm", "--socket", sock, "M", ""), "cache id is empty")
    usage_error(cli("rm", "--socket", sock, "M", "x" * 5000), "5000 bytes")
    usage_error(cli("export", "--socket", str(short_dir / "none.sock"), "", "x",
                    str(short_dir / "f.safetensors")), "model is empty")
    assert not (short_dir / "f.safetensors").exists()


@pytest.mark.parametrize("toml", ["root = 5\n", "this is not toml\n"])
def test_bad_config_file_is_a_one_line_error_outside_serve(toml: str,
                                                           short_dir: Path) -> None:
    cfg = short_dir / "bad.toml"
    cfg.write_text(toml)
    # (Not --socket: with no daemon there, verify needs --root, not the file's.)
    r = cli("verify", env={"KVKEEPER_CONFIG": str(cfg),
                           "KVKEEPER_SOCKET": str(short_dir / "none.sock")})
    usage_error(r, str(cfg))


def test_a_config_file_that_is_not_utf8_or_names_an_unknown_home(short_dir: Path) -> None:
    """Bytes that are not UTF-8 raised UnicodeDecodeError (a traceback, even
    for a command that needed nothing from the file); "~nosuchuser" raised
    RuntimeError from expanduser. Both are one-line errors where the file is
    needed, and the commands that need nothing from it go on."""
    cfg = short_dir / "bad.toml"
    cfg.write_bytes(b'root = "/x\xff"\n')
    usage_error(cli("serve", "--config", str(cfg), "--print-config"), str(cfg), "utf-8")
    root = short_dir / "root"
    (root / "sessions").mkdir(parents=True, mode=0o700)
    r = cli("verify", "--root", str(root), "--socket", str(short_dir / "none.sock"),
            env={"KVKEEPER_CONFIG": str(cfg)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    cfg.write_text('socket = "~nosuchuser-kvk/k.sock"\n')
    usage_error(cli("serve", "--config", str(cfg), "--print-config"), "socket",
                "home directory")


def test_verify_without_a_daemon_reads_the_configured_root_past_other_typos(
    short_dir: Path,
) -> None:
    """Like a client, verify takes only the root from the config file: a typo
    in another setting is serve's to report."""
    root = short_dir / "root"
    root.mkdir(mode=0o700)
    cfg = short_dir / "cfg.toml"
    cfg.write_text(f'root = "{root}"\nsocket = "{short_dir / "none.sock"}"\n'
                   f'max_disk_bites = 1\ndrain_timeout = -1\n')
    r = cli("verify", env={"KVKEEPER_CONFIG": str(cfg)})
    assert r.returncode == 0 and f"checked under {root}" in r.stdout, (r.stdout, r.stderr)
    # Said, though: serve would refuse this file.
    assert r.stderr.startswith(f"kvkeeper: warning: config file {cfg}: unknown settings "
                                "['max_disk_bites']"), r.stderr


def test_verify_and_export_of_a_named_socket_with_no_daemon_there_check_no_other_root(
    short_dir: Path,
) -> None:
    """`verify --socket X` with no daemon at X checked the configured root, a
    store X's daemon may not serve, and said all was well."""
    root = short_dir / "root"
    (root / "sessions").mkdir(parents=True, mode=0o700)
    sock = str(short_dir / "none.sock")
    env = {"KVKEEPER_ROOT": str(root)}
    for argv in (("verify",), ("export", "m", "c", str(short_dir / "out.safetensors"))):
        r = cli(*argv, "--socket", sock, env=env)
        assert r.returncode == 3, (argv, r.stdout, r.stderr)
        assert sock in r.stderr and "--root" in r.stderr and "checked" not in r.stdout, r.stderr
    # Without --socket, the configured root is the store meant.
    r = cli("verify", env={**env, "KVKEEPER_SOCKET": sock})
    assert r.returncode == 0 and f"checked under {root}" in r.stdout, (r.stdout, r.stderr)


def test_a_client_says_which_config_settings_do_not_exist(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo of `socket` sends a client to the default socket, where no daemon
    is: the client still starts (its saves are dropped and counted), but the
    log names the setting that does not exist, once."""
    for k in [k for k in os.environ if k.startswith("KVKEEPER_")]:
        monkeypatch.delenv(k)
    cfg = short_dir / "typo.toml"
    cfg.write_text(f'sockett = "{short_dir / "k.sock"}"\nroot = "{short_dir / "root"}"\n')
    monkeypatch.setenv("KVKEEPER_CONFIG", str(cfg))
    with caplog.at_level("WARNING", logger="kvkeeper"):
        for _ in range(2):
            with Client(timeout=WAIT, connect_timeout=0) as kv:
                assert kv.root == short_dir / "root"
    said = [r.getMessage() for r in caplog.records if "config_unknown_settings" in r.getMessage()]
    assert len(said) == 1, said
    assert "unknown=sockett" in said[0] and str(cfg) in said[0] and "socket" in said[0]


# ------------------------------------------------------------------ export


def _leftovers(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if ".tmp" in p.name]


def test_a_relative_socket_path_starting_with_at_is_a_file(short_dir: Path) -> None:
    """``serve --socket @foo`` binds the file ./@foo; the other commands took
    ``ipc://@foo`` for Linux's abstract namespace, and said "did not answer
    within 2 s (is it stopped?)" of a running daemon."""
    proc = serve_process(short_dir / "root", short_dir / "@foo")
    try:
        r = cli("ls", "--json", "--socket", "@foo", cwd=short_dir)
        assert r.returncode == 0 and json.loads(r.stdout) == [], (r.stdout, r.stderr)
    finally:
        assert stop_process(proc) == 0


def test_verify_goes_on_past_a_link_it_may_not_look_through(client: Client,
                                                           daemon: RunningDaemon,
                                                           short_dir: Path) -> None:
    """A symlink in sessions/ into a directory this process may not search
    stopped the whole check with a bare "[Errno 13]" (and no --json report),
    when verify asked whether it led to a model's directory."""
    need_linux_root()
    assert client.save("m1", "a", small_cache(), [1, 2]) and client.flush(timeout=WAIT)
    bad = entry_path(daemon.root, "a", "m1")
    bad.write_bytes(b"garbage")
    private = short_dir / "priv"
    (private / "d").mkdir(parents=True)
    private.chmod(0o000)
    try:
        for name in ("m2", "Notes"):
            (daemon.root / "sessions" / name).symlink_to(private / "d")
        r = cli("verify", "--root", str(daemon.root), "--socket", str(short_dir / "no.sock"),
                "--json", prefix=NO_DAC)
        report = json.loads(r.stdout)
        assert r.returncode == 1 and [b["path"] for b in report["bad"]] == [str(bad)], r
        assert report["could_not_read"] == [], report
    finally:
        private.chmod(0o700)


def test_export_says_what_is_at_the_entry_s_place(client: Client, daemon: RunningDaemon,
                                                   short_dir: Path) -> None:
    """A symlink or a directory at an entry's place is a miss to load(), and
    the daemon moves it aside: export said "no entry", as if nothing were
    there. (The README: export fails saying why and where the file went.)"""
    sock = str(daemon.socket)
    for cache_id in ("s", "t"):
        assert client.save("m1", cache_id, small_cache(), [1, 2])
    assert client.flush(timeout=WAIT)
    s, t = entry_path(daemon.root, "s", "m1"), entry_path(daemon.root, "t", "m1")
    outside = short_dir / "outside.safetensors"
    s.rename(outside)
    s.symlink_to(outside)
    t.unlink()
    t.mkdir()
    for place, kind in ((s, "a symbolic link"), (t, "a directory")):
        r = cli("export", "--socket", sock, "m1", place.stem, str(short_dir / "o.safetensors"))
        said = " ".join(r.stderr.split())
        assert r.returncode == 1 and f"m1 / {place.stem} cannot be read: {place} is {kind}, " \
            f"not a cache file (the daemon moves it into {daemon.root}/quarantine/)" in said, said
    assert outside.exists() and not (short_dir / "o.safetensors").exists()
    # Read from another root, without the daemon: a dangling link said "no
    # entry ... under ROOT" there.
    other = short_dir / "other"
    place = entry_path(other, "u", "m1")
    place.parent.mkdir(parents=True)
    other.chmod(0o700)
    place.symlink_to(short_dir / "nowhere.safetensors")
    r = cli("export", "--socket", sock, "--root", str(other), "m1", "u",
            str(short_dir / "o.safetensors"))
    said = " ".join(r.stderr.split())
    assert r.returncode == 1 and f"cannot export m1 / u: {place} is a symbolic link, not a " \
        "cache file" in said, said


def test_export_to_a_destination_it_cannot_write(client: Client, daemon: RunningDaemon,
                                                 short_dir: Path) -> None:
    sock = str(daemon.socket)
    assert client.save("m1", "a", small_cache(), [1, 2, 3, 4, 5])
    assert client.flush(timeout=WAIT)
    missing = short_dir / "no-such-dir" / "x.safetensors"
    usage_error(cli("export", "--socket", sock, "m1", "a", str(missing)), str(missing.parent))
    a_dir = short_dir / "d.safetensors"
    a_dir.mkdir()
    usage_error(cli("export", "--socket", sock, "m1", "a", str(a_dir)), "is a directory")
    assert a_dir.is_dir() and not list(a_dir.iterdir())
    # Named as a directory whatever its name (before: "the file name must
    # end in .safetensors", for a directory to export into).
    usage_error(cli("export", "--socket", sock, "m1", "a", str(short_dir)),
                f"{short_dir} is a directory; give a file name")
    assert not _leftovers(short_dir)
    # It still writes where it can, and says how to open the file.
    ok = short_dir / "ok.safetensors"
    r = cli("export", "--socket", sock, "m1", "a", str(ok))
    assert r.returncode == 0 and ok.exists(), r.stderr
    assert "load_prompt_cache" in r.stdout and "mlx_lm.generate" not in r.stdout
    assert ", 5 tokens)" in " ".join(r.stdout.split()), r.stdout
    assert client.save("m1", "one", small_cache(), [7]) and client.flush(timeout=WAIT)
    r = cli("export", "--socket", sock, "m1", "one", str(short_dir / "one.safetensors"))
    assert ", 1 token)" in " ".join(r.stdout.split()), r.stdout  # was "1 tokens"
    assert "replacing" not in r.stdout
    assert not _leftovers(short_dir)
    # Again: the file there is replaced, and the output says so.
    r = cli("export", "--socket", sock, "m1", "a", str(ok))
    assert r.returncode == 0 and "replacing the file that was there" in r.stdout, r.stdout
    # A name of 255 bytes, the most a file name has: the tmp file's name was
    # this one and 20 bytes more ([Errno 36] File name too long, naming it).
    longest = short_dir / ("n" * (255 - len(".safetensors")) + ".safetensors")
    r = cli("export", "--socket", sock, "m1", "a", str(longest))
    assert r.returncode == 0 and longest.exists(), (r.stdout, r.stderr)
    assert len(load_prompt_cache(str(longest))) == len(small_cache())
    assert not _leftovers(short_dir)


def _interrupted(args: list[str], ready: Callable[[], bool], again: float | None = None,
                 sig: int = signal.SIGINT) -> tuple[int, str, str]:
    """Run the CLI, press Ctrl-C (or send ``sig``) once ``ready()`` says so
    (and ``again`` seconds later once more); (status, stdout, stderr)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVKEEPER_")}
    # Python's own SIGINT handler, even where the tests run with SIGINT ignored.
    # main() as the command line calls it (SIGTERM is taken as Ctrl-C there only).
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from kvkeeper.cli import main; sys.exit(main())")
    child = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**base, "XDG_CONFIG_HOME": "/nonexistent-kvkeeper-test-config"})
    try:
        deadline = time.monotonic() + WAIT
        while not ready():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.002)
        child.send_signal(sig)
        if again is not None:
            time.sleep(again)
            child.send_signal(sig)
        out, err = child.communicate(timeout=WAIT)
    finally:
        child.kill()
        child.wait(WAIT)
    return child.returncode, out, err


_CTRL_C_IN_A_DEL = """
import gc, os, signal, sys
import kvkeeper.cli as cli

class Ctrl_C_Inside:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # handled in the loop below
        for _ in range(10000):
            pass

installed = cli._terminate_as_interrupt
def install_then_collect():
    installed()
    c = Ctrl_C_Inside()
    c.me = c  # a cycle: collected here, on the main thread
    del c
    gc.collect()
cli._terminate_as_interrupt = install_then_collect
sys.argv = ["kvkeeper", "ls", "--socket", sys.argv[1]]
sys.exit(cli.main())
"""


def test_ctrl_c_where_python_ignores_exceptions_still_ends_the_command(
        short_dir: Path) -> None:
    """kvkeeper's handler raises KeyboardInterrupt once only. Landing in a
    __del__ or a weakref callback (importlib's, as ZeroMQ loads: 1 run in
    150), it was ignored, with an "Exception ignored" traceback, and so was
    every later Ctrl-C: ls waited on for its daemon and exited 3. Here the
    signal comes inside a __del__ that the command's first collection runs."""
    env = _own_env(tree=True)
    r = subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_DEL, str(short_dir / "none.sock")],
                       capture_output=True, text=True, timeout=WAIT, env=env,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130 and r.stderr.strip() == "kvkeeper: interrupted", r.stderr


_CTRL_C_AT_THE_END_THEN_MORE = """
import gc, json, os, signal, sys, time
import kvkeeper.cli as cli
from kvkeeper import ops

class Late:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):
            pass

class Raising:
    def __del__(self):
        raise ValueError("an ordinary error in a __del__")

def collect(cls):
    c = cls(); c.me = c; del c; gc.collect()

caller_hook_saw = []
sys.unraisablehook = lambda u: caller_hook_saw.append(type(u.exc_value).__name__)
real = ops.install_service
mode = sys.argv[1]

def command(args):
    if mode == "nested":  # a main() inside the command's own
        ops.install_service = real
        sys.argv = ["kvkeeper", "install-service", "--print", "--platform", "linux"]
        assert cli.main() == 0
        collect(Raising)
    status = real(args)
    collect(Late)  # Ctrl-C in the command's last moment, ignored there
    if mode == "pipe":
        raise BrokenPipeError  # the reader gone too
    return status

said = []
sys.argv = ["kvkeeper", "install-service", "--print", "--platform", "linux"]
ops.install_service = command
said.append(cli.main())
ops.install_service = real
try:
    time.sleep(0.3)  # the caller's own work
    said.append("slept")
except KeyboardInterrupt:
    said.append("the caller interrupted")
said.append(sys.unraisablehook.__name__)
print(json.dumps([said, caller_hook_saw]), file=sys.stderr)  # (a broken pipe ends stdout)
"""


@pytest.mark.parametrize("mode", ["end", "nested", "pipe"])
def test_an_interrupt_sent_again_is_the_commands_and_hooks_nest(
        short_dir: Path, mode: str) -> None:
    """A Ctrl-C ignored in a __del__ in a command's last moment was sent
    again 50 ms on, after main() had returned 0: it hit the caller's next
    call. A main() inside a command's main() took the hook as the one to
    hand on to (an ordinary error in a __del__ then recursed), and put the
    outer command's handlers back as it ended, so the Ctrl-C was lost; a
    BrokenPipeError then exited 1 (reviews). In-process, as a script would."""
    env = _own_env(tree=True)
    r = subprocess.run([sys.executable, "-c", _CTRL_C_AT_THE_END_THEN_MORE, mode],
                       cwd=short_dir, capture_output=True, text=True, timeout=WAIT, env=env,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 0, r.stderr
    said, caller_hook_saw = json.loads(r.stderr.splitlines()[-1])
    assert said == [130, "slept", "<lambda>"], (said, r.stderr)
    assert caller_hook_saw == (["ValueError"] if mode == "nested" else []), r.stderr
    assert "RecursionError" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    # (The reader gone, nothing is said: the status tells.)
    assert r.stderr.count("kvkeeper: interrupted") == (mode != "pipe"), r.stderr


def _wait_until_zmq_is_loaded(pid: int) -> None:
    """Until the command has loaded ZeroMQ, which it imports after its
    signal handlers are in (Linux: its memory map), and 0.3 s more, past the
    import (elsewhere 0.6 s, which a slow start under load, 0.2-0.3 s
    measured, could outlast)."""
    maps = Path(f"/proc/{pid}/maps")
    if not Path("/proc/self/maps").exists():
        time.sleep(0.6)
        return

    def loaded() -> bool:
        try:
            return "zmq" in maps.read_text()
        except OSError:
            return False

    wait_for(loaded, "the command to load ZeroMQ")
    time.sleep(0.3)


def test_two_ctrl_c_in_a_row_end_a_command_without_a_traceback(short_dir: Path) -> None:
    """timeout(1) sends its signal twice (to the command and to its group),
    and an impatient user presses Ctrl-C twice: the second landed in the
    exit's clean-up (a client's close) and printed a traceback, in 8 of 20
    runs measured. Several runs: the second signal's moment varies."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVKEEPER_")}
    for _ in range(6):
        child = subprocess.Popen(
            # The kvkeeper command itself (main() with no argv: it exits).
            [sys.executable, "-m", "kvkeeper", "ls", "--socket", str(short_dir / "none.sock")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**base, "XDG_CONFIG_HOME": "/nonexistent-kvkeeper-test-config"},
            # Python's own SIGINT handler, even where the tests run with SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            _wait_until_zmq_is_loaded(child.pid)  # waiting for a daemon to connect (2 s)
            child.send_signal(signal.SIGINT)
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=WAIT)
        finally:
            child.kill()
            child.wait(WAIT)
        assert child.returncode == 130 and err.strip() == "kvkeeper: interrupted", err


def test_sigterm_still_ends_a_program_that_calls_main_with_arguments(short_dir: Path) -> None:
    """SIGTERM is taken as Ctrl-C by the kvkeeper command only: a program
    calling main(argv) got "kvkeeper: terminated", 143 back, and went on
    running as if nothing had been asked of it."""
    code = ("import sys; from kvkeeper.cli import main; main(sys.argv[1:]); "
            "print('went on', flush=True)")
    child = subprocess.Popen(
        [sys.executable, "-c", code, "ls", "--socket", str(short_dir / "none.sock")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.6)  # waiting for a daemon to connect (2 s)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=WAIT)
    finally:
        child.kill()
        child.wait(WAIT)
    assert child.returncode == -signal.SIGTERM and "went on" not in out, (out, err)


@pytest.mark.parametrize(("sig", "status", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                     (signal.SIGTERM, 143, "terminated")])
def test_export_stopped_by_ctrl_c_leaves_no_tmp_file(client: Client, daemon: RunningDaemon,
                                                     short_dir: Path, sig: int, status: int,
                                                     said: str) -> None:
    """Ctrl-C while export wrote its tmp file left it there for good: a
    hidden whole copy of the conversation, under a name with the run's pid.
    So did SIGTERM (timeout(1)'s, a supervisor's), until it stopped the
    command as Ctrl-C does."""
    c = KVCache()
    x = mx.random.normal((1, 8, 32768, 128)).astype(mx.bfloat16)  # 64 MiB
    c.update_and_fetch(x, x)
    assert client.save("m1", "big", [c], list(range(32768))) and client.flush(timeout=WAIT)
    out = short_dir / "out"
    out.mkdir()
    # The tmp file is made, then filled (about 0.5 s).
    got, _, err = _interrupted(["export", "--socket", str(daemon.socket), "m1", "big",
                                str(out / "big.safetensors")], lambda: bool(_leftovers(out)),
                               sig=sig)
    assert got == status and err.strip() == f"kvkeeper: {said}", err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("times", [1, 2])
def test_import_stopped_by_ctrl_c_reports_what_it_did(short_dir: Path, times: int) -> None:
    """Ctrl-C printed a traceback and nothing of the files imported, which a
    second run then refused as "already in the store". Twice: the second
    while the client closes, waiting for a daemon that does not answer."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-write-interval", "0",
                         env={"KVKEEPER_TEST_FAULTS": "write_delay=10"})  # 1-3 s a file
    src = Path(__file__).parent / "data" / "legacy-formats" / "mlx-lm"

    def ready() -> bool:
        # The first file written and its flush answered: the second's tmp
        # file is there (the first's was renamed before).
        if not (entry_path(root, "cachelist", model="m").exists() and tmp_files(root)):
            return False
        if times == 2:
            proc.send_signal(signal.SIGSTOP)  # close() then waits for it
        return True

    try:
        status, out, err = _interrupted(
            ["import", "--socket", str(sock), "--model", "m", str(src)], ready,
            again=1.0 if times == 2 else None)
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_process(proc) == 0
    # (Twice: the close cut short is finished at exit, which warns that the
    # stopped daemon did not confirm the last save.)
    assert status == 130 and "kvkeeper: interrupted\n" in err, err
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"imported {src / 'cachelist.safetensors'} as m / cachelist")
    assert lines[1].startswith(f"not imported {src / 'chunked.safetensors'}: interrupted")
    assert len(lines) == 2, out


def test_export_into_a_directory_it_may_write_but_not_read(
        client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    """The file was written and renamed in, then the directory's fsync could
    not open it (mode 0300) and export said "cannot write", exit 1."""
    need_linux_root()
    assert client.save("m1", "a", small_cache(), [1, 2]) and client.flush(timeout=WAIT)
    drop = short_dir / "drop"
    drop.mkdir(mode=0o300)
    r = cli("export", "--socket", str(daemon.socket), "m1", "a", str(drop / "out.safetensors"),
            prefix=NO_DAC)
    drop.chmod(0o700)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "could not fsync its directory" in r.stderr and "cannot write" not in r.stderr
    assert len(load_prompt_cache(str(drop / "out.safetensors"))) == len(small_cache())


def test_export_into_the_store_is_refused(client: Client, daemon: RunningDaemon,
                                          short_dir: Path) -> None:
    """An export to another entry's place replaced that entry behind the
    daemon's back (ls still listed the old one; the next load quarantined it)."""
    sock = str(daemon.socket)
    assert client.save("m1", "a", small_cache(), [1, 2, 3, 4, 5])
    assert client.save("m2", "b", small_cache(), [6, 7])
    assert client.flush(timeout=WAIT)
    other = entry_path(daemon.root, "b", model="m2")
    before = other.read_bytes()
    for argv in (["--socket", sock], ["--socket", str(short_dir / "none.sock"),
                                      "--root", str(daemon.root)]):
        usage_error(cli("export", *argv, "m1", "a", str(other)), "inside the store")
        usage_error(cli("export", *argv, "m1", "a", str(daemon.root / "x.safetensors")),
                    "inside the store")
    # Reading another store (--root) while the daemon runs: its store is
    # still not a place to write to.
    copy = short_dir / "copy"
    shutil.copytree(daemon.root, copy, ignore=shutil.ignore_patterns(".kvkeeper.lock"))
    usage_error(cli("export", "--socket", sock, "--root", str(copy), "m1", "a", str(other)),
                "inside the store")
    assert other.read_bytes() == before and not (daemon.root / "x.safetensors").exists()
    loaded = client.load("m2", "b")
    assert loaded is not None and loaded.token_ids == [6, 7]


def test_export_into_the_store_by_another_name_is_refused(
        client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    """The guard compared spellings: on case-insensitive APFS,
    ~/library/caches/kvkeeper is the store too, and an export there replaced
    an entry behind the daemon's back. It compares the directories
    themselves now; a bind mount stands for the other spelling here."""
    need_linux_root()
    assert client.save("m2", "b", small_cache(), [6, 7]) and client.flush(timeout=WAIT)
    before = entry_path(daemon.root, "b", model="m2").read_bytes()
    entry = entry_path(daemon.root, "b", model="m2")
    # The root, and a directory below it (the guard looked for the root
    # among the place's parents, which a mount of sessions/ has not).
    for i, mounted in enumerate((daemon.root, daemon.root / "sessions")):
        alias = short_dir / f"alias{i}"
        alias.mkdir(mode=0o700)
        run("mount", "--bind", str(mounted), str(alias))
        try:
            aliased = alias / entry.relative_to(mounted)
            for argv in (["--socket", str(daemon.socket)],
                         ["--socket", str(short_dir / "none.sock"), "--root", str(daemon.root)]):
                usage_error(cli("export", *argv, "m2", "b", str(aliased)), "inside the store")
        finally:
            run("umount", "-l", str(alias))
    # A store directory this user cannot list (sessions/ at 0311): the place
    # is still found inside it (d05585b's walk alone missed it).
    (daemon.root / "sessions").chmod(0o311)
    try:
        usage_error(cli("export", "--socket", str(daemon.socket), "m2", "b", str(entry),
                        prefix=NO_DAC), "inside the store")
    finally:
        (daemon.root / "sessions").chmod(0o700)
    assert entry.read_bytes() == before


def test_export_of_a_damaged_entry_says_why(client: Client, daemon: RunningDaemon,
                                            short_dir: Path) -> None:
    """With the daemon up, the load moved the damaged file aside and export
    said only "no entry m1 / a" (the entry had just been listed)."""
    sock = str(daemon.socket)
    assert client.save("m1", "a", small_cache(), [1, 2, 3, 4, 5])
    assert client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "a", model="m1")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    out = short_dir / "out.safetensors"
    r = cli("export", "--socket", sock, "m1", "a", str(out))
    assert r.returncode == 1 and not out.exists(), (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    # The reason as the client gives it, not as its log line quotes it.
    assert len(lines) == 1 and lines[0].startswith(f"kvkeeper: m1 / a cannot be read: {path}: "
                                                   f"checksum mismatch"), lines
    assert not path.exists() and list((daemon.root / "quarantine").iterdir())
    # It names the path where the file was; it says where the file went.
    assert lines[0].endswith(f"(the daemon moved the file into {daemon.root / 'quarantine'}/)"), \
        lines
    r = cli("export", "--socket", sock, "m1", "a", str(out))  # now it is gone
    assert r.returncode == 1 and "no entry m1 / a" in r.stderr, r.stderr
    # An id with a newline or a trailing space is quoted, as rm quotes it
    # (printed raw, the newline made a second line that looked like output).
    for model, cache_id, said in (("m1", "zz\nfake line", 'no entry m1 / "zz\\nfake line"'),
                                  ("m 1 ", "b", 'no entry "m 1 " / b')):
        r = cli("export", "--socket", sock, model, cache_id, str(out))
        assert r.returncode == 1 and r.stderr == f"kvkeeper: {said}\n", r.stderr


def test_export_help_claims_only_what_works() -> None:
    text = cli("export", "--help").stdout
    assert "load_prompt_cache" in text and "prompt-cache-file" not in text
    assert "mlx_lm.generate" not in text


# ------------------------------------------------------------------ install-service


def _exec_start(unit: str) -> list[str]:
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def test_install_service_warns_of_an_interpreter_in_a_cache(short_dir: Path) -> None:
    """uvx runs kvkeeper from an environment in uv's cache: install-service
    wrote that interpreter into the service, said it was done, and the
    service stopped starting once the cache was cleared (uv cache clean).
    It now warns, naming the cache. Here the environment is this suite's,
    seen from a directory tagged as a cache (CACHEDIR.TAG, as uv's is)."""
    cache = short_dir / "cache"
    env_dir = cache / "archive-v0" / "x1"
    (env_dir / "bin").mkdir(parents=True)
    (cache / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
    if (Path(sys.prefix) / "pyvenv.cfg").exists():  # a virtual environment: this one
        shutil.copyfile(Path(sys.prefix) / "pyvenv.cfg", env_dir / "pyvenv.cfg")
        for lib in ("lib", "lib64"):
            if (Path(sys.prefix) / lib).is_dir():
                (env_dir / lib).symlink_to(Path(sys.prefix) / lib)
    python = env_dir / "bin" / "python"
    python.symlink_to(os.path.realpath(sys.executable))
    base = _own_env()
    for platform in ("linux", "macos"):
        r = subprocess.run([str(python), "-m", "kvkeeper.cli", "install-service", "--print",
                            "--platform", platform], capture_output=True, text=True,
                           timeout=WAIT, env=base)
        assert r.returncode == 0, r.stderr
        command = (_exec_start(r.stdout) if platform == "linux"
                   else plistlib.loads(r.stdout.encode())["ProgramArguments"])
        assert command[0] == str(python)  # what the service would run
        said = " ".join(r.stderr.split())
        assert said.startswith(f"kvkeeper: warning: the service runs {python}, which is "
                               f"inside the cache directory {cache} (uvx and pipx"), said
        assert said.endswith("Install kvkeeper where it stays (a virtual environment, or uv "
                             "tool install), and run install-service from there."), said
    # This suite's interpreter, in no cache: no word.
    r = cli("install-service", "--print", "--platform", "linux")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    # A virtual environment that tags itself (uv's and virtualenv's do, for
    # backups), not in a cache: no word either (a review: it was warned of).
    if (env_dir / "pyvenv.cfg").exists():
        (cache / "CACHEDIR.TAG").unlink()
        (env_dir / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n")
        r = subprocess.run([str(python), "-m", "kvkeeper.cli", "install-service", "--print",
                            "--platform", "linux"], capture_output=True, text=True,
                           timeout=WAIT, env=base)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        # pipx run's environments: under a ".cache" it does not tag.
        cache.rename(short_dir / ".cache")
        pipx_python = short_dir / ".cache" / "archive-v0" / "x1" / "bin" / "python"
        r = subprocess.run([str(pipx_python), "-m", "kvkeeper.cli", "install-service",
                            "--print", "--platform", "linux"], capture_output=True, text=True,
                           timeout=WAIT, env=base)
        assert r.returncode == 0, r.stderr
        assert f"inside the cache directory {short_dir / '.cache'} " in " ".join(
            r.stderr.split()), r.stderr


def test_install_service_pins_the_pythonpath_kvkeeper_came_from(short_dir: Path) -> None:
    """kvkeeper run from a source tree through PYTHONPATH: the service
    manager passes no environment on, and the service (run from /) imported
    another installed copy, or failed with no module named kvkeeper. The
    PYTHONPATH goes into the service file, its relative entries made
    absolute; the service's interpreter then imports this shell's copy."""
    src = short_dir / "src"
    shutil.copytree(Path(kvkeeper.__file__).parent, src / "kvkeeper",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": f"src{os.pathsep}{os.pathsep}/opt/a b%"}
    want = f"{src}{os.pathsep}/opt/a b%"
    r = cli("install-service", "--print", "--platform", "linux", env=env, cwd=short_dir)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("Environment="))
    assert shlex.split(line.removeprefix("Environment=")) == [
        f"PYTHONPATH={want}".replace("%", "%%")], line
    r = cli("install-service", "--print", "--platform", "macos", env=env, cwd=short_dir)
    assert r.returncode == 0, r.stderr
    plist = plistlib.loads(r.stdout.encode())
    assert plist["EnvironmentVariables"] == {"PYTHONPATH": want,
                                             "KVKEEPER_SERVICE_MANAGER": "launchd"}
    # The service's interpreter, from /, with that environment alone.
    found = subprocess.run(
        [plist["ProgramArguments"][0], "-c", "import kvkeeper; print(kvkeeper.__file__)"],
        cwd="/", env={"PYTHONPATH": want}, capture_output=True, text=True, timeout=120)
    assert found.stdout.strip() == str(src / "kvkeeper" / "__init__.py"), found
    # None set, or python -E (this process did not use it): nothing pinned
    # (run from a directory that holds no kvkeeper: it is the installed one).
    elsewhere = short_dir / "elsewhere"
    elsewhere.mkdir()
    r = cli("install-service", "--print", "--platform", "linux", env={"PYTHONPATH": ""},
            cwd=elsewhere)
    assert r.returncode == 0 and "Environment=" not in r.stdout, r.stdout
    r = cli("install-service", "--print", "--platform", "linux", env={"PYTHONPATH": "/x"},
            run=("-E", "-m", "kvkeeper.cli"), cwd=elsewhere)
    assert r.returncode == 0 and "Environment=" not in r.stdout, r.stdout
    # python -m kvkeeper in a source tree, no PYTHONPATH: the working
    # directory is first on this process's import path, not on the service's
    # (run from /), whose interpreter imported the installed copy instead.
    tree = short_dir / "tree"
    shutil.copytree(src, tree)
    for how in (("-m", "kvkeeper.cli"), ("-E", "-m", "kvkeeper.cli")):
        r = cli("install-service", "--print", "--platform", "macos", env={"PYTHONPATH": ""},
                cwd=tree, run=how)
        assert r.returncode == 0, r.stderr
        plist = plistlib.loads(r.stdout.encode())
        assert plist["EnvironmentVariables"]["PYTHONPATH"] == str(tree), plist
        found = subprocess.run(
            [plist["ProgramArguments"][0], "-c", "import kvkeeper; print(kvkeeper.__file__)"],
            cwd="/", env={"PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=120)
        assert found.stdout.strip() == str(tree / "kvkeeper" / "__init__.py"), found
    r = cli("install-service", "--print", "--platform", "linux", env={"PYTHONPATH": ""}, cwd=tree)
    line = next(x for x in r.stdout.splitlines() if x.startswith("Environment="))
    assert shlex.split(line.removeprefix("Environment=")) == [f"PYTHONPATH={tree}"], line
    # Such a tree whose path a service file cannot carry: the message names
    # the tree (before: "PYTHONPATH holds a control character", none set).
    odd_tree = short_dir / "t\tab"
    shutil.copytree(src, odd_tree)
    r = cli("install-service", "--print", "--platform", "linux", env={"PYTHONPATH": ""},
            cwd=odd_tree)
    usage_error(r, "the source tree kvkeeper runs from", "control character", "move the tree")
    assert "PYTHONPATH holds" not in r.stderr, r.stderr
    # One holding ':' would be two entries (before: pinned, and the service
    # imported the installed copy).
    colon_tree = short_dir / "a:b"
    shutil.copytree(src, colon_tree)
    r = cli("install-service", "--print", "--platform", "linux", env={"PYTHONPATH": ""},
            cwd=colon_tree)
    usage_error(r, "the source tree kvkeeper runs from", "holds ':', which separates")
    # What a service file cannot carry: exit 2 saying so (before: tracebacks,
    # and a CR cut the unit's line, which systemd then ignored).
    for value, says in (("/src:/tmp/caf\udce9", "not valid UTF-8"),
                        ("/src\r/x", "control character"), ("/a\x01", "control character")):
        for platform in ("linux", "macos"):
            usage_error(cli("install-service", "--print", "--platform", platform,
                            env={"PYTHONPATH": value}), says)
    # A control character in a path given: a unit escapes it, a plist cannot
    # carry it (before: plistlib's ValueError traceback).
    odd = short_dir / "a\x01b.sock"
    usage_error(cli("install-service", "--print", "--platform", "macos", "--socket", str(odd)),
                "cannot go into it")
    # A CR in a word of ExecStart is escaped too. A plist took it, and read
    # back it was a line feed: the agent's daemon used another socket.
    cr = short_dir / "a\rb.sock"
    usage_error(cli("install-service", "--print", "--platform", "macos", "--socket", str(cr)),
                "cannot go into it: a carriage return")
    r = cli("install-service", "--print", "--platform", "linux", "--socket", str(cr))
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout and f'"{short_dir}/a\\rb.sock"' in r.stdout, r.stdout


def test_install_service_stop_timeout_follows_the_resolved_drain_timeout(
        short_dir: Path) -> None:
    cfg = short_dir / "kv.toml"
    cfg.write_text("drain_timeout = 60\n")
    r = cli("install-service", "--print", "--platform", "linux", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "TimeoutStopSec=70" in r.stdout
    r = cli("install-service", "--print", "--platform", "macos",
            env={"KVKEEPER_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr
    plist = plistlib.loads(r.stdout.encode())
    assert plist["ExitTimeOut"] == 70
    # The service manager does not hand this shell's environment to the
    # service, so the file it runs has to be the one that said 60.
    args = plist["ProgramArguments"]
    assert args[args.index("--config") + 1] == str(cfg)
    r = cli("install-service", "--print", "--platform", "linux", "--config", str(cfg),
            env={"KVKEEPER_DRAIN_TIMEOUT": "45"})
    assert r.returncode == 0, r.stderr
    assert "TimeoutStopSec=55" in r.stdout
    cmd = _exec_start(r.stdout)
    assert float(cmd[cmd.index("--drain-timeout") + 1]) == 45
    r = cli("install-service", "--print", "--platform", "linux", "--drain-timeout", "0")
    assert r.returncode == 0 and "TimeoutStopSec=10" in r.stdout, r.stderr


def test_install_service_pins_what_the_xdg_variables_chose(short_dir: Path) -> None:
    """A config file found through $XDG_CONFIG_HOME, and the default root and
    socket under $XDG_CACHE_HOME / $XDG_RUNTIME_DIR, were left off the
    service's command line: launchd (or a user manager started without them)
    ran a daemon on another root and socket than this shell's clients use,
    with a stop timeout taken from a file it never read."""
    xdg = {"XDG_CONFIG_HOME": str(short_dir / "cfg"), "XDG_CACHE_HOME": str(short_dir / "cache"),
           "XDG_RUNTIME_DIR": str(short_dir / "run")}
    (short_dir / "cfg" / "kvkeeper").mkdir(parents=True)
    (short_dir / "cfg" / "kvkeeper" / "config.toml").write_text("drain_timeout = 100\n")
    r = cli("install-service", "--print", "--platform", "macos", env=xdg)
    assert r.returncode == 0, r.stderr
    plist = plistlib.loads(r.stdout.encode())
    args = plist["ProgramArguments"]
    assert args[args.index("--config") + 1] == str(short_dir / "cfg" / "kvkeeper" / "config.toml")
    assert args[args.index("--root") + 1].startswith(str(short_dir / "cache"))
    assert args[args.index("--socket") + 1].startswith(str(short_dir / "run"))
    assert plist["ExitTimeOut"] == 110
    printed = cli("serve", "--print-config", env=xdg).stdout
    assert args[args.index("--root") + 1] in printed and args[args.index("--socket") + 1] in printed
    # $XDG_CONFIG_HOME with no config file in it: none for this shell, while
    # the service, without the variable, would read the one in ~/.config.
    home = {"HOME": str(short_dir / "home"), "XDG_CONFIG_HOME": str(short_dir / "empty")}
    (short_dir / "home" / ".config" / "kvkeeper").mkdir(parents=True)
    (short_dir / "home" / ".config" / "kvkeeper" / "config.toml").write_text("drain_timeout = 7\n")
    r = cli("install-service", "--print", "--platform", "linux", env=home)
    assert r.returncode == 0, r.stderr
    cmd = _exec_start(r.stdout)
    assert cmd[cmd.index("--config") + 1] == os.devnull and "TimeoutStopSec=30" in r.stdout
    # $XDG_CONFIG_HOME=~/.config names the file the service finds anyway: no
    # pin, so that one written later counts for both.
    for exists in (True, False):
        if not exists:
            (short_dir / "home" / ".config" / "kvkeeper" / "config.toml").unlink()
        r = cli("install-service", "--print", "--platform", "linux",
                env={**home, "XDG_CONFIG_HOME": str(short_dir / "home" / ".config")})
        assert r.returncode == 0 and "--config" not in _exec_start(r.stdout), r.stdout


def test_install_service_pins_the_default_socket_without_xdg_runtime_dir(
    short_dir: Path
) -> None:
    """A shell without $XDG_RUNTIME_DIR (ssh, su, cron) resolves the socket
    to /tmp/kvkeeper-UID, while systemd gives a user service
    $XDG_RUNTIME_DIR: the unit said a bare `serve`, and the daemon listened
    where this shell's clients never look."""
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["HOME"] = str(short_dir / "home")
    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "install-service", "--print",
                        "--platform", "linux"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    cmd = _exec_start(r.stdout)
    assert cmd[cmd.index("--socket") + 1] == f"/tmp/kvkeeper-{os.getuid()}/kvkeeper.sock", cmd
    printed = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "serve", "--print-config"],
                             capture_output=True, text=True, timeout=120, env=env).stdout
    assert cmd[cmd.index("--socket") + 1] in printed


def test_the_macos_default_socket_does_not_follow_tmpdir(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On macOS the default socket lay under $TMPDIR, which is unset under
    sudo and cron and another one in a nix-shell: such a client looked for
    the daemon elsewhere and dropped every save. It is the user's temp
    directory as confstr(3) tells it (simulated here: Linux has none), and
    $TMPDIR only where the system tells none."""
    from kvkeeper import config

    told: list[str | None] = ["/var/folders/zz/abc123/T/"]

    def confstr(name: int | str) -> str | None:
        if name != 65537 or told[0] is None:  # _CS_DARWIN_USER_TEMP_DIR
            raise OSError(22, "Invalid argument")
        return told[0]

    monkeypatch.delenv("KVKEEPER_SOCKET", raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(os, "confstr", confstr)
    want = Path(f"/var/folders/zz/abc123/T/kvkeeper-{os.getuid()}/kvkeeper.sock")
    for tmpdir in ("/var/folders/zz/abc123/T/", "/nix/shell/tmp", None):
        if tmpdir is None:
            monkeypatch.delenv("TMPDIR", raising=False)
        else:
            monkeypatch.setenv("TMPDIR", tmpdir)
        assert config.default_socket() == want, tmpdir
    told[0] = None
    monkeypatch.setenv("TMPDIR", "/private/tmp/x")
    assert config.default_socket() == Path(f"/private/tmp/x/kvkeeper-{os.getuid()}/kvkeeper.sock")
    monkeypatch.undo()
    assert config.darwin_user_temp_dir() is None  # Linux: no such directory


@pytest.mark.parametrize(("argv", "process_type"), [
    ([], "Standard"),
    (["--cpu-policy", "normal"], "Interactive"),
])
def test_the_launch_agent_follows_the_cpu_policy(argv: list[str], process_type: str) -> None:
    r = cli("install-service", "--print", "--platform", "macos", *argv)
    assert r.returncode == 0, r.stderr
    plist = plistlib.loads(r.stdout.encode())
    assert plist["ProcessType"] == process_type
    assert ("--cpu-policy" in plist["ProgramArguments"]) == bool(argv)


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--min-write-interval", "-3"], {}, "min_write_interval"),
    (["--log-level", "loud"], {}, "log_level"),
    (["--drain-timeout", "nan"], {}, "drain_timeout"),
    ([], {"KVKEEPER_MIN_WRITE_INTERVAL": "-3"}, "KVKEEPER_MIN_WRITE_INTERVAL"),
    (["--cpu-policy", "fast"], {}, "cpu_policy"),
    (["--stall-timeout", "0.5"], {}, "stall_timeout"),
], ids=lambda v: repr(v))
def test_install_service_refuses_invalid_settings(argv: list[str], env: dict[str, str],
                                                  needle: str, short_dir: Path) -> None:
    home = {"HOME": str(short_dir / "home"), "XDG_CONFIG_HOME": str(short_dir / "cfg")}
    r = cli("install-service", "--print", "--platform", "linux", *argv, env=env)
    usage_error(r, needle)
    r = cli("install-service", "--platform", "linux", "--no-load", *argv, env={**env, **home})
    usage_error(r, needle)
    assert not (short_dir / "cfg" / "systemd" / "user" / "kvkeeper.service").exists()


@pytest.mark.parametrize("what", ["a socket path too long", "a root open to others",
                                  "a file at the socket path", "min_free_bytes past the disk",
                                  "a relative socket path too long once absolute",
                                  "a socket path not UTF-8"])
def test_install_service_refuses_places_serve_would_refuse(what: str, short_dir: Path) -> None:
    """Each of these made a unit that failed at every start (and, with
    Restart=on-failure, restarted forever): only the settings' values were
    checked. serve --print-config says so too, after the settings. A
    relative socket path was measured as given, not as serve binds it
    (serve then ended in a ZeroMQ traceback, exit 1); a name not valid
    UTF-8 ended serve in a UnicodeEncodeError traceback."""
    root, sock, argv = short_dir / "root", short_dir / "run" / "k.sock", []
    cwd = None
    if what == "a socket path too long":
        sock = short_dir / ("s" * 120) / "k.sock"
        needle = "bytes; this platform allows"
    elif what == "a relative socket path too long once absolute":
        cwd = short_dir / ("s" * (110 - len(str(short_dir))))
        cwd.mkdir(mode=0o700)
        sock = Path("k.sock")  # 6 bytes as given, over 107 in cwd
        needle = "bytes; this platform allows"
    elif what == "a socket path not UTF-8":
        sock = short_dir / "run" / os.fsdecode(b"\xff.sock")
        needle = "is not valid UTF-8"
    elif what == "a root open to others":
        root.mkdir(mode=0o700)
        root.chmod(0o755)
        needle = "root directory"
    elif what == "a file at the socket path":
        sock.parent.mkdir(mode=0o700)
        sock.write_text("precious")
        needle = "not a socket"
    else:
        argv = ["--min-free-bytes", "1000T"]
        needle = "more than the whole file system"
    places = ["--root", str(root), "--socket", str(sock), *argv]
    home = {"HOME": str(short_dir / "home"), "XDG_CONFIG_HOME": str(short_dir / "cfg")}
    usage_error(cli("install-service", "--print", "--platform", "linux", *places, cwd=cwd),
                needle)
    usage_error(cli("install-service", "--platform", "linux", "--no-load", *places, env=home,
                    cwd=cwd), needle)
    assert not (short_dir / "cfg" / "systemd" / "user" / "kvkeeper.service").exists()
    r = cli("serve", "--print-config", *places, cwd=cwd)
    assert r.returncode == 2 and "min_free_bytes" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith("kvkeeper: ") and needle in r.stderr, r.stderr
    r = cli("serve", *places, timeout=15, cwd=cwd)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    if what == "a file at the socket path":
        assert sock.read_text() == "precious"
    if what != "a root open to others":
        assert not root.exists()  # refused before anything was made


@pytest.mark.parametrize("what", ["root", "socket directory"])
def test_serve_on_a_full_disk_says_so_in_one_line(what: str, short_dir: Path) -> None:
    """A new root, or the socket's directory, on a full tmpfs (a full
    /run/user/UID): the directory and the empty lock file are made (they take
    no blocks), and writing the lock's text failed with an ENOSPC traceback,
    exit 1, which Restart=on-failure restarts forever."""
    with small_tmpfs(short_dir, "1m") as disk:
        with open(disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        root, sock = short_dir / "root", short_dir / "run" / "k.sock"
        if what == "root":
            root = disk / "root"
        else:
            sock = disk / "run" / "k.sock"
        r = cli("serve", "--root", str(root), "--socket", str(sock), "--min-free-bytes", "0",
                timeout=15)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "cannot write lock file" in r.stderr and "No space left on device" in r.stderr, \
            r.stderr


@pytest.mark.parametrize("what", ["root", "socket directory", "store directory", "lock file"])
def test_serve_refuses_a_place_it_cannot_write_with_one_line(what: str, short_dir: Path) -> None:
    """As a user who may not write there (root without CAP_DAC_OVERRIDE
    here): serve ended with a PermissionError traceback and exit 1, which
    Restart=on-failure restarts forever, and --print-config and
    install-service said nothing; with the store's sessions/ read-only it
    started and failed every save."""
    need_linux_root()
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    root.mkdir(mode=0o700)
    sock.parent.mkdir(mode=0o700)
    (root / "sessions").mkdir(mode=0o700)
    place, mode = {"root": (root, 0o500), "socket directory": (sock.parent, 0o500),
                   "store directory": (root / "sessions", 0o500),
                   "lock file": (root / ".kvkeeper.lock", 0o400)}[what]
    if what == "lock file":
        place.write_text("")
    place.chmod(mode)
    places = ["--root", str(root), "--socket", str(sock)]
    needle = f"{str(place)!r} cannot be written" if what != "lock file" else \
        f"cannot open lock file {str(place)!r} to write it"
    r = cli("serve", *places, prefix=NO_DAC, timeout=15)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr.splitlines()[-1] and not sock.exists(), r.stderr
    r = cli("serve", "--print-config", *places, prefix=NO_DAC)
    assert r.returncode == 2 and "max_pending_bytes" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith("kvkeeper: ") and needle in r.stderr, r.stderr
    usage_error(cli("install-service", "--print", "--platform", "linux", *places,
                    prefix=NO_DAC), needle)
    # With the place mended, the same command serves.
    place.chmod(0o700 if what != "lock file" else 0o600)
    proc = serve_process(root, sock, prefix=NO_DAC)
    assert stop_process(proc) == 0


def test_serve_on_a_read_only_file_system_says_so(short_dir: Path) -> None:
    """A root on a read-only file system was refused with the advice to
    "chmod 700 it, as its owner", which cannot help there."""
    with small_tmpfs(short_dir, "1m") as mnt:
        (mnt / "root").mkdir(mode=0o700)
        run("mount", "-o", "remount,ro", str(mnt))
        r = cli("serve", "--root", str(mnt / "root"), "--socket",
                str(short_dir / "run" / "k.sock"), timeout=15)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "read-only file system: choose a place on a writable one" in last, r.stderr
    assert "chmod" not in last and last.startswith("kvkeeper: root directory"), r.stderr


def test_repair_with_a_lock_file_it_cannot_write_fails_with_status_1(short_dir: Path) -> None:
    """verify --repair, no daemon, a root lock file this user cannot write:
    the repair failed (exit 1) with a PermissionError; when _Lock learned to
    say so in one line it became a settings error (exit 2)."""
    need_linux_root()
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    proc = serve_process(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("m", "a", small_cache(), [1, 2]) and kv.flush(timeout=WAIT)
    finally:
        assert stop_process(proc) == 0
    path = entry_path(root, "a", model="m")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    (root / ".kvkeeper.lock").chmod(0o400)
    r = cli("verify", "--root", str(root), "--socket", str(sock), "--repair", prefix=NO_DAC)
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert f"cannot open lock file {str(root / '.kvkeeper.lock')!r} to write it: " \
        f"Permission denied (no daemon can hold a lock file it cannot write" in r.stderr, r.stderr
    assert "BAD" in r.stdout and path.exists(), r.stdout


def test_a_save_failing_in_a_directory_the_daemon_cannot_write_names_it(
        short_dir: Path) -> None:
    """A model's directory made read-only under a running daemon: the log
    said only error="Permission denied (errno 13)"."""
    need_linux_root()
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    proc = serve_process(root, sock, prefix=NO_DAC)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save("m", "a", small_cache(), [1, 2]) and kv.flush(timeout=WAIT)
            model_dir = entry_path(root, "a", model="m").parent
            model_dir.chmod(0o500)
            try:
                assert kv.save("m", "b", small_cache(), [1, 2])
                assert kv.flush(timeout=WAIT) is False
            finally:
                model_dir.chmod(0o700)
    finally:
        assert stop_process(proc) == 0
    log = daemon_log(proc)
    failed = [line for line in log.splitlines() if "event=save_failed" in line]
    assert len(failed) == 1 and "id=b" in failed[0], log
    assert f"Permission denied (errno 13): {model_dir}" in failed[0], failed


def test_a_listing_while_a_model_directory_is_unreadable_forgets_nothing(
        short_dir: Path) -> None:
    """A model's directory the daemon could not look into for a moment (its
    mode changed by hand) during one `ls`: its entries were taken for files
    removed by hand and forgotten until a gc (not listed, not counted
    against --max-disk-bytes, never evicted; `rm --model` said "no entries")."""
    need_linux_root()
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    proc = serve_process(root, sock, "--min-write-interval", "0", prefix=NO_DAC)
    try:
        with Client(sock, timeout=WAIT) as kv:
            for k in ("a", "b"):
                assert kv.save("m", k, small_cache(), [1, 2])
            assert kv.flush(timeout=WAIT)
            used = kv.stats()["disk_used_bytes"]
            model_dir = entry_path(root, "a", model="m").parent
            model_dir.chmod(0)
            try:
                r = cli("ls", "--socket", str(sock))
            finally:
                model_dir.chmod(0o700)
            assert r.returncode == 0 and r.stdout.startswith("2 entries"), (r.stdout, r.stderr)
            assert [e.cache_id for e in kv.entries("m")] == ["a", "b"]
            assert kv.stats()["disk_used_bytes"] == used
        r = cli("rm", "--socket", str(sock), "--model", "m")
        assert r.returncode == 0 and "2 entries of model m" in r.stdout, (r.stdout, r.stderr)
    finally:
        assert stop_process(proc) == 0


def test_print_config_says_when_a_daemon_holds_the_root_or_socket(
        daemon: RunningDaemon, short_dir: Path) -> None:
    """The README says --print-config exits 2 when serve would refuse its
    root or socket; with another daemon on either it exited 0."""
    for places in (["--root", str(daemon.root), "--socket", str(short_dir / "s" / "k.sock")],
                   ["--root", str(short_dir / "r"), "--socket", str(daemon.socket)]):
        r = cli("serve", "--print-config", *places)
        assert r.returncode == 2 and "max_pending_bytes" in r.stdout, (r.stdout, r.stderr)
        assert "another kvkeeper daemon is running (pid" in r.stderr, r.stderr
        assert not (short_dir / "s").exists() and not (short_dir / "r").exists()
        # serve itself makes nothing either (before: the new socket directory
        # was left behind when another daemon held the root).
        r = cli("serve", *places)
        assert r.returncode == 2 and "another kvkeeper daemon is running" in r.stderr, r.stderr
        assert not (short_dir / "s").exists() and not (short_dir / "r").exists()
    assert "or another daemon holds either" in " ".join(cli("serve", "--help").stdout.split())


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_sessions_directory_serve_refuses_is_refused_before_it_starts(
        short_dir: Path, planted: str) -> None:
    """sessions/ a symlink or a regular file: serve exits 2, but
    --print-config and install-service said nothing (a unit that fails at
    every start, and stays down: RestartPreventExitStatus=2); for a regular
    file serve said only "cannot create ...: File exists"."""
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    root.mkdir(mode=0o700)
    if planted == "symlink":
        (short_dir / "out").mkdir(mode=0o700)
        (root / "sessions").symlink_to(short_dir / "out", target_is_directory=True)
    else:
        (root / "sessions").write_text("x")
    places = ("--root", str(root), "--socket", str(sock))
    needle = f"{root / 'sessions'} is a symlink or not a directory"
    for argv in (("serve", "--print-config", *places),
                 ("install-service", "--print", "--platform", "linux", *places),
                 ("serve", *places)):
        r = cli(*argv, timeout=15)
        assert r.returncode == 2 and needle in r.stderr, (argv, r.stdout, r.stderr)


def test_a_live_socket_whose_lock_file_went_is_not_taken(
        daemon: RunningDaemon, short_dir: Path) -> None:
    """The socket's lock file removed (a /tmp cleaner) under a running
    daemon: a second serve on the same socket and another root took the
    lock, unlinked the live socket as a dead daemon's and bound its own;
    the first daemon exited 1 and its clients went on with the other root."""
    (daemon.socket.parent / f"{daemon.socket.name}.lock").unlink()
    other = short_dir / "other" / "root"
    # Refused alike by serve, by --print-config and by install-service (the
    # last two said nothing: exit 0, and a unit that failed at every start).
    places = ("--root", str(other), "--socket", str(daemon.socket))
    for argv in (("serve", *places), ("serve", "--print-config", *places),
                 ("install-service", "--print", "--platform", "linux", *places)):
        r = cli(*argv, timeout=15)
        assert r.returncode == 2 and f"a process is listening on socket {daemon.socket}" \
            in r.stderr, (argv, r.stdout, r.stderr)
    assert not (short_dir / "other").exists()
    with Client(daemon.socket, timeout=WAIT) as kv:
        assert kv.ping().root == str(daemon.root)
        assert kv.save("m", "a", small_cache(), [1, 2]) and kv.flush(timeout=WAIT)
    assert entry_path(daemon.root, "a", model="m").exists()


def test_a_socket_whose_listener_does_not_accept_is_not_taken(short_dir: Path) -> None:
    """A process listening on the socket path but not accepting (a stopped
    daemon whose backlog is full): the probe's EAGAIN was taken for "nobody
    listens", and serve unlinked the live socket and bound its own."""
    import socket as sockets

    sock = short_dir / "run" / "k.sock"
    sock.parent.mkdir(mode=0o700)
    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    queued = []
    try:
        listener.bind(str(sock))
        listener.listen(0)
        for _ in range(4):  # fill the backlog
            c = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(str(sock))
            except BlockingIOError:
                break
        r = cli("serve", "--root", str(short_dir / "root"), "--socket", str(sock), timeout=15)
        assert r.returncode == 2 and "cannot tell whether a process listens on socket" \
            in r.stderr, (r.stdout, r.stderr)
        assert sock.exists() and not (short_dir / "root").exists()
    finally:
        for c in queued:
            c.close()
        listener.close()


def test_serve_refused_for_a_socket_in_use_leaves_no_root_behind(
        daemon: RunningDaemon, short_dir: Path) -> None:
    """The root was made (and locked) before the socket's lock said another
    daemon serves it: a new empty store left behind."""
    root = short_dir / "new" / "root"
    r = cli("serve", "--root", str(root), "--socket", str(daemon.socket), timeout=15)
    assert r.returncode == 2 and "another kvkeeper daemon is running" in r.stderr, r.stderr
    assert not (short_dir / "new").exists()


# ------------------------------------------------------------------ one config for both sides


def test_clients_find_the_daemon_by_the_config_files_socket(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = short_dir / "cs" / "k.sock"
    conf = short_dir / "kvkeeper.toml"
    conf.write_text(f'socket = "{sock}"\nroot = "{short_dir / "root"}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvkeeper.cli", "serve"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("KVKEEPER_")},
             "KVKEEPER_CONFIG": str(conf)})
    try:
        from .conftest import ping

        deadline = time.monotonic() + WAIT
        while not (sock.exists() and ping(sock, 0.5)):
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not answer"
            time.sleep(0.05)
        # The CLI and Client() with no socket given use the config's.
        r = cli("stats", "--json", env={"KVKEEPER_CONFIG": str(conf)})
        assert r.returncode == 0, r.stderr
        for k in [k for k in os.environ if k.startswith("KVKEEPER_")]:
            monkeypatch.delenv(k)
        monkeypatch.setenv("KVKEEPER_CONFIG", str(conf))
        with Client(timeout=WAIT) as kv:
            assert kv.socket_path == sock and kv.connected
            assert kv.save("fp", "c", small_cache(), [1, 2, 3, 4, 5])
            assert kv.flush(timeout=WAIT)
            assert kv.root == short_dir / "root"
    finally:
        assert stop_process(proc) == 0


def test_a_missing_config_file_named_by_the_environment_is_an_error(short_dir: Path) -> None:
    r = cli("serve", "--print-config", env={"KVKEEPER_CONFIG": str(short_dir / "nope.toml")})
    usage_error(r, "nope.toml", "does not exist")


@pytest.mark.parametrize("variable", ["KVKEEPER_ROOT", "KVKEEPER_SOCKET", "KVKEEPER_CONFIG"])
def test_an_environment_path_under_an_unknown_users_home_is_a_usage_error(
        variable: str) -> None:
    """~nosuchuser/... could not be expanded while the command line was read
    (the defaults --help shows): every command died with a traceback."""
    env = {variable: "~kvkeeper-no-such-user/x"}
    assert cli("--help", env=env).returncode == 0
    for argv in (("ls",), ("serve", "--print-config"), ("verify",)):
        usage_error(cli(*argv, env=env), "~kvkeeper-no-such-user")


def test_an_empty_environment_variable_means_unset(short_dir: Path) -> None:
    # KVKEEPER_ROOT= made serve take the current directory as its root, while
    # the clients took the default.
    r = cli("serve", "--print-config", env={"KVKEEPER_ROOT": "", "KVKEEPER_SOCKET": ""})
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "environment" not in lines["root"] and "environment" not in lines["socket"], r.stdout


def test_verify_repair_of_another_root_than_the_running_daemons(
    daemon: RunningDaemon, short_dir: Path
) -> None:
    from .conftest import start_daemon

    other = short_dir / "other-root"
    d = start_daemon(other, short_dir / "o" / "kv.sock")
    try:
        with Client(d.socket, timeout=WAIT) as kv:
            assert kv.save("fp", "c", small_cache(), [1, 2, 3, 4, 5])
            assert kv.flush(timeout=WAIT)
    finally:
        assert d.stop() == 0
    path = entry_path(other, "c", model="fp")
    os.truncate(path, path.stat().st_size - 10)
    # A daemon is running, but on another root: the repair is done directly.
    r = cli("verify", "--socket", str(daemon.socket), "--root", str(other), "--repair")
    assert r.returncode == 1 and "moved aside" in r.stdout, r.stdout + r.stderr
    assert not path.exists() and len(list((other / "quarantine").iterdir())) == 1



# ------------------------------------------------------------------ FIFOs


def test_a_fifo_named_like_a_cache_file_is_refused_not_waited_on(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """Opening a FIFO waits for a writer: import, verify and a load (export's
    read) waited forever before the regular-file check could refuse it."""
    sock = str(daemon.socket)
    src = short_dir / "in"
    src.mkdir()
    os.mkfifo(src / "f.safetensors")
    r = cli("import", "--socket", sock, "--model", "m", str(src), "--json", timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "not a regular file" in json.loads(r.stdout)["failed"][0]["reason"]
    assert client.save("m", "c", small_cache(), [1, 2, 3, 4, 5])
    assert client.flush(timeout=WAIT)
    fifo = entry_path(daemon.root, "fifo", model="m")
    os.mkfifo(fifo, 0o600)
    r = cli("verify", "--socket", sock, "--json", timeout=60)
    assert r.returncode == 1 and str(fifo) in r.stdout, (r.stdout, r.stderr)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(client.load("m", "fifo")), daemon=True)
    reader.start()
    reader.join(WAIT)
    assert got == [None], "the load of a FIFO did not return"
    r = cli("export", "--socket", sock, "m", "fifo", str(short_dir / "out.safetensors"),
            timeout=60)
    assert r.returncode == 1 and not (short_dir / "out.safetensors").exists(), r.stderr
    # The entry beside it is still served.
    loaded = client.load("m", "c")
    assert loaded is not None and loaded.token_ids == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("line", ['root = "relstore"', 'socket = "run/k.sock"',
                                  'socket = "ipc://k.sock"'])
def test_a_relative_path_in_the_config_file_is_refused(line: str, short_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One config file serves serve (started in / by launchd, in $HOME by
    systemd) and every client (each in its own directory): a relative root
    or socket named a different place for each."""
    cfg = short_dir / "rel.toml"
    cfg.write_text(line + "\n")
    name = line.split()[0]
    usage_error(cli("serve", "--config", str(cfg), "--print-config"), name, "relative path")
    usage_error(cli("ls", env={"KVKEEPER_CONFIG": str(cfg)}), name, "relative path")
    for k in [k for k in os.environ if k.startswith("KVKEEPER_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVKEEPER_CONFIG", str(cfg))
    with pytest.raises(ValueError, match="relative path"):
        Client(timeout=WAIT, connect_timeout=0)
    home = short_dir / "home"
    cfg.write_text(line.replace('"', '"~/', 1).replace("ipc://", "") + "\n")
    monkeypatch.setenv("HOME", str(home))
    r = cli("serve", "--config", str(cfg), "--print-config", env={"HOME": str(home)})
    assert r.returncode == 0 and str(home) in r.stdout, r.stderr


def test_print_config_shows_where_a_relative_path_leads(short_dir: Path) -> None:
    """A relative --root or --socket was printed as given: where serve would
    put the store, and listen, was left to the reader to work out."""
    r = cli("serve", "--root", "rr", "--socket", "s/kv.sock", "--print-config", cwd=short_dir)
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert f"rr (= {short_dir / 'rr'})" in rows["root"], r.stdout
    assert f"s/kv.sock (= {short_dir / 's' / 'kv.sock'})" in rows["socket"], r.stdout
    assert not (short_dir / "rr").exists()  # printing makes nothing


def test_kvkeeper_debug_shows_the_client_library_log(short_dir: Path) -> None:
    """The commands keep the library's log lines off stderr; KVKEEPER_DEBUG
    (documented in the README) lets them through: here the refusal of an
    import's save over the disk budget (event=save_refused)."""
    from mlx_lm.models.cache import save_prompt_cache

    from .conftest import start_daemon

    c = KVCache()
    x = mx.zeros((1, 8, 512, 128))  # 2 MiB a layer in float32
    c.update_and_fetch(x, x)
    src = short_dir / "big.safetensors"
    save_prompt_cache(str(src), [c])
    rd = start_daemon(short_dir / "root", short_dir / "run" / "k.sock", max_disk_bytes=2**20)
    try:
        argv = ("import", "--socket", str(rd.socket), "--model", "m", str(src))
        quiet, loud = cli(*argv), cli(*argv, env={"KVKEEPER_DEBUG": "1"})
    finally:
        assert rd.stop() == 0
    assert quiet.returncode == loud.returncode == 1, (quiet.stderr, loud.stderr)
    assert "event=" not in quiet.stderr, quiet.stderr
    assert "event=save_refused" in loud.stderr, loud.stderr


@pytest.mark.parametrize(("argv", "unknown"), [
    (("ls", "--sokcet", "x"), "--sokcet x"),
    (("rm", "m", "c", "-x"), "-x"),
    (("serve", "--max-disk", "1G", "--bogus"), "--bogus"),
    (("gc", "extra"), "extra"),
    (("--bogus", "ls"), "--bogus"),
    (("--bogus", "ls", "--other"), "--bogus"),
])
def test_an_unknown_argument_shows_its_commands_usage(argv: tuple[str, ...],
                                                      unknown: str) -> None:
    """argparse reported arguments a command did not know with the top
    parser's usage (``usage: kvkeeper [-h] [--version] COMMAND ...``), which
    does not show the flag the user meant; one given before the command is
    the top parser's."""
    r = cli(*argv)
    command = argv[0] if not argv[0].startswith("-") else ""
    who = f"kvkeeper {command}".rstrip()
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"usage: {who} "), r.stderr
    # (rm's "-x" gets the way past it after a ";": test_cli_usage.py.)
    said = f"{who}: error: unrecognized arguments: {unknown}"
    assert f"{said}\n" in r.stderr or f"{said}; " in r.stderr, r.stderr


def test_commands_work_without_a_home_directory(short_dir: Path) -> None:
    """HOME unset and a uid with no password entry (a container's): every
    command, `serve --help` included, ended in a RuntimeError traceback
    (Path.home(), for the defaults in the help), even with --root and
    --socket given."""
    need_linux_root()
    short_dir.chmod(0o711)  # for uid 12345 to pass through
    base = short_dir / "nohome"
    base.mkdir()
    base.chmod(0o777)  # and to make its root and socket directory in
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    as_nobody = ("setpriv", "--reuid", "12345", "--regid", "12345", "--clear-groups",
                 sys.executable, "-m", "kvkeeper.cli")

    def run_(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*as_nobody, *argv], capture_output=True, text=True,
                              timeout=WAIT, env=env)

    # A Python built with a shared libpython under a directory only root may
    # enter (pyenv's 3.10 and 3.13 under /root) cannot start as another user
    # at all (exit 127): nothing of kvkeeper's would be tested.
    probe = subprocess.run([*as_nobody[:-2], "-c", "pass"], capture_output=True, text=True,
                           timeout=WAIT, env=env)
    if probe.returncode == 127 and "shared librar" in probe.stderr:
        pytest.skip(f"{sys.executable} cannot run as another user here: {probe.stderr.strip()}")
    assert probe.returncode == 0, probe.stderr
    places = ("--root", str(base / "r"), "--socket", str(base / "s" / "k.sock"))
    r = run_("serve", "--help")
    assert r.returncode == 0 and "no home directory" in " ".join(r.stdout.split()), r.stderr
    r = run_("serve", "--print-config", *places)
    assert r.returncode == 0, r.stderr
    r = run_("stats", "--socket", places[3])
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    # The default root needs the home: said in one line, exit 2.
    r = run_("serve", "--print-config", "--socket", places[3])
    usage_error(r, "cannot tell this user's home directory")
    # A shared root's advice names the default root, where there is one: here
    # it said only that the home was unknown, not what was wrong with /tmp.
    r = run_("serve", "--print-config", "--root", "/tmp", "--socket", places[3])
    usage_error(r, "keep the store in a directory of its own")
    assert "home directory" not in r.stderr, r.stderr


def test_a_daemon_takes_no_message_from_another_user(short_dir: Path) -> None:
    """A daemon of uid 12345: root, whom no file mode keeps out of its socket
    directory, connects, and its ping is never answered (libzmq drops the
    connection: IPC_FILTER_UID); the daemon's own user is answered. No test
    held this before."""
    from kvkeeper.protocol import messages as m

    from .conftest import _ask

    need_linux_root()
    short_dir.chmod(0o711)  # for uid 12345 to pass through
    base = short_dir / "other"
    base.mkdir()
    base.chmod(0o777)  # and to make its root and socket directory in
    sock = base / "s" / "k.sock"
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HOME": str(base),
           "XDG_CONFIG_HOME": "/nonexistent-kvkeeper-test-config"}
    as_other = ("setpriv", "--reuid", "12345", "--regid", "12345", "--clear-groups")

    def stats_as_its_user() -> subprocess.CompletedProcess[str]:
        return subprocess.run([*as_other, sys.executable, "-m", "kvkeeper.cli", "stats",
                               "--json", "--socket", str(sock)], capture_output=True,
                              text=True, timeout=WAIT, env={**os.environ, **env})

    probe = subprocess.run([*as_other, sys.executable, "-c", "pass"], capture_output=True,
                           text=True, timeout=WAIT, env={**os.environ, **env})
    if probe.returncode == 127 and "shared librar" in probe.stderr:
        pytest.skip(f"{sys.executable} cannot run as another user here: {probe.stderr.strip()}")
    proc = serve_process(base / "r", sock, env=env, prefix=as_other, answering=False)
    try:
        wait_for(sock.exists, "the daemon's socket")
        mine = stats_as_its_user()
        assert mine.returncode == 0, mine.stderr
        assert _ask(sock, m.Ping(v=m.PROTOCOL_VERSION, req=1), 2.0) is None
        assert stats_as_its_user().returncode == 0  # still serving its own
    finally:
        assert stop_process(proc) == 0
    assert "Traceback" not in daemon_log(proc)


def test_relative_xdg_directories_are_ignored(short_dir: Path) -> None:
    """The XDG base directory spec says a relative value is to be ignored:
    taken from each process's own directory, the daemon and its clients
    looked for each other in different places."""
    env = {"XDG_RUNTIME_DIR": "relrun", "XDG_CACHE_HOME": "relcache",
           "XDG_CONFIG_HOME": "relcfg"}
    r = cli("serve", "--print-config", env=env, cwd=short_dir)
    assert r.returncode in (0, 2), r.stderr
    for name in ("relrun", "relcache"):
        assert name not in r.stdout, r.stdout


def test_serve_in_a_removed_directory_with_a_relative_path(short_dir: Path) -> None:
    """A relative --root, the shell's directory removed: os.path.abspath
    raised FileNotFoundError (a traceback, exit 1)."""
    gone = short_dir / "gone"
    gone.mkdir()
    sock = short_dir / "run" / "k.sock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for extra in ((), ("--print-config",)):
        r = subprocess.run(
            ["sh", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "$0" -m kvkeeper.cli serve '
                         f'--root rel --socket "{sock}" {" ".join(extra)}; ', sys.executable],
            capture_output=True, text=True, timeout=WAIT, env=env)
        usage_error(r, "the current directory was removed", "root rel")
        gone.mkdir()
    assert not sock.exists()
    # The other commands too (before: "[Errno 2] No such file or directory",
    # exit 1, with no word of which path or why).
    r = subprocess.run(
        ["sh", "-c", f'cd "{gone}" && rmdir "{gone}" && exec "$0" -m kvkeeper.cli ls '
                     f'--socket rel.sock', sys.executable],
        capture_output=True, text=True, timeout=WAIT, env=env)
    usage_error(r, "the current directory was removed", "socket 'rel.sock' is relative")


@pytest.mark.parametrize("stderr", ["/dev/full", "a pipe nobody reads"])
def test_serve_with_an_unwritable_stderr_still_serves(short_dir: Path, stderr: str) -> None:
    """The start-up banner's write failed (ENOSPC, EPIPE) and serve exited 1
    before binding its socket: every client's saves were dropped. Log lines
    failing later were already taken in stride."""
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    if stderr == "/dev/full":
        err: Any = open("/dev/full", "w")  # noqa: SIM115 - handed to the child
    else:
        read_end, write_end = os.pipe()
        os.close(read_end)
        err = write_end
    proc = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "serve", "--root", str(root),
                             "--socket", str(sock)], stdout=subprocess.DEVNULL, stderr=err)
    os.close(err) if isinstance(err, int) else err.close()
    try:
        with Client(sock, timeout=WAIT, connect_timeout=WAIT) as kv:
            assert kv.save("m", "c", small_cache(), [1, 2]) and kv.flush(timeout=WAIT)
    finally:
        assert stop_process(proc) == 0
    assert entry_path(root, "c", model="m").exists()


def test_the_environment_is_not_shown_as_the_built_in_default(short_dir: Path) -> None:
    """With $KVKEEPER_ROOT set, serve --help gave its value as the default
    root (and $KVKEEPER_MAX_DISK_BYTES's not as the default budget), and a
    root refused as shared with everyone pointed at "the default root",
    that very directory."""
    home = short_dir / "home"
    shared = short_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    env = {"HOME": str(home), "XDG_CACHE_HOME": "", "KVKEEPER_ROOT": str(shared),
           "KVKEEPER_SOCKET": str(short_dir / "run" / "kv.sock")}
    built_in = home / ".cache" / "kvkeeper"
    r = cli("serve", "--help", env=env)
    assert r.returncode == 0, r.stderr
    said = "".join(r.stdout.split())  # argparse folds the paths, at hyphens too
    assert "".join(f"store directory (default: {built_in})".split()) in said, r.stdout
    assert str(shared) not in said and str(short_dir / "run") not in said, r.stdout
    r = cli("serve", "--print-config", env=env)
    assert f"root {shared} (environment KVKEEPER_ROOT)" in " ".join(r.stdout.split()), r.stdout
    r = cli("serve", env=env)
    assert r.returncode == 2 and "outlives a reboot" in r.stderr, r.stderr
    assert f"(the default root is '{built_in}')" in r.stderr, r.stderr


def test_a_client_with_an_unusable_root_setting_keeps_it_and_reads_no_other_store(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$KVKEEPER_ROOT naming a user that does not exist: the client logs it
    and keeps the value as given, where no store is, so that a load with the
    daemon down misses. (When the built-in default became the settings'
    default, the client read the built-in store instead: another daemon's.)
    A config file at fault leaves the client no root at all."""
    monkeypatch.setenv("KVKEEPER_ROOT", "~nosuchuser-kvk/x")
    monkeypatch.setenv("HOME", str(short_dir / "home"))
    with Client(short_dir / "none.sock", connect_timeout=0) as kv:
        assert kv.root == Path("~nosuchuser-kvk/x")
    # The same from a config file (before: a file that did not parse, or a
    # root in it that was no path, gave the built-in store).
    monkeypatch.delenv("KVKEEPER_ROOT")
    built_in = short_dir / "home" / ".cache" / "kvkeeper"
    (built_in / "sessions").mkdir(parents=True)
    conf = short_dir / "kvk.toml"
    monkeypatch.setenv("KVKEEPER_CONFIG", str(conf))
    for text in ('root = "~nosuchuser-kvk/x"', "root = 5", "root = [", 'root = ""'):
        conf.write_text(text)
        with Client(short_dir / "none.sock", connect_timeout=0) as kv:
            assert kv.root != built_in and not (kv.root / "sessions").exists(), (text, kv.root)


def test_the_built_in_root_refused_as_shared_is_not_offered_as_the_way_out(
        short_dir: Path) -> None:
    home = short_dir / "home"
    built_in = home / ".cache" / "kvkeeper"
    built_in.mkdir(parents=True)
    built_in.chmod(0o1777)
    (short_dir / "a").mkdir()
    (short_dir / "link").symlink_to(home)
    # The same directory, written three ways.
    for given in (home, short_dir / "a" / ".." / "home", short_dir / "link"):
        r = cli("serve", "--print-config", env={"HOME": str(given), "XDG_CACHE_HOME": "",
                                                 "KVKEEPER_SOCKET": str(short_dir / "run" / "s")})
        assert r.returncode == 2 and "has mode 1777" in r.stderr, r.stderr
        assert "the default root is" not in r.stderr, r.stderr
    # A home directory given as the root is not to be chmod-ed, however
    # HOME is written: a directory of its own inside it is.
    built_in.chmod(0o700)
    home.chmod(0o755)
    for given in (home, short_dir / "a" / ".." / "home", short_dir / "link"):
        r = cli("serve", "--print-config", env={"HOME": str(given), "KVKEEPER_ROOT": str(home),
                                                 "KVKEEPER_SOCKET": str(short_dir / "run" / "s")})
        assert r.returncode == 2 and "has mode 755" in r.stderr, r.stderr
        assert "chmod" not in r.stderr and "a directory of its own inside it" in r.stderr, \
            (given, r.stderr)


def test_an_error_quoting_a_path_with_control_characters_stays_one_line(
        short_dir: Path) -> None:
    """A newline in a path an error quotes made a second line that read as
    another message, and an ESC reached the terminal; both come escaped."""
    sock = str(short_dir / "none.sock")
    r = cli("export", "--socket", sock, "m", "id", str(short_dir / "no\nsuch" / "x.safetensors"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "no\\nsuch is not an existing directory" in r.stderr, r.stderr
    empty = short_dir / "e\x1b[31mmpty"
    empty.mkdir()
    r = cli("import", "--socket", sock, "--model", "m", str(empty))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "\x1b" not in r.stderr, r.stderr
    assert "e\\x1b[31mmpty" in r.stderr, r.stderr


def test_no_daemon_at_a_path_that_is_no_socket_is_not_told_to_start_one_there(
        short_dir: Path) -> None:
    """A regular file or a directory given as the socket: the hint said
    "start it: kvkeeper serve --socket PATH", which serve refuses."""
    (short_dir / "plain").write_text("")
    for path, what in ((short_dir / "plain", "not a socket"), (short_dir, "a directory")):
        r = cli("stats", "--socket", str(path))
        assert r.returncode == 3 and f"it is {what}" in r.stderr, r.stderr
        assert "start it" not in r.stderr, r.stderr


def test_a_lock_file_that_is_a_fifo_is_refused_not_waited_on(short_dir: Path) -> None:
    """The look at the root's lock (which serve, --print-config and
    install-service take before anything is made) opened it to read, and a
    FIFO there blocked that open for ever."""
    from kvkeeper.daemon.app import LOCK_NAME

    root = short_dir / "root"
    root.mkdir(mode=0o700)
    os.mkfifo(root / LOCK_NAME, 0o600)
    for extra in ((), ("--print-config",)):
        r = cli("serve", "--root", str(root), "--socket", str(short_dir / "run" / "k.sock"),
                *extra)
        assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr
