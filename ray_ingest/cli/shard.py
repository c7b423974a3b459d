"""``ray-ingest shard``: raw modality folders -> twin tars + wdinfo.json
(:mod:`ray_ingest.tools.shard`)."""

from __future__ import annotations

import json

import click

from ray_ingest.tools.shard import shard_folders


@click.command("shard")
@click.argument("input_dir")
@click.argument("output_dir")
@click.option("--max-shard-size-mb", type=float, default=500.0, show_default=True,
              help="Size mode: shard budget over the primary modality's files.")
@click.option("--shard-size", type=int, default=None,
              help="Count mode: samples per shard (overrides --max-shard-size-mb).")
@click.option("--part-size", type=int, default=1000, show_default=True,
              help="Shards per part_XXXXXX folder (0: flat {id:08d}.tar).")
@click.option("--classify-aspect-ratio", is_flag=True,
              help="Bucket samples into aspect_ratio_W_H/ leaves by image header.")
@click.option("--dataset-name", default=None, help="Key prefix: <name>__<stem>.")
@click.option("--shuffle", is_flag=True, help="Seeded shuffle instead of sorted order.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --shuffle.")
@click.option("--limit", type=int, default=None, help="Keep only the first N samples.")
@click.option("--size-based-on", default=None,
              help="Primary modality (default: image if present, else the first folder).")
@click.option("--max-file-size-mb", type=float, default=1024.0, show_default=True,
              help="Drop files larger than this.")
@click.option("--num-workers", type=int, default=1, show_default=True,
              help="Threads writing shards.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUTPUT_DIR if it holds only a dataset written by ray-ingest.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Write the shards as Ray tasks on the cluster (RAY_ADDRESS or a local Ray).")
@click.option("--shards-per-task", type=int, default=1, show_default=True,
              help="With --ray: output shards written by one Ray task.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def command(input_dir: str, output_dir: str, max_shard_size_mb: float, shard_size: int | None,
            part_size: int, classify_aspect_ratio: bool, dataset_name: str | None,
            shuffle: bool, seed: int, limit: int | None, size_based_on: str | None,
            max_file_size_mb: float, num_workers: int, overwrite: bool, use_ray: bool,
            shards_per_task: int, as_json: bool) -> None:
    """Shard INPUT_DIR (one subfolder per modality, files keyed by stem) into OUTPUT_DIR."""
    executor = None
    if use_ray:
        from ray_ingest.tools.tasks import RayExecutor

        executor = RayExecutor()
    report = shard_folders(
        input_dir, output_dir, max_shard_size_mb=max_shard_size_mb, shard_size=shard_size,
        part_size=part_size, classify_aspect_ratio=classify_aspect_ratio,
        dataset_name=dataset_name, shuffle=shuffle, seed=seed, limit=limit,
        size_based_on=size_based_on, max_file_size_mb=max_file_size_mb,
        num_workers=num_workers, progress=None, overwrite=overwrite, executor=executor,
        shards_per_task=shards_per_task,
    )
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    click.echo(f"wrote {report.samples} samples in {report.shards} shards "
               f"({', '.join(report.modalities)}) to {output_dir}")
    for url in report.wdinfos:
        click.echo(f"  {url}")
    for bucket, n in sorted(report.buckets.items()):
        click.echo(f"  bucket {bucket}: {n} samples")
    for folder, reasons in sorted(report.dropped.items()):
        text = ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items()))
        click.echo(f"  dropped from {folder}/: {text}")
