"""Lockstep expansion of twin tars into aligned samples.

One iterator of :class:`~ray_ingest.twintar.tario.Member` per modality goes in; aligned rows come
out. The first modality drives. Three alignment modes (design.md, "Alignment modes"):

``strict`` (default)
    Members pair by position and their keys must be equal. The first disagreement raises
    :class:`AlignmentError` naming the shard, the position and every modality's key. Two
    different keys are never emitted as one sample (PiD's silent ``zip`` did exactly that).
``merge``
    A prepare-free merge-join: every driver key present in all required modalities is emitted,
    in driver order. Secondaries are read forward with a bounded look-ahead buffer
    (``max_read_ahead`` members), so reordered members still match. Missing, extra, duplicated
    and orphaned members are skipped and counted per modality and reason in
    :class:`AlignStats` (and logged). A key that is not found before the buffer is full cannot
    be told from a missing one: it is an error, or under ``on_error="skip"`` a row marked
    with the error (the read state records it like any read skip). When a modality's key set
    is known up front (the sharder's key index), an absent key is declared missing at once,
    without reading ahead.
``index``
    A key list (PiD's ``sample_keys_full_list``) is the driver: it fixes order and membership;
    every modality is matched against it like a merge secondary. An empty index ends at once.

Optional modalities may lack a sample; their column is then None.

A member whose header exceeded the reader's size limit (``Member.over_limit``) was never read:
its sample is an :class:`~ray_ingest.errors.OversizedMemberError`, or under
``on_error="skip"`` a row marked with it.

No Ray, no torch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from ray_ingest import columns
from ray_ingest.errors import AlignmentError, ConfigError, IngestError, OversizedMemberError
from ray_ingest.twintar.tario import Member

log = logging.getLogger(__name__)

AlignMode = Literal["strict", "merge", "index"]
ALIGN_MODES: tuple[str, ...] = ("strict", "merge", "index")
#: Reasons counted by :class:`AlignStats`.
REASONS = ("missing", "extra", "duplicate", "orphan", "reordered", "unnamed", "beyond_read_ahead",
           "oversized")
#: Look-ahead members buffered per secondary modality in merge/index mode (``data.max_read_ahead``).
DEFAULT_READ_AHEAD = 1000
ON_ERROR = ("raise", "skip")

KEY, SHARD, INDEX = columns.KEY, columns.SHARD, columns.INDEX
#: Set (to the :class:`~ray_ingest.errors.IngestError`) in a row that stands for a sample that
#: could not be read, under ``on_error="skip"``; its modality columns are then None.
ERROR = columns.ERROR
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


def shown(text: str) -> str:
    """A key or member name as an error shows it: as is, or ``repr`` when it holds a line break
    or another character that is not printable (an error stays one line)."""
    return text if text.isprintable() else repr(text)


def _row(shard: str, key: str, index: int, picked: Mapping[str, Member | None],
         on_error: str = "raise", stats: AlignStats | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {KEY: key, SHARD: shard, INDEX: index}
    for modality, member in picked.items():
        row[modality] = None if member is None else member.data
        row[ext_column(modality)] = None if member is None else member.ext
        if member is not None and member.over_limit is not None and ERROR not in row:
            if stats is not None:
                stats.add(modality, "oversized")
            row[ERROR] = _fail(OversizedMemberError(
                f"shard {shard}: key {shown(key)}: {modality} member {shown(member.name)} is "
                f"{member.size} bytes, over the member size limit of {member.over_limit} "
                f"(decode.max_member_bytes); not read"), on_error)
    return row


def _fail(exc: IngestError, on_error: str) -> IngestError:
    """Raise ``exc``, or under ``on_error="skip"`` return it to mark the sample's row."""
    if on_error != "skip":
        raise exc
    return exc


def _error_row(shard: str, key: str, index: int, modalities: Sequence[str],
               exc: IngestError) -> dict[str, Any]:
    row = _row(shard, key, index, {m: None for m in modalities})
    row[ERROR] = exc
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
    read_ahead: int = DEFAULT_READ_AHEAD,
    on_error: str = "raise",
    known_keys: Mapping[str, frozenset[str]] | None = None,
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
        read_ahead: look-ahead members buffered per secondary in merge/index mode; a key not found
            when the buffer is full is an error (see ``on_error``).
        on_error: ``raise``: a member over the size limit, or a key beyond the look-ahead,
            raises. ``skip``: the sample's row carries the error under :data:`ERROR` (modality
            columns None) and expansion goes on.
        known_keys: (merge/index) every key a modality's tar holds, when known without reading
            it (the sharder's key index): an absent key is missing at once, no read-ahead.
    """
    check_align(align)
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error: expected one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if read_ahead < 1:
        raise ConfigError(f"read_ahead: expected a number of members >= 1, got {read_ahead!r}")
    stats = stats if stats is not None else AlignStats()
    modalities = list(streams)
    if not modalities:
        raise ConfigError("modalities: expected at least one, got none")
    optional = frozenset(optional)
    known = dict(known_keys or {})
    if align == "strict":
        gen = _strict(shard, streams, modalities, optional, first_index, stats, on_error)
    elif align == "merge":
        gen = _merge(shard, streams, modalities, optional, first_index, stats, read_ahead,
                     frozenset(skip_keys), on_error, known)
    else:
        if index_keys is None:
            raise ConfigError("index_keys: align='index' needs a key list, got None")
        gen = _indexed(shard, streams, modalities, optional, index_keys, first_index, stats,
                       read_ahead, on_error, known)
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
    on_error: str,
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
            desc = ", ".join(f"{m}={shown(k) if k is not None else '<end of tar>'}"
                             for m, k in keys.items())
            raise AlignmentError(
                f"shard {shard}: modalities disagree at position {position}: {desc}")
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
        yield _row(shard, key, position, {m: picked[m] for m in modalities}, on_error, stats)
        position += 1
    for m, cand in pending.items():
        if cand is None:
            cand = next(iters[m], None)  # a member after the last match is unmatched too
        if cand is not None:
            raise AlignmentError(
                f"shard {shard}: optional modality {m} has member {shown(cand.key)} (after "
                f"position {position}) that no {driver} sample matches"
            )


class _Cursor:
    """Forward reader of one secondary modality with a bounded look-ahead buffer."""

    def __init__(self, modality: str, members: Iterator[Member], stats: AlignStats, read_ahead: int,
                 passed: frozenset[str], known: frozenset[str] | None = None):
        self.modality = modality
        self.members = members
        self.stats = stats
        self.read_ahead = read_ahead
        self.passed = passed
        #: Every key of the tar when known up front (key index): absent keys need no read-ahead.
        self.known = known
        self.buf: OrderedDict[str, Member] = OrderedDict()
        self.seen: set[str] = set()
        self.done = False
        #: The last :meth:`find` gave up because the buffer was full (not because the key is
        #: absent): the key may still come later.
        self.full = False
        #: Stream position of each buffered member, and the highest position taken so far:
        #: a member taken behind it was out of driver order ("reordered").
        self.seq: dict[str, int] = {}
        self.read = 0
        self.max_taken = -1

    def _next(self) -> Member | None:
        """The next member not seen before and not before the resume point (None at the end)."""
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
            return m
        return None

    def find(self, key: str) -> bool:
        """Read forward until ``key`` is buffered; False when the stream ends without it, the
        key index says it is absent, or the buffer is full (then :attr:`full` is True)."""
        self.full = False
        if key in self.buf:
            return True
        if self.known is not None and key not in self.known:
            return False
        while not self.done:
            if len(self.buf) >= self.read_ahead:
                self.full = True
                return False
            m = self._next()
            if m is None:
                break
            self.seq[m.key] = self.read
            self.read += 1
            self.buf[m.key] = m
            if m.key == key:
                return True
        return False

    def take(self, key: str) -> Member:
        seq = self.seq.pop(key)
        if seq < self.max_taken:
            self.stats.add(self.modality, "reordered")  # stored ahead of a later-taken member
        else:
            self.max_taken = seq
        return self.buf.pop(key)

    def finish(self, driver_keys: set[str]) -> None:
        """Classify leftovers, buffered and unread (only called once the driver is exhausted)."""
        leftovers = list(self.buf)
        self.buf.clear()
        self.seq.clear()
        while (m := self._next()) is not None:
            leftovers.append(m.key)  # one member at a time: draining needs no buffer
        for key in leftovers:
            reason = "orphan" if key in driver_keys else "extra"
            self.stats.add(self.modality, reason)
            log.info("skip %s member %s of %s", reason, key, self.modality)


def _merge(
    shard: str,
    streams: Mapping[str, Iterable[Member]],
    modalities: list[str],
    optional: frozenset[str],
    first_index: int,
    stats: AlignStats,
    read_ahead: int,
    passed: frozenset[str],
    on_error: str,
    known: Mapping[str, frozenset[str]],
) -> Iterator[dict[str, Any]]:
    driver = modalities[0]
    cursors = {
        m: _Cursor(m, _named(streams[m], m, stats), stats, read_ahead, passed, known.get(m))
        for m in modalities[1:]
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
                              state, on_error)


def _join_tracking(
    shard: str,
    keys_iter: Iterator[tuple[int, str, Member | None]],
    driver: str | None,
    cursors: dict[str, _Cursor],
    modalities: list[str],
    optional: frozenset[str],
    stats: AlignStats,
    state: dict[str, bool],
    on_error: str,
) -> Iterator[dict[str, Any]]:
    """Emit driver keys found in every required cursor; classify leftovers at the end."""
    seen: set[str] = set()
    for position, key, driver_member in keys_iter:
        if key in seen:
            stats.add(driver or "index", "duplicate")
            log.info("skip duplicate %s key %s in shard %s", driver or "index", key, shard)
            continue
        seen.add(key)
        found: dict[str, bool] = {}
        lacking: list[str] = []
        for m, c in cursors.items():
            if m not in optional:
                found[m] = c.find(key)
                if not found[m] and not c.full:
                    lacking.append(m)
        if lacking:  # absent for sure from a required modality: merge skips the sample
            for m in lacking:
                stats.add(m, "missing")
            log.info("shard %s: skip key %s (missing in %s)", shard, key, ",".join(lacking))
            continue
        for m, c in cursors.items():
            if m in optional:
                found[m] = c.find(key)
        beyond = [m for m, c in cursors.items() if not found[m] and c.full]
        if beyond:
            # The buffer is full and the key was not in it: it may still come, or never.
            read_ahead = cursors[beyond[0]].read_ahead
            for m in beyond:
                stats.add(m, "beyond_read_ahead")
            for m, c in cursors.items():
                if found[m]:
                    c.take(key)  # the sample is skipped as a whole: free its members' buffer
            exc = AlignmentError(
                f"shard {shard}: key {shown(key)} not found in {','.join(beyond)} within "
                f"{read_ahead} members read ahead (data.max_read_ahead); that tar is too far out "
                f"of order or lacks too many keys for merge alignment without a key index")
            yield _error_row(shard, key, position, modalities, _fail(exc, on_error))
            continue
        picked: dict[str, Member | None] = {}
        for m in modalities:
            if m == driver:
                picked[m] = driver_member
            else:
                picked[m] = cursors[m].take(key) if found[m] else None
        stats.emitted += 1
        yield _row(shard, key, position, picked, on_error, stats)
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
    read_ahead: int,
    on_error: str,
    known: Mapping[str, frozenset[str]],
) -> Iterator[dict[str, Any]]:
    if not index_keys:
        return
    cursors = {
        m: _Cursor(m, _named(streams[m], m, stats), stats, read_ahead, frozenset(), known.get(m))
        for m in modalities
    }
    state = {"exhausted": False}

    def keys() -> Iterator[tuple[int, str, Member | None]]:
        for pos in range(first_index, len(index_keys)):
            yield pos, index_keys[pos], None
        state["exhausted"] = True

    yield from _join_tracking(shard, keys(), None, cursors, modalities, optional, stats, state,
                              on_error)
