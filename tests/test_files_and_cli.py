"""read_cache_file on the formats users have, the hybrid model through the
daemon, and the CLI against a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from safetensors import safe_open

import kvkeeper
from kvkeeper.client.client import Client

from .conftest import WAIT, RunningDaemon
from .legacy_describe import MLX_LM_OLD_API, describe
from .test_legacy import MANIFEST, READABLE, ROOT, digest
from .tiny import prefill, prompt, tiny_lfm2


@pytest.mark.parametrize("rel", READABLE)
def test_read_cache_file_opens_legacy_files(rel: str) -> None:
    want = MANIFEST[rel]
    got = kvkeeper.read_cache_file(ROOT / rel)
    assert [type(c).__name__ for c in got.cache] == want["classes"]
    if "layers" in want:  # as mlx-lm's own loader restores it, under either API
        assert [describe(c) for c in got.cache] == want["layers"]
    if "leaves" in want and not (MLX_LM_OLD_API and want["format"] == "mlx-lm-prompt-cache"):
        assert digest(got.cache) == want["leaves"]
    assert got.format == want["format"]
    if "token_ids" in want:
        assert got.token_ids == want["token_ids"]
        assert got.model == want["model_fingerprint"]
        # A model mismatch is refused for files that record their model.
        with pytest.raises(kvkeeper.client.reader.CacheFileError, match="model"):
            kvkeeper.read_cache_file(ROOT / rel, model="another-model")


def test_read_cache_file_rejects_foreign_files(tmp_path: Path) -> None:
    f = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(f), {"w": mx.zeros((2, 2))}, {"format": "pt"})
    with pytest.raises(kvkeeper.client.reader.CacheFileError, match="not a kvkeeper"):
        kvkeeper.read_cache_file(f)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(kvkeeper.client.reader.CacheFileError, match="header length"):
        kvkeeper.read_cache_file(junk)


def test_hybrid_model_round_trips_through_the_daemon(client: Client) -> None:
    model = tiny_lfm2(seed=2)
    tokens = prompt(60, seed=5)
    cache = make_prompt_cache(model)
    assert {type(c) for c in cache} == {ArraysCache, KVCache}
    prefill(model, tokens, cache)
    assert client.save("lfm2", "hybrid", cache, tokens)
    got = client.load("lfm2", "hybrid")
    assert got is not None
    assert [type(c) for c in got.cache] == [type(c) for c in cache]
    a = model(mx.array([[9]]), cache=got.cache)[0, -1]
    b = model(mx.array([[9]]), cache=cache)[0, -1]
    mx.eval(a, b)
    np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvkeeper.cli", *args],
                          capture_output=True, text=True, timeout=WAIT)


def test_cli_stats_ls_rm(client: Client, daemon: RunningDaemon) -> None:
    c = KVCache()
    x = mx.zeros((1, 2, 5, 8))
    c.update_and_fetch(x, x)
    assert client.save("m1", "Session A", [c], [1, 2, 3, 4, 5])
    assert client.flush(timeout=WAIT)
    sock = str(daemon.socket)
    stats = json.loads(cli("stats", "--socket", sock, "--json").stdout)
    assert stats["saves_written"] == 1
    listed = json.loads(cli("ls", "--socket", sock, "--json").stdout)
    assert [(e["model"], e["cache_id"], e["tokens"]) for e in listed] == [("m1", "Session A", 5)]
    assert "Session A" in cli("ls", "--socket", sock).stdout
    assert cli("rm", "m1", "Session A", "--socket", sock).returncode == 0
    assert cli("rm", "m1", "Session A", "--socket", sock).returncode == 1
    assert client.entries() == []


def test_cli_without_daemon_and_help(short_dir: Path) -> None:
    r = cli("stats", "--socket", str(short_dir / "nope.sock"))
    assert r.returncode == 3 and "no kvkeeper daemon" in r.stderr
    helptext = cli("serve", "--help").stdout
    for flag in ("--root", "--socket", "--max-pending-bytes", "--drain-timeout", "--log-level"):
        assert flag in helptext
    bad = cli("serve", "--max-pending-bytes", "lots")
    assert bad.returncode == 2 and "not a byte size" in bad.stderr


def test_serve_refuses_unsafe_dirs(short_dir: Path) -> None:
    open_root = short_dir / "open"
    open_root.mkdir(mode=0o755)
    open_root.chmod(0o755)
    r = cli("serve", "--root", str(open_root), "--socket", str(short_dir / "s" / "k.sock"))
    assert r.returncode == 2 and "chmod 700" in r.stderr
    link = short_dir / "link"
    link.symlink_to(short_dir)
    r = cli("serve", "--root", str(link), "--socket", str(short_dir / "s" / "k.sock"))
    assert r.returncode == 2 and "symlink" in r.stderr
    a_file = short_dir / "plain"
    a_file.write_bytes(b"")
    r = cli("serve", "--root", str(a_file), "--socket", str(short_dir / "s" / "k.sock"))
    assert r.returncode == 2 and "not a directory" in r.stderr  # as --socket <a file> is
    long_sock = short_dir / ("x" * 120) / "k.sock"
    r = cli("serve", "--root", str(short_dir / "r"), "--socket", str(long_sock))
    assert r.returncode == 2 and "bytes; this platform allows" in r.stderr


@pytest.mark.parametrize("writeback", ["early", "at fsync only"])
def test_big_saves_are_whole_with_and_without_early_writeback(
    writeback: str, client: Client, daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linux starts writing a big save back while the rest still arrives
    # (sync_file_range); elsewhere the final fsync does it all. Both ways the
    # file is the same whole, checksummed version, and no tmp file is left.
    from kvkeeper.daemon import durable

    from .faultkit import FP as FAULT_FP
    from .faultkit import entry_path, filled, tmp_files, version_of

    if sys.platform == "linux":
        assert durable._sync_file_range is not None
    if writeback != "early":
        monkeypatch.setattr(durable, "_sync_file_range", None)
    for v in (3, 4):  # a new file, then a replace
        assert client.save(FAULT_FP, "big", filled(40, v), [v])
        assert client.flush(timeout=WAIT)
        path = entry_path(daemon.root, "big")
        assert version_of(path) == v
        with safe_open(str(path), "np") as f:  # an independent reader agrees on the layout
            assert len(list(f.keys())) == 8 and f.metadata()["kvkeeper.token_ids"] == f"[{v}]"
        assert path.stat().st_size >= 39 * 2**20
    assert not tmp_files(daemon.root)
