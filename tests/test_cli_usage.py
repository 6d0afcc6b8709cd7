"""The CLI as a user runs it: usage errors exit 2 and real failures 1, config
values of the wrong TOML type are refused, ``export`` takes ``--root`` and
writes 0600, ``import`` of nothing says so, ``demo --socket`` insists on that
daemon, and the service commands point at ``--no-load`` where there is no
service manager. Every command is a real subprocess against a real daemon."""

from __future__ import annotations

import json
import os
import plistlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache

from kvkeeper.client.client import Client

from .conftest import WAIT, RunningDaemon, serve_process, start_daemon, stop_process
from .faultkit import NO_DAC, entry_path, need_linux_root
from .test_cli_checks import cli, usage_error
from .test_legacy import ROOT as LEGACY

DEMO_TIMEOUT = 180.0  # a cap: without the fix the demo runs in full


def small_cache(value: float = 0.0) -> list[KVCache]:
    c = KVCache()
    x = mx.full((1, 2, 5, 8), value)
    c.update_and_fetch(x, x)
    return [c]


def _save(kv: Client, model: str, cache_id: str, value: float = 0.0) -> None:
    assert kv.save(model, cache_id, small_cache(value), [1, 2, 3, 4, 5])
    assert kv.flush(timeout=WAIT)


def _cache_files(d: Path, n: int) -> list[Path]:
    """``n`` mlx-lm prompt-cache files in ``d`` (made by kvkeeper export's
    own writer, mlx-lm's save_prompt_cache)."""
    from mlx_lm.models.cache import save_prompt_cache

    d.mkdir(exist_ok=True)
    files = []
    for i in range(n):
        f = d / f"c{i}.safetensors"
        save_prompt_cache(str(f), small_cache(float(i)))
        files.append(f)
    return files


# ------------------------------------------------------------------ 1. usage errors exit 2


def test_rm_without_a_whole_key_is_a_usage_error(client: Client, daemon: RunningDaemon) -> None:
    _save(client, "m1", "a")
    sock = str(daemon.socket)
    usage_error(cli("rm", "--socket", sock), "rm MODEL ID", "rm --model FP")
    # Only MODEL: not a delete of anything, and it says what is missing.
    usage_error(cli("rm", "--socket", sock, "m1"), "cache id", "rm --model FP")
    assert [e.cache_id for e in client.entries()] == ["a"]
    # Without a daemon, a usage error is still one (not "no daemon").
    usage_error(cli("rm", "--socket", str(daemon.socket.parent / "none.sock"), "m1"))
    # A real failure stays 1: the key names no entry.
    r = cli("rm", "--socket", sock, "m1", "nope")
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == "kvkeeper: no such entry: m1 / nope\n", r.stderr  # was on stdout
    # One of a thing is not "1 entries" ("1 files", ...).
    r = cli("verify", "--socket", sock)
    assert r.returncode == 0 and r.stdout.startswith("1 file checked under "), r.stdout
    r = cli("rm", "--socket", sock, "--model", "m1")
    assert r.returncode == 0 and r.stdout == "deleted 1 entry of model m1\n", r.stdout


def test_import_usage_errors(client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    sock = str(daemon.socket)
    a, b = _cache_files(short_dir / "two", 2)
    # --id names one entry: two files, or a directory of two, cannot take it.
    usage_error(cli("import", "--socket", sock, "--model", "m", "--id", "x", str(a), str(b)),
                "--id", "the 2 paths hold 2")
    # One file named twice, or a directory and its one file, is one file
    # (exit 2 before, "not 2 paths": a review).
    (short_dir / "one").mkdir()
    only = (short_dir / "one" / "only.safetensors")
    only.write_bytes(a.read_bytes())
    for twice in ([str(a), str(a)], [str(short_dir / "one"), str(only)]):
        r = cli("import", "--socket", sock, "--model", "m", "--id", "x", "--replace", *twice)
        assert r.returncode == 0, (twice, r.stdout, r.stderr)
    assert [e.cache_id for e in client.entries("m")] == ["x"]
    assert client.delete("m", "x")
    usage_error(cli("import", "--socket", sock, "--model", "m", "--id", "x",
                    str(short_dir / "two")), "--id", "2")
    # A PATH that does not exist is a mistake on the command line.
    missing = short_dir / "no-such-file.safetensors"
    usage_error(cli("import", "--socket", sock, "--model", "m", str(missing)), str(missing))
    assert client.entries() == []
    # Real failures stay 1: a file that is not a cache.
    junk = short_dir / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    r = cli("import", "--socket", sock, "--model", "m", str(junk))
    assert r.returncode == 1 and "not imported" in r.stdout, (r.stdout, r.stderr)
    # The file named once (before: "not imported J: J: not a ...").
    assert r.stdout.count(str(junk)) == 1, r.stdout
    # And --id with exactly one file works.
    r = cli("import", "--socket", sock, "--model", "m", "--id", "x", str(a))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert [(e.model, e.cache_id) for e in client.entries()] == [("m", "x")]


def test_import_refuses_an_empty_path_and_takes_a_file_named_twice_once(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """import "" searched the current directory whole (Path("") is "."), and
    with --replace overwrote the entries it found there; a file named twice
    was imported, then refused as a second file for its key (exit 1)."""
    sock = str(daemon.socket)
    here = short_dir / "here"
    a, b = _cache_files(here, 2)
    r = cli("import", "--socket", sock, "--model", "m", "--replace", "", cwd=here)
    assert r.returncode == 2 and "the path is empty" in r.stderr, (r.stdout, r.stderr)
    r = cli("export", "--socket", sock, "m", "c0", "", cwd=here)
    assert r.returncode == 2 and "the path is empty" in r.stderr, (r.stdout, r.stderr)
    usage_error(cli("export", "--socket", sock, "m", "c0", ".safetensors", cwd=here),
                "give a name before .safetensors")
    assert client.entries() == []
    r = cli("import", "--socket", sock, "--model", "m", "--json", str(a),
            str(here / "." / a.name), str(here), cwd=short_dir)
    assert r.returncode == 0, (r.stdout, r.stderr)
    report = json.loads(r.stdout)
    assert [i["path"] for i in report["imported"]] == [str(a), str(b)]
    assert report["failed"] == []
    assert sorted(e.cache_id for e in client.entries()) == ["c0", "c1"]


def test_a_path_mlx_cannot_open_is_refused_as_such(client: Client, daemon: RunningDaemon,
                                                   short_dir: Path) -> None:
    """A name that is not UTF-8: import called the file damaged ("MLX cannot
    read it: std::bad_cast"), and export wrote one no loader could open."""
    sock = str(daemon.socket)
    here = short_dir / "here"
    (good,) = _cache_files(here, 1)
    odd = here / os.fsdecode(b"\xff.safetensors")
    shutil.copyfile(good, odd)
    r = cli("import", "--socket", sock, "--model", "m", "--json", str(odd))
    assert r.returncode == 1, (r.stdout, r.stderr)
    (failed,) = json.loads(r.stdout)["failed"]
    assert failed["reason"].startswith("MLX cannot open a path that is not valid UTF-8: "
                                       "rename it"), failed
    assert client.entries() == []
    assert client.save("m", "c0", small_cache(), [1, 2]) and client.flush(timeout=WAIT)
    dest = here / os.fsdecode(b"out\xfe.safetensors")
    usage_error(cli("export", "--socket", sock, "m", "c0", str(dest)), "not valid UTF-8")
    assert not os.path.lexists(dest)
    # A relative name opens in a directory whose own name is not UTF-8.
    odd_dir = short_dir / os.fsdecode(b"d\xff")
    odd_dir.mkdir()
    r = cli("export", "--socket", sock, "m", "c0", "out.safetensors", cwd=odd_dir)
    assert r.returncode == 0, (r.stdout, r.stderr)
    r = cli("import", "--socket", sock, "--model", "m", "--id", "again", "out.safetensors",
            cwd=odd_dir)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert {e.cache_id for e in client.entries()} == {"c0", "again"}


def test_import_of_a_directory_with_an_unlistable_subdirectory(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """A subdirectory the user may not list is said, and the rest imported.
    (The search skipped it without a word.)"""
    need_linux_root()
    top = short_dir / "top"
    (a,) = _cache_files(top, 1)
    _cache_files(top / "shut", 1)
    (top / "shut").chmod(0)
    try:
        r = cli("import", "--socket", str(daemon.socket), "--model", "m", str(top),
                prefix=NO_DAC)
    finally:
        (top / "shut").chmod(0o700)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"cannot list {top / 'shut'}: Permission denied" in r.stderr, r.stderr
    assert [e.cache_id for e in client.entries()] == ["c0"]


# ------------------------------------------------------------------ 2. TOML booleans


@pytest.mark.parametrize("toml", [
    "drain_timeout = true\n",
    "min_write_interval = false\n",
    "max_disk_bytes = true\n",
    "min_free_bytes = false\n",
    "max_pending_bytes = true\n",
    "root = true\n",
])
def test_config_file_booleans_are_refused(toml: str, short_dir: Path) -> None:
    cfg = short_dir / "kv.toml"
    cfg.write_text(toml)
    name = toml.split()[0]
    usage_error(cli("serve", "--config", str(cfg), "--print-config"), name, str(cfg),
                "boolean")
    usage_error(cli("install-service", "--print", "--platform", "linux", "--config", str(cfg)),
                name, "boolean")


def test_serve_does_not_start_with_a_boolean_drain_timeout(short_dir: Path) -> None:
    cfg = short_dir / "kv.toml"
    cfg.write_text("drain_timeout = true\n")
    sock = short_dir / "run" / "k.sock"
    # Before the fix this served (drain_timeout 1.0 s) until the timeout.
    r = cli("serve", "--config", str(cfg), "--root", str(short_dir / "root"), "--socket",
            str(sock), timeout=15)
    usage_error(r, "drain_timeout", "boolean true")
    assert not sock.exists()


def test_config_file_numbers_and_strings_still_work(short_dir: Path) -> None:
    cfg = short_dir / "kv.toml"
    cfg.write_text('drain_timeout = 3\nmin_write_interval = 0.5\nmax_disk_bytes = "2G"\n'
                   "min_free_bytes = 0\n")
    r = cli("serve", "--config", str(cfg), "--print-config")
    assert r.returncode == 0, r.stderr
    got = {ln.split()[0]: ln.split()[1] for ln in r.stdout.splitlines() if ln.strip()}
    assert got["drain_timeout"] == "3.0" and got["min_write_interval"] == "0.5"
    assert got["max_disk_bytes"] == str(2 * 1024**3) and got["min_free_bytes"] == "0"


def test_a_config_file_named_with_a_tilde_is_found_in_the_home(short_dir: Path) -> None:
    # "--config=~/..." reaches kvkeeper unexpanded (the shell expands a "~"
    # only at a word's start); --root and $KVKEEPER_CONFIG expanded it, --config
    # said the file did not exist (serve and install-service, exit 2).
    home = short_dir / "home"
    home.mkdir()
    (home / "kv.toml").write_text("drain_timeout = 3.5\n")
    env = {"HOME": str(home)}
    places = ("--root", str(short_dir / "root"), "--socket", str(short_dir / "k.sock"))
    r = cli("serve", "--config=~/kv.toml", *places, "--print-config", env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(rf"drain_timeout +3.5 +\(config file {re.escape(str(home))}/kv.toml\)",
                     r.stdout), r.stdout
    r = cli("install-service", "--print", "--platform", "linux", "--config=~/kv.toml", *places,
            env=env)
    assert r.returncode == 0, r.stderr
    assert f"--config {home}/kv.toml" in r.stdout, r.stdout
    r = cli("serve", "--config=", "--print-config", env=env)
    assert r.returncode == 2 and "the path is empty" in r.stderr, r.stderr


# ------------------------------------------------------------------ 3. export --root


def _root_holding(root: Path, sock: Path, value: float) -> None:
    """Have a daemon of its own write m1 / a (every element ``value``) under
    ``root``, then stop it."""
    d = start_daemon(root, sock)
    try:
        with Client(d.socket, timeout=WAIT) as kv:
            _save(kv, "m1", "a", value)
    finally:
        assert d.stop() == 0


def test_export_from_a_root_without_a_daemon(short_dir: Path) -> None:
    root = short_dir / "root"
    _root_holding(root, short_dir / "r1" / "kv.sock", 7.0)
    out = short_dir / "out.safetensors"
    none = str(short_dir / "none.sock")
    r = cli("export", "--socket", none, "--root", str(root), "m1", "a", str(out))
    assert r.returncode == 0, r.stderr
    layers, meta = load_prompt_cache(str(out), return_metadata=True)
    assert json.loads(meta["token_ids"]) == [1, 2, 3, 4, 5]
    assert mx.all(layers[0].state[0] == 7.0).item()
    # A root that is not a directory is a usage error; a key it lacks a failure.
    usage_error(cli("export", "--socket", none, "--root", str(short_dir / "nope"), "m1", "a",
                    str(short_dir / "o2.safetensors")), "--root", "nope")
    r = cli("export", "--socket", none, "--root", str(root), "m1", "zz",
            str(short_dir / "o3.safetensors"))
    assert r.returncode == 1 and "no entry" in r.stderr and str(root) in r.stderr, r.stderr
    assert "--root" in cli("export", "--help").stdout


def test_export_root_is_read_even_when_a_daemon_serves_another(
        client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    other = short_dir / "other"
    _root_holding(other, short_dir / "r2" / "kv.sock", 3.0)
    _save(client, "m1", "a", 9.0)  # the same key in the running daemon's root
    sock = str(daemon.socket)
    out = short_dir / "other.safetensors"
    r = cli("export", "--socket", sock, "--root", str(other), "m1", "a", str(out))
    assert r.returncode == 0, r.stderr
    assert mx.all(load_prompt_cache(str(out))[0].state[0] == 3.0).item()
    # --root naming the running daemon's own root goes through the daemon.
    out2 = short_dir / "mine.safetensors"
    r = cli("export", "--socket", sock, "--root", str(daemon.root), "m1", "a", str(out2))
    assert r.returncode == 0, r.stderr
    assert mx.all(load_prompt_cache(str(out2))[0].state[0] == 9.0).item()


# ------------------------------------------------------------------ 4. import of nothing


def test_import_of_a_directory_without_cache_files(client: Client, daemon: RunningDaemon,
                                                   short_dir: Path) -> None:
    sock = str(daemon.socket)
    empty = short_dir / "empty"
    empty.mkdir()
    others = short_dir / "others"
    others.mkdir()
    (others / "notes.txt").write_text("no caches here")
    for d in (empty, others):
        r = cli("import", "--socket", sock, "--model", "m", str(d))
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "no *.safetensors files" in r.stderr and str(d) in r.stderr, r.stderr
    r = cli("import", "--socket", sock, "--model", "m", "--json", str(empty))
    assert r.returncode == 1 and "nothing to import" in r.stderr, r.stderr
    # With something to import next to it, the empty directory is mentioned,
    # and what could be imported is.
    (f,) = _cache_files(short_dir / "one", 1)
    r = cli("import", "--socket", sock, "--model", "m", str(empty), str(f))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert str(empty) in r.stderr and "imported" in r.stdout
    assert [e.cache_id for e in client.entries()] == ["c0"]
    help_text = " ".join(cli("import", "--help").stdout.split())
    assert "nothing to import" in help_text
    # A directory is searched with its subdirectories, as --help now says.
    assert "directories searched (subdirectories too) for *.safetensors" in help_text
    (short_dir / "tree" / "a").mkdir(parents=True)
    (deep,) = _cache_files(short_dir / "tree" / "a" / "b", 1)
    r = cli("import", "--socket", sock, "--model", "m", "--id", "deep", str(short_dir / "tree"))
    assert r.returncode == 0 and str(deep) in " ".join(r.stdout.split()), (r.stdout, r.stderr)
    assert sorted(e.cache_id for e in client.entries()) == ["c0", "deep"]


# ------------------------------------------------------------------ 5. demo --socket


def test_demo_with_a_named_socket_and_no_daemon_there(short_dir: Path) -> None:
    sock = short_dir / "none.sock"
    r = cli("demo", "--socket", str(sock), "--tokens", "2", "--prompt-tokens", "64",
            timeout=DEMO_TIMEOUT)
    assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert str(sock) in r.stderr and "kvkeeper serve" in r.stderr, r.stderr
    assert "private daemon" not in r.stdout
    # Naming a socket and asking for a private daemon contradict each other.
    r = cli("demo", "--socket", str(sock), "--private", timeout=DEMO_TIMEOUT)
    assert r.returncode == 2 and "not allowed with" in r.stderr, r.stderr


# ------------------------------------------------------------------ 6. no service manager


def test_service_commands_without_a_service_manager_point_at_no_load(
        short_dir: Path) -> None:
    bare = short_dir / "bin"
    bare.mkdir()  # a PATH with no systemctl or launchctl on it
    env = {"PATH": str(bare), "HOME": str(short_dir / "home"),
           "XDG_CONFIG_HOME": str(short_dir / "home" / ".cfg")}
    for platform, path in (("linux", short_dir / "home" / ".cfg" / "systemd" / "user"
                            / "kvkeeper.service"),
                           ("macos", short_dir / "home" / "Library" / "LaunchAgents"
                            / "io.github.kvkeeper.daemon.plist")):
        r = cli("install-service", "--platform", platform, env=env)
        assert r.returncode == 1 and "--no-load" in r.stderr, r.stderr
        assert path.exists()  # written; only loading it failed
        r = cli("uninstall-service", "--platform", platform, env=env)
        assert r.returncode == 1, r.stderr
        assert "--no-load" in r.stderr and str(path) in r.stderr, r.stderr
        assert path.exists()
        r = cli("uninstall-service", "--platform", platform, "--no-load", env=env)
        assert r.returncode == 0 and not path.exists(), r.stderr
        # Written only: what starts it is said, and for systemd that the unit
        # is not enabled (it would not start at the next login).
        r = cli("install-service", "--platform", platform, "--no-load", env=env)
        assert r.returncode == 0 and path.exists(), r.stderr
        said = " ".join(r.stdout.split())
        if platform == "linux":
            assert "systemctl --user enable kvkeeper.service" in said, said
            assert "nor at login until enabled" in said, said
            # Installed again over an enabled unit: it is not said to be off.
            wants = path.parent / "default.target.wants"
            wants.mkdir()
            (wants / path.name).symlink_to(path)
            r = cli("install-service", "--platform", platform, "--no-load", env=env)
            said = " ".join(r.stdout.split())
            assert r.returncode == 0 and "not restarted" in said and "enabled" not in said, said
            (wants / path.name).unlink()
            # systemd goes by the link's name, wherever it leads: enabled;
            # a link to /dev/null masks it.
            # A copy, not a link, is ignored.
            (short_dir / "empty").write_bytes(b"")
            for target, enabled in (("/nonexistent/kvkeeper.service", True),
                                    (os.devnull, False), (str(short_dir / "empty"), False),
                                    (None, False)):
                if target is None:
                    shutil.copy(path, wants / path.name)
                else:
                    (wants / path.name).symlink_to(target)
                r = cli("install-service", "--platform", platform, "--no-load", env=env)
                said = " ".join(r.stdout.split())
                assert ("not restarted" in said) is enabled, said
                assert ("nor at login until enabled" in said) is not enabled, said
                (wants / path.name).unlink()
        else:
            # An agent still loaded from an earlier install is booted out
            # first: launchd refuses to bootstrap a label that is loaded.
            assert "starts at the next login" in said, said
            assert "launchctl bootout gui/" in said and "; launchctl bootstrap gui/" in said, said
        r = cli("uninstall-service", "--platform", platform, "--no-load", env=env)
        assert r.returncode == 0 and not path.exists(), r.stderr


_FAKE_MANAGERS = {
    # launchd as it answers: bootstrap of a loaded label fails (5), bootout of
    # one not loaded fails (3). The running daemon's pid is in $MAINPID's file.
    # With $SETTLE, bootout returns while the label stays registered (print
    # shows it, bootstrap fails 5) for $SETTLE seconds, as launchd's does;
    # with $LATE, print no longer shows it then, but bootstrap still fails.
    "launchctl": """#!/bin/sh
echo "launchctl $*" >> "$CALLS"
if [ -n "$NOGUI" ]; then  # ssh into a Mac nobody is logged into at its screen
  echo "Bootstrap failed: 125: Domain does not support specified action" >&2; exit 125
fi
case "$1" in
  bootstrap) if [ -e "$STATE" ] || [ -e "$STATE.late" ]; then
               echo "Bootstrap failed: 5: Input/output error" >&2; exit 5; fi
             touch "$STATE" ;;
  bootout) [ -e "$STATE" ] || exit 3; [ -n "$BOOTOUT_RC" ] && exit "$BOOTOUT_RC"
           rm -f "$MAINPID"
           if [ -n "$SETTLE" ]; then (sleep "$SETTLE"; rm -f "$STATE") >/dev/null 2>&1 &
             if [ -n "$RC36" ]; then exit 36; fi  # "Operation now in progress": still stopping
           elif [ -n "$LATE" ]; then rm "$STATE"; touch "$STATE.late"
             (sleep "$LATE"; rm -f "$STATE.late") >/dev/null 2>&1 &
           else rm "$STATE"; fi ;;
  print) [ -e "$STATE" ] || exit 113; echo "{"; echo "	state = running";
         [ -e "$MAINPID" ] && echo "	pid = $(cat "$MAINPID")"; echo "}" ;;
esac
""",
    "systemctl": """#!/bin/sh
echo "systemctl $*" >> "$CALLS"
case "$2" in
  show) if [ -e "$MAINPID" ]; then echo "MainPID=$(cat "$MAINPID")"; else echo MainPID=0; fi ;;
  stop) rm -f "$MAINPID" ;;
esac
""",
}


def test_install_service_again_replaces_the_running_service(short_dir: Path) -> None:
    """A second install-service (new settings) failed on macOS (launchd
    refuses to bootstrap a loaded label) and, on Linux, left the daemon
    running with its old command line (enable --now starts, never restarts).
    The service managers are stand-ins that answer as the real ones do."""
    bin_dir = short_dir / "bin"
    bin_dir.mkdir()
    for name, script in _FAKE_MANAGERS.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    calls = short_dir / "calls"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(short_dir / "home"),
           "XDG_CONFIG_HOME": str(short_dir / "home" / ".cfg"), "CALLS": str(calls),
           "STATE": str(short_dir / "loaded"), "MAINPID": str(short_dir / "mainpid")}
    for platform in ("macos", "linux"):
        for timeout in ("30", "40"):
            r = cli("install-service", "--platform", platform, "--drain-timeout", timeout,
                    env=env)
            assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    # (print: whether launchd still has the label, after a bootout that
    # stopped one, see below.)
    assert [x.split()[1] for x in lines if x.startswith("launchctl")] == [
        "bootout", "bootstrap", "bootout", "print", "bootstrap"]
    # Stopped before the daemon-reload: under the stop timeout of the unit
    # that started it (the drain's), not the new one's.
    assert [x.split()[2] for x in lines if x.startswith("systemctl")] == [
        "stop", "daemon-reload", "enable", "restart"] * 2


@pytest.mark.parametrize("lingers", ["SETTLE", "LATE", "RC36"])
def test_install_service_again_waits_for_launchd_to_let_go(short_dir: Path,
                                                          lingers: str) -> None:
    """launchd's bootout returns while the label is still registered, and a
    bootstrap fails (5, "Input/output error") for a few seconds more: a
    second install-service booted the running agent out, failed to
    bootstrap the new one, and left no daemon running. It now waits while
    launchctl print still shows the label, and tries a bootstrap answering
    5 again. (launchctl is a stand-in answering as launchd was reported to.)"""
    env = {**_fake_managers(short_dir), lingers: "1"}
    if lingers == "RC36":  # bootout answering 36 while the daemon still drains
        env["SETTLE"] = "1"
    state = Path(env["STATE"])
    for timeout in ("30", "40"):
        r = cli("install-service", "--platform", "macos", "--drain-timeout", timeout, env=env,
                timeout=60)
        assert r.returncode == 0, r.stderr
        assert state.exists(), "the agent is not loaded"
    calls = [x.split()[1] for x in Path(env["CALLS"]).read_text().splitlines()]
    # The second install: booted out, then the new agent bootstrapped once
    # launchd let go of the label.
    second = calls[calls.index("bootstrap") + 1:]
    assert second[0] == "bootout" and second[-1] == "bootstrap", second
    assert second.count("bootstrap" if lingers == "LATE" else "print") > 1, second
    if lingers == "SETTLE":
        # The command --no-load prints to start it, pasted into a shell
        # while the agent runs: it was bootout then bootstrap, which failed.
        r = cli("install-service", "--platform", "macos", "--no-load", env=env)
        said = r.stdout.splitlines()
        start = said[said.index(next(x for x in said if "To start it now:" in x)) + 1:]
        done = subprocess.run(["sh", "-c", " ".join(start)], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and state.exists(), (start, done.stderr)


def test_install_service_says_why_launchd_kept_refusing(short_dir: Path) -> None:
    """A bootstrap answering 5 for longer than install-service tries again:
    the message says what launchd's "Input/output error" means here, and that
    the agent installed before was stopped."""
    env = _fake_managers(short_dir)
    assert cli("install-service", "--platform", "macos", env=env).returncode == 0
    env["LATE"] = "40"  # longer than the retries
    began = time.monotonic()
    r = cli("install-service", "--platform", "macos", env=env, timeout=90)
    assert r.returncode == 1, r.stderr
    said = " ".join(r.stderr.split())
    assert "failed (5): Bootstrap failed: 5: Input/output error" in said, said
    assert "for some seconds after a bootout of the agent" in said, said
    assert f"launchctl enable gui/{os.getuid()}/io.github.kvkeeper.daemon" in said, said
    assert 15 < time.monotonic() - began < 60
    calls = [x.split()[1] for x in Path(env["CALLS"]).read_text().splitlines()]
    assert calls.count("bootstrap") > 10, calls
    # With nothing booted out (an agent launchd refuses, say one turned off
    # with launchctl disable), no wait and no retries: 20 s for nothing.
    Path(env["CALLS"]).unlink()
    began = time.monotonic()
    r = cli("install-service", "--platform", "macos", env=env, timeout=90)
    assert r.returncode == 1 and "launchctl enable gui/" in r.stderr, r.stderr
    assert time.monotonic() - began < 10
    assert [x.split()[1] for x in Path(env["CALLS"]).read_text().splitlines()] == [
        "bootout", "bootstrap"]


def test_install_service_bounds_its_wait_after_a_failed_bootout(short_dir: Path) -> None:
    """A bootout failing otherwise (1: the agent left loaded) made the
    install wait the whole stop budget for the label to go (111 s here, an
    hour with --drain-timeout 3600) and then say nothing of the bootout."""
    env = _fake_managers(short_dir)
    assert cli("install-service", "--platform", "macos", env=env).returncode == 0
    env["BOOTOUT_RC"] = "1"
    began = time.monotonic()
    r = cli("install-service", "--platform", "macos", "--drain-timeout", "3600", env=env,
            timeout=120)
    assert r.returncode == 1, r.stderr
    said = " ".join(r.stderr.split())
    assert f"(before it, launchctl bootout gui/{os.getuid()}/io.github.kvkeeper.daemon " \
        "answered 1)" in said, said
    assert time.monotonic() - began < 60


def _fake_managers(short_dir: Path) -> dict[str, str]:
    bin_dir = short_dir / "bin"
    bin_dir.mkdir()
    for name, script in _FAKE_MANAGERS.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(short_dir / "home"),
            "XDG_CONFIG_HOME": str(short_dir / "home" / ".cfg"),
            "CALLS": str(short_dir / "calls"), "STATE": str(short_dir / "loaded"),
            "MAINPID": str(short_dir / "mainpid")}


@pytest.mark.parametrize("who", ["a user", "root"])
def test_a_launch_agent_over_ssh_alone_is_written_and_said_when_it_starts(
        short_dir: Path, who: str) -> None:
    """Over ssh into a Mac nobody is logged into at its screen there is no
    gui/<uid> domain: launchctl answers 125 to everything. install-service
    said only launchctl's "Domain does not support specified action", and
    uninstall-service refused to remove the file ('stopping the service
    failed'). For root (sudo keeps HOME: gui/0 is not the domain of the
    user's agent, which may run) 125 is still a failure, said as such.
    (launchctl is a stand-in answering as the real one does; "a user" runs
    the CLI as uid 12345.)"""
    need_linux_root()
    short_dir.chmod(0o711)  # for uid 12345 to pass through
    base = short_dir / "shared"
    base.mkdir()
    base.chmod(0o777)
    env = {**_fake_managers(base), "NOGUI": "1"}
    prefix: tuple[str, ...] = ()
    if who == "a user":
        prefix = ("setpriv", "--reuid", "12345", "--regid", "12345", "--clear-groups")
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        (base / "home").mkdir()
        (base / "home").chmod(0o777)
    plist = base / "home" / "Library" / "LaunchAgents" / "io.github.kvkeeper.daemon.plist"
    r = cli("install-service", "--platform", "macos", env=env, prefix=prefix)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Domain does not support specified action" in r.stderr and plist.exists()
    assert ("starts at this user's next login there" if who == "a user"
            else "as the user whose agent it is, not as root") in r.stderr, r.stderr
    r = cli("uninstall-service", "--platform", "macos", env=env, prefix=prefix)
    if who == "a user":
        assert r.returncode == 0, r.stdout + r.stderr
        assert "removed" in r.stdout and not plist.exists()
    else:
        assert r.returncode == 1 and plist.exists(), r.stdout + r.stderr
        assert "stopping the service failed" in r.stderr


@pytest.mark.parametrize("whose", ["the home", "its directory", "the home, not made yet"])
@pytest.mark.parametrize("platform", ["macos", "linux"])
def test_root_does_not_install_or_remove_another_users_service(
        short_dir: Path, platform: str, whose: str) -> None:
    """sudo keeps HOME: root wrote root-owned files and directories (the
    plist and its log directory; ~/.config/systemd/user) into the user's
    home, and launchctl's gui/0 is not the domain the user's agent runs in.
    Refused before anything is touched, wherever the user's own directory
    begins; --print still shows the file. (The service managers are
    stand-ins.)"""
    need_linux_root()
    env = _fake_managers(short_dir)
    home = Path(env["HOME"])
    if platform == "macos":
        service_dir = home / "Library" / "LaunchAgents"
        name = "io.github.kvkeeper.daemon.plist"
    else:
        service_dir = home / ".cfg" / "systemd" / "user"
        name = "kvkeeper.service"
    service_dir.mkdir(parents=True)
    (service_dir / name).write_text("the user's own")
    users = {"the home": home, "its directory": service_dir,
             "the home, not made yet": short_dir}[whose]
    if whose == "the home, not made yet":  # HOME names a directory inside another's
        env["HOME"] = str(short_dir / "not-yet")
        env["XDG_CONFIG_HOME"] = str(short_dir / "not-yet" / ".cfg")
    os.chown(users, 12345, 12345)
    try:
        for argv in (["install-service"], ["install-service", "--no-load"],
                     ["uninstall-service"]):
            usage_error(cli(*argv, "--platform", platform, env=env),
                        f"{users} is uid 12345's, another user's", "not as root")
        r = cli("install-service", "--print", "--platform", platform, env=env)
        assert r.returncode == 0, r.stderr
    finally:
        os.chown(users, 0, 0)
    assert (service_dir / name).read_text() == "the user's own"
    assert not Path(env["CALLS"]).exists() and not (short_dir / "not-yet").exists()
    assert not (home / "Library" / "Logs").exists()


def test_service_places_root_cannot_use_are_said_plainly(short_dir: Path) -> None:
    """As root: a HOME a plist cannot carry (a control character) ended in
    plistlib's traceback before the refusal's own check; a place under a
    regular file was called "another user's"."""
    need_linux_root()
    env = _fake_managers(short_dir)
    odd = {**env, "HOME": str(short_dir / "a\x01b")}
    for argv in (["install-service", "--no-load"], ["uninstall-service"]):
        usage_error(cli(*argv, "--platform", "macos", env=odd),
                    "cannot go into it")
    (short_dir / "afile").write_text("")
    under_a_file = {**env, "XDG_CONFIG_HOME": str(short_dir / "afile" / "cfg")}
    usage_error(cli("install-service", "--no-load", "--platform", "linux", env=under_a_file),
                f"cannot look at {short_dir / 'afile' / 'cfg'}", "Not a directory")
    assert not Path(env["CALLS"]).exists()


def test_install_service_refuses_a_daemon_started_by_hand(short_dir: Path) -> None:
    """A daemon started by hand on the service's socket or root made the
    service exit 2 at every start (systemd gives up, launchd retries every
    10 s), and install-service said "started". It is refused before anything
    is written; the service's own daemon (the pid its manager names) is not.
    The service managers are stand-ins; the daemons are real."""
    env = _fake_managers(short_dir)
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    places = ("--root", str(root), "--socket", str(sock))
    unit = short_dir / "home" / ".cfg" / "systemd" / "user" / "kvkeeper.service"
    plist = short_dir / "home" / "Library" / "LaunchAgents" / "io.github.kvkeeper.daemon.plist"
    by_hand = serve_process(root, sock)
    try:
        for platform, path in (("linux", unit), ("macos", plist)):
            r = cli("install-service", "--platform", platform, *places, env=env)
            usage_error(r, f"the socket {sock} is held by another kvkeeper process (pid "
                        f"{by_hand.pid}", "which the service manager does not run",
                        f"kill -TERM {by_hand.pid}", "--no-load")
            assert not path.exists()
            # --no-load only writes the file: allowed.
            r = cli("install-service", "--platform", platform, "--no-load", *places, env=env)
            assert r.returncode == 0 and path.exists(), r.stderr
            path.unlink()
        # The same root on another socket, given relative: the root is named, whole.
        r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "install-service",
                            "--platform", "linux", "--root", "root", "--socket",
                            str(short_dir / "run" / "other.sock")], cwd=short_dir,
                           capture_output=True, text=True, timeout=WAIT,
                           env={**{k: v for k, v in os.environ.items()
                                   if not k.startswith("KVKEEPER_")}, **env})
        usage_error(r, f"the root {root} is held", f"pid {by_hand.pid}")
        # No service manager to ask: it says so rather than that it asked.
        no_manager = dict(env, PATH=str(short_dir / "home"))
        r = cli("install-service", "--platform", "linux", *places, env=no_manager)
        usage_error(r, "could not be asked whether it runs it", "systemctl not found")
        # The service's own daemon: installed again (new settings), restarted.
        (short_dir / "mainpid").write_text(f"{by_hand.pid}\n")
        (short_dir / "loaded").touch()
        for platform, path in (("linux", unit), ("macos", plist)):
            r = cli("install-service", "--platform", platform, *places, env=env)
            assert r.returncode == 0 and path.exists(), r.stderr
            # The stand-ins' bootout and stop forgot them (the daemon runs on).
            (short_dir / "loaded").touch()
            (short_dir / "mainpid").write_text(f"{by_hand.pid}\n")
    finally:
        assert stop_process(by_hand) == 0
    # Nothing holds them any more: installed. Looking made nothing (a root
    # not made yet stays so, for the daemon to make).
    (short_dir / "mainpid").unlink(missing_ok=True)
    r = cli("install-service", "--platform", "linux", *places, env=env)
    assert r.returncode == 0, r.stderr
    r = cli("install-service", "--platform", "linux", "--root", str(short_dir / "new-root"),
            "--socket", str(short_dir / "new-run" / "kv.sock"), env=env)
    assert r.returncode == 0, r.stderr
    assert not (short_dir / "new-root").exists() and not (short_dir / "new-run").exists()


def test_a_daemon_starting_while_install_service_looks_at_its_lock_starts(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """install-service's look at a lock takes it, shared, for microseconds:
    a daemon taking it then exited 2 ("another kvkeeper daemon is running",
    naming whoever held it last). It now tries again for 50 ms. (The look
    is stretched here until the daemon's first wait: a timer of 20 ms fired
    after the 50 ms on a loaded machine.)"""
    import fcntl
    import time

    from kvkeeper.daemon.app import AlreadyRunning, _Lock

    path = short_dir / "kv.lock"
    path.write_text("pid 1, root /gone, socket /gone.sock")
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    waits: list[float] = []
    real_sleep = time.sleep

    def look_ends(seconds: float) -> None:
        if not waits:
            os.close(fd)
        waits.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", look_ends)
    lock = _Lock(path, "pid 2")
    monkeypatch.undo()
    assert waits == [0.01]
    assert path.read_text() == "pid 2"
    lock.release()
    # Held for good, it is refused as before.
    held = _Lock(path, "pid 3")
    with pytest.raises(AlreadyRunning, match="pid 3"):
        _Lock(path, "pid 4")
    held.release()


def test_uninstall_service_stops_a_service_whose_file_was_deleted(short_dir: Path) -> None:
    """A unit or agent file deleted by hand leaves the service loaded and its
    daemon running: uninstall-service said "no service file" and stopped
    nothing. It now stops it by name, and says so."""
    env = _fake_managers(short_dir)
    calls = short_dir / "calls"
    for platform, stop in (("linux", "systemctl --user stop kvkeeper.service"),
                           ("macos", f"launchctl bootout gui/{os.getuid()}/"
                                     f"io.github.kvkeeper.daemon")):
        (short_dir / "mainpid").write_text("4242\n")
        (short_dir / "loaded").touch()
        r = cli("uninstall-service", "--platform", platform, env=env)
        assert r.returncode == 0, r.stderr
        assert "no service file at" in r.stdout and "stopped the service" in r.stdout, r.stdout
        assert "pid 4242" in r.stdout
        assert stop in calls.read_text().splitlines()
        calls.unlink()
    # A stop that fails (the service manager still names its pid): exit 1.
    (short_dir / "mainpid").write_text("4242\n")
    (short_dir / "bin" / "systemctl").write_text(
        _FAKE_MANAGERS["systemctl"].replace('case "$2" in', 'case "$2" in\n  stop) exit 1 ;;'))
    r = cli("uninstall-service", "--platform", "linux", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "still runs without it (pid 4242): stopping it failed" in r.stderr, r.stderr
    # Nothing running, no file: says only that.
    (short_dir / "mainpid").unlink()
    r = cli("uninstall-service", "--platform", "linux", env=env)
    assert r.returncode == 0 and "stopped" not in r.stdout, r.stdout


def test_uninstall_service_removes_the_enable_link_a_deleted_unit_left(
        short_dir: Path) -> None:
    """systemctl enable links default.target.wants/kvkeeper.service to the
    unit file; before systemd 257, disable refuses a unit whose file was
    deleted, and the link stayed, pointing at nothing. A link that leads to
    a file is not kvkeeper's to remove."""
    env = _fake_managers(short_dir)
    unit_dir = short_dir / "home" / ".cfg" / "systemd" / "user"
    wants = unit_dir / "default.target.wants"
    wants.mkdir(parents=True)
    link = wants / "kvkeeper.service"
    link.symlink_to(unit_dir / "kvkeeper.service")  # as systemctl enable makes it
    # Gone before systemd reloads (it reads the links then): the stand-in
    # notes whether the link was there at daemon-reload.
    systemctl = short_dir / "bin" / "systemctl"
    systemctl.write_text(systemctl.read_text().replace(
        'case "$2" in', f'case "$2" in\n  daemon-reload) if [ -L "{link}" ]; then echo LINKED >> "$CALLS"; fi ;;'))
    r = cli("uninstall-service", "--platform", "linux", env=env)
    assert r.returncode == 0, r.stderr
    assert not link.is_symlink()
    assert "systemctl --user daemon-reload" in Path(env["CALLS"]).read_text()
    assert "LINKED" not in Path(env["CALLS"]).read_text()
    # Installed and uninstalled with the link in place: it goes with the file.
    assert cli("install-service", "--platform", "linux", env=env).returncode == 0
    link.symlink_to(unit_dir / "kvkeeper.service")
    assert cli("uninstall-service", "--platform", "linux", env=env).returncode == 0
    assert not link.is_symlink() and not (unit_dir / "kvkeeper.service").exists()
    # Someone else's file under that name: kept.
    other = short_dir / "elsewhere.service"
    other.write_text("[Service]\n")
    link.symlink_to(other)
    assert cli("uninstall-service", "--platform", "linux", env=env).returncode == 0
    assert link.is_symlink() and other.exists()


def test_uninstall_service_of_an_agent_not_loaded_removes_it(short_dir: Path) -> None:
    """A LaunchAgent written with --no-load (or stopped by hand) is not
    loaded: launchctl bootout says so (3) and uninstall-service used to stop
    there, leaving the file. Other failures still keep the file."""
    env = _fake_managers(short_dir)
    plist = short_dir / "home" / "Library" / "LaunchAgents" / "io.github.kvkeeper.daemon.plist"
    r = cli("install-service", "--platform", "macos", "--no-load", env=env)
    assert r.returncode == 0 and plist.exists(), r.stderr
    r = cli("uninstall-service", "--platform", "macos", env=env)
    assert r.returncode == 0, r.stderr
    assert not plist.exists()
    # Loaded, and bootout fails for another reason: the file stays.
    r = cli("install-service", "--platform", "macos", env=env)
    assert r.returncode == 0 and plist.exists(), r.stderr
    (short_dir / "bin" / "launchctl").write_text("#!/bin/sh\necho 'Boot-out failed: 5: "
                                                  "Input/output error' >&2\nexit 5\n")
    r = cli("uninstall-service", "--platform", "macos", env=env)
    assert r.returncode == 1 and "Input/output error" in r.stderr, r.stderr
    assert plist.exists()


def test_stopping_the_service_waits_as_long_as_its_stop_timeout(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service manager waits up to the installed file's stop timeout
    (drain timeout + 10 s) for the daemon to exit before it answers; a fixed
    60 s wait gave up on a longer drain and left the file. Here the margin
    over the stop timeout is cut to 0 and the daemon's stop takes 2 s."""
    from kvkeeper import service

    env = _fake_managers(short_dir)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("CALLS", env["CALLS"])
    monkeypatch.setattr(service, "COMMAND_SECONDS", 0)
    (short_dir / "bin" / "systemctl").write_text("#!/bin/sh\nsleep 2\n")
    sf = service.systemd([], 20.0, short_dir / "cfg")
    sf.path.parent.mkdir(parents=True)
    for stop_timeout, done in ((1, False), (5, True)):
        # As installed earlier (by hand, or by an older version): its own value counts.
        sf.path.write_text(f"[Service]\nTimeoutStopSec={stop_timeout}\n")
        if done:
            assert service.uninstall(sf)
            assert not sf.path.exists()
        else:
            with pytest.raises(service.ServiceError, match="did not finish within 1 s"):
                service.uninstall(sf)
            assert sf.path.exists()


def test_the_service_runs_from_a_directory_whose_files_cannot_replace_its_modules(
        short_dir: Path) -> None:
    """The service runs `python -m kvkeeper.cli`, which puts its working
    directory first on sys.path, and a systemd user service starts in the
    home directory unless told otherwise: a ~/msgspec.py replaced the real
    module and the daemon failed at every start. The commands are run as the
    service managers would run them, from their WorkingDirectory (the home
    directory by default, as systemd does for a user service)."""
    home = short_dir / "home"
    home.mkdir()
    (home / "msgspec.py").write_text('raise SystemExit("a module of the home directory ran")\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVKEEPER_")},
           "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    places = ("--root", str(short_dir / "root"), "--socket", str(short_dir / "s.sock"))
    r = cli("install-service", "--print", "--platform", "linux", *places, env=env)
    assert r.returncode == 0, r.stderr
    unit = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    # (The arguments here need none of systemd's escapes.)
    command = shlex.split(unit["ExecStart"])
    plist = plistlib.loads(cli("install-service", "--print", "--platform", "macos", *places,
                               env=env).stdout.encode())
    for argv, cwd in ((command, unit.get("WorkingDirectory", str(home))),
                      (plist["ProgramArguments"], plist.get("WorkingDirectory", str(home)))):
        r = subprocess.run([*argv, "--print-config"], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=WAIT)
        assert r.returncode == 0 and "home directory ran" not in r.stderr, r.stderr
        assert str(short_dir / "root") in r.stdout
    # Exit 2 (another daemon holds the root, a setting refused) is not worth a restart.
    assert unit["RestartPreventExitStatus"] == "2"


def test_a_systemd_unit_for_an_interpreter_path_with_dollar_and_percent(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd expands % specifiers everywhere in ExecStart but $VARIABLES
    only in the arguments: the command path's "$" must stay single (doubled,
    `systemd-analyze verify` found no such executable)."""
    from kvkeeper import service

    python = "/opt/p$HOME%i z/bin/python"
    monkeypatch.setattr(sys, "executable", python)
    sf = service.systemd(["--socket", "/tmp/a$b%c"], 20.0, short_dir / "cfg")
    (exec_start,) = [x for x in sf.content.decode().splitlines() if x.startswith("ExecStart=")]
    assert exec_start.startswith('ExecStart="/opt/p$HOME%%i z/bin/python" -m kvkeeper.cli ')
    assert exec_start.endswith(' --socket "/tmp/a$$b%%c"')


def test_a_launch_agent_written_without_loading_has_its_log_directory(
        short_dir: Path) -> None:
    """launchd opens StandardOutPath when it loads the agent (at the next
    login, after --no-load): the directory was made only by the load step."""
    env = {"HOME": str(short_dir / "home")}
    r = cli("install-service", "--platform", "macos", "--no-load", env=env)
    assert r.returncode == 0, r.stderr
    plist = plistlib.loads((short_dir / "home" / "Library" / "LaunchAgents"
                            / "io.github.kvkeeper.daemon.plist").read_bytes())
    assert Path(plist["StandardOutPath"]).parent.is_dir()


def test_uninstall_service_has_systemd_forget_the_unit(short_dir: Path) -> None:
    """After the unit file is removed, systemd keeps the unit it loaded
    until a daemon-reload."""
    env = _fake_managers(short_dir)
    assert cli("install-service", "--platform", "linux", env=env).returncode == 0
    Path(env["CALLS"]).unlink()
    r = cli("uninstall-service", "--platform", "linux", env=env)
    assert r.returncode == 0, r.stderr
    assert [x.split()[2] for x in Path(env["CALLS"]).read_text().splitlines()] == [
        "disable", "daemon-reload"]


# ------------------------------------------------------------------ 7. export is 0600


def test_export_writes_a_private_file(client: Client, daemon: RunningDaemon,
                                      short_dir: Path) -> None:
    _save(client, "m1", "a")
    sock = str(daemon.socket)
    out = short_dir / "new.safetensors"
    r = cli("export", "--socket", sock, "m1", "a", str(out), umask=0o022)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    # Over an existing, readable file: the new one is private too.
    old = short_dir / "old.safetensors"
    old.write_bytes(b"old")
    os.chmod(old, 0o644)
    r = cli("export", "--socket", sock, "m1", "a", str(old), umask=0o022)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o600
    assert load_prompt_cache(str(old))[0].state[0].shape == (1, 2, 5, 8)
    assert not [p for p in short_dir.iterdir() if ".tmp" in p.name]
    assert "0600" in cli("export", "--help").stdout


def test_every_setting_is_a_serve_flag(short_dir: Path) -> None:
    """Each setting of ``kvkeeper.settings`` can be given as a flag of serve
    (and of install-service, which passes them on): the effective settings
    say the flag gave every one."""
    from kvkeeper.settings import SETTINGS

    sample = {"path": str(short_dir / "p"), "socket": str(short_dir / "s"), "size": "1G",
              "seconds": "3", "text": None}
    args: list[str] = []
    for s in SETTINGS:
        value = sample[s.kind] or {"cpu_policy": "normal", "log_level": "debug"}[s.name]
        args += [f"--{s.name.replace('_', '-')}", value]
    r = cli("serve", *args, "--print-config")
    assert r.returncode == 0, r.stderr
    sources = {ln.split()[0]: ln.split()[-1] for ln in r.stdout.splitlines() if ln.strip()}
    assert sources == {s.name: f"--{s.name.replace('_', '-')})" for s in SETTINGS}
    r = cli("install-service", "--print", "--platform", "linux", *args)
    assert r.returncode == 0, r.stderr
    for s in SETTINGS:
        assert f"--{s.name.replace('_', '-')}" in r.stdout, s.name


def test_a_pending_budget_of_zero_is_refused(short_dir: Path) -> None:
    """--max-pending-bytes 0 would start a daemon that refuses every save (as
    too large); --max-disk-bytes 0 means no limit, so a user may try it."""
    sock = short_dir / "run" / "k.sock"
    r = cli("serve", "--root", str(short_dir / "root"), "--socket", str(sock),
            "--max-pending-bytes", "0", timeout=15)
    usage_error(r, "max_pending_bytes", "more than 0")
    assert not sock.exists()
    usage_error(cli("serve", "--print-config", env={"KVKEEPER_MAX_PENDING_BYTES": "0"}),
                "KVKEEPER_MAX_PENDING_BYTES", "more than 0")
    from kvkeeper.daemon.app import Daemon, DaemonConfig

    with pytest.raises(ValueError, match="max_pending_bytes"):
        Daemon(DaemonConfig(root=short_dir / "root", socket=sock, max_pending_bytes=0))


def test_budgets_no_store_can_meet_are_refused(short_dir: Path) -> None:
    """--max-pending-bytes 100 started a daemon whose writer could take a
    75-byte save at most (every save dropped as too large); --min-free-bytes
    over the file system's size evicted every entry at start, then warned."""
    root, sock = short_dir / "root", short_dir / "run" / "k.sock"
    rd = start_daemon(root, sock)
    with Client(rd.socket, timeout=WAIT) as kv:
        _save(kv, "m1", "a")
    rd.stop()
    entry = next((root / "sessions").rglob("*.safetensors"))
    usage_error(cli("serve", "--root", str(root), "--socket", str(sock),
                    "--max-pending-bytes", "100", timeout=15), "max_pending_bytes", "at least 1M")
    r = cli("serve", "--root", str(root), "--socket", str(sock), "--min-free-bytes", "100000T",
            timeout=15)
    assert r.returncode == 2 and "min_free_bytes" in r.stderr, r.stderr
    assert "whole file system" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert entry.exists() and not sock.exists()


def test_an_empty_root_is_refused(short_dir: Path) -> None:
    # It meant the current directory ("root ." in --print-config).
    cfg = short_dir / "c.toml"
    cfg.write_text('root = ""\n')
    for args in (["serve", "--root", "", "--print-config"],
                 ["serve", "--config", str(cfg), "--print-config"],
                 ["verify", "--root", ""]):
        r = cli(*args)
        assert r.returncode == 2 and "empty" in r.stderr, (args, r.stderr)


def test_a_size_in_fractions_of_a_byte_is_refused(short_dir: Path) -> None:
    """"1.5" as a disk budget was cut to 1 byte (every entry evicted at
    start) and "0.5" to 0 (no budget at all): a unit was surely missing. A
    size without a unit is a whole number of bytes; with one, it is rounded
    down to whole bytes."""
    r = cli("serve", "--max-disk-bytes", "1.5", "--print-config")
    assert r.returncode == 2 and "whole number of bytes" in r.stderr and "1.5G" in r.stderr
    usage_error(cli("serve", "--print-config", env={"KVKEEPER_MAX_DISK_BYTES": "0.5"}),
                "KVKEEPER_MAX_DISK_BYTES", "whole number of bytes")
    cfg = short_dir / "config.toml"
    cfg.write_text("min_free_bytes = 1.5\n")
    usage_error(cli("serve", "--config", str(cfg), "--print-config"),
                "min_free_bytes", "whole number of bytes")
    r = cli("serve", "--max-disk-bytes", "1.5G", "--min-free-bytes", "0.5K", "--print-config")
    assert r.returncode == 0, r.stderr
    assert str(3 * 2**29) in r.stdout and " 512 " in r.stdout.replace("\n", " "), r.stdout


@pytest.mark.parametrize(("how", "value"), [
    ("flag", "2.0"), ("flag", "1e3"), ("env", "50.0"), ("toml", "50.0"), ("toml", "1e3"),
    ("flag", "50"), ("env", "1000"), ("toml", "50"), ("flag", "0.5K"), ("toml", '"999K"'),
])
def test_a_disk_budget_that_holds_no_cache_is_refused(how: str, value: str,
                                                      short_dir: Path) -> None:
    """A disk budget of 2 bytes (from "2.0", or 50 for 50G) evicted every
    entry at start. Bytes written as a float, and budgets under 1M other
    than 0 (none), are refused; the store is left as it was."""
    root = short_dir / "root"
    sock = short_dir / "run" / "k.sock"
    cfg = short_dir / "c.toml"
    cfg.write_text(f"max_disk_bytes = {value}\n" if how == "toml" else "")
    argv = ["--max-disk-bytes", value] if how == "flag" else []
    env = {"KVKEEPER_MAX_DISK_BYTES": value} if how == "env" else {}
    root.mkdir(mode=0o700)
    kept = root / "kept"
    kept.write_text("x")
    r = cli("serve", "--root", str(root), "--socket", str(sock), "--config", str(cfg),
            "--min-free-bytes", "0", *argv, env=env, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "max_disk_bytes" in r.stderr or "--max-disk-bytes" in r.stderr, r.stderr
    assert "whole number of bytes" in r.stderr or "at least 1M" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and kept.exists() and not sock.exists()
    ok = cli("serve", "--config", str(cfg), "--print-config", "--max-disk-bytes", "1M")
    assert ok.returncode == 0 and "1048576" in ok.stdout, ok.stderr


def test_a_socket_given_as_the_endpoint_kvkeeper_prints(
    daemon: RunningDaemon, short_dir: Path
) -> None:
    """kvkeeper's messages name the socket as ``ipc://<path>``; pasted back
    into --socket, $KVKEEPER_SOCKET or Client(socket=...), it reaches the
    daemon. Another transport is refused with a message that says why."""
    ep = f"ipc://{daemon.socket}"
    r = cli("stats", "--socket", ep)
    assert r.returncode == 0, r.stderr  # before: "no kvkeeper daemon at ipc:/..."
    assert cli("ls", env={"KVKEEPER_SOCKET": ep}).returncode == 0
    with Client(ep, timeout=WAIT) as kv:
        assert kv.connected and kv.save("m", "c", small_cache(), [1, 2, 3, 4, 5])
        assert kv.flush(timeout=WAIT) is True
    for args in (("stats", "--socket", "tcp://127.0.0.1:5555"),
                 ("serve", "--socket", "tcp://127.0.0.1:5555", "--print-config")):
        r = cli(*args)  # argparse's usage line, then its error
        assert r.returncode == 2 and "local socket only" in r.stderr, r.stderr
    usage_error(cli("serve", "--print-config", env={"KVKEEPER_SOCKET": "tcp://h:1"}),
                "KVKEEPER_SOCKET", "local socket only")
    with pytest.raises(ValueError, match="local socket only"):
        Client("tcp://127.0.0.1:5555")
    # A client given no socket reads $KVKEEPER_SOCKET: it refuses one there
    # too (before: it looked for a daemon at the path "tcp:/h:1", exit 3).
    for args in (("stats",), ("ls", "--all")):
        usage_error(cli(*args, env={"KVKEEPER_SOCKET": "tcp://h:1"}),
                    "KVKEEPER_SOCKET", "local socket only")
    r = cli("demo", "--tokens", "2", "--prompt-tokens", "64",
            env={"KVKEEPER_SOCKET": "tcp://h:1"}, timeout=DEMO_TIMEOUT)
    assert r.returncode == 2 and "KVKEEPER_SOCKET" in r.stderr, r.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVKEEPER_SOCKET", "tcp://h:1")
        with pytest.raises(ValueError, match="KVKEEPER_SOCKET.*local socket only"):
            Client()
    # The demo's --socket too (before: "no kvkeeper daemon at ipc:/...", exit 3).
    r = cli("demo", "--socket", ep, "--tokens", "2", "--prompt-tokens", "64",
            timeout=DEMO_TIMEOUT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])


def test_import_keeps_a_files_own_model_and_rm_of_no_entries_fails(
    daemon: RunningDaemon, short_dir: Path
) -> None:
    """import --model does not relabel a file that records another model (a
    cache is only restored for the model that made it); rm --model with a
    model that has no entries (a typo) exits 1, as rm MODEL ID does."""
    sock = str(daemon.socket)
    with Client(daemon.socket, timeout=WAIT) as kv:
        _save(kv, "model-a", "conv", 1.0)
        out = short_dir / "a.safetensors"
        assert cli("export", "--socket", sock, "model-a", "conv", str(out)).returncode == 0
        r = cli("import", "--socket", sock, "--model", "model-b", str(out))
        assert r.returncode == 1 and "records model 'model-a'" in " ".join(r.stdout.split())
        assert {(e.model, e.cache_id) for e in kv.entries()} == {("model-a", "conv")}
        # Its own model, but the key is stored (and newer than the file by
        # now): not replaced without --replace.
        _save(kv, "model-a", "conv", 2.0)
        r = cli("import", "--socket", sock, str(out), "--json")
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "model-a / conv is already in the store (give --replace" in r.stdout
        stored = kv.load("model-a", "conv")
        assert stored is not None and stored.cache[0].keys[0, 0, 0, 0].item() == 2.0
        r = cli("import", "--socket", sock, str(out), "--replace", "--json")
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert json.loads(r.stdout)["imported"][0]["replaced"] is True
        stored = kv.load("model-a", "conv")
        assert stored is not None and stored.cache[0].keys[0, 0, 0, 0].item() == 1.0
        r = cli("import", "--socket", sock, str(out), "--replace", "--id", "new")
        assert r.returncode == 0 and "replaced" not in r.stdout, (r.stdout, r.stderr)
    r = cli("rm", "--socket", sock, "--model", "model-aa")
    assert r.returncode == 1 and "kvkeeper: no entries of model model-aa" in r.stderr
    r = cli("rm", "--socket", sock, "--model", "model-a")
    assert r.returncode == 0 and "deleted 2 entries" in r.stdout


#: The CLI as an install without the mlx extra runs it: MLX, mlx-lm, mlx-vlm
#: and numpy (which only they bring) cannot be imported (the finder refuses
#: them, as a missing package would; nothing of MLX is imitated).
_WITHOUT_MLX = """
import importlib.abc, sys

class NoMlx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("mlx", "mlx_lm", "mlx_vlm", "numpy"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMlx())
from kvkeeper.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_commands_that_only_talk_to_the_daemon_run_without_mlx(
    daemon: RunningDaemon, short_dir: Path
) -> None:
    """``pip install .`` (no mlx extra) brings the daemon only: stats, ls, rm, gc,
    verify and install-service work there (before: every one of them died
    importing MLX, with a traceback); import and export, which read and write
    caches through MLX, say what to install, exit 2."""
    with Client(daemon.socket, timeout=WAIT) as kv:
        assert kv.save("m", "c", small_cache(), [1, 2, 3, 4, 5])
        assert kv.flush(timeout=WAIT)
    sock = str(daemon.socket)

    def run(*args: str):  # type: ignore[no-untyped-def]
        return cli(*args, run=("-c", _WITHOUT_MLX))

    for args in (("stats", "--socket", sock), ("ls", "--socket", sock, "--json"),
                 ("gc", "--socket", sock), ("verify", "--socket", sock),
                 ("install-service", "--print", "--platform", "linux", "--socket", sock)):
        r = run(*args)
        assert r.returncode == 0, (args, r.stderr)
        assert "mlx" not in r.stderr.lower(), (args, r.stderr)
    assert [e["cache_id"] for e in json.loads(run("ls", "--socket", sock, "--json").stdout)] \
        == ["c"]
    for args in (("export", "--socket", sock, "m", "c", str(short_dir / "out.safetensors")),
                 ("import", "--socket", sock, str(short_dir / "out.safetensors"))):
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "needs the mlx extra" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("rm", "--socket", sock, "m", "c")
    assert r.returncode == 0, r.stderr
    assert run("ls", "--socket", sock, "--json").stdout.strip() == "[]"


def test_the_library_without_mlx_says_what_to_install(daemon: RunningDaemon) -> None:
    """Without the mlx extra, Client.save, Client.load and read_cache_file
    raise ModuleNotFoundError naming the extra (before: a bare "No module
    named 'mlx'"); the client still connects, and ping answers."""
    code = _WITHOUT_MLX.replace("from kvkeeper.cli import main\nsys.exit(main(sys.argv[1:]))", f"""
import kvkeeper
kv = kvkeeper.Client({str(daemon.socket)!r}, timeout=30)
print("pong", kv.ping().pid > 0)
for call in (lambda: kv.save("m", "c", [object()], [1]), lambda: kv.load("m", "c"),
             lambda: kvkeeper.read_cache_file("/nonexistent")):
    try:
        call()
    except ModuleNotFoundError as exc:
        print("raised:", exc)
kv.close()
""")
    assert "import kvkeeper" in code
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "pong True", r.stdout
    assert len(lines) == 4 and all(
        ln.startswith("raised: ") and "pip install -e '.[mlx]'" in ln for ln in lines[1:]), \
        r.stdout
    # And, for an environment that is not a checkout, the extra's packages by
    # name, as pyproject.toml gives them for this platform.
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    for req in project["project"]["optional-dependencies"]["mlx"]:
        spec, _, marker = (part.strip() for part in req.partition(";"))
        here = {"": True, "sys_platform == 'darwin'": sys.platform == "darwin",
                "sys_platform != 'darwin'": sys.platform != "darwin"}[marker]
        if here:
            assert all(f"'{spec}'" in ln for ln in lines[1:]), (spec, r.stdout)


def test_a_client_takes_its_socket_from_the_config_file_whatever_else_is_in_it(
    daemon: RunningDaemon, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config file names the socket; a bad value of another setting (in
    the file or the environment), or a setting this version does not know,
    is serve's to report, and the client still finds the daemon (before: it
    fell back to the default socket, "no daemon", exit 3). A file that does
    not parse, or a socket in it that cannot be used, is an error naming the
    file (exit 2), not a silent fallback."""
    cfg = short_dir / "cfg"
    (cfg / "kvkeeper").mkdir(parents=True)
    toml = cfg / "kvkeeper" / "config.toml"
    env = {"XDG_CONFIG_HOME": str(cfg)}
    good = f'socket = "{daemon.socket}"\n'
    for extra, extra_env in (("", {}), ('max_disk_bytes = "lots"\n', {}),
                             ("colour = 1\n", {}), ("", {"KVKEEPER_DRAIN_TIMEOUT": "20s"})):
        toml.write_text(good + extra)
        r = cli("stats", "--json", env={**env, **extra_env})
        assert r.returncode == 0, (extra, extra_env, r.stderr)
        assert json.loads(r.stdout)["max_pending_bytes"] > 0
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cfg))
    monkeypatch.delenv("KVKEEPER_SOCKET", raising=False)
    with Client(timeout=WAIT) as kv:  # the file still has an unknown setting
        assert kv.socket_path == daemon.socket and kv.connected
    for text, needle in (("socket = [", "config.toml"),
                         ('socket = "tcp://h:1"\n', "local socket only")):
        toml.write_text(text)
        usage_error(cli("ls", env=env), str(toml), needle)
        with pytest.raises(ValueError, match=needle):
            Client(timeout=WAIT)
        # Given the socket, a client has no use for the file.
        r = cli("stats", "--socket", str(daemon.socket), env=env)
        assert r.returncode == 0, r.stderr
        with Client(daemon.socket, timeout=WAIT) as kv:
            assert kv.connected


def test_names_are_printed_as_they_are(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """Models and ids are the user's text: brackets are not markup ("m[b]x"
    was listed as "mx", so `rm` of what ls showed missed), and a newline or
    ESC in an id is shown escaped, never sent to the terminal."""
    sock = str(daemon.socket)
    names = [("m[b]x", "arr[i]"), ("m[b]x", "[bold]rich[/bold]"), ("m[b]x", "two\nlines\x1b[2J")]
    for model, cache_id in names:
        assert client.save(model, cache_id, small_cache(), [1, 2, 3, 4, 5])
    assert client.flush(timeout=WAIT)
    listed = cli("ls", "--socket", sock, env={"COLUMNS": "200"}).stdout
    assert "m[b]x" in listed and "arr[i]" in listed and "[bold]rich[/bold]" in listed, listed
    assert "two\\nlines\\x1b[2J" in listed and "\x1b" not in listed, listed
    assert client.save("m[b]x", "back\\slash\n", small_cache(), [1])  # escaped whole
    assert client.flush(timeout=WAIT)
    assert "back\\\\slash\\n" in cli("ls", "--socket", sock, env={"COLUMNS": "200"}).stdout
    # Ids a space begins or ends looked like the bare one (rm of it missed),
    # and one with a newline like one with a backslash and an n; quoted,
    # one with a tab looked like one with a backslash and a t.
    for cache_id in ("sp", " sp", "sp ", '"sp"', "n\n", "n\\n", " t\t", " t\\t", '"q\\'):
        assert client.save("spaced", cache_id, small_cache(), [1])
    assert client.flush(timeout=WAIT)
    for env in ({"COLUMNS": "200"}, {"COLUMNS": "200", "FORCE_COLOR": "1"}):
        listed = cli("ls", "--socket", sock, "--model", "spaced", env=env).stdout
        assert all(f" {shown} " in listed
                   for shown in ('" sp"', '"sp "', '""sp""', '"n\\n"', '" t\\t"',
                                 '" t\\\\t"', '""q\\\\"')), listed
        assert re.search(r"│ sp +│", listed) and re.search(r"│ n\\n +│", listed), listed
    r = cli("rm", "--socket", sock, "spaced", "nothing ")
    assert r.returncode == 1 and 'no such entry: spaced / "nothing "' in r.stderr, r.stderr
    out = short_dir / "x[1].safetensors"
    r = cli("export", "--socket", sock, "m[b]x", "arr[i]", str(out))
    assert r.returncode == 0 and str(out) in r.stdout, r.stdout
    r = cli("import", "--socket", sock, str(out), "--id", "c[d]")
    assert r.returncode == 0 and "as m[b]x / c[d]" in r.stdout, r.stdout
    r = cli("rm", "--socket", sock, "--model", "m[b]x")
    assert r.returncode == 0 and "5 entries of model m[b]x" in r.stdout, r.stdout


def test_empty_import_names_and_a_missing_store_are_errors(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """import --id "" was ignored (the file imported under another id) and
    --model "" asked to "give --model"; verify of a root that does not exist
    reported "0 files verified, all good"."""
    sock = str(daemon.socket)
    _save(client, "m1", "a")
    out = short_dir / "a.safetensors"
    assert cli("export", "--socket", sock, "m1", "a", str(out)).returncode == 0
    usage_error(cli("import", "--socket", sock, str(out), "--id", ""), "--id is empty")
    usage_error(cli("import", "--socket", sock, str(out), "--model", ""), "--model is empty")
    assert [e.cache_id for e in client.entries("m1")] == ["a"]  # nothing imported
    r = cli("verify", env={"KVKEEPER_ROOT": str(short_dir / "never-made"),
                           "KVKEEPER_SOCKET": str(short_dir / "none.sock")})
    assert r.returncode == 1 and "no store at" in r.stderr and "all good" not in r.stdout, \
        (r.stdout, r.stderr)


def _systemd_words(line: str) -> list[str]:
    """An ExecStart command line read by systemd.service(5)'s rules: a word
    is bare or wrapped whole in quotes; C escapes; "%%" is "%" and any other
    "%" a specifier; "$$" is "$" and "$NAME" or "${NAME}" a variable (both
    refused here: they would not be the text that was meant)."""
    words, i = [], 0
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        if line[i] in "\"'":
            quote, i, raw = line[i], i + 1, ""
            while line[i] != quote:
                if line[i] == "\\" and line[i + 1] == "x":
                    raw += chr(int(line[i + 2:i + 4], 16))
                    i += 4
                elif line[i] == "\\":
                    raw += {"n": "\n", "t": "\t", "r": "\r"}.get(line[i + 1], line[i + 1])
                    i += 2
                else:
                    raw += line[i]
                    i += 1
            i += 1
        else:
            end = line.find(" ", i)
            end = len(line) if end < 0 else end
            raw, i = line[i:end], end
        word, j = "", 0
        while j < len(raw):
            if raw[j] in "%$":
                assert raw[j + 1:j + 2] == raw[j], f"{raw!r}: {raw[j]} would be expanded"
                j += 1
            word += raw[j]
            j += 1
        words.append(word)
    return words


def test_a_systemd_unit_runs_the_socket_path_it_was_given(short_dir: Path) -> None:
    """systemd expands % specifiers and $VARIABLES in ExecStart: a socket
    path "/tmp/a%i" would have become the unit's instance name."""
    odd = str(short_dir / 'x%i$HOME "q" b\\c.sock')
    r = cli("install-service", "--print", "--platform", "linux", "--socket", odd)
    assert r.returncode == 0, r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("ExecStart=")]
    words = _systemd_words(line.removeprefix("ExecStart="))
    assert words[words.index("--socket") + 1] == odd, words
    assert words[1:4] == ["-m", "kvkeeper.cli", "serve"], words


def test_a_stopped_daemon_is_told_apart_from_none(short_dir: Path) -> None:
    """A daemon stopped with SIGSTOP was reported as 'no kvkeeper daemon at',
    as if none ran; a socket file left by a killed one still is."""
    import signal

    from .conftest import serve_process

    sock = short_dir / "run" / "kv.sock"
    proc = serve_process(short_dir / "root", sock)
    try:
        proc.send_signal(signal.SIGSTOP)
        r = cli("stats", "--socket", str(sock), timeout=30)
        assert r.returncode == 3 and "did not answer" in r.stderr and "stopped" in r.stderr, \
            r.stderr
        # verify and export, which can do without it given --root, too (they
        # said "no kvkeeper daemon at ... to name its root").
        for args in (["verify"], ["export", "m", "a", str(short_dir / "a.safetensors")]):
            r = cli(*args, "--socket", str(sock), timeout=30)
            assert r.returncode == 3 and "did not answer within 2 s (is it stopped?); give " \
                "--root to work on its files without it" in r.stderr, r.stderr
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(WAIT)
        assert sock.exists()  # left behind by the killed daemon
        r = cli("stats", "--socket", str(sock), timeout=30)
        assert r.returncode == 3 and "no kvkeeper daemon at" in r.stderr, r.stderr
        # The hint starts a daemon on that socket (before: "kvkeeper serve",
        # the default socket's).
        assert f"(start it: kvkeeper serve --socket {sock})" in r.stderr, r.stderr
        r = cli("verify", "--socket", str(sock), timeout=30)
        assert r.returncode == 3 and "no kvkeeper daemon at " in r.stderr, r.stderr
        assert "to name its root: give --root" in r.stderr, r.stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_uninstall_service_help_speaks_of_removing() -> None:
    """uninstall-service's --platform and --no-load spoke of writing a file
    (install-service's words)."""
    text = " ".join(cli("uninstall-service", "--help").stdout.split())
    assert "the service manager whose file to remove" in text, text
    assert "only remove the file; do not stop the service first" in text, text
    assert "write" not in text, text


def test_help_gives_sizes_as_written_and_python_m_kvkeeper_runs(daemon: RunningDaemon) -> None:
    """Sizes' defaults read 1073741824 and 21474836480, with no word of the
    suffixes a flag takes; and ``python -m kvkeeper`` found no __main__."""
    for command in ("serve", "install-service"):
        r = cli(command, "--help")
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        # --max-pending-bytes: a quarter of this machine's memory, at least 1G.
        import psutil

        from kvkeeper.settings import cgroup_memory_limit

        memory = min(psutil.virtual_memory().total, cgroup_memory_limit() or 2**63)
        pending = max(2**30, memory // 4 // 2**20 * 2**20)
        shown = f"{pending >> 30}G" if pending % 2**30 == 0 else f"{pending >> 20}M"
        for default in (shown, "20G", "5G"):
            assert (f"(default: {default}; bytes, or with a K, M, G or T suffix (1K = 1024))"
                    in text), text
        assert "1073741824" not in text and "at least 1M" in text
        assert ("a quarter of this machine's memory (of its cgroup's limit, in a "
                "container), at least 1G") in text
    r = cli("--version", run=("-m", "kvkeeper"))
    assert r.returncode == 0 and r.stdout.startswith("kvkeeper "), (r.stdout, r.stderr)
    r = cli("stats", "--socket", str(daemon.socket), "--json", run=("-m", "kvkeeper"))
    assert r.returncode == 0 and "saves_received" in json.loads(r.stdout), r.stderr


def test_an_id_starting_with_a_dash_goes_after_double_dash(
    client: Client, daemon: RunningDaemon, short_dir: Path
) -> None:
    """As rm's and export's help say: ``--`` ends the options; without it,
    argparse's error (an unknown option, or a missing PATH) says so too."""
    sock = str(daemon.socket)
    _save(client, "m1", "-dash")
    assert "goes after '--'" in cli("rm", "--help").stdout.replace("\n", " ")
    out = short_dir / "x.safetensors"
    way = "starting with '-' goes after '--'"
    for args, said in ((("rm", "m1", "-dash"), "unrecognized arguments: -dash"),
                       (("export", "m1", "-dash", str(out)), "required: path"),
                       (("import", "-x.safetensors"), "required: PATH")):
        r = cli(*args[:1], "--socket", sock, *args[1:])
        assert r.returncode == 2 and said in r.stderr and way in r.stderr, r.stderr
        command = args[0]
        assert f"is no option of kvkeeper {command}" in r.stderr, r.stderr
    assert "kvkeeper rm -- MODEL -ID" in cli("rm", "m1", "-dash").stderr
    assert "./-FILE" in cli("import", "-x.safetensors").stderr
    # A value given to an option: after '=' (after '--' it would be an id).
    for args, option in ((("rm", "--model", "-abc"), "--model"),
                         (("import", "--id", "-x", "f.safetensors"), "--id"),
                         (("rm", "--socket", "-x.sock", "m1", "x"), "--socket"),
                         (("rm", "--mod", "-abc"), "--model"),  # argparse's abbreviation
                         (("export", "--ro", "-x", "m", "i", "p.safetensors"), "--root")):
        r = cli(*args)
        assert r.returncode == 2 and f"argument {option}: expected one argument" in r.stderr \
            and f"goes after '=' ({option}={args[2]})" in r.stderr, r.stderr
        assert way not in r.stderr, r.stderr
    # A negative number, or a word holding a space, is an argument to
    # argparse: the error is elsewhere.
    for word in ("-1", "-a b"):
        r = cli("rm", word, "x", "--bogus")
        assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr, r.stderr
        assert f"'{word}'" not in r.stderr, r.stderr
    # A word starting with '--' is a mistyped option, more likely than an id.
    r = cli("rm", "--socket", sock, "m1", "--dash")
    assert r.returncode == 2 and "unrecognized arguments: --dash" in r.stderr, r.stderr
    assert way not in r.stderr and not out.exists()
    assert [e.cache_id for e in client.entries()] == ["-dash"]
    r = cli("export", "--socket", sock, "--", "m1", "-dash", str(out))
    assert r.returncode == 0 and out.exists(), (r.stdout, r.stderr)
    r = cli("rm", "--socket", sock, "--", "m1", "-dash")
    assert r.returncode == 0 and r.stdout == "deleted m1 / -dash\n", (r.stdout, r.stderr)
    assert client.entries() == []


def test_ls_shows_the_token_count_a_legacy_file_records(
    daemon: RunningDaemon, short_dir: Path
) -> None:
    """A cache_persist file (schema "3") records its token count; ls --all
    listed it with 0 tokens, as an mlx-lm file, which records none."""
    manifest = json.loads((LEGACY / "MANIFEST.json").read_text())
    rel = "gezel-schema3/fp-demo/kv.safetensors"
    for cache_id, src in (("gez", rel), ("mlx", "mlx-lm/kv.safetensors")):
        place = entry_path(daemon.root, cache_id, model="model-l")
        place.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(LEGACY / src, place)
    assert cli("gc", "--socket", str(daemon.socket)).returncode == 0  # a rescan indexes them
    r = cli("ls", "--socket", str(daemon.socket), "--all", "--json")
    listed = {e["cache_id"]: (e["kind"], e["tokens"]) for e in json.loads(r.stdout)}
    assert listed == {"gez": ("legacy", len(manifest[rel]["token_ids"])), "mlx": ("legacy", 0)}


def test_a_legacy_cache_at_an_entrys_place_is_one_import_and_rm_see(
    daemon: RunningDaemon, short_dir: Path
) -> None:
    """A cache of an older format at an entry's place loads by its key, but
    import replaced it without --replace, and rm --model said "no entries"
    and left it."""
    sock = str(daemon.socket)
    legacy = LEGACY / "mlx-lm" / "kv.safetensors"
    place = entry_path(daemon.root, "leg", model="model-l")
    place.parent.mkdir(parents=True)
    shutil.copyfile(legacy, place)
    assert cli("gc", "--socket", sock).returncode == 0  # a rescan indexes it
    with Client(daemon.socket, timeout=WAIT) as kv:
        assert kv.load("model-l", "leg") is not None
    r = cli("import", "--socket", sock, "--model", "model-l", "--id", "leg", str(legacy))
    assert r.returncode == 1 and "model-l / leg is already in the store" in r.stdout, r.stdout
    assert place.read_bytes() == legacy.read_bytes()
    # One at a hashed place (an id too long for a file name) lists without
    # its id: rm --model stopped at it ("cache id is empty", exit 2).
    long_id = "x" * 300
    hashed = entry_path(daemon.root, long_id, model="model-l")
    shutil.copyfile(legacy, hashed)
    assert cli("gc", "--socket", sock).returncode == 0
    r = cli("import", "--socket", sock, "--model", "model-l", "--id", long_id, str(legacy))
    assert r.returncode == 1 and "is already in the store" in r.stdout, r.stdout
    r = cli("rm", "--socket", sock, "--model", "model-l")
    assert r.returncode == 0 and "deleted 1 entry of model model-l" in r.stdout, r.stdout
    assert not place.exists() and hashed.exists()
