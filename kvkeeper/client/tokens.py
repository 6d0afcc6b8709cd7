"""Token ids as the client keeps them: a list of ints, copied once."""

from __future__ import annotations

import operator
from array import array
from typing import Any

import msgspec

from kvkeeper.writebehind import check_token_ids, one_row

__all__ = ["token_id_list"]


def token_id_list(token_ids: Any) -> list[int]:
    """A list of ``token_ids`` (a sequence, iterable, numpy or MLX array of
    integers; an array of shape (1, n) too) the caller cannot change
    afterwards; raises ValueError for anything else (see `check_token_ids`;
    bools are refused)."""
    token_ids = one_row(token_ids)
    check_token_ids(token_ids)
    if hasattr(token_ids, "tolist"):
        try:
            token_ids = token_ids.tolist()
        except RuntimeError as exc:
            if "in current thread" not in str(exc):
                raise
            # As for the cache's arrays (codec.capture_cache).
            raise ValueError(
                f"token_ids is an MLX array still to be computed on another thread's "
                f"stream ({exc}): evaluate it there first (mx.eval), or pass a list"
            ) from None
    # A copy the caller cannot change afterwards, checked in C: a list of
    # ints in ~3 ns a token (array('q') took 10); numpy integers and
    # other whole numbers go the slower way.
    try:
        ids = msgspec.convert(token_ids, list[int])
    except msgspec.ValidationError:
        try:
            items = list(token_ids)  # once: it may be an iterator
            # array("q") takes True as 1: a mask passed by mistake would
            # be saved as token ids that look real.
            if any(isinstance(t, bool) for t in items):
                raise TypeError("bools are not token ids")
            try:
                ids = array("q", items).tolist()
            except OverflowError:
                # Past 64 signed bits beside another kind of integer (a numpy
                # uint64 of 2**64 - 1, a Python int of 2**70 beside a numpy
                # one): any integer is an id, as it is alone.
                ids = [operator.index(t) for t in items]
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"token_ids must be integers: {exc}") from None
    return ids
