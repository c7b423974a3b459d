"""`ray-ingest audit DIR --data PATH`: exactly-once check of a consumption ledger."""

from __future__ import annotations

import json

import attrs
import click
from tqdm import tqdm

from ray_ingest.catalog.load import load_catalog
from ray_ingest.cli._options import modalities_arg, modalities_option
from ray_ingest.tools.audit import (
    VIOLATION,
    audit,
    keys_at,
    read_ledgers,
)


@click.command("audit")
@click.argument("ledger_dir")
@click.option("--data", "data", multiple=True, required=True, help="dataset path(s) trained on")
@modalities_option("modalities, comma-separated (as trained)")
@click.option("--step", type=int, default=None, help="show the keys of this global step")
@click.option("--rank", type=int, default=0, show_default=True, help="rank for --step")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr, one tick per epoch (default: only on a terminal).")
def command(ledger_dir: str, data: tuple[str, ...], modalities: str | None,
            old_keys: str | None, step: int | None, rank: int, progress: bool | None) -> None:
    """Per epoch: samples expected, seen, duplicated, missing, and a status: exactly-once,
    incomplete (the run stopped inside the epoch) or violation (exit 1)."""
    mods = modalities_arg(modalities, old_keys)
    ledgers = read_ledgers(ledger_dir)
    if step is not None:
        click.echo(json.dumps(keys_at(ledgers, rank, step)))
        return
    catalog = load_catalog(list(data), modalities=mods)
    bad = False
    epochs = sorted({b["epoch"] for lg in ledgers.values() for b in lg.batches}
                    | {e for lg in ledgers.values() for e in lg.epoch_ends})
    bar = tqdm(epochs, desc="audit", unit="epoch",
               disable=None if progress is None else not progress)
    for epoch in bar:  # epochs are audited independently: one at a time, reported as they finish
        view = {r: attrs.evolve(lg, batches=[b for b in lg.batches if b["epoch"] == epoch],
                                epoch_ends={e: s for e, s in lg.epoch_ends.items() if e == epoch})
                for r, lg in ledgers.items()}
        for report in audit(view, catalog):
            bar.clear()
            click.echo(json.dumps(report))
            bad |= report["status"] == VIOLATION
    if bad:
        raise click.exceptions.Exit(1)
