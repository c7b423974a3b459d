"""Train-step benchmark (ray_ingest/tools/train_bench.py): `python bench/train_step.py --help`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ingest.tools.train_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
