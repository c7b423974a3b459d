"""`ray-ingest bench`: a multi-epoch job's decoded samples/s vs DataLoader, read_webdataset,
ceiling."""

from __future__ import annotations

import click


@click.command("bench")
@click.option("--data", default="/tmp/ray_ingest_bench_tp", show_default=True,
              help="dataset folder (synthesized when absent, reused otherwise)")
@click.option("--samples", type=int, default=9600, show_default=True)
@click.option("--shard-size", type=int, default=100, show_default=True)
@click.option("--min-side", type=int, default=512, show_default=True)
@click.option("--max-side", type=int, default=768, show_default=True)
@click.option("--res", type=int, default=224, show_default=True, help="output side")
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--epochs", type=int, default=3, show_default=True, help="epochs per job")
@click.option("--runs", type=int, default=3, show_default=True, help="repetitions (medians)")
@click.option("--cores", type=int, default=None,
              help="DataLoader workers and ceiling multiplier (default: cpu count)")
@click.option("--only", default=None,
              help="comma list of ours,wds_dl,wds_dl_pw,ray_wds,ceiling")
@click.option("--json-out", default=None, help="write medians and runs as JSON here")
@click.option("--block-rows", type=int, default=None,
              help="ours: samples per read task and block (default: loader.block_rows)")
@click.option("--pool", type=int, default=None,
              help="ours: decode actors, min = max (default: decode.pool_min..pool_max)")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.FIELD=VALUE",
              help="ours: a config override, e.g. loader.fused_read=true (repeatable)")
def command(overrides: tuple[str, ...], **opts) -> None:
    """Throughput of ray_ingest vs baselines, same data, same sitting (prints ratios)."""
    from ray_ingest.tools.benchmark import main

    argv: list[str] = []
    for name, value in opts.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    for item in overrides:
        argv += ["--set", item]
    rc = main(argv)
    if rc:
        raise click.exceptions.Exit(rc)
