"""Part 3 of bench/scale_out.py: simulated ranks that take *synchronous* steps.

A data-parallel step waits for its slowest rank, so what a job gets from its decode capacity is
the samples of the steps every rank took together. Here R simulated ranks (the loader's loop,
as in part 2) take a step together: each takes its next batch (the time that takes is its
data-wait), waits at a barrier (:class:`StepBarrier`, an async Ray actor every rank process
arrives at), then spends ``compute_s`` on its simulated step. Phases:

* ``below``: decode capacity below demand (a short step): decode sets the pace.
* ``above``: capacity above demand: the step is ``above_ratio`` × the capacity's step time, so
  the pool should shrink to what the ranks keep busy and the ranks should not wait.
* ``churn``: as ``below``, and ``churn_nodes`` decode nodes are killed (SIGKILL, a preemption)
  after step ``churn_at[0]`` and as many fresh ones join after step ``churn_at[1]``. The
  capacity counts each node's slots from when it is up (the phase's ``decode_slots``). The
  ranks' windows hold items decoded before the kill, at the whole capacity, so over a short
  phase (16 ranks: ~20 s) the efficiency may read a little above 1.

Per phase: samples/s as synchronous steps (R × batch × steps over the time from step
:data:`SKIP_STEPS` to the last: the items the ranks' windows hold for later steps are decoded
while the pool starts, and would count as throughput before that; also from the start), the
decode capacity in samples/s (the decode slots alive, averaged over the same time, /
``sim_cost_s``), ``efficiency`` = the first / the second,
the time to the first synchronous step against one rank alone (on the job pool at its fair
share of the capacity, one worker at R / slots × the cost; and on the whole capacity), every
rank's data-wait as a share of the step time (steps after the first), the decode CPUs the job
held against those it kept busy (the job controller's samples, over whole steps: from step
:data:`SKIP_STEPS`, and from the step under way 60 s after the start), and
every rank's exactness
(its batches against the planner's, :func:`bench.scale_out.compare`).
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time
from typing import Any

#: Steps left out of the steady rate (see :func:`summarize_phase`).
SKIP_STEPS = 3
#: Steps at the end whose items the ranks' windows held before (left out of held vs busy).
TAIL_STEPS = 3
#: Seconds a barrier (or a rank waiting at it) gives up after: a failed rank must not hang
#: the sitting.
BARRIER_TIMEOUT_S = 900.0


class BarrierAborted(RuntimeError):
    """A rank failed: the others stop at the barrier instead of waiting for it."""


class StepBarrier:
    """An async Ray actor: a step is released when ``parties`` ranks arrived at it (a process
    arrives once for its ranks); keeps the release times (wall clock). :meth:`abort` (a rank
    failed) releases every waiting and later arrival with :class:`BarrierAborted`, so the
    phase ends with that rank's error at once, not after :data:`BARRIER_TIMEOUT_S`."""

    def __init__(self, parties: int):
        self.parties = parties
        self.count: dict[int, int] = collections.defaultdict(int)
        self.events: dict[int, asyncio.Event] = {}
        self.released: dict[int, float] = {}
        self.aborted: str | None = None

    async def arrive(self, step: int, n: int) -> float:
        self.count[step] += n
        ev = self.events.setdefault(step, asyncio.Event())
        if self.count[step] >= self.parties:
            self.released[step] = time.time()
            ev.set()
        if self.aborted is None:
            await asyncio.wait_for(ev.wait(), BARRIER_TIMEOUT_S)
        if step not in self.released:
            raise BarrierAborted(f"step {step}: {self.aborted}")
        return self.released[step]

    async def abort(self, reason: str) -> None:
        """Release every rank waiting now or later, with ``reason`` (not a step release)."""
        if self.aborted is None:
            self.aborted = reason
        for ev in self.events.values():
            ev.set()

    async def progress(self) -> dict[int, float]:
        return dict(self.released)


def rank_loop(loader: Any, steps: int, compute_s: float, sync: Any) -> dict[str, Any]:
    """One rank's synchronous steps: take the batch (timed: data-wait), ``sync(step)`` (the
    barrier), sleep ``compute_s``. Returns its batches and waits."""
    batches, waits = [], []
    t_start = time.time()

    def flat():
        for _, epoch_batches in loader.epochs(1):
            yield from epoch_batches

    it = flat()
    first = None
    for step in range(steps):
        t0 = time.perf_counter()
        b = next(it)
        waits.append(time.perf_counter() - t0)
        if first is None:
            first = time.time() - t_start
        batches.append(list(zip(b.sids, b.indices, b.pads, strict=True)))
        sync(step)
        time.sleep(compute_s)
    rest = sum(1 for _ in it)  # the epoch's end (nothing is left when steps cover it)
    return {"batches": batches, "waits": waits, "t_start": t_start, "first_batch_s": first,
            "left_over_batches": rest, "decode_compute": loader.compute,
            "stats": list(loader.data_stats)}


def capacity(events: list[tuple[float, int]], t0: float, t1: float, sim_cost_s: float) -> float:
    """Decode capacity in samples/s over [t0, t1]: the slots alive (``events``: (time, slots
    from then on), sorted) averaged over the time, / the simulated cost per sample."""
    if t1 <= t0:
        return float("nan")
    total, slots, t = 0.0, events[0][1], t0
    for when, n in events:
        if when <= t0:
            slots = n
            continue
        if when >= t1:
            break
        total += slots * (when - t)
        t, slots = when, n
    total += slots * (t1 - t)
    return total / (t1 - t0) / sim_cost_s


def held_busy(history: list[dict], num_cpus: float, marks: list[float],
              window_s: float = 10.0) -> dict[str, float | None]:
    """The controller's samples (its clock) between the first and last of ``marks`` (step
    releases, sorted): time-averaged decode CPUs held and busy, their ratio, and the start of
    the earliest window from which every window of whole steps (at least ``window_s``) holds
    at most 1.3× what it keeps busy (seconds after the first mark).

    Whole steps: behind a barrier the pool decodes a step's items in a burst and idles until
    the next step, so busy over a span that cuts a step is off by up to a step's work (a span
    of 26.8 s over 13-s steps read 3.71 busy CPUs where whole steps read 3.99)."""
    if len(marks) < 2:
        return {"held_cpus": None, "busy_cpus": None, "held_over_busy": None,
                "le_1_3_from_s": None}

    def span(t0: float, t1: float) -> tuple[float, float]:
        """(held CPU-s, busy CPU-s) over [t0, t1] from the samples (held is a step function,
        busy a cumulative count read at the samples nearest the ends)."""
        pts = [h for h in history if t0 <= h["t"] <= t1]
        if len(pts) < 2:
            return 0.0, 0.0
        held = sum(a["held"] * (b["t"] - a["t"]) for a, b in zip(pts, pts[1:], strict=False))
        # scaled to the whole span: the samples start and end within a control period of it
        held *= (t1 - t0) / (pts[-1]["t"] - pts[0]["t"])
        busy = (pts[-1]["busy_s"] - pts[0]["busy_s"]) * (t1 - t0) / (pts[-1]["t"] - pts[0]["t"])
        return held, busy

    held, busy = span(marks[0], marks[-1])
    if busy <= 0:
        return {"held_cpus": None, "busy_cpus": None, "held_over_busy": None,
                "le_1_3_from_s": None}
    windows = []
    for i, m in enumerate(marks):
        j = next((j for j in range(i - 1, -1, -1) if m - marks[j] >= window_s), None)
        if j is not None:
            h, b = span(marks[j], m)
            windows.append((marks[j], h / b if b > 0 else math.inf))
    ok_from = None
    for t, r in windows:  # the start of the last run of windows at <= 1.3
        ok_from = (t if ok_from is None else ok_from) if r <= 1.3 else None
    dt = marks[-1] - marks[0]
    return {"held_cpus": round(held / dt * num_cpus, 2),
            "busy_cpus": round(busy / dt * num_cpus, 2), "held_over_busy": round(held / busy, 2),
            "le_1_3_from_s": None if ok_from is None else round(ok_from - marks[0], 1)}


def summarize_phase(results: list[dict], released: dict[int, float], t0: float, world: int,
                    batch: int, slot_events: list[tuple[float, int]], sim_cost_s: float,
                    history: dict | None) -> dict[str, Any]:
    """The figures of one phase (see the module docstring)."""
    steps = len(released)
    rel = [released[s] for s in sorted(released)]
    first, last = rel[0], rel[-1]
    # steady: from step `skip` on, once the look-ahead the ranks built while the pool started
    # (their windows hold later steps' items) is spent, so it does not count as throughput
    skip = min(SKIP_STEPS, (steps - 1) // 2)
    a = rel[skip]
    steady = (steps - 1 - skip) * world * batch / (last - a) if last > a else float("nan")
    whole = steps * world * batch / (last - t0)
    cap = capacity(slot_events, a, last, sim_cost_s)
    step_s = (last - first) / max(1, steps - 1)
    waits = {r["rank"]: r["waits"] for r in results}
    share = {rank: sum(w[1:]) / max(1, len(w) - 1) / step_s if step_s > 0 else 0.0
             for rank, w in waits.items()}
    out: dict[str, Any] = {
        "steps": steps, "steady_from_step": skip, "step_s": round(step_s, 3),
        "sync_samples_per_s": round(steady, 1), "sync_samples_per_s_from_start":
            round(whole, 1),
        "capacity_samples_per_s": round(cap, 1),
        "efficiency": round(steady / cap, 3) if steps > 1 else None,
        "first_step_s": round(first - t0, 2),
        "first_batch_s": _spread([r["first_batch_s"] for r in results]),
        "data_wait_share_of_step": {"median": round(statistics.median(share.values()), 4),
                                    "max": round(max(share.values()), 4)},
        "data_wait_share_per_rank": {r: round(v, 4) for r, v in sorted(share.items())},
        "first_batch_wait_s": _spread([w[0] for w in waits.values()]),
        "step_release_s": [round(r - t0, 2) for r in rel],
    }
    if history:
        hist, off = history["history"], history["t0_wall"]
        cpus = history["num_cpus"]
        # the last steps' items were decoded ahead (the ranks' windows): nothing is left to
        # decode for them, so busy is measured up to the release of step -1 - TAIL_STEPS
        last = max(0, steps - 1 - TAIL_STEPS)
        end = rel[last]
        # whole steps: from step `skip`, and from the step under way 60 s after the start (the
        # last released by then), to step `last`
        marks = [r - off for r in rel[skip:last + 1]]
        at60 = max((i for i, r in enumerate(rel[:last + 1]) if r - t0 <= 60.0), default=0)
        late = [r - off for r in rel[at60:last + 1]]
        out["decode_cpus"] = held_busy(hist, cpus, marks)
        out["decode_cpus_after_60s"] = held_busy(hist, cpus, late)
        out["decode_cpus_window_s"] = [round(a - t0, 1),
                                       round(late[0] + off - t0, 1) if late else None,
                                       round(end - t0, 1)]
        out["pool"] = {"started": history["started"], "retired": history["retired"],
                       "lost": history["lost"], "last_target": history["target"],
                       "reason": history["reason"]}
        # the controller's samples from the phase's start, one a second: (s, target, held,
        # pending, busy CPU-s so far, ranks' wait so far, items queued, demand in workers)
        keep, last = [], -1.0
        for h in hist:
            if h["t"] + off >= t0 and h["t"] - last >= 1.0:
                last = h["t"]
                keep.append((round(h["t"] + off - t0, 1), h["target"], h["held"], h["pending"],
                             round(h["busy_s"] * cpus, 1), round(h["wait_s"], 1),
                             h["queued"], h.get("demand")))
        out["pool_history"] = keep
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return {"min": round(values[0], 2), "median": round(statistics.median(values), 2),
            "max": round(values[-1], 2)}
