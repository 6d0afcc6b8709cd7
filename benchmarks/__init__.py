"""kvkeeper's benchmark suite: ``python -m benchmarks [--quick] [--tiny] [--out DIR]``.

Starts its own daemon (a real ``kvkeeper serve`` subprocess) on a temporary
root, runs every case side by side with its baselines, prints a summary and
writes ``BENCHMARKS.md``, ``results.json`` and ``save_latency.png``.
"""

import time

#: When the suite was first imported: a run's time counts its imports (MLX's
#: and the rest, about 2 s), which its own clock left out.
STARTED = time.monotonic()
