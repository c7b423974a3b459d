"""Failures injected into a training job on purpose (``jobs/train.py --fail-at-step``), for the
fault tests and benchmarks: once per run, on one rank, right after a checkpoint was reported.

Kept out of the train loop itself: the loop calls :meth:`InjectedFailure.after_checkpoint`,
which does nothing unless a failure was asked for.
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs


@attrs.frozen
class InjectedFailure:
    """Fail once after ``step``'s checkpoint on ``rank`` (None: the last rank).

    ``marker`` is a file recording that the failure happened, so the restarted attempt runs
    through; ``hard`` exits the process at once (a node or OOM kill) instead of raising.
    """

    step: int | None = None
    marker: str | None = None
    rank: int | None = None
    hard: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> InjectedFailure:
        return cls(config.get("fail_at_step"), config.get("fail_marker"),
                   config.get("fail_rank"), bool(config.get("fail_hard")))

    def after_checkpoint(self, step: int, rank: int, world: int) -> None:
        """Fail here if this is the step and the rank, and it has not failed yet."""
        if (self.step is None or step != self.step or not self.marker
                or rank != (world - 1 if self.rank is None else self.rank)
                or os.path.exists(self.marker)):
            return
        with open(self.marker, "w") as f:
            f.write(str(step))
        if self.hard:
            # Ray Train's controller registers a reported checkpoint when it next polls the
            # workers: give it that poll, then die at once (without the wait a fast pipeline
            # died before any checkpoint was registered, and the group restarted from scratch).
            time.sleep(2.0)
            os._exit(17)
        raise RuntimeError(f"injected failure after step {step}")
