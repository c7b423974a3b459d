"""Skip filter: takes samples the read or decode stage gave up on (``on_error=skip``) out of the
stream, logs and counts them by kind, and enforces the skip budgets.

Samples a user hook dropped (kind ``filtered``) go the same way, counted and recorded, but they
are no failure: they stay outside the budgets and are logged at debug level.

A skipped sample is *consumed* with the next batch delivered after it (its stream position and
``(shard id, index, reason)`` go into the read state then), so a run stopped in between skips it
again after resuming — the same skip, the same budget. No Ray, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ray_ingest.columns import ERROR, INDEX, KEY, SEQ, SID
from ray_ingest.errors import SkipBudgetExceeded
from ray_ingest.loader.stateful import require

log = logging.getLogger(__name__)

Skip = tuple[int, int, str]  # (shard id, index, reason)
#: The kind of a sample a user hook dropped (ray_ingest.decode.decoder.FILTERED).
FILTERED = "filtered"


def skip_kind(reason: str) -> str:
    """``SampleError`` / ``read/TarFormatError``: the failure class named by a skip reason."""
    parts = reason.split(": ", 2)
    return f"read/{parts[1]}" if parts[0] == "read" and len(parts) > 1 else parts[0]


@attrs.define
class SkipFilter:
    """Per-epoch skip accounting of one rank (see module docstring).

    Args:
        max_per_shard: budget of skips in one shard (None: unlimited).
        max_per_epoch: budget of skips in one epoch (None: unlimited).
        shard_name: shard id -> its path, for messages.
        rank: for log lines.
    """

    max_per_shard: int | None
    max_per_epoch: int | None
    shard_name: Callable[[int], str]
    rank: int = 0
    #: Called with the failure kind of every skip (metrics).
    on_skip: Callable[[str], Any] | None = None
    epoch: int = 0
    #: Skips of the epoch already accounted in the read state.
    accounted: tuple[Skip, ...] = ()
    #: Skips seen since the last delivered batch: (stream position, skip).
    pending: list[tuple[int, Skip]] = attrs.field(factory=list)
    #: Skips by failure kind since this filter was built (all epochs).
    by_kind: dict[str, int] = attrs.field(factory=dict)
    _in_epoch: int = 0
    _in_shard: dict[int, int] = attrs.field(factory=dict)

    # --- state ---------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The epoch and its accounted skips (pending ones are re-met after a resume)."""
        return {"epoch": self.epoch, "skips": [list(s) for s in self.accounted]}

    def load_state(self, state: dict[str, Any]) -> None:
        """Start (or resume) an epoch whose accounted skips are ``state["skips"]``."""
        self.epoch, skips = require(state, "SkipFilter", "epoch", "skips")
        self.accounted = tuple((int(a), int(b), str(c)) for a, b, c in skips)
        self.pending = []
        failed = [s for s in self.accounted if skip_kind(s[2]) != FILTERED]
        self._in_epoch = len(failed)
        self._in_shard = {}
        for sid, _, _ in failed:
            self._in_shard[sid] = self._in_shard.get(sid, 0) + 1

    def start_epoch(self, epoch: int) -> None:
        """Begin an epoch with no skips yet."""
        self.load_state({"epoch": epoch, "skips": []})

    # --- the stage -----------------------------------------------------------------------
    def __call__(self, block: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``block`` without its failed rows (recorded as pending skips)."""
        errors = block[ERROR]
        bad = np.flatnonzero(errors != "") if len(errors) else ()
        if not len(bad):
            return block
        for i in bad:
            sid, idx, reason = int(block[SID][i]), int(block[INDEX][i]), str(errors[i])
            kind = skip_kind(reason)
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            if self.on_skip is not None:
                self.on_skip(kind)
            log.log(logging.DEBUG if kind == FILTERED else logging.WARNING,
                    "rank %d: skip shard %s key %s index %d: %s", self.rank,
                    self.shard_name(sid), block[KEY][i] or "?", idx, reason)
            self.pending.append((int(block[SEQ][i]), (sid, idx, reason)))
            if kind == FILTERED:
                continue
            self._in_epoch += 1
            self._in_shard[sid] = self._in_shard.get(sid, 0) + 1
            self._check_budget(sid, reason)
        good = np.flatnonzero(errors == "")
        return {k: v[good] for k, v in block.items()}

    def count(self, skips: list[Skip]) -> None:
        """Count skips another rank filtered (a group share's follower): kinds and metrics."""
        for _, _, reason in skips:
            kind = skip_kind(reason)
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            if self.on_skip is not None:
                self.on_skip(kind)

    def drain(self) -> tuple[list[int], list[Skip]]:
        """Stream positions and skips to account with the batch being delivered."""
        positions = [p for p, _ in self.pending]
        skips = [s for _, s in self.pending]
        self.pending = []
        self.accounted = tuple(sorted({*self.accounted, *skips}))
        return positions, skips

    def _check_budget(self, sid: int, reason: str) -> None:
        in_shard = self._in_shard[sid]
        if self.max_per_shard is not None and in_shard > self.max_per_shard:
            raise SkipBudgetExceeded(
                f"shard {self.shard_name(sid)}: {in_shard} samples skipped, over "
                f"loader.max_skips_per_shard ({self.max_per_shard}); last: {reason}")
        if self.max_per_epoch is not None and self._in_epoch > self.max_per_epoch:
            raise SkipBudgetExceeded(
                f"epoch {self.epoch}: {self._in_epoch} samples skipped, over "
                f"loader.max_skips_per_epoch ({self.max_per_epoch}); last: {reason} "
                f"(shard {self.shard_name(sid)})")

