"""Lockstep expansion of twin tars into aligned samples.

One iterator of :class:`~ray_ingest.tario.Member` per modality goes in; aligned rows come out.
The first modality drives. Three alignment modes (design.md, "Alignment modes"):

``strict`` (default)
    Members pair by position and their keys must be equal. The first disagreement raises
    :class:`AlignmentError` naming the shard, the position and every modality's key. Two
    different keys are never emitted as one sample (PiD's silent ``zip`` did exactly that).
``merge``
    A prepare-free merge-join: every driver key present in all required modalities is emitted,
    in driver order. Secondaries are read forward with a bounded look-ahead buffer, so
    reordered members still match. Missing, extra, duplicated and orphaned members are skipped
    and counted per modality and reason in :class:`AlignStats` (and logged).
``index``
    A key list (PiD's ``sample_keys_full_list``) is the driver: it fixes order and membership;
    every modality is matched against it like a merge secondary. An empty index ends at once.

Optional modalities may lack a sample; their column is then None.

No Ray, no torch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from ray_ingest import columns
from ray_ingest.errors import AlignmentError, ConfigError
from ray_ingest.tario import Member

log = logging.getLogger(__name__)

AlignMode = Literal["strict", "merge", "index"]
ALIGN_MODES: tuple[str, ...] = ("strict", "merge", "index")
#: Reasons counted by :class:`AlignStats`.
REASONS = ("missing", "extra", "duplicate", "orphan", "reordered", "unnamed", "evicted")
#: Look-ahead members buffered per secondary modality in merge/index mode.
DEFAULT_WINDOW = 100_000

KEY, SHARD, INDEX = columns.KEY, columns.SHARD, columns.INDEX
ext_column = columns.ext_column


@attrs.define
class AlignStats:
    """Per-modality, per-reason counters of what alignment skipped or tolerated."""

    counts: dict[str, dict[str, int]] = attrs.field(factory=dict)
    emitted: int = 0

    def add(self, modality: str, reason: str, n: int = 1) -> None:
        per = self.counts.setdefault(modality, {})
        per[reason] = per.get(reason, 0) + n

    def get(self, modality: str, reason: str) -> int:
        return self.counts.get(modality, {}).get(reason, 0)

    def merge(self, other: AlignStats) -> None:
        self.emitted += other.emitted
        for m, per in other.counts.items():
            for r, n in per.items():
                self.add(m, r, n)

    def to_dict(self) -> dict[str, Any]:
        counts = {m: {r: n for r, n in p.items() if n} for m, p in self.counts.items()}
        return {"emitted": self.emitted, "counts": {m: p for m, p in counts.items() if p}}


def check_align(align: str) -> None:
    if align not in ALIGN_MODES:
        raise ConfigError(f"align: expected one of {', '.join(ALIGN_MODES)}, got {align!r}")


def _named(members: Iterable[Member], modality: str, stats: AlignStats) -> Iterator[Member]:
    for m in members:
        if m.key is None:
            stats.add(modality, "unnamed")
            continue
        yield m


def _row(shard: str, key: str, index: int, picked: Mapping[str, Member | None]) -> dict[str, Any]:
    row: dict[str, Any] = {KEY: key, SHARD: shard, INDEX: index}
    for modality, member in picked.items():
        row[modality] = None if member is None else member.data
        row[ext_column(modality)] = None if member is None else member.ext
    return row


def expand(
    shard: str,
    streams: Mapping[str, Iterable[Member]],
    *,
    align: str = "strict",
    optional: Iterable[str] = (),
    index_keys: Sequence[str] | None = None,
    first_index: int = 0,
    limit: int | None = None,
    skip_keys: Iterable[str] = (),
    stats: AlignStats | None = None,
    window: int = DEFAULT_WINDOW,
) -> Iterator[dict[str, Any]]:
    """Expand one twin shard into sample rows.

    Args:
        shard: the shard's ``data_list`` path (``__shard__`` and error messages).
        streams: modality -> members, in modality order; the first modality drives (strict,
            merge). Each stream must already be positioned at sample ``first_index`` for strict
            mode; for merge the driver is positioned and secondaries start at the beginning.
        align: ``strict`` | ``merge`` | ``index``.
        optional: modalities that may lack a sample (column None).
        index_keys: the key list for ``index`` mode (already restricted to this shard).
        first_index: ``__index__`` of the first sample read (resume / slice start).
        limit: stop after this many emitted samples.
        skip_keys: (merge) driver keys before ``first_index``, so secondaries drop them quietly.
        stats: counters to update; a fresh one is used when None.
        window: look-ahead members buffered per secondary in merge/index mode.
    """
    check_align(align)
    stats = stats if stats is not None else AlignStats()
    modalities = list(streams)
    if not modalities:
        raise ConfigError("modalities: expected at least one, got none")
    optional = frozenset(optional)
    if align == "strict":
        gen = _strict(shard, streams, modalities, optional, first_index, stats)
    elif align == "merge":
        gen = _merge(shard, streams, modalities, optional, first_index, stats, window,
                     frozenset(skip_keys))
    else:
        if index_keys is None:
            raise ConfigError("index_keys: align='index' needs a key list, got None")
        gen = _indexed(shard, streams, modalities, optional, index_keys, first_index, stats, window)
    if limit is None:
        yield from gen
        return
    if limit <= 0:
        return
    for n, row in enumerate(gen, start=1):
        yield row
        if n >= limit:
            return


def _strict(
    shard: str,
    streams: Mapping[str, Iterable[Member]],
    modalities: list[str],
    optional: frozenset[str],
    first_index: int,
    stats: AlignStats,
) -> Iterator[dict[str, Any]]:
    driver = modalities[0]
    required = [m for m in modalities if m not in optional or m == driver]
    iters = {m: _named(streams[m], m, stats) for m in modalities}
    pending: dict[str, Member | None] = {m: None for m in modalities if m not in required}
    position = first_index
    while True:
        picked: dict[str, Member | None] = {m: next(iters[m], None) for m in required}
        if all(v is None for v in picked.values()):
            break
        keys = {m: (v.key if v is not None else None) for m, v in picked.items()}
        key = keys[driver]
        if key is None or any(k != key for k in keys.values()):
            desc = ", ".join(f"{m}={k if k is not None else '<end of tar>'}" for m, k in keys.items())
            raise AlignmentError(f"shard {shard}: modalities disagree at position {position}: {desc}")
        for m in pending:
            if pending[m] is None:
                pending[m] = next(iters[m], None)
            cand = pending[m]
            if cand is not None and cand.key == key:
                picked[m] = cand
                pending[m] = None
            else:
                picked[m] = None
        stats.emitted += 1
        yield _row(shard, key, position, {m: picked[m] for m in modalities})
        position += 1
    for m, cand in pending.items():
        if cand is None:
            cand = next(iters[m], None)  # a member after the last match is unmatched too
        if cand is not None:
            raise AlignmentError(
                f"shard {shard}: optional modality {m} has member {cand.key} (after position "
                f"{position}) that no {driver} sample matches"
            )


class _Cursor:
    """Forward reader of one secondary modality with a bounded look-ahead buffer."""

    def __init__(self, modality: str, members: Iterator[Member], stats: AlignStats, window: int,
                 passed: frozenset[str]):
        self.modality = modality
        self.members = members
        self.stats = stats
        self.window = window
        self.passed = passed
        self.buf: OrderedDict[str, Member] = OrderedDict()
        self.seen: set[str] = set()
        self.done = False
        #: Stream position of each buffered member, and the highest position taken so far:
        #: a member taken behind it was out of driver order ("reordered").
        self.seq: dict[str, int] = {}
        self.read = 0
        self.max_taken = -1

    def find(self, key: str) -> bool:
        """Read forward until ``key`` is buffered; False when the stream ends without it."""
        if key in self.buf:
            return True
        while not self.done:
            m = next(self.members, None)
            if m is None:
                self.done = True
                break
            if m.key in self.seen:
                self.stats.add(self.modality, "duplicate")
                log.info("skip duplicate %s member %s", self.modality, m.name)
                continue
            self.seen.add(m.key)
            if m.key in self.passed:
                continue  # belongs to a sample before the resume point
            self.seq[m.key] = self.read
            self.read += 1
            if m.key == key:
                self.buf[key] = m
                return True
            self.buf[m.key] = m
            if len(self.buf) > self.window:
                old_key, old = self.buf.popitem(last=False)
                del self.seq[old_key]
                self.stats.add(self.modality, "evicted")
                log.warning("look-ahead window of %s full: dropped %s", self.modality, old.name)
        return False

    def take(self, key: str) -> Member:
        seq = self.seq.pop(key)
        if seq < self.max_taken:
            self.stats.add(self.modality, "reordered")  # stored ahead of a later-taken member
        else:
            self.max_taken = seq
        return self.buf.pop(key)

    def finish(self, driver_keys: set[str]) -> None:
        """Drain the stream and classify leftovers (only called once the driver is exhausted)."""
        while self.find("\0never\0"):
            pass
        for key in self.buf:
            reason = "orphan" if key in driver_keys else "extra"
            self.stats.add(self.modality, reason)
            log.info("skip %s member %s of %s", reason, key, self.modality)
        self.buf.clear()
        self.seq.clear()


def _merge(
    shard: str,
    streams: Mapping[str, Iterable[Member]],
    modalities: list[str],
    optional: frozenset[str],
    first_index: int,
    stats: AlignStats,
    window: int,
    passed: frozenset[str],
) -> Iterator[dict[str, Any]]:
    driver = modalities[0]
    cursors = {
        m: _Cursor(m, _named(streams[m], m, stats), stats, window, passed) for m in modalities[1:]
    }
    state = {"exhausted": False}

    def driver_keys() -> Iterator[tuple[int, str, Member | None]]:
        pos = first_index
        for member in streams[driver]:
            if member.key is None:
                stats.add(driver, "unnamed")
            else:
                yield pos, member.key, member
            pos += 1
        state["exhausted"] = True

    yield from _join_tracking(shard, driver_keys(), driver, cursors, modalities, optional, stats,
                              state)


def _join_tracking(
    shard: str,
    keys_iter: Iterator[tuple[int, str, Member | None]],
    driver: str | None,
    cursors: dict[str, _Cursor],
    modalities: list[str],
    optional: frozenset[str],
    stats: AlignStats,
    state: dict[str, bool],
) -> Iterator[dict[str, Any]]:
    """Emit driver keys found in every required cursor; classify leftovers at the end."""
    seen: set[str] = set()
    for position, key, driver_member in keys_iter:
        if key in seen:
            stats.add(driver or "index", "duplicate")
            log.info("skip duplicate %s key %s in shard %s", driver or "index", key, shard)
            continue
        seen.add(key)
        lacking = [m for m, c in cursors.items() if m not in optional and not c.find(key)]
        if lacking:
            for m in lacking:
                stats.add(m, "missing")
            log.info("shard %s: skip key %s (missing in %s)", shard, key, ",".join(lacking))
            continue
        picked: dict[str, Member | None] = {}
        for m in modalities:
            if m == driver:
                picked[m] = driver_member
                continue
            cursor = cursors[m]
            if not cursor.find(key):
                picked[m] = None  # optional modality without this sample
                continue
            picked[m] = cursor.take(key)
        stats.emitted += 1
        yield _row(shard, key, position, picked)
    if state["exhausted"]:
        for c in cursors.values():
            c.finish(seen)


def _indexed(
    shard: str,
    streams: Mapping[str, Iterable[Member]],
    modalities: list[str],
    optional: frozenset[str],
    index_keys: Sequence[str],
    first_index: int,
    stats: AlignStats,
    window: int,
) -> Iterator[dict[str, Any]]:
    if not index_keys:
        return
    cursors = {
        m: _Cursor(m, _named(streams[m], m, stats), stats, window, frozenset()) for m in modalities
    }
    state = {"exhausted": False}

    def keys() -> Iterator[tuple[int, str, Member | None]]:
        for pos in range(first_index, len(index_keys)):
            yield pos, index_keys[pos], None
        state["exhausted"] = True

    yield from _join_tracking(shard, keys(), None, cursors, modalities, optional, stats, state)
