"""The one checkpoint round-trip helper every stateful stage of the stream is run through.

A *scenario* is a list of steps, each a function of the stage returning what it produced
(``None`` for nothing). :func:`run_save_load` runs the scenario uninterrupted, then for every
stop point runs it up to there, saves the stage's state through JSON (what a checkpoint file
keeps), restores it into a fresh stage and runs the rest. What both halves produced must equal
the uninterrupted run, and so must the final state. Stop points: ``initial`` (before the first
step), ``mid-epoch``, ``end-of-epoch`` (after the epoch's last step, before the next epoch
begins) and ``next-epoch`` (inside the following epoch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol


class Stateful(Protocol):
    def get_state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


Step = Callable[[Any], Any]
POINTS = ("initial", "mid-epoch", "end-of-epoch", "next-epoch")


def through_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def run_save_load(make: Callable[[], Stateful], steps: Sequence[Step],
                  points: Mapping[str, int]) -> dict[str, tuple[list[Any], list[Any]]]:
    """Check every stop point of ``points`` (name -> number of steps run before saving).

    Returns, per point, what the stage produced before and after the restore.
    """
    assert set(points) == set(POINTS), f"stop points: expected {POINTS}, got {sorted(points)}"
    full_stage = make()
    full = [step(full_stage) for step in steps]
    final = through_json(full_stage.get_state())
    out = {}
    for name, k in points.items():
        assert 0 <= k <= len(steps), (name, k)
        first = make()
        before = [step(first) for step in steps[:k]]
        saved = through_json(first.get_state())
        second = make()
        second.load_state(saved)
        assert through_json(second.get_state()) == saved, f"{name}: load_state/get_state differ"
        after = [step(second) for step in steps[k:]]
        assert before + after == full, f"{name}: resumed output differs from the uninterrupted run"
        assert through_json(second.get_state()) == final, f"{name}: final state differs"
        out[name] = (before, after)
    return out
