"""The consumption ledger: one JSON line per delivered batch per rank, for ``ray-ingest audit``.

Each run of a rank appends to its own file (the attempt number counts earlier files), so a
restart never rewrites what an earlier attempt recorded.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger("ray_ingest.train")



def _ledger_append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, separators=(",", ":")) + "\n")


def _ledger_attempt(audit_dir: str, rank: int, device: Any) -> int:
    """This (re)start's attempt number, the same on every rank (see :mod:`ray_ingest.tools.audit`):
    rank 0 counts the start events in its own ledger and broadcasts the number (through the
    rank's device: NCCL needs it)."""
    import torch.distributed as dist

    from ray_ingest.tools.audit import next_attempt

    attempt = [next_attempt(os.path.join(audit_dir, "rank_00000.jsonl")) if rank == 0 else -1]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(attempt, src=0, device=device)
    return int(attempt[0])
