"""``decode.compute: actors`` with ``decode.pool_scope: job`` (the default): a rank's read items
decoded by the job's shared pool of decode actors (:mod:`ray_ingest.execution.service`),
handed back in the rank's stream order.

The rank keeps what :class:`~ray_ingest.execution.pool.PoolExecution` keeps: a bounded window
of its planned items in flight, taken back oldest first (ordered stream, exact resume), an item
whose worker or blocks were lost resubmitted in its place, a stall error after
``loader.stall_timeout_s`` of waiting. What changes is who decodes: it submits each item to the
job's controller, tagged with the step its rows are for; the controller hands it to a worker
once it is the earliest step waiting and a worker has room, and answers with the reference of
the worker's result, which the rank then takes from the worker's node like any other block.
The controller is a shared actor, or, for a job of one pipeline, hosted in the rank's process
(:mod:`ray_ingest.execution.hosted`). The pool's size is the controller's decision, from every
rank's data-wait (which each rank reports) and the workers' busy time. Where the controller
leased this rank whole workers (each decoding rank can have one), the rank calls them itself,
:data:`PER_WORKER` calls each, as on a pool of its own: those items skip the controller, and the
rank owns their results.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import ray

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.config import Config
from ray_ingest.decode.sizing import block_rows
from ray_ingest.execution import hosted, service
from ray_ingest.execution.fairshare import TakeRate, ahead_calls, step_key, window_calls
from ray_ingest.execution.pool import (
    PER_WORKER,
    POLL_S,
    Block,
    PoolExecution,
    _window_limit,
    stall_error,
)
from ray_ingest.plan.epoch import ReadItem

#: Numbers this process's executions (their names at the controller).
_CLIENTS = itertools.count()
#: Longest wait for the controller to answer a join (seconds; it may be starting).
JOIN_TIMEOUT_S = 120.0
#: Reports a rank keeps in flight: the periodic one and one for a step just taken.
REPORTS_IN_FLIGHT = 2
#: A new step's report goes at once, but not sooner than this after the last report: the
#: controller reads them once a control period, and at 512 px a rank starts ~30 steps a
#: second (a report each cost the controller ~25 ms of CPU a second, docs/benchmarks.md).
REPORT_MIN_S = service.CONTROL_S / 2
#: What a lost worker or lost blocks look like to the rank: the item is submitted again.
LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError,
        ray.exceptions.OwnerDiedError)


@attrs.define(eq=False)
class _JobCall:
    """An item submitted to the controller: ``outer`` answers with ``[ref]`` once a worker has
    it (None: submit again), ``ref`` is the worker's result; or, on a leased worker ``wid``,
    no ``outer`` and the result this rank owns."""

    item: ReadItem
    outer: Any
    ref: Any = None
    wid: str | None = None


class JobPoolExecution(PoolExecution):
    """An :class:`~ray_ingest.execution.handoff.Execution` on the job's shared decode pool (see
    the module docstring).

    Args:
        cfg: the run configuration (``decode.compute: actors``).
        catalog: the datasets' catalog.
        items: the rank's planned read items, in stream order.
        metric_tags: the rank's Ray metric tags.
        rank: the rank (the controller's key for it).
        pipelines: the job's ranks that decode (``pool_max`` counts per pipeline).
    """

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 metric_tags: dict[str, str] | None = None, rank: int = 0, pipelines: int = 1):
        super().__init__(cfg, catalog, items, metric_tags, rank)
        self.pipelines = max(1, pipelines)
        self.dataset = catalog.fingerprint
        self._service: Any = None
        #: Reports in flight, oldest first (at most :data:`REPORTS_IN_FLIGHT`), as (number,
        #: ref); the number of the newest answer applied (an older one arriving after it is
        #: not applied over it).
        self._reports: list[tuple[int, Any]] = []
        self._sent = self._applied = 0
        self._reported = 0.0
        #: A new step was taken: report its rate now, not at the next period.
        self._report_now = False
        self._rows = block_rows(cfg)
        self._cap = _window_limit(cfg, max(PER_WORKER * cfg.decode.pool_max,
                                           ahead_calls(cfg.loader.batch_size, self._rows)))
        self._ranks = 1
        #: Workers the controller leased to this rank, by id (it calls them itself), and the
        #: ones that failed a call (gone: not called again, whatever a view still says).
        self._leases: dict[str, Any] = {}
        self._dead: set[str] = set()
        #: Every leased worker's handle this rank was sent (a view sends only the ones its
        #: last report did not name).
        self._handles: dict[str, Any] = {}
        self._tags = dict(metric_tags or {"rank": str(rank)})
        #: This execution's name at the controller (the rank may open several, one by one).
        self.client = f"{rank}:{ray.get_runtime_context().get_worker_id()}:{next(_CLIENTS)}"
        #: Seconds this rank waited for results not decoded yet (reported to the controller):
        #: what a larger pool shortens. Fetching a finished result (the object store, a
        #: loaded node) is not counted: more workers would not make it faster.
        self.wait_s = 0.0
        #: Items decoded on leased workers.
        self.leased = 0
        self._waiting: float | None = None
        #: The items per second this rank takes (reported: the pool's demand).
        self._rate = TakeRate(service.hold_s(cfg))

    # --- the controller ------------------------------------------------------------------
    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self._join()
        self._fill()

    def _join(self) -> None:
        """Join the job's controller (a new one if the last one is ending)."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            handle = hosted.controller(self.cfg, self.pipelines, self.dataset)
            # None: it ended as we asked, its name is free again shortly
            view = hosted.answer(handle.join.remote(self.client, self.rank, self._tags, True),
                                 JOIN_TIMEOUT_S)
            if view is not None:
                self._service = handle
                self._apply(view)
                return
            if time.monotonic() > deadline:
                raise stall_error(self.cfg, self.rank, JOIN_TIMEOUT_S)
            time.sleep(POLL_S)

    def _apply(self, view: dict[str, Any]) -> None:
        """The window follows the pool: two steps ahead, or the rank's share of the workers;
        with leased workers, :data:`PER_WORKER` calls on each (as on a rank's own pool)."""
        self._ranks = view["ranks"]
        self._handles.update(view.get("handles", {}))
        self._leases = {wid: self._handles[wid] for wid in view.get("leases", ())
                        if wid in self._handles and wid not in self._dead}
        self.peak_workers = max(self.peak_workers, view["workers"])
        self.window = window_calls(self.cfg.loader.batch_size, self._rows, view["workers"],
                                   self._ranks, PER_WORKER, self._cap)
        if self._leases:
            self.window = min(self._cap, PER_WORKER * len(self._leases))

    def _admit(self, wait_s: float = 0.0) -> None:
        """Report this rank's data-wait and items taken (its step rate) every
        :data:`~ray_ingest.execution.service.REPORT_S`, and at once when it took a new step,
        and apply the answers (never blocks on the controller)."""
        if self._reports:
            refs = [ref for _, ref in self._reports]
            ready = hosted.answered(refs, 0)
            for n, ref in [r for r in self._reports if r[1] in ready]:
                self._reports.remove((n, ref))
                view = hosted.answer(ref)
                if view is None:  # the controller ended or forgot this rank: join again
                    self._reports.clear()
                    self._join()
                    break
                if n > self._applied:
                    self._applied = n
                    self._apply(view)
        now = time.monotonic()
        due = not self._reports and now - self._reported >= service.REPORT_S
        soon = (self._report_now and len(self._reports) < REPORTS_IN_FLIGHT
                and now - self._reported >= REPORT_MIN_S)
        if due or soon:
            self._reported, self._report_now = now, False
            self._sent += 1
            self._reports.append((self._sent, self._service.report.remote(
                self.client, self._waited(), self._rate.rate(now), self._using(), self._sent)))
        if wait_s:
            time.sleep(wait_s)

    def _using(self) -> list[str]:
        """The leased workers this rank may still call or has calls on (a retired one is
        killed only once the rank no longer names it)."""
        return sorted(set(self._leases) | {c.wid for c in self._calls if c.wid is not None})

    # --- submitting and waiting ----------------------------------------------------------
    def _submit(self, item: ReadItem) -> _JobCall:  # type: ignore[override]
        """On the least loaded leased worker with room, else through the controller."""
        shard = self.catalog.shard(item.sid)
        if self._leases:
            load = collections.Counter(c.wid for c in self._calls if c.wid is not None)
            wid = min(self._leases, key=lambda w: load[w])
            if load[wid] < PER_WORKER:
                ref = self._leases[wid].decode_leased.remote(self.rank, self._tags, shard, item)
                return _JobCall(item, None, ref, wid)
        key = step_key(item, self.cfg.loader.batch_size)
        return _JobCall(item, self._service.submit.remote(self.client, key, shard, item))

    def _capacity(self) -> int:
        return self.window

    def _resolved(self, call: _JobCall, timeout: float) -> bool:
        """Whether the worker's result is ready (resolving the controller's answer first)."""
        if call.ref is None:
            if not hosted.answered([call.outer], timeout):
                return False
            try:
                answer = hosted.answer(call.outer)
            except ray.exceptions.RayError:
                answer = None
            if answer is None:  # the controller ended: join the next one, submit again
                self._join()
                new = self._submit(call.item)
                call.outer, call.ref, call.wid = new.outer, new.ref, new.wid
                return False
            call.ref = answer[0]
            timeout = 0
        ready, _ = ray.wait([call.ref], timeout=timeout)
        return bool(ready)

    def _take(self, call: _JobCall) -> Iterator[Block]:  # type: ignore[override]
        """Wait for the oldest call (submitting and reporting meanwhile), then its blocks; a
        lost worker or lost blocks: the item again, in its place."""
        t0 = self._waiting = time.monotonic()
        try:
            while not self._resolved(call, POLL_S):
                self._fill()
                self._check_stall(time.monotonic() - t0)
        finally:
            self.wait_s += time.monotonic() - t0
            self._waiting = None
        try:
            blocks = ray.get(call.ref)
        except LOST:
            if call.wid is not None:  # a leased worker gone: never called again
                self._dead.add(call.wid)
                self._leases.pop(call.wid, None)
            self._calls.popleft()  # (out of the leased workers' load before choosing one)
            self._calls.appendleft(self._submit(call.item))
            self.resubmitted += 1
            return
        except Exception as exc:
            raise self._cause(exc) from None
        self._calls.popleft()
        self.done += 1
        self.leased += call.wid is not None
        if self._rate.took(step_key(call.item, self.cfg.loader.batch_size), time.monotonic()):
            # a new step: its rate goes to the controller now, not a period later (beside a
            # report still in flight, whose answer is applied as well)
            self._report_now = True
        self._fill()
        yield from blocks

    def _waited(self) -> float:
        """Seconds waited so far, the wait going on now included."""
        return self.wait_s + (0.0 if self._waiting is None else time.monotonic() - self._waiting)

    # --- the rest of the protocol --------------------------------------------------------
    def stats(self) -> str:
        return (f"job: {self.done} read items decoded on a job pool of up to "
                f"{self.peak_workers} workers shared by {self._ranks} ranks, "
                f"{self.leased} on leased workers, {self.resubmitted} resubmitted, "
                f"window {self.window}")

    def close(self) -> None:
        """Stop: this rank's items are dropped by the controller (shared workers would decode
        them for no one) and it leaves; the workers stay with the job."""
        if self.closed:
            return
        self.closed = True
        for call in self._calls:  # the leased workers' calls are this rank's to cancel
            if call.wid is not None:
                with contextlib.suppress(Exception):
                    ray.cancel(call.ref, force=False)
        self._calls.clear()
        if self._service is not None:
            with contextlib.suppress(Exception):
                self._service.leave.remote(self.client)
