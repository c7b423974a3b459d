"""Per-rank stream into Ray Train: the loader wires the stages of one rank's data path.

    ReadState ─► plan (plan/epoch.py: unconsumed items, batch counts, a window of epochs)
              ─► execution (executions.py: the Ray edge, pipeline.py, with decode actors or
                 tasks; or decode threads here, threads.py), one per window
              ─► epoch window (window.py) ─► accounting (account.py) ─► skip filter (skips.py)
              ─► batcher (batcher.py) ─► progress into ReadState (progress.py)
              ─► torch (collate.py) ─► [group share: group.py] ─► the train loop

Inside ``train_loop_per_worker`` every rank builds its own, ordered pipeline for the stream of
its data-parallel slot (ray_notes §6–§7), so the ranks of one parallel group see identical
batches. One execution reads the rest of the current epoch and the following epochs in order,
so decode actors and read workers start once per job (and once per resume) and the next epoch
is read while the current one trains. The loader records what the trainer *consumed*,
never what was prefetched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.load import load_catalog
from ray_ingest.columns import ERROR, PLACEMENT, SEQ
from ray_ingest.config import Config
from ray_ingest.decode.memory import keep_freed_memory
from ray_ingest.decode.sizing import block_rows
from ray_ingest.errors import ConfigError
from ray_ingest.execution.handoff import Handoff
from ray_ingest.execution.opener import (
    Executions,
    Opener,
)
from ray_ingest.execution.threads import describe_compute
from ray_ingest.loader import checkpoint
from ray_ingest.loader.account import BlockAccount
from ray_ingest.loader.batcher import BucketBatcher
from ray_ingest.loader.checkpoint import (
    STATE_DIR,
    state_file,
)
from ray_ingest.loader.clock import (
    StageClock,
    timed,
)
from ray_ingest.loader.collate import (
    Batch,
    to_batch,
)
from ray_ingest.loader.device_decode import handover
from ray_ingest.loader.group import (
    GroupShare,
    follow,
    lead,
)
from ray_ingest.loader.progress import Progress
from ray_ingest.loader.skips import SkipFilter
from ray_ingest.loader.window import EpochWindow
from ray_ingest.metrics import LoaderMetrics
from ray_ingest.plan.assign import PlanParams
from ray_ingest.plan.epoch import EpochPlan, plan_window
from ray_ingest.plan.state import ReadState, initial_state, with_topology
from ray_ingest.plan.topology import Topology

__all__ = ["STATE_DIR", "Batch", "IngestLoader", "StageClock", "plan_params", "state_file"]

log = logging.getLogger(__name__)

#: Executions whose stats :attr:`IngestLoader.data_stats` keeps (the last ones): the decode
#: pool's or threads' one line, Ray Data's ``ds.stats()`` text with ``loader.fused_read: false``.
DATA_STATS_KEPT = 4


def plan_params(cfg: Config, start_index: int = 0) -> PlanParams:
    return cfg.loader.plan_params(start_index)


class IngestLoader:
    """The rank's loader. One per ``train_loop_per_worker``.

    Args:
        cfg: the run configuration.
        topology: this rank's topology (``detect_topology()`` inside Ray Train).
        catalog: parsed once on the driver and passed in (PiD's rank-0 parse-and-broadcast);
            loaded from ``cfg.data.paths`` when None.
        state: a restored read state (None: start at ``start_epoch``).
        device: torch device for tensors (None: CPU tensors).
        start_index, start_epoch: PiD's ``WDS_START_INDEX``/``WDS_EPOCH_NUM`` starting point.
        open_execution: builds the read+decode stage for a list of read items (default:
            :class:`~ray_ingest.execution.opener.Executions`, decode threads or a Ray Data
            execution as ``decode.compute`` says); tests pass an in-process one.
        share: this rank's :class:`~ray_ingest.loader.group.GroupShare` when one rank of
            the parallel group decodes for all (``loader.group_share``): the leader runs the
            pipeline and sends its batches, the others receive them and build no pipeline.
        node_pipelines: pipelines decoding on this rank's node, its own among them (the
            job passes its ranks per node): decode threads share the node's cores.
        image_decoder: with ``decode.device: cuda``, what decodes the primary image here
            (default: a :class:`~ray_ingest.loader.device_decode.DeviceDecoder` on ``device``,
            which must be a CUDA device); tests pass one on the CPU.
    """

    def __init__(self, cfg: Config, topology: Topology, catalog: Catalog | None = None,
                 state: ReadState | None = None, device: Any = None, start_index: int = 0,
                 start_epoch: int = 0, open_execution: Opener | None = None,
                 share: GroupShare | None = None, node_pipelines: int = 1,
                 image_decoder: Any = None):
        import torch  # noqa: F401 - imported here, not on the first batch of the hot path

        if topology.group_size > 1 and not cfg.loader.ordered:
            # unordered delivery differs between the ranks of a group: their batches and read
            # states would diverge, and the merged state would skip what only one rank saw
            raise ConfigError(f"loader.ordered: expected true with parallel groups "
                              f"(group_size {topology.group_size}), got false")
        if share is not None and topology.group_size == 1:
            raise ConfigError("IngestLoader share: a group share needs train.group_size > 1")
        self.cfg, self.topology, self.device, self.share = cfg, topology, device, share
        keep_freed_memory()  # batches of 4K samples are stacked here: their buffers reused
        #: Decodes the primary image on the trainer's GPU (``decode.device: cuda``; a group's
        #: followers receive decoded batches and need none).
        self.device_decoder = image_decoder
        if (cfg.decode.device == "cuda" and image_decoder is None
                and (share is None or share.leader)):
            from ray_ingest.loader.device_decode import DeviceDecoder, check_device

            check_device(device)
            self.device_decoder = DeviceDecoder(device, gpu_backend=cfg.decode.gpu_backend,
                                                max_image_pixels=cfg.decode.max_image_pixels)
        self.catalog = catalog or load_catalog(list(cfg.data.paths),
                                               modalities=cfg.data.modalities,
                                               storage_options=cfg.data.storage_options,
                                               cache=True, root=cfg.data.root)
        bsz = cfg.loader.batch_size
        self._params = plan_params(cfg, start_index)
        if state is None:
            state = initial_state(self.catalog.fingerprint, self._params, start_epoch, topology,
                                  self.catalog.fingerprint_doc(), bsz)
        self.progress = Progress(self._resumable(state), topology, bsz)
        #: Ray metrics of this rank (ray_ingest.metrics; a no-op without Ray).
        self.recorder = LoaderMetrics(topology.rank, topology.slot, self.catalog.fingerprint)
        self.skips = SkipFilter(cfg.loader.max_skips_per_shard, cfg.loader.max_skips_per_epoch,
                                lambda sid: self.catalog.path(sid), topology.rank,
                                on_skip=self.recorder.on_skip)
        self.batcher = BucketBatcher(bsz, bucketing=bool(cfg.decode.buckets))
        self.clock = StageClock()
        self.account = BlockAccount(self.clock, self.recorder.on_actors)
        # who decoded and read what (the same objects as the account's)
        self.actors_seen = self.account.actors_seen
        self.decode_nodes, self.read_nodes = self.account.decode_nodes, self.account.read_nodes
        self.executions_of = Executions(cfg, self.catalog, topology, self.recorder.tags,
                                        shared=share is not None, node_pipelines=node_pipelines,
                                        custom=open_execution)
        #: What decodes (``decode.compute`` with ``auto`` resolved for this cluster).
        self.compute = self.executions_of.compute
        self.data_stats: list[str] = []
        #: A group leader's production clock (one batch ahead, in a helper thread).
        self._ahead_clock = StageClock()
        #: A window opened by :meth:`start`: ((state, num_epochs) it was planned for, window).
        self._started: tuple[tuple[ReadState, int], EpochWindow] | None = None

    @property
    def state(self) -> ReadState:
        """What the trainer consumed so far (what :meth:`save` writes)."""
        return self.progress.state

    @property
    def skips_by_kind(self) -> dict[str, int]:
        """Samples skipped under on_error=skip since this loader was built, by failure kind."""
        return self.skips.by_kind

    @property
    def executions(self) -> int:
        """Executions started by this loader (one per window of epochs)."""
        return self.executions_of.opened

    # --- checkpoints ---------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """What the trainer consumed so far: the read state, as :meth:`save` writes it."""
        return self.progress.get_state()

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a read state (a :meth:`get_state`, or a checkpoint's merged state):
        checked against this loader's data and plan, adapted to its topology. An execution
        opened by :meth:`start` is closed (it read from the old position)."""
        restored = self._resumable(ReadState.from_dict(state))
        if self._started is not None:
            self._started[1].close()
            self._started = None
        self.progress.load_state(restored.to_dict())

    def _resumable(self, state: ReadState) -> ReadState:
        """``state`` checked against this loader's data and plan, for its topology."""
        state.check_compatible(self.catalog.fingerprint, self._params,
                               self.catalog.describe_change)
        return with_topology(state, self.topology, self.cfg.loader.batch_size)

    @classmethod
    def restore_state(cls, checkpoint_dir: str | None) -> ReadState | None:
        """Merge the per-rank state files of a checkpoint (None when there is none)."""
        return checkpoint.restore_state(checkpoint_dir)

    def save(self, checkpoint_dir: str) -> str:
        """Write this rank's state file into a checkpoint folder; returns its path."""
        return checkpoint.save_state(self.state, checkpoint_dir, self.topology.rank)

    # --- iteration -----------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[tuple[int, Iterator[Batch]]]:
        """Yield ``(epoch, batches)`` from the saved epoch up to ``num_epochs`` (exclusive).

        One execution reads as many of these epochs as ``loader.max_planned_items`` read items
        allow; leaving an epoch's batches unfinished (max_steps, an exception) closes it.
        """
        following = self.share is not None and not self.share.leader
        while self.state.epoch < num_epochs:
            if following:  # the leader's batches and progress
                epoch = self.state.epoch
                yield epoch, self._deliver(epoch, None, None)
                if self.state.epoch == epoch:  # stopped early, like the leader
                    return
                continue
            started, self._started = self._started, None
            # The window lives while this generator or an epoch's batches refer to it.
            window = (started[1] if started and started[0] == (self.state, num_epochs)
                      else self._window(num_epochs))
            if started and window is not started[1]:
                started[1].close()
            for plan in window.plans:
                yield plan.epoch, self._deliver(plan.epoch, plan, window)
                if self.state.epoch == plan.epoch:  # stopped early (max_steps): keep position
                    window.close()
                    return
            window.close()

    def start(self, num_epochs: int) -> None:
        """Start reading and decoding the first epochs now, before :meth:`epochs` asks.

        The execution's start-up (decode actors are new processes) then overlaps with whatever
        the caller does before its loop (building and wrapping the model, restoring it); the
        next :meth:`epochs` call with the same ``num_epochs`` continues it. Nothing is consumed:
        the read state is unchanged. A follower of a group share has nothing to start.
        """
        if self.share is not None and not self.share.leader:
            return
        if self._started is None and self.state.epoch < num_epochs:
            window = self._window(num_epochs)
            window.open()
            self._started = ((self.state, num_epochs), window)

    def _window(self, num_epochs: int) -> EpochWindow:
        lc = self.cfg.loader
        strict = self.cfg.data.align == "strict"
        # Unordered rows of a non-positional alignment cannot tell when an epoch is complete
        # before the execution ends: one epoch per execution then.
        last = num_epochs if (lc.ordered or strict) else self.state.epoch + 1
        plans = plan_window(self.state, self.topology, self.catalog.counts,
                            self.catalog.chunk_size, lc.batch_size, last,
                            shard_bucket=self.catalog.buckets if self.cfg.decode.buckets else None,
                            block_rows=block_rows(self.cfg) if strict else None,
                            max_items=lc.max_planned_items,
                            first_rows=lc.batch_size if strict else None)
        # A group leader, and a GPU decoder, produce one batch ahead in a helper thread: its
        # waits there are not the train loop's (that one is timed where it takes each batch).
        ahead = self.share is not None or self.device_decoder is not None
        return EpochWindow(plans, self.executions_of, exact=strict, ordered=lc.ordered,
                           clock=self._ahead_clock if ahead else self.clock,
                           on_stats=self._keep_stats,
                           on_wait=None if ahead else self.recorder.on_wait)

    def _deliver(self, epoch: int, plan: EpochPlan | None, window: EpochWindow | None
                 ) -> Iterator[Batch]:
        """The epoch's batches as the train loop takes them: made here (``plan``), made here and
        sent to the group (a group leader), or received from the leader (a follower)."""
        self.recorder.set_epoch(epoch)
        ahead: Handoff | None = None
        if plan is None:  # a follower
            ahead = follow(self.share, epoch)
            made = ((m.batch, m.positions) for m in timed(ahead, self._waited)
                    if m.batch is not None)
        elif self.share is not None:  # a leader: made one ahead, the loop's waits timed here
            ahead = lead(self.share, self._made(plan, window), epoch)
            made = timed(ahead, self._waited)
        elif self.device_decoder is not None:  # the GPU decodes one batch ahead of the step
            ahead = Handoff(self._made(plan, window), None, ahead=True,
                            name="ray_ingest-gpu-decode")
            made = timed(ahead, self._waited)
        else:  # the window times the waits
            made = self._made(plan, window)
        try:
            for batch, consumed in made:
                if batch.ready is not None:  # the GPU decode's event: this stream waits on it
                    handover(batch.data[self.cfg.decode.image_modality], batch.ready)
                    batch.ready = None
                if plan is None:
                    self.skips.count(batch.skipped)
                self.progress.deliver(consumed, batch.skipped)  # only now is it consumed
                self.clock.batches += 1
                self.clock.samples += len(batch.sample_keys)
                self.recorder.on_batch(len(batch.sample_keys))
                yield batch
        finally:
            if ahead is not None:
                ahead.close()
        self.progress.end_epoch()

    def _made(self, plan: EpochPlan, window: EpochWindow) -> Iterator[tuple[Batch, list[int]]]:
        """The epoch's batches, made but not yet delivered: (batch, stream positions consumed)."""
        log.debug("rank %d slot %d epoch %d: %d read items, %d/%d batches done", self.topology.rank,
                  plan.slot, plan.epoch, len(plan.items), plan.done_batches, plan.total_batches)
        self.skips.load_state({"epoch": plan.epoch, "skips": list(self.state.skips)})
        self.batcher.start_epoch(plan.done_batches, plan.total_batches)
        clock = window.clock
        step = self.progress.step_in_epoch(plan)
        complete = False
        try:
            for block in window.blocks_of(plan):
                block = self.skips(self.account(block))
                block.pop(ERROR)
                if not len(block[SEQ]):
                    continue
                t0 = time.perf_counter()
                for cols, bucket in self.batcher.add(block):
                    clock.assemble += time.perf_counter() - t0
                    yield self._make(cols, bucket, plan, step, clock)
                    step += 1
                    t0 = time.perf_counter()
                clock.assemble += time.perf_counter() - t0
            for cols, bucket in self.batcher.finish():
                yield self._make(cols, bucket, plan, step, clock)
                step += 1
            complete = True
        except Exception as exc:
            if self.share is not None:  # the followers wait for this epoch's next batch
                self.share.send_error(plan.epoch, exc)
            raise
        finally:
            if not complete:  # abandoned: stop reading and decoding in the background
                window.close()

    def _make(self, cols: dict[str, np.ndarray], bucket: str, plan: EpochPlan, step: int,
              clock: StageClock) -> tuple[Batch, list[int]]:
        t0 = time.perf_counter()
        positions, skipped = self.skips.drain()
        primary = self.cfg.decode.image_modality
        gpu = self.device_decoder is not None and PLACEMENT in cols
        batch = to_batch(cols, self.cfg.decode, self.device, bucket=bucket, epoch=plan.epoch,
                         step=step, optional=self.cfg.data.optional_modalities,
                         skip=(primary,) if gpu else ())
        if gpu:
            batch.data[primary], batch.ready = self.device_decoder(list(cols[primary]),
                                                                   cols[PLACEMENT])
            if self.share is not None and batch.ready is not None:
                batch.ready.synchronize()  # broadcast from the helper thread: decoded first
                batch.ready = None
        batch.skipped = skipped
        clock.transfer += time.perf_counter() - t0
        return batch, [*cols[SEQ].tolist(), *positions]

    def _waited(self, seconds: float) -> None:
        self.clock.wait += seconds
        self.recorder.on_wait(seconds)

    def describe_decode(self) -> str:
        """What decodes for this rank, in words (``decode.compute`` resolved)."""
        return describe_compute(self.compute, self.executions_of.threads,
                                self.cfg.decode.pool_scope)

    def _keep_stats(self, stats: str) -> None:
        self.data_stats.append(stats)
        del self.data_stats[:-DATA_STATS_KEPT]

    # --- observability -------------------------------------------------------------------
    def stage_breakdown(self, elapsed: float) -> dict[str, float]:
        """Fractions of ``elapsed`` train-loop time per stage (:meth:`StageClock.breakdown`)."""
        return self.clock.breakdown(elapsed)

    def metrics(self) -> dict[str, Any]:
        """Stage timings and counters collected so far (see docs/observability)."""
        gpu = {} if self.device_decoder is None else {
            "device_decode": self.device_decoder.stats()}
        return {**self.clock.to_dict(), **gpu, "decode_compute": self.compute,
                "actors_seen": len(self.actors_seen), "executions": self.executions,
                "head_start_rows": self.executions_of.head_rows,
                "decode_nodes": dict(self.decode_nodes), "read_nodes": dict(self.read_nodes),
                "skips_in_epoch": len(self.state.skips),
                "skips_total": sum(self.skips_by_kind.values()),
                "skips_by_kind": dict(self.skips_by_kind)}
