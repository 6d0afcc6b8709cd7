"""Decoders for the two on-disk prompt-cache formats users already have.

* ``gezel-schema3``: files written by gezel's ``cache_persist.py`` (schema "3"):
  arrays keyed by their ``tree_flatten`` path in ``[layer.state ...]``, and in the
  metadata JSON lists ``classes``, ``class_modules``, ``meta_state``, a JSON map
  ``state_scalars`` (path -> scalar leaf), ``token_ids`` and
  ``model_fingerprint``. mlx-vlm classes, rebuilt with
  ``from_state(state, meta_state)``.
* ``mlx-lm-prompt-cache``: files written by ``mlx_lm.models.cache.save_prompt_cache``.
  Arrays keyed by the same paths; every scalar leaf is stored as an array and
  listed in the metadata, which is itself ``tree_flatten([user_metadata,
  class_names, scalars])``: ``0.<key>`` user metadata, ``1.<i>`` class names,
  ``2.0`` an empty sentinel and ``2.<i>.0``/``2.<i>.1`` a scalar's path and kind
  ("scalar", "string", "none"). mlx-lm classes, rebuilt with ``from_state(state)``.
  mlx-lm 0.31 and earlier wrote another layout: ``tree_flatten([meta_states,
  user_metadata, class_names])``, i.e. ``0.<i>...`` each layer's meta_state
  (strings), ``1.<key>`` user metadata, ``2.<i>`` class names, and no scalars
  among the arrays. Read as that version's loader read it; with mlx-lm 0.32
  (whose classes have no meta_state) the counters move into the state.

Neither writer's loader is used: both look class names up in a module's
globals(). Classes are resolved with the codec's rules instead (only inside
``mlx_lm.models.`` / ``mlx_vlm.models.``, only cache classes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_unflatten

from kvkeeper.client.cache_classes import (
    CodecError,
    OverMemory,
    is_composite_class,
    rebuild_composite,
    rebuild_layer,
    resolve_cache_class,
)
from kvkeeper.client.lm_api import BadCounter, rebuild_from_new, rebuild_from_old
from kvkeeper.protocol.legacy_formats import (
    GEZEL_SCHEMA3,
    MLX_LM_PROMPT_CACHE,
    detect_legacy,
    indexed,
)
from kvkeeper.settings import physical_memory

__all__ = ["GEZEL_SCHEMA3", "MLX_LM_PROMPT_CACHE", "LegacyCache", "decode_legacy", "detect_legacy"]

# Where each writer's own loader looks class names up.
_VLM_CACHE = "mlx_vlm.models.cache"
_LM_CACHE = "mlx_lm.models.cache"
#: The user metadata `kvkeeper export` adds to an mlx-lm prompt-cache file;
#: the entry's own metadata goes in as one JSON object (mlx-lm's loader would
#: turn a key with a dot into nested dicts).
EXPORT_MODEL_KEY, EXPORT_CACHE_ID_KEY, EXPORT_TOKENS_KEY, EXPORT_METADATA_KEY = (
    "kvkeeper_model", "kvkeeper_cache_id", "token_ids", "kvkeeper_metadata")

_MLX_LM_SCALAR = re.compile(r"2\.(\d+)\.([01])")


@dataclass
class LegacyCache:
    """A cache decoded from a legacy file."""

    format: str
    layers: list[Any]
    token_ids: list[int] | None
    model_fingerprint: str | None
    #: mlx-lm: the user metadata given to save_prompt_cache; gezel: the raw metadata.
    metadata: dict[str, str] = field(default_factory=dict)


class LegacyDamage(CodecError):
    """The file is damaged: what its writer always writes is missing or
    malformed (a field that is not JSON, an array its state names, a count
    out of range). Other CodecErrors may be this process's limits (a class
    this mlx-lm or mlx-vlm does not have), with the file sound."""


def decode_legacy(arrays: Mapping[str, mx.array], metadata: Mapping[str, str]) -> LegacyCache:
    """Rebuild the cache of a legacy file from its arrays and metadata (as `mx.load` returns them).

    Raises CodecError when the metadata is not a known legacy format or does
    not describe a cache these arrays can rebuild (LegacyDamage when the
    file is damaged).
    """
    fmt = detect_legacy(metadata)
    try:
        if fmt == GEZEL_SCHEMA3:
            cache = _decode_gezel(arrays, metadata)
        elif fmt == MLX_LM_PROMPT_CACHE:
            cache = _decode_mlx_lm(arrays, metadata)
        else:
            raise CodecError("not a known legacy cache format (gezel schema 3 or mlx-lm "
                             "prompt cache)")
    except RecursionError:
        raise LegacyDamage("legacy cache structure is nested too deeply") from None
    except OverMemory as exc:  # these files carry no checksum: the count is damaged
        raise LegacyDamage(str(exc)) from None
    size = sum(_check_counts(layer, f"layer {i}") for i, layer in enumerate(cache.layers))
    # Rebuilding may pad the rows the file holds (mlx-vlm's
    # StaticPrefixKVCache, to its max_size): a damaged max_size of 2**30 made
    # 64 GiB of zeros from a 4 KB file, and evaluating them ended the
    # process (SIGSEGV); so did 8 layers of 8 GiB each. A sound file larger
    # than the memory (read lazily) is no damage: only padding is.
    if _MEMORY is not None and size > _MEMORY \
            and size > sum(a.nbytes for a in arrays.values()):
        raise LegacyDamage(f"its keys and values would take {size} bytes, more than this "
                           f"machine's memory ({_MEMORY}) and than the file holds")
    return cache


_MEMORY = physical_memory()  # None, not told: not checked


#: Classes that hold their tokens in their first offset rows (the others are
#: spare): an offset past the rows is damage. Rotating and chunked caches
#: hold fewer rows than their offset.
_ROWS_HOLD_OFFSET = frozenset({"KVCache", "QuantizedKVCache", "ConcatenateKVCache"})
#: Classes whose offset is always a token count, never None.
_COUNTS_TOKENS = _ROWS_HOLD_OFFSET | {"RotatingKVCache", "ChunkedKVCache"}


def _check_counts(layer: Any, where: str) -> int:
    """Refuse a layer whose offset no cache can have; return the bytes its
    keys and values take (its children's, for a CacheList). These files
    carry no checksums: a damaged offset (-5, 1000 over 256 rows, NaN) was
    restored as it was, and kvkeeper's own file of it, after an import, then
    passed every check; the cache's next update went wrong, or raised."""
    children = getattr(layer, "caches", None)
    if isinstance(children, (list, tuple)):  # CacheList
        return sum(_check_counts(child, f"{where}.{i}") for i, child in enumerate(children))
    sides = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    arrays = [a for side in sides for a in (side if isinstance(side, (list, tuple)) else [side])
              if isinstance(a, mx.array)]
    size = sum(a.nbytes for a in arrays)
    offset = getattr(layer, "offset", None)
    if offset is None and type(layer).__name__ in _COUNTS_TOKENS:
        # Its first update raised TypeError (None + the new tokens).
        raise LegacyDamage(f"{where}: offset None is not a token count")
    if offset is None or isinstance(offset, mx.array):
        return size  # no offset, or a batch's offsets (one per sequence)
    if type(offset) is not int or not 0 <= offset < 1 << 31:
        raise LegacyDamage(f"{where}: offset {offset!r} is not a token count")
    first = arrays[0] if arrays else None  # keys, or a quantized cache's packed keys
    if type(layer).__name__ in _ROWS_HOLD_OFFSET and first is not None and first.ndim == 4 \
            and offset > first.shape[-2]:
        raise LegacyDamage(f"{where}: offset {offset} is past its {first.shape[-2]} rows")
    rows = first.shape[-2] if first is not None and first.ndim == 4 else 0
    if type(layer).__name__ == "RotatingKVCache":
        _check_window(layer, offset, rows, where)
    elif type(layer).__name__ == "ChunkedKVCache":
        # Its rows hold the tokens from start_position to the offset.
        # Restored as they were, a start of -5 or past the offset, or an
        # offset past the rows, served all-zero rows as keys, or dropped
        # the next token, with no error (a review).
        start = getattr(layer, "start_position", None)
        if type(start) is not int or not 0 <= start <= offset or offset - start > rows:
            raise LegacyDamage(f"{where}: a ChunkedKVCache of {rows} rows cannot hold the "
                               f"tokens from start_position {start!r} to offset {offset}")
        chunk = getattr(layer, "chunk_size", None)
        if type(chunk) is not int or chunk <= 0:  # its next trim would drop every row
            raise LegacyDamage(f"{where}: chunk_size {chunk!r} is not a chunk size")
    return size


#: The keep of every window mlx-lm's make_prompt_cache makes (max_kv_size).
_MLX_LM_KEEP = 4


def _check_window(layer: Any, offset: int, rows: int, where: str) -> None:
    """Refuse a rotating cache whose window no cache can have. Restored as
    they were, a write position of 1000 (or -3) in a window of 16 rows put
    the next token nowhere and the update went on without it; a max_size of
    0 or -1 made every later update return no rows at all. Neither raised.

    One window keeps as many rows as it holds, or more: mlx-lm's
    ``make_prompt_cache(max_kv_size=4)`` or less (keep 4, always). Once it
    wraps, its write position runs past its rows, and each new token goes
    nowhere, under mlx-lm as restored here. Such a file is mlx-lm's own, read
    as mlx-lm reads it (a review: it was called damaged and moved aside);
    any other keep past the window is damage (a keep of 40 in 32, restored,
    sent every later token nowhere)."""
    max_size, keep, idx = (getattr(layer, name, None) for name in ("max_size", "keep", "_idx"))
    if type(max_size) is not int or not 0 < max_size < 1 << 31:
        raise LegacyDamage(f"{where}: max_size {max_size!r} is not a window's size")
    own_tiny = keep == _MLX_LM_KEEP and max_size <= _MLX_LM_KEEP
    if type(keep) is not int or not (0 <= keep < max_size or own_tiny):
        raise LegacyDamage(f"{where}: keep {keep!r} is not within its window of {max_size}")
    # The write position never passes the tokens seen, nor, but in mlx-lm's
    # tiny window, the rows held.
    bound = offset if own_tiny else min(offset, rows)
    if type(idx) is not int or not 0 <= idx <= bound:
        raise LegacyDamage(f"{where}: write position {idx!r} is not within its {rows} rows "
                           f"and offset {offset}")


# ---------------------------------------------------------------------------
# helpers


#: What ``cache_persist.py`` writes to rebuild its cache: restored as such
#: (the token ids, the model), or of no use once restored. ``saved_at`` and
#: keys of other writers stay.
_SCHEMA3_OWN = frozenset({"schema_version", "classes", "class_modules", "meta_state",
                          "state_scalars", "token_ids", "model_fingerprint", "token_count"})


def entry_metadata(format: str, metadata: Mapping[str, str]) -> dict[str, str]:
    """The metadata an entry restored from a legacy file carries: its writer's
    bookkeeping keys are gone (the model, id and tokens are restored as such;
    before, ``kvkeeper import`` copied every token id of a ``cache_persist.py``
    file into the entry's metadata); for a file ``kvkeeper export`` wrote,
    the exported entry's own; otherwise the file's metadata as it is."""
    if format == GEZEL_SCHEMA3:
        return {k: v for k, v in metadata.items() if k not in _SCHEMA3_OWN}
    if format != MLX_LM_PROMPT_CACHE or EXPORT_MODEL_KEY not in metadata:
        return dict(metadata)
    own = (EXPORT_MODEL_KEY, EXPORT_CACHE_ID_KEY, EXPORT_TOKENS_KEY, EXPORT_METADATA_KEY)
    out = {k: v for k, v in metadata.items() if k not in own}
    try:
        exported = json.loads(metadata.get(EXPORT_METADATA_KEY, "{}"))
    except (ValueError, RecursionError):
        exported = {}
    if isinstance(exported, dict):
        out.update({k: v for k, v in exported.items() if isinstance(v, str)})
    return out


def _json_field(metadata: Mapping[str, str], key: str, kind: type) -> Any:
    try:
        value = json.loads(metadata[key])
    except KeyError:
        raise LegacyDamage(f"metadata has no {key!r}") from None
    except (TypeError, ValueError) as exc:
        raise LegacyDamage(f"metadata {key!r} is not JSON: {exc}") from None
    if not isinstance(value, kind):
        raise LegacyDamage(f"metadata {key!r} is not a {kind.__name__}")
    return value


def _unflatten_layers(flat: dict[str, Any], n_layers: int) -> list[Any]:
    """Per-layer states from `tree_flatten` paths, as the writers' loaders rebuild them."""
    if not flat:
        raise CodecError("the file holds no cache state")
    try:
        states = tree_unflatten(list(flat.items()))
    except Exception as exc:  # malformed paths of any sort
        raise CodecError(f"cannot rebuild the state tree: {exc!r}") from exc
    if not isinstance(states, list) or len(states) != n_layers:
        raise LegacyDamage(f"state tree does not have one entry per layer ({n_layers} classes)")
    _no_hole(states, "")
    return states


def _no_hole(tree: Any, path: str) -> None:
    """Refuse a state tree with an entry missing: tree_unflatten puts {} in
    the place of an array the file lacks (one removed, or its name damaged),
    and the layer came back with {} for its keys."""
    if isinstance(tree, dict):
        if not tree:
            raise LegacyDamage(f"the file has no array for state entry {path.lstrip('.')!r}")
        for k, v in tree.items():
            _no_hole(v, f"{path}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _no_hole(v, f"{path}.{i}")


def _class_named(name: Any, modules: list[str]) -> type:
    """The cache class `name` from the first of `modules` that has one."""
    errors = []
    for module in modules:
        try:
            return resolve_cache_class(module, name)
        except CodecError as exc:
            errors.append(str(exc))
    raise CodecError(f"cannot resolve cache class {name!r}: {'; '.join(errors)}")


# ---------------------------------------------------------------------------
# gezel cache_persist schema 3


def _rebuild(cls: type, state: Any, meta: Any, where: str) -> Any:
    if meta == {} and cls.__module__ == _LM_CACHE:
        # cache_persist's record of an mlx-lm 0.32 layer, which has no meta_state.
        return _from_new(cls, state, where)
    return rebuild_layer(cls, state, meta, where=where)


def _from_new(cls: type, state: Any, where: str) -> Any:
    """``rebuild_from_new``; a counter that is no number is damage, as
    ``_check_counts`` says of it where mlx-lm 0.32 rebuilds (these files
    carry no checksums)."""
    try:
        return rebuild_from_new(cls, state, where)
    except BadCounter as exc:
        raise LegacyDamage(str(exc)) from None


def _meta_layer(cls: type, state: Any, meta: Any, where: str,
                leaf: Callable[[type, Any, Any, str], Any] = _rebuild) -> Any:
    """A layer saved as (state, meta_state), rebuilt by ``leaf`` (all but
    CacheList, whose state is [child states] and meta_state ([names], [metas]))."""
    if is_composite_class(cls):
        if not (
            isinstance(state, list)
            and isinstance(meta, list)
            and len(meta) == 2
            and isinstance(meta[0], list)
            and isinstance(meta[1], list)
            and len(state) == len(meta[0]) == len(meta[1])
        ):
            raise CodecError(f"{where}: malformed {cls.__name__} state")
        children = [
            _meta_layer(_class_named(name, [cls.__module__]), s, m, f"{where}.{i}", leaf)
            for i, (s, name, m) in enumerate(zip(state, meta[0], meta[1], strict=True))
        ]
        return rebuild_composite(cls, children, list)
    return leaf(cls, state, meta, where)


def _front_trimmed(cls: type, meta: Any) -> int:
    """The start_position of a ChunkedKVCache given as (state, meta_state)
    (mlx-lm 0.31, mlx-vlm), else 0. Once its front is trimmed, its state is
    its buffer up to the offset, spare rows included: the row count is the
    offset only while the buffer is at least that long."""
    if cls.__name__ != "ChunkedKVCache" or not (isinstance(meta, (list, tuple))
                                                and len(meta) == 2):
        return 0
    try:
        return max(int(meta[1]), 0)
    except (TypeError, ValueError):
        return 0  # the class's own setter refuses it, as for any malformed meta_state


def _old_mlx_lm_leaf(cls: type, state: Any, meta: Any, where: str) -> Any:
    start = _front_trimmed(cls, meta)
    if start:
        # mlx-lm's own loader took the row count for the offset: other logits, no error.
        raise CodecError(f"{where}: a ChunkedKVCache whose front was trimmed "
                         f"(start_position {start}) is saved by mlx-lm 0.31 without the "
                         "count of the tokens it has seen: it cannot be restored as it was")
    return rebuild_from_old(cls, state, meta, where)


def _gezel_leaf(tokens: int) -> Callable[[type, Any, Any, str], Any]:
    """cache_persist's layers: its token count is the offset of a front-trimmed
    ChunkedKVCache, which its state alone does not tell."""
    def leaf(cls: type, state: Any, meta: Any, where: str) -> Any:
        layer = _rebuild(cls, state, meta, where)
        start = _front_trimmed(cls, meta)
        if start:
            rows = layer.keys.shape[-2]
            # The state is the buffer cut at the offset: as many rows, or all
            # of a shorter buffer, which still holds every token from start on.
            if not (start <= tokens and tokens - start <= rows <= tokens):
                raise LegacyDamage(f"{where}: a ChunkedKVCache of {rows} rows from "
                                   f"start_position {start} cannot hold {tokens} tokens")
            layer.offset = tokens
        return layer
    return leaf


def _decode_gezel(arrays: Mapping[str, mx.array], metadata: Mapping[str, str]) -> LegacyCache:
    classes = _json_field(metadata, "classes", list)
    modules = _json_field(metadata, "class_modules", list)
    metas = _json_field(metadata, "meta_state", list)
    scalars = _json_field(metadata, "state_scalars", dict)
    token_ids = _json_field(metadata, "token_ids", list)
    if not classes or not len(classes) == len(modules) == len(metas):
        raise CodecError("gezel metadata: classes, class_modules and meta_state disagree")
    if not all(type(t) is int for t in token_ids):
        raise LegacyDamage("gezel metadata: token_ids are not all integers")
    for path, value in scalars.items():
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise CodecError(f"gezel metadata: state scalar {path!r} is not a scalar")
    if set(arrays) & set(scalars):
        raise CodecError("gezel metadata: a state path is both an array and a scalar")
    states = _unflatten_layers({**arrays, **scalars}, len(classes))
    layers = []
    for i, (name, module, meta, state) in enumerate(
        zip(classes, modules, metas, states, strict=True)
    ):
        # As cache_persist itself did: the recorded module first, then the
        # shared cache modules (never importing a module outside the two packages).
        candidates = list(
            dict.fromkeys(m for m in (module, _VLM_CACHE, _LM_CACHE) if isinstance(m, str))
        )
        cls = _class_named(name, candidates)
        layers.append(_meta_layer(cls, state, meta, f"layer {i}", _gezel_leaf(len(token_ids))))
    fingerprint = metadata.get("model_fingerprint")
    return LegacyCache(GEZEL_SCHEMA3, layers, token_ids, fingerprint, dict(metadata))


# ---------------------------------------------------------------------------
# mlx-lm save_prompt_cache


def _indexed(metadata: Mapping[str, str], prefix: str) -> list[str]:
    """Values of keys `prefix<i>` (i = 0, 1, ...), which must be contiguous."""
    values = indexed(metadata, prefix)
    if values is None:
        raise CodecError(f"mlx-lm metadata: entries {prefix}* are not numbered 0..n-1")
    return values


def _scalar_leaf(array: mx.array, kind: str, path: str) -> Any:
    try:
        if kind == "scalar":
            return array.item()
        if kind == "string":
            return "".join(chr(c) for c in cast("list[int]", array.tolist()))
        if kind == "none":
            return None
    except (TypeError, ValueError, OverflowError) as exc:
        raise LegacyDamage(f"mlx-lm scalar {path!r} ({kind}) is malformed: {exc}") from None
    # A kind a later mlx-lm may write: not known here, the file may be sound.
    raise CodecError(f"mlx-lm scalar {path!r} has unknown kind {kind!r}")


def _mlx_lm_layer(cls: type, state: Any, where: str) -> Any:
    if is_composite_class(cls):
        # mlx-lm CacheList: state [[child state, class name], ...].
        if not (
            isinstance(state, list) and all(isinstance(c, list) and len(c) == 2 for c in state)
        ):
            raise CodecError(f"{where}: malformed {cls.__name__} state")
        children = [
            _mlx_lm_layer(_class_named(name, [cls.__module__]), s, f"{where}.{i}")
            for i, (s, name) in enumerate(state)
        ]
        return rebuild_composite(cls, children, list)
    return _from_new(cls, state, where)


def _decode_mlx_lm(arrays: Mapping[str, mx.array], metadata: Mapping[str, str]) -> LegacyCache:
    if metadata.get("2.0"):  # a class name: mlx-lm 0.31 or earlier wrote it
        classes = _indexed(metadata, "2.")
        user = {k[2:]: v for k, v in metadata.items() if k.startswith("1.")}
        metas = _old_meta_states(metadata, len(classes))
        states = _unflatten_layers(dict(arrays), len(classes))
        layers = [
            _meta_layer(_class_named(name, [_LM_CACHE]), state, meta, f"layer {i}",
                        _old_mlx_lm_leaf)
            for i, (name, state, meta) in enumerate(zip(classes, states, metas, strict=True))
        ]
        return _mlx_lm_cache(layers, user)
    classes = _indexed(metadata, "1.")
    user = {k[2:]: v for k, v in metadata.items() if k.startswith("0.")}
    # Scalar leaves: "2.<i>.0" is the path, "2.<i>.1" the kind, for i = 1..n.
    entries: dict[int, list[str | None]] = {}
    for key, value in metadata.items():
        m = _MLX_LM_SCALAR.fullmatch(key)
        if m:
            entries.setdefault(int(m[1]), [None, None])[int(m[2])] = value
    if sorted(entries) != list(range(1, len(entries) + 1)):
        raise CodecError("mlx-lm metadata: scalar entries are not numbered 1..n")
    flat: dict[str, Any] = dict(arrays)
    for i in sorted(entries):
        path, kind = entries[i]
        if path is None or kind is None:
            raise LegacyDamage(f"mlx-lm metadata: scalar entry {i} is incomplete")
        if path not in arrays:
            raise LegacyDamage(f"mlx-lm metadata: scalar {path!r} has no array")
        flat[path] = _scalar_leaf(arrays[path], kind, path)
    states = _unflatten_layers(flat, len(classes))
    if "LayerCache" in classes:
        # mlx-lm's save_prompt_cache writes DeepSeek V4.1's caches too, under
        # this bare name, without the window size (its loader fails on them).
        raise CodecError("mlx-lm's own files of DeepSeek V4.1's LayerCache cannot be "
                         "imported: they do not record its window size (kvkeeper's own "
                         "save() keeps it)")
    layers = [
        _mlx_lm_layer(_class_named(name, [_LM_CACHE]), state, f"layer {i}")
        for i, (name, state) in enumerate(zip(classes, states, strict=True))
    ]
    return _mlx_lm_cache(layers, user)


def _mlx_lm_cache(layers: list[Any], user: dict[str, str]) -> LegacyCache:
    # `kvkeeper export` writes its key and token ids beside the cache; any
    # other writer's "token_ids" is used only if it is a list of integers.
    tokens: list[int] | None = None
    try:
        parsed = json.loads(user.get(EXPORT_TOKENS_KEY, "null"))
    except ValueError:
        parsed = None
    if isinstance(parsed, list) and all(type(t) is int for t in parsed):
        tokens = parsed
    return LegacyCache(MLX_LM_PROMPT_CACHE, layers, tokens, user.get(EXPORT_MODEL_KEY), user)


# mlx-lm 0.31 and earlier: metadata tree_flatten([meta_states, user_metadata,
# class_names]); a layer is rebuilt with from_state(state, meta_state). mlx-lm
# 0.32 dropped meta_state: its classes take the scalars inside the state, so
# an old file is rebuilt there as mlx-lm 0.31's own loader rebuilt it.


def _old_meta_states(metadata: Mapping[str, str], n_layers: int) -> list[Any]:
    """Each layer's meta_state ("" or a tree of strings) from the ``0.`` keys."""
    flat = [(k[2:], v) for k, v in metadata.items() if k.startswith("0.")]
    # Every mlx-lm class's meta_state leaves a key ("" for none), so each layer has one.
    if {int(k.partition(".")[0]) for k, _ in flat} != set(range(n_layers)):
        raise CodecError("mlx-lm metadata: meta states do not match the classes")
    try:
        tree = tree_unflatten(flat)
    except Exception as exc:  # malformed paths of any sort
        raise CodecError(f"mlx-lm metadata: cannot rebuild the meta states: {exc!r}") from exc
    if not isinstance(tree, list) or len(tree) != n_layers:
        raise CodecError("mlx-lm metadata: meta states do not match the classes")
    return tree
