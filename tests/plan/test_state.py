"""ReadState: serialisation, validation, range algebra and exactly-once re-planning (no Ray)."""

from __future__ import annotations

import collections
import itertools
import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_ingest.errors import StateError
from ray_ingest.plan import PlanParams, ShardSlice, Topology, iter_samples, plan_epoch, plan_slot
from ray_ingest.plan.state import (
    STATE_KIND,
    STATE_VERSION,
    Generation,
    ReadState,
    add_positions,
    add_range,
    covered,
    generation_streams,
    initial_state,
    merge_slot_states,
    next_epoch,
    slot_stream,
    subtract,
    with_progress,
    with_topology,
)

COUNTS = [7, 3, 0, 11, 5, 9, 2, 6, 4, 8, 1]
CHUNK = 8
FP = "0123456789abcdef"

PARAMS = {
    "epoch-equal": PlanParams(seed=3, seed_mode="epoch", repeat=False, equal_work=True),
    "epoch-repeat": PlanParams(seed=3, seed_mode="epoch", repeat=True, equal_work=True),
    "pid-unequal": PlanParams(seed_mode="pid", repeat=True, equal_work=False),
    "noshuffle": PlanParams(seed=1, shuffle=False, repeat=False, equal_work=False),
}


def topo(world: int, workers: int = 1, group: int = 1, rank: int = 0) -> Topology:
    return Topology(world_size=world, rank=rank, read_workers=workers, group_size=group)


def state_for(params: PlanParams = PARAMS["epoch-equal"], t: Topology | None = None,
              epoch: int = 0) -> ReadState:
    return initial_state(FP, params, epoch, t or topo(2, 2), {"num_shards": len(COUNTS)})


def positions(ranges) -> set[int]:
    return {p for a, b in ranges for p in range(a, b)}


def canonical(ranges) -> bool:
    """Sorted, non-empty, disjoint and not touching (touching ranges are merged)."""
    return all(a < b for a, b in ranges) and all(
        b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(ranges))


# --- serialisation -----------------------------------------------------------------------


def rich_state() -> ReadState:
    s = initial_state(FP, PARAMS["epoch-repeat"], 3, topo(4, 2, 2), {"num_shards": 11}, 16)
    s = with_progress(s, 0, ((0, 16), (20, 24)), 3, [(4, 2, "decode: bad jpeg")])
    s = with_progress(s, 1, ((0, 8),), 1)
    s = with_topology(s, topo(3, 1, 1), 8)
    s = with_progress(s, 2, ((0, 5),), 1, [(9, 0, "read: OSError")])
    return s


def test_round_trip_through_json():
    s = rich_state()
    doc = json.loads(json.dumps(s.to_dict()))
    assert doc["kind"] == STATE_KIND and doc["version"] == STATE_VERSION
    back = ReadState.from_dict(doc)
    assert back == s
    assert back.to_dict() == s.to_dict()
    assert len(back.generations) == 2 and back.current.slots == 3


def test_round_trip_initial_state():
    s = state_for()
    assert ReadState.from_dict(s.to_dict()) == s
    assert s.current == Generation.fresh(topo(2, 2))


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(kind="other"), "'kind'"),
        (lambda d: d.update(version=99), "'version'"),
        (lambda d: d.pop("epoch"), "'epoch'"),
        (lambda d: d.pop("fingerprint"), "'fingerprint'"),
        (lambda d: d.update(seed="x"), "'seed'"),
        (lambda d: d.update(epoch=-1), "'epoch'"),
        (lambda d: d.update(seed_mode="weekly"), "'seed_mode'"),
        (lambda d: d.update(plan=[]), "'plan'"),
        (lambda d: d["plan"].pop("shuffle"), "'plan.shuffle'"),
        (lambda d: d["plan"].update(colour="red"), "'plan.colour'"),
        (lambda d: d["plan"].update(start_index=-8), "'plan.start_index'"),
        (lambda d: d.update(generations=[]), "'generations'"),
        (lambda d: d["generations"][0].pop("world_size"), "'generations[0].world_size'"),
        (lambda d: d["generations"][0].update(group_size=3), "'generations[0].group_size'"),
        (lambda d: d["generations"][1].update(num_workers=0), "'generations[1].num_workers'"),
        (lambda d: d["generations"][0]["consumed"].pop(), "'generations[0].consumed'"),
        (lambda d: d["generations"][0].update(batches=[1]), "'generations[0].batches'"),
        (lambda d: d["generations"][0].update(batches=[1, -2]), "'generations[0].batches[1]'"),
        (lambda d: d["generations"][1].update(batch_size=-8), "'generations[1].batch_size'"),
        (lambda d: d["generations"][0]["consumed"][0].append([10, 30]),
         "'generations[0].consumed[0]'"),
        (lambda d: d["generations"][0]["consumed"][1].__setitem__(0, [5, 5]),
         "'generations[0].consumed[1]'"),
        (lambda d: d["generations"][0]["consumed"][1].__setitem__(0, [-1, 5]),
         "'generations[0].consumed[1]'"),
        (lambda d: d["generations"][0]["consumed"][1].__setitem__(0, "ab"),
         "'generations[0].consumed[1]'"),
        (lambda d: d.update(skips=[[1, 2]]), "'skips[0]'"),
        (lambda d: d.update(dataset="x"), "'dataset'"),
    ],
)
def test_from_dict_errors_name_the_field(mutate, field):
    doc = json.loads(json.dumps(rich_state().to_dict()))
    mutate(doc)
    with pytest.raises(StateError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ReadState.from_dict(doc)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(StateError, match="expected a mapping"):
        ReadState.from_dict([1, 2])  # type: ignore[arg-type]


# --- range algebra -----------------------------------------------------------------------

range_st = st.tuples(st.integers(0, 60), st.integers(0, 12)).map(lambda t: (t[0], t[0] + t[1]))


@given(st.lists(range_st, max_size=12))
def test_add_range_is_set_union(pairs):
    ranges: tuple = ()
    expect: set[int] = set()
    for lo, hi in pairs:
        ranges = add_range(ranges, lo, hi)
        expect |= set(range(lo, hi))
        assert canonical(ranges), ranges
        assert positions(ranges) == expect
        assert covered(ranges) == len(expect)


@given(st.lists(st.integers(0, 80), max_size=40), st.lists(range_st, max_size=4))
def test_add_positions_is_set_union(points, pairs):
    base: tuple = ()
    for lo, hi in pairs:
        base = add_range(base, lo, hi)
    out = add_positions(base, points)
    assert canonical(out)
    assert positions(out) == positions(base) | set(points)


def test_add_range_ignores_empty_and_merges_touching():
    assert add_range((), 4, 4) == ()
    assert add_range(((0, 3),), 3, 5) == ((0, 5),)
    assert add_range(((0, 3), (7, 9)), 3, 7) == ((0, 9),)
    assert add_range(((5, 6),), 0, 2) == ((0, 2), (5, 6))


slice_st = st.builds(ShardSlice, st.integers(0, 5), st.integers(0, 9), st.integers(0, 7),
                     st.booleans())


@given(st.lists(slice_st, max_size=10), st.lists(range_st, max_size=6))
def test_subtract_keeps_exactly_the_unconsumed_positions(stream, pairs):
    consumed: tuple = ()
    for lo, hi in pairs:
        consumed = add_range(consumed, lo, hi)
    flat = list(iter_samples(stream))  # stream position -> (shard, index, pad)
    out = subtract(stream, consumed)
    got = [(seq + k, (sl.shard, sl.start + k, sl.pad)) for seq, sl in out for k in range(sl.count)]
    want = [(p, s) for p, s in enumerate(flat) if p not in positions(consumed)]
    assert got == want
    assert all(sl.count > 0 for _, sl in out)


def test_subtract_examples():
    stream = (ShardSlice(2, 0, 5), ShardSlice(0, 3, 4, True))
    assert subtract(stream, ()) == [(0, ShardSlice(2, 0, 5)), (5, ShardSlice(0, 3, 4, True))]
    assert subtract(stream, ((0, 9),)) == []
    assert subtract(stream, ((1, 3), (4, 6))) == [
        (0, ShardSlice(2, 0, 1)), (3, ShardSlice(2, 3, 1)), (6, ShardSlice(0, 4, 3, True))]


# --- generations: re-planning across topologies stays exactly-once --------------------------


def consume_prefix(stream, frac: float) -> tuple:
    n = sum(sl.count for sl in stream)
    k = round(n * frac)
    return ((0, k),) if k else ()


def tally(state: ReadState, counts, final_all: bool) -> collections.Counter:
    """Non-pad samples consumed in every generation (the last one fully when ``final_all``)."""
    seen: collections.Counter = collections.Counter()
    last = len(state.generations) - 1
    for gi, gen in enumerate(state.generations):
        streams = generation_streams(state, counts, CHUNK, upto=gi)
        assert len(streams) == gen.slots
        for s, stream in enumerate(streams):
            done = positions(gen.consumed[s])
            for pos, (shard, idx, pad) in enumerate(iter_samples(stream)):
                if not pad and (pos in done or (gi == last and final_all)):
                    seen[(shard, idx)] += 1
    return seen


def every_sample(counts) -> collections.Counter:
    return collections.Counter((sid, i) for sid, c in enumerate(counts) for i in range(c))


@pytest.mark.parametrize("pname", sorted(PARAMS))
@pytest.mark.parametrize(("slots", "workers"), [(1, 1), (2, 2), (3, 1), (4, 2)])
@pytest.mark.parametrize("frac", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize(("new_slots", "new_workers", "new_group"),
                         [(1, 1, 1), (2, 1, 2), (3, 2, 1), (5, 1, 1)])
def test_replan_grid_is_exactly_once(pname, slots, workers, frac, new_slots, new_workers,
                                     new_group):
    params = PARAMS[pname]
    s = state_for(params, topo(slots, workers))
    for slot, stream in enumerate(plan_epoch(COUNTS, CHUNK, slots, workers, params, 0)):
        s = with_progress(s, slot, consume_prefix(stream, frac), 0)
    s2 = with_topology(s, topo(new_slots * new_group, new_workers, new_group))
    assert len(s2.generations) == (1 if (slots, workers) == (new_slots, new_workers)
                                   and new_group == 1 else 2)
    assert tally(s2, COUNTS, final_all=True) == every_sample(COUNTS)
    streams = generation_streams(s2, COUNTS, CHUNK)
    if len(s2.generations) == 2:
        # the re-plan gives every new slot the same amount of work
        assert len({sum(sl.count for sl in x) for x in streams}) == 1
        remaining = sum(c for c in COUNTS) - sum(
            1 for _ in tally(s2, COUNTS, final_all=False).elements())
        assert sum(sl.count for x in streams for sl in x if not sl.pad) == remaining


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=9),
    chain=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3),
                             st.lists(st.floats(0, 1), min_size=4, max_size=4)),
                   min_size=1, max_size=4),
    seed=st.integers(0, 5),
    data=st.data(),
)
def test_replan_chains_with_scattered_consumption(counts, chain, seed, data):
    """Several topology changes in one epoch, each consuming arbitrary (unordered) positions."""
    params = PlanParams(seed=seed, repeat=bool(seed % 2), equal_work=bool(seed % 3))
    s = initial_state(FP, params, 1, topo(2), {})
    for slots, workers, fracs in chain:
        s = with_topology(s, topo(slots, workers))
        streams = generation_streams(s, counts, CHUNK)
        for slot, stream in enumerate(streams):
            n = sum(sl.count for sl in stream)
            k = round(n * fracs[slot % len(fracs)])
            picked = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=k)) if n else []
            s = with_progress(s, slot, add_positions((), picked), 1)
    assert tally(s, counts, final_all=True) == every_sample(counts)


def test_slot_stream_matches_the_plan():
    params = PARAMS["epoch-repeat"]
    s = state_for(params, topo(6, 2, 2), epoch=2)
    for slot in range(3):
        assert (slot_stream(s, COUNTS, CHUNK, slot)
                == plan_slot(COUNTS, CHUNK, slot, 3, 2, params, 2))
    assert generation_streams(s, COUNTS, CHUNK) == plan_epoch(COUNTS, CHUNK, 3, 2, params, 2)
    s = with_progress(s, 1, ((0, 10),), 2)
    s2 = with_topology(s, topo(2, 1))
    replanned = generation_streams(s2, COUNTS, CHUNK)
    assert [slot_stream(s2, COUNTS, CHUNK, i) for i in range(2)] == replanned
    assert generation_streams(s2, COUNTS, CHUNK, upto=0) == plan_epoch(COUNTS, CHUNK, 3, 2,
                                                                        params, 2)


def test_a_batch_size_change_starts_a_generation():
    """Batch counts are in the generation's batch size: another size re-plans the rest."""
    s = initial_state(FP, PARAMS["epoch-equal"], 0, topo(2, 2), {}, batch_size=8)
    s = with_progress(s, 0, ((0, 16),), 2)
    assert with_topology(s, topo(2, 2), 8) is s
    assert with_topology(s, topo(2, 2)) is s  # size not given: unknown, keep
    moved = with_topology(s, topo(2, 2), 16)
    assert len(moved.generations) == 2 and moved.current.batch_size == 16
    assert tally(moved, COUNTS, final_all=True) == every_sample(COUNTS)
    assert next_epoch(moved, topo(2, 2)).current.batch_size == 16
    assert next_epoch(moved, topo(2, 2), 4).current.batch_size == 4
    # a state saved before batch sizes were recorded: unknown, never a reason to re-plan
    doc = s.to_dict()
    for g in doc["generations"]:
        del g["batch_size"]
    legacy = ReadState.from_dict(doc)
    assert legacy.current.batch_size == 0
    assert with_topology(legacy, topo(2, 2), 16) is legacy


def test_with_topology_same_topology_keeps_the_generation():
    s = state_for(t=topo(4, 2, 2))
    assert with_topology(s, topo(4, 2, 2, rank=3)) is s  # the rank does not matter
    assert len(with_topology(s, topo(4, 2, 1)).generations) == 2  # group size does
    assert len(with_topology(s, topo(4, 1, 2)).generations) == 2  # so do read workers


def test_next_epoch_starts_fresh_and_forgets_the_start_index():
    params = PlanParams(seed_mode="pid", start_index=3 * CHUNK * 2, repeat=True)
    s = initial_state(FP, params, 4, topo(2, 2), {})
    s = with_progress(s, 0, ((0, 5),), 1, [(1, 1, "x")])
    s = with_topology(s, topo(1, 2))
    n = next_epoch(s, topo(1, 2))
    assert n.epoch == 5 and n.skips == ()
    assert n.generations == (Generation.fresh(topo(1, 2)),)
    # WDS_START_INDEX is a starting point: the following epoch reads everything
    assert n.plan["start_index"] == 0
    assert sorted(x for st_ in plan_epoch(COUNTS, CHUNK, 1, 2, n.params(), 5)
                  for x in iter_samples(st_) if not x[2]) == sorted(
        (sid, i, False) for sid, c in enumerate(COUNTS) for i in range(c))


# --- merging per-rank files --------------------------------------------------------------


def rank_states(group: int = 2) -> tuple[ReadState, list[ReadState]]:
    """Every rank of a 3-slot run holds the restored state plus its own slot's progress."""
    base = state_for(t=topo(3 * group, 2, group))
    base = with_progress(base, 2, ((0, 4),), 1)  # progress restored from an older checkpoint
    per_slot = {0: ((0, 12),), 1: ((0, 8), (10, 12)), 2: ((0, 12),)}
    out = []
    for rank in range(3 * group):
        slot = rank // group
        out.append(with_progress(base, slot, per_slot[slot], 3, [(slot, 0, "r")]))
    want = base
    for slot, ranges in per_slot.items():
        want = with_progress(want, slot, ranges, 3, [(slot, 0, "r")])
    return want, out


@pytest.mark.parametrize("group", [1, 2])
def test_merge_slot_states_is_the_union_in_any_order(group):
    want, states = rank_states(group)
    assert merge_slot_states(states) == want
    assert merge_slot_states(states[::-1]) == want
    assert merge_slot_states(states[:group]).current.consumed[0] == ((0, 12),)


def test_merge_of_one_state_is_that_state():
    s = rich_state()
    assert merge_slot_states([s]) == s


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: attrs.evolve(s, epoch=s.epoch + 1), "'epoch'"),
        (lambda s: attrs.evolve(s, fingerprint="f" * 16), "'fingerprint'"),
        (lambda s: attrs.evolve(s, seed=99), "'seed'"),
        (lambda s: with_topology(s, topo(2, 2)), "'generations'"),
    ],
)
def test_merge_rejects_disagreeing_ranks(change, field):
    _, states = rank_states()
    states[3] = change(states[3])
    with pytest.raises(StateError, match=field):
        merge_slot_states(states)


def test_merge_of_nothing_is_an_error():
    with pytest.raises(StateError, match="no per-rank states"):
        merge_slot_states([])


# --- compatibility on restore -------------------------------------------------------------


def test_check_compatible_names_what_changed():
    s = state_for()
    s.check_compatible(FP, PARAMS["epoch-equal"])
    with pytest.raises(StateError, match=r"'fingerprint'.*num_shards: saved 11, now 12"):
        s.check_compatible("f" * 16, PARAMS["epoch-equal"],
                           lambda saved: f"num_shards: saved {saved['num_shards']}, now 12")
    with pytest.raises(StateError, match="'seed': saved 3, this run uses 4"):
        s.check_compatible(FP, PlanParams(seed=4, repeat=False))
    with pytest.raises(StateError, match="'repeat'"):
        s.check_compatible(FP, PlanParams(seed=3, repeat=True))
    with pytest.raises(StateError, match="'seed_mode'"):
        s.check_compatible(FP, PlanParams(seed=3, seed_mode="pid", repeat=False))


def test_check_compatible_lets_the_saved_start_index_win():
    """A restored position supersedes a PiD WDS_START_INDEX starting point (either way)."""
    started = initial_state(FP, PlanParams(seed_mode="pid", start_index=64, repeat=True), 0,
                            topo(2), {})
    started.check_compatible(FP, PlanParams(seed_mode="pid", start_index=0, repeat=True))
    state_for().check_compatible(FP, PlanParams(seed=3, repeat=False, start_index=64))


def test_state_is_small():
    """O(slots), not O(samples): 64 slots, a topology change and a few skips fit in a few KB."""
    params = PARAMS["epoch-repeat"]
    counts = [1000] * 4096
    s = initial_state(FP, params, 7, topo(64, 4), {"num_shards": len(counts)})
    for slot in range(64):
        s = with_progress(s, slot, ((0, 31_000 + slot),), 1937)
    s = with_topology(s, topo(48, 4))
    for slot in range(48):
        s = with_progress(s, slot, ((0, 5_000),), 312, [(slot, 17, "decode: bad jpeg")])
    size = len(json.dumps(s.to_dict(), separators=(",", ":")))
    assert size < 8_000, size
    assert ReadState.from_dict(json.loads(json.dumps(s.to_dict()))) == s
