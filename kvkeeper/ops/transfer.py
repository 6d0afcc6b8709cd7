"""``import`` and ``export``: cache files in and out of the store (import
through the daemon, export as mlx-lm's own file format)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn
from rich.text import Text

from kvkeeper.ops.common import (
    CommandError,
    client,
    counted,
    err,
    fsync_path,
    human,
    key_shown,
    loadable,
    out,
    print_json,
    same_dir,
    shown,
    store_root,
    within,
)
from kvkeeper.protocol import messages as m
from kvkeeper.protocol import naming
from kvkeeper.protocol import safetensors as st
from kvkeeper.walk import walk


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
    return _composed_first(files), empty


#: How the daemon words a save its writer could not write (a SaveRefused).
_WRITE_FAILED = "writing it failed: "


def _cache_files_under(directory: Path) -> list[Path]:
    """Every ``*.safetensors`` under ``directory`` (not through links to
    directories), sorted. A subdirectory removed while this walks it is
    skipped, one it cannot list is reported: neither fails the import."""
    def unlisted(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            err.print(Text.assemble("cannot list ", shown(exc.filename), f": {exc.strerror}"))

    return sorted(Path(d) / name for d, _, names in walk(directory, onerror=unlisted)
                  for name in names if name.endswith(naming.SUFFIX))


def _composed_first(files: list[Path]) -> list[Path]:
    """``files`` in their order, but for paths that are one text composed
    (NFC) and decomposed: those twins together, where the first of them
    was, the composed one first. They give one id, and the file of that
    very name is the one imported (a decomposed name sorts first, and a
    shell's glob gives it first too)."""
    def composed(f: Path) -> str:
        return unicodedata.normalize("NFC", str(f))

    first_at: dict[str, int] = {}
    for i, f in enumerate(files):
        first_at.setdefault(composed(f), i)
    return sorted(files, key=lambda f: (first_at[composed(f)], composed(f) != str(f)))


def import_files(args: argparse.Namespace) -> int:
    from kvkeeper.client.reader import CacheFileError, read_cache_file

    # Checked as given: "" is not "none given" (it was ignored, silently).
    if args.model is not None:
        naming.check_id(args.model, "--model")
    if args.id is not None:
        naming.check_id(args.id, "--id")
    # (Counted once the paths are files: a file named twice is one file.)
    files, empty = _inputs(args.paths)
    if not files:
        # Nothing imported is not success: a script that imports a directory
        # must not read a typo or an empty download as done.
        raise CommandError("nothing to import: no *" + naming.SUFFIX + " files in "
                           + ", ".join(str(d) for d in empty))
    if args.id is not None and len(files) != 1:
        where = args.paths[0] if len(args.paths) == 1 else f"the {len(args.paths)} paths"
        raise CommandError(f"--id names one entry: give exactly one file with it; "
                           f"{where} hold{'s' if len(args.paths) == 1 else ''} "
                           f"{len(files)} *{naming.SUFFIX} files", status=2)
    for d in empty:
        err.print(Text.assemble(f"no *{naming.SUFFIX} files in ", shown(d)))
    from kvkeeper.client.channel import DaemonTimedOut, DaemonUnavailable
    from kvkeeper.client.client import DaemonError

    done: list[tuple[Path, str, str, bool]] = []
    failed: list[tuple[Path, str]] = []
    taken: dict[tuple[str, str], Path] = {}
    stored: dict[str, set[str]] = {}  # model -> ids in the store when first asked
    gone: str | None = None
    unchecked: str | None = None  # the daemon went away as the run checked its imports
    # ... or was up and did not answer that check (refused it, or too slow).
    unanswered: str | None = None
    halted: Path | None = None  # the run stopped at a file the daemon did not answer for
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
                    # (Its message names the file, which the report does.)
                    failed.append((f, str(exc).removeprefix(f"{src}: ")))
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
                # A name as the file system gives it: decomposed (NFD) from
                # HFS+ and SMB shares, where the server's ids are composed
                # (NFC), and the two are different ids: "café" missed.
                cache_id = args.id or got.cache_id or unicodedata.normalize(
                    "NFC", f.name.removesuffix(naming.SUFFIX))
                why = _no_key(model, cache_id, args, got)
                if why is not None:
                    # Before: the run ended there, as a usage error (exit 2),
                    # with nothing reported of the files before it.
                    failed.append((f, why))
                    continue
                first = taken.get((model, cache_id))
                if first is not None:
                    # Two files named alike in different directories: the second
                    # would replace the first without a word.
                    failed.append((f, f"{model} / {cache_id} was imported from {first} already "
                                      f"(import this one alone, with --id)"))
                    continue
                if model not in stored:
                    try:
                        stored[model] = {e.cache_id for e in loadable(kv, model)}
                    except (DaemonTimedOut, DaemonError) as exc:
                        # Up and slow, or refusing (busy): this file only.
                        # (Before, either ended the run with no report.)
                        failed.append((f, f"not imported: the daemon did not list the "
                                          f"model's entries: {exc}"))
                        continue
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
                refused_before = kv._refusals.last
                try:
                    # Checked again by the daemon as the save arrives: the
                    # check above sees files only, and a live conversation's
                    # first save on its way was replaced by the backup. (A
                    # daemon older than the flag refuses it: then only the
                    # check above.)
                    said = kv._daemon_here(5.0)
                    create = not args.replace and said is not None \
                        and m.version_tuple(said.version) >= m.CREATE_SINCE
                    handed = kv.save(model, cache_id, got.cache, got.token_ids, metadata=meta,
                                     create=create)
                except ValueError as exc:
                    # A cache or metadata save() refuses (its metadata over
                    # 8 MiB as JSON): before, a traceback ended the run.
                    failed.append((f, str(exc)))
                    continue
                if not handed:
                    if not kv.connected:  # gone between two files
                        gone = f"the daemon at {kv.socket_path} went away"
                        failed.append((f, f"not imported: {gone}"))
                        break
                    failed.append((f, "the client did not hand it to the daemon: it is larger "
                                      "than the daemon takes (raise its --max-pending-bytes) "
                                      "or than the client's in-flight budget"))
                    continue
                del got
                # One file at a time: each gets its own answer, and the files
                # never wait in memory together (the daemon refuses what is over
                # its pending budget).
                try:
                    written = kv.flush(timeout=FLUSH_TIMEOUT)
                except (DaemonTimedOut, DaemonError) as exc:
                    # The daemon is up: writing a large file on a slow disk,
                    # or refusing the flush (busy). Before, a timeout was
                    # called the daemon going away (exit 3), and a refusal
                    # ended the run with no report. The run stops: the next
                    # file's flush would answer for this save too, and its
                    # failure was reported as the next file's (a review).
                    halted = f
                    failed.append((f, f"not known to be written: {exc} (it may be yet: see "
                                      f"kvkeeper ls; import it again with --replace)"))
                    break
                except DaemonUnavailable as exc:
                    # What is imported so far is still reported.
                    gone = str(exc)
                    failed.append((f, f"not known to be written: {exc} (see kvkeeper ls; "
                                      f"import it again with --replace)"))
                    break
                if not written:
                    # Its refusal comes before the flush's answer, on the same connection.
                    refused = kv._refusals.last
                    if refused is None or refused is refused_before:
                        why = "the daemon could not write it (see its log)"
                    elif refused.code == "internal" \
                            and refused.message.startswith(_WRITE_FAILED):
                        # Told at once by a daemon since 0.2.9: with its reason.
                        why = (f"the daemon could not write it: "
                               f"{refused.message.removeprefix(_WRITE_FAILED)}")
                    elif refused.code == "exists":
                        why = (f"{model} / {cache_id} is already in the store, or a save of "
                               f"it is on its way (give --replace to replace it)")
                    else:
                        why = f"the daemon refused it: {refused.message}"
                    failed.append((f, why))
                    continue
                taken[(model, cache_id)] = f
                done.append((f, model, cache_id, replaced))
            if gone is None:
                try:
                    done, lost = _still_stored(kv, done)
                    failed += lost
                except (DaemonTimedOut, DaemonError) as exc:
                    unanswered = str(exc)
                except DaemonUnavailable as exc:
                    unchecked = str(exc)
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
        print_json({"imported": [{"path": str(p), "model": mo, "cache_id": c, "replaced": r}
                                  for p, mo, c, r in done],
                     "failed": [{"path": str(p), "reason": r} for p, r in failed]})
    else:
        for p, mo, c, r in done:
            out.print(Text.assemble("imported ", shown(p), " as ", key_shown(mo, c),
                                    " (replaced the stored entry)" if r else ""))
        for p, why in failed:
            out.print(Text.assemble(("not imported", "red"), " ", shown(p), ": ", shown(why)))
    if stopped:
        raise KeyboardInterrupt  # exit 130, once the report is out
    if gone is not None:
        err.print("kvkeeper: the daemon went away; the files after it were not imported",
                  markup=False)
        return 3
    if unchecked is not None:
        err.print(f"kvkeeper: the daemon went away as the run ended ({unchecked}): whether "
                  f"every import is still in the store was not checked (see kvkeeper ls)",
                  markup=False)
        return 3
    if halted is not None:
        # (Its name as every name is shown: a control character printed raw.)
        err.print(Text.assemble("kvkeeper: the daemon did not say it wrote ", shown(halted),
                                "; the files after it were not imported"))
        return 1
    if unanswered is not None:
        err.print(f"kvkeeper: the daemon did not answer the run's last check ({unanswered}): "
                  f"whether every import is still in the store was not checked (see "
                  f"kvkeeper ls)", markup=False)
        return 1
    return 1 if failed else 0


def _no_key(model: str, cache_id: str, args: argparse.Namespace, got: Any) -> str | None:
    """Why the key ``model`` / ``cache_id`` a file is imported under cannot
    be stored, and what to do; None when it can. (``--model`` and ``--id``
    were checked at the start.)"""
    try:
        naming.check_id(model, "model")
    except ValueError as exc:
        return f"the model the file records cannot be stored: {exc}"
    try:
        naming.check_id(cache_id, "cache id")
    except ValueError as exc:
        if got.cache_id:
            return f"the cache id the file records cannot be stored ({exc}): import it " \
                   f"alone, with --id"
        return f"its name gives no cache id ({exc}): import it alone, with --id"
    return None


def _still_stored(kv: Any, done: list[tuple[Path, str, str, bool]]) -> tuple[
        list[tuple[Path, str, str, bool]], list[tuple[Path, str]]]:
    """The imports still in the store at the end of the run, and the others
    with why: the disk budget evicted them for later files, or another
    client deleted them (an import said "imported" of entries already gone,
    exit 0). Raises DaemonUnavailable or DaemonError (nothing is then told)."""
    kept: list[tuple[Path, str, str, bool]] = []
    lost: list[tuple[Path, str]] = []
    listed: dict[str, set[str]] = {}
    for item in done:
        f, model, cache_id, _ = item
        if model not in listed:
            listed[model] = {e.cache_id for e in loadable(kv, model)}
        if cache_id in listed[model]:
            kept.append(item)
        else:
            lost.append((f, f"imported as {model} / {cache_id}, but no longer in the store "
                            f"when the run ended: evicted by the disk budget (--max-disk-bytes, "
                            f"--min-free-bytes) for the files after it, or deleted meanwhile"))
    return kept, lost


#: How long import waits for each file to be written (a large one on a slow disk).
FLUSH_TIMEOUT = 300.0

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
    if not os.path.lexists(path):
        return None
    for d in (path.parent.parent, path.parent):
        if d.is_symlink():
            # As the daemon and load(): a symlink planted for sessions/ or the
            # model's directory leads out of the store, and is not followed.
            raise CommandError(f"cannot export {key_shown(model, cache_id)}: {d} is a symlink, "
                               f"not followed")
    not_a_file = _not_a_file(path)
    if not_a_file:  # (a dangling symlink said "no entry")
        raise CommandError(f"cannot export {key_shown(model, cache_id)}: {not_a_file}")
    try:
        return read_cache_file(path, model=model, cache_id=cache_id)
    except CacheFileError as exc:
        raise CommandError(f"cannot export {key_shown(model, cache_id)}: {exc}") from None


def _not_a_file(path: Path) -> str | None:
    """What is at ``path`` when it is there and no regular file, for a message."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a special file (a FIFO, a socket or a device)")
    return f"{path} is {kind}, not a cache file"


def export(args: argparse.Namespace) -> int:
    from mlx_lm.models.cache import save_prompt_cache

    from kvkeeper.client.legacy import (
        EXPORT_CACHE_ID_KEY,
        EXPORT_METADATA_KEY,
        EXPORT_MODEL_KEY,
        EXPORT_TOKENS_KEY,
    )

    dest: Path = args.path
    if dest.is_dir():  # before the suffix: "must end in .safetensors" told of no directory
        raise CommandError(f"{dest} is a directory; give a file name", status=2)
    if dest.suffix != naming.SUFFIX:
        # (".safetensors" alone is a name with no suffix, to pathlib and mlx-lm.)
        need = (f"give a name before {naming.SUFFIX}" if dest.name == naming.SUFFIX
                else f"the file name must end in {naming.SUFFIX}")
        raise CommandError(f"{dest}: {need} (mlx-lm's loader expects it)", status=2)
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
        root = store_root(args, kv) if args.root is not None or not kv.connected else None
        if root is None or (kv is not None and kv.connected and same_dir(kv.root, root)):
            root = kv.root
            _not_inside(dest, root)
            # What is at the entry's place: a directory or symlink there is a
            # plain miss to load(), and the daemon moves it aside meanwhile.
            not_a_file = _not_a_file(naming.entry_path(root, args.model, args.cache_id))
            with _load_misses() as misses:
                got = kv.load(args.model, args.cache_id)
            if got is None and not misses and not_a_file:
                misses.append(f"{not_a_file} (the daemon moves it into {root}/quarantine/)")
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
        raise CommandError(f"{key_shown(args.model, args.cache_id)} cannot be read: {misses[-1]}")
    if got is None:
        raise CommandError(f"no entry {key_shown(args.model, args.cache_id)}{where}")
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
        fsync_path(tmp, os.O_RDONLY)
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
        fsync_path(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        # Written and in place: only the rename's durability is not vouched
        # for (a directory this user may write but not read, say).
        err.print(Text.assemble("kvkeeper: warning: wrote ", shown(dest), ", but could not "
                                f"fsync its directory ({exc.strerror or exc}): a power cut "
                                f"may still undo the rename"))
    # Not mlx_lm.generate --prompt-cache-file: it also wants the model and
    # tokenizer config in the metadata, which kvkeeper does not have.
    out.print(Text.assemble("wrote ", shown(dest),
                            f" ({human(dest.stat().st_size)}, {counted(len(got.token_ids or []), 'token')}"
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
                # The reason as said: the line's is quoted (a reason in
                # quotes, its own quotes escaped, read oddly after "cannot be
                # read:").
                reasons.append(getattr(record, "kvkeeper_reason", None)
                               or text.partition(" reason=")[2] or text)
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
        inside = within(dest.parent, root)
    except OSError:
        return  # the write reports what is wrong with the place
    if inside:
        raise CommandError(f"{dest} is inside the store ({root}), whose files are the "
                           f"daemon's; export to another directory", status=2)
