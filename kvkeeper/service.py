"""Run the daemon as a per-user service: a launchd LaunchAgent on macOS, a
systemd user unit on Linux."""

from __future__ import annotations

import os
import plistlib
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LABEL = "io.github.kvkeeper.daemon"
UNIT = "kvkeeper.service"


class ServiceError(Exception):
    """A service manager command failed; the message has its output."""


@dataclass(frozen=True)
class ServiceFile:
    path: Path
    content: bytes
    load: list[list[str]]  # commands that load/start it
    unload: list[list[str]]  # commands that stop/unload it
    # Before loading, failures ignored: unload what an earlier install loaded
    # (launchd refuses to bootstrap a label that is loaded).
    stop_first: list[list[str]] = field(default_factory=list)


def serve_command(serve_args: Sequence[str]) -> list[str]:
    """The exact command line the service runs: this interpreter, absolute."""
    return [os.path.abspath(sys.executable), "-m", "kvkeeper.cli", "serve", *serve_args]


def launchd(serve_args: Sequence[str], drain_timeout: float, home: Path, *,
            background: bool = True) -> ServiceFile:
    logs = home / "Library" / "Logs" / "kvkeeper"
    plist = {
        "Label": LABEL,
        "ProgramArguments": serve_command(serve_args),
        "RunAtLoad": True,
        "KeepAlive": True,
        # macOS's counterpart of SCHED_BATCH (--cpu-policy batch); "normal"
        # gets launchd's own default.
        "ProcessType": "Background" if background else "Standard",
        # launchd sends SIGTERM, waits ExitTimeOut, then SIGKILL: give the drain its time.
        "ExitTimeOut": int(drain_timeout) + 10,
        "StandardOutPath": str(logs / "kvkeeper.log"),
        "StandardErrorPath": str(logs / "kvkeeper.log"),
    }
    path = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    domain = f"gui/{os.getuid()}"
    return ServiceFile(
        path,
        plistlib.dumps(plist),
        load=[["mkdir", "-p", str(logs)], ["launchctl", "bootstrap", domain, str(path)]],
        unload=[["launchctl", "bootout", f"{domain}/{LABEL}"]],
        stop_first=[["launchctl", "bootout", f"{domain}/{LABEL}"]],
    )


def _systemd_word(word: str) -> str:
    """One ExecStart argument, as systemd reads it back: it expands %
    specifiers and $VARIABLES and unescapes C escapes even in quotes (a
    socket path "/tmp/a%i" would have become the instance name)."""
    w = word.replace("%", "%%").replace("$", "$$")
    if w and all(c.isalnum() or c in "/._-=+:,@" for c in w):
        return w
    w = w.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return '"' + w + '"'


def systemd(serve_args: Sequence[str], drain_timeout: float, config_home: Path) -> ServiceFile:
    unit = "\n".join([
        "[Unit]",
        "Description=kvkeeper: keeps MLX prompt caches across restarts",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={' '.join(_systemd_word(w) for w in serve_command(serve_args))}",
        "Restart=on-failure",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={int(drain_timeout) + 10}",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])
    path = config_home / "systemd" / "user" / UNIT
    return ServiceFile(
        path,
        unit.encode(),
        # restart, not enable --now: a daemon already running from an earlier
        # install must pick up the new command line.
        load=[["systemctl", "--user", "daemon-reload"],
              ["systemctl", "--user", "enable", UNIT],
              ["systemctl", "--user", "restart", UNIT]],
        unload=[["systemctl", "--user", "disable", "--now", UNIT]],
    )


def service_file(serve_args: Sequence[str], drain_timeout: float,
                 platform: str = sys.platform, *, background: bool = True) -> ServiceFile:
    """The service file for this platform. ``background`` (the daemon's cpu
    policy is batch) marks a LaunchAgent as background work; on Linux the
    daemon sets its own policy from ``--cpu-policy`` on the command line."""
    home = Path.home()
    if platform == "darwin":
        return launchd(serve_args, drain_timeout, home, background=background)
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    return systemd(serve_args, drain_timeout, config_home)


def _run(commands: list[list[str]]) -> None:
    for cmd in commands:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise ServiceError(f"{cmd[0]} not found on PATH: is this machine's service "
                               f"manager available?") from None
        except subprocess.TimeoutExpired:
            raise ServiceError(f"{shlex.join(cmd)} did not finish within 60 s") from None
        if r.returncode != 0:
            raise ServiceError(f"{shlex.join(cmd)} failed ({r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()}")


def install(sf: ServiceFile, *, load: bool = True) -> None:
    sf.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = sf.path.with_name(sf.path.name + ".tmp")
    tmp.write_bytes(sf.content)
    os.replace(tmp, sf.path)
    if load:
        for cmd in sf.stop_first:
            try:
                subprocess.run(cmd, capture_output=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass  # nothing loaded, or no service manager: load says which
        _run(sf.load)


def uninstall(sf: ServiceFile, *, unload: bool = True) -> bool:
    if unload and sf.path.exists():
        _run(sf.unload)
    try:
        sf.path.unlink()
    except FileNotFoundError:
        return False
    return True
