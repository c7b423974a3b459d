"""The sharding tool: raw modality folders -> twin tars + wdinfo.json (``ray-ingest shard``).

Input: one subfolder per modality (any names), files keyed by stem::

    in/image/a.jpg  in/image/b.png  in/caption/a.json  in/caption/b.json  in/umt5/a.npy ...

How it works:

1. Scan each folder's top-level files. A stem counts in a folder when exactly one usable file
   has it (hidden files, files without extension, several files per stem, unreadable entries,
   links and special files, never followed, and files over ``max_file_size_mb`` are dropped
   and counted). A modality folder that is a link is refused.
2. Samples = the stems usable in **every** folder, sorted (or shuffled with ``seed``). Keys are
   the stems with ``.`` replaced by ``-`` (what readers would make of them anyway), optionally
   prefixed ``<dataset_name>__``; stems that collide after that are dropped.
3. Optionally bucket by aspect ratio (image header read with Pillow, no decode) into
   ``aspect_ratio_W_H/`` leaves; each leaf numbers its shards from 0.
4. Group into shards by size of the primary modality's file (``max_shard_size_mb``) or by
   count (``shard_size``), write them with :mod:`ray_ingest.twintar.writer` (thread pool, progress
   bar on stderr; or groups of shards as Ray tasks through an executor,
   :mod:`ray_ingest.tools.tasks`) and write one wdinfo.json per leaf.

Every input file is accounted for: written, or dropped under its folder with a reason
(:data:`REASONS`). Unlike PiD's sharder the order is deterministic and nothing is dropped
silently. No Ray, no torch.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import fsspec

from ray_ingest.errors import ConfigError, IngestError
from ray_ingest.redact import options_repr, register
from ray_ingest.tools.tasks import Executor
from ray_ingest.twintar.dataset import (
    DatasetReport,
    ShardJob,
    finish_dataset,
    prepare_output,
    write_jobs,
)
from ray_ingest.twintar.layout import (
    ASPECT_RATIOS,
    aspect_bucket,
    bucket_dir,
    check_key,
    pack_shards,
    shard_rel_path,
)
from ray_ingest.twintar.writer import (
    Members,
    ShardInfo,
)

#: Why an input file was not written.
NOT_EVERYWHERE = "not in every folder"
UNREADABLE = "unreadable"
TOO_LARGE = "too large"
NO_EXTENSION = "no extension"
HIDDEN = "hidden"
AMBIGUOUS = "several files share the stem"
BAD_KEY = "unusable key"
COLLISION = "key collision"
OTHER_FOLDER = "sample dropped in another folder"
BEYOND_LIMIT = "beyond limit"
#: A symbolic link, device, FIFO or socket: never read (a link can point anywhere).
SPECIAL = "link or special file"
REASONS = (NOT_EVERYWHERE, UNREADABLE, TOO_LARGE, NO_EXTENSION, HIDDEN, AMBIGUOUS, BAD_KEY,
           COLLISION, OTHER_FOLDER, BEYOND_LIMIT, SPECIAL)

_MB = 1024 * 1024


@attrs.frozen
class _File:
    url: str
    ext: str
    size: int


@attrs.frozen
class _Item:
    """One sample to write: its key and, per modality, (url, extension)."""

    key: str
    files: tuple[tuple[str, str, str], ...]


@attrs.frozen
class _ShardWriters:
    """Writes a list of shard jobs; returns their infos and the inputs dropped while reading.

    Picklable, so an executor can run groups of shards as Ray tasks.
    """

    modalities: tuple[str, ...]
    storage_options: dict[str, Any] = attrs.field(repr=options_repr)
    num_workers: int = 1
    progress: bool | None = False

    def __call__(self, jobs: Sequence[ShardJob]
                 ) -> tuple[list[ShardInfo], dict[str, dict[str, int]]]:
        so = self.storage_options
        register(so)  # maybe a Ray task's process: its errors never show them
        drops = DatasetReport()
        lock = threading.Lock()

        def load(item: _Item) -> tuple[str, Members] | None:
            members: dict[str, tuple[str, bytes]] = {}
            for folder, url, ext in item.files:
                try:
                    with fsspec.open(url, "rb", **so) as f:
                        members[folder] = (ext, f.read())
                except OSError:
                    with lock:
                        drops.drop(folder, UNREADABLE)
                        for other, _, _ in item.files:
                            if other != folder:
                                drops.drop(other, OTHER_FOLDER)
                    return None
            return item.key, members

        infos = write_jobs(jobs, self.modalities, load, num_workers=self.num_workers,
                           progress=self.progress, storage_options=so)
        return infos, drops.dropped


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _scan(
    fs: fsspec.AbstractFileSystem,
    folder_path: str,
    folder: str,
    protocol_prefix: str,
    max_file_bytes: int,
    report: DatasetReport,
) -> tuple[dict[str, _File], dict[str, tuple[str, int]]]:
    """Usable files by stem, and bad stems -> (reason, files)."""
    by_stem: dict[str, list[dict[str, Any]]] = {}
    for entry in fs.ls(folder_path, detail=True):
        name = _basename(entry["name"])
        if entry.get("type") == "directory":
            continue
        if name.startswith("."):
            report.drop(folder, HIDDEN)
            continue
        stem, dot, ext = name.rpartition(".")
        if not dot or not stem or not ext:
            report.drop(folder, NO_EXTENSION)
            continue
        by_stem.setdefault(stem, []).append(entry)
    good: dict[str, _File] = {}
    bad: dict[str, tuple[str, int]] = {}
    for stem, entries in by_stem.items():
        if len(entries) > 1:
            bad[stem] = (AMBIGUOUS, len(entries))
            continue
        entry = entries[0]
        if entry.get("islink") or entry.get("type") == "other":
            bad[stem] = (SPECIAL, 1)  # link, device, FIFO, socket: never followed or read
            continue
        if entry.get("type") != "file":
            bad[stem] = (UNREADABLE, 1)
            continue
        size = int(entry.get("size") or 0)
        if size > max_file_bytes:
            bad[stem] = (TOO_LARGE, 1)
            continue
        url = entry["name"]
        if protocol_prefix and not url.startswith(protocol_prefix):
            url = protocol_prefix + url.lstrip("/")
        good[stem] = _File(url=url, ext=_basename(url).rpartition(".")[2], size=size)
    return good, bad


def _image_size(url: str, storage_options: Mapping[str, Any]) -> tuple[int, int] | None:
    from PIL import Image

    try:
        with fsspec.open(url, "rb", **storage_options) as f, Image.open(f) as im:
            return im.size  # header only: Pillow decodes lazily
    except Exception:  # noqa: BLE001 - any failure means "unreadable image"
        return None


def shard_folders(
    input_dir: str,
    output_dir: str,
    *,
    max_shard_size_mb: float = 500.0,
    shard_size: int | None = None,
    part_size: int = 1000,
    classify_aspect_ratio: bool = False,
    aspect_ratios: Sequence[tuple[int, int]] = ASPECT_RATIOS,
    dataset_name: str | None = None,
    shuffle: bool = False,
    seed: int = 0,
    limit: int | None = None,
    size_based_on: str | None = None,
    max_file_size_mb: float = 1024.0,
    num_workers: int = 1,
    progress: bool | None = False,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    executor: Executor | None = None,
    shards_per_task: int = 1,
) -> DatasetReport:
    """Shard the modality subfolders of ``input_dir`` into a twin-tar dataset in ``output_dir``.

    Args:
        input_dir: folder with one subfolder per modality.
        output_dir: empty (or absent) output folder.
        max_shard_size_mb: size mode: shard budget over the primary modality's file sizes.
        shard_size: count mode (samples per shard); overrides size mode when given.
        part_size: shards per ``part_XXXXXX`` folder; 0 names tars ``{id:08d}.tar`` flat.
        classify_aspect_ratio: bucket samples into ``aspect_ratio_W_H/`` leaves.
        aspect_ratios: the buckets, in tie-breaking order.
        dataset_name: optional key prefix (``<name>__<stem>``).
        shuffle: seeded shuffle of the sorted samples (``seed``) instead of sorted order.
        seed: shuffle seed.
        limit: keep only the first ``limit`` samples (after ordering).
        size_based_on: primary modality (size mode, aspect ratio, first in ``data_keys``);
            default ``image`` when present, else the first folder in sorted order.
        max_file_size_mb: files larger than this are dropped (``too large``).
        num_workers: threads writing shards (and reading image headers).
        progress: tqdm bar on stderr; None shows it only on a terminal.
        overwrite: replace an output folder that holds only a previously written dataset.
        storage_options: fsspec options for input and output.
        executor: runs groups of ``shards_per_task`` shards as jobs, e.g.
            :class:`~ray_ingest.tools.tasks.RayExecutor` for one Ray task per group; None writes
            here with ``num_workers`` threads. The output is byte-identical either way.
        shards_per_task: shards per executor job.

    Returns:
        The :class:`~ray_ingest.twintar.dataset.DatasetReport` (``dropped`` per folder, reason).

    Raises:
        ConfigError: bad arguments, no modality folders, or no sample usable in every folder.
    """
    so = dict(storage_options or {})
    register(so)
    _check_args(shard_size, max_shard_size_mb, max_file_size_mb, num_workers, shards_per_task,
                limit, dataset_name)
    fs, root = fsspec.core.url_to_fs(input_dir, **so)
    sel = _Selection(_modality_folders(fs, root, input_dir, size_based_on))
    protocol = fs.protocol[0] if isinstance(fs.protocol, (list, tuple)) else fs.protocol
    sel.scan(fs, root, "" if protocol in ("file", "local") else f"{protocol}://",
             int(max_file_size_mb * _MB))
    stems, keys = sel.keyed(sel.common_stems(), dataset_name)
    stems = sel.ordered(stems, shuffle, seed, limit)
    bucket_of, stems = sel.bucketed(stems, classify_aspect_ratio, aspect_ratios,
                                    max(num_workers, 8), so)
    sel.require(stems, input_dir)
    jobs, leaf_bucket = sel.plan(stems, keys, bucket_of, output_dir, shard_size,
                                 int(max_shard_size_mb * _MB), part_size)
    # write here, or one task per group of shards on an executor: the same bytes either way
    prepare_output(output_dir, overwrite=overwrite, storage_options=so)
    writer = _ShardWriters(tuple(sel.modalities), so, num_workers=num_workers,
                           progress=progress if executor is None else False)
    if executor is None:
        results = [writer(jobs)]
    else:
        results = executor.map(writer, [jobs[i : i + shards_per_task]
                                        for i in range(0, len(jobs), shards_per_task)])
    return _finish(input_dir, results, sel, leaf_bucket, shard_size, so)


def _check_args(shard_size: int | None, max_shard_size_mb: float, max_file_size_mb: float,
                num_workers: int, shards_per_task: int, limit: int | None,
                dataset_name: str | None) -> None:
    if shard_size is not None and shard_size < 1:
        raise ConfigError(f"shard_size: expected >= 1, got {shard_size}")
    if shard_size is None and not max_shard_size_mb > 0:
        raise ConfigError(f"max_shard_size_mb: expected > 0 (or give shard_size), got "
                          f"{max_shard_size_mb}")
    if not max_file_size_mb > 0:
        raise ConfigError(f"max_file_size_mb: expected > 0, got {max_file_size_mb}")
    if num_workers < 1:
        raise ConfigError(f"num_workers: expected >= 1, got {num_workers}")
    if shards_per_task < 1:
        raise ConfigError(f"shards_per_task: expected >= 1, got {shards_per_task}")
    if limit is not None and limit < 0:
        raise ConfigError(f"limit: expected >= 0, got {limit}")
    if dataset_name is not None and (not dataset_name or "." in dataset_name
                                     or "/" in dataset_name):
        raise ConfigError(f"dataset_name: expected a name without '.' or '/', got {dataset_name!r}")


def _modality_folders(fs: fsspec.AbstractFileSystem, root: str, input_dir: str,
                      size_based_on: str | None) -> list[str]:
    """The modality folders, the primary (``size_based_on``) first, the others sorted."""
    if not fs.exists(root) or not fs.isdir(root):
        raise ConfigError(f"{input_dir}: input folder not found")
    entries = fs.ls(root, detail=True)
    for e in entries:  # a linked modality folder could be anywhere: refused, not followed
        if e.get("islink") and not _basename(e["name"]).startswith(".") and fs.isdir(e["name"]):
            raise ConfigError(f"{input_dir}: {_basename(e['name'])} is a link to a folder; "
                              "shard reads real folders only (a link can point anywhere)")
    folders = sorted(
        _basename(e["name"]) for e in entries
        if e.get("type") == "directory" and not _basename(e["name"]).startswith(".")
    )
    if not folders:
        raise ConfigError(f"{input_dir}: no modality subfolders (expected e.g. image/, caption/)")
    primary = size_based_on or ("image" if "image" in folders else folders[0])
    if primary not in folders:
        raise ConfigError(f"size_based_on: expected one of {folders}, got {primary!r}")
    return [primary] + [f for f in folders if f != primary]


@attrs.define
class _Selection:
    """Which samples of the modality folders are written, and why the others are not: every
    file of a dropped stem is accounted in ``report`` under its folder and reason."""

    modalities: list[str]
    report: DatasetReport = attrs.field(factory=DatasetReport)
    #: Per folder: usable files by stem, and unusable stems -> (reason, files).
    good: dict[str, dict[str, _File]] = attrs.field(factory=dict)
    bad: dict[str, dict[str, tuple[str, int]]] = attrs.field(factory=dict)

    @property
    def primary(self) -> str:
        return self.modalities[0]

    def scan(self, fs: fsspec.AbstractFileSystem, root: str, prefix: str,
             max_file_bytes: int) -> None:
        for folder in self.modalities:
            self.good[folder], self.bad[folder] = _scan(
                fs, f"{root.rstrip('/')}/{folder}", folder, prefix, max_file_bytes, self.report)

    def drop(self, stem: str, reason_for: Mapping[str, str]) -> None:
        for folder in self.modalities:
            if stem in self.bad[folder]:
                reason, n = self.bad[folder][stem]
                self.report.drop(folder, reason, n)
            elif stem in self.good[folder]:
                self.report.drop(folder, reason_for.get(folder, OTHER_FOLDER))

    def drop_all(self, stem: str, reason: str) -> None:
        self.drop(stem, dict.fromkeys(self.modalities, reason))

    def common_stems(self) -> list[str]:
        """Stems usable in every folder, sorted; the others dropped."""
        mods = self.modalities
        union = set().union(*(set(self.good[f]) | set(self.bad[f]) for f in mods))
        stems: list[str] = []
        for stem in sorted(union):
            if all(stem in self.good[f] for f in mods):
                stems.append(stem)
                continue
            absent = any(stem not in self.good[f] and stem not in self.bad[f] for f in mods)
            self.drop(stem, dict.fromkeys(mods, NOT_EVERYWHERE) if absent else {})
        return stems

    def keyed(self, stems: list[str], dataset_name: str | None
              ) -> tuple[list[str], dict[str, str]]:
        """Each stem's key, what readers will see; unusable and colliding ones dropped."""
        keys: dict[str, str] = {}
        by_key: dict[str, list[str]] = {}
        for stem in stems:
            base = stem.replace(".", "-")
            key = f"{dataset_name}__{base}" if dataset_name else base
            try:
                check_key(key)
            except ConfigError:
                self.drop_all(stem, BAD_KEY)
                continue
            keys[stem] = key
            by_key.setdefault(key, []).append(stem)
        for same in by_key.values():
            if len(same) > 1:
                for stem in same:
                    self.drop_all(stem, COLLISION)
                    del keys[stem]
        return [s for s in stems if s in keys], keys

    def ordered(self, stems: list[str], shuffle: bool, seed: int, limit: int | None
                ) -> list[str]:
        """Sorted, or a seeded shuffle of sorted; beyond ``limit`` dropped."""
        if shuffle:
            random.Random(seed).shuffle(stems)
        if limit is not None:
            for stem in stems[limit:]:
                self.drop_all(stem, BEYOND_LIMIT)
            stems = stems[:limit]
        return stems

    def bucketed(self, stems: list[str], classify: bool, ratios: Sequence[tuple[int, int]],
                 threads: int, so: Mapping[str, Any]
                 ) -> tuple[dict[str, str | None], list[str]]:
        """Each stem's aspect bucket (image headers read in parallel; unreadable ones
        dropped), or None without classification."""
        bucket_of: dict[str, str | None] = dict.fromkeys(stems)
        if not classify:
            return bucket_of, stems
        urls = [self.good[self.primary][s].url for s in stems]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            dims = list(pool.map(lambda u: _image_size(u, so), urls))
        kept = []
        for stem, wh in zip(stems, dims, strict=True):
            if wh is None:
                self.drop(stem, {self.primary: UNREADABLE})
                continue
            bucket_of[stem] = aspect_bucket(wh[0], wh[1], ratios)
            kept.append(stem)
        return bucket_of, kept

    def require(self, stems: list[str], input_dir: str) -> None:
        """At least one sample is left, or an error saying what was dropped and why."""
        if stems:
            return
        detail = "; ".join(
            f"{f}: " + ", ".join(f"{r}={n}" for r, n in sorted(rs.items()))
            for f, rs in sorted(self.report.dropped.items())
        ) or "the folders are empty"
        raise ConfigError(f"{input_dir}: no sample is usable in every modality folder ({detail})")

    def plan(self, stems: list[str], keys: Mapping[str, str],
             bucket_of: Mapping[str, str | None], output_dir: str, shard_size: int | None,
             max_shard_bytes: int, part_size: int) -> tuple[list[ShardJob], dict[str, str]]:
        """The shard jobs, per leaf (a bucket's ``aspect_ratio_W_H/``, or the top)."""
        jobs: list[ShardJob] = []
        leaf_bucket: dict[str, str] = {}
        for bucket in sorted({bucket_of[s] or "" for s in stems}):
            leaf_stems = [s for s in stems if (bucket_of[s] or "") == bucket]
            leaf = output_dir.rstrip("/") + (f"/{bucket_dir(bucket)}" if bucket else "")
            sizes = [self.good[self.primary][s].size for s in leaf_stems]
            for shard_id, members in enumerate(
                    pack_shards(leaf_stems, sizes, shard_size, max_shard_bytes)):
                items = tuple(_Item(keys[s], tuple((f, self.good[f][s].url, self.good[f][s].ext)
                                                   for f in self.modalities))
                              for s in members)
                jobs.append(ShardJob(leaf, shard_rel_path(shard_id, part_size), items))
            if bucket:
                leaf_bucket[leaf] = bucket
        return jobs, leaf_bucket


def _finish(input_dir: str, results: Sequence[tuple[list[ShardInfo], dict[str, dict[str, int]]]],
            sel: _Selection, leaf_bucket: Mapping[str, str], shard_size: int | None,
            so: Mapping[str, Any]) -> DatasetReport:
    """The written shards' wdinfo files, and the report with every drop and bucket."""
    report = sel.report
    infos = [info for shard_infos, _ in results for info in shard_infos]
    for _, dropped in results:
        for folder, reasons in dropped.items():
            for reason, n in reasons.items():
                report.drop(folder, reason, n)
    if not infos:
        raise IngestError(f"{input_dir}: every sample failed to read; nothing written")
    finish_dataset(infos, sel.modalities, report, chunk_size=shard_size, storage_options=so)
    for info in infos:
        if info.leaf in leaf_bucket:
            bucket = leaf_bucket[info.leaf]
            report.buckets[bucket] = report.buckets.get(bucket, 0) + info.count
    return report
