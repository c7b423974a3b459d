"""The read and decode stages run in this process: what the Ray edge computes, without Ray.

``IngestLoader(..., open_execution=LocalExecution.factory(cfg, catalog))`` exercises every other
stage of the loader (epoch window, skip filter, batcher, progress, collate) on real tars with the
real read and decode code, no cluster needed. The class is the head start's
(:mod:`ray_ingest.headstart`).
"""

from ray_ingest.headstart import LocalExecution

__all__ = ["LocalExecution"]
