"""Progress: what the trainer consumed, kept in the rank's :class:`ReadState`.

Every delivered batch adds its rows' stream positions (and the skips accounted with it) to the
slot's consumed ranges and counts one batch; the end of an epoch moves the state to the next
epoch on the current topology. Positions of prefetched but undelivered rows are never recorded.
No Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ray_ingest.plan.epoch import EpochPlan
from ray_ingest.plan.state import ReadState, add_positions, next_epoch, with_progress
from ray_ingest.plan.topology import Topology

Skip = tuple[int, int, str]


class Progress:
    """The rank's read state, advanced batch by batch (see module docstring)."""

    def __init__(self, state: ReadState, topology: Topology, batch_size: int):
        self.topology = topology
        self.batch_size = batch_size
        self._set(state)

    # --- state ---------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return self.state.to_dict()

    def load_state(self, doc: dict[str, Any]) -> None:
        self._set(ReadState.from_dict(doc))

    def _set(self, state: ReadState) -> None:
        self.state = state
        gen = state.current
        self._consumed = gen.consumed[self.topology.slot]
        self._step = gen.batches[self.topology.slot]

    # --- the stage -----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.state.epoch

    def step_in_epoch(self, plan: EpochPlan) -> int:
        """``step_in_epoch`` of the next batch (earlier generations' batches included)."""
        return plan.earlier_batches + self._step

    def deliver(self, positions: Iterable[int], skips: Sequence[Skip] = ()) -> None:
        """Record one delivered batch: its rows' stream positions (pads: -1) and its skips."""
        self._consumed = add_positions(self._consumed, [int(p) for p in positions if p >= 0])
        self._step += 1
        self.state = with_progress(self.state, self.topology.slot, self._consumed, self._step,
                                   skips)

    def end_epoch(self) -> None:
        """Every batch of the epoch was delivered: continue at the next epoch's start."""
        self.state = next_epoch(self.state, self.topology, self.batch_size)
        self._consumed = ()
        self._step = 0
