"""The mlx-lm and mlx-vlm integrations: conversations that restart between
turns give exactly the tokens of an uninterrupted run that keeps its cache in
memory. Real tiny models (a llama, and an lfm2 hybrid whose ArraysCache layers
cannot be trimmed), random weights, greedy sampling, a real daemon."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import stream_generate as lm_stream_generate
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_vlm.generate import PromptCacheState
from mlx_vlm.generate import stream_generate as vlm_stream_generate
from mlx_vlm.models import cache as vlm_cache
from mlx_vlm.models import lfm2 as vlm_lfm2
from mlx_vlm.models import llama as vlm_llama
from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
from mlx_vlm.utils import StoppingCriteria

from kvkeeper.client.client import Client
from kvkeeper.demo import word_tokenizer
from kvkeeper.integrations import common_prefix, plan_reuse
from kvkeeper.integrations import mlx_lm as kv_lm
from kvkeeper.integrations import mlx_vlm as kv_vlm
from kvkeeper.writebehind import cache_length

from .conftest import WAIT, RunningDaemon, serve_process, stop_process
from .tiny import VOCAB, _finish, prompt, tiny_lfm2, tiny_llama

GEN = 16  # tokens per turn


@pytest.fixture(scope="module")
def lm_tok() -> TokenizerWrapper:
    return TokenizerWrapper(word_tokenizer(VOCAB))


LM_MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: tiny_llama(seed=3),
    "lfm2": lambda: tiny_lfm2(seed=3),
}


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
                for r in kv_lm.stream_generate(kv, "tiny-lm-" + name, sid, model, lm_tok, full,
                                               max_tokens=GEN, every_tokens=4):
                    gen.append(r.token)
                session = None
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
    else:  # the ArraysCache layers of lfm2 cannot go back: a full re-prefill
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


# --------------------------------------------------------------------------- mlx-vlm


def vlm_processor(vocab: int) -> Any:
    """A Hugging Face tokenizer dressed the way ``mlx_vlm.load`` dresses a processor."""
    tok = word_tokenizer(vocab)
    tok.detokenizer = NaiveStreamingDetokenizer(tok)
    tok.stopping_criteria = StoppingCriteria([], tok)
    return tok


def tiny_vlm_llama() -> nn.Module:
    mx.random.seed(6)
    cfg = vlm_llama.ModelConfig(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
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


VLM_MODELS: dict[str, Callable[[], nn.Module]] = {"llama": tiny_vlm_llama, "lfm2": tiny_vlm_lfm2}


@pytest.fixture(scope="module", params=sorted(VLM_MODELS))
def vlm(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    return request.param, VLM_MODELS[request.param]()


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
