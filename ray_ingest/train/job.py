"""The training job behind ``jobs/train.py`` (``ray job submit -- python jobs/train.py ...``).

Trains a tiny convolutional autoencoder on the images of a twin-tar dataset with Ray Train's
``TorchTrainer``. The data comes from :class:`ray_ingest.loader.ingest.IngestLoader`: each rank
reads its planned stream; read offsets are saved in every checkpoint, so a worker failure
(``FailureConfig``) or a re-run with the same ``--name`` and ``--storage-path`` resumes at the
exact sample. ``--audit-dir`` writes a consumption ledger checked by ``ray-ingest audit``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

from ray_ingest.config import Config, load_config
from ray_ingest.train import ledger as ledger_file

log = logging.getLogger("ray_ingest.train")


MODEL_FILE = "model.pt"
TRAIN_FILE = "train_state.json"


def build_model():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(16, 3, 4, stride=2, padding=1), nn.Sigmoid(),
    )


STEP_LOG_PREFIX = "[train] step "


def format_step_log(step: int, epoch: int, loss: float, samples_per_s: float, data_wait: float,
                    stages: dict[str, float]) -> str:
    """The periodic log line:
    ``[train] step N epoch E loss L samples/s R data-wait W stages {json}``.

    ``data_wait`` is the share of the last interval spent blocked on the loader; ``stages`` is
    :meth:`ray_ingest.loader.ingest.IngestLoader.stage_breakdown` since the loop started (fractions
    ``data_wait``, ``assemble``, ``transfer``, ``compute``, ``other`` summing to 1, plus the
    upstream ``read_cpu_s``/``decode_cpu_s``).
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


def job_config(cfg: Config, **extra: Any) -> dict[str, Any]:
    """The ``train_loop_config`` of the job: the config with its storage options redacted (Ray
    Train shows and exports this dict), the real ones sealed beside it (:mod:`ray_ingest.redact`:
    they reach the workers inside Ray's transport and show nowhere), and ``extra``."""
    from ray_ingest.redact import Sealed, redact_config

    return {"cfg": redact_config(cfg.to_dict()),
            "storage_options": Sealed(cfg.data.storage_options), **extra}


def worker_config(config: dict[str, Any]) -> Config:
    """The run's :class:`Config` in a worker, storage options unsealed (see :func:`job_config`)."""
    from ray_ingest.config import config_from_dict

    doc = config["cfg"]
    sealed = config.get("storage_options")
    if sealed is not None:
        doc = {**doc, "data": {**doc["data"], "storage_options": sealed.reveal()}}
    return config_from_dict(doc)


def _say(line: str) -> None:
    """One line on the worker's real stdout. Ray Train patches ``print`` to log through the
    root logger *and*, because Ray replaced ``sys.stdout`` in its workers, to print too: every
    line came out twice (once on stdout, once on stderr)."""
    out = sys.__stdout__ or sys.stdout
    out.write(line + "\n")
    out.flush()


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray
    import ray.train
    import ray.train.torch
    import torch

    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology

    if config.get("quiet", True):
        from ray_ingest.train.quiet import quiet_worker

        quiet_worker()
    cfg = worker_config(config)
    catalog = ray.get(config["catalog_ref"]) if config.get("catalog_ref") is not None else None
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    topo = Topology(world_size=world, rank=rank, read_workers=cfg.loader.read_workers,
                    group_size=cfg.train.group_size)
    device = ray.train.torch.get_device()
    node_id = ray.get_runtime_context().get_node_id()  # where this worker runs (placement)
    torch.manual_seed(cfg.loader.seed)
    model = build_model()

    state = None
    global_step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = IngestLoader.restore_state(d)
            model.load_state_dict(torch.load(os.path.join(d, MODEL_FILE), weights_only=True))
            with open(os.path.join(d, TRAIN_FILE)) as f:
                global_step = json.load(f)["global_step"]
    start_index, start_epoch = 0, 0
    if cfg.loader.pid_env and cfg.loader.seed_mode == "pid" and state is None:
        from ray_ingest.train.detect import pid_env_start

        start_index, start_epoch = pid_env_start(os.environ)
    share = None
    if topo.group_size > 1 and cfg.loader.group_share == "broadcast":
        from ray_ingest.loader.group import (
            GroupShare,
            dist_channel,
        )

        # collective: every rank creates every group's process group
        share = GroupShare(dist_channel(topo, device, cfg.loader.group_timeout_s), device)
    # the pipelines decoding on this node (a group's followers decode nothing) share its cores
    local = ctx.get_local_world_size()
    node_pipelines = -(-local // topo.group_size) if share is not None else local
    loader = IngestLoader(cfg, topo, catalog=catalog, state=state, device=device,
                          start_index=start_index, start_epoch=start_epoch, share=share,
                          node_pipelines=node_pipelines)
    done = cfg.train.max_steps is not None and global_step >= cfg.train.max_steps
    if not done:
        loader.start(cfg.train.epochs)  # decode actors start while the model is wrapped
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.learning_rate)

    audit_dir = config.get("audit_dir")
    ledger = None
    if audit_dir:
        os.makedirs(audit_dir, exist_ok=True)
        ledger = os.path.join(audit_dir, f"rank_{rank:05d}.jsonl")
        ledger_file.append(ledger, {"event": "start",
                                "attempt": ledger_file.attempt_number(audit_dir, rank, device),
                                "rank": rank, "world": world,
                                "slot": topo.slot, "resume_step": global_step,
                                "epoch": loader.state.epoch, "node": node_id})
    fail_at = config.get("fail_at_step")
    fail_marker = config.get("fail_marker")

    max_steps = cfg.train.max_steps
    t_start = time.perf_counter()
    t_log = t_start
    wait_log = loader.clock.wait
    samples_log = 0
    losses: list[float] = []
    metrics: dict[str, Any] = {}

    def report(with_checkpoint: bool, extra: dict[str, Any]) -> None:
        nonlocal metrics
        metrics = {"step": global_step, "epoch": loader.state.epoch,
                   "loss": float(losses[-1]) if losses else float("nan"), **extra}
        if not with_checkpoint:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as d:
            loader.save(d)
            if rank == 0:
                inner = model.module if hasattr(model, "module") else model
                torch.save(inner.state_dict(), os.path.join(d, MODEL_FILE))
                with open(os.path.join(d, TRAIN_FILE), "w") as f:
                    json.dump({"global_step": global_step}, f)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    for epoch, batches in ([] if done else loader.epochs(cfg.train.epochs)):
        for batch in batches:
            # Everything the loop does between two batches counts as compute (the model step,
            # the ledger, logging, checkpoints), so the stage fractions cover the loop's time.
            t_step = time.perf_counter()
            x = batch["image"].permute(0, 3, 1, 2).float().div_(255.0)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), x)
            loss.backward()
            opt.step()
            global_step += 1
            losses.append(loss.item())
            samples_log += len(batch.sample_keys)
            if ledger:
                ledger_file.append(ledger, {"epoch": epoch, "step": global_step, "rank": rank,
                                        "slot": topo.slot, "batch": batch.step_in_epoch,
                                        "keys": batch.sample_keys, "sids": batch.sids,
                                        "indices": batch.indices, "pads": batch.pads,
                                        "skipped": batch.skipped})
            if global_step % cfg.train.log_every == 0 and rank == 0:
                now = time.perf_counter()
                loader.clock.compute += now - t_step
                t_step = now
                wait = loader.clock.wait - wait_log
                _say(format_step_log(global_step, epoch, loss.item(), samples_log / (now - t_log),
                                     wait / (now - t_log), loader.stage_breakdown(now - t_start)))
                t_log, wait_log, samples_log = now, loader.clock.wait, 0
            last = max_steps is not None and global_step >= max_steps
            if global_step % cfg.train.checkpoint_every == 0 or last:
                report(True, {})
                loader.clock.compute += time.perf_counter() - t_step
                t_step = time.perf_counter()
                fail_rank = config.get("fail_rank")
                if (fail_at is not None and global_step == fail_at
                        and rank == (world - 1 if fail_rank is None else fail_rank)
                        and fail_marker and not os.path.exists(fail_marker)):
                    with open(fail_marker, "w") as f:
                        f.write(str(global_step))
                    if config.get("fail_hard"):
                        # Ray Train's controller registers a reported checkpoint when it next
                        # polls the workers; give it that poll, then die at once, as on a node
                        # or OOM kill (a fast pipeline reached the death before any was
                        # registered, and the group restarted from scratch).
                        time.sleep(2.0)
                        os._exit(17)
                    raise RuntimeError(f"injected failure after step {global_step}")
            loader.clock.compute += time.perf_counter() - t_step
            if last:
                break
        if ledger and loader.state.epoch > epoch:
            # decode/read nodes: samples per Ray node id, as reported by the decode actors and
            # read tasks themselves, since this worker (re)started (placement provenance)
            ledger_file.append(ledger, {"event": "epoch_end", "epoch": epoch, "rank": rank,
                                    "step": global_step, "node": node_id,
                                    "decode_nodes": dict(loader.decode_nodes),
                                    "read_nodes": dict(loader.read_nodes)})
        if max_steps is not None and global_step >= max_steps:
            break
    elapsed = time.perf_counter() - t_start
    clock = loader.clock
    # Every rank's own line: decode/read CPU seconds and bytes this rank's pipeline spent (0 on
    # a group share's followers), so a job's totals are sums over its output.
    summary = {"final": True, "rank": rank, "slot": topo.slot, "elapsed_s": elapsed,
               "samples": clock.samples,
               "samples_per_s": clock.samples / elapsed if elapsed else 0.0,
               "data_wait_s": clock.wait,
               "data_wait_frac": clock.wait / elapsed if elapsed else 0.0,
               "decode_cpu_s": clock.decode, "read_cpu_s": clock.read,
               "bytes_read": clock.bytes_read,
               "group_share": "off" if share is None else
               ("leader" if share.leader else "follower"),
               "executions": loader.executions,
               "first_loss": losses[0] if losses else None, "actors_seen": len(loader.actors_seen),
               "decode_nodes": dict(loader.decode_nodes), "read_nodes": dict(loader.read_nodes),
               "train_node": node_id,
               "stages": loader.stage_breakdown(elapsed)}
    for line in _gather_on_rank0(summary, rank, world):
        _say(f"[train] done: {json.dumps(line)}")
    report(True, summary)


def _gather_on_rank0(summary: dict[str, Any], rank: int, world: int) -> list[dict[str, Any]]:
    """Every rank's final summary, printed by rank 0 in rank order (lines of several processes
    that differ only in numbers would be folded by Ray's log deduplication)."""
    import torch.distributed as dist

    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return [summary]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, summary)
    return out if rank == 0 else []


def build_parser() -> argparse.ArgumentParser:
    """The job's command line (``python jobs/train.py --help``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config (configs/demo.yaml)")
    p.add_argument("--data", action="append",
                   help="dataset path (overrides data.paths; repeatable)")
    p.add_argument("--num-workers", type=int, help="Ray Train workers (train.num_workers)")
    p.add_argument("--group-size", type=int, help="ranks per parallel group (train.group_size)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps (train.max_steps)")
    p.add_argument("--epochs", type=int, help="epochs to train (train.epochs)")
    p.add_argument("--storage-path", help="RunConfig storage path (train.storage_path)")
    p.add_argument("--name", help="RunConfig name; re-running with the same name resumes")
    p.add_argument("--use-gpu", action="store_true", default=None, help="train on CUDA")
    p.add_argument("--batch-size", type=int, help="loader.batch_size")
    p.add_argument("--audit-dir", help="append (epoch, step, keys) per consumed batch here")
    p.add_argument("--fail-at-step", type=int,
                   help="raise once on the last rank right after step N's checkpoint")
    p.add_argument("--fail-rank", type=int,
                   help="the rank that fails at --fail-at-step (default: the last rank)")
    p.add_argument("--fail-hard", action="store_true",
                   help="the failing rank's process exits at once instead of raising")
    p.add_argument("--num-cpus", type=int, default=8,
                   help="logical CPUs of the embedded local Ray (ignored when joining a cluster)")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's own INFO logs and every line Ray forwards from its processes")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def resolve_config(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {}
    pairs = {"data.paths": args.data, "train.num_workers": args.num_workers,
             "train.group_size": args.group_size, "train.max_steps": args.max_steps,
             "train.epochs": args.epochs, "train.storage_path": args.storage_path,
             "train.name": args.name, "train.use_gpu": args.use_gpu,
             "loader.batch_size": args.batch_size}
    overrides = {k: v for k, v in pairs.items() if v is not None}
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    ray_module = sys.modules.get("ray")
    if not os.environ.get("RAY_ADDRESS") and not (ray_module and ray_module.is_initialized()):
        from ray_ingest.train.auth import secure_local_ray

        secure_local_ray()  # the embedded Ray below runs with token authentication
    from ray_ingest.errors import IngestError

    try:
        cfg = resolve_config(args)
    except IngestError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.train import quiet

    quiet_kw = {} if args.verbose else {"logging_level": logging.WARNING}
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**quiet_kw)
        else:
            ray.init(**quiet.embedded_ray_kwargs(
                args.num_cpus, {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"},
                quiet=not args.verbose))
    if not args.verbose:
        quiet.filter_driver_output()
    from ray_ingest.execution.raydata import warm_up

    warm_up()  # Ray Data's cluster actors start while Ray Train starts its workers
    try:
        catalog = load_catalog(list(cfg.data.paths), modalities=cfg.data.modalities,
                               storage_options=cfg.data.storage_options, root=cfg.data.root)
        catalog.require_counts()  # resolved once here, not by every rank
    except IngestError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"[train] dataset: {len(catalog.shards)} shards, {catalog.total_key_count} samples, "
          f"fingerprint {catalog.fingerprint}", flush=True)
    fail_marker = None
    if args.fail_at_step is not None:
        fail_marker = os.path.join(cfg.train.storage_path, f"{cfg.train.name}.failed_once")
        os.makedirs(cfg.train.storage_path, exist_ok=True)
    train_config = job_config(
        cfg,
        catalog_ref=ray.put(catalog),  # parsed once on the driver, shared by every rank
        audit_dir=os.path.abspath(args.audit_dir) if args.audit_dir else None,
        fail_at_step=args.fail_at_step,
        fail_marker=fail_marker,
        fail_rank=args.fail_rank,
        fail_hard=args.fail_hard,
        quiet=not args.verbose,
    )
    scaling_kw: dict[str, Any] = {}
    if cfg.train.label_selector:
        scaling_kw["label_selector"] = dict(cfg.train.label_selector)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=train_config,
        scaling_config=ScalingConfig(
            num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
            resources_per_worker={"CPU": cfg.train.cpus_per_worker}, **scaling_kw),
        run_config=RunConfig(
            name=cfg.train.name, storage_path=os.path.abspath(cfg.train.storage_path)
            if "://" not in cfg.train.storage_path else cfg.train.storage_path,
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            # Ray Train's own INFO (worker group started, checkpoint reported) only with --verbose
            logging_config=LoggingConfig(log_level="INFO" if args.verbose else "WARNING")),
    )
    result = trainer.fit()
    if result.error is not None:
        from ray_ingest.redact import scrub

        print(f"train.py: training failed: {scrub(str(result.error))}", file=sys.stderr)
        return 1
    print(f"[train] result: {json.dumps(result.metrics, default=str)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
