"""`python -m benchmarks.serving`: the benchmark's command line (`benchmarks/serving/bench.py`)."""

import sys

from benchmarks.serving.bench import main

sys.exit(main())
