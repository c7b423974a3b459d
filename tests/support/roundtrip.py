"""The one checkpoint round-trip helper every stateful stage of the loader is run through.

A *scenario* is a list of steps, each a function of the stage returning what it produced
(``None`` for nothing). :func:`run_save_load` runs the scenario uninterrupted, then stops it at
**every position** (before the first step, after each step): it runs it up to there, saves the
stage's state through JSON (what a checkpoint file keeps), restores it into a freshly made stage
and runs the rest. What both halves produced must equal the uninterrupted run, and so must the
final state. The caller names where its positions fall (``initial``, ``mid-epoch``,
``end-of-epoch``: after the epoch's last step, ``next-epoch``: inside the following epoch) so
that every scenario is checked to cover all four.

Stages that hold rows they have not handed on (the batcher's partial batch, the window's rows
of a later epoch) leave those out of their state: a restored run reads them again. Such a stage
is run inside a :class:`Replay` node, which stands for the plan: it hands the stage the rows of
a fixed stream that are not consumed yet, and the rows the stage hands on are consumed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ray_ingest.columns import PAD, SEQ
from ray_ingest.loader.stateful import Stateful

Step = Callable[[Any], Any]
POINTS = ("initial", "mid-epoch", "end-of-epoch", "next-epoch")


def through_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def run_save_load(make: Callable[[], Stateful], steps: Sequence[Step],
                  points: Mapping[str, int]) -> dict[int, tuple[list[Any], list[Any]]]:
    """Stop, save, restore and finish at every position ``0..len(steps)``.

    ``points`` names the positions of the four kinds (name -> steps run before saving).
    Returns, per position, what the stage produced before and after the restore.
    """
    assert set(points) == set(POINTS), f"stop points: expected {POINTS}, got {sorted(points)}"
    assert all(0 <= k <= len(steps) for k in points.values()), points
    assert len(set(points.values())) == len(POINTS), f"the four points coincide: {points}"
    full_stage = make()
    full = [step(full_stage) for step in steps]
    final = through_json(full_stage.get_state())
    out = {}
    for k in range(len(steps) + 1):
        first = make()
        before = [step(first) for step in steps[:k]]
        saved = through_json(first.get_state())
        second = make()
        second.load_state(saved)
        assert through_json(second.get_state()) == saved, f"{k}: load_state/get_state differ"
        after = [step(second) for step in steps[k:]]
        assert before + after == full, f"stopped after {k} steps: resumed output differs"
        assert through_json(second.get_state()) == final, f"stopped after {k} steps: final state"
        out[k] = (before, after)
    return out


Block = dict[str, np.ndarray]


class Replay:
    """A stage fed from a fixed stream of row blocks, as the loader feeds it from the plan.

    ``stream`` holds the epochs' blocks in order; every row has a distinct ``__seq__``. A step
    (:meth:`feed`) hands the stage the next block of unconsumed rows and marks the rows of what
    it hands on (``consumed(output)``) consumed. The node's state is the consumed positions and
    the stage's own state; restored, it hands on only the rows not consumed, in order, which is
    what the plan re-reads after a real restore.

    Args:
        stage: the stage (a fresh one per node).
        stream: ``[(epoch, block), ...]`` in stream order.
        consumed: the stream positions an output consumed (pads and padding excluded).
    """

    def __init__(self, stage: Stateful, stream: Sequence[tuple[int, Block]],
                 consumed: Callable[[Any], list[tuple[int, int]]]):
        self.stage, self.stream, self._consumed = stage, list(stream), consumed
        self.done: set[tuple[int, int]] = set()
        self._next = 0

    def pending(self, before: int | None = None) -> tuple[int, Block] | None:
        """The next block of unconsumed rows among the stream's blocks up to ``before``
        (exclusive; default: all); None when there is none."""
        end = len(self.stream) if before is None else min(before, len(self.stream))
        while self._next < end:
            epoch, block = self.stream[self._next]
            self._next += 1
            keep = np.array([(epoch, int(s)) not in self.done for s in block[SEQ]], dtype=bool)
            if keep.any():
                return epoch, {k: v[keep] for k, v in block.items()}
        return None

    def record(self, output: Any) -> Any:
        """Mark what ``output`` consumed; returns ``output``."""
        self.done.update(self._consumed(output))
        return output

    def get_state(self) -> dict[str, Any]:
        return {"consumed": sorted(self.done), "stage": self.stage.get_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.done = {(int(e), int(s)) for e, s in state["consumed"]}
        self._next = 0
        self.stage.load_state(state["stage"])


def consumed_rows(epoch: int, block: Block) -> list[tuple[int, int]]:
    """``(epoch, seq)`` of a block's real rows (not planned padding)."""
    return [(epoch, int(s)) for s, p in zip(block[SEQ], block[PAD], strict=True)
            if s >= 0 and not p]


class LoaderNode:
    """A loader taken batch by batch over ``epochs`` epochs (a trainer's loop) as a stage of
    :func:`run_save_load`: a step is :meth:`next`, the batch reduced by ``record(epoch,
    batch)`` to something comparable."""

    def __init__(self, loader: Any, epochs: int, record: Callable[[int, Any], Any]):
        self.loader, self.epochs, self.record = loader, epochs, record
        self._batches = self._iterate()

    def _iterate(self):
        for epoch, batches in self.loader.epochs(self.epochs):
            for b in batches:
                yield self.record(epoch, b)

    @staticmethod
    def next(node: LoaderNode) -> Any:
        return next(node._batches, None)

    def get_state(self) -> dict[str, Any]:
        return self.loader.get_state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.loader.load_state(state)
        self._batches = self._iterate()
