"""Epoch window: the rows of one execution, which reads several epochs, handed out epoch by epoch.

The execution starts when the first rows are asked for. An epoch's rows are complete when all
its planned rows arrived (positional alignment), when a row of a later epoch arrives (ordered
delivery), or when the execution ends; rows of later epochs that arrive early (unordered
delivery) wait for their epoch. No Ray, no torch: the execution is opened by a callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ray_ingest.columns import EPOCH, SEQ
from ray_ingest.execution.handoff import Block, Execution
from ray_ingest.loader.clock import StageClock
from ray_ingest.plan.epoch import EpochPlan, ReadItem


class EpochWindow:
    """See module docstring.

    Args:
        plans: the window's epoch plans, in order.
        open_execution: builds the execution reading the given items in order.
        exact: an epoch's planned row count is exact (strict alignment).
        ordered: rows arrive in stream order.
        clock: waiting for rows (and starting the execution) is counted as ``clock.wait``.
        on_stats: receives the execution's statistics when it finishes.
        on_wait: receives every wait for rows, in seconds (metrics).
    """

    def __init__(self, plans: Sequence[EpochPlan],
                 open_execution: Callable[[list[ReadItem]], Execution], *, exact: bool,
                 ordered: bool, clock: StageClock | None = None,
                 on_stats: Callable[[str], Any] | None = None,
                 on_wait: Callable[[float], Any] | None = None):
        self.plans = list(plans)
        self.exact, self.ordered = exact, ordered
        self._open = open_execution
        self._clock = clock or StageClock()
        #: Where the window counts its waits (and the batches made from it their assembly).
        self.clock = self._clock
        self._on_stats = on_stats
        self._on_wait = on_wait
        self._execution: Execution | None = None
        self._blocks: Iterator[Block] | None = None
        self._ahead: dict[int, list[Block]] = {}
        self._ended = self._closed = False

    def blocks_of(self, plan: EpochPlan) -> Iterator[Block]:
        """The rows of ``plan``'s epoch, as they arrive; ends when the epoch's rows are in."""
        if not plan.items or self._closed:
            return
        seen = 0
        for part in self._ahead.pop(plan.epoch, []):
            seen += len(part[SEQ])
            yield part
        while not (self.exact and seen >= plan.samples):
            block = self._next()
            if block is None:
                return
            later = False
            for epoch, part in split_by_epoch(block):
                if epoch == plan.epoch:
                    seen += len(part[SEQ])
                    yield part
                elif epoch > plan.epoch:
                    self._ahead.setdefault(epoch, []).append(part)
                    later = True
                else:
                    raise RuntimeError(f"rows of epoch {epoch} arrived after it ended "
                                       f"(now in epoch {plan.epoch}): a planning bug")
            if later and self.ordered:
                return
        if plan is self.plans[-1] and self._execution is not None and self._next() is not None:
            # all planned rows are in: the execution must end (and report its statistics)
            raise RuntimeError(f"epoch {plan.epoch}: more rows than planned: a planning bug")

    def open(self) -> None:
        """Build and start the execution now (it reads ahead of the first request)."""
        if self._blocks is None and not self._closed and any(p.items for p in self.plans):
            self._execution = self._open([it for p in self.plans for it in p.items])
            self._blocks = self._execution.blocks()
            start = getattr(self._execution, "start", None)
            if start is not None:
                start()

    def _next(self) -> Block | None:
        if self._ended:
            return None
        t0 = time.perf_counter()
        try:
            if self._blocks is None:
                # building and starting the execution blocks the train loop too
                self.open()
            block = next(self._blocks, None)
        finally:
            waited = time.perf_counter() - t0
            self._clock.wait += waited
            if self._on_wait is not None:
                self._on_wait(waited)
        if block is None:
            self._ended = True
            stats = self._execution.stats() if self._on_stats is not None else None
            if stats:
                self._on_stats(stats)
        return block

    def close(self) -> None:
        """Stop the execution (idempotent); an abandoned one would keep reading and decoding."""
        if self._execution is not None and not self._closed:
            self._execution.close()
        self._closed = True

    def __del__(self) -> None:
        self.close()


def split_by_epoch(block: Block) -> list[tuple[int, Block]]:
    """A block split by its ``__epoch__`` column (the blocks of one read item hold one epoch)."""
    epochs = block[EPOCH]
    if not len(epochs):
        return []
    if (epochs == epochs[0]).all():
        return [(int(epochs[0]), block)]
    out = []
    for e in dict.fromkeys(epochs.tolist()):
        idx = np.flatnonzero(epochs == e)
        out.append((int(e), {k: v[idx] for k, v in block.items()}))
    return out
