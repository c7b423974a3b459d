"""Slot streams, equal-work padding and balance(): invariants over grids and Hypothesis."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_ingest.errors import ConfigError
from ray_ingest.plan import (
    PlanParams,
    ShardSlice,
    assign_slot,
    balance,
    interleave,
    iter_samples,
    plan_epoch,
    plan_slot,
    slot_totals,
    total,
)

COUNTS = [3, 5, 2, 7, 1, 4, 6, 0, 9, 2, 5]


def samples(slices):
    return list(iter_samples(slices))


def real_samples(slices):
    return [(shard, i) for shard, i, pad in iter_samples(slices) if not pad]


def test_shard_slice_basics():
    s = ShardSlice(3, 2, 4)
    assert (s.end, s.pad) == (6, False)
    assert samples([s, ShardSlice(1, 0, 1, True)]) == [
        (3, 2, False), (3, 3, False), (3, 4, False), (3, 5, False), (1, 0, True)]
    assert total([s, ShardSlice(0, 0, 10)]) == 14
    with pytest.raises(ConfigError, match="ShardSlice.count"):
        ShardSlice(0, 0, -1)
    with pytest.raises(ConfigError, match="ShardSlice.shard"):
        ShardSlice(-1, 0, 1)


def test_interleave_round_robin_skips_exhausted():
    workers = assign_slot(10, 1, 0, 2, 2, PlanParams(seed_mode="pid", shuffle=False,
                                                     repeat=False))
    # E3 rank 0: w0 [0,4,8], w1 [2,6] -> 0,2,4,6,8
    stream = interleave(workers, list(range(1, 11)))
    assert [s.shard for s in stream] == [0, 2, 4, 6, 8]
    assert [s.count for s in stream] == [1, 3, 5, 7, 9]
    assert all(s.start == 0 and not s.pad for s in stream)


def test_plan_slot_pid_stream_without_equal_work():
    params = PlanParams(seed_mode="pid", equal_work=False, repeat=True)
    # E2 rank 0: w0 [0,8,4], w1 [6,0*,2]  (* cyclic extra)
    got = plan_slot([10] * 10, 10, 0, 2, 2, params)
    assert [(s.shard, s.pad) for s in got] == [
        (0, False), (6, False), (8, False), (0, True), (4, False), (2, False)]


PARAMS = [
    PlanParams(repeat=True),
    PlanParams(seed=4, repeat=False),
    PlanParams(seed_mode="pid", repeat=True),
    PlanParams(seed_mode="pid", repeat=False, shuffle=False),
]


@pytest.mark.parametrize("params", PARAMS, ids=["epoch", "epoch-norepeat", "pid", "pid-plain"])
@pytest.mark.parametrize(("slots", "workers"), [(1, 1), (2, 2), (3, 2), (4, 3), (7, 1), (13, 2)])
@pytest.mark.parametrize("epoch", [0, 3])
def test_equal_work_and_exact_coverage(params, slots, workers, epoch):
    plans = plan_epoch(COUNTS, 4, slots, workers, params, epoch)
    totals = [total(p) for p in plans]
    raw = slot_totals(COUNTS, 4, slots, workers, params, epoch)
    assert totals == [int(raw.max())] * slots
    # Every sample of the catalog is read exactly once as a non-pad sample.
    real = [x for p in plans for x in real_samples(p)]
    assert sorted(real) == sorted((s, i) for s, c in enumerate(COUNTS) for i in range(c))
    for slot, plan in enumerate(plans):
        assert plan == plan_slot(COUNTS, 4, slot, slots, workers, params, epoch)
        # Padding comes after the stream, wraps over the slot's own real samples when it has
        # any, and is sample-granular.
        own = real_samples(plan)
        pads = samples(plan)[int(raw[slot]):]
        assert all(pad for _, _, pad in pads)
        if own and pads:
            cycle = [x for _, x in zip(range(len(pads)), itertools.cycle(own), strict=False)]
            assert [(s, i) for s, i, _ in pads] == cycle


def test_equal_work_off_gives_raw_totals():
    params = PlanParams(seed=2, equal_work=False, repeat=True)
    plans = plan_epoch(COUNTS, 4, 3, 2, params, 1)
    assert [total(p) for p in plans] == slot_totals(COUNTS, 4, 3, 2, params, 1).tolist()


def test_empty_slot_pads_from_epoch_order():
    # 2 shards, 4 slots, no repeat: slots 2 and 3 have no shards of their own.
    params = PlanParams(seed_mode="pid", repeat=False)
    plans = plan_epoch([3, 2], 1, 4, 1, params)
    assert [total(p) for p in plans] == [3, 3, 3, 3]
    assert plans[3] == (ShardSlice(0, 0, 3, True),)
    assert plans[1] == (ShardSlice(1, 0, 2), ShardSlice(1, 0, 1, True))


def test_slot_only_of_repeats_pads_from_its_stream():
    # 1 shard, 3 slots with repeat: slots 1 and 2 hold only cyclic extras of shard 0.
    plans = plan_epoch([4], 1, 3, 1, PlanParams(seed_mode="pid", repeat=True))
    assert plans == [(ShardSlice(0, 0, 4),), (ShardSlice(0, 0, 4, True),),
                     (ShardSlice(0, 0, 4, True),)]


def test_start_index_skip_keeps_equal_work_exact():
    params = PlanParams(seed=1, start_index=13, repeat=True)
    counts = [5, 1, 8, 3, 3, 9, 2, 4, 7, 6, 1, 2, 8, 5]
    plans = plan_epoch(counts, 4, 3, 2, params, 2)
    raw = slot_totals(counts, 4, 3, 2, params, 2)
    assert [total(p) for p in plans] == [int(raw.max())] * 3
    for slot in range(3):
        ws = assign_slot(len(counts), 4, slot, 3, 2, params, 2)
        assert int(raw[slot]) == sum(counts[s] for w in ws for s in w.shards)


def test_counts_validation():
    with pytest.raises(ConfigError, match=r"counts\[1\]"):
        plan_slot([1, -2], 1, 0, 1, 1)
    with pytest.raises(ConfigError, match="counts"):
        plan_slot([[1, 2]], 1, 0, 1, 1)
    with pytest.raises(ConfigError, match="slot"):
        plan_slot([1, 2], 1, 2, 2, 1)


# --- balance ------------------------------------------------------------------------------------


def test_balance_small_example():
    inp = [ShardSlice(0, 0, 3), ShardSlice(1, 2, 2, True), ShardSlice(2, 0, 0)]
    parts = balance(inp, 4)
    assert parts == [
        (ShardSlice(0, 0, 2),),
        (ShardSlice(0, 2, 1), ShardSlice(1, 2, 1, True)),
        (ShardSlice(1, 3, 1, True), ShardSlice(0, 0, 1, True)),
        (ShardSlice(0, 1, 2, True),),
    ]


def test_balance_empty_and_validation():
    assert balance([], 3) == [(), (), ()]
    assert balance([ShardSlice(1, 0, 0)], 2) == [(), ()]
    with pytest.raises(ConfigError, match="slots"):
        balance([ShardSlice(0, 0, 1)], 0)


slice_lists = st.lists(
    st.builds(ShardSlice, st.integers(0, 20), st.integers(0, 50), st.integers(0, 12),
              st.booleans()),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(inp=slice_lists, slots=st.integers(1, 9))
def test_balance_properties(inp, slots):
    parts = balance(inp, slots)
    assert len(parts) == slots
    size = total(inp)
    counts = {total(p) for p in parts}
    assert counts == ({-(-size // slots)} if size else {0})
    assert all(s.count > 0 for p in parts for s in p)
    flat = [x for p in parts for x in samples(p)]
    # The first `size` samples are the input, in order, with its own pad flags ...
    assert flat[:size] == samples(inp)
    # ... the rest wrap over the beginning of the whole input, flagged pad.
    tail = flat[size:]
    assert all(pad for _, _, pad in tail)
    wrap = [(s, i) for s, i, _ in samples(inp)]
    assert [(s, i) for s, i, _ in tail] == list(itertools.islice(itertools.cycle(wrap), len(tail)))
    assert len(tail) < max(slots, 1)


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=30),
    slots=st.integers(1, 6),
    workers=st.integers(1, 4),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 5),
    mode=st.sampled_from(["epoch", "pid"]),
    repeat=st.booleans(),
)
def test_plan_epoch_properties(counts, slots, workers, seed, epoch, mode, repeat):
    params = PlanParams(seed=seed, seed_mode=mode, repeat=repeat)
    plans = plan_epoch(counts, 3, slots, workers, params, epoch)
    assert len({total(p) for p in plans}) == 1
    real = collections.Counter(x for p in plans for x in real_samples(p))
    assert sorted(real) == sorted((s, i) for s, c in enumerate(counts) for i in range(c))
    assert set(real.values()) <= {1}
    # Ranks of one group share the slot plan; a new call reproduces it exactly.
    assert plans == plan_epoch(np.asarray(counts), 3, slots, workers, params, epoch)


@pytest.mark.parametrize("mode", ["epoch", "pid"])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("repeat", [False, True])
@pytest.mark.parametrize("start_index", [0, 5, 12, 40])
def test_slot_totals_match_worker_lists(mode, shuffle, repeat, start_index):
    params = PlanParams(seed=8, seed_mode=mode, shuffle=shuffle, repeat=repeat,
                        start_index=start_index)
    for slots, workers in ((1, 1), (2, 2), (3, 1), (4, 3)):
        got = slot_totals(COUNTS, 2, slots, workers, params, 1).tolist()
        want = [sum(COUNTS[s] for w in assign_slot(len(COUNTS), 2, slot, slots, workers, params, 1)
                    for s in w.shards) for slot in range(slots)]
        assert got == want
