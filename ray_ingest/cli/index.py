"""``ray-ingest index``: key indexes and per-shard counts
(:func:`ray_ingest.tools.index.index_dataset`)."""

from __future__ import annotations

import json

import click

from ray_ingest.catalog.shard import ROOT_MODES
from ray_ingest.tools.index import index_dataset


@click.command("index")
@click.argument("paths", nargs=-1, required=True)
@click.option("--modalities", default=None,
              help="Comma-separated modalities to index (default: each wdinfo's data_keys); "
                   "the first one's member counts are the shard counts.")
@click.option("--counts/--no-counts", default=True, show_default=True,
              help="Record data_list_key_count in each wdinfo.json (atomically).")
@click.option("--force", is_flag=True, help="Rebuild indexes that look current.")
@click.option("--num-workers", type=int, default=8, show_default=True,
              help="Tars indexed concurrently.")
@click.option("--root", "root_mode", type=click.Choice(ROOT_MODES), default="wdinfo",
              show_default=True, help="Tars under the wdinfo's root, or the folder holding it.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def command(paths: tuple[str, ...], modalities: str | None, counts: bool, force: bool,
            num_workers: int, root_mode: str, as_json: bool) -> None:
    """Write <tar>.idx.json beside every tar of every modality of PATH... (wdinfo.json files
    or folders searched for them) and record the samples per shard in each wdinfo.json."""
    mods = [m.strip() for m in modalities.split(",") if m.strip()] if modalities else None
    report = index_dataset(list(paths), mods, counts=counts, force=force,
                           num_workers=num_workers, root=root_mode)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    for w in report.wdinfos:
        click.echo(f"{w.wdinfo}: {w.shards} shards x {len(w.modalities)} modalities "
                   f"({', '.join(w.modalities)}): {w.written} indexes written, {w.kept} kept; "
                   f"{w.samples} samples; data_list_key_count {w.counts}")
        if w.samples != w.total_key_count:
            click.echo(f"  note: total_key_count is {w.total_key_count}, the tars hold "
                       f"{w.samples} samples (left as it is)")
        for m, (n, first) in w.missing.items():
            click.echo(f"  {m}: {n} tars missing (first: {first})")
        if w.num_mismatches:
            click.echo(f"  {w.num_mismatches} shards whose modalities hold different numbers "
                       f"of members, e.g. {w.mismatches[0][0]}: {w.mismatches[0][1]}")
