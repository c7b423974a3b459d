"""The job's decode pool (``decode.compute: actors``, ``decode.pool_scope: job``): one pool of
decode actors that every rank of a job draws from, and the controller that feeds and sizes it.

* :class:`DecodeService`: the job's controller, a named actor (``ray_ingest_decode_<key>``,
  not detached, 0 CPUs). Ranks join it and submit their read items, each tagged with the step
  its rows are for; it keeps one queue for the job and hands the items to the workers
  earliest step first, :data:`~ray_ingest.execution.fairshare.PER_WORKER` per worker, least
  loaded first, answering each submit with the reference of the worker's result: the blocks go
  from the worker's node to the rank's through the object store, never through the
  controller. Every :data:`CONTROL_S` it reads the workers' busy time (each call's end says
  how long it took) and nodes, the ranks' wait for results not decoded yet and rate of
  taking items (each reports them every :data:`REPORT_S`) and the cluster's free CPUs, sizes
  the pool (:class:`~ray_ingest.execution.fairshare.Sizer`), starts workers (one no node has room
  for stays pending: demand the autoscaler sees), retires workers (no more items, killed once
  empty), kills the workers of a dead node (their ranks submit those items again at once),
  exports the job's and each rank's target and busy decode CPUs as Ray metrics, and ends
  itself, with its workers, :data:`LINGER_S` after its last rank left (or, pre-started,
  :data:`PRESTART_WAIT_S` after its start if no rank came). Where every decoding rank can
  have whole workers of its own (the workers at least as many as the ranks), it *leases*
  them: ``workers // ranks`` each (:meth:`DecodeService._lease`). A rank calls its leased
  workers itself and owns their results, so those items never pass through the controller
  (~5-6 ms of its CPU per item in a one-rank run here, its own start included:
  docs/architecture.md); it still sizes the pool from their busy time (each worker's stats)
  and the ranks' reports.
* :class:`~ray_ingest.execution.sharedworker.SharedDecodeWorker`: a decode actor
  (``decode.num_cpus``, ``decode.label_selector``) decoding one item at a time on its main
  thread (the second it holds queued behind it), called by the controller or, leased, by its
  rank.

The job's driver starts the controller before Ray Train starts the ranks (:func:`prestart`);
otherwise the first rank does, and a job of one pipeline runs it in its rank's process
(:mod:`ray_ingest.execution.hosted`). The rank side (its ordered window, resubmits, stall
checks) is :class:`ray_ingest.execution.jobpool.JobPoolExecution`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import heapq
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import attrs
import ray

from ray_ingest.catalog.shard import Shard
from ray_ingest.config import Config
from ray_ingest.execution.fairshare import (
    PER_WORKER,
    ItemCost,
    Signals,
    Sizer,
    SizerSettings,
    consumption_demand,
    lease_workers,
    trim_window,
)
from ray_ingest.execution.pool import decode_process_options
from ray_ingest.execution.sharedworker import SharedDecodeWorker
from ray_ingest.metrics import job_tags, record_job, record_rank
from ray_ingest.plan.epoch import ReadItem

#: How often the controller reads its workers and sizes the pool (seconds).
CONTROL_S = 0.5
#: How often a rank reports its demand (seconds).
REPORT_S = 1.0
#: Seconds a rank that joined may take to submit its first item before later steps of other
#: ranks go ahead of it (see :meth:`DecodeService._start_floor`).
START_GRACE_S = 2.0
#: Seconds from the job's first item that the ranks which have not joined yet get to submit
#: theirs before later steps of the others go ahead of it (the same).
START_WAIT_S = 5.0
#: A retired worker gets no more items and is killed once it has none (at the latest after
#: this many seconds).
RETIRE_MAX_S = 60.0
#: The controller ends (its workers with it) after this long without a rank (seconds): longer
#: than the gap between two windows of a loader, short enough not to hold CPUs after a run.
LINGER_S = 3.0
#: A pool the driver pre-started ends (its workers with it) if no rank joined within this many
#: seconds: ranks that never come (Ray Train waiting for GPU nodes, a failed start, a stream
#: the ranks' head starts served whole) must not hold its decode CPUs for the driver's
#: lifetime. Ranks that come later start a new pool (as without a pre-start).
PRESTART_WAIT_S = 300.0
#: Seconds the exported busy CPUs are averaged over.
EXPORT_WINDOW_S = 5.0
#: Controller samples kept for :meth:`DecodeService.stats` (one per control period).
HISTORY = 7200


def hold_s(cfg: Config) -> float:
    """The pool's shrink hold (``decode.scale_down_hold_s``; 0: a few control periods), also
    the window the ranks measure their consumption over."""
    return cfg.decode.scale_down_hold_s or CONTROL_S * 4


def _stable(obj: Any) -> str:
    """A setting that JSON cannot write, as the same text in every rank's process: a hook
    given as a callable by its import path (its ``repr`` holds an address)."""
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}:{obj.__qualname__}"
    return str(obj)


def service_name(cfg: Config, dataset: str, job: str | None = None) -> str:
    """The controller's actor name for this job (default: this process's), config and
    dataset: ranks of one job with the same settings share one pool (a hash: no setting, and
    no credential, shows in the name)."""
    job = job if job is not None else ray.get_runtime_context().get_job_id()
    doc = json.dumps(cfg.to_dict(), sort_keys=True, default=_stable)
    digest = hashlib.sha1(f"{job}|{dataset}|{doc}".encode()).hexdigest()[:16]
    return f"ray_ingest_decode_{digest}"


@attrs.define(eq=False)
class _Entry:
    """A rank's read item waiting for a worker, then on one."""

    key: tuple[int, int]
    client: str
    rank: int
    shard: Shard
    item: ReadItem
    fut: asyncio.Future
    ref: Any = None


@attrs.define(eq=False)
class _Worker:
    handle: Any
    wid: str
    ready_ref: Any
    up: bool = False
    node: str = ""
    busy_s: float = 0.0
    by_rank: dict[int, float] = attrs.field(factory=dict)
    inflight: list[_Entry] = attrs.field(factory=list)
    retired_at: float | None = None
    stats: asyncio.Future | None = None
    #: The client it is leased to (kept once retired, until that client stops using it).
    lease: str | None = None
    #: The worker's stats as last read (its leased counters and the process that counted
    #: them; None: not read yet).
    last_stats: dict[str, Any] | None = None


@attrs.define
class _Rank:
    """A rank's execution drawing from the pool (a client: the same rank may open several
    executions one after another, each joins and leaves)."""

    rank: int
    tags: dict[str, str]
    wait_s: float = 0.0
    #: When it joined (monotonic) and the step of its first item (None: none yet).
    joined: float = attrs.field(factory=time.monotonic)
    first: tuple[int, int] | None = None
    #: Items per second it takes (:class:`~ray_ingest.execution.fairshare.TakeRate`; None:
    #: not known yet) and when it said so (monotonic).
    rate: float | None = None
    rate_t: float = 0.0
    #: Whether it takes leases, the workers it said it still uses (leased or with calls on
    #: them), the number of the report that said so and when that report came (monotonic).
    leases: bool = False
    using: frozenset[str] = frozenset()
    report_n: int = 0
    using_t: float = 0.0


class DecodeService:
    """The job's decode controller (see the module docstring).

    Args:
        cfg: the run configuration (decode settings; ``pool_min``/``pool_max``).
        pipelines: the job's ranks that build a pipeline (``pool_max`` counts per pipeline).
        dataset: the catalog fingerprint (metric tag).
        on_exit: called at its end in place of ending the actor's process (None: an actor;
            :mod:`ray_ingest.execution.hosted` hosts it in a rank's process).
    """

    def __init__(self, cfg: Config, pipelines: int, dataset: str,
                 on_exit: Callable[[], None] | None = None):
        self._on_exit = on_exit
        dc = cfg.decode
        self.cfg, self.num_cpus, self.pipelines = cfg, dc.num_cpus, max(1, pipelines)
        self.sizer = Sizer(SizerSettings(lo=dc.pool_min, hi=max(1, dc.pool_max * pipelines),
                                         hold_s=hold_s(cfg)))
        self.tags = job_tags(ray.get_runtime_context().get_job_id(), dataset)
        self.workers: dict[str, _Worker] = {}
        self.ranks: dict[str, _Rank] = {}  # by client
        #: Items waiting for a worker, earliest step first: (key, arrival, entry).
        self.queue: list[tuple[tuple[int, int], int, _Entry]] = []
        self._arrival = itertools.count()
        self.busy_total = self.wait_left = 0.0  # of workers and ranks gone
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self.started = self.retired = self.lost = self.dispatched = self.completed = 0
        self.submitted = self.leased_done = 0
        self._t0, self._t0_wall = time.monotonic(), time.time()
        #: When the controller ends unless a rank joins (monotonic; None: ranks are here).
        self._end_at: float | None = self._t0 + LINGER_S
        self._tasks: list[asyncio.Task] = []
        #: One task per call on a worker awaiting its end, and per starting worker awaiting
        #: its start (:meth:`_keep`).
        self._pending: set[asyncio.Future] = set()
        self._ending = False
        self._remote = ray.remote(SharedDecodeWorker).options(**self._worker_options())
        self._labels: tuple[float, dict[str, dict]] = (0.0, {})
        self._gone_by_rank: dict[int, float] = collections.defaultdict(float)
        self._rank_hist: collections.deque[tuple[float, dict[int, float]]] = \
            collections.deque()
        self._cost = ItemCost(self.sizer.s.hold_s)
        #: The ranks that submitted an item, and when the first did (monotonic).
        self._started_ranks: set[int] = set()
        self._first_item: float | None = None

    def _worker_options(self) -> dict[str, Any]:
        # out of order: a plain actor otherwise runs its calls by sequence number, and one
        # cancelled before it arrived (a rank left) holds the calls behind it for 30 s; the
        # order is still the order the calls arrive in, one at a time on the main thread
        return {"max_restarts": -1, "max_task_retries": -1,
                "allow_out_of_order_execution": True, **decode_process_options(self.cfg)}

    # --- the ranks' calls ----------------------------------------------------------------
    async def join(self, client: str, rank: int, tags: dict[str, str],
                   leases: bool = False) -> dict[str, Any] | None:
        """Register a rank's execution, ``client``, which takes leased workers if ``leases``
        (None: this controller is ending, ask for a new one)."""
        if self._ending:
            return None
        old = self.ranks.get(client)
        if old is not None:
            self.wait_left += old.wait_s
        self.ranks[client] = _Rank(rank, dict(tags), leases=leases)
        self._end_at = None
        await self._start()  # the first workers start now, not a period later
        self._lease()
        return self._view(client)

    async def prestart(self, wait_s: float = PRESTART_WAIT_S) -> dict[str, Any]:
        """Start the pool before any rank asks (the job's driver, while Ray Train starts its
        workers): it stays until its ranks have come and gone, or ``wait_s`` if none comes."""
        if not self.ranks:
            self._end_at = time.monotonic() + wait_s
        await self._start()
        return self._view()

    async def _start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._run())]
        if self.sizer.target is None:
            await self._tick()

    async def submit(self, client: str, key: tuple[int, int], shard: Shard,
                     item: ReadItem) -> list[Any] | None:
        """Queue a rank's item (earliest step first); once a worker has it, ``[its result's
        ref]`` (None: this controller is ending or does not know the rank: join again). The
        blocks go from the worker to the rank; this actor never fetches them."""
        r = self.ranks.get(client)
        if self._ending or r is None:
            return None
        fut = asyncio.get_running_loop().create_future()
        entry = _Entry(tuple(key), client, r.rank, shard, item, fut)
        self.submitted += 1
        if r.first is None:
            self._started_ranks.add(r.rank)
            if self._first_item is None:
                self._first_item = time.monotonic()
        # the earliest, not the first to arrive: Ray does not keep an async actor's calls
        # from one caller in the order they were sent
        r.first = entry.key if r.first is None else min(r.first, entry.key)
        heapq.heappush(self.queue, (entry.key, next(self._arrival), entry))
        self._dispatch()
        return [await fut]

    async def report(self, client: str, wait_s: float, rate: float | None = None,
                     using: list[str] | None = None, n: int = 0) -> dict[str, Any] | None:
        """A rank's cumulative wait for results not decoded yet, the items per second it
        takes and, in its report number ``n``, the leased workers it still uses; the pool's
        size and ranks and the rank's leases (None: join again)."""
        r = self.ranks.get(client)
        if r is None or self._ending:
            return None
        r.wait_s = wait_s
        r.rate, r.rate_t = rate, time.monotonic()
        if n >= r.report_n:  # (a rank's calls may arrive out of order)
            r.using, r.report_n, r.using_t = frozenset(using or ()), n, r.rate_t
        return self._view(client)

    async def cancel(self, client: str) -> None:
        """Drop a rank's items: queued ones never run, running ones are cancelled."""
        for w in self.workers.values():
            for e in w.inflight:
                if e.client == client:
                    ray.cancel(e.ref, force=False)
        for _, _, e in self.queue:
            if e.client == client and not e.fut.done():
                e.fut.cancel()

    async def leave(self, client: str) -> None:
        """A rank's execution ends: its queued items are dropped, its leased workers go to the
        others (the rank cancels its own calls on them)."""
        await self.cancel(client)
        r = self.ranks.pop(client, None)
        if r is not None:
            self.wait_left += r.wait_s
        self._lease()  # (a client gone holds no lease)
        if not self.ranks:
            self._end_at = time.monotonic() + LINGER_S

    def _view(self, client: str | None = None) -> dict[str, Any]:
        """What a rank sizes its window by (the workers up, the ranks), ``client``'s leased
        workers, by id, and the handles of those its last report did not name (a handle
        costs a serialization on each side)."""
        live = [w for w in self.workers.values() if w.up and w.retired_at is None]
        r = self.ranks.get(client) if client is not None else None
        leased = [w for w in live if r is not None and w.lease == client]
        return {"workers": len(live), "ranks": max(1, len(self.ranks)),
                "leases": [w.wid for w in leased],
                "handles": {w.wid: w.handle for w in leased if w.wid not in r.using}}

    def _lease(self) -> None:
        """Lease whole workers to the ranks that take leases
        (:func:`~ray_ingest.execution.fairshare.lease_workers`): a leased worker takes calls
        from its rank only, which calls it itself, so its items skip this actor."""
        live = [w for w in self.workers.values() if w.up and w.retired_at is None]
        leases = lease_workers([(w.wid, w.lease, len(w.inflight)) for w in live],
                               [c for c, r in self.ranks.items() if r.leases],
                               len(self.ranks), self.pipelines)
        for w in live:
            w.lease = leases[w.wid]

    async def worker_handles(self) -> list[Any]:
        """The workers up (for tests and benchmarks that kill one)."""
        return [w.handle for w in self.workers.values() if w.up]

    async def stats(self) -> dict[str, Any]:
        """Counters, the busy seconds per rank and the sampled history (``t``: seconds since
        ``t0_wall``; target, held, pending, busy, wait, queued, free)."""
        return {"target": self.sizer.target, "reason": self.sizer.reason,
                "started": self.started, "retired": self.retired, "lost": self.lost,
                "submitted": self.submitted, "dispatched": self.dispatched,
                "leased_done": self.leased_done,
                "ranks": len(self.ranks),
                "num_cpus": self.num_cpus, "rank_busy_s": self.rank_busy(),
                "t0_wall": self._t0_wall, "history": list(self.history)}

    # --- dispatching ---------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Earliest step first onto the least loaded workers, :data:`PER_WORKER` calls each
        (one running, one queued behind it: no idle gap between two items). Leased workers
        come last and take one call at a time beside their rank's: the items a rank queued
        before it learned of its lease still go out when every worker is leased."""
        live = [w for w in self.workers.values() if w.up and w.retired_at is None]
        floor = self._start_floor()
        while self.queue and live:
            w = min(live, key=lambda w: (w.lease is not None, len(w.inflight)))
            if len(w.inflight) >= (PER_WORKER if w.lease is None else 1):
                return
            if self.queue[0][2].fut.done():  # cancelled by its rank
                heapq.heappop(self.queue)
                continue
            if floor is not None and self.queue[0][0] > floor:
                return  # a rank that just joined has not submitted its first step yet
            _, _, e = heapq.heappop(self.queue)
            r = self.ranks.get(e.client)
            ended, e.ref = w.handle.decode.remote(r.tags if r else None, e.shard, e.item)
            w.inflight.append(e)
            e.fut.set_result(e.ref)
            self.dispatched += 1
            self._keep(self._ended(w, e, ended))

    def _keep(self, coro: Any) -> None:
        """Run ``coro`` as a task held in :attr:`_pending` until it ends (asyncio keeps only
        weak references to tasks)."""
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _start_floor(self) -> tuple[int, int] | None:
        """While a rank that joined less than :data:`START_GRACE_S` ago has submitted nothing,
        or fewer of the job's pipelines than it has submitted anything and the first item
        came less than :data:`START_WAIT_S` ago, the earliest first step any rank submitted:
        later steps wait for it. (Ranks start their windows a little apart; without this,
        the first ones' look-ahead took the workers while the last ones' first step was still
        to come: ~0.5 s of the scale-out bench's first synchronous step at 64 ranks,
        docs/benchmarks.md.)"""
        now = time.monotonic()
        late = any(r.first is None and now - r.joined < START_GRACE_S
                   for r in self.ranks.values())
        if not late and len(self._started_ranks) < self.pipelines:
            late = self._first_item is not None and now - self._first_item < START_WAIT_S
        if not late:
            return None
        firsts = [r.first for r in self.ranks.values() if r.first is not None]
        return min(firsts) if firsts else None

    async def _ended(self, w: _Worker, e: _Entry, ended: Any) -> None:
        """A call's end (decoded, failed, cancelled, its worker lost) frees its worker's place
        and adds its busy time to the worker's and its rank's. Awaited on the call's first
        return, a few bytes: no polling, and the blocks are never fetched here (50 Hz
        ``ray.wait`` scans cost the controller ~23 % of its CPU)."""
        try:
            busy = float(await ended)
        except ray.exceptions.ActorDiedError:  # dead for good: no more calls for it (they
            busy = 0.0  # fail at once and come back, ~200 round trips before the next tick)
            if self.workers.get(w.wid) is w:
                self.lost += 1
                self._forget(w)
        except Exception:  # failed, cancelled or lost: the rank's to see and handle
            busy = 0.0
        w.busy_s += busy
        w.by_rank[e.rank] = w.by_rank.get(e.rank, 0.0) + busy
        self.completed += 1
        with contextlib.suppress(ValueError):
            w.inflight.remove(e)
        self._dispatch()

    # --- the control loop ----------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CONTROL_S)
            await self._tick()
            if self._end_at is not None and time.monotonic() >= self._end_at:
                self._ending = True  # joins and submits now answer None: a new controller
                for _, _, e in self.queue:
                    if not e.fut.done():
                        e.fut.cancel()
                for w in list(self.workers.values()):
                    ray.kill(w.handle, no_restart=True)
                self.workers.clear()
                self._exit()
                return

    def _exit(self) -> None:
        """The controller's end, its workers killed: the actor's process ends (or its host's
        loop, ``on_exit``)."""
        if self._on_exit is not None:
            self._on_exit()
        else:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def _tick(self) -> None:
        now = time.monotonic()
        self._poll_workers()
        self._drop_lost_nodes()
        held = sum(1 for w in self.workers.values() if w.up and w.retired_at is None)
        pending = sum(1 for w in self.workers.values() if not w.up and w.retired_at is None)
        busy = self._busy()
        sig = Signals(t=now - self._t0, held=held, pending=pending, busy_s=busy,
                      wait_s=self.wait_left + sum(r.wait_s for r in self.ranks.values()),
                      ranks=len(self.ranks), queued=self._queued(), free=self._free_workers(),
                      demand=consumption_demand(
                          [r.rate if now - r.rate_t <= self.sizer.s.hold_s else None
                           for r in self.ranks.values()],
                          self._cost.update(now, busy, self.completed)))
        target = self.sizer.update(sig)
        self._resize(target, held, pending)
        self._kill_drained(now)
        self._lease()
        self.history.append({"t": round(sig.t, 2), "target": target, "held": held,
                             "pending": pending, "busy_s": round(sig.busy_s, 3),
                             "wait_s": round(sig.wait_s, 3), "queued": sig.queued,
                             "free": sig.free, "ranks": sig.ranks,
                             "leased": sum(1 for w in self.workers.values()
                                           if w.lease is not None and w.retired_at is None),
                             "demand": None if sig.demand is None else round(sig.demand, 2)})
        self._export(now)

    def _queued(self) -> int:
        return sum(1 for _, _, e in self.queue if not e.fut.done())

    def _busy(self) -> float:
        return self.busy_total + sum(w.busy_s for w in self.workers.values())

    def _poll_workers(self) -> None:
        """The up workers' nodes, and which died for good, from one stats call in flight each
        (never a blocking ``ray.wait``: that would hold up the ranks' calls); new workers come
        in through :meth:`_came_up`. Items a start floor held back go out here too."""
        self._dispatch()
        for w in [w for w in self.workers.values() if w.up]:
            # one stats call in flight per worker, never dropped: on a busy machine an answer
            # may take longer than a control period, and a dropped one would read as idle
            if w.stats is not None and not w.stats.done():
                continue
            st = w.stats.result() if w.stats is not None else None
            w.stats = asyncio.ensure_future(_awaited(w.handle.stats.remote()))
            if st == DEAD:  # killed, or out of restarts: its ranks resubmit what it held
                self.lost += 1
                self._forget(w)
                continue
            if st is not None:  # None: restarting, or its node is gone (the node's state decides)
                w.node = st["node"]
                self._count_leased(w, st)

    def _count_leased(self, w: _Worker, st: dict[str, Any]) -> None:
        """A worker's leased calls since its last stats: their busy time goes to the worker's
        and their ranks' (as a shared call's end does), their number to the items completed."""
        last = w.last_stats
        if last is None or last["process"] != st["process"]:  # a new process counts from 0
            last = {"leased_done": 0, "leased_busy": {}}
        self.completed += st["leased_done"] - last["leased_done"]
        self.leased_done += st["leased_done"] - last["leased_done"]
        for rank, s in st["leased_busy"].items():
            added = s - last["leased_busy"].get(rank, 0.0)
            w.busy_s += added
            w.by_rank[rank] = w.by_rank.get(rank, 0.0) + added
        w.last_stats = st

    async def _came_up(self, w: _Worker) -> None:
        """A new worker takes items as soon as it is up, not at the next control period (a
        pool starting with its job waited up to :data:`CONTROL_S` for its first items); one
        that could not start leaves the pool (the next tick's :meth:`_resize` replaces it)."""
        try:
            node = await w.ready_ref
        except ray.exceptions.RayError:
            if self.workers.get(w.wid) is w:
                self._forget(w)
            return
        if self.workers.get(w.wid) is w:  # still in the pool (a pending one may be dropped)
            w.node, w.up = node, True
            self._dispatch()

    def _forget(self, w: _Worker) -> None:
        """Out of the pool (its calls in flight fail at their ranks, which resubmit them); what
        it did stays in the job's totals."""
        self.busy_total += w.busy_s
        for rank, s in w.by_rank.items():
            self._gone_by_rank[rank] += s
        w.busy_s, w.by_rank = 0.0, {}
        if w.stats is not None:
            w.stats.cancel()
        self.workers.pop(w.wid, None)

    def _drop_lost_nodes(self) -> None:
        """Workers on a dead node are killed (no restart): their ranks resubmit the calls they
        held, which go to the workers that are left, and the pool starts replacements (pending
        until a node has room: demand the autoscaler sees)."""
        up = [w for w in self.workers.values() if w.up and w.node]
        if not up:
            return
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for w in up:
            if w.node not in alive:
                ray.kill(w.handle, no_restart=True)
                self.lost += 1
                self._forget(w)

    def _free_workers(self) -> int:
        """Workers the nodes decode may use have room for now (0 when it cannot be told)."""
        from ray._private import state

        dc = self.cfg.decode
        now = time.monotonic()
        if now - self._labels[0] > 5.0:
            self._labels = (now, {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes()
                                  if n.get("Alive")})
        try:
            avail = state.available_resources_per_node()
        except Exception:  # an internal API: without it, grow one pending worker at a time
            return 0
        free = 0
        for node, res in avail.items():
            labels = self._labels[1].get(node)
            if labels is None or any(labels.get(k) != v for k, v in dc.label_selector.items()):
                continue
            cpus = res.get("CPU", 0.0)
            free += int(cpus // dc.num_cpus) if dc.num_cpus > 0 else 64
        return free

    def _resize(self, target: int, held: int, pending: int) -> None:
        """Start workers up to ``target``, or retire the surplus: pending ones first (they hold
        nothing), then the least loaded."""
        for _ in range(target - held - pending):
            handle = self._remote.remote(self.cfg)
            wid = handle._actor_id.hex()
            w = self.workers[wid] = _Worker(handle, wid, handle.ready.remote())
            self.started += 1
            self._keep(self._came_up(w))
        surplus = held + pending - target
        if surplus <= 0:
            return
        live = [w for w in self.workers.values() if w.retired_at is None]
        for w in sorted(live, key=lambda w: (w.up, w.lease is not None,
                                             len(w.inflight)))[:surplus]:
            if not w.up:
                ray.kill(w.handle, no_restart=True)
                self._forget(w)
            else:
                w.retired_at = time.monotonic()  # gets no more items; ends once empty
            self.retired += 1

    def _kill_drained(self, now: float) -> None:
        for w in [w for w in self.workers.values() if w.retired_at is not None]:
            if self._drained(w) or now - w.retired_at >= RETIRE_MAX_S:
                ray.kill(w.handle, no_restart=True)
                self._forget(w)

    def _drained(self, w: _Worker) -> bool:
        """A retired worker holds no shared call and, if it was leased, its rank said after
        the retirement that it no longer uses it (its calls on it taken, or it left)."""
        if w.inflight:
            return False
        r = self.ranks.get(w.lease) if w.lease is not None else None
        return r is None or (r.using_t > (w.retired_at or 0.0) and w.wid not in r.using)

    def _export(self, now: float) -> None:
        """Target, held and busy decode CPUs of the job and of each rank (Ray metrics): busy
        averaged over :data:`EXPORT_WINDOW_S`; a rank's target is an equal share of the job's
        (earliest step first serves the ranks equally when decode is short)."""
        cpus, n = self.num_cpus, self.history[-1]
        by_rank = self.rank_busy()
        self._rank_hist.append((now, by_rank))
        trim_window(self._rank_hist, now, EXPORT_WINDOW_S)
        t0, old = self._rank_hist[0]
        dt = max(now - t0, 1e-9)
        busy = {r: (s - old.get(r, 0.0)) / dt for r, s in by_rank.items()}
        record_job("target", n["target"] * cpus, self.tags)
        record_job("held", n["held"] * cpus, self.tags)
        record_job("pending", n["pending"] * cpus, self.tags)
        record_job("busy", sum(busy.values()) * cpus, self.tags)
        share = n["target"] * cpus / max(1, len(self.ranks))
        for r in self.ranks.values():
            record_rank("target", share, r.tags)
            record_rank("busy", busy.get(r.rank, 0.0) * cpus, r.tags)

    def rank_busy(self) -> dict[int, float]:
        """Seconds the job's workers spent on each rank's items (cumulative)."""
        out = collections.defaultdict(float, self._gone_by_rank)
        for w in self.workers.values():
            for rank, s in w.by_rank.items():
                out[int(rank)] += s
        return dict(out)


#: What :func:`_awaited` answers for an actor that is dead for good.
DEAD = "dead"


async def _awaited(ref: Any) -> Any:
    """The value, :data:`DEAD` when its actor died for good, None on any other failure (an
    actor restarting, or unreachable for now)."""
    try:
        return await ref
    except ray.exceptions.ActorDiedError:
        return DEAD
    except ray.exceptions.RayError:
        return None


def prestart(cfg: Config, pipelines: int, dataset: str,
             wait_s: float = PRESTART_WAIT_S) -> Any:
    """Start the job's decode pool now, from the job's driver (its workers start while Ray
    Train starts the ranks); returns the controller. It lives until its ranks have come and
    gone, or ``wait_s`` if none comes (at the latest as long as the driver)."""
    handle = connect(cfg, pipelines, dataset)
    ray.get(handle.prestart.remote(wait_s))
    return handle


#: The controllers this process connected to, by name, with the handle that created each:
#: Ray ends an actor (named or not) once its creator holds no handle to it, and the controller
#: must outlive the execution that created it (it ends itself, :data:`LINGER_S` after its
#: last rank left).
_HANDLES: dict[str, Any] = {}


@functools.cache
def _service_class() -> Any:
    """The controller's actor class, built once a process: ``ray.remote`` inspects every
    method of the class (~0.6 ms of CPU a call), and every rank of a process connects."""
    return ray.remote(DecodeService)


def connect(cfg: Config, pipelines: int, dataset: str, name: str | None = None) -> Any:
    """The job's controller: the running one of this name (``service_name``'s, computed here
    unless the caller has it), or a new one on this node.

    Pinned to this node (the driver's, or a rank's), not merely preferred: Ray's soft
    affinity passes over a node without CPUs (a head with ``resources: {"CPU": 0}``, as
    cluster.yaml has it) and put the controller on a decode node, whose removal then took the
    job's pool with it (``bench/scale_out.py``'s churn phase stalled every rank that way)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    name = name or service_name(cfg, dataset)
    handle = _service_class().options(
        name=name, get_if_exists=True, num_cpus=0, max_restarts=0,
        lifetime=None, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(cfg, pipelines, dataset)
    old = _HANDLES.get(name)
    if old is None or old._actor_id != handle._actor_id:  # keep the creating handle
        _HANDLES[name] = handle
    return _HANDLES[name]
