"""Twin-tar datasets as Ray Datasets: :func:`~ray_ingest.datasets.read.read_twin_tars` and
:func:`~ray_ingest.datasets.write.write_twin_tars` (also importable from ``ray_ingest``)."""

from __future__ import annotations




