"""Behaviour no other test pinned down, found by mutation testing (each test
fails when the check it names is removed from the code): read-your-writes
across a load racing a newer save, quarantined files evicted first, another
id's file never served, a cache this process cannot import kept, a client
root elsewhere never read, every use kept in the eviction order across
a restart, a checksum table that leaves out a tensor, a layers
description that gives a tensor another shape of the same size, a
save whose rename fails, and an mlx-lm ChunkedKVCache trimmed at the front
saved without its spare rows. A second review (server, write-behind,
integrations, settings, naming, ops): requests given back to the daemon's
waiting limit, a flush counting saves sent during an earlier one, the
write-behind's intervals, final saves and retries, caches whose front was
dropped or of another layer count not reused, negative sizes, ids that
would be hidden file names, verify not counting as a use, an import the
daemon could not write failing, evictions at start counted, and a text
prompt that starts with BOS tokenized as mlx-lm does."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kvkeeper.client.client import Client
from kvkeeper.daemon.faults import ENV
from kvkeeper.protocol import safetensors as st

from .conftest import WAIT, RunningDaemon, serve_process, start_daemon, stop_process
from .faultkit import FP, MiB, entry_path, filled, rewrite_header


def _version(got) -> int:  # noqa: ANN001
    assert got is not None
    return got.token_ids[0]


def test_a_load_racing_a_newer_save_leaves_it_unsettled(short_dir: Path) -> None:
    """A load must not mark the key settled past a newer save of it made
    while it waited: the next load read the file, an older version."""
    sock = short_dir / "run" / "kv.sock"
    proc = serve_process(short_dir / "root", sock, "--min-write-interval", "0",
                         env={ENV: "write_delay=0.5"})
    try:
        with Client(sock, timeout=WAIT, min_send_interval=60) as kv:
            assert kv.save(FP, "k", filled(1, 1), [1])
            out: list = []
            t = threading.Thread(target=lambda: out.append(kv.load(FP, "k")))
            t.start()
            time.sleep(0.15)  # the load waits for v1's slow write
            assert kv.save(FP, "k", filled(0.01, 2), [2])  # held in the client
            t.join(WAIT)
            assert not t.is_alive() and _version(out[0]) in (1, 2)
            # Read-your-writes: v2 was saved through this client.
            assert _version(kv.load(FP, "k")) == 2
    finally:
        stop_process(proc)


def test_quarantined_files_go_first_under_the_budget(short_dir: Path) -> None:
    """A file moved aside is evicted before any entry (and is indexed as such)."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock",
                      max_disk_bytes=int(3.5 * MiB))
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for name in ("a", "b"):
                assert kv.save(FP, name, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            p = entry_path(rd.root, "b")
            data = bytearray(p.read_bytes())
            data[-100] ^= 1
            p.write_bytes(bytes(data))
            assert kv.load(FP, "b") is None  # moved aside
            assert len(list((rd.root / "quarantine").iterdir())) == 1
            for name in ("c", "d"):
                assert kv.save(FP, name, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            assert {e.cache_id for e in kv.entries()} == {"a", "c", "d"}
            assert list((rd.root / "quarantine").iterdir()) == []
    finally:
        rd.stop()


def test_a_file_holding_another_id_is_a_miss(short_dir: Path) -> None:
    """The file at b's place that holds cache a is never served for b."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for v, name in enumerate(("a", "b"), 1):
                assert kv.save(FP, name, filled(0.1, v), [v]) and kv.flush(timeout=WAIT)
            tmp = entry_path(rd.root, "b").with_name("x.tmpcopy")
            shutil.copyfile(entry_path(rd.root, "a"), tmp)
            os.rename(tmp, entry_path(rd.root, "b"))
            assert kv.load(FP, "b", verify=False) is None
    finally:
        rd.stop()


def test_an_unimportable_class_is_a_miss_not_moved_aside(short_dir: Path) -> None:
    """A sound file of a class this process cannot import is kept for those
    that can (its report is answered before load() returns)."""
    import mlx_vlm.models.cache as vc
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            c = vc.KVCache()
            x = mx.ones((1, 2, 4, 8))
            c.update_and_fetch(x, x)
            assert kv.save(FP, "v", [c], [1]) and kv.flush(timeout=WAIT)
            code = ("import sys; sys.modules['mlx_vlm'] = None\n"
                    "from kvkeeper import Client\n"
                    f"kv = Client({str(rd.socket)!r}, timeout=30)\n"
                    f"print(kv.load({FP!r}, 'v'))\n"
                    "kv.close()\n")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=WAIT, env={**os.environ})
            assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
            assert entry_path(rd.root, "v").exists()
            assert kv.stats()["files_quarantined"] == 0
    finally:
        rd.stop()


def test_a_client_root_elsewhere_never_serves_its_files(short_dir: Path) -> None:
    """With Client(root=...) not the daemon's root, loads go by the daemon."""
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock")
    other = short_dir / "other"
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            assert kv.save(FP, "k", filled(0.1, 1), [1]) and kv.flush(timeout=WAIT)
            stale = entry_path(other, "k")
            stale.parent.mkdir(parents=True)
            shutil.copyfile(entry_path(rd.root, "k"), stale)
            assert kv.save(FP, "k", filled(0.1, 2), [2]) and kv.flush(timeout=WAIT)
        with Client(rd.socket, timeout=WAIT, root=other) as kv:
            assert _version(kv.load(FP, "k")) == 2
            assert _version(kv.load(FP, "k", verify=False)) == 2
    finally:
        rd.stop()


def test_a_second_load_survives_a_restart_in_the_lru_order(short_dir: Path) -> None:
    """Every use goes to the file's atime (relatime skips a second read's):
    the eviction order after a restart follows the last use."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    rd = start_daemon(root, sock)
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            for name in ("a", "b", "c"):
                assert kv.save(FP, name, filled(1, 1), [1]) and kv.flush(timeout=WAIT)
            for name in ("a", "b", "a"):
                time.sleep(0.05)
                assert kv.load(FP, name) is not None
                kv.ping()  # the Used notice is handled before the ping's answer
    finally:
        assert rd.stop() == 0
    rd = start_daemon(root, sock, max_disk_bytes=int(1.5 * MiB))
    try:
        with Client(rd.socket, timeout=WAIT) as kv:
            assert {e.cache_id for e in kv.entries()} == {"a"}
    finally:
        rd.stop()


def _edit_metadata(path: Path, key: str, change) -> None:  # noqa: ANN001
    """Rewrite one metadata value of a file in place (tensor bytes unchanged)."""

    def edit(header: dict) -> None:
        meta = header["__metadata__"]
        meta[key] = json.dumps(change(json.loads(meta[key])))

    rewrite_header(path, edit)


def test_a_checksum_table_missing_a_tensor_is_a_clean_miss(client: Client,
                                                           daemon: RunningDaemon) -> None:
    """A table that leaves out one tensor: a verified load is a miss and the
    file is moved aside (with the coverage check gone: a KeyError out of
    load())."""
    assert client.save(FP, "k", filled(1, 7), [7]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "k")

    def drop_one(sums: dict) -> dict:
        sums["tensors"].pop(sorted(sums["tensors"])[0])
        return sums

    _edit_metadata(path, st.CHECKSUMS_KEY, drop_one)
    assert client.load(FP, "k") is None
    deadline = time.monotonic() + WAIT
    while os.path.lexists(path):
        assert time.monotonic() < deadline, "file was not moved aside"
        time.sleep(0.01)


def test_a_layers_description_of_another_shape_is_a_miss(client: Client,
                                                         daemon: RunningDaemon) -> None:
    """The layers JSON names a tensor with a shape of the same size as the
    file's (its last two dimensions swapped): restoring it would build a
    cache of the wrong geometry. Lazy and verified loads are misses (with the
    tensor table's shortcut taking any entry of that name: restored)."""
    assert client.save(FP, "k", filled(1, 7), [7]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "k")

    def swap(doc: dict) -> dict:
        ref = doc["layers"][0]["state"]["items"][0]
        assert ref["$"] == "tensor" and ref["shape"][-1] != ref["shape"][-2]
        ref["shape"][-2:] = ref["shape"][-1:-3:-1]
        return doc

    _edit_metadata(path, st.LAYERS_KEY, swap)
    for verify in (True, False):
        assert client.load(FP, "k", verify=verify) is None


def test_a_save_whose_rename_fails_leaves_no_entry_behind(client: Client,
                                                         daemon: RunningDaemon) -> None:
    """A directory at the entry's place makes the rename fail (EISDIR): the
    save fails and the index gains nothing (with the rename's outcome
    unchecked: a phantom entry listed and counted against the budget)."""
    assert client.save(FP, "other", filled(1, 1), [1]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "k")
    path.mkdir()
    before = client.stats()
    assert client.save(FP, "k", filled(1, 2), [2])
    assert client.flush(timeout=WAIT) is False
    after = client.stats()
    assert after["saves_failed"] == before.get("saves_failed", 0) + 1
    assert after["disk_used_bytes"] == before["disk_used_bytes"]
    assert "k" not in {e.cache_id for e in client.entries()}
    assert path.is_dir() and not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_a_chunked_cache_trimmed_at_the_front_saves_its_live_rows_only(
        client: Client, daemon: RunningDaemon) -> None:
    """mlx-lm's ChunkedKVCache keeps tokens start_position..offset at rows
    0..offset-start_position of a buffer grown 256 rows at a time: the file
    holds exactly those rows (with offset taken for the live length: 101 rows
    of 320, the last 36 of them spare), and the restored cache goes on as the
    original. (mlx-lm 0.31 and earlier trim by the buffer's size, and give the
    row count for the offset: saved whole with its offset, it too goes on as
    the original.)"""
    from mlx_lm.models.cache import ChunkedKVCache
    from safetensors import safe_open

    from .legacy_describe import MLX_LM_OLD_API

    layers = []
    for i in range(2):
        c = ChunkedKVCache(chunk_size=64)
        x = mx.random.normal((1, 2, 100, 16), key=mx.random.key(i)).astype(mx.bfloat16)
        c.update_and_fetch(x, x)
        c.maybe_trim_front()  # what the model does before each step
        y = mx.random.normal((1, 2, 1, 16), key=mx.random.key(10 + i)).astype(mx.bfloat16)
        c.update_and_fetch(y, y)
        if not MLX_LM_OLD_API:
            assert (c.offset, c.start_position, c.keys.shape[2]) == (101, 36, 320)
        layers.append(c)
    assert client.save(FP, "chunked", layers, list(range(101))) and client.flush(timeout=WAIT)
    with safe_open(str(entry_path(daemon.root, "chunked")), "numpy") as f:
        rows = {f.get_slice(name).get_shape()[2] for name in f.keys()}
    assert rows == ({64} if MLX_LM_OLD_API else {65})
    got = client.load(FP, "chunked")
    assert got is not None
    for old, new in zip(layers, got.cache, strict=True):
        assert (new.offset, new.start_position) == (old.offset, old.start_position)
        assert new.offset == 101
        z = mx.ones((1, 2, 1, 16), dtype=mx.bfloat16)
        for a, b in zip(old.update_and_fetch(z, z), new.update_and_fetch(z, z), strict=True):
            assert mx.array_equal(a, b).item()


# ---------------------------------------------------------------- second review: server,
# write-behind, integrations, settings, naming, ops (each fails with its mutant)


def _tiny_cache(n: int = 8):  # noqa: ANN202 - (cache, ids)
    from mlx_lm.models.cache import make_prompt_cache

    from .tiny import prefill, prompt, tiny_llama

    model = tiny_llama(seed=2)
    cache = make_prompt_cache(model)
    ids = prompt(n, seed=1)
    prefill(model, ids, cache)
    return model, cache, ids


def test_requests_that_waited_are_given_back_to_the_daemons_limit(
        daemon: RunningDaemon) -> None:
    """The daemon counts requests waiting for an answer against MAX_WAITING; one
    not given back when answered made a long-running daemon answer "busy" to
    everything once that many had ever waited."""
    from kvkeeper.daemon.server import MAX_WAITING
    from kvkeeper.protocol import messages as m

    from .conftest import dealers

    with dealers(daemon.socket, 1) as (s,):
        req = 0
        for _ in range(MAX_WAITING // 1000 + 2):
            for _ in range(1000):
                req += 1
                s.send(m.encode(m.ListEntries(v=m.PROTOCOL_VERSION, req=req)))
            for _ in range(1000):
                r = m.decode_reply(s.recv())
                assert isinstance(r, m.Entries), r


def test_a_flush_counts_saves_sent_while_an_earlier_flush_waited(short_dir: Path) -> None:
    """Flush 2 follows save 2: its answer must count save 2 written, not carry
    flush 1's tally (taken before save 2 arrived)."""
    from kvkeeper.protocol import messages as m

    from .conftest import dealers

    v = m.PROTOCOL_VERSION

    def save(s: object, n: int, cid: str, nbytes: int) -> None:
        s.send(m.encode(m.SaveBegin(v=v, save=n, model=FP, cache_id=cid,  # type: ignore[attr-defined]
                                    tensors=[m.TensorSpec("t", "U8", [nbytes])])))
        s.send_multipart([m.encode(m.SaveData(v=v, save=n, frames=1)),  # type: ignore[attr-defined]
                          bytes(nbytes)])

    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    proc = serve_process(root, sock, env={ENV: "write_delay=0.5"})  # 0.5 s per MiB
    try:
        with dealers(sock, 1) as (s,):
            save(s, 1, "big", 4 * MiB)  # about 2 s to write
            s.send(m.encode(m.Flush(v=v, req=1)))
            time.sleep(0.3)
            save(s, 2, "small", 1024)
            s.send(m.encode(m.Flush(v=v, req=2)))
            got = {}
            while len(got) < 2:
                r = m.decode_reply(s.recv())
                got[r.req] = r
            assert got[1].written >= 1 and got[2].written == 2, got
    finally:
        assert stop_process(proc) == 0


def test_every_seconds_counts_from_the_last_save(client: Client) -> None:
    _, cache, ids = _tiny_cache()
    wb = client.write_behind(FP, "secs", every_tokens=None, every_seconds=0.3)
    assert wb.step(cache, ids)
    time.sleep(0.35)
    # One save when the interval is over, then none until it is over again
    # (each step saved once it had been 0.3 s since the first).
    assert [wb.step(cache, ids) for _ in range(5)] == [True, False, False, False, False]
    wb.discard()


def test_close_saves_a_cache_grown_since_the_last_saved_step(client: Client) -> None:
    from .tiny import prefill

    model, cache, ids = _tiny_cache()
    wb = client.write_behind(FP, "grown", every_tokens=1, every_seconds=None)
    assert wb.step(cache, ids)
    prefill(model, [3], cache)
    assert wb.close(cache, ids + [3])
    assert client.flush(timeout=WAIT)
    got = client.load(FP, "grown")
    assert got is not None and got.token_ids == ids + [3]


def test_a_streaming_generator_closed_by_its_consumer_saves_its_last_state(
        client: Client) -> None:
    from .tiny import prefill

    model, cache, ids = _tiny_cache()

    def stream():  # noqa: ANN202 - a server's token stream
        with client.write_behind(FP, "gen", every_tokens=100, every_seconds=None) as wb:
            for t in range(5):
                prefill(model, [t + 1], cache)
                ids.append(t + 1)
                wb.step(cache, ids)
                yield t

    g = stream()
    next(g), next(g), next(g)
    g.close()  # GeneratorExit inside the with: a clean end, not an error
    assert client.flush(timeout=WAIT)
    got = client.load(FP, "gen")
    assert got is not None and got.token_ids == ids and len(ids) == 11


def test_write_behind_without_a_daemon_tries_once_per_interval_and_close_retries(
        short_dir: Path) -> None:
    from .tiny import prefill

    model, cache, ids = _tiny_cache()
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    with Client(sock, timeout=WAIT, connect_timeout=0.2) as kv:
        wb = kv.write_behind(FP, "outage", every_tokens=4, every_seconds=None)
        for i in range(10):
            prefill(model, [i + 1], cache)
            ids.append(i + 1)
            wb.step(cache, ids)
        # Down from the start: a try at the first step and every 4 after, not each step.
        assert wb.counters.dropped == 3, wb.counters
        wb.discard()
        wb = kv.write_behind(FP, "retry", every_tokens=None, every_seconds=None)
        assert not wb.save(cache, ids)  # dropped: no daemon
        rd = start_daemon(root, sock)
        try:
            deadline = time.monotonic() + WAIT
            while not kv.connected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert wb.close()  # the dropped save is tried again
            assert kv.flush(timeout=WAIT)
            got = kv.load(FP, "retry")
            assert got is not None and got.token_ids == ids
        finally:
            assert rd.stop() == 0


def test_a_cache_whose_front_was_dropped_is_not_trimmed_for_reuse() -> None:
    """mlx-vlm's BufferedRotatingKVCache says it is trimmable however much of
    its front it dropped: trimmed, it would hold the prefix without the
    window the model needs, and answer wrongly."""
    from mlx_vlm.models.cache import BufferedRotatingKVCache

    from kvkeeper.integrations import plan_reuse

    c = BufferedRotatingKVCache(max_size=8, buffer_size=2)
    for i in range(40):
        x = mx.full((1, 2, 1, 8), float(i))
        c.update_and_fetch(x, x)
    assert c.is_trimmable() and c.start_position > 0
    ids = list(range(40))
    plan = plan_reuse([c], ids, ids[:30] + [99])
    assert plan.action == "cold", plan


def _kv(ids: list[int]) -> mx.array:
    """Keys (or values) for ``ids``: one position each, a vector of its id."""
    return mx.concatenate([mx.full((1, 1, 1, 4), float(i)) for i in ids], axis=2)


def _fed(c: Any, ids: list[int], prefill: int = 0) -> Any:
    """``c`` fed ``ids``: the first ``prefill`` in one update, the rest one
    at a time (as decoding does)."""
    if prefill:
        c.update_and_fetch(_kv(ids[:prefill]), _kv(ids[:prefill]))
    for i in ids[prefill:]:
        c.update_and_fetch(_kv([i]), _kv([i]))
    return c


def _attended(c: Any, token: int) -> list[float]:
    """The ids of the positions ``c`` attends to when fed ``token``."""
    keys, _ = c.update_and_fetch(_kv([token]), _kv([token]))
    return sorted(keys[0, 0, :, 0].tolist())


@pytest.mark.parametrize("kind", ["buffered_keep", "ring"])
def test_a_ring_whose_slots_were_overwritten_is_not_trimmed_for_reuse(kind: str) -> None:
    """mlx-vlm's BufferedRotatingKVCache with keep > 0 (its start_position
    stays 0 when it wraps) and unlimited_ocr's RingSlidingKVCache (a KVCache,
    trimmable by inheritance) were trimmed back to a common prefix after
    their slots had been overwritten: the model then attended to 17, 18, 19
    in place of 14, 15, 16."""
    from mlx_vlm.models.cache import BufferedRotatingKVCache
    from mlx_vlm.models.unlimited_ocr.language import RingSlidingKVCache

    from kvkeeper.integrations import plan_reuse

    def make() -> Any:
        return (BufferedRotatingKVCache(max_size=8, keep=2) if kind == "buffered_keep"
                else RingSlidingKVCache(window_size=4))

    prefill = 0 if kind == "buffered_keep" else 10
    ids = list(range(20))
    plan = plan_reuse([_fed(make(), ids, prefill)], ids, ids[:17] + [99, 98])
    assert plan.action == "cold", plan
    # Before they wrap, a trim gives back the prefix a cache fed it holds.
    short = ids[:7] if kind == "buffered_keep" else ids[:10]
    c = _fed(make(), short, prefill)
    plan = plan_reuse([c], short, short[:5] + [99, 98])
    assert plan.action == "trim" and plan.reused == 5, plan
    assert _attended(c, 99) == _attended(_fed(make(), short[:5], min(prefill, 5)), 99)


def test_a_buffered_ring_past_its_size_that_dropped_nothing_is_trimmed() -> None:
    """mlx-vlm's BufferedRotatingKVCache (keep 0) fed 10 tokens at once
    with room for 8 still holds all 10 in order: a trim is exact, and went
    cold when the check only compared the offset with max_size."""
    from mlx_vlm.models.cache import BufferedRotatingKVCache

    from kvkeeper.integrations import plan_reuse

    ids = list(range(10))
    c = _fed(BufferedRotatingKVCache(max_size=8), ids, prefill=10)
    assert c.offset > c.max_size and c.start_position == 0
    plan = plan_reuse([c], ids, ids[:9] + [99])
    assert plan.action == "trim" and plan.reused == 9, plan
    assert _attended(c, 99) == _attended(_fed(BufferedRotatingKVCache(max_size=8), ids[:9],
                                              prefill=9), 99)
    # With keep > 0 it updates as a ring however many rows it holds: trimmed,
    # the same prompt again attended to 9 twice and lost 4.
    kept = _fed(BufferedRotatingKVCache(max_size=8, keep=2), ids, prefill=10)
    assert kept._idx >= kept.offset and kept.start_position == 0
    assert plan_reuse([kept], ids, ids).action == "cold"


def test_a_saved_conversation_of_another_layer_count_is_not_reused(client: Client) -> None:
    """mlx-lm's llama zips its layers with the cache: a restored cache with
    more layers than the model would be used, silently, and answer wrongly."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from kvkeeper.demo import word_tokenizer
    from kvkeeper.integrations import mlx_lm as kv_lm

    from .tiny import VOCAB, prompt, tiny_llama

    tok = TokenizerWrapper(word_tokenizer(VOCAB))
    p = prompt(30, seed=4)
    four = kv_lm.Session(client, "tiny", "layers", tiny_llama(seed=3), tok)
    four.generate(p, max_tokens=4)
    assert client.flush(timeout=WAIT)
    two_layers = tiny_llama(seed=3, layers=2)
    assert len(make_prompt_cache(two_layers)) != len(make_prompt_cache(four.model))
    other = kv_lm.Session(client, "tiny", "layers", two_layers, tok)
    other.generate(p + [5], max_tokens=2)
    assert other.last_plan is not None and other.last_plan.action == "cold"


def test_a_negative_size_in_the_config_is_refused(short_dir: Path) -> None:
    """max_disk_bytes = -1 passed through as a budget below zero: the daemon
    evicted every entry at start."""
    from kvkeeper.settings import SettingsError, resolve

    with pytest.raises(SettingsError, match="negative"):
        resolve({"max_disk_bytes": "-1"}, environ={})
    cfg = short_dir / "kv.toml"
    cfg.write_text('max_disk_bytes = "-1"\n')
    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "serve", "--config", str(cfg),
                        "--print-config"], capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 2 and "negative" in r.stderr, r.stderr


def test_ids_that_would_be_hidden_file_names_stay_entries_across_a_restart(
        short_dir: Path) -> None:
    """".", ".." and ".x" as ids: were their dots kept in the file name, the
    files would be hidden, and after a restart foreign (never listed, evicted
    or verified); ".." as a model would write into the root itself."""
    _, cache, ids = _tiny_cache(4)
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    for round_ in range(2):
        rd = start_daemon(root, sock)
        try:
            with Client(sock, timeout=WAIT) as kv:
                if round_ == 0:
                    for cid in (".", "..", ".x"):
                        assert kv.save("..", cid, cache, ids)
                    assert kv.flush(timeout=WAIT)
                got = {(e.model, e.cache_id) for e in kv.entries()}
                assert got == {("..", "."), ("..", ".."), ("..", ".x")}, got
        finally:
            assert rd.stop() == 0
    assert not [p for p in (root / "sessions").rglob("*") if p.name.startswith(".")]


def test_verify_does_not_count_as_a_use(client: Client, daemon: RunningDaemon) -> None:
    """The eviction order lives in the atime: a verify that touched it made
    every entry look just used after a restart."""
    _, cache, ids = _tiny_cache(4)
    assert client.save(FP, "v", cache, ids) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "v")
    os.utime(path, ns=(1_000_000_000, path.stat().st_mtime_ns))  # long ago
    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "verify", "--socket",
                        str(daemon.socket)], capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert path.stat().st_atime_ns == 1_000_000_000


def test_an_import_the_daemon_could_not_write_fails(client: Client, daemon: RunningDaemon) -> None:
    """A file the daemon could not write (a plain file where the model's
    directory goes) was reported imported, exit 0."""
    from kvkeeper.protocol import naming

    from .test_legacy import ROOT as LEGACY

    blocker = naming.entry_path(daemon.root, "lm", "kv").parent
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("in the way")
    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "import", "--socket",
                        str(daemon.socket), "--model", "lm",
                        str(LEGACY / "mlx-lm" / "kv.safetensors")],
                       capture_output=True, text=True, timeout=WAIT)
    assert r.returncode == 1 and "could not write it" in r.stdout, (r.stdout, r.stderr)
    # With the daemon's reason (before 0.2.9: "see its log").
    assert "lm is not a directory" in " ".join(r.stdout.split()), r.stdout
    assert client.entries() == []


def test_an_import_the_daemon_refused_says_why(short_dir: Path) -> None:
    """A file over the daemon's disk budget: import said only "the daemon
    could not write it (see its log)", and the client's line with the reason
    shows only with KVKEEPER_DEBUG, once a minute per code."""
    from .test_legacy import ROOT as LEGACY

    files = []
    for name in ("kv.safetensors", "rotating.safetensors"):
        files.append(short_dir / name)
        shutil.copy(LEGACY / "mlx-lm" / name, files[-1])
    rd = start_daemon(short_dir / "root", short_dir / "run" / "kv.sock",
                      max_disk_bytes=10_000)  # under either file
    try:
        r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "import", "--socket",
                            str(rd.socket), "--model", "lm", *map(str, files)],
                           capture_output=True, text=True, timeout=WAIT)
    finally:
        assert rd.stop() == 0
    said = " ".join(r.stdout.split())
    assert r.returncode == 1, (r.stdout, r.stderr)
    for f in files:
        assert f"not imported {f}: the daemon refused it: save of " in said, said
    assert said.count("exceeds max disk bytes (10000)") == 2, said


def test_evictions_at_start_are_counted(short_dir: Path) -> None:
    """A daemon restarted with a smaller disk budget evicts at start: its
    counters must say so."""
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    rd = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            for v in range(3):
                assert kv.save(FP, f"e{v}", filled(1, v), [v])
                assert kv.flush(timeout=WAIT)
            sizes = {e.cache_id: e.nbytes for e in kv.entries()}
    finally:
        assert rd.stop() == 0
    rd = start_daemon(root, sock, max_disk_bytes=sizes["e2"] + 1024)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert [e.cache_id for e in kv.entries()] == ["e2"]
            stats = kv.stats()
            assert stats["evictions"] == 2
            assert stats["bytes_evicted"] == sizes["e0"] + sizes["e1"]
    finally:
        assert rd.stop() == 0


def test_a_text_prompt_that_starts_with_bos_gets_no_second_one() -> None:
    """mlx-lm adds the BOS token to a text prompt only when the text does not
    start with it (a rendered chat template does): the session must tokenize
    the same, or its cache and answer differ from mlx-lm's."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import processors

    from kvkeeper.demo import word_tokenizer
    from kvkeeper.integrations import mlx_lm as kv_lm

    from .tiny import VOCAB, tiny_llama

    fast = word_tokenizer(VOCAB)
    bos = fast.convert_ids_to_tokens(1)
    fast._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, 1)])
    fast.bos_token = bos
    tok = TokenizerWrapper(fast)
    words = " ".join(fast.convert_ids_to_tokens(list(range(5, 25))))
    assert tok.encode(words)[:2] == [1, 5]  # BOS added to text without one
    text = f"{bos} {words}"
    model = tiny_llama(seed=3)
    session = kv_lm.Session(None, "tiny", "bos", model, tok)
    assert session.encode(text) == tok.encode(text, add_special_tokens=False)
    assert session.encode(text).count(1) == 1
    want = [r.token for r in stream_generate(model, tok, text, max_tokens=6)]
    assert session.generate(text, max_tokens=6) == want
