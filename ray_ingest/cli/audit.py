"""`ray-ingest audit DIR --data PATH`: exactly-once check of a consumption ledger."""

from __future__ import annotations

import json

import click

from ray_ingest.audit import audit, keys_at, read_ledgers
from ray_ingest.catalog import load_catalog


@click.command("audit")
@click.argument("ledger_dir")
@click.option("--data", "data", multiple=True, required=True, help="dataset path(s) trained on")
@click.option("--keys", default=None, help="modalities, comma-separated (as trained)")
@click.option("--step", type=int, default=None, help="show the keys of this global step")
@click.option("--rank", type=int, default=0, show_default=True, help="rank for --step")
def command(ledger_dir: str, data: tuple[str, ...], keys: str | None, step: int | None,
            rank: int) -> None:
    """Per epoch: samples expected, seen, duplicated, missing (exit 1 if not exactly-once)."""
    ledgers = read_ledgers(ledger_dir)
    if step is not None:
        click.echo(json.dumps(keys_at(ledgers, rank, step)))
        return
    catalog = load_catalog(list(data), keys=keys.split(",") if keys else None)
    bad = False
    for report in audit(ledgers, catalog):
        click.echo(json.dumps(report))
        bad |= report["complete"] and not report["exactly_once"]
    if bad:
        raise click.exceptions.Exit(1)
