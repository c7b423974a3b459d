"""The Ray edge of the stream: one Ray Data execution reading planned items, maybe of several
epochs, through the decode actor pool, yielding numpy column blocks in stream order.

The only stage of the stream that imports Ray. Its DataContext is a private copy set once per
execution (ordering, no silently dropped blocks, original error types, quiet progress), so a
rank's loader does not change the settings of anything else in the process. Errors raised by
our read or decode code come out as the one-line :class:`~ray_ingest.errors.IngestError` they
were, not wrapped in Ray's task errors.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext, TaskPoolStrategy
from ray.data._internal.execution.execution_callback import ExecutionCallback
from ray.data._internal.execution.interfaces import ExecutionResources
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.shard import Shard
from ray_ingest.config import Config, DecodeConfig
from ray_ingest.decode.decoder import Decoder
from ray_ingest.decode.sizing import block_rows
from ray_ingest.errors import StallError
from ray_ingest.execution.handoff import Handoff
from ray_ingest.execution.pool import ingest_cause, stall_error
from ray_ingest.execution.read import DEFAULT_SAMPLE_BYTES, TO_END, block_schema, read_item
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.twintar.reader import ReadOptions, read_options

log = logging.getLogger(__name__)


#: DataContext key read by :class:`HoldScaleDown`.
HOLD_KEY = "ray_ingest.scale_down_hold_s"
#: DataContext key naming an execution for :class:`TrackExecutor`.
TRACK_KEY = "ray_ingest.execution"
#: Running executors by token (weak: a finished, collected executor leaves by itself).
_EXECUTORS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


def execution_context(cfg: Config, world_size: int = 1,
                      token: str | None = None) -> DataContext:
    """The DataContext of a loader's executions (a copy: the process's current one is kept);
    with ``token``, :class:`TrackExecutor` records its executor under it once it starts."""
    ctx = DataContext.get_current().copy()
    if token is not None:
        ctx.set_config(TRACK_KEY, token)
        ctx.custom_execution_callback_classes = [*ctx.custom_execution_callback_classes,
                                                 TrackExecutor]
    ctx.execution_options.preserve_order = cfg.loader.ordered
    ctx.enable_progress_bars = False
    ctx.execution_options.verbose_progress = False
    ctx.max_errored_blocks = 0  # never drop data silently
    # Keep an IngestError's type and one-line message (not a UserCodeException wrapper).
    ctx.raise_original_map_exception = True
    # Ray's no-progress guard also fires when the train loop merely pauses (a full buffer is no
    # progress to it); Execution bounds the time spent waiting instead (loader.stall_timeout_s).
    ctx.execution_no_progress_timeout_s = -1
    limits = rank_limits(cfg, world_size)
    if limits is not None:
        ctx.execution_options.resource_limits = limits
    if cfg.decode.scale_down_hold_s > 0 and cfg.decode.compute != "tasks":  # tasks: no pool
        ctx.set_config(HOLD_KEY, float(cfg.decode.scale_down_hold_s))
        ctx.custom_execution_callback_classes = [*ctx.custom_execution_callback_classes,
                                                 HoldScaleDown]
    return ctx


def rank_limits(cfg: Config, world_size: int) -> ExecutionResources | None:
    """This rank's share of the cluster for its execution (None: the whole cluster).

    Every rank runs its own executor, and an executor assumes it owns the cluster (ray_notes
    §10): with several ranks each would plan to use every CPU and the whole object store.
    """
    cpu, store = cfg.loader.cpu_limit, cfg.loader.object_store_limit
    if world_size > 1 and (cpu is None or store is None):
        total = ray.cluster_resources()
        if cpu is None and total.get("CPU"):
            cpu = total["CPU"] / world_size
        if store is None and total.get("object_store_memory"):
            store = total["object_store_memory"] / world_size
    if cpu is None and store is None:
        return None
    return ExecutionResources.for_limits(cpu=cpu, object_store_memory=store)


class HoldScaleDown(ExecutionCallback):
    """Keeps the decode pool through pauses of the train loop.

    A checkpoint or a validation pass stops consumption; the pipeline fills its buffers, the
    decode actors go idle, and Ray's actor autoscaler (utilisation <= 0.5) would shrink the pool
    at once, then grow it again after the pause, paying actor start-up each time. This holds
    utilisation-driven shrinking until the pool has been under-used for ``decode.
    scale_down_hold_s`` seconds in a row. Growing, and shrinking for resource pressure or at the
    end of the input, are unchanged. (Ray 2.60 has no setting for this: the callback wraps the
    executor's actor autoscaler.)
    """

    def before_execution_starts(self, executor: Any) -> None:
        hold = float(executor._data_context.get_config(HOLD_KEY, 0.0))
        scaler = getattr(executor, "_actor_autoscaler", None)
        derive = getattr(scaler, "_derive_target_scaling_config", None)
        if not hold or derive is None:
            log.warning("decode.scale_down_hold_s: this Ray version's actor autoscaler is not "
                        "the one it wraps; pauses may shrink the decode pool")
            return
        low_since: dict[int, float] = {}

        def held(actor_pool: Any, op: Any, op_state: Any) -> Any:
            req = derive(actor_pool, op, op_state)
            key = id(actor_pool)
            if req.delta < 0 and not req.force and "utilization" in (req.reason or ""):
                first = low_since.setdefault(key, time.monotonic())
                if time.monotonic() - first < hold:
                    return type(req).no_op(reason=f"scale-down held ({req.reason})")
            else:
                low_since.pop(key, None)
            return req

        scaler._derive_target_scaling_config = held


class TrackExecutor(ExecutionCallback):
    """Records an execution's executor under its token: a consumer thread blocked inside Ray
    Data's iterator (a stall) cannot close it, so :meth:`Execution.close` shuts it down."""

    def before_execution_starts(self, executor: Any) -> None:
        token = executor._data_context.get_config(TRACK_KEY, None)
        if token is not None:
            _EXECUTORS[token] = executor


def warm_up() -> None:
    """Start Ray Data's per-cluster actors now, ahead of the first execution.

    The first execution in a cluster creates a stats actor and an autoscaling coordinator, each
    a new process importing ``ray.data``; its actor pool is not scheduled until the coordinator
    answers. A driver that calls this right after ``ray.init`` (the job does, while Ray Train
    starts its workers) takes both start-ups off the first batch's path. Best effort: a Ray
    whose internals differ only loses the head start.
    """
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        from ray.data._internal.stats import get_or_create_stats_actor

        get_or_create_stats_actor()
        get_or_create_autoscaling_coordinator()
    except Exception as exc:  # a head start only: never fail a job over it
        log.debug("Ray Data warm-up skipped: %s", exc)


@contextlib.contextmanager
def _current(ctx: DataContext) -> Iterator[None]:
    """Build datasets under ``ctx`` (each copies the current context when created)."""
    before = DataContext.get_current()
    DataContext._set_current(ctx)
    try:
        yield
    finally:
        DataContext._set_current(before)


def build_dataset(cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                  world_size: int = 1, metric_tags: dict[str, str] | None = None,
                  token: str | None = None) -> ray.data.Dataset:
    """Read ``items`` in order with read tasks (``TwinTarDatasource``) feeding raw bytes through
    the object store to the elastic Ray Data actor pool of decoders (``decode.compute: tasks``:
    Ray Data tasks on reused worker processes): the ``loader.fused_read: false`` execution."""
    read_kw: dict[str, Any] = {}
    map_kw: dict[str, Any] = {}
    if cfg.decode.label_selector:
        read_kw["label_selector"] = dict(cfg.decode.label_selector)
        map_kw["label_selector"] = dict(cfg.decode.label_selector)
    with _current(execution_context(cfg, world_size, token)):
        tasks = [[ReadUnit(catalog.shard(it.sid), it)] for it in items if it.count > 0]
        source = TwinTarDatasource(tasks, read_options(cfg), block_rows=block_rows(cfg),
                                   on_error=cfg.loader.on_error, metric_tags=metric_tags)
        ds = ray.data.read_datasource(source, num_cpus=cfg.loader.read_num_cpus,
                                      concurrency=cfg.loader.read_concurrency,
                                      override_num_blocks=max(1, len(items)), **read_kw)
        return ds.map_batches(
            **decode_udf(cfg.decode, Decoder, {"cfg": cfg.decode, "seed": cfg.loader.seed,
                                               "on_error": cfg.loader.on_error}),
            num_cpus=cfg.decode.num_cpus,
            batch_size=None,
            batch_format="pyarrow",
            zero_copy_batch=True,
            udf_modifying_row_count=False,
            **map_kw,
        )



# --------------------------------------------------------------------------- the Datasource


@attrs.frozen
class ReadUnit:
    """One shard slice a read task reads (``item`` of ``shard``), plus columns that are constant
    over it (``read_twin_tars``' ``__leaf__``)."""

    shard: Shard
    item: ReadItem
    constants: tuple[tuple[str, str], ...] = ()


class TwinTarDatasource(Datasource):
    """Reads ordered groups of shard slices, one ReadTask per group, with
    :func:`~ray_ingest.execution.read.read_item` (Arrow blocks of raw bytes plus provenance).

    The loader gives it one planned read item per task and keeps the read's own columns
    (``schema`` None); ``read_twin_tars`` gives it whole shards, slices or runs of shards and
    its public ``schema``, whose columns are taken from the read's blocks or from the unit's
    constants. The driver builds the tasks (small picklable closures, no I/O; Ray calls
    :meth:`get_read_tasks` several times per execution).

    Args:
        tasks: the units of every read task, in order (a unit's ``item.count`` of
            :data:`~ray_ingest.execution.read.TO_END` reads to the shard's end).
        opts: read options (alignment, key index, storage options).
        block_rows: rows per block.
        on_error: ``raise`` | ``skip`` (skipped samples are rows with ``__error__`` set).
        schema: the blocks' columns (None: the read's own, per shard).
        sample_bytes: bytes assumed per sample for Ray's size estimates.
        metric_tags: the Ray metric tags of the loader that planned the reads.
    """

    def __init__(self, tasks: Sequence[Sequence[ReadUnit]], opts: ReadOptions = ReadOptions(),
                 *, block_rows: int = 64, on_error: str = "raise",
                 schema: pa.Schema | None = None, sample_bytes: int = DEFAULT_SAMPLE_BYTES,
                 metric_tags: dict[str, str] | None = None):
        super().__init__()
        self._tasks = tuple(tuple(t) for t in tasks if t)
        self._opts = opts
        self._block_rows = block_rows
        self._on_error = on_error
        self._schema = schema
        self._sample_bytes = sample_bytes
        self._metric_tags = dict(metric_tags or {})

    def get_name(self) -> str:
        return "TwinTar"

    def _rows(self, units: Sequence[ReadUnit]) -> int | None:
        counts = [u.item.count for u in units]
        return None if any(c >= TO_END for c in counts) else sum(counts)

    def estimate_inmemory_data_size(self) -> int | None:
        rows = [self._rows(t) for t in self._tasks]
        return None if None in rows else sum(rows) * self._sample_bytes

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        tasks = []
        for units in self._tasks:
            rows = self._rows(units)
            if rows == 0:
                continue
            meta = BlockMetadata(
                num_rows=rows,
                size_bytes=None if rows is None else int(rows * self._sample_bytes),
                input_files=[u.shard.url(u.shard.modalities[0]) for u in units],
                exec_stats=None,
            )
            schema = self._schema or block_schema(units[0].shard.modalities)
            tasks.append(ReadTask(
                functools.partial(_read_units, units, self._opts, self._block_rows,
                                  self._on_error, self._schema, self._metric_tags),
                meta, schema=schema, per_task_row_limit=per_task_row_limit))
        return tasks


def _read_units(units: Sequence[ReadUnit], opts: ReadOptions, rows: int, on_error: str,
                schema: pa.Schema | None, metric_tags: dict[str, str]) -> Iterator[pa.Table]:
    """Generator behind one ReadTask: its units' blocks, as read or in ``schema``'s columns."""
    for u in units:
        for table in read_item(u.shard, u.item, opts, rows, on_error, metric_tags):
            if schema is None:
                yield table
                continue
            consts, n = dict(u.constants), table.num_rows
            yield pa.table({f.name: (pa.array([consts[f.name]] * n, f.type) if f.name in consts
                                     else table.column(f.name).cast(f.type)) for f in schema},
                           schema=schema)

def decode_udf(dc: DecodeConfig, cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``map_batches`` arguments of a decode step: ``cls(**kwargs)`` on the elastic pool of
    pool_min..pool_max actors, or (``decode.compute: tasks``) built per block in at most
    pool_max tasks at a time on reused worker processes (a few geometry objects to build,
    nothing to load). On Ray every other mode (``auto``, ``threads``) means the actor pool:
    threads are the loader's in-process path, which never builds a dataset."""
    if dc.compute == "tasks":
        return {"fn": functools.partial(_in_task, cls, kwargs),
                "compute": TaskPoolStrategy(size=dc.pool_max)}
    return {"fn": cls, "fn_constructor_kwargs": kwargs,
            "compute": ActorPoolStrategy(min_size=dc.pool_min, max_size=dc.pool_max)}


def _in_task(cls: type, kwargs: dict[str, Any], batch: Any) -> Any:
    return cls(**kwargs)(batch)


class Execution:
    """One running execution: iterate :meth:`blocks`, then :meth:`close` (also when abandoned).

    Blocks come through a :class:`~ray_ingest.execution.handoff.Handoff`, so a wait is bounded: no
    block within ``loader.stall_timeout_s`` of *waiting* raises
    :class:`~ray_ingest.errors.StallError`. Pauses of the train loop never count, unlike Ray Data's
    no-progress guard, which this replaces (a stopped consumer is "no progress" to it).
    """

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 world_size: int = 1, metric_tags: dict[str, str] | None = None,
                 rank: int = 0):
        self.cfg, self.rank = cfg, rank
        self._token = str(next(_TOKENS))  # unique in this process, where the executor runs
        self._ds = build_dataset(cfg, catalog, items, world_size, metric_tags, self._token)
        it = iter(self._ds.iter_batches(batch_size=None, batch_format="numpy",
                                        prefetch_batches=cfg.loader.prefetch_batches))
        self._handoff = Handoff(it, cfg.loader.stall_timeout_s, self._stalled)
        self.finished = False

    def start(self) -> None:
        """Start the execution now: its first block is fetched in the background."""
        self._handoff.prime()

    def blocks(self) -> Iterator[dict[str, np.ndarray]]:
        """Decoded column blocks in stream order; read/decode errors as one-line IngestErrors."""
        try:
            yield from self._handoff
        except StallError:
            raise
        except Exception as exc:  # RayTaskError(IngestError) subclasses both: unwrap always
            cause = ingest_cause(exc)
            if cause is None:
                raise
            raise cause from None  # one line naming shard, index/key and reason
        self.finished = True

    def _stalled(self, timeout: float) -> StallError:
        return stall_error(self.cfg, self.rank, timeout)

    def stats(self) -> str | None:
        """Ray Data's ``ds.stats()`` of a finished execution (None when unavailable)."""
        try:
            return self._ds.stats()
        except Exception as exc:  # diagnostics only: never fail a run over them
            log.warning("Ray Data stats unavailable: %s", exc)
            return None

    def close(self) -> None:
        """Stop the execution (an abandoned one would keep reading and decoding).

        The helper thread closes Ray Data's iterator, which shuts the executor down. A helper
        still blocked inside it (a stalled execution never yields) cannot: the executor is shut
        down from here, which ends the wait, so no execution outlives its loader.
        """
        if self._handoff.close(join_s=1.0):
            return
        executor = _EXECUTORS.get(self._token)  # None: not started, or already gone
        if executor is not None:
            executor.shutdown(force=True)
        if not self._handoff.close(join_s=10.0):
            log.warning("rank %d: a Ray Data execution did not stop within 10 s of close()",
                        self.rank)
