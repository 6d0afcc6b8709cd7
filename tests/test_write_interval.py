"""--min-write-interval: a cache saved again soon after a write is held, and only
its newest save is written; a flush, a load, a delete, memory pressure and
SIGTERM each end the wait. Files are read back with the safetensors package.
Held saves also show which loads skip the daemon (see the second part). The
clients of those parts send every save at once (min_send_interval=0); the
third part holds saves in the client instead."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from safetensors import safe_open

from kvkeeper.client.client import Client
from kvkeeper.protocol import naming
from kvkeeper.protocol.safetensors import TOKENS_KEY

from .conftest import WAIT, RunningDaemon, serve_process, start_daemon, stop_process, wait_for
from .faultkit import filled, version_of
from .tiny import greedy_decode, prefill, prompt, tiny_llama

FP = "tiny-llama-interval"
LONG = 60.0  # an interval no test outlasts: whatever ends a hold here is not the clock


@pytest.fixture(scope="module")
def versions() -> list[tuple[list, list[int]]]:
    """Four states of one conversation: (cache, token ids), each one token longer."""
    model = tiny_llama(seed=3)
    out = []
    for n in range(40, 44):
        tokens = prompt(n, seed=3)
        cache = make_prompt_cache(model)
        prefill(model, tokens, cache)
        out.append((cache, tokens))
    return out


def tokens_on_disk(root: Path, cache_id: str) -> list[int] | None:
    path = naming.entry_path(root, FP, cache_id)
    if not path.exists():
        return None
    with safe_open(str(path), "numpy") as f:
        return json.loads(f.metadata()[TOKENS_KEY])


def save_then_hold(kv: Client, root: Path, versions: list, cache_id: str = "c") -> None:
    """Version 0 is written at once (no earlier write); 1-3 come within the interval."""
    assert kv.save(FP, cache_id, *versions[0])
    wait_for(lambda: tokens_on_disk(root, cache_id) == versions[0][1], "the first save")
    for cache, tokens in versions[1:]:
        assert kv.save(FP, cache_id, cache, tokens)
    wait_for(lambda: kv.stats()["saves_received"] == len(versions), "every save to arrive")
    wait_for(lambda: kv.stats()["held_saves"] == 1, "the newest save to be held")
    assert tokens_on_disk(root, cache_id) == versions[0][1]


@pytest.fixture
def holding(short_dir: Path, versions) -> Iterator[tuple[Path, Client]]:
    """A daemon with a long interval, its root, and a client whose cache "c" has
    version 0 on disk and version 3 held."""
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=LONG)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            save_then_hold(kv, d.root, versions)
            yield d.root, kv
    finally:
        d.stop()


def test_held_saves_coalesce_and_flush_writes_the_newest(holding, versions) -> None:
    root, kv = holding
    assert kv.flush(WAIT) is True  # a superseded save is not a failure
    assert tokens_on_disk(root, "c") == versions[-1][1]
    s = kv.stats()
    assert (s["saves_written"], s["saves_superseded"], s["held_saves"]) == (2, 2, 0)
    assert s["saves_held"] >= 1


def test_a_held_save_is_written_when_its_interval_ends(short_dir: Path, versions) -> None:
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=0.5)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.save(FP, "c", *versions[0])
            wait_for(lambda: tokens_on_disk(d.root, "c") == versions[0][1], "the first save")
            assert kv.save(FP, "c", *versions[1])
            # No flush, no load: only the end of the interval writes it.
            wait_for(lambda: tokens_on_disk(d.root, "c") == versions[1][1], "the held save")
            assert kv.stats()["saves_held"] == 1
    finally:
        d.stop()


def test_interval_zero_writes_every_save(short_dir: Path, versions) -> None:
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=0.0)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            for cache, tokens in versions:
                assert kv.save(FP, "c", cache, tokens)
                wait_for(lambda t=tokens: tokens_on_disk(d.root, "c") == t, "each save")
            assert kv.flush(WAIT) is True
            s = kv.stats()
            assert (s["saves_written"], s.get("saves_held", 0)) == (len(versions), 0)
    finally:
        d.stop()


@pytest.mark.parametrize("verify", [False, True])
def test_a_load_does_not_wait_for_the_interval(holding, versions, verify: bool) -> None:
    """Each kind of load, from a held save (not after another load ended the
    hold): it gets the newest version, written."""
    root, kv = holding
    assert kv.stats()["held_saves"] == 1
    got = kv.load(FP, "c", verify=verify)
    assert got is not None and got.token_ids == versions[-1][1]
    assert tokens_on_disk(root, "c") == versions[-1][1]


def test_a_delete_supersedes_a_held_save(holding) -> None:
    root, kv = holding
    assert kv.delete(FP, "c") is True
    assert kv.flush(WAIT) is True
    assert tokens_on_disk(root, "c") is None
    assert kv.load(FP, "c") is None
    s = kv.stats()
    assert (s["saves_written"], s["saves_superseded"], s["held_saves"]) == (1, 3, 0)


def test_saves_are_not_held_when_memory_is_short(short_dir: Path) -> None:
    # 8 MiB budget: the writer gets 6 (ZeroMQ a quarter), and a 4 MiB save is
    # more than half of that, so holding it could crowd out other saves.
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=LONG,
                     max_pending_bytes=8 << 20)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            for i in range(3):
                layer = KVCache()
                k = mx.full((1, 8, 1024, 128), i, dtype=mx.bfloat16)  # 2 MiB, keys and values
                layer.update_and_fetch(k, k)
                assert kv.save(FP, "big", [layer], [i])
                # Written without a flush or a load, long before the interval ends.
                wait_for(lambda i=i: tokens_on_disk(d.root, "big") == [i], f"save {i}")
                # Its bytes leave the budget just after the rename: a save sent
                # in between found 4 of 6 MiB still pending and was refused.
                wait_for(lambda: kv.stats()["pending_bytes"] == 0, "the budget to be free")
            assert kv.stats().get("saves_held", 0) == 0
    finally:
        d.stop()


def test_sigterm_writes_a_held_save(short_dir: Path, versions) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, "--min-write-interval", str(LONG))
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            save_then_hold(kv, root, versions)
            assert stop_process(proc) == 0
        assert tokens_on_disk(root, "c") == versions[-1][1]
    finally:
        stop_process(proc)


# ------------------------------------------------------------ loads that skip the daemon
# A load asks the daemon only when this client has a save of the key that no
# flush, load or delete has waited for; otherwise it reads the file itself and
# tells the daemon afterwards (``loads_direct``). A held save makes the
# difference visible: the file on disk is then older than the newest save.


def test_a_load_reads_directly_unless_this_client_has_a_save_pending(
        short_dir: Path, versions) -> None:
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=LONG)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as a, Client(d.socket, timeout=WAIT, min_send_interval=0) as b:
            assert a.save(FP, "c", *versions[0]) and a.flush(WAIT)
            assert a.load(FP, "c").token_ids == versions[0][1]
            assert (a.stats()["loads_direct"], a.stats().get("loads_found", 0)) == (1, 0)

            assert a.save(FP, "c", *versions[1])  # held: the file is still version 0
            assert a.load(FP, "c").token_ids == versions[1][1]  # asked, so written first
            assert a.stats()["loads_found"] == 1
            assert a.load(FP, "c").token_ids == versions[1][1]  # settled: direct again
            assert a.stats()["loads_direct"] == 2

            assert a.save(FP, "c", *versions[2])
            wait_for(lambda: a.stats()["held_saves"] == 1, "the save to be held")
            # Another client's pending save is seen once that client has flushed.
            assert b.load(FP, "c").token_ids == versions[1][1]
            assert a.flush(WAIT)
            assert b.load(FP, "c").token_ids == versions[2][1]
            assert b.stats()["loads_direct"] == 4  # b's notices come before its request
    finally:
        d.stop()


def test_a_client_reads_the_root_of_the_daemon_it_reconnected_to(
        short_dir: Path, versions) -> None:
    sock = short_dir / "kv.sock"
    first = start_daemon(short_dir / "root-1", sock)
    kv = Client(sock, timeout=WAIT, min_send_interval=0)
    try:
        assert kv.save(FP, "c", *versions[0]) and kv.flush(WAIT)
        first.stop()
        wait_for(lambda: not kv.connected, "the client to see the daemon go")
        second = start_daemon(short_dir / "root-2", sock)
        try:
            with Client(sock, timeout=WAIT, min_send_interval=0) as other:
                assert other.save(FP, "c", *versions[1]) and other.flush(WAIT)
            wait_for(lambda: kv.connected, "the client to reconnect")
            # Reading root-1 (where this client's daemon used to keep it) would
            # give version 0.
            got = kv.load(FP, "c")
            assert got is not None and got.token_ids == versions[1][1]
            assert got.path is not None and (short_dir / "root-2") in got.path.parents
        finally:
            second.stop()
    finally:
        kv.close()


def test_a_flush_waits_for_the_save_that_replaced_its_own(short_dir: Path, versions) -> None:
    # a's version 1 is held, then b's version 2 replaces it (and is held): a's
    # flush must answer for version 2, or a's next load would read version 0.
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=LONG)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as a, Client(d.socket, timeout=WAIT, min_send_interval=0) as b:
            save_then_hold(a, d.root, versions[:2])
            assert b.save(FP, "c", *versions[2])
            wait_for(lambda: b.stats()["saves_superseded"] == 1, "b's save to replace a's")
            assert a.flush(WAIT) is True
            assert tokens_on_disk(d.root, "c") == versions[2][1]
            assert a.load(FP, "c").token_ids == versions[2][1]
            assert b.flush(WAIT) is True
    finally:
        d.stop()


def test_memory_pressure_releases_held_saves(short_dir: Path, versions) -> None:
    # 8 MiB budget, 6 MiB of it the writer's: a 3.5 MiB save of another key
    # takes it past half, so the held save is written at once.
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=LONG,
                     max_pending_bytes=8 << 20)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            save_then_hold(kv, d.root, versions)
            assert kv.save(FP, "big", filled(3.5, 1, layers=1), [1])
            wait_for(lambda: tokens_on_disk(d.root, "c") == versions[-1][1], "the held save")
    finally:
        d.stop()


def test_large_saves_are_never_held(short_dir: Path) -> None:
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=LONG)
    try:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            for v in (1, 2):
                assert kv.save(FP, "big", filled(65, v, layers=1), [v])
                wait_for(lambda v=v: tokens_on_disk(d.root, "big") == [v], f"save {v}")
            assert kv.stats().get("saves_held", 0) == 0
    finally:
        d.stop()


def test_an_older_daemon_is_always_asked(short_dir: Path, versions) -> None:
    # A daemon of another kvkeeper version (one that may not know the Used
    # notice) gets every load as a request.
    site = short_dir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import kvkeeper\nkvkeeper.__version__ = '0.1.0'\n")
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={"PYTHONPATH": str(site)})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            assert kv.ping().version == "0.1.0"
            assert kv.save(FP, "c", *versions[0]) and kv.flush(WAIT)
            assert kv.load(FP, "c").token_ids == versions[0][1]
            s = kv.stats()
            assert (s.get("loads_direct", 0), s["loads_found"]) == (0, 1)
    finally:
        stop_process(proc)


# ------------------------------------------------------------ the client's send interval
# Client(min_send_interval=S): a save of a cache this client sent less than S
# ago waits in the client, unsent, and a newer save replaces it. The daemons
# here write every save they receive (interval 0), so what reaches the disk
# is what the client sent.


@contextmanager
def writing_every_save(short_dir: Path) -> Iterator[RunningDaemon]:
    """A daemon that writes every save it receives at once (interval 0)."""
    d = start_daemon(short_dir / "root", short_dir / "kv.sock", min_write_interval=0.0)
    try:
        yield d
    finally:
        if d.thread.is_alive():
            d.stop()


@pytest.fixture
def sender(short_dir: Path, versions) -> Iterator[tuple[Path, Client]]:
    """A daemon writing every save at once, and a client with a long send
    interval whose cache "c" has version 0 on disk and version 3 waiting."""
    with writing_every_save(short_dir) as d:
        with Client(d.socket, timeout=WAIT, min_send_interval=LONG) as kv:
            assert kv.save(FP, "c", *versions[0])  # never sent before: goes at once
            wait_for(lambda: tokens_on_disk(d.root, "c") == versions[0][1], "the first save")
            for cache, tokens in versions[1:]:
                assert kv.save(FP, "c", cache, tokens)
            wait_for(lambda: kv.client_stats()["client_saves_coalesced"] == 2,
                     "versions 1 and 2 to be replaced in the client")
            s = kv.stats()
            assert (s["saves_received"], s["client_held_saves"]) == (1, 1)
            assert tokens_on_disk(d.root, "c") == versions[0][1]
            yield d.root, kv


def test_a_save_made_to_create_its_entry_goes_after_the_held_save_of_its_key(
        sender, versions) -> None:
    """save(create=True) while a save of the key is held: the client put the
    create save in the held one's place, the held save was never sent, and
    the create was refused against the older file (a review: the newer
    version lost, flush False)."""
    root, kv = sender
    assert kv.save(FP, "c", *versions[1], create=True)
    assert kv.flush(WAIT) is False  # the create refused: the key has a save
    assert tokens_on_disk(root, "c") == versions[3][1]  # the held save, sent first
    s = kv.stats()
    assert (s["client_saves_coalesced"], s["client_saves_refused"]) == (2, 1), s


def test_a_save_made_to_create_its_entry_after_a_delete_goes_after_the_held_save(
        sender, versions) -> None:
    """The key deleted, then saved (held: sent less than the interval ago),
    then saved with create=True: the held save is sent first and makes the
    entry; the create is refused (before: it replaced the held save, and
    was written in its place)."""
    root, kv = sender
    assert kv.save(FP, "n", *versions[0]) and kv.flush(WAIT)
    assert kv.delete(FP, "n") is True
    assert kv.save(FP, "n", *versions[1])  # held: "n" was sent a moment ago
    assert kv.save(FP, "n", *versions[2], create=True)
    assert kv.flush(WAIT) is False
    assert tokens_on_disk(root, "n") == versions[1][1]


def test_a_client_sends_one_save_per_interval_and_flush_sends_the_newest(sender,
                                                                         versions) -> None:
    root, kv = sender
    assert kv.load(FP, "other") is None  # another key's load leaves it waiting
    assert kv.stats()["client_held_saves"] == 1
    assert kv.flush(WAIT) is True
    assert tokens_on_disk(root, "c") == versions[-1][1]
    s = kv.stats()
    assert (s["saves_received"], s["saves_written"], s["client_held_saves"]) == (2, 2, 0)
    assert s["client_saves_sent"] == 2
    # Given back once ZeroMQ lets the frames go, which pyzmq tells from a
    # thread of its own: after the flush's answer, now and then (once in a
    # full run).
    wait_for(lambda: kv.stats()["client_inflight_bytes"] == 0, "the in-flight bytes back")


@pytest.mark.parametrize("verify", [False, True])
def test_a_load_sends_the_waiting_save_first(sender, versions, verify: bool) -> None:
    root, kv = sender
    got = kv.load(FP, "c", verify=verify)
    assert got is not None and got.token_ids == versions[-1][1]
    assert tokens_on_disk(root, "c") == versions[-1][1]
    assert kv.stats()["client_held_saves"] == 0


def test_a_delete_comes_after_the_waiting_save(sender) -> None:
    root, kv = sender
    assert kv.delete(FP, "c") is True
    assert kv.flush(WAIT) is True
    assert tokens_on_disk(root, "c") is None
    assert kv.stats()["client_held_saves"] == 0


def test_close_sends_the_waiting_save(short_dir: Path, versions) -> None:
    with writing_every_save(short_dir) as d:
        kv = Client(d.socket, timeout=WAIT, min_send_interval=LONG)
        assert kv.save(FP, "c", *versions[0])
        assert kv.save(FP, "c", *versions[1])
        kv.close()
        assert kv.client_stats()["client_saves_sent"] == 2
        wait_for(lambda: tokens_on_disk(d.root, "c") == versions[1][1], "the waiting save")


def test_a_waiting_save_goes_when_its_interval_ends(short_dir: Path, versions) -> None:
    with writing_every_save(short_dir) as d:
        with Client(d.socket, timeout=WAIT, min_send_interval=0.5) as kv:
            for cache, tokens in versions:
                assert kv.save(FP, "c", cache, tokens)
            # No flush, no load: only the end of the interval sends the newest.
            wait_for(lambda: tokens_on_disk(d.root, "c") == versions[-1][1], "the newest save")
            s = kv.stats()
            assert s["saves_received"] + s["client_saves_coalesced"] == len(versions)
            assert s["saves_received"] >= 2 and s["client_held_saves"] == 0


def test_what_the_client_sends_at_once(short_dir: Path, versions) -> None:
    # Interval 0; a save over 64 MiB; a save taking the in-flight budget past
    # half: each goes as it comes, with no flush.
    with writing_every_save(short_dir) as d:
        with Client(d.socket, timeout=WAIT, min_send_interval=0) as kv:
            for cache, tokens in versions:
                assert kv.save(FP, "c", cache, tokens)
            wait_for(lambda: kv.stats()["saves_received"] == len(versions), "every save")
        with Client(d.socket, timeout=WAIT, min_send_interval=LONG) as kv:
            for v in (1, 2):
                assert kv.save(FP, "big", filled(65, v, layers=1), [v])
                wait_for(lambda v=v: tokens_on_disk(d.root, "big") == [v], f"65 MiB save {v}")
        with Client(d.socket, timeout=WAIT, min_send_interval=LONG,
                    max_inflight_bytes=6 << 20) as kv:
            for v in (1, 2):
                assert kv.save(FP, "mid", filled(3.5, v, layers=1), [v])
                wait_for(lambda v=v: tokens_on_disk(d.root, "mid") == [v], f"3.5 MiB save {v}")
            assert kv.client_stats()["client_saves_coalesced"] == 0


def test_a_waiting_save_is_the_cache_as_it_was_at_save(short_dir: Path) -> None:
    """While a save waits in the client, decoding rewrites rows it holds in
    place; what is written is still the cache as it was at save()."""
    model = tiny_llama(seed=4)
    tokens = prompt(40, seed=4)
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    before = _rows(cache, 0, 40)
    with writing_every_save(short_dir) as d:
        with Client(d.socket, timeout=WAIT, min_send_interval=LONG) as kv:
            assert kv.save(FP, "iso", filled(0.1, 0, layers=1), [0])  # goes at once
            wait_for(lambda: tokens_on_disk(d.root, "iso") == [0], "the first save")
            assert kv.save(FP, "iso", cache, tokens)
            wait_for(lambda: kv.client_stats()["client_held_saves"] == 1, "the save to wait")
            for c in cache:
                c.trim(20)
            greedy_decode(model, cache, tokens[-1], 20)  # rewrites rows 20..39 in place
            assert not all(np.array_equal(a, b[..., 20:40, :])  # really rewritten
                           for a, b in zip(_rows(cache, 20, 40), before, strict=True))
            assert kv.flush(WAIT) is True
            assert tokens_on_disk(d.root, "iso") == tokens
            got = kv.load(FP, "iso")
            assert got is not None
            for a, b in zip(_rows(got.cache, 0, 40), before, strict=True):
                np.testing.assert_array_equal(a, b)


def _decode_step(cache: list) -> int:
    """What a decode step does to every layer's buffers; the MLX memory it took."""
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    before = mx.get_active_memory()
    for c in cache:
        c.keys[..., -1:, :] = 1
        c.values[..., -1:, :] = 1
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return mx.get_active_memory() - before


def _fresh(mib: float) -> tuple[list, int]:
    cache = filled(mib, 1)
    _decode_step(cache)  # the first update of a fresh cache copies half of it (MLX's doing)
    assert _decode_step(cache) == 0
    return cache, sum(c.keys.nbytes + c.values.nbytes for c in cache)


def _rewrite_held_rows(cache: list) -> None:
    for c in cache:  # rows the save holds, rewritten in place
        c.keys[..., :1, :] = 7
        c.values[..., :1, :] = 7
    mx.eval([c.keys for c in cache] + [c.values for c in cache])


def test_a_waiting_save_leaves_the_cache_its_buffers(short_dir: Path) -> None:
    """A save waiting in the client held MLX handles on the cache's buffers,
    so the next update of every layer copied its whole buffer on the
    generation loop's thread (MLX writes in place only into a buffer nothing
    else holds), and decoding a tiny model saving every 16 tokens ran 2-4%
    slower. A waiting save of up to 8 MiB now holds a copy of its bytes
    instead (here 6 MiB: the I/O thread's copy; see the next test for 4 MiB
    and less)."""
    cache, nbytes = _fresh(6)
    with writing_every_save(short_dir) as d:
        with Client(d.socket, timeout=WAIT, min_send_interval=LONG) as kv:
            assert kv.save(FP, "own", filled(0.1, 0, layers=1), [0])  # goes at once
            wait_for(lambda: tokens_on_disk(d.root, "own") == [0], "the first save")
            assert kv.save(FP, "own", cache, [1])
            wait_for(lambda: kv.client_stats()["client_held_saves"] == 1, "the save to wait")
            grew = _decode_step(cache)
            assert grew < nbytes // 8, f"the step took {grew} more bytes ({nbytes} cached)"
            _rewrite_held_rows(cache)
            assert kv.flush(WAIT) is True
    # Written as it was at save(): every element 1, none 7.
    assert version_of(naming.entry_path(d.root, FP, "own"), model=FP) == 1


def test_a_small_save_is_a_copy_from_the_start(short_dir: Path) -> None:
    """A capture of up to 4 MiB is a copy taken inside save(), so the
    cache's next update writes in place even while the save is on its way
    (here it stays there: the daemon is stopped). Before, the capture shared
    the buffers until the save was sent or copied on the I/O thread, which
    raced the next decode step."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock)
    try:
        cache, nbytes = _fresh(4)  # one 4 MiB message: sent without a copy
        with Client(sock, timeout=WAIT, min_send_interval=0) as kv:
            proc.send_signal(signal.SIGSTOP)
            try:
                assert kv.save(FP, "small", cache, [1])
                grew = _decode_step(cache)
                _rewrite_held_rows(cache)
            finally:
                proc.send_signal(signal.SIGCONT)
            assert grew < nbytes // 8, f"the step took {grew} more bytes ({nbytes} cached)"
            assert kv.flush(WAIT) is True
        assert version_of(naming.entry_path(root, FP, "small"), model=FP) == 1
    finally:
        assert stop_process(proc) == 0


def _rows(cache: list, start: int, end: int) -> list[np.ndarray]:
    """Rows start..end of every layer's keys and values, as raw bf16 bits."""
    out = []
    for layer in cache:
        for a in layer.state[:2]:
            out.append(np.array(a[..., start:end, :].view(mx.uint16)))
    return out


def test_a_waiting_save_is_counted_lost_when_the_daemon_is_gone(short_dir: Path,
                                                                 versions) -> None:
    with writing_every_save(short_dir) as d:
        kv = Client(d.socket, timeout=WAIT, min_send_interval=LONG)
        assert kv.save(FP, "c", *versions[0])
        wait_for(lambda: tokens_on_disk(d.root, "c") == versions[0][1], "the first save")
        assert kv.save(FP, "c", *versions[1])
        wait_for(lambda: kv.client_stats()["client_held_saves"] == 1, "the save to wait")
        d.stop()
        wait_for(lambda: not kv.connected, "the client to see the daemon go")
        kv.close()
        s = kv.client_stats()
        assert (s["client_saves_lost"], s["client_held_saves"]) == (1, 0)
        assert s["client_inflight_bytes"] == 0


def test_a_save_past_half_the_in_flight_budget_sends_the_waiting_ones(short_dir: Path,
                                                                      versions) -> None:
    with writing_every_save(short_dir) as d:
        with Client(d.socket, timeout=WAIT, min_send_interval=LONG,
                    max_inflight_bytes=6 << 20) as kv:
            assert kv.save(FP, "c", *versions[0])
            wait_for(lambda: tokens_on_disk(d.root, "c") == versions[0][1], "the first save")
            assert kv.save(FP, "c", *versions[1])
            wait_for(lambda: kv.client_stats()["client_held_saves"] == 1, "the save to wait")
            assert kv.save(FP, "big", filled(3.5, 1, layers=1), [1])
            wait_for(lambda: tokens_on_disk(d.root, "c") == versions[1][1], "the waiting save")


_EXIT_WITHOUT_CLOSE = """
import sys
import threading
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from kvkeeper import Client

kv = Client(sys.argv[1], timeout=30, min_send_interval=60)


def saves(pause):
    time.sleep(pause)
    for v in (1, 2):
        layer = KVCache()
        x = mx.full((1, 2, 8, 16), float(v), dtype=mx.bfloat16)
        layer.update_and_fetch(x, x)
        assert kv.save("tiny-llama-interval", "exit", [layer], [v] * 8)


if sys.argv[2] == "main":
    saves(0)
else:  # the main thread is done before a worker thread saves
    threading.Thread(target=saves, args=(0.5,)).start()
# No flush, no close: version 2 is still waiting out the interval.
"""


@pytest.mark.parametrize("saver", ["main", "worker"])
def test_a_normal_exit_sends_what_a_client_still_holds(short_dir: Path, saver: str) -> None:
    with writing_every_save(short_dir) as d:
        proc = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(d.socket), saver],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "save_lost" not in proc.stderr and "dropped" not in proc.stderr, proc.stderr
        wait_for(lambda: tokens_on_disk(d.root, "exit") == [2] * 8, "version 2")


def test_threads_sharing_a_client_read_their_writes_through_the_interval(
        short_dir: Path) -> None:
    """Four threads save their own cache 60 times each through one client with
    a 50 ms send interval, loading and flushing as they go: every load gets
    the thread's newest save, and every save is either sent or replaced."""
    errors: list[BaseException] = []
    saved = [0] * 4

    def work(kv: Client, n: int) -> None:
        try:
            key = f"t{n}"
            for v in range(1, 61):
                assert kv.save(FP, key, filled(0.05, v, layers=1), [v])
                saved[n] += 1
                if v % 10 == 0:
                    got = kv.load(FP, key, verify=v % 20 == 0)
                    assert got is not None and got.token_ids == [v], (key, v, got)
                if v % 15 == 0:
                    assert kv.flush(WAIT) is True
                time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    with writing_every_save(short_dir) as d:
        with Client(d.socket, timeout=WAIT, min_send_interval=0.05) as kv:
            threads = [threading.Thread(target=work, args=(kv, n)) for n in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT)
            assert not any(t.is_alive() for t in threads), "a thread hung"
            assert not errors, errors
            assert kv.flush(WAIT) is True
            for n in range(4):
                assert tokens_on_disk(d.root, f"t{n}") == [60]
            s = kv.stats()
            assert s["saves_received"] + s["client_saves_coalesced"] == sum(saved) == 240
            assert s["client_saves_coalesced"] > 0 and s["client_held_saves"] == 0
            assert s["saves_written"] + s["saves_superseded"] == s["saves_received"]


def test_a_waiting_save_outlives_a_daemon_restart(short_dir: Path, versions) -> None:
    root, sock = short_dir / "root", short_dir / "kv.sock"
    d = start_daemon(root, sock, min_write_interval=0.0)
    try:
        with Client(sock, timeout=WAIT, min_send_interval=2.0) as kv:
            assert kv.save(FP, "c", *versions[0])
            sent = time.monotonic()
            wait_for(lambda: tokens_on_disk(root, "c") == versions[0][1], "the first save")
            assert kv.save(FP, "c", *versions[1])
            d.stop()
            wait_for(lambda: not kv.connected, "the client to see the daemon go")
            time.sleep(max(0.0, sent + 2.3 - time.monotonic()))  # past due, with no daemon
            assert kv.client_stats()["client_held_saves"] == 1
            # Meanwhile the I/O thread sleeps instead of spinning on the overdue
            # save (it spun: about 1 s of CPU a second).
            cpu = time.process_time()
            time.sleep(1.0)
            assert time.process_time() - cpu < 0.5
            d = start_daemon(root, sock, min_write_interval=0.0)
            wait_for(lambda: tokens_on_disk(root, "c") == versions[1][1], "the waiting save")
            s = kv.client_stats()
            assert (s["client_saves_lost"], s["client_held_saves"]) == (0, 0)
    finally:
        if d.thread.is_alive():
            d.stop()


_FORK_AND_EXIT = """
import os
import sys
import time

from kvkeeper import Client

kv = Client(sys.argv[1], timeout=30)
pid = os.fork()
if pid == 0:
    del kv  # dropped: the parent's to close, not the child's (no ResourceWarning)
    sys.exit(0)  # a normal exit: atexit handlers run, in a child without I/O threads
deadline = time.monotonic() + 3.0
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:
        sys.exit("the forked child hung at exit")
    time.sleep(0.01)
kv.close()
"""


def test_a_forked_child_exits_without_waiting_for_its_parents_channels(short_dir: Path) -> None:
    with writing_every_save(short_dir) as d:
        proc = subprocess.run([sys.executable, "-W", "always", "-c", _FORK_AND_EXIT,
                               str(d.socket)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "ResourceWarning" not in proc.stderr, proc.stderr


def test_closing_a_channel_from_two_threads_at_once(short_dir: Path, versions) -> None:
    # What an exit does when a thread is closing its client meanwhile (or a
    # dropped client's channel closes in the background): neither close()
    # returns before the channel is closed, or the process could end under
    # the one still sending.
    from kvkeeper import config
    from kvkeeper.client.channel import Channel

    with writing_every_save(short_dir) as d:
        channel = Channel(config.endpoint(d.socket), max_inflight_bytes=1 << 30)
        assert channel.connected.wait(WAIT)
        errors: list[BaseException] = []
        io_alive_after: list[bool] = []
        start = threading.Barrier(2)

        def close() -> None:
            start.wait(WAIT)
            try:
                channel.close()
                io_alive_after.append(channel._thread.is_alive())
            except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=close) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert not errors, errors
        assert io_alive_after == [False, False]
