"""Writes the mlx-lm-0.31/ fixtures: prompt-cache files in the layout
mlx-lm 0.31 and earlier wrote (metadata ``[meta_states, user, classes]``),
and their entries in MANIFEST.json, described as mlx-lm 0.31's own
load_prompt_cache restores them (see ``describe``).

Run with mlx-lm 0.31.x installed (Python 3.10 gets no later one), from the
repository root: ``python tests/data/legacy-formats/make_mlx_lm_031.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx_lm
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.legacy_describe import describe  # noqa: E402
from tests.mlx_lm_cases import CASES  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE / "mlx-lm-0.31"


def main() -> None:
    assert mlx_lm.__version__.startswith("0.31."), mlx_lm.__version__
    OUT.mkdir(exist_ok=True)
    manifest_path = HERE / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text())
    for name, make in CASES.items():
        path = OUT / f"{name}.safetensors"
        user = {"note": f"fixture {name} (mlx-lm {mlx_lm.__version__})"}
        save_prompt_cache(str(path), make(), user)
        restored, meta = load_prompt_cache(str(path), return_metadata=True)
        manifest[f"mlx-lm-0.31/{name}.safetensors"] = {
            "format": "mlx-lm-prompt-cache",
            "layout": "mlx-lm 0.31",
            "metadata": meta,
            "classes": [type(c).__name__ for c in restored],
            "layers": [describe(c) for c in restored],
        }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
