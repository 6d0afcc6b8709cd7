"""The client against a real daemon with real MLX caches from real tiny models."""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, make_prompt_cache
from safetensors import safe_open

import kvkeeper
from kvkeeper.client.client import Client, DaemonUnavailable

from .conftest import (
    WAIT,
    RunningDaemon,
    line_from,
    serve_process,
    start_daemon,
    stop_process,
    wait_for,
)
from .faultkit import entry_path, filled, rewrite_header
from .legacy_describe import MLX_LM_OLD_API
from .tiny import greedy_decode, prefill, prompt, tiny_deepseek_v41, tiny_llama

FP = "tiny-llama-test"


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return tiny_llama(seed=1)


def leaves(cache: list) -> list[np.ndarray]:
    """Every array leaf of the cache's state, trimmed to the used length, as uint16/float bytes."""
    out = []
    for layer in cache:
        k, v = layer.state[:2]
        for a in (k[..., : layer.offset, :], v[..., : layer.offset, :]):
            mx.eval(a)
            out.append(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))
    return out


def next_logits(model, cache: list, token: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = model(mx.array([[token]]), cache=cache)[0, -1]
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def test_restore_gives_bit_identical_logits(model, client: Client, daemon: RunningDaemon) -> None:
    tokens = prompt(300)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    assert client.save(FP, "conv-1", cache, tokens) is True
    assert client.flush(timeout=WAIT) is True

    got = client.load(FP, "conv-1")
    assert got is not None
    assert got.token_ids == tokens and got.cache_id == "conv-1" and got.model == FP
    assert [type(c) for c in got.cache] == [KVCache] * len(cache)
    expected = next_logits(model, cache, 7)
    np.testing.assert_array_equal(next_logits(model, got.cache, 7), expected)

    # And again from a new daemon on the same root (the process restarted).
    daemon.stop()
    rd = start_daemon(daemon.root, daemon.socket)
    try:
        with Client(daemon.socket, timeout=WAIT) as kv:
            again = kv.load(FP, "conv-1")
            assert again is not None
            np.testing.assert_array_equal(next_logits(model, again.cache, 7), expected)
    finally:
        rd.stop()


def test_snapshot_isolation_under_continued_decoding(model, client: Client) -> None:
    """What is saved is the cache as it was at save(), though decoding goes on."""
    tokens = prompt(40, seed=3)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    before = leaves(cache)
    assert client.save(FP, "iso", cache, tokens)
    # Step back 20 tokens and decode again: the same buffers, rows 20..39 of
    # which are part of the save, are rewritten in place while the client's
    # I/O thread may still be encoding and sending them.
    for c in cache:
        c.trim(20)
    greedy_decode(model, cache, tokens[-1], 20)
    assert client.flush(timeout=WAIT)
    got = client.load(FP, "iso")
    assert got is not None and got.token_ids == tokens
    after = leaves(got.cache)
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)
    # The restored cache continues exactly like a copy taken at save time would.
    ref = make_prompt_cache(model)
    prefill(model, tokens, ref)
    assert greedy_decode(model, got.cache, 5, 8) == greedy_decode(model, ref, 5, 8)


def test_a_strided_bf16_cache_is_saved_as_it_was(client: Client) -> None:
    """Transposed bf16 keys (strided, a format numpy cannot read) reach the
    file as they were at save(), though the arrays are rewritten in place
    right after it: the I/O thread exports them without an MLX operation
    (kvkeeper.client.rawbuffer), and the capture's handles keep the old
    bytes."""
    layers, before = [], []
    for i in range(4):
        c = ConcatenateKVCache()
        k = (mx.random.normal((1, 64, 4, 32), key=mx.random.key(i)) * 8).astype(mx.bfloat16)
        c.update_and_fetch(k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3))
        mx.eval(c.keys, c.values)
        layers.append(c)
        before.append(np.array(c.keys.astype(mx.float32)))
    assert client.save(FP, "strided", layers, list(range(64)))
    for c in layers:  # in place: the handle makes MLX copy instead
        c.keys[..., :8, :] = mx.zeros((1, 4, 8, 32), dtype=mx.bfloat16)
        mx.eval(c.keys)
    assert client.flush(timeout=WAIT)
    got = client.load(FP, "strided")
    assert got is not None
    for c, want in zip(got.cache, before, strict=True):
        np.testing.assert_array_equal(np.array(c.keys.astype(mx.float32)), want)
    assert got.path is not None
    stored = mx.load(str(got.path))  # the file itself, through MLX's own reader
    for want in before:
        assert sum(np.array_equal(np.array(a.astype(mx.float32)), want)
                   for a in stored.values()) == 2  # keys and values


def test_clients_saving_strided_caches_leave_no_threads_behind(short_dir: Path) -> None:
    """Each Client's I/O thread exports the buffers; it must run no MLX
    operation, which would start an MLX stream (a thread) for it that
    outlives it: a server opening a client per session would grow.

    The daemon runs in its own process: an in-process one starts worker
    threads for its disk work whenever it likes, which would be counted."""
    sock = short_dir / "run" / "kv.sock"
    proc = serve_process(short_dir / "root", sock)
    k = mx.random.normal((1, 16, 4, 32)).astype(mx.bfloat16).transpose(0, 2, 1, 3)
    c = ConcatenateKVCache()
    c.update_and_fetch(k, k)
    mx.eval(c.keys, c.values)

    def one_client() -> None:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "strided", [c], list(range(16)))
            assert kv.flush(timeout=WAIT)

    def threads() -> int:  # native ones too (MLX's), which threading does not see
        import psutil

        return psutil.Process().num_threads()

    try:
        one_client()  # whatever is started once per process
        before = threads()
        for _ in range(5):
            one_client()
        # A thread that leaks stays; one that is ending is gone within the wait.
        wait_for(lambda: threads() <= before, f"threads back to {before} (now {threads()})")
    finally:
        assert stop_process(proc) == 0


def test_a_client_dropped_without_close_sends_its_save_and_leaves_nothing_behind(
    short_dir: Path,
) -> None:
    """A server making a client per request and never closing it must not
    grow by an I/O thread, ZeroMQ's threads and a dozen descriptors each
    time (it ran out of descriptors), and what the client held still goes
    to the daemon. The daemon runs in its own process, as above."""
    import psutil

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    me = psutil.Process()

    def dropped(*keys: str) -> None:
        """Drop a client per key, each holding a save; return once each has
        been collected and has said so."""
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", ResourceWarning)
            for key in keys:
                kv = Client(sock, timeout=WAIT)
                assert kv.save(FP, key, filled(1, 7), [1, 2])
                del kv  # no close()
            # The queued save holds its client until the I/O thread has built
            # it; the finalizer may then run on that thread.
            gc.collect()
            wait_for(lambda: sum("dropped without close" in str(w.message) for w in said)
                     == len(keys), "each client collected, with its ResourceWarning")

    try:
        with Client(sock, timeout=WAIT) as kv:
            dropped("first")  # whatever is started once per process
            wait_for(lambda: kv.stats()["saves_written"] == 1, "the first save written")
            threads, fds = me.num_threads(), me.num_fds()
            dropped(*(f"d{i}" for i in range(8)))
            wait_for(lambda: me.num_threads() <= threads and me.num_fds() <= fds,
                     f"threads and descriptors back to {threads} and {fds} "
                     f"(now {me.num_threads()} and {me.num_fds()})")
            wait_for(lambda: kv.stats()["saves_written"] == 9, "every dropped client's save")
        for i in range(8):
            arrays = mx.load(str(entry_path(root, f"d{i}", model=FP)))
            assert arrays and all(bool(mx.all(a == 7)) for a in arrays.values())
    finally:
        assert stop_process(proc) == 0


#: Drops three clients under -W error::ResourceWarning, then prints how many
#: of their I/O threads are left once they are collected.
DROP_UNDER_W_ERROR = """
import gc, sys, threading, time, weakref
from kvkeeper import Client
gone = []
for _ in range(3):
    kv = Client(sys.argv[1], timeout=30)
    assert kv.ping()
    gone.append(weakref.ref(kv))
    del kv
gc.collect()
assert all(ref() is None for ref in gone)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    left = [t for t in threading.enumerate() if t.name == "kvkeeper-client-io"]
    if not left:
        break
    time.sleep(0.05)
print(len(left))
"""


def test_a_dropped_client_is_closed_when_its_warning_is_an_error(short_dir: Path) -> None:
    """Under -W error the ResourceWarning raises inside the finalizer: the
    close must have started before it (it did not, and the client's threads
    and descriptors stayed)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        child = subprocess.run(
            [sys.executable, "-W", "error::ResourceWarning", "-c", DROP_UNDER_W_ERROR, str(sock)],
            timeout=2 * WAIT, capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == "0", child.stderr
        assert "ResourceWarning" in child.stderr  # said, as an exception the finalizer ignored
    finally:
        assert stop_process(proc) == 0


def test_a_client_made_after_mlx_is_loaded_has_its_codec_ready(daemon: RunningDaemon) -> None:
    """The codec was imported by the first save(), inside the generation loop
    (8-9 ms here, against 1.2 ms for that save with it imported). A client
    made once MLX is loaded imports it; one made without MLX (the commands)
    still does not."""
    script = """
import sys
import threading
if sys.argv[2] == "mlx-without-numpy":  # numpy is not a dependency of MLX or the daemon
    sys.modules["numpy"] = None
if sys.argv[2].startswith("mlx"):
    import mlx.core
from kvkeeper import Client
with Client(sys.argv[1], timeout=30) as kv:
    kv.entries()
    print("kvkeeper.client.codec" in sys.modules, "mlx.core" in sys.modules)
"""
    for mode, expected in (("mlx", "True True"), ("none", "False False"),
                           ("mlx-without-numpy", "False True")):
        child = subprocess.run([sys.executable, "-c", script, str(daemon.socket), mode],
                               timeout=2 * WAIT, capture_output=True, text=True)
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == expected, (mode, child.stdout, child.stderr)


#: The start of a child process: 64 MiB of cache layers filled with the
#: value given as its second argument, a connected client ``kv``, "ready"
#: said, and the line from stdin that says go.
CHILD_WITH_64_MIB = """
import sys, time, weakref, mlx.core as mx
from mlx_lm.models.cache import KVCache
from kvkeeper import Client
layers = []
for _ in range(4):
    c = KVCache()
    x = mx.full((1, 8, 8192, 128), float(sys.argv[2]), dtype=mx.bfloat16)
    c.update_and_fetch(x, x)
    layers.append(c)
kv = Client(sys.argv[1], timeout=30)
assert kv.connected
print("ready", flush=True)
sys.stdin.readline()
"""


@contextmanager
def child_ready(script: str, sock: Path, value: int) -> Iterator[subprocess.Popen[str]]:
    """A CHILD_WITH_64_MIB script, once it has said "ready"; killed at the
    end if it is still running."""
    child = subprocess.Popen([sys.executable, "-c", script, str(sock), str(value)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert line_from(child) == "ready"
        yield child
    finally:
        child.kill()
        child.wait(WAIT)


def written_whole(sock: Path, root: Path, cache_id: str, value: int) -> None:
    """Wait for the one save the daemon got to end; it must be written, every
    element ``value`` (read back with mx.load)."""
    with Client(sock, timeout=WAIT) as kv:
        def ended() -> float:
            s = kv.stats()
            return s["saves_written"] + s["saves_failed"] + s["saves_cut_off"]

        wait_for(lambda: ended() >= 1, "the save to be written or to fail")
        assert kv.stats()["saves_written"] == 1
    arrays = mx.load(str(entry_path(root, cache_id, model="fp")))
    assert arrays and all(bool(mx.all(a == value)) for a in arrays.values())


#: Drops a client holding a 64 MiB save and exits at once: the exit must wait
#: for the background close the drop started (here the daemon is stopped
#: meanwhile), not cut it short.
DROP_AND_EXIT = CHILD_WITH_64_MIB + """
assert kv.save("fp", "last", layers, [1])
gone = weakref.ref(kv)
del kv
# The queued save holds the client until the I/O thread has built it.
for _ in range(3000):
    if gone() is None:
        break
    time.sleep(0.01)
assert gone() is None, "the client was never collected"
"""


def test_a_client_dropped_just_before_exit_still_gets_its_save_sent(short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with child_ready(DROP_AND_EXIT, sock, 9) as child:
            assert child.stdin is not None
            # A stopped daemon reads nothing: the 64 MiB cannot leave before
            # the child reaches its exit.
            proc.send_signal(signal.SIGSTOP)
            try:
                child.stdin.write("go\n")
                child.stdin.flush()
                time.sleep(1.0)
            finally:
                proc.send_signal(signal.SIGCONT)
            assert child.wait(WAIT) == 0
        written_whole(sock, root, "last", 9)
    finally:
        assert stop_process(proc) == 0


#: Saves 64 MiB while the daemon is stopped, then says "closing" and closes
#: with a long timeout; a Ctrl-C cuts that close short, and the process then
#: ends normally: its exit hook must still close the channel.
INTERRUPTED_CLOSE = CHILD_WITH_64_MIB + """
import signal
# Ctrl-C's own handler, even where the tests run with SIGINT ignored (a
# background job of a shell without job control): then it was no
# KeyboardInterrupt, and close() went on waiting.
signal.signal(signal.SIGINT, signal.default_int_handler)
assert kv.save("fp", "cut", layers, [1])
print("closing", flush=True)
try:
    kv.close(timeout=60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.readline()
"""


def _cut_close_short(child: subprocess.Popen[str], daemon: subprocess.Popen[bytes]) -> None:
    """Have an INTERRUPTED_CLOSE child close its client while the daemon is
    stopped (the 64 MiB cannot all leave), and Ctrl-C that close()."""
    assert child.stdin is not None
    daemon.send_signal(signal.SIGSTOP)
    try:
        child.stdin.write("go\n")
        child.stdin.flush()
        assert line_from(child) == "closing"
        time.sleep(0.5)
        child.send_signal(signal.SIGINT)
        assert line_from(child) == "interrupted"
    finally:
        daemon.send_signal(signal.SIGCONT)


def test_a_close_beside_another_thread_s_returns_once_that_one_is_done(
        short_dir: Path) -> None:
    """Thread A closes with 3 s to send 48 MiB to a stopped daemon; thread B
    calls close(0.2) meanwhile. B returned after its own 0.2 s, while A's
    close still had the saves to send (a review): the README says a close()
    beside another thread's returns once that one is done."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        kv = Client(sock, timeout=WAIT, min_send_interval=0)
        proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(3):
                assert kv.save("fp", f"k{i}", filled(16, i), [i])
            def close(name: str, timeout: float) -> None:
                kv.close(timeout)

            a = threading.Thread(target=close, args=("A", 3.0))
            a.start()
            wait_for(lambda: kv.closed, "A's close to begin")
            time.sleep(0.1)
            close("B", 0.2)
            # A's close is over (its channel ended, the saves it could not
            # send counted lost); before, B returned after 0.2 s with them
            # still in flight.
            stats = kv.client_stats()
            assert stats["client_inflight_bytes"] == 0, stats
            assert stats["client_saves_lost"] == 3, stats
            a.join(WAIT)
        finally:
            proc.send_signal(signal.SIGCONT)
    finally:
        assert stop_process(proc) == 0


CLOSED_AGAIN = INTERRUPTED_CLOSE + """
import threading
kv.close(timeout=60)
print("io threads", sum(t.name == "kvkeeper-client-io" for t in threading.enumerate()),
      flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("then", ["exit", "close again"])
def test_a_close_cut_short_by_ctrl_c_is_finished(then: str, short_dir: Path) -> None:
    """A Ctrl-C inside close() left the channel out of the exit hook's
    reach: the save it was sending was cut off at exit. And close() again
    returned at once and did nothing: the connection and its I/O thread
    stayed until the process exited (a server that catches Ctrl-C and goes
    on kept them)."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        with child_ready(INTERRUPTED_CLOSE if then == "exit" else CLOSED_AGAIN, sock,
                         5) as child:
            assert child.stdin is not None
            _cut_close_short(child, proc)
            if then == "close again":
                child.stdin.write("again\n")
                child.stdin.flush()
                assert line_from(child) == "io threads 0"
                written_whole(sock, root, "cut", 5)  # the child still runs: its close sent it
            child.stdin.write("exit\n")
            child.stdin.flush()
            assert child.wait(WAIT) == 0
        if then == "exit":
            written_whole(sock, root, "cut", 5)
    finally:
        assert stop_process(proc) == 0


def test_mlx_vlm_prompt_cache_state_round_trips(model, client: Client) -> None:
    from mlx_vlm.generate import PromptCacheState
    from mlx_vlm.models import cache as vlm_cache

    state = PromptCacheState()
    tokens = prompt(33, seed=4)
    state.cache = [vlm_cache.KVCache() for _ in model.layers]
    prefill(model, tokens, state.cache)
    state.token_ids = tokens
    assert client.save(FP, "vlm", state)
    got = client.load(FP, "vlm")  # read-your-writes: no flush needed
    assert got is not None
    assert [type(c) for c in got.cache] == [vlm_cache.KVCache] * len(state.cache)
    assert got.token_ids == tokens
    assert got.find_prefix_length(tokens[:10] + [999]) == 10
    assert state.find_prefix_length(tokens) == got.find_prefix_length(tokens)
    np.testing.assert_array_equal(next_logits(model, got.cache, 3),
                                  next_logits(model, state.cache, 3))
    # Ids of every kind save() takes: an MLX array was compared one element
    # (an MLX op) at a time, a generator raised TypeError, a str matched 0.
    longer = tokens + [5, 6]
    for ids in (mx.array(longer), np.array(longer), tuple(longer),
                iter(longer)):
        assert got.find_prefix_length(ids) == len(tokens), type(ids)
    for bad in ("abc", {1, 2}, [True, False], b"ab"):
        with pytest.raises(ValueError):
            got.find_prefix_length(bad)
    got.update(mx.array(tokens[:5]), got.cache)
    assert got.token_ids == tokens[:5] and type(got.token_ids[0]) is int


def test_token_ids_are_taken_as_they_are_at_save_time(client: Client) -> None:
    c = KVCache()
    x = mx.zeros((1, 1, 3, 8))
    c.update_and_fetch(x, x)
    tokens = [5, 6, 7]
    assert client.save(FP, "list", [c], tokens)
    tokens.append(8)  # the generation loop goes on appending after save() returned
    tokens[0] = 99
    assert client.save(FP, "numpy", [c], np.array([1, 2, 2**62], dtype=np.int64))
    assert client.save(FP, "mlx", [c], mx.array([3, 4], dtype=mx.uint32))
    assert client.save(FP, "numpy-scalars", [c], [np.int32(9), np.uint64(10)])
    assert client.save(FP, "generator", [c], (i for i in (11, 12)))  # read once
    # No vocabulary here (README): any integer is kept as given.
    assert client.save(FP, "any-int", [c], [-5, 0, 2**64 - 1, 2**70])
    # The same beside numpy integers (refused before: "int too big to convert").
    assert client.save(FP, "mixed-ints", [c], [2**70, np.int64(1), np.uint64(2**64 - 1)])
    assert client.flush(timeout=WAIT)
    expect = {"list": [5, 6, 7], "numpy": [1, 2, 2**62], "mlx": [3, 4], "numpy-scalars": [9, 10],
              "generator": [11, 12], "any-int": [-5, 0, 2**64 - 1, 2**70],
              "mixed-ints": [2**70, 1, 2**64 - 1]}
    for cid, ids in expect.items():
        got = client.load(FP, cid)
        assert got is not None and got.token_ids == ids, cid
        with safe_open(got.path, "np") as f:
            assert json.loads(f.metadata()["kvkeeper.token_ids"]) == ids, cid
    for bad in ([1, 2.5], ["1"], [None], [np.float32(1)], 7, [1, True], [2**70, 1.0],
                [2**70, np.int64(1), np.True_],
                np.array([True, False]), mx.array([False, True])):
        with pytest.raises(ValueError, match="token_ids must be integers"):
            client.save(FP, "bad", [c], bad)
    # Before: saved in some order (a dict's keys), as ids that look real.
    for unordered in ({1, 2, 3}, frozenset({1}), {1: 2, 3: 4}):
        with pytest.raises(ValueError, match="ordered sequence of integers"):
            client.save(FP, "bad", [c], unordered)
    # Before: pairs were taken as a dict; a str failed with dict()'s message.
    for meta in ([("a", "b")], "ab"):
        with pytest.raises(ValueError, match="metadata must be a mapping of str to str"):
            client.save(FP, "bad", [c], [1, 2, 3], metadata=meta)  # type: ignore[arg-type]
    # A batch of one (mlx-vlm's input_ids, a Session prompt) is its row
    # (before: refused, where a Session took it); more rows are refused.
    for cid, batch in (("mx-batch", mx.array([[1, 2, 3]])), ("np-batch", np.array([[1, 2, 3]]))):
        assert client.save(FP, cid, [c], batch)
    assert client.flush(timeout=WAIT)
    for cid in ("mx-batch", "np-batch"):
        got = client.load(FP, cid)
        assert got is not None and got.token_ids == [1, 2, 3], cid
        with safe_open(got.path, "np") as f:
            assert json.loads(f.metadata()["kvkeeper.token_ids"]) == [1, 2, 3], cid
        assert got.find_prefix_length(mx.array([[1, 2, 9]])) == 2
    for batch in (mx.array([[1, 2, 3], [4, 5, 6]]), np.array([[[1, 2, 3]]]), np.array(7)):
        with pytest.raises(ValueError, match=r"one row of integers, shape \(n,\) or \(1, n\)"):
            client.save(FP, "bad", [c], batch)
    # Before: saved as the ids 97, 98, 99.
    for raw in (b"abc", bytearray(b"abc"), memoryview(b"abc"), memoryview(bytearray(b"ab")),
                array("B", b"abc"), memoryview((ctypes.c_ubyte * 3)())):
        with pytest.raises(ValueError, match="token_ids must be integers, not byte"):
            client.save(FP, "bad", [c], raw)
    # Before: "'str' object cannot be interpreted as an integer", with no hint.
    with pytest.raises(ValueError, match=r"must be integers, not str \(encode the text"):
        client.save(FP, "bad", [c], "hello")  # type: ignore[arg-type]
    # Before: MLX's RuntimeError "There is no Stream(cpu, 0) in current thread".
    lazy: list[Any] = []
    maker = threading.Thread(target=lambda: lazy.append(mx.arange(3) + 1))
    maker.start()
    maker.join(WAIT)
    with pytest.raises(ValueError, match="another thread's stream.*evaluate it there"):
        client.save(FP, "bad", [c], lazy[0])
    assert client.load(FP, "bad") is None


def test_a_long_conversation_loads_whole_lazily_and_verified(client: Client) -> None:
    # 100,000 token ids make a file header of over 600 KB: more than a
    # reader's first read of the file takes.
    c = KVCache()
    x = mx.ones((1, 1, 4, 8))
    c.update_and_fetch(x, x)
    ids = [(i * 7919) % 128_256 for i in range(100_000)]
    assert client.save(FP, "long", [c], ids) and client.flush(timeout=WAIT)
    for verify in (False, True):
        got = client.load(FP, "long", verify=verify)
        assert got is not None and got.token_ids == ids, verify
        assert mx.array_equal(got.cache[0].state[0], x)
    with open(got.path, "rb") as f:
        assert int.from_bytes(f.read(8), "little") > 600_000


def test_loads_of_one_description_stay_apart(client: Client, daemon: RunningDaemon) -> None:
    """Two entries of the same shapes share one layers description, which a
    load decodes once for the next ones: every load still gets its own
    arrays and containers, and its own file's tensors are still checked
    against the description."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    def cache(v: float) -> list:
        a = ArraysCache(2)
        a[0] = mx.full((1, 3, 4), v)
        a[1] = mx.full((1, 2), v + 1)
        kv = KVCache()
        x = mx.full((1, 2, 5, 8), v, dtype=mx.bfloat16)
        kv.update_and_fetch(x, x)
        return [a, kv]

    def values(layers: list) -> list[float]:
        return [layers[0][0][0, 0, 0].item(), layers[0][1][0, 0].item(),
                layers[1].state[0][0, 0, 0, 0].item(), layers[1].offset]

    for name, v in (("a", 1.0), ("b", 7.0)):
        assert client.save(FP, name, cache(v), [1, 2, 3, 4, 5])
    assert client.flush(timeout=WAIT)
    for verify in (False, True):
        first = client.load(FP, "a", verify=verify)
        assert first is not None and values(first.cache) == [1.0, 2.0, 1.0, 5]
        # What a generation loop does to its cache, in place.
        first.cache[0][0] = mx.zeros((1, 3, 4))
        first.cache[0].cache.append(mx.zeros((1,)))
        y = mx.zeros((1, 2, 1, 8), dtype=mx.bfloat16)
        first.cache[1].update_and_fetch(y, y)
        again = client.load(FP, "a", verify=verify)
        other = client.load(FP, "b", verify=verify)
        assert again is not None and other is not None
        assert values(again.cache) == [1.0, 2.0, 1.0, 5] and len(again.cache[0].cache) == 2
        assert values(other.cache) == [7.0, 8.0, 7.0, 5]
    # b's tensor table now gives t0 another shape of the same size; its
    # layers description is still a's, word for word.
    path = entry_path(daemon.root, "b", FP)
    rewrite_header(path, lambda h: h["t0"].update(shape=[1, 4, 3]))
    assert client.load(FP, "a", verify=False) is not None
    assert client.load(FP, "b", verify=False) is None


def test_saves_go_through_without_the_gil_holding_wake_up(
    daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where ctypes cannot call write(2) with the GIL held, the I/O thread is
    # woken with os.write: same behaviour, only slower.
    from kvkeeper.client import channel

    monkeypatch.setattr(channel, "_write_holding_gil", None)
    c = KVCache()
    x = mx.arange(48, dtype=mx.float32).reshape(1, 2, 3, 8)
    c.update_and_fetch(x, x)
    with Client(daemon.socket, timeout=WAIT) as kv:
        for i in range(5):
            assert kv.save(FP, f"fallback-{i}", [c], [i])
        assert kv.flush(timeout=WAIT)
        for i in range(5):
            got = kv.load(FP, f"fallback-{i}")
            assert got is not None and got.token_ids == [i]
            np.testing.assert_array_equal(np.array(got.cache[0].keys), np.array(x))


def test_a_save_that_fails_to_encode_is_counted_lost(
    daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # save() returns once the cache is captured; if turning the capture into
    # messages then fails on the I/O thread (a kvkeeper bug, injected here),
    # the save is counted lost, the next flush() says so, its room in the
    # in-flight budget comes back, and later saves go through.
    from kvkeeper.client import codec

    def broken(cap: object) -> object:
        raise RuntimeError("injected encoding failure")

    c = KVCache()
    x = mx.ones((1, 2, 3, 8))
    c.update_and_fetch(x, x)
    with Client(daemon.socket, timeout=WAIT) as kv:
        with monkeypatch.context() as mp:
            mp.setattr(codec, "encode_capture", broken)
            assert kv.save(FP, "lost", [c], [1]) is True
            assert kv.flush(timeout=WAIT) is False
        stats = kv.stats()
        assert stats["client_saves_lost"] == 1 and stats["client_inflight_bytes"] == 0
        assert kv.load(FP, "lost") is None
        assert kv.save(FP, "lost", [c], [2]) and kv.flush(timeout=WAIT) is True
        got = kv.load(FP, "lost")
        assert got is not None and got.token_ids == [2]


def test_a_save_whose_header_passes_the_daemons_limit_is_lost_with_one_line(
        daemon: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
    """Millions of token ids: the README's documented limit was logged as a
    failure of kvkeeper's own encoding (a traceback), with no key named."""
    c = filled(0.01, 1)
    with Client(daemon.socket, timeout=WAIT) as kv, caplog.at_level(logging.WARNING):
        assert kv.save(FP, "huge", c, list(range(9_000_000))) is True
        assert kv.flush(timeout=WAIT) is False
        assert kv.client_stats()["client_saves_lost"] == 1
        assert kv.load(FP, "huge") is None
        assert kv.save(FP, "huge", c, [1, 2]) and kv.flush(timeout=WAIT) is True
    lost = [r for r in caplog.records if "event=save_lost" in r.getMessage()]
    assert len(lost) == 1 and lost[0].exc_info is None, [r.getMessage() for r in lost]
    said = lost[0].getMessage()
    assert f"reason=header_too_large model={FP} id=huge msg=" in said, said
    assert "the save's header is" in said and "takes at most 33554432" in said, said


@pytest.mark.parametrize("send_interval", [0.0, 0.25])
def test_read_your_writes_and_coalescing(daemon: RunningDaemon, send_interval: float) -> None:
    with Client(daemon.socket, timeout=WAIT, min_send_interval=send_interval) as client:
        _read_your_writes_and_coalescing(client, daemon)


def _read_your_writes_and_coalescing(client: Client, daemon: RunningDaemon) -> None:
    # A big save of one key keeps the writer busy while many saves of another arrive.
    big = [KVCache() for _ in range(8)]
    for c in big:
        x = mx.ones((1, 8, 2048, 128), dtype=mx.bfloat16)
        c.update_and_fetch(x, x)
    assert client.save(FP, "big", big, list(range(2048)))
    small = KVCache()
    for i in range(20):
        x = mx.full((1, 2, 1, 16), float(i), dtype=mx.float32)
        small.update_and_fetch(x, x)
        assert client.save(FP, "hot", [small], list(range(i + 1)))
    got = client.load(FP, "hot")  # no flush: the daemon finishes pending writes first
    assert got is not None and got.token_ids == list(range(20))
    assert client.flush(timeout=WAIT)
    stats = client.stats()
    # Coalesced in the client (sent within its send interval), or in the daemon.
    assert stats["saves_received"] + stats["client_saves_coalesced"] == 21
    assert stats["saves_superseded"] + stats["client_saves_coalesced"] >= 1, stats
    assert stats["saves_written"] + stats["saves_superseded"] == stats["saves_received"]
    # On disk: the newest version only.
    path = daemon.root / "sessions"
    with safe_open(str(got.path), "numpy") as f:
        assert f.metadata()["kvkeeper.token_count"] == "20"
    assert len(list(path.rglob("*.safetensors"))) == 2
    # Again with the old version on disk: load() starts reading the file it
    # finds while the daemon answers, and must not return that older version.
    old_inode = got.path.stat().st_ino
    assert client.save(FP, "big", big, list(range(2048)))
    x = mx.full((1, 2, 1, 16), 20.0, dtype=mx.float32)
    small.update_and_fetch(x, x)
    assert client.save(FP, "hot", [small], list(range(21)))
    got = client.load(FP, "hot", verify=False)
    assert got is not None and got.token_ids == list(range(21))
    assert got.path is not None and got.path.stat().st_ino != old_inode
    assert np.array(got.cache[0].keys)[0, 0, 20, 0] == 20.0
    assert client.flush(timeout=WAIT)


@pytest.mark.skipif(MLX_LM_OLD_API, reason="mlx-lm 0.31 has no DeepSeek V4.1")
def test_a_deepseek_v41_cache_is_saved_field_by_field_and_restores(client: Client) -> None:
    """mlx-lm 0.32's DeepSeek V4.1 LayerCache (no from_state, a read-only
    state without its window size): save() refused it. The file holds each
    field as a tensor (read with the safetensors package), and the loaded
    cache goes on as the original does."""
    model = tiny_deepseek_v41(seed=2)
    tokens = prompt(30)
    cache = model.make_cache()
    prefill(model, tokens, cache)
    assert client.save(FP, "deepseek", cache, tokens) is True
    assert client.flush(timeout=WAIT) is True
    got = client.load(FP, "deepseek")
    assert got is not None and got.path is not None and got.token_ids == tokens
    with safe_open(str(got.path), "numpy") as f:
        layers = json.loads(f.metadata()["kvkeeper.layers"])["layers"]
        for layer, entry in zip(cache, layers, strict=True):
            state = dict(entry["state"]["items"])
            assert (state["window_size"], state["offset"]) == (8, 30)
            for field in ("window", "compress_kv", "index_k", "pending_kv", "pending_gate"):
                want = getattr(layer, field)
                if want is None:
                    assert state[field] is None
                else:
                    assert np.array_equal(f.get_tensor(state[field]["name"]), np.array(want))
    assert np.array_equal(next_logits(model, cache, 7), next_logits(model, got.cache, 7))
    assert greedy_decode(model, cache, 7, 8) == greedy_decode(model, got.cache, 7, 8)


def test_delete_entries_and_distinct_ids(client: Client) -> None:
    c = KVCache()
    x = mx.zeros((1, 1, 3, 8))
    c.update_and_fetch(x, x)
    ids = ["a/b", "a b", "a_b", "Foo", "foo", "../x", "/abs", "nul\0byte", "caf\u00e9",
           "cafe\u0301"]
    for i, cid in enumerate(ids):
        assert client.save(FP, cid, [c], [i])
    assert client.flush(timeout=WAIT)
    entries = client.entries(FP)
    assert sorted(e.cache_id for e in entries) == sorted(ids)
    assert len({e.path for e in entries}) == len(ids)
    root = client.root.resolve()
    assert all(Path(e.path).resolve().is_relative_to(root) for e in entries)
    for i, cid in enumerate(ids):
        got = client.load(FP, cid)
        assert got is not None and got.token_ids == [i], cid
    assert client.delete(FP, "a/b") is True
    assert client.delete(FP, "a/b") is False
    assert client.load(FP, "a/b") is None
    assert client.load(FP, "a b") is not None
    assert client.entries("other-model") == []


def test_bad_arguments_raise_clear_errors(client: Client) -> None:
    c = KVCache()
    with pytest.raises(ValueError, match="cache id is empty"):
        client.save(FP, "", [c])
    with pytest.raises(ValueError, match="limit is 1024"):
        client.load(FP, "x" * 2000)
    with pytest.raises(ValueError, match="1026 bytes; the limit is 1024"):
        client.delete(FP, "\u00e9" * 513)  # bytes of UTF-8 count, not characters
    with pytest.raises(ValueError, match="model must be a string"):
        client.load(7, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no layers"):
        client.save(FP, "x", [])
    with pytest.raises(ValueError, match=r"key 'kvkeeper.model' is kvkeeper's own"):
        client.save(FP, "x", [c], metadata={"kvkeeper.model": "evil"})
    # The fault named: "values str: ['a']" read as the key 'a' being at fault.
    with pytest.raises(ValueError, match=r"the value of 'a' is int, not str$"):
        client.save(FP, "x", [c], metadata={"a": 1})
    with pytest.raises(ValueError, match=r"key 2 is int, not str$"):
        client.save(FP, "x", [c], metadata={2: "b"})
    for meta in ({"a": "\udc80"}, {"\ud800": "b"}):  # before: True, then lost on the I/O thread
        with pytest.raises(ValueError, match="metadata must be valid Unicode"):
            client.save(FP, "x", [c], [1], metadata=meta)
    assert client.flush(timeout=WAIT) is True
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="min_send_interval"):
            Client(client.socket_path, min_send_interval=bad)
    # Each was accepted, and then every save dropped, every wait failed, or
    # flush raised a TypeError; and "" became the socket ".".
    for kw, name in ((dict(max_inflight_bytes=0), "max_inflight_bytes"),
                     (dict(max_inflight_bytes=-1), "max_inflight_bytes"),
                     (dict(max_inflight_bytes=1.5), "max_inflight_bytes"),
                     # Just under 1 (a review: a float test let it through as 0).
                     (dict(max_inflight_bytes=Fraction(2**54 - 1, 2**54)), "max_inflight_bytes"),
                     (dict(max_inflight_bytes=float("inf")), "max_inflight_bytes"),
                     (dict(timeout=0), "timeout"), (dict(timeout=None), "timeout"),
                     (dict(connect_timeout=-1), "connect_timeout")):
        with pytest.raises(ValueError, match=name):
            Client(client.socket_path, **kw)
    with pytest.raises(ValueError, match="root is empty"):
        Client(client.socket_path, root="")  # before: the working directory
    with pytest.raises(ValueError, match="names no user"):  # before: a RuntimeError
        Client(client.socket_path, root="~nosuchuser-kvk/x")
    # Relative, as the socket: where it named then, not wherever the working
    # directory is at each load (before: kept relative).
    with Client(client.socket_path, root="rel") as other:
        assert other.root == Path.cwd() / "rel"
    for socket in ("", "ipc://"):
        with pytest.raises(ValueError, match="socket path is empty"):
            Client(socket)
    for timeout in (None, -1, float("nan"), float("inf"), 1e10):
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            client.flush(timeout=timeout)
    # Whole numbers of bytes and seconds in the types a caller has at hand.
    with Client(client.socket_path, max_inflight_bytes=4e9, timeout=np.int64(5),
                connect_timeout=np.float32(1)) as other:
        assert other.connected
    with Client(client.socket_path, max_inflight_bytes=np.int64(2**30)) as other:
        assert other.connected
    # Whole, though a float would round it (a review: refused).
    with Client(client.socket_path, max_inflight_bytes=np.int64(2**53 + 1)) as other:
        assert other.connected
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        Client(client.socket_path, timeout=1e10)  # before: OverflowError, thread left running


def test_wrong_model_and_corrupt_file_are_clean_misses(model, client: Client) -> None:
    tokens = prompt(20)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    assert client.save(FP, "corrupt", cache, tokens)
    got = client.load(FP, "corrupt")
    assert got is not None and got.path is not None
    # Another model's fingerprint never gets this file.
    assert client.load("other-model", "corrupt") is None
    with pytest.raises(kvkeeper.client.reader.CacheFileError, match="model"):
        kvkeeper.read_cache_file(got.path, model="other-model")
    # Flip one data byte: the checksum catches what safetensors readers accept.
    data = bytearray(got.path.read_bytes())
    data[-3] ^= 0x40
    got.path.write_bytes(bytes(data))
    with safe_open(str(got.path), "numpy") as f:
        assert f.keys()  # the oracle still opens it
    assert client.load(FP, "corrupt", verify=False) is not None  # unchecked, it is served
    assert client.load(FP, "corrupt") is None
    # The bad file was moved aside by the daemon, so it is never served again.
    assert not got.path.exists()
    moved = list((client.root / "quarantine").iterdir())
    assert len(moved) == 1 and moved[0].read_bytes() == bytes(data)
    assert client.stats()["files_quarantined"] == 1
    assert client.load(FP, "corrupt", verify=False) is None


def test_a_save_dropped_for_a_daemon_that_does_not_answer_says_it_may_be_there(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A daemon stopped (SIGSTOP) or hung: a new client's save was dropped as
    "no kvkeeper daemon at <socket>", which read as if nothing ran there (a
    review)."""
    from kvkeeper.client.channel import RETURN_GRACE

    sock = short_dir / "run" / "kv.sock"
    proc = serve_process(short_dir / "root", sock)
    try:
        proc.send_signal(signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="kvkeeper"):
            kv = Client(sock, timeout=WAIT, connect_timeout=0.2)
            try:
                assert not kv.connected
                # Past the grace a new client gives a socket something listens on.
                time.sleep(RETURN_GRACE + 0.2)
                assert kv.save("m", "k", filled(0.1, 1), [1]) is False
            finally:
                kv.close(0)
        said = [r.getMessage() for r in caplog.records if "reason=daemon_down" in r.getMessage()]
        assert len(said) == 1 and f"no kvkeeper daemon connected at {sock}" in said[0] \
            and "or it does not answer" in said[0], said
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_process(proc) == 0


def test_daemon_down_save_drops_fast_and_load_reads_the_file(model, short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    tokens = prompt(50)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    rd = start_daemon(root, sock)
    kv = Client(sock, timeout=WAIT)
    try:
        assert kv.save(FP, "offline", cache, tokens)
        assert kv.flush(timeout=WAIT)
        rd.stop()
        deadline = time.monotonic() + WAIT
        while kv.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not kv.connected
        t0 = time.perf_counter()
        assert kv.save(FP, "offline", cache, tokens) is False
        assert time.perf_counter() - t0 < 1.0  # no waiting on a dead daemon
        got = kv.load(FP, "offline")  # straight from the file
        assert got is not None and got.token_ids == tokens
        np.testing.assert_array_equal(next_logits(model, got.cache, 1),
                                      next_logits(model, cache, 1))
        with pytest.raises(DaemonUnavailable):
            kv.flush(timeout=1)
        # The daemon comes back: the same client reconnects by itself.
        rd = start_daemon(root, sock)
        deadline = time.monotonic() + WAIT
        while not kv.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kv.save(FP, "offline", cache, tokens + [1])
        assert kv.flush(timeout=WAIT)
        assert kv.load(FP, "offline").token_ids == tokens + [1]  # type: ignore[union-attr]
    finally:
        kv.close()
        if rd.thread.is_alive():
            rd.stop()


def test_client_without_any_daemon(short_dir: Path) -> None:
    t0 = time.perf_counter()
    with Client(short_dir / "none.sock", root=short_dir / "root", connect_timeout=0.2) as kv:
        assert not kv.connected
        c = KVCache()
        x = mx.zeros((1, 1, 3, 8))
        c.update_and_fetch(x, x)
        assert kv.save(FP, "x", [c], [1]) is False
        assert kv.load(FP, "x") is None
    assert time.perf_counter() - t0 < 5


def test_a_relative_kvkeeper_root_names_the_directory_it_was_read_in(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read from whatever directory was current at each load (Client(root=)
    # and the socket were made absolute): a process that changed directory
    # missed every entry while the daemon was down.
    root, sock = short_dir / "root", short_dir / "kv.sock"
    c = KVCache()
    x = mx.arange(24, dtype=mx.float32).reshape(1, 1, 3, 8)
    c.update_and_fetch(x, x)
    rd = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "rel", [c], [1, 2, 3])
            assert kv.flush(timeout=WAIT)
    finally:
        rd.stop()
    (short_dir / "elsewhere").mkdir()
    monkeypatch.chdir(short_dir)
    monkeypatch.setenv("KVKEEPER_ROOT", "root")
    with Client(sock, connect_timeout=0.2, timeout=WAIT) as kv:
        # Not read before the move: with a socket given, the root is first
        # read at the first load (a review: /elsewhere/root then).
        monkeypatch.chdir(short_dir / "elsewhere")
        got = kv.load(FP, "rel")
        assert got is not None and got.token_ids == [1, 2, 3]
        assert kv.root == root
    # Named by the environment before the client is made, with no socket
    # given: taken where the Client was made, too.
    monkeypatch.chdir(short_dir)
    monkeypatch.setenv("KVKEEPER_SOCKET", str(sock))
    with Client(connect_timeout=0.2, timeout=WAIT) as kv:
        monkeypatch.chdir(short_dir / "elsewhere")
        assert kv.root == root
        assert kv.load(FP, "rel") is not None


def test_loads_with_no_daemon_and_no_store_say_where_they_looked(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every load was a silent miss: the client read the default root, which
    # was not there, and said nothing.
    monkeypatch.delenv("KVKEEPER_ROOT", raising=False)
    monkeypatch.setenv("KVKEEPER_CONFIG", str(short_dir / "none.toml"))
    (short_dir / "none.toml").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(short_dir / "cache"))
    monkeypatch.setenv("HOME", str(short_dir / "home"))  # macOS: ~/Library/Caches
    caplog.set_level(logging.WARNING, logger="kvkeeper.client")
    with Client(short_dir / "none.sock", connect_timeout=0.2) as kv:
        for _ in range(3):
            assert kv.load(FP, "x") is None
        where = kv.root
    said = [r.getMessage() for r in caplog.records if "no store at" in r.getMessage()]
    assert len(said) == 1 and str(where) in said[0], caplog.text
    assert "the root the daemon would use" in said[0], said
    # A root given, missing or a directory that holds no store (a models
    # directory): the second was a silent miss, and the first's line said
    # the root was the daemon's.
    (short_dir / "models").mkdir()
    for given in (short_dir / "missing", short_dir / "models"):
        caplog.clear()
        with Client(short_dir / "none.sock", root=given, connect_timeout=0.2) as kv:
            for _ in range(2):
                assert kv.load(FP, "x") is None
        said = [r.getMessage() for r in caplog.records if "no store at" in r.getMessage()]
        assert len(said) == 1 and f"no store at {given} to read instead (given as " \
            f"Client(root=...))" in said[0], caplog.text


def test_a_root_this_user_cannot_enter_is_a_miss_not_an_error(short_dir: Path) -> None:
    """With the daemon down, a load looked for the root's sessions/ to say
    "no store": in a root this user may not enter, is_dir() raised
    PermissionError out of load() (Python before 3.14)."""
    from .faultkit import NO_DAC, need_linux_root

    need_linux_root()
    shut = short_dir / "shut"
    (shut / "sessions").mkdir(parents=True)
    shut.chmod(0)
    script = ("import sys; from kvkeeper import Client\n"
              "with Client(sys.argv[1], root=sys.argv[2], connect_timeout=0.2) as kv:\n"
              "    print(kv.load('m', 'x'))\n")
    r = subprocess.run([*NO_DAC, sys.executable, "-c", script, str(short_dir / "none.sock"),
                        str(shut)], capture_output=True, text=True, timeout=WAIT)
    shut.chmod(0o700)
    assert r.returncode == 0 and r.stdout == "None\n", (r.stdout, r.stderr)
    assert "no store at" not in r.stderr, r.stderr


def test_the_daemon_moving_a_damaged_file_is_logged_with_its_own_root(
        daemon: RunningDaemon, short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Client(root=X) while the daemon serves another root: the daemon moves
    the file into its own quarantine/, which the line must name."""
    with Client(daemon.socket, root=short_dir, timeout=WAIT) as kv:
        assert kv.save(FP, "bad", filled(0.01, 1), [1]) and kv.flush(timeout=WAIT)
        path = entry_path(daemon.root, "bad", model=FP)
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        with caplog.at_level(logging.INFO, logger="kvkeeper.client"):
            assert kv.load(FP, "bad") is None
    moved = [r for r in caplog.records if "event=moved_aside" in r.getMessage()]
    assert len(moved) == 1 and str(daemon.root / "quarantine") in moved[0].getMessage(), \
        caplog.text
    assert [p.name for p in (daemon.root / "quarantine").iterdir()] != []


def test_a_root_given_with_a_tilde_is_the_home_one(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Client(root="~/...")`` reads under the home directory, as
    ``socket="~/..."`` and ``--root ~/...`` do (before: a relative path
    named "~" under the working directory, where it found nothing)."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    c = KVCache()
    x = mx.ones((1, 1, 3, 8))
    c.update_and_fetch(x, x)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            assert kv.save(FP, "tilde", [c], [1, 2, 3])
            assert kv.flush(timeout=WAIT)
    finally:
        assert rd.stop() == 0
    monkeypatch.setenv("HOME", str(short_dir))
    with Client(rd.socket, root="~/root", connect_timeout=0.2) as kv:
        assert not kv.connected
        assert kv.root == short_dir / "root"
        got = kv.load(FP, "tilde")
        assert got is not None and got.token_ids == [1, 2, 3]


def test_pending_bytes_budget_refuses_and_counts(short_dir: Path) -> None:
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock",
                      max_pending_bytes=4 * 1024 * 1024)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            ok = KVCache()
            x = mx.zeros((1, 2, 256, 64), dtype=mx.bfloat16)
            ok.update_and_fetch(x, x)
            big = KVCache()
            y = mx.zeros((1, 8, 1024, 128), dtype=mx.bfloat16)  # 2 x 2 MiB > 4 MiB budget?
            big.update_and_fetch(y, y)
            big.update_and_fetch(y[..., :1, :], y[..., :1, :])
            assert kv.save(FP, "fits", [ok], [1]) is True
            assert kv.save(FP, "too-big", [big], [1]) is False  # refused by the client itself
            assert kv.flush(timeout=WAIT) is True
            stats = kv.stats()
            assert stats["saves_written"] == 1 and stats["client_saves_dropped"] == 1
    finally:
        rd.stop()


def test_serve_subprocess_round_trip_and_sigterm_drain(model, short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        # A second daemon on the same root exits non-zero, naming the first.
        second = serve_process_fails(root, short_dir / "run" / "other.sock")
        assert second.returncode == 2
        assert f"pid {proc.pid}" in second.stderr.decode()
        tokens = prompt(64)
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        with Client(sock, timeout=WAIT) as kv:
            for i in range(5):
                assert kv.save(FP, f"drain-{i}", cache, tokens)
            kv.close()  # hands everything over, no flush
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
        assert not sock.exists()
        expected = next_logits(model, cache, 2)
        for i in range(5):
            got = kvkeeper.read_cache_file(
                next((root / "sessions").glob("*")) / f"drain-{i}.safetensors", model=FP)
            np.testing.assert_array_equal(next_logits(model, got.cache, 2), expected)
            with safe_open(str(got.path), "numpy") as f:
                assert f.metadata()["kvkeeper.cache_id"] == f"drain-{i}"
        assert not [p for p in root.rglob("*.tmp")]
        assert (os.stat(root).st_mode & 0o777) == 0o700
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)


def serve_process_fails(root: Path, sock: Path):  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "kvkeeper.cli", "serve", "--root", str(root), "--socket", str(sock)],
        capture_output=True, timeout=WAIT,
    )


def _address(a: mx.array) -> int:
    mx.eval(a)
    view = np.asarray(memoryview(a))  # a bare view: MLX does not count it as sharing
    addr = view.__array_interface__["data"][0]
    del view
    return addr


def test_after_a_save_is_sent_the_cache_updates_in_place(client: Client) -> None:
    """Once its bytes are handed over, a save holds nothing of the cache, so the
    next decode step writes in place instead of copying the whole cache."""
    c = KVCache()
    x = mx.ones((1, 2, 10, 8), dtype=mx.float32)
    c.update_and_fetch(x, x)
    one = mx.zeros((1, 2, 1, 8), dtype=mx.float32)

    # Control: while something holds a second handle, MLX copies on update.
    held = c.keys[..., :10, :]
    mx.eval(held)
    before = _address(c.keys)
    c.update_and_fetch(one, one)
    assert _address(c.keys) != before
    del held

    assert client.save(FP, "inplace", [c], list(range(11)))
    assert client.flush(timeout=WAIT)
    deadline = time.monotonic() + WAIT
    while client.stats()["client_inflight_bytes"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = _address(c.keys)
    c.update_and_fetch(one, one)
    assert _address(c.keys) == before, "the sent save still shares the cache's buffer"


def test_a_load_waits_for_a_stalled_daemon_one_timeout_in_all(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A load that has to ask who the daemon is (it reconnected), then for the
    file, then to move the damaged file aside, gave each of those requests the
    whole timeout: three timeouts against a stalled daemon. It gets one."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        kv = Client(sock, timeout=1.0, connect_timeout=WAIT)
        try:
            assert kv.save(FP, "a", filled(1, 3), [1, 2, 3])
            assert kv.flush(WAIT)
            assert stop_process(proc) == 0
            path = entry_path(root, "a", model=FP)
            with open(path, "r+b") as f:  # one bit of the last tensor
                f.seek(-1, os.SEEK_END)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([byte ^ 1]))
            proc = serve_process(root, sock)

            def answered() -> bool:  # the first daemon is gone: the new one answers
                try:
                    kv.stats()
                except DaemonUnavailable:
                    return False
                return True

            wait_for(answered, "the client to reach the new daemon")
            proc.send_signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with caplog.at_level(logging.INFO, logger="kvkeeper.client"):
                    assert kv.load(FP, "a") is None
                took = time.monotonic() - t0
            finally:
                proc.send_signal(signal.SIGCONT)
            assert took < 2.0, f"load() took {took:.2f} s with a 1 s timeout"
            assert "event=quarantine_requested" in caplog.text  # not "not done"
            assert "event=quarantine_not_done" not in caplog.text
            # The requests went out all the same: once it runs again, the
            # daemon moves the file aside.
            wait_for(lambda: not path.exists(), "the damaged file to be moved aside")
            assert len(list((root / "quarantine").iterdir())) == 1
        finally:
            kv.close()
    finally:
        assert stop_process(proc) == 0


def test_with_no_daemon_a_store_open_to_others_is_not_read(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """serve refuses a root others can write in (any user could plant a file
    under a key there); with the daemon down, the client read it all the
    same, and returned what it found."""
    root, sock = short_dir / "root", short_dir / "kv.sock"
    d = start_daemon(root, sock)
    with Client(sock, root=root, timeout=WAIT, connect_timeout=0.2) as kv:
        assert kv.save(FP, "x", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
        assert d.stop() == 0
        wait_for(lambda: not kv.connected, "the client to see the daemon go")
        got = kv.load(FP, "x")
        assert got is not None and got.token_ids == [1]  # ours, private: read
        root.chmod(0o777)
        caplog.set_level(logging.WARNING, logger="kvkeeper.client")
        for _ in range(2):
            assert kv.load(FP, "x") is None
    said = [r.getMessage() for r in caplog.records if "not reading the store" in r.getMessage()]
    assert len(said) == 1 and "has mode 777" in said[0], caplog.text
