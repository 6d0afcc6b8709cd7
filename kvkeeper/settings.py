"""The daemon's effective settings, and where each came from.

Precedence: command-line flag > environment (``KVKEEPER_*``) > config file
(TOML) > default. ``kvkeeper serve --print-config`` shows the result.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvkeeper import config
from kvkeeper.cpupolicy import check_cpu_policy
from kvkeeper.logs import get_logger

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = get_logger(__name__)

MiB = 1024**2
GiB = 1024**3
ENV_CONFIG = "KVKEEPER_CONFIG"


class SettingsError(config.ConfigError, ValueError):
    """A setting with a value that cannot be used; the message names its source.

    A ValueError too: what a ``Client`` raises for a bad ``socket`` argument
    is what it raises for a bad ``$KVKEEPER_SOCKET``."""


def _not_a(what: str, value: Any) -> ValueError:
    """The error for a config file value of the wrong TOML type."""
    if isinstance(value, bool):
        # bool is an int: `drain_timeout = true` was taken as 1 second.
        return ValueError(f"{what}, not the boolean {str(value).lower()}")
    return ValueError(f"{what}, not {value!r} ({type(value).__name__})")


#: The size suffixes, for parse_size and format_size (binary: 1K is 1024).
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def format_size(n: int) -> str:
    """``n`` bytes as parse_size reads them back, in the largest unit that
    writes it whole: "1G", "512M", "1000"."""
    for unit, scale in sorted(_SIZE_UNITS.items(), key=lambda u: -u[1]):
        if n and n % scale == 0:
            return f"{n // scale}{unit.upper()}"
    return str(n)


def plain_float(text: str) -> float:
    """float() of a number a person wrote, a size's or a duration's: not
    "1_000" or digits of other scripts ("١٠٠"), which float() takes too and
    no one means; ValueError else."""
    if not text.isascii() or "_" in text:
        raise ValueError(text)
    return float(text)


def parse_size(text: str | int | float) -> int:
    """Byte sizes: 1073741824, "512M", "1G", "1.5GiB", "0"."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise _not_a('a size must be a number of bytes or a string such as "512M"', text)
    if isinstance(text, int):
        value = text
    elif isinstance(text, float):
        if not math.isfinite(text):
            raise ValueError(f"a size must be a finite number of bytes, not {_as_given(text)}")
        # TOML's 50.0 or 1e3: bytes written as a float are surely a unit missing.
        raise ValueError(f"a size without a unit is a whole number of bytes, not the float "
                         f"{_as_given(text)} (write an integer, or a string such as \"50G\")")
    else:
        t = str(text).strip().lower()
        # "iB" only after a unit: "5iB" (a 5GiB with the G lost) was 5 bytes.
        t = t[:-2] if t.endswith("ib") and t[-3:-2] in ("k", "m", "g", "t") \
            else t.removesuffix("b")
        num, unit = (t[:-1], t[-1]) if t and t[-1] in _SIZE_UNITS else (t, "")
        if num.strip().isascii() and num.strip().isdigit():
            # Exact: through a float, 2**63 - 1 became 2**63 (over the limit).
            # (int() refuses over 4300 digits, with advice about Python.)
            digits = num.strip().lstrip("0")
            value = int(digits or "0") * _SIZE_UNITS[unit] if len(digits) <= 30 else MAX_SIZE + 1
            return _in_range(value, text)
        try:
            number = plain_float(num) * _SIZE_UNITS[unit]
        except ValueError:
            raise ValueError(f"not a byte size: {_as_given(text)} (try 512M or 1G)") from None
        # float() takes "inf", "nan" and "1e400" (inf); int() of them fails
        # with an OverflowError no caller expects.
        if not math.isfinite(number):
            raise ValueError(f"a size must be a finite number of bytes, not {_as_given(text)}")
        # Cut to whole bytes, "1.5" would be a disk budget of 1 byte (every
        # entry evicted) and "0.5" none at all: surely a missing unit. So is
        # "2.0" or "1e3" (integers are not written so).
        if (unit == "" and any(c in num for c in ".e")) or (
                number != int(number) and int(number) == 0):
            hint = (f' (a unit missing? e.g. "{num.strip()}G")'
                    if unit == "" and "e" not in num else "")
            raise ValueError(f"a size is a whole number of bytes, not {_as_given(text)}{hint}")
        value = int(number)
    return _in_range(value, text)


def _in_range(value: int, text: object) -> int:
    if value < 0:
        raise ValueError(f"a size cannot be negative: {_as_given(text)}")
    if value > MAX_SIZE:
        # ZeroMQ's message size limit (an int64) takes the pending budget.
        raise ValueError(f"a size must be at most {MAX_SIZE} bytes (8 EiB), not "
                         f"{_as_given(text)}")
    return value


#: The start of a setting's source when it came from the config file (the
#: file's path follows; ``serve --print-config`` shows it escaped).
FROM_FILE = "config file "


def path_text(path: object) -> str:
    """A path for a message: as it is, or its repr when it holds what a
    terminal would not show as written (a tab, an ESC, a byte not UTF-8)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def _as_given(text: object) -> str:
    """``text`` for a message, cut short (repr of an int of over 4300 digits
    raises ValueError, with advice about Python itself)."""
    try:
        r = repr(text)
    except ValueError:
        return "a number of thousands of digits"
    return r if len(r) <= 60 else f"{r[:57]}..."


#: The largest byte size a setting takes.
MAX_SIZE = 2**63 - 1


def physical_memory() -> int | None:
    """This machine's memory in bytes, or None when the system does not tell."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf, or not these names
        return None


def memory_share(floor: int) -> int:
    """A quarter of this machine's physical memory (or of its cgroup's
    limit, when lower), at least ``floor`` (also when the system does not
    tell). The default budget for saves in flight, on both sides of the
    socket: a conversation's cache is saved only if it fits whole, and a
    fixed 1 GiB left every Llama-3-8B conversation past about 7,600 tokens
    unsaved, on any machine."""
    total = usable_memory()
    if total is None:
        return floor
    return max(floor, total // 4 // MiB * MiB)  # whole MiB: shown as 5885M, not 6170946K


def usable_memory() -> int | None:
    """This machine's memory, or its cgroup's limit when lower (a
    container's memory is its limit); None when the system does not tell."""
    total = physical_memory()
    if total is None:
        return None
    limit = cgroup_memory_limit()
    return total if limit is None else min(total, limit)


def cgroup_memory_limit() -> int | None:
    """The smallest memory limit set on this process's cgroup or one above
    it (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes`` and
    ``hierarchical_memory_limit``, which also counts ancestors a container
    does not show), as Linux shows them under /proc/self; None when there is
    none, or no Linux. Never raises: every Client() and ``serve --help`` ask."""
    try:
        return _cgroup_memory_limit()
    except (OSError, ValueError):  # names are bytes: a cgroup "caf\xe9" is no UTF-8
        return None


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", "surrogateescape")


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _unescaped(field: str) -> str:
    """A mountinfo field as the path it is: "\\040" is a space."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_memory_limit() -> int | None:
    try:
        groups = _read(Path("/proc/self/cgroup")).splitlines()
        mounts = _read(Path("/proc/self/mountinfo")).splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}  # file system type -> this process's cgroup
    for line in groups:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            paths["cgroup2"] = path
        elif "memory" in controllers.split(","):
            paths["cgroup"] = path
    limits: list[int] = []
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in paths:
            continue
        if tail[0] == "cgroup" and "memory" not in tail[2].split(","):
            continue
        root, top = _unescaped(fields[3]), Path(_unescaped(fields[4]))
        rel = os.path.relpath(paths[tail[0]], root)
        if rel.startswith(".."):
            continue  # a cgroup outside what this mount shows
        v2 = tail[0] == "cgroup2"
        d = Path(os.path.normpath(top / rel))
        if not v2:
            with contextlib.suppress(OSError):
                for stat in _read(d / "memory.stat").splitlines():
                    key, _, value = stat.partition(" ")
                    if key == "hierarchical_memory_limit" and _is_number(value.strip()):
                        limits.append(int(value))
        while True:
            try:
                text = _read(d / ("memory.max" if v2 else "memory.limit_in_bytes")).strip()
            except OSError:
                text = ""
            if _is_number(text):  # v2 says "max" for none, v1 a number near 2**63
                limits.append(int(text))
            if d == top or d.parent == d:
                break
            d = d.parent
    return min(limits) if limits else None


#: The least --max-pending-bytes: a quarter goes to ZeroMQ's queue, and with
#: less the writer could take next to no save (every one dropped as too large).
MIN_PENDING_BYTES = 1024 * 1024


def _pending_size(value: Any) -> int:
    v = parse_size(value)
    if v == 0:
        raise ValueError("must be more than 0 bytes (0 would refuse every save)")
    if v < MIN_PENDING_BYTES:
        raise ValueError(f"must be at least 1M, not {v} bytes (less leaves the writer room "
                         f"for next to no save: every save would be dropped as too large)")
    return v


#: The least --max-disk-bytes other than 0 (none). Below it no cache fits,
#: and every entry would be evicted at start: a unit left out ("50").
MIN_DISK_BYTES = 1024 * 1024


def _disk_size(value: Any) -> int:
    v = parse_size(value)
    if 0 < v < MIN_DISK_BYTES:
        raise ValueError(f"must be 0 (no budget) or at least 1M, not {v} bytes (a budget that "
                         f"small holds no cache: every entry would be evicted; sizes take "
                         f"K/M/G/T suffixes)")
    return v


def parse_path(value: Any) -> Path:
    """A directory setting (``~`` expanded); raises ValueError when empty."""
    if not isinstance(value, (str, os.PathLike)):
        raise _not_a("a path must be a string", value)
    if not os.fspath(value):
        # Path("") is the current directory: surely not what was meant.
        raise ValueError("the path is empty")
    return config.expanded(value)


def _socket(value: Any) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise _not_a("a socket must be a string", value)
    return config.socket_path(value)


def _level(value: Any) -> str:
    if not isinstance(value, str):
        raise _not_a("log level must be the string debug, info, warning or error", value)
    v = value.lower()
    if v not in ("debug", "info", "warning", "error"):
        raise ValueError(f"log level must be debug, info, warning or error, not {value!r}")
    return v


def _cpu_policy(value: Any) -> str:
    if not isinstance(value, str):
        raise _not_a("cpu policy must be the string batch or normal", value)
    return check_cpu_policy(value.lower())


#: The most any seconds setting takes.
MAX_SECONDS = 86_400




def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _not_a("seconds must be a number", value)
    try:
        v = plain_float(value) if isinstance(value, str) else float(value)
    except ValueError:
        raise ValueError(f"not a number of seconds: {value!r} (a plain number: 5 or 0.5, "
                         f"no unit)") from None
    # nan passes every comparison: --drain-timeout nan got as far as SIGTERM.
    if not math.isfinite(v):
        raise ValueError(f"seconds must be a finite number, not {value!r}")
    if v < 0:
        raise ValueError(f"seconds cannot be negative: {value!r}")
    # The drain timeout becomes the service manager's stop timeout, which
    # has a limit of its own (launchd's plist integer, systemd's time
    # value), and none of these waits means anything past a day.
    if v > MAX_SECONDS:
        raise ValueError(f"seconds must be at most {MAX_SECONDS} (a day), not {value!r}")
    return v


def _stall_seconds(value: Any) -> float:
    v = _seconds(value)
    # Less would fail a live client's save over an ordinary gap between two
    # of its messages on a busy machine (the writer parks a save after 0.5 s).
    if v < 1:
        raise ValueError(f"must be at least 1 second, not {value!r}")
    return v


@dataclass(frozen=True)
class Setting:
    name: str  # as in the config file; the flag is --name-with-dashes
    parse: Callable[[Any], Any]
    default: Callable[[], Any]
    help: str
    #: What the value is, for the command line's flag: "path", "socket",
    #: "size", "seconds" or "text" (the flag's own check, before ``parse``).
    kind: str = "text"

    @property
    def env(self) -> str:
        return "KVKEEPER_" + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    # The built-in defaults: the environment is a layer of its own (serve
    # --help showed $KVKEEPER_ROOT as the default, and the other settings'
    # variables not).
    Setting("root", parse_path, functools.partial(config.default_root, environment=False),
            "store directory", "path"),
    Setting("socket", _socket, functools.partial(config.default_socket, environment=False),
            "ipc socket path", "socket"),
    Setting("max_pending_bytes", _pending_size, lambda: memory_share(1 * GiB),
            "memory for saves received but not yet written (at least 1M); a save that "
            "does not fit is refused and counted; the default is a quarter of this "
            "machine's memory (of its cgroup's limit, in a container), at least 1G", "size"),
    Setting("max_disk_bytes", _disk_size, lambda: 20 * GiB,
            "disk budget over everything under the root (0: none, else at least 1M); "
            "least recently used entries are evicted past it", "size"),
    Setting("min_free_bytes", parse_size, lambda: 5 * GiB,
            "free space kept on the store's file system (sessions/'s: the root's unless a "
            "disk is mounted there); entries are evicted to keep it (0 for none; set past the "
            "disk's free space, every entry goes)", "size"),
    Setting("min_write_interval", _seconds, lambda: 0.25,
            "seconds a cache's writes are kept apart: a save of up to 64 MiB that "
            "comes sooner after its cache's last write waits out the rest, and a newer "
            "save of the cache replaces it meanwhile; a flush or a load of the cache by "
            "the client that saved it, a delete of the cache, a memory budget more than "
            "half used and shutdown end the wait (other clients reading the file directly "
            "see the version written before) "
            "(0: write every save as it arrives)", "seconds"),
    Setting("drain_timeout", _seconds, lambda: 20.0,
            "on SIGTERM, SIGINT or SIGHUP, seconds to keep writing saves already "
            "received", "seconds"),
    Setting("stall_timeout", _stall_seconds, lambda: 10.0,
            "seconds (1 or more) a save whose client stops sending part way, connection open "
            "(paused, stopped, starved), waits for its next bytes before it fails and "
            "its memory and tmp file are freed; other saves go by meanwhile, and a "
            "client that exits or hangs up is cut off within about 1 s", "seconds"),
    Setting("cpu_policy", _cpu_policy, lambda: "batch",
            "batch: on Linux the daemon's threads run under SCHED_BATCH, so waking up "
            "never takes a core from a running thread such as the generation loop (when "
            "every core is busy, its answers come a few ms later), and on macOS its "
            "LaunchAgent is ProcessType Standard; normal: they keep the policy the daemon "
            "was started with (the LaunchAgent: Interactive)"),
    Setting("log_level", _level, lambda: "info", "debug, info, warning or error"),
)
BY_NAME = {s.name: s for s in SETTINGS}


def default_config_file(environ: Mapping[str, str] | None = None) -> Path:
    """$KVKEEPER_CONFIG, else $XDG_CONFIG_HOME/kvkeeper/config.toml (an
    absolute one), else ~/.config/kvkeeper/config.toml; ConfigError when
    that needs a home directory there is none of."""
    environ = os.environ if environ is None else environ
    env = environ.get(ENV_CONFIG)
    if env:
        return config.expand_user(env)
    base = config.xdg_dir("XDG_CONFIG_HOME", environ) or str(config.home_dir() / ".config")
    return Path(base) / "kvkeeper" / "config.toml"


def _config_values(config_file: Path | None,
                   environ: Mapping[str, str]) -> tuple[Path, dict[str, Any]]:
    """The config file's path and its values (none if it does not exist)."""
    # A file named by $KVKEEPER_CONFIG is asked for as much as one given by
    # --config: its absence is an error, not a silent fallback to defaults.
    explicit = config_file is not None or bool(environ.get(ENV_CONFIG))
    try:
        path = config_file or default_config_file(environ)
    except config.ConfigError:
        # No home directory to hold one: no config file (a default that
        # needs the home, such as the root's, says so if it is used).
        return Path("~/.config/kvkeeper/config.toml"), {}
    if not path.exists():
        if explicit:
            raise SettingsError(f"config file {path_text(path)} does not exist")
        return path, {}
    try:
        return path, tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"config file {path_text(path)}: {exc}") from None


def resolve(
    flags: Mapping[str, Any],
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Effective values and, for each, where it came from."""
    environ = os.environ if environ is None else environ
    path, file_values = _config_values(config_file, environ)
    unknown = _unknown(file_values)
    if unknown:
        raise SettingsError(f"config file {path_text(path)}: unknown settings {unknown}; "
                            f"known: {sorted(BY_NAME)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        candidates = [
            (flags.get(s.name), f"flag --{s.name.replace('_', '-')}"),
            # Empty means unset, as for the clients (KVKEEPER_ROOT= is not the cwd).
            (environ.get(s.env) or None, f"environment {s.env}"),
            (file_values.get(s.name), f"{FROM_FILE}{path}"),
        ]
        values[s.name], sources[s.name] = _first_set(s, candidates)
    return values, sources


def _first_set(s: Setting, candidates: list[tuple[Any, str]]) -> tuple[Any, str]:
    """The first candidate that is set, parsed, and its source; else the
    default. Raises SettingsError naming the source of a value it refuses."""
    for raw, source in candidates:
        if raw is not None:
            try:
                value = s.parse(raw)
            except (ValueError, TypeError) as exc:
                raise SettingsError(f"{s.name} from {source}: {exc}") from None
            if isinstance(value, Path) and not value.is_absolute() \
                    and source.startswith(FROM_FILE):
                # One file serves serve (under launchd its directory is /, under
                # systemd $HOME) and every client, each from its own directory.
                raise SettingsError(f"{s.name} from {source}: {raw!r} is a relative path, "
                                    f"which each process would take from the directory it "
                                    f"started in; give an absolute path (or one starting "
                                    f"with ~)")
            return value, source
    return s.default(), "default"


def client_path(name: str) -> Path:
    """The ``socket`` or ``root`` a client uses when none is given: the one
    ``serve`` would use without flags (``$KVKEEPER_SOCKET``/``_ROOT``, else
    the config file's, else the default), so one config file serves both
    sides. Only this setting is looked at: a bad value of another one is
    ``serve``'s to report. Raises SettingsError when this setting's value, or
    the config file itself, cannot be used, as ``serve`` would: falling back
    to the default would look for a daemon where none is."""
    s = BY_NAME[name]
    env = os.environ.get(s.env) or None
    candidates: list[tuple[Any, str]]
    if env is not None:  # the config file is not even read
        candidates = [(env, f"environment {s.env}")]
    else:
        path, values = _config_values(None, os.environ)
        _warn_unknown(path, values)
        candidates = [(values.get(name), f"{FROM_FILE}{path}")]
    return Path(_first_set(s, candidates)[0])


def unknown_settings() -> tuple[Path, list[str]] | None:
    """The config file clients would read and the settings in it that do not
    exist, if any (None also when the file cannot be read: the setting a
    command needs reports that)."""
    try:
        path, values = _config_values(None, os.environ)
    except SettingsError:
        return None
    unknown = _unknown(values)
    return (path, unknown) if unknown else None


def _unknown(values: Mapping[str, Any]) -> list[str]:
    """The names in a config file's values that are no setting, sorted."""
    return sorted(set(values) - set(BY_NAME))


_WARNED_UNKNOWN: set[tuple[str, tuple[str, ...]]] = set()


def _warn_unknown(path: Path, values: Mapping[str, Any]) -> None:
    """Log, once per file and set of names, settings the file has that do not
    exist. ``serve`` refuses such a file; a client goes on (its save() must
    not fail for it), but a typo of ``socket`` or ``root`` would otherwise
    send it to the default, where no daemon is, with nothing said why."""
    unknown = tuple(_unknown(values))
    if unknown and (str(path), unknown) not in _WARNED_UNKNOWN:
        _WARNED_UNKNOWN.add((str(path), unknown))
        log.warning(
            "event=config_unknown_settings file=%s unknown=%s known=%s: kvkeeper serve "
            "refuses this file", path, ",".join(unknown), ",".join(sorted(BY_NAME)))
