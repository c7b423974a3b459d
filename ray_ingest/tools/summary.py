"""Library side of ``ray-ingest info`` and ``ray-ingest cat``.

:func:`summarize` describes datasets (wdinfo files, shards, samples, modalities, tar bytes per
modality, aspect-ratio buckets) without opening a tar. :func:`iter_records` expands shards with
:func:`ray_ingest.twintar.reader.read_shard` — the same path the Ray read tasks take — and turns
each sample into a small JSON-able record (key, shard, index and per modality ext/bytes/sha1).

No Ray, no torch.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import fsspec

from ray_ingest.catalog.discovery import check_roots
from ray_ingest.catalog.discovery import discover as discover_wdinfos
from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.shard import DEFAULT_MODALITIES
from ray_ingest.catalog.wdinfo import (
    read_wdinfo,
)
from ray_ingest.columns import SID
from ray_ingest.errors import CatalogError
from ray_ingest.twintar.fsio import same_place
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_shard,
)
from ray_ingest.twintar.twin import (
    INDEX,
    KEY,
    SHARD,
    AlignStats,
    ext_column,
)


def _split_url(url: str) -> tuple[str, str]:
    head, _, tail = url.rpartition("/")
    return head, tail


def _tar_sizes(urls: Sequence[str], storage_options: Mapping[str, Any]) -> dict[str, int | None]:
    """Size of each tar URL (None when missing), one listing per parent folder."""
    by_dir: dict[str, list[str]] = {}
    for u in urls:
        by_dir.setdefault(_split_url(u)[0], []).append(u)
    out: dict[str, int | None] = {}
    for parent, members in by_dir.items():
        fs, path = fsspec.core.url_to_fs(parent, **storage_options)
        try:
            listing = {posixpath.basename(e["name"].rstrip("/")): e
                       for e in fs.ls(path, detail=True)}
        except FileNotFoundError:
            listing = {}
        for u in members:
            entry = listing.get(_split_url(u)[1])
            ok = entry is not None and entry.get("type") == "file"
            out[u] = int(entry.get("size") or 0) if ok else None
    return out


def summarize(
    paths: str | Sequence[str],
    modalities: Sequence[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    root: str = "wdinfo",
) -> dict[str, Any]:
    """Summary of the datasets under ``paths`` (wdinfo.json files or folders searched for them).

    Returns a JSON-able dict: ``datasets`` (wdinfo files), ``shards``, ``samples``,
    ``modalities``, ``bytes`` (tar bytes per modality), ``buckets`` (aspect-ratio bucket ->
    samples) and ``wdinfos`` (one entry per file with the same fields, plus ``root`` in use,
    ``wdinfo_root``, ``folder`` and where the per-shard counts come from). ``root``: read the
    tars under each wdinfo's ``root`` (``wdinfo``) or the folder holding it (``folder``).
    ``modalities`` default to each wdinfo's ``data_keys``.

    Raises:
        CatalogError: a wdinfo is missing or malformed, or a listed tar does not exist.
    """
    so = dict(storage_options or {})
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise CatalogError("no dataset paths given")
    urls = [u for p in paths for u in discover_wdinfos(p, so)]
    total: dict[str, Any] = {"datasets": 0, "shards": 0, "samples": 0, "modalities": [],
                             "bytes": {}, "buckets": {}, "wdinfos": []}
    for url in urls:
        probe = read_wdinfo(url, modalities or None, storage_options=so, root=root)
        mods = tuple(modalities) if modalities else (probe.listed_modalities or DEFAULT_MODALITIES)
        probe = probe._replace(modalities=mods)
        check_roots([probe], [so], root)
        nbytes: dict[str, int] = {}
        for m in mods:
            tar_urls = probe.urls(m)
            sizes = _tar_sizes(tar_urls, so)
            missing = [u for u in tar_urls if sizes[u] is None]
            if missing:
                raise CatalogError(
                    f"{url}: {len(missing)} of {len(probe)} {m} tars are missing "
                    f"(first: {missing[0]})"
                )
            nbytes[m] = sum(v for v in sizes.values() if v is not None)
        samples = (int(probe.counts.sum()) if probe.counts is not None
                   else probe.total_key_count)
        bucket = probe.bucket
        entry = {
            "wdinfo": url,
            "root": probe.root,
            "wdinfo_root": probe.wdinfo_root,
            "folder": probe.folder,
            "shards": len(probe),
            "samples": samples,
            "counts": probe.count_source,
            "chunk_size": probe.chunk_size,
            "modalities": list(mods),
            "bytes": nbytes,
            "bucket": bucket,
        }
        total["wdinfos"].append(entry)
        total["datasets"] += 1
        total["shards"] += len(probe)
        total["samples"] += samples
        for m in mods:
            if m not in total["modalities"]:
                total["modalities"].append(m)
            total["bytes"][m] = total["bytes"].get(m, 0) + nbytes[m]
        if bucket is not None:
            total["buckets"][bucket] = total["buckets"].get(bucket, 0) + samples
    total["buckets"] = dict(sorted(total["buckets"].items()))
    return total


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def format_summary(summary: Mapping[str, Any]) -> str:
    """Human-readable text of :func:`summarize`'s result."""
    lines = [
        f"datasets:   {summary['datasets']} wdinfo.json",
        f"shards:     {summary['shards']}",
        f"samples:    {summary['samples']}",
        f"modalities: {', '.join(summary['modalities'])}",
        "bytes:      " + ", ".join(f"{m} {_human(n)}" for m, n in summary["bytes"].items()),
    ]
    if summary["buckets"]:
        lines.append("buckets:    " + ", ".join(
            f"{b} {n}" for b, n in summary["buckets"].items()))
    for w in summary["wdinfos"]:
        extra = f", bucket {w['bucket']}" if w["bucket"] else ""
        counts = w.get("counts") or "unknown (total_key_count only)"
        lines.append(f"  {w['wdinfo']}: {w['shards']} shards, {w['samples']} samples, "
                     f"chunk_size {w['chunk_size']}{extra}, counts from {counts}")
        if same_place(w["wdinfo_root"], w["folder"]):
            lines.append(f"    root: {w['root']}")
        else:
            mode, other, other_mode = (("wdinfo", w["folder"], "folder")
                                       if w["root"] == w["wdinfo_root"]
                                       else ("folder", w["wdinfo_root"], "wdinfo"))
            lines.append(f"    root: {w['root']} (data.root: {mode}); the other choice: "
                         f"{other} (--root {other_mode})")
    return "\n".join(lines)


def record(row: Mapping[str, Any], modalities: Sequence[str]) -> dict[str, Any]:
    """``{"key", "shard", "index", <modality>: {"ext", "bytes", "sha1"} | None}`` of a row."""
    out: dict[str, Any] = {"key": row[KEY], "shard": row[SHARD], "index": row[INDEX]}
    for m in modalities:
        data = row.get(m)
        if data is None:
            out[m] = None
            continue
        out[m] = {"ext": row.get(ext_column(m)), "bytes": len(data),
                  "sha1": hashlib.sha1(data).hexdigest()}
    return out


def describe(value: Any) -> Any:
    """A decoded value as ``cat --decode`` shows it: arrays by dtype and shape, the rest by
    type and a short view."""
    import numpy as np

    if value is None:
        return None
    if isinstance(value, np.ndarray):
        out: dict[str, Any] = {"dtype": str(value.dtype), "shape": list(value.shape)}
        if value.size and value.dtype.kind in "biuf":
            out["min"], out["max"] = value.min().item(), value.max().item()
        return out
    if isinstance(value, (bool, int, float, np.number)):
        return {"type": type(value).__name__, "value": value.item()
                if isinstance(value, np.generic) else value}
    if isinstance(value, str):
        return {"type": "str", "chars": len(value), "text": value[:60]}
    if isinstance(value, (bytes, bytearray)):
        return {"type": "bytes", "bytes": len(value)}
    if isinstance(value, dict):
        return {"type": "dict", "keys": sorted(map(str, value))[:12]}
    return {"type": type(value).__name__}


def decoded_record(row: Mapping[str, Any], decoder: Any) -> dict[str, Any]:
    """``{"key", "shard", "index", <field>: describe(value)}``: the row through ``decoder`` (every
    modality, then the hook's fields); a failure is the decoder's one-line IngestError."""
    block = decoder({k: [v] for k, v in row.items()})
    out: dict[str, Any] = {"key": row[KEY], "shard": row[SHARD], "index": row[INDEX]}
    for name, col in block.items():
        if not name.startswith("__"):
            out[name] = describe(col[0])
    return out


def iter_records(
    paths: str | Sequence[str],
    modalities: Sequence[str] | None = None,
    *,
    align: str = "strict",
    index_path: str | None = None,
    optional: Sequence[str] = (),
    limit: int | None = None,
    stats: AlignStats | None = None,
    storage_options: Mapping[str, Any] | None = None,
    root: str = "wdinfo",
    decoder: Any = None,
) -> Iterator[dict[str, Any]]:
    """Records of every sample of the datasets under ``paths``, in catalog order.

    Args:
        paths: wdinfo.json files or folders searched for them.
        modalities: modalities to read (default: the first wdinfo's ``data_keys``); the first
            drives alignment.
        align: ``strict`` | ``merge`` | ``index``.
        index_path: parquet key list for ``index`` mode.
        optional: modalities that may lack a sample or a whole tar.
        limit: stop after this many records.
        stats: alignment counters to update (merge/index skips).
        storage_options: fsspec options.
        root: ``wdinfo`` (the wdinfo's root) or ``folder`` (the folder holding it).
        decoder: a :class:`~ray_ingest.decode.decoder.Decoder`: records of decoded fields
            (:func:`decoded_record`) instead of member sizes and digests.
    """
    if limit is not None and limit <= 0:
        return
    catalog = load_catalog(list(paths) if not isinstance(paths, str) else paths,
                           modalities=modalities, storage_options=dict(storage_options or {}),
                           root=root)
    opts = ReadOptions(align=align, optional=tuple(optional), index_path=index_path,
                       storage_options=dict(storage_options or {}))
    n = 0
    for sid, shard in enumerate(catalog.shards):
        for row in read_shard(shard, opts=opts, stats=stats):
            yield (record(row, shard.modalities) if decoder is None
                   else decoded_record({**row, SID: sid}, decoder))
            n += 1
            if limit is not None and n >= limit:
                return
