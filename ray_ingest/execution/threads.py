"""``decode.compute: threads``: read and decode in the consumer's process, on a thread pool.

On a small node the consumer's own cores are all there is, and Ray's decode actors add what a
2-core machine feels: more processes, each block serialized into the object store and read back,
and Ray Data's executor and iterator threads in the driver (docs/benchmarks.md, "Where the cores
go"). Pillow releases the GIL while it decodes and resizes, so threads in this process use the
cores without any of that. Items are read and decoded ``threads`` at a time, a bounded number
ahead, and handed out in stream order: the rows are exactly those of the Ray edge (the same
read and decode code), so plans, padding, skips and resume are unchanged. What it gives up is
what Ray is for: decode nodes, elastic pools, a crashing decoder isolated from the trainer, and
Python-heavy decode that holds the GIL. No Ray, no torch.
"""

from __future__ import annotations

import collections
import os
import queue
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.columns import ACTOR, SEQ
from ray_ingest.config import Config, DecodeConfig
from ray_ingest.decode.sizing import block_rows
from ray_ingest.errors import StallError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.plan.epoch import ReadItem

Block = dict[str, np.ndarray]

#: ``__actor__`` of rows decoded by the consumer's threads (no decode actor).
THREAD_ACTOR = "decode-threads"
#: Read items read and decoded ahead per thread (their units are decoded in stream order).
AHEAD_PER_THREAD = 2


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's or Ray's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def decode_threads(dc: DecodeConfig, node_pipelines: int = 1) -> int:
    """``decode.threads``, or the usable cores shared by the ``node_pipelines`` pipelines that
    decode on this node (several ranks on one node must not each assume they own it), at least
    one: twice them in the trainer's own process (``threads``: a thread waiting for the GIL
    leaves its core to the trainer's), once as ``process`` companions (one decoder each).
    Both measured: docs/benchmarks.md."""
    per_core = 1 if dc.compute == "process" else 2
    return dc.threads or max(1, per_core * usable_cores() // max(1, node_pipelines))


def resolve_compute(dc: DecodeConfig, nodes: int | None, cores: int) -> str:
    """``decode.compute``, ``auto`` resolved: decode off the trainer's process whenever Ray is
    up; ``threads`` only without a running Ray.

    Args:
        dc: the decode settings.
        nodes: alive nodes of the Ray cluster (None: no Ray running, this machine alone).
        cores: cores this process may use (:func:`usable_cores`).

    On a small one-node cluster (at most ``decode.small_node_cores`` cores) ``process``: the
    rank's companion processes on its node, no object-store hop to another node and no pool
    start-up per actor, and the trainer's step keeps its cores and its GIL (threads in the
    trainer slowed a train step 1.64× against 1.05× for ``process``, docs/benchmarks.md).
    Elsewhere (more nodes, a larger node, or a label selector naming decode nodes) ``actors``:
    the job's elastic pool. Without Ray there is nothing to decode in but this process.
    """
    if dc.compute != "auto":
        return dc.compute
    if nodes is None:
        return "threads"
    if dc.label_selector or nodes > 1 or cores > dc.small_node_cores:
        return "actors"
    return "process"


#: What each resolved ``decode.compute`` means, in words (the job says it once per run).
COMPUTE_WORDS = {
    "threads": "decode threads inside the trainer's process (no Ray running)",
    "process": "companion decode processes on each rank's own node, off the trainer's "
               "process",
    "actors": "decode actors off the trainer's process",
    "tasks": "Ray tasks off the trainer's process, one per read item",
    "custom": "a custom execution",
}


def describe_compute(compute: str, threads: int = 1, scope: str = "job") -> str:
    """``decode.compute`` (resolved) in words, e.g. for the job's ``[train] decode:`` line."""
    words = COMPUTE_WORDS.get(compute, compute)
    if compute == "actors":
        words = ("the job's shared, elastic pool of " if scope == "job"
                 else "each rank's own elastic pool of ") + words
    if compute == "process":
        words += f", {threads} per rank"
    elif compute == "threads":
        words += f", {threads} decode thread{'s' if threads != 1 else ''}"
    return f"{compute}: {words}"


class ThreadedExecution:
    """An :class:`~ray_ingest.execution.handoff.Execution` on ``threads`` threads of this process.

    Reader threads read read items, a bounded number ahead, and submit each unit of at most a
    batch's rows (fewer where ``loader.max_block_bytes`` asks) to the decode threads as it is
    read; units are decoded several at once and handed out in stream order as each is done.
    Decoding whole items instead would hand rows out in bursts of ``threads`` items every
    ``threads`` items' decode time (as the bench's 0.4 s gaps showed), so that the boundary of an
    epoch stalls by chance. Reads have threads of their own so that a slow read (``gs://``)
    holds no decode thread and decodes never queue behind reads. All threads read and decode
    with one :class:`~ray_ingest.execution.local.LocalExecution`: a read opens its own files and the
    decoder keeps no state between calls. At most ``threads * AHEAD_PER_THREAD`` items are read
    and not yet consumed, which bounds memory at that many items' rows. An error of a unit
    re-raises, as it was, when its rows are due; a wait for one longer than
    ``loader.stall_timeout_s`` (a read that hangs) raises
    :class:`~ray_ingest.errors.StallError`, as on the Ray edge.
    """

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 metric_tags: dict[str, str] | None = None, threads: int | None = None):
        self.cfg, self.catalog = cfg, catalog
        self.items = [it for it in items if it.count > 0]
        self.threads = threads or decode_threads(cfg.decode)
        #: Rows decoded as one unit: a batch at most, so rows come out as steadily as batches.
        self.unit_rows = max(1, min(block_rows(cfg), cfg.loader.batch_size))
        self._ahead = self.threads * AHEAD_PER_THREAD
        #: Reads and decodes for every thread (the Ray edge's read and decode code).
        self._local = LocalExecution(cfg, catalog, [], metric_tags)
        self._readers: ThreadPoolExecutor | None = None
        self._decoders: ThreadPoolExecutor | None = None
        #: Items being read or consumed, in stream order, each with its units' decodes (ended
        #: by None) as they are submitted.
        self._pending: collections.deque[tuple[ReadItem, queue.SimpleQueue]] = collections.deque()
        self._next = 0
        self.closed = False
        #: Items read and consumed.
        self.read = 0

    def _read(self, item: ReadItem, units: queue.SimpleQueue) -> None:
        """Read ``item`` (in a reader thread); each unit's decode is submitted as it is read."""
        try:
            for cols in self._local.read_columns(item, self.unit_rows):
                if self.closed:
                    return
                units.put(self._decoders.submit(self._decode, cols))
        except BaseException as exc:  # re-raised in the consumer when this unit is due
            failed: Future[Block] = Future()
            failed.set_exception(exc)
            units.put(failed)
            return
        units.put(None)

    def _decode(self, cols: dict[str, list]) -> Block:
        block = self._local.decoder(cols)
        block[ACTOR] = np.full(len(block[SEQ]), THREAD_ACTOR, dtype=object)
        return block

    def _fill(self) -> None:
        if self._decoders is None:
            self._decoders = ThreadPoolExecutor(self.threads,
                                                thread_name_prefix="ray_ingest-decode")
            self._readers = ThreadPoolExecutor(self.threads, thread_name_prefix="ray_ingest-read")
        while (not self.closed and len(self._pending) < self._ahead
               and self._next < len(self.items)):
            units: queue.SimpleQueue = queue.SimpleQueue()
            self._readers.submit(self._read, self.items[self._next], units)
            self._pending.append((self.items[self._next], units))
            self._next += 1

    def start(self) -> None:
        """Begin reading and decoding the first items now (before the first block is asked for)."""
        self._fill()

    def blocks(self) -> Iterator[Block]:
        self._fill()
        timeout = self.cfg.loader.stall_timeout_s
        while self._pending and not self.closed:
            item, units = self._pending[0]
            deadline = time.monotonic() + timeout
            try:
                unit = units.get(timeout=timeout)
                block = (None if unit is None
                         else unit.result(timeout=max(0.0, deadline - time.monotonic())))
            except (queue.Empty, FutureTimeout):
                raise StallError(
                    f"no decoded block for loader.stall_timeout_s ({timeout:g} s) of waiting: "
                    f"reading or decoding {self.catalog.path(item.sid)} rows {item.start}.."
                    f"{item.start + item.count - 1} is stuck (decode.compute: threads)") from None
            if block is None:  # the item's rows are all out
                self._pending.popleft()
                self.read += 1
                self._fill()
                continue
            yield block

    def stats(self) -> str:
        return f"threads: {self.read} read items decoded on {self.threads} threads"

    def close(self) -> None:
        """Stop: queued reads and decodes are dropped, running ones finish in the background."""
        self.closed = True
        self._pending.clear()
        for pool in (self._readers, self._decoders):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
