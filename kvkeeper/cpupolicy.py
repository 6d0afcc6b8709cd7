"""Background work gives way to the generation loop when it wakes up.

The daemon's threads and the client's I/O threads wake up again and again
while a save streams (for frames sent, received and written). Under
Linux's default policy each wake-up may take the core from the thread running
the generation loop, in the middle of a ``save()`` or a decode step. Under
``SCHED_BATCH`` they keep their fair share of the CPU but never preempt a
running thread when they wake: they wait for its time slice to end. On the
2-core benchmark machine (512 MiB saves every 50 ms while earlier ones
stream), the ``save()`` calls that lost their core fell from 18% to 6.5%.

The price: when every core is busy with other work, a request's round trip
(``flush()``, ``ping()``, a ``load()`` that asks the daemon) may wait for
those threads to get a core (two CPU-bound processes on the two cores: ping
p50 2.9 ms against 0.2 ms in one run, 0.14 against 0.24 ms in another). ``cpu_policy="normal"`` (the daemon's
``--cpu-policy``, the client's ``Client(cpu_policy=...)``) leaves the threads
as they are.

Not ``SCHED_IDLE``, which a waking thread preempts at once: the client's I/O
thread holds the GIL while it runs, and under ``SCHED_IDLE`` it gets a core
only when nothing else wants one, so on a busy machine the generation loop
waits for that thread to be given one (a thread sleeping 10 ms beside such a
Python thread and two CPU-bound processes woke up to 196-208 ms late, against
at most 3.9 ms under ``SCHED_BATCH``; BENCHMARKS.md has what it gained).

macOS has no ``SCHED_BATCH``; there the LaunchAgent's ``ProcessType``
(Standard, launchd's light limits, or Interactive for "normal": none) does
the daemon's part when it runs as a service; a daemon started by hand, and
the client's threads, keep the default policy.
"""

from __future__ import annotations

import os

__all__ = ["CPU_POLICIES", "batch_this_thread", "check_cpu_policy", "restore_this_thread"]

#: "batch": background threads under SCHED_BATCH where there is one;
#: "normal": left under the policy they inherit.
CPU_POLICIES = ("batch", "normal")


def check_cpu_policy(value: object) -> str:
    """``value`` if it is one of `CPU_POLICIES`; raises ValueError otherwise."""
    if value not in CPU_POLICIES:
        raise ValueError(f"cpu policy must be batch or normal, not {value!r}")
    return value  # type: ignore[return-value]


def batch_this_thread() -> int | None:
    """Run the calling thread, and every thread it starts from now on, under
    ``SCHED_BATCH``.

    Only a thread under the default policy is moved: one the user gave another
    policy (``chrt``, systemd's ``CPUSchedulingPolicy``) keeps it. Returns the
    policy replaced, for `restore_this_thread`; None when nothing changed (no
    ``SCHED_BATCH`` on this platform, another policy already, or the system
    refused).
    """
    batch = getattr(os, "SCHED_BATCH", None)
    other = getattr(os, "SCHED_OTHER", None)
    if batch is None or other is None or not hasattr(os, "sched_setscheduler"):
        return None
    try:
        # pid 0 is the calling thread, not the whole process, on Linux.
        if os.sched_getscheduler(0) != other:
            return None
        os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError:
        return None
    return other


def restore_this_thread(policy: int | None) -> None:
    """Give the calling thread back the policy `batch_this_thread` replaced,
    unless someone gave it another one meanwhile (that one is kept)."""
    if policy is None:
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        pass  # the thread keeps SCHED_BATCH: slower to wake, otherwise the same
