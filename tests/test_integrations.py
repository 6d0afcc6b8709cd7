"""The mlx-lm and mlx-vlm integrations: conversations that restart between
turns give exactly the tokens of an uninterrupted run that keeps its cache in
memory. Real tiny models (a llama, and an lfm2 hybrid whose ArraysCache layers
cannot be trimmed), random weights, greedy sampling, a real daemon."""

from __future__ import annotations

import gc
import json
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import stream_generate as lm_stream_generate
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_vlm.generate import PromptCacheState
from mlx_vlm.generate import stream_generate as vlm_stream_generate
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.models import lfm2 as vlm_lfm2
from mlx_vlm.models import llama as vlm_llama
from mlx_vlm.models import qwen2_vl as vlm_qwen2_vl
from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
from mlx_vlm.utils import StoppingCriteria

from kvkeeper.client.client import Client
from kvkeeper.demo import word_tokenizer
from kvkeeper.integrations import common_prefix, layers_fit, plan_reuse
from kvkeeper.integrations import mlx_lm as kv_lm
from kvkeeper.integrations import mlx_vlm as kv_vlm
from kvkeeper.writebehind import cache_length

from .conftest import WAIT, RunningDaemon, serve_process, stop_process
from .legacy_describe import MLX_LM_OLD_API
from .tiny import VOCAB, _finish, prompt, tiny_deepseek_v41, tiny_lfm2, tiny_llama, tiny_qwen2

GEN = 16  # tokens per turn


@pytest.fixture(scope="module")
def lm_tok() -> TokenizerWrapper:
    return TokenizerWrapper(word_tokenizer(VOCAB))


LM_MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: tiny_llama(seed=3),
    "lfm2": lambda: tiny_lfm2(seed=3),
}
if not MLX_LM_OLD_API:  # 0.31, the newest for Python 3.10, has no DeepSeek V4.1
    LM_MODELS["deepseek_v41"] = lambda: tiny_deepseek_v41(seed=3)


@pytest.fixture(scope="module", params=sorted(LM_MODELS))
def lm(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    return request.param, LM_MODELS[request.param]()


def conversation(history: list[list[int]], turn: int) -> list[int]:
    """The prompt of each turn, from the turns' outputs so far.

    Turn 0: a long first message. Turn 1: the history plus a new message (the
    cache extends). Turn 2: the user edits the second message: the prompt
    leaves the cached history after turn 0's answer (trim, or re-prefill)."""
    first, second, edited = prompt(48, seed=10), prompt(8, seed=11), prompt(7, seed=12)
    if turn == 0:
        return first
    if turn == 1:
        return first + history[0] + second
    return first + history[0] + edited


# --------------------------------------------------------------------------- mlx-lm


def lm_reference(model: nn.Module, tok: TokenizerWrapper, turns: int) -> list[list[int]]:
    """The uninterrupted run: one cache in memory, plain mlx-lm, mlx-lm's own
    trim helper; a cache that cannot be trimmed is rebuilt from scratch."""
    cache = make_prompt_cache(model)
    held: list[int] = []
    out: list[list[int]] = []
    for turn in range(turns):
        full = conversation(out, turn)
        p = min(common_prefix(held, full), len(full) - 1)
        if p < len(held):
            if all(c.is_trimmable() for c in cache) and p > 0:
                assert trim_prompt_cache(cache, len(held) - p) == len(held) - p
            else:
                cache, p = make_prompt_cache(model), 0
        gen = [r.token for r in lm_stream_generate(model, tok, mx.array(full[p:]),
                                                   max_tokens=GEN, prompt_cache=cache)]
        held = full + gen
        out.append(gen)
    return out


def test_mlx_lm_restarts_between_turns_give_the_same_tokens(
    lm: tuple[str, nn.Module], lm_tok: TokenizerWrapper, daemon: RunningDaemon
) -> None:
    name, model = lm
    expected = lm_reference(model, lm_tok, 3)
    sid = f"chat-{name}"
    out: list[list[int]] = []
    plans = []
    for turn in range(3):
        full = conversation(out, turn)
        with Client(daemon.socket, timeout=WAIT) as kv:  # a new process each turn
            if turn == 1:  # the one-call form
                gen: list[int] = []
                # metadata= went on to mlx-lm, which refused it (TypeError).
                for r in kv_lm.stream_generate(kv, "tiny-lm-" + name, sid, model, lm_tok, full,
                                               max_tokens=GEN, every_tokens=4,
                                               metadata={"turn": "1"}):
                    gen.append(r.token)
                session = None
                assert kv.flush(timeout=WAIT) is True
                got = kv.load("tiny-lm-" + name, sid, verify=False)
                assert got is not None and got.metadata["turn"] == "1"
            else:
                session = kv_lm.Session(kv, "tiny-lm-" + name, sid, model, lm_tok, every_tokens=4)
                gen = session.generate(full, max_tokens=GEN)
                plans.append(session.last_plan)
                assert session.token_ids == full + gen
                assert cache_length(session.cache) == len(full) + len(gen)
            assert kv.flush(timeout=WAIT) is True
        out.append(gen)
        assert gen == expected[turn], f"turn {turn}"

    first = plans[0]
    assert first is not None and (first.action, first.source) == ("cold", None)
    third = plans[1]
    assert third is not None and third.source == "kvkeeper"
    if name == "llama":
        assert third.action == "trim"
        assert third.reused == 48 + GEN and third.trimmed == 8 + GEN
    else:  # lfm2's ArraysCache and DeepSeek's LayerCache cannot go back: a re-prefill
        assert third.action == "cold" and third.reused == 0
        assert "cannot be trimmed" in third.reason

    # The same conversation in one process: the cache stays in memory.
    with Client(daemon.socket, timeout=WAIT) as kv:
        session = kv_lm.Session(kv, "tiny-lm-" + name, sid + "-mem", model, lm_tok)
        mem: list[list[int]] = []
        sources = []
        for turn in range(3):
            mem.append(session.generate(conversation(mem, turn), max_tokens=GEN))
            assert session.last_plan is not None
            sources.append(session.last_plan.source)
        assert mem == expected
        assert sources == [None, "memory", "memory"]


def test_mlx_lm_a_cache_made_from_other_input_embeddings_is_not_reused(
    lm_tok: TokenizerWrapper, client: Client
) -> None:
    """Two images behind the same placeholder ids (input_embeddings that are
    not the ids' own): the session matched the cache by its ids alone, so the
    second image got the first one's answer, in memory and after a restart."""
    model = tiny_llama(seed=3)
    ids = [7] * 16 + prompt(20, seed=50)
    own = model.model.embed_tokens(mx.array(ids))
    mx.random.seed(1)
    image = {name: own.at[:16].add(mx.random.normal((16, own.shape[-1])).astype(own.dtype) * 3)
             for name in "AB"}

    def cold(emb: mx.array, ids: list[int] = ids) -> list[int]:
        return [r.token for r in lm_stream_generate(model, lm_tok, mx.array(ids), max_tokens=8,
                                                    input_embeddings=emb)]

    fresh = {name: cold(emb) for name, emb in image.items()}
    assert fresh["A"] != fresh["B"]
    session = kv_lm.Session(client, "tiny-lm", "images", model, lm_tok)
    said = session.generate(ids, max_tokens=8, input_embeddings=image["A"])
    assert said == fresh["A"]
    assert session.generate(ids, max_tokens=8, input_embeddings=image["B"]) == fresh["B"]
    assert session.last_plan is not None and session.last_plan.action == "cold"
    assert client.flush(timeout=WAIT)
    restarted = kv_lm.Session(client, "tiny-lm", "images", model, lm_tok)
    assert restarted.generate(ids, max_tokens=8, input_embeddings=image["A"]) == fresh["A"]
    assert restarted.last_plan is not None and restarted.last_plan.action == "cold"
    # The same image again, the conversation carried on: the rows its
    # embeddings made are reused (the generated ones, the model's own
    # embeddings, are fed again with the rows given for them).
    assert client.flush(timeout=WAIT)
    again = kv_lm.Session(client, "tiny-lm", "images", model, lm_tok)
    whole = ids + fresh["A"] + prompt(4, seed=51)
    emb = mx.concatenate([image["A"], model.model.embed_tokens(mx.array(whole[len(ids):]))])
    assert again.generate(whole, max_tokens=8, input_embeddings=emb) == cold(emb, whole)
    assert again.last_plan is not None and again.last_plan.source == "kvkeeper"
    assert again.last_plan.reused == len(ids), again.last_plan
    # A fingerprint read back from a file that is none (its row count "²",
    # a digit to str.isdigit only): a cold start, not a ValueError.
    from kvkeeper.integrations import MEDIA_KEY

    # (One token in it: mlx-lm 0.31, Python 3.10's, cannot describe an empty KVCache.)
    one = make_prompt_cache(model)
    mx.eval(model(mx.array([ids[:1]]), cache=one))
    assert client.save("tiny-lm", "odd-mark", one, ids[:1],
                       metadata={MEDIA_KEY: "input_embeddings:\u00b2:0"})
    assert client.flush(timeout=WAIT)
    odd = kv_lm.Session(client, "tiny-lm", "odd-mark", model, lm_tok)
    assert odd.generate(ids, max_tokens=8, input_embeddings=image["A"]) == fresh["A"]
    # Without embeddings, a cache made from them is not the ids' own either.
    assert again.generate(whole, max_tokens=8) == [
        r.token for r in lm_stream_generate(model, lm_tok, mx.array(whole), max_tokens=8)]
    assert again.last_plan is not None and again.last_plan.action == "cold"


def test_mlx_lm_arguments_that_follow_the_prompt_see_the_cached_part_too(
    lm_tok: TokenizerWrapper,
) -> None:
    """The session feeds mlx-lm only what its cache lacks: a repetition
    penalty saw only that (the answer depended on a cache hit: turns differed
    from a cold run), and input_embeddings of the whole prompt were refused
    on every turn that reused the cache."""
    from mlx_lm.sample_utils import make_logits_processors

    model = tiny_llama(seed=3)

    def cold(ids: list[int], **kw: Any) -> list[int]:
        return [r.token for r in lm_stream_generate(model, lm_tok, mx.array(ids), max_tokens=8,
                                                    **kw)]

    penalty = make_logits_processors(repetition_penalty=1.3, repetition_context_size=20)
    for seed in range(12):
        first, more = prompt(30, seed=100 + seed), prompt(2, seed=200 + seed)
        session = kv_lm.Session(None, "tiny-lm", "penalty", model, lm_tok)
        said = session.generate(first, max_tokens=8, logits_processors=penalty)
        assert said == cold(first, logits_processors=penalty)
        whole = first + said + more
        assert session.generate(whole, max_tokens=8, logits_processors=penalty) == cold(
            whole, logits_processors=penalty), seed
        assert session.last_plan is not None and session.last_plan.action == "extend"

    def embed(ids: list[int]) -> mx.array:
        return model.model.embed_tokens(mx.array(ids))

    session = kv_lm.Session(None, "tiny-lm", "embeddings", model, lm_tok)
    first, more = prompt(30, seed=140), prompt(5, seed=141)
    said = session.generate(first, max_tokens=6, input_embeddings=embed(first))
    whole = first + said + more
    got = session.generate(whole, max_tokens=6, input_embeddings=embed(whole))
    assert session.last_plan is not None and session.last_plan.reused > 0
    assert got == [r.token for r in lm_stream_generate(
        model, lm_tok, mx.array(whole), max_tokens=6, input_embeddings=embed(whole))]
    # Embeddings alone (mlx-lm takes an empty prompt with them): nothing for a
    # session to match or save its cache under, said plainly (it was "the
    # prompt is empty"), and the session's cache is left as it was.
    with pytest.raises(ValueError, match="needs the prompt's token ids"):
        session.generate([], max_tokens=4, input_embeddings=embed(first))
    assert session.token_ids == whole + got


def test_mlx_lm_whole_prompt_cached_still_feeds_a_token(
    lm: tuple[str, nn.Module], lm_tok: TokenizerWrapper, client: Client
) -> None:
    """Regenerating an answer: the prompt is all in the cache. A trimmable cache
    goes back one more token; a hybrid one is re-prefilled. Either way the
    model computes what it computed the first time."""
    name, model = lm
    p = prompt(40, seed=20)
    first = kv_lm.Session(client, "tiny-lm-" + name, "regen", model, lm_tok)
    answer = first.generate(p, max_tokens=GEN)
    again = kv_lm.Session(client, "tiny-lm-" + name, "regen", model, lm_tok)  # restarted
    assert again.generate(p, max_tokens=GEN) == answer
    plan = again.last_plan
    assert plan is not None and plan.source == "kvkeeper"
    if name == "llama":
        assert (plan.action, plan.reused, plan.prefill) == ("trim", 39, 1)
    else:
        assert (plan.action, plan.prefill) == ("cold", 40)
        # Nothing diverged (it said "cache diverges at token 40").
        assert "holds the whole prompt" in plan.reason, plan.reason


def test_a_saved_cache_without_token_ids_is_not_reused_and_says_why(
    lm_tok: TokenizerWrapper, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """An mlx-lm file brought in by `kvkeeper import` has no token ids: the
    session started cold with nothing logged, and its first save replaced
    the entry. Its plan says why."""
    model = tiny_llama()
    p = prompt(40, seed=21)
    cache = make_prompt_cache(model)
    model(mx.array([p]), cache=cache)
    assert client.save("tiny-lm-llama", "imported", cache) and client.flush(timeout=WAIT)
    session = kv_lm.Session(client, "tiny-lm-llama", "imported", model, lm_tok)
    with caplog.at_level(logging.WARNING, logger="kvkeeper"):
        gen = session.generate(p, max_tokens=GEN)
    assert "event=restore_no_token_ids model=tiny-lm-llama id=imported" in caplog.text
    assert session.last_plan is not None and session.last_plan.action == "cold"
    # It said "no cache for this session", as if none had been found.
    assert session.last_plan.reason == "the saved cache does not say which tokens it holds"
    assert client.flush(timeout=WAIT)
    got = client.load("tiny-lm-llama", "imported")
    assert got is not None and got.token_ids == p + gen


def test_mlx_lm_stop_token_and_early_stop_keep_cache_and_ids_together(
    lm_tok: TokenizerWrapper, client: Client
) -> None:
    model = tiny_llama(seed=4)
    p = prompt(30, seed=21)
    free = kv_lm.Session(None, "tiny-lm-eos", "x", model, lm_tok).generate(p, max_tokens=GEN)
    k = next(i for i in range(3, GEN) if free[i] not in free[:i])
    with_eos = TokenizerWrapper(word_tokenizer(VOCAB), eos_token_ids=[free[k]])

    s = kv_lm.Session(client, "tiny-lm-eos", "eos", model, with_eos)
    rs = list(s.stream_generate(p, max_tokens=GEN))
    assert rs[-1].finish_reason == "stop" and [r.token for r in rs] == free[: k + 1]
    assert s.token_ids == p + free[: k + 1]  # the stop token was fed to the cache too
    assert cache_length(s.cache) == len(p) + k + 1

    early = kv_lm.Session(client, "tiny-lm-eos", "early", model, lm_tok)
    for n, _ in enumerate(early.stream_generate(p, max_tokens=GEN), 1):
        if n == 5:
            break  # the caller stops reading: the generator is closed here
    assert early.token_ids == p + free[:5]
    assert cache_length(early.cache) == len(p) + 5
    assert client.flush(timeout=WAIT) is True
    got = client.load("tiny-lm-eos", "early")
    assert got is not None and got.token_ids == p + free[:5]

    # The next turn of the restarted process extends the saved stop-token state.
    nxt = kv_lm.Session(client, "tiny-lm-eos", "eos", model, lm_tok)
    nxt.generate(p + free[: k + 1] + prompt(5, seed=22), max_tokens=4)
    assert nxt.last_plan is not None and nxt.last_plan.action == "extend"
    assert nxt.last_plan.reused == len(p) + k + 1


def test_plan_never_reuses_a_wrong_cache() -> None:
    model = tiny_lfm2(seed=5)
    p = prompt(20, seed=23)
    cache = make_prompt_cache(model)
    assert {type(c) for c in cache} == {ArraysCache, KVCache}
    model(mx.array([p]), cache=cache)
    # Ids that disagree with the cache's length: never reused.
    assert plan_reuse(cache, p[:-1], p + [1]).action == "cold"
    # Diverging prompt on a hybrid cache: cold, and the cache was not touched.
    plan = plan_reuse(cache, p, p[:10] + [1, 2, 3])
    assert plan.action == "cold" and cache_length(cache) == 20
    assert plan_reuse(cache, p, p + [4]).action == "extend"
    with pytest.raises(ValueError):
        plan_reuse(cache, p, [])
    # Ids as arrays, (n,) or a batch of one, like lists (before: MLX's
    # "[convert] Only length-1 arrays", numpy's "truth value ... ambiguous").
    for ids in (mx.array([p + [4]]), np.array([p + [4]]), mx.array(p + [4])):
        plan = plan_reuse(cache, mx.array([p]), ids)
        assert (plan.action, plan.reused, plan.prefill) == ("extend", 20, 1)
    with pytest.raises(ValueError, match="one prompt"):
        plan_reuse(cache, p, np.array([p, p]))


# --------------------------------------------------------------------------- mlx-vlm


def vlm_processor(vocab: int) -> Any:
    """A Hugging Face tokenizer dressed the way ``mlx_vlm.load`` dresses a processor."""
    tok = word_tokenizer(vocab)
    tok.detokenizer = NaiveStreamingDetokenizer(tok)
    tok.stopping_criteria = StoppingCriteria([], tok)
    return tok


def tiny_vlm_llama(kv_heads: int = 2) -> nn.Module:
    mx.random.seed(6)
    cfg = vlm_llama.ModelConfig(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=VOCAB,
        max_position_embeddings=4096,
    )
    return _finish(vlm_llama.Model(cfg), mx.bfloat16)


def tiny_vlm_lfm2() -> nn.Module:
    mx.random.seed(6)
    cfg = vlm_lfm2.ModelConfig(
        model_type="lfm2", vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=128, block_ff_dim=256,
        block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    )
    return _finish(vlm_lfm2.Model(cfg), mx.bfloat16)


def tiny_qwen2_vl(kv_heads: int = 2) -> nn.Module:
    """A 2-layer Qwen2-VL (head size 16, mRoPE) with a 1-layer vision tower.
    Its language model has no cache layout of its own (max_kv_size gives a
    RotatingKVCache) and keeps rope deltas and position ids between calls."""
    mx.random.seed(6)
    text = {"model_type": "qwen2_vl", "vocab_size": VOCAB, "hidden_size": 64,
            "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}}
    cfg = vlm_qwen2_vl.ModelConfig.from_dict({
        **text, "text_config": text,
        "vision_config": {"model_type": "qwen2_vl", "depth": 1, "embed_dim": 32,
                          "hidden_size": 64, "num_heads": 2}})
    for part, cls in (("text_config", vlm_qwen2_vl.TextConfig),
                      ("vision_config", vlm_qwen2_vl.VisionConfig)):
        if isinstance(getattr(cfg, part), dict):
            setattr(cfg, part, cls.from_dict(getattr(cfg, part)))
    return _finish(vlm_qwen2_vl.Model(cfg), mx.bfloat16)


VLM_MODELS: dict[str, Callable[[], nn.Module]] = {"llama": tiny_vlm_llama, "lfm2": tiny_vlm_lfm2}


@pytest.fixture(scope="module", params=sorted(VLM_MODELS))
def vlm(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    return request.param, VLM_MODELS[request.param]()


@pytest.mark.parametrize("library", ["mlx-lm", "mlx-vlm"])
def test_a_hybrid_cache_kept_in_memory_serves_the_next_request_on_another_thread(
    lm_tok: TokenizerWrapper, library: str
) -> None:
    """A server runs each request on a worker thread of its own. The libraries
    generate on a stream of the thread's own, and a hybrid model's ArraysCache
    state (which the last token does not need) was left lazy there: the next
    request, on another thread, failed with "There is no Stream(cpu, N) in
    current thread" unless a save had happened to evaluate it (memory only,
    or the daemon down, it never did)."""
    import threading

    if library == "mlx-lm":
        session: Any = kv_lm.Session(None, "tiny-lfm2", "threads", tiny_lfm2(seed=3), lm_tok,
                                     every_tokens=None, every_seconds=None)

        def ask(ids: list[int]) -> list[int]:
            return session.generate(ids, max_tokens=6)
    else:
        session = kv_vlm.Session(None, "tiny-vlm-lfm2", "threads", tiny_vlm_lfm2(),
                                 vlm_processor(VOCAB), every_tokens=None, every_seconds=None)

        def ask(ids: list[int]) -> list[int]:
            return vlm_tokens(session.stream_generate(input_ids=ids, max_tokens=6,
                                                      temperature=0.0))

    said: list[list[int]] = []
    errors: list[BaseException] = []

    def on_a_thread(ids: list[int]) -> None:
        def run() -> None:
            try:
                said.append(ask(ids))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        worker = threading.Thread(target=run)
        worker.start()
        worker.join(WAIT)
        assert not worker.is_alive() and not errors, errors

    first = prompt(30, seed=2)
    on_a_thread(first)
    on_a_thread(first + said[0] + [5, 6, 7])
    assert session.last_plan is not None and session.last_plan.source == "memory"
    assert len(said[1]) == 6


def _on_a_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a thread of its own (a server's worker), its error
    raised here; the wait capped."""
    import threading

    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(WAIT)
    assert not worker.is_alive(), "the worker hangs"
    if errors:
        raise errors[0]
    return out[0]


Request = Callable[[Any, list[int], int], Any]


def _session_kit(lm_tok: TokenizerWrapper, library: str, hybrid: bool, **kw: Any) -> tuple[
        Callable[[], Any], Request, Callable[[Any], list[int]]]:
    """For ``library``: a maker of memory-only Sessions of one tiny model
    (lfm2 when ``hybrid``, else llama), a greedy request (session, ids,
    max_tokens) giving its generator, and the tokens of its results."""
    if library == "mlx-lm":
        model = tiny_lfm2(seed=3) if hybrid else tiny_llama(seed=3)

        def session() -> Any:
            return kv_lm.Session(None, "tiny-lm", "kit", model, lm_tok, **kw)

        def request(s: Any, ids: list[int], n: int) -> Any:
            return s.stream_generate(ids, max_tokens=n)

        def tokens(results: Any) -> list[int]:
            return [int(r.token) for r in results]

        return session, request, tokens
    vlm_model = tiny_vlm_lfm2() if hybrid else tiny_vlm_llama()
    processor = vlm_processor(VOCAB)

    def vlm_session() -> Any:
        return kv_vlm.Session(None, "tiny-vlm", "kit", vlm_model, processor, **kw)

    def vlm_request(s: Any, ids: list[int], n: int) -> Any:
        return s.stream_generate(input_ids=ids, max_tokens=n, temperature=0.0)

    return vlm_session, vlm_request, vlm_tokens


@pytest.mark.parametrize("form", ["mlx-lm", "mlx-vlm ids", "mlx-vlm text"])
def test_a_generator_made_on_one_thread_runs_on_another(lm_tok: TokenizerWrapper,
                                                          form: str) -> None:
    """A server checks a request on its request thread (the call raises
    there, before headers go out) and generates on a worker. mlx-vlm's
    Session left the prompt's ids lazy on the calling thread: the worker
    failed with "There is no Stream(cpu, 0) in current thread"."""
    ids = prompt(30, seed=1)
    session, request, tokens = _session_kit(lm_tok, form.split()[0], hybrid=False)
    if form == "mlx-vlm text":
        words = " ".join(vlm_processor(VOCAB).convert_ids_to_tokens(ids))

        def request(s: Any, ids: list[int], n: int) -> Any:
            return s.stream_generate(words, max_tokens=n, temperature=0.0)

    here = tokens(request(session(), ids, 5))
    made_here = request(session(), ids, 5)
    assert _on_a_thread(lambda: tokens(made_here)) == here and len(here) == 5


# mlx-lm's own generate_step, closed on another thread, reports "[StreamContext]
# Destroyed in a different thread than it was constructed in" (as an
# exception ignored: plain mlx_lm.stream_generate does the same).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("next_on", ["the same worker", "another thread"])
@pytest.mark.parametrize("library", ["mlx-lm", "mlx-vlm"])
def test_a_hybrid_request_closed_from_another_thread(
    lm_tok: TokenizerWrapper, library: str, next_on: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request's generator closed on a thread other than the one running
    it (a server's event loop dropping the generator of a client gone): the
    hybrid model's last state is lazy on the worker's stream. It was kept,
    and a next request on another thread failed inside the model ("There is
    no Stream(cpu, N) in current thread"): that one now runs cold. One on
    the same worker still extends the cache in memory."""
    from concurrent.futures import ThreadPoolExecutor

    first = prompt(30, seed=2)
    session, request, tokens = _session_kit(lm_tok, library, hybrid=True,
                                            every_tokens=None, every_seconds=None)
    s = session()
    with ThreadPoolExecutor(1) as worker:
        gen = request(s, first, 20)
        said = worker.submit(lambda: [int(next(gen).token) for _ in range(5)]).result(WAIT)
        gen.close()  # here, not on the worker
        follow = first + said + [5, 6, 7]
        with caplog.at_level(logging.WARNING, logger="kvkeeper"):
            if next_on == "the same worker":
                got = worker.submit(lambda: tokens(request(s, follow, 5))).result(WAIT)
            else:
                got = _on_a_thread(lambda: tokens(request(s, follow, 5)))
    assert s.last_plan is not None and len(got) == 5
    if next_on == "the same worker":
        assert (s.last_plan.action, s.last_plan.source, s.last_plan.reused) == \
            ("extend", "memory", len(first) + 5), s.last_plan
        assert "event=state_not_kept" not in caplog.text
    else:
        assert s.last_plan.action == "cold" and "event=state_not_kept" in caplog.text
        assert got == tokens(request(session(), follow, 5))


def vlm_tokens(results: Any) -> list[int]:
    out: list[int] = []
    for r in results:
        if r.token is not None and r.generation_tokens > len(out):
            out.append(int(r.token))
    return out


def test_mlx_vlm_restarts_between_turns_give_the_same_tokens(
    vlm: tuple[str, nn.Module], daemon: RunningDaemon
) -> None:
    name, model = vlm
    proc = vlm_processor(VOCAB)
    # The uninterrupted run: mlx-vlm's own PromptCacheState flow, in memory.
    state = PromptCacheState()
    expected: list[list[int]] = []
    for turn in range(3):
        full = conversation(expected, turn)
        expected.append(vlm_tokens(vlm_stream_generate(
            model, proc, "", input_ids=mx.array([full]), max_tokens=GEN, temperature=0.0,
            prompt_cache_state=state)))
    assert {type(c) for c in state.cache} <= {vlm_cache.KVCache, vlm_cache.ArraysCache}

    out: list[list[int]] = []
    for turn in range(3):
        full = conversation(out, turn)
        with Client(daemon.socket, timeout=WAIT) as kv:  # a new process each turn
            session = kv_vlm.Session(kv, "tiny-vlm-" + name, "chat", model, proc, every_tokens=4)
            if turn == 2:  # the text path: mlx-vlm tokenizes the prompt itself
                text = proc.decode(full)
                gen = vlm_tokens(session.stream_generate(text, max_tokens=GEN, temperature=0.0))
            else:
                gen = vlm_tokens(session.stream_generate(input_ids=full, max_tokens=GEN,
                                                         temperature=0.0))
            plan = session.last_plan
            assert plan is not None
            assert session.tracked is True  # the saves behind followed mlx-vlm's cache
            assert session.token_ids == full + gen
            assert session.last_write_behind is not None
            assert session.last_write_behind.counters.sent >= 2
            assert kv.flush(timeout=WAIT) is True
            saved = kv.load("tiny-vlm-" + name, "chat")
            assert saved is not None and saved.token_ids == full + gen
            assert [type(c) for c in saved.cache] == [type(c) for c in session.cache]
        out.append(gen)
        assert gen == expected[turn], f"turn {turn}"
        if turn == 1:
            assert (plan.action, plan.source, plan.reused) == ("extend", "kvkeeper", 48 + GEN)
        if turn == 2:
            assert plan.action == ("trim" if name == "llama" else "cold")


def test_mlx_vlm_whole_prompt_cached(vlm: tuple[str, nn.Module], client: Client) -> None:
    """mlx-vlm alone re-prefills when the whole prompt is cached; the session
    trims one token when it can, and the answer is the same."""
    name, model = vlm
    proc = vlm_processor(VOCAB)
    p = prompt(40, seed=30)
    s = kv_vlm.Session(client, "tiny-vlm-" + name, "regen", model, proc)
    answer = vlm_tokens(s.stream_generate(input_ids=p, max_tokens=GEN, temperature=0.0))
    s2 = kv_vlm.Session(client, "tiny-vlm-" + name, "regen", model, proc)
    assert vlm_tokens(s2.stream_generate(input_ids=p, max_tokens=GEN, temperature=0.0)) == answer
    assert s2.last_plan is not None
    assert s2.last_plan.action == ("trim" if name == "llama" else "cold")
    assert s2.tracked is True
    # The one-call form, with the session's metadata (it went on to mlx-vlm).
    again = kv_vlm.stream_generate(client, "tiny-vlm-" + name, "regen", model, proc,
                                   input_ids=p, max_tokens=GEN, temperature=0.0,
                                   metadata={"turn": "3"})
    assert vlm_tokens(again) == answer
    assert client.flush(timeout=WAIT) is True
    got = client.load("tiny-vlm-" + name, "regen", verify=False)
    assert got is not None and got.metadata["turn"] == "3"


def test_mlx_vlm_request_without_tokens_keeps_state_consistent(client: Client) -> None:
    """With max_tokens=0 mlx-vlm prefills but leaves its PromptCacheState's ids
    behind the cache; the session records what the cache really holds."""
    model = tiny_vlm_lfm2()
    proc = vlm_processor(VOCAB)
    p = prompt(30, seed=40)
    s = kv_vlm.Session(client, "tiny-vlm-lfm2", "empty", model, proc)
    first = vlm_tokens(s.stream_generate(input_ids=p, max_tokens=5, temperature=0.0))
    longer = p + first + prompt(6, seed=41)
    assert vlm_tokens(s.stream_generate(input_ids=longer, max_tokens=0, temperature=0.0)) == []
    assert s.token_ids == longer and cache_length(s.cache) == len(longer)
    s2 = kv_vlm.Session(client, "tiny-vlm-lfm2", "empty", model, proc)  # restarted
    s2.restore()
    assert s2.token_ids == longer


def test_a_session_whose_daemon_does_not_answer_starts_cold(
    lm_tok: TokenizerWrapper, short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restore that cannot be sure of the newest save (the daemon is frozen
    while this session's own saves of the conversation are unwritten) does not
    stop generation: the session starts cold, and logs why."""
    model = tiny_llama(seed=3)
    proc = serve_process(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        with Client(short_dir / "run" / "kv.sock", timeout=1.0, min_send_interval=0) as kv:
            session = kv_lm.Session(kv, "tiny-lm-frozen", "chat", model, lm_tok, every_tokens=4)
            first = conversation([], 0)
            out = [session.generate(first, max_tokens=GEN)]
            assert kv.flush(timeout=WAIT) is True
            proc.send_signal(signal.SIGSTOP)
            try:
                out.append(session.generate(conversation(out, 1), max_tokens=GEN))
                session.forget()  # as a restart would; its last saves are unwritten
                gen = session.generate(conversation(out, 1), max_tokens=GEN)
            finally:
                proc.send_signal(signal.SIGCONT)
            assert len(gen) == GEN
            plan = session.last_plan
            assert plan is not None and (plan.action, plan.source) == ("cold", None)
            assert "event=restore_failed" in caplog.text and "not be written yet" in caplog.text
    finally:
        assert stop_process(proc) == 0


# --------------------------------------------------------------------------- misuse and mishaps


def tiny_paligemma() -> nn.Module:
    """A tiny image-text model: image tokens in the prompt, pixel values beside it."""
    from mlx_vlm.models import paligemma

    mx.random.seed(7)
    cfg = paligemma.ModelConfig.from_dict(dict(
        model_type="paligemma", vocab_size=VOCAB, image_token_index=VOCAB - 2, hidden_size=64,
        pad_token_id=0,
        text_config=dict(model_type="gemma", hidden_size=64, num_hidden_layers=2,
                         intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, vocab_size=VOCAB),
        vision_config=dict(model_type="siglip_vision_model", num_hidden_layers=1, hidden_size=64,
                           intermediate_size=128, num_attention_heads=2, patch_size=8,
                           image_size=32, projection_dim=64)))
    return _finish(paligemma.Model(cfg), mx.float32)


def test_mlx_vlm_another_image_with_the_same_tokens_is_not_answered_from_the_cache(
    client: Client,
) -> None:
    """Asked again about a picture of the same size, the prompt's token ids are
    the same: the cache of the first picture was reused (trimmed to all but the
    last token), and the answer was about the first picture. Also after a
    restart: the media fingerprint is saved with the cache."""
    model, proc = tiny_paligemma(), vlm_processor(VOCAB)
    ids = [VOCAB - 2] * 16 + prompt(20, seed=50)
    mask = mx.ones((1, len(ids)))
    mx.random.seed(8)
    images = [mx.random.normal((1, 3, 32, 32)), mx.random.normal((1, 3, 32, 32)) * 3]

    def ask(run: Any, img: mx.array) -> list[int]:
        return vlm_tokens(run(input_ids=ids, pixel_values=img, mask=mask, max_tokens=12,
                              temperature=0.0))

    fresh = [vlm_tokens(vlm_stream_generate(model, proc, "", input_ids=mx.array([ids]),
                                            pixel_values=img, mask=mask, max_tokens=12,
                                            temperature=0.0)) for img in images]
    assert fresh[0] != fresh[1]  # the picture matters
    memory = kv_vlm.Session(None, "tiny-pg", "same-ids", model, proc)
    assert ask(memory.stream_generate, images[0]) == fresh[0]
    assert ask(memory.stream_generate, images[1]) == fresh[1]
    assert memory.last_plan is not None and memory.last_plan.action == "cold"
    assert ask(memory.stream_generate, images[1]) == fresh[1]  # same picture: reused
    assert memory.last_plan.action == "trim" and memory.last_plan.source == "memory"
    saved = kv_vlm.Session(client, "tiny-pg", "same-ids", model, proc)
    assert ask(saved.stream_generate, images[0]) == fresh[0]
    assert client.flush(timeout=WAIT)
    # Each restarted session saves its own answer: image 0's, then image 1's.
    for img, want, action in ((images[0], fresh[0], "trim"), (images[1], fresh[1], "cold")):
        restarted = kv_vlm.Session(client, "tiny-pg", "same-ids", model, proc)
        assert ask(restarted.stream_generate, img) == want
        assert restarted.last_plan is not None and restarted.last_plan.action == action
        assert client.flush(timeout=WAIT)


class PerTokenProcessor:
    """Returns what PaliGemma's processor does: the pixels, and beside them a
    tensor with one entry per prompt token (``token_type_ids``; Gemma 4's
    ``mm_token_type_ids`` is the same kind). "<image>" stands for 16 image
    tokens."""

    def __init__(self, vocab: int) -> None:
        tok = vlm_processor(vocab)
        self.tokenizer = tok
        self.image_processor = object()
        self.detokenizer = tok.detokenizer
        self.image_token = vocab - 2

    def __call__(self, text: Any, images: Any = None, padding: bool = True,
                 return_tensors: str = "mlx", **kw: Any) -> dict[str, mx.array]:
        text = text[0] if isinstance(text, list) else text
        ids: list[int] = []
        for w in text.split():
            ids += ([self.image_token] * 16 if w == "<image>"
                    else self.tokenizer.encode(w, add_special_tokens=False))
        px = np.stack([np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 255
                       for im in images])
        return {"input_ids": mx.array([ids]), "attention_mask": mx.ones((1, len(ids))),
                "pixel_values": mx.array(px),
                "token_type_ids": mx.array([[int(t == self.image_token) for t in ids]])}


def test_mlx_vlm_per_token_tensors_are_not_taken_for_media() -> None:
    """A processor's per-token tensor (PaliGemma's token_type_ids) was hashed
    with the pixels, so every turn about the same image, its prompt longer,
    started cold, where mlx-vlm alone reuses the prefix."""
    from PIL import Image

    model, proc = tiny_paligemma(), PerTokenProcessor(VOCAB)
    img = Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8))
    words = proc.tokenizer.decode(list(range(5, 25))).split()
    turn1 = "<image> " + " ".join(words[:10])

    def turn2(answer: list[int]) -> str:
        return turn1 + " " + proc.tokenizer.decode(answer) + " " + " ".join(words[10:])

    state = PromptCacheState()
    alone1 = vlm_tokens(vlm_stream_generate(model, proc, turn1, image=[img], max_tokens=4,
                                            temperature=0.0, prompt_cache_state=state))
    results = list(vlm_stream_generate(model, proc, turn2(alone1), image=[img], max_tokens=4,
                                       temperature=0.0, prompt_cache_state=state))
    assert results[0].cached_tokens > 0  # mlx-vlm alone reuses
    session = kv_vlm.Session(None, "tiny-pg", "per-token", model, proc)
    first = vlm_tokens(session.stream_generate(turn1, image=[img], max_tokens=4,
                                               temperature=0.0))
    assert first == alone1
    second = vlm_tokens(session.stream_generate(turn2(first), image=[img], max_tokens=4,
                                                temperature=0.0))
    assert session.last_plan is not None and session.last_plan.action != "cold", \
        session.last_plan
    assert session.last_plan.reused == results[0].cached_tokens
    assert second == vlm_tokens(results)


def test_per_token_masks_of_other_processors_are_not_taken_for_media() -> None:
    """DeepSeek-VL2's processor (and DeepSeek-OCR's) returns images_seq_mask,
    mllama's cross_attention_mask, one row per prompt token: hashed, a
    longer prompt about the same picture gave another fingerprint, and the
    turn started cold. Shapes as those processors make them."""
    rng = np.random.default_rng(1)
    pixels = mx.array(rng.random((1, 3, 32, 32), dtype=np.float32))
    other = mx.array(rng.random((1, 3, 32, 32), dtype=np.float32))

    def turn(px: mx.array, n: int) -> str:
        seq = mx.array(np.arange(n)[None] < 16)  # the first 16 tokens are the image's
        cross = mx.ones((1, n, 1, 4), dtype=mx.int32)  # tokens x images x tiles
        return kv_vlm.media_fingerprint({"input_ids": mx.zeros((1, n), dtype=mx.int32),
                                         "pixel_values": px, "images_seq_mask": seq,
                                         "cross_attention_mask": cross})

    assert turn(pixels, 20) == turn(pixels, 31)
    assert turn(pixels, 20) != turn(other, 20)


def test_media_sources_are_fingerprinted_by_what_they_hold(tmp_path: Path) -> None:
    """Without prepared arrays the fingerprint came from the sources' repr: a
    file rewritten under the same name kept its fingerprint (the new picture
    answered from the old one's cache), and so did a PIL image or BytesIO
    freed and another made at the same address. Now contents are hashed."""
    import io

    from PIL import Image

    def fp(**sources: Any) -> str:
        return kv_vlm.media_fingerprint({}, **sources)

    red, blue = Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (32, 32), (0, 0, 255))
    assert fp(image=red) != fp(image=blue)
    assert fp(image=red) == fp(image=red.copy())  # the same picture: its cache is reused
    upload = tmp_path / "upload.png"
    red.save(upload)
    first = fp(image=str(upload))
    assert fp(image=str(upload)) == first
    blue.save(upload)  # another picture under the same name
    assert fp(image=str(upload)) != first
    assert fp(image=[str(upload), red]) != fp(image=[str(upload), blue])
    assert fp(audio=io.BytesIO(b"one")) == fp(audio=io.BytesIO(b"one"))
    assert fp(audio=io.BytesIO(b"one")) != fp(audio=io.BytesIO(b"two"))
    assert fp(image="https://example.com/a.png") == fp(image="https://example.com/a.png")
    assert fp(image="https://example.com/a.png") != fp(image="https://example.com/b.png")

    class Unknown:
        def __repr__(self) -> str:
            return "always the same"

    assert fp(image=Unknown()) != fp(image=Unknown())  # never taken for another
    assert fp(image=str(tmp_path / "missing.png")) != fp(image=str(tmp_path / "missing.png"))
    assert fp(image="bad\0name.png") != fp(image="bad\0name.png")  # no ValueError
    assert fp() == ""


def test_a_cache_kvkeeper_cannot_save_does_not_stop_generation(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """mlx-vlm's HybridQuantKVCache (keys and values quantized by different
    schemes) lives in mlx_vlm.turboquant, from which kvkeeper takes only the
    class it builds itself: the first save behind the loop raised CodecError
    after the prefill, and the request died. Now the request's saves stop,
    with a warning, and it generates what a session without kvkeeper does."""
    model, proc = tiny_vlm_llama(), vlm_processor(VOCAB)
    kw = dict(max_tokens=GEN, temperature=0.0, kv_bits=4, kv_key_scheme="turboquant",
              kv_value_scheme="uniform", quantized_kv_start=0)
    want = vlm_tokens(kv_vlm.Session(None, "tiny-vlm-tq", "a", model, proc).stream_generate(
        input_ids=prompt(48), **kw))
    session = kv_vlm.Session(client, "tiny-vlm-tq", "a", model, proc, every_tokens=4)
    assert vlm_tokens(session.stream_generate(input_ids=prompt(48), **kw)) == want
    assert "event=write_behind_off" in caplog.text and "HybridQuantKVCache" in caplog.text
    assert session.cache is not None  # kept in memory all the same
    assert client.flush(timeout=WAIT) and client.load("tiny-vlm-tq", "a") is None


@pytest.mark.parametrize("kw", [{"kv_bits": 3.5}, {"kv_bits": 4, "kv_quant_scheme": "turboquant"},
                                {"kv_bits": 3.5, "kv_key_bits": 2.5, "quantized_kv_start": 30}],
                         ids=["3.5-bits", "scheme", "split-codec-late"])
def test_mlx_vlm_turboquant_restarts_between_turns_give_the_same_tokens(
        kw: dict[str, Any], daemon: RunningDaemon) -> None:
    """mlx-vlm's TurboQuant caches (kv_bits=3.5: 3-bit keys, 4-bit values;
    kv_quant_scheme="turboquant"; 2.5-bit keys, whose codec picks its
    channels from the data, made from a KVCache after 30 tokens) were
    refused by save(): a session using them saved nothing. Across restarts
    they now give the tokens of an uninterrupted run, extended and trimmed
    from the saved quantized state, and the file holds that state (read
    with the safetensors package)."""
    from safetensors import safe_open

    model, proc = tiny_vlm_llama(), vlm_processor(VOCAB)
    kw = dict({"quantized_kv_start": 0}, **kw, temperature=0.0, max_tokens=GEN)
    memory = kv_vlm.Session(None, "tiny-vlm-tq", "mem", model, proc)
    expected: list[list[int]] = []
    for turn in range(3):
        expected.append(vlm_tokens(memory.stream_generate(
            input_ids=conversation(expected, turn), **kw)))
    assert "TurboQuantKVCache" in {type(c).__name__ for c in memory.cache}
    out: list[list[int]] = []
    for turn in range(3):
        full = conversation(out, turn)
        with Client(daemon.socket, timeout=WAIT) as kv:  # a new process each turn
            session = kv_vlm.Session(kv, "tiny-vlm-tq", "chat", model, proc, every_tokens=4)
            gen = vlm_tokens(session.stream_generate(input_ids=full, **kw))
            plan = session.last_plan
            assert plan is not None and session.tracked is True
            assert kv.flush(timeout=WAIT) is True
            saved = kv.load("tiny-vlm-tq", "chat")
            assert saved is not None and saved.token_ids == full + gen and saved.path
            layer = session.cache[0]
            assert type(layer).__name__ == type(saved.cache[0]).__name__ == "TurboQuantKVCache"
            with safe_open(str(saved.path), "numpy") as f:
                layers = json.loads(f.metadata()["kvkeeper.layers"])["layers"]
                state = dict(layers[0]["state"]["items"])
                meta = state["meta_state"]["items"]
                assert int(meta[0]) == layer.offset == len(full + gen)
                # The values' packed rows (an MSE codec's: norms, indices).
                _, indices = state["values"]["items"]
                want = layer.state[1].indices
                assert np.array_equal(f.get_tensor(indices["name"]), np.array(want))
        out.append(gen)
        assert gen == expected[turn], f"turn {turn}"
        if turn:
            assert (plan.action, plan.source) == (("extend", "trim")[turn - 1], "kvkeeper")


def test_an_older_request_ending_late_leaves_the_newer_state(
    lm_tok: TokenizerWrapper, client: Client
) -> None:
    """A generator left open (its caller went away), then a newer request on
    the session, then the old generator closed: its state replaced the newer
    one in memory and in kvkeeper."""
    session = kv_lm.Session(client, "tiny-lm-stale", "chat", tiny_llama(seed=3), lm_tok,
                            every_tokens=4)
    p = prompt(30, seed=2)
    first = session.generate(p, max_tokens=8)
    old = session.stream_generate(p + first + prompt(5, seed=3), max_tokens=40)
    for _ in range(3):
        next(old)
    newer = p + first + prompt(6, seed=4)
    newer += session.generate(newer, max_tokens=8)
    assert client.flush(timeout=WAIT)
    for _ in range(8):  # the old request goes on after the newer one ended
        next(old)
    old.close()
    assert session.token_ids == newer
    assert client.flush(timeout=WAIT)
    got = client.load("tiny-lm-stale", "chat")
    assert got is not None and got.token_ids == newer


def test_an_empty_prompt_refused_while_a_request_streams_leaves_that_request_newest(
    lm_tok: TokenizerWrapper, client: Client
) -> None:
    """An empty prompt was refused only after it had become the session's
    newest request (and loaded the cache from kvkeeper): the request
    streaming then stopped saving, and its end was dropped."""
    session = kv_lm.Session(client, "tiny-lm-empty", "chat", tiny_llama(seed=3), lm_tok,
                            every_tokens=4)
    p = prompt(30, seed=1)
    streaming = session.stream_generate(p, max_tokens=12)
    out = [int(next(streaming).token) for _ in range(2)]
    for empty in ([], ""):
        with pytest.raises(ValueError, match="the prompt is empty"):
            session.generate(empty, max_tokens=4)
    out += [int(r.token) for r in streaming]
    # Its end is the session's, in memory and in kvkeeper.
    saved = client.flush(timeout=WAIT) and client.load("tiny-lm-empty", "chat")
    assert saved and saved.token_ids == session.token_ids == p + out and len(out) == 12


def test_the_one_call_forms_check_their_arguments_at_the_call(
    lm_tok: TokenizerWrapper, client: Client
) -> None:
    """They were generators: a bad argument raised only at the first token,
    after a server may have sent its headers."""
    model = tiny_llama(seed=3)
    with pytest.raises(ValueError):
        kv_lm.stream_generate(client, "tiny-lm", "one", model, lm_tok, prompt(5),
                              every_tokens=0)
    with pytest.raises(ValueError, match="metadata"):
        kv_vlm.stream_generate(client, "tiny-vlm", "one", tiny_vlm_llama(), vlm_processor(VOCAB),
                               "hi", metadata={"kvkeeper.x": "y"})
    # The prompt too (an adopter's review: these raised at the first next()),
    # and so does a Session's own stream_generate.
    vlm_model, processor = tiny_vlm_llama(), vlm_processor(VOCAB)
    session = kv_lm.Session(client, "tiny-lm", "one", model, lm_tok)
    for call in (lambda p, **kw: kv_lm.stream_generate(client, "tiny-lm", "one", model,
                                                      lm_tok, p, **kw),
                 session.stream_generate):
        for bad, error in (([], "the prompt is empty"), ("", "the prompt is empty"),
                           ([5, VOCAB + 5], "not in the model's vocabulary"),
                           ([1.5], "token ids")):
            with pytest.raises(ValueError, match=error):
                call(bad)
        with pytest.raises(TypeError, match="prompt_cache"):
            call(prompt(5), prompt_cache=[])
    for bad, error in (("", ValueError), ([1, 2], TypeError)):
        with pytest.raises(error):
            kv_vlm.stream_generate(client, "tiny-vlm", "one", vlm_model, processor, bad)
    with pytest.raises(ValueError, match="the prompt is empty"):
        kv_vlm.stream_generate(client, "tiny-vlm", "one", vlm_model, processor,
                               input_ids=mx.array([[]], dtype=mx.int32))
    # Good arguments: a generator, as before.
    got = kv_lm.stream_generate(client, "tiny-lm", "one", model, lm_tok, prompt(5), 3)
    assert len([r.token for r in got]) == 3


def test_a_client_closed_while_a_request_streams_does_not_stop_it(
    lm_tok: TokenizerWrapper, short_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from .conftest import start_daemon

    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        kv = Client(rd.socket, timeout=WAIT)
        session = kv_lm.Session(kv, "tiny-lm-closed", "chat", tiny_llama(seed=3), lm_tok,
                                every_tokens=4)
        n = 0
        for _ in session.stream_generate(prompt(30, seed=2), max_tokens=40):
            n += 1
            if n == 10:
                kv.close()  # a server shutting its client down mid-request
        assert n == 40 and session.cache is not None
        assert session.last_write_behind is not None
        assert session.last_write_behind.counters.dropped > 0
        assert "event=write_behind_client_closed" in caplog.text
    finally:
        rd.stop()


def test_a_session_whose_client_is_closed_runs_cold(
        lm_tok: TokenizerWrapper, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    """A server that shut its client down: the session's requests run cold
    and stream, as a load that failed does."""
    model = tiny_llama(seed=3)
    session = kv_lm.Session(client, "tiny-lm-closed", "chat", model, lm_tok)
    client.close()
    ids = prompt(20, seed=2)
    with caplog.at_level(logging.WARNING, logger="kvkeeper"):
        got = session.generate(ids, max_tokens=4)
    assert got == kv_lm.Session(None, "m", "c", model, lm_tok).generate(ids, max_tokens=4)
    plan = session.last_plan
    assert plan is not None and plan.action == "cold"
    assert plan.reason == "the client is closed: nothing was restored"
    assert "error=client_closed" in caplog.text


def test_a_request_refused_before_its_first_token_keeps_the_cache(
    lm_tok: TokenizerWrapper,
) -> None:
    """An argument mlx-lm refuses (``temp=`` of older versions, ``max_tokens=0``)
    fails before the model reads anything: the session had already dropped
    its cache, and the next request re-read the whole conversation."""
    session = kv_lm.Session(None, "tiny-lm", "chat", tiny_llama(seed=3), lm_tok)
    p = prompt(200, seed=1)
    p += session.generate(p, max_tokens=8)
    # (mlx-lm 0.31 and earlier read the prompt for max_tokens=0, then fail.)
    for bad in ({"temp": 0.7}, *([] if MLX_LM_OLD_API else [{"max_tokens": 0}])):
        with pytest.raises((TypeError, ValueError)):
            session.generate(p + [5], **bad)
        assert session.cache is not None
    session.generate(p + [5], max_tokens=2)
    plan = session.last_plan
    assert plan is not None and plan.action != "cold" and plan.prefill == 1
    # A hybrid cache's ArraysCache layers tell no length: a failure part way
    # through a forward pass could have changed them, so nothing is kept.
    hybrid = kv_lm.Session(None, "tiny-lfm2", "chat", tiny_lfm2(seed=3), lm_tok)
    p = prompt(40, seed=1)
    p += hybrid.generate(p, max_tokens=4)
    with pytest.raises(TypeError):
        hybrid.generate(p + [5], temp=0.7)
    assert hybrid.cache is None


def test_session_and_write_behind_arguments_are_checked_up_front(
    lm_tok: TokenizerWrapper, client: Client
) -> None:
    """They used to be checked at the first save, after the prefill, with the
    request half done; so was metadata that the media fingerprint a request
    adds takes past the limit."""
    from kvkeeper.client.client import MAX_METADATA_BYTES
    from kvkeeper.integrations import MEDIA_KEY

    model = tiny_llama(seed=3)
    for bad in ({"every_tokens": 0}, {"every_tokens": 2.5}, {"every_seconds": float("nan")},
                {"every_seconds": -1}, {"metadata": {"kvkeeper.user": "bob"}}):
        with pytest.raises(ValueError):
            kv_lm.Session(client, "tiny-lm", "chat", model, lm_tok, **bad)
        with pytest.raises(ValueError):
            client.write_behind("tiny-lm", "chat", **bad)
    # "no" was taken as true (every_tokens and every_seconds refuse bools).
    for flag in ("no", 0, None):
        with pytest.raises(TypeError, match="save_first must be True or False"):
            client.write_behind("tiny-lm", "chat", save_first=flag)  # type: ignore[arg-type]
    for model_id, session_id in (("tiny-lm", ""), ("", "chat"), ("tiny-lm", "\ud800")):
        with pytest.raises(ValueError):
            kv_lm.Session(client, model_id, session_id, model, lm_tok)
        with pytest.raises(ValueError):
            client.write_behind(model_id, session_id)
    for meta in ({"a": "x" * (MAX_METADATA_BYTES - 9)}, {MEDIA_KEY: ""}):
        with pytest.raises(ValueError, match="metadata"):
            kv_vlm.Session(client, "tiny-pg", "meta", tiny_paligemma(), vlm_processor(VOCAB),
                           metadata=meta)
    # An mlx-lm session keeps room for the fingerprint of input_embeddings
    # (a request with them would fail at its first save otherwise); one kept
    # in memory only needs no ids kvkeeper could file.
    with pytest.raises(ValueError, match="metadata"):
        kv_lm.Session(client, "tiny-lm", "chat", model, lm_tok,
                      metadata={"a": "x" * (MAX_METADATA_BYTES - 9)})
    kv_lm.Session(client, "tiny-lm", "chat", model, lm_tok,
                  metadata={"a": "x" * (MAX_METADATA_BYTES - 100)})
    kv_lm.Session(None, "", "", model, lm_tok)


def test_a_session_whose_client_is_closed_still_generates(lm_tok: TokenizerWrapper,
                                                          client: Client) -> None:
    session = kv_lm.Session(client, "tiny-lm", "closed", tiny_llama(seed=3), lm_tok)
    client.close()
    assert len(session.generate(prompt(20), max_tokens=4)) == 4
    plan = session.last_plan
    assert plan is not None and plan.action == "cold"


def test_write_behind_close_without_token_ids_can_be_called_again(client: Client) -> None:
    """close(cache) without token ids raised, but had already closed the
    helper: the call with them saved nothing."""
    c = KVCache()
    x = mx.ones((1, 1, 20, 8))
    c.update_and_fetch(x, x)
    ids = prompt(20, seed=1)
    wb = client.write_behind("tiny-lm", "wb", every_tokens=100, save_first=False)
    wb.step([c], ids)
    with pytest.raises(ValueError, match="needs token_ids"):
        wb.close([c])
    assert wb.close([c], ids) is True
    assert client.flush(timeout=WAIT)
    got = client.load("tiny-lm", "wb")
    assert got is not None and got.token_ids == ids


def test_a_prompt_that_is_not_one_row_of_integers_is_refused(
    lm_tok: TokenizerWrapper,
) -> None:
    """Float ids were cut to integers, and a batch of two prompts was read as
    one long prompt."""
    lm_session = kv_lm.Session(None, "tiny-lm", "chat", tiny_llama(seed=3), lm_tok)
    vlm_session = kv_vlm.Session(None, "tiny-vlm", "chat", tiny_vlm_llama(), vlm_processor(VOCAB))
    for bad in ([1, 2.5, 3], mx.array([1.0, 2.0]), mx.array([[1, 2], [3, 4]]),
                [True, False, True], np.array([[1, 2], [3, 4]]), np.array([1.0, 2.0])):
        with pytest.raises(ValueError, match="prompt"):
            lm_session.generate(bad, max_tokens=2)
    # numpy's (1, n) is one prompt, as MLX's is (it was refused).
    assert lm_session.generate(np.array([[5, 6, 7]]), max_tokens=2) != []
    for bad in (mx.array([[1, 2], [3, 4]]), mx.array([0.5, 2.0]), [[1, 2], [3, 4]]):
        with pytest.raises(ValueError, match="prompt"):
            vlm_tokens(vlm_session.stream_generate(input_ids=bad, max_tokens=2))
    assert lm_session.generate(mx.array([[5, 6, 7]]), max_tokens=2) != []
    assert vlm_tokens(vlm_session.stream_generate(input_ids=[5, 6, 7], max_tokens=2)) != []
    # Bytes were taken for token ids ([104, 105]); mlx-vlm's prompt given ids
    # failed deep in its tokenizer; a None tokenizer at its first decode.
    for raw in (b"hi", memoryview(b"hi")):
        with pytest.raises(ValueError, match="not bytes"):
            lm_session.generate(raw, max_tokens=2)
    with pytest.raises(TypeError, match="give token ids as input_ids="):
        vlm_tokens(vlm_session.stream_generate([5, 6, 7], max_tokens=2))
    with pytest.raises(TypeError, match="tokenizer is None"):
        kv_lm.Session(None, "tiny-lm", "chat", tiny_llama(seed=3), None)
    # A None model failed at the first request (AttributeError deep inside);
    # an id past the vocabulary killed the process (SIGSEGV, in MLX), one of
    # 2**64 - 1 raised std::bad_cast, a negative one was generated from.
    with pytest.raises(TypeError, match="model is None"):
        kv_lm.Session(None, "tiny-lm", "chat", None, lm_tok)
    # The mlx-vlm Session (and its one-call form) took a None model, or an
    # mlx-lm one, and failed at the first token with an AttributeError.
    processor = vlm_session.processor
    from mlx_lm.models import pixtral  # mlx-lm's: a language_model, no config

    lm_wrapper = pixtral.Model(pixtral.ModelArgs(model_type="pixtral", text_config=dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB)))
    for model, said in ((None, "model is None"), (tiny_llama(seed=3), "no mlx-vlm model"),
                        (lm_wrapper, "it has no config")):
        with pytest.raises(TypeError, match=said):
            kv_vlm.Session(None, "tiny-vlm", "chat", model, processor)
        with pytest.raises(TypeError, match=said):
            kv_vlm.stream_generate(None, "tiny-vlm", "chat", model, processor,
                                   input_ids=[5, 6, 7], max_tokens=2)
    # A None processor: AttributeError inside mlx-vlm at the first request
    # (at its first token with input_ids=), as the tokenizer's was (a review).
    with pytest.raises(TypeError, match="processor is None"):
        kv_vlm.Session(None, "tiny-vlm", "chat", tiny_vlm_llama(), None)
    # The mlx-lm Session took an mlx-vlm model, or mlx_lm.load's (model,
    # tokenizer) as the model, and failed at the first token (TypeError,
    # AttributeError, deep inside mlx-lm; a review). mlx-lm's wrapper is its own.
    for model, said in ((tiny_vlm_llama(), "is an mlx-vlm model: use "
                                           "kvkeeper.integrations.mlx_vlm.Session"),
                        ((tiny_llama(seed=3), lm_tok), "model is a tuple")):
        with pytest.raises(TypeError, match=said):
            kv_lm.Session(None, "tiny-lm", "chat", model, lm_tok)
    assert kv_lm.Session(None, "tiny-lm", "chat", lm_wrapper, lm_tok).model is lm_wrapper
    # plan_reuse given the prompt's text compared its characters with the ids:
    # a cold plan, "nothing in common" (a review).
    for prompt_ids, cached in (("hello", [1, 2]), ([1, 2], "hello"), (b"hi", [1])):
        with pytest.raises(ValueError, match="not text"):
            plan_reuse(None, cached, prompt_ids)
    # Floats were compared as ids (an extend plan on 1.0, 2.0), bools and a
    # nested list gave a cold plan, and None or a set raised TypeError (a review).
    cache = [KVCache()]
    cache[0].update_and_fetch(mx.ones((1, 2, 2, 8)), mx.ones((1, 2, 2, 8)))
    for bad, said in (([1.0, 2.0, 3.0], "integers, not float"),
                      ([True, False, True], "integers, not bool"),
                      ([[1, 2, 3]], "integers, not list"), (None, "not NoneType"),
                      ({1, 2, 3}, "not set")):
        with pytest.raises(ValueError, match=f"the prompt's ids must be .*{said}"):
            plan_reuse(cache, [1, 2], bad)
        if bad is not None:  # (no cached ids: no cache, a cold plan)
            with pytest.raises(ValueError, match=f"the cached ids must be .*{said}"):
                plan_reuse(cache, bad, [1, 2, 3])
    assert cache[0].offset == 2  # untouched
    assert plan_reuse(cache, (1, 2), [np.int64(1), np.int64(2), 3]).action == "extend"
    for bad_id in (VOCAB, 2**64 - 1, -1):
        for given in ([5, bad_id, 7], np.array([5, bad_id, 7], dtype=np.uint64 if bad_id > 0
                                               else np.int64)):
            with pytest.raises(ValueError, match=f"token id {bad_id} .at 1. is not in the "
                                                 f"model's vocabulary .0 to {VOCAB - 1}."):
                lm_session.generate(given, max_tokens=2)
    assert lm_session.generate([5, VOCAB - 1, 7], max_tokens=2) != []
    # A wrapper model (pixtral: its args hold only a text_config) was not
    # checked: id VOCAB was read past the table, a larger one SIGSEGV.
    from mlx_lm.models import pixtral

    wrapper = pixtral.Model(pixtral.ModelArgs(model_type="pixtral", text_config=dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB)))
    mx.eval(wrapper.parameters())
    # Nor one that keeps its arguments as .config (youtu-llm, plamo2, ...).
    from mlx_lm.models import youtu_llm

    configured = youtu_llm.Model(youtu_llm.ModelArgs(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16))
    mx.eval(configured.parameters())
    for name, other in (("tiny-pixtral", wrapper), ("tiny-youtu", configured)):
        wrapped = kv_lm.Session(None, name, "chat", other, lm_tok)
        with pytest.raises(ValueError, match=f"token id {VOCAB} .at 1. is not in the model's"):
            wrapped.generate([5, VOCAB, 7], max_tokens=2)
        assert wrapped.generate([5, VOCAB - 1, 7], max_tokens=2) != []


def test_mlx_vlm_state_is_kept_when_the_caller_stops_at_the_last_result(
    client: Client,
) -> None:
    """mlx-vlm declines a prefix whose suffix holds image tokens and prefills
    into a cache of its own, which it records only after yielding its last
    result: a caller that stopped there (the usual `break` on finish_reason)
    left the session with nothing in memory and nothing saved."""
    model, proc = tiny_paligemma(), vlm_processor(VOCAB)
    mx.random.seed(9)
    image = mx.random.normal((1, 3, 32, 32))
    text0, text1 = prompt(10, seed=60), prompt(12, seed=61)
    session = kv_vlm.Session(client, "tiny-pg", "last", model, proc)

    def ask(ids: list[int]) -> list[int]:
        out: list[int] = []
        for r in session.stream_generate(input_ids=ids, pixel_values=image,
                                         mask=mx.ones((1, len(ids))), max_tokens=6,
                                         temperature=0.0):
            if r.token is not None and r.generation_tokens > len(out):
                out.append(int(r.token))
            if r.finish_reason is not None:
                break
        return out

    first = [*text0, *[VOCAB - 2] * 16, *text1]
    first_out = ask(first)
    # Same picture, the opening text changed after its 5th token: the session
    # keeps 5 tokens, and the suffix holds the image tokens.
    second = [*text0[:5], *prompt(5, seed=62), *[VOCAB - 2] * 16, *text1]
    out = ask(second)
    assert session.tracked is False  # mlx-vlm declined the prefix
    # last_plan says what mlx-vlm did, not the 5-token reuse prepared for it.
    plan = session.last_plan
    assert plan is not None and (plan.action, plan.reused, plan.prefill) == \
        ("cold", 0, len(second)), plan
    assert plan.trimmed == len(first) + len(first_out) and "declined" in plan.reason, plan
    assert session.token_ids == second + out and session.cache is not None
    assert client.flush(timeout=WAIT)
    got = client.load("tiny-pg", "last")
    assert got is not None and got.token_ids == second + out


def test_mlx_vlm_plan_says_so_when_mlx_vlm_reuses_a_cache_of_its_own() -> None:
    """An apc_manager= passed on to mlx-vlm replaces the cache the session
    prepared with a longer prefix of mlx-vlm's own: last_plan said cold, 0
    reused, 46 to prefill, "declined the prepared prefix of 0 tokens and
    reused 40" (a review)."""
    from mlx_vlm.apc import APCManager

    model, proc = tiny_vlm_llama(), vlm_processor(VOCAB)
    apc = APCManager(num_blocks=64, block_size=8)
    ids = prompt(40, seed=70)
    first = kv_vlm.Session(None, "tiny-vlm", "a", model, proc)
    for _ in first.stream_generate(input_ids=ids, max_tokens=2, apc_manager=apc):
        pass
    second = kv_vlm.Session(None, "tiny-vlm", "b", model, proc)
    results = list(second.stream_generate(input_ids=[*ids, *prompt(6, seed=71)], max_tokens=2,
                                          apc_manager=apc))
    reused = results[0].cached_tokens
    assert reused > 0, "mlx-vlm's prefix cache reused nothing: the case is not made"
    plan = second.last_plan
    assert plan is not None and (plan.action, plan.source, plan.reused, plan.prefill) == \
        ("extend", "mlx-vlm", reused, 46 - reused), plan
    assert "a cache of its own" in plan.reason and second.tracked is False, plan


def test_a_saved_cache_whose_layers_the_model_does_not_keep_starts_cold(
        lm_tok: TokenizerWrapper, daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """One model id given to two models with as many layers (a helper's
    resume review): a Session took the other model's cache, a KVCache where
    lfm2 keeps an ArraysCache, and every request of the conversation raised
    inside the model (TypeError from create_attention_mask), in new processes
    too. Now the session starts cold and its first save replaces the entry.
    What kv_bits and max_kv_size make of the model's own layers is still
    restored (the test below); CacheLists are compared child by child."""
    ids = prompt(30, seed=3)
    with Client(daemon.socket, timeout=WAIT) as kv:
        kv_lm.Session(kv, "model-x", "chat", tiny_llama(), lm_tok).generate(ids, max_tokens=8)
        assert kv.flush(timeout=WAIT) is True
    lfm = tiny_lfm2()
    want = kv_lm.Session(None, "model-x", "mem", lfm, lm_tok).generate(ids, max_tokens=8)
    with Client(daemon.socket, timeout=WAIT) as kv:
        session = kv_lm.Session(kv, "model-x", "chat", lfm, lm_tok)
        assert session.generate(ids, max_tokens=8) == want
        assert session.last_plan is not None and session.last_plan.action == "cold"
        assert session.last_plan.reason == "the saved cache's layers do not fit this model"
        assert kv.flush(timeout=WAIT) is True
        got = kv.load("model-x", "chat")
        assert got is not None
        assert [type(c) for c in got.cache] == [ArraysCache, KVCache, ArraysCache, KVCache]
    assert "event=restore_incompatible" in caplog.text
    from mlx_lm.models.cache import CacheList, QuantizedKVCache

    own = [CacheList(ArraysCache(2), KVCache())]
    assert layers_fit([CacheList(ArraysCache(2), QuantizedKVCache())], own)
    assert not layers_fit([CacheList(KVCache(), KVCache())], own)

    # mlx-vlm's model-specific caches subclass KVCache. qwen4_exp's QSAKVCache
    # quantizes into its own QSAQuantizedKVCache (refused by name at first);
    # a plain QuantizedKVCache in its place raised in its attention
    # (update_indexer), and a subclass in place of a plain KVCache (a
    # sliding window in a full-attention model) was taken (a review's finds).
    class ModelQuantized(vlm_cache.QuantizedKVCache):
        pass

    class ModelKV(vlm_cache.KVCache):
        preserve_auxiliary_kv_state = True

        def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
            return ModelQuantized(group_size=group_size, bits=bits)

    class Ring(vlm_cache.KVCache):
        pass

    assert layers_fit([ModelQuantized()], [ModelKV()])
    assert not layers_fit([vlm_cache.QuantizedKVCache()], [ModelKV()])
    assert not layers_fit([vlm_cache.KVCache()], [ModelKV()])
    assert layers_fit([vlm_cache.QuantizedKVCache()], [Ring()])  # its inherited to_quantized
    assert not layers_fit([Ring()], [vlm_cache.KVCache()])
    assert not layers_fit([vlm_cache.KVCache()], [vlm_cache.RotatingKVCache(max_size=8)])
    # A window (max_kv_size) only where the model makes one of it.
    rotating = [KVCache(), RotatingKVCache(max_size=8)]
    assert not layers_fit([RotatingKVCache(max_size=8)] * 2, [KVCache(), KVCache()])
    assert layers_fit([RotatingKVCache(max_size=8)] * 2, [KVCache(), KVCache()],
                      [RotatingKVCache(max_size=8)] * 2)
    assert not layers_fit([RotatingKVCache(max_size=8)] * 2, rotating, rotating)


@pytest.mark.parametrize("kind", ["kv_bits", "max_kv_size"])
def test_mlx_lm_quantized_and_windowed_caches_continue_as_mlx_lm_reuse_does(
        kind: str, lm_tok: TokenizerWrapper, daemon: RunningDaemon) -> None:
    """A quantized cache (kv_bits) and a window that has filled (max_kv_size;
    mlx-lm's RotatingKVCache keeps 4 tokens) are extended as mlx-lm's own
    prompt-cache reuse extends them: restarts between turns give the tokens
    of an uninterrupted run, though not those of a cold run of the whole
    conversation (which quantizes after its prefill, and windows the prompt
    without the kept tokens), as the README says."""
    if kind == "kv_bits":
        model, kw = tiny_llama(seed=3), {"kv_bits": 8, "quantized_kv_start": 0}
    else:
        model, kw = tiny_qwen2(seed=3), {"max_kv_size": 16}
    turns = [prompt(30, seed=1), prompt(4, seed=10), prompt(5, seed=11)]
    # mlx-lm alone: one cache, each turn feeds what it lacks.
    cache = make_prompt_cache(model, max_kv_size=kw.get("max_kv_size"))
    held: list[int] = []
    expected, cold = [], []
    for new in turns:
        full = held + new
        gen = [r.token for r in lm_stream_generate(model, lm_tok, mx.array(full[len(held):]),
                                                   max_tokens=8, prompt_cache=cache, **kw)]
        cold.append([r.token for r in lm_stream_generate(model, lm_tok, mx.array(full),
                                                         max_tokens=8, **kw)])
        expected.append(gen)
        held = full + gen
    assert expected != cold  # what the README warns of: the case shows it
    held = []
    for turn, new in enumerate(turns):
        with Client(daemon.socket, timeout=WAIT) as kv:  # a new process each turn
            session = kv_lm.Session(kv, "tiny-" + kind, "chat", model, lm_tok)
            gen = session.generate(held + new, max_tokens=8, **kw)
            assert session.last_plan is not None
            assert session.last_plan.action == ("cold" if turn == 0 else "extend")
            assert kv.flush(timeout=WAIT) is True
        assert gen == expected[turn], f"turn {turn}"
        held = held + new + gen


def _kv_heads_kit(lib: str, lm_tok: TokenizerWrapper) -> tuple[
        Callable[[Client | None, nn.Module], Any], Callable[..., list[int]],
        Callable[[int], nn.Module]]:
    """For the tests of one model id given to models of other KV head counts:
    a session of ``lib`` ("chat" with a client, else "mem"), a request of 8
    tokens on it, and a tiny model with a given number of KV heads."""
    if lib == "mlx_lm":
        def session(kv: Client | None, model: nn.Module) -> Any:
            return kv_lm.Session(kv, "model-y", "chat" if kv else "mem", model, lm_tok)

        def ask(s: Any, ids: list[int], **kw: Any) -> list[int]:
            return s.generate(ids, **{"max_tokens": 8, **kw})

        return session, ask, lambda heads: tiny_llama(seed=4, kv_heads=heads)
    processor = vlm_processor(VOCAB)

    def vlm_session(kv: Client | None, model: nn.Module) -> Any:
        return kv_vlm.Session(kv, "model-y", "chat" if kv else "mem", model, processor)

    def vlm_ask(s: Any, ids: list[int], **kw: Any) -> list[int]:
        return vlm_tokens(s.stream_generate(input_ids=mx.array([ids]), max_tokens=8, **kw))

    return vlm_session, vlm_ask, lambda heads: tiny_vlm_llama(kv_heads=heads)


@pytest.mark.parametrize("lib", ["mlx_lm", "mlx_vlm"])
def test_a_saved_cache_of_another_head_count_starts_cold_once(
        lib: str, lm_tok: TokenizerWrapper, daemon: RunningDaemon,
        caplog: pytest.LogCaptureFixture
) -> None:
    """One model id given to two models whose layers are of the same classes
    but other shapes (2 and 4 KV heads; an adopter's review): the session
    took the other model's cache, and every request of the conversation
    raised inside the model (a failed broadcast), in new processes too. Now
    the request starts cold, says why, and its saves replace the entry. A
    request's own error is still the request's: the saved cache is kept."""
    session, ask, model_with = _kv_heads_kit(lib, lm_tok)
    small, large = model_with(2), model_with(4)
    ids = prompt(30, seed=3)
    with Client(daemon.socket, timeout=WAIT) as kv:
        said = ask(session(kv, small), ids)
        assert kv.flush(timeout=WAIT) is True
    more = ids + said + prompt(4, seed=5)  # extends the saved conversation
    want = ask(session(None, large), more)
    with Client(daemon.socket, timeout=WAIT) as kv:
        s = session(kv, large)
        with caplog.at_level(logging.WARNING, logger="kvkeeper"):
            assert ask(s, more) == want
        plan = s.last_plan
        assert plan is not None and plan.action == "cold" and plan.source == "kvkeeper"
        assert plan.reason.startswith("the saved cache failed in the model (ValueError")
        assert plan.prefill == len(more)
        assert "event=restore_unusable model=model-y id=chat" in caplog.text
        assert kv.flush(timeout=WAIT) is True
        caplog.clear()

        # The entry is the large model's now: a new session extends it.
        s = session(kv, large)
        ask(s, more + want + [7])
        assert s.last_plan is not None and s.last_plan.source == "kvkeeper"
        assert s.last_plan.action == "extend"

        # A request that fails of itself, on a cache that fits: raised as
        # before, its processor called once (a review: twice, the error
        # swallowed and the cache blamed), nothing said of the cache, and
        # the plan is the restored cache's.
        calls: list[int] = []

        def refuse(tokens: mx.array, logits: mx.array) -> mx.array:
            calls.append(1)
            raise ValueError("the request's own error")

        s = session(kv, large)
        with pytest.raises(ValueError, match="the request's own error"):
            ask(s, more + want + [7, 8], logits_processors=[refuse])
        assert calls == [1] and "restore_unusable" not in caplog.text
        assert s.last_plan is not None and s.last_plan.source == "kvkeeper"
        assert s.last_plan.action != "cold"
        # So are the sampler's and the progress callback's (a second review:
        # called twice, the error swallowed). mlx-vlm never calls the latter.
        sampled: list[int] = []

        class Sampler:
            def __call__(self, logprobs: mx.array) -> mx.array:
                sampled.append(1)
                raise ValueError("the sampler's own error")

            # What mlx-vlm calls instead, where a sampler has it (a third
            # review: not watched, as the sampler's attributes passed through).
            def sample_target(self, *args: Any, **kw: Any) -> mx.array:
                sampled.append(1)
                raise ValueError("the sampler's own error")

        s = session(kv, large)
        with pytest.raises(ValueError, match="the sampler's own error"):
            ask(s, more + want + [7, 8], sampler=Sampler())
        assert sampled == [1] and "restore_unusable" not in caplog.text
        if lib == "mlx_lm":
            progress: list[tuple[int, int]] = []

            def report(done: int, total: int) -> None:
                progress.append((done, total))
                raise RuntimeError("the callback's own error")

            s = session(kv, large)
            with pytest.raises(RuntimeError, match="the callback's own error"):
                ask(s, more + want + [7, 8], prompt_progress_callback=report)
            assert len(progress) == 1 and "restore_unusable" not in caplog.text
        # Refused before the model ran (mlx-lm: max_tokens=0), cold too: the
        # plan is still the restored cache's; the cache is not kept in
        # memory (it may be the one that failed), the next request restores it.
        if lib == "mlx_lm" and not MLX_LM_OLD_API:
            s = session(kv, large)
            with pytest.raises(ValueError):
                ask(s, more + want + [7, 8], max_tokens=0)
            assert s.last_plan is not None and s.last_plan.action != "cold"
            assert s.cache is None and "restore_unusable" not in caplog.text
            ask(s, more + want + [7, 8])
            assert s.last_plan.source == "kvkeeper" and s.last_plan.action != "cold"
        s = session(kv, large)
        ask(s, more + want + [7, 8])
        assert s.last_plan is not None and s.last_plan.source == "kvkeeper"
        assert s.last_plan.action != "cold"

    # A misfit whose cold rerun fails of itself: the misfit cache is not put
    # back in memory (a review: kept as "memory", every later request of the
    # session then raised inside the model); the next request runs cold.
    with Client(daemon.socket, timeout=WAIT) as kv:
        ask(session(kv, small), ids)
        assert kv.flush(timeout=WAIT) is True
        s = session(kv, large)
        with pytest.raises(ValueError, match="the request's own error"):
            ask(s, more, logits_processors=[refuse])
        assert s.cache is None
        assert ask(s, more) == want
        assert s.last_plan is not None and s.last_plan.action == "cold"
        if lib == "mlx_lm":
            # Stopped before the model ran (its progress callback raised at
            # once): the misfit cache, untouched, was kept as the session's
            # own, and every later request raised inside the model.
            ask(session(kv, small), ids)
            assert kv.flush(timeout=WAIT) is True

            def stop(done: int, total: int) -> None:
                raise KeyboardInterrupt

            s = session(kv, large)
            with pytest.raises(KeyboardInterrupt):
                ask(s, more, prompt_progress_callback=stop)
            assert ask(s, more) == want
            assert s.last_plan is not None and s.last_plan.action == "cold"


def _runs_cold_as_unusable(daemon: RunningDaemon, caplog: pytest.LogCaptureFixture,
                           session: Callable[[Client | None, nn.Module], Any],
                           ask: Callable[..., list[int]], model: nn.Module,
                           more: list[int]) -> None:
    """A request of ``model`` for ``more`` on the entry saved by another
    model: it runs cold (``restore_unusable``), with a cold run's tokens,
    and its save replaces the entry."""
    want = ask(session(None, model), more)
    with Client(daemon.socket, timeout=WAIT) as kv:
        s = session(kv, model)
        with caplog.at_level(logging.WARNING, logger="kvkeeper"):
            got = ask(s, more)
        plan = s.last_plan
        assert plan is not None and plan.action == "cold" and plan.source == "kvkeeper", plan
        assert plan.reason.startswith("the saved cache failed in the model (ValueError"), plan
        assert got == want
        assert kv.flush(timeout=WAIT) is True


@pytest.mark.parametrize("lib", ["mlx_lm", "mlx_vlm"])
def test_a_trimmed_cache_of_more_kv_heads_starts_cold(
        lib: str, lm_tok: TokenizerWrapper, daemon: RunningDaemon,
        caplog: pytest.LogCaptureFixture
) -> None:
    """A saved cache of a model with 2 KV heads, restored under the same
    model id for one with 1, and trimmed (the prompt leaves the saved
    conversation part way; a docs review): the one head's keys broadcast
    into the rows the trim left spare, and the session streamed other tokens
    than a cold run, with no error until the buffer grew. Now the request
    runs cold, as one that extends the cache does."""
    session, ask, model_with = _kv_heads_kit(lib, lm_tok)
    ids = prompt(30, seed=3)
    with Client(daemon.socket, timeout=WAIT) as kv:
        ask(session(kv, model_with(2)), ids)
        assert kv.flush(timeout=WAIT) is True
    more = ids[:20] + prompt(5, seed=9)
    assert more[20] != ids[20]
    one = model_with(1)
    _runs_cold_as_unusable(daemon, caplog, session, ask, one, more)
    assert "event=restore_unusable model=model-y id=chat" in caplog.text
    with Client(daemon.socket, timeout=WAIT) as kv:
        # The entry is the one-head model's now: a trim of it is used.
        s = session(kv, one)
        ask(s, more[:22] + [7, 8, 9])
        assert s.last_plan is not None and s.last_plan.source == "kvkeeper"
        assert s.last_plan.action == "trim"


def test_a_trimmed_window_of_more_kv_heads_fed_one_token_starts_cold(
        lm_tok: TokenizerWrapper, daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """As above with max_kv_size (RotatingKVCache layers, not yet full), and
    a prompt that leaves the saved conversation one token before its end (a
    regenerate): the trim's spare rows took the one head's keys of the
    single new token, and the session streamed other tokens than a cold run,
    with no error, and saved that cache (a review)."""
    def session(kv: Client | None, model: nn.Module) -> kv_lm.Session:
        return kv_lm.Session(kv, "model-w", "chat" if kv else "mem", model, lm_tok)

    def ask(s: kv_lm.Session, ids: list[int]) -> list[int]:
        return s.generate(ids, max_tokens=8, max_kv_size=64)

    ids = prompt(30, seed=3)
    with Client(daemon.socket, timeout=WAIT) as kv:
        first = session(kv, tiny_qwen2(seed=4, kv_heads=2))
        ask(first, ids)
        assert first.cache is not None
        assert {type(layer).__name__ for layer in first.cache} == {"RotatingKVCache"}
        assert kv.flush(timeout=WAIT) is True
    more = ids[:20] + [ids[20] + 1]
    _runs_cold_as_unusable(daemon, caplog, session, ask, tiny_qwen2(seed=4, kv_heads=1), more)
    # The same model restored, trimmed and fed one token: used, as in memory.
    two = tiny_qwen2(seed=4, kv_heads=2)
    with Client(daemon.socket, timeout=WAIT) as kv:
        ask(session(kv, two), ids)
        assert kv.flush(timeout=WAIT) is True
        s = session(kv, two)
        got = ask(s, more)
        assert s.last_plan is not None and s.last_plan.action == "trim"
    assert got == ask(session(None, two), more)


@pytest.mark.parametrize("lib", ["mlx_lm", "mlx_vlm"])
def test_a_full_window_of_more_kv_heads_fed_one_token_starts_cold(
        lib: str, lm_tok: TokenizerWrapper, daemon: RunningDaemon) -> None:
    """A max_kv_size window that has wrapped (keys of 16 rows, 38 tokens
    seen), restored for a model with 1 KV head under the model id of one
    with 2, and extended by one token: a full window's one-token update
    writes in place, where the one head's keys broadcast into the slot
    of two. The session streamed other tokens than a cold run with no
    error, saved that cache, and its next request raised (a review; in
    mlx-vlm's session until 0.2.11). Now the restore is refused before the
    model runs; the same model's window is still extended."""
    session, kit_ask, _ = _kv_heads_kit(lib, lm_tok)
    # Models that make a RotatingKVCache of max_kv_size (mlx-lm's llama and
    # mlx-vlm's keep a cache layout of their own); Qwen2-VL keeps rope deltas
    # and position ids between calls, which the probe must leave as they were.
    model_with = (lambda heads: tiny_qwen2(seed=4, kv_heads=heads)) if lib == "mlx_lm" \
        else tiny_qwen2_vl

    def ask(s: Any, ids: list[int]) -> list[int]:
        return kit_ask(s, ids, max_kv_size=16)

    ids = prompt(30, seed=3)
    two = model_with(2)
    with Client(daemon.socket, timeout=WAIT) as kv:
        first = session(kv, two)
        said = ask(first, ids)
        assert first.cache is not None
        assert {(layer.offset > 16, layer.keys.shape[2]) for layer in first.cache} \
            == {(True, 16)}
        assert kv.flush(timeout=WAIT) is True
    more = ids + said + [7]
    one = model_with(1)
    want = ask(session(None, one), more)
    with Client(daemon.socket, timeout=WAIT) as kv:
        s = session(kv, one)
        got = ask(s, more)
        assert s.last_plan is not None and s.last_plan.action == "cold", s.last_plan
        assert s.last_plan.reason == "the saved cache's layers do not fit this model"
        assert got == want
        assert s.cache is not None and {layer.keys.shape[1] for layer in s.cache} == {1}
        # And its next request, on the cache in memory, goes on.
        ask(s, more + got + prompt(5, seed=8))
        assert kv.flush(timeout=WAIT) is True
        assert {layer.keys.shape[1] for layer in kv.load("model-y", "chat").cache} == {1}
    # The model that saved it: its window is extended by the one token, as in memory.
    with Client(daemon.socket, timeout=WAIT) as kv:
        s = session(kv, two)
        ask(s, ids)
        assert kv.flush(timeout=WAIT) is True
        s = session(kv, two)
        got = ask(s, more)
        assert s.last_plan is not None and s.last_plan.action == "extend", s.last_plan
    mem = session(None, two)
    ask(mem, ids)
    assert got == ask(mem, more)


@pytest.mark.parametrize("library", ["mlx_lm", "mlx_vlm"])
def test_a_restored_window_trimmed_refuses_keys_of_other_heads(
        client: Client, library: str) -> None:
    """Both libraries' RotatingKVCache, restored and trimmed by plan_reuse
    (a caller's own loop): one token of keys with 1 head for a cache of 2
    was written into the rows the trim left, no error."""
    cls = RotatingKVCache if library == "mlx_lm" else vlm_cache.RotatingKVCache
    layer = cls(max_size=64, keep=4)
    x = mx.ones((1, 2, 30, 64), dtype=mx.bfloat16)
    layer.update_and_fetch(x, x)
    assert client.save("fp", f"window-{library}", [layer], list(range(30)))
    got = client.load("fp", f"window-{library}")
    assert got is not None and type(got.cache[0]) is cls
    plan = plan_reuse(got.cache, got.token_ids, list(range(20)) + [99])
    assert plan.action == "trim" and plan.prefill == 1
    one = mx.ones((1, 1, 1, 64), dtype=mx.bfloat16)
    with pytest.raises(ValueError):
        keys, _ = got.cache[0].update_and_fetch(one, one)
        mx.eval(keys)


@pytest.mark.parametrize("library", ["mlx-lm", "mlx-vlm"])
@pytest.mark.parametrize("finish", ["length", "stop"])
def test_a_request_read_to_its_last_response_and_left_open_is_kept_and_saved(
        lm_tok: TokenizerWrapper, client: Client, library: str, finish: str) -> None:
    """A server that reads responses with next() until finish_reason and
    keeps the generator (closing it later, or never) had the session keep
    nothing and save nothing past the last write-behind save: the request
    ended only at close(), and the next request restored the older save."""
    model_id = f"tiny-open-{library}-{finish}"
    if library == "mlx-lm":
        model = tiny_llama(seed=3)

        def session(stop: list[int] | None = None) -> Any:
            tok = lm_tok if stop is None else TokenizerWrapper(word_tokenizer(VOCAB),
                                                               eos_token_ids=stop)
            return kv_lm.Session(client, model_id, "chat", model, tok, every_tokens=4)

        def request(s: Any, ids: list[int]) -> Any:
            return s.stream_generate(ids, max_tokens=GEN)
    else:
        vlm_model = tiny_vlm_llama()

        def session(stop: list[int] | None = None) -> Any:
            proc = vlm_processor(VOCAB)
            if stop is not None:
                proc.stopping_criteria = StoppingCriteria(stop, proc)
            return kv_vlm.Session(client, model_id, "chat", vlm_model, proc, every_tokens=4)

        def request(s: Any, ids: list[int]) -> Any:
            return s.stream_generate(input_ids=ids, max_tokens=GEN, temperature=0.0)

    p = prompt(30, seed=70)
    free = vlm_tokens(request(session(), p))
    assert len(free) == GEN
    stop = None
    if finish == "stop":
        k = next(i for i in range(5, GEN) if free[i] not in free[:i])
        stop = [free[k]]
        free = free[:k + 1]
    s = session(stop)
    gen = request(s, p)
    got: list[int] = []
    while True:
        r = next(gen)
        if r.token is not None and r.generation_tokens > len(got):
            got.append(int(r.token))
        if r.finish_reason is not None:
            break
    assert r.finish_reason == finish and got == free
    # The generator is still open, and referenced: the request is over all the same.
    assert s.token_ids == p + free and s.cache is not None
    assert cache_length(s.cache) == len(p + free)
    assert client.flush(timeout=WAIT) is True
    saved = client.load(model_id, "chat")
    assert saved is not None and saved.token_ids == p + free
    with pytest.raises(StopIteration):
        next(gen)
    gen.close()
    assert s.token_ids == p + free


@pytest.mark.parametrize("library", ["mlx-lm", "mlx-vlm"])
@pytest.mark.parametrize("failure", ["the library past its last result", "the final save"])
@pytest.mark.parametrize("caller", ["reads on", "closes at the last result",
                                    "drops the generator"])
def test_a_failure_after_the_last_result_still_hands_it_over(
        lm_tok: TokenizerWrapper, client: Client, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, library: str, failure: str, caller: str) -> None:
    """The request now ends before its last result is handed over: an error
    there (the library's, past that result; or the final save's) must still
    come after the last result, at the caller's next call (logged when it
    stops there instead), and one of the library's leaves nothing kept, as
    before. (The first version kept and saved that state, and lost the last
    result to an error of the final save; the second raised it from close(),
    which printed "Exception ignored" for a generator the collector closed.)"""
    model_id = f"tiny-late-{library}-{failure[4:11]}-{caller[:5]}"
    boom = RuntimeError("simulated failure")
    if failure == "the final save":
        real_save = client.save

        def save(model: str, cache_id: str, cache: Any, ids: Any, **kw: Any) -> bool:
            if len(ids) == 30 + GEN:  # the final one
                raise boom
            return real_save(model, cache_id, cache, ids, **kw)

        monkeypatch.setattr(client, "save", save)
    if library == "mlx-lm":
        s: Any = kv_lm.Session(client, model_id, "chat", tiny_llama(seed=3), lm_tok,
                               every_tokens=None, every_seconds=None)
        where, name = kv_lm, "_mlx_stream_generate"
        gen = s.stream_generate(prompt(30, seed=70), max_tokens=GEN)
    else:
        s = kv_vlm.Session(client, model_id, "chat", tiny_vlm_llama(), vlm_processor(VOCAB),
                           every_tokens=None, every_seconds=None)
        where, name = kv_vlm, "_vlm_stream_generate"
        gen = s.stream_generate(input_ids=prompt(30, seed=70), max_tokens=GEN, temperature=0.0)
    if failure != "the final save":
        real = getattr(where, name)

        def failing(*a: Any, **kw: Any) -> Any:
            yield from real(*a, **kw)
            raise boom

        monkeypatch.setattr(where, name, failing)
    seen = []
    while True:
        r = next(gen)
        seen.append(r.finish_reason)
        if r.finish_reason is not None:
            break
    assert seen[-1] == "length" and len(seen) >= GEN
    if caller == "reads on":
        with pytest.raises(RuntimeError) as raised:
            next(gen)
        assert raised.value is boom
    else:
        unraisable: list[Any] = []
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        with caplog.at_level(logging.WARNING, logger="kvkeeper"):
            if caller == "drops the generator":
                del gen
                gc.collect()
            else:
                gen.close()
        assert unraisable == []
        state = "kept" if failure == "the final save" else "dropped"
        assert "event=error_after_last_result" in caplog.text and f" state={state} " \
            f"error_type=RuntimeError error=\"simulated failure\"" in caplog.text, caplog.text
    if failure == "the final save":
        assert len(s.token_ids) == 30 + GEN  # kept: only the save failed
    else:
        assert s.token_ids is None and s.cache is None  # the request did not end cleanly
    assert client.flush(timeout=WAIT)
    got = client.load(model_id, "chat")  # the first step's save at most, not the final one
    assert got is None or len(got.token_ids) < 30 + GEN


@pytest.mark.parametrize("library", ["mlx-lm", "mlx-vlm"])
@pytest.mark.parametrize("caller", ["reads on", "closes at the last result"])
def test_a_request_failed_past_its_last_result_lets_go_of_its_cache(
        lm_tok: TokenizerWrapper, monkeypatch: pytest.MonkeyPatch, library: str,
        caller: str) -> None:
    """The error past the last result, kept by the request's frames while
    its traceback led back to them, made a cycle that held the request's
    cache (a whole KV cache) until a full collection."""
    made: list[Any] = []

    def watched(factory: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def make(*a: Any, **kw: Any) -> list[Any]:
            cache = factory(*a, **kw)
            made.extend(weakref.ref(layer) for layer in cache)
            return cache
        return make

    if library == "mlx-lm":
        s: Any = kv_lm.Session(None, "tiny", "chat", tiny_llama(seed=3), lm_tok)
        monkeypatch.setattr(kv_lm, "make_prompt_cache", watched(kv_lm.make_prompt_cache))
        where, name = kv_lm, "_mlx_stream_generate"
    else:
        s = kv_vlm.Session(None, "tiny", "chat", tiny_vlm_llama(), vlm_processor(VOCAB))
        monkeypatch.setattr(s, "_fresh_cache", watched(s._fresh_cache))
        where, name = kv_vlm, "_vlm_stream_generate"
    real = getattr(where, name)

    def failing(*a: Any, **kw: Any) -> Any:
        yield from real(*a, **kw)
        raise RuntimeError("simulated failure")  # a new one: the test holds none

    monkeypatch.setattr(where, name, failing)
    gc.collect()
    gc.disable()  # what a cycle holds stays held
    try:
        gen = (s.stream_generate(prompt(30, seed=70), max_tokens=4) if library == "mlx-lm"
               else s.stream_generate(input_ids=prompt(30, seed=70), max_tokens=4,
                                      temperature=0.0))
        for r in gen:
            if r.finish_reason is not None:
                break
        if caller == "reads on":
            with pytest.raises(RuntimeError, match="simulated failure"):
                next(gen)
        else:
            gen.close()
        del gen, r
        assert made and s.cache is None
        assert [ref for ref in made if ref() is not None] == []
    finally:
        gc.enable()


def test_probes_of_a_shared_model_leave_other_threads_its_weights() -> None:
    """A mlx-vlm session probes its model's language model (see
    ``windows_fit``) with the model's state kept and put back. Put back by
    clearing each module and filling it again, a generation on another
    thread met modules without their weights (AttributeError, KeyError),
    and two probes at once, each keeping what the other had left, ended
    with a model of no parameters at all (a review). Two threads keep and
    put back in a loop beside one that runs the model."""
    from mlx.utils import tree_flatten

    from kvkeeper.integrations.mlx_vlm import _state_kept

    model = tiny_qwen2_vl()
    lm = model.language_model
    params = len(tree_flatten(model.parameters()))
    def logits() -> mx.array:
        out = lm(mx.array([[1, 2, 3]]), cache=vlm_cache.make_prompt_cache(lm)).logits
        mx.eval(out)
        return out

    want = logits()
    stop, errors = threading.Event(), []

    def run() -> None:
        while not stop.is_set():
            try:
                logits()
            except Exception as exc:  # noqa: BLE001 - counted, and the test fails on it
                errors.append(repr(exc))

    def probe() -> None:
        while not stop.is_set():
            with _state_kept(model):
                pass

    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # many thread switches inside each put back
    threads = [threading.Thread(target=f) for f in (run, probe, probe)]
    try:
        for t in threads:
            t.start()
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT)
        sys.setswitchinterval(switch)
    assert not any(t.is_alive() for t in threads)
    assert errors == [], errors[:3]
    assert len(tree_flatten(model.parameters())) == params
    assert mx.array_equal(logits(), want).item()
