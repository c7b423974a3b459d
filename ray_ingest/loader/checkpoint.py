"""Read states in checkpoint folders: one file per rank, merged on restore.

Ray Train merges every rank's checkpoint folder into one, so each rank writes
``ingest_state/rank_NNNNN.json``; restoring merges them (each rank is authoritative for its own
slot) and refuses a checkpoint lacking a slot's files. No Ray, no torch.
"""

from __future__ import annotations

import json
import os

from ray_ingest.errors import StateError
from ray_ingest.plan.state import ReadState, merge_slot_states

STATE_DIR = "ingest_state"


def state_file(rank: int) -> str:
    """Per-rank file name, relative to the checkpoint folder."""
    return os.path.join(STATE_DIR, f"rank_{rank:05d}.json")


def save_state(state: ReadState, checkpoint_dir: str, rank: int) -> str:
    """Write ``rank``'s state file into a checkpoint folder; returns its path."""
    path = os.path.join(checkpoint_dir, state_file(rank))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(state.to_dict(), f, separators=(",", ":"))
    return path


def restore_state(checkpoint_dir: str | None) -> ReadState | None:
    """Merge the per-rank state files of a checkpoint (None when there is none)."""
    if not checkpoint_dir:
        return None
    folder = os.path.join(checkpoint_dir, STATE_DIR)
    if not os.path.isdir(folder):
        return None
    states = []
    slots_seen: set[int] = set()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                try:
                    state = ReadState.from_dict(json.load(f))
                except json.JSONDecodeError as exc:
                    raise StateError(f"{folder}/{name}: malformed JSON ({exc})") from None
                except StateError as exc:
                    raise StateError(f"{folder}/{name}: {exc}") from None
            states.append(state)
            rank = name[len("rank_"):-len(".json")]
            if name.startswith("rank_") and rank.isdigit():
                slots_seen.add(int(rank) // state.current.group_size)
    if not states:
        return None
    merged = merge_slot_states(states)
    # Every rank saves only its own slot's progress: a slot without any file would silently
    # re-read what it consumed (e.g. a checkpoint written by rank 0 alone).
    missing = sorted(set(range(merged.current.slots)) - slots_seen)
    if missing:
        group = merged.current.group_size
        names = ", ".join(os.path.basename(state_file(s * group + i))
                          for s in missing for i in range(group))
        raise StateError(f"{folder}: no read state for slot(s) {missing} (expected one of "
                         f"{names}); every rank must save its file into the checkpoint")
    return merged
