"""Files written by older kvkeeper versions, served by this one.

tests/data/kvkeeper-0.2.0 holds files kvkeeper 0.2.0's own daemon wrote
(make_kvkeeper_020.py says how). Two hold mlx-vlm caches 0.2.0 saved in a
way that no version restores exactly; they must be misses with their
reason, never a cache that computes something else. The other two are the
same classes in states 0.2.0 saved correctly, and must load as saved.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import pytest

from kvkeeper import Client

from .conftest import WAIT, RunningDaemon, start_daemon
from .test_codec import _same_steps

DATA = Path(__file__).parent / "data" / "kvkeeper-0.2.0"


def _maker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_kvkeeper_020", DATA / "make_kvkeeper_020.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MAKER = _maker()
REFUSED = sorted(k for k, (_, refused) in MAKER.CASES.items() if refused)
KEPT = sorted(k for k, (_, refused) in MAKER.CASES.items() if not refused)


@pytest.fixture
def old_root(short_dir: Path) -> Any:
    """A daemon on a root holding the 0.2.0 files, as 0.2.0 left them."""
    root = short_dir / "root"
    sessions = root / "sessions" / MAKER.MODEL
    sessions.mkdir(parents=True)
    for d in (root, root / "sessions", sessions):
        d.chmod(0o700)  # as a daemon leaves them: it refuses a root open to others
    for f in DATA.glob("*.safetensors"):
        shutil.copy(f, sessions / f.name)
    rd: RunningDaemon = start_daemon(root, short_dir / "run" / "kv.sock")
    try:
        yield rd
    finally:
        if rd.thread.is_alive():
            rd.stop()


def test_every_case_has_its_file() -> None:
    names = {p.stem for p in DATA.glob("*.safetensors")}
    assert names == set(MAKER.CASES)


@pytest.mark.parametrize("cache_id", REFUSED)
def test_a_cache_kvkeeper_020_saved_lossily_is_a_miss_with_its_reason(
        old_root: RunningDaemon, cache_id: str, caplog: pytest.LogCaptureFixture) -> None:
    with Client(old_root.socket, timeout=WAIT) as kv, caplog.at_level(logging.WARNING):
        for verify in (True, False):
            caplog.clear()
            assert kv.load(MAKER.MODEL, cache_id, verify=verify) is None
            assert "written by kvkeeper 0.2.0" in caplog.text, caplog.text
    # Not damaged: the file stays where it is (another version may read it).
    assert (old_root.root / "sessions" / MAKER.MODEL / f"{cache_id}.safetensors").exists()


@pytest.mark.parametrize("cache_id", REFUSED)
def test_export_refuses_a_cache_kvkeeper_020_saved_lossily(
        old_root: RunningDaemon, cache_id: str, short_dir: Path) -> None:
    out = short_dir / "out.safetensors"
    r = subprocess.run([sys.executable, "-m", "kvkeeper.cli", "export", "--socket",
                        str(old_root.socket), MAKER.MODEL, cache_id, str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "written by kvkeeper 0.2.0" in r.stderr, r.stderr
    assert not out.exists()


def _same(restored: Any, original: Any) -> None:
    assert type(restored) is type(original)
    assert restored.meta_state == original.meta_state
    assert restored.offset == original.offset
    for a, b in zip(restored.state, original.state, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.parametrize("cache_id", KEPT)
def test_a_cache_kvkeeper_020_saved_correctly_loads_and_goes_on_alike(
        old_root: RunningDaemon, cache_id: str) -> None:
    with Client(old_root.socket, timeout=WAIT) as kv:
        got = kv.load(MAKER.MODEL, cache_id)
    assert got is not None
    (restored,), (original,) = got.cache, MAKER.build(cache_id)
    _same(restored, original)
    _same_steps(restored, original, 3, seed=500)
    _same(restored, original)
