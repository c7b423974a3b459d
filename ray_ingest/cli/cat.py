"""``ray-ingest cat``: samples as JSON lines (:func:`ray_ingest.tools.summary.iter_records`)."""

from __future__ import annotations

import json

import click

from ray_ingest.catalog.shard import ROOT_MODES
from ray_ingest.cli._options import modalities_arg, modalities_option
from ray_ingest.errors import IngestError
from ray_ingest.tools.summary import iter_records
from ray_ingest.twintar.twin import (
    ALIGN_MODES,
    AlignStats,
)


def _csv(text: str | None) -> list[str] | None:
    return [p.strip() for p in text.split(",") if p.strip()] if text else None


@click.command("cat")
@click.argument("paths", nargs=-1, required=True)
@modalities_option("Comma-separated modalities (default: data_keys); the first drives.")
@click.option("--align", type=click.Choice(ALIGN_MODES), default="strict", show_default=True)
@click.option("--index", "index_path", default=None,
              help="Parquet key list (first column; optional 'shard' column) for --align index.")
@click.option("--optional", default=None,
              help="Comma-separated modalities that may lack a sample or a tar.")
@click.option("--limit", type=int, default=None, help="Stop after N samples.")
@click.option("--root", "root_mode", type=click.Choice(ROOT_MODES), default="wdinfo",
              show_default=True, help="Tars under the wdinfo's root, or the folder holding it.")
@click.option("--decode", is_flag=True,
              help="Decode every modality (and run decode.transform): show dtypes and shapes.")
@click.option("--config", "config_path", default=None,
              help="YAML config whose decode section decodes (implies --decode).")
def command(paths: tuple[str, ...], modalities: str | None, align: str,
            index_path: str | None, optional: str | None, limit: int | None,
            root_mode: str, decode: bool, config_path: str | None) -> None:
    """One JSON line per sample of PATH... (wdinfo.json files or folders searched for them):
    {"key", "shard", "index", "<modality>": {"ext", "bytes", "sha1"}}; with --decode each
    modality and hook field decoded: {"dtype", "shape", "min", "max"} for arrays, else its
    type and a short view."""
    mods = modalities_arg(modalities)
    if align == "index" and index_path is None:
        raise IngestError("--index: --align index needs a parquet key list, got none")
    decoder = _decoder(config_path) if decode or config_path else None
    stats = AlignStats()
    try:
        for rec in iter_records(list(paths), mods, align=align, index_path=index_path,
                                optional=_csv(optional) or (), limit=limit, stats=stats,
                                root=root_mode, decoder=decoder):
            click.echo(json.dumps(rec))
    except OSError as exc:
        raise IngestError(f"read failed: {exc}") from None
    if align != "strict":
        click.echo(f"ray-ingest cat: {align} stats: {json.dumps(stats.to_dict())}", err=True)


def _decoder(config_path: str | None):
    """The loader's Decoder with the config's decode section (defaults without one)."""
    from ray_ingest.config import DecodeConfig, load_config
    from ray_ingest.decode.decoder import Decoder

    if config_path is None:
        return Decoder(DecodeConfig())
    cfg = load_config(config_path)
    return Decoder(cfg.decode, seed=cfg.loader.seed)
