"""The client half: what a generation loop imports (``kvkeeper.Client``)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

#: How to get what the client needs, in the messages that say it is missing
#: (kvkeeper is installed from a checkout; a bare package name would install
#: whatever the index has under it): the extra, or its packages by name.
MLX_EXTRA = ("in a checkout: pip install -e '.[mlx]'; into an environment that has "
             "kvkeeper already: pip install "
             f"'{'mlx' if sys.platform == 'darwin' else 'mlx[cpu]'}>=0.29' "
             "'mlx-lm>=0.31' 'mlx-vlm>=0.7'")


def mlx_part(name: str) -> ModuleType:
    """``kvkeeper.client.<name>``, a module that needs MLX (the codec, the
    reader). Installed without the mlx extra (``pip install .``, the
    daemon's install), the ModuleNotFoundError says what to install."""
    try:
        return importlib.import_module(f"kvkeeper.client.{name}")
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in ("mlx", "numpy"):
            raise
        raise ModuleNotFoundError(f"{exc}: saving and loading caches needs MLX "
                                  f"(kvkeeper's mlx extra; {MLX_EXTRA})", name=exc.name) from None
