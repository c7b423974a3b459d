"""``ray-ingest convert``: rewrite one modality's tars, pickled arrays -> ``.npy``
(:func:`ray_ingest.tools.convert.convert_pickles`)."""

from __future__ import annotations

import json

import click

from ray_ingest.errors import IngestError
from ray_ingest.tools.convert import convert_pickles


@click.command("convert")
@click.argument("root")
@click.option("--modality", required=True, help="Modality folder to rewrite (e.g. umt5).")
@click.option("--pickle-to-npy", is_flag=True,
              help="Turn pickled numpy arrays (.pkl/.pickle members) into .npy members.")
@click.option("--out", default=None,
              help="Write a converted copy of the dataset here instead of rewriting ROOT.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Convert the shards as Ray tasks on the cluster (RAY_ADDRESS or a local Ray).")
@click.option("--shards-per-task", type=int, default=1, show_default=True,
              help="With --ray: shards converted by one Ray task.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def command(root: str, modality: str, pickle_to_npy: bool, out: str | None, use_ray: bool,
            shards_per_task: int, as_json: bool) -> None:
    """Rewrite MODALITY's tars under ROOT (a wdinfo.json or a folder searched for them)."""
    if not pickle_to_npy:
        raise IngestError("--pickle-to-npy: no conversion chosen (it is the only one so far)")
    executor = None
    if use_ray:
        from ray_ingest.tools.tasks import RayExecutor

        executor = RayExecutor()
    report = convert_pickles(root, modality, out=out, executor=executor,
                             shards_per_task=shards_per_task)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    click.echo(f"{modality}: {report.converted} tars converted ({report.pickles} pickled "
               f"arrays -> .npy), {report.unchanged} without pickles, {report.done} already done, "
               f"{report.shards} shards")
    if report.unnamed:
        click.echo(f"  left out {report.unnamed} members without a sample key")
    for m, n in sorted(report.missing.items()):
        click.echo(f"  {m}: {n} tars missing in the source, not copied")
    for url in report.wdinfos:
        click.echo(f"  {url}")
