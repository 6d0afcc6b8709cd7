"""Write-behind inside a real mlx-lm streaming loop, against a real daemon."""

from __future__ import annotations

import logging
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvkeeper.client.client import Client
from kvkeeper.demo import word_tokenizer
from kvkeeper.integrations import plan_reuse
from kvkeeper.integrations.mlx_lm import Session
from kvkeeper.writebehind import WriteBehind, cache_length

from .conftest import WAIT, RunningDaemon
from .tiny import prefill, prompt, tiny_llama

FP = "tiny-llama-wb"


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return tiny_llama(seed=2)


@pytest.fixture(scope="module")
def tok() -> TokenizerWrapper:
    return TokenizerWrapper(word_tokenizer())


def next_logits(model, cache: list, token: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = model(mx.array([[token]]), cache=cache)[0, -1]
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def daemon_counts(kv: Client) -> dict[str, float]:
    s = kv.stats()
    return {k: s[k] for k in ("saves_received", "saves_written", "saves_superseded",
                              "saves_refused", "saves_failed")}


def test_snapshots_while_streaming_restore_exactly(model, tok, client: Client,
                                                   daemon: RunningDaemon) -> None:
    """Saves every 8 tokens while mlx-lm streams; the process 'crashes' without a
    final save; the newest snapshot restores a cache that computes exactly what
    the live cache computed at that point, and the conversation goes on from it."""
    p = prompt(30, seed=5)
    before = daemon_counts(client)
    cache = make_prompt_cache(model)
    ids = list(p)
    wb = client.write_behind(FP, "crash", every_tokens=8, every_seconds=None)
    saved_at = []
    for r in stream_generate(model, tok, mx.array(p), max_tokens=40, prompt_cache=cache):
        ids.append(r.token)
        if wb.step(cache, ids):
            saved_at.append(len(ids) - len(p))
    assert saved_at == [1, 9, 17, 25, 33]  # the first step right after the prefill, then every 8
    assert wb.counters.sent == 5 and wb.counters.dropped == 0 and wb.counters.steps == 40
    # Crash: no close(), the cache is gone. What the daemon received is durable.
    generated = ids[len(p):]
    del cache
    assert client.flush(timeout=WAIT) is True
    after = daemon_counts(client)
    received = after["saves_received"] - before["saves_received"]
    # A save of a cache sent within the client's send interval waits in the
    # client, and a newer one replaces it; the flush sent the newest.
    assert received + client.client_stats()["client_saves_coalesced"] == 5 and received >= 2
    assert (after["saves_written"] - before["saves_written"]
            + after["saves_superseded"] - before["saves_superseded"]) == received
    assert after["saves_failed"] == before["saves_failed"]

    with Client(daemon.socket, timeout=WAIT) as kv:  # the restarted process
        got = kv.load(FP, "crash")
        assert got is not None
        assert got.token_ids == p + generated[:33]
        assert cache_length(got.cache) == len(p) + 33

        # What the live cache held after 33 tokens, rebuilt in memory.
        ref = make_prompt_cache(model)
        ref_tokens = [r.token for r in stream_generate(model, tok, mx.array(p), max_tokens=33,
                                                       prompt_cache=ref)]
        assert ref_tokens == generated[:33]
        np.testing.assert_array_equal(next_logits(model, got.cache, generated[33]),
                                      next_logits(model, ref, generated[33]))

        # Continue the conversation: the session restores the snapshot (the
        # tokens after it are re-read), the in-memory reference just extends.
        user = prompt(6, seed=6)
        full = p + generated + user
        session = Session(kv, FP, "crash", model, tok, every_tokens=8)
        out = session.generate(full, max_tokens=12)
        plan = session.last_plan
        assert plan is not None and (plan.action, plan.source) == ("extend", "kvkeeper")
        assert plan.reused == len(p) + 33 and plan.prefill == len(full) - plan.reused

        ref2 = make_prompt_cache(model)
        prefill_then = [r.token for r in stream_generate(model, tok, mx.array(p + generated[:33]),
                                                         max_tokens=1, prompt_cache=ref2)]
        assert prefill_then == [generated[33]]  # ref2 now holds p + generated[:34]
        expected = [r.token for r in stream_generate(model, tok, mx.array(full[len(p) + 34:]),
                                                     max_tokens=12, prompt_cache=ref2)]
        assert out == expected


def test_a_cache_without_its_token_ids_is_planned_cold_saying_so(model) -> None:
    """A file imported from mlx-lm's format loads with token_ids None: the
    README's loop's plan said "no cache for this session", as if none had
    been found (a review)."""
    p = prompt(10, seed=3)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([p]), cache=cache))
    plan = plan_reuse(cache, None, p + [1])
    assert (plan.action, plan.reused, plan.prefill) == ("cold", 0, 11)
    assert plan.reason == "the cache does not say which tokens it holds", plan
    assert plan_reuse(None, None, p).reason == "no cache for this session"


@pytest.mark.parametrize("parts", [False, True], ids=["extends", "parts_way"])
def test_the_readme_resume_loop_feeds_only_what_the_cache_lacks(
        model, tok, client: Client, daemon: RunningDaemon, parts: bool) -> None:
    """The README's raw loop after a restart: plan_reuse on the loaded cache,
    the prompt's tokens past plan.reused fed. The tokens are a cold run's,
    whether the new prompt extends the saved conversation or leaves it part
    way (trimmed), and the final save holds the whole new conversation."""
    p = prompt(30, seed=7)
    cache, token_ids = make_prompt_cache(model), list(p)
    wb = client.write_behind(FP, "resume")
    for r in stream_generate(model, tok, mx.array(p), max_tokens=12, prompt_cache=cache):
        token_ids.append(r.token)
        wb.step(cache, token_ids)
    wb.close()
    assert client.flush(timeout=WAIT) is True
    said = token_ids
    prompt_ids = (said[:25] if parts else said) + prompt(8, seed=8)
    cold = [r.token for r in stream_generate(model, tok, mx.array(prompt_ids), max_tokens=10,
                                             prompt_cache=make_prompt_cache(model))]

    with Client(daemon.socket, timeout=WAIT) as kv:  # the restarted process
        got = kv.load(FP, "resume")
        plan = plan_reuse(got.cache if got else None, got.token_ids if got else None,
                          prompt_ids)
        cache = make_prompt_cache(model) if plan.action == "cold" else got.cache
        token_ids = list(prompt_ids)
        wb = kv.write_behind(FP, "resume")
        for r in stream_generate(model, tok, mx.array(prompt_ids[plan.reused:]),
                                 max_tokens=10, prompt_cache=cache):
            token_ids.append(r.token)
            wb.step(cache, token_ids)
        wb.close()
        assert (plan.action, plan.reused) == (("trim", 25) if parts else ("extend", len(said)))
        assert token_ids[len(prompt_ids):] == cold
        assert kv.flush(timeout=WAIT) is True
        again = kv.load(FP, "resume")
        assert again is not None and again.token_ids == token_ids


def test_the_readme_resume_loop_on_a_model_of_fewer_kv_heads_raises(
        tok, client: Client, daemon: RunningDaemon) -> None:
    """The README's resume loop, the conversation saved by a model with 2 KV
    heads and resumed under the same id by one with 1, the prompt leaving it
    part way (a trim): the one head's keys broadcast into the rows the trim
    left spare, and the loop streamed other tokens than a cold run with no
    error. plan_reuse now cuts a loaded cache to its rows: the first step
    raises."""
    two, one = tiny_llama(seed=2), tiny_llama(seed=2, kv_heads=1)
    p = prompt(30, seed=7)
    cache, token_ids = make_prompt_cache(two), list(p)
    for r in stream_generate(two, tok, mx.array(p), max_tokens=12, prompt_cache=cache):
        token_ids.append(r.token)
    assert client.save(FP, "heads", cache, token_ids) and client.flush(timeout=WAIT)
    prompt_ids = token_ids[:25] + prompt(4, seed=8)
    with Client(daemon.socket, timeout=WAIT) as kv:
        got = kv.load(FP, "heads")
        assert got is not None
        plan = plan_reuse(got.cache, got.token_ids, prompt_ids)
        assert plan.action == "trim"
        with pytest.raises(ValueError):
            for _ in stream_generate(one, tok, mx.array(prompt_ids[plan.reused:]),
                                     max_tokens=4, prompt_cache=got.cache):
                pass


def test_triggers_and_final_save(model, client: Client) -> None:
    p = prompt(12, seed=7)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    ids = list(p)

    every = client.write_behind(FP, "every", every_tokens=None, every_seconds=0.0)
    assert [every.step(cache, ids) for _ in range(3)] == [True, True, True]
    assert every.close() is False  # the last step was saved already
    assert every.counters.sent == 3

    quiet = WriteBehind(client, FP, "quiet", every_tokens=None, every_seconds=None,
                        save_first=False)
    assert [quiet.step(cache, ids) for _ in range(5)] == [False] * 5
    assert quiet.counters.sent == 0 and quiet.counters.steps == 5
    assert quiet.close() is True and quiet.counters.sent == 1
    assert quiet.close() is False  # closed: later calls do nothing
    with pytest.raises(RuntimeError):
        quiet.step(cache, ids)

    tokens = client.write_behind(FP, "tokens", every_tokens=4, every_seconds=None,
                                 save_first=False)
    assert [tokens.step(cache, ids) for _ in range(9)] == [False, False, False, True] * 2 + [False]
    tokens.discard()
    assert tokens.close() is False and tokens.counters.sent == 2

    assert client.flush(timeout=WAIT) is True
    got = client.load(FP, "quiet")
    assert got is not None and got.token_ids == p


def test_a_cache_whose_layers_disagree_is_refused_and_never_restored(
        model, tok: TokenizerWrapper, client: Client) -> None:
    """Layers of two caches mixed (or a forward pass cut short), offsets 8,
    12, 8, 12: only the largest offset was compared with the ids, so step()
    saved it, and a Session restored it and generated other tokens than a
    cold run, without a word (the API review's find)."""
    p = prompt(12, seed=9)
    short, full = make_prompt_cache(model), make_prompt_cache(model)
    prefill(model, p[:8], short)
    prefill(model, p, full)
    mixed = [short[0], full[1], short[2], full[3]]
    wb = client.write_behind(FP, "mixed")
    for ids in (p, p[:8]):
        with pytest.raises(ValueError, match=r"layers hold different numbers of tokens \(8 to 12\)"):
            wb.step(mixed, ids)
    assert wb.counters.sent == 0
    plan = plan_reuse(mixed, p, p + [5, 6])
    assert plan.action == "cold" and "different numbers of tokens" in plan.reason
    # Saved all the same through save(), which does not compare: a session
    # finds it out, and runs cold.
    assert client.save(FP, "mixed", mixed, p) and client.flush(timeout=WAIT)
    cold = Session(client, FP, "never-saved", model, tok).generate(p + [5, 6], max_tokens=4)
    session = Session(client, FP, "mixed", model, tok)
    assert session.generate(p + [5, 6], max_tokens=4) == cold
    assert session.last_plan is not None and session.last_plan.action == "cold"
    assert "different numbers of tokens" in session.last_plan.reason


def test_refuses_a_cache_that_does_not_match_its_tokens(model, client: Client) -> None:
    p = prompt(10, seed=8)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    wb = client.write_behind(FP, "mismatch")
    with pytest.raises(ValueError, match="holds 10 tokens but 9"):
        wb.step(cache, p[:9])
    assert wb.counters.sent == 0
    assert client.load(FP, "mismatch") is None
    # A refused step is not counted, and close() saves the last step taken.
    assert wb.counters.steps == 0
    assert wb.close() is False  # no step was taken: nothing to save
    wb = client.write_behind(FP, "mismatch", every_tokens=2, save_first=False)
    wb.step(cache, p)  # not due
    with pytest.raises(ValueError, match="holds 10 tokens but 9"):
        wb.step(cache, p[:9])  # due
    assert wb.counters.steps == 1
    # A step that saves nothing is checked too (it was not: an off-by-one
    # showed only at the next save, up to every_tokens steps later).
    quiet = client.write_behind(FP, "quiet-mismatch", every_tokens=100, save_first=False)
    for bad, says in (((cache, p[:9]), "holds 10 tokens but 9"), ((None, p), "NoneType"),
                      ((model, p), "Model"), ((cache, set(p)), "not a set"),
                      # Before: "holds 10 tokens but 2 token ids were given".
                      ((cache, mx.array([p, p])), r"one row of integers.*\(2, 10\)"),
                      ((cache, bytes(range(10))), "not bytes"),
                      # Before: no error until the next save, or close().
                      ((cache, [float(t) for t in p]), "must be integers"),
                      ((cache, [*p[:9], True]), "must be integers"),
                      ((cache, np.array(p, dtype=np.float32)), "not an array of float32"),
                      ((cache, mx.array(p).astype(mx.float16)), "not an array of float16")):
        with pytest.raises(ValueError, match=says):
            quiet.step(*bad)
    assert quiet.counters.steps == 0
    # Ids save() takes, in an array of Python ints (dtype object): a step too.
    assert quiet.step(cache, np.array(p, dtype=object)) is False
    assert quiet.counters.steps == 1
    quiet.discard()
    assert wb.close() is True and client.flush(timeout=WAIT)
    got = client.load(FP, "mismatch")
    assert got is not None and got.token_ids == p


def test_daemon_down_drops_and_never_raises(model, daemon: RunningDaemon,
                                            caplog: pytest.LogCaptureFixture) -> None:
    p = prompt(10, seed=9)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    kv = Client(daemon.socket, timeout=WAIT)
    try:
        daemon.stop()
        deadline = time.monotonic() + WAIT
        while kv.connected:  # the client notices the daemon is gone
            assert time.monotonic() < deadline, "client did not notice the daemon stopped"
            time.sleep(0.01)
        wb = kv.write_behind(FP, "down", every_tokens=1, every_seconds=None)
        assert [wb.step(cache, p) for _ in range(3)] == [False, False, False]
        assert wb.counters.dropped == 3 and wb.counters.sent == 0
        assert wb.close(cache, p) is False
        # A helper whose saves were already dropped still says so when the
        # client is closed under it (the warning was only logged before any drop).
        wb = kv.write_behind(FP, "down", every_tokens=1, every_seconds=None)
        assert wb.step(cache, p) is False
        kv.close()
        with caplog.at_level(logging.WARNING, logger="kvkeeper.writebehind"):
            assert wb.step(cache, p) is False
            assert wb.step(cache, p) is False
        told = [r for r in caplog.records if "event=write_behind_client_closed" in r.getMessage()]
        assert len(told) == 1
    finally:
        kv.close()


def test_every_call_on_a_closed_client_raises_write_behind_too(client: Client) -> None:
    """README: after close(), every call but close() and client_stats()
    raises RuntimeError. write_behind() returned a helper whose every save
    was then dropped."""
    cache = make_prompt_cache(tiny_llama())
    client.close()
    calls = {
        "write_behind": lambda: client.write_behind("fp", "x"),
        "save": lambda: client.save("fp", "x", cache, []),
        "load": lambda: client.load("fp", "x"),
        "delete": lambda: client.delete("fp", "x"),
        "flush": client.flush,
        "ping": client.ping,
        "stats": client.stats,
        "entries": client.entries,
        "gc": client.gc,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="client is closed"):
            call()
            pytest.fail(f"{name}() did not raise")
    client.close()
    assert "client_saves_dropped" in client.client_stats()


def test_a_refused_save_or_close_leaves_the_final_save_to_make(model, client: Client) -> None:
    """close(cache, ids) with a pair that disagrees closed the helper before
    refusing, so the retry with the right pair saved nothing; and a refused
    save() left its pair as the last step, so close() refused it in turn."""
    p = prompt(10, seed=9)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    wb = client.write_behind(FP, "close-retry", every_tokens=100, save_first=False)
    wb.step(cache, p)  # not due
    with pytest.raises(ValueError, match="holds 10 tokens but 9"):
        wb.close(cache, p[:9])
    assert wb.close(cache, p) is True
    wb = client.write_behind(FP, "save-refused", every_tokens=100, save_first=False)
    wb.step(cache, p)  # not due
    with pytest.raises(ValueError, match="holds 10 tokens but 5"):
        wb.save(cache, p[:5])
    assert wb.close() is True  # the last step taken
    assert client.flush(timeout=WAIT)
    for cache_id in ("close-retry", "save-refused"):
        got = client.load(FP, cache_id)
        assert got is not None and got.token_ids == p, cache_id


def test_a_closed_helper_holds_no_cache(model, tok, client: Client) -> None:
    """A session's last helper kept the cache it saved last, so forget()
    freed nothing until the session's next request."""
    import gc
    import weakref

    s = Session(client, FP, "forget", model, tok)
    s.generate(prompt(40, seed=3), max_tokens=4)
    refs = [weakref.ref(layer) for layer in s.cache]
    s.forget()
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert s.last_write_behind is not None and s.last_write_behind.counters.sent >= 1


@pytest.mark.parametrize("in_place, passed", [(False, True), (True, True), (True, False)])
def test_close_saves_a_rollback_to_the_same_length(model, client: Client, in_place: bool,
                                                   passed: bool) -> None:
    """A step saved the cache at 10 tokens; the last 2 were then taken back
    and 2 others fed (a rejected draft), so cache and ids are 10 long again.
    close() skipped the save (same cache, same length, no step since), and
    the key kept the tokens taken back. The ids may be a new list or the
    saved one changed in place; close() may be given the pair or not (then
    it saves what the last step saw, as it is now)."""
    p = prompt(10, seed=9)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    key = f"rollback-{in_place}-{passed}"
    wb = client.write_behind(FP, key, every_tokens=1, every_seconds=None)
    ids = list(p)
    assert wb.step(cache, ids) is True
    for layer in cache:
        layer.trim(2)
    other = [(t + 1) % 64 for t in p[-2:]]
    prefill(model, other, cache)
    if in_place:
        ids[-2:] = other
    else:
        ids = p[:8] + other
    assert (wb.close(cache, ids) if passed else wb.close()) is True
    assert client.flush(timeout=WAIT)
    got = client.load(FP, key)
    assert got is not None and got.token_ids == p[:8] + other
    for saved, live in zip(got.cache, cache, strict=True):
        assert saved.offset == live.offset == 10
        assert mx.array_equal(saved.state[0][..., :10, :], live.state[0][..., :10, :]).item()


def test_close_does_not_save_again_what_the_last_step_saved(model, client: Client) -> None:
    p = prompt(10, seed=9)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    wb = client.write_behind(FP, "same", every_tokens=1, every_seconds=None)
    assert wb.step(cache, p) is True
    assert wb.close(cache, list(p)) is False
    assert wb.counters.sent == 1


def test_a_batch_of_one_is_taken_as_its_row(model, client: Client) -> None:
    """Ids of shape (1, n), as mlx-vlm's input_ids come, at every entry point:
    before, step() refused them ("holds 10 tokens but 1 token ids")."""
    p = prompt(10, seed=9)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    wb = client.write_behind(FP, "batch-of-one", every_tokens=1, every_seconds=None)
    assert wb.step(cache, mx.array([p])) is True
    assert wb.close(cache, np.array([p])) is False  # that step saved exactly this
    assert wb.counters.sent == 1
    wb = client.write_behind(FP, "batch-of-one-close", every_tokens=None, every_seconds=None,
                             save_first=False)
    assert wb.save(cache, np.array([p])) is True
    with pytest.raises(ValueError, match="holds 10 tokens but 9"):
        wb.close(cache, mx.array([p[:9]]))
    # The last step's ids, saved by a close() on another thread (before: the
    # row, lazy on the stepping thread's stream, could not be read there).
    ids = mx.array([p])
    mx.eval(ids)
    late = client.write_behind(FP, "batch-of-one-late", every_tokens=None, every_seconds=None,
                               save_first=False)
    assert late.step(cache, ids) is False
    closing = threading.Thread(target=lambda: closed.append(late.close()))
    closed: list[bool] = []
    closing.start()
    closing.join(WAIT)
    assert closed == [True]
    assert client.flush(timeout=WAIT)
    for cid in ("batch-of-one", "batch-of-one-close", "batch-of-one-late"):
        got = client.load(FP, cid)
        assert got is not None and got.token_ids == p, cid


def test_close_after_a_step_that_saved_ids_in_a_deque(model, client: Client) -> None:
    """Ids that take no slices (a deque) are compared from their end: the
    final save of what the last step saved is still skipped."""
    from collections import deque

    p = prompt(10, seed=9)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    wb = client.write_behind(FP, "deque", every_tokens=1, every_seconds=None)
    ids = deque(p)
    assert wb.step(cache, ids) is True
    assert wb.close() is False and wb.counters.sent == 1
    ids[-1] = (ids[-1] + 1) % 64
    wb = client.write_behind(FP, "deque", every_tokens=1, every_seconds=None)
    assert wb.step(cache, deque(p)) is True
    assert wb.close(cache, ids) is True  # not the ids saved


def test_close_sees_tokens_fed_after_the_last_step(model, client: Client) -> None:
    """A loop that builds a new ids list per token, fed one more token without
    a step, then closed: close() skipped the save as done (the last step's
    ids and save matched), and the last token was lost without a word; had
    that step not saved, the same close raised. close(token_ids=...) alone
    dropped the ids given and saved the last step's."""
    p = prompt(20, seed=3)
    cache = make_prompt_cache(model)
    prefill(model, p, cache)
    wb = client.write_behind(FP, "fed", every_tokens=None, every_seconds=0)
    ids = list(p)
    for t in (1, 2, 3):
        next_logits(model, cache, t)
        ids = ids + [t]
        assert wb.step(cache, ids) is True
    next_logits(model, cache, 4)  # fed, and no step
    with pytest.raises(ValueError, match="holds 24 tokens but 23"):
        wb.close()
    assert wb.close(token_ids=ids + [4]) is True  # the cache of the last step, these ids
    assert client.flush(timeout=WAIT)
    got = client.load(FP, "fed")
    assert got is not None and got.token_ids == ids + [4] and got.cache[0].offset == 24
    fresh = client.write_behind(FP, "never", every_tokens=None, every_seconds=None)
    with pytest.raises(ValueError, match="give the cache too"):
        fresh.close(token_ids=ids)


def test_the_write_behind_module_imports_no_socket_library() -> None:
    """Its token-id checks came from the client module for a while, which
    made importing kvkeeper.writebehind (and kvkeeper.integrations) load
    ZeroMQ and msgspec too."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "import sys, kvkeeper.writebehind; "
                        "print(sorted(m for m in ('zmq', 'msgspec') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
