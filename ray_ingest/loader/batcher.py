"""Bucket batcher: rows of one epoch -> batches of exactly ``batch_size`` rows, one aspect bucket
per batch, padded so every rank of the epoch delivers the same number of batches.

Rows arrive in stream order as column blocks (dicts of numpy arrays). Full batches leave as soon
as a bucket holds ``batch_size`` rows; at the end of the epoch's rows each bucket's partial batch
is filled with marked duplicates of its own rows, then pad-only batches (duplicates of the
epoch's first rows seen) make up the planned batch count. Padding rows carry ``__seq__ = -1``
(not a consumption) and ``__pad__ = True``. Whatever the batcher holds when a run stops is
unconsumed and read again after a resume: its state is only the batches it still owes the
epoch. No Ray, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from ray_ingest.columns import BUCKET, PAD, SEQ
from ray_ingest.loader.stateful import require

log = logging.getLogger(__name__)

Block = dict[str, np.ndarray]


def _rows(block: Block) -> int:
    return len(block[SEQ])


def concat(parts: list[Block]) -> Block:
    """The rows of ``parts`` in order, column by column (every column of any part)."""
    n = [_rows(p) for p in parts]
    keys = dict.fromkeys(k for p in parts for k in p)
    return {k: _concat_column([p.get(k) for p in parts], n) for k in keys}


def _concat_column(cols: list[np.ndarray | None], n: list[int]) -> np.ndarray:
    """One column of several blocks: concatenated where every block has it with one dtype and
    row shape (stacked arrays, numbers); else an object array of the rows (a block without the
    column: None), e.g. one block's stacked masks next to another's list of varying shapes."""
    present = [c for c in cols if c is not None]
    if len(present) == len(cols) and all(
            c.dtype == present[0].dtype and c.shape[1:] == present[0].shape[1:]
            for c in present):
        return present[0].copy() if len(present) == 1 else np.concatenate(present)
    out = np.empty(sum(n), dtype=object)
    i = 0
    for c, rows in zip(cols, n, strict=True):
        if c is not None:
            for j in range(rows):
                out[i + j] = c[j]
        i += rows
    return out


class BucketBatcher:
    """See module docstring.

    Args:
        batch_size: rows per batch.
        bucketing: group rows by their ``__bucket__`` (aspect buckets); else one group.
    """

    def __init__(self, batch_size: int, bucketing: bool = False):
        self.batch_size = batch_size
        self.bucketing = bucketing
        self.start_epoch(0, 0)

    def get_state(self) -> dict[str, Any]:
        """The batches still owed this epoch (held rows are unconsumed: read again)."""
        return {"remaining": self.remaining}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue an epoch that still owes ``state["remaining"]`` batches, holding nothing."""
        (remaining,) = require(state, "BucketBatcher", "remaining")
        self.start_epoch(0, int(remaining))

    def start_epoch(self, done: int, total: int) -> None:
        """Begin an epoch whose generation delivers ``total`` batches, ``done`` of them already."""
        self.remaining = max(0, total - done)
        self._parts: dict[str, list[Block]] = {}
        self._rows: dict[str, int] = {}
        #: First rows seen per bucket (in order of first appearance): the pad-only source.
        self._reservoir: list[tuple[str, Block]] = []

    def add(self, block: Block) -> Iterator[tuple[Block, str]]:
        """Take a block of rows; yield ``(batch columns, bucket)`` for every batch it completes."""
        bsz = self.batch_size
        for bucket, part in self._split(block):
            if all(b != bucket for b, _ in self._reservoir):
                self._reservoir.append((bucket, {k: v[:bsz].copy() for k, v in part.items()}))
            self._parts.setdefault(bucket, []).append(part)
            self._rows[bucket] = self._rows.get(bucket, 0) + _rows(part)
            while self._rows[bucket] >= bsz and self.remaining > 0:
                out, self._parts[bucket] = _take(self._parts[bucket], bsz)
                self._rows[bucket] -= bsz
                yield self._emit(out, bucket)

    def finish(self) -> Iterator[tuple[Block, str]]:
        """The epoch's rows are all in: yield the padded partial batches, then pad-only ones."""
        bsz = self.batch_size
        for bucket, parts in self._parts.items():  # buckets in order of first appearance
            have = self._rows.get(bucket, 0)
            if have and self.remaining > 0:
                yield self._emit(_pad(concat(parts), bsz - have, parts), bucket)
        self._parts, self._rows = {}, {}
        while self.remaining > 0:
            if not self._reservoir:
                log.warning("no sample to pad with: the epoch ends %d batches short",
                            self.remaining)
                self.remaining = 0
                break
            bucket, rows = self._reservoir[0]
            yield self._emit(_pad(rows, bsz, []), bucket)

    def _emit(self, parts: list[Block], bucket: str) -> tuple[Block, str]:
        self.remaining -= 1
        return concat(parts), bucket

    def _split(self, block: Block) -> list[tuple[str, Block]]:
        if not self.bucketing:
            return [("", block)]
        labels = block[BUCKET]
        out = []
        for b in dict.fromkeys(labels.tolist()):
            idx = np.flatnonzero(labels == b)
            out.append((b, {k: v[idx] for k, v in block.items()}))
        return out


def _take(parts: list[Block], n: int) -> tuple[list[Block], list[Block]]:
    """The first ``n`` rows of ``parts`` and the rest."""
    out: list[Block] = []
    rest: list[Block] = []
    need = n
    for p in parts:
        m = _rows(p)
        if need >= m:
            out.append(p)
            need -= m
        elif need > 0:
            out.append({k: v[:need] for k, v in p.items()})
            rest.append({k: v[need:] for k, v in p.items()})
            need = 0
        else:
            rest.append(p)
    return out, rest


def _pad(src: Block, need: int, parts: list[Block]) -> list[Block]:
    """``parts`` followed by ``need`` marked duplicates of ``src``'s rows (cycling through them).

    A partial batch pads with its own rows, a pad-only batch with the epoch's first rows seen:
    never with rows a restart may have skipped, so padding does not depend on where a run
    resumed.
    """
    out = list(parts)
    while need > 0:
        n = min(need, _rows(src))
        pad = {k: v[:n].copy() for k, v in src.items()}
        pad[SEQ] = np.full(n, -1, dtype=np.int64)
        pad[PAD] = np.ones(n, dtype=bool)
        out.append(pad)
        need -= n
    return out
