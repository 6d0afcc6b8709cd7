"""The client half: what a generation loop imports (``kvkeeper.Client``)."""

from __future__ import annotations

import importlib
from types import ModuleType


def mlx_part(name: str) -> ModuleType:
    """``kvkeeper.client.<name>``, a module that needs MLX (the codec, the
    reader). Installed without the mlx extra (``pip install kvkeeper``, the
    daemon's install), the ModuleNotFoundError says what to install."""
    try:
        return importlib.import_module(f"kvkeeper.client.{name}")
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in ("mlx", "numpy"):
            raise
        raise ModuleNotFoundError(f"{exc}: saving and loading caches needs MLX "
                                  f"(pip install 'kvkeeper[mlx]')", name=exc.name) from None
