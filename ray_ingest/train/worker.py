"""One rank of the training job: ``train_loop_per_worker`` and the steps it takes.

:class:`WorkerRun` restores the rank's checkpoint (model, step, read state), builds its
:class:`~ray_ingest.loader.ingest.IngestLoader`, trains the job's tiny autoencoder batch by
batch, writes the consumption ledger, reports checkpoints (read offsets beside the model) and
prints the ``[train]`` lines. Everything the loop does between two batches counts as compute,
so the stage fractions cover the loop's time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from ray_ingest.config import Config
from ray_ingest.train import ledger as ledger_file
from ray_ingest.train.faults import InjectedFailure

MODEL_FILE = "model.pt"
TRAIN_FILE = "train_state.json"
STEP_LOG_PREFIX = "[train] step "


def build_model():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 3, 4, stride=2, padding=1), nn.Sigmoid(),
    )


def format_step_log(step: int, epoch: int, loss: float, samples_per_s: float, data_wait: float,
                    stages: dict[str, float]) -> str:
    """The periodic log line:
    ``[train] step N epoch E loss L samples/s R data-wait W stages {json}``.

    ``data_wait`` is the share of the last interval spent blocked on the loader; ``stages`` is
    :meth:`~ray_ingest.loader.ingest.IngestLoader.stage_breakdown` since the loop started
    (fractions ``data_wait``, ``assemble``, ``transfer``, ``compute``, ``other`` summing to 1,
    plus the upstream ``read_cpu_s``/``decode_cpu_s``).
    """
    return (f"{STEP_LOG_PREFIX}{step} epoch {epoch} loss {loss:.4f} "
            f"samples/s {samples_per_s:.1f} data-wait {data_wait:.1%} "
            f"stages {json.dumps(stages, separators=(',', ':'))}")


def parse_step_log(line: str) -> dict[str, Any] | None:
    """Inverse of :func:`format_step_log` (None for any other line), for log scrapers."""
    if not line.startswith(STEP_LOG_PREFIX) or " stages " not in line:
        return None
    head, _, stages = line.partition(" stages ")
    f = head.split()
    return {"step": int(f[2]), "epoch": int(f[4]), "loss": float(f[6]),
            "samples_per_s": float(f[8]), "data_wait": round(float(f[10].rstrip("%")) / 100, 4),
            "stages": json.loads(stages)}


def worker_config(config: dict[str, Any]) -> Config:
    """The run's :class:`Config` in a worker, storage options unsealed (see
    :func:`ray_ingest.train.job.job_config`)."""
    from ray_ingest.config import config_from_dict

    doc = config["cfg"]
    sealed = config.get("storage_options")
    if sealed is not None:
        doc = {**doc, "data": {**doc["data"], "storage_options": sealed.reveal()}}
    return config_from_dict(doc)


def say(line: str) -> None:
    """One line on the worker's real stdout. Ray Train patches ``print`` to log through the
    root logger *and*, because Ray replaced ``sys.stdout`` in its workers, to print too: every
    line came out twice (once on stdout, once on stderr)."""
    out = sys.__stdout__ or sys.stdout
    out.write(line + "\n")
    out.flush()


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train's entry point on every rank (``config``: the job's ``train_loop_config``)."""
    WorkerRun(config).run()


class WorkerRun:
    """One rank's run: set up in the constructor, trained by :meth:`run`."""

    def __init__(self, config: dict[str, Any]):
        import ray
        import ray.train
        import ray.train.torch
        import torch

        from ray_ingest.plan.topology import Topology

        if config.get("quiet", True):
            from ray_ingest.train.quiet import quiet_worker

            quiet_worker()
        self.cfg = cfg = worker_config(config)
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.topo = Topology(world_size=self.world, rank=self.rank,
                             read_workers=cfg.loader.read_workers,
                             group_size=cfg.train.group_size)
        self.device = ray.train.torch.get_device()
        self.node_id = ray.get_runtime_context().get_node_id()  # where it runs (placement)
        torch.manual_seed(cfg.loader.seed)
        self.model = build_model()
        self.global_step = 0
        state = self._restore()
        self.loader = self._loader(config, state, ctx.get_local_world_size())
        if self.rank == 0:  # which decode mode ran, in words (make demo shows it)
            say(f"[train] decode: {self.loader.describe_decode()}")
        self.done = cfg.train.max_steps is not None and self.global_step >= cfg.train.max_steps
        if not self.done:
            self.loader.start(cfg.train.epochs)  # decode actors start while the model is wrapped
        self.model = ray.train.torch.prepare_model(self.model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.train.learning_rate)
        self.ledger = self._open_ledger(config.get("audit_dir"))
        self.failure = InjectedFailure.from_config(config)
        self.stop_file = config.get("stop_file")
        self.losses: list[float] = []

    def _restore(self) -> Any:
        """The model and step of the rank's checkpoint (if any); returns its read state."""
        import ray.train
        import torch

        from ray_ingest.loader.ingest import IngestLoader

        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return None
        with ckpt.as_directory() as d:
            state = IngestLoader.restore_state(d)
            self.model.load_state_dict(torch.load(os.path.join(d, MODEL_FILE),
                                                  weights_only=True))
            with open(os.path.join(d, TRAIN_FILE)) as f:
                self.global_step = json.load(f)["global_step"]
        return state

    def _loader(self, config: dict[str, Any], state: Any, local_ranks: int) -> Any:
        import ray

        from ray_ingest.loader.ingest import IngestLoader

        cfg, topo = self.cfg, self.topo
        catalog = ray.get(config["catalog_ref"]) if config.get("catalog_ref") is not None else None
        start_index, start_epoch = 0, 0
        if cfg.loader.pid_env and cfg.loader.seed_mode == "pid" and state is None:
            from ray_ingest.train.detect import pid_env_start

            start_index, start_epoch = pid_env_start(os.environ)
        self.share = None
        if topo.group_size > 1 and cfg.loader.group_share == "broadcast":
            from ray_ingest.loader.group import GroupShare, dist_channel

            # collective: every rank creates every group's process group
            self.share = GroupShare(dist_channel(topo, self.device, cfg.loader.group_timeout_s),
                                    self.device)
        # the pipelines decoding on this node (a group's followers decode nothing) share it
        pipelines = -(-local_ranks // topo.group_size) if self.share is not None else local_ranks
        return IngestLoader(cfg, topo, catalog=catalog, state=state, device=self.device,
                            start_index=start_index, start_epoch=start_epoch, share=self.share,
                            node_pipelines=pipelines)

    def _open_ledger(self, audit_dir: str | None) -> str | None:
        if not audit_dir:
            return None
        os.makedirs(audit_dir, exist_ok=True)
        path = os.path.join(audit_dir, f"rank_{self.rank:05d}.jsonl")
        ledger_file.append(path, {
            "event": "start", "attempt": ledger_file.attempt_number(audit_dir, self.rank,
                                                                    self.device),
            "rank": self.rank, "world": self.world, "slot": self.topo.slot,
            "resume_step": self.global_step, "epoch": self.loader.state.epoch,
            "node": self.node_id})
        return path

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Train every epoch (up to ``train.max_steps``), then report the final checkpoint."""
        max_steps = self.cfg.train.max_steps
        self.t_start = self.t_log = time.perf_counter()
        self.wait_log, self.samples_log = self.loader.clock.wait, 0
        for epoch, batches in ([] if self.done else self.loader.epochs(self.cfg.train.epochs)):
            for batch in batches:
                t_step = time.perf_counter()
                self._step(batch, epoch, t_step)
                if max_steps is not None and self.global_step >= max_steps:
                    break
            if self.ledger and self.loader.state.epoch > epoch:
                # decode/read nodes: samples per Ray node id as the decode actors and read tasks
                # report them, since this worker (re)started (placement provenance)
                ledger_file.append(self.ledger, {
                    "event": "epoch_end", "epoch": epoch, "rank": self.rank,
                    "step": self.global_step, "node": self.node_id,
                    "decode_nodes": dict(self.loader.decode_nodes),
                    "read_nodes": dict(self.loader.read_nodes)})
            if max_steps is not None and self.global_step >= max_steps:
                break
            if _stop_requested(self.stop_file, self.world, self.device):
                break
        summary = self.summary(time.perf_counter() - self.t_start)
        for line in _gather_on_rank0(summary, self.rank, self.world):
            say(f"[train] done: {json.dumps(line)}")
        self.report(True, summary)

    def _step(self, batch: Any, epoch: int, t_step: float) -> None:
        """One batch: the model step, the ledger, the log line, a checkpoint when due."""
        import torch

        cfg, clock = self.cfg.train, self.loader.clock
        x = batch["image"].permute(0, 3, 1, 2).float().div_(255.0)
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(x), x)
        loss.backward()
        self.opt.step()
        self.global_step += 1
        self.losses.append(loss.item())
        self.samples_log += len(batch.sample_keys)
        if self.ledger:
            ledger_file.append(self.ledger, {
                "epoch": epoch, "step": self.global_step, "rank": self.rank,
                "slot": self.topo.slot, "batch": batch.step_in_epoch, "keys": batch.sample_keys,
                "sids": batch.sids, "indices": batch.indices, "pads": batch.pads,
                "skipped": batch.skipped})
        if self.global_step % cfg.log_every == 0 and self.rank == 0:
            now = time.perf_counter()
            clock.compute += now - t_step
            t_step = now
            self._log(epoch, self.losses[-1], now)
        last = cfg.max_steps is not None and self.global_step >= cfg.max_steps
        if self.global_step % cfg.checkpoint_every == 0 or last:
            self.report(True, {})
            clock.compute += time.perf_counter() - t_step
            t_step = time.perf_counter()
            self.failure.after_checkpoint(self.global_step, self.rank, self.world)
        clock.compute += time.perf_counter() - t_step

    def _log(self, epoch: int, loss: float, now: float) -> None:
        wait = self.loader.clock.wait - self.wait_log
        say(format_step_log(self.global_step, epoch, loss, self.samples_log / (now - self.t_log),
                            wait / (now - self.t_log),
                            self.loader.stage_breakdown(now - self.t_start)))
        self.t_log, self.wait_log, self.samples_log = now, self.loader.clock.wait, 0

    def report(self, with_checkpoint: bool, extra: dict[str, Any]) -> None:
        """``ray.train.report`` the step's metrics (and a checkpoint: the rank's read state,
        rank 0's model and step)."""
        import ray.train
        import torch

        metrics = {"step": self.global_step, "epoch": self.loader.state.epoch,
                   "loss": float(self.losses[-1]) if self.losses else float("nan"), **extra}
        if not with_checkpoint:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as d:
            self.loader.save(d)
            if self.rank == 0:
                inner = self.model.module if hasattr(self.model, "module") else self.model
                torch.save(inner.state_dict(), os.path.join(d, MODEL_FILE))
                with open(os.path.join(d, TRAIN_FILE), "w") as f:
                    json.dump({"global_step": self.global_step}, f)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    def summary(self, elapsed: float) -> dict[str, Any]:
        """Every rank's own final line: the decode/read CPU seconds and bytes this rank's
        pipeline spent (0 on a group share's followers), so a job's totals are sums over its
        output."""
        clock, loader, share = self.loader.clock, self.loader, self.share
        return {"final": True, "rank": self.rank, "slot": self.topo.slot, "elapsed_s": elapsed,
                "samples": clock.samples,
                "samples_per_s": clock.samples / elapsed if elapsed else 0.0,
                "data_wait_s": clock.wait,
                "data_wait_frac": clock.wait / elapsed if elapsed else 0.0,
                "decode_cpu_s": clock.decode, "read_cpu_s": clock.read,
                "bytes_read": clock.bytes_read,
                "group_share": "off" if share is None else
                ("leader" if share.leader else "follower"),
                "executions": loader.executions, "decode_compute": loader.compute,
                "first_loss": self.losses[0] if self.losses else None,
                "actors_seen": len(loader.actors_seen),
                "decode_nodes": dict(loader.decode_nodes), "read_nodes": dict(loader.read_nodes),
                "train_node": self.node_id,
                "stages": loader.stage_breakdown(elapsed)}


def _stop_requested(path: str | None, world: int, device: Any) -> bool:
    """Whether the run ends at this epoch end (``jobs/train.py --stop-file``): the file exists
    for some rank. Every rank calls this at the same epoch end and they agree (a MAX
    all-reduce), so none goes on into an epoch the others left."""
    if not path:
        return False
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if os.path.exists(path) else 0], device=device)
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _gather_on_rank0(summary: dict[str, Any], rank: int, world: int) -> list[dict[str, Any]]:
    """Every rank's final summary, printed by rank 0 in rank order (lines of several processes
    that differ only in numbers would be folded by Ray's log deduplication)."""
    import torch.distributed as dist

    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return [summary]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, summary)
    return out if rank == 0 else []
