"""``TwinTarDatasource``: the Ray Data read stage of a rank's planned stream.

The driver turns a rank's planned stream (ordered :class:`ReadItem` slices of shards) into one
small picklable :class:`~ray.data.ReadTask` per slice; each task reads its slice with
:func:`ray_ingest.execution.read.read_item` (Arrow blocks of raw bytes plus provenance).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from ray_ingest.catalog.shard import TarSample
from ray_ingest.execution.read import DEFAULT_SAMPLE_BYTES, block_schema, read_item
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.twintar.reader import ReadOptions


class TwinTarDatasource(Datasource):
    """Reads a planned, ordered list of shard slices; one ReadTask per slice."""

    def __init__(
        self,
        shards: Sequence[TarSample],
        items: Sequence[ReadItem],
        opts: ReadOptions = ReadOptions(),
        block_rows: int = 64,
        on_error: str = "raise",
        sample_bytes: int = DEFAULT_SAMPLE_BYTES,
        metric_tags: Mapping[str, str] | None = None,
    ):
        super().__init__()
        self._shards = {it.sid: shards[it.sid] for it in items}
        self._items = tuple(items)
        self._opts = opts
        self._block_rows = block_rows
        self._on_error = on_error
        self._sample_bytes = sample_bytes
        self._metric_tags = dict(metric_tags or {})

    def get_name(self) -> str:
        return "TwinTar"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(it.count for it in self._items) * self._sample_bytes

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        # NOTE: called several times per execution; it only builds closures (no I/O).
        tasks = []
        for item in self._items:
            if item.count <= 0:
                continue
            shard = self._shards[item.sid]
            meta = BlockMetadata(
                num_rows=item.count,
                size_bytes=int(item.count * self._sample_bytes),
                input_files=[shard.url(shard.modalities[0])],
                exec_stats=None,
            )
            tasks.append(ReadTask(
                _bind(shard, item, self._opts, self._block_rows, self._on_error,
                      self._metric_tags),
                meta,
                schema=block_schema(shard.modalities),
                per_task_row_limit=per_task_row_limit,
            ))
        return tasks


def _bind(shard: TarSample, item: ReadItem, opts: ReadOptions, block_rows: int, on_error: str,
          metric_tags: Mapping[str, str]):
    def read_fn() -> Iterator[pa.Table]:
        return read_item(shard, item, opts, block_rows, on_error, metric_tags)

    return read_fn
