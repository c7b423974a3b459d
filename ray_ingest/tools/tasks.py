"""Run independent jobs in this process or as Ray tasks, with the same results.

The offline tools (``ray-ingest shard``, ``ray-ingest convert``) cut their work into jobs
(groups of output shards) that a pure function writes. :class:`LocalExecutor` runs them here;
:class:`RayExecutor` runs one Ray task per job on the cluster. Results come back in job
order either way, so what is written does not depend on where the jobs ran.

Ray is imported only when a :class:`RayExecutor` runs something: ``import ray_ingest.tools.tasks``
stays cheap for the CLI.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from ray_ingest.errors import ConfigError, IngestError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Executor(Protocol):
    """Maps a picklable function over jobs; results in job order."""

    def map(self, fn: Callable[[T], R], jobs: Sequence[T]) -> list[R]: ...


class LocalExecutor:
    """Runs the jobs one after the other in this process."""

    def map(self, fn: Callable[[T], R], jobs: Sequence[T]) -> list[R]:
        return [fn(job) for job in jobs]


def _check_cpus(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{attribute.name}: expected a number >= 0, got {value!r}")


def _apply(fn: Callable[[Any], Any], job: Any) -> Any:
    return fn(job)


@attrs.frozen
class RayExecutor:
    """One Ray task per job on the connected cluster (``ray.init()`` is called when Ray is not
    initialised yet: it joins ``RAY_ADDRESS`` or a running local cluster, else starts one).

    A task's :class:`~ray_ingest.errors.IngestError` is re-raised as itself (one line, names
    the shard), not wrapped in Ray's traceback.
    """

    #: Logical CPUs per task (the jobs are I/O-bound: fractions let more run per node).
    num_cpus: float = attrs.field(default=1.0, validator=_check_cpus)
    #: Memory to reserve per task, in bytes (None: no reservation).
    memory: int | None = None
    #: Ray label selector for the tasks (``{"pool": "cpu-decode"}``).
    label_selector: dict[str, str] | None = None

    def map(self, fn: Callable[[T], R], jobs: Sequence[T]) -> list[R]:
        import ray

        if not jobs:
            return []
        if not ray.is_initialized():
            from ray_ingest.train.auth import check_token_file

            check_token_file()  # the token Ray is about to read: one line if others can read it
            ray.init()
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "max_retries": 3}
        if self.memory is not None:
            options["memory"] = self.memory
        if self.label_selector:
            options["label_selector"] = dict(self.label_selector)
        remote = ray.remote(_apply).options(**options)
        fn_ref = ray.put(fn)  # shipped once, not once per task
        refs = [remote.remote(fn_ref, job) for job in jobs]
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            for ref in refs:
                ray.cancel(ref)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, IngestError):
                raise cause from None
            raise
