"""``python -m kvkeeper``: the ``kvkeeper`` command, where no script is on PATH."""

import sys

from kvkeeper.cli import main

if __name__ == "__main__":
    sys.exit(main())
