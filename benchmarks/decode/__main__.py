"""`python -m benchmarks.decode`: the benchmark's command line (`benchmarks/decode/bench.py`)."""

import sys

from benchmarks.decode.bench import main

sys.exit(main())
