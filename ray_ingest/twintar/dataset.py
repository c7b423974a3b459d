"""Writing a whole twin-tar dataset: shard jobs in parallel, ``wdinfo.json``, the output folder.

``ray-ingest shard``, ``synth`` and ``convert`` and :func:`~ray_ingest.datasets.write.
write_twin_tars` all end here: shards are written through :class:`~ray_ingest.twintar.writer.
ShardWriter` (``.partial`` names, renamed when complete), a re-run keeps complete shards, and
``wdinfo.json`` is written last, atomically. No Ray, no torch.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import fsspec

from ray_ingest.errors import ConfigError
from ray_ingest.twintar.fsio import PARTIAL_SUFFIX, join_url, write_file_atomic
from ray_ingest.twintar.layout import WDINFO_NAME
from ray_ingest.twintar.tario import index_url
from ray_ingest.twintar.writer import Members, ShardInfo, ShardWriter

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- wdinfo


def write_wdinfo(
    leaf: str,
    data_list: Sequence[str],
    counts: Sequence[int],
    data_keys: Sequence[str],
    chunk_size: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write ``<leaf>/wdinfo.json`` (indent 2) and return its URL.

    Args:
        leaf: folder holding the modality folders.
        data_list: relative tar paths, in reading order.
        counts: samples per tar (``data_list_key_count``).
        data_keys: modality folders; the first one drives alignment by default.
        chunk_size: samples per shard for PiD's resume arithmetic; None = floored mean of
            ``counts`` (PiD's fallback), at least 1.
        storage_options: fsspec options.
    """
    if not data_list:
        raise ConfigError(f"{leaf}: data_list: expected at least one shard, got none")
    if len(counts) != len(data_list):
        raise ConfigError(
            f"{leaf}: counts: expected {len(data_list)} entries (one per shard), got {len(counts)}"
        )
    if len(set(data_list)) != len(data_list):
        raise ConfigError(f"{leaf}: data_list: expected distinct paths")
    if not data_keys:
        raise ConfigError(f"{leaf}: data_keys: expected at least one modality, got none")
    if any(c < 0 for c in counts):
        raise ConfigError(f"{leaf}: counts: expected values >= 0, got {list(counts)}")
    if chunk_size is None:
        chunk_size = max(1, int(sum(counts) / len(counts)))
    if chunk_size <= 0:
        raise ConfigError(f"{leaf}: chunk_size: expected > 0, got {chunk_size}")
    doc = {
        "data_list": list(data_list),
        "data_list_key_count": [int(c) for c in counts],
        "total_key_count": int(sum(counts)),
        "chunk_size": int(chunk_size),
        "data_keys": list(data_keys),
        "root": ".",
    }
    url = join_url(leaf, WDINFO_NAME)
    write_file_atomic(url, (json.dumps(doc, indent=2) + "\n").encode(), storage_options)
    return url


# --------------------------------------------------------------------------- many shards


@attrs.frozen
class ShardJob:
    """One shard to write: where, and the opaque sample items a loader turns into members."""

    leaf: str
    path: str
    items: tuple[Any, ...] = attrs.field(converter=tuple)


@attrs.define
class DatasetReport:
    """What a dataset write produced (returned by ``shard`` and ``synth``)."""

    #: Samples written in all shards.
    samples: int = 0
    #: Shards written.
    shards: int = 0
    #: Modality folders, in ``data_keys`` order.
    modalities: tuple[str, ...] = ()
    #: wdinfo.json URLs written, sorted.
    wdinfos: list[str] = attrs.field(factory=list)
    #: Tar bytes per modality.
    bytes: dict[str, int] = attrs.field(factory=dict)
    #: Samples per aspect-ratio bucket (empty when not classified).
    buckets: dict[str, int] = attrs.field(factory=dict)
    #: Input files not written, per folder and reason (``shard`` only).
    dropped: dict[str, dict[str, int]] = attrs.field(factory=dict)

    def drop(self, folder: str, reason: str, n: int = 1) -> None:
        per = self.dropped.setdefault(folder, {})
        per[reason] = per.get(reason, 0) + n

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "shards": self.shards,
            "modalities": list(self.modalities),
            "wdinfos": list(self.wdinfos),
            "bytes": dict(self.bytes),
            "buckets": dict(sorted(self.buckets.items())),
            "dropped": {f: dict(sorted(r.items())) for f, r in sorted(self.dropped.items())},
        }


#: A loader turns one job item into ``(key, members)``, or None to skip it (already counted).
Loader = Callable[[Any], "tuple[str, Members] | None"]


def write_jobs(
    jobs: Sequence[ShardJob],
    modalities: Sequence[str],
    load: Loader,
    *,
    num_workers: int = 1,
    progress: bool | None = False,
    storage_options: Mapping[str, Any] | None = None,
) -> list[ShardInfo]:
    """Write every job's shard (in a thread pool when ``num_workers > 1``); keep job order.

    Shards that end up empty (every item skipped by ``load``) are deleted and left out.
    ``progress``: tqdm bar on stderr (None: only on a terminal).
    """
    from tqdm import tqdm

    if num_workers < 1:
        raise ConfigError(f"num_workers: expected >= 1, got {num_workers}")
    total = sum(len(j.items) for j in jobs)
    disable = None if progress is None else not progress
    bar = tqdm(total=total, unit="sample", file=sys.stderr, disable=disable, dynamic_ncols=True)

    def run(job: ShardJob) -> ShardInfo | None:
        with ShardWriter(job.leaf, job.path, modalities, storage_options=storage_options) as w:
            for item in job.items:
                loaded = load(item)
                if loaded is not None:
                    w.add(*loaded)
        bar.update(len(job.items))
        if w.info.count == 0:
            _remove_shard(w, storage_options)
            return None
        return w.info

    try:
        if num_workers == 1:
            results = [run(j) for j in jobs]
        else:
            with ThreadPoolExecutor(max_workers=num_workers) as pool:
                results = list(pool.map(run, jobs))
    finally:
        bar.close()
    return [r for r in results if r is not None]


def _remove_shard(w: ShardWriter, storage_options: Mapping[str, Any] | None) -> None:
    for m in w.modalities:
        for url in (w.url(m), index_url(w.url(m))):
            fs, fspath = fsspec.core.url_to_fs(url, **(storage_options or {}))
            if fs.exists(fspath):
                fs.rm(fspath)


def finish_dataset(
    infos: Sequence[ShardInfo],
    modalities: Sequence[str],
    report: DatasetReport,
    *,
    chunk_size: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> DatasetReport:
    """Write one wdinfo.json per leaf (shards in path order) and fill ``report``'s totals."""
    by_leaf: dict[str, list[ShardInfo]] = {}
    for info in infos:
        by_leaf.setdefault(info.leaf, []).append(info)
    report.modalities = tuple(modalities)
    for leaf in sorted(by_leaf):
        shards = sorted(by_leaf[leaf], key=lambda s: s.path)
        report.wdinfos.append(write_wdinfo(
            leaf, [s.path for s in shards], [s.count for s in shards], modalities,
            chunk_size=chunk_size, storage_options=storage_options,
        ))
    report.wdinfos.sort()
    for info in infos:
        report.samples += info.count
        report.shards += 1
        for m, n in info.bytes.items():
            report.bytes[m] = report.bytes.get(m, 0) + n
    return report


def prepare_output(out_dir: str, *, overwrite: bool = False,
                   storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse a non-empty output folder; with ``overwrite``, clear one that holds only a
    dataset this module could have written (tars, key indexes, wdinfo.json)."""
    fs, fspath = fsspec.core.url_to_fs(out_dir, **(storage_options or {}))
    if not fs.exists(fspath):
        return
    if not fs.isdir(fspath):
        raise ConfigError(f"{out_dir}: output must be a folder, got a file")
    files = fs.find(fspath)
    if not files:
        return
    if not overwrite:
        raise ConfigError(f"{out_dir}: output folder is not empty (pass --overwrite to replace "
                          "a dataset written by ray-ingest)")
    ours = (".tar", ".idx.json", WDINFO_NAME, PARTIAL_SUFFIX)
    foreign = [p for p in files if not p.endswith(ours)]
    if foreign:
        raise ConfigError(f"{out_dir}: refusing to overwrite, it holds other files "
                          f"(e.g. {foreign[0]})")
    fs.rm(fspath, recursive=True)
