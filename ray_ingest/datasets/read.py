"""``read_twin_tars``: twin tars as a Ray Dataset, one row per aligned sample.

Opens twin tars as a :class:`ray.data.Dataset` (raw member bytes plus provenance, optionally
decoded), so a notebook or an offline job can filter, aggregate or ``take()`` at cluster scale
with the read path training uses (:func:`ray_ingest.execution.read.read_item`).
"""
from __future__ import annotations

import logging
import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import ray

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.discovery import discover
from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.shard import Shard
from ray_ingest.config import DecodeConfig
from ray_ingest.errors import ConfigError
from ray_ingest.execution.raydata import ReadUnit, TwinTarDatasource, decode_udf
from ray_ingest.execution.read import TO_END, ReadItem
from ray_ingest.twintar.fsio import url_dirname
from ray_ingest.twintar.reader import ReadOptions
from ray_ingest.twintar.twin import INDEX, KEY, SHARD, ext_column

log = logging.getLogger(__name__)


#: Folder of the sample's wdinfo.json relative to the path it was read from ("" at the top).
LEAF = "__leaf__"
#: Aspect-ratio bucket of the sample's shard (``16_9``), "" outside ``aspect_ratio_*`` leaves.
BUCKET = "__bucket__"
#: Provenance columns of every row, in order.
PROVENANCE = (KEY, SHARD, INDEX, LEAF, BUCKET)
_SID = "__sid__"
#: Row columns the write path adds (output leaf, output shard path, position in it).
_OUT_LEAF, _OUT_PATH, _OUT_POS = "__out_leaf__", "__out_path__", "__out_pos__"
_SIZE = "__size__"


def _modalities(modalities: Sequence[str] | str | None, where: str) -> tuple[str, ...] | None:
    """``modalities=`` (a list or a comma-separated string) checked: distinct, non-empty."""
    if modalities is None:
        return None
    if isinstance(modalities, str):
        modalities = [m for m in modalities.split(",") if m]
    out = tuple(modalities)
    if not out or len(set(out)) != len(out) or not all(isinstance(m, str) and m for m in out):
        raise ConfigError(f"{where}: modalities: expected distinct names, got {list(out)}")
    return out


# =========================================================================== reading


def _schema(modalities: Sequence[str], with_sid: bool) -> pa.Schema:
    fields = [pa.field(KEY, pa.string()), pa.field(SHARD, pa.string()),
              pa.field(INDEX, pa.int64()), pa.field(LEAF, pa.string()),
              pa.field(BUCKET, pa.string())]
    if with_sid:
        fields.append(pa.field(_SID, pa.int64()))
    for m in modalities:
        fields += [pa.field(m, pa.binary()), pa.field(ext_column(m), pa.string())]
    return pa.schema(fields)


def _unit(shard: Shard, sid: int, leaf: str, count: int | None) -> ReadUnit:
    """A whole shard (``count`` None: read to its end, the wdinfo has no per-shard counts)."""
    item = ReadItem(seq=0, sid=sid, start=0, count=TO_END if count is None else count)
    return ReadUnit(shard, item, constants=((LEAF, leaf),))


def _tasks(units: Sequence[ReadUnit], num_blocks: int | None) -> list[list[ReadUnit]]:
    """One read task per shard; per shard slice with ``num_blocks`` above the shard count
    (needs per-shard counts), per run of whole shards below it."""
    units = list(units)
    if not num_blocks or num_blocks == len(units):
        return [[u] for u in units]
    if num_blocks < len(units):  # contiguous runs of whole shards
        bounds = np.linspace(0, len(units), num_blocks + 1).round().astype(int)
        return [units[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    if any(u.item.count >= TO_END for u in units):
        return [[u] for u in units]  # slicing needs per-shard counts
    target = max(1, math.ceil(sum(u.item.count for u in units) / num_blocks))
    return [[attrs.evolve(u, item=attrs.evolve(u.item, start=s,
                                               count=min(target, u.item.count - s)))]
            for u in units for s in range(0, u.item.count, target)]


def _leaves(paths: Sequence[str], storage_options: Mapping[str, Any]) -> dict[str, str]:
    """wdinfo URL -> its folder relative to the path it was found under."""
    import fsspec

    out: dict[str, str] = {}
    for p in paths:
        for url in discover(p, dict(storage_options)):
            if p.endswith(".json"):
                out.setdefault(url, "")
                continue
            base = fsspec.core.url_to_fs(p, **storage_options)[1].rstrip("/")
            leaf = fsspec.core.url_to_fs(url_dirname(url), **storage_options)[1].rstrip("/")
            rel = posixpath.relpath(leaf, base)
            out.setdefault(url, "" if rel == "." else rel)
    return out


def _default_decode(modalities: Sequence[str]) -> DecodeConfig:
    return DecodeConfig(
        image_modality="image" if "image" in modalities else None,
        caption_modality="caption" if "caption" in modalities else None,
        embedding_modality=next((m for m in ("umt5", "t5", "embedding") if m in modalities), None),
    )


class _DecodeColumns:
    """``ray_ingest.decode.decoder.Decoder`` (the loader's decode): the provenance columns, then
    every modality decoded and every field the hook adds (raw bytes and extensions dropped)."""

    def __init__(self, cfg: DecodeConfig, seed: int):
        from ray_ingest.decode.decoder import Decoder

        self.decoder = Decoder(cfg, seed=seed, on_error="raise")

    def __call__(self, batch: pa.Table) -> dict[str, Any]:
        from ray_ingest.columns import BOOKKEEPING, PLACEMENT

        out = self.decoder(batch)
        result: dict[str, Any] = {name: batch.column(name).to_numpy(zero_copy_only=False)
                                  for name in PROVENANCE}
        for name, col in out.items():
            if name not in result and name not in BOOKKEEPING and name not in (PLACEMENT, _SID):
                result[name] = col
        return result


def _at_least_one(**args: int | None) -> None:
    for name, value in args.items():
        if value is not None and value < 1:
            raise ConfigError(f"{name}: expected >= 1, got {value}")


def _shard_units(catalog: Catalog, leaf_of: Mapping[str, str]) -> list[ReadUnit]:
    """Every shard of ``catalog`` as a read unit, in catalog order, with its wdinfo's leaf."""
    units: list[ReadUnit] = []
    for w in catalog.wdinfos:
        for shard in w.tar_files:
            units.append(_unit(shard, len(units), leaf_of.get(w.source, ""), shard.count))
    return units


def _decode_config(decode: bool | DecodeConfig, modalities: Sequence[str]
                   ) -> DecodeConfig | None:
    """``read_twin_tars``' ``decode`` argument as a config (None: no decode), checked against
    the modalities read."""
    if decode is False:
        return None
    if decode is True:
        cfg = _default_decode(modalities)
    elif isinstance(decode, DecodeConfig):
        cfg = decode
    else:
        raise ConfigError(f"decode: expected a bool or a DecodeConfig, got {decode!r}")
    if cfg.device != "cpu":  # a training-time transport: rows here hold decoded pixels
        cfg = attrs.evolve(cfg, device="cpu")
    unknown = [k for k in cfg.decoded_modalities if k not in modalities]
    if unknown:
        raise ConfigError(f"decode: modalities {unknown} are not read "
                          f"(modalities: {list(modalities)})")
    return cfg


def read_twin_tars(
    paths: str | Sequence[str],
    *,
    modalities: Sequence[str] | str | None = None,
    align: str = "strict",
    optional: Sequence[str] = (),
    index_path: str | None = None,
    use_index: bool = True,
    decode: bool | DecodeConfig = False,
    transform: Any = None,
    seed: int = 0,
    block_rows: int = 64,
    storage_options: Mapping[str, Any] | None = None,
    override_num_blocks: int | None = None,
    concurrency: int | None = None,
    num_cpus: float | None = None,
    memory: float | None = None,
    label_selector: dict[str, str] | None = None,
) -> ray.data.Dataset:
    """Open twin-tar datasets as a :class:`ray.data.Dataset`, one row per aligned sample.

    Columns: ``__key__`` (str), ``__shard__`` (the shard's ``data_list`` path), ``__index__``
    (position in the shard), ``__leaf__`` (folder of the shard's wdinfo.json relative to the
    path it was found under; "" at the top), ``__bucket__`` (aspect bucket such as ``16_9``,
    "" outside ``aspect_ratio_*`` folders), then per modality ``<modality>`` (the member's
    bytes) and ``<modality>__ext`` (its extension). Rows come in catalog order within a read
    task; set ``DataContext.execution_options.preserve_order = True`` for catalog order overall.

    Args:
        paths: wdinfo.json files or folders searched for them (local, ``gs://``, ``memory://``).
        modalities: modality folders to read, the first drives alignment (default: the first
            wdinfo's ``data_keys``).
        align: ``strict`` | ``merge`` | ``index`` (as the loader, :mod:`ray_ingest.twintar.twin`).
        optional: modalities that may lack a sample (their value is then None).
        index_path: parquet key list for ``align="index"``.
        use_index: seek with the ``<tar>.idx.json`` key indexes when slicing shards.
        decode: True or a :class:`~ray_ingest.config.DecodeConfig`: decode with the loader's
            :class:`~ray_ingest.decode.decoder.Decoder` on an autoscaling actor pool
            (``pool_min..pool_max`` actors; ``compute="tasks"``: at most ``pool_max`` tasks).
            Decoded columns replace the raw ones, every modality by its decoder
            (``DecodeConfig.decoders``; by extension: image -> uint8 ``(H, W, 3)``, a 16-bit
            depth PNG -> uint16 ``(H, W)``, caption -> str, ``.npy`` -> the array, ``.cls`` ->
            int, anything else its bytes), image-like modalities in the image's geometry, then
            ``DecodeConfig.transform``'s fields. True picks ``image``/``caption``/``umt5``
            roles from ``modalities`` with defaults.
        transform: a user hook (``"package.module:function"`` or a callable,
            :mod:`ray_ingest.decode.hook`) run on every decoded sample; implies ``decode``.
        seed: seed of random crops when decoding (``DecodeConfig.crop="random"``).
        block_rows: rows per Arrow block yielded by a read task.
        storage_options: fsspec options (``token``, ``project``, ``endpoint_url``).
        override_num_blocks: number of read tasks: more than the shards cuts shards into
            slices (needs per-shard counts), fewer groups whole shards; default one per shard.
        concurrency: maximum concurrent read tasks.
        num_cpus: logical CPUs per read task (Ray's default 1; fractions avoid deadlocks on
            small clusters running Train workers too).
        memory: heap memory per read task, in bytes.
        label_selector: node labels for the read tasks (``{"pool": "cpu-decode"}``).

    Raises:
        CatalogError, ConfigError: bad paths or arguments (before anything runs). Read errors
        (missing tar, strict misalignment) surface when the Dataset executes, naming the shard.
    """
    so = dict(storage_options or {})
    mods = _modalities(modalities, "read_twin_tars")
    paths = [paths] if isinstance(paths, str) else list(paths)
    _at_least_one(block_rows=block_rows, override_num_blocks=override_num_blocks)
    opts = ReadOptions(align=align, optional=tuple(optional), use_index=use_index,
                       index_path=index_path, storage_options=so)
    catalog = load_catalog(paths, modalities=mods, storage_options=so)
    units = _shard_units(catalog, _leaves(paths, so))
    cfg = _decode_config(decode or transform is not None, catalog.modalities)
    if cfg is not None and transform is not None:
        cfg = attrs.evolve(cfg, transform=transform)
    source = TwinTarDatasource(_tasks(units, override_num_blocks), opts, block_rows=block_rows,
                               schema=_schema(catalog.modalities, with_sid=cfg is not None))
    ds = ray.data.read_datasource(
        source, override_num_blocks=override_num_blocks, concurrency=concurrency,
        num_cpus=num_cpus, memory=memory, label_selector=label_selector)
    return ds if cfg is None else _decoded(ds, cfg, seed)


def _decoded(ds: ray.data.Dataset, cfg: DecodeConfig, seed: int) -> ray.data.Dataset:
    """``ds`` decoded by the loader's Decoder on an actor pool (or tasks)."""
    return ds.map_batches(
        **decode_udf(cfg, _DecodeColumns, {"cfg": cfg, "seed": seed}),
        num_cpus=cfg.num_cpus,
        batch_format="pyarrow",
        udf_modifying_row_count=False,
        label_selector=dict(cfg.label_selector) or None,
    )
