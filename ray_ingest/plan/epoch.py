"""The epoch plan of one data-parallel slot: from a ReadState to what the stream reads, in one call.

:func:`plan_epoch_reads` answers every planning question the loader asks at the start of an
epoch (or of a resumed one): which samples of the slot's stream are still unconsumed, cut into
read items; how many batches every rank of the epoch delivers; how many were delivered before.
:func:`plan_window` chains the plans of the following epochs (fresh on the current topology), so
one Ray Data execution can read several epochs in order.

No Ray, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from ray_ingest.plan.slices import ShardSlice, plan_epoch
from ray_ingest.plan.state import (
    Ranges,
    ReadState,
    generation_streams,
    next_epoch,
    slot_stream,
    subtract,
)
from ray_ingest.plan.topology import Topology


@attrs.frozen(slots=True)
class ReadItem:
    """One read task: ``count`` samples of shard ``sid`` from ``start``; stream position ``seq``."""

    #: Position of the first sample in the slot's stream of ``epoch``.
    seq: int
    #: Shard number in the catalog.
    sid: int
    #: First sample (position in the shard).
    start: int
    count: int
    #: Planned duplicates (cyclic-repeat extras, equal-work padding).
    pad: bool = False
    epoch: int = 0


def read_items(stream: Sequence[ShardSlice], consumed: Ranges, max_rows: int | None = None,
               epoch: int = 0) -> list[ReadItem]:
    """Unconsumed parts of a slot stream as read items (stream positions kept).

    With ``max_rows`` a slice is cut into items of at most that many samples: each is one read
    task and one block, so decoding starts after the first block instead of after a whole shard
    (only valid for positional alignment, where a task can seek straight to its first sample).
    """
    out = []
    for seq, sl in subtract(stream, consumed):
        step = max_rows or sl.count
        for off in range(0, sl.count, step):
            n = min(step, sl.count - off)
            out.append(ReadItem(seq + off, sl.shard, sl.start + off, n, sl.pad, epoch))
    return out


def expected_batches(streams: Sequence[Sequence[ShardSlice]], batch_size: int,
                     shard_bucket: Sequence[str] | np.ndarray | None = None) -> int:
    """Batches every rank delivers in a generation: the most any slot needs (others pad).

    With ``shard_bucket`` (the aspect bucket of every shard) a slot needs one partial batch per
    bucket it reads.
    """
    best = 0
    for stream in streams:
        if shard_bucket is None:
            need = math.ceil(sum(sl.count for sl in stream) / batch_size)
        else:
            per: dict[str, int] = {}
            for sl in stream:
                b = shard_bucket[sl.shard]
                per[b] = per.get(b, 0) + sl.count
            need = sum(math.ceil(n / batch_size) for n in per.values())
        best = max(best, need)
    return best


@attrs.frozen
class EpochPlan:
    """What one slot reads and delivers in (the rest of) one epoch."""

    epoch: int
    slot: int
    #: Unconsumed samples of the slot's stream, in reading order.
    items: tuple[ReadItem, ...]
    #: Batches every rank delivers in the current generation of the epoch.
    total_batches: int
    #: Batches this slot already delivered in the current generation.
    done_batches: int
    #: Batches delivered on earlier topologies (generations) of the epoch, equal on every slot.
    earlier_batches: int
    #: Consumed stream positions of the slot in the current generation.
    consumed: Ranges

    @property
    def samples(self) -> int:
        """Rows the read stage produces for this plan (strict alignment: exactly)."""
        return sum(it.count for it in self.items)

    @property
    def first_step(self) -> int:
        """``step_in_epoch`` of the first batch this plan delivers."""
        return self.earlier_batches + self.done_batches


def plan_epoch_reads(
    state: ReadState,
    counts: Sequence[int] | np.ndarray,
    chunk_size: int,
    slot: int,
    batch_size: int,
    *,
    shard_bucket: Sequence[str] | np.ndarray | None = None,
    block_rows: int | None = None,
) -> EpochPlan:
    """The plan of ``slot`` for the epoch and generation ``state`` is in.

    Args:
        state: the read state (its epoch, plan parameters, generations and progress).
        counts: samples per shard (``catalog.counts``).
        chunk_size: ``catalog.chunk_size`` (PiD's start-index skip).
        slot: the data-parallel slot (``Topology.slot``).
        batch_size: samples per batch.
        shard_bucket: aspect bucket per shard when batching by bucket (None: one group).
        block_rows: cut read items to at most this many samples (positional alignment only).
    """
    params = state.params()
    gen = state.current
    if len(state.generations) == 1:
        if shard_bucket is not None:
            # a slot's batch count depends on how every slot's samples fall into buckets
            streams = plan_epoch(counts, chunk_size, gen.slots, gen.read_workers, params,
                                 state.epoch)
            stream = streams[slot]
        else:
            stream = slot_stream(state, counts, chunk_size, slot)
            streams = [stream]  # equal work: every slot has this many samples
    else:
        streams = generation_streams(state, counts, chunk_size)
        stream = streams[slot]
    total = expected_batches(streams, batch_size, shard_bucket)
    if not params.equal_work and shard_bucket is None:
        total = math.ceil(sum(sl.count for sl in stream) / batch_size)
    consumed = gen.consumed[slot]
    done = gen.batches[slot]
    # every batch delivered (a run stopped right after the epoch's last batch): nothing to read
    items = read_items(stream, consumed, block_rows, state.epoch) if done < total else []
    earlier = sum(max(g.batches, default=0) for g in state.generations[:-1])
    return EpochPlan(epoch=state.epoch, slot=slot, items=tuple(items), total_batches=total,
                     done_batches=done, earlier_batches=earlier, consumed=consumed)


def plan_window(
    state: ReadState,
    topology: Topology,
    counts: Sequence[int] | np.ndarray,
    chunk_size: int,
    batch_size: int,
    num_epochs: int,
    *,
    shard_bucket: Sequence[str] | np.ndarray | None = None,
    block_rows: int | None = None,
    max_items: int | None = None,
    first_rows: int | None = None,
) -> list[EpochPlan]:
    """Plans of the epochs one execution reads: the rest of ``state``'s epoch, then the following
    epochs from their start on ``topology``, up to ``num_epochs`` (exclusive).

    Epochs are added while the window holds at most ``max_items`` read items (every read task is
    ``ray.put`` when an execution starts); the current epoch is always included. With
    ``first_rows`` (positional alignment only) the window's first item is cut to at most that
    many samples, so the first batch waits for one small block, not a whole one.
    """
    plans: list[EpochPlan] = []
    items = 0
    while state.epoch < num_epochs:
        plan = plan_epoch_reads(state, counts, chunk_size, topology.slot, batch_size,
                                shard_bucket=shard_bucket, block_rows=block_rows)
        if plans and max_items is not None and items + len(plan.items) > max_items:
            break
        if first_rows and not items and plan.items and plan.items[0].count > first_rows:
            head = plan.items[0]
            cut = (attrs.evolve(head, count=first_rows),
                   attrs.evolve(head, seq=head.seq + first_rows, start=head.start + first_rows,
                                count=head.count - first_rows))
            plan = attrs.evolve(plan, items=(*cut, *plan.items[1:]))
        plans.append(plan)
        items += len(plan.items)
        state = next_epoch(state, topology, batch_size)
    return plans
