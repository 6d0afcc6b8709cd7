"""Write-behind for a streaming loop: call ``step()`` once per generated token.

    wb = kv.write_behind(model_fp, session_id, every_tokens=64, every_seconds=2.0)
    for response in stream_generate(..., prompt_cache=cache):
        token_ids.append(response.token)
        wb.step(cache, token_ids)          # now and then hands a snapshot off
    wb.close()                             # the final state

Every save is ``Client.save()``: a snapshot handed to the daemon at once,
never waited for. The client and the daemon keep only the newest pending save
of a key, so a slow disk costs dropped intermediate snapshots (most replaced
in the client before they are sent, ``client_saves_coalesced``; the rest in
the daemon, ``saves_superseded``), never a stall of the loop.

The helper also refuses to save a cache that does not hold exactly the tokens
it is saved with (when the layers tell their length): a cache restored later
is fed to a model, and a wrong one would silently produce wrong tokens.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import time
from array import array
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

from kvkeeper import config
from kvkeeper.logs import get_logger

if TYPE_CHECKING:
    from kvkeeper.client.client import Client

log = get_logger("kvkeeper.writebehind")

_TAIL = 64  # ids compared by close(cache, ids): see _tail

__all__ = ["WriteBehind", "WriteBehindCounters", "cache_length", "check_token_ids", "one_row",
           "check_triggers", "is_bytes", "layer_offsets", "length_mismatch"]


@dataclass
class WriteBehindCounters:
    """What one helper did. ``sent``: saves handed off (``Client.save()``
    returned True; the client may still replace one with a newer save of the
    key before sending it, ``client_saves_coalesced``); ``dropped``: saves
    the client dropped (daemon down, too much in flight). Whether the daemon
    wrote or superseded them shows in ``Client.stats()``."""

    steps: int = 0
    sent: int = 0
    dropped: int = 0
    last_saved_tokens: int | None = None


class WriteBehind:
    """Saves ``(cache, token_ids)`` of one session every ``every_tokens`` steps
    or ``every_seconds`` seconds, whichever comes first, and once more on
    ``close()``.

    ``every_tokens=None`` / ``every_seconds=None`` turn one trigger off;
    ``every_seconds=0`` saves at every step. ``save_first`` (default on) saves
    at the first step too: right after a prefill, the state most expensive to
    recompute. Not thread-safe: one helper per generation loop. As a context
    manager it closes (the final save) when its block ends, and discards
    (no final save) when the block raises.
    """

    def __init__(
        self,
        client: Client,
        model: str,
        cache_id: str,
        *,
        every_tokens: int | None = 64,
        every_seconds: float | None = 2.0,
        save_first: bool = True,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        from kvkeeper.client.client import check_metadata
        from kvkeeper.protocol.naming import check_key

        model, cache_id = check_key(model, cache_id)
        check_triggers(every_tokens, every_seconds)
        self.client = client
        self.model = model
        self.cache_id = cache_id
        self.every_tokens = every_tokens
        self.every_seconds = every_seconds
        # Checked as strictly as the triggers: "no" was taken as true.
        self.save_first = config.check_flag("save_first", save_first)
        # Checked here, not at the first save in the middle of a generation.
        self.metadata = check_metadata(metadata) or None
        self.counters = WriteBehindCounters()
        # Steps since the last save handed off: what close() still has to
        # save. A dropped save leaves them pending (the daemon may be back by
        # then), while the triggers count from the last try (_tried), so an
        # outage does not turn into a save attempt at every step.
        self._pending = 0
        self._tried = 0
        self._last_time = time.monotonic()
        self._last: tuple[Any, Sequence[int]] | None = None
        self._saved_tail: tuple[int, ...] | None = None  # of the last save handed off
        self._closed = False
        self._told_closed = False

    # ------------------------------------------------------------ the loop

    def step(self, cache: Any, token_ids: Sequence[int]) -> bool:
        """Note one more generated token; save if a trigger fired.

        ``cache`` is the live cache (list of layers, or an object with
        ``.cache``), ``token_ids`` every token it holds (prompt and generated).
        Returns True when a save was handed off at this step. Never blocks on
        the daemon. Raises ValueError when the cache's length and
        ``len(token_ids)`` disagree.
        """
        if self._closed:
            raise RuntimeError("write-behind is closed")
        token_ids = one_row(token_ids)
        # At every step, not only those that save: an off-by-one would
        # otherwise show up only at the next save, up to every_tokens later.
        _checked_length(cache, token_ids)
        c = self.counters
        before = (self._pending, self._tried, self._last)
        c.steps += 1
        self._pending += 1
        self._tried += 1
        self._last = (cache, token_ids)
        if not self._due():
            return False
        try:
            return self._save(cache, token_ids)
        except ValueError:
            # Refused: not a step. The counters, the triggers and close() go
            # on from the last step taken.
            c.steps -= 1
            self._pending, self._tried, self._last = before
            raise

    def _due(self) -> bool:
        c = self.counters
        if self.save_first and c.sent == 0 and c.dropped == 0:
            return True
        if self.every_tokens is not None and self._tried >= self.every_tokens:
            return True
        return (
            self.every_seconds is not None
            and time.monotonic() - self._last_time >= self.every_seconds
        )

    def save(self, cache: Any, token_ids: Sequence[int]) -> bool:
        """Save now, whatever the triggers say (still fire-and-forget)."""
        if self._closed:
            raise RuntimeError("write-behind is closed")
        token_ids = one_row(token_ids)
        before, self._last = self._last, (cache, token_ids)
        try:
            return self._save(cache, token_ids)
        except ValueError:
            self._last = before  # refused: close() goes on from the last step taken
            raise

    def close(self, cache: Any = None, token_ids: Sequence[int] | None = None) -> bool:
        """The final save: of ``(cache, token_ids)`` when given, else of what the
        last ``step()`` saw, as it is now (``token_ids`` alone: of that step's
        cache with those ids; skipped when no step came after the
        last save handed off, by a step or by ``save()``, and the pair is that
        save's cache with as many token ids, the last 64 the same: a rollback
        to the same length, ids changed in place, is saved).
        Returns True when a save was handed off. Does not wait for the daemon
        (``Client.flush()`` does). Later calls do nothing. A ValueError (a
        cache and token ids that disagree) leaves the helper open: a call
        with the right pair may follow."""
        if self._closed:
            return False
        if cache is not None and token_ids is None:
            token_ids = getattr(cache, "token_ids", None)
            if token_ids is None:
                raise ValueError("close(cache) needs token_ids")
        if token_ids is not None:
            token_ids = one_row(token_ids)
        try:
            handed = self._final_save(cache, token_ids)
        except ValueError:
            raise  # refused: still open
        except BaseException:
            self._end()
            raise
        self._end()
        return handed

    def _final_save(self, cache: Any, token_ids: Sequence[int] | None) -> bool:
        if cache is None:
            if self._last is None:
                if token_ids is not None:
                    raise ValueError("close(token_ids=...) saves the cache the last step() "
                                     "saw, and no step came: give the cache too")
                return False
            # Token ids alone: of the cache the last step saw (they were
            # dropped, and that step's ids saved instead).
            cache, token_ids = self._last[0], (self._last[1] if token_ids is None
                                               else token_ids)
        assert token_ids is not None
        # Checked before the skip: a cache fed more tokens since the last
        # step, with that step's ids, was skipped as saved already (and
        # refused as a mismatch when the last step had not saved).
        _checked_length(cache, token_ids)
        if (self._pending == 0 and self._last is not None and self._last[0] is cache
                and self.counters.last_saved_tokens == len(token_ids)
                and self._saved_tail is not None and _tail(token_ids) == self._saved_tail):
            return False  # the last save was of exactly this
        return self._save(cache, token_ids)

    def _end(self) -> None:
        self._closed = True
        # Holding the cache past the end would keep it from being freed (a
        # Session's forget() keeps its last helper, for the counters).
        self._last = None

    def discard(self) -> None:
        """Close without a final save (e.g. the loop failed half way and the
        cache may be inconsistent); the last save stays the newest."""
        self._end()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None or exc_type is GeneratorExit:
            self.close()
        else:
            self.discard()

    # ------------------------------------------------------------ internals

    def _save(self, cache: Any, token_ids: Sequence[int]) -> bool:
        n = _checked_length(cache, token_ids)
        try:
            ok = self.client.save(self.model, self.cache_id, cache, token_ids,
                                  metadata=self.metadata)
        except RuntimeError:
            if not self.client.closed:
                raise
            # The server closed its client while a request streams: the
            # generation goes on, its saves are drops (said once per helper,
            # whatever was dropped before).
            if not self._told_closed:
                self._told_closed = True
                log.warning("event=write_behind_client_closed model=%s id=%s: saves are "
                            "dropped", self.model, self.cache_id)
            ok = False
        c = self.counters
        if ok:
            c.sent += 1
            c.last_saved_tokens = n
            self._saved_tail = _tail(token_ids)
            self._pending = 0
        else:
            c.dropped += 1
            self._pending = max(self._pending, 1)  # a dropped save() without steps too
        self._tried = 0
        self._last_time = time.monotonic()
        return ok


def check_triggers(every_tokens: Any, every_seconds: Any) -> None:
    """Raise ValueError for save triggers that could never fire as meant."""
    if every_tokens is not None and (isinstance(every_tokens, bool)
                                     or not isinstance(every_tokens, Integral) or every_tokens < 1):
        raise ValueError(f"every_tokens must be an integer of at least 1 (or None), "
                         f"not {every_tokens!r}")
    if every_seconds is not None and (isinstance(every_seconds, bool)
                                      or not isinstance(every_seconds, Real)
                                      or math.isnan(every_seconds) or every_seconds < 0):
        raise ValueError(f"every_seconds must be a number >= 0 (or None), not {every_seconds!r}")


def _tail(token_ids: Sequence[int]) -> tuple[int, ...] | None:
    """The last ids, which close(cache, ids) compares with those of the last
    save before it skips its own: a rollback to the same length (a draft
    rejected, others fed) changes them, and its save was skipped. Not every
    id: a copy of 128k of them at every save would cost the loop about
    0.15 ms. None when they can be neither sliced nor reversed (close()
    then saves)."""
    try:
        tail = token_ids[-_TAIL:]
        return tuple(tail.tolist() if hasattr(tail, "tolist") else tail)
    except (TypeError, ValueError):
        pass
    try:  # a deque: no slices
        return tuple(itertools.islice(reversed(token_ids), _TAIL))[::-1]
    except (TypeError, ValueError):
        return None


#: struct formats (less any byte order) and array typecodes of bytes
#: (``memoryview(b"...")`` is "B", a ctypes one "<B").
_BYTE_FORMATS = frozenset({"B", "b", "c"})


def is_bytes(raw: Any) -> bool:
    """Whether ``raw`` is bytes, or a view or array of them: iterated, any of
    them gives byte values that would pass for token ids."""
    if isinstance(raw, memoryview):
        return raw.format.lstrip("@=<>!") in _BYTE_FORMATS
    if isinstance(raw, array):
        return raw.typecode in _BYTE_FORMATS
    return isinstance(raw, (bytes, bytearray))


def one_row(token_ids: Any) -> Any:
    """``token_ids`` as one row: an array of shape (1, n) (a batch of one,
    as mlx-vlm's ``input_ids`` and a ``Session`` prompt come) reshaped to
    (n,); anything else as given."""
    shape = getattr(token_ids, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] != 1:
        return token_ids
    row = token_ids.reshape(-1)
    if type(row).__module__.partition(".")[0] == "mlx":
        # MLX's reshape is lazy, on this thread's stream: a close() on
        # another thread could not read the ids the last step kept. (Ids
        # still to be computed on another thread stay so: saving them
        # raises ValueError, as it does for a row.)
        import mlx.core as mx

        with contextlib.suppress(RuntimeError):
            mx.eval(row)
    return row


def check_token_ids(token_ids: Any) -> None:
    """Raise ValueError for token ids of a kind that cannot be one: unordered
    (a set, a dict's keys would be saved in some order and load back as ids
    that look real), bytes (their bytes would be taken for ids), text, or an array
    other than one row (give `one_row` a batch of one first)."""
    if isinstance(token_ids, (Set, Mapping)):
        raise ValueError(f"token_ids must be an ordered sequence of integers, not a "
                         f"{type(token_ids).__name__}")
    if is_bytes(token_ids) or isinstance(token_ids, str):
        kind = type(token_ids).__name__ if isinstance(token_ids, (bytes, bytearray, str)) \
            else "bytes"
        raise ValueError(f"token_ids must be integers, not {kind} "
                         f"(encode the text with the tokenizer)")
    if getattr(token_ids, "ndim", 1) != 1:
        raise ValueError(f"token_ids must be one row of integers, shape (n,) or (1, n), "
                         f"not an array of shape {tuple(token_ids.shape)}")


def _checked_length(cache: Any, token_ids: Sequence[int]) -> int:
    """``len(token_ids)``, once the pair passes the checks that cost no
    more than a walk of the layers; raises ValueError otherwise."""
    if isinstance(cache, (list, tuple)):
        layers = cache
    elif hasattr(cache, "cache"):
        layers = cache.cache
    else:
        raise ValueError(f"cache must be a list of cache layers or have a .cache attribute, "
                         f"not {type(cache).__name__}")
    check_token_ids(token_ids)
    if not hasattr(token_ids, "__len__"):
        raise ValueError(f"token_ids must be an ordered sequence of integers, not a "
                         f"{type(token_ids).__name__}")
    n = len(token_ids)
    if n:
        _check_newest_id(token_ids)
    why = length_mismatch(layers, n)
    if why is not None:
        raise ValueError(f"{why}; refusing to save a cache that does not match its tokens")
    return n


def _check_newest_id(token_ids: Sequence[int]) -> None:
    """Raise ValueError when the ids' dtype, or else their last one, is no
    integer: a step that does not save checked no id, so floats went
    through every such step and raised only at the next save, or at close()
    (which then never made its final save). One id, not all: every step
    checking every id cost a generation time quadratic in its length."""
    dtype = getattr(token_ids, "dtype", None)
    kind = str(dtype).rsplit(".", 1)[-1] if dtype is not None else "object"
    if kind != "object":  # a numpy or MLX array of one kind for all
        if not kind.startswith(("int", "uint")):
            raise ValueError(f"token_ids must be integers, not an array of {kind}")
        return
    try:
        last = token_ids[-1]
    except (TypeError, KeyError, IndexError):
        return  # a sized iterable without indexing: left to the save
    try:
        if isinstance(last, bool):
            raise TypeError("bools are not token ids")
        operator.index(last)
    except TypeError as exc:
        raise ValueError(f"token_ids must be integers: {exc}") from None


def cache_length(layers: Sequence[Any] | None) -> int | None:
    """How many tokens a prompt cache holds, as its layers tell (the largest
    integer ``offset``, looking inside CacheList); None when no layer has one
    (e.g. only ArraysCache layers)."""
    known = [n for n in layer_offsets(layers) if n is not None]
    return max(known) if known else None


#: Classes whose ``offset`` counts every token the cache was fed, in mlx-lm
#: and mlx-vlm alike (the class itself, not a subclass, which may count
#: otherwise). mlx-vlm's PoolingCache counts the pooled tokens, beside a
#: layer counting them all in a CacheList (DeepSeek V4, GLM-5 Next).
_COUNTS_EVERY_TOKEN = frozenset(
    f"{module}.{name}" for module in ("mlx_lm.models.cache", "mlx_vlm.models.cache")
    for name in ("KVCache", "RotatingKVCache", "QuantizedKVCache", "ChunkedKVCache",
                 "ConcatenateKVCache"))


_COUNTING: dict[type, bool] = {}  # by class: see _counts_every_token


def _counts_every_token(cls: type) -> bool:
    # (Looked up by class: a name built per layer per step cost 23 us a step
    # for 64 layers.)
    known = _COUNTING.get(cls)
    if known is None:
        known = _COUNTING[cls] = f"{cls.__module__}.{cls.__qualname__}" in _COUNTS_EVERY_TOKEN
    return known


def length_mismatch(layers: Sequence[Any] | None, n: int) -> str | None:
    """Why ``layers`` do not hold ``n`` tokens as their offsets tell (looking
    inside CacheList), or None when they do: the largest offset is ``n``,
    and the layers of the classes whose offset counts every token agree.
    The largest alone passed a cache of such layers that disagree (one part
    way through a forward pass, or layers of two caches mixed), and a
    session restoring it generated wrong tokens."""
    # Those that hold nothing are left out: mllama's cross-attention layers
    # (plain KVCache) are never fed, at offset 0 beside the others.
    leaves = _leaf_offsets(layers)
    counted = {off for layer, off in leaves if off and _counts_every_token(type(layer))}
    if len(counted) > 1:
        return (f"the cache's layers hold different numbers of tokens ({min(counted)} to "
                f"{max(counted)}) for {n} token ids")
    have = max((off for _, off in leaves if off is not None), default=None)
    if have is not None and have != n:
        return f"the cache holds {have} tokens but {n} token ids were given"
    return None


def layer_offsets(layers: Sequence[Any] | None) -> list[int | None]:
    """Each leaf layer's ``offset`` (looking inside CacheList), None for a
    layer without an integer one (e.g. ArraysCache)."""
    return [off for _, off in _leaf_offsets(layers)]


def _leaf_offsets(layers: Sequence[Any] | None) -> list[tuple[Any, int | None]]:
    out: list[tuple[Any, int | None]] = []
    for layer in layers or ():
        children = getattr(layer, "caches", None)
        if children is not None and not isinstance(layer, (list, tuple)):
            out.extend(_leaf_offsets(list(children)))
        else:
            off = getattr(layer, "offset", None)
            out.append((layer, off if isinstance(off, int) and not isinstance(off, bool)
                        else None))
    return out
