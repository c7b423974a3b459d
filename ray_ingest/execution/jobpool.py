"""``decode.compute: actors`` with ``decode.pool_scope: job`` (the default): a rank's read items
decoded by the job's shared pool of decode actors (:mod:`ray_ingest.execution.service`),
handed back in the rank's stream order.

The rank keeps what :class:`~ray_ingest.execution.pool.PoolExecution` keeps: a bounded window
of its planned items in flight, taken back oldest first (ordered stream, exact resume), items
of a worker that is gone for good resubmitted in their places, a stall error after
``loader.stall_timeout_s`` of waiting. What changes is whose workers: it sends each item
directly to a worker of the job's roster (rotating from its own rank, so the ranks' calls
spread evenly), tagged with the step its rows are for, and the workers run their queues
earliest step first. The pool's size is the controller's decision, from every rank's data-wait
and the workers' busy time; the rank only reports how long it waited.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import ray

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.config import Config
from ray_ingest.decode.sizing import block_rows
from ray_ingest.execution import service
from ray_ingest.execution.fairshare import ahead_calls, step_key, window_calls
from ray_ingest.execution.pool import (
    PER_WORKER,
    POLL_S,
    Block,
    PoolExecution,
    _Call,
    _window_limit,
    _Worker,
    stall_error,
)
from ray_ingest.plan.epoch import ReadItem

#: Longest wait for the controller to answer a join (seconds; it may be starting).
JOIN_TIMEOUT_S = 120.0


class JobPoolExecution(PoolExecution):
    """An :class:`~ray_ingest.execution.handoff.Execution` on the job's shared decode pool (see
    the module docstring).

    Args:
        cfg: the run configuration (``decode.compute: actors``).
        catalog: the datasets' catalog.
        items: the rank's planned read items, in stream order.
        metric_tags: the rank's Ray metric tags.
        rank: the rank (the controller's key for it; the start of its rotation).
        pipelines: the job's ranks that decode (``pool_max`` counts per pipeline).
    """

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 metric_tags: dict[str, str] | None = None, rank: int = 0, pipelines: int = 1):
        super().__init__(cfg, catalog, items, metric_tags, rank)
        self.pipelines = max(1, pipelines)
        self.dataset = catalog.fingerprint
        self._service: Any = None
        self._version = -1
        self._ranks = 1
        self._report_ref: Any = None
        self._reported = 0.0
        self._rotation = rank
        #: Seconds this rank waited on the pool for its next rows (reported to the controller).
        self.wait_s = 0.0
        self._rows = block_rows(cfg)
        self._cap = _window_limit(cfg, max(PER_WORKER * cfg.decode.pool_max,
                                           ahead_calls(cfg.loader.batch_size, self._rows)))

    # --- the controller ------------------------------------------------------------------
    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self._join()
        self._fill()

    def _join(self) -> None:
        """Join the job's controller (a new one if the last one is ending), take its roster."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        tags = dict(self.metric_tags or {"rank": str(self.rank)})
        while True:
            handle = service.connect(self.cfg, self.pipelines, self.dataset)
            try:
                roster = ray.get(handle.join.remote(self.rank, tags), timeout=JOIN_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                roster = None  # it ended as we asked: its name is free again shortly
            if roster is not None:
                self._service = handle
                self._apply(roster)
                return
            if time.monotonic() > deadline:
                raise stall_error(self.cfg, self.rank, JOIN_TIMEOUT_S)
            time.sleep(POLL_S)

    def _apply(self, roster: dict[str, Any]) -> None:
        if "workers" not in roster:
            return
        self._version, self._ranks = roster["version"], roster["ranks"]
        known = {w.handle._actor_id.hex(): w for w in self.workers}
        self.workers = [known.get(wid) or _Worker(handle) for wid, handle in roster["workers"]]
        self.peak_workers = max(self.peak_workers, len(self.workers))
        self.window = window_calls(self.cfg.loader.batch_size, self._rows, len(self.workers),
                                   self._ranks, PER_WORKER, self._cap)

    def _admit(self, wait_s: float = 0.0) -> None:
        """Report this rank's data-wait every :data:`~ray_ingest.execution.service.REPORT_S`
        and take the roster the controller answers with (never blocks on the controller)."""
        if self._report_ref is not None:
            ready, _ = ray.wait([self._report_ref], timeout=wait_s)
            if not ready:
                return
            ref, self._report_ref = self._report_ref, None
            try:
                roster = ray.get(ref)
            except ray.exceptions.RayActorError:
                roster = None
            if roster is None:  # the controller ended or forgot this rank: join again
                self._join()
            else:
                self._apply(roster)
        elif wait_s:
            time.sleep(wait_s)
        now = time.monotonic()
        if self._report_ref is None and now - self._reported >= service.REPORT_S:
            self._reported = now
            self._report_ref = self._service.report.remote(self.rank, self._version,
                                                           self.wait_s)

    # --- submitting and waiting ----------------------------------------------------------
    def _submit(self, item: ReadItem) -> _Call:
        """To the worker of the roster with the fewest of this rank's calls, the next in this
        rank's rotation among equals."""
        n = len(self.workers)
        order = [self.workers[(self._rotation + i) % n] for i in range(n)]
        worker = min(order, key=lambda w: w.load)
        self._rotation += 1
        worker.load += 1
        shard = self.catalog.shard(item.sid)
        key = step_key(item, self.cfg.loader.batch_size)
        ref = worker.handle.decode.remote(key, self.rank, self.metric_tags, shard, item)
        return _Call(item, ref, worker)

    def _capacity(self) -> int:
        return self.window if self.workers else 0

    def blocks(self) -> Iterator[Block]:
        """The rank's blocks in stream order; the time to each is its wait on the pool."""
        it = super().blocks()
        while True:
            t0 = time.monotonic()
            block = next(it, None)
            self.wait_s += time.monotonic() - t0
            if block is None:
                return
            yield block

    def _maybe_grow(self) -> None:  # the controller sizes the pool
        return

    def _maybe_shrink(self) -> None:
        return

    def _replace(self, call: _Call) -> None:
        """Its worker is gone for good (killed by the controller on a lost node, or ended):
        out of this rank's roster; its calls go to the others in their places."""
        dead = call.worker
        self.workers = [w for w in self.workers if w is not dead]
        lost = [call] + [c for c in self._calls if c.worker is dead and c is not call]
        t0 = time.monotonic()
        while not self.workers:  # the controller starts replacements: wait for the roster
            self._admit(POLL_S)
            self._check_stall(time.monotonic() - t0)
        for old in lost:
            new = self._submit(old.item)
            self.resubmitted += 1
            if old is call:
                self._calls.appendleft(new)
            else:
                self._calls[self._calls.index(old)] = new

    # --- the rest of the protocol --------------------------------------------------------
    def stats(self) -> str:
        return (f"job: {self.done} read items decoded on a job pool of up to "
                f"{self.peak_workers} workers shared by {self._ranks} ranks, "
                f"{self.resubmitted} resubmitted, window {self.window}")

    def close(self) -> None:
        """Stop: this rank's calls are cancelled (shared workers would decode them for no one)
        and it leaves the controller; the workers stay with the job."""
        if self.closed:
            return
        self.closed = True
        for c in self._calls:
            with contextlib.suppress(Exception):  # best effort: a finished one is fine
                ray.cancel(c.ref, force=False)
        self._calls.clear()
        if self._service is not None:
            with contextlib.suppress(Exception):
                self._service.leave.remote(self.rank)
        self.workers = []
