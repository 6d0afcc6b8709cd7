"""kvkeeper: keep MLX prompt caches across restarts.

``import kvkeeper`` stays light (the daemon never imports MLX); the client API
below loads MLX on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.11"

__all__ = ["CacheFileError", "Client", "DaemonError", "DaemonShuttingDown", "DaemonTimedOut",
           "DaemonUnavailable", "LoadedCache", "read_cache_file", "model_fingerprint",
           "__version__"]

if TYPE_CHECKING:
    from kvkeeper.client.channel import DaemonShuttingDown, DaemonTimedOut, DaemonUnavailable
    from kvkeeper.client.client import Client, DaemonError
    from kvkeeper.client.reader import CacheFileError, LoadedCache, read_cache_file
    from kvkeeper.fingerprint import model_fingerprint


def __dir__() -> list[str]:
    # The names __getattr__ gives, for dir() and tab completion.
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    if name == "Client":
        from kvkeeper.client.client import Client

        return Client
    if name == "DaemonError":  # a typed error reply (e.g. "busy")
        from kvkeeper.client.client import DaemonError

        return DaemonError
    if name == "DaemonUnavailable":  # what flush() and the other requests raise
        from kvkeeper.client.channel import DaemonUnavailable

        return DaemonUnavailable
    if name == "DaemonShuttingDown":  # a DaemonUnavailable: the daemon is draining
        from kvkeeper.client.channel import DaemonShuttingDown

        return DaemonShuttingDown
    if name == "DaemonTimedOut":  # a DaemonUnavailable: no answer in time, may still be up
        from kvkeeper.client.channel import DaemonTimedOut

        return DaemonTimedOut
    if name in ("CacheFileError", "LoadedCache", "read_cache_file"):
        from kvkeeper.client import mlx_part

        return getattr(mlx_part("reader"), name)
    if name == "model_fingerprint":
        from kvkeeper.fingerprint import model_fingerprint

        return model_fingerprint
    raise AttributeError(f"module 'kvkeeper' has no attribute {name!r}")
