"""The read and decode stages run in this process: what the Ray edge computes, without Ray.

``IngestLoader(..., open_execution=LocalExecution.factory(cfg, catalog))`` exercises every other
stage of the loader (epoch window, skip filter, batcher, progress, collate) on real tars with the
real read and decode code, no cluster needed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ray_ingest.catalog import Catalog
from ray_ingest.config import Config
from ray_ingest.decode import Decoder
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.reader import read_options
from ray_ingest.sizing import block_rows
from ray_ingest.source import read_item


class LocalExecution:
    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem]):
        self.cfg, self.catalog, self.items = cfg, catalog, list(items)
        self.decoder = Decoder(cfg.decode, seed=cfg.loader.seed, on_error=cfg.loader.on_error)
        self.closed = False
        self.read = 0

    @classmethod
    def factory(cls, cfg: Config, catalog: Catalog):
        return lambda items: cls(cfg, catalog, items)

    def blocks(self) -> Iterator[dict[str, np.ndarray]]:
        opts = read_options(self.cfg)
        for item in self.items:
            if self.closed:
                return
            self.read += 1
            for table in read_item(self.catalog.shards[item.sid], item, opts,
                                   block_rows(self.cfg), self.cfg.loader.on_error):
                yield self.decoder(table)

    def stats(self) -> str:
        return f"local: {self.read} read items"

    def close(self) -> None:
        self.closed = True
