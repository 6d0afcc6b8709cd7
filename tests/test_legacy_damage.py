"""Damaged files of the older formats (cache_persist schema 3, mlx-lm's
save_prompt_cache), read through the public surface: ``read_cache_file``,
a daemon's store and ``kvkeeper import``. These files carry no checksums,
so what a cache cannot be is all that tells damage apart."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from kvkeeper.client.client import Client
from kvkeeper.client.reader import CacheFileError, read_cache_file

from .conftest import WAIT, RunningDaemon, wait_for
from .faultkit import entry_path
from .test_cli_checks import cli
from .test_legacy import ROOT as LEGACY

MLX_LM = LEGACY / "mlx-lm" / "kv.safetensors"
ROTATING = LEGACY / "gezel-schema3" / "fp-demo" / "rotating.safetensors"


def _rewritten(src: Path, dest: Path, arrays: dict[str, Any] | None = None,
               **meta: str) -> Path:
    """``src`` written again with some arrays and metadata values replaced
    (an array given as None is left out)."""
    have, metadata = mx.load(str(src), return_metadata=True)
    for k, v in (arrays or {}).items():
        if v is None:
            del have[k]
        else:
            have[k] = v
    mx.save_safetensors(str(dest), have, metadata={**metadata, **meta})
    return dest


def _with_meta_state(src: Path, dest: Path, edit: Any) -> Path:
    _, metadata = mx.load(str(src), return_metadata=True)
    state = json.loads(metadata["meta_state"])
    edit(state)
    return _rewritten(src, dest, meta_state=json.dumps(state))


#: A StaticPrefixKVCache row of _static_prefix's: keys and values, 8 heads of 128 float16.
_ROW_BYTES = 2 * 8 * 128 * 2


def _static_prefix(dest: Path, max_size: int, layers: int = 1) -> Path:
    k = mx.ones((1, 8, 4, 128), dtype=mx.float16)
    arrays = {f"{i}.{j}": k for i in range(layers) for j in (0, 1)}
    mx.save_safetensors(str(dest), arrays, metadata={
        "schema_version": "3", "model_fingerprint": "fp",
        "classes": json.dumps(["StaticPrefixKVCache"] * layers),
        "class_modules": json.dumps(["mlx_vlm.models.cache"] * layers),
        "meta_state": json.dumps([[str(max_size), "256", "4", "0"]] * layers),
        "state_scalars": "{}", "token_ids": "[1, 2, 3, 4]"})
    return dest


def _memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _overlapping(dest: Path) -> Path:
    """The mlx-lm fixture with layer 0's values pointing at layer 1's keys
    (same shape), leaving their own bytes to no tensor."""
    raw = MLX_LM.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["0.1"]["data_offsets"] = header["1.0"]["data_offsets"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    dest.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return dest


def _offset_of_no_value(dest: Path) -> Path:
    """The mlx-lm fixture with layer 0's offset recorded as of kind "none"."""
    _, metadata = mx.load(str(MLX_LM), return_metadata=True)
    [path_key] = [k for k, v in metadata.items() if k.startswith("2.") and v == "0.2"]
    return _rewritten(MLX_LM, dest, **{path_key[:-1] + "1": "none"})


def _int_at(src: Path, key: str, value: int) -> Any:
    """Makes ``src`` again with its int32 scalar ``key`` set to ``value``."""
    return lambda d: _rewritten(src, d, {key: mx.array(value, mx.int32)})


def _set_offset(state: list[Any]) -> None:
    state[0][2] = "-7"  # keep, max_size, offset, _idx


def _keep_of(keep: str) -> Any:
    def edit(state: list[Any]) -> None:
        state[0][0] = keep  # in a window of 32

    return edit


ROTATING_LM = LEGACY / "mlx-lm" / "rotating.safetensors"  # keys, values, offset, keep, max_size, _idx
# keys, values, offset 37, chunk_size 16, start_position 0 (256 rows)
CHUNKED_LM = LEGACY / "mlx-lm" / "chunked.safetensors"
CHUNKED = LEGACY / "gezel-schema3" / "fp-demo" / "chunked.safetensors"  # 37 rows, 37 tokens


def _start_of(start: str) -> Any:
    def edit(state: list[Any]) -> None:
        state[0][1] = start  # chunk_size, start_position

    return edit


DAMAGED = {
    # (what, how to make it, the reason's words)
    "negative offset": (_int_at(MLX_LM, "0.2", -5),
                        "offset -5 is not a token count"),
    "offset past the rows": (_int_at(MLX_LM, "0.2", 1000),
                             "offset 1000 is past its 256 rows"),
    "NaN offset": (lambda d: _rewritten(MLX_LM, d, {"0.2": mx.array(float("nan"))}),
                   "offset nan is not a token count"),
    # mlx-lm 0.31 (Python 3.10's) rebuilt these three with int(): offsets
    # 200 and 1, loaded, where 0.32 called them damage (a review's finds).
    "fractional offset": (lambda d: _rewritten(MLX_LM, d, {"0.2": mx.array(200.5)}),
                          "offset 200.5 is not a token count"),
    "bool offset": (lambda d: _rewritten(MLX_LM, d, {"0.2": mx.array(True)}),
                    "offset True is not a token count"),
    # Loaded under either mlx-lm, its first update raised TypeError.
    "offset of no value": (_offset_of_no_value, "offset None is not a token count"),
    "negative offset of a rotating cache": (lambda d: _with_meta_state(ROTATING, d, _set_offset),
                                            "offset -7 is not a token count"),
    # Restored as they were, the next update wrote its token nowhere (the
    # write position) or returned no rows (the window's size), and raised not.
    "write position past the rows of a rotating cache": (
        _int_at(ROTATING_LM, "0.5", 1000),
        "write position 1000 is not within its 37 rows"),
    "negative write position of a rotating cache": (
        _int_at(ROTATING_LM, "0.5", -3),
        "write position -3 is not within"),
    "rotating window of no rows": (
        _int_at(ROTATING_LM, "0.4", 0),
        "max_size 0 is not a window's size"),
    "rotating cache keeping more than its window": (
        lambda d: _with_meta_state(ROTATING, d, _keep_of("40")), "keep 40 is not within its window"),
    # As many as the window holds: mlx-lm's keep of 4 past a window of 4 or less only.
    "rotating cache keeping its window's size": (
        lambda d: _with_meta_state(ROTATING, d, _keep_of("32")), "keep 32 is not within its window"),
    "rotating cache keeping rows it cannot": (
        lambda d: _with_meta_state(ROTATING, d, _keep_of("-1")), "keep -1 is not within its window"),
    # mlx-lm writes each of these as one value with its array; a miss that
    # left the file in place for ever (damaged=False) before.
    "a scalar of two values": (
        lambda d: _rewritten(MLX_LM, d, {"0.2": mx.array([1, 2], mx.int32)}),
        "scalar '0.2' (scalar) is malformed"),
    "a scalar's array missing": (lambda d: _rewritten(MLX_LM, d, {"0.2": None}),
                                 "scalar '0.2' has no array"),
    "an array missing": (lambda d: _rewritten(ROTATING, d, {"0.0": None}),
                         "no array for state entry '0.0'"),
    "token ids not JSON": (lambda d: _rewritten(ROTATING, d, token_ids="[1, 2,, 3]"),
                           "'token_ids' is not JSON"),
    "offset past the rows of a quantized cache": (
        lambda d: _rewritten(LEGACY / "mlx-lm" / "quantized.safetensors", d,
                             {"0.2": mx.array(1000, mx.int32)}),
        "offset 1000 is past its 256 rows"),
    # A ChunkedKVCache holds the tokens from its start_position to its
    # offset in its rows. Restored as they were, these served all-zero rows
    # as keys (a start of -5, an offset of 300 over 256 rows), or returned
    # 254 rows or none and dropped the next token (a start of 40 or 1000
    # past an offset of 37), with no error; in all three formats (a review).
    "chunked cache starting before its first token": (
        _int_at(CHUNKED_LM, "0.4", -5),
        "cannot hold the tokens from start_position -5 to offset 37"),
    "chunked cache starting past its offset": (
        _int_at(CHUNKED_LM, "0.4", 40),
        "cannot hold the tokens from start_position 40 to offset 37"),
    "chunked cache offset past its rows": (
        _int_at(CHUNKED_LM, "0.2", 300),
        "a ChunkedKVCache of 256 rows cannot hold the tokens from start_position 0 to "
        "offset 300"),
    "chunked cache of no chunk size": (
        _int_at(CHUNKED_LM, "0.3", 0),
        "chunk_size 0 is not a chunk size"),
    "cache_persist chunked cache starting before its first token": (
        lambda d: _with_meta_state(CHUNKED, d, _start_of("-5")),
        "cannot hold the tokens from start_position -5 to offset 37"),
    # Refused before, but as a file this version cannot read (damaged
    # False): in a store it stayed in place, a miss at every load.
    "cache_persist chunked cache starting past its tokens": (
        lambda d: _with_meta_state(CHUNKED, d, _start_of("40")),
        "a ChunkedKVCache of 37 rows from start_position 40 cannot hold 37 tokens"),
    "mlx-lm 0.31 chunked cache starting before its first token": (
        lambda d: _rewritten(LEGACY / "mlx-lm-0.31" / "chunked.safetensors", d,
                             **{"0.0.1": "-3"}),
        "start_position -3"),
    "max_size of 2**30 rows": (lambda d: _static_prefix(d, 2**30),  # 4 TiB
                               "more than this machine's memory"),
    # Each layer a quarter of this machine's memory: only the file's total is over.
    "8 layers of a quarter of the memory": (
        lambda d: _static_prefix(d, _memory() // 4 // _ROW_BYTES, layers=8),
        "more than this machine's memory"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
@pytest.mark.parametrize("verify", [True, False])
def test_a_damaged_legacy_file_is_refused_as_damaged(case: str, verify: bool,
                                                     tmp_path: Path) -> None:
    """Before: the offsets were restored as they were (an update then gave
    252 rows for -5, or raised for NaN), the missing array came back as
    keys == {} (AttributeError at first use), bad JSON was a miss that left
    the file in place for ever (damaged=False), and the 2**30-row
    StaticPrefixKVCache was returned, 64 GiB of zeros its first evaluation
    asked for (SIGSEGV under a 6 GB address-space limit)."""
    make, reason = DAMAGED[case]
    path = make(tmp_path / "c.safetensors")
    with pytest.raises(CacheFileError) as caught:
        read_cache_file(path, verify=verify)
    assert caught.value.damaged and reason in str(caught.value), caught.value


def test_a_sound_static_prefix_cache_still_loads(tmp_path: Path) -> None:
    got = read_cache_file(_static_prefix(tmp_path / "c.safetensors", 64))
    assert got.cache[0].keys.shape == (1, 8, 64, 128) and got.cache[0].offset == 4


@pytest.mark.parametrize("window", [4, 2])
def test_mlx_lm_s_own_tiny_window_is_read_as_mlx_lm_reads_it(window: int,
                                                              tmp_path: Path) -> None:
    """make_prompt_cache(max_kv_size=4 or less) keeps 4 rows, as many as the
    window or more; wrapped, its write position runs past its rows. Such a
    file of mlx-lm's own was called damaged (and a store's moved aside): it
    is read as mlx-lm's load_prompt_cache reads it, and goes on the same."""
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    from . import tiny

    model = tiny.tiny_qwen2()
    cache = make_prompt_cache(model, max_kv_size=window)
    tiny.prefill(model, tiny.prompt(10), cache)
    for token in (9, 8, 7):
        mx.eval(model(mx.array([[token]]), cache=cache))
    assert cache[0].keep >= cache[0].max_size and cache[0]._idx > cache[0].keys.shape[2]
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), cache)
    theirs = load_prompt_cache(str(path))
    ours = read_cache_file(path).cache
    for a, b in zip(ours, theirs, strict=True):
        for name in ("keep", "max_size", "offset", "_idx"):
            assert getattr(a, name) == getattr(b, name), name
        assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
    for token in (6, 5):
        step = mx.array([[token]])
        assert mx.array_equal(model(step, cache=ours), model(step, cache=theirs)).item()


@pytest.mark.parametrize("verify", [True, False])
def test_tensors_over_the_same_bytes_are_refused(tmp_path: Path, verify: bool) -> None:
    """A verified read checks that the tensors tile the file, as its
    docstring says; it checked bounds and sizes only, and layer 0's values
    came back as layer 1's keys. A file of the older formats, which has no
    checksums, is checked so lazily too."""
    with pytest.raises(CacheFileError, match="overlap") as caught:
        read_cache_file(_overlapping(tmp_path / "c.safetensors"), verify=verify)
    assert caught.value.damaged


def test_a_loop_of_directories_is_not_called_a_symlink(tmp_path: Path) -> None:
    """ELOOP also comes from a loop among the directories above the file,
    which is no symlink to give the target of."""
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(CacheFileError) as caught:
        read_cache_file(tmp_path / "loop" / "x.safetensors")
    assert "it is a symlink" not in str(caught.value), caught.value


def test_a_damaged_legacy_file_in_the_store_is_moved_aside(daemon: RunningDaemon,
                                                           tmp_path: Path) -> None:
    """Before: a miss at every load, the file left in place (not damaged)."""
    place = entry_path(daemon.root, "tok", model="fp-demo")
    place.parent.mkdir(parents=True)
    shutil.copyfile(DAMAGED["token ids not JSON"][0](tmp_path / "c.safetensors"), place)
    with Client(daemon.socket, timeout=WAIT) as kv:
        kv.gc()  # a rescan indexes it
        assert kv.load("fp-demo", "tok") is None
        wait_for(lambda: not place.exists(), "the file moved aside")
    moved = list((daemon.root / "quarantine").iterdir())
    assert [p.name.split(".")[0] for p in moved] == ["fp-demo"], moved


def test_import_reports_a_damaged_legacy_file_and_goes_on(daemon: RunningDaemon,
                                                          tmp_path: Path) -> None:
    """A file missing an array, beside a sound one: import ended in a
    CodecError traceback, importing neither and reporting nothing."""
    src = tmp_path / "in"
    src.mkdir()
    _rewritten(ROTATING, src / "a-broken.safetensors", {"0.0": None})
    shutil.copyfile(ROTATING, src / "b-sound.safetensors")
    r = cli("import", "--socket", str(daemon.socket), "--json", str(src))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout)
    assert [Path(f["path"]).name for f in report["failed"]] == ["a-broken.safetensors"], report
    assert [(e["model"], e["cache_id"]) for e in report["imported"]] == \
        [("fp-demo", "b-sound")], report


def test_a_file_and_a_symlink_to_it_import_under_the_files_name(
        daemon: RunningDaemon, tmp_path: Path) -> None:
    """The two are one file, imported once: under the name of whichever
    sorted first (here the link's, a-latest)."""
    src = tmp_path / "in"
    src.mkdir()
    shutil.copyfile(ROTATING, src / "z-conversation.safetensors")
    (src / "a-latest.safetensors").symlink_to("z-conversation.safetensors")
    r = cli("import", "--socket", str(daemon.socket), "--json", str(src))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert [(e["model"], e["cache_id"]) for e in json.loads(r.stdout)["imported"]] == \
        [("fp-demo", "z-conversation")]


def test_import_reads_the_file_a_symlink_names(daemon: RunningDaemon, tmp_path: Path) -> None:
    """A symlink named to import is the user's: it was refused as damaged
    ("cannot open: Too many levels of symbolic links"). read_cache_file
    itself never follows one, and now says so."""
    link = tmp_path / "link.safetensors"
    link.symlink_to(ROTATING)
    with pytest.raises(CacheFileError, match="it is a symlink"):
        read_cache_file(link)
    r = cli("import", "--socket", str(daemon.socket), "--json", str(link))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert [(e["model"], e["cache_id"]) for e in json.loads(r.stdout)["imported"]] == \
        [("fp-demo", "link")]


def test_a_sound_file_larger_than_the_memory_is_no_damage(tmp_path: Path) -> None:
    """An mlx-lm file whose keys and values are more than this machine's
    memory (sparse here), read lazily: the memory bound took it for damage
    (and a daemon moved it to quarantine/). Only rows a file does not hold,
    made by padding, are."""
    _, metadata = mx.load(str(MLX_LM), return_metadata=True)
    rows = _memory() // (4 * 8 * 128 * 2) + 1  # 2 layers of keys and values, float16
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name in ("0.0", "0.1", "1.0", "1.1"):
        size = 8 * rows * 128 * 2
        header[name] = {"dtype": "F16", "shape": [1, 8, rows, 128], "data_offsets": [at, at + size]}
        at += size
    for name in ("0.2", "1.2"):
        header[name] = {"dtype": "I32", "shape": [], "data_offsets": [at, at + 4]}
        at += 4
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.seek(8 + len(text) + at - 8)
        f.write(struct.pack("<ii", rows, rows))  # the offsets; the rest is a hole
    got = read_cache_file(path, verify=False)
    assert [c.offset for c in got.cache] == [rows, rows]
    assert sum(c.keys.nbytes + c.values.nbytes for c in got.cache) > _memory()
