"""Generation-loop integrations: ``kvkeeper.integrations.mlx_lm`` and
``kvkeeper.integrations.mlx_vlm``.

Both wrap the library's own streaming loop (they never patch it) with the same
decision, made on every request:

1. Take the session's cache: the one kept in memory from the last turn, else
   the one kvkeeper restores (``Client.load``), else none.
2. Find the common prefix of the tokens it holds and the new prompt.
3. Keep exactly that prefix, and always leave at least one prompt token to
   feed the model:

   * the cache holds nothing beyond the prefix: **extend** it (feed the rest);
   * it holds more, and every layer can be trimmed back without loss (KVCache,
     QuantizedKVCache, a RotatingKVCache that has not wrapped, ...): **trim**;
   * otherwise (ArraysCache of hybrid/recurrent models, a wrapped sliding
     window, nothing in common, a cache whose length disagrees with its
     tokens): **cold** — a fresh cache and a full prefill. A wrong cache is
     never fed to the model.

4. Generate, handing snapshots to the daemon behind the loop
   (:class:`kvkeeper.writebehind.WriteBehind`), and save the final state.

Extending feeds the tokens the cache lacks on top of it, as the libraries' own
prompt-cache reuse does: a continued conversation answers as one continued in
memory. For quantized caches and filled ``max_kv_size`` windows that is not a
cold run's answer (see the README).

This module imports neither MLX library.
"""

from __future__ import annotations

import itertools
import operator
import reprlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvkeeper.logs import get_logger
from kvkeeper.writebehind import (
    WriteBehind,
    cache_length,
    check_triggers,
    layer_offsets,
    length_mismatch,
    one_row,
)

if TYPE_CHECKING:
    from kvkeeper.client.client import Client

log = get_logger("kvkeeper.integrations")

__all__ = ["MEDIA_KEY", "Plan", "SessionBase", "cache_length", "common_prefix",
           "length_mismatch", "plan_reuse", "token_ids_of"]

#: Saved with a session's cache: a fingerprint of the images, audio and video
#: its prompt was given with ("" or absent: none). The token ids alone cannot
#: tell two pictures of one size apart.
MEDIA_KEY = "kvkeeper_session.media"

Action = Literal["extend", "trim", "cold"]

#: A cold plan's reason when the session has no cache (none in memory, none saved).
NO_CACHE = "no cache for this session"


@dataclass(frozen=True)
class Plan:
    """What one request did with the session's cache.

    ``source``: where the cache came from (``"memory"`` or ``"kvkeeper"``;
    a cold plan says so too when that cache was not reused: nothing in
    common with the prompt, other media, or it failed in the model;
    ``"mlx-vlm"`` when mlx-vlm reused a cache of its own, through an
    ``apc_manager=`` passed on to it), or
    None when there was none: none found, the load failed, or the saved
    cache was refused as it was restored (its length against its token ids,
    no token ids, layers this model does not keep). ``reused``: prompt
    tokens taken from the cache;
    ``trimmed``: cached tokens dropped to get back to the common prefix;
    ``prefill``: prompt tokens fed to the model.
    """

    action: Action
    source: str | None
    reused: int
    trimmed: int
    prefill: int
    reason: str


def token_ids_of(ids: Any) -> list[int]:
    """The token ids of one prompt given as an array (MLX's or numpy's): shape
    (n,) or (1, n), integers. Raises ValueError for a batch or other values."""
    ids = one_row(ids)
    if len(ids.shape) != 1:
        raise ValueError(f"the prompt's ids must be one prompt, shape (n,) or (1, n), "
                         f"not {tuple(ids.shape)}")
    values = ids.tolist()
    if not all(type(v) is int for v in values):
        raise ValueError(f"the prompt's ids must be integers, not {ids.dtype}")
    return values


def _ids(ids: Any, what: str) -> Sequence[int]:
    """``ids`` as plan_reuse compares them: an array's (see token_ids_of), or
    a sequence of integers as it is. Floats were compared as ids (10.0 ==
    10: an extend plan), bools and a nested list gave a cold plan; the
    caller's loop then failed inside mlx-lm."""
    if hasattr(ids, "shape"):
        return token_ids_of(ids)
    if not isinstance(ids, Sequence):
        raise ValueError(f"{what} must be a sequence of integers, not {type(ids).__name__}")
    if all(type(v) is int for v in ids):
        return ids  # the common case, not copied
    for v in ids:
        if type(v) is bool or not hasattr(v, "__index__"):
            raise ValueError(f"{what} must be integers, not {type(v).__name__} "
                             f"({reprlib.repr(v)})")
    return [operator.index(v) for v in ids]


def hash_array(h: Any, arr: Any) -> None:
    """Feed an array's dtype, shape and bytes (MLX's or numpy's) into the
    xxhash object ``h``: the media and embedding fingerprints."""
    import mlx.core as mx
    import numpy as np

    h.update(f"{arr.dtype}:{tuple(arr.shape)}:".encode())
    h.update(memoryview(mx.contiguous(arr)) if isinstance(arr, mx.array)  # type: ignore[arg-type]  # stubs lack the buffer protocol
             else np.ascontiguousarray(arr).data)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _fully_retained(layer: Any) -> bool:
    """Whether a layer still holds its whole sequence from position 0, so that
    trimming it gives back an earlier prefix exactly."""
    children = getattr(layer, "caches", None)
    if children is not None:
        return all(_fully_retained(c) for c in children)
    start = getattr(layer, "start_position", None)
    if start is not None and int(start) != 0:  # ChunkedKVCache & co. evict by advancing it
        return False
    offset = int(getattr(layer, "offset", 0) or 0)
    max_size = getattr(layer, "max_size", None)
    # Rotating caches: fine until the window wraps, or, for mlx-vlm's
    # buffered one, until it drops rows (past max_size it may still hold
    # every token; with keep > 0 it wraps with its start_position still 0).
    if max_size is not None and offset > int(max_size):
        held = _rows_held(layer)
        return held is not None and held >= offset
    # mlx-vlm's RingSlidingKVCache (unlimited_ocr) is a KVCache, trimmable by
    # inheritance, whose decode tokens overwrite a ring after the prefill:
    # once decoding began, its slots are no longer in order of position.
    return getattr(layer, "prefill_length", None) is None


def _rows_held(layer: Any) -> int | None:
    """How many rows a buffered rotating layer holds in order from position 0
    (its ``_idx``), if it says. Not with ``keep`` > 0: that one updates as a
    ring even before it drops a row (trimmed, it overwrote a kept token)."""
    idx = getattr(layer, "_idx", None)
    if type(idx) is not int or not hasattr(layer, "start_position"):
        return None
    return idx if getattr(layer, "keep", 0) == 0 else None


def _trimmable(cache: Sequence[Any]) -> bool:
    for layer in cache:
        is_trimmable = getattr(layer, "is_trimmable", None)
        if is_trimmable is None or not is_trimmable() or not _fully_retained(layer):
            return False
    return True


def plan_reuse(
    cache: list[Any] | None,
    cached_ids: Sequence[int] | None,
    prompt_ids: Sequence[int],
    source: str | None = None,
    max_reuse: int | None = None,
    none: str = NO_CACHE,
) -> Plan:
    """Decide how to use ``cache`` (holding ``cached_ids``) for ``prompt_ids``,
    and trim it in place when that is the decision. After an ``extend`` or
    ``trim`` plan the cache holds exactly ``prompt_ids[:plan.reused]``; after
    ``cold`` it must not be used. ``max_reuse``: at most that many of its
    tokens are reused (the rest were computed from other inputs). ``none``:
    the cold plan's reason when there is no cache. A cache not made in this
    process (``source`` other than "memory": a ``load()``'s) is trimmed down
    to the rows it keeps (see ``_cut_to_offsets``). Ids come as sequences of
    integers, or arrays of shape (n,) or (1, n) (ValueError for others)."""
    for ids, what in ((prompt_ids, "the prompt's ids"), (cached_ids, "the cached ids")):
        if isinstance(ids, (str, bytes)):
            # mlx-lm's stream_generate takes a prompt's text: given here, its
            # characters were compared as ids (a cold plan, "nothing in common").
            raise ValueError(f"{what} must be token ids, not text ({type(ids).__name__}): "
                             f"tokenize it first")
    prompt_ids = _ids(prompt_ids, "the prompt's ids")
    if cached_ids is not None:
        cached_ids = _ids(cached_ids, "the cached ids")
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty")

    def cold(reason: str) -> Plan:
        return Plan("cold", source, 0, 0, n, reason)

    if cache is None:
        return cold(none)
    if cached_ids is None:
        # A cache was given (a file imported from mlx-lm's format has no
        # ids): "no cache" misled (a review).
        return cold("the cache does not say which tokens it holds")
    why = length_mismatch(cache, len(cached_ids))
    if why is not None:
        return cold(why)
    p = common_prefix(cached_ids, prompt_ids)
    target = min(p, n - 1)  # the model needs at least one token to read
    if max_reuse is not None and max_reuse < target:
        if max_reuse <= 0:
            return cold("the cache was made from other input_embeddings")
        target = max_reuse
    if target <= 0:
        return cold("nothing in common with the cached tokens")
    drop = len(cached_ids) - target
    if drop == 0:
        return Plan("extend", source, target, 0, n - target,
                    f"cache holds {target} tokens of the prompt")
    if not _trimmable(cache):
        if p >= n:  # nothing diverged: the model needs a token of the prompt to read
            return cold("the cache holds the whole prompt, its last token must be read "
                        "again, and its layers cannot be trimmed")
        return cold(f"cache diverges at token {p} and its layers cannot be trimmed")
    for layer in cache:
        layer.trim(drop)
    if (why := length_mismatch(cache, target)) is not None:
        return cold(f"after trimming, {why}")
    if source != "memory":
        _cut_to_offsets(cache)
    return Plan("trim", source, target, drop, n - target,
                f"trimmed {drop} cached tokens back to the common prefix")


#: The classes whose trim leaves spare rows behind the offset and whose update
#: grows a full buffer by concatenation, in mlx-lm and mlx-vlm alike.
_CUT_CLASSES = frozenset({"KVCache", "QuantizedKVCache"})


def _rows_kept(layer: Any) -> int | None:
    """How many rows of a trimmed layer's buffer hold its tokens, where the
    rest may be cut (None: keep the buffer as it is). A RotatingKVCache that
    has not wrapped around (its write index at its offset, short of its
    window) holds them in order, grows by concatenation once full as a
    KVCache does, and, trimmed and fed one token, wrote another model's
    keys into the rows the trim left (``max_kv_size``: wrong tokens, no
    error; a review). A ChunkedKVCache is left: an older mlx-lm trims its
    front by its buffer's size, so cutting it would change its logits; it
    comes beside KVCache layers (llama4), which refuse another model."""
    offset = getattr(layer, "offset", None)
    if type(offset) is not int:
        return None
    name = type(layer).__name__
    if name in _CUT_CLASSES:
        return offset
    if name == "RotatingKVCache":
        size, idx = getattr(layer, "max_size", None), getattr(layer, "_idx", None)
        if type(size) is int and idx == offset < size:
            return offset
    return None


def _cut_to_offsets(layers: Sequence[Any]) -> None:
    """Cut the buffers of trimmed KVCache, QuantizedKVCache and (not wrapped
    around) RotatingKVCache layers to the rows they hold. A cache restored from kvkeeper is known to fit the model
    only once the model has run on it: one saved under the same model id by
    a model with more KV heads, trimmed, kept spare rows into which the keys
    of a model with one KV head broadcast without an error (wrong tokens,
    then a ValueError when the buffer grew). With no spare row the model's
    first step concatenates, which fails for any other head count, head
    size or batch before the first token, as on an extend plan, and the
    request runs cold (``restore_unusable``). It costs that step a copy of
    the cache, as an extend plan's first step pays. In a caller's own loop
    (``plan_reuse`` on a ``load()``), that step raises instead of streaming
    other tokens."""
    for layer in layers:
        children = getattr(layer, "caches", None)
        if children is not None:
            _cut_to_offsets(children)
            continue
        rows = _rows_kept(layer)
        if rows is None:
            continue
        for name in ("keys", "values"):
            held = getattr(layer, name, None)
            if held is not None:
                setattr(layer, name, _first_rows(held, rows))


def _first_rows(held: Any, n: int) -> Any:
    """An array's (or a quantized tuple's arrays') first ``n`` rows of axis -2."""
    if isinstance(held, (tuple, list)):
        return type(held)(_first_rows(part, n) for part in held)
    return held[..., :n, :] if held.shape[-2] > n else held


def _offsets_said(layers: Sequence[Any]) -> str:
    """The layers' token counts for a log line: one number when they agree,
    the least and the most ("8-12") when they do not."""
    known = [off for off in layer_offsets(layers) if off is not None]
    low, high = min(known), max(known)
    return str(low) if low == high else f"{low}-{high}"


def _untouched(layers: Sequence[Any], n: int) -> bool:
    """Whether every layer still holds exactly ``n`` tokens, as its offset
    tells. A layer without one (ArraysCache) cannot tell: a failure part way
    through a forward pass may have changed it, so it counts as touched."""
    return all(off == n for off in layer_offsets(layers))


class SessionBase:
    """One conversation's cache: kept in memory between requests, restored
    from kvkeeper when memory has none, saved behind every generation.

    ``client=None`` keeps the cache in memory only (nothing is saved).
    """

    #: The longest media fingerprint a request may carry into the metadata
    #: ("": none), for the check of the metadata's room.
    _media_room = ""

    def __init__(
        self,
        client: Client | None,
        model_id: str,
        session_id: str,
        *,
        every_tokens: int | None = 64,
        every_seconds: float | None = 2.0,
        metadata: dict[str, str] | None = None,
    ) -> None:
        from kvkeeper.client.client import Client, check_metadata
        from kvkeeper.protocol.naming import check_key

        if client is not None and not isinstance(client, Client):
            # A socket path given instead failed only at the first request
            # (AttributeError deep in the generation).
            raise TypeError(f"client must be a kvkeeper.Client or None, not "
                            f"{type(client).__name__}")
        # Checked now, not at the first save in the middle of a request, with
        # room for the media fingerprint a request may add.
        if client is not None:
            model_id, session_id = check_key(model_id, session_id)
        check_triggers(every_tokens, every_seconds)
        if metadata and MEDIA_KEY in metadata:
            raise ValueError(f"metadata key {MEDIA_KEY!r} is the session's own")
        self.metadata = check_metadata(metadata) or None
        if self._media_room:
            check_metadata({**(self.metadata or {}), MEDIA_KEY: self._media_room})
        self.client = client
        self.model_id = model_id
        self.session_id = session_id
        self.every_tokens = every_tokens
        self.every_seconds = every_seconds
        #: The cache and the tokens it holds, between requests (None: none in memory).
        self.cache: list[Any] | None = None
        self.token_ids: list[int] | None = None
        #: The media fingerprint of the cache (see MEDIA_KEY; "" for none).
        self.media = ""
        self._source: str | None = None
        # The cache kept holds state its request's thread left lazy (_keep).
        self._lazy_state = False
        # Requests begun on this session: only the latest one's state is kept.
        self._requests = 0
        #: The decision of the last request.
        self.last_plan: Plan | None = None
        #: The write-behind helper of the last request (its counters).
        self.last_write_behind: WriteBehind | None = None

    def forget(self) -> None:
        """Drop the in-memory cache, as a restart would; kvkeeper keeps its copy."""
        self.cache = None
        self.token_ids = None
        self.media = ""
        self._source = None
        self._lazy_state = False

    def restore(self) -> bool:
        """Make sure a cache is in memory: keep the one there, else load the
        session's from kvkeeper. False when there is none (or it is unusable)."""
        return self._restore() is None

    def _restore(self) -> str | None:
        """``restore()``: None when a cache is in memory, else why not (a
        cold plan's reason)."""
        if self.cache is not None and self._lazy_state:
            self._lazy_state = False
            import mlx.core as mx

            try:
                mx.eval([layer.state for layer in self.cache])
            except RuntimeError as exc:  # lazy on another thread's stream: unusable here
                log.warning("event=state_not_kept model=%s id=%s error=%s: the cache the "
                            "last request left was computed on another thread and cannot be "
                            "used on this one", self.model_id, self.session_id, exc)
                self.forget()
        if self.cache is not None:
            return None
        if self.client is None:
            return NO_CACHE
        from kvkeeper.client.channel import DaemonUnavailable
        from kvkeeper.client.client import DaemonError

        try:
            got = self.client.load(self.model_id, self.session_id)
        except (DaemonError, DaemonUnavailable) as exc:  # must not stop generation
            log.warning("event=restore_failed model=%s id=%s error=%s",
                        self.model_id, self.session_id, exc)
            return f"the saved cache could not be loaded ({exc})"
        except RuntimeError:
            # The server shut its client down: nothing to restore. (Told by
            # load() itself: a check before it left another thread's close()
            # room to land in between, and raise out of the request.)
            if not self.client.closed:
                raise
            log.warning("event=restore_failed model=%s id=%s error=client_closed",
                        self.model_id, self.session_id)
            return "the client is closed: nothing was restored"
        if got is None:
            return NO_CACHE
        if got.token_ids is None:
            # (An mlx-lm file brought in by `kvkeeper import` records none.)
            log.warning("event=restore_no_token_ids model=%s id=%s: the saved cache does not "
                        "say which tokens it holds, so it cannot be matched to the prompt; "
                        "starting cold, and the session's first save replaces it",
                        self.model_id, self.session_id)
            return "the saved cache does not say which tokens it holds"
        why = length_mismatch(got.cache, len(got.token_ids))
        if why is not None:
            log.warning("event=restore_mismatch model=%s id=%s cache_tokens=%s ids=%d",
                        self.model_id, self.session_id, _offsets_said(got.cache),
                        len(got.token_ids))
            return f"saved: {why}"
        if not self._compatible(got.cache):
            log.warning("event=restore_incompatible model=%s id=%s layers=%d",
                        self.model_id, self.session_id, len(got.cache))
            return "the saved cache's layers do not fit this model"
        self.cache, self.token_ids, self._source = got.cache, list(got.token_ids), "kvkeeper"
        self.media = got.metadata.get(MEDIA_KEY, "")
        return None

    def _compatible(self, cache: list[Any]) -> bool:
        """Whether a restored cache fits the session's model (see ``layers_fit``)."""
        return True

    def _begin(self, prompt_ids: list[int]) -> int:
        """A request starts: its number (see ``_latest``). An empty prompt is
        refused first: a request refused then must not become the newest,
        which stops the saves of one still streaming and drops its end."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self._requests += 1
        return self._requests

    def _latest(self, request: int) -> bool:
        """Whether no request began after ``request``: an older one ending late
        (a generator left open, then closed) must not replace the newer state
        in memory or in kvkeeper."""
        return request == self._requests

    def _prepare(self, prompt_ids: list[int], media: str = "",
                 matched: Callable[[str], tuple[str, int | None]] | None = None) -> Plan:
        """Restore, decide, and leave ``self.cache`` holding exactly the reused
        prefix (or None for a cold start). ``media``: the fingerprint of the
        request's images, audio and video; a cache made with others is not used.
        ``matched``, given the fingerprint the cache was made with, answers
        the request's instead, and how many tokens the two agree on (None: all)."""
        missing = self._restore()
        source = self._source if self.cache is not None else None
        if self.cache is not None and source is None:
            source = "memory"
        max_reuse = None
        if matched is not None and self.cache is not None:
            media, max_reuse = matched(self.media)
        if self.cache is not None and self.media != media:
            self.forget()
            plan = Plan("cold", source, 0, 0, len(prompt_ids),
                        "the cache was made with other images, audio or video"
                        if matched is None else "the cache was made from other inputs")
        else:
            plan = plan_reuse(self.cache, self.token_ids, prompt_ids, source, max_reuse,
                              none=missing or NO_CACHE)
        if plan.action == "cold":
            self.forget()
        else:
            self.token_ids = list(prompt_ids[: plan.reused])
        self.last_plan = plan
        log.debug("event=plan model=%s id=%s action=%s source=%s reused=%d prefill=%d reason=%s",
                  self.model_id, self.session_id, plan.action, plan.source, plan.reused,
                  plan.prefill, plan.reason)
        return plan

    def _first_or_cold(self, results: Iterator[Any], prompt_ids: list[int],
                       callers_ran: list[bool], cold: Callable[[Plan], Iterator[Any]],
                       back: Callable[[], None]) -> Iterator[Any]:
        """``results`` of a request on a cache just restored from kvkeeper,
        the first one taken already. When that fails as a cache that does not
        fit the model fails (``MISFIT_ERRORS``), before any of the caller's
        code could be its cause (``callers_ran``, see ``watch_callers``), it
        may have been saved for another model under this model id (other head
        counts or sizes, which ``layers_fit`` cannot see in classes; each
        request of the conversation raised). The request runs again cold:
        ``cold(plan)`` makes the cold plan's state and returns its results.
        Only when their first comes was it the cache (``restore_unusable``,
        and the request's first save replaces it); otherwise the request's
        own error is raised, after ``back()`` has put the restored state
        back and ``last_plan`` is the restored plan again."""
        try:
            first = list(itertools.islice(results, 1))
        except MISFIT_ERRORS as exc:
            if callers_ran[0]:
                raise
            restored = self.last_plan
            plan = Plan("cold", "kvkeeper", 0, 0, len(prompt_ids),
                        f"the saved cache failed in the model ({type(exc).__name__}: {exc})")
            self.last_plan = plan
            results = cold(plan)
            try:
                first = list(itertools.islice(results, 1))
            except BaseException:
                back()
                self.last_plan = restored
                raise
            log.warning("event=restore_unusable model=%s id=%s: %s; started cold",
                        self.model_id, self.session_id, plan.reason)
        return itertools.chain(first, results)

    def _write_behind(self, media: str = "") -> WriteBehind | None:
        if self.client is None:
            self.last_write_behind = None
            return None
        metadata = {**(self.metadata or {}), MEDIA_KEY: media} if media else self.metadata
        wb = WriteBehind(self.client, self.model_id, self.session_id,
                         every_tokens=self.every_tokens, every_seconds=self.every_seconds,
                         metadata=metadata)
        self.last_write_behind = wb
        return wb

    def _step(self, wb: WriteBehind | None, cache: list[Any], token_ids: list[int],
              request: int) -> WriteBehind | None:
        """``wb.step``; a save the helper refuses (a cache class kvkeeper cannot
        save, a cache that disagrees with its tokens) ends the saves of this
        request, never the generation, and so does a newer request on the
        session (its state is the one to keep). Returns the helper to go on with."""
        if wb is None:
            return None
        if not self._latest(request):
            wb.discard()
            return None
        try:
            wb.step(cache, token_ids)
        except ValueError as exc:
            self._give_up_saving(wb, exc)
            return None
        return wb

    def _hand_over(self, last: LastResult) -> Iterator[Any]:
        """Yield the library's last result once the request has ended, then
        raise the error past it at the caller's next call, where the caller
        met it before. A caller that stops at the last result (close(), the
        generator dropped) has its answer: the error is logged instead
        (raised from close(), it printed "Exception ignored" for every
        generator the collector closed)."""
        # Held by no frame of the request's once raised: its traceback leads
        # back to them, and the cycle kept the request's cache (a whole KV
        # cache) alive until a full collection.
        error, last.error = last.error, None
        try:
            try:
                yield last.result
            except BaseException:
                if error is not None:
                    log.warning("event=error_after_last_result model=%s id=%s state=%s "
                                "error_type=%s error=%s: the caller stopped at the last result",
                                self.model_id, self.session_id,
                                "kept" if last.kept else "dropped", type(error).__name__, error)
                raise
            if error is not None:
                raise error
        finally:
            del error

    def _end(self, request: int, wb: WriteBehind | None, clean: bool,
             keep: Callable[[], None], unused: Callable[[], None] | None,
             last: LastResult) -> None:
        """How a request leaves the session: ``keep()`` records its final state
        and the final save follows when it ended cleanly (finished, or stopped
        between tokens); otherwise its saves are dropped and ``unused()``, given
        when it failed before its first response, may keep the prepared prefix.
        A request that is no longer the latest leaves the newer one's state.
        With the library's last result held back in ``last``, an error here
        waits there, to come after that result, where it came before."""
        try:
            self._leave(request, wb, clean, keep, unused)
        except Exception as exc:
            if last.result is None:
                raise
            last.error = exc

    def _leave(self, request: int, wb: WriteBehind | None, clean: bool,
               keep: Callable[[], None], unused: Callable[[], None] | None) -> None:
        if self._latest(request) and clean:
            keep()
            self._close(wb)
            return
        if wb is not None:
            wb.discard()
        if self._latest(request) and unused is not None:
            unused()

    def _close(self, wb: WriteBehind | None) -> None:
        """The request's final save, of the state kept in memory (if any)."""
        if wb is None:
            return
        if self.cache is None:
            wb.discard()
            return
        try:
            wb.close(self.cache, self.token_ids)
        except ValueError as exc:
            self._give_up_saving(wb, exc)

    def _give_up_saving(self, wb: WriteBehind, exc: ValueError) -> None:
        wb.discard()
        log.warning("event=write_behind_off model=%s id=%s reason=%s: this request's cache "
                    "is not saved", self.model_id, self.session_id, exc)

    def _unused(self, cache: list[Any], plan: Plan, prompt_ids: list[int], media: str) -> None:
        """A request failed before its first response: keep the prepared
        prefix in memory when every layer shows it was not touched."""
        if plan.action != "cold" and plan.reused and _untouched(cache, plan.reused):
            self._keep(cache, list(prompt_ids[: plan.reused]), media)
            if plan.source == "kvkeeper" and self.cache is cache:
                # It never reached the model: the next request may still find
                # that it does not fit, and run cold (see _first_or_cold).
                self._source = "kvkeeper"

    def _keep(self, cache: list[Any] | None, token_ids: list[int] | None,
              media: str = "") -> None:
        """Remember what the cache holds after a request (None: nothing usable),
        made with the media of fingerprint ``media``."""
        if cache is None or token_ids is None:
            self.forget()
            return
        if length_mismatch(cache, len(token_ids)) is not None:
            log.warning("event=state_mismatch model=%s id=%s cache_tokens=%s ids=%d",
                        self.model_id, self.session_id, _offsets_said(cache), len(token_ids))
            self.forget()
            return
        import mlx.core as mx

        lazy = False
        try:
            # On the generating thread: mlx-lm and mlx-vlm generate on a
            # stream of the thread's own, and a state left lazy there (a
            # hybrid model's ArraysCache, which the last token does not need)
            # cannot be evaluated from another thread. A server's next request
            # on another worker failed ("There is no Stream(cpu, 2) in current
            # thread") unless a save had happened to evaluate it.
            mx.eval([layer.state for layer in cache])
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            # A layer without a state as mlx-lm's: kept as it is. RuntimeError:
            # a request closed from a thread other than the generating one (a
            # server's event loop dropping the generator of a client gone)
            # cannot evaluate what that thread left lazy. Kept too: a next
            # request on that thread uses it; on another one, _restore drops
            # it (it failed inside the model: "There is no Stream(cpu, 10)
            # in current thread").
            log.debug("event=state_not_evaluated model=%s id=%s error=%s",
                      self.model_id, self.session_id, exc)
            lazy = isinstance(exc, RuntimeError) and "in current thread" in str(exc)
        self.cache, self.token_ids, self._source = cache, token_ids, "memory"
        self._lazy_state = lazy
        self.media = media


#: What a model raises on a cache that does not fit it: MLX's shape checks
#: (broadcast, reshape, matmul) raise ValueError, a few RuntimeError.
MISFIT_ERRORS: tuple[type[Exception], ...] = (ValueError, RuntimeError, IndexError)


class _Watched:
    """A caller's callable, passed through (its attributes too: mlx-vlm asks
    a sampler for ``sample_target``), that sets ``flag[0]`` when it is
    called (``on_call``) or when it raises."""

    def __init__(self, fn: Callable[..., Any], flag: list[bool], on_call: bool) -> None:
        self._fn, self._flag, self._on_call = fn, flag, on_call

    def __call__(self, *args: Any, **kw: Any) -> Any:
        if self._on_call:
            self._flag[0] = True
        try:
            return self._fn(*args, **kw)
        except BaseException:
            self._flag[0] = True
            raise

    def __getattr__(self, name: str) -> Any:
        # Its methods watched too: mlx-vlm calls a sampler's sample_target
        # instead of the sampler.
        attr = getattr(self._fn, name)
        return _Watched(attr, self._flag, self._on_call) if callable(attr) else attr


def run_out(results: Iterator[Any]) -> Exception | None:
    """Run a library's generator on from its last result, which a Session
    hands on only after the request has ended (see ``LastResult``): a caller
    may stop reading there and keep the generator open, and the request's
    state must not wait for its close(). What the library does past that
    result (mlx-lm leaves its wired-memory limit, mlx-vlm records its cache)
    happens first. Returns what it raised there: the request did not end
    cleanly."""
    try:
        for _ in results:
            pass
    except Exception as exc:
        return exc
    return None


@dataclass
class LastResult:
    """A library's last result, held back until the request has ended, and
    an error past it (see ``SessionBase._hand_over``)."""

    result: Any = None
    #: What the library raised past its last result (the request did not end
    #: cleanly: its state was dropped), or what ending the request raised.
    error: Exception | None = None
    kept: bool = True  # whether the request ended cleanly (its state kept)

    def library_failed(self, error: Exception | None) -> None:
        self.error, self.kept = error, error is None


def watch_callers(kwargs: dict[str, Any]) -> list[bool]:
    """Wrap the caller's callables in ``kwargs`` so that the returned flag's
    ``[0]`` turns True once an error before the first token may be theirs,
    and the request must not run again (it would call them twice): once a
    logits processor or the sampler has run (they run after the prefill's
    forward passes), or once the progress callback has raised (it is
    called before the first forward pass too, and again by a rerun)."""
    flag = [False]
    processors = kwargs.get("logits_processors")
    if processors:
        kwargs["logits_processors"] = [_Watched(p, flag, True) for p in processors]
    if kwargs.get("sampler") is not None:
        kwargs["sampler"] = _Watched(kwargs["sampler"], flag, True)
    if kwargs.get("prompt_progress_callback") is not None:
        kwargs["prompt_progress_callback"] = _Watched(kwargs["prompt_progress_callback"], flag,
                                                      False)
    return flag


def _becomes(layer: Any) -> set[str]:
    """The names of the classes ``layer``, a layer of a fresh cache, may
    have in a saved conversation: its own; what its to_quantized makes
    (kv_bits: asked of the empty layer, so a model's own cache class gives
    its own quantized class, as qwen4_exp's does); and for a KVCache or a
    subclass that does not keep state of its own beside the keys
    (``preserve_auxiliary_kv_state``), mlx-vlm's TurboQuant. By name:
    mlx-lm's and mlx-vlm's classes share their names."""
    names = {type(layer).__name__}
    to_quantized = getattr(layer, "to_quantized", None)
    if callable(to_quantized):
        try:
            names.add(type(to_quantized(group_size=64, bits=8)).__name__)
        except Exception:  # noqa: BLE001 - RotatingKVCache's is not implemented: it has none
            pass
    if "KVCache" in {c.__name__ for c in type(layer).__mro__} \
            and not getattr(layer, "preserve_auxiliary_kv_state", False):
        names.add("TurboQuantKVCache")
    if "RotatingKVCache" in names:
        names.add("BufferedRotatingKVCache")  # what mlx-vlm's from_cache makes of one
    return names


#: The max_kv_size sessions ask a model's cache for, to learn what it makes
#: of one (``layers_fit``'s ``windowed``).
WINDOW_PROBE = 4096


def _full_window(layer: Any) -> bool:
    """Whether ``layer`` is a rotating window holding all its rows (its offset
    at or past its size): its next single-token update writes in place,
    never concatenating."""
    size, offset = getattr(layer, "max_size", None), getattr(layer, "offset", None)
    keys = getattr(layer, "keys", None)
    return (type(size) is int and type(offset) is int and offset >= size
            and getattr(keys, "ndim", None) == 4 and "RotatingKVCache" in type(layer).__name__)


def windows_fit(restored: Sequence[Any], probe: Callable[[], Sequence[Any] | None]) -> bool:
    """Whether the full rotating windows of a restored cache have the KV heads
    and head size of the session's model. Elsewhere a cache of another
    model fails in the model's first step, which concatenates (see
    ``_first_or_cold``); a full window's one-token update writes in place,
    where the keys of a model with one KV head broadcast into a slot of
    two: wrong tokens streamed and saved, no error (a review). ``probe()``
    gives a fresh cache after one token of the model (as many layers),
    or None where the model cannot be asked so: then not checked. Asked
    only when a full window was restored."""
    full = [i for i, layer in enumerate(restored) if _full_window(layer)]
    if not full:
        return True
    fresh = probe()
    if fresh is None or len(fresh) != len(restored):
        return True
    for i in full:
        for side in ("keys", "values"):
            got: Any = getattr(restored[i], side, None)
            made: Any = getattr(fresh[i], side, None)
            if getattr(got, "ndim", None) != 4 or getattr(made, "ndim", None) != 4:
                continue
            if (got.shape[1], got.shape[3]) != (made.shape[1], made.shape[3]):
                return False
    return True


def probe_cache(make: Callable[[], list[Any]], run: Callable[[Any, list[Any]], Any]
                ) -> list[Any] | None:
    """A fresh cache (``make()``) after ``run(ids, cache)`` of one token: its
    layers' keys then have the model's shapes. Only the graph is built (the
    shapes are known before anything is computed). None if the model
    cannot be run so (inputs it needs beside the ids)."""
    import mlx.core as mx

    cache = make()
    try:
        run(mx.array([[0]]), cache)
    except Exception as exc:  # noqa: BLE001 - then the windows go unchecked, as before
        log.debug("event=probe_failed error=%s", repr(exc))
        return None
    return cache


def layers_fit(restored: Sequence[Any], fresh: Sequence[Any],
               windowed: Sequence[Any] | None = None) -> bool:
    """Whether the layers of a restored cache can stand in for ``fresh``, a
    new cache of the session's model (and ``windowed``, one made with
    max_kv_size, where the model honours it): as many, each of a class the
    fresh layer may become (see ``_becomes``), CacheLists child by child. A
    cache saved for another model under the same model id, with as many
    layers, was taken, and every request of the conversation then raised
    inside the model (a KVCache where lfm2 keeps an ArraysCache; a plain
    QuantizedKVCache where qwen4_exp's attention asks its own class for
    more)."""
    if len(restored) != len(fresh) or (windowed is not None and len(windowed) != len(fresh)):
        return False
    for i, (got, want) in enumerate(zip(restored, fresh, strict=True)):
        allowed = _becomes(want)
        if windowed is not None:
            allowed |= _becomes(windowed[i])
        if type(got).__name__ not in allowed:
            return False
        if type(want).__name__ == "CacheList" and not layers_fit(
                getattr(got, "caches", ()), want.caches):
            return False
    return True
