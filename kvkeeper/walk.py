"""A directory tree walked without recursion.

``os.walk`` recurses once per level up to Python 3.11: a tree 1,100
levels deep under the store's root (paths of 2,200 bytes, well inside
PATH_MAX) raised RecursionError, which stopped the daemon's start-up scan
and every ``gc`` (the disk budget then stayed off) and ended ``export``
with a traceback. Python 3.12's ``os.walk`` keeps a stack of its own; this
is that walk, top-down only, for every Python kvkeeper runs on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator


def walk(top: str | os.PathLike[str], onerror: Callable[[OSError], object] | None = None,
         followlinks: bool = False) -> Iterator[tuple[str, list[str], list[str]]]:
    """As ``os.walk(top, topdown=True, onerror=..., followlinks=...)``: yields
    (directory, its subdirectory names, its other names), and the caller may
    prune the subdirectory names in place. The depth is bounded only by memory."""
    stack = [os.fspath(top)]
    while stack:
        here = stack.pop()
        dirs: list[str] = []
        others: list[str] = []
        try:
            listing = os.scandir(here)
        except OSError as exc:
            if onerror is not None:
                onerror(exc)
            continue
        with listing:
            try:
                for entry in listing:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    (dirs if is_dir else others).append(entry.name)
            except OSError as exc:  # the listing failed part way (as os.walk: skip it)
                if onerror is not None:
                    onerror(exc)
                continue
        yield here, dirs, others
        # Reversed: popped in the listing's order, as os.walk visits them.
        for name in reversed(dirs):
            path = os.path.join(here, name)
            if followlinks or not os.path.islink(path):
                stack.append(path)
