"""Shard assignment: PiD golden cases (pid_semantics §12), the §6 grid, epoch-mode pins,
invariants."""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_ingest.errors import ConfigError
from ray_ingest.plan import (
    PlanParams,
    Topology,
    assign,
    assign_epoch,
    assign_slot,
    assign_worker,
    epoch_key,
    epoch_order,
    extended_length,
    splitmix64,
    worker_seed,
)

PID = PlanParams(seed_mode="pid", repeat=True)


def urls_of(n: int) -> list[str]:
    return [f"u{i}" for i in range(n)]


def pid_lists(n, world, workers, group=1, shuffle=True, repeat=True, start_index=0, chunk=1):
    """{(rank, worker): [url, ...]} through the public API and a Topology per rank."""
    params = PlanParams(seed_mode="pid", shuffle=shuffle, repeat=repeat, start_index=start_index)
    out = {}
    for rank, w in itertools.product(range(world), range(workers)):
        topo = Topology(world, rank, workers, w, group)
        out[rank, w] = [f"u{i}" for i in assign(n, chunk, topo, params).shards]
    return out


def pid_reference(urls, rank, world, w, workers, group, shuffle, repeat, start_index, chunk):
    """pid_semantics §6 pseudo-code, literally (finite mode, resume_flag=True, both splits)."""
    slot, slots = rank // group, world // group
    s = start_index // chunk
    n = len(urls)
    lst = list(urls)
    if repeat:
        t = slots * workers
        lst = [urls[i % n] for i in range(math.ceil(n / t) * t)]
    lst = lst[slot::slots]
    lst = lst[w::workers]
    if shuffle:
        random.Random(slot * workers + w).shuffle(lst)
    return lst[s // workers :]


# --- golden worked examples (pid_semantics §12) ------------------------------------------------


def test_e1_no_shuffle_repeat():
    got = pid_lists(10, 2, 2, shuffle=False)
    assert got == {
        (0, 0): ["u0", "u4", "u8"], (0, 1): ["u2", "u6", "u0"],
        (1, 0): ["u1", "u5", "u9"], (1, 1): ["u3", "u7", "u1"],
    }


def test_e2_shuffle_repeat():
    got = pid_lists(10, 2, 2, shuffle=True)
    assert got == {
        (0, 0): ["u0", "u8", "u4"], (0, 1): ["u6", "u0", "u2"],
        (1, 0): ["u5", "u9", "u1"], (1, 1): ["u7", "u1", "u3"],
    }


def test_e3_no_repeat():
    got = pid_lists(10, 2, 2, shuffle=False, repeat=False)
    assert got == {
        (0, 0): ["u0", "u4", "u8"], (0, 1): ["u2", "u6"],
        (1, 0): ["u1", "u5", "u9"], (1, 1): ["u3", "u7"],
    }


def test_e6_uneven_repeat():
    got = pid_lists(7, 3, 2, shuffle=False)
    assert got == {
        (0, 0): ["u0", "u6"], (0, 1): ["u3", "u2"],
        (1, 0): ["u1", "u0"], (1, 1): ["u4", "u3"],
        (2, 0): ["u2", "u1"], (2, 1): ["u5", "u4"],
    }


def test_e8_parallel_sync_groups():
    got = pid_lists(10, 4, 2, group=2, shuffle=True)
    first = {0: ["u0", "u8", "u4"], 1: ["u6", "u0", "u2"]}
    second = {0: ["u5", "u9", "u1"], 1: ["u7", "u1", "u3"]}
    for rank in (0, 1):
        assert {w: got[rank, w] for w in (0, 1)} == first
    for rank in (2, 3):
        assert {w: got[rank, w] for w in (0, 1)} == second


def test_random_shuffle_reference_values():
    # §12: Random(int).shuffle of [0,1,2] for seeds 0..3 (guards the interpreter we run on).
    out = []
    for seed in range(4):
        lst = [0, 1, 2]
        random.Random(seed).shuffle(lst)
        out.append(lst)
    assert out == [[0, 2, 1], [1, 2, 0], [1, 2, 0], [1, 2, 0]]


def test_cyclic_extras_flagged_pad_e1():
    lists = assign_epoch(10, 1, 2, 2, PlanParams(seed_mode="pid", shuffle=False, repeat=True))
    assert lists[0][1].pad == (False, False, True)
    assert lists[1][1].pad == (False, False, True)
    assert not any(lists[0][0].pad) and not any(lists[1][0].pad)


# --- the §6 grid against a literal reimplementation --------------------------------------------


def _grid():
    for n, world, workers in itertools.product((1, 2, 5, 7, 10, 23), (1, 2, 3, 4, 6), (1, 2, 3)):
        for group in (g for g in (1, 2, 3) if world % g == 0):
            for shuffle, repeat in itertools.product((False, True), repeat=2):
                for start_index, chunk in ((0, 1), (7, 3), (40, 4)):
                    yield n, world, workers, group, shuffle, repeat, start_index, chunk


def test_pid_matches_reference_grid():
    checked = 0
    for n, world, workers, group, shuffle, repeat, start, chunk in _grid():
        urls = urls_of(n)
        got = pid_lists(n, world, workers, group, shuffle, repeat, start, chunk)
        for (rank, w), lst in got.items():
            want = pid_reference(urls, rank, world, w, workers, group, shuffle, repeat, start,
                                 chunk)
            assert lst == want, (n, world, workers, group, shuffle, repeat, start, chunk, rank, w)
            checked += 1
    assert checked > 3000


def test_chunk_size_zero_is_config_error():
    with pytest.raises(ConfigError, match="chunk_size"):
        assign_worker(10, 0, 0, 2, 0, 2, PID)
    with pytest.raises(ConfigError, match="chunk_size"):
        assign_epoch(10, 0, 2, 2, PlanParams(seed_mode="pid", start_index=5, repeat=True))


def test_pid_mode_ignores_epoch_and_seed():
    a = assign_epoch(23, 1, 3, 2, PID, epoch=0)
    assert assign_epoch(23, 1, 3, 2, PID, epoch=5) == a
    assert assign_epoch(23, 1, 3, 2, PlanParams(seed=9, seed_mode="pid", repeat=True), epoch=5) == a


# --- epoch mode: the owned permutation, pinned ----------------------------------------------------


def _splitmix64_py(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_splitmix64_reference_value():
    # First output of the reference splitmix64 generator seeded with 0.
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    xs = [1, 2**63, 2**64 - 1, 123456789]
    assert splitmix64(np.array(xs, dtype=np.uint64)).tolist() == [_splitmix64_py(x) for x in xs]


def test_epoch_key_definition():
    digest = hashlib.sha256(b"ray_ingest:7:3").digest()
    assert epoch_key(7, 3) == int.from_bytes(digest[:8], "big")
    digest = hashlib.sha256(b"ray_ingest:7:3:1:2").digest()
    assert worker_seed("epoch", 7, 3, 1, 2, 4) == int.from_bytes(digest[:8], "big")
    assert worker_seed("pid", 7, 3, 1, 2, 4) == 6


def test_epoch_order_matches_pure_python():
    for n, seed, epoch in ((1, 0, 0), (17, 3, 2), (200, 12345, 9)):
        key = epoch_key(seed, epoch)
        want = sorted(range(n), key=lambda i, k=key: (_splitmix64_py(k ^ i), i))
        assert epoch_order(n, seed, epoch).tolist() == want


def test_epoch_order_golden():
    assert epoch_order(10, 0, 0).tolist() == [9, 8, 2, 7, 6, 0, 3, 1, 4, 5]
    assert epoch_order(10, 0, 1).tolist() == [3, 9, 0, 1, 6, 5, 8, 7, 2, 4]
    big = epoch_order(100_000, 42, 7).astype("<i8").tobytes()
    assert hashlib.sha256(big).hexdigest()[:16] == "cbd75bec6ddd9481"


def test_epoch_mode_golden_lists():
    params = PlanParams(repeat=True)
    got = [[w.shards for w in slot] for slot in assign_epoch(10, 1, 2, 2, params)]
    assert got == [[(4, 9, 6), (2, 3, 9)], [(0, 8, 5), (8, 7, 1)]]
    got = [[w.shards for w in slot] for slot in assign_epoch(10, 1, 2, 2, params, 1)]
    assert got == [[(2, 3, 6), (0, 3, 8)], [(9, 5, 4), (7, 1, 9)]]


def test_epoch_mode_deterministic_and_epoch_dependent():
    params = PlanParams(seed=11, repeat=True)
    a0 = assign_epoch(64, 1, 3, 2, params, epoch=0)
    assert assign_epoch(64, 1, 3, 2, params, epoch=0) == a0
    a1 = assign_epoch(64, 1, 3, 2, params, epoch=1)
    assert a1 != a0
    assert assign_epoch(64, 1, 3, 2, PlanParams(seed=12, repeat=True), epoch=0) != a0
    # Same shard multiset per epoch regardless of the reshuffle (without repeat).
    flat = lambda lists: sorted(s for slot in lists for w in slot for s in w.shards)  # noqa: E731
    p = PlanParams(seed=11, repeat=False)
    assert flat(assign_epoch(64, 1, 3, 2, p, 0)) == flat(assign_epoch(64, 1, 3, 2, p, 1))


# --- invariants over grids ------------------------------------------------------------------------


MODES = (PlanParams(seed_mode="pid", repeat=True), PlanParams(seed=3, repeat=True),
         PlanParams(seed_mode="pid", shuffle=False, repeat=True))


@pytest.mark.parametrize("base", MODES, ids=["pid", "epoch", "pid-noshuffle"])
@pytest.mark.parametrize("n", [1, 4, 9, 31])
@pytest.mark.parametrize(("slots", "workers"), [(1, 1), (2, 3), (4, 2), (5, 1), (3, 4)])
def test_without_repeat_each_shard_exactly_once(base, n, slots, workers):
    params = PlanParams(seed=base.seed, seed_mode=base.seed_mode, shuffle=base.shuffle,
                        repeat=False)
    for epoch in (0, 2):
        lists = assign_epoch(n, 1, slots, workers, params, epoch)
        every = [s for slot in lists for w in slot for s in w.shards]
        assert sorted(every) == list(range(n))
        assert not any(p for slot in lists for w in slot for p in w.pad)


@pytest.mark.parametrize("base", MODES, ids=["pid", "epoch", "pid-noshuffle"])
@pytest.mark.parametrize("n", [1, 4, 9, 31])
@pytest.mark.parametrize(("slots", "workers"), [(1, 1), (2, 3), (4, 2), (5, 1), (3, 4)])
def test_with_repeat_extras_only_from_cyclic_wrap(base, n, slots, workers):
    lists = assign_epoch(n, 1, slots, workers, base, epoch=1)
    ext = extended_length(n, slots, workers, True)
    per = ext // (slots * workers)
    real, extra = [], []
    for slot in lists:
        for w in slot:
            assert len(w.shards) == per
            for shard, pad in zip(w.shards, w.pad, strict=True):
                (extra if pad else real).append(shard)
    assert sorted(real) == list(range(n))
    order = list(range(n)) if base.seed_mode == "pid" else epoch_order(n, base.seed, 1).tolist()
    wrap = [order[i % n] for i in range(n, ext)]
    assert sorted(extra) == sorted(wrap)


@pytest.mark.parametrize("params", [PID, PlanParams(seed=5, repeat=True),
                                    PlanParams(start_index=9, repeat=True)])
def test_ranks_of_a_group_get_identical_lists(params):
    world, workers, group = 8, 3, 4
    for w in range(workers):
        lists = [assign(29, 2, Topology(world, r, workers, w, group), params, 4)
                 for r in range(world)]
        assert lists[0] == lists[1] == lists[2] == lists[3]
        assert lists[4] == lists[5] == lists[6] == lists[7]
        assert lists[0].shards != lists[4].shards


def test_start_index_skip_drops_head_of_each_worker():
    full = assign_slot(40, 5, 1, 2, 3, PlanParams(seed=1, repeat=True))
    # start_index 31 // chunk 5 = 6 chunks seen; 6 // 3 workers = 2 shards skipped per worker.
    skipped = assign_slot(40, 5, 1, 2, 3, PlanParams(seed=1, start_index=31, repeat=True))
    for a, b in zip(full, skipped, strict=True):
        assert b.shards == a.shards[2:] and b.pad == a.pad[2:]


def test_argument_validation():
    with pytest.raises(ConfigError, match="slot"):
        assign_slot(10, 1, 2, 2, 1)
    with pytest.raises(ConfigError, match="worker"):
        assign_worker(10, 1, 0, 2, 3, 3)
    with pytest.raises(ConfigError, match="epoch"):
        assign_slot(10, 1, 0, 2, 1, PlanParams(), -1)
    with pytest.raises(ConfigError, match="seed_mode.*epoch, pid.*'bogus'"):
        PlanParams(seed_mode="bogus")
    with pytest.raises(ConfigError, match="PlanParams.start_index"):
        PlanParams(start_index=-1)
    with pytest.raises(ConfigError, match="PlanParams.shuffle"):
        PlanParams(shuffle=1)
    with pytest.raises(ConfigError, match="params"):
        assign_slot(10, 1, 0, 1, 1, {"seed": 0})


def test_empty_catalog_gives_empty_lists():
    lists = assign_epoch(0, 1, 2, 2, PlanParams(repeat=True))
    assert all(len(w) == 0 for slot in lists for w in slot)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    slots=st.integers(1, 6),
    workers=st.integers(1, 4),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
    shuffle=st.booleans(),
    repeat=st.booleans(),
)
def test_epoch_mode_is_a_permuted_pid_structure(n, slots, workers, seed, epoch, shuffle, repeat):
    params = PlanParams(seed=seed, shuffle=shuffle, repeat=repeat)
    lists = assign_epoch(n, 1, slots, workers, params, epoch)
    counter = collections.Counter(s for slot in lists for w in slot
                                  for s, p in zip(w.shards, w.pad, strict=True) if not p)
    assert sorted(counter) == list(range(n)) and set(counter.values()) == {1}
    # Without shuffle the worker list is exactly the strided extended positions.
    if not shuffle:
        order = epoch_order(n, seed, epoch)
        ext = extended_length(n, slots, workers, repeat)
        for s, slot in enumerate(lists):
            for w, ws in enumerate(slot):
                pos = range(s + slots * w, ext, slots * workers)
                assert ws.shards == tuple(int(order[p % n]) for p in pos)
                assert ws.pad == tuple(p >= n for p in pos)
