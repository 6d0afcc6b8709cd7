"""What the commands share: the consoles, the error that ends a command,
how names, sizes and times are shown, the client, listings, and the store's
root as a command finds it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import stat
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kvkeeper import plaintable
from kvkeeper.protocol import messages as m
from kvkeeper.protocol import naming
from kvkeeper.walk import walk

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


def key_shown(model: str, cache_id: str) -> str:
    """"model / id" for a message, each part as ``shown`` gives it (an id
    with a newline printed raw made a second line that looked like output)."""
    return f"{shown(model).plain} / {shown(cache_id).plain}"


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
        # serve on the same socket: without --socket it would take the default.
        serve = ("kvkeeper serve" if socket is None
                 else f"kvkeeper serve --socket {shell_word(kv.socket_path)}")
        raise CommandError(no_daemon(kv.socket_path, f" (start it: {serve})"), status=3)
    return kv


def one_line(error: object) -> str:
    """An error's text as one line: a control character in a path or name it
    quotes escaped (a newline made a second line that read as another
    message; an ESC drove the terminal). Names already shown stay as shown."""
    text = str(error)
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def shell_word(value: object) -> str:
    """``value`` (a path, say) as one word to paste into a shell. One holding
    a character that cannot be shown as it is (a tab, an ESC, a byte that
    is no UTF-8; any non-ASCII one where the output is not UTF-8) comes in
    bash's and zsh's ``$'...'`` form, each such character written as its
    bytes (``\\xHH``, which names the same file in any locale): ``one_line``
    leaves it alone, and pasted back it names the same file (``one_line``
    over a plain quoted word made a tab the two characters ``\\t``)."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    utf = out.encoding.startswith("utf") and err.encoding.startswith("utf")

    def as_is(ch: str) -> bool:
        return ch.isprintable() and (utf or ch.isascii())

    if all(map(as_is, text)):
        return shlex.quote(text)
    escaped = []
    for ch in text:
        if ch in "\\'":
            escaped.append("\\" + ch)
        elif as_is(ch):
            escaped.append(ch)
        else:  # its bytes in the file name: a byte os.fsdecode could not decode is that byte
            escaped.extend(f"\\x{b:02x}" for b in os.fsencode(ch))
    return "$'" + "".join(escaped) + "'"


def no_daemon(path: Path, hint: str, hint_if_stopped: str = "") -> str:
    """Why no daemon answered at ``path``: none runs (``hint`` follows), or
    one does and did not answer (``hint_if_stopped``)."""
    if _listening(path):  # a daemon stopped (SIGSTOP) or hung, not a stale socket
        return (f"the kvkeeper daemon at {path} did not answer within 2 s (is it stopped?)"
                f"{hint_if_stopped}")
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISSOCK(mode):
        # serve refuses it too: "start it" there would fail.
        what = "a directory" if stat.S_ISDIR(mode) else "not a socket"
        return f"no kvkeeper daemon at {path}: it is {what}; give the daemon's socket"
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


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True))


def entry_dict(e: m.Entry) -> dict[str, Any]:
    return {f: getattr(e, f) for f in e.__struct_fields__}

#: Up to this many rows a terminal gets rich's table, folded to its width;
#: more are drawn as for a pipe (rich took 14 s for 20,000).
RICH_ROWS = 1000


def print_table(title: str, columns: list[plaintable.Column],
                 rows: list[list[str | Text]]) -> None:
    """A listing on stdout. Piped, as wide as its rows need: rich would fold
    it to 80 columns, and an id cut across two rows cannot be copied whole
    (or grepped)."""
    if (not out.is_terminal or len(rows) > RICH_ROWS) and out.encoding.startswith("utf"):
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
    print_whole(table)


def print_whole(table: Table) -> None:
    """A table on stdout; piped, as wide as it needs (rich cut its cells to
    80 columns, or to COLUMNS)."""
    if out.is_terminal:
        out.print(table)
    else:
        need = Measurement.get(out, out.options.update_width(1 << 20), table).maximum
        Console(highlight=False, soft_wrap=True, width=max(out.width, need)).print(table)

def loadable(kv: Any, model: str) -> list[m.Entry]:
    """A model's entries and the caches of the older formats at entries'
    places (``legacy``): a load of their key returns them, so rm --model
    deletes them and import does not replace them unasked."""
    # (A legacy file at a hashed place has no id to give: none to delete by.)
    return [e for e in kv.entries(model, everything=True)
            if e.kind in ("entry", "legacy") and e.cache_id]


def same_dir(a: Path, b: Path) -> bool:
    """Whether two paths name one directory, by its identity, not its
    spelling: APFS is case-insensitive, and ``resolve()`` keeps the case it
    is given (``~/library/caches/kvkeeper`` is the store too)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def within(path: Path, root: Path) -> bool:
    """Whether directory ``path`` is ``root`` or a directory below it, by
    identity (see ``same_dir``): any way to reach the store's directories (a
    bind mount of ``sessions/``, another spelling) is the store. Raises
    OSError when ``root`` cannot be looked at."""
    top = os.stat(root)
    own = (top.st_dev, top.st_ino)
    here = path.resolve()
    # Its parents first: a store directory this process cannot list is
    # still found above a place inside it.
    for d in (here, *here.parents):
        try:
            seen = os.stat(d)
        except OSError:
            continue
        if (seen.st_dev, seen.st_ino) == own:
            return True
    info = os.stat(here)
    target = (info.st_dev, info.st_ino)
    for parent, dirs, _ in walk(root):
        for name in dirs:
            try:
                seen = os.stat(os.path.join(parent, name), follow_symlinks=False)
            except OSError:
                continue
            if (seen.st_dev, seen.st_ino) == target:
                return True
    return False


def fsync_path(path: Path, flags: int) -> None:
    from kvkeeper.daemon.durable import full_fsync

    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def store_root(args: argparse.Namespace, kv: Any) -> Path:
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
        said: Path = kv.root
        if not (said / naming.SESSIONS_DIR).is_dir():
            # The daemon's store as another mount namespace has it (a
            # container's daemon, its socket shared): checking nothing here
            # must not read as "all good" either.
            raise CommandError(f"the daemon's root {said} is not a kvkeeper store here (no "
                               f"{naming.SESSIONS_DIR}/ directory: a daemon in a container "
                               f"sees another file system?): give --root")
        return said
    if args.socket is not None:
        # The store of the daemon named: the configured root may be another.
        where = kv.socket_path if kv is not None else args.socket
        raise CommandError(no_daemon(where, " to name its root: give --root",
                                      "; give --root to work on its files without it"),
                           status=3)
    from kvkeeper.settings import client_path

    root = client_path("root")
    if not root.is_dir():
        # Checking nothing must not read as "all good".
        raise CommandError(f"no store at {root} (the root serve would use; no daemon runs "
                           f"to name another): give --root")
    return root
