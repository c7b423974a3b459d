"""``decode.compute: actors | tasks | process``: a rank's read items read and decoded by Ray
workers of its own, handed back in stream order through the object store.

Ray core, not Ray Data. The rank keeps a bounded window of its planned items in flight on its
workers (each returns the item's decoded blocks: numpy arrays, which the object store hands to
the rank without a copy) and takes the results back in stream order. What this leaves out of
a decoded sample's path, measured against the Ray Data edge (docs/benchmarks.md): the streaming
executor's threads in the trainer, numpy to Arrow tensor blocks and back, Ray Data's per-block
bookkeeping in the actor, and the per-cluster stats and autoscaling actors each rank's executor
reports to. The workers run the same :class:`~ray_ingest.execution.local.ItemDecoder` as every
other execution, so the rows are the same bit for bit.

* ``actors``: an elastic pool of ``pool_min..pool_max`` decode actors (``decode.num_cpus``
  each, ``decode.label_selector``): it grows while the rank waits on a full pool, by one actor
  that joins once it is up (no item waits behind an actor's start), and shrinks after
  ``decode.scale_down_hold_s`` idle. A killed actor restarts and Ray re-runs its calls
  (``max_restarts``/``max_task_retries``); one gone for good has its items resubmitted.
* ``tasks``: one Ray task per item on the nodes' reused worker processes, at most
  ``2 × pool_max`` in flight (Ray runs as many at once as the CPUs allow).
* ``process``: ``decode.threads`` companion actors per rank on the rank's own node, each
  decoding one item at a time on its main thread: decode off the trainer's process and cores,
  batches over the node's shared memory, no pool to size. (One companion decoding on several
  threads, SPDL's way, held the GIL against itself: at 512 px its two threads ran 0.90 of a
  core each, the machine 1.89–1.90 cores busy against 1.95–1.96 for two single-threaded
  decoders at no more CPU per sample: docs/benchmarks.md.)
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import ray

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.shard import Shard
from ray_ingest.config import Config
from ray_ingest.decode.sizing import block_rows, decoded_sample_bytes
from ray_ingest.errors import IngestError, StallError
from ray_ingest.execution.fairshare import PER_WORKER
from ray_ingest.execution.local import ItemDecoder
from ray_ingest.plan.epoch import ReadItem

log = logging.getLogger(__name__)

Block = dict[str, np.ndarray]
#: Modes this module runs.
POOL_MODES = ("actors", "tasks", "process")
# PER_WORKER (fairshare): calls in flight per decode actor, one running and one queued behind
# it (no idle gap between two items); a task pool keeps as many tasks queued as running.
#: Granularity of a wait: growing, shrinking and resubmitting happen between waits.
POLL_S = 0.1


class DecodeWorker:
    """A decode actor (or a ``process`` mode companion): reads and decodes the items it is
    given, one at a time on its main thread, and returns their blocks."""

    def __init__(self, cfg: Config, metric_tags: dict[str, str] | None = None):
        self.items = ItemDecoder(cfg, metric_tags)

    def ready(self) -> bool:
        return True

    def decode(self, shard: Shard, item: ReadItem) -> list[Block]:
        return self.items(shard, item)


def decode_process_options(cfg: Config, companion: bool = False) -> dict[str, Any]:
    """Ray options every decode process gets: ``decode.num_cpus`` and ``decode.label_selector``
    (the ``process`` companions are pinned to their rank's node instead).

    No ``runtime_env``: every decode process decodes on its main thread, whose malloc arena
    keeps freed memory (:mod:`ray_ingest.decode.memory`), and a process with an environment
    of its own cannot be one Ray prestarted (~1 s and ~0.4 CPU-s more to start,
    docs/benchmarks.md)."""
    dc = cfg.decode
    opts: dict[str, Any] = {"num_cpus": dc.num_cpus}
    if not companion and dc.label_selector:
        opts["label_selector"] = dict(dc.label_selector)
    return opts


#: The ItemDecoder of this task worker process (decode tasks run on reused workers).
_TASK_DECODER: list[ItemDecoder] = []


def decode_task(cfg: Config, metric_tags: dict[str, str] | None, shard: Shard,
                item: ReadItem) -> list[Block]:
    """``decode.compute: tasks``: one item in a Ray task."""
    if not (_TASK_DECODER and _TASK_DECODER[0].cfg == cfg
            and _TASK_DECODER[0].metric_tags == metric_tags):
        _TASK_DECODER[:] = [ItemDecoder(cfg, metric_tags)]
    return _TASK_DECODER[0](shard, item)


@attrs.define
class _Worker:
    handle: Any
    load: int = 0
    idle_since: float = attrs.field(factory=time.monotonic)


@attrs.define
class _Call:
    item: ReadItem
    ref: Any
    worker: _Worker | None


class PoolExecution:
    """An :class:`~ray_ingest.execution.handoff.Execution` on Ray workers of this rank's own
    (see module docstring).

    Args:
        cfg: the run configuration (``decode.compute`` one of :data:`POOL_MODES`).
        catalog: the datasets' catalog.
        items: the rank's planned read items, in stream order.
        metric_tags: the rank's Ray metric tags.
        rank: for messages.
        threads: companions of the ``process`` mode.
    """

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 metric_tags: dict[str, str] | None = None, rank: int = 0, threads: int = 1):
        self.cfg, self.catalog, self.rank = cfg, catalog, rank
        self.mode = cfg.decode.compute
        if self.mode not in POOL_MODES:
            raise ValueError(f"PoolExecution: decode.compute {self.mode!r} is not one of "
                             f"{POOL_MODES}")
        self.items = collections.deque(it for it in items if it.count > 0)
        self.metric_tags = metric_tags
        dc = cfg.decode
        self.min_workers = threads if self.mode == "process" else dc.pool_min
        self.max_workers = threads if self.mode == "process" else dc.pool_max
        self.window = _window_limit(cfg, self.max_workers * PER_WORKER)
        self.workers: list[_Worker] = []
        self._starting: dict[Any, Any] = {}  # ready ref -> actor handle
        self._calls: collections.deque[_Call] = collections.deque()
        self._cfg_ref: Any = None
        self._remote: Any = None  # the worker class or the task function, as a Ray remote
        self.started = self.closed = False
        #: Counters for :meth:`stats`.
        self.done = self.resubmitted = self.peak_workers = self.retired = 0
        self._grown_at = 0.0

    # --- workers -------------------------------------------------------------------------
    def _actor_options(self) -> dict[str, Any]:
        companion = self.mode == "process"
        opts: dict[str, Any] = {"max_restarts": -1, "max_task_retries": -1,
                                **decode_process_options(self.cfg, companion)}
        if companion:
            # the rank's companions: on the rank's node, their blocks through shared memory
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)
        return opts

    def _task_options(self) -> dict[str, Any]:
        return {"max_retries": -1, **decode_process_options(self.cfg)}

    def _start_worker(self) -> None:
        """A new actor; it takes items once it is up (see :meth:`_admit`)."""
        # the config by value: an actor that restarts must not depend on an object that may be
        # gone by then (Ray logs an error for constructor arguments in the object store)
        handle = self._remote.remote(self.cfg, self.metric_tags)
        self._starting[handle.ready.remote()] = handle
        self._grown_at = time.monotonic()

    def _admit(self, wait_s: float = 0.0) -> None:
        """Workers whose start finished join the pool."""
        if not self._starting:
            return
        ready, _ = ray.wait(list(self._starting), num_returns=len(self._starting),
                            timeout=wait_s)
        for ref in ready:
            handle = self._starting.pop(ref)
            try:
                ray.get(ref)
            except Exception as exc:  # a worker that cannot start is an error of the run
                raise self._cause(exc) from None
            self.workers.append(_Worker(handle))
        self.peak_workers = max(self.peak_workers, len(self.workers))

    def start(self) -> None:
        """Start the workers and submit the first items (before the first block is asked)."""
        if self.started:
            return
        self.started = True
        self._cfg_ref = ray.put(self.cfg)
        if self.mode == "tasks":
            self._remote = ray.remote(decode_task).options(**self._task_options())
        else:
            self._remote = ray.remote(DecodeWorker).options(**self._actor_options())
            for _ in range(self.min_workers):
                self._start_worker()
        self._fill()

    # --- submitting ----------------------------------------------------------------------
    def _submit(self, item: ReadItem) -> _Call:
        shard = self.catalog.shard(item.sid)
        if self.mode == "tasks":
            return _Call(item, self._remote.remote(self._cfg_ref, self.metric_tags, shard, item),
                         None)
        worker = min(self.workers, key=lambda w: w.load)
        worker.load += 1
        return _Call(item, worker.handle.decode.remote(shard, item), worker)

    def _capacity(self) -> int:
        if self.mode == "tasks":
            return self.window
        return min(self.window, len(self.workers) * PER_WORKER)

    def _fill(self) -> None:
        """Submit items while the window has room (least-loaded worker first)."""
        if self.mode != "tasks":
            self._admit()
        while self.items and len(self._calls) < self._capacity():
            self._calls.append(self._submit(self.items.popleft()))

    # --- the stream ----------------------------------------------------------------------
    def blocks(self) -> Iterator[Block]:
        self.start()
        t0 = time.monotonic()
        while self._calls or self.items:
            if self.closed:
                return
            self._fill()
            if not self._calls:  # no worker up yet
                self._admit(POLL_S)
                self._check_stall(time.monotonic() - t0)
                continue
            yield from self._take(self._calls[0])
            t0 = time.monotonic()

    def _take(self, call: _Call) -> Iterator[Block]:
        """Wait for the oldest call (growing or resubmitting meanwhile), then its blocks.

        A rank that has to wait on a full pool is what growing is for (past the first item:
        every pool waits for its first)."""
        self._wait_for(call)
        self._calls.popleft()
        try:
            blocks = ray.get(call.ref)
        except ray.exceptions.RayActorError:
            self._replace(call)
            return
        except Exception as exc:
            raise self._cause(exc) from None
        if call.worker is not None:
            call.worker.load -= 1
            if call.worker.load == 0:
                call.worker.idle_since = time.monotonic()
        self.done += 1
        self._maybe_shrink()
        self._fill()
        yield from blocks

    def _wait_for(self, call: _Call) -> None:
        """Until ``call`` is done: growing, submitting and checking for a stall meanwhile."""
        t0 = time.monotonic()
        ready, _ = ray.wait([call.ref], timeout=0)
        while not ready:
            if self.done:
                self._maybe_grow()
            self._fill()
            self._check_stall(time.monotonic() - t0)
            ready, _ = ray.wait([call.ref], timeout=POLL_S)

    def _replace(self, call: _Call) -> None:
        """Its actor is gone for good: drop it, resubmit its items in their places."""
        dead = call.worker
        self.workers = [w for w in self.workers if w is not dead]
        lost = [call] + [c for c in self._calls if c.worker is dead]
        if not self.workers:
            if not self._starting:
                self._start_worker()
            timeout = self.cfg.loader.stall_timeout_s
            self._admit(600.0 if timeout is None else timeout)
            if not self.workers:  # no replacement came up in time
                raise stall_error(self.cfg, self.rank, timeout or 600.0)
        for old in lost:
            new = self._submit(old.item)
            self.resubmitted += 1
            if old is call:
                self._calls.appendleft(new)
            else:
                self._calls[self._calls.index(old)] = new

    def _maybe_grow(self) -> None:
        if (self.mode == "tasks" or self._starting or not self.items
                or len(self.workers) >= self.max_workers
                or any(w.load < PER_WORKER for w in self.workers)):
            return
        self._start_worker()

    def _maybe_shrink(self) -> None:
        hold = self.cfg.decode.scale_down_hold_s
        now = time.monotonic()
        idle = [w for w in self.workers if w.load == 0 and now - w.idle_since > hold]
        while idle and len(self.workers) > self.min_workers:
            w = idle.pop()
            self.workers.remove(w)
            self.retired += 1
            ray.kill(w.handle, no_restart=True)

    def _check_stall(self, waited: float) -> None:
        timeout = self.cfg.loader.stall_timeout_s
        if timeout is None or waited < timeout:
            return
        raise stall_error(self.cfg, self.rank, timeout)

    def _cause(self, exc: BaseException) -> BaseException:
        """The one-line IngestError behind a worker's failure, or the failure itself."""
        return ingest_cause(exc) or exc

    # --- the rest of the protocol --------------------------------------------------------
    def stats(self) -> str:
        if self.mode == "tasks":
            return (f"tasks: {self.done} read items decoded by tasks, {self.resubmitted} "
                    f"resubmitted, window {self.window}")
        return (f"{self.mode}: {self.done} read items decoded on up to {self.peak_workers} "
                f"workers, {self.retired} retired idle, {self.resubmitted} resubmitted, "
                f"window {self.window}")

    def close(self) -> None:
        """Stop: calls in flight are cancelled, the workers end."""
        if self.closed:
            return
        self.closed = True
        if self.mode == "tasks":  # (actors end below, with whatever they were doing)
            for call in self._calls:
                with contextlib.suppress(Exception):  # best effort: a finished one is fine
                    ray.cancel(call.ref, force=False)
        self._calls.clear()
        for handle in [*(w.handle for w in self.workers), *self._starting.values()]:
            ray.kill(handle, no_restart=True)
        self.workers, self._starting = [], {}


def stall_error(cfg: Config, rank: int, timeout: float) -> StallError:
    """What a rank that waited ``loader.stall_timeout_s`` for a decoded block raises."""
    dc = cfg.decode
    where = f"nodes with labels {dict(dc.label_selector)}" if dc.label_selector else "nodes"
    return StallError(
        f"rank {rank}: no decoded block for loader.stall_timeout_s ({timeout:g} s) of "
        f"waiting; likely a decode node was lost and no {where} have room to restart its "
        f"decoders ({dc.num_cpus} CPUs each), or no node matches: add decode capacity, or "
        f"raise loader.stall_timeout_s")


def _window_limit(cfg: Config, calls: int) -> int:
    """Calls in flight: ``calls``, fewer where ``loader.object_store_limit`` bounds the rank's
    decoded bytes (at least one)."""
    limit = cfg.loader.object_store_limit
    item_bytes = max(1, decoded_sample_bytes(cfg.decode) * block_rows(cfg))
    if limit is None:
        return max(1, calls)
    return max(1, min(calls, limit // item_bytes))


def ingest_cause(exc: BaseException) -> IngestError | None:
    """The IngestError behind a failed Ray task or execution (one line, names the shard), if
    any: through ``RayTaskError.cause`` and the exception chain."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ray.exceptions.RayTaskError):
            cause = getattr(cur, "cause", None)
            cur = cause if isinstance(cause, BaseException) else cur.__cause__
            continue
        if isinstance(cur, IngestError):
            if cur.args and isinstance(cur.args[0], str) and "\n" in cur.args[0]:
                # Ray appends retry advice on new lines; our messages are one line.
                cur.args = (cur.args[0].split("\n", 1)[0], *cur.args[1:])
            return cur
        cur = cur.__cause__ or cur.__context__
    return None
