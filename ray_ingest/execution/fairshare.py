"""Fair shares of a job's decode pool: which call the job's workers run next, and how
many workers the job holds. No Ray, no torch.

A data-parallel step waits for its slowest rank, so a job's decode capacity is worth what it
turns into *synchronous steps*. Two rules make the shared pool
(:mod:`ray_ingest.execution.service`) fair and elastic:

* **Earliest step first.** Every call carries the step its rows are for, :func:`step_key`:
  ``(epoch, stream position // batch_size)``, equal on every rank for the same step (every
  rank of a job consumes the same positions of its own slot's stream at the same step). The
  controller hands its queue to the workers lowest key first, so no rank's step k+1 is
  decoded before another rank's step k: ranks that are behind catch up instead of waiting
  for everyone else's look-ahead (docs/architecture.md, "The job's decode pool").
* **Sized by demand** (:class:`Sizer`): grow while the ranks wait on data and the workers are
  busy; shrink to the busy CPUs plus headroom once the ranks have not waited for
  ``hold_s`` (trainer-bound: batches queued, data-wait about 0), not only once fully idle.
"""

from __future__ import annotations

import collections
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ray_ingest.plan.epoch import ReadItem

#: A call's place in the job's schedule: (epoch, step); lower runs first.
StepKey = tuple[int, int]
#: Calls a worker holds at once: one running, one queued behind it (no idle gap between two).
PER_WORKER = 2


def step_key(item: ReadItem, batch_size: int) -> StepKey:
    """The step whose batch ``item``'s first row goes into: ``(epoch, seq // batch_size)``."""
    return (int(item.epoch), int(item.seq) // max(1, batch_size))


@attrs.frozen
class Signals:
    """What the job's controller sees at time ``t`` (cumulative counters are monotone)."""

    #: Controller clock, seconds.
    t: float
    #: Workers up (in the roster) and workers starting (not yet placed or not yet up).
    held: int
    pending: int
    #: Seconds the job's workers spent decoding, summed over workers, since the job began.
    busy_s: float
    #: Seconds the ranks waited on the pool for their next rows, summed over ranks.
    wait_s: float
    #: Ranks drawing from the pool now.
    ranks: int
    #: Items waiting for a worker (demand the workers have not started).
    queued: int
    #: Workers the cluster has room for now (free CPUs on the nodes decode may use).
    free: int
    #: Workers the ranks' consumption keeps busy (:func:`consumption_demand`; None: not
    #: known yet).
    demand: float | None = None


@attrs.frozen
class SizerSettings:
    """Bounds and thresholds of :class:`Sizer` (docs/architecture.md gives the reasons)."""

    #: Workers the job keeps at least (``decode.pool_min``) and at most (``pool_max`` × the
    #: job's pipelines).
    lo: int = attrs.field(validator=attrs.validators.ge(0))
    hi: int = attrs.field(validator=attrs.validators.ge(1))
    #: Seconds of no data-wait before the pool shrinks (``decode.scale_down_hold_s``); also
    #: the window the busy CPUs are averaged over.
    hold_s: float = 30.0
    #: Workers kept per busy worker when shrinking, rounded up to whole workers...
    headroom: float = 1.2
    #: ...unless that rounds past this many per busy worker while fewer whole workers still
    #: leave ``slack_min`` spare: then the fewer (at ~3.9 busy, 4 workers rather than 5).
    headroom_max: float = 1.25
    slack_min: float = 1.02
    #: Grow when the ranks waited more than this share of the last ``grow_window_s``...
    grow_wait: float = 0.05
    grow_window_s: float = 5.0
    #: ...and the workers were busy more than this share of it (or calls were queued).
    grow_busy: float = 0.75
    #: Shrink only when the ranks waited less than this share of the last ``hold_s``.
    shrink_wait: float = 0.02


class Sizer:
    """The job pool's target size, from :class:`Signals` sampled every control period.

    * **Start:** the free room, within ``lo..hi``: a job starts with what the cluster can
      place now, and at least ``lo`` (pending workers are demand the autoscaler sees).
    * **Grow** (data-wait over ``grow_wait`` and workers busy, or items waiting for a worker)
      by as many workers as the waiting items keep busy, within the free room when there is
      any, else by one pending worker (again demand for the autoscaler); never while workers
      are still starting.
    * **Shrink** after ``hold_s`` without data-wait (since the last growth), to the workers
      the ranks' consumption keeps busy (:func:`consumption_demand`; the busy workers over
      that ``hold_s`` where it is not known, or where they are fewer) × ``headroom`` in whole
      workers (:func:`keep_workers`; at least ``lo``), again at most
      every third of ``hold_s`` while it holds: trainer-bound ranks give back what they do
      not use within about ``2 × hold_s``; a pause of the train loop shorter than ``hold_s``
      keeps the pool, and so does a pool no rank has joined yet (started early by the job's
      driver).
    """

    def __init__(self, settings: SizerSettings):
        self.s = settings
        self.target: int | None = None
        self.reason = "start"
        #: When the pool last grew (or started, or its first ranks came): the no-wait window
        #: of a shrink starts after it. When it last shrank: the next shrink waits a third of
        #: ``hold_s`` (the busy average still covers the whole ``hold_s``).
        self._grown = self._shrunk = 0.0
        self._hist: collections.deque[Signals] = collections.deque()

    def update(self, sig: Signals) -> int:
        """The target after ``sig`` (also :attr:`target`; :attr:`reason` says why)."""
        s = self.s
        self._hist.append(sig)
        trim_window(self._hist, sig.t, max(s.hold_s, s.grow_window_s) + 1.0,
                    operator.attrgetter("t"))
        if self.target is None:
            self.target = _clamp(sig.held + sig.pending + sig.free, s.lo, s.hi)
            self._grown = sig.t
            return self.target
        if sig.ranks and not self._hist[-2].ranks:
            self._grown = sig.t  # the first ranks came: what was before says nothing
        grown = self._grow(sig)
        if grown is None:
            self._shrink(sig)
        return self.target

    def _since(self, sig: Signals, seconds: float) -> Signals | None:
        """The latest sample at least ``seconds`` before ``sig`` (None: history too short)."""
        for old in reversed(self._hist):
            if sig.t - old.t >= seconds:
                return old
        return None

    def _grow(self, sig: Signals) -> int | None:
        s, target = self.s, self.target or 0
        old = self._since(sig, s.grow_window_s)
        if old is None or sig.pending or target >= s.hi:
            return None
        dt = sig.t - old.t
        wait = (sig.wait_s - old.wait_s) / (dt * max(1, sig.ranks))
        busy = (sig.busy_s - old.busy_s) / (dt * max(1, sig.held))
        if wait <= s.grow_wait or not (busy >= s.grow_busy or sig.queued > 0):
            return None
        # as many as the items waiting for a worker can keep busy, within the free room; none
        # free: one pending worker, demand the autoscaler sees
        step = min(sig.free, max(1, math.ceil(sig.queued / PER_WORKER))) if sig.free > 0 else 1
        self.target = min(s.hi, max(target, sig.held + step))
        self.reason = f"grow: ranks waited {wait:.0%}, workers busy {busy:.0%}"
        self._grown = sig.t
        return self.target

    def _shrink(self, sig: Signals) -> None:
        s, target = self.s, self.target or 0
        old = self._since(sig, s.hold_s)
        if (old is None or old.t < self._grown or sig.t - self._shrunk < s.hold_s / 3
                or not sig.ranks):
            return  # (no rank: none came yet, or they left and the controller ends soon)
        dt = sig.t - old.t
        wait = (sig.wait_s - old.wait_s) / (dt * max(1, sig.ranks))
        if wait >= s.shrink_wait:
            return
        busy = (sig.busy_s - old.busy_s) / dt
        # what the ranks consume, when known: busy also counts the look-ahead the ranks'
        # windows fill at their start, which a steady state does not need
        need = busy if sig.demand is None else min(busy, sig.demand)
        want = _clamp(keep_workers(need, s.headroom, s.headroom_max, s.slack_min), s.lo, s.hi)
        if want < target:
            self.target = want
            self.reason = (f"shrink: ranks waited {wait:.1%} over {dt:.0f} s, "
                           f"{busy:.2f} workers busy, consumption keeps "
                           f"{'?' if sig.demand is None else f'{sig.demand:.2f}'} busy")
            self._shrunk = sig.t


class TakeRate:
    """Items per second a rank takes from the pool, measured between the starts of its steps.

    Why between step starts: behind a step barrier a rank takes a step's items in one burst,
    then none until the next step. A rate over a time window is off by the bursts the window
    cuts; from the window's first to its last take it leaves out the idle time at the ends,
    and with 13-s steps in a 30-s window it often spans one period, whose jitter (12.2-14.3 s
    on the scale-out bench) goes straight into the demand. From the start of one step (its
    first item taken) to the start of a later one the items are whole steps' and the time
    whole periods. The rank's first step is left out (it trickles in while the pool starts).
    The span is the starts of the last ``window_s``, at least the last two whole steps; once
    the next start is overdue (later than a mean period after the last) the span runs to a
    period before now, so a rank that stopped taking decays towards 0.
    """

    def __init__(self, window_s: float, keep: int = 256):
        self.window_s = window_s
        self.taken = 0
        self._key: StepKey | None = None
        #: (time, items taken before it) at the start of each step after the first.
        self._starts: collections.deque[tuple[float, int]] = collections.deque(maxlen=keep)

    def took(self, key: StepKey, t: float) -> bool:
        """An item of step ``key`` taken at ``t``; whether it started a step after the first
        (the rate changed)."""
        started = False
        if self._key is None or key > self._key:
            if self._key is not None:
                self._starts.append((t, self.taken))
                started = True
            self._key = key
        self.taken += 1
        return started

    def rate(self, now: float) -> float | None:
        """Items per second (None: fewer than two step starts after the first step)."""
        s = self._starts
        if len(s) < 2:
            return None
        first = next((i for i, (t, _) in enumerate(s) if now - t <= self.window_s), len(s) - 1)
        first = max(0, min(first, len(s) - 3))
        (t0, n0), (t1, n1) = s[first], s[-1]
        if t1 <= t0:
            return None
        period = (t1 - t0) / (len(s) - 1 - first)
        return (n1 - n0) / (max(t1, now - period) - t0)


class ItemCost:
    """Seconds of a worker per item: over the items completed in the last ``window_s`` when
    there are at least ``min_items`` of them, else over every item so far.

    Why a window: the first items of a job cost more than the steady ones (its ranks start
    on the same machines, the workers' first calls warm up). On the scale-out bench (64
    ranks, 0.8 s items) the mean since the start read 0.84-0.87 s a minute in against 0.80
    s in the steady state, and the demand it gives kept a fifth worker over 3.95 busy.
    """

    def __init__(self, window_s: float, min_items: int = 8):
        self.window_s, self.min_items = window_s, min_items
        self._hist: collections.deque[tuple[float, float, int]] = collections.deque()

    def update(self, t: float, busy_s: float, completed: int) -> float | None:
        """The cost after the cumulative ``busy_s`` over ``completed`` items at ``t`` (None:
        no item completed yet)."""
        self._hist.append((t, busy_s, completed))
        trim_window(self._hist, t, self.window_s)
        _, b0, c0 = self._hist[0]
        if completed - c0 >= self.min_items:
            return (busy_s - b0) / (completed - c0)
        return busy_s / completed if completed else None


def trim_window(hist: collections.deque, now: float, window_s: float,
                when: Callable[[Any], float] = operator.itemgetter(0)) -> None:
    """Drop ``hist``'s oldest samples (times ``when(sample)``) while the next oldest is at
    least ``window_s`` before ``now``: the oldest left is the latest that spans the window
    (at least two stay), the base of a rate over it."""
    while len(hist) > 2 and now - when(hist[1]) >= window_s:
        hist.popleft()


def consumption_demand(rates: Sequence[float | None], cost_s: float | None) -> float | None:
    """Workers the ranks' consumption keeps busy: their items per second (:class:`TakeRate`,
    as each last reported) × ``cost_s`` seconds of a worker per item. Ranks whose rate is not
    known yet count as the mean of those known (the ranks of a data-parallel job step
    together). None when the cost is unknown or fewer than half the ranks' rates are known.
    """
    known = [r for r in rates if r is not None]
    if not cost_s or not known or 2 * len(known) < len(rates):
        return None
    return sum(known) / len(known) * len(rates) * cost_s


def keep_workers(need: float, headroom: float, headroom_max: float, slack_min: float) -> int:
    """Whole workers to keep for ``need`` busy ones: ``need × headroom`` rounded up, or the
    most whole workers within ``need × headroom_max`` where rounding up would hold more and
    those still leave ``slack_min`` spare. Whole workers make the held/busy ratio jump (at 3.9
    busy, 5 workers hold 1.28× and 4 hold 1.03×): the cap keeps a pool from holding a worker
    it barely uses, the slack keeps it from one it cannot do without."""
    want = math.ceil(need * headroom - 1e-9)
    cap = math.floor(need * headroom_max + 1e-9)
    if headroom <= headroom_max and cap < want and cap >= need * slack_min:
        return cap
    return want


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


def ahead_calls(batch_size: int, block_rows: int) -> int:
    """Read items (of at most ``block_rows`` rows) that cover two batches: a rank's next step
    and the one after, so the workers never run dry at a step boundary."""
    return 2 * math.ceil(batch_size / max(1, block_rows)) + 1


def lease_workers(workers: Sequence[tuple[str, str | None, int]], takers: Sequence[str],
                  ranks: int, pipelines: int) -> dict[str, str | None]:
    """Which client each live worker is leased to (None: shared), from ``workers`` as ``(id,
    its lease now, the shared calls it holds)``: once the job's ``pipelines`` decoding ranks
    have all joined (``ranks`` clients), ``len(workers) // ranks`` whole workers to each
    client in ``takers``, the rest shared; none at all where that is 0.

    Why: earliest step first needs one queue only while ranks contend for workers; with a worker
    (or more) for each rank, every rank's items can go straight to workers of its own, and the
    controller's CPU per queued item is saved (~5-6 ms in a one-rank run here, its start
    included: docs/architecture.md). Not before every pipeline joined: the first ranks'
    look-ahead would take the workers from the last ones' first step (what the queue's start
    floor prevents). Stable: a client keeps the workers it holds while its share allows; free
    ones go least loaded first, the clients in a fixed order."""
    share = len(workers) // ranks if ranks >= max(1, pipelines) else 0
    allowed = set(takers)
    held: collections.Counter[str] = collections.Counter()
    out: dict[str, str | None] = {}
    for wid, lease, _ in workers:
        keep = bool(share) and lease in allowed and held[lease] < share
        out[wid] = lease if keep else None
        if keep:
            held[lease] += 1
    if share:
        free = sorted((w for w in workers if out[w[0]] is None), key=lambda w: w[2])
        for client in sorted(allowed):
            while held[client] < share and free:
                out[free.pop(0)[0]] = client
                held[client] += 1
    return out


def window_calls(batch_size: int, block_rows: int, workers: int, ranks: int,
                 per_worker: int, cap: int) -> int:
    """Calls a rank keeps in flight on the job's pool: :func:`ahead_calls`, or its share of
    the pool's queue (``per_worker`` calls per worker spread over the ranks) where that is
    more, at most ``cap`` (its object-store budget)."""
    share = math.ceil(per_worker * max(1, workers) / max(1, ranks))
    return max(1, min(cap, max(ahead_calls(batch_size, block_rows), share)))
