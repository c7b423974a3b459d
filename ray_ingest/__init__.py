"""ray_ingest: twin-tar WebDataset ingest on Ray.

Pure layers (no Ray, no torch): :mod:`ray_ingest.catalog`, :mod:`ray_ingest.tario`,
:mod:`ray_ingest.twin`, :mod:`ray_ingest.plan`. Ray lives only in :mod:`ray_ingest.source`,
:mod:`ray_ingest.decode` and :mod:`ray_ingest.stream`.
"""

__version__ = "0.1.0"
