"""Detect the :class:`Topology` of this process from Ray Train or the environment.

Kept apart from planning: planners take a ``Topology`` and never call anything here.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping

from ray_ingest.errors import ConfigError
from ray_ingest.plan.topology import Topology


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"env {name}: expected an int, got {raw!r}") from None


def _env_pair(environ: Mapping[str, str], a: str, b: str) -> tuple[int, int] | None:
    va, vb = _env_int(environ, a), _env_int(environ, b)
    if va is None and vb is None:
        return None
    if va is None or vb is None:
        have, missing = (a, b) if vb is None else (b, a)
        raise ConfigError(f"env {missing}: expected it set together with {have}, got it unset")
    return va, vb


def ray_train_rank() -> tuple[int, int] | None:
    """``(world_rank, world_size)`` of the active Ray Train worker, or None outside one.

    Ray is consulted only when this process has already imported it (every Ray Train worker
    has), so detection never pays for importing Ray. Any failure means "no context".
    """
    if "ray" not in sys.modules:
        return None
    try:
        import ray.train

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx = ray.train.get_context()  # Train v2 raises outside a training function
            if type(ctx).__module__ == "ray.train.context":  # Train v1 answers (0, 1) outside
                from ray.train._internal.session import get_session

                if get_session() is None:
                    return None
            return int(ctx.get_world_rank()), int(ctx.get_world_size())
    except Exception:
        return None


def detect_topology(
    num_workers: int | None = None,
    group_size: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Topology:
    """Build this process's :class:`Topology`.

    Rank and world size come from, in order: an active Ray Train context; env ``RANK`` and
    ``WORLD_SIZE`` (both or neither); ``(0, 1)``. Worker id and count come from
    ``num_workers`` when given (worker 0), else env ``WORKER`` and ``NUM_WORKERS`` (both or
    neither), else ``(0, 1)``. ``group_size`` comes from the argument, else env
    ``GROUP_SIZE``, else 1. Malformed or half-set variables raise :class:`ConfigError`
    instead of silently falling back.

    Args:
        num_workers: Loader workers per rank; None reads the environment.
        group_size: Ranks per data-parallel group; None reads env ``GROUP_SIZE``.
        environ: Mapping to read instead of ``os.environ``.

    Returns:
        A validated :class:`Topology`.
    """
    env = os.environ if environ is None else environ
    ranks = ray_train_rank() or _env_pair(env, "RANK", "WORLD_SIZE") or (0, 1)
    if num_workers is not None:
        workers = (0, num_workers)
    else:
        workers = _env_pair(env, "WORKER", "NUM_WORKERS") or (0, 1)
    if group_size is None:
        group_size = _env_int(env, "GROUP_SIZE") or 1
    return Topology(
        world_size=ranks[1],
        rank=ranks[0],
        num_workers=workers[1],
        worker_id=workers[0],
        group_size=group_size,
    )


def pid_env_start(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """PiD's resume variables ``(WDS_START_INDEX, WDS_EPOCH_NUM)``, 0 when unset.

    Only for callers that opt into PiD's env-driven skip; feed the start index into
    ``PlanParams(start_index=...)``. Planning itself never reads the environment.
    """
    env = os.environ if environ is None else environ
    start = _env_int(env, "WDS_START_INDEX") or 0
    epoch = _env_int(env, "WDS_EPOCH_NUM") or 0
    if start < 0:
        raise ConfigError(f"env WDS_START_INDEX: expected >= 0, got {start}")
    if epoch < 0:
        raise ConfigError(f"env WDS_EPOCH_NUM: expected >= 0, got {epoch}")
    return start, epoch
