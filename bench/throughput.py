"""Throughput benchmark (see ray_ingest/tools/benchmark.py): `python bench/throughput.py --help`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ingest.tools.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
