"""`python -m benchmarks.startup`: the benchmark's command line (`benchmarks/startup/bench.py`)."""

import sys

from benchmarks.startup.bench import main

sys.exit(main())
