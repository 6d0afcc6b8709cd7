"""``kvkeeper``: run the daemon and look at what it holds."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from kvkeeper import __version__, config

GiB = 1024**3


def _size(text: str) -> int:
    """Byte sizes like 1073741824, 512M, 1G, 1.5GiB."""
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 512M or 1G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvkeeper",
        description="Keep MLX prompt caches across restarts. A daemon takes saves off "
        "the generation loop and writes them durably; clients load them back.",
    )
    p.add_argument("--version", action="version", version=f"kvkeeper {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        description="Run the daemon in the foreground until SIGTERM or SIGINT, then finish "
        "every save already received and exit 0. One daemon per root: a second one exits "
        "with status 2 naming the first.",
    )
    serve.add_argument("--root", type=Path, default=None,
                       help=f"store directory (default ${config.ENV_ROOT} or {config.default_root()})")
    serve.add_argument("--socket", type=Path, default=None,
                       help=f"ipc socket path (default ${config.ENV_SOCKET} or "
                            f"{config.default_socket()})")
    serve.add_argument("--max-pending-bytes", type=_size, default=1 * GiB, metavar="N",
                       help="memory for saves received but not yet written; a save that "
                            "does not fit is refused and counted (default 1G)")
    serve.add_argument("--drain-timeout", type=float, default=20.0, metavar="S",
                       help="on SIGTERM, how long to keep writing received saves (default 20)")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"], help="default info")

    for name, text in (("stats", "the daemon's counters"), ("ls", "stored entries")):
        c = sub.add_parser(name, help=text, description=f"Print {text}.")
        c.add_argument("--socket", type=Path, default=None, help="daemon socket")
        c.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "ls":
            c.add_argument("--model", default=None, help="only this model fingerprint")

    rm = sub.add_parser("rm", help="delete one entry", description="Delete one entry.")
    rm.add_argument("model")
    rm.add_argument("cache_id")
    rm.add_argument("--socket", type=Path, default=None, help="daemon socket")
    return p


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )


def _serve(args: argparse.Namespace) -> int:
    from kvkeeper.daemon.app import AlreadyRunning, Daemon, DaemonConfig

    _logging(args.log_level)
    cfg = DaemonConfig(
        root=(args.root or config.default_root()).expanduser(),
        socket=(args.socket or config.default_socket()).expanduser(),
        max_pending_bytes=args.max_pending_bytes,
        drain_timeout=args.drain_timeout,
    )
    print(f"kvkeeper {__version__}: socket {cfg.socket}, root {cfg.root}", file=sys.stderr,
          flush=True)
    try:
        return Daemon(cfg).run()
    except AlreadyRunning as exc:
        print(f"kvkeeper: {exc}", file=sys.stderr)
        return 2
    except config.ConfigError as exc:
        print(f"kvkeeper: {exc}", file=sys.stderr)
        return 1


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvkeeper.client.channel import DaemonUnavailable
    from kvkeeper.client.client import Client

    kv = Client(args.socket, connect_timeout=2.0)
    if not kv.connected:
        kv.close()
        raise DaemonUnavailable(f"no kvkeeper daemon at {kv.socket_path}")
    return kv


def _stats(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        counters = kv.stats()
    counters = {k: v for k, v in counters.items() if not k.startswith("client_")}
    if args.json:
        print(json.dumps(counters, indent=1, sort_keys=True))
    else:
        width = max(map(len, counters))
        for k, v in sorted(counters.items()):
            print(f"{k:<{width}}  {v:g}")
    return 0


def _ls(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        entries = kv.entries(args.model)
    if args.json:
        print(json.dumps([{f: getattr(e, f) for f in e.__struct_fields__} for e in entries],
                         indent=1))
        return 0
    now = time.time()
    print(f"{'MODEL':<20} {'ID':<30} {'TOKENS':>8} {'BYTES':>12} {'LAST USED':>10}")
    for e in entries:
        print(f"{e.model[:20]:<20} {e.cache_id[:30]:<30} {e.tokens:>8} {e.nbytes:>12} "
              f"{int(now - e.last_used):>9}s")
    return 0


def _rm(args: argparse.Namespace) -> int:
    with _client(args) as kv:
        existed = kv.delete(args.model, args.cache_id)
    print("deleted" if existed else "no such entry")
    return 0 if existed else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if not os.environ.get("KVKEEPER_DEBUG"):
        logging.disable(logging.WARNING)
    from kvkeeper.client.channel import DaemonUnavailable

    try:
        return {"stats": _stats, "ls": _ls, "rm": _rm}[args.command](args)
    except DaemonUnavailable as exc:
        print(f"kvkeeper: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
