"""Exactly-once audit of a consumption ledger written by ``jobs/train.py --audit-dir``.

Each rank appends one JSON line per consumed batch (epoch, global step, keys, shard ids,
indices, pad flags, skipped samples) and a ``start`` event whenever it (re)starts from a
checkpoint. Batches logged after the checkpoint a restart resumed from were rolled back (the
model never kept them), so they are dropped before counting. Then, per epoch: every sample of
the catalog must have been consumed exactly once by exactly one data-parallel slot — planned
duplicates (``pad``) and recorded skips are reported separately — and ranks of one parallel
group must have seen identical batches.

Ordering is logical, never by wall clock: every (re)start of the worker group is an *attempt*
with a number (``attempt`` in the start events: rank 0 counts its own start events and
broadcasts the number to the group); a record belongs to the attempt of the last start event
before it in its rank's file. A record of attempt ``a`` at step ``s`` was rolled back when a
later attempt (``a' > a``) resumed from a step before ``s`` — also on ranks that did not come
back (a re-run with fewer workers). Clocks of different nodes never have to agree.

No Ray, no torch.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from typing import Any

import attrs

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.errors import IngestError
from ray_ingest.train.ledger import read_lines

#: ``status`` of an epoch report.
EXACTLY_ONCE, INCOMPLETE, VIOLATION = "exactly-once", "incomplete", "violation"


@attrs.define
class RankLedger:
    rank: int
    batches: list[dict[str, Any]] = attrs.field(factory=list)
    epoch_ends: dict[int, int] = attrs.field(factory=dict)
    restarts: int = 0


def _derive_attempts(starts: dict[int, list[tuple[str, dict[str, Any]]]]) -> dict[int, list[int]]:
    """Attempt number of every start event, per rank (explicit, or derived for older ledgers).

    Ledgers written before start events carried ``attempt``: rank 0 took part in every attempt,
    so its start events list them all, in order; rank ``r``'s start events are the ones among
    them whose world size includes ``r``, matched in order by resume step and world size.
    """
    out: dict[int, list[int]] = {}
    explicit = all("attempt" in rec for recs in starts.values() for _, rec in recs)
    if explicit:
        return {r: [int(rec["attempt"]) for _, rec in recs] for r, recs in starts.items()}
    ref = [rec for _, rec in starts.get(0, [])]
    for rank, recs in starts.items():
        mine: list[int] = []
        i = 0
        for where, rec in recs:
            key = (int(rec["resume_step"]), int(rec.get("world", 1)))
            while i < len(ref) and not (
                    int(ref[i].get("world", 1)) > rank
                    and (int(ref[i]["resume_step"]), int(ref[i].get("world", 1))) == key):
                i += 1
            if i == len(ref):
                raise IngestError(
                    f"{where}: start event (resume_step {key[0]}, world {key[1]}) has no "
                    f"matching start event in rank 0's ledger; cannot order the attempts "
                    f"(ledgers written with 'attempt' in start events do not need rank 0's)")
            mine.append(i)
            i += 1
        out[rank] = mine
    return out


def read_ledgers(folder: str) -> dict[int, RankLedger]:
    """Per-rank ledgers with rolled-back batches removed."""
    if not os.path.isdir(folder):
        raise IngestError(f"{folder}: audit folder not found")
    files = sorted(f for f in os.listdir(folder) if f.startswith("rank_") and f.endswith(".jsonl"))
    if not files:
        raise IngestError(f"{folder}: no rank_*.jsonl ledger files")
    # Per rank, in file order: start events, and records tagged with the index of the start
    # event before them (-1: none). A rank's file is appended by one process at a time.
    records: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    starts: dict[int, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for name in files:
        path = os.path.join(folder, name)
        rank: int | None = None
        for n, rec in read_lines(path):
            if rank is None:
                rank = int(rec.get("rank", -1))
            if rec.get("event") == "start":
                starts[rank].append((f"{path}:{n}", rec))
            elif rec.get("event") == "epoch_end" or "keys" in rec:
                records[rank].append((len(starts[rank]) - 1, rec))
            else:
                raise IngestError(f"{path}:{n}: unknown ledger record")
    attempts = _derive_attempts(starts)
    # every (attempt, resume step) of the whole job, whichever rank logged it
    resumes = {(a, int(rec["resume_step"]))
               for r, recs in starts.items() for a, (_, rec) in zip(attempts[r], recs, strict=True)}

    def rolled_back(attempt: int, step: int) -> bool:
        return any(a > attempt and resume < step for a, resume in resumes)

    out: dict[int, RankLedger] = {}
    for rank in sorted(set(records) | set(starts)):
        lg = out[rank] = RankLedger(rank, restarts=len(starts[rank]))
        for i, rec in records[rank]:
            attempt = attempts[rank][i] if i >= 0 else -1
            step = int(rec["step"])
            if rolled_back(attempt, step):
                continue
            if rec.get("event") == "epoch_end":
                lg.epoch_ends[int(rec["epoch"])] = step
            else:
                lg.batches.append(rec)
    return out


def audit(ledgers: dict[int, RankLedger], catalog: Catalog) -> list[dict[str, Any]]:
    """One report per epoch: expected, seen, duplicated, missing, padded, skipped, verdict.

    ``status`` is ``exactly-once``, ``incomplete`` (the epoch has not ended, e.g. cut by
    ``train.max_steps``: nothing was consumed twice so far, the rest is simply not read yet;
    ``exactly_once`` is then None) or ``violation`` (``exactly_once`` False).
    """
    counts = catalog.counts
    expected = sum(counts)
    epochs = sorted({b["epoch"] for lg in ledgers.values() for b in lg.batches}
                    | {e for lg in ledgers.values() for e in lg.epoch_ends})
    reports = []
    for epoch in epochs:
        # Group batches by (slot, step): the ranks of a slot must agree; count each slot once.
        by_slot: dict[int, dict[int, dict[int, dict[str, Any]]]] = defaultdict(
            lambda: defaultdict(dict))
        for lg in ledgers.values():
            for b in lg.batches:
                if b["epoch"] == epoch:
                    by_slot[(b.get("gen", 0), b["slot"])][b["step"]][lg.rank] = b
        seen: Counter[tuple[int, int]] = Counter()
        padded = 0
        skipped: set[tuple[int, int]] = set()
        group_mismatches = 0
        for steps in by_slot.values():
            for step_batches in steps.values():
                ranks = sorted(step_batches)
                ref = step_batches[ranks[0]]
                for r in ranks[1:]:
                    if step_batches[r]["keys"] != ref["keys"]:
                        group_mismatches += 1
                for sid, idx, pad in zip(ref["sids"], ref["indices"], ref["pads"], strict=True):
                    if pad:
                        padded += 1
                    else:
                        seen[(sid, idx)] += 1
                for sid, idx, _reason in ref.get("skipped", []):
                    skipped.add((sid, idx))
        for key in skipped:
            seen[key] += 1  # a recorded skip accounts for the sample
        duplicated = sum(n - 1 for n in seen.values() if n > 1)
        unknown = sum(1 for sid, idx in seen
                      if not (0 <= sid < len(counts) and 0 <= idx < counts[sid]))
        missing_list = [(sid, i) for sid, c in enumerate(counts) for i in range(c)
                        if (sid, i) not in seen]
        complete = any(epoch in lg.epoch_ends for lg in ledgers.values())
        report = {
            "epoch": epoch,
            "complete": complete,
            "expected": expected,
            "seen": sum(seen.values()) - len(skipped),
            "distinct": len(seen),
            "duplicated": duplicated,
            "missing": len(missing_list),
            "padded": padded,
            "skipped": len(skipped),
            "unknown": unknown,
            "group_mismatches": group_mismatches,
            "missing_examples": [
                {"shard": catalog.shards[s].path, "index": i} for s, i in missing_list[:5]],
        }
        # Duplicates, unknown samples and diverging group ranks are violations even in an
        # epoch that has not ended; missing samples only once it has (max_steps cuts epochs).
        if duplicated or unknown or group_mismatches or (complete and missing_list):
            status = VIOLATION
        else:
            status = EXACTLY_ONCE if complete else INCOMPLETE
        report["status"] = status
        report["exactly_once"] = None if status == INCOMPLETE else status == EXACTLY_ONCE
        reports.append(report)
    return reports


def keys_at(ledgers: dict[int, RankLedger], rank: int, step: int) -> dict[str, Any]:
    """Which keys were in global step ``step`` on rank ``rank`` (after rollbacks)."""
    lg = ledgers.get(rank)
    if lg is None:
        raise IngestError(f"rank {rank}: no ledger (ranks: {sorted(ledgers)})")
    for b in lg.batches:
        if b["step"] == step:
            return {"rank": rank, "step": step, "epoch": b["epoch"], "slot": b["slot"],
                    "keys": b["keys"], "pads": b["pads"]}
    raise IngestError(f"rank {rank}: no batch at step {step}")


def summary_line(report: dict[str, Any]) -> str:
    """One human line per epoch report (``ray-ingest demo``); the CLI prints the JSON."""
    r = report
    counts = (f"{r['distinct']}/{r['expected']} samples, {r['padded']} padded, "
              f"{r['skipped']} skipped")
    if r["status"] == EXACTLY_ONCE:
        return f"epoch {r['epoch']}: exactly-once ({counts})"
    if r["status"] == INCOMPLETE:
        return (f"epoch {r['epoch']}: incomplete, not a violation: the run stopped inside it "
                f"(train.max_steps); {counts} so far, none twice")
    kinds = ("duplicated", "missing", "unknown", "group_mismatches")
    problems = [f"{r[k]} {k.replace('_', ' ')}" for k in kinds
                if r[k] and (k != "missing" or r["complete"])]
    return f"epoch {r['epoch']}: VIOLATION: {', '.join(problems)} ({counts})"
