"""kvkeeper around ``mlx_lm.stream_generate``.

    from kvkeeper import Client
    from kvkeeper.integrations.mlx_lm import Session

    kv = Client()
    chat = Session(kv, model_fp, "chat-42", model, tokenizer)
    for r in chat.stream_generate(prompt_ids, max_tokens=256):
        print(r.text, end="", flush=True)

A ``Session`` keeps the conversation's cache in memory between requests; after
a restart (a new ``Session``) the first request restores it from kvkeeper.
Each request reuses, trims or re-prefills the cache as described in
:mod:`kvkeeper.integrations`, runs mlx-lm's own ``stream_generate`` with
``prompt_cache=`` the cache, and saves it behind the loop.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx_lm
import numpy as np
import xxhash
from mlx_lm.generate import GenerationResponse
from mlx_lm.generate import stream_generate as _mlx_stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvkeeper.integrations import (
    WINDOW_PROBE,
    LastResult,
    Plan,
    SessionBase,
    hash_array,
    layers_fit,
    probe_cache,
    run_out,
    token_ids_of,
    watch_callers,
    windows_fit,
)
from kvkeeper.protocol.messages import version_tuple
from kvkeeper.writebehind import is_bytes

if TYPE_CHECKING:
    from kvkeeper.client.client import Client

__all__ = ["Plan", "Session", "stream_generate"]


class Session(SessionBase):
    """One conversation with an mlx-lm model, its cache kept by kvkeeper.

    ``client``: a :class:`kvkeeper.Client` (None: memory only). ``model_id``:
    the model's fingerprint (a cache is only ever restored for the same one).
    ``session_id``: the conversation. ``tokenizer``: what ``mlx_lm.load``
    returns (a plain Hugging Face tokenizer is wrapped once). Saves happen every
    ``every_tokens`` generated tokens or ``every_seconds``, and at the end.
    """

    def __init__(
        self,
        client: Client | None,
        model_id: str,
        session_id: str,
        model: Any,
        tokenizer: Any,
        *,
        every_tokens: int | None = 64,
        every_seconds: float | None = 2.0,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(client, model_id, session_id, every_tokens=every_tokens,
                         every_seconds=every_seconds, metadata=metadata)
        # Else each failed only at the first token, deep inside mlx-lm
        # (after a server sent its headers).
        if model is None:
            raise TypeError("model is None: give the model mlx_lm.load returned")
        if isinstance(model, tuple):
            raise TypeError("model is a tuple: mlx_lm.load returns (model, tokenizer), "
                            "give them as two arguments")
        if hasattr(model, "language_model") and hasattr(model, "config"):
            # (mlx-lm's own wrappers of vision models have no config.)
            raise TypeError(f"{type(model).__name__} is an mlx-vlm model: use "
                            f"kvkeeper.integrations.mlx_vlm.Session")
        self.model = model
        if tokenizer is None:
            raise TypeError("tokenizer is None: give the tokenizer mlx_lm.load returned")
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        self.tokenizer = tokenizer

    # input_embeddings: "input_embeddings:<rows>:<xxh3-128>" (see _embeddings_mark).
    _media_room = "input_embeddings:9999999999:" + "0" * 32

    def _compatible(self, cache: list[Any]) -> bool:
        return layers_fit(cache, make_prompt_cache(self.model),
                          make_prompt_cache(self.model, max_kv_size=WINDOW_PROBE)) \
            and windows_fit(cache, lambda: probe_cache(
                lambda: make_prompt_cache(self.model),
                lambda ids, fresh: self.model(ids, cache=fresh)))

    def encode(self, prompt: str | list[int] | mx.array) -> list[int]:
        """The prompt's token ids, tokenized the way ``mlx_lm.stream_generate`` does."""
        if isinstance(prompt, str):
            bos = self.tokenizer.bos_token
            add_special = bos is None or not prompt.startswith(bos)
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special))
            self._check_vocabulary(ids)  # (a tokenizer's added tokens, past the model's)
            return ids
        if isinstance(prompt, (mx.array, np.ndarray)):
            ids = token_ids_of(prompt)
            self._check_vocabulary(ids)
            return ids
        if is_bytes(prompt):
            # Iterated, its bytes were taken for token ids.
            raise ValueError("the prompt must be text or token ids (integers), not bytes")
        ids = []
        try:
            for t in prompt:
                # index(): integers of any kind, never a float cut to one;
                # bools are refused, as Client.save refuses them.
                if type(t) is bool:
                    raise TypeError
                ids.append(operator.index(t))
        except TypeError:
            raise ValueError("the prompt must be text or token ids (integers)") from None
        self._check_vocabulary(ids)
        return ids

    def _check_vocabulary(self, ids: list[int]) -> None:
        """Raise ValueError for an id the model has no embedding for: MLX reads
        past the table (the process died of SIGSEGV) or cannot make the array."""
        top = _vocabulary_size(self.model) or 2**31
        for i, t in enumerate(ids):
            if not 0 <= t < top:
                raise ValueError(f"token id {t} (at {i}) is not in the model's vocabulary "
                                 f"(0 to {top - 1})")

    def stream_generate(
        self,
        prompt: str | list[int] | mx.array,
        max_tokens: int = 256,
        **kwargs: Any,
    ) -> Iterator[GenerationResponse]:
        """``mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens, **kwargs)``
        with the session's cache: yields mlx-lm's own responses.

        ``prompt`` is the whole conversation so far (text or token ids), not
        just the new message: the session works out what its cache already
        holds. ``max_kv_size`` builds a fresh cache as mlx-lm would;
        ``prompt_cache`` and ``draft_model`` are not accepted. ``last_plan``
        tells what was reused. The prompt and arguments are checked at the
        call (ValueError, TypeError), before a server sends its headers.
        """
        for name in ("prompt_cache", "draft_model"):
            if name in kwargs:
                raise TypeError(f"Session.stream_generate does not take {name}=")
        ids = self.encode(prompt)
        if not ids and kwargs.get("input_embeddings") is not None:
            # mlx-lm takes embeddings alone; a session has nothing to match
            # against its cache, nor ids to save the cache under.
            raise ValueError("a Session needs the prompt's token ids: input_embeddings with "
                             "an empty prompt cannot be matched against a cached "
                             "conversation (give the ids the embeddings stand for, or call "
                             "mlx_lm.stream_generate without a Session)")
        if not ids:
            raise ValueError("the prompt is empty")
        return self._generate(ids, max_tokens, kwargs)

    def _generate(self, ids: list[int], max_tokens: int,
                  kwargs: dict[str, Any]) -> Iterator[GenerationResponse]:
        max_kv_size = kwargs.pop("max_kv_size", None)
        embeddings = kwargs.get("input_embeddings")
        request = self._begin(ids)
        made_from = matched = None
        if embeddings is not None:
            # The ids alone do not tell what the cache's rows were computed
            # from (two images behind the same placeholder ids): it is reused
            # only as far as the embeddings it was made from are the same.
            made_from = _embeddings_mark(embeddings, len(ids))

            def matched(cached: str) -> tuple[str, int | None]:
                rows = _rows_marked(cached)
                if rows is None or rows > len(ids) or _embeddings_mark(embeddings, rows) != cached:
                    return made_from, 0
                return cached, rows

        plan = self._prepare(ids, made_from or "", matched)
        if plan.action == "cold":
            cache = make_prompt_cache(self.model, max_kv_size=max_kv_size)
        else:
            assert self.cache is not None
            cache = self.cache
        # While generating, the cache changes under us: nothing usable in memory
        # until the loop ends cleanly.
        self.forget()
        all_ids = list(ids)
        n_prompt = len(ids)
        as_given = dict(kwargs)  # for a cold start after a restored cache failed
        restored = plan.source == "kvkeeper" and plan.action != "cold"
        callers_ran = watch_callers(kwargs) if restored else [True]
        rerun_failed = False
        if plan.reused:
            _feed_only_the_rest(kwargs, ids[:plan.reused])
        wb = self._write_behind(made_from or "")
        clean = started = False
        last = LastResult()
        try:
            responses: Iterator[GenerationResponse] = _mlx_stream_generate(
                self.model, self.tokenizer, mx.array(ids[plan.reused:]), max_tokens,
                prompt_cache=cache, **kwargs,
            )
            if restored:
                tried = plan, cache

                def cold(p: Plan) -> Iterator[GenerationResponse]:
                    nonlocal plan, cache
                    plan, cache = p, make_prompt_cache(self.model, max_kv_size=max_kv_size)
                    return _mlx_stream_generate(self.model, self.tokenizer, mx.array(ids),
                                                max_tokens, prompt_cache=cache, **as_given)

                def back() -> None:
                    nonlocal plan, cache, rerun_failed
                    (plan, cache), rerun_failed = tried, True

                responses = self._first_or_cold(responses, ids, callers_ran, cold, back)
            for r in responses:
                started = True
                # Every token mlx-lm yields has been fed to the cache already.
                if r.generation_tokens > len(all_ids) - n_prompt:
                    all_ids.append(int(r.token))
                wb = self._step(wb, cache, all_ids, request)
                if r.finish_reason is not None:
                    last.result = r
                    last.library_failed(run_out(responses))
                    break
                try:
                    yield r
                except GeneratorExit:
                    clean = True  # the caller stopped early: the cache is consistent
                    raise
            clean = last.kept
        finally:
            unused = None if started or rerun_failed else (
                lambda: self._unused(cache, plan, ids, made_from or ""))
            self._end(request, wb, clean, lambda: self._keep(cache, all_ids, made_from or ""),
                      unused, last)
        if last.result is not None:
            yield from self._hand_over(last)

    def generate(self, prompt: str | list[int] | mx.array, max_tokens: int = 256,
                 **kwargs: Any) -> list[int]:
        """Run :meth:`stream_generate` to the end; return the generated token ids."""
        out: list[int] = []
        for r in self.stream_generate(prompt, max_tokens, **kwargs):
            if r.generation_tokens > len(out):
                out.append(int(r.token))
        return out


def _vocabulary_size(model: Any) -> int | None:
    """The model's vocabulary size as its arguments (``args``, or ``config``
    for plamo2, youtu-llm and a few more) give it: their own (``vocab_size``;
    phixtral's ``num_vocab``), their ``text_config``'s, or its
    ``language_model``'s (pixtral, qwen2-vl and the other wrappers)."""
    for _ in range(4):
        for args in (getattr(model, "args", None), getattr(model, "config", None)):
            text = getattr(args, "text_config", None)
            for size in (getattr(args, "vocab_size", None), getattr(args, "num_vocab", None),
                         text.get("vocab_size") if isinstance(text, dict)
                         else getattr(text, "vocab_size", None)):
                if type(size) is int and size > 0:
                    return size
        model = getattr(model, "language_model", None)
        if model is None:
            return None
    return None


_MARK = "input_embeddings:"


def _embeddings_mark(embeddings: Any, rows: int) -> str:
    """The fingerprint of the first ``rows`` rows of ``embeddings`` (recorded
    with a cache as its media: its first ``rows`` tokens came from them)."""
    h = xxhash.xxh3_128()
    hash_array(h, embeddings[:rows])
    return f"{_MARK}{rows}:{h.hexdigest()}"


def _rows_marked(mark: str) -> int | None:
    """How many rows a fingerprint of ``_embeddings_mark`` covers (None: it is none)."""
    rows, sep, _ = mark.removeprefix(_MARK).partition(":")
    # ASCII digits only: "²" is a digit to str.isdigit and not to int() (a
    # fingerprint read back from a file may say anything).
    ok = mark.startswith(_MARK) and sep and rows.isascii() and rows.isdigit()
    return int(rows) if ok else None


#: mlx-lm 0.32 shows logits processors every prompt token; 0.31 and earlier
#: only those of the last prefill step (one, for a prompt of any length), so
#: there a cold run sees no history either, and prepending the cached tokens
#: would make a cache hit answer otherwise.
_PROCESSORS_SEE_THE_PROMPT = version_tuple(mlx_lm.__version__) >= (0, 32)


def _feed_only_the_rest(kwargs: dict[str, Any], cached: list[int]) -> None:
    """mlx-lm is given only the tokens the cache does not hold: the arguments
    that follow the prompt must too. Its logits processors see the tokens
    they were given and those generated since, so each is handed the cached
    ones first (a repetition penalty otherwise forgot the history, and the
    answer depended on a cache hit); ``input_embeddings`` lose the cached rows
    (mlx-lm refused them: one row per token fed)."""
    processors = kwargs.get("logits_processors")
    if processors and _PROCESSORS_SEE_THE_PROMPT:
        head = mx.array(cached)

        def seeing_all(proc: Any) -> Any:
            return lambda tokens, logits: proc(
                mx.concatenate([head.astype(tokens.dtype), tokens]), logits)

        kwargs["logits_processors"] = [seeing_all(proc) for proc in processors]
    embeddings = kwargs.get("input_embeddings")
    if embeddings is not None:
        kwargs["input_embeddings"] = embeddings[len(cached):]


def stream_generate(
    client: Client | None,
    model_id: str,
    session_id: str,
    model: Any,
    tokenizer: Any,
    prompt: str | list[int] | mx.array,
    max_tokens: int = 256,
    *,
    every_tokens: int | None = 64,
    every_seconds: float | None = 2.0,
    metadata: dict[str, str] | None = None,
    **kwargs: Any,
) -> Iterator[GenerationResponse]:
    """One request without keeping a :class:`Session`: restore the session's
    cache from kvkeeper, generate with it, save it behind. ``every_tokens``,
    ``every_seconds`` and ``metadata`` are the session's; other keyword
    arguments go to ``mlx_lm.stream_generate``."""
    # Not a generator itself: the Session's checks raise here, at the call,
    # not at the first token (after a server has sent its headers).
    session = Session(client, model_id, session_id, model, tokenizer,
                      every_tokens=every_tokens, every_seconds=every_seconds,
                      metadata=metadata)
    return session.stream_generate(prompt, max_tokens, **kwargs)
