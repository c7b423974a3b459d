"""Pure planning: topology, shard assignment per (slot, worker), and per-slot sample slices.

No Ray, no torch. See ``docs/planning.md``.
"""

from ray_ingest.plan.assign import (
    DEFAULT_PARAMS,
    SEED_MODES,
    PlanParams,
    WorkerShards,
    assign,
    assign_epoch,
    assign_slot,
    assign_worker,
    base_order,
    epoch_key,
    epoch_order,
    extended_length,
    shard_paths,
    skip_count,
    splitmix64,
    worker_seed,
)
from ray_ingest.plan.settings import DEFAULT_SETTINGS, SETTING_NAMES, PlanSettings
from ray_ingest.plan.slices import (
    ShardSlice,
    balance,
    interleave,
    iter_samples,
    plan_epoch,
    plan_slot,
    slot_totals,
    total,
)
from ray_ingest.plan.topology import Topology, check_int

__all__ = [
    "DEFAULT_PARAMS",
    "DEFAULT_SETTINGS",
    "PlanParams",
    "PlanSettings",
    "SEED_MODES",
    "SETTING_NAMES",
    "ShardSlice",
    "Topology",
    "WorkerShards",
    "assign",
    "assign_epoch",
    "assign_slot",
    "assign_worker",
    "balance",
    "base_order",
    "check_int",
    "epoch_key",
    "epoch_order",
    "extended_length",
    "interleave",
    "iter_samples",
    "plan_epoch",
    "plan_slot",
    "shard_paths",
    "skip_count",
    "slot_totals",
    "splitmix64",
    "total",
    "worker_seed",
]
