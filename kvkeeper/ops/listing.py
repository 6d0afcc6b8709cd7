"""The commands that read and trim the store through the daemon: stats, ls,
rm, gc."""

from __future__ import annotations

import argparse
import time

from rich.table import Table
from rich.text import Text

from kvkeeper import plaintable
from kvkeeper.ops.common import (
    CommandError,
    ago,
    client,
    counted,
    entry_dict,
    err,
    human,
    key_shown,
    loadable,
    one_line,
    out,
    print_json,
    print_table,
    print_whole,
    shown,
)
from kvkeeper.protocol import messages as m

_GROUPS = [
    ("Saves", ["saves_received", "saves_written", "saves_superseded", "saves_refused",
               "saves_failed", "saves_cut_off", "bytes_received", "bytes_written"]),
    ("Loads", ["loads_found", "loads_direct", "loads_missing", "files_quarantined"]),
    ("Writer", ["pending_bytes", "writer_max_pending_bytes", "max_pending_bytes",
                "queue_depth", "held_saves", "saves_held", "parked_saves",
                "saves_parked", "write_seconds_p50",
                "write_seconds_p99", "fsync_seconds_p50", "fsync_seconds_p99"]),
    ("Disk", ["store_indexing", "disk_used_bytes", "max_disk_bytes", "free_bytes",
              "min_free_bytes", "below_min_free", "evictions",
              "bytes_evicted", "deletes", "deletes_missing"]),
    ("Daemon", ["uptime_s", "boot_id", "protocol_errors", "requests_refused",
                "internal_errors", "forbidden_peers"]),
]


def _fmt(name: str, v: float) -> str:
    if name == "max_disk_bytes" and v == 0:
        return "none"  # --max-disk-bytes 0: no limit
    if name == "free_bytes" and v < 0:
        return "unknown"  # a disk of no size (ramfs), or not to be looked at
    if name.endswith("bytes") or name.startswith("bytes_"):
        return human(v)
    if name.endswith("_seconds_p50") or name.endswith("_seconds_p99"):
        return f"{v * 1000:.1f} ms"
    if name == "uptime_s":
        return f"{v:.0f} s"
    if name == "boot_id":
        # An identifier, not a quantity; as --json and Client.stats() give it.
        return str(int(v))
    return f"{v:g}"


def stats(args: argparse.Namespace) -> int:
    with client(args.socket) as kv:
        # Which daemon answered: with several (a root each), or one restarted
        # since, the counters alone do not tell.
        who = kv.ping()
        counters = {k: v for k, v in kv.stats().items() if not k.startswith("client_")}
        socket = str(kv.socket_path)
    if args.json:
        # Counts and sizes ints, times floats (Client.stats).
        print_json({"pid": who.pid, "version": who.version, "root": who.root,
                    "socket": socket, **counters})
        return 0
    # Lines of their own, never cut: in the table, rich shortened a long
    # root to its width ("/tmp/a-rather-long-directory-name-for-t…").
    out.print(f"kvkeeper daemon, pid {who.pid}, version {who.version}")
    out.print(Text.assemble("  root    ", shown(who.root)))
    out.print(Text.assemble("  socket  ", shown(socket)))
    table = Table(show_header=False, box=None, padding=(0, 2))
    # On a narrow terminal a name wraps rather than ends in "…" (p50 and
    # p99 read alike); piped, print_whole makes room for it.
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")
    listed = set()
    for group, names in _GROUPS:
        table.add_row(f"[bold]{group}[/]", "")
        for name in names:
            if name in counters:
                table.add_row(f"  {name}", _fmt(name, counters[name]))
                listed.add(name)
    rest = sorted(set(counters) - listed)
    if rest:
        table.add_row("[bold]Other[/]", "")
        for name in rest:
            table.add_row(f"  {name}", _fmt(name, counters[name]))
    print_whole(table)
    return 0


# ------------------------------------------------------------------ ls, rm, gc

_SORTS = {
    "last-used": (lambda e: e.last_used, True),
    "saved": (lambda e: e.saved_at, True),
    "size": (lambda e: e.nbytes, True),
    "tokens": (lambda e: e.tokens, True),
    "id": (lambda e: e.cache_id, False),
    "model": (lambda e: (e.model, e.cache_id), False),
}


def ls(args: argparse.Namespace) -> int:
    with client(args.socket) as kv:
        entries = kv.entries(args.model, everything=args.all)
    key, descending = _SORTS[args.sort]
    entries.sort(key=key, reverse=descending != args.reverse)
    if args.json:
        print_json([entry_dict(e) for e in entries])
        return 0
    now = time.time()
    n = sum(e.kind == "entry" for e in entries)
    others = f", {counted(len(entries) - n, 'other file')}" if len(entries) > n else ""
    columns: list[plaintable.Column] = [("model", "left"), ("id", "left"), ("tokens", "right"),
                                        ("size", "right"), ("saved", "right"),
                                        ("last used", "right")]
    rows: list[list[str | Text]] = []
    for e in entries:
        row: list[str | Text] = [shown(e.model), shown(e.cache_id), str(e.tokens),
                                 human(e.nbytes), ago(e.saved_at, now), ago(e.last_used, now)]
        if args.all:
            row.append(e.kind if e.kind == "entry"
                       else Text.assemble((e.kind, "yellow"), " ", shown(e.path)))
        rows.append(row)
    if args.all:
        columns.append(("kind", "left"))
    print_table(f"{counted(n, 'entry', 'entries')}{others}, "
                 f"{human(sum(e.nbytes for e in entries))}", columns, rows)
    return 0


def rm(args: argparse.Namespace) -> int:
    if args.all_of_model is not None and args.model is not None:
        # Deleting all of a model when one entry was named would be the
        # worst way to read it.
        raise CommandError("give either MODEL ID (kvkeeper rm MODEL ID) for one entry, or "
                           "only --model FP (kvkeeper rm --model FP) for all of a model",
                           status=2)
    if args.all_of_model is None and args.cache_id is None:
        # Checked before looking for the daemon: a usage error is one with or
        # without it.
        raise CommandError(("rm MODEL ID needs the cache id too" if args.model is not None
                            else "nothing to delete")
                           + ": give MODEL ID (kvkeeper rm MODEL ID) for one entry, or "
                           "--model FP (kvkeeper rm --model FP) for all of a model", status=2)
    with client(args.socket) as kv:
        if args.cache_id is not None:
            if not kv.delete(args.model, args.cache_id):
                # On stderr, as every other failure: "2>err" keeps the reason.
                err.print(Text.assemble("kvkeeper: no such entry: ",
                                        key_shown(args.model, args.cache_id)))
                return 1
            out.print(Text.assemble("deleted ", key_shown(args.model, args.cache_id)))
            return 0
        from kvkeeper.client.channel import (
            DaemonShuttingDown,
            DaemonTimedOut,
            DaemonUnavailable,
        )
        from kvkeeper.client.client import DaemonError

        entries = loadable(kv, args.all_of_model)
        deleted = 0
        # One entry the daemon will not delete (a file it cannot tell from
        # another program's) ended the command there, the rest untried and
        # the deletes done unsaid; so did a daemon going away part way.
        left: list[tuple[m.Entry, str]] = []
        gone: DaemonUnavailable | None = None
        untried = ""
        stopped = False
        for e in entries:
            if gone is not None or stopped:
                left.append((e, f"not tried: {untried}"))
                continue
            try:
                deleted += kv.delete(e.model, e.cache_id)
            except KeyboardInterrupt:
                # What was deleted is still said, as import says what it
                # imported (before: "interrupted" alone, exit 130).
                stopped, untried = True, "interrupted"
                left.append((e, "interrupted: it may be deleted or not (see kvkeeper ls)"))
            except DaemonError as exc:
                left.append((e, exc.message if exc.code == "internal"
                             else f"the daemon refused: {exc}"))
            except DaemonUnavailable as exc:  # stopped, restarted, timed out
                gone = exc
                if isinstance(exc, DaemonShuttingDown):  # refused before it was carried out
                    untried = "the daemon is shutting down"
                    left.append((e, str(exc)))
                else:  # it may have been carried out (a slow disk, a daemon killed)
                    untried = ("the daemon did not answer" if isinstance(exc, DaemonTimedOut)
                               else "the daemon went away")
                    left.append((e, f"not known whether deleted: {exc}"))
    if not entries:  # as for one entry: a typo in the model must not read as done
        err.print(Text.assemble("kvkeeper: no entries of model ", shown(args.all_of_model)))
        return 1
    # The count of deletes done: an entry evicted or deleted meanwhile was
    # listed, but not deleted by this command.
    missing = len(entries) - deleted - len(left)
    already = f" ({missing} listed were gone already)" if missing else ""
    out.print(Text.assemble(f"deleted {counted(deleted, 'entry', 'entries')} of model ",
                            shown(args.all_of_model), already))
    for e, why in left:
        err.print(Text.assemble("kvkeeper: not deleted: ", key_shown(e.model, e.cache_id),
                                f": {one_line(why)}"))
    if stopped:
        raise KeyboardInterrupt  # exit 130, once the report is out
    if gone is not None:
        raise gone  # exit 3, its message last
    return 1 if left else 0


def gc(args: argparse.Namespace) -> int:
    with client(args.socket) as kv:
        result = kv.gc()
    if args.json:
        print_json({"evicted": [entry_dict(e) for e in result.entries],
                     "disk_used_bytes": result.disk_used_bytes, "free_bytes": result.free_bytes})
        return 0
    if result.entries:
        print_table(f"evicted {len(result.entries)}",
                     [("model", "left"), ("id", "left"), ("size", "left"), ("kind", "left")],
                     [[shown(e.model), shown(e.cache_id), human(e.nbytes), e.kind]
                      for e in result.entries])
    else:
        out.print("evicted nothing")
    free = human(result.free_bytes) if result.free_bytes >= 0 else "unknown"
    out.print(f"root uses {human(result.disk_used_bytes)}; {free} free on the store's file "
              f"system")
    return 0
