"""Reading and decoding read items, once for every execution: :class:`ItemDecoder` and
:class:`LocalExecution`.

:class:`ItemDecoder` turns one read item (a slice of a shard) into decoded blocks with
:func:`~ray_ingest.execution.read.read_item` and the :class:`~ray_ingest.decode.decoder.Decoder`:
the decode workers of every Ray mode run it, so the rows are the same bit for bit whoever
decodes. :class:`LocalExecution` runs it in this process: the head start
(:mod:`ray_ingest.execution.headstart`) decodes an execution's first items with it while the
workers start, ``decode.compute: threads`` (:mod:`ray_ingest.execution.threads`) reads and
decodes with one on all its threads, and tests run the loader's stages on it without a
cluster. No Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.shard import Shard
from ray_ingest.config import Config
from ray_ingest.decode.decoder import Decoder
from ray_ingest.decode.sizing import block_rows
from ray_ingest.execution.read import read_item
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.twintar.reader import read_options

Block = dict[str, np.ndarray]


class ItemDecoder:
    """Reads one read item of a shard and decodes it into blocks of at most a block's rows.

    Args:
        cfg: the run configuration (decode settings, read options, error policy).
        metric_tags: the Ray metric tags of the loader whose items it reads.
        log_skips: log every skip here (False where the loader's skip filter, in the same
            process, logs them with its rank).
    """

    def __init__(self, cfg: Config, metric_tags: dict[str, str] | None = None,
                 log_skips: bool = True):
        self.cfg, self.metric_tags, self.log_skips = cfg, metric_tags, log_skips
        self.decoder = Decoder(cfg.decode, seed=cfg.loader.seed, on_error=cfg.loader.on_error,
                               log_skips=log_skips)
        self.opts = read_options(cfg)
        self.rows_per_block = block_rows(cfg)

    def read_columns(self, shard: Shard, item: ReadItem, rows: int | None = None
                     ) -> Iterator[dict[str, list[Any]]]:
        """The raw rows of ``item`` as column lists, ``rows`` (default: a block) at a time."""
        yield from read_item(shard, item, self.opts, rows or self.rows_per_block,
                             self.cfg.loader.on_error, self.metric_tags,
                             log_skips=self.log_skips, arrow=False)

    def __call__(self, shard: Shard, item: ReadItem) -> list[Block]:
        """The decoded blocks of ``item``."""
        return [self.decoder(cols) for cols in self.read_columns(shard, item)]


class LocalExecution:
    """Read and decode ``items`` in this process (an
    :class:`~ray_ingest.execution.handoff.Execution`).

    Its skips are not logged here: the loader's skip filter, in this process, logs every one
    with its rank (a decode actor's go to that actor's log).
    """

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 metric_tags: dict[str, str] | None = None):
        self.cfg, self.catalog, self.items = cfg, catalog, list(items)
        self.items_decoder = ItemDecoder(cfg, metric_tags, log_skips=False)
        self.decoder = self.items_decoder.decoder
        self.closed = False
        self.read = 0

    @classmethod
    def factory(cls, cfg: Config, catalog: Catalog):
        return lambda items: cls(cfg, catalog, items)

    def read_columns(self, item: ReadItem, rows: int | None = None
                     ) -> Iterator[dict[str, list[Any]]]:
        """The raw rows of one read item as column lists, ``rows`` (default: a block) at a time."""
        self.read += 1
        yield from self.items_decoder.read_columns(self.catalog.shard(item.sid), item, rows)

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
