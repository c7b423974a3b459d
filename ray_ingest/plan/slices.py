"""Shard slices: a slot's ordered stream of samples for one epoch, with equal-work padding.

A :class:`ShardSlice` names samples ``[start, start + count)`` of one shard. A slot's stream is
the round-robin interleave of its workers' shard lists (see :mod:`ray_ingest.plan.assign`),
each entry a whole-shard slice. With ``equal_work`` every slot of an epoch is padded to the
same number of samples, so data-parallel ranks run the same number of steps.

numpy only; no Ray, no torch.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from ray_ingest.errors import ConfigError
from ray_ingest.plan.assign import (
    DEFAULT_PARAMS,
    PlanParams,
    WorkerShards,
    assign_slot,
    base_order,
    extended_length,
    skip_count,
    worker_seed,
)
from ray_ingest.plan.topology import check_int


def _non_negative(instance: object, attribute: attrs.Attribute, value: object) -> None:
    check_int(f"ShardSlice.{attribute.name}", value, 0)


@attrs.frozen
class ShardSlice:
    """Samples ``[start, start + count)`` of shard ``shard`` (an index into ``catalog.shards``)."""

    #: Index into ``catalog.shards``.
    shard: int = attrs.field(validator=_non_negative)
    #: First sample (position in the shard).
    start: int = attrs.field(validator=_non_negative)
    #: Number of samples.
    count: int = attrs.field(validator=_non_negative)
    #: True for planned duplicates: cyclic-repeat extras and equal-work padding.
    pad: bool = False

    @property
    def end(self) -> int:
        """One past the last sample."""
        return self.start + self.count


def total(slices: Sequence[ShardSlice]) -> int:
    """Number of samples in ``slices``."""
    return sum(s.count for s in slices)


def iter_samples(slices: Sequence[ShardSlice]) -> Iterator[tuple[int, int, bool]]:
    """Yield ``(shard, index, pad)`` for every sample of ``slices``, in order."""
    for s in slices:
        for i in range(s.start, s.end):
            yield s.shard, i, s.pad


def _counts_array(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(counts)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ConfigError(f"counts: expected a 1-D sequence of ints, got shape {arr.shape} "
                          f"dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ConfigError(f"counts[{i}]: expected >= 0, got {int(arr[i])}")
    return arr


def interleave(workers: Sequence[WorkerShards], counts: Sequence[int] | np.ndarray
               ) -> list[ShardSlice]:
    """Round-robin merge ``w0[0], w1[0], ..., w0[1], ...`` (exhausted workers skipped).

    Each entry becomes a whole-shard slice; cyclic-repeat extras keep ``pad=True``.
    """
    out: list[ShardSlice] = []
    for row in itertools.zip_longest(*(zip(w.shards, w.pad, strict=True) for w in workers)):
        for entry in row:
            if entry is not None:
                shard, pad = entry
                out.append(ShardSlice(shard, 0, int(counts[shard]), pad))
    return out


def _cut(inp: Sequence[ShardSlice], prefix: list[int], begin: int, length: int,
         force_pad: bool) -> list[ShardSlice]:
    """Samples ``[begin, begin + length)`` of ``inp`` repeated forever; past one lap is pad.

    ``inp`` holds no zero-count slice and ``prefix`` is its running sample count (from 0).
    """
    size = prefix[-1]
    out: list[ShardSlice] = []
    pos = begin
    while length > 0:
        lap, off = divmod(pos, size)
        i = bisect.bisect_right(prefix, off) - 1
        s = inp[i]
        within = off - prefix[i]
        n = min(s.count - within, length)
        out.append(ShardSlice(s.shard, s.start + within, n, force_pad or s.pad or lap > 0))
        pos += n
        length -= n
    return out


def _prefix(slices: Sequence[ShardSlice]) -> list[int]:
    return [0, *itertools.accumulate(s.count for s in slices)]


def balance(slices: Sequence[ShardSlice], slots: int) -> list[tuple[ShardSlice, ...]]:
    """Split an ordered stream into ``slots`` contiguous parts with equal sample counts.

    Part ``i`` gets samples ``[i*c, (i+1)*c)`` with ``c = ceil(total / slots)`` of the input
    repeated cyclically: the tail parts wrap over the beginning of the whole input, and those
    wrapped samples are ``pad=True``. Zero-count slices are dropped; other slices keep their
    own ``pad`` flag. Used to re-plan unconsumed samples after a topology change.

    Args:
        slices: Ordered slices (any pad flags).
        slots: Number of parts, at least 1.

    Returns:
        ``slots`` tuples of slices, each holding ``c`` samples (all empty when total is 0).
    """
    check_int("slots", slots, 1)
    inp = [s for s in slices if s.count > 0]
    prefix = _prefix(inp)
    size = prefix[-1]
    if size == 0:
        return [() for _ in range(slots)]
    chunk = -(-size // slots)
    return [tuple(_cut(inp, prefix, i * chunk, chunk, False)) for i in range(slots)]


def slot_totals(
    counts: Sequence[int] | np.ndarray,
    chunk_size: int,
    slots: int,
    read_workers: int,
    params: PlanParams = DEFAULT_PARAMS,
    epoch: int = 0,
    order: np.ndarray | None = None,
) -> np.ndarray:
    """Samples per slot in an epoch before equal-work padding (int64, length ``slots``).

    Extended position ``p`` belongs to slot ``p % slots``, so without a start-index skip this
    is one vectorized pass over the (virtual) extended list. With a start-index skip the
    dropped heads depend on every worker's shuffle, which is replayed for every worker of
    every slot (O(slots * workers) Python work: slower, still exact).
    """
    arr = _counts_array(counts)
    n = arr.size
    check_int("slots", slots, 1)
    check_int("read_workers", read_workers, 1)
    if order is None:
        order = base_order(n, params, epoch)
    skip = skip_count(params.start_index, chunk_size, read_workers)
    ordered = arr if order is None else arr[order]
    ext_size = extended_length(n, slots, read_workers, params.repeat)
    totals = np.zeros(slots, dtype=np.int64)
    _fold(ordered, 0, totals)
    if ext_size > n:  # the cyclic-repeat extras (fewer than slots * read_workers)
        _fold(np.resize(ordered, ext_size - n), n, totals)
    if skip and ext_size:
        # The skipped head of each worker list depends on that worker's shuffle: replay the
        # same shuffle of positions as assign._worker and subtract what it drops.
        stride = slots * read_workers
        dropped: list[int] = []
        for slot in range(slots):
            for w in range(read_workers):
                first = slot + slots * w
                length = max(0, -(-(ext_size - first) // stride))
                perm = list(range(length))
                if params.shuffle and length > 1:
                    seed = worker_seed(params.seed_mode, params.seed, epoch, slot, w,
                                       read_workers)
                    random.Random(seed).shuffle(perm)
                dropped.extend(first + stride * j for j in perm[:skip])
        pos = np.asarray(dropped, dtype=np.int64)
        np.subtract.at(totals, pos % slots, ordered[pos % n])
    return totals


def _fold(values: np.ndarray, start: int, totals: np.ndarray) -> None:
    """``totals[(start + i) % slots] += values[i]`` for every i, without an index array."""
    slots = totals.size
    first = start % slots
    head = min(values.size, (slots - first) % slots)
    totals[first:first + head] += values[:head]
    rest = values[head:]
    rows = rest.size // slots
    if rows:
        totals += rest[:rows * slots].reshape(rows, slots).sum(axis=0)
    tail = rest[rows * slots:]
    totals[:tail.size] += tail


def _plan_slot(arr: np.ndarray, chunk_size: int, slot: int, slots: int, read_workers: int,
               params: PlanParams, epoch: int, order: np.ndarray | None,
               target: int | None) -> tuple[ShardSlice, ...]:
    workers = assign_slot(arr.size, chunk_size, slot, slots, read_workers, params, epoch, order)
    stream = interleave(workers, arr)
    deficit = 0 if target is None else target - total(stream)
    if deficit <= 0:
        return tuple(stream)
    # Pad source: the slot's own non-pad stream; else its whole stream; else the epoch order
    # (never empty here: a positive target means some shard has samples).
    source = [s for s in stream if not s.pad and s.count] or [s for s in stream if s.count]
    if not source:
        ids = range(arr.size) if order is None else order.tolist()
        source = [ShardSlice(int(i), 0, int(arr[i])) for i in ids if arr[i]]
    return (*stream, *_cut(source, _prefix(source), 0, deficit, True))


def plan_slot(
    counts: Sequence[int] | np.ndarray,
    chunk_size: int,
    slot: int,
    slots: int,
    read_workers: int,
    params: PlanParams = DEFAULT_PARAMS,
    epoch: int = 0,
) -> tuple[ShardSlice, ...]:
    """The ordered stream of one data-parallel slot (every rank of its group reads it).

    The round-robin interleave of the slot's worker lists, one whole-shard slice per entry.
    With ``params.equal_work`` a slot shorter than the longest slot of the epoch then wraps
    over its own non-pad stream from the beginning, cut at sample granularity, with
    ``pad=True`` slices (falling back to its whole stream, then to the epoch's global order,
    when it has no non-pad samples).

    Args:
        counts: Samples per shard (``catalog.counts``).
        chunk_size: ``catalog.chunk_size`` (for PiD's start-index skip).
        slot: Data-parallel group id (``Topology.slot``).
        slots: Number of data-parallel groups (``Topology.slots``).
        read_workers: Loader workers per rank.
        params: Planning parameters.
        epoch: Epoch number.

    Returns:
        The slot's slices in reading order.
    """
    arr = _counts_array(counts)
    check_int("slot", slot, 0, slots, "slots")
    order = base_order(arr.size, params, epoch)
    target = None
    if params.equal_work:
        target = int(slot_totals(arr, chunk_size, slots, read_workers, params, epoch, order).max())
    return _plan_slot(arr, chunk_size, slot, slots, read_workers, params, epoch, order, target)


def plan_epoch(
    counts: Sequence[int] | np.ndarray,
    chunk_size: int,
    slots: int,
    read_workers: int,
    params: PlanParams = DEFAULT_PARAMS,
    epoch: int = 0,
) -> list[tuple[ShardSlice, ...]]:
    """:func:`plan_slot` for every slot of the epoch (tests and audits)."""
    arr = _counts_array(counts)
    check_int("slots", slots, 1)
    order = base_order(arr.size, params, epoch)
    target = None
    if params.equal_work:
        target = int(slot_totals(arr, chunk_size, slots, read_workers, params, epoch, order).max())
    return [_plan_slot(arr, chunk_size, s, slots, read_workers, params, epoch, order, target)
            for s in range(slots)]
