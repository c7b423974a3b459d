"""Accounting: a decoded block's instrumentation columns, taken off before it is batched.

Read and decode seconds and bytes go into the rank's :class:`~ray_ingest.loader.clock.StageClock`;
which decode actors delivered rows (the pool's, not the head start's or the decode threads')
and which nodes read and decoded them are kept for the metrics and the placement checks. No
Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from ray_ingest.columns import ACTOR, BYTES, NODE, READ_NODE, T_DECODE, T_READ
from ray_ingest.execution.headstart import HEAD_ACTOR
from ray_ingest.execution.threads import THREAD_ACTOR
from ray_ingest.loader.clock import StageClock

Block = dict[str, np.ndarray]
#: ``__actor__`` values that name no actor of a decode pool.
NOT_POOL = frozenset({HEAD_ACTOR, THREAD_ACTOR})


class BlockAccount:
    """Takes a block's instrumentation columns off (a callable on blocks).

    Args:
        clock: receives read and decode seconds and bytes read.
        on_actors: receives the pool's actor ids of every block (metrics).
    """

    def __init__(self, clock: StageClock, on_actors: Callable[[Iterable[str]], None]):
        self.clock, self.on_actors = clock, on_actors
        #: Decode actors of a pool that delivered rows.
        self.actors_seen: set[str] = set()
        #: Samples decoded / read per Ray node id, as reported by the decode actors and read
        #: tasks themselves (``__node__`` / ``__read_node__``).
        self.decode_nodes: dict[str, int] = {}
        self.read_nodes: dict[str, int] = {}

    def __call__(self, block: Block) -> Block:
        actors = block.pop(ACTOR, None)
        if actors is not None and len(actors):
            ids = [a for a in actors.tolist() if a not in NOT_POOL]
            if ids:
                self.actors_seen.update(ids)
                self.on_actors(ids)
        _count_nodes(self.decode_nodes, block.pop(NODE, None))
        _count_nodes(self.read_nodes, block.pop(READ_NODE, None))
        sizes = block.pop(BYTES, None)
        if sizes is not None:
            self.clock.bytes_read += int(sizes.sum())
        self.clock.read += float(block.pop(T_READ).sum())
        self.clock.decode += float(block.pop(T_DECODE).sum())
        return block


def _count_nodes(counts: dict[str, int], nodes: np.ndarray | None) -> None:
    if nodes is None or not len(nodes):
        return
    for node, n in zip(*np.unique(nodes.astype(str), return_counts=True), strict=True):
        counts[str(node)] = counts.get(str(node), 0) + int(n)
