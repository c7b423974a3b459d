"""The consumption ledger: one JSON line per delivered batch per rank, for ``ray-ingest audit``.

Each run of a rank appends to its own file (the attempt number counts earlier files), so a
restart never rewrites what an earlier attempt recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from ray_ingest.errors import IngestError


def append(path: str, record: dict[str, Any]) -> None:
    """Append one record (one JSON line)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


def attempt_number(audit_dir: str, rank: int, device: Any) -> int:
    """This (re)start's attempt number, the same on every rank (see :mod:`ray_ingest.tools.audit`):
    rank 0 counts the start events in its own ledger and broadcasts the number (through the
    rank's device: NCCL needs it)."""
    import torch.distributed as dist

    attempt = [next_attempt(os.path.join(audit_dir, "rank_00000.jsonl")) if rank == 0 else -1]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(attempt, src=0, device=device)
    return int(attempt[0])


def read_lines(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of every record of a ledger file; a malformed line is a
    one-line error naming the file and the line."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as exc:
                raise IngestError(f"{path}:{n}: malformed ledger line ({exc.msg})") from None


def next_attempt(path: str) -> int:
    """Number of the next attempt: the start events already in ``path`` (rank 0's ledger).

    Rank 0 takes part in every attempt, so its own file counts them all; it computes the
    number and broadcasts it to the other ranks before any of them writes its start event.
    """
    if not os.path.exists(path):
        return 0
    return sum(1 for _, rec in read_lines(path) if rec.get("event") == "start")
