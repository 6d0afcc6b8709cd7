"""kvkeeper around mlx-vlm's ``stream_generate`` and its ``PromptCacheState``.

    from kvkeeper import Client
    from kvkeeper.integrations.mlx_vlm import Session

    kv = Client()
    chat = Session(kv, model_fp, "chat-42", model, processor)
    for r in chat.stream_generate(formatted_prompt, image=["cat.png"], max_tokens=256):
        print(r.text, end="", flush=True)

mlx-vlm already reuses a ``PromptCacheState`` from one turn to the next. A
``Session`` restores that state from kvkeeper when memory has none (after a
restart), prepares it (see :mod:`kvkeeper.integrations`: the state handed to
mlx-vlm holds exactly the common prefix, trimmed if needed and possible, or is
empty with a fresh cache for a cold prefill, so mlx-vlm's own prefix logic only
ever sees a cache that matches its tokens), runs mlx-vlm's own
``stream_generate(..., prompt_cache_state=state)``, and saves behind it.

mlx-vlm may still decline the prefix (media tokens in the suffix, a model that
cannot re-derive its RoPE state): it then prefills into a cache of its own.
The session notices (the first result's ``cached_tokens`` and the cache's
length tell), skips the intermediate saves it cannot make correctly, and saves
the state mlx-vlm hands back at the end.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import xxhash
from mlx_vlm.generate import GenerationResult, PromptCacheState
from mlx_vlm.generate import stream_generate as _vlm_stream_generate
from mlx_vlm.models import cache as vlm_cache

from kvkeeper.integrations import (
    WINDOW_PROBE,
    LastResult,
    Plan,
    SessionBase,
    hash_array,
    layers_fit,
    length_mismatch,
    log,
    probe_cache,
    run_out,
    token_ids_of,
    watch_callers,
    windows_fit,
)

if TYPE_CHECKING:
    from kvkeeper.client.client import Client

__all__ = ["Plan", "Session", "media_fingerprint", "stream_generate"]


class Session(SessionBase):
    """One conversation with an mlx-vlm model, its ``PromptCacheState`` kept
    by kvkeeper. Arguments as :class:`kvkeeper.integrations.mlx_lm.Session`,
    with mlx-vlm's ``processor``.
    """

    _media_room = "0" * 32

    def __init__(
        self,
        client: Client | None,
        model_id: str,
        session_id: str,
        model: Any,
        processor: Any,
        *,
        every_tokens: int | None = 64,
        every_seconds: float | None = 2.0,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(client, model_id, session_id, every_tokens=every_tokens,
                         every_seconds=every_seconds, metadata=metadata)
        # Else both failed only at the first token, deep inside mlx-vlm.
        if model is None:
            raise TypeError("model is None: give the model mlx_vlm.load returned")
        # (mlx-vlm reads both; mlx-lm's wrappers of vision models, pixtral,
        # gemma3, qwen2_vl, have a language_model and no config.)
        missing = [name for name in ("language_model", "config") if not hasattr(model, name)]
        if missing:
            raise TypeError(f"{type(model).__name__} is no mlx-vlm model (it has no "
                            f"{' nor '.join(missing)}): for an mlx-lm model, use "
                            f"kvkeeper.integrations.mlx_lm.Session")
        if processor is None:
            # As mlx-lm's Session refuses a tokenizer of None: accepted, the
            # first request raised AttributeError inside mlx-vlm, at its
            # first token with input_ids= (a review).
            raise TypeError("processor is None: give the processor mlx_vlm.load returned")
        self.model = model
        self.processor = processor
        #: Whether the last request's intermediate saves could follow the cache.
        self.tracked: bool | None = None

    def _fresh_cache(self, max_kv_size: int | None) -> list[Any]:
        return vlm_cache.make_prompt_cache(self.model.language_model, max_kv_size=max_kv_size)

    def _compatible(self, cache: list[Any]) -> bool:
        return layers_fit(cache, self._fresh_cache(None), self._fresh_cache(WINDOW_PROBE)) \
            and windows_fit(cache, self._probe)

    def _probe(self) -> list[Any] | None:
        """``probe_cache`` of the language model, which leaves the model as
        it was: running it changes state some keep between calls (Qwen2-VL's
        rope deltas and position ids: a review measured other logits on the
        next prefill after a bare probe)."""
        lm = self.model.language_model
        with _state_kept(self.model):
            return probe_cache(lambda: self._fresh_cache(None),
                               lambda ids, fresh: lm(ids, cache=fresh))

    @property
    def state(self) -> PromptCacheState:
        """The in-memory cache as a ``PromptCacheState`` (a copy of the references)."""
        s = PromptCacheState()
        if self.cache is not None:
            s.update(list(self.token_ids or []), self.cache)
        return s

    def _inputs(self, prompt: str, image: Any, audio: Any, video: Any,
                kwargs: dict[str, Any]) -> list[int]:
        """The prompt's token ids, prepared once; the prepared tensors (the ids
        as mlx-vlm takes them among them) go back into ``kwargs`` so that
        mlx-vlm does not prepare them again."""
        input_ids = kwargs.get("input_ids")
        if input_ids is None and not isinstance(prompt, str):
            # mlx-vlm's tokenizer failed deep inside on a list of ids.
            raise TypeError(f"the prompt is the formatted conversation as text, not "
                            f"{type(prompt).__name__}: give token ids as input_ids=")
        if input_ids is None:
            from mlx_vlm.generate import dispatch

            prepare = getattr(dispatch, "_prepare_generation_inputs", None)
            if prepare is None:
                raise TypeError("this mlx-vlm cannot prepare inputs for kvkeeper; "
                                "pass input_ids= (and pixel_values=, mask=)")
            input_ids, pixel_values, mask, _ = prepare(
                self.model, self.processor, prompt, image, audio, video, kwargs)
            kwargs["pixel_values"] = pixel_values
            kwargs["mask"] = mask
        if not isinstance(input_ids, mx.array):
            input_ids = mx.array(input_ids)
        ids = token_ids_of(input_ids)  # one prompt of integers, or ValueError
        kwargs["input_ids"] = input_ids.reshape(1, -1)
        # Here, on the calling thread: MLX evaluates on a stream of the
        # thread's own, and a generator made on a server's request thread and
        # run on a worker failed ("There is no Stream(cpu, 0) in current
        # thread") where mlx-vlm's own runs.
        # (Arrays in lists and dicts too; other values are passed over.)
        mx.eval(list(kwargs.values()))
        return ids

    def stream_generate(
        self,
        prompt: str = "",
        image: str | list[str] | None = None,
        audio: str | list[str] | None = None,
        video: str | list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationResult]:
        """``mlx_vlm.stream_generate(model, processor, prompt, image, ...)`` with
        the session's prompt cache: yields mlx-vlm's own results.

        ``prompt`` is the whole formatted conversation so far; ``input_ids=``
        (ids of that prompt) may be given instead. ``prompt_cache_state`` and
        ``prompt_cache`` are not accepted (the session owns them), nor is
        ``draft_model`` (TypeError). The prompt and its inputs are prepared and
        checked at the call (ValueError, TypeError), before a server sends
        its headers.
        """
        for name in ("prompt_cache_state", "prompt_cache", "draft_model"):
            if name in kwargs:
                raise TypeError(f"Session.stream_generate does not take {name}=")
        ids = self._inputs(prompt, image, audio, video, kwargs)
        if not ids:
            raise ValueError("the prompt is empty")
        media = media_fingerprint(kwargs, image=image, audio=audio, video=video)
        return self._generate(prompt, image, audio, video, ids, media, kwargs)

    def _generate(self, prompt: str, image: Any, audio: Any, video: Any, ids: list[int],
                  media: str, kwargs: dict[str, Any]) -> Iterator[GenerationResult]:
        request = self._begin(ids)
        plan = self._prepare(ids, media)
        state = PromptCacheState()
        if plan.action == "cold":
            expected = self._fresh_cache(kwargs.get("max_kv_size"))
            kwargs["prompt_cache"] = expected
        else:
            assert self.cache is not None and self.token_ids is not None
            expected = self.cache
            state.update(self.token_ids, expected)  # exactly the common prefix
        sentinel = state.token_ids
        self.forget()  # the cache changes while generating
        all_ids = list(ids)
        n_prompt = len(ids)
        wb = self._write_behind(media)
        as_given = dict(kwargs)  # for a cold start after a restored cache failed
        restored = plan.source == "kvkeeper" and plan.action != "cold"
        callers_ran = watch_callers(kwargs) if restored else [True]
        rerun_failed = False
        self.tracked = None
        clean = finished = started = False
        last = LastResult()
        try:
            results: Iterator[GenerationResult] = _vlm_stream_generate(
                self.model, self.processor, prompt, image=image, audio=audio, video=video,
                prompt_cache_state=state, **kwargs,
            )
            if restored:
                tried = plan, expected, state, sentinel

                def cold(p: Plan) -> Iterator[GenerationResult]:
                    nonlocal plan, expected, state, sentinel
                    plan, expected = p, self._fresh_cache(kwargs.get("max_kv_size"))
                    state = PromptCacheState()
                    sentinel = state.token_ids
                    return _vlm_stream_generate(
                        self.model, self.processor, prompt, image=image, audio=audio,
                        video=video, prompt_cache_state=state,
                        **{**as_given, "prompt_cache": expected})

                def back() -> None:
                    nonlocal plan, expected, state, sentinel, rerun_failed
                    (plan, expected, state, sentinel), rerun_failed = tried, True

                results = self._first_or_cold(results, ids, callers_ran, cold, back)
            for r in results:
                started = True
                if self.tracked is None:
                    self.tracked = self._follows(r, plan, expected)
                if r.token is not None and r.generation_tokens > len(all_ids) - n_prompt:
                    all_ids.append(int(r.token))
                if self.tracked:
                    wb = self._step(wb, expected, all_ids, request)
                if r.finish_reason is not None:
                    # mlx-vlm records its cache only after yielding its last
                    # result, the one a caller stops at.
                    last.result = r
                    last.library_failed(run_out(results))
                    break
                try:
                    yield r
                except GeneratorExit:
                    clean = True
                    raise
            # mlx-vlm ran to its end (and recorded its cache), but for an error
            # past its last result.
            clean = finished = last.kept
        finally:
            def keep() -> None:
                if finished and state.token_ids is not sentinel and state.cache is not None:
                    # mlx-vlm recorded what its cache holds: trust its pairing.
                    self._keep(state.cache, list(state.token_ids or []), media)
                elif self.tracked:
                    self._keep(expected, all_ids, media)
                else:
                    self._keep(None, None, media)

            unused = None if started or rerun_failed else (
                lambda: self._unused(expected, plan, ids, media))
            self._end(request, wb, clean, keep, unused, last)
        if last.result is not None:
            yield from self._hand_over(last)

    def _follows(self, r: GenerationResult, plan: Plan, expected: list[Any]) -> bool:
        """Whether mlx-vlm is generating into the cache we prepared."""
        if r.cached_tokens != plan.reused:
            log.info("event=vlm_declined_prefix model=%s id=%s planned=%d used=%d",
                     self.model_id, self.session_id, plan.reused, r.cached_tokens)
            # What mlx-vlm did instead: last_plan said the prepared reuse.
            n = plan.reused + plan.prefill
            used = max(0, min(r.cached_tokens, n))
            if used < plan.reused:
                self.last_plan = Plan(
                    "cold" if used == 0 else "trim", plan.source, used,
                    plan.trimmed + plan.reused - used, n - used,
                    f"mlx-vlm declined the prepared prefix of {plan.reused} tokens "
                    f"and reused {used}")
            else:  # more than prepared: a cache of its own (an apc_manager= passed on)
                self.last_plan = Plan(
                    "extend", "mlx-vlm", used, plan.reused + plan.trimmed, n - used,
                    f"mlx-vlm reused {used} tokens from a cache of its own, not the "
                    f"{plan.reused} prepared")
            return False
        return length_mismatch(expected, r.total_tokens) is None


#: Keyword arguments that are the prompt itself, not media: its ids and
#: mask, and the tensors some processors return with one entry per prompt
#: token, made from the ids (PaliGemma's and Gemma 3's ``token_type_ids``,
#: Gemma 4's ``mm_token_type_ids``, DeepSeek-VL2's and DeepSeek-OCR's
#: ``images_seq_mask``, Llama 3.2 Vision's ``cross_attention_mask``, whose
#: image and tile axes follow the pixels, hashed anyway): hashed, they changed
#: with every longer prompt, and every turn about the same image started cold.
_NOT_MEDIA = frozenset({"input_ids", "mask", "attention_mask", "token_type_ids",
                        "mm_token_type_ids", "labels", "position_ids", "images_seq_mask",
                        "cross_attention_mask"})


_GONE = object()

#: One probe at a time, in every session of the process: a probe that
#: began inside another's kept that one's probe state and put it back
#: after (a review: two threads probing in a loop left a model of no
#: parameters at all).
_PROBING = threading.Lock()


@contextlib.contextmanager
def _state_kept(model: Any) -> Iterator[None]:
    """Put every module of ``model`` back as it was: its entries (arrays,
    lists, children: an mlx Module is a dict) and its plain attributes
    (None, numbers). The references only: arrays are immutable, and no
    model seen changes a list or dict of its own in place. Only what
    changed is set back, one entry at a time (never cleared and filled
    again): a generation on another thread never sees a module without
    its weights. Its own state, which a model keeps per model, is no
    more shared by two threads than without the probe."""
    with _PROBING:
        kept = [(m, dict(m), dict(vars(m))) for m in model.modules()]
        try:
            yield
        finally:
            for m, entries, attrs in kept:
                for now, then in ((m, entries), (vars(m), attrs)):
                    for name in [k for k in list(now) if k not in then]:
                        dict.pop(now, name, None)
                    for name, value in then.items():
                        if dict.get(now, name, _GONE) is not value:
                            dict.__setitem__(now, name, value)


def media_fingerprint(kwargs: dict[str, Any], *, image: Any = None, audio: Any = None,
                      video: Any = None) -> str:
    """A fingerprint of a request's images, audio and video ("" when it has
    none): every array argument but the prompt's ids, mask and per-token
    tensors (pixel values, image sizes, audio features, ...), else the
    sources named by ``image`` / ``audio`` / ``video``. Two requests with the
    same ids and fingerprint produce the same cache."""
    h = xxhash.xxh3_128()
    found = False
    for name in sorted(kwargs):
        if name in _NOT_MEDIA:
            continue
        for arr in _arrays(kwargs[name]):
            found = True
            h.update(f"{name}:".encode())
            hash_array(h, arr)
    if not found:
        # Nothing prepared: mlx-vlm reads the sources itself. What they hold
        # is hashed, not what they are called: a file rewritten under the same
        # name, and a PIL image or BytesIO freed and another made at the same
        # address (the same repr), were taken for the first one.
        for name, ref in (("image", image), ("audio", audio), ("video", video)):
            if ref is not None and not (isinstance(ref, (list, tuple)) and not ref):
                found = True
                _hash_source(h, name, ref)
    return h.hexdigest() if found else ""


#: How much of a media file is read at once while hashing it.
_READ_BYTES = 1 << 20


def _hash_source(h: Any, name: str, ref: Any) -> None:
    """Feed what a media source holds into ``h``: a file's bytes, a URL or data
    URI as written, a PIL image's mode, size and pixels, a buffer's bytes.
    Anything else gets a random value: never reused, never a wrong cache."""
    if isinstance(ref, (list, tuple)):
        for i, r in enumerate(ref):
            _hash_source(h, f"{name}[{i}]", r)
        return
    h.update(f"{name}:{type(ref).__name__}:".encode())
    if isinstance(ref, (mx.array, np.ndarray)):
        hash_array(h, ref)
    elif isinstance(ref, (bytes, bytearray, memoryview)):
        h.update(ref)
    elif isinstance(ref, io.BytesIO):
        h.update(ref.getbuffer())
    elif all(hasattr(ref, a) for a in ("tobytes", "mode", "size")):  # a PIL image
        h.update(f"{ref.mode}:{tuple(ref.size)}:".encode())
        h.update(ref.tobytes())
    elif isinstance(ref, (str, os.PathLike)):
        text = os.fspath(ref)
        text = text if isinstance(text, str) else os.fsdecode(text)
        h.update(text.encode("utf-8", "surrogateescape") + b"\0")
        if not text.startswith(("data:", "http://", "https://")):
            try:
                with open(text, "rb") as f:
                    while chunk := f.read(_READ_BYTES):
                        h.update(chunk)
            except (OSError, ValueError):  # ValueError: a NUL in the name
                h.update(os.urandom(16))  # mlx-vlm cannot read it either
    else:
        h.update(os.urandom(16))


def _arrays(value: Any) -> list[Any]:
    if isinstance(value, (mx.array, np.ndarray)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


def stream_generate(
    client: Client | None,
    model_id: str,
    session_id: str,
    model: Any,
    processor: Any,
    prompt: str = "",
    image: str | list[str] | None = None,
    *,
    every_tokens: int | None = 64,
    every_seconds: float | None = 2.0,
    metadata: dict[str, str] | None = None,
    **kwargs: Any,
) -> Iterator[GenerationResult]:
    """One request without keeping a :class:`Session`: restore the session's
    prompt cache from kvkeeper, generate with it, save it behind.
    ``every_tokens``, ``every_seconds`` and ``metadata`` are the session's;
    other keyword arguments go to ``mlx_vlm.stream_generate``."""
    # Not a generator itself: the Session's checks raise here, at the call,
    # not at the first token (after a server has sent its headers).
    session = Session(client, model_id, session_id, model, processor,
                      every_tokens=every_tokens, every_seconds=every_seconds,
                      metadata=metadata)
    return session.stream_generate(prompt, image, **kwargs)
