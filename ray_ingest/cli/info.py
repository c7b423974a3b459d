"""``ray-ingest info``: summary of datasets (:func:`ray_ingest.tools.summary.summarize`)."""

from __future__ import annotations

import json

import click

from ray_ingest.catalog.shard import ROOT_MODES
from ray_ingest.cli._options import modalities_arg, modalities_option
from ray_ingest.errors import IngestError
from ray_ingest.tools.summary import (
    format_summary,
    summarize,
)


@click.command("info")
@click.argument("paths", nargs=-1, required=True)
@modalities_option("Comma-separated modalities (default: data_keys).")
@click.option("--root", "root_mode", type=click.Choice(ROOT_MODES), default="wdinfo",
              show_default=True, help="Tars under the wdinfo's root, or the folder holding it.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def command(paths: tuple[str, ...], modalities: str | None, old_keys: str | None, root_mode: str,
            as_json: bool) -> None:
    """Datasets, shards, samples, modalities, bytes, buckets and the root in use of PATH...
    (wdinfo.json files or folders searched for them)."""
    mods = modalities_arg(modalities, old_keys)
    try:
        summary = summarize(list(paths), modalities=mods, root=root_mode)
    except OSError as exc:
        raise IngestError(f"cannot read dataset: {exc}") from None
    click.echo(json.dumps(summary) if as_json else format_summary(summary))
