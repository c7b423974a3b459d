"""The training job behind ``jobs/train.py`` (``ray job submit -- python jobs/train.py ...``).

The driver: parses the flags and the config, starts (or joins) Ray, loads the catalog once and
starts Ray Train's ``TorchTrainer`` on :func:`~ray_ingest.train.worker.train_loop_per_worker`,
which trains a tiny convolutional autoencoder on the images of a twin-tar dataset. The data comes
from :class:`ray_ingest.loader.ingest.IngestLoader`: each rank reads its planned stream; read
offsets are saved in every checkpoint, so a worker failure (``FailureConfig``) or a re-run with the
same ``--name`` and ``--storage-path`` resumes at the exact sample. ``--audit-dir`` writes a
consumption ledger checked by ``ray-ingest audit``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from ray_ingest.config import Config, load_config
from ray_ingest.train.worker import train_loop_per_worker

log = logging.getLogger("ray_ingest.train")


def job_config(cfg: Config, **extra: Any) -> dict[str, Any]:
    """The ``train_loop_config`` of the job: the config with its storage options redacted (Ray
    Train shows and exports this dict), the real ones sealed beside it (:mod:`ray_ingest.redact`:
    they reach the workers inside Ray's transport and show nowhere), and ``extra``."""
    from ray_ingest.redact import Sealed, redact_config

    return {"cfg": redact_config(cfg.to_dict()),
            "storage_options": Sealed(cfg.data.storage_options), **extra}


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
    p.add_argument("--stop-file",
                   help="end the run at the first epoch end after this file exists (every "
                        "rank checks it there; they agree over torch.distributed)")
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
    from ray_ingest.train.auth import check_token_file, secure_local_ray

    if not os.environ.get("RAY_ADDRESS") and not (ray_module and ray_module.is_initialized()):
        secure_local_ray()  # the embedded Ray below runs with token authentication
    elif os.environ.get("RAY_ADDRESS"):
        check_token_file()  # the token this client sends: one line if others can read it
    from ray_ingest.errors import IngestError

    try:
        cfg = resolve_config(args)
    except IngestError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    import ray

    from ray_ingest.catalog.load import load_catalog

    _start_ray(args, cfg)
    try:
        catalog = load_catalog(list(cfg.data.paths), modalities=cfg.data.modalities,
                               storage_options=cfg.data.storage_options, root=cfg.data.root)
        catalog.require_counts()  # resolved once here, not by every rank
    except IngestError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"[train] dataset: {len(catalog.shards)} shards, {catalog.total_key_count} samples, "
          f"fingerprint {catalog.fingerprint}", flush=True)
    _prestart_decode(cfg, catalog.fingerprint)
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
        stop_file=os.path.abspath(args.stop_file) if args.stop_file else None,
        quiet=not args.verbose,
    )
    result = _trainer(cfg, train_config, args.verbose).fit()
    if result.error is not None:
        from ray_ingest.redact import scrub

        print(f"train.py: training failed: {scrub(str(result.error))}", file=sys.stderr)
        return 1
    print(f"[train] result: {json.dumps(result.metrics, default=str)}", flush=True)
    return 0


def _start_ray(args: argparse.Namespace, cfg: Config) -> None:
    """Join ``RAY_ADDRESS``'s cluster or start an embedded, quiet local Ray (unless one runs);
    on the Ray Data path (``loader.fused_read: false``), start Ray Data's cluster actors while
    Ray Train starts its workers (the rank's own pool never uses them)."""
    import ray

    from ray_ingest.execution.raydata import warm_up
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
    if not cfg.loader.fused_read:
        warm_up()


def _prestart_decode(cfg: Config, dataset: str) -> None:
    """The job's decode pool starts now (when the ranks will use one), so its workers start
    while Ray Train starts the ranks (~20 s): the first step does not wait for them."""
    from ray_ingest.execution.opener import prestart_job_pool

    t = cfg.train
    shared = t.group_size > 1 and cfg.loader.group_share == "broadcast"
    prestart_job_pool(cfg, dataset, t.num_workers // (t.group_size if shared else 1))


def _trainer(cfg: Config, train_config: dict[str, Any], verbose: bool) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    scaling_kw: dict[str, Any] = {}
    if cfg.train.label_selector:
        scaling_kw["label_selector"] = dict(cfg.train.label_selector)
    storage = cfg.train.storage_path
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=train_config,
        scaling_config=ScalingConfig(
            num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
            resources_per_worker={"CPU": cfg.train.cpus_per_worker}, **scaling_kw),
        run_config=RunConfig(
            name=cfg.train.name,
            storage_path=os.path.abspath(storage) if "://" not in storage else storage,
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            # Ray Train's own INFO (worker group started, checkpoint reported) only with --verbose
            logging_config=LoggingConfig(log_level="INFO" if verbose else "WARNING")),
    )


if __name__ == "__main__":
    sys.exit(main())
