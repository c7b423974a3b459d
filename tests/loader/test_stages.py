"""The stream's stages one by one, without Ray: epoch plan, skip filter, bucket batcher, progress,
the epoch demultiplexing of one execution's rows, the block accounting, the train loop's wait
clock and the choice of execution. Stateful stages go through the shared
checkpoint round-trip helper (tests/support/roundtrip.py)."""

from __future__ import annotations

import logging
import math
import sys

import numpy as np
import pytest

from ray_ingest.columns import BUCKET, EPOCH, ERROR, INDEX, KEY, PAD, SEQ, SID
from ray_ingest.errors import SkipBudgetExceeded
from ray_ingest.loader.batcher import BucketBatcher
from ray_ingest.loader.progress import Progress
from ray_ingest.loader.skips import (
    SkipFilter,
    skip_kind,
)
from ray_ingest.plan.assign import PlanParams
from ray_ingest.plan.epoch import (
    ReadItem,
    expected_batches,
    plan_epoch_reads,
    plan_window,
    read_items,
)
from ray_ingest.plan.slices import plan_epoch, plan_slot
from ray_ingest.plan.state import (
    add_positions,
    initial_state,
    next_epoch,
    with_progress,
    with_topology,
)
from ray_ingest.plan.topology import Topology
from tests.support.roundtrip import run_save_load

COUNTS = [20, 20, 17, 20, 9, 20, 20, 13]
PARAMS = PlanParams(seed=3, equal_work=True, repeat=False)


def test_stage_modules_import_neither_ray_nor_torch():
    import subprocess

    code = ("import sys; import ray_ingest.plan.epoch, ray_ingest.loader.skips, "
            "ray_ingest.loader.batcher, ray_ingest.loader.progress, ray_ingest.columns, "
            "ray_ingest.loader.account, ray_ingest.loader.clock, ray_ingest.loader.window, "
            "ray_ingest.execution.threads, ray_ingest.execution.opener, "
            "ray_ingest.execution.read, ray_ingest.execution.local, "
            "ray_ingest.execution.headstart, ray_ingest.decode.decoder, ray_ingest.config; "
            # nor do a decoder and a read's node id where no Ray runs (a process of threads)
            "ray_ingest.decode.decoder.Decoder(ray_ingest.config.DecodeConfig()); "
            "assert ray_ingest.execution.read._node_id() == 'local'; "
            "bad = [m for m in ('ray', 'torch') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# --- epoch plan --------------------------------------------------------------------------


def _state(world=2, workers=2, group=1, epoch=0, bsz=8):
    topo = Topology(world, 0, workers, 0, group)
    return initial_state("fp", PARAMS, epoch, topo, {}, bsz), topo


@pytest.mark.parametrize("slot", [0, 1])
def test_plan_of_a_fresh_epoch_reads_the_whole_slot_stream(slot):
    state, _ = _state()
    plan = plan_epoch_reads(state, COUNTS, 20, slot, 8, block_rows=6)
    stream = plan_slot(COUNTS, 20, slot, 2, 2, PARAMS, 0)
    assert plan.samples == sum(sl.count for sl in stream)
    assert plan.total_batches == math.ceil(max(
        sum(sl.count for sl in s) for s in plan_epoch(COUNTS, 20, 2, 2, PARAMS, 0)) / 8)
    # items cover the stream in order, each at most block_rows samples, positions contiguous
    assert [it.seq for it in plan.items] == list(
        np.cumsum([0] + [it.count for it in plan.items])[:-1])
    assert all(0 < it.count <= 6 and it.epoch == 0 for it in plan.items)
    flat = [(it.sid, it.start + i) for it in plan.items for i in range(it.count)]
    assert flat == [(sl.shard, sl.start + i) for sl in stream for i in range(sl.count)]
    assert (plan.done_batches, plan.earlier_batches, plan.first_step) == (0, 0, 0)


def test_plan_of_a_resumed_epoch_skips_consumed_positions():
    state, _ = _state()
    stream = plan_slot(COUNTS, 20, 0, 2, 2, PARAMS, 0)
    consumed = add_positions((), [*range(0, 16), 20, 21])
    state = with_progress(state, 0, consumed, 2)
    plan = plan_epoch_reads(state, COUNTS, 20, 0, 8)
    assert plan.items == tuple(read_items(stream, consumed))
    assert plan.samples == sum(sl.count for sl in stream) - 18
    assert plan.done_batches == plan.first_step == 2


def test_plan_after_the_last_batch_reads_nothing():
    state, _ = _state()
    full = plan_epoch_reads(state, COUNTS, 20, 0, 8)
    state = with_progress(state, 0, (), full.total_batches)
    assert plan_epoch_reads(state, COUNTS, 20, 0, 8).items == ()


def test_plan_after_a_topology_change_counts_earlier_batches():
    state, _ = _state(world=2)
    state = with_progress(state, 0, ((0, 16),), 2)
    state = with_progress(state, 1, ((0, 16),), 2)
    state = with_topology(state, Topology(3, 0, 2), 8)
    plans = [plan_epoch_reads(state, COUNTS, 20, s, 8) for s in range(3)]
    assert {p.earlier_batches for p in plans} == {2}
    assert len({p.total_batches for p in plans}) == 1
    # the three new slots read every unconsumed non-pad sample of generation 0 once
    left = sum(p.samples for p in plans)
    assert left >= sum(COUNTS) - 32


def test_bucket_plan_counts_a_partial_batch_per_bucket():
    state, _ = _state(world=2)
    buckets = ["a", "b", "a", "b", "a", "b", "a", "b"]
    plan = plan_epoch_reads(state, COUNTS, 20, 0, 8, shard_bucket=buckets)
    streams = plan_epoch(COUNTS, 20, 2, 2, PARAMS, 0)
    assert plan.total_batches == expected_batches(streams, 8, buckets)
    assert plan.total_batches >= expected_batches(streams, 8)


def test_window_chains_fresh_epochs_and_respects_the_item_budget():
    state, topo = _state()
    state = with_progress(state, 0, ((0, 8),), 1)
    plans = plan_window(state, topo, COUNTS, 20, 8, 4)
    assert [p.epoch for p in plans] == [0, 1, 2, 3]
    assert plans[0].done_batches == 1 and all(p.done_batches == 0 for p in plans[1:])
    assert all(it.epoch == p.epoch for p in plans for it in p.items)
    fresh = next_epoch(state, topo, 8)
    assert plans[1] == plan_epoch_reads(fresh, COUNTS, 20, 0, 8)
    assert plans[2].items != plans[1].items  # epoch mode reshuffles every epoch
    per_epoch = len(plans[1].items)
    limited = plan_window(state, topo, COUNTS, 20, 8, 4, max_items=len(plans[0].items) + per_epoch)
    assert [p.epoch for p in limited] == [0, 1]
    assert [p.epoch for p in plan_window(state, topo, COUNTS, 20, 8, 4, max_items=1)] == [0]
    assert plan_window(state, topo, COUNTS, 20, 8, 0) == []


# --- skip filter -------------------------------------------------------------------------


def _block(seqs, errors, sid=3):
    n = len(seqs)
    return {SEQ: np.array(seqs, np.int64), SID: np.full(n, sid, np.int64),
            INDEX: np.array(seqs, np.int64) + 100, KEY: np.array([f"k{s}" for s in seqs], object),
            ERROR: np.array(errors, object)}


def _skip_filter(per_shard=None, per_epoch=None):
    return SkipFilter(per_shard, per_epoch, lambda sid: f"part/{sid:06d}.tar")


def test_skip_filter_drops_failed_rows_and_accounts_them_with_the_next_batch(caplog):
    f = _skip_filter()
    with caplog.at_level(logging.WARNING):
        out = f(_block([0, 1, 2], ["", "SampleError: bad", ""]))
    assert out[SEQ].tolist() == [0, 2]
    assert "part/000003.tar" in caplog.text and "k1" in caplog.text
    assert f.drain() == ([1], [(3, 101, "SampleError: bad")])
    assert f.drain() == ([], [])
    assert f.by_kind == {"SampleError": 1}
    assert skip_kind("read: TarFormatError: truncated") == "read/TarFormatError"


def test_skip_budgets_name_the_shard_and_the_epoch():
    f = _skip_filter(per_shard=1)
    f(_block([0], ["x: 1"]))
    with pytest.raises(SkipBudgetExceeded, match=r"shard part/000003.tar: 2 samples skipped"):
        f(_block([1], ["x: 2"]))
    g = _skip_filter(per_epoch=2)
    g.start_epoch(4)
    g(_block([0], ["x"], sid=1))
    g(_block([1], ["x"], sid=2))
    with pytest.raises(SkipBudgetExceeded, match=r"^epoch 4: 3 samples skipped"):
        g(_block([2], ["x"], sid=3))


def _skip_scenario():
    def feed(seqs, errors, sid=3):
        def step(f):
            try:
                out = f(_block(seqs, errors, sid))
            except SkipBudgetExceeded as exc:
                return f"budget: {exc}"
            return out[SEQ].tolist(), f.drain()
        return step

    def new_epoch(e):
        return lambda f: f.start_epoch(e)

    steps = [feed([0, 1, 2], ["", "a", ""]), feed([3, 4], ["b", "c"], sid=4),
             feed([5, 6], ["", ""]), feed([7], ["d"]),  # epoch 0 ends here (4 steps)
             new_epoch(1), feed([0, 1], ["e", ""]), feed([2, 3], ["f", "g"]),
             feed([4], ["h"])]  # the per-shard budget (3) is exceeded in epoch 1
    return steps


def test_skip_filter_round_trip():
    res = run_save_load(lambda: _skip_filter(per_shard=3), _skip_scenario(),
                        {"initial": 0, "mid-epoch": 2, "end-of-epoch": 4, "next-epoch": 6})
    assert res[0][1][-1].startswith("budget: shard part/000003.tar: 4 samples")


# --- progress ----------------------------------------------------------------------------


def _progress_scenario():
    def deliver(positions, skips=()):
        def step(p):
            p.deliver(positions, skips)
            return p.epoch, p.state.current.consumed, p.state.current.batches, p.state.skips
        return step

    def end(p):
        p.end_epoch()
        return p.epoch

    return [deliver([0, 1, 2, 3]), deliver([4, 5, 6, -1], [(2, 7, "bad")]),
            deliver([8, 9, -1, -1]), end,
            deliver([3, 2, 1, 0]), deliver([4, 5, 6, 7], [(1, 1, "x")]), end]


def test_progress_round_trip():
    state, topo = _state(world=2, bsz=4)

    def make():
        return Progress(state, topo, 4)

    res = run_save_load(make, _progress_scenario(),
                        {"initial": 0, "mid-epoch": 2, "end-of-epoch": 3, "next-epoch": 5})
    before, after = res[5]
    assert before[-1][0] == 1 and before[-1][1][0] == ((0, 4),)
    assert after[-1] == 2


def test_progress_records_consumed_positions_and_skips():
    state, topo = _state(world=2, bsz=4)
    p = Progress(state, topo, 4)
    p.deliver([0, 1, 2, 3])
    p.deliver([5, 4, -1, -1], [(3, 9, "r")])
    assert p.state.current.consumed[0] == ((0, 6),)
    assert p.state.current.batches == (2, 0)
    assert p.state.skips == ((3, 9, "r"),)
    plan = plan_epoch_reads(p.state, COUNTS, 20, 0, 4)
    assert p.step_in_epoch(plan) == 2
    p.end_epoch()
    assert (p.state.epoch, p.state.skips, p.state.current.consumed) == (1, (), ((), ()))


# --- bucket batcher ----------------------------------------------------------------------


def _rows(seqs, bucket=""):
    n = len(seqs)
    return {SEQ: np.array(seqs, np.int64), PAD: np.zeros(n, bool),
            BUCKET: np.array([bucket] * n, object), "x": np.array(seqs) * 10}


def test_batcher_emits_full_batches_and_pads_the_partial_one_with_its_own_rows():
    b = BucketBatcher(4)
    b.start_epoch(0, 3)
    got = [cols for cols, _ in b.add(_rows(range(6)))]
    assert [c[SEQ].tolist() for c in got] == [[0, 1, 2, 3]]
    got += [cols for cols, _ in b.add(_rows([6, 7, 8]))]
    assert [c[SEQ].tolist() for c in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    tail = [cols for cols, _ in b.finish()]
    assert [c[SEQ].tolist() for c in tail] == [[8, -1, -1, -1]]
    assert tail[0]["x"].tolist() == [80, 80, 80, 80]
    assert tail[0][PAD].tolist() == [False, True, True, True]
    assert b.remaining == 0


def test_batcher_pad_only_batches_reuse_the_epochs_first_rows():
    b = BucketBatcher(4)
    b.start_epoch(1, 4)  # one batch delivered before a resume: three to go
    out = [c for c, _ in b.add(_rows(range(10, 14)))] + [c for c, _ in b.finish()]
    assert [c[SEQ].tolist() for c in out] == [[10, 11, 12, 13], [-1] * 4, [-1] * 4]
    assert out[1]["x"].tolist() == [100, 110, 120, 130] and out[1][PAD].all()


def test_batcher_keeps_one_bucket_per_batch_in_order_of_first_appearance():
    b = BucketBatcher(2, bucketing=True)
    b.start_epoch(0, 4)
    block = {k: np.concatenate([_rows([0, 1, 2], "a")[k], _rows([3], "b")[k]])
             for k in _rows([0])}
    out = list(b.add(block)) + list(b.finish())
    assert [(bk, c[SEQ].tolist()) for c, bk in out] == [
        ("a", [0, 1]), ("a", [2, -1]), ("b", [3, -1]), ("a", [-1, -1])]


def test_batcher_without_rows_warns_and_ends_short(caplog):
    b = BucketBatcher(4)
    b.start_epoch(0, 2)
    with caplog.at_level(logging.WARNING):
        assert list(b.finish()) == []
    assert "2 batches short" in caplog.text


# --- demultiplexing one execution's rows by epoch ----------------------------------------


class _FakeExecution:
    def __init__(self, blocks):
        self._blocks = blocks
        self.closed = False

    def blocks(self):
        yield from self._blocks

    def stats(self):
        return "stats"

    def close(self):
        self.closed = True


def _eblock(epoch, seqs):
    return {SEQ: np.array(seqs, np.int64), EPOCH: np.full(len(seqs), epoch, np.int64)}


def _plan(epoch, n):
    from ray_ingest.plan.epoch import EpochPlan

    return EpochPlan(epoch=epoch, slot=0, items=(ReadItem(0, 0, 0, n, False, epoch),),
                     total_batches=1, done_batches=0, earlier_batches=0, consumed=())


@pytest.mark.parametrize("exact,ordered", [(True, True), (True, False), (False, True)])
def test_rows_of_one_execution_are_handed_out_epoch_by_epoch(exact, ordered):
    from ray_ingest.loader.window import EpochWindow

    blocks = [_eblock(0, [0, 1]), _eblock(0, [2]), _eblock(1, [0, 1, 2])]
    if not ordered:
        blocks = [_eblock(0, [0, 1]), _eblock(1, [0, 1]), _eblock(0, [2]), _eblock(1, [2])]
    plans = [_plan(0, 3), _plan(1, 3)]
    execution = _FakeExecution(blocks)
    stats: list[str] = []
    window = EpochWindow(plans, lambda items: execution, exact=exact, ordered=ordered,
                         on_stats=stats.append)
    got = [[b[SEQ].tolist() for b in window.blocks_of(p)] for p in plans]
    flat = [[s for b in epoch for s in b] for epoch in got]
    assert flat == [[0, 1, 2], [0, 1, 2]]
    window.close()
    assert execution.closed
    assert stats == ["stats"]  # the execution's end is observed after the window's last epoch


# --- bounded waits (the stall watchdog of an execution) ----------------------------------


class _Stalled(Exception):
    pass


def _handoff(source, timeout):
    from ray_ingest.execution.handoff import Handoff

    return Handoff(source, timeout, lambda t: _Stalled(f"waited {t} s"))


def test_handoff_raises_when_a_wait_exceeds_the_timeout():
    import threading

    release = threading.Event()

    def source():
        yield 1
        release.wait(10)  # a pipeline that stopped producing
        yield 2

    it = iter(_handoff(source(), 0.3))
    assert next(it) == 1
    with pytest.raises(_Stalled, match="waited 0.3 s"):
        next(it)
    release.set()


def test_handoff_pauses_of_the_consumer_never_count():
    import time

    h = _handoff(iter(range(4)), 0.2)
    got = []
    for x in h:
        got.append(x)
        time.sleep(0.4)  # the train loop pauses longer than the timeout
    assert got == [0, 1, 2, 3]


def test_handoff_passes_errors_and_closes_the_source_in_its_thread():
    import threading

    closed = []

    def source():
        try:
            yield 1
            yield 2
        finally:
            closed.append(threading.current_thread().name)

    h = _handoff(source(), 5)
    it = iter(h)
    assert next(it) == 1
    h.close()
    assert closed == ["ray_ingest-handoff"]

    def failing():
        yield 1
        raise ValueError("bad shard")

    with pytest.raises(ValueError, match="bad shard"):
        list(_handoff(failing(), 5))


def test_handoff_close_reports_a_helper_still_blocked_in_the_source():
    """A stalled source keeps the helper inside ``next()``: close() says so (the Ray edge then
    shuts its executor down), and says it ended once the source lets go."""
    import threading

    release = threading.Event()

    def source():
        yield 1
        release.wait(10)
        yield 2

    h = _handoff(source(), 0.2)
    it = iter(h)
    assert next(it) == 1
    with pytest.raises(_Stalled):
        next(it)
    assert h.close(join_s=0.2) is False  # blocked in the source
    release.set()
    assert h.close(join_s=5) is True
    assert _handoff(iter(()), None).close() is True  # never started


# --------------------------------------------------------------------------- accounting
def test_block_account_takes_the_instrumentation_columns_off():
    from ray_ingest.columns import ACTOR, BYTES, NODE, READ_NODE, T_DECODE, T_READ
    from ray_ingest.execution.headstart import HEAD_ACTOR
    from ray_ingest.execution.threads import THREAD_ACTOR
    from ray_ingest.loader.account import BlockAccount
    from ray_ingest.loader.clock import StageClock

    clock, reported = StageClock(), []
    account = BlockAccount(clock, reported.append)
    obj = lambda *v: np.array(v, dtype=object)  # noqa: E731
    block = {SEQ: np.arange(4), ACTOR: obj("a1", "a2", HEAD_ACTOR, THREAD_ACTOR),
             NODE: obj("n1", "n1", "n2", "n2"), READ_NODE: obj("r", "r", "r", "r"),
             BYTES: np.array([10, 20, 30, 40]), T_READ: np.full(4, 0.25),
             T_DECODE: np.full(4, 0.5)}
    out = account(block)
    assert list(out) == [SEQ]  # only the rows' own columns go on to the skip filter
    assert account.actors_seen == {"a1", "a2"} and reported == [["a1", "a2"]]
    assert account.decode_nodes == {"n1": 2, "n2": 2} and account.read_nodes == {"r": 4}
    assert (clock.bytes_read, clock.read, clock.decode) == (100, 1.0, 2.0)
    account({SEQ: np.arange(1), ACTOR: obj(THREAD_ACTOR), T_READ: np.zeros(1),
             T_DECODE: np.zeros(1)})
    assert reported == [["a1", "a2"]]  # no pool actor in a block of the decode threads


def test_timed_reports_every_wait_of_the_consumer():
    import time

    from ray_ingest.loader.clock import timed

    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield i

    waits: list[float] = []
    got = []
    for item in timed(slow(), waits.append):
        got.append(item)
        time.sleep(0.1)  # the consumer's own work is not a wait
    assert got == [0, 1, 2] and len(waits) == 4  # three items and the end
    assert all(0.04 <= w < 0.1 for w in waits[:3])


# --------------------------------------------------------------------------- executions
def test_executions_resolve_auto_once_and_open_threads_without_ray(tmp_path, monkeypatch):
    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.config import config_from_dict
    from ray_ingest.execution import opener as executions
    from ray_ingest.execution.opener import Executions
    from ray_ingest.execution.threads import (
        ThreadedExecution,
        decode_threads,
    )
    from ray_ingest.tools.synth import synth_dataset

    out = str(tmp_path / "ds")
    synth_dataset(out, samples=8, shard_size=4, seed=1, min_side=16, max_side=16)
    cfg = config_from_dict({"data": {"paths": [out]}, "decode": {"small_node_cores": 4096}})
    catalog = load_catalog([out])
    monkeypatch.setattr(executions, "_ray_nodes", lambda: 2)  # a cluster of two nodes
    assert Executions(cfg, catalog, Topology(2, 1, 1)).compute == "actors"
    monkeypatch.setattr(executions, "_ray_nodes", lambda: 1)  # Ray up on this one node
    assert Executions(cfg, catalog, Topology(2, 1, 1)).compute == "process"
    monkeypatch.setattr(executions, "_ray_nodes", lambda: None)  # no Ray: this machine alone
    ex = Executions(cfg, catalog, Topology(2, 1, 1), node_pipelines=2)
    assert ex.compute == "threads" and ex.cfg.decode.compute == "threads"
    assert cfg.decode.compute == "auto"  # the caller's config is left as it was
    assert ex.threads == decode_threads(cfg.decode, 2)
    opened = ex([])
    assert isinstance(opened, ThreadedExecution) and opened.threads == ex.threads
    assert ex.opened == 1 and ex.head_rows == 0
    calls = []
    custom = Executions(cfg, catalog, Topology(1, 0, 1), custom=lambda items: calls.append(items))
    custom([])
    assert custom.compute == "custom" and calls == [[]] and custom.cfg is cfg
