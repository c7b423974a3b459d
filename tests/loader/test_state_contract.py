"""Every stateful stage keeps one contract (``get_state``/``load_state``, ray_ingest.loader.
stateful) and goes through the one round-trip helper (tests/support/roundtrip.py), stopped and
restored at every position of its scenario: the batcher, the epoch window, the group share and
the loader as a whole here; the skip filter and progress in test_stages.py. No Ray."""

from __future__ import annotations

import numpy as np
import pytest

from ray_ingest.columns import BUCKET, EPOCH, PAD, SEQ
from ray_ingest.config import config_from_dict
from ray_ingest.errors import StateError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.loader.batcher import BucketBatcher
from ray_ingest.loader.group import GroupShare
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.loader.progress import Progress
from ray_ingest.loader.skips import SkipFilter
from ray_ingest.loader.stateful import Stateful
from ray_ingest.loader.window import EpochWindow
from ray_ingest.plan.epoch import EpochPlan, ReadItem
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from tests.support.group_ranks import ThreadChannel
from tests.support.roundtrip import LoaderNode, Replay, consumed_rows, run_save_load


def test_every_stateful_stage_keeps_the_contract():
    for cls in (BucketBatcher, EpochWindow, GroupShare, IngestLoader, Progress, SkipFilter):
        assert issubclass(cls, Stateful), cls  # runtime_checkable: both methods present


# --- bucket batcher ----------------------------------------------------------------------


def _rows(seqs, buckets):
    n = len(seqs)
    return {SEQ: np.array(seqs, np.int64), PAD: np.zeros(n, bool),
            BUCKET: np.array(buckets, object), "x": np.array(seqs) * 10 + 1}


# Two epochs of two aspect buckets, batch size 3; a block is one shard's slice, so it holds one
# bucket. Partial batches are held across blocks and buckets, tails padded at each epoch's end
# (no pad-only batch: each epoch's planned count is what its rows make).
BATCHER_STREAM = [
    (0, _rows([0, 1], ["a"] * 2)), (0, _rows([2, 3, 4, 5], ["b"] * 4)),
    (0, _rows([6, 7, 8], ["a"] * 3)), (0, _rows([9], ["b"])), (0, _rows([10], ["a"])),
    (1, _rows([0, 1], ["b"] * 2)), (1, _rows([2, 3, 4], ["a"] * 3)),
    (1, _rows([5, 6, 7, 8], ["b"] * 4)),
]
BATCHES = {0: 4, 1: 3}  # epoch 0: a 0 1 6 7 8 10 -> 2, b 2 3 4 5 9 -> 2 (one padded);
#                          epoch 1: a 2 3 4 -> 1, b 0 1 5 6 7 8 -> 2


def _batcher_steps():
    def start(epoch):
        def step(node):
            node.stage.start_epoch(0, BATCHES[epoch])
        return step

    def feed(upto, epoch):
        def step(node):
            out = []
            while node.fed < upto:
                node.fed += 1
                for got in node.pending_until(node.fed):
                    out += [node.record((epoch, b, c)) for c, b in node.stage.add(got)]
            return [_batch_view(c, b) for _, b, c in out]
        return step

    def finish(epoch):
        def step(node):
            out = []
            for held in node.pending_until(node.fed):  # after a restore: held rows, read again
                out += [node.record((epoch, b, c)) for c, b in node.stage.add(held)]
            out += [node.record((epoch, b, c)) for c, b in node.stage.finish()]
            return [_batch_view(c, b) for _, b, c in out]
        return step

    return [start(0), feed(2, 0), feed(3, 0), feed(5, 0), finish(0),
            start(1), feed(7, 1), feed(8, 1), finish(1)]


def _batch_view(cols, bucket):
    return bucket, cols[SEQ].tolist(), cols[PAD].tolist(), cols["x"].tolist()


class _BatcherNode(Replay):
    """The batcher fed block by block (``fed`` blocks so far), as the loader feeds it."""

    def __init__(self):
        super().__init__(BucketBatcher(3, bucketing=True), BATCHER_STREAM,
                         lambda out: consumed_rows(out[0], out[2]))
        self.fed = 0

    def pending_until(self, n: int):
        """The unconsumed rows of stream blocks before ``n`` not handed over yet, block by
        block."""
        out = []
        while (got := self.pending(before=n)) is not None:
            out.append(got[1])
        return out

    def get_state(self):
        return {**super().get_state(), "fed": self.fed}

    def load_state(self, state):
        super().load_state(state)
        self.fed = state["fed"]
        self._next = 0
        # rows of blocks already fed but not consumed are handed over again with the next feed


def test_batcher_round_trip_at_every_position():
    steps = _batcher_steps()
    res = run_save_load(_BatcherNode, steps,
                        {"initial": 0, "mid-epoch": 2, "end-of-epoch": 5, "next-epoch": 7})
    full = [b for part in res[0][1] if part for b in part]
    assert len(full) == BATCHES[0] + BATCHES[1] and all(len(b[1]) == 3 for b in full)
    assert sum(pad for b in full for pad in b[2]) == 1  # the padded tail: b of epoch 0
    # stopped holding a 0 1 and b 5 (b 2 3 4 went out): the restored batcher held nothing,
    # and the held rows came again from the plan
    assert res[2][0][-1] == [("b", [2, 3, 4], [False] * 3, [21, 31, 41])]
    assert res[2][1][0] == [("a", [0, 1, 6], [False] * 3, [1, 11, 61])]


def test_batcher_state_is_only_what_it_owes():
    b = BucketBatcher(3, bucketing=True)
    b.start_epoch(1, 4)
    list(b.add(_rows([0, 1], ["a", "a"])))
    assert b.get_state() == {"remaining": 3}
    fresh = BucketBatcher(3, bucketing=True)
    fresh.load_state(b.get_state())
    assert fresh.remaining == 3 and list(fresh.finish()) == []  # it holds no rows
    with pytest.raises(StateError, match=r"BucketBatcher.load_state: state lacks remaining"):
        fresh.load_state({"left": 3})


# --- epoch window ------------------------------------------------------------------------


WINDOW_STREAM = {0: [[0, 1], [2, 3, 4], [5]], 1: [[0], [1, 2], [3, 4, 5]], 2: [[0, 1, 2]]}


class _Execution:
    def __init__(self, blocks):
        self._blocks = blocks

    def blocks(self):
        yield from self._blocks

    def stats(self):
        return None

    def close(self):
        pass


class _WindowNode:
    """The window over an execution of every unconsumed row of three epochs, in stream order
    and in the stream's blocks; handed-out blocks are consumed (as the loader's batches)."""

    def __init__(self):
        self.done: set[tuple[int, int]] = set()
        self._build()

    def _build(self):
        blocks, plans = [], []
        for epoch, parts in WINDOW_STREAM.items():
            left = [[s for s in part if (epoch, s) not in self.done] for part in parts]
            left = [p for p in left if p]
            n = sum(len(p) for p in left)
            blocks += [{SEQ: np.array(p, np.int64), EPOCH: np.full(len(p), epoch)} for p in left]
            items = (ReadItem(0, 0, 0, n, False, epoch),) if n else ()
            plans.append(EpochPlan(epoch=epoch, slot=0, items=items, total_batches=1,
                                   done_batches=0, earlier_batches=0, consumed=()))
        self.window = EpochWindow(plans, lambda items: _Execution(blocks), exact=True,
                                  ordered=True)
        self._iters: dict[int, object] = {}

    def take(self, epoch):
        def step(node):
            it = node._iters.setdefault(epoch, iter(node.window.blocks_of(
                next(p for p in node.window.plans if p.epoch == epoch))))
            block = next(it, None)
            if block is None:
                return None
            node.done.update((epoch, int(s)) for s in block[SEQ])
            return epoch, block[SEQ].tolist()
        return step

    def end(self, epoch):
        def step(node):
            it = node._iters.pop(epoch, None) or iter(node.window.blocks_of(
                next(p for p in node.window.plans if p.epoch == epoch)))
            assert next(it, None) is None  # the epoch's rows are all in: it ends
            return "end", epoch
        return step

    def get_state(self):
        return {"consumed": sorted(self.done), "window": self.window.get_state()}

    def load_state(self, state):
        self.done = {(int(e), int(s)) for e, s in state["consumed"]}
        self._build()
        self.window.load_state(state["window"])


def test_window_round_trip_at_every_position():
    n = _WindowNode()
    steps = ([n.take(0)] * 3 + [n.end(0)] + [n.take(1)] * 3 + [n.end(1)] + [n.take(2)]
             + [n.end(2)])
    run_save_load(_WindowNode, steps,
                  {"initial": 0, "mid-epoch": 2, "end-of-epoch": 4, "next-epoch": 6})


def test_window_state_names_the_next_epoch_and_drops_earlier_plans():
    node = _WindowNode()
    assert node.window.get_state() == {"epoch": 0}
    for step in (node.take(0),) * 3 + (node.end(0),):
        step(node)
    assert node.window.get_state() == {"epoch": 1}
    fresh = _WindowNode()
    fresh.window.load_state({"epoch": 2})
    assert [p.epoch for p in fresh.window.plans] == [2]
    with pytest.raises(StateError, match="already started"):
        node.window.load_state({"epoch": 1})


# --- group share -------------------------------------------------------------------------


class _ShareNode:
    """A group of two over in-process queues: the leader sends each batch, the follower
    receives it (the batches a follower saw before a restore are not sent again)."""

    def __init__(self):
        self.leader, self.follower = (GroupShare(c) for c in ThreadChannel.group(2))

    def send(self, epoch, step):
        def run(node):
            from ray_ingest.loader.collate import Batch

            keys = [f"e{epoch}s{step}r{i}" for i in range(2)]
            batch = Batch(data={}, sample_keys=keys, captions=None, sids=[0, 0],
                          indices=[2 * step, 2 * step + 1], pads=[False, False], bucket="",
                          epoch=epoch, step_in_epoch=step)
            node.leader.send_batch(batch, [2 * step, 2 * step + 1])
            msg = node.follower.receive(epoch)
            return msg.batch.sample_keys, msg.positions, node.follower.step
        return run

    def end(self, epoch):
        def run(node):
            node.leader.send_end(epoch)
            return node.follower.receive(epoch).kind, node.follower.step
        return run

    def get_state(self):
        state = self.follower.get_state()
        assert state == self.leader.get_state()  # a group moves in step
        return state

    def load_state(self, state):
        self.leader.load_state(state)
        self.follower.load_state(state)


def test_group_share_round_trip_at_every_position():
    n = _ShareNode()
    steps = [n.send(0, 0), n.send(0, 1), n.end(0), n.send(1, 0), n.send(1, 1), n.end(1)]
    run_save_load(_ShareNode, steps,
                  {"initial": 0, "mid-epoch": 1, "end-of-epoch": 3, "next-epoch": 4})


# --- the loader as a whole ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("contract") / "ds")
    synth_dataset(out, samples=23, shard_size=6, seed=1, min_side=16, max_side=24)
    return out


def _loader_node(path) -> LoaderNode:
    """An in-process loader taken batch by batch over two epochs (a trainer's loop)."""
    cfg = config_from_dict({"data": {"paths": [path]}, "decode": {"resolution": 8},
                            "loader": {"batch_size": 4, "seed": 2, "read_workers": 2}})
    loader = IngestLoader(cfg, Topology(world_size=2, rank=1, read_workers=2),
                          open_execution=LocalExecution.factory(cfg, _catalog(path)),
                          catalog=_catalog(path))
    return LoaderNode(loader, 2, lambda epoch, b: (
        epoch, b.step_in_epoch, b.sample_keys, b.sids, b.indices, b.pads,
        int(b.data["image"].sum())))


_CATALOGS: dict[str, object] = {}


def _catalog(path):
    from ray_ingest.catalog.load import load_catalog

    return _CATALOGS.setdefault(path, load_catalog([path]))


def test_loader_round_trip_at_every_position(small):
    probe = _loader_node(small)
    per_epoch = sum(1 for _ in probe.loader.epochs(1) for _ in _[1])
    assert per_epoch >= 2
    steps = [LoaderNode.next] * (2 * per_epoch + 1)  # the last step finds the end
    res = run_save_load(lambda: _loader_node(small), steps,
                        {"initial": 0, "mid-epoch": 1, "end-of-epoch": per_epoch,
                         "next-epoch": per_epoch + 1})
    full = res[0][1]
    assert full[-1] is None and [r[0] for r in full[:-1]] == [0] * per_epoch + [1] * per_epoch


def test_loader_load_state_checks_the_data(small, tmp_path):
    other = str(tmp_path / "other")
    synth_dataset(other, samples=29, shard_size=6, seed=1, min_side=16, max_side=24)
    state = _loader_node(small).get_state()
    with pytest.raises(StateError, match="read state field 'fingerprint'"):
        _loader_node(other).load_state(state)
