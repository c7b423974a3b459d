"""``LocalExecution``: read and decode read items in this process, with the Ray edge's code.

What the Ray edge computes for a rank's stream, without Ray: the same :func:`read_item` and
:class:`~ray_ingest.decode.decoder.Decoder`, so the rows are the same bit for bit. The head start
(:mod:`ray_ingest.execution.headstart`) decodes an execution's first items with it while the pool
starts,
``decode.compute: threads`` (:mod:`ray_ingest.execution.threads`) reads and decodes with one on all
its threads, and tests run the loader's stages on it without a cluster. No Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.config import Config
from ray_ingest.decode.decoder import Decoder
from ray_ingest.decode.sizing import block_rows
from ray_ingest.execution.read import read_item
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.twintar.reader import read_options

Block = dict[str, np.ndarray]


class LocalExecution:
    """Read and decode ``items`` in this process (an
    :class:`~ray_ingest.execution.handoff.Execution`).

    Its skips are not logged here: the loader's skip filter, in this process, logs every one
    with its rank (a decode actor's go to that actor's log).
    """

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 metric_tags: dict[str, str] | None = None):
        self.cfg, self.catalog, self.items = cfg, catalog, list(items)
        self.decoder = Decoder(cfg.decode, seed=cfg.loader.seed, on_error=cfg.loader.on_error,
                               log_skips=False)
        self.metric_tags = metric_tags
        self.opts = read_options(cfg)
        self.rows_per_block = block_rows(cfg)
        self.closed = False
        self.read = 0

    @classmethod
    def factory(cls, cfg: Config, catalog: Catalog):
        return lambda items: cls(cfg, catalog, items)

    def read_columns(self, item: ReadItem, rows: int | None = None
                     ) -> Iterator[dict[str, list[Any]]]:
        """The raw rows of one read item as column lists, ``rows`` (default: a block) at a time."""
        self.read += 1
        yield from read_item(self.catalog.shard(item.sid), item, self.opts,
                             rows or self.rows_per_block, self.cfg.loader.on_error,
                             self.metric_tags, log_skips=False, arrow=False)

    def item_blocks(self, item: ReadItem) -> Iterator[Block]:
        """The decoded blocks of one read item."""
        for cols in self.read_columns(item):
            yield self.decoder(cols)

    def blocks(self) -> Iterator[Block]:
        for item in self.items:
            if self.closed:
                return
            yield from self.item_blocks(item)

    def stats(self) -> str:
        return f"local: {self.read} read items"

    def close(self) -> None:
        self.closed = True
