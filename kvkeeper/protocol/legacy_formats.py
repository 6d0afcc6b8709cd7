"""Which legacy cache format a safetensors file's metadata belongs to: known
without MLX, so the daemon can tell a user's old cache file (its to evict)
from any other safetensors file (never its to delete)."""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["GEZEL_SCHEMA3", "MLX_LM_PROMPT_CACHE", "detect_legacy", "indexed"]

GEZEL_SCHEMA3 = "gezel-schema3"
MLX_LM_PROMPT_CACHE = "mlx-lm-prompt-cache"

#: The metadata keys mlx-lm's save_prompt_cache writes (mlx-lm 0.32 and later):
#: user metadata, class names, scalar leaves after an empty sentinel.
MLX_LM_KEY = re.compile(r"0\..+|1\.\d+|2\.0|2\.\d+\.[01]")
#: The same in mlx-lm 0.31 and earlier: each layer's meta_state, user
#: metadata, class names.
MLX_LM_OLD_KEY = re.compile(r"0\.\d+(\.\d+)*|1\..+|2\.\d+")


def detect_legacy(metadata: Mapping[str, str]) -> str | None:
    """The legacy format a safetensors metadata map belongs to, or None."""
    if (
        metadata.get("schema_version") == "3"
        and "classes" in metadata
        and "class_modules" in metadata
    ):
        return GEZEL_SCHEMA3
    if (
        metadata.get("2.0") == ""
        and any(k.startswith("1.") for k in metadata)
        and all(MLX_LM_KEY.fullmatch(k) for k in metadata)
    ):
        return MLX_LM_PROMPT_CACHE
    if (
        metadata.get("2.0")  # a class name, where mlx-lm 0.32 writes ""
        and all(MLX_LM_OLD_KEY.fullmatch(k) for k in metadata)
        and (names := indexed(metadata, "2.")) is not None
        and all(name.isidentifier() for name in names)
    ):
        return MLX_LM_PROMPT_CACHE
    return None


def indexed(metadata: Mapping[str, str], prefix: str) -> list[str] | None:
    """The values of the keys ``prefix<i>`` in order of i, or None unless they
    are numbered 0..n-1, each number written once."""
    found = {k[len(prefix):]: v for k, v in metadata.items()
             if k.startswith(prefix) and k[len(prefix):].isdigit()}
    if sorted(map(int, found)) != list(range(len(found))):
        return None
    return [found[str(i)] for i in range(len(found))]
