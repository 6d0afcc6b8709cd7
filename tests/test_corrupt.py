"""Damaged files on disk are clean misses, moved aside (another program's
safetensors file is left alone); loads racing replaces always see a whole
version."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

import kvkeeper
from kvkeeper.client import reader
from kvkeeper.client.client import Client
from kvkeeper.client.reader import CacheFileError

from .conftest import WAIT, RunningDaemon, ping, start_daemon
from .faultkit import (
    FP,
    entry_path,
    filled,
    need_linux_root,
    resealed,
    rewrite_header,
    version_of,
)
from .test_cli_checks import cli


def truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size // 2)


def zero_fill(p: Path) -> None:
    p.write_bytes(bytes(p.stat().st_size))


def flip_bit(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-100] ^= 0x01
    p.write_bytes(bytes(data))


def huge_header(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    p.write_bytes(bytes(data))


def foreign(p: Path) -> None:
    p.unlink()
    tmp = p.with_name("x.safetensors")
    mx.save_safetensors(str(tmp), {"weight": mx.ones((4, 4))}, {"format": "pt"})
    tmp.rename(p)


def other_models_file(p: Path) -> None:
    # A copy of model B's file put where model A's entry should be.
    other = entry_path(p.parents[2], "victim", model="model-b")
    shutil.copyfile(other, p)


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


def string_offsets(p: Path) -> None:
    def change(header: dict) -> None:
        t = _first_tensor(header)
        t["data_offsets"] = [str(x) for x in t["data_offsets"]]
    rewrite_header(p, change)


def string_shape(p: Path) -> None:
    # "x" * 10**19 is what an unchecked product of this shape would compute.
    rewrite_header(p, lambda h: _first_tensor(h).update(shape=["x", 10**19]))


def bool_dim(p: Path) -> None:
    # True == 1: a check of values alone would take it for the first dimension.
    rewrite_header(p, lambda h: _first_tensor(h).update(shape=[True, *_first_tensor(h)["shape"][1:]]))


def float_offsets(p: Path) -> None:
    def change(header: dict) -> None:
        t = _first_tensor(header)
        t["data_offsets"] = [float(x) for x in t["data_offsets"]]
    rewrite_header(p, change)


def negative_dims(p: Path) -> None:
    # The same product, so the same byte count: MLX 0.32 builds such an array.
    def change(header: dict) -> None:
        t = _first_tensor(header)
        t["shape"] = [-t["shape"][0], -t["shape"][1], *t["shape"][2:]]
    rewrite_header(p, change)


def nested_header(p: Path) -> None:
    # msgspec gives up with RecursionError, not a DecodeError: it escaped load().
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = b'{"z":' + b"[" * 5000 + b"]" * 5000 + b"," + data[8 : 8 + n].lstrip()[1:]
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def nested_checksums(p: Path) -> None:
    # A valid header whose checksums entry is JSON 2000 deep: msgspec's
    # RecursionError escaped load() and verify, with a traceback (a review).
    from kvkeeper.protocol import safetensors as st

    def nest(header: dict) -> None:
        header["__metadata__"][st.CHECKSUMS_KEY] = "[" * 2000 + "]" * 2000

    rewrite_header(p, nest)


def _flip_in_header(p: Path, old: bytes, new: bytes) -> None:
    """Change bytes of the header in place, as a bad sector would: same length."""
    data = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    i = data.index(old, 8, 8 + n)
    data[i : i + len(old)] = new
    p.write_bytes(bytes(data))


def token_id_digit(p: Path) -> None:
    # The tensors' checksums pass: only the header's own checksum sees that
    # the cache now claims another conversation's tokens.
    _flip_in_header(p, b'"kvkeeper.token_ids":"[7]"', b'"kvkeeper.token_ids":"[9]"')


def format_name(p: Path) -> None:
    # Without the header's checksum: another program's file, which the daemon
    # never replaces (every later save of the key failed).
    _flip_in_header(p, b'"kvkeeper/1"', b'"kvkeeper/7"')


def metadata_key(p: Path) -> None:
    # The key's name damaged, the JSON whole: the metadata then read as none
    # (no cache's), and the file was taken for another program's, never
    # moved aside or replaced, and every later save of the key failed.
    _flip_in_header(p, b'"__metadata__"', b'"__letadata__"')


def layer_class(p: Path) -> None:
    # The layers' description names a class no module has: a lazy load, which
    # skips the checksums, took the file for one this process cannot rebuild
    # (a newer kvkeeper's), and left it in place: a miss at every load.
    _flip_in_header(p, b'\\"class\\":\\"KVCache\\"', b'\\"class\\":\\"KVCachf\\"')


def tensor_named_twice(p: Path) -> None:
    # One bit ("t1" to "t0"): layer 0's values were its keys, served by a
    # lazy load (which skips the header's checksum) with no error (a review).
    _flip_in_header(p, b'\\"name\\":\\"t1\\"', b'\\"name\\":\\"t0\\"')


def tensor_named_nowhere(p: Path) -> None:
    # Written again with one more tensor, which no layer names.
    arrays, metadata = mx.load(str(p), return_metadata=True)
    mx.save_safetensors(str(p), {**arrays, "t999": mx.zeros((4,))}, metadata=metadata)


def directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


def symlink(p: Path) -> None:
    p.unlink()
    p.symlink_to(entry_path(p.parents[2], "victim", model="model-b"))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": truncate,
    "zero-filled": zero_fill,
    "flipped-bit": flip_bit,
    "header-2^40": huge_header,
    "another-models-file": other_models_file,
    "directory": directory,
    "symlink": symlink,
    "string-offsets": string_offsets,
    "string-shape": string_shape,
    "bool-dimension": bool_dim,
    "float-offsets": float_offsets,
    "negative-dimensions": negative_dims,
    "nested-header": nested_header,
    "nested-checksums": nested_checksums,
    "token-id-digit": token_id_digit,
    "format-name": format_name,
    "metadata-key": metadata_key,
    "layer-class": layer_class,
    "tensor-named-twice": tensor_named_twice,
    "tensor-named-nowhere": tensor_named_nowhere,
}


#: Headers that give the saved integers in other JSON types (1.0 for 1, true
#: for a dimension of 1): MLX reads the same layout from them, so a lazy load,
#: which leaves the layout to MLX's loader, serves them as saved (see
#: test_a_lazy_load_leaves_the_layout_to_mlx).
SAME_INTEGERS = ("float-offsets", "bool-dimension")


#: Damage only checksums can see (of the data, of the header), which a lazy
#: load skips.
CHECKSUMS_ONLY = ("flipped-bit", "token-id-digit", "format-name", "nested-checksums")


def _lazy_sees(kind: str) -> bool:
    return kind not in CHECKSUMS_ONLY and not (reader.MLX_CHECKS_OFFSETS and kind in SAME_INTEGERS)


# Lazy loads (verify=False) read the file while the daemon answers and report
# what they find damaged once the answer names it.
@pytest.mark.parametrize(("kind", "verify"), [(k, True) for k in sorted(DAMAGE)]
                         + [(k, False) for k in sorted(DAMAGE) if _lazy_sees(k)])
def test_damaged_file_is_a_clean_miss_and_moved_aside(
    kind: str, verify: bool, client: Client, daemon: RunningDaemon,
    caplog: pytest.LogCaptureFixture
) -> None:
    assert client.save(FP, "victim", filled(1, 7), [7])
    assert client.save("model-b", "victim", filled(1, 8), [8])
    assert client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "victim")
    DAMAGE[kind](path)
    caplog.set_level(logging.INFO, logger="kvkeeper")
    found = client.stats().get("loads_found", 0)
    assert client.load(FP, "victim", verify=verify) is None
    if kind in ("directory", "symlink"):  # the daemon's own look: not an entry it found
        assert client.stats().get("loads_found", 0) == found
    # Moved aside (by the daemon, the only writer), so it is never served again.
    deadline = time.monotonic() + WAIT
    while os.path.lexists(path):
        assert time.monotonic() < deadline, "damaged file was not moved aside"
        time.sleep(0.01)
    assert len(list((daemon.root / "quarantine").iterdir())) == 1
    if kind not in ("directory", "symlink"):  # those the daemon sees itself
        assert any("event=load_miss" in r.getMessage() for r in caplog.records)
    assert client.load(FP, "victim") is None
    assert ping(daemon.socket)
    # Model B's entry is untouched, and the key takes new saves.
    assert version_of(entry_path(daemon.root, "victim", model="model-b"), "model-b") == 8
    assert client.save(FP, "victim", filled(1, 9), [9])
    got = client.load(FP, "victim")
    assert got is not None and got.token_ids == [9]


@pytest.mark.parametrize("verify", [True, False])
def test_a_sound_file_naming_a_class_not_here_is_a_miss_left_in_place(
    verify: bool, client: Client, daemon: RunningDaemon
) -> None:
    """The other side of "layer-class": a file whose header checks out but
    names a cache class this process cannot import (a newer kvkeeper's, or
    a model package not installed here) is a miss, not damage, lazy or not:
    the file stays for a process that can read it."""
    from kvkeeper.protocol import safetensors as st

    assert client.save(FP, "future", filled(1, 7), [7]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "future")

    def from_the_future(header: dict) -> None:
        meta = header["__metadata__"]
        meta[st.LAYERS_KEY] = meta[st.LAYERS_KEY].replace("mlx_lm.models.cache",
                                                          "mlx_lm.models.future_cache")
        sums = json.loads(meta[st.CHECKSUMS_KEY])
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        sums["header"] = st.header_digest(meta, tensors)
        meta[st.CHECKSUMS_KEY] = json.dumps(sums)

    rewrite_header(path, from_the_future)
    written = path.read_bytes()
    with pytest.raises(CacheFileError, match="future_cache") as info:
        reader.read_cache_file(path, verify=verify)
    assert info.value.damaged is False
    assert client.load(FP, "future", verify=verify) is None
    client.gc()  # on the writer's turn: after any move the load asked for
    assert path.read_bytes() == written
    assert client.stats()["files_quarantined"] == 0


def _edited_and_refused(path: Path, change: Callable[[dict], object], vouched: bool,
                        said: str) -> bytes:
    """Edit ``path``'s header (its checksum redone if ``vouched``, as its
    writer would); check both reads refuse it: as damage unless vouched
    for, and then saying ``said``. Returns the file's bytes."""
    def edit(header: dict) -> None:
        change(header)
        if vouched:
            resealed(header)

    rewrite_header(path, edit)
    for verify in (True, False):
        with pytest.raises(CacheFileError) as info:
            reader.read_cache_file(path, verify=verify)
        assert info.value.damaged is not vouched, (verify, info.value)
        assert not vouched or said in str(info.value), (verify, info.value)
    return path.read_bytes()


def _left_in_place_or_moved_aside(client: Client, path: Path, written: bytes,
                                  vouched: bool) -> None:
    client.gc()  # on the writer's turn: after any move the loads asked for
    if vouched:
        assert path.read_bytes() == written
        assert client.stats()["files_quarantined"] == 0
    else:
        assert not path.exists() and client.stats()["files_quarantined"] == 1


def _to_f8(header: dict) -> None:
    """Tensor t0 (bf16) relabelled ``F8_E4M3``: the same bytes, one a
    value, twice as many; the layers' description says the same of it."""
    from kvkeeper.protocol import safetensors as st

    meta, t0 = header["__metadata__"], header["t0"]
    assert t0["dtype"] == "BF16"
    t0["dtype"], t0["shape"][-1] = "F8_E4M3", t0["shape"][-1] * 2
    layers = json.loads(meta[st.LAYERS_KEY])
    refs, found = [layers], 0
    while refs:
        node = refs.pop()
        if isinstance(node, dict) and node.get("$") == "tensor" and node["name"] == "t0":
            node["dtype"], node["shape"] = t0["dtype"], t0["shape"]
            found += 1
        refs.extend(node.values() if isinstance(node, dict)
                    else node if isinstance(node, list) else [])
    assert found == 1
    meta[st.LAYERS_KEY] = json.dumps(layers)


def _verify_json(daemon: RunningDaemon) -> dict:
    done = cli("verify", "--json", "--root", str(daemon.root), "--socket", str(daemon.socket))
    assert done.returncode == 1, (done.stdout, done.stderr)  # every case has a file to report
    return json.loads(done.stdout)


@pytest.mark.parametrize("vouched", [True, False])
def test_a_file_with_a_dtype_kvkeeper_lacks_is_damage_only_if_its_header_says_so(
    vouched: bool, client: Client, daemon: RunningDaemon
) -> None:
    """A tensor of a dtype this kvkeeper does not know (``F8_E4M3``, as a
    newer kvkeeper might write), its header's checksum passing: a miss that
    leaves the file in place, lazy or verified, and `verify` says it was not
    checked rather than bad (before: damaged, moved aside for every client).
    The same header with its checksum not redone is damage."""
    assert client.save(FP, "f8", filled(1, 7), [7]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "f8")
    written = _edited_and_refused(path, _to_f8, vouched, "F8_E4M3")
    # A check is not a use: the access time (the eviction order) stays.
    before = path.stat()
    os.utime(path, ns=(before.st_atime_ns - 3 * 86400 * 10**9, before.st_mtime_ns))
    atime = path.stat().st_atime_ns
    report = _verify_json(daemon)
    assert path.stat().st_atime_ns == atime
    if vouched:
        assert [r["path"] for r in report["could_not_read"]] == [str(path)], report
        assert "F8_E4M3" in report["could_not_read"][0]["reason"], report
        assert report["bad"] == [], report
    else:
        assert [b["path"] for b in report["bad"]] == [str(path)], report
    assert client.load(FP, "f8", verify=False) is None
    assert client.load(FP, "f8") is None
    _left_in_place_or_moved_aside(client, path, written, vouched)


def test_verify_reports_a_checksums_entry_nested_too_deep(
    client: Client, daemon: RunningDaemon
) -> None:
    """verify ended with msgspec's RecursionError and a traceback (a review)."""
    assert client.save(FP, "deep", filled(1, 7), [7]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "deep")
    nested_checksums(path)
    report = _verify_json(daemon)
    assert [(b["path"], "nested too deeply" in b["reason"]) for b in report["bad"]] == [
        (str(path), True)], report


@pytest.mark.parametrize("damage", ["cut short", "a data byte flipped", "another key's file"])
def test_a_file_with_a_dtype_kvkeeper_lacks_is_still_checked_for_damage(
    damage: str, client: Client, daemon: RunningDaemon
) -> None:
    """A header whose checksum passes does not vouch for the rest: the
    first version took the file as written as soon as the header's checksum
    passed, before the tensors were checked against the file's size, so a
    file cut short, one whose data failed its checksum, or another key's
    file passed for sound (a review). Each is damage now: verified (the
    data's checksums go by bytes), by verify, and moved aside by a load;
    a lazy load of the flipped byte, which reads no checksum, leaves it."""
    assert client.save(FP, "f8", filled(1, 7), [7]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "f8")
    def f8_resealed(header: dict) -> None:
        _to_f8(header)
        resealed(header)

    rewrite_header(path, f8_resealed)
    key = "f8"
    if damage == "cut short":
        truncate(path)
    elif damage == "a data byte flipped":
        flip_bit(path)
    else:
        key = "other"
        os.rename(path, entry_path(daemon.root, key))
        path = entry_path(daemon.root, key)
    lazy_sees = damage != "a data byte flipped"
    for verify in (True, False):
        with pytest.raises(CacheFileError) as info:
            reader.read_cache_file(path, verify=verify, model=FP, cache_id=key)
        assert info.value.damaged is (verify or lazy_sees), (verify, info.value)
    report = _verify_json(daemon)
    assert [b["path"] for b in report["bad"]] == [str(path)], report
    assert client.load(FP, key, verify=False) is None
    assert client.load(FP, key) is None
    _left_in_place_or_moved_aside(client, path, b"", vouched=False)


@pytest.mark.parametrize("vouched", [True, False])
def test_a_static_prefix_cache_padded_past_the_memory_is_refused_lazy_or_not(
    vouched: bool, client: Client, daemon: RunningDaemon
) -> None:
    """mlx-vlm's StaticPrefixKVCache comes back padded to its max_size. A
    max_size of 2**30 in the layers' description (a damaged header a lazy
    load does not check, or a sound file of a bigger machine's) made a
    lazy load return 256 GiB of zeros to be, whose first evaluation ended
    the process (SIGSEGV). Now refused: as damage when the header's
    checksum fails, else as what this machine cannot hold, left in place."""
    from mlx_vlm.models.cache import StaticPrefixKVCache

    from kvkeeper.protocol import safetensors as st

    c = StaticPrefixKVCache(max_size=32)
    rows = mx.ones((1, 2, 5, 64), dtype=mx.bfloat16)
    c.update_and_fetch(rows, rows)
    assert client.save(FP, "static", [c], [1, 2, 3, 4, 5]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "static")
    # Padded to its 32 rows, as saved. (Read here, not loaded: the daemon
    # would record that use in the file's times, maybe after the edit below,
    # putting back the mtime the move aside is then asked for.)
    got = reader.read_cache_file(path, verify=False)
    assert got.cache[0].keys.shape == (1, 2, 32, 64)

    def huge(header: dict) -> None:
        meta = header["__metadata__"]
        doc = json.loads(meta[st.LAYERS_KEY])
        items = doc["layers"][0]["meta_state"]["items"]
        assert items[0] == "32", items
        items[0] = str(2**30)
        meta[st.LAYERS_KEY] = json.dumps(doc)

    written = _edited_and_refused(path, huge, vouched, "more than this machine's memory")
    assert client.load(FP, "static", verify=False) is None
    _left_in_place_or_moved_aside(client, path, written, vouched)


def test_a_symlink_judged_at_a_load_spares_the_file_put_back(
    client: Client, daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that finds a symlink at an entry's place has it moved aside, on
    the writer's turn. The entry's file put back meanwhile was moved instead
    (to quarantine/, whose files the disk budget deletes first)."""
    from kvkeeper.daemon import faults

    from .faultkit import tmp_files

    assert client.save(FP, "k", filled(0.5, 7), [7]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "k")
    away = daemon.root.parent / "away.safetensors"
    shutil.move(path, away)
    path.symlink_to(away)
    monkeypatch.setitem(faults.ACTIVE, "write_delay", "0.5")  # 4 MiB: 2 s of writing
    with Client(daemon.socket, timeout=WAIT) as other:
        assert other.save(FP, "big", filled(4, 1), [1])
        deadline = time.monotonic() + WAIT
        while not tmp_files(daemon.root):  # the writer is busy with "big"
            assert time.monotonic() < deadline, "the big save's write did not start"
            time.sleep(0.005)
        assert client.load(FP, "k") is None  # the symlink: a miss, moved aside later
        os.replace(away, path)
        assert other.flush(timeout=WAIT)
    client.gc()  # on the writer's turn: after the move the load asked for
    assert version_of(path) == 7
    assert not (daemon.root / "quarantine").exists() or not any(
        (daemon.root / "quarantine").iterdir())
    got = client.load(FP, "k")
    assert got is not None and got.token_ids == [7]


@pytest.mark.parametrize("kind", SAME_INTEGERS)
def test_a_lazy_load_leaves_the_layout_to_mlx(
    kind: str, client: Client, daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lazy load no longer reads the header itself before mx.load (a quarter
    of its time) when MLX checks every tensor's offsets: a header MLX reads as
    the saved layout is served as saved; a verified load, which still checks
    the header itself, refuses it. With an older MLX our check runs first."""
    assert client.save(FP, "victim", filled(1, 7), [7])
    assert client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "victim")
    DAMAGE[kind](path)
    if reader.MLX_CHECKS_OFFSETS:
        got = client.load(FP, "victim", verify=False)
        assert got is not None and got.token_ids == [7]
        for layer in got.cache:
            assert all(mx.all(a == 7).item() for a in layer.state[:2])
        assert path.exists()
    monkeypatch.setattr(reader, "MLX_CHECKS_OFFSETS", False)
    for verify in (False, True):
        with pytest.raises(CacheFileError, match="malformed entry") as info:
            kvkeeper.read_cache_file(path, verify=verify)
        assert info.value.damaged
    assert client.load(FP, "victim", verify=False) is None
    deadline = time.monotonic() + WAIT
    while os.path.lexists(path):
        assert time.monotonic() < deadline, "damaged file was not moved aside"
        time.sleep(0.01)


def test_mlx_checks_offsets_when_kvkeeper_says_it_does(tmp_path: Path) -> None:
    """The premise of leaving a lazy load's layout to MLX: the installed MLX
    refuses a tensor beyond the end of the file or of the wrong size for its
    shape (0.29 to 0.31.1 load both and read past the end)."""
    good = tmp_path / "good.safetensors"
    mx.save_safetensors(str(good), {"a": mx.arange(4, dtype=mx.float32)})
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    bad = {
        "beyond the end": (dict(header, a=dict(header["a"], shape=[8], data_offsets=[0, 32]))),
        "wrong size": (dict(header, a=dict(header["a"], shape=[2]))),
    }
    refused = []
    for what, h in bad.items():
        raw = json.dumps(h).encode()
        p = tmp_path / f"{what}.safetensors"
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
        try:
            mx.eval(mx.load(str(p))["a"])
        except RuntimeError:
            refused.append(what)
        with pytest.raises(CacheFileError):
            kvkeeper.read_cache_file(p, verify=False)  # refused either way
    assert reader.MLX_CHECKS_OFFSETS == (refused == list(bad)), (mx.__version__, refused)


def test_another_programs_safetensors_file_is_never_moved_or_replaced(
    client: Client, daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    """Model weights at an entry's place: a load of that key moved them to
    quarantine/, where the budget deletes first (gc right after: gone), and a
    save renamed over them. Now a load is a clean miss, a save fails (flush
    says False), and the file stays as it was, verify --repair included."""
    from .test_cli_checks import cli

    assert client.save(FP, "victim", filled(1, 7), [7])
    assert client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "victim")
    foreign(path)
    weights = path.read_bytes()
    caplog.set_level(logging.INFO, logger="kvkeeper")
    for verify in (True, False):
        assert client.load(FP, "victim", verify=verify) is None
    # The load's report of a bad file is answered before load() returns.
    assert any("event=not_quarantined" in r.getMessage() for r in caplog.records)
    failed = client.stats()["saves_failed"]
    assert client.save(FP, "victim", filled(1, 8), [8])
    assert client.flush(timeout=WAIT) is False
    assert client.stats()["saves_failed"] == failed + 1
    r = cli("verify", "--socket", str(daemon.socket), "--repair", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["not_caches"] == [str(path)]
    # A delete of the key unlinked them; now it fails, saying why.
    with pytest.raises(kvkeeper.DaemonError, match="another program's safetensors file"):
        client.delete(FP, "victim")
    r = cli("rm", "--socket", str(daemon.socket), FP, "victim")
    # One line, exit 1, not "the daemon refused: internal: ... [Errno 17]".
    assert r.returncode == 1 and r.stderr == (
        f"kvkeeper: delete failed: {path} is another program's safetensors file (not a "
        f"cache); left in place\n"), r
    assert path.read_bytes() == weights
    assert not (daemon.root / "quarantine").exists() or not any(
        (daemon.root / "quarantine").iterdir())
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no tmp left


@pytest.mark.parametrize("tensor", ["t0", "t1", "t6", "t7"])
def test_a_flipped_byte_in_any_tensor_of_a_big_file_is_caught(
    tensor: str, client: Client, daemon: RunningDaemon
) -> None:
    # 24 MiB: large enough that verified loads share the hashing between two
    # threads (even and odd tensors), so each thread's half is tried.
    assert client.save(FP, "big", filled(24, 5), [5])
    assert client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "big")
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8 : 8 + n])[tensor]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert client.load(FP, "big", verify=False) is not None  # unverified: not looked at
    assert client.load(FP, "big") is None
    deadline = time.monotonic() + WAIT
    while os.path.lexists(path):
        assert time.monotonic() < deadline, "damaged file was not moved aside"
        time.sleep(0.01)


def test_a_newer_version_is_never_moved_aside(client: Client, daemon: RunningDaemon) -> None:
    """The move names the inode the client judged; a replaced file stays."""
    from kvkeeper.protocol import messages as m

    assert client.save(FP, "fresh", filled(1, 1), [1]) and client.flush(timeout=WAIT)
    st = entry_path(daemon.root, "fresh").stat()
    assert client.save(FP, "fresh", filled(1, 2), [2]) and client.flush(timeout=WAIT)
    reply = client._request(lambda req: m.Quarantine(
        v=m.PROTOCOL_VERSION, req=req, model=FP, cache_id="fresh", ino=st.st_ino,
        mtime_ns=st.st_mtime_ns, reason="test"))
    assert isinstance(reply, m.Deleted) and reply.existed is False
    assert version_of(entry_path(daemon.root, "fresh")) == 2
    assert client.stats().get("files_quarantined", 0) == 0  # nothing was moved


def _replace_while(reader: Callable[[], None], stop: threading.Event, client: Client,
                   key: str, n: int) -> None:
    """Versions 1..n of ``key``, each flushed, while ``reader`` runs in a thread
    until ``stop``; fails if the reader does not end."""
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        for v in range(1, n + 1):
            assert client.save(FP, key, filled(0.25, v), [v])
            assert client.flush(timeout=WAIT)
    finally:
        stop.set()
        t.join(WAIT)
    assert not t.is_alive()


def test_loads_racing_1000_replaces(client: Client, daemon: RunningDaemon) -> None:
    assert client.save(FP, "race", filled(0.25, 0), [0]) and client.flush(timeout=WAIT)
    path = entry_path(daemon.root, "race")
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                for _ in range(2):  # the reader's own retry when replaced mid-read
                    try:
                        seen.append(version_of(path))
                        break
                    except CacheFileError as exc:
                        if exc.damaged:
                            raise
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    _replace_while(reader, stop, client, "race", 1000)
    assert not errors, errors[:1]
    assert client.stats()["saves_written"] >= 1001
    assert len(seen) > 50 and all(0 <= v <= 1000 for v in seen)
    assert len(set(seen)) > 10  # the reads really overlapped the replaces
    assert version_of(path) == 1000


def test_client_loads_racing_replaces_never_miss(client: Client, daemon: RunningDaemon) -> None:
    """Another client's verified loads, racing 500 replaces of the key, each
    return a whole version, never an older one than the last (a file
    replaced between the header read and mx.load is read again)."""
    assert client.save(FP, "race", filled(0.25, 0), [0]) and client.flush(timeout=WAIT)
    stop = threading.Event()
    seen: list[int | None] = []

    def loader() -> None:
        with Client(daemon.socket, timeout=WAIT) as other:
            while not stop.is_set():
                got = other.load(FP, "race")
                seen.append(None if got is None else got.token_ids[0])

    _replace_while(loader, stop, client, "race", 500)
    assert len(seen) > 50 and None not in seen, seen.count(None)
    assert seen == sorted(seen) and len(set(seen)) > 10


def test_read_cache_file_errors_say_what(tmp_path: Path) -> None:
    p = tmp_path / "e.safetensors"
    p.write_bytes(b"short")
    with pytest.raises(CacheFileError, match="shorter than a safetensors header"):
        kvkeeper.read_cache_file(p)
    with pytest.raises(CacheFileError, match="cannot open"):
        kvkeeper.read_cache_file(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("kind", ["string-offsets", "string-shape", "truncated", "nested-header"])
def test_a_damaged_file_under_the_root_does_not_stop_the_daemon(kind: str, short_dir: Path) -> None:
    root, sock = short_dir / "root", short_dir / "run" / "kv.sock"
    d = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            assert kv.save(FP, "victim", filled(1, 7), [7])
            assert kv.save(FP, "fine", filled(1, 8), [8])
            assert kv.flush(timeout=WAIT)
    finally:
        assert d.stop() == 0
    DAMAGE[kind](entry_path(root, "victim"))
    # The start-up scan reads every header under the root.
    d = start_daemon(root, sock)
    try:
        with Client(sock, timeout=WAIT) as kv:
            kv.gc()
            assert kv.stats().get("internal_errors", 0) == 0
            assert kv.load(FP, "victim") is None
            got = kv.load(FP, "fine")
            assert got is not None and got.token_ids == [8]
    finally:
        assert d.stop() == 0


def test_a_file_moved_aside_can_still_be_opened_for_salvage(
    client: Client, daemon: RunningDaemon
) -> None:
    """A quarantined file keeps its bytes under a name MLX cannot tell the
    format of (``...safetensors.<ns>``): read_cache_file still opens it, and
    says exactly what is wrong with it."""
    assert client.save(FP, "salvage", filled(1, 7), [7])
    assert client.flush(timeout=WAIT)
    flip_bit(entry_path(daemon.root, "salvage"))
    assert client.load(FP, "salvage") is None
    deadline = time.monotonic() + WAIT
    while not (moved := list((daemon.root / "quarantine").iterdir())):
        assert time.monotonic() < deadline, "damaged file was not moved aside"
        time.sleep(0.01)
    assert not moved[0].name.endswith(".safetensors")
    # Before the fix: "MLX cannot read it: [load] Unknown file format", even unverified.
    with pytest.raises(kvkeeper.CacheFileError, match="checksum mismatch") as info:
        kvkeeper.read_cache_file(moved[0])
    assert info.value.damaged
    got = kvkeeper.read_cache_file(moved[0], verify=False)
    assert got.token_ids == [7] and len(got.cache) == 4


#: A client whose process is out of file descriptors loads an entry: the
#: file cannot be opened, which says nothing about the file.
OUT_OF_DESCRIPTORS = """
import os, resource, sys
from kvkeeper import Client
from kvkeeper.client import reader  # noqa: F401 - imported before the limit
kv = Client(sys.argv[1], timeout=30)
assert kv.connected
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
fds = [int(x) for x in os.listdir("/proc/self/fd")]
resource.setrlimit(resource.RLIMIT_NOFILE, (max(fds) + 1, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
missed = kv.load(sys.argv[2], "a") is None
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
again = kv.load(sys.argv[2], "a")
print("RESULT", missed, again is not None)
kv.close()
"""


def test_a_file_a_client_cannot_open_now_is_not_moved_aside(
        client: Client, daemon: RunningDaemon) -> None:
    """Any error opening the file counted as damage: a client out of file
    descriptors (or memory, or permission) had the daemon move good files
    to quarantine/, where the disk budget deletes first."""
    assert client.save(FP, "a", filled(0.2, 4), [4]) and client.flush(timeout=WAIT)
    missed_and_left_in_place(daemon, OUT_OF_DESCRIPTORS, "a", 4, "Too many open files")


def missed_and_left_in_place(daemon: RunningDaemon, script: str, cache_id: str,
                             version: int, reason: str, prefix: tuple[str, ...] = ()) -> None:
    """Run a client ``script`` (under ``prefix``) that loads ``cache_id`` in
    trouble of its own, then not: the first load missed, saying ``reason``,
    the second returned the entry, and the file stayed where it was."""
    import subprocess
    import sys

    path = entry_path(daemon.root, cache_id)
    r = subprocess.run([*prefix, sys.executable, "-c", script, str(daemon.socket), FP,
                        str(path)], capture_output=True, text=True, timeout=WAIT * 4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT True True" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert reason in r.stderr  # the miss says why
    assert path.exists()
    quarantine = daemon.root / "quarantine"
    assert not quarantine.exists() or not any(quarantine.iterdir())
    assert version_of(path) == version


#: A client whose process may not map more memory loads a 64 MiB entry:
#: MLX fails to read the tensors, which says nothing about the file.
OUT_OF_MEMORY = """
import resource, sys
from kvkeeper import Client
from kvkeeper.client import reader  # noqa: F401 - imported before the limit
kv = Client(sys.argv[1], timeout=30)
assert kv.connected
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/status") as f:
    vm = int(f.read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 16 * 2**20, hard))
try:
    missed = kv.load(sys.argv[2], "big") is None
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
again = kv.load(sys.argv[2], "big")
print("RESULT", missed, again is not None and again.token_ids == [6])
kv.close()
"""


def test_a_load_out_of_memory_is_a_miss_not_an_exception_or_damage(
        client: Client, daemon: RunningDaemon) -> None:
    """A verified load whose tensors MLX failed to read (here for want of
    memory) raised MLX's RuntimeError out of load()."""
    assert client.save(FP, "big", filled(64, 6), [6]) and client.flush(timeout=WAIT)
    missed_and_left_in_place(daemon, OUT_OF_MEMORY, "big", 6, "could not read its tensors")


#: A client that may not read the entry's file (its mode 0, the process
#: without the capabilities that override file modes) loads it, verified and
#: lazily; then the mode is put back.
NO_PERMISSION = """
import os, sys
from kvkeeper import Client
kv = Client(sys.argv[1], timeout=30)
assert kv.connected
os.chmod(sys.argv[3], 0)
missed = kv.load(sys.argv[2], "locked") is None
missed = kv.load(sys.argv[2], "locked", verify=False) is None and missed
os.chmod(sys.argv[3], 0o600)
again = kv.load(sys.argv[2], "locked")
print("RESULT", missed, again is not None and again.token_ids == [3])
kv.close()
"""


def test_a_file_the_client_may_not_read_is_a_miss_not_damage(
        client: Client, daemon: RunningDaemon) -> None:
    """EACCES, which only a user other than the file's owner meets (or
    root without CAP_DAC_OVERRIDE, as here), was tested nowhere."""
    need_linux_root()
    assert client.save(FP, "locked", filled(0.2, 3), [3]) and client.flush(timeout=WAIT)
    drop = "-dac_override,-dac_read_search"
    missed_and_left_in_place(daemon, NO_PERMISSION, "locked", 3, "Permission denied",
                             prefix=("setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}"))


def test_a_file_where_the_model_directory_should_be_is_a_miss(
        client: Client, daemon: RunningDaemon) -> None:
    """Looking at the entry's place failed with an error other than "no such
    file" (here ENOTDIR; for another user, EACCES), and load() raised it."""
    place = entry_path(daemon.root, "x", model="stray-model")
    place.parent.parent.mkdir(parents=True, exist_ok=True)
    place.parent.write_bytes(b"not a directory")
    assert client.load("stray-model", "x") is None
    assert client.load("stray-model", "x", verify=False) is None
    assert place.parent.read_bytes() == b"not a directory"


@pytest.mark.parametrize("moved", ["model", "sessions"])
def test_a_symlink_planted_for_a_model_directory_is_not_followed(
        client: Client, daemon: RunningDaemon, short_dir: Path, moved: str) -> None:
    """A symlink where a model's directory goes (an operator moving one
    model to another disk) was followed by loads (served from outside the
    root), rm (the file outside deleted, then "delete failed") and the
    quarantine of a damaged file there (moved into the root, unindexed).
    Saves already refused it; now all of them do. So for sessions/ replaced
    by a symlink while the daemon runs (refused at start): saves, loads and
    deletes went through it."""
    for key in ("good", "bad"):
        assert client.save("elsewhere", key, filled(0.1, 4), [4])
    assert client.flush(timeout=WAIT)
    model_dir = entry_path(daemon.root, "good", model="elsewhere").parent
    link = model_dir if moved == "model" else model_dir.parent
    outside = short_dir / "outside"
    link.rename(outside)
    link.symlink_to(outside, target_is_directory=True)
    if moved == "sessions":
        outside = outside / model_dir.name
    flip_bit(outside / entry_path(daemon.root, "bad", model="elsewhere").name)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    assert client.load("elsewhere", "good") is None
    assert client.load("elsewhere", "good", verify=False) is None
    assert client.load("elsewhere", "bad") is None
    with pytest.raises(kvkeeper.DaemonError, match="is a symlink"):
        client.delete("elsewhere", "good")
    assert client.save("elsewhere", "new", filled(0.1, 5), [5])
    assert client.flush(timeout=WAIT) is False
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    assert not (daemon.root / "quarantine").exists()
    # With no daemon to ask, the client reads the store itself: as refused;
    # so does export.
    with Client(short_dir / "none.sock", root=daemon.root, timeout=WAIT) as alone:
        assert alone.load("elsewhere", "good") is None
    r = cli("export", "--socket", str(short_dir / "none.sock"), "--root", str(daemon.root),
            "elsewhere", "good", str(short_dir / "out.safetensors"))
    assert r.returncode == 1 and "is a symlink, not followed" in r.stderr, r.stderr
    assert not (short_dir / "out.safetensors").exists()


def test_a_symlink_planted_for_quarantine_is_not_followed(
        client: Client, daemon: RunningDaemon, short_dir: Path) -> None:
    """A damaged file was moved through a symlinked quarantine/ out of the
    root, and the disk budget later deleted it there."""
    assert client.save(FP, "bad", filled(0.1, 4), [4]) and client.flush(timeout=WAIT)
    outside = short_dir / "outside"
    outside.mkdir()
    (daemon.root / "quarantine").symlink_to(outside, target_is_directory=True)
    flip_bit(entry_path(daemon.root, "bad"))
    assert client.load(FP, "bad") is None
    assert list(outside.iterdir()) == []
    assert entry_path(daemon.root, "bad").exists()  # left where it was
