"""``ray job submit --working-dir . -- python jobs/train.py --config configs/demo.yaml``.

Thin entry point: the job lives in :mod:`ray_ingest.train` (flags: ``--help``).
"""

import os
import sys

# The job's working_dir is a checkout: make `ray_ingest` importable without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ingest.train.job import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
