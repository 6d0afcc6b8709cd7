"""``kvkeeper``: run the daemon, look at and look after what it stores."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvkeeper import __version__

EPILOG = """\
Settings for serve come from flags, then KVKEEPER_* environment variables
(KVKEEPER_ROOT, KVKEEPER_SOCKET, KVKEEPER_MAX_DISK_BYTES, ...), then the TOML
config file ($KVKEEPER_CONFIG or $XDG_CONFIG_HOME/kvkeeper/config.toml, by
default ~/.config/kvkeeper/config.toml), then defaults;
`kvkeeper serve --print-config` shows the result. The other commands, given
no --socket, use the socket serve would resolve. Sizes take K/M/G/T suffixes
(1.5G), binary (1K is 1024; KB and KiB mean the same); without one they are
whole bytes.
Exit status: 0 ok, 1 failed, 2 usage or another daemon holds the root,
3 no daemon running, 130 interrupted (Ctrl-C), 143 SIGTERM (serve drains
instead for either), 141 the output's reader went away (| head).
KVKEEPER_DEBUG set to any value that is not empty
shows the client library's warnings and errors on stderr too."""


def _flag_value(parse: Callable[[str], Any], text: str) -> Any:
    """``parse(text)``, its ValueError's message made argparse's error."""
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    from kvkeeper.settings import parse_size

    return _flag_value(parse_size, text)


def _number(text: str) -> float:
    """A seconds flag's number; its range is checked with the other settings'."""
    from kvkeeper.settings import plain_float

    try:
        return plain_float(text)
    except ValueError:
        # As for the same value from the environment or the config file:
        # argparse's "invalid float value: '5s'" did not say what was wrong.
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r} (a plain "
                                         f"number: 5 or 0.5, no unit)") from None


def _path(text: str) -> Path:
    from kvkeeper.settings import parse_path

    return _flag_value(parse_path, text)


def _file_path(text: str) -> Path:
    """A file or directory argument as given; never "" (Path("") is the
    current directory, which import would then search whole)."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty")
    return Path(text)


def _socket(text: str) -> Path:
    from kvkeeper.config import socket_path

    return _flag_value(socket_path, text)


def _socket_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", type=_socket, default=None, metavar="PATH",
                   help="daemon socket (default: $KVKEEPER_SOCKET, else the config file's, "
                        "else the per-user default)")


def _serve_settings(p: argparse.ArgumentParser, *, for_service: bool = False) -> None:
    from kvkeeper.settings import SETTINGS, format_size

    p.add_argument("--config", type=_path, default=None, metavar="FILE",
                   help="TOML config file, which must exist (default $KVKEEPER_CONFIG, "
                        "which must exist too, else $XDG_CONFIG_HOME/kvkeeper/config.toml, "
                        "by default ~/.config/kvkeeper/config.toml, if it exists)")
    flag_types: dict[str, Callable[[str], Any]] = {"path": _path, "socket": _socket,
                                                   "size": _size, "seconds": _number, "text": str}
    from kvkeeper.config import ConfigError

    for s in SETTINGS:
        try:
            default = s.default()
        except ConfigError:  # no home directory: serve --help must still answer
            default = "none: this user has no home directory; give it"
        if s.kind == "size":
            # As a person would write it (1G, not 1073741824), and how.
            default = f"{format_size(default)}; bytes, or with a K, M, G or T suffix (1K = 1024)"
        p.add_argument(f"--{s.name.replace('_', '-')}", type=flag_types[s.kind], default=None,
                       metavar="PATH" if s.kind in ("path", "socket")
                       else s.name.split("_")[-1].upper(),
                       help=f"{s.help} (default: {default})")
    if not for_service:
        p.add_argument("--print-config", action="store_true",
                       help="print the effective settings and where each came from, then exit "
                            "(2, with the reason, when serve would refuse the root or socket, "
                            "or another daemon holds either)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors name the way past them when what
    went wrong may be an argument starting with '-' (argparse reads "rm m
    -x" as an unknown option, and "export m -x out" as a missing PATH)."""

    dash_hint: str | None = None  # the command's example, where it has one
    given: list[str] = []  # what the command was given (set by _main)
    commands: dict[str, _Parser] = {}  # the top parser's, by name

    def error(self, message: str) -> Any:  # argparse's own is NoReturn
        stray = self._stray_dash() if self.dash_hint is not None else None
        if stray is not None:
            word, option = stray
            way = (f"a value starting with '-' goes after '=' ({option}={word})" if option
                   else self.dash_hint)
            message += f"; {word!r} is no option of {self.prog}: {way}"
        super().error(message)

    def _stray_dash(self) -> tuple[str, str | None] | None:
        """The first word given before any '--' that starts with one '-',
        names none of this parser's options and is not a negative number
        (argparse takes those for arguments), with the option it follows
        when that one takes a value (argparse took it for a missing value).
        A word starting with '--' is more likely a mistyped option."""
        after: str | None = None
        for word in self.given:
            if word == "--":
                return None
            # (argparse takes a word holding a space for an argument too.)
            if (len(word) > 1 and word[0] == "-" and word[1] != "-" and " " not in word
                    and not self._negative_number_matcher.match(word)
                    and not any(known.startswith(word) for known in self._option_string_actions)):
                return word, after
            after = self._takes_value(word)
        return None

    def _takes_value(self, word: str) -> str | None:
        """The option ``word`` names, as argparse reads it (an abbreviation
        of one long option too), when it takes a value not given with '='."""
        named = [word] if word in self._option_string_actions else [
            known for known in self._option_string_actions
            if word.startswith("--") and known.startswith(word)]
        if len(named) != 1 or self._option_string_actions[named[0]].nargs == 0:
            return None
        return named[0]


def _parser() -> _Parser:
    p = _Parser(
        prog="kvkeeper",
        description="Keep MLX prompt caches across restarts. A daemon takes saves off the "
        "generation loop and writes them durably; clients load them back.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kvkeeper {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the daemon in the foreground",
        description="Run the daemon in the foreground until SIGTERM, SIGINT or SIGHUP (the "
        "shell it runs in closing; not under nohup), then write every save already received "
        "(up to --drain-timeout) and exit 0 (1 if the timeout cut the drain short). It also "
        "drains and exits 1 when its socket or the root's lock file is removed or replaced "
        "(the root removed), for a supervisor to start a new daemon. A second "
        "signal during the drain is logged and ignored (SIGKILL is not). One daemon per root: a "
        "second one exits 2, naming the first. The "
        "disk budget (--max-disk-bytes, --min-free-bytes) is applied at start and after every "
        "write, evicting least recently used entries. A setting not given as a flag comes "
        "from its KVKEEPER_* variable, else the config file, else the default shown below; "
        "--print-config shows the values in effect and where each came from.")
    _serve_settings(serve)

    stats = sub.add_parser("stats", help="the daemon's live counters",
                           description="Saves, loads, the writer's queue and latencies, disk "
                           "use against the budget, uptime.")
    _socket_arg(stats)
    stats.add_argument("--json", action="store_true", help="machine-readable output")

    ls = sub.add_parser("ls", help="stored entries",
                        description="Entries with model, id, tokens, size, when saved and "
                        "last used.")
    _socket_arg(ls)
    ls.add_argument("--model", default=None, help="only entries of this model fingerprint")
    ls.add_argument("--all", action="store_true",
                    help="also files that are not entries: legacy-format files and "
                         "quarantined ones (moved aside as unusable), which the disk budget "
                         "evicts (quarantined first), and foreign ones, which are never "
                         "deleted")
    ls.add_argument("--sort", choices=sorted(["last-used", "saved", "size", "tokens", "id",
                                              "model"]), default="last-used",
                    help="order of the entries: last-used (the default) and saved most "
                         "recent first, size and tokens largest first, id and model A to "
                         "Z (model, then id)")
    ls.add_argument("--reverse", action="store_true", help="reverse the order")
    ls.add_argument("--json", action="store_true", help="machine-readable output")

    rm = sub.add_parser("rm", help="delete one entry, or all of a model",
                        description="kvkeeper rm MODEL ID deletes one entry; kvkeeper rm "
                        "--model FP deletes every entry of a model. Give one form, not both "
                        "(anything else exits 2). Exit 1 if MODEL ID names no entry, or FP none, "
                        "or the daemon would not delete one of FP's (the others are deleted, "
                        "and each one left is named). "
                        "A model or id starting with '-' goes after '--' "
                        "(kvkeeper rm -- MODEL -ID).")
    _socket_arg(rm)
    rm.add_argument("model", nargs="?", help="model fingerprint")
    rm.add_argument("cache_id", nargs="?", help="cache id")
    rm.add_argument("--model", dest="all_of_model", default=None, metavar="FP",
                    help="delete every entry of this model (without MODEL ID)")

    gc = sub.add_parser("gc", help="apply the disk budget now and show what went",
                        description="Re-read the root (files added or removed by hand count) "
                        "and evict least recently used entries until the budget holds. Exits "
                        "1 if the gc failed part way (it says how many it evicted first).")
    _socket_arg(gc)
    gc.add_argument("--json", action="store_true", help="machine-readable output")

    verify = sub.add_parser("verify", help="check every file's header and checksums",
                            description="Read every entry's file and check its header and the "
                            "checksum of each tensor. Works without a daemon. Caches of the "
                            "two older formats carry no checksums; safetensors files that are "
                            "no cache (model weights) are listed and left alone, and files "
                            "under names the daemon does not give are not its entries: not "
                            "checked. A file this "
                            "process cannot read (no permission, out of file descriptors) is "
                            "listed as not checked and never moved, and so is a model's directory "
                            "that is a symbolic link to a directory (the daemon follows none). "
                            "Exit 1 if any file is bad "
                            "or could not be checked, with --repair too (damage was found, "
                            "even if every bad file was moved aside: a second run then "
                            "exits 0).")
    _socket_arg(verify)
    verify.add_argument("--root", type=_path, default=None,
                        help="store root (default: the running daemon's; with no daemon, the "
                             "configured, unless --socket names one)")
    verify.add_argument("--repair", action="store_true",
                        help="move bad files aside to <root>/quarantine, or beside their "
                             "place on a model's own disk (through the daemon "
                             "when it runs; a file it may not read, so cannot tell from "
                             "another program's, it leaves in place and the report says so; "
                             "without a daemon, only as the user the root belongs to)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")

    imp = sub.add_parser("import", help="bring existing cache files into the store",
                         description="Import files of the formats users already have: the "
                         "cache_persist.py reference (schema 3) and mlx_lm's "
                         "save_prompt_cache, or kvkeeper's own. Needs the mlx extra and a "
                         "running daemon. Files are written one at a time, each reported; "
                         "a file whose key is already in the store, or has a save the "
                         "daemon received and has not written yet, is not imported (unless "
                         "--replace), nor a second file for a key imported in the run. "
                         "Exit 1 if any file was not imported, or if there was nothing to "
                         "import (only directories with no *.safetensors files); a missing "
                         "or empty PATH exits 2; no daemon, or one that goes away part way, "
                         "exits 3. A file named twice (or found again in a directory named) "
                         "is imported once; a subdirectory that cannot be listed is said and "
                         "skipped.")
    _socket_arg(imp)
    imp.add_argument("paths", nargs="+", type=_file_path, metavar="PATH",
                     help="files, or directories searched (subdirectories too) for "
                          "*.safetensors")
    imp.add_argument("--model", default=None,
                     help="model fingerprint (required for mlx_lm files, which record none, "
                          "unless kvkeeper export wrote them); a file that records another "
                          "model is not imported")
    imp.add_argument("--id", default=None,
                     help="cache id (with one PATH that is or holds one file; default: the "
                          "file's own or its name)")
    imp.add_argument("--replace", action="store_true",
                     help="replace entries already in the store (without it, a file whose "
                          "model and id are stored, or have a save the daemon received and "
                          "has not written yet, is not imported, and exits 1)")
    imp.add_argument("--json", action="store_true", help="machine-readable output")

    exp = sub.add_parser("export", help="write an entry as an mlx_lm prompt-cache file",
                         description="Write an entry to PATH in mlx_lm's save_prompt_cache "
                         "format, for mlx_lm.models.cache.load_prompt_cache, readable by you "
                         "alone (mode 0600, as the store's files: it holds the conversation). "
                         "Its metadata holds the model (kvkeeper_model), the id "
                         "(kvkeeper_cache_id), the token ids (token_ids) and the entry's own "
                         "metadata (kvkeeper_metadata, JSON); kvkeeper import restores each. "
                         "Needs the mlx extra. Works without a daemon, reading the store's "
                         "file. An existing file at PATH is replaced (atomically and durably; "
                         "the output says so); a PATH inside the store is refused (exit 2): its "
                         "files are the daemon's. "
                         "Refused (exit 1): caches mlx-lm's loader cannot rebuild (mlx-vlm's "
                         "classes, DeepSeek V4.1's) or whose offset mlx-lm's file loses (a "
                         "trimmed ConcatenateKVCache; under mlx-lm 0.31 a ChunkedKVCache "
                         "trimmed at the front). A model or id starting with '-' goes after "
                         "'--' (kvkeeper export -- MODEL -ID PATH).")
    _socket_arg(exp)
    exp.add_argument("--root", type=_path, default=None,
                     help="store root to export from (default: the running daemon's; with no "
                          "daemon, the configured, unless --socket names one)")
    exp.add_argument("model", help="model fingerprint")
    exp.add_argument("cache_id", help="cache id")
    exp.add_argument("path", type=_file_path,
                     help="the file to write, ending in .safetensors")

    for name, text in (("install-service", "run the daemon as a user service (launchd or "
                                           "systemd)"),
                       ("uninstall-service", "stop and remove the user service")):
        sp = sub.add_parser(name, help=text, description=text.capitalize() + ": a LaunchAgent "
                            "in ~/Library/LaunchAgents on macOS, a systemd user unit in "
                            "$XDG_CONFIG_HOME/systemd/user (by default ~/.config/systemd/user) "
                            "elsewhere.")
        installing = name == "install-service"
        sp.add_argument("--platform", choices=["macos", "linux"], default=None,
                        help="the service manager to write for (default: this machine's); "
                             "the paths in it (interpreter, root, socket) are still this "
                             "machine's" if installing else
                             "the service manager whose file to remove (default: this "
                             "machine's)")
        sp.add_argument("--no-load", action="store_true",
                        help=("only write the file; do not start it" if installing else
                              "only remove the file; do not stop the service first")
                             + " (for a machine without the service manager running)")
        if installing:
            sp.add_argument("--print", action="store_true",
                            help="print the service file instead of installing it")
            _serve_settings(sp, for_service=True)

    from kvkeeper import demo

    demo.add_arguments(sub.add_parser(
        "demo",
        help="show what kvkeeper buys a generation loop (needs the mlx extra)",
        description="Stream from a tiny model with write-behind, crash, restore from kvkeeper "
        "and continue; then print measured time to first token, decode throughput and "
        "what the daemon wrote. Uses the daemon at --socket (exit 3 if none answers "
        "there), else the user's daemon if it is running, else a private one. A running "
        "daemon must have room for the demo's entry without evicting any (its disk budget, "
        "the free space it keeps): the one at --socket is refused (exit 1), the user's "
        "passed over for a private one. The demo's entry is deleted at the end, Ctrl-C or "
        "SIGTERM too.",
    ))
    for sp in sub.choices.values():
        # For _main: an unknown argument is the command's mistake, shown
        # with the command's usage (argparse names the top parser's).
        sp.set_defaults(command_parser=sp)
    p.commands = sub.choices  # type: ignore[assignment]  # made by _Parser (parser_class)
    for name, hint in DASH_HINTS.items():
        p.commands[name].dash_hint = hint
    return p


# Where a command's positional arguments may start with '-'.
DASH_HINTS = {
    "rm": "a model or id starting with '-' goes after '--' (kvkeeper rm -- MODEL -ID)",
    "export": "a model, id or PATH starting with '-' goes after '--' "
              "(kvkeeper export -- MODEL -ID PATH)",
    "import": "a PATH starting with '-' goes after '--' (kvkeeper import -- -FILE), "
              "or give it as ./-FILE",
}


def _logging(level: str) -> logging.Handler:
    """The daemon's log on stderr, written by a thread of its own (see
    BehindHandler); returns the handler, for the caller to close."""
    from kvkeeper.logs import BehindHandler, LogfmtFormatter

    handler = BehindHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    return handler


def _serve(args: argparse.Namespace, *, exiting: bool = False) -> int:
    from kvkeeper import config
    from kvkeeper.daemon.app import check_not_held, check_places, config_from_settings
    from kvkeeper.settings import FROM_FILE, SETTINGS, resolve

    try:
        values, sources = resolve({s.name: getattr(args, s.name) for s in SETTINGS},
                                  args.config)
    except config.ConfigError as exc:
        print(f"kvkeeper: {exc}", file=sys.stderr)
        return 2
    try:
        os.getcwd()
    except FileNotFoundError:
        # Removed under the shell that started us: a relative path means nothing.
        relative = [f"{s.name} {values[s.name]}" for s in SETTINGS
                    if isinstance(values[s.name], Path) and not values[s.name].is_absolute()]
        if relative:
            print(f"kvkeeper: the current directory was removed, and {', '.join(relative)} "
                  f"is relative to it: give an absolute path", file=sys.stderr)
            return 2
    cfg = config_from_settings(values)
    if args.print_config:
        from kvkeeper.ops.common import shown

        width = max(len(s.name) for s in SETTINGS)
        for s in SETTINGS:
            value = values[s.name]
            if isinstance(value, Path):
                # Escaped as ls shows names: a tab or ESC printed raw would
                # break the table or drive the terminal.
                text = shown(value).plain
                if not value.is_absolute():  # where serve would use it
                    text += f" (= {shown(os.path.abspath(value)).plain})"
                value = text
            source = sources[s.name]
            if source.startswith(FROM_FILE):  # the file's path, as the values' are
                source = FROM_FILE + shown(source.removeprefix(FROM_FILE)).plain
            print(f"{s.name:<{width}}  {value!s:<40}  ({source})")
        try:
            check_places(cfg)  # what serve would refuse, said here too
            check_not_held(cfg)
        except config.ConfigError as exc:
            print(f"kvkeeper: {exc}", file=sys.stderr)
            return 2
        return 0
    handler = _logging(values["log_level"])
    try:
        return _run_daemon(cfg, exiting)
    finally:
        logging.root.removeHandler(handler)
        handler.close()


def _run_daemon(cfg: Any, exiting: bool) -> int:
    from kvkeeper import config
    from kvkeeper.daemon.app import AlreadyRunning, Daemon
    from kvkeeper.logs import get_logger

    # A log line like every other (a plain banner here was the one line of
    # the log no logfmt reader could split); the log never stops the daemon,
    # on a full disk or a pipe nobody reads.
    get_logger("kvkeeper.cli").info("event=starting version=%s socket=%s root=%s pid=%d",
                                    __version__, os.path.abspath(cfg.socket),
                                    os.path.abspath(cfg.root), os.getpid())
    try:
        return Daemon(cfg).run(exiting=exiting)
    except (AlreadyRunning, config.ConfigError) as exc:
        # A root or socket that cannot be used (not a directory, open to
        # others, too long a path) is an invalid setting, as a bad value is.
        print(f"kvkeeper: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """The ``kvkeeper`` command; returns its exit status."""
    if argv is not None:
        return _command(argv)
    from kvkeeper import service

    if os.environ.get(service.LAUNCHD_MARK[0]) != service.LAUNCHD_MARK[1]:
        return _command(argv)
    # The daemon of a LaunchAgent: launchd starts it again after any exit
    # but 0, every 10 s; exit 2 (a setting refused, another daemon on the
    # root) is the one a new start cannot mend (systemd's unit says so).
    try:
        status = _command(argv)
    except SystemExit as exc:  # argparse's error: a flag this kvkeeper lacks
        if exc.code != 2:
            raise
        status = 2
    if status != 2:
        return status
    print(f"kvkeeper: exit status 0, not 2: launchd would start this agent again every 10 s; "
          f"mend what is said above, then start it: launchctl kickstart "
          f"gui/{os.getuid()}/{service.LABEL}", file=sys.stderr)
    return 0


def _command(argv: list[str] | None) -> int:
    # The commands turn the log off; run in-process (a script, a test),
    # that must not outlast them.
    disabled = logging.root.manager.disable
    # Names are the user's text: where the output's encoding cannot show a
    # character (PYTHONIOENCODING=ascii, a C locale without UTF-8), it is
    # written as an escape rather than ending the command with a traceback.
    escape = getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure")
    if escape:
        sys.stdout.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]  # hasattr above
    global _terminated, _interrupted, _sigterm_before, _sigint_before, _hook_before, _owed
    # A main() run by a command's own main() (a script's fake command): the
    # signal state is the outer command's, and so is an interrupt.
    nested = _sigterm_before is not None or _sigint_before is not None
    if not nested:
        _terminated = _interrupted = _owed = False
    try:
        status = _main(argv)
        if not nested:
            _settle_redelivery()  # an interrupt still owed is the command's
        return status
    except BrokenPipeError:
        # The reader went away (kvkeeper ls | head): nothing more to say, and
        # no traceback. Python would fail again flushing stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        if _owed and not nested:
            return 128 + signal.SIGTERM if _terminated else 130
        # As a shell reports a command SIGPIPE ended (ls | head): not 1,
        # which says the command failed (verify: a bad file found).
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        if nested:
            raise
        # Ctrl-C: what the command was doing is undone where it can be
        # (export's tmp file), and a traceback would tell the user nothing.
        if argv is None:
            # The process exits now. kvkeeper's own handler raises once
            # only; where it was not put in (the signal handled by another
            # handler), a second signal (timeout(1) sends its own twice, to
            # the command and to its group) landed in the exit's clean-up,
            # a client's close, with a traceback.
            with contextlib.suppress(ValueError):  # (not on the main thread)
                for signum in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(signum, signal.SIG_IGN)
            _sigterm_before = _sigint_before = None  # (not put back)
        if _terminated:
            print("\nkvkeeper: terminated", file=sys.stderr)
            return 128 + signal.SIGTERM
        print("\nkvkeeper: interrupted", file=sys.stderr)
        return 130
    finally:
        if not nested:
            _end_redelivery()
            if _sigterm_before is not None:
                signal.signal(signal.SIGTERM, _sigterm_before)
                _sigterm_before = None
            if _sigint_before is not None:
                signal.signal(signal.SIGINT, _sigint_before)
                _sigint_before = None
            if _hook_before is not None:
                sys.unraisablehook = _hook_before
                _hook_before = None
        logging.disable(disabled)
        if escape:
            sys.stdout.reconfigure(errors="strict")  # type: ignore[union-attr]  # hasattr above


#: SIGTERM came first (see _terminate_as_interrupt); either signal came;
#: and the SIGTERM handler replaced.
_terminated = False
_interrupted = False
_sigterm_before: signal.Handlers | Callable[[int, Any], Any] | int | None = None
_sigint_before: signal.Handlers | Callable[[int, Any], Any] | int | None = None
_hook_before: Callable[[Any], Any] | None = None
#: An interrupt lost where Python ignores exceptions, and its sending again.
_owed = False
_again: threading.Timer | None = None
_again_lock = threading.Lock()


def _terminate_as_interrupt() -> None:
    """Have SIGTERM (what timeout(1) and supervisors send) stop a command as
    Ctrl-C does, undoing what it can: killed outright, export left its
    unfinished copy of a conversation behind and demo its private daemon
    running. Only where SIGTERM would kill the process, and for the command
    line's own main() (which exits after): a program that calls main(argv)
    keeps SIGTERM as it was (taken as Ctrl-C, it went on running), and one
    that handles SIGTERM keeps its handler. Only the first of SIGTERM and
    Ctrl-C raises: a second cut the clean-up short (the private daemon's
    directory was left), or landed before the handler of the first could
    ignore it and printed a traceback (two Ctrl-C, 1 run in about 50)."""
    global _sigterm_before, _sigint_before, _hook_before

    def interrupt(signum: int, _frame: Any) -> None:
        global _terminated, _interrupted, _owed
        if not _interrupted:
            _interrupted = True
            _owed = False
            _terminated = signum == signal.SIGTERM
            raise KeyboardInterrupt

    took = False
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            _sigterm_before = signal.signal(signal.SIGTERM, interrupt)
            took = True
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _sigint_before = signal.signal(signal.SIGINT, interrupt)
            took = True
    except ValueError:  # not the main thread: signals are not ours to take
        pass
    # (A main() called inside a command's main() takes no handler: the hook
    # would have saved itself as the one to hand on to.)
    if took and sys.unraisablehook is not _redeliver:
        _hook_before = sys.unraisablehook
        sys.unraisablehook = _redeliver


def _redeliver(unraisable: Any) -> None:
    """sys.unraisablehook while the command's handlers are in. The one
    KeyboardInterrupt they raise, landing where Python can only ignore an
    exception (a __del__, a weakref callback in the middle of an import),
    was lost with every later signal: the command ran on, after an
    "Exception ignored" traceback (1 run in 150 with Ctrl-C as ZeroMQ
    loads). It is sent again, from another thread 50 ms on (at once, it
    was raised inside this hook, and ignored too), and it raises."""
    global _interrupted, _owed, _again
    if (isinstance(unraisable.exc_value, KeyboardInterrupt) and _interrupted
            and (_sigint_before is not None or _sigterm_before is not None)):
        _interrupted = False
        _owed = True
        signum = signal.SIGTERM if _terminated else signal.SIGINT
        _cancel_redelivery()
        _again = threading.Timer(0.05, _send_again, (signum,))
        _again.daemon = True
        _again.start()
        return
    (_hook_before or sys.__unraisablehook__)(unraisable)


def _send_again(signum: int) -> None:
    # Under the lock _end_redelivery takes: once the command has ended, a
    # timer late to run (past its cancel) sends nothing to the caller.
    with _again_lock:
        if _again is not None:
            os.kill(os.getpid(), signum)


def _cancel_redelivery() -> None:
    with _again_lock:
        _cancel_held()


def _cancel_held() -> None:
    """_cancel_redelivery's work, with _again_lock held."""
    global _again
    if _again is not None:
        _again.cancel()
        _again = None


def _end_redelivery() -> None:
    """As the command ends, before its handlers go: no signal is sent again
    from now on, and one already sent is taken by the handler without a
    raise (signal.signal runs pending handlers before it replaces one)."""
    global _interrupted, _owed
    with _again_lock:  # one section: no timer can send between the two
        _interrupted = True
        _owed = False
        _cancel_held()


def _settle_redelivery() -> None:
    """At the command's end: an interrupt sent again but not yet raised is
    raised here, inside the command (left to its timer, it hit whatever
    the caller did next, or a next command run in the same process). One
    already on its way raises on its own, here too."""
    global _interrupted, _owed
    _cancel_redelivery()
    if _owed:
        _owed = False
        _interrupted = True
        raise KeyboardInterrupt


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    for name in DASH_HINTS:
        if name in given:
            parser.commands[name].given = given[given.index(name) + 1:]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Those before the command are the top parser's: "kvkeeper --bogus ls".
        at = given.index(args.command) if args.command in given else -1
        before = [u for u in unknown if u in given and given.index(u) < at]
        (parser if before else args.command_parser).error(
            f"unrecognized arguments: {' '.join(before or unknown)}")
    if args.command == "serve":
        # No argv given: this is the process's own command line (the
        # kvkeeper script, python -m kvkeeper), and it exits on return.
        return _serve(args, exiting=argv is None)
    if argv is None:
        _terminate_as_interrupt()
    if args.command == "demo":
        from kvkeeper import demo

        return demo.main(args)
    if not os.environ.get("KVKEEPER_DEBUG"):
        logging.disable(logging.WARNING)
    from kvkeeper import config, ops, settings

    # (install-service refuses such a file itself.)
    typos = settings.unknown_settings() if args.command != "install-service" else None
    if typos is not None:
        # The log is off for these commands; a typo of socket or root would
        # send them to the default with nothing said why.
        print(f"kvkeeper: warning: config file {settings.path_text(typos[0])}: unknown settings "
              f"{typos[1]} (kvkeeper serve refuses this file); known: {sorted(settings.BY_NAME)}",
              file=sys.stderr)
    from kvkeeper.client.channel import DaemonUnavailable
    from kvkeeper.client.client import DaemonError
    from kvkeeper.protocol.naming import BadId

    command = {
        "stats": ops.stats, "ls": ops.ls, "rm": ops.rm, "gc": ops.gc, "verify": ops.verify,
        "import": ops.import_files, "export": ops.export,
        "install-service": ops.install_service, "uninstall-service": ops.uninstall_service,
    }[args.command]
    try:
        return command(args)
    except ops.CommandError as exc:
        print(f"kvkeeper: {ops.one_line(exc)}", file=sys.stderr)
        return exc.status
    except DaemonUnavailable as exc:
        print(f"kvkeeper: {ops.one_line(exc)}", file=sys.stderr)
        return 3
    except DaemonError as exc:
        # "internal" comes with a request the daemon took and could not carry
        # out (a delete of another program's file): its message says why.
        said = exc.message if exc.code == "internal" else f"the daemon refused: {exc}"
        print(f"kvkeeper: {ops.one_line(said)}", file=sys.stderr)
        return 1
    except (BadId, config.ConfigError) as exc:
        # An id or setting given on the command line or in the config: usage.
        print(f"kvkeeper: {ops.one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # main() ends quietly
    except OSError as exc:
        # E.g. a directory of the store this user cannot read: what failed,
        # not a traceback.
        try:
            os.getcwd()
            gone = ""
        except FileNotFoundError:  # a bare "[Errno 2]" from something that resolved "."
            gone = " (the current directory was removed: run kvkeeper from another)"
        print(f"kvkeeper: {ops.one_line(exc)}{gone}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as exc:
        # import and export read and write caches through MLX, which an
        # install of the daemon alone does not have.
        if (exc.name or "").partition(".")[0] not in ("mlx", "mlx_lm", "mlx_vlm", "numpy"):
            raise
        from kvkeeper.client import MLX_EXTRA

        print(f"kvkeeper {args.command} needs the mlx extra ({MLX_EXTRA}): {exc}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
