"""``ray-ingest synth``: write a synthetic twin-tar dataset (see :mod:`ray_ingest.tools.synth`)."""

from __future__ import annotations

import json

import click

from ray_ingest.tools.synth import (
    DEFAULT_MODALITIES,
    parse_aspect_ratios,
    synth_dataset,
)
from ray_ingest.twintar.layout import ASPECT_RATIOS


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


@click.command("synth")
@click.argument("out_dir")
@click.option("--samples", type=int, required=True, help="Number of samples.")
@click.option("--shard-size", type=int, required=True, help="Samples per shard.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--min-side", type=int, default=64, show_default=True,
              help="Smallest long side of an image, px.")
@click.option("--max-side", type=int, default=256, show_default=True,
              help="Largest long side of an image, px.")
@click.option("--aspect-ratios", default=",".join(f"{w}:{h}" for w, h in ASPECT_RATIOS),
              show_default=True, help="W:H ratios drawn per sample.")
@click.option("--modalities", default=",".join(DEFAULT_MODALITIES), show_default=True,
              help="Comma-separated subset of image,caption,umt5; the first drives alignment.")
@click.option("--classify-aspect-ratio", is_flag=True,
              help="Write aspect_ratio_W_H/ leaves, one wdinfo.json each.")
@click.option("--part-size", type=int, default=1000, show_default=True,
              help="Shards per part_XXXXXX folder (0: flat {id:08d}.tar).")
@click.option("--num-workers", type=int, default=1, show_default=True,
              help="Threads generating shards (output does not depend on it).")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT_DIR if it holds only a dataset written by ray-ingest.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def command(out_dir: str, samples: int, shard_size: int, seed: int, min_side: int,
            max_side: int, aspect_ratios: str, modalities: str, classify_aspect_ratio: bool,
            part_size: int, num_workers: int, overwrite: bool, as_json: bool) -> None:
    """Generate a deterministic synthetic twin-tar dataset in OUT_DIR."""
    report = synth_dataset(
        out_dir, samples=samples, shard_size=shard_size, seed=seed, min_side=min_side,
        max_side=max_side, aspect_ratios=parse_aspect_ratios(aspect_ratios),
        modalities=_csv(modalities), classify_aspect_ratio=classify_aspect_ratio,
        part_size=part_size, num_workers=num_workers, progress=None, overwrite=overwrite,
    )
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    click.echo(f"wrote {report.samples} samples in {report.shards} shards "
               f"({', '.join(report.modalities)}) to {out_dir}")
    for url in report.wdinfos:
        click.echo(f"  {url}")
