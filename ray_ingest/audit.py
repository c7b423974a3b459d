"""Exactly-once audit of a consumption ledger written by ``jobs/train.py --audit-dir``.

Each rank appends one JSON line per consumed batch (epoch, global step, keys, shard ids,
indices, pad flags, skipped samples) and a ``start`` event whenever it (re)starts from a
checkpoint. Batches logged after the checkpoint a restart resumed from were rolled back (the
model never kept them), so they are dropped before counting. Then, per epoch: every sample of
the catalog must have been consumed exactly once by exactly one data-parallel slot — planned
duplicates (``pad``) and recorded skips are reported separately — and ranks of one parallel
group must have seen identical batches.

No Ray, no torch.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import attrs

from ray_ingest.catalog import Catalog
from ray_ingest.errors import IngestError


@attrs.define
class RankLedger:
    rank: int
    batches: list[dict[str, Any]] = attrs.field(factory=list)
    epoch_ends: dict[int, int] = attrs.field(factory=dict)
    restarts: int = 0


def _lines(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as exc:
                raise IngestError(f"{path}:{n}: malformed ledger line ({exc.msg})") from None


def read_ledgers(folder: str) -> dict[int, RankLedger]:
    """Per-rank ledgers with rolled-back batches removed."""
    if not os.path.isdir(folder):
        raise IngestError(f"{folder}: audit folder not found")
    files = sorted(f for f in os.listdir(folder) if f.startswith("rank_") and f.endswith(".jsonl"))
    if not files:
        raise IngestError(f"{folder}: no rank_*.jsonl ledger files")
    out: dict[int, RankLedger] = {}
    starts: list[tuple[float, int]] = []  # (time, resume step) of every (re)start, any rank
    end_times: dict[tuple[int, int], float] = {}  # (rank, epoch) -> time of its epoch_end
    for name in files:
        path = os.path.join(folder, name)
        ledger: RankLedger | None = None
        for n, rec in _lines(path):
            rank = int(rec.get("rank", -1))
            if ledger is None:
                ledger = out.setdefault(rank, RankLedger(rank))
            if rec.get("event") == "start":
                resume = int(rec["resume_step"])
                ledger.restarts += 1
                ledger.batches = [b for b in ledger.batches if b["step"] <= resume]
                ledger.epoch_ends = {e: s for e, s in ledger.epoch_ends.items() if s <= resume}
                if "t" in rec:
                    starts.append((float(rec["t"]), resume))
            elif rec.get("event") == "epoch_end":
                ledger.epoch_ends[int(rec["epoch"])] = int(rec["step"])
                if "t" in rec:
                    end_times[(ledger.rank, int(rec["epoch"]))] = float(rec["t"])
            elif "keys" in rec:
                ledger.batches.append(rec)
            else:
                raise IngestError(f"{path}:{n}: unknown ledger record")

    # A restart rolls back every rank, also ranks that did not come back (a re-run with fewer
    # workers), whose files hold no later start: drop what was logged before a (re)start that
    # resumed from an earlier step. Uses the records' "t" stamps (older ledgers lack them).
    def rolled_back(t: float | None, step: int) -> bool:
        return t is not None and any(ts > t and resume < step for ts, resume in starts)

    for lg in out.values():
        lg.batches = [b for b in lg.batches if not rolled_back(b.get("t"), b["step"])]
        lg.epoch_ends = {e: s for e, s in lg.epoch_ends.items()
                         if not rolled_back(end_times.get((lg.rank, e)), s)}
    return out


def audit(ledgers: dict[int, RankLedger], catalog: Catalog) -> list[dict[str, Any]]:
    """One report per epoch: expected, seen, duplicated, missing, padded, skipped, verdict."""
    counts = catalog.counts
    expected = sum(counts)
    epochs = sorted({b["epoch"] for lg in ledgers.values() for b in lg.batches}
                    | {e for lg in ledgers.values() for e in lg.epoch_ends})
    reports = []
    for epoch in epochs:
        # Group batches by (slot, step): the ranks of a slot must agree; count each slot once.
        by_slot: dict[int, dict[int, dict[int, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
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
        unknown = sum(1 for sid, idx in seen if not (0 <= sid < len(counts) and 0 <= idx < counts[sid]))
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
        report["exactly_once"] = (duplicated == 0 and not missing_list and unknown == 0
                                  and group_mismatches == 0)
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
