"""The commands a person (or a script, with ``--json``) runs against a store:
stats, ls, rm, gc (``listing``), verify (``verify``), import and export
(``transfer``), and the service installers (``services``).

Everything that changes the store goes through the daemon, its only writer;
``verify`` reads files itself, and ``verify --repair`` without a daemon takes
the daemon's lock so that nothing else writes meanwhile.
"""

from kvkeeper.ops.common import CommandError, one_line
from kvkeeper.ops.listing import gc, ls, rm, stats
from kvkeeper.ops.services import install_service, uninstall_service
from kvkeeper.ops.transfer import export, import_files
from kvkeeper.ops.verify import verify

__all__ = ["CommandError", "export", "gc", "import_files", "install_service", "ls", "one_line",
           "rm", "stats", "uninstall_service", "verify"]
