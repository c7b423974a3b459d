"""Which execution reads and decodes a rank's read items: threads of this process or Ray.

``decode.compute`` resolved once, for this cluster, here (``auto``: the ``process`` companion on
a small one-node cluster, actors otherwise, threads only without a running Ray,
:func:`ray_ingest.execution.threads.resolve_compute`), and the executions of a loader's windows
opened by it: :class:`~ray_ingest.execution.threads.ThreadedExecution` (no Ray), or, behind the
head start (:mod:`ray_ingest.execution.headstart`) where that applies, the job's shared decode
pool (:class:`~ray_ingest.execution.jobpool.JobPoolExecution`, ``decode.pool_scope: job``), the
rank's own Ray workers (:class:`~ray_ingest.execution.pool.PoolExecution`: actors with
``pool_scope: rank``, tasks, the ``process`` companion) or a Ray Data execution
(:class:`ray_ingest.execution.raydata.Execution`, with ``loader.fused_read: false``), whose
module is imported when the loader is built (not on its first batch). Imports Ray only where a
Ray execution will be opened.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import attrs

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.config import Config
from ray_ingest.decode.decoder import prepare_process
from ray_ingest.execution.handoff import Execution
from ray_ingest.execution.headstart import (
    HeadStart,
    split_head,
)
from ray_ingest.execution.local import LocalExecution
from ray_ingest.execution.threads import (
    ThreadedExecution,
    decode_threads,
    resolve_compute,
    usable_cores,
)
from ray_ingest.metrics import running_ray
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.plan.topology import Topology

Opener = Callable[[list[ReadItem]], Execution]


class Executions:
    """Opens the execution of each window of a rank's stream (an ``open_execution`` callable).

    Args:
        cfg: the run configuration (``decode.compute: auto`` is resolved here).
        catalog: the datasets' catalog.
        topology: this rank's topology.
        tags: the rank's Ray metric tags.
        shared: one rank of the parallel group decodes for all (``loader.group_share``): a
            share of the cluster per group, not per rank.
        node_pipelines: pipelines that decode on this node, this one among them: decode
            threads share the node's cores between them.
        custom: opens every execution instead (tests: an in-process one); nothing is resolved.
    """

    def __init__(self, cfg: Config, catalog: Catalog, topology: Topology,
                 tags: dict[str, str] | None = None, *, shared: bool = False,
                 node_pipelines: int = 1, custom: Opener | None = None):
        self.catalog, self.topology, self.tags, self.shared = catalog, topology, tags, shared
        self._custom = custom
        #: What decodes (``decode.compute``, ``auto`` resolved; "custom" for ``custom``).
        self.compute = "custom"
        if custom is None:
            self.compute = resolve_compute(cfg.decode, _ray_nodes(), usable_cores())
            cfg = with_compute(cfg, self.compute)
        self.cfg = cfg
        # one-off work of this process's first batch, done now, while the trainer sets up
        if custom is None and (self.compute == "threads" or head_start_batches(cfg)):
            prepare_process()  # this process decodes (its threads, or the head start)
        #: The module of the Ray execution this rank opens (None: threads, custom), imported
        #: here (the job pool's: ~5 ms of CPU on an idle node, its classes built by attrs).
        self.ray_module: str | None = None
        if custom is None and self.compute != "threads":
            self.ray_module = ("jobpool" if self.job_pool else
                               "pool" if self.compute == "process" or cfg.loader.fused_read
                               else "raydata")
            importlib.import_module(f"ray_ingest.execution.{self.ray_module}")
        #: Decode threads of ``compute: threads``.
        self.threads = decode_threads(cfg.decode, node_pipelines)
        #: Executions opened (one per window of epochs).
        self.opened = 0
        #: Head starts of the Ray executions (their rows are counted in :attr:`head_rows`).
        self.heads: list[HeadStart] = []

    @property
    def head_rows(self) -> int:
        return sum(h.head_rows for h in self.heads)

    def __call__(self, items: list[ReadItem]) -> Execution:
        self.opened += 1
        if self._custom is not None:
            return self._custom(items)
        if self.compute == "threads":  # this process decodes: no Ray involved
            return ThreadedExecution(self.cfg, self.catalog, items, self.tags, self.threads)
        batches = head_start_batches(self.cfg)
        if not (batches and self.cfg.loader.ordered):
            return self._ray(items)
        head, rest = split_head(items, batches * self.cfg.loader.batch_size)
        local = LocalExecution(self.cfg, self.catalog, head, self.tags)
        # a shared pool's controller is joined by every rank at once: after the first block
        shared_pool = self.ray_module == "jobpool" and self.pipelines > 1
        self.heads.append(HeadStart(local, (lambda: self._ray(rest)) if rest else None,
                                    after_first_block=shared_pool))
        return self.heads[-1]

    @property
    def pipelines(self) -> int:
        """The job's pipelines: one per group when its leader decodes for it."""
        topo = self.topology
        return max(1, topo.world_size // (topo.group_size if self.shared else 1))

    @property
    def job_pool(self) -> bool:
        """Whether the rank draws from the job's shared decode pool (execution/service.py)."""
        return self._custom is None and uses_job_pool(self.cfg)

    def _ray(self, items: list[ReadItem]) -> Execution:
        topo = self.topology
        if self.ray_module == "jobpool":
            from ray_ingest.execution.jobpool import JobPoolExecution

            return JobPoolExecution(self.cfg, self.catalog, items, self.tags, topo.rank,
                                    self.pipelines)
        if self.ray_module == "pool":
            from ray_ingest.execution.pool import PoolExecution

            return PoolExecution(self.cfg, self.catalog, items, self.tags, topo.rank,
                                 threads=self.threads)
        from ray_ingest.execution.raydata import Execution as RayExecution

        # a share of the cluster per pipeline
        return RayExecution(self.cfg, self.catalog, items, self.pipelines, self.tags, topo.rank)


def head_start_batches(cfg: Config) -> int:
    """``loader.head_start_batches`` resolved: the value set, else 2, or 0 where a
    ``decode.label_selector`` puts decoding on other nodes (the user's placement wins unless
    the user asked for a head start)."""
    if cfg.loader.head_start_batches is not None:
        return cfg.loader.head_start_batches
    return 0 if cfg.decode.label_selector else 2


def with_compute(cfg: Config, compute: str) -> Config:
    """``cfg`` with ``decode.compute`` resolved (what the executions, and the job pool's name,
    are built from)."""
    return attrs.evolve(cfg, decode=attrs.evolve(cfg.decode, compute=compute))


def uses_job_pool(cfg: Config) -> bool:
    """Whether ranks of ``cfg`` (``decode.compute`` resolved) draw from the job's pool."""
    return (cfg.decode.compute == "actors" and cfg.loader.fused_read
            and cfg.decode.pool_scope == "job")


def prestart_job_pool(cfg: Config, dataset: str, pipelines: int) -> bool:
    """From the job's driver, on a running Ray: start the job's decode pool now when its ranks
    will use one (``decode.compute`` resolved as they resolve it), so its workers start while
    Ray Train starts the ranks. Returns whether it did."""
    resolved = with_compute(cfg, resolve_compute(cfg.decode, _ray_nodes(), usable_cores()))
    if not uses_job_pool(resolved):
        return False
    from ray_ingest.execution import service

    service.prestart(resolved, pipelines, dataset)
    return True


def _ray_nodes() -> int | None:
    """Alive nodes of the Ray cluster this process is connected to (None: not connected).
    Asks only a Ray already imported and initialised: this module does not start one."""
    ray = running_ray()
    return None if ray is None else sum(1 for n in ray.nodes() if n.get("Alive"))
