"""Fault injection for the reliability tests: off unless a test asks for it.

``KVKEEPER_TEST_FAULTS`` holds comma-separated ``name=value`` pairs, read once
at import. Nothing here runs in a normal daemon: every hook is a dictionary
lookup that finds nothing.

- ``crash_at=POINT``: SIGKILL the daemon at a point of a durable replace:
  ``tmp_created``, ``half_written``, ``fsynced``, ``renamed``, ``dir_fsynced``.
- ``write_delay=S``: sleep S seconds per MiB written (a slow disk).
- ``write_hold=PATH``: every write of a save's bytes waits until PATH exists
  (at most 600 s): the writer stays busy until a test lets it go.
- ``abort_delay=S``: sleep S seconds before removing a tmp file (widens the
  writer's wait on it, for the tests of what may happen meanwhile).
- ``no_fsync=1`` / ``no_dir_fsync=1``: skip a flush (negative controls of the
  power-cut test: they must show loss).
- ``scan_hold=PATH``: a rescan waits, after reading every file and before
  it replaces the index, until PATH exists (at most 600 s; a drain's stop
  ends the wait); with ``scan_hold_after=N``, after reading N files instead.
- ``io_error=POINT``: raise EIO at a point: ``dir_fsync`` (after the rename),
  ``evicted`` (in any disk-budget pass, after each eviction: in one made
  before a save's write, that save then fails), ``listing`` (an answer to
  ``ls``: a failure no listing meets otherwise).
- ``bug=POINT``: raise RuntimeError (a bug, not the disk) where ``io_error``
  would raise EIO.
- ``dir_fsync_errno=N``: every directory fsync fails with errno N instead of
  syncing (a file system that cannot sync directories answers EINVAL).
- ``renamed_delay=S``: sleep S seconds after a save's rename, before the
  directory's fsync (a slow one); ``evict_delay=S``: sleep S seconds between
  an eviction's check of its victim and the unlink (the thread losing the
  CPU there); ``moved_delay=S``: sleep S seconds after a file moved aside
  is renamed into quarantine/, before the directories' fsyncs;
  ``delete_delay=S``: sleep S seconds before a delete's unlink (a slow one,
  for a daemon to go away in the middle of a run of deletes).

A delay logs ``event=fault_delay step=NAME`` as it begins, and a hold
``event=fault_hold step=write`` or ``step=scan`` as it begins to wait, so a
test can wait for the step it means rather than guess at a window.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

from kvkeeper.logs import get_logger

log = get_logger("kvkeeper.faults")
ENV = "KVKEEPER_TEST_FAULTS"
CRASH_POINTS = ("tmp_created", "half_written", "fsynced", "renamed", "dir_fsynced")


def _parse(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        out[name] = value
    return out


ACTIVE: dict[str, str] = _parse(os.environ.get(ENV, ""))


def crash_point(point: str) -> None:
    if ACTIVE and ACTIVE.get("crash_at") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def skip(flag: str) -> bool:
    return bool(ACTIVE) and ACTIVE.get(flag) == "1"


def slow_write(nbytes: int) -> None:
    if ACTIVE and "write_hold" in ACTIVE:
        _hold(ACTIVE["write_hold"], "write", None)
    if ACTIVE and "write_delay" in ACTIVE:
        time.sleep(float(ACTIVE["write_delay"]) * nbytes / 2**20)


def slow_abort() -> None:
    slow_step("abort_delay")


def slow_step(name: str) -> None:
    """Sleep for the ``renamed_delay``, ``evict_delay``, ``begin_delay``,
    ``moved_delay``, ``delete_delay`` or ``abort_delay`` fault, if set."""
    if ACTIVE and name in ACTIVE:
        log.info("event=fault_delay step=%s seconds=%s", name, ACTIVE[name])
        time.sleep(float(ACTIVE[name]))


def io_error(point: str) -> None:
    if ACTIVE and ACTIVE.get("io_error") == point:
        raise OSError(errno.EIO, f"injected I/O error at {point}")
    if ACTIVE and ACTIVE.get("bug") == point:
        raise RuntimeError(f"injected bug at {point}")


def dir_fsync_refused() -> None:
    """Raise the ``dir_fsync_errno`` fault's error, if set."""
    if ACTIVE and "dir_fsync_errno" in ACTIVE:
        code = int(ACTIVE["dir_fsync_errno"])
        raise OSError(code, f"injected: {os.strerror(code)}")


def hold_scan(stop: threading.Event | None, files_read: int | None) -> None:
    """Wait for the ``scan_hold`` file (or the stop) at the point the
    faults name: after ``scan_hold_after`` files, or at the end (None)."""
    if not ACTIVE or "scan_hold" not in ACTIVE:
        return
    after = ACTIVE.get("scan_hold_after")
    if (None if after is None else int(after)) != files_read:
        return
    _hold(ACTIVE["scan_hold"], "scan", stop)


def _hold(path: str, step: str, stop: threading.Event | None) -> None:
    """Wait until ``path`` exists (at most 600 s), or ``stop`` is set,
    logging ``event=fault_hold step=STEP`` if there is a wait."""
    if os.path.exists(path):
        return
    log.info("event=fault_hold step=%s", step)
    deadline = time.monotonic() + 600
    while not os.path.exists(path) and time.monotonic() < deadline:
        if stop is not None and stop.wait(0.02):
            return
        if stop is None:
            time.sleep(0.02)
