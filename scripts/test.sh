#!/usr/bin/env bash
# Set up everything the tests need, then lint and run them. Works on a fresh
# machine with Python 3.10+; on Linux as root it also installs libfiu's tools
# (Debian's fiu-utils) for the I/O-error tests, and mkfs for XFS and btrfs for
# the disk-budget tests on file systems that free blocks later.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname)" = Linux ] && [ "$(id -u)" = 0 ] && ! { command -v fiu-run \
        && command -v mkfs.xfs && command -v mkfs.btrfs; } >/dev/null; then
    if command -v apt-get >/dev/null; then
        (apt-get update -qq && apt-get install -y -qq fiu-utils xfsprogs btrfs-progs) >/dev/null
    else
        # The tests that need them fail and say so; the rest still run.
        echo "scripts/test.sh: no apt-get: install libfiu's tools (fiu-run), xfsprogs and" \
             "btrfs-progs with this system's package manager for the fault tests" >&2
    fi
fi
python3 -m venv .venv
# A Python 3.10.0 venv brings a pip too old for an editable pyproject-only install.
.venv/bin/pip install -q -U pip
.venv/bin/pip install -q -e '.[test]'
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
