import sys

from benchmarks.run import main

try:
    sys.exit(main())
except KeyboardInterrupt:
    # (Ctrl-C or SIGTERM: the run's clean-ups have run; no report is written.)
    print("benchmarks: interrupted; no report written", file=sys.stderr)
    sys.exit(130)
