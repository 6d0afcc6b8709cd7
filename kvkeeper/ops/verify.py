"""``verify``: check every entry's checksums, and with ``--repair`` move the
bad files aside (through the daemon, else holding its lock)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.text import Text

from kvkeeper.ops.common import (
    CommandError,
    client,
    counted,
    err,
    out,
    print_json,
    same_dir,
    shell_word,
    shown,
    store_root,
)
from kvkeeper.protocol import messages as m
from kvkeeper.protocol import naming
from kvkeeper.protocol import safetensors as st
from kvkeeper.protocol.legacy_formats import detect_legacy


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
        if d.is_symlink() and naming.is_entry_place(d / f"a{naming.SUFFIX}") and _leads_to_dir(d):
            # A model's directory moved and linked to, which the daemon will
            # not follow: its saves fail and its loads miss, and verify said
            # "all good" of the store. (A file, or a link to one, under such
            # a name may be anybody's notes: not the store's.)
            unlisted.append((d, LINKED_MODEL_DIR))
            continue
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


#: Why a model's directory that is a symbolic link is not checked.
LINKED_MODEL_DIR = ("a symbolic link, which the daemon never follows: no save or load of "
                    "this model goes through it")


def _leads_to_dir(link: Path) -> bool:
    """Whether ``link`` leads to a directory; False where that cannot be told
    (a target this process may not look at stopped the whole check)."""
    try:
        return link.is_dir()
    except OSError:
        return False


def verify(args: argparse.Namespace) -> int:
    kv = client(args.socket, required=False, root=args.root)
    try:
        root = store_root(args, kv)
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
                    with st.open_bytes(f, keep_atime=True) as (fh, info):
                        try:
                            header, newer = st.read_header(fh, info.st_size), None
                        except st.UnknownDtypeError as exc:
                            if not exc.header_vouched():
                                raise  # as any table refused (below)
                            # A newer kvkeeper's dtype: the rest is checked as
                            # for any file (the checksums go by bytes).
                            header, newer = exc.header, exc
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
                        elif newer is not None:  # sound, but not this kvkeeper's to read
                            unchecked.append((f, f"{newer}; its header's and its tensors' "
                                                 f"checksums pass"))
                except FileNotFoundError:
                    files.pop()  # gone meanwhile: not checked
                    bar.advance(task, size)
                except OSError as exc:
                    if st.says_nothing_of_the_file(exc):
                        unchecked.append((f, exc.strerror or str(exc)))
                        bar.advance(task, size)
                    elif exc.errno in st.MAY_PASS:
                        # Reported, never moved aside by --repair: a load
                        # leaves such a file in place too (the disk budget
                        # deletes quarantined files first).
                        unchecked.append((f, f"{exc.strerror or exc} (it may pass: run "
                                             f"verify again)"))
                        bar.advance(task, size)
                    else:
                        bad.append((f, st.why_not_opened(f, exc), judged))
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
        print_json({"root": str(root), "checked": checked,
                     "legacy_unchecked": [str(p) for p in legacy],
                     "not_caches": [str(p) for p in others],
                     "bad": [{"path": str(p), "reason": r} for p, r, _ in bad],
                     "could_not_read": [{"path": str(p), "reason": r} for p, r in unchecked],
                     "moved_aside": [str(p) for p in repaired],
                     "not_moved": [{"path": str(p), "reason": r} for p, r in refused
                                   if not r.startswith(_MAYBE)],
                     "maybe_moved": [{"path": str(p), "reason": r} for p, r in refused
                                     if r.startswith(_MAYBE)],
                     **({"repair_error": str(repair_error)} if repair_error else {})})
    else:
        out.print(Text.assemble(
            f"{counted(checked, 'file')} checked under ", shown(root),
            f", {counted(len(legacy), 'legacy file')} without checksums" if legacy else "",
            f", {counted(len(others), 'safetensors file')} "
            f"{'that is not a cache' if len(others) == 1 else 'that are not caches'} (left alone)"
            if others else ""))
        not_moved = dict(refused)
        for p, reason, _ in bad:
            out.print(Text.assemble(("BAD", "red"), " ", shown(p), ": ", shown(reason),
                                    (" (moved aside)", "green") if p in repaired else "",
                                    *((" (", shown(not_moved[p]), ")")
                                      if p in not_moved and not_moved[p].startswith(_MAYBE)
                                      else (" (not moved: ", shown(not_moved[p]), ")")
                                      if p in not_moved else ())))
        for p, reason in unchecked:
            out.print(Text.assemble(("NOT CHECKED", "yellow"), " ", shown(p), ": ",
                                    shown(reason), " (left in place)"
                                    if reason == LINKED_MODEL_DIR
                                    else " (this process could not read it; left in place)"))
        out.print(Text.assemble(
            (f"{len(bad)} bad", "red") if bad else
            ("" if unchecked else ("all good", "green")),
            ", " if bad and unchecked else "",
            (f"{len(unchecked)} not checked", "yellow") if unchecked else "",
            # What to do about them, where nothing was done yet: with the
            # options that named this store (without them, another).
            f" ({_repair_command(args.root, args.socket)} moves the bad ones aside, into "
            "quarantine/ or, on a model's own disk, beside their place)"
            if bad and not args.repair else ""))
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


def _repair_command(root: Path | str | None, socket: Path | str | None) -> str:
    """``kvkeeper verify --repair`` with the root and socket given (those not
    None), to paste into a shell: each a word of its own, whatever it holds
    (a tab, an ESC)."""
    words = ["kvkeeper", "verify", "--repair"]
    for flag, value in (("--root", root), ("--socket", socket)):
        if value is not None:
            # "--root=": a root starting with "-" taken for an option.
            words.append(f"{flag}={shell_word(value)}")
    return " ".join(words)


#: Why a bad file was left: it changed after it was judged (moved aside by a
#: load, replaced by a save), or gone, and the repair moves only the file judged.
_CHANGED = "replaced or removed since it was checked: left as it is"
_UNSEEN = "not even its status could be read: nothing to tell a newer file from"
#: Asked of a daemon that did not answer in time: it may move the file yet.
_MAYBE = "may have been moved, or may be yet"


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
    if kv is not None and kv.connected and same_dir(kv.root, root):
        from kvkeeper.client.channel import DaemonTimedOut, DaemonUnavailable
        from kvkeeper.client.client import DaemonError, DaemonShuttingDown

        for i, (path, reason, ident) in enumerate(bad):
            if ident is None:
                # Not even its lstat worked: nothing to tell a newer file from.
                refused.append((path, _UNSEEN))
                continue
            model, cache_id = _key_of(path)
            if model is None or cache_id is None:
                # The daemon moves files by key: a hashed name whose header
                # names another entry gives it none. Without a daemon,
                # --repair moves files by path. (Said on stderr alone, it
                # was missing from --json's not_moved and from the BAD line.)
                refused.append((path, "the daemon moves files by key, and neither its name "
                                      "nor its header tells its id: stop the daemon and run "
                                      "verify --repair again"))
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
            except DaemonUnavailable as exc:
                # Slow (a writer held by a slow disk), or gone: this one may
                # yet be moved, the rest were not tried. (Before, neither was
                # said, and a slow daemon ended the run as if none ran.)
                refused.append((path, f"{_MAYBE}: {exc}"))
                refused.extend((p, _UNSEEN if seen is None else
                                "not tried: the daemon did not answer the one before")
                               for p, _, seen in bad[i + 1:])
                if isinstance(exc, DaemonTimedOut):
                    raise CommandError(f"the repair stopped: {exc}; run verify --repair "
                                       f"again once it answers") from None
                raise
            if isinstance(reply, m.Deleted) and reply.existed:
                moved.append(path)
            else:
                refused.append((path, _CHANGED))
        return
    from kvkeeper.daemon.app import LOCK_NAME, AlreadyRunning, LockUnusable, _Lock, holder_socket
    from kvkeeper.daemon.store import Store

    owner = root.stat().st_uid
    if hasattr(os, "geteuid") and owner != os.geteuid():
        # Root repairing a user's store: quarantine/ (and a lock file) made
        # here would be root's, 0700, and shut that user's daemon out.
        refused.extend((path, "the store is another user's") for path, _, _ in bad)
        raise CommandError(f"{root} belongs to uid {owner}: run verify --repair as that user "
                           f"(what this process made there would be uid {os.geteuid()}'s, which "
                           f"that user's daemon could not use)", status=2)
    try:
        lock = _Lock(root / LOCK_NAME, f"kvkeeper verify --repair, pid {os.getpid()}")
    except AlreadyRunning as exc:
        # A daemon on another socket than the one asked (it is the one to
        # move them): none moved, and how to reach it said.
        sock = holder_socket(exc.holder)
        why = "another daemon serves this root" if sock else f"its lock is held ({exc.holder})"
        refused.extend((path, why) for path, _, _ in bad)
        if sock and kv is not None and same_dir(Path(sock).parent, kv.socket_path.parent) \
                and Path(sock).name == kv.socket_path.name:
            # The daemon asked is that one: it did not answer (stopped, hung).
            hint = f"; it did not answer at {sock} (is it stopped?): repair once it answers"
        elif sock:
            hint = f"; repair through it: {_repair_command(root, sock)}"
        else:
            hint = ""
        raise CommandError(f"{exc}{hint}", status=2) from None
    except LockUnusable as exc:
        # A root this user cannot write: the repair failed (exit 1), as it did
        # with the OSError; exit 2 is for usage and a root another holds.
        refused.extend((path, f"the root's lock cannot be taken: {exc}") for path, _, _ in bad)
        raise CommandError(str(exc)) from None
    try:
        store = Store(root)
        for path, _, ident in bad:
            if ident is None:
                refused.append((path, _UNSEEN))
                continue
            try:
                if store.quarantine_path(path, ident.st_ino, ident.st_mtime_ns) is not None:
                    moved.append(path)
                else:
                    refused.append((path, _CHANGED))
            except OSError as exc:
                refused.append((path, exc.strerror or str(exc)))
    finally:
        lock.release()
