"""``install-service`` and ``uninstall-service``: the serve settings
resolved as ``serve`` would, pinned into a launchd or systemd service."""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import sys
from pathlib import Path
from typing import Any

from rich.text import Text

from kvkeeper.ops.common import CommandError, err, out, shown


def serve_args_for_service(args: argparse.Namespace) -> list[str]:
    from kvkeeper.settings import SETTINGS

    out_args = []
    # Every serve setting (a list kept here apart once left --cpu-policy out).
    names = [s.name for s in SETTINGS]
    for name in [*names[:2], "config", *names[2:]]:
        value = getattr(args, name, None)
        if value is not None:
            if isinstance(value, Path):
                value = os.path.abspath(value.expanduser())
            out_args += [f"--{name.replace('_', '-')}", str(value)]
    return out_args


def _service_settings(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """The serve arguments for the service, and every setting, resolved as
    ``serve`` resolves them; invalid settings end the command with status 2
    rather than write a service that fails at every start."""
    from kvkeeper.config import ConfigError
    from kvkeeper.daemon.app import check_places, config_from_settings
    from kvkeeper.settings import SETTINGS, SettingsError, default_config_file, resolve

    try:
        values, sources = resolve({s.name: getattr(args, s.name) for s in SETTINGS},
                                  args.config)
        # The root and socket as serve looks at them: too long a socket path,
        # a root open to others, or min_free_bytes past the file system made
        # a unit that failed at every start (and restarted forever).
        check_places(config_from_settings(values))
    except (SettingsError, ConfigError) as exc:
        raise CommandError(str(exc), status=2) from None
    # launchd and systemd do not hand this shell's environment to the service:
    # what came from it goes on the service's command line, so that the
    # service runs with the settings (and the drain timeout) resolved here.
    pinned = argparse.Namespace(**vars(args))
    for s in SETTINGS:
        if sources[s.name].startswith("environment"):
            setattr(pinned, s.name, values[s.name])
    # So do the config file found through $KVKEEPER_CONFIG or $XDG_CONFIG_HOME,
    # and the default root and socket when they came from $XDG_CACHE_HOME /
    # $XDG_RUNTIME_DIR: without them the service would read another file,
    # and serve another root on another socket than this shell's clients use.
    config_file = default_config_file()
    home_file = default_config_file({})  # what the service finds without the variables
    if args.config is None and config_file.resolve() != home_file.resolve():
        if config_file.is_file():
            pinned.config = config_file
        elif home_file.is_file():
            # None for this shell, where the service would read ~/.config's:
            # an empty file says "none" to it.
            pinned.config = Path(os.devnull)
    if sources["root"] == "default" and os.environ.get("XDG_CACHE_HOME"):
        pinned.root = values["root"]
    # The default socket always: it comes from the environment whether a
    # variable is set here or not (systemd gives a user service
    # $XDG_RUNTIME_DIR even when this shell has none, and this shell's
    # clients then use /tmp/kvkeeper-UID; on macOS it is the per-user temp
    # directory, the same for launchd, unless the system tells none).
    if sources["socket"] == "default":
        pinned.socket = values["socket"]
    return serve_args_for_service(pinned), values


def _refuse_a_daemon_the_service_did_not_start(sf: Any, values: dict[str, Any]) -> None:
    """A daemon started by hand on the service's root or socket makes the
    service exit 2 at every start: systemd then gives up on it, as launchd
    does (the agent's daemon gives that exit as 0, see cli.main), and
    install-service said "started". Refused (exit 2)
    before anything is written; the service's own daemon is restarted."""
    from kvkeeper import service
    from kvkeeper.daemon.app import config_from_settings, holder_pid, lock_holder, lock_paths

    for path, what in zip(lock_paths(config_from_settings(values)), ("socket", "root"),
                          strict=True):
        # The lock file beside the socket, in the root.
        place = path.with_name(path.name.removesuffix(".lock")) if what == "socket" \
            else path.parent
        try:
            holder = lock_holder(path)
        except OSError as exc:
            raise CommandError(f"cannot read the {what}'s lock file {path}: {exc.strerror}; "
                               f"the service could not take it either", status=2) from None
        if holder is None:
            continue
        pid = holder_pid(holder)
        try:
            if pid is not None and pid == service.running_pid(sf):
                continue  # the service's own daemon, which the install restarts
            why = ", which the service manager does not run"
        except service.ServiceError as exc:
            why = f" (the service manager could not be asked whether it runs it: {exc})"
        raise CommandError(
            f"the {what} {place} is held by another kvkeeper process ({holder}){why}; the "
            f"service would fail at every start: stop that process first"
            f"{f' (kill -TERM {pid})' if pid else ''}, or only write the file with --no-load",
            status=2)


def _platform(args: argparse.Namespace) -> str:
    """The platform whose service file --platform asks for: this one by default."""
    return {"macos": "darwin", "linux": "linux", None: sys.platform}[args.platform]


def _not_another_users_home(sf: Any) -> None:
    """Refuse root working in another user's home (sudo keeps HOME): it made
    root-owned files and directories there (the service file, its log
    directory, ~/.config/systemd), and launchctl's gui/0 is not the domain
    the user's agent runs in (its 125 was taken for "nothing loaded", and
    the agent ran on). Looked at for the home and each place ``sf``, the
    service file, is written to: the nearest directory of it that exists."""
    if os.getuid() != 0:
        return
    from kvkeeper.config import home_dir

    for place in (home_dir(), sf.path.parent, *sf.dirs):
        here = place
        while True:
            try:
                owner = here.stat().st_uid
                break
            except FileNotFoundError:
                if here.parent == here:
                    return
                here = here.parent
            except OSError as exc:  # a file on the way, a directory root may not search
                raise CommandError(f"cannot look at {here}, where the service's files go: "
                                   f"{exc.strerror}", status=2) from None
        if owner != 0:
            raise CommandError(f"{here} is uid {owner}'s, another user's: run this as that "
                               f"user, not as root (sudo keeps HOME, and the service manager "
                               f"runs a user's services as that user)", status=2)


def _service_file(service: Any, *args: Any, **kw: Any) -> Any:
    """``service.service_file(*args, **kw)``; exit 2 for a setting (a path)
    a service file cannot carry: plistlib refuses control characters."""
    try:
        return service.service_file(*args, **kw)
    except ValueError as exc:
        raise CommandError(f"a path the service file names (the home, --root, --socket) "
                           f"cannot go into it: {exc}", status=2) from None


def install_service(args: argparse.Namespace) -> int:
    from kvkeeper import service

    if not args.print:
        # First: the settings' own checks would refuse the user's store as
        # another uid's, and not say why (sudo).
        # (Where the files go does not depend on the settings.)
        _not_another_users_home(_service_file(service, [], 20.0, _platform(args)))
    serve_args, values = _service_settings(args)
    try:
        python_path = service.pinned_python_path()
    except ValueError as exc:
        raise CommandError(str(exc), status=2) from None
    sf = _service_file(service, serve_args, values["drain_timeout"], _platform(args),
                       background=values["cpu_policy"] == "batch", python_path=python_path)
    _warn_if_cached(service)
    if args.print:
        print(sf.content.decode(), end="")
        return 0
    if not args.no_load:
        _refuse_a_daemon_the_service_did_not_start(sf, values)
    try:
        service.install(sf, load=not args.no_load)
    except service.ServiceError as exc:
        raise CommandError(f"wrote {sf.path}, but loading it failed: {exc} (with --no-load, "
                           f"install-service only writes the file)") from None
    if not args.no_load:
        out.print(Text.assemble("installed ", shown(sf.path), " and started it"))
        return 0
    # What install() runs: launchd refuses to bootstrap a label still loaded
    # (an earlier install's), hence its bootout first, whose failure when
    # nothing is loaded does not matter.
    # (launchd: and the wait install() makes for the label to be let go of,
    # bounded: pasted as bootout then bootstrap, it hit that race.)
    settle = ([f"for i in $(seq 60); do {shlex.join(sf.pid_command)} >/dev/null 2>&1 || break; "
               f"sleep 1; done"] if sf.wait_unregistered else [])
    start = "; ".join([*(shlex.join(c) + " 2>/dev/null" for c in sf.stop_first), *settle,
                       " && ".join(map(shlex.join, sf.load))])
    # launchd loads every agent in LaunchAgents at login.
    enabled = any(map(_wanted_by, sf.links))
    if sf.links and not enabled:
        how = ", not started (nor at login until enabled). To start it:"
    elif sf.links:
        how = (", not restarted (a daemon an earlier install started, if one runs, keeps its "
               "command line until then). To restart it:")
    else:
        how = ", not (re)started (it starts at the next login). To start it now:"
    out.print(Text.assemble("installed ", shown(sf.path), how))
    out.print(Text.assemble("  ", shown(start)), soft_wrap=True)
    return 0


def _warn_if_cached(service: Any) -> None:
    """Warn when the interpreter the service is to run lives in a cache
    (``uvx kvkeeper install-service``): the service stops starting once the
    cache is cleared, long after the install said it was done."""
    python = service.serve_command([])[0]
    cache = service.cache_holding(python)
    if cache is not None:
        err.print(Text.assemble(
            "kvkeeper: warning: the service runs ", shown(python), ", which is inside the "
            "cache directory ", shown(cache), " (uvx and pipx run the tools they run from "
            "theirs): once that cache is cleared (uv cache clean; pipx after 14 days "
            "unused), the service no longer starts. Install kvkeeper where it stays (a "
            "virtual environment, or uv tool install), and run install-service from there."))


def _wanted_by(link: Path) -> bool:
    """Whether systemd starts the unit at login for this entry of
    default.target.wants: a symlink of the unit's name, wherever it leads
    (systemd goes by the name; dangling too), unless to an empty file or a
    device (masked: /dev/null). A file that is not a symlink is ignored."""
    if not link.is_symlink():
        return False
    try:
        st = os.stat(link)
    except OSError:
        return True
    return not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                or (stat.S_ISREG(st.st_mode) and st.st_size == 0))


def uninstall_service(args: argparse.Namespace) -> int:
    from kvkeeper import service

    sf = _service_file(service, [], 20.0, _platform(args))
    _not_another_users_home(sf)
    # A file deleted by hand leaves its service loaded, maybe running.
    orphan = None if args.no_load or sf.path.exists() else _service_pid(sf)
    try:
        existed = service.uninstall(sf, unload=not args.no_load)
    except service.ServiceError as exc:
        raise CommandError(f"stopping the service failed, so {sf.path} stays: {exc} (with "
                           f"--no-load, uninstall-service only removes the file)") from None
    if orphan and not existed:
        left = _service_pid(sf)
        if left:
            raise CommandError(f"no service file at {sf.path}, and the service still runs "
                               f"without it (pid {left}): stopping it failed")
        out.print(Text.assemble("no service file at ", shown(sf.path), "; stopped the service "
                                f"still running without it (pid {orphan})"))
        return 0
    out.print(Text.assemble("removed " if existed else "no service file at ", shown(sf.path)))
    return 0


def _service_pid(sf: Any) -> int | None:
    """The service's running pid; None also when the manager cannot be asked
    (uninstall-service then does what it can and says no more)."""
    from kvkeeper import service

    try:
        return service.running_pid(sf)
    except service.ServiceError:
        return None
