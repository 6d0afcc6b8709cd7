"""mlx-vlm's automatic prefix caching (APC) disk tier, driven the way its server drives it.

What mlx-vlm 0.7.10 does, read from ``mlx_vlm/apc.py`` and ``apc_coordinator.py``:

* ``apc.from_env(overrides=...)`` builds an ``APCManager`` with a
  ``DiskBlockStore`` (one background writer thread; ``mx.save_safetensors`` to a
  sibling file, then ``os.replace``; no fsync anywhere).
* ``APCCoordinator.commit(prompt_cache, token_ids)`` is the hand-off. For plain
  KV layouts (mlx-vlm's own ``KVCache``: strategy "block") it evaluates the
  cache, hashes the token blocks and queues one layer-major shard that
  references the live arrays (no copy); the worker slices and pads them to the
  next multiple of 256 tokens and writes. With ``memory_max_gb=0`` (disk tier
  only, the configuration measured here) nothing is copied into its memory pool.
  For mixed layouts (ArraysCache + KVCache: strategy "checkpoint") with no
  memory budget, the snapshot is written synchronously inside ``commit``.
  mlx-lm's own cache classes are not supported by its checkpoint writer
  ("unsupported exact-cache entry"), so the mlx-vlm classes are used here.
* Every prefill starts with ``prepare_prefill``, which calls
  ``DiskBlockStore.flush()`` (``queue.join()``): the next request waits for
  whatever is still being written.
* ``APCManager.lookup_prefix_disk_cache(token_ids)`` restores a ready, evaluated
  prompt cache from the shard (no checksums). It reads free RAM with psutil on
  Linux; without psutil its memory check fails and it never restores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import remove_tree, short_tmpdir

logging.getLogger("mlx_vlm.apc").setLevel(logging.ERROR)


class _StubModel:
    """What APCCoordinator needs of a model: ``make_cache()`` giving the layout."""

    def __init__(self, make: Callable[[], list[Any]]) -> None:
        self._make = make

    def make_cache(self) -> list[Any]:
        return self._make()


def _layout_factory(layers: Sequence[Any]) -> Callable[[], list[Any]]:
    from mlx_vlm.models.cache import ArraysCache, KVCache

    kinds = [(type(c), len(getattr(c, "cache", ()) or ())) for c in layers]

    def make() -> list[Any]:
        return [ArraysCache(n) if cls is ArraysCache else KVCache() for cls, n in kinds]

    return make


def measure(layers: Sequence[Any], tokens: list[int], *, restore: bool) -> dict[str, Any]:
    """One APC round on a fresh disk tier: hand-off, wait for the write, optionally restore."""
    from mlx_vlm import apc

    d = short_tmpdir("kvkb-apc-")
    manager = None
    try:
        manager = apc.from_env(overrides={
            "enabled": True, "disk_path": str(d), "memory_max_gb": 0, "disk_max_gb": 0,
        })
        if manager is None or manager.disk is None:
            return {"error": "mlx-vlm APC did not start a disk tier"}
        coord = manager.coordinator(_StubModel(_layout_factory(layers)))
        out: dict[str, Any] = {"strategy": coord.strategy}
        t0 = time.perf_counter()
        ok = coord.commit(list(layers), tokens)
        t1 = time.perf_counter()
        # The next request's prefill: mlx-vlm flushes its disk queue first.
        coord.prepare_prefill(len(tokens) + 16)
        t2 = time.perf_counter()
        stats = manager.stats_snapshot()
        files = list(Path(manager.disk.dir).glob("*.safetensors"))
        out.update({
            "committed": bool(ok),
            "handoff_s": t1 - t0,
            "written_s": t2 - t0,
            "next_request_wait_s": t2 - t1,
            "disk_writes": stats.get("disk_writes"),
            "disk_write_failures": stats.get("disk_write_failures"),
            "file_bytes": sum(f.stat().st_size for f in files),
        })
        if restore:
            t3 = time.perf_counter()
            warm, matched = manager.lookup_prefix_disk_cache(tokens)
            t4 = time.perf_counter()
            out["restore_s"] = t4 - t3
            out["restored_tokens"] = int(matched)
            if warm is None:
                out["restore_error"] = "lookup_prefix_disk_cache returned no cache"
            del warm
        return out
    finally:
        if manager is not None:
            try:
                manager.close()
            except Exception:  # noqa: BLE001 - cleanup only
                pass
        remove_tree(d)


class DiskTier:
    """An APC disk tier holding one committed prefix, for timing its restore."""

    def __init__(self, layers: Sequence[Any], tokens: list[int]) -> None:
        self.tokens = tokens
        self.error: str | None = None
        self.file_bytes: int | None = None
        self.ready = False
        self._dir = short_tmpdir("kvkb-apc-")
        self._manager: Any = None
        try:
            from mlx_vlm import apc

            self._manager = apc.from_env(overrides={
                "enabled": True, "disk_path": str(self._dir), "memory_max_gb": 0,
                "disk_max_gb": 0,
            })
            if self._manager is None or self._manager.disk is None:
                raise RuntimeError("mlx-vlm APC did not start a disk tier")
            coord = self._manager.coordinator(_StubModel(_layout_factory(layers)))
            if not coord.commit(list(layers), tokens):
                raise RuntimeError(f"commit() refused the cache (strategy {coord.strategy})")
            coord.prepare_prefill(len(tokens) + 16)  # waits for the write
            self.file_bytes = sum(f.stat().st_size
                                  for f in Path(self._manager.disk.dir).glob("*.safetensors"))
            self.restore()  # proves it works (and warms its header cache)
            self.ready = True
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a finding, not a crash
            self.error = f"{type(exc).__name__}: {exc}"

    def restore(self) -> list[Any]:
        """``lookup_prefix_disk_cache``: an evaluated, unverified prompt cache."""
        warm, matched = self._manager.lookup_prefix_disk_cache(self.tokens)
        if warm is None or matched == 0:
            raise RuntimeError("lookup_prefix_disk_cache restored nothing")
        return warm

    def close(self) -> None:
        if self._manager is not None:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 - cleanup only
                pass
        remove_tree(self._dir)
