"""The inference benchmark of Section 5 (latency, maximum throughput, HF comparison, bandwidth).

    python benchmarks/inference.py            # CPU-sized defaults
    python benchmarks/inference.py --help     # flags, e.g. --scale paper-1b --device cuda --dtype bfloat16

The logic lives in :mod:`griffin.bench` (also ``griffin bench inference``).
"""

import sys

from griffin.bench import main

if __name__ == "__main__":
    sys.exit(main())
