"""The read stage: one planned read item (a slice of a shard) as blocks of raw rows.

:func:`read_item` opens the slice's twin tars, positions them at the slice's first sample
(key-index seek or header-only skip), expands them in lockstep and yields blocks (Arrow tables,
or Python column lists for a decoder in the same process) of raw bytes plus provenance:

``__key__`` ``__shard__`` ``__index__`` (position in the shard), ``__sid__`` (shard number in
the catalog), ``__seq__`` (position in the rank's stream of its epoch, what the read state
records), ``__epoch__``, ``__pad__`` (planned duplicate), ``__bucket__`` (aspect bucket of the
shard), ``__error__`` (non-empty for a sample skipped under ``on_error=skip``), ``__bytes__``
(member payload bytes read for the sample, summed per rank by the loader), then one binary
column and one extension column per modality (:mod:`ray_ingest.columns`). Bytes read and remote
retries are also recorded as Ray metrics (:mod:`ray_ingest.metrics`) under the tags of the
loader that planned the read. ``__read_node__`` is the Ray node id of the task that read it.
The Ray Data read tasks (:class:`~ray_ingest.execution.raydata.TwinTarDatasource`), the fused read
of the decode actors, the head start and the decode threads all read with it. No Ray, no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from ray_ingest import metrics
from ray_ingest.catalog.shard import Shard
from ray_ingest.columns import (
    BUCKET,
    BYTES,
    EPOCH,
    ERROR,
    INDEX,
    KEY,
    PAD,
    READ_NODE,
    SEQ,
    SHARD,
    SID,
    T_READ,
    ext_column,
)
from ray_ingest.errors import IngestError
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_shard,
)
from ray_ingest.twintar.twin import shown

__all__ = ["ReadItem", "block_schema", "read_item"]

log = logging.getLogger(__name__)

#: Bytes assumed per sample before anything was measured (a 4K JPEG is ~2 MB, ours ~20 KB).
DEFAULT_SAMPLE_BYTES = 256 * 1024
#: A read item's count that reads to the end of its shard (a wdinfo without per-shard counts).
TO_END = 2**62


def block_schema(modalities: Sequence[str]) -> pa.Schema:
    """The Arrow schema of the blocks of a shard with these modalities."""
    fields = [
        pa.field(KEY, pa.string()),
        pa.field(SHARD, pa.string()),
        pa.field(INDEX, pa.int64()),
        pa.field(SID, pa.int64()),
        pa.field(SEQ, pa.int64()),
        pa.field(EPOCH, pa.int64()),
        pa.field(PAD, pa.bool_()),
        pa.field(BUCKET, pa.string()),
        pa.field(ERROR, pa.string()),
        pa.field(T_READ, pa.float64()),
        pa.field(BYTES, pa.int64()),
        pa.field(READ_NODE, pa.string()),
    ]
    for m in modalities:
        fields.append(pa.field(m, pa.binary()))
        fields.append(pa.field(ext_column(m), pa.string()))
    return pa.schema(fields)


def read_item(
    shard: Shard,
    item: ReadItem,
    opts: ReadOptions,
    block_rows: int,
    on_error: str = "raise",
    metric_tags: Mapping[str, str] | None = None,
    log_skips: bool = True,
    arrow: bool = True,
) -> Iterator[pa.Table | dict[str, list[Any]]]:
    """Generator behind one ReadTask: Arrow blocks of at most ``block_rows`` rows.

    ``log_skips`` false where the loader's skip filter logs every skip (same process).
    ``arrow`` false: the same blocks as Python column lists, for a decoder in the reading
    process (decode actors that read their own items, the loader's threads), which would
    otherwise copy every payload into Arrow and straight back into Python bytes."""
    with metrics.read_scope(metric_tags):
        yield from _read_item(shard, item, opts, block_rows, on_error, log_skips, arrow)


def _read_item(shard: Shard, item: ReadItem, opts: ReadOptions, block_rows: int,
               on_error: str, log_skips: bool, arrow: bool) -> Iterator[Any]:
    schema = block_schema(shard.modalities)
    names = schema.names
    cols: dict[str, list[Any]] = {n: [] for n in names}
    bucket = shard.bucket or ""
    node = _node_id()

    clock = [time.perf_counter()]

    def flush() -> pa.Table | dict[str, list[Any]]:
        n = len(cols[KEY])
        cols[T_READ].extend([(time.perf_counter() - clock[0]) / max(n, 1)] * n)
        metrics.on_bytes_read(sum(cols[BYTES]))
        cols[READ_NODE].extend([node] * n)
        if not arrow:
            block = {n: cols[n] for n in names}
            for n in names:
                cols[n] = []
            return block
        table = pa.table({n: pa.array(cols[n], type=schema.field(n).type) for n in names},
                         schema=schema)
        for n in names:
            cols[n].clear()
        return table

    def add(row: dict[str, Any], error: str = "") -> None:
        index = row[INDEX]
        cols[KEY].append(row[KEY])
        cols[SHARD].append(shard.path)
        cols[INDEX].append(index)
        cols[SID].append(item.sid)
        cols[SEQ].append(item.seq + index - item.start)
        cols[EPOCH].append(item.epoch)
        cols[PAD].append(item.pad)
        cols[BUCKET].append(bucket)
        cols[ERROR].append(error)
        cols[BYTES].append(sum(len(row[m]) for m in shard.modalities if row.get(m) is not None))
        for m in shard.modalities:
            cols[m].append(row.get(m))
            cols[ext_column(m)].append(row.get(ext_column(m)))

    next_index = item.start
    last_key = None
    try:
        for row in read_shard(shard, item.start, item.count, opts, on_error=on_error):
            if row.get(ERROR) is not None:  # one unreadable sample (on_error=skip)
                reason = _reason(row[ERROR])
                if log_skips:
                    log.warning("skip shard %s key %s index %d: %s", shard.path, row[KEY],
                                row[INDEX], reason)
                add(row, error=reason)
            else:
                add(row)
            next_index = row[INDEX] + 1
            last_key = row[KEY]
            if len(cols[KEY]) >= block_rows:
                yield flush()
                clock[0] = time.perf_counter()
    except (IngestError, OSError) as exc:
        if on_error != "skip":
            raise _located(exc, shard.path, next_index, last_key) from None
        reason = _reason(exc)
        if log_skips:
            log.warning("skip shard %s samples %d..%d: %s", shard.path, next_index,
                        item.start + item.count - 1, reason)
        for index in range(next_index, item.start + item.count):
            add({KEY: "", INDEX: index}, error=reason)
            if len(cols[KEY]) >= block_rows:
                yield flush()
    if cols[KEY]:
        yield flush()


def _reason(exc: BaseException) -> str:
    """Skip reason of a read failure, as the read state records it."""
    return f"read: {type(exc).__name__}: {exc}".replace("\n", " ")


def _node_id() -> str:
    """The Ray node this read runs on ("local" outside Ray: never imports, starts or joins
    one)."""
    ray = metrics.running_ray()
    return ray.get_runtime_context().get_node_id() if ray is not None else "local"


def _located(exc: BaseException, shard: str, index: int, last_key: str | None) -> IngestError:
    """One-line error naming the shard, the sample index and the last key read before it.

    Keeps the exception type when it takes a plain message (TarFormatError, AlignmentError…).
    """
    where = f"shard {shard} index {index}" + (f" (after key {shown(last_key)})" if last_key
                                              else "")
    text = " ".join(str(exc).split())
    text = text.removeprefix(f"shard {shard}: ")
    if isinstance(exc, IngestError) and type(exc).__init__ is Exception.__init__:
        return type(exc)(f"{where}: {text}")
    return IngestError(f"{where}: read failed: {type(exc).__name__}: {text}")
