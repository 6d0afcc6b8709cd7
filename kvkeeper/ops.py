"""The commands a person (or a script, with ``--json``) runs against a store:
stats, ls, rm, gc, verify, import, export, and the service installers.

Everything that changes the store goes through the daemon, its only writer;
``verify`` reads files itself, and ``verify --repair`` without a daemon takes
the daemon's lock so that nothing else writes meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from kvkeeper import plaintable
from kvkeeper.protocol import messages as m
from kvkeeper.protocol import naming
from kvkeeper.protocol import safetensors as st
from kvkeeper.protocol.legacy_formats import detect_legacy

# soft_wrap: messages (paths, ids) are never broken across lines when piped;
# tables still fit the width.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class CommandError(Exception):
    """Ends a command with a message and exit status 1 (2: usage, 3: no daemon)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def shown(value: object) -> Text:
    """A name that came from a user (model, id, path, a message quoting one)
    as it is: never read as markup ("arr[i]" stays so, for copying into
    ``rm``), control characters escaped (a newline or ESC would break a
    table or drive the terminal), and in double quotes when escaped ("a\\nb"
    with a newline looked like the id a\\nb), when a space begins or ends it
    ("a " and "a" looked alike) or when it begins with one (so a name shown
    in quotes is always one quoted). Inside quotes every backslash is
    escaped too: " a\\t" with a tab and " a\\\\t" with a backslash looked alike."""
    s = str(value)
    utf = out.encoding.startswith("utf")

    def plain(text: str) -> bool:
        # What the output cannot show is escaped before a table measures it.
        return text.isprintable() and (utf or _encodable(text, out.encoding))

    if plain(s) and s == s.strip(" ") and not s.startswith('"'):
        return Text(s)
    return Text('"' + "".join(ch if ch != "\\" and plain(ch)
                              else ch.encode("unicode_escape").decode("ascii")
                              for ch in s) + '"')


def _encodable(text: str, encoding: str) -> bool:
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


def counted(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun it takes: "1 entry", "2 entries"."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ago(t: float, now: float | None = None) -> str:
    if not t:
        return "-"
    s = max(0.0, (now or time.time()) - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def client(socket: Path | None, *, required: bool = True,  # type: ignore[no-untyped-def]
           root: Path | None = None):
    """A client of the daemon. ``root``: the command was given --root and can
    work on it alone, so without ``socket`` a socket setting it cannot use is
    warned of and None returned (no daemon), not a usage error."""
    from kvkeeper.client.client import Client
    from kvkeeper.settings import SettingsError

    try:
        kv = Client(socket, connect_timeout=2.0, timeout=60.0)
    except SettingsError as exc:
        if socket is not None or root is None:
            raise CommandError(str(exc), status=2) from None
        err.print(Text.assemble("kvkeeper: no daemon asked (", str(exc), "); working on ",
                                shown(root), " alone"))
        return None
    except ValueError as exc:  # a socket path the platform cannot take, say
        raise CommandError(str(exc), status=2) from None
    if required and not kv.connected:
        kv.close()
        raise CommandError(_no_daemon(kv.socket_path, " (start it: kvkeeper serve)"),
                           status=3)
    return kv


def _no_daemon(path: Path, hint: str, hint_if_stopped: str = "") -> str:
    """Why no daemon answered at ``path``: none runs (``hint`` follows), or
    one does and did not answer (``hint_if_stopped``)."""
    if _listening(path):  # a daemon stopped (SIGSTOP) or hung, not a stale socket
        return (f"the kvkeeper daemon at {path} did not answer within 2 s (is it stopped?)"
                f"{hint_if_stopped}")
    return f"no kvkeeper daemon at {path}{hint}"


def _listening(path: Path) -> bool:
    """Whether a process listens on the Unix socket at ``path`` (the kernel
    accepts for it even while it is stopped)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(os.fspath(path))
        except OSError:
            return False
    return True


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True))


def _entry_dict(e: m.Entry) -> dict[str, Any]:
    return {f: getattr(e, f) for f in e.__struct_fields__}


# ------------------------------------------------------------------ stats

_GROUPS = [
    ("Saves", ["saves_received", "saves_written", "saves_superseded", "saves_refused",
               "saves_failed", "saves_cut_off", "bytes_received", "bytes_written"]),
    ("Loads", ["loads_found", "loads_direct", "loads_missing", "files_quarantined"]),
    ("Writer", ["pending_bytes", "writer_max_pending_bytes", "max_pending_bytes",
                "queue_depth", "held_saves", "saves_held", "parked_saves",
                "saves_parked", "write_seconds_p50",
                "write_seconds_p99", "fsync_seconds_p50", "fsync_seconds_p99"]),
    ("Disk", ["store_indexing", "disk_used_bytes", "max_disk_bytes", "min_free_bytes", "evictions",
              "bytes_evicted", "deletes"]),
    ("Daemon", ["uptime_s", "boot_id", "protocol_errors", "requests_refused",
                "internal_errors", "forbidden_peers"]),
]


def _fmt(name: str, v: float) -> str:
    if name == "max_disk_bytes" and v == 0:
        return "none"  # --max-disk-bytes 0: no limit
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
        counters = {k: v for k, v in kv.stats().items() if not k.startswith("client_")}
    if args.json:
        _print_json(counters)  # counts and sizes ints, times floats (Client.stats)
        return 0
    table = Table(title="kvkeeper daemon", show_header=False, box=None, padding=(0, 2))
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
    out.print(table)
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
        _print_json([_entry_dict(e) for e in entries])
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
    _print_table(f"{counted(n, 'entry', 'entries')}{others}, "
                 f"{human(sum(e.nbytes for e in entries))}", columns, rows)
    return 0


#: Up to this many rows a terminal gets rich's table, folded to its width;
#: more are drawn as for a pipe (rich took 14 s for 20,000).
_RICH_ROWS = 1000


def _print_table(title: str, columns: list[plaintable.Column],
                 rows: list[list[str | Text]]) -> None:
    """A listing on stdout. Piped, as wide as its rows need: rich would fold
    it to 80 columns, and an id cut across two rows cannot be copied whole
    (or grepped)."""
    if (not out.is_terminal or len(rows) > _RICH_ROWS) and out.encoding.startswith("utf"):
        # (Other encodings get rich's ASCII box.)
        text = plaintable.render(title, columns,
                                 [[str(cell) for cell in row] for row in rows])
        out.file.write(text)
        out.file.flush()
        return
    table = Table(title=title)
    for col, justify in columns:
        # Ids and models wrap rather than end in "…": they are shown to be
        # copied into rm (on a terminal narrower than them).
        table.add_column(col, justify=justify,
                         overflow="fold" if justify == "left" else "ellipsis")
    for row in rows:
        table.add_row(*row)
    if out.is_terminal:
        out.print(table)
    else:
        need = Measurement.get(out, out.options.update_width(1 << 20), table).maximum
        Console(highlight=False, soft_wrap=True, width=max(out.width, need)).print(table)


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
                err.print(Text.assemble("kvkeeper: no such entry: ", shown(args.model), " / ",
                                        shown(args.cache_id)))
                return 1
            out.print("deleted")
            return 0
        entries = _loadable(kv, args.all_of_model)
        deleted = sum(kv.delete(e.model, e.cache_id) for e in entries)
    if not entries:  # as for one entry: a typo in the model must not read as done
        err.print(Text.assemble("kvkeeper: no entries of model ", shown(args.all_of_model)))
        return 1
    # The count of deletes done: an entry evicted or deleted meanwhile was
    # listed, but not deleted by this command.
    gone = f" ({len(entries) - deleted} listed were gone already)" if deleted < len(entries) else ""
    out.print(Text.assemble(f"deleted {counted(deleted, 'entry', 'entries')} of model ",
                            shown(args.all_of_model), gone))
    return 0


def _loadable(kv: Any, model: str) -> list[m.Entry]:
    """A model's entries and the caches of the older formats at entries'
    places (``legacy``): a load of their key returns them, so rm --model
    deletes them and import does not replace them unasked."""
    # (A legacy file at a hashed place has no id to give: none to delete by.)
    return [e for e in kv.entries(model, everything=True)
            if e.kind in ("entry", "legacy") and e.cache_id]


def gc(args: argparse.Namespace) -> int:
    with client(args.socket) as kv:
        result = kv.gc()
    if args.json:
        _print_json({"evicted": [_entry_dict(e) for e in result.entries],
                     "disk_used_bytes": result.disk_used_bytes, "free_bytes": result.free_bytes})
        return 0
    _print_table(f"evicted {len(result.entries)}",
                 [("model", "left"), ("id", "left"), ("size", "left"), ("kind", "left")],
                 [[shown(e.model), shown(e.cache_id), human(e.nbytes), e.kind]
                  for e in result.entries])
    out.print(f"root uses {human(result.disk_used_bytes)}; {human(result.free_bytes)} free on "
              f"the store's file system")
    return 0


def _fsync_path(path: Path, flags: int) -> None:
    from kvkeeper.daemon.store import full_fsync

    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ verify

def _store_files(root: Path, unlisted: list[tuple[Path, str]]) -> Iterator[Path]:
    """The files at entries' places. Others (a copy under a name the daemon
    does not give) are not the daemon's: moved aside as bad, they became
    quarantined files, which the disk budget deletes first. A model's
    directory this process cannot list goes to ``unlisted``, with why."""
    sessions = root / naming.SESSIONS_DIR
    if not sessions.is_dir():
        return
    try:
        models = sorted(sessions.iterdir())
    except OSError as exc:
        raise CommandError(f"cannot list {sessions}: {exc.strerror or exc}") from None
    for d in models:
        if d.is_symlink() or not d.is_dir():
            continue
        try:
            names = sorted(d.iterdir())
        except OSError as exc:
            # One such directory stopped the whole check with a bare errno.
            unlisted.append((d, exc.strerror or str(exc)))
            continue
        for f in names:
            if not f.name.startswith(".") and naming.is_entry_place(f):
                yield f


def _root(args: argparse.Namespace, kv: Any) -> Path:
    if args.root is not None:
        root: Path = args.root.expanduser()
        if not root.is_dir():
            what = "does not exist" if not root.exists() else "is not a directory"
            raise CommandError(f"--root {root} {what}", status=2)
        if not (root / naming.SESSIONS_DIR).is_dir():
            # Checking nothing must not read as "all good" (a mistyped root).
            raise CommandError(f"--root {root} is not a kvkeeper store: it has no "
                               f"{naming.SESSIONS_DIR}/ directory", status=2)
        return root
    if kv is not None and kv.connected:
        return kv.root
    if args.socket is not None:
        # The store of the daemon named: the configured root may be another.
        where = kv.socket_path if kv is not None else args.socket
        raise CommandError(_no_daemon(where, " to name its root: give --root",
                                      "; give --root to work on its files without it"),
                           status=3)
    from kvkeeper.settings import client_path

    root = client_path("root")
    if not root.is_dir():
        # Checking nothing must not read as "all good".
        raise CommandError(f"no store at {root} (the root serve would use; no daemon runs "
                           f"to name another): give --root")
    return root


def verify(args: argparse.Namespace) -> int:
    kv = client(args.socket, required=False, root=args.root)
    try:
        root = _root(args, kv)
        unlisted: list[tuple[Path, str]] = []  # directories: reported as not checked
        # Files the daemon deletes or evicts meanwhile are gone, not bad.
        sizes = {f: n for f in _store_files(root, unlisted) if (n := _size(f)) is not None}
        files: list[Path] = []
        # With the file's identity when it was judged: the repair must move
        # that file, never a newer version saved since (a check of a big store
        # takes minutes, and a load that found it damaged may have had it
        # moved aside and a new version saved meanwhile).
        bad: list[tuple[Path, str, os.stat_result | None]] = []
        legacy: list[Path] = []
        others: list[Path] = []  # safetensors files that are not caches: not the daemon's
        # Files this process could not read for reasons of its own (out of
        # descriptors, no permission): not checked, and never moved aside.
        unchecked: list[tuple[Path, str]] = []
        with Progress(TextColumn("verify"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                      console=err, disable=args.json or not err.is_terminal) as bar:
            task = bar.add_task("verify", total=sum(sizes.values()))
            for f, size in sizes.items():
                files.append(f)
                judged = None
                try:
                    # Before the open: if a newer file takes the place in
                    # between, the repair finds another inode and leaves it.
                    judged = f.lstat()
                    # A check is not a use: the eviction order stays as it was.
                    with st.open_file(f, keep_atime=True) as (fh, header):
                        meta = header.metadata
                        if not st.written_by_kvkeeper(meta):
                            (legacy if detect_legacy(meta) else others).append(f)
                            bar.advance(task, size)
                            continue
                        st.verify_data(fh, header, lambda n: bar.advance(task, n))
                        # What load() refuses: another key's file at this place.
                        if _header_key_here(f, meta) is None:
                            bad.append((f, f"holds the entry {meta.get(st.MODEL_KEY)!r}/"
                                           f"{meta.get(st.CACHE_ID_KEY)!r}, which belongs "
                                           f"elsewhere", judged))
                except FileNotFoundError:
                    files.pop()  # gone meanwhile: not checked
                    bar.advance(task, size)
                except OSError as exc:
                    if st.says_nothing_of_the_file(exc):
                        unchecked.append((f, exc.strerror or str(exc)))
                        bar.advance(task, size)
                    else:
                        bad.append((f, str(exc), judged))
                except st.TableError as exc:
                    if st.is_cache(exc.metadata):
                        bad.append((f, str(exc), judged))
                    else:  # another program's safetensors (FP8 weights, say), as the store says
                        others.append(f)
                        bar.advance(task, size)
                except st.LayoutError as exc:
                    bad.append((f, str(exc), judged))
        repaired: list[Path] = []
        refused: list[tuple[Path, str]] = []
        repair_error: Exception | None = None
        try:
            if args.repair and bad:
                _repair(root, bad, kv, repaired, refused)
        except Exception as exc:  # noqa: BLE001 - raised again once the check is reported
            # E.g. another daemon holds the root: what the check found is
            # still worth reporting (and --json output still expected).
            repair_error = exc
    finally:
        if kv is not None:
            kv.close()
    checked = len(files) - len(legacy) - len(others) - len(unchecked)
    unchecked += unlisted
    if args.json:
        _print_json({"root": str(root), "checked": checked,
                     "legacy_unchecked": [str(p) for p in legacy],
                     "not_caches": [str(p) for p in others],
                     "bad": [{"path": str(p), "reason": r} for p, r, _ in bad],
                     "could_not_read": [{"path": str(p), "reason": r} for p, r in unchecked],
                     "moved_aside": [str(p) for p in repaired],
                     "not_moved": [{"path": str(p), "reason": r} for p, r in refused],
                     **({"repair_error": str(repair_error)} if repair_error else {})})
    else:
        out.print(Text.assemble(
            f"{counted(checked, 'file')} checked under ", shown(root),
            f", {counted(len(legacy), 'legacy file')} without checksums" if legacy else "",
            f", {counted(len(others), 'safetensors file')} that are not caches (left alone)"
            if others else ""))
        not_moved = dict(refused)
        for p, reason, _ in bad:
            out.print(Text.assemble(("BAD", "red"), " ", shown(p), ": ", shown(reason),
                                    (" (moved aside)", "green") if p in repaired else "",
                                    *((" (not moved: ", shown(not_moved[p]), ")")
                                      if p in not_moved else ())))
        for p, reason in unchecked:
            out.print(Text.assemble(("NOT CHECKED", "yellow"), " ", shown(p), ": ",
                                    shown(reason), " (this process could not read it; "
                                    "left in place)"))
        out.print(Text.assemble(
            (f"{len(bad)} bad", "red") if bad else
            ("" if unchecked else ("all good", "green")),
            ", " if bad and unchecked else "",
            (f"{len(unchecked)} not checked", "yellow") if unchecked else ""))
    if repair_error is not None:
        raise repair_error  # its message and exit status, after the report
    return 1 if bad or unchecked else 0


def _size(path: Path) -> int | None:
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return None


def _key_of(path: Path) -> tuple[str | None, str | None]:
    """The key a file's place stands for: from its name, or (a hashed name)
    from its header, when that names this very place."""
    model, cache_id = naming.key_of(path)
    if model is not None and cache_id is not None:
        return model, cache_id
    try:
        with st.open_file(path, keep_atime=True) as (_, header):
            return _header_key_here(path, header.metadata) or (None, None)
    except (OSError, st.LayoutError):
        return None, None


def _header_key_here(path: Path, meta: dict[str, str]) -> tuple[str, str] | None:
    """The key a file's header names, if an entry of that key lives at the
    file's own place (``<sessions>/<model>/<id>.safetensors``); else None."""
    return naming.placed_key(path, meta.get(st.MODEL_KEY), meta.get(st.CACHE_ID_KEY))


def _repair(root: Path, bad: list[tuple[Path, str, os.stat_result | None]], kv: Any,
            moved: list[Path], refused: list[tuple[Path, str]]) -> None:
    """Move bad files aside: through the daemon when it runs (it is the only
    writer), else directly, holding its lock so that none starts meanwhile;
    each only if it is still the file judged (same inode and mtime). Each
    file moved is added to ``moved`` at once: if a later one fails, the
    report still names those that went. A file that could not be moved
    (the daemon refused, or moving it directly failed) goes to ``refused``
    with the reason, and the others are still tried."""
    # Only the daemon that serves this root may move its files; one serving
    # another root would refuse (the files it knows are elsewhere).
    if kv is not None and kv.connected and kv.root.resolve() == root.resolve():
        from kvkeeper.client.client import DaemonError, DaemonShuttingDown

        for path, reason, ident in bad:
            if ident is None:
                continue  # not even its lstat worked: nothing to tell a newer file from
            model, cache_id = _key_of(path)
            if model is None or cache_id is None:
                # The daemon moves files by key: a hashed name whose header
                # names another entry gives it none. Without a daemon,
                # --repair moves files by path.
                err.print(Text.assemble("cannot repair ", shown(path), " through the daemon: "
                                        "neither its name nor its header tells its id (stop "
                                        "the daemon and run verify --repair again)"))
                continue
            try:
                reply = kv._request(lambda req, model=model, cache_id=cache_id, ident=ident,
                                    reason=reason: m.Quarantine(
                    v=m.PROTOCOL_VERSION, req=req, model=model, cache_id=cache_id,
                    ino=ident.st_ino, mtime_ns=ident.st_mtime_ns, reason=reason[:4000]))
            except DaemonError as exc:
                # E.g. the daemon may not read the file, so cannot tell it from
                # another program's: it left this one, the others may still go.
                refused.append((path, exc.message))
                continue
            except DaemonShuttingDown:
                refused.append((path, "the daemon is shutting down"))
                continue
            if isinstance(reply, m.Deleted) and reply.existed:
                moved.append(path)
        return
    from kvkeeper.daemon.app import LOCK_NAME, LockUnusable, _Lock
    from kvkeeper.daemon.store import Store

    try:
        lock = _Lock(root / LOCK_NAME, f"kvkeeper verify --repair, pid {os.getpid()}")
    except LockUnusable as exc:
        # A root this user cannot write: the repair failed (exit 1), as it did
        # with the OSError; exit 2 is for usage and a root another holds.
        raise CommandError(str(exc)) from None
    try:
        store = Store(root)
        for path, _, ident in bad:
            if ident is None:
                continue
            try:
                if store.quarantine_path(path, ident.st_ino, ident.st_mtime_ns) is not None:
                    moved.append(path)
            except OSError as exc:
                refused.append((path, exc.strerror or str(exc)))
    finally:
        lock.release()


# ------------------------------------------------------------------ import / export

def _inputs(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """The files to import, and the directories that hold none."""
    files: list[Path] = []
    empty: list[Path] = []
    seen: dict[str, int] = {}  # real path -> its place in files
    for p in paths:
        if p.is_dir():
            found = _cache_files_under(p)
            if not found:
                empty.append(p)
        elif p.exists():
            found = [p]
        else:
            raise CommandError(f"{p}: no such file or directory", status=2)
        for f in found:
            # One file named twice (a.safetensors ./a.safetensors, or a file
            # and its directory) is one file: its second mention is no
            # duplicate key to refuse.
            real = os.path.realpath(f)
            if real not in seen:
                seen[real] = len(files)
                files.append(f)
            elif files[seen[real]].is_symlink() and not f.is_symlink():
                # A file and a symlink to it: the file's own name is its id,
                # not whichever of the two sorts first.
                files[seen[real]] = f
    return files, empty


def _cache_files_under(directory: Path) -> list[Path]:
    """Every ``*.safetensors`` under ``directory`` (not through links to
    directories), sorted. A subdirectory removed while this walks it is
    skipped, one it cannot list is reported: neither fails the import."""
    def unlisted(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            err.print(f"cannot list {exc.filename}: {exc.strerror}", markup=False)

    return sorted(Path(d) / name for d, _, names in os.walk(directory, onerror=unlisted)
                  for name in names if name.endswith(naming.SUFFIX))


def import_files(args: argparse.Namespace) -> int:
    from kvkeeper.client.reader import CacheFileError, read_cache_file

    # Checked as given: "" is not "none given" (it was ignored, silently).
    if args.model is not None:
        naming.check_id(args.model, "--model")
    if args.id is not None:
        naming.check_id(args.id, "--id")
    if args.id is not None and len(args.paths) != 1:
        raise CommandError(f"--id names one entry: give exactly one file with it, not "
                           f"{len(args.paths)} paths", status=2)
    files, empty = _inputs(args.paths)
    if not files:
        # Nothing imported is not success: a script that imports a directory
        # must not read a typo or an empty download as done.
        raise CommandError("nothing to import: no *" + naming.SUFFIX + " files in "
                           + ", ".join(str(d) for d in empty))
    if args.id is not None and len(files) != 1:
        raise CommandError(f"--id names one entry: give exactly one file with it; "
                           f"{args.paths[0]} holds {len(files)} *{naming.SUFFIX} files",
                           status=2)
    for d in empty:
        err.print(f"no *{naming.SUFFIX} files in {d}", markup=False)
    from kvkeeper.client.channel import DaemonUnavailable

    done: list[tuple[Path, str, str, bool]] = []
    failed: list[tuple[Path, str]] = []
    taken: dict[tuple[str, str], Path] = {}
    stored: dict[str, set[str]] = {}  # model -> ids in the store when first asked
    gone: str | None = None
    stopped = False
    current: Path | None = None
    try:
        with client(args.socket) as kv, Progress(
            TextColumn("import"), BarColumn(), TextColumn("{task.completed}/{task.total} files"),
            console=err, disable=args.json or not err.is_terminal,
        ) as bar:
            task = bar.add_task("import", total=len(files))
            for f in files:
                bar.advance(task)
                current = f
                # A symlink given or found is the user's own: its file is read
                # (the reader never follows one: in the store, a symlink at an
                # entry's place is not a cache).
                src = Path(os.path.realpath(f)) if f.is_symlink() else f
                if not _mlx_can_open(src):
                    # Not "damaged", which MLX's error made of it.
                    failed.append((f, f"{NOT_UTF8}: rename it, or copy it, to import it"))
                    continue
                try:
                    got = read_cache_file(src)
                except CacheFileError as exc:
                    failed.append((f, str(exc)))
                    continue
                model = args.model or got.model
                if not model:
                    failed.append((f, "this format records no model fingerprint: give --model"))
                    continue
                if got.model and model != got.model:
                    # A cache is only ever restored for the model that made it:
                    # relabelling one would hand another model its keys and values.
                    failed.append((f, f"the file records model {got.model!r}, not --model "
                                      f"{model!r} (leave --model out to keep its own)"))
                    continue
                cache_id = args.id or got.cache_id or f.name.removesuffix(naming.SUFFIX)
                first = taken.get((model, cache_id))
                if first is not None:
                    # Two files named alike in different directories: the second
                    # would replace the first without a word.
                    failed.append((f, f"{model} / {cache_id} was imported from {first} already "
                                      f"(import this one alone, with --id)"))
                    continue
                if model not in stored:
                    try:
                        stored[model] = {e.cache_id for e in _loadable(kv, model)}
                    except DaemonUnavailable as exc:
                        gone = str(exc)
                        failed.append((f, f"not imported: {exc}"))
                        break
                # By name too: a legacy cache at a hashed place lists without its id.
                replaced = cache_id in stored[model] or os.path.lexists(
                    naming.entry_path(kv.root, model, cache_id))
                if replaced and not args.replace:
                    # An old backup imported over the live conversation would
                    # replace it without a word.
                    failed.append((f, f"{model} / {cache_id} is already in the store (give "
                                      f"--replace to replace it)"))
                    continue
                meta = {k: v for k, v in got.metadata.items()
                        if isinstance(v, str) and not k.startswith("kvkeeper.")} \
                    if got.format != st.FORMAT else got.metadata
                if not kv.save(model, cache_id, got.cache, got.token_ids, metadata=meta):
                    if not kv.connected:  # gone between two files
                        gone = f"the daemon at {kv.socket_path} went away"
                        failed.append((f, f"not imported: {gone}"))
                        break
                    failed.append((f, "the client did not hand it to the daemon (over the "
                                      "client's in-flight budget, or the daemon's size limit)"))
                    continue
                del got
                # One file at a time: each gets its own answer, and the files
                # never wait in memory together (the daemon refuses what is over
                # its pending budget).
                try:
                    written = kv.flush(timeout=300)
                except DaemonUnavailable as exc:
                    # What is imported so far is still reported.
                    gone = str(exc)
                    failed.append((f, f"not known to be written: {exc}"))
                    break
                if not written:
                    failed.append((f, "the daemon could not write it (see its log)"))
                    continue
                taken[(model, cache_id)] = f
                done.append((f, model, cache_id, replaced))
    except KeyboardInterrupt:
        # What was imported is still reported (also after a second Ctrl-C
        # as the client closed, waiting for the daemon to confirm what it
        # sent), and the file on its way named: its save may be written yet
        # (a run with --replace imports it again).
        stopped = True
        reported = {p for p, *_ in done} | {p for p, _ in failed}
        if current is not None and current not in reported:
            failed.append((current, "interrupted: it may be imported or not (see "
                                    "kvkeeper ls; import it again with --replace)"))
    if args.json:
        _print_json({"imported": [{"path": str(p), "model": mo, "cache_id": c, "replaced": r}
                                  for p, mo, c, r in done],
                     "failed": [{"path": str(p), "reason": r} for p, r in failed]})
    else:
        for p, mo, c, r in done:
            out.print(Text.assemble("imported ", shown(p), " as ", shown(mo), " / ", shown(c),
                                    " (replaced the stored entry)" if r else ""))
        for p, r in failed:
            out.print(Text.assemble(("not imported", "red"), " ", shown(p), ": ", shown(r)))
    if stopped:
        raise KeyboardInterrupt  # exit 130, once the report is out
    if gone is not None:
        err.print("kvkeeper: the daemon went away; the files after it were not imported",
                  markup=False)
        return 3
    return 1 if failed else 0


#: Why a path MLX is given fails (std::bad_cast, from its loader and writer).
NOT_UTF8 = "MLX cannot open a path that is not valid UTF-8"


def _mlx_can_open(path: Path) -> bool:
    """Whether MLX can open ``path`` (it takes paths as UTF-8 text)."""
    try:
        # As given: a relative one opens in a directory whose own name is not.
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _each_layer(layers: list[Any]) -> Iterator[Any]:
    """Every layer, and the children of a CacheList after it."""
    for layer in layers:
        yield layer
        children = getattr(layer, "caches", None)
        if isinstance(children, (list, tuple)):
            yield from _each_layer(list(children))


def _mlx_lm_classes_only(layers: list[Any]) -> list[str]:
    return [f"{type(layer).__module__}.{type(layer).__name__}" for layer in _each_layer(layers)
            if type(layer).__module__ != "mlx_lm.models.cache"]


def _lost_by_mlx_lm_files(layers: list[Any]) -> list[str]:
    """The layers whose offset mlx-lm's own file loses: their state leaves it
    out, and it differs from their row count. (Under mlx-lm 0.31 a
    ChunkedKVCache also loses its spare rows there, as in mlx-lm's own files:
    the README says so.)"""
    lost = []
    for layer in _each_layer(layers):
        name, offset = type(layer).__name__, getattr(layer, "offset", None)
        keys = getattr(layer, "keys", None)
        if (name == "ConcatenateKVCache" and keys is not None
                and keys.shape[-2] != offset):
            lost.append(f"a trimmed ConcatenateKVCache ({offset} of {keys.shape[-2]} rows)")
        if (name == "ChunkedKVCache" and hasattr(type(layer), "meta_state")
                and getattr(layer, "start_position", 0) > 0):
            lost.append(f"a ChunkedKVCache trimmed at the front (start_position "
                        f"{layer.start_position}) as mlx-lm 0.31 saves it")
    return lost


def _read_entry(root: Path, model: str, cache_id: str) -> Any:
    """The entry ``model`` / ``cache_id`` read from the files under ``root``,
    or None when it has none."""
    from kvkeeper.client.reader import CacheFileError, read_cache_file

    path = naming.entry_path(root, model, cache_id)
    if not path.exists():
        return None
    for d in (path.parent.parent, path.parent):
        if d.is_symlink():
            # As the daemon and load(): a symlink planted for sessions/ or the
            # model's directory leads out of the store, and is not followed.
            raise CommandError(f"cannot export {model} / {cache_id}: {d} is a symlink, "
                               f"not followed")
    try:
        return read_cache_file(path, model=model, cache_id=cache_id)
    except CacheFileError as exc:
        raise CommandError(f"cannot export {model} / {cache_id}: {exc}") from None


def export(args: argparse.Namespace) -> int:
    from mlx_lm.models.cache import save_prompt_cache

    from kvkeeper.client.legacy import (
        EXPORT_CACHE_ID_KEY,
        EXPORT_METADATA_KEY,
        EXPORT_MODEL_KEY,
        EXPORT_TOKENS_KEY,
    )

    dest: Path = args.path
    if dest.suffix != naming.SUFFIX:
        # (".safetensors" alone is a name with no suffix, to pathlib and mlx-lm.)
        need = (f"give a name before {naming.SUFFIX}" if dest.name == naming.SUFFIX
                else f"the file name must end in {naming.SUFFIX}")
        raise CommandError(f"{dest}: {need} (mlx-lm's loader expects it)", status=2)
    if dest.is_dir():
        raise CommandError(f"{dest} is a directory; give a file name", status=2)
    if not dest.parent.is_dir():
        raise CommandError(f"{dest.parent} is not an existing directory", status=2)
    if not _mlx_can_open(dest):
        raise CommandError(f"{dest}: {NOT_UTF8}: choose another name (mlx-lm's loader could "
                           f"not read the file back)", status=2)
    naming.check_key(args.model, args.cache_id)
    kv = client(args.socket, required=False, root=args.root)
    misses: list[str] = []
    try:
        # No daemon to ask: the default root is read, and must be a store.
        root = _root(args, kv) if args.root is not None or not kv.connected else None
        if root is None or (kv is not None and kv.connected
                            and kv.root.resolve() == root.resolve()):
            root = kv.root
            _not_inside(dest, root)
            with _load_misses() as misses:
                got = kv.load(args.model, args.cache_id)
            where = ""
        else:
            _not_inside(dest, root)
            if kv is not None and kv.connected:
                _not_inside(dest, kv.root)  # the running daemon's store, too
            # Another root than the running daemon's (or none runs): read the
            # file there; the daemon writes by rename, so it is whole.
            got = _read_entry(root, args.model, args.cache_id)
            where = f" under {root}"
    finally:
        if kv is not None:
            kv.close()
    if got is None and misses:
        # The file was there but could not be used (a damaged one has just
        # been moved to quarantine/): "no entry" misled.
        raise CommandError(f"{args.model} / {args.cache_id} cannot be read: {misses[-1]}")
    if got is None:
        raise CommandError(f"no entry {args.model} / {args.cache_id}{where}")
    foreign = _mlx_lm_classes_only(got.cache)
    if foreign:
        raise CommandError(f"mlx-lm's loader cannot rebuild {sorted(set(foreign))}; only caches "
                           f"of mlx_lm.models.cache classes can be exported")
    lost = _lost_by_mlx_lm_files(got.cache)
    if lost:
        # Its loader would take the row count for the offset: other logits, no error.
        raise CommandError(f"mlx-lm's file cannot record the offset of {lost[0]}; "
                           f"mlx-lm's loader would restore it wrong")
    # No dots in the keys: mlx-lm's loader turns "a.b" into nested dicts.
    meta = {EXPORT_MODEL_KEY: args.model, EXPORT_CACHE_ID_KEY: args.cache_id,
            EXPORT_TOKENS_KEY: json.dumps(got.token_ids)}
    if got.metadata:
        meta[EXPORT_METADATA_KEY] = json.dumps(got.metadata)
    # Not named after dest: a name near the 255-byte limit left no room for
    # the additions (ENAMETOOLONG, naming a file the user never gave).
    tmp = dest.with_name(f".kvkeeper-export.{os.getpid()}.tmp{naming.SUFFIX}")
    replaced = os.path.lexists(dest)
    try:
        # The file holds a conversation: 0600 like the store's own files, from
        # its creation on (mlx opens it for writing without changing its mode).
        tmp.unlink(missing_ok=True)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))
        save_prompt_cache(str(tmp), got.cache, metadata=meta)
        os.chmod(tmp, 0o600)  # in case the writer replaced the file instead
        # Durable as the store's files: a power cut must not leave an empty
        # file where a good export was.
        _fsync_path(tmp, os.O_RDONLY)
        os.replace(tmp, dest)
    except BaseException as exc:
        # Ctrl-C too: the tmp file is a whole hidden copy of the conversation,
        # and no later run looks for it (its name has this run's pid).
        with contextlib.suppress(OSError):  # the error to report is the first
            tmp.unlink(missing_ok=True)
        if isinstance(exc, (OSError, RuntimeError)):  # mlx: a file it cannot open
            raise CommandError(f"cannot write {dest}: {exc}") from None
        raise
    try:
        _fsync_path(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        # Written and in place: only the rename's durability is not vouched
        # for (a directory this user may write but not read, say).
        err.print(Text.assemble("kvkeeper: warning: wrote ", shown(dest), ", but could not "
                                f"fsync its directory ({exc.strerror or exc}): a power cut "
                                f"may still undo the rename"))
    # Not mlx_lm.generate --prompt-cache-file: it also wants the model and
    # tokenizer config in the metadata, which kvkeeper does not have.
    out.print(Text.assemble("wrote ", shown(dest),
                            f" ({human(dest.stat().st_size)}, {len(got.token_ids or [])} tokens"
                            f"{', replacing the file that was there' if replaced else ''}); "
                            f"open it with mlx_lm.models.cache.load_prompt_cache"))
    return 0


@contextmanager
def _load_misses() -> Iterator[list[str]]:
    """The reasons of the client's load misses meanwhile (the commands turn
    the log off; these are what they have to say)."""
    import logging

    reasons: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "event=load_miss" in text:
                reasons.append(text.partition(" reason=")[2] or text)
            elif hasattr(record, "kvkeeper_moved_to") and reasons:
                # The reason names the entry's path, where the file is no more.
                reasons[-1] += f" (the daemon moved the file into {record.kvkeeper_moved_to}/)"

    logger = logging.getLogger("kvkeeper.client")
    handler, level = Catch(logging.INFO), logging.root.manager.disable
    propagate, logger.propagate = logger.propagate, False  # said once, by the error
    was = logger.level
    logger.setLevel(logging.INFO)  # (setLevel also clears the loggers' level cache)
    logger.addHandler(handler)
    logging.disable(logging.NOTSET)
    try:
        yield reasons
    finally:
        logging.disable(level)
        logger.removeHandler(handler)
        logger.propagate = propagate
        logger.setLevel(was)


def _not_inside(dest: Path, root: Path) -> None:
    """Refuse an export into the store: its files are the daemon's (one put at
    another entry's place replaced that entry behind the daemon's back)."""
    try:
        inside = dest.parent.resolve().is_relative_to(root.resolve())
    except OSError:
        return  # the write reports what is wrong with the place
    if inside:
        raise CommandError(f"{dest} is inside the store ({root}), whose files are the "
                           f"daemon's; export to another directory", status=2)


# ------------------------------------------------------------------ services

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
    # clients then use /tmp/kvkeeper-UID; on macOS it follows $TMPDIR).
    if sources["socket"] == "default":
        pinned.socket = values["socket"]
    return serve_args_for_service(pinned), values


def _refuse_a_daemon_the_service_did_not_start(sf: Any, values: dict[str, Any]) -> None:
    """A daemon started by hand on the service's root or socket makes the
    service exit 2 at every start: systemd then gives up on it, launchd
    retries every 10 s, and install-service said "started". Refused (exit 2)
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


def install_service(args: argparse.Namespace) -> int:
    from kvkeeper import service

    platform = {"macos": "darwin", "linux": "linux", None: None}[args.platform]
    serve_args, values = _service_settings(args)
    sf = service.service_file(serve_args, values["drain_timeout"],
                              background=values["cpu_policy"] == "batch",
                              **({"platform": platform} if platform else {}))
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
    out.print(Text.assemble("installed ", shown(sf.path), "" if args.no_load else " and started it"))
    return 0


def uninstall_service(args: argparse.Namespace) -> int:
    from kvkeeper import service

    platform = {"macos": "darwin", "linux": "linux", None: None}[args.platform]
    sf = service.service_file([], 20.0, **({"platform": platform} if platform else {}))
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


