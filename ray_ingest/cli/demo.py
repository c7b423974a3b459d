"""`ray-ingest demo`: synthetic data -> local Ray -> TorchTrainer job -> exactly-once audit."""

from __future__ import annotations

import os
import shutil

import click


@click.command("demo")
@click.option("--out", default="data/demo", show_default=True, help="synthetic dataset folder")
@click.option("--samples", default=3000, show_default=True, help="samples to synthesize")
@click.option("--shard-size", default=100, show_default=True, help="samples per shard")
@click.option("--config", "config_path", default="configs/demo.yaml", show_default=True)
@click.option("--max-steps", default=None, type=int, help="override train.max_steps")
@click.option("--num-workers", default=2, show_default=True, help="Ray Train workers")
def command(out: str, samples: int, shard_size: int, config_path: str, max_steps: int | None,
            num_workers: int) -> None:
    """Run the end-to-end demo on an embedded local Ray (CPU)."""
    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.tools.audit import (
        VIOLATION,
        audit,
        read_ledgers,
        summary_line,
    )
    from ray_ingest.tools.summary import (
        format_summary,
        summarize,
    )
    from ray_ingest.tools.synth import synth_dataset
    from ray_ingest.train.job import main as train_main

    if not os.path.exists(os.path.join(out, "wdinfo.json")):
        click.echo(f"[demo] synthesizing {samples} samples into {out}")
        synth_dataset(out, samples=samples, shard_size=shard_size, seed=0, progress=None,
                      overwrite=True)
    click.echo(format_summary(summarize([out])))
    runs = os.path.join(os.path.dirname(os.path.abspath(out)), "demo_runs")
    ledger = os.path.join(runs, "ledger")
    shutil.rmtree(runs, ignore_errors=True)  # the demo is a fresh run, not a resume
    argv = ["--config", config_path, "--data", out, "--storage-path", runs, "--name", "demo",
            "--audit-dir", ledger, "--num-workers", str(num_workers)]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    rc = train_main(argv)
    if rc != 0:
        raise click.exceptions.Exit(rc)
    reports = audit(read_ledgers(ledger), load_catalog([out]))
    for r in reports:
        click.echo(f"[demo] audit {summary_line(r)}")
    click.echo(f"[demo] done: run folder {runs}; `ray-ingest audit {ledger} --data {out}` "
               f"prints the full reports")
    if any(r["status"] == VIOLATION for r in reports):
        raise click.exceptions.Exit(1)
