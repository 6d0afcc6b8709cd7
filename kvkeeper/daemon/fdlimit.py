"""Room for client connections: the daemon holds one descriptor per client.

libzmq (4.3.5) aborts the whole process when ``accept()`` on an ``ipc://``
socket fails with EMFILE (an assertion in ``ipc_listener.cpp``), so running
out of descriptors would kill the daemon and every save it holds. The usual
soft limit (1024 in a shell or a systemd service, 256 under launchd) is
reached by about a thousand connected clients (measured: the daemon aborted
at 1,010); the hard limit is far above it, and any process may raise its soft
limit up to the hard one.
"""

from __future__ import annotations

import resource

from kvkeeper.logs import get_logger

log = get_logger("kvkeeper.daemon")

#: Enough for any real number of clients; not more, as some code sizes
#: tables by the limit.
WANTED = 65536
#: macOS refuses a soft limit above kern.maxfilesperproc (commonly 10240,
#: OPEN_MAX) even when the hard limit is unlimited; a Mac may set it lower,
#: so smaller limits are tried after it, halving (those above the limit in
#: force are the ones worth having).
_FALLBACK = 10240


def raise_fd_limit() -> int | None:
    """Raise this process's soft limit on open descriptors toward the hard
    limit (at most `WANTED`); return the soft limit in force afterwards, or
    None when it is unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    top = WANTED if hard == resource.RLIM_INFINITY else min(WANTED, hard)
    # With kern.maxfilesperproc at 8192 both 65536 and 10240 were refused,
    # and the daemon kept launchd's 256 (a review): about 250 clients, then
    # libzmq's abort.
    tries = sorted({top, min(top, _FALLBACK), *(top >> n for n in range(1, 8))}, reverse=True)
    for want in tries:
        if want <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.debug("event=fd_limit_not_raised want=%d error=%s", want, exc)
            continue
        return want
    return soft
