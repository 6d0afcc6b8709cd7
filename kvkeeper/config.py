"""Where things live by default, and the checks every private directory passes.

Shared by the daemon and the client (both must agree on the default socket and
root); it imports nothing heavy.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

ENV_ROOT = "KVKEEPER_ROOT"
ENV_SOCKET = "KVKEEPER_SOCKET"
SOCKET_NAME = "kvkeeper.sock"
#: sun_path is 108 bytes on Linux and 104 on macOS and the BSDs, NUL included.
MAX_SOCKET_PATH = 107 if sys.platform.startswith("linux") else 103


class ConfigError(Exception):
    """A path or setting the daemon refuses to run with; the message says why."""


def expanded(text: str | os.PathLike[str]) -> Path:
    """``text`` as a path, ``~`` expanded; ValueError for a ``~`` that names
    no user with a home directory (``~nosuchuser``)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ValueError(f"{os.fspath(text)}: its ~ names no user with a home directory") from None


def expand_user(text: str) -> Path:
    """``text`` as a path, ``~`` expanded where it can be: ``~nosuchuser``
    stays as it is, for the setting's own check to refuse with a message
    (a default computed while the command line is read must not fail)."""
    try:
        return expanded(text)
    except ValueError:
        return Path(text)


def home_dir() -> Path:
    """The user's home directory; ConfigError when it cannot be told (HOME
    unset, and no password entry for this uid: a container's)."""
    try:
        return Path.home()
    except RuntimeError:
        raise ConfigError(f"cannot tell this user's home directory (HOME is not set and uid "
                          f"{os.getuid()} has no password entry), where the default root and "
                          f"config file are: set HOME, or give --root and --socket") from None


def xdg_dir(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """An XDG base directory variable's value, None unless it is an absolute
    path: the spec says a relative one is to be ignored (each process would
    take it from its own working directory: a daemon and its clients then
    looked in different places)."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value and os.path.isabs(value) else None


def default_root(*, environment: bool = True) -> Path:
    """Store root: $KVKEEPER_ROOT (unless not ``environment``), else the
    user's cache dir + /kvkeeper. Raises ConfigError when that needs a home
    directory there is none of."""
    env = os.environ.get(ENV_ROOT) if environment else None
    if env:
        return expand_user(env)
    if sys.platform == "darwin":
        return home_dir() / "Library" / "Caches" / "kvkeeper"
    base = xdg_dir("XDG_CACHE_HOME") or str(home_dir() / ".cache")
    return Path(base) / "kvkeeper"


def default_socket(*, environment: bool = True) -> Path:
    """Socket path: $KVKEEPER_SOCKET (unless not ``environment``), else a
    per-user 0700 runtime dir."""
    env = os.environ.get(ENV_SOCKET) if environment else None
    if env:
        try:
            return socket_path(env)
        except ValueError:  # serve's settings report it; a client finds no daemon there
            return expand_user(env)
    if sys.platform == "darwin":
        # The user's own temp directory (/var/folders/...), short enough, as
        # the system tells it: $TMPDIR, which launchd sets to it, is unset
        # under sudo and cron and another under nix-shell, where clients
        # then looked for the daemon elsewhere and dropped every save.
        tmp = darwin_user_temp_dir() or os.environ.get("TMPDIR") or "/tmp"
        base = Path(tmp) / f"kvkeeper-{os.getuid()}"
    else:
        runtime = xdg_dir("XDG_RUNTIME_DIR")
        base = Path(runtime) / "kvkeeper" if runtime else Path(f"/tmp/kvkeeper-{os.getuid()}")
    return base / SOCKET_NAME


#: confstr(3)'s _CS_DARWIN_USER_TEMP_DIR (os.confstr takes the number).
_CS_DARWIN_USER_TEMP_DIR = 65537


def darwin_user_temp_dir() -> str | None:
    """macOS's per-user temp directory, from the system rather than the
    environment; None where there is none (other systems)."""
    try:
        return os.confstr(_CS_DARWIN_USER_TEMP_DIR) or None
    except (OSError, ValueError):  # EINVAL elsewhere
        return None


IPC_SCHEME = "ipc://"


def endpoint(socket_path: Path) -> str:
    return f"{IPC_SCHEME}{socket_path}"


def socket_path(value: str | os.PathLike[str]) -> Path:
    """A socket given as a path or as the endpoint kvkeeper prints in its
    messages (``ipc://`` + path). Raises ValueError for another transport."""
    text = os.fspath(value)
    if text.startswith(IPC_SCHEME):
        text = text[len(IPC_SCHEME):]
    elif "://" in text:
        raise ValueError(f"{text!r}: kvkeeper listens on a local socket only: give its path "
                         f"(or {IPC_SCHEME}<path>)")
    if not text:
        raise ValueError("the socket path is empty")
    return expanded(text)


def check_socket_path(socket_path: Path) -> None:
    """Raise ConfigError for a socket path ZeroMQ cannot bind or connect:
    over the platform's length once absolute, or not valid UTF-8."""
    socket_path = Path(os.path.abspath(socket_path))
    _check_utf8(socket_path, "socket path")
    n = len(os.fsencode(str(socket_path)))
    if n > MAX_SOCKET_PATH:
        raise ConfigError(
            f"socket path {str(socket_path)!r} is {n} bytes; this platform allows "
            f"{MAX_SOCKET_PATH}. Choose a shorter --socket or {ENV_SOCKET}."
        )


def check_private_dir(path: Path, what: str) -> None:
    """What `private_dir` would refuse, found without creating anything: so a
    daemon refused for one directory leaves no other one made behind."""
    path = Path(os.path.abspath(path))
    _check_utf8(path, what)
    if os.path.lexists(path):
        check_ours(path, what)
        return
    parent = path.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create {what} {str(path)!r}: {str(parent)!r} "
                          f"is not a directory this user can write in")


def _check_utf8(path: Path, what: str) -> None:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        # Replies name files by path, in UTF-8: a client could not open them.
        raise ConfigError(f"{what} {str(path)!r} is not valid UTF-8; choose another") from None


def private_dir(path: Path, what: str) -> Path:
    """Create ``path`` (mode 0700) if missing, then insist it is a real directory
    of ours that nobody else can enter. Returns the absolute path."""
    path = Path(os.path.abspath(path))
    _check_utf8(path, what)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create {what} {str(path)!r}: {exc.strerror}") from None
    check_ours(path, what)
    return path


def _same_place(a: Path, b: Path) -> bool:
    """Whether two paths name one directory, however written (HOME given
    with "..", or through a symlink)."""
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:  # a relative one, and the working directory is gone
        return os.path.normpath(a) == os.path.normpath(b)


def check_ours(path: Path, what: str, *, writable: bool = True) -> None:
    """Refuse a directory that is a symlink, not ours, open to group or
    others, or (``writable``) one this user cannot make files in."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        try:
            # macOS's /tmp is a link to /private/tmp: --socket /tmp/kv.sock
            # is to get the advice /private/tmp/kv.sock gets.
            shared = _shared(os.stat(path))
        except OSError:
            shared = False
        raise ConfigError(f"{what} {str(path)!r} is a symlink; refusing to follow it"
                          + (_own_place(path, what, shared=True) if shared else ""))
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {str(path)!r} is not a directory")
    own_place = _own_place(path, what, shared=_shared(st))
    if st.st_uid != os.getuid():
        raise ConfigError(f"{what} {str(path)!r} is owned by uid {st.st_uid}, not by us"
                          f"{own_place}")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{what} {str(path)!r} has mode {stat.S_IMODE(st.st_mode):o}; it must not be "
            f"open to group or others" + (own_place or CHMOD_IT)
        )
    if writable:
        check_writable(path, what)


#: The advice for a directory of one's own open to others. (A volume whose
#: modes come from its mount, exFAT or FAT, shows 777 whatever chmod does.)
CHMOD_IT = (" (chmod 700 it); on a file system that keeps no modes, such as exFAT or FAT, "
            "use a directory on another")


def _shared(st: os.stat_result) -> bool:
    """Whether a directory is one every user shares (/tmp: sticky, open to all)."""
    return bool(stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
                and st.st_mode & stat.S_IWOTH)


def _own_place(path: Path, what: str, *, shared: bool) -> str:
    """Where to go instead of ``path``, for a refusal; "" where chmod is the
    advice. A directory every user shares (/tmp) must not be chmod-ed: the
    place wanted is a directory of this user's own inside it, which start-up
    makes. (Inside another user's, nothing can be made.)"""
    own_place = ""
    if shared and what == "root directory":
        # A shared directory is /tmp, or like it: emptied at boot, and a
        # store is to outlive restarts.
        try:
            # (Not $KVKEEPER_ROOT's: that may be the directory refused.)
            built_in = default_root(environment=False)
        except ConfigError:  # no home directory: no default to point to
            built_in = path
        default = ("" if _same_place(built_in, path)
                   else f" (the default root is {str(built_in)!r})")
        own_place = f"; keep the store in a directory of its own that outlives a reboot{default}"
    elif shared or _same_place(path, Path(os.path.expanduser("~"))):
        # Nor is a home directory to be chmod-ed for a socket.
        own_place = (f"; use a directory of its own inside it instead (e.g. "
                     f"{str(path / (f'kvkeeper-{os.getuid()}' if shared else '.kvkeeper'))!r}: "
                     f"made at start, mode 700)")
    return own_place


def check_flag(name: str, value: object) -> bool:
    """``value`` when it is True or False; TypeError otherwise: a flag given
    "no" would be taken as true."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


def check_writable(path: Path, what: str) -> None:
    """Refuse a directory the daemon cannot make files in: it failed later,
    with a traceback (its lock file) or at every save."""
    if not os.access(path, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = ("it is on a read-only file system: choose a place on a writable one"
               if read_only else "chmod 700 it, as its owner")
        raise ConfigError(f"{what} {str(path)!r} cannot be written by this user: the daemon "
                          f"makes its files there ({why})")
