"""Topology: the value object that says which data-parallel slot and loader worker we are.

Built from plain ints and validated at construction. Detecting it from Ray Train or the
environment lives in :mod:`ray_ingest.train.detect`; planning never reads the environment.
"""

from __future__ import annotations

from typing import Any

import attrs

from ray_ingest.errors import ConfigError


def check_int(
    field: str,
    value: Any,
    minimum: int | None = None,
    upper: int | None = None,
    upper_name: str | None = None,
) -> int:
    """Validate an int (``bool`` rejected), raising :class:`ConfigError` that names ``field``.

    Args:
        field: Name shown in the error (``"Topology.rank"``).
        value: The value to check.
        minimum: Smallest allowed value, if any.
        upper: Exclusive upper bound, if any.
        upper_name: What ``upper`` is called in the message (``"world_size"``).

    Returns:
        ``value`` unchanged.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{field}: expected an int, got {value!r} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (upper is not None and value >= upper):
        name = field.rsplit(".", 1)[-1]
        lo = f"{minimum} <= " if minimum is not None else ""
        hi = f" < {upper_name} ({upper})" if upper_name else f" < {upper}"
        expected = f"{lo}{name}{hi}" if upper is not None else f">= {minimum}"
        raise ConfigError(f"{field}: expected {expected}, got {value}")
    return value


@attrs.frozen
class Topology:
    """Where this reader sits: global rank, loader worker, and the model-parallel group size.

    Ranks ``[g*group_size, (g+1)*group_size)`` form data-parallel group ``g`` (PiD's
    ``ShardlistBasicParallelSync``: ``group_id = rank // group_size``); every rank of a group
    reads the same data. Planning works on ``slot``/``slots`` only.
    """

    #: Number of training ranks (processes), all groups together.
    world_size: int
    #: This process's global rank, ``0 <= rank < world_size``.
    rank: int = 0
    #: Loader workers per rank (PiD: DataLoader ``num_workers``, at least 1).
    num_workers: int = 1
    #: This worker, ``0 <= worker_id < num_workers``.
    worker_id: int = 0
    #: Ranks per data-parallel group (TP*CP*PP); must divide ``world_size``.
    group_size: int = 1

    def __attrs_post_init__(self) -> None:
        check_int("Topology.world_size", self.world_size, 1)
        check_int("Topology.rank", self.rank, 0, self.world_size, "world_size")
        check_int("Topology.num_workers", self.num_workers, 1)
        check_int("Topology.worker_id", self.worker_id, 0, self.num_workers, "num_workers")
        check_int("Topology.group_size", self.group_size, 1)
        if self.world_size % self.group_size:
            raise ConfigError(
                f"Topology.group_size: expected a divisor of world_size ({self.world_size}), "
                f"got {self.group_size}"
            )

    @property
    def slot(self) -> int:
        """Data-parallel group id of this rank (``rank // group_size``)."""
        return self.rank // self.group_size

    @property
    def slots(self) -> int:
        """Number of data-parallel groups (``world_size // group_size``)."""
        return self.world_size // self.group_size

    def to_dict(self) -> dict[str, int]:
        """Plain dict of the five fields (for JSON and checkpoints)."""
        return attrs.asdict(self)
