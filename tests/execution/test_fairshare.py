"""The job pool's pure rules (ray_ingest/execution/fairshare.py), without Ray: a worker's queue
runs earliest step first; the pool starts with the cluster's free room, grows while ranks wait
on busy workers, shrinks to the busy workers plus headroom once ranks stop waiting for
``hold_s`` (not only when idle), and keeps its bounds; a rank's window covers two steps."""

from __future__ import annotations

import itertools
import math

import pytest

from ray_ingest.execution.fairshare import (
    ItemCost,
    Signals,
    Sizer,
    SizerSettings,
    TakeRate,
    ahead_calls,
    consumption_demand,
    keep_workers,
    lease_workers,
    step_key,
    window_calls,
)
from ray_ingest.plan.epoch import ReadItem


def test_step_key_is_the_same_step_on_every_rank():
    assert step_key(ReadItem(seq=0, sid=3, start=0, count=16), 16) == (0, 0)
    assert step_key(ReadItem(seq=47, sid=9, start=5, count=1, epoch=2), 16) == (2, 2)
    # the same stream position is the same step whatever the shard (ranks read other shards)
    a = step_key(ReadItem(seq=33, sid=1, start=0, count=8), 16)
    assert a == step_key(ReadItem(seq=33, sid=7, start=40, count=8), 16) == (0, 2)
    assert step_key(ReadItem(seq=0, sid=0, start=0, count=1, epoch=1), 16) > (0, 10**9)


# --- sizing ------------------------------------------------------------------------------------

class Sim:
    """Feeds a :class:`Sizer` signals every ``dt`` seconds from rates: the ranks' wait share,
    the busy workers and the queued calls, with the pool following its target at once."""

    def __init__(self, settings: SizerSettings, free: int, dt: float = 0.5):
        self.sizer, self.free, self.dt = Sizer(settings), free, dt
        self.t = self.busy = self.wait = 0.0
        self.held, self.pending, self.ranks = 0, 0, 4
        self.targets: list[int] = []

    def step(self, wait_share: float, busy_workers: float, queued: int = 0,
             pending: int | None = None, seconds: float | None = None) -> int:
        for _ in range(max(1, round((seconds or self.dt) / self.dt))):
            self.t += self.dt
            self.wait += wait_share * self.ranks * self.dt
            self.busy += min(busy_workers, self.held) * self.dt
            sig = Signals(t=self.t, held=self.held, pending=self.pending if pending is None
                          else pending, busy_s=self.busy, wait_s=self.wait, ranks=self.ranks,
                          queued=queued, free=self.free)
            target = self.sizer.update(sig)
            room = max(0, target - self.held)
            up = min(room, self.free)
            self.free -= up
            self.free += max(0, self.held - target)
            self.held = min(target, self.held + up)
            self.pending = target - self.held
            self.targets.append(target)
        return self.sizer.target


def test_the_pool_starts_with_the_free_room_within_its_bounds():
    for free, lo, hi, want in [(8, 1, 64, 8), (100, 1, 64, 64), (0, 1, 64, 1), (0, 3, 8, 3),
                               (2, 3, 8, 3)]:
        s = Sizer(SizerSettings(lo=lo, hi=hi))
        assert s.update(Signals(0.0, 0, 0, 0.0, 0.0, 4, 0, free)) == want, (free, lo, hi)


def test_grows_while_ranks_wait_on_busy_workers_and_not_while_workers_start():
    sim = Sim(SizerSettings(lo=1, hi=64), free=2)
    sim.step(0.0, 0.0)  # start: the 2 free
    assert sim.held == 2
    sim.free = 10  # a node joins
    sim.step(0.5, 2.0, queued=8, seconds=5.5)
    assert sim.held > 2 and "grow" in sim.sizer.reason
    grown = sim.held
    # waiting, but the new workers are not up yet: no more growth meanwhile
    sim.step(0.5, grown, queued=8, pending=1, seconds=3.0)
    assert sim.sizer.target == grown
    # waiting on idle workers (decode is not the bottleneck: reads, a small window): no growth
    idle = Sim(SizerSettings(lo=1, hi=64), free=4)
    idle.step(0.0, 0.0)
    idle.free = 10
    idle.step(0.5, 0.2 * 4, queued=0, seconds=10.0)
    assert idle.sizer.target == 4 and idle.sizer.reason == "start"


def test_without_free_room_it_grows_by_one_pending_worker_for_the_autoscaler():
    sim = Sim(SizerSettings(lo=1, hi=64), free=3)
    sim.step(0.0, 0.0)
    assert sim.held == 3 and sim.free == 0
    sim.step(0.6, 3.0, queued=20, seconds=5.5)
    assert sim.sizer.target == 4 and sim.pending == 1  # one pending worker: demand
    sim.step(0.6, 3.0, queued=20, seconds=5.0)
    assert sim.sizer.target == 4  # still pending: no more


def test_growth_stops_at_pool_max_times_the_pipelines():
    sim = Sim(SizerSettings(lo=1, hi=6), free=2)
    sim.step(0.0, 0.0)
    sim.free = 100
    for _ in range(20):
        sim.step(0.9, 100.0, queued=50, seconds=2.5)
    assert sim.held == 6 and max(sim.targets) == 6


def test_shrinks_when_trainer_bound_to_busy_plus_headroom_after_hold():
    sim = Sim(SizerSettings(lo=1, hi=64, hold_s=10.0, headroom=1.2), free=16)
    sim.step(0.0, 0.0)
    assert sim.held == 16
    # trainer-bound: no data-wait, 5 of 16 workers busy (batches queued): not idle
    sim.step(0.0, 5.0, seconds=9.0)
    assert sim.sizer.target == 16  # within hold_s
    sim.step(0.0, 5.0, seconds=2.0)
    assert sim.sizer.target == 6 and "shrink" in sim.sizer.reason  # ceil(5 * 1.2)
    sim.step(0.0, 5.0, seconds=30.0)
    assert sim.sizer.target == 6  # stable: 6 >= ceil(5 * 1.2)
    # fully idle (a long pause): down to pool_min (at most two holds: a shrink on the way
    # down, while the window still held busy seconds, restarts the hold)
    sim.step(0.0, 0.0, seconds=21.0)
    assert sim.sizer.target == 1


def test_no_shrink_while_ranks_wait_and_a_short_pause_keeps_the_pool():
    sim = Sim(SizerSettings(lo=1, hi=64, hold_s=10.0), free=8)
    sim.step(0.0, 0.0)
    sim.step(0.3, 2.0, seconds=30.0)  # ranks wait, workers only partly busy: keep
    assert sim.sizer.target == 8
    sim2 = Sim(SizerSettings(lo=1, hi=64, hold_s=10.0), free=8)
    sim2.step(0.0, 0.0)
    sim2.step(0.3, 8.0, queued=4, seconds=5.0)
    sim2.step(0.0, 0.0, seconds=8.0)  # a pause shorter than hold_s
    sim2.step(0.3, 8.0, queued=4, seconds=5.0)
    assert min(sim2.targets) == 8


@pytest.mark.parametrize("busy,free,headroom", itertools.product((0.0, 1.0, 3.3, 7.9, 12.0),
                                                                  (4, 16, 40), (1.0, 1.2, 1.5)))
def test_held_converges_within_headroom_of_busy_and_bounds_hold(busy, free, headroom):
    settings = SizerSettings(lo=1, hi=32, hold_s=5.0, headroom=headroom)
    sim = Sim(settings, free=free)
    sim.step(0.0, 0.0)
    sim.step(0.0, busy, seconds=60.0)
    used = min(busy, float(min(free, 32)))
    assert settings.lo <= sim.held <= settings.hi
    assert all(settings.lo <= t <= settings.hi for t in sim.targets)
    # at most busy x headroom (rounded up) once trainer-bound, never below what is busy
    assert sim.held <= max(settings.lo, -(-used * headroom // 1) + 1e-9)
    assert sim.held >= used - 1e-9


def test_a_rank_keeps_two_steps_in_flight_or_its_share_of_the_queue():
    assert ahead_calls(16, 16) == 3 and ahead_calls(16, 4) == 9 and ahead_calls(4, 16) == 3
    assert window_calls(16, 16, workers=8, ranks=64, per_worker=2, cap=100) == 3
    assert window_calls(16, 16, workers=8, ranks=1, per_worker=2, cap=100) == 16
    assert window_calls(16, 16, workers=8, ranks=1, per_worker=2, cap=5) == 5
    assert window_calls(16, 16, workers=0, ranks=1, per_worker=2, cap=1) == 1


def _first_growth(sim: Sim, busy: float, queued: int) -> int:
    before = sim.sizer.target
    for _ in range(20):
        sim.step(0.5, busy, queued=queued)
        if sim.sizer.target != before:
            return sim.sizer.target - before
    return 0


def test_growth_follows_the_items_waiting_for_a_worker():
    sim = Sim(SizerSettings(lo=1, hi=64), free=1)
    sim.step(0.0, 0.0)
    sim.free = 20
    assert _first_growth(sim, 1.0, queued=6) == 3  # 6 items waiting: 3 workers keep them busy
    assert _first_growth(sim, 4.0, queued=100) == 17  # more waiting than room: all the room
    assert _first_growth(sim, 21.0, queued=100) == 1  # no room: one pending worker
    assert sim.pending == 1


def test_a_pool_started_before_its_ranks_keeps_its_size_until_they_came():
    sim = Sim(SizerSettings(lo=1, hi=64, hold_s=10.0), free=8)
    sim.ranks = 0
    sim.step(0.0, 0.0)
    sim.step(0.0, 0.0, seconds=60.0)  # the job's driver started it; Ray Train starts ranks
    assert sim.sizer.target == 8
    sim.ranks = 4
    sim.step(0.0, 2.0, seconds=9.0)  # trainer-bound from the start: the hold counts from here
    assert sim.sizer.target == 8
    sim.step(0.0, 2.0, seconds=2.0)
    assert sim.sizer.target == 3  # ceil(2 * 1.2)


def _burst(rate: TakeRate, step: int, t: float, items: int = 4) -> None:
    for i in range(items):  # a step's items, taken together at the barrier
        rate.took((0, step), t + 0.01 * i)


def test_take_rate_counts_whole_steps_behind_a_barrier():
    # the scale-out bench's 64-rank trainer-bound phase: step 0 trickles in while the pool
    # starts, then 4 items per step at the steps' starts; the shrink is decided at 51.5 s
    rate = TakeRate(30.0)
    for k in range(4):
        rate.took((0, 0), 2.0 + k)
    assert rate.rate(10.0) is None  # the first step says nothing
    for step, t in ((1, 20.8), (2, 35.1), (3, 47.4)):
        _burst(rate, step, t)
    # two whole steps between the starts of steps 1 and 3: 8 items in 26.6 s. A window's
    # first to last take (35.1 .. 47.43) would say 4 items in 12.3 s: +8 %
    assert rate.rate(51.5) == pytest.approx(8 / 26.6)
    # periods alternating 12.2 / 14.3 s: always within 10 % of the mean 4 / 13.25 s
    t = 47.4
    for step in range(4, 20):
        t += 12.2 if step % 2 else 14.3
        _burst(rate, step, t)
        for now in (t + 0.5, t + 6.0, t + 12.0):
            assert rate.rate(now) == pytest.approx(4 / 13.25, rel=0.1), (step, now)


def test_take_rate_says_which_take_started_a_step():
    """The rank reports at once when a step starts (the rate changed), not a step later."""
    rate = TakeRate(30.0)
    assert [rate.took((0, 0), t) for t in (1.0, 1.1)] == [False, False]  # the first step
    assert [rate.took((0, 1), t) for t in (14.0, 14.1)] == [True, False]
    assert rate.rate(14.2) is None  # one start after the first step
    assert rate.took((0, 2), 27.0) is True
    assert rate.rate(27.1) == pytest.approx(2 / 13.0)  # known at step 2's first take
    assert rate.took((0, 1), 27.2) is False  # an earlier step's item (a resubmitted one)


def test_item_cost_follows_the_recent_items_not_the_start():
    """Items that cost 1.0 s at the start, then 0.8 s: the cost over the last window reads
    0.8 once the window holds enough items; before that, the mean since the start."""
    cost = ItemCost(30.0, min_items=8)
    assert cost.update(0.0, 0.0, 0) is None
    busy = done = 0
    t = 0.0
    for _ in range(40):  # 4 items a second at 1.0 s each for 10 s
        t += 0.25
        busy, done = busy + 1.0, done + 1
        c = cost.update(t, busy, done)
    assert c == pytest.approx(1.0)
    for _ in range(160):  # then 40 s at 0.8 s each
        t += 0.25
        busy, done = busy + 0.8, done + 1
        c = cost.update(t, busy, done)
    assert c == pytest.approx(0.8)
    assert busy / done > 0.83  # the mean since the start, still off by 5 %
    # a window with fewer than min_items items: the mean since the start
    t += 31.0
    c = cost.update(t, busy + 0.8, done + 1)
    assert c == pytest.approx((busy + 0.8) / (done + 1))


def test_take_rate_with_fast_steps_and_after_taking_stops():
    rate = TakeRate(10.0)
    for step in range(200):  # 0.5 s steps of 2 items: 4 items/s
        _burst(rate, step, 0.5 * step, items=2)
    assert rate.rate(100.0) == pytest.approx(4.0, rel=0.01)
    # the rank stops taking (an evaluation, the end): the rate decays instead of standing still
    later = [rate.rate(now) for now in (101.0, 110.0, 200.0)]
    assert later[0] < 4.0 and later[2] < later[1] < later[0] and later[2] < 0.5


def test_consumption_demand_from_the_ranks_rates():
    assert consumption_demand([0.3, 0.2], 0.8) == pytest.approx(0.4)
    # unknown ranks count as the mean of the known ones (data-parallel ranks step together)
    assert consumption_demand([0.3, None, 0.3, 0.2], 1.0) == pytest.approx(0.8 / 3 * 4)
    assert consumption_demand([0.3, None, None], 1.0) is None  # fewer than half known
    assert consumption_demand([0.3, 0.3], None) is None  # cost unknown
    assert consumption_demand([], 1.0) is None


def test_shrink_follows_consumption_not_the_look_ahead_a_start_fills():
    """At their start the ranks' windows fill: every worker is busy for a while although the
    steady demand is far lower. With the consumption known the pool shrinks to it at once."""
    settings = SizerSettings(lo=1, hi=64, hold_s=10.0, headroom=1.2)
    sim = Sim(settings, free=8)
    sim.step(0.0, 0.0)
    sim.step(0.0, 8.0, seconds=11.0)  # the look-ahead: all 8 busy, nobody waits
    assert sim.sizer.target == 8  # busy alone says: keep
    sizer = Sizer(settings)
    sizer.update(Signals(0.0, 8, 0, 0.0, 0.0, 4, 0, 0))
    t = 0.0
    for _ in range(24):
        t += 0.5
        sizer.update(Signals(t, 8, 0, 8 * t, 0.0, 4, 0, 0, demand=3.9))
    # 3.9 busy: 4 whole workers (1.03x, 2.6 % spare) rather than ceil(3.9 x 1.2) = 5 (1.28x)
    assert sizer.target == 4 and "consumption keeps 3.90 busy" in sizer.reason


@pytest.mark.parametrize("need,kept", [
    (3.9, 4),    # ceil(4.68) = 5 holds 1.28x; 4 still leaves 2.6 % spare
    (3.85, 4),
    (3.95, 5),   # 4 would leave 1.3 % spare: round up (1.27x)
    (4.0, 5),    # 4 would leave none
    (5.0, 6),    # ceil(6.0) = 6 is within 1.25x already
    (10.0, 12),
    (0.5, 1),
    (2.5, 3),    # ceil(3.0) = 3 = 1.2x
    (3.0, 4),    # no whole worker between 3.06 and 3.75: round up (1.33x)
    (0.0, 0),
])
def test_whole_workers_kept_stay_within_the_cap_where_a_spare_margin_allows(need, kept):
    assert keep_workers(need, 1.2, 1.25, 1.02) == kept
    # a headroom above the cap is the operator's choice and is kept
    assert keep_workers(need, 1.5, 1.25, 1.02) == math.ceil(need * 1.5 - 1e-9)
    # the rule never keeps fewer than the busy workers plus the spare margin
    assert kept >= need * 1.02 - 1e-9 or kept == 0


def _leased(out: dict) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {}
    for wid, client in sorted(out.items()):
        if client is not None:
            by.setdefault(client, []).append(wid)
    return by


def test_leases_whole_workers_once_every_pipeline_can_have_one():
    """``workers // ranks`` each once every pipeline joined, least loaded free workers first,
    clients in a fixed order; none while a pipeline is missing, none with fewer workers than
    ranks, none for a client that does not take leases (it still counts as a rank)."""
    w = [("w0", None, 2), ("w1", None, 0), ("w2", None, 1), ("w3", None, 0), ("w4", None, 2)]
    assert _leased(lease_workers(w, ["a"], ranks=1, pipelines=2)) == {}
    assert _leased(lease_workers(w, ["b", "a"], ranks=2, pipelines=2)) == \
        {"a": ["w1", "w3"], "b": ["w0", "w2"]}  # a: the two idle, b: the next (w2, then w0)
    assert _leased(lease_workers(w, ["a", "b"], ranks=3, pipelines=2)) == \
        {"a": ["w1"], "b": ["w3"]}  # a third client without leases: shares of 1
    assert _leased(lease_workers(w, ["a", "b"], ranks=6, pipelines=2)) == {}
    assert _leased(lease_workers(w[:1], ["a"], ranks=1, pipelines=1)) == {"a": ["w0"]}
    assert lease_workers([], ["a"], ranks=1, pipelines=1) == {}


def test_leases_are_stable_and_follow_the_share():
    """A client keeps the workers it holds while its share allows, gives back the surplus
    when the share falls, and a client gone (or no longer taking leases) loses its own."""
    held = [("w0", "a", 0), ("w1", "a", 0), ("w2", "b", 0), ("w3", "b", 0), ("w4", None, 0)]
    assert _leased(lease_workers(held, ["a", "b"], ranks=2, pipelines=1)) == \
        {"a": ["w0", "w1"], "b": ["w2", "w3"]}
    three = lease_workers(held, ["a", "b", "c"], ranks=3, pipelines=1)
    assert _leased(three) == {"a": ["w0"], "b": ["w2"], "c": ["w1"]}  # c: a's surplus, idle
    assert _leased(lease_workers(held, ["b"], ranks=1, pipelines=1)) == \
        {"b": ["w0", "w1", "w2", "w3", "w4"]}
    for n in range(1, 9):  # every share is whole workers, never more workers than there are
        for ranks in range(1, 5):
            out = lease_workers([(f"w{i}", None, 0) for i in range(n)],
                                [f"c{r}" for r in range(ranks)], ranks, 1)
            counts = [len(v) for v in _leased(out).values()]
            assert counts == ([n // ranks] * ranks if n >= ranks else []), (n, ranks, counts)
