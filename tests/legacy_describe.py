"""A description of a restored cache layer that reads the same under
mlx-lm 0.31 (state + meta_state) and 0.32 (scalars inside the state): its
class, its counters, and a digest of every array it holds."""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

#: mlx-lm 0.31 and earlier (Python 3.10 gets no later one): layers keep their
#: counters in meta_state, and state leaves out spare capacity.
MLX_LM_OLD_API = hasattr(KVCache, "meta_state")

#: The counters mlx-lm cache classes keep, under both APIs.
COUNTERS = ("offset", "keep", "max_size", "_idx", "group_size", "bits", "chunk_size",
            "start_position")


def digest(a: mx.array) -> list[Any]:
    data = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes()
    return [str(a.dtype), list(a.shape), hashlib.sha256(data).hexdigest()]


def describe(layer: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": type(layer).__name__}
    if hasattr(layer, "caches"):  # CacheList
        out["children"] = [describe(c) for c in layer.caches]
        return out
    if type(layer).__name__ == "ArraysCache":
        out["cache"] = [None if a is None else digest(a) for a in layer.cache]
        return out
    out["counters"] = {n: int(getattr(layer, n)) for n in COUNTERS if hasattr(layer, n)}
    for part in ("keys", "values"):
        v = getattr(layer, part)
        out[part] = [digest(a) for a in v] if isinstance(v, (tuple, list)) else digest(v)
    return out
