"""Open a cache file without a daemon: kvkeeper's own format and the two
formats users already have (the reference ``cache_persist.py`` schema "3" and
``mlx_lm.models.cache.save_prompt_cache``).

Files are only ever replaced whole, so reading one directly is always safe.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import msgspec

from kvkeeper import config
from kvkeeper.client.codec import MLX_UNREADABLE_DTYPES, CodecError, LayoutDamage, restore_cache
from kvkeeper.client.tokens import token_id_list
from kvkeeper.logs import get_logger
from kvkeeper.protocol import safetensors as st

log = get_logger("kvkeeper.client")


class CacheFileError(Exception):
    """A file that cannot give back a usable cache; the message says why.

    ``damaged`` is True when the file itself is bad (failed checksum,
    another model's or another id's file, not a regular file: a directory, or
    a symlink, never followed) and can never be served for its key;
    False when the file may be fine but cannot be used here and now (a cache
    class this process cannot import, a dtype this MLX cannot load or this
    kvkeeper does not know in a file otherwise sound; padding past
    this machine's memory; a file
    this process cannot open or read now: no permission, an I/O error; or
    the file was replaced mid-read).
    ``replaced`` is True for the last: reading the path again gives a whole
    newer version.
    """

    def __init__(self, message: str, *, damaged: bool = True, replaced: bool = False) -> None:
        super().__init__(message)
        self.damaged = damaged
        self.replaced = replaced


@dataclass
class LoadedCache:
    """A restored prompt cache. Duck-types mlx-vlm's ``PromptCacheState``:
    ``.cache``, ``.token_ids``, ``find_prefix_length`` and ``update``."""

    cache: list[Any]
    token_ids: list[int] | None
    metadata: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    cache_id: str | None = None
    path: Path | None = None
    format: str = st.FORMAT

    def find_prefix_length(self, new_ids: Any) -> int:
        """Number of leading tokens of ``new_ids`` (token ids of any kind
        ``Client.save`` takes; ValueError for others) this cache already holds."""
        new_ids = token_id_list(new_ids)
        if self.token_ids is None:
            return 0
        n = min(len(self.token_ids), len(new_ids))
        for i in range(n):
            if self.token_ids[i] != new_ids[i]:
                return i
        return n

    def update(self, token_ids: Any, kv_cache: list[Any]) -> None:
        self.token_ids = token_id_list(token_ids)
        self.cache = kv_cache


def read_cache_file(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    model: str | None = None,
    cache_id: str | None = None,
) -> LoadedCache:
    """Open any supported cache file and rebuild its cache layers.

    ``verify`` (default on) checks every tensor against the checksum the daemon
    recorded, which reads and evaluates every array, after checking that the
    header's tensors tile the file exactly, and the header's own checksum;
    with it off, arrays stay lazy (each is read from the file when first
    evaluated) and MLX's loader checks the layout (each tensor inside the
    file and of its shape's size; with MLX older than 0.31.2, which does not,
    kvkeeper's own check runs first). Files of the older formats carry no
    checksums.
    ``model`` / ``cache_id``, when given, must match what the file records
    (an older format may record neither: then they are not checked). Raises
    CacheFileError for anything that is not a usable cache, TypeError for
    a ``verify`` that is not a bool (as ``Client.load`` does).
    """
    # verify="no" would be true: checked, where a lazy read was asked for.
    return read_file(Path(path), config.check_flag("verify", verify), model, cache_id)


def read_file(path: Path, verify: bool, model: str | None, cache_id: str | None,
              regular: bool = False) -> LoadedCache:
    """``read_cache_file``; ``regular`` says the caller has just seen a
    regular file at ``path`` (an lstat is a few us of a lazy load)."""
    # A verified load reads every byte: checking the header ourselves first
    # costs nothing beside that. A lazy load is what the generation loop waits
    # for, and reading the header a second time was a quarter of it (512 MiB:
    # 0.3-0.45 ms of 1.7 ms): there MLX's own checks (every tensor's offsets
    # against its size and the file's) stand for ours when it makes them.
    if verify or not MLX_CHECKS_OFFSETS:
        header = _header(path, model, cache_id, verify)
    else:
        header = None
        if not regular:
            _regular_file(path)
    try:
        # Every supported format is safetensors; MLX would otherwise go by the
        # name, and refuse a file moved aside (".safetensors.<ns>") or renamed.
        # (The stubs' return type covers every format and flag.)
        loaded = mx.load(str(path), format="safetensors", return_metadata=True)
        arrays, meta = cast("tuple[dict[str, mx.array], dict[str, str]]", loaded)
    except Exception as exc:  # noqa: BLE001 - MLX raises several types for bad files
        if header is None:
            header = _header(path, model, cache_id, verify)  # our reason, if the layout's
        _header_sums(path, header)
        # The header checked out (its layout, each tensor within the file,
        # its checksum): what MLX refused is this process's trouble, not
        # damage. A dtype this MLX cannot load; or a read that failed here
        # (EIO) and may pass: taken for damage, the file was moved aside for
        # every client.
        unreadable = sorted({str(t.get("dtype")) for t in header.tensors.values()}
                            & MLX_UNREADABLE_DTYPES)
        why = f" (it holds {', '.join(unreadable)} tensors)" if unreadable else ""
        raise CacheFileError(f"{path}: MLX cannot read it: {exc}{why}", damaged=False) from None
    if header is None and not st.written_by_kvkeeper(meta):
        # The older formats carry no checksums: our layout check (tensors
        # tiling the file) is all that refuses two tensors over the same
        # bytes, which MLX serves alike. They are rare: their lazy loads
        # can pay for the header's second read.
        header = _header(path, model, cache_id, verify)
    if header is not None and meta != header.metadata:
        raise CacheFileError(f"{path}: replaced while being read; try again", damaged=False,
                             replaced=True)
    if verify and header is not None:
        # The header's own checksum, before its model, format or token ids
        # are believed (a flipped byte in the format name made a file
        # another program's, which the daemon would then never replace).
        _header_sums(path, header)
    if st.written_by_kvkeeper(meta):
        return _kvkeeper_file(path, header, arrays, meta, verify, model, cache_id)
    from kvkeeper.client.legacy import (
        EXPORT_CACHE_ID_KEY,
        MLX_LM_PROMPT_CACHE,
        LegacyDamage,
        decode_legacy,
        detect_legacy,
        entry_metadata,
    )

    fmt = detect_legacy(meta)
    if fmt is None:
        raise CacheFileError(f"{path}: not a kvkeeper, cache_persist or mlx-lm cache file")
    try:
        legacy = decode_legacy(arrays, meta)
    except CodecError as exc:
        # Damage, or what this process cannot rebuild (a class not installed).
        raise CacheFileError(f"{path}: {exc}", damaged=isinstance(exc, LegacyDamage)) from None
    if model is not None and legacy.model_fingerprint not in (None, model):
        raise CacheFileError(
            f"{path}: saved for model {legacy.model_fingerprint!r}, not {model!r}"
        )
    recorded_id = (legacy.metadata.get(EXPORT_CACHE_ID_KEY)
                   if legacy.format == MLX_LM_PROMPT_CACHE else None)
    if cache_id is not None and recorded_id not in (None, cache_id):
        raise CacheFileError(f"{path}: holds cache {recorded_id!r}, not {cache_id!r}")
    return LoadedCache(
        cache=legacy.layers,
        token_ids=legacy.token_ids,
        metadata=entry_metadata(legacy.format, legacy.metadata),
        model=legacy.model_fingerprint,
        cache_id=recorded_id,
        path=path,
        format=legacy.format,
    )


def _mlx_checks_offsets() -> bool:
    """Whether this MLX refuses a safetensors file whose tensors lie outside
    it or do not match their shapes. 0.31.2 does; 0.29 to 0.31.1 load such
    a file and read past its end, or another tensor's bytes, when evaluated."""
    try:
        version = tuple(int(x) for x in mx.__version__.split(".")[:3])  # type: ignore[attr-defined]  # not in the stubs
    except ValueError:  # a development build: no way to tell
        return False
    return version >= (0, 31, 2)


MLX_CHECKS_OFFSETS = _mlx_checks_offsets()



def cannot_open(path: Path, exc: OSError) -> CacheFileError:
    """The CacheFileError for a file that could not be opened (or looked at):
    damaged unless the error is this process's, or may pass."""
    return CacheFileError(f"{path}: cannot open: {st.why_not_opened(path, exc)}",
                          damaged=not (st.says_nothing_of_the_file(exc)
                                       or exc.errno in st.MAY_PASS))


def _regular_file(path: Path) -> None:
    """Refuse what is not a regular file before MLX opens it (MLX follows
    symlinks, and opening a FIFO would block)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        raise cannot_open(path, exc) from None
    if not stat.S_ISREG(mode):
        raise CacheFileError(f"{path}: not a regular file")


def _header(path: Path, model: str | None = None, cache_id: str | None = None,
            verify: bool = False) -> st.FileHeader:
    try:
        return st.read_file_header(path)
    except OSError as exc:
        raise cannot_open(path, exc) from None
    except st.UnknownDtypeError as exc:
        raise _dtype_not_known(path, exc, model, cache_id, verify) from None
    except st.LayoutError as exc:
        raise CacheFileError(f"{path}: {exc}") from None


def _dtype_not_known(path: Path, exc: st.UnknownDtypeError, model: str | None,
                     cache_id: str | None, verify: bool) -> CacheFileError:
    """The error for a file holding a dtype kvkeeper does not know: damage
    when its header's checksum fails, or it is another key's file, or (read
    verified) a tensor's bytes fail theirs; else what was written, by a
    newer kvkeeper say, which moved aside was lost for the clients that can
    read it."""
    if not exc.header_vouched():
        return CacheFileError(f"{path}: {exc}")
    if (other := _other_key(path, exc.metadata, model, cache_id)) is not None:
        return other
    if verify:  # the checksums go by bytes: they can be checked all the same
        try:
            with st.open_bytes(path) as (f, _):
                st.verify_data(f, exc.header)
        except OSError as oserr:
            return cannot_open(path, oserr)
        except st.LayoutError as damage:
            return CacheFileError(f"{path}: {damage}")
    return CacheFileError(f"{path}: {exc}", damaged=False)


def _other_key(path: Path, meta: dict[str, str], model: str | None,
               cache_id: str | None) -> CacheFileError | None:
    """The error for a kvkeeper file whose header names another key than the
    one asked for (None: not asked, or the same)."""
    if model is not None and meta.get(st.MODEL_KEY) != model:
        return CacheFileError(f"{path}: saved for model {meta.get(st.MODEL_KEY)!r}, not {model!r}")
    if cache_id is not None and meta.get(st.CACHE_ID_KEY) != cache_id:
        return CacheFileError(f"{path}: holds cache {meta.get(st.CACHE_ID_KEY)!r}, "
                              f"not {cache_id!r}")
    return None


#: Made once: a decoder per call cost 30-70 us of a lazy load.
_TOKEN_IDS = msgspec.json.Decoder(list[int] | None)
_USER_METADATA = msgspec.json.Decoder(dict[str, str])


def _kvkeeper_file(
    path: Path,
    header: st.FileHeader | None,
    arrays: dict[str, mx.array],
    meta: dict[str, str],
    verify: bool,
    model: str | None,
    cache_id: str | None,
) -> LoadedCache:
    if (other := _other_key(path, meta, model, cache_id)) is not None:
        raise other
    if verify:
        assert header is not None  # read_cache_file reads it for every verified load
        _verify(path, header, arrays)
    try:
        token_ids = _TOKEN_IDS.decode(meta.get(st.TOKENS_KEY, "null"))
        user = _USER_METADATA.decode(meta.get(st.USER_KEY, "{}"))
        layers_json = meta[st.LAYERS_KEY]
    except (KeyError, msgspec.DecodeError) as exc:
        raise CacheFileError(f"{path}: bad metadata: {type(exc).__name__}: {exc}") from None
    try:
        layers = restore_cache(arrays, layers_json, header.tensors if header else None,
                               strict=True)
    except LayoutDamage as exc:
        raise CacheFileError(f"{path}: {exc}", damaged=True) from None
    except CodecError as exc:
        if header is None:
            # A lazy load left the layout to MLX, which takes some our check
            # refuses (e.g. two negative dimensions of the right product):
            # such a file is damaged, not just unusable here.
            header = _header(path, model, cache_id, verify)
        if not verify:
            # The layer description is in the header, which a lazy load did
            # not check: a flipped byte in a class name was taken for a file
            # of a newer kvkeeper's and never moved aside.
            _header_sums(path, header)
        # The header's checksum passed (and the data's, when verified): this
        # is what was saved, but this process cannot rebuild it (e.g. a class
        # it cannot import).
        raise CacheFileError(f"{path}: {exc}", damaged=False) from None
    return LoadedCache(
        cache=layers,
        token_ids=token_ids,
        metadata=user,
        model=meta.get(st.MODEL_KEY),
        cache_id=meta.get(st.CACHE_ID_KEY),
        path=path,
    )


def _header_sums(path: Path, header: st.FileHeader) -> dict[str, str] | None:
    """The header's tensor checksums, its own checksum checked first (kept
    once checked); a header that fails it is a damaged file."""
    try:
        return header.checksums
    except st.LayoutError as damage:
        raise CacheFileError(f"{path}: {damage}") from None


def _verify(path: Path, header: st.FileHeader, arrays: dict[str, mx.array]) -> None:
    sums = _header_sums(path, header)
    if sums is None or set(sums) != set(arrays):
        raise CacheFileError(f"{path}: checksums missing or not covering every tensor")
    try:
        mx.eval(list(arrays.values()))
    except Exception as exc:  # noqa: BLE001 - MLX raises RuntimeError for any failed read
        # The header, just read, says the file holds every byte: what failed
        # is as likely this process (out of memory: "Unable to read from
        # file", measured under an address-space limit) as the file, so it
        # is not moved aside; a file cut short since fails the next header check.
        raise CacheFileError(f"{path}: MLX could not read its tensors: {exc}",
                             damaged=False) from None
    got = _checksums_of(arrays)
    for name in arrays:
        if got[name] != sums[name]:
            raise CacheFileError(f"{path}: checksum mismatch in tensor {name!r}")


#: Below this many bytes a second hashing thread costs more than it saves.
_PARALLEL_HASH_BYTES = 16 * 1024 * 1024


def _checksums_of(arrays: dict[str, mx.array]) -> dict[str, str]:
    """The checksum of every array, the work shared by two threads when there
    is enough of it: xxhash lets go of the GIL for large buffers (512 MiB on
    2 cores: 17 ms of hashing in one thread, about 12 in two)."""
    items = list(arrays.items())
    got: dict[str, str] = {}
    errors: list[BaseException] = []

    def hash_all(part: list[tuple[str, mx.array]]) -> None:
        try:
            for name, arr in part:
                got[name] = st.checksum(memoryview(arr))  # type: ignore[arg-type]  # stubs lack the buffer protocol
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    if (os.cpu_count() or 1) < 2 or sum(a.nbytes for _, a in items) < _PARALLEL_HASH_BYTES:
        hash_all(items)
    else:
        helper = threading.Thread(target=hash_all, args=(items[1::2],),
                                  name="kvkeeper-verify", daemon=True)
        helper.start()
        hash_all(items[0::2])
        helper.join()
    if errors:
        raise errors[0]
    return got
