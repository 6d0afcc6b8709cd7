"""Run the daemon as a per-user service: a launchd LaunchAgent on macOS, a
systemd user unit on Linux."""

from __future__ import annotations

import os
import plistlib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvkeeper import config
from kvkeeper.settings import MAX_SECONDS

LABEL = "io.github.kvkeeper.daemon"
#: In the LaunchAgent's environment: the daemon gives exit 2 as 0 (cli.main).
LAUNCHD_MARK = ("KVKEEPER_SERVICE_MANAGER", "launchd")
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
    # Exit statuses of an unload command that mean "was not loaded": done.
    not_loaded: frozenset[int] = frozenset()
    # After a stop_first that may have stopped something (not an answer in
    # not_loaded), wait while pid_command still answers 0: launchd's bootout
    # returns (0, or 36 "Operation now in progress" while the daemon drains)
    # while the label is still registered, and a bootstrap then fails (5,
    # "Input/output error") for a few seconds more.
    wait_unregistered: bool = False
    # Exit statuses of a load command that mean "not yet" after such a stop:
    # tried again for up to LOAD_RETRY_SECONDS (launchd: 5, and 37,
    # "Operation already in progress", while it is still unloading the label).
    load_retry: frozenset[int] = frozenset()
    # What a load command's exit status means, and what to do, where its
    # own message does not say.
    load_hints: dict[int, str] = field(default_factory=dict)
    # Seconds this file lets the service manager wait for the daemon to stop.
    stop_timeout: int = 30
    # Directories the service needs before it is loaded, made with the file.
    dirs: list[Path] = field(default_factory=list)
    # With unload, after the file is removed.
    after_removal: list[list[str]] = field(default_factory=list)
    # Stops the service by name, file or none (one whose file was deleted
    # by hand is still loaded).
    stop_loaded: list[list[str]] = field(default_factory=list)
    # Prints the running daemon's pid, which pid_pattern finds (group 1);
    # the statuses in not_loaded mean "no such service".
    pid_command: list[str] = field(default_factory=list)
    pid_pattern: str = r"^MainPID=([0-9]+)\s*$"
    # Where loading the file makes a symbolic link to it (systemd's enable):
    # removed by uninstall when left pointing at nothing.
    links: list[Path] = field(default_factory=list)


#: A service manager command that stops nothing gets this long; one that may
#: stop the daemon also gets the service's stop timeout (it waits that long).
COMMAND_SECONDS = 60
#: The longest stop timeout a service file of kvkeeper's has (the largest
#: drain timeout plus 10 s).
MAX_STOP_TIMEOUT = MAX_SECONDS + 10
#: How long a load command answering one of ``load_retry`` is tried again:
#: launchd was measured holding a label about 5 s after its bootout returned.
LOAD_RETRY_SECONDS = 20.0
#: Pause between two polls of the service manager.
POLL_SECONDS = 0.25


def installed_stop_timeout(path: Path) -> int | None:
    """The stop timeout (ExitTimeOut, TimeoutStopSec) of the service file at
    ``path``, or None when there is none or it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if path.suffix == ".plist":
            value = plistlib.loads(data).get("ExitTimeOut")
            return value if type(value) is int and value >= 0 else None
        found = re.search(rb"^TimeoutStopSec=([0-9]+)\s*$", data, re.MULTILINE)
        return int(found.group(1)) if found else None
    except Exception:  # noqa: BLE001 - any unreadable file: the default applies
        return None


def serve_command(serve_args: Sequence[str]) -> list[str]:
    """The exact command line the service runs: this interpreter, absolute."""
    return [os.path.abspath(sys.executable), "-m", "kvkeeper.cli", "serve", *serve_args]


def cache_holding(path: str) -> str | None:
    """The nearest directory above the interpreter ``path`` tagged as a cache
    (it holds a ``CACHEDIR.TAG``, as uv's cache does, where ``uvx`` puts the
    tools it runs), or None. What is in one may be deleted at any time (``uv
    cache clean``), so a service must not run an interpreter from there.
    Looked for above a virtual environment's root (its ``pyvenv.cfg``, or a
    conda prefix's ``conda-meta/``): uv, virtualenv and pixi tag every
    environment they make, so that backups skip it, and each was taken for
    a cache. A directory named ``.cache`` (``~/.cache``, pipx's own) or
    ``~/Library/Caches`` is a cache too, tagged or not."""
    here = os.path.dirname(os.path.abspath(path))
    root = os.path.dirname(here)  # bin/'s parent
    # (pixi tags its conda prefixes too, conda-meta/ in them.)
    if os.path.isfile(os.path.join(root, "pyvenv.cfg")) or os.path.isdir(
            os.path.join(root, "conda-meta")):
        here = os.path.dirname(root)
    while True:
        # pipx run's environments sit in an untagged ".cache" (its own, or
        # ~/.cache/pipx) and go after 14 days unused; ~/.cache is for
        # files that may be deleted (XDG), ~/Library/Caches on macOS.
        if (os.path.isfile(os.path.join(here, "CACHEDIR.TAG"))
                or os.path.basename(here) == ".cache"
                or here.endswith(os.sep + os.path.join("Library", "Caches"))):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


#: Why launchctl refuses gui/<uid> (112, 125) to a user, and what to do.
NO_GUI_DOMAIN = ("launchd's gui/<uid> domain exists only while this user is logged in at the "
                 "Mac's screen, which an ssh session is not: the agent file is written and "
                 "starts at this user's next login there (log in once, or turn on automatic "
                 "login)")


def launchd(serve_args: Sequence[str], drain_timeout: float, home: Path, *,
            background: bool = True, python_path: str | None = None) -> ServiceFile:
    logs = home / "Library" / "Logs" / "kvkeeper"
    # launchd sends SIGTERM, waits ExitTimeOut, then SIGKILL: give the drain its time.
    exit_timeout = int(drain_timeout) + 10
    command = serve_command(serve_args)
    if any("\r" in word for word in (*command, str(logs))):
        # plistlib writes it, and XML reads it back as a line feed: the
        # agent would use another path (other control characters, which
        # XML cannot hold at all, plistlib refuses itself).
        raise ValueError("a carriage return, which a plist reads back as a line feed")
    plist = {
        "Label": LABEL,
        "ProgramArguments": command,
        "RunAtLoad": True,
        # Started again after a failure, not after exit 0: a drain that
        # SIGTERM asked for, or exit 2 given as 0 (see cli.main), which a
        # new start cannot mend, as systemd's RestartPreventExitStatus=2.
        "KeepAlive": {"SuccessfulExit": False},
        # --cpu-policy batch: launchd's default class, named ("light resource
        # limits", launchd.plist(5)), for SCHED_BATCH's "give way, but keep
        # up". Not Background, as before: its limits throttle the job's CPU
        # and disk I/O whenever the user's work contends, as SCHED_IDLE and
        # idle I/O would, which the writer cannot afford (saves falling
        # behind fill the pending budget, and are refused; a throttled
        # drain overruns ExitTimeOut). "normal": no limits, as an app's own.
        "ProcessType": "Standard" if background else "Interactive",
        "ExitTimeOut": exit_timeout,
        "StandardOutPath": str(logs / "kvkeeper.log"),
        "StandardErrorPath": str(logs / "kvkeeper.log"),
        # `python -m` puts the working directory first on sys.path: a file
        # named like a module the daemon imports must not replace it.
        "WorkingDirectory": "/",
    }
    plist["EnvironmentVariables"] = {LAUNCHD_MARK[0]: LAUNCHD_MARK[1],
                                     **({"PYTHONPATH": python_path} if python_path else {})}
    path = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    domain = f"gui/{os.getuid()}"
    user = os.getuid() != 0
    return ServiceFile(
        path,
        plistlib.dumps(plist),
        load=[["launchctl", "bootstrap", domain, str(path)]],
        unload=[["launchctl", "bootout", f"{domain}/{LABEL}"]],
        stop_first=[["launchctl", "bootout", f"{domain}/{LABEL}"]],
        # launchctl's "No such process" and "Could not find service": an
        # agent written with --no-load, or stopped by hand, is not running;
        # "Domain does not support specified action" (and 112, "Could not
        # find specified domain"): no gui/<uid> domain in this session (ssh
        # into a Mac nobody is logged into at its screen), so nothing of
        # this user's is loaded there (uninstall refused to remove the
        # file). Not for root, whose gui/0 is no user's login.
        not_loaded=frozenset({3, 113} | ({112, 125} if user else set())),
        wait_unregistered=True,
        load_retry=frozenset({5, 37}),
        load_hints={
            **dict.fromkeys((112, 125), NO_GUI_DOMAIN if user else
                            "run install-service as the user whose agent it is, not "
                            "as root (gui/0 is no user's login)"),
            **dict.fromkeys((5, 37), f"launchd answers this for an agent turned off with "
                            f"launchctl disable (launchctl enable {domain}/{LABEL} first), "
                            f"for a plist it will not load (its owner or mode), and for some "
                            f"seconds after a bootout of the agent: see launchctl print "
                            f"{domain}/{LABEL}, and run install-service again"),
        },
        stop_timeout=exit_timeout,
        # Made with the file: launchd cannot open the log of an agent it
        # loads at the next login (--no-load) in a directory that is missing.
        dirs=[logs],
        stop_loaded=[["launchctl", "bootout", f"{domain}/{LABEL}"]],
        pid_command=["launchctl", "print", f"{domain}/{LABEL}"],
        pid_pattern=r"^\s*pid = ([0-9]+)\s*$",
    )


def _systemd_word(word: str, *, command: bool = False) -> str:
    """One ExecStart word, as systemd reads it back: it expands % specifiers
    and unescapes C escapes even in quotes (a socket path "/tmp/a%i" would
    have become the instance name), and in the arguments, not in the
    ``command`` path, $VARIABLES."""
    w = word.replace("%", "%%")
    if not command:
        w = w.replace("$", "$$")
    if w and all(c.isalnum() or c in "/._-=+:,@" for c in w):
        return w
    w = (w.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
         .replace("\r", "\\r").replace("\t", "\\t"))
    # Any other control character as a C escape: a unit holds none raw.
    return '"' + "".join(f"\\x{ord(c):02x}" if _control(c) else c for c in w) + '"'


def _control(c: str) -> bool:
    return ord(c) < 32 or ord(c) == 127


#: What systemd refuses in an ExecStart executable, quoted or not, besides
#: control characters ("Executable name contains special characters": the
#: unit never starts).
UNSAFE_EXECUTABLE = "\"'\\"


def _systemd_command(words: Sequence[str]) -> str:
    if any(c in UNSAFE_EXECUTABLE or _control(c) for c in words[0]):
        # An interpreter under "~/Bob's projects": /bin/sh runs it, given as
        # an argument (there systemd takes any character). Not env(1): it
        # reads a first word holding "=" as a variable to set.
        words = ["/bin/sh", "-c", 'exec "$0" "$@"', *words]
    return " ".join(_systemd_word(w, command=i == 0) for i, w in enumerate(words))


def systemd(serve_args: Sequence[str], drain_timeout: float, config_home: Path, *,
            python_path: str | None = None) -> ServiceFile:
    stop_timeout = int(drain_timeout) + 10
    # (No $ expansion in Environment=: the word is quoted as a command's.)
    environment = ([f"Environment={_systemd_word(f'PYTHONPATH={python_path}', command=True)}"]
                   if python_path else [])
    unit = "\n".join([
        "[Unit]",
        "Description=kvkeeper: keeps MLX prompt caches across restarts",
        "",
        "[Service]",
        "Type=simple",
        *environment,
        f"ExecStart={_systemd_command(serve_command(serve_args))}",
        # `python -m` puts the working directory (for a user service: the
        # home directory) first on sys.path: a ~/msgspec.py replaced the module.
        "WorkingDirectory=/",
        "Restart=on-failure",
        # Exit 2: another daemon holds the root or socket, or a setting is
        # refused. Starting again cannot help.
        "RestartPreventExitStatus=2",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={stop_timeout}",
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
        # Before the daemon-reload: a daemon an earlier install started
        # drains under that unit's stop timeout (restarted after the reload,
        # a shorter new one had systemd kill it part way through its drain).
        stop_first=[["systemctl", "--user", "stop", UNIT]],
        # Once the file is gone: the manager forgets the unit it had loaded.
        after_removal=[["systemctl", "--user", "daemon-reload"]],
        stop_timeout=stop_timeout,
        stop_loaded=[["systemctl", "--user", "stop", UNIT]],
        # Not --value: systemd before 230 has none.
        pid_command=["systemctl", "--user", "show", "--property=MainPID", UNIT],
        links=[path.parent / "default.target.wants" / UNIT],
    )


def service_file(serve_args: Sequence[str], drain_timeout: float,
                 platform: str = sys.platform, *, background: bool = True,
                 python_path: str | None = None) -> ServiceFile:
    """The service file for this platform. ``background`` (the daemon's cpu
    policy is batch) marks a LaunchAgent as background work; on Linux the
    daemon sets its own policy from ``--cpu-policy`` on the command line.
    ``python_path``: the service's PYTHONPATH (see ``pinned_python_path``)."""
    home = config.home_dir()
    if platform == "darwin":
        return launchd(serve_args, drain_timeout, home, background=background,
                       python_path=python_path)
    config_home = Path(config.xdg_dir("XDG_CONFIG_HOME") or home / ".config")
    return systemd(serve_args, drain_timeout, config_home, python_path=python_path)


def pinned_python_path(environ: Mapping[str, str] | None = None) -> str | None:
    """This shell's PYTHONPATH as the service must have it (None for none):
    the service manager does not pass it on, and a kvkeeper run from a
    source tree through it had the service import another copy, or none.
    Relative entries are made absolute (the service runs from /); empty
    ones, the working directory, are left out (the service's is /). A
    kvkeeper imported from the working directory (``python -m kvkeeper``
    in a source tree) has its directory put first, unless the service
    would import it anyway. ValueError for a value a service file cannot
    carry."""
    if environ is None and sys.flags.ignore_environment:
        value = ""  # python -E or -I: this process did not use it either
    else:
        value = (os.environ if environ is None else environ).get("PYTHONPATH", "")
    entries = [os.path.abspath(e) for e in value.split(os.pathsep) if e]
    _check_carried(os.pathsep.join(entries), "PYTHONPATH",
                   "set it to other paths, or leave it unset")
    here = _this_package_if_missed(entries)
    if here is not None:
        what = f"the source tree kvkeeper runs from ({here!r}), which the service's " \
               f"PYTHONPATH must name,"
        mend = "move the tree, or install kvkeeper and run it from elsewhere"
        _check_carried(here, what, mend)
        if os.pathsep in here:  # PYTHONPATH would name two other directories
            raise ValueError(f"{what} holds {os.pathsep!r}, which separates PYTHONPATH's "
                             f"entries: {mend}")
        entries.insert(0, here)
    return os.pathsep.join(entries) or None


def _check_carried(text: str, what: str, mend: str) -> None:
    """ValueError when ``text`` is what a service file cannot carry as it
    is: bytes not UTF-8 (a traceback in the unit's or plist's encoding),
    control characters (a CR ends a unit's line; XML has no place for most
    of them)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8, which a service file cannot carry: "
                         f"{mend}") from None
    if any(_control(c) for c in text):
        raise ValueError(f"{what} holds a control character, which a service file cannot "
                         f"carry: {mend}")


def _this_package_if_missed(entries: list[str]) -> str | None:
    """The directory this kvkeeper was imported from, when it is the
    working directory's (``python -m kvkeeper`` in a source tree) and the
    service, run from / with ``entries`` as its PYTHONPATH, would import
    another copy of kvkeeper or none; None else."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    first = os.path.realpath(sys.path[0] if sys.path and sys.path[0] else os.curdir)
    if os.path.realpath(here) != first:
        return None  # installed, or on PYTHONPATH: where the service finds it too
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    probe = "import importlib.util as u; s = u.find_spec('kvkeeper'); print(s and s.origin)"
    try:
        # Asked of the interpreter itself: an editable install's import hook
        # finds the same tree from anywhere, a copy in site-packages another.
        r = subprocess.run([os.path.abspath(sys.executable), "-c", probe], cwd="/", env=env,
                           capture_output=True, text=True, timeout=COMMAND_SECONDS)
        found = r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        found = ""
    mine = os.path.realpath(os.path.join(here, "kvkeeper", "__init__.py"))
    return None if found and os.path.realpath(found) == mine else here


def _run(commands: list[list[str]], seconds: float, ok: frozenset[int] = frozenset(),
         hints: dict[int, str] | None = None, retry: frozenset[int] = frozenset()) -> None:
    for cmd in commands:
        retry_until = time.monotonic() + LOAD_RETRY_SECONDS
        while True:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds)
            except FileNotFoundError:
                raise ServiceError(f"{cmd[0]} not found on PATH: is this machine's service "
                                   f"manager available?") from None
            except subprocess.TimeoutExpired:
                raise ServiceError(f"{shlex.join(cmd)} did not finish within "
                                   f"{seconds:g} s") from None
            if r.returncode not in retry or time.monotonic() >= retry_until:
                break
            time.sleep(POLL_SECONDS)
        if r.returncode != 0 and r.returncode not in ok:
            hint = (hints or {}).get(r.returncode)
            raise ServiceError(f"{shlex.join(cmd)} failed ({r.returncode}): "
                               f"{(r.stderr or r.stdout).strip()}"
                               + (f" ({hint})" if hint else ""))


def _try(commands: list[list[str]], seconds: float) -> list[int | None]:
    """Run ``commands``, their failures ignored; their exit statuses (None
    for one that could not be run or did not finish)."""
    answers: list[int | None] = []
    for cmd in commands:
        try:
            answers.append(subprocess.run(cmd, capture_output=True, timeout=seconds).returncode)
        except (OSError, subprocess.TimeoutExpired):
            answers.append(None)
    return answers


def install(sf: ServiceFile, *, load: bool = True) -> None:
    """Write the service file (atomically) and, with ``load``, have the
    service manager (re)start the daemon from it. Raises ServiceError."""
    before = installed_stop_timeout(sf.path)
    for directory in (*sf.dirs, sf.path.parent):
        directory.mkdir(parents=True, exist_ok=True)
    tmp = sf.path.with_name(sf.path.name + ".tmp")
    tmp.write_bytes(sf.content)
    os.replace(tmp, sf.path)
    if load:
        # The service manager waits up to the stop timeout of the service it
        # stops (the one installed before, if any), then answers.
        seconds = COMMAND_SECONDS + max(sf.stop_timeout, before or 0)
        # Nothing loaded, or no service manager: the load says which.
        answers = _try(sf.stop_first, seconds)
        # Not after "nothing was loaded": a bootstrap answering 5 then (a
        # disabled agent, a plist refused) waited out the retries for nothing.
        settling = sf.wait_unregistered and not all(a in sf.not_loaded for a in answers)
        # A stop that failed otherwise (not 0, nor launchd's 36, "Operation
        # now in progress", while the daemon drains) may have stopped
        # nothing: the label is waited for as long as a bootstrap is retried,
        # not the stop timeout (an hour, with --drain-timeout 3600).
        odd = [(cmd, a) for cmd, a in zip(sf.stop_first, answers, strict=True)
               if sf.wait_unregistered and a not in (0, 36) and a not in sf.not_loaded]
        if settling:
            _wait_unregistered(sf, LOAD_RETRY_SECONDS if odd else seconds)
        try:
            _run(sf.load, seconds, hints=sf.load_hints,
                 retry=sf.load_retry if settling else frozenset())
        except ServiceError as exc:
            if not odd:
                raise
            said = "; ".join(f"{shlex.join(cmd)} " + ("did not finish" if a is None
                                                       else f"answered {a}")
                             for cmd, a in odd)
            raise ServiceError(f"{exc} (before it, {said})") from None


def _wait_unregistered(sf: ServiceFile, seconds: float) -> None:
    """Wait, up to ``seconds``, while ``sf.pid_command`` answers 0 (the
    service manager still has the service). Any other answer ends the wait:
    the load that follows says what is wrong, if anything is."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            r = subprocess.run(sf.pid_command, capture_output=True,
                               timeout=max(0.1, min(COMMAND_SECONDS,
                                                    deadline - time.monotonic())))
        except (OSError, subprocess.TimeoutExpired):
            return
        if r.returncode != 0:
            return
        time.sleep(POLL_SECONDS)


def running_pid(sf: ServiceFile) -> int | None:
    """The pid of the daemon the service manager runs from ``sf``, or None
    when it runs none (not loaded, or loaded and not running). Raises
    ServiceError when the service manager cannot be asked."""
    try:
        r = subprocess.run(sf.pid_command, capture_output=True, text=True,
                           timeout=COMMAND_SECONDS)
    except FileNotFoundError:
        raise ServiceError(f"{sf.pid_command[0]} not found on PATH") from None
    except subprocess.TimeoutExpired:
        raise ServiceError(f"{shlex.join(sf.pid_command)} did not finish within "
                           f"{COMMAND_SECONDS} s") from None
    if r.returncode in sf.not_loaded:
        return None
    if r.returncode != 0:
        raise ServiceError(f"{shlex.join(sf.pid_command)} failed ({r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()}")
    found = re.search(sf.pid_pattern, r.stdout, re.MULTILINE)
    pid = int(found.group(1)) if found else 0
    return pid or None  # systemd says 0 for a unit not running


def uninstall(sf: ServiceFile, *, unload: bool = True) -> bool:
    """Stop the service (with ``unload``) and remove its file; False when
    there was no file. Raises ServiceError when stopping fails."""
    if unload and sf.path.exists():
        installed = installed_stop_timeout(sf.path)
        seconds = COMMAND_SECONDS + (sf.stop_timeout if installed is None else installed)
        _run(sf.unload, seconds, sf.not_loaded)
    try:
        sf.path.unlink()
        existed = True
    except FileNotFoundError:
        existed = False
        if unload:
            # Deleted by hand, the service may still be loaded and running:
            # stopped by name, if so (failures ignored: most often there is
            # no such service; the caller asks for its pid after). With no
            # file its stop timeout is unknown: the manager keeps to it, this
            # only bounds the wait for the manager.
            _try(sf.stop_loaded, COMMAND_SECONDS + MAX_STOP_TIMEOUT)
    _remove_links(sf)  # before the manager reloads: it reads the links too
    if unload:
        _try(sf.after_removal, COMMAND_SECONDS)  # the service is stopped and its file gone
    return existed


def _remove_links(sf: ServiceFile) -> None:
    # systemctl disable before systemd 257 refuses a unit whose file is gone
    # ("does not exist"): a file deleted by hand left
    # default.target.wants/kvkeeper.service pointing at nothing. A link that
    # still leads to a file is left alone.
    for link in sf.links:
        if link.is_symlink() and not link.exists():
            try:
                link.unlink()
            except OSError:
                pass  # harmless where it stays; the uninstall goes on
