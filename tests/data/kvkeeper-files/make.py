"""Writes kvkeeper entries saved under the installed mlx-lm into
mlx-lm-<0.31|0.32>/ (its cache API: counters in meta_state up to 0.31, in the
state from 0.32), and into MANIFEST.json each one's layers as that mlx-lm
restores them (tests/legacy_describe.py: the same under either API).

Saved through a real ``kvkeeper serve`` on a temporary root. Run once under
each API, from the repository root: ``python tests/data/kvkeeper-files/make.py``
(Python 3.10 installs mlx-lm 0.31; 3.11+ installs 0.32).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kvkeeper import Client, read_cache_file  # noqa: E402
from kvkeeper.protocol import naming  # noqa: E402
from tests.legacy_describe import MLX_LM_OLD_API, describe  # noqa: E402
from tests.mlx_lm_cases import CASES, TOKENS  # noqa: E402

HERE = Path(__file__).parent
MODEL = "fixture-model"


def main() -> None:
    api = "mlx-lm-0.31" if MLX_LM_OLD_API else "mlx-lm-0.32"
    out = HERE / api
    out.mkdir(exist_ok=True)
    manifest_path = HERE / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvk") as tmp:
        root, sock = Path(tmp) / "root", Path(tmp) / "s"
        proc = subprocess.Popen([sys.executable, "-m", "kvkeeper.cli", "serve", "--root",
                                 str(root), "--socket", str(sock)], stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                if sock.exists():
                    break
                time.sleep(0.1)
            with Client(sock, timeout=30) as kv:
                for name, make in CASES.items():
                    assert kv.save(MODEL, name, make(), list(range(TOKENS)))
                assert kv.flush(timeout=60)
            for name in CASES:
                path = out / f"{name}.safetensors"
                shutil.copyfile(naming.entry_path(root, MODEL, name), path)
                got = read_cache_file(path, model=MODEL, cache_id=name)
                manifest[f"{api}/{name}.safetensors"] = {
                    "saved_with": f"mlx-lm {mlx_lm.__version__}",
                    "layers": [describe(c) for c in got.cache],
                }
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
