"""Keeping a cache's saves apart in time, on both sides of the socket.

A loop saving every few tokens makes many saves of one cache, and only the
newest matters. The client holds a save of a cache it sent less than
``min_send_interval`` ago, the daemon one of a cache it wrote less than
``--min-write-interval`` ago; a newer save replaces a held one meanwhile.
"""

from __future__ import annotations

from collections.abc import Hashable

#: Larger saves are never held, by either side. The client: a held save keeps
#: its copy (or, over 8 MiB, the cache's buffers shared, so MLX copies them at
#: the next decode step), and sending one takes long enough that newer saves
#: coalesce in the daemon anyway.
#: The daemon: writing one takes long enough that newer saves coalesce behind
#: it, and holding it would stop its write from overlapping its arrival (256 MiB
#: saved and flushed back to back, default budget: 0.33 s held, 0.15 s not).
HOLD_MAX_BYTES = 64 * 1024 * 1024

#: A client's capture of a cache of at most this many bytes copies it at once
#: (``capture_cache``), so no later update of the cache has to: on the
#: benchmark's tiny model (1.5 MiB, a save every 16 steps) the copy took
#: 0.25 ms in save(), and decode ran at 0.994x of no saves against 0.977x
#: when the capture shared the buffers. Larger captures share them.
CAPTURE_COPY_MAX_BYTES = 4 * 1024 * 1024


class Pacer:
    """When each key last went (was sent, or written): a save of it may go
    again ``interval`` seconds later. Keys whose interval is over are
    forgotten as the table grows, so it stays the size of the recent keys."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._went: dict[Hashable, float] = {}
        self._prune_at = 1024

    def due(self, key: Hashable, now: float) -> float | None:
        """When a save of ``key`` may go, if that is later than ``now``."""
        last = self._went.get(key)
        if last is None:
            return None
        due = last + self.interval
        return due if now < due else None

    def went(self, key: Hashable, now: float) -> None:
        """A save of ``key`` went at ``now``."""
        if not self.interval:
            return
        if len(self._went) >= self._prune_at:
            self._went = {k: t for k, t in self._went.items() if now - t < self.interval}
            self._prune_at = max(1024, 2 * len(self._went))
        self._went[key] = now
