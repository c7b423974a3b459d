"""The job's decode pool (``decode.compute: actors``, ``decode.pool_scope: job``): one pool of
decode actors that every rank of a job draws from, and the controller that sizes it.

* :class:`SharedDecodeWorker`: a decode actor (``decode.num_cpus``, ``decode.label_selector``)
  that any rank of the job sends read items to, directly (the blocks go from the worker's node
  to the rank's through the object store, never through the controller). It decodes one item
  at a time and runs its queued calls earliest step first
  (:class:`~ray_ingest.execution.fairshare.PriorityGate`): the job's capacity turns into
  synchronous steps instead of look-ahead for the ranks that happened to ask first.
* :class:`DecodeService`: the job's controller, a named actor (``ray_ingest_decode_<key>``,
  not detached: it ends with the rank process that created it, and so do the workers it
  owns). Ranks join it, report their demand (data-wait, calls in flight and finished) every
  :data:`REPORT_S` and get the current list of workers (the roster) back. Every
  :data:`CONTROL_S` it reads the workers' busy time and queues and the cluster's free CPUs,
  sizes the pool (:class:`~ray_ingest.execution.fairshare.Sizer`), starts workers (a worker
  no node has room for stays pending: demand the autoscaler sees), retires workers (out of the
  roster first, killed once their queue is empty), replaces workers whose node died (killed,
  so that the ranks resubmit their calls at once), exports the job's and each rank's target
  and busy decode CPUs as Ray metrics, and ends itself once no rank has used it for
  :data:`LINGER_S`.

The rank side (its ordered window, resubmits, stall checks) is
:class:`ray_ingest.execution.jobpool.JobPoolExecution`.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import ray

from ray_ingest.catalog.shard import Shard
from ray_ingest.config import Config
from ray_ingest.execution.fairshare import PriorityGate, Signals, Sizer, SizerSettings
from ray_ingest.execution.local import ItemDecoder
from ray_ingest.metrics import job_tags, record_job, record_rank
from ray_ingest.plan.epoch import ReadItem

#: How often the controller reads its workers and sizes the pool (seconds).
CONTROL_S = 0.5
#: How often a rank reports its demand (seconds).
REPORT_S = 0.5
#: A retired worker is killed once its queue is empty and the ranks had this long to learn
#: the new roster (seconds); at the latest after :data:`RETIRE_MAX_S`.
ROSTER_GRACE_S = 2.0
RETIRE_MAX_S = 60.0
#: The controller ends (its workers with it) after this long without a rank (seconds): longer
#: than the gap between two windows of a loader, short enough not to hold CPUs after a run.
LINGER_S = 3.0
#: Seconds the exported busy CPUs are averaged over.
EXPORT_WINDOW_S = 5.0
#: Controller samples kept for :meth:`DecodeService.stats` (one per control period).
HISTORY = 7200


def service_name(cfg: Config, dataset: str) -> str:
    """The controller's actor name for this job, config and dataset: ranks of one job with
    the same decode and read settings share one pool (a hash: no setting shows in the name)."""
    job = ray.get_runtime_context().get_job_id()
    doc = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    digest = hashlib.sha1(f"{job}|{dataset}|{doc}".encode()).hexdigest()[:16]
    return f"ray_ingest_decode_{digest}"


class SharedDecodeWorker:
    """A decode actor of the job's pool (async: its calls queue in a priority gate, decoding
    runs in one thread)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._decoders: dict[tuple, ItemDecoder] = {}
        self._gate = PriorityGate(1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ray_ingest-decode")
        self.busy_s = 0.0
        self.running = 0
        self.by_rank: dict[int, float] = collections.defaultdict(float)
        self.node = ray.get_runtime_context().get_node_id()

    async def ready(self) -> str:
        return self.node

    async def decode(self, key: tuple[int, int], rank: int, tags: dict[str, str] | None,
                     shard: Shard, item: ReadItem) -> list[dict]:
        await self._gate.acquire(key)
        t0 = time.monotonic()
        self.running += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self._decode, tags, shard, item)
        finally:
            dt = time.monotonic() - t0
            self.running -= 1
            self.busy_s += dt
            self.by_rank[rank] += dt
            self._gate.release()

    def _decode(self, tags: dict[str, str] | None, shard: Shard, item: ReadItem) -> list[dict]:
        k = tuple(sorted((tags or {}).items()))
        if k not in self._decoders:
            self._decoders[k] = ItemDecoder(self.cfg, tags)
        return self._decoders[k](shard, item)

    async def stats(self) -> dict[str, Any]:
        """Busy seconds (cumulative, all and per rank), calls queued and running, its node."""
        return {"busy_s": self.busy_s, "by_rank": dict(self.by_rank), "node": self.node,
                "queued": self._gate.queued, "running": self.running}


@attrs.define
class _Worker:
    handle: Any
    wid: str
    ready_ref: Any
    up: bool = False
    node: str = ""
    busy_s: float = 0.0
    by_rank: dict[int, float] = attrs.field(factory=dict)
    queued: int = 0
    running: int = 0
    retired_at: float | None = None


@attrs.define
class _Rank:
    tags: dict[str, str]
    wait_s: float = 0.0
    seen: float = 0.0


class DecodeService:
    """The job's decode controller (see the module docstring).

    Args:
        cfg: the run configuration (decode settings; ``pool_min``/``pool_max``).
        pipelines: the job's ranks that build a pipeline (``pool_max`` counts per pipeline).
        dataset: the catalog fingerprint (metric tag).
    """

    def __init__(self, cfg: Config, pipelines: int, dataset: str):
        dc = cfg.decode
        self.cfg, self.num_cpus = cfg, dc.num_cpus
        self.sizer = Sizer(SizerSettings(lo=dc.pool_min, hi=max(1, dc.pool_max * pipelines),
                                         hold_s=dc.scale_down_hold_s or CONTROL_S * 4))
        self.tags = job_tags(ray.get_runtime_context().get_job_id(), dataset)
        self.workers: dict[str, _Worker] = {}
        self.ranks: dict[int, _Rank] = {}
        self.version = 0
        self.busy_total = self.wait_left = 0.0  # of workers and ranks gone
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self.started = self.retired = self.lost = 0
        self._t0 = time.monotonic()
        self._empty_since: float | None = self._t0
        self._loop: asyncio.Task | None = None
        self._remote = ray.remote(SharedDecodeWorker).options(**self._worker_options())
        self._labels: tuple[float, dict[str, dict]] = (0.0, {})
        self._gone_by_rank: dict[int, float] = collections.defaultdict(float)
        self._rank_hist: collections.deque[tuple[float, dict[int, float]]] = \
            collections.deque()

    def _worker_options(self) -> dict[str, Any]:
        dc = self.cfg.decode
        opts: dict[str, Any] = {"num_cpus": dc.num_cpus, "max_restarts": -1,
                                "max_task_retries": -1}
        if dc.label_selector:
            opts["label_selector"] = dict(dc.label_selector)
        return opts

    # --- the ranks' calls ----------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def join(self, rank: int, tags: dict[str, str]) -> dict[str, Any] | None:
        """Register a rank; its roster (None: this controller is ending, ask for a new one)."""
        if self._loop is not None and self._loop.done():
            return None
        self._ensure_loop()
        old = self.ranks.get(rank)
        if old is not None:
            self.wait_left += old.wait_s
        self.ranks[rank] = _Rank(dict(tags), seen=time.monotonic())
        self._empty_since = None
        if self.sizer.target is None:
            await self._tick()  # the first workers start now, not a control period later
        return self._roster()

    async def report(self, rank: int, version: int, wait_s: float) -> dict[str, Any] | None:
        """A rank's cumulative data-wait; the roster when it changed since ``version`` (else
        only the version), None when the rank must join again."""
        r = self.ranks.get(rank)
        if r is None or (self._loop is not None and self._loop.done()):
            return None  # unknown (or ending): join again
        r.wait_s, r.seen = wait_s, time.monotonic()
        return {"version": version} if version == self.version else self._roster()

    async def leave(self, rank: int) -> None:
        r = self.ranks.pop(rank, None)
        if r is not None:
            self.wait_left += r.wait_s
        if not self.ranks:
            self._empty_since = time.monotonic()

    def _roster(self) -> dict[str, Any]:
        up = [(w.wid, w.handle) for w in self.workers.values() if w.up and w.retired_at is None]
        return {"version": self.version, "workers": up, "ranks": max(1, len(self.ranks))}

    async def stats(self) -> dict[str, Any]:
        """Counters and the sampled history (t, target, held, pending, busy, wait, free)."""
        return {"target": self.sizer.target, "reason": self.sizer.reason,
                "started": self.started, "retired": self.retired, "lost": self.lost,
                "ranks": len(self.ranks), "num_cpus": self.num_cpus,
                "history": list(self.history)}

    # --- the control loop ----------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CONTROL_S)
            await self._tick()
            if (self._empty_since is not None
                    and time.monotonic() - self._empty_since >= LINGER_S):
                for w in list(self.workers.values()):
                    ray.kill(w.handle, no_restart=True)
                self.workers.clear()
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    async def _tick(self) -> None:
        now = time.monotonic()
        await self._poll_workers()
        self._drop_lost_nodes()
        held = sum(1 for w in self.workers.values() if w.up and w.retired_at is None)
        pending = sum(1 for w in self.workers.values() if not w.up and w.retired_at is None)
        sig = Signals(t=now - self._t0, held=held, pending=pending, busy_s=self._busy(),
                      wait_s=self.wait_left + sum(r.wait_s for r in self.ranks.values()),
                      ranks=len(self.ranks), queued=sum(w.queued for w in self.workers.values()),
                      free=self._free_workers())
        target = self.sizer.update(sig)
        self._resize(target, held, pending)
        self._kill_drained(now)
        self.history.append({"t": round(sig.t, 2), "target": target, "held": held,
                             "pending": pending, "busy_s": round(sig.busy_s, 3),
                             "wait_s": round(sig.wait_s, 3), "queued": sig.queued,
                             "free": sig.free, "ranks": sig.ranks})
        self._export(now)

    def _busy(self) -> float:
        return self.busy_total + sum(w.busy_s for w in self.workers.values())

    async def _poll_workers(self) -> None:
        """Workers that came up join the roster; the others' busy time, queues and nodes.
        (Awaited, never ``ray.wait``: a blocking wait would hold up the ranks' reports.)"""
        for w in [w for w in self.workers.values() if not w.up]:
            ready, _ = ray.wait([w.ready_ref], timeout=0)
            if not ready:
                continue
            try:
                w.node = await w.ready_ref
                w.up = True
                self.version += 1
            except ray.exceptions.RayError:  # could not start: replaced by _resize
                self._forget(w)
        up = [w for w in self.workers.values() if w.up]
        if not up:
            return
        futs = {asyncio.ensure_future(_awaited(w.handle.stats.remote())): w for w in up}
        done, late = await asyncio.wait(futs, timeout=CONTROL_S)
        for f in late:  # restarting, or its node is gone: the node's state decides (below)
            f.cancel()
        for f in done:
            st, w = f.result(), futs[f]
            if st is None:
                continue
            if st["busy_s"] < w.busy_s:  # restarted in place: its counters began again
                self._forget_counters(w)
            w.busy_s, w.by_rank = st["busy_s"], st["by_rank"]
            w.queued, w.running, w.node = st["queued"], st["running"], st["node"]

    def _forget_counters(self, w: _Worker) -> None:
        """Keep what a worker did in the job's totals (it ends, or its counters restart)."""
        self.busy_total += w.busy_s
        for rank, s in w.by_rank.items():
            self._gone_by_rank[int(rank)] += s
        w.busy_s, w.by_rank = 0.0, {}

    def _forget(self, w: _Worker) -> None:
        self._forget_counters(w)
        self.workers.pop(w.wid, None)
        if w.up and w.retired_at is None:
            self.version += 1

    def _drop_lost_nodes(self) -> None:
        """Workers on a dead node are killed (no restart): the ranks resubmit their calls to
        the workers that are left, and the pool starts replacements (pending until a node has
        room)."""
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
            self.workers[wid] = _Worker(handle, wid, handle.ready.remote())
            self.started += 1
        surplus = held + pending - target
        if surplus <= 0:
            return
        live = [w for w in self.workers.values() if w.retired_at is None]
        for w in sorted(live, key=lambda w: (w.up, w.queued + w.running))[:surplus]:
            if not w.up:
                ray.kill(w.handle, no_restart=True)
                self._forget(w)
            else:
                w.retired_at = time.monotonic()
                self.version += 1
            self.retired += 1

    def _kill_drained(self, now: float) -> None:
        for w in [w for w in self.workers.values() if w.retired_at is not None]:
            idle = w.queued == 0 and w.running == 0
            if (idle and now - w.retired_at >= ROSTER_GRACE_S) or \
                    now - w.retired_at >= RETIRE_MAX_S:
                ray.kill(w.handle, no_restart=True)
                self._forget(w)

    def _export(self, now: float) -> None:
        """Target, held and busy decode CPUs of the job and of each rank (Ray metrics): busy
        averaged over :data:`EXPORT_WINDOW_S`; a rank's target is an equal share of the job's
        (earliest step first serves the ranks equally when decode is short)."""
        cpus, n = self.num_cpus, self.history[-1]
        by_rank = self.rank_busy()
        self._rank_hist.append((now, by_rank))
        while len(self._rank_hist) > 2 and now - self._rank_hist[1][0] >= EXPORT_WINDOW_S:
            self._rank_hist.popleft()
        t0, old = self._rank_hist[0]
        dt = max(now - t0, 1e-9)
        busy = {r: (s - old.get(r, 0.0)) / dt for r, s in by_rank.items()}
        record_job("target", n["target"] * cpus, self.tags)
        record_job("held", n["held"] * cpus, self.tags)
        record_job("pending", n["pending"] * cpus, self.tags)
        record_job("busy", sum(busy.values()) * cpus, self.tags)
        share = n["target"] * cpus / max(1, len(self.ranks))
        for rank, r in self.ranks.items():
            record_rank("target", share, r.tags)
            record_rank("busy", busy.get(rank, 0.0) * cpus, r.tags)

    def rank_busy(self) -> dict[int, float]:
        """Seconds the job's workers spent on each rank's items (cumulative)."""
        out = collections.defaultdict(float, self._gone_by_rank)
        for w in self.workers.values():
            for rank, s in w.by_rank.items():
                out[int(rank)] += s
        return dict(out)


async def _awaited(ref: Any) -> Any:
    try:
        return await ref
    except ray.exceptions.RayError:
        return None


def connect(cfg: Config, pipelines: int, dataset: str) -> Any:
    """The job's controller: the running one of this name, or a new one on this node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return ray.remote(DecodeService).options(
        name=service_name(cfg, dataset), get_if_exists=True, num_cpus=0, max_restarts=0,
        lifetime=None, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
    ).remote(cfg, pipelines, dataset)
