"""Key indexes for a whole dataset: ``<tar>.idx.json`` beside every tar, and per-shard counts.

``ray-ingest index PATH`` runs :func:`index_dataset`. For every wdinfo under PATH, every
modality it lists (``data_keys``) and every tar of its ``data_list``, the tar's headers are
scanned (payloads skipped, :func:`ray_ingest.twintar.tario.build_index`) and its key index is
written beside it, so readers seek to a sample instead of streaming to it. An index whose recorded
tar size still matches is kept (``force`` rewrites it).

The samples per shard (named members of the first modality's tar, what PiD's sharder counts)
are then written into the wdinfo as ``data_list_key_count``: the file is replaced atomically
(a temporary file renamed over it locally; one object write on object stores) with its other
fields and their order untouched. PiD's seed-format files (``data_list``,
``total_key_count``, ``chunk_size`` only) then load with exact counts and never need the
indexes read for them. Modalities whose member counts differ from the first one's, and tars
missing for a modality, are reported.

No Ray, no torch.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import fsspec

from ray_ingest.catalog.discovery import (
    check_roots,
    discover,
)
from ray_ingest.catalog.shard import (
    DEFAULT_MODALITIES,
    check_root_mode,
)
from ray_ingest.catalog.wdinfo import read_wdinfo
from ray_ingest.errors import CatalogError, IngestError
from ray_ingest.twintar import remote
from ray_ingest.twintar.tario import (
    TarIndex,
    build_index,
    index_url,
    split_name,
)

log = logging.getLogger(__name__)

#: Tars in flight per worker thread (bounds the futures kept for million-shard datasets).
_WINDOW_PER_WORKER = 64
#: Tar URLs built at a time.
_URL_BATCH = 65536

T = TypeVar("T")
R = TypeVar("R")


@attrs.define
class WdinfoIndexReport:
    """What :func:`index_dataset` did for one wdinfo."""

    wdinfo: str
    shards: int
    modalities: list[str]
    #: Key indexes written / kept because they were current.
    written: int = 0
    kept: int = 0
    #: Samples per shard (first modality), summed.
    samples: int = 0
    total_key_count: int = 0
    #: ``written`` (added), ``corrected`` (replaced different counts), ``unchanged``, ``skipped``.
    counts: str = "skipped"
    #: Tars absent for a modality: modality -> (number, first URL).
    missing: dict[str, list[Any]] = attrs.field(factory=dict)
    #: Shards whose member count differs from the first modality's: ``(path, {modality: n})``.
    mismatches: list[list[Any]] = attrs.field(factory=list)
    num_mismatches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class IndexReport:
    """Per-wdinfo reports of :func:`index_dataset`."""

    wdinfos: list[WdinfoIndexReport] = attrs.field(factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"wdinfos": [w.to_dict() for w in self.wdinfos],
                "written": sum(w.written for w in self.wdinfos),
                "kept": sum(w.kept for w in self.wdinfos),
                "samples": sum(w.samples for w in self.wdinfos)}


def _named(idx: TarIndex) -> int:
    return sum(1 for n in idx.names if split_name(n) is not None)


def index_tar(tar_url: str, storage_options: Mapping[str, Any] | None = None,
              force: bool = False) -> tuple[int | None, bool]:
    """Write (or keep) the key index of one tar; return (samples, written).

    ``(None, False)`` when the tar does not exist. A corrupt tar raises
    :class:`~ray_ingest.errors.TarFormatError` naming it.
    """
    so = dict(storage_options or {})
    fs, path = fsspec.core.url_to_fs(tar_url, **so)
    try:
        size = int(fs.size(path))
    except FileNotFoundError:
        return None, False
    if not force:
        try:
            old = TarIndex.from_dict(json.loads(remote.read_bytes(index_url(tar_url), so)),
                                     index_url(tar_url))
            if old.tar_size == size:
                return _named(old), False
        except (FileNotFoundError, OSError, IngestError, ValueError):
            pass  # absent, unreadable or stale: rebuild
    with remote.open_url(tar_url, so) as f:
        idx = build_index(f, tar_url, tar_size=size)
    fs.pipe_file(index_url(path), idx.dumps().encode())
    return _named(idx), True


def _bounded_map(pool: concurrent.futures.Executor, fn: Callable[[T], R], items: Iterable[T],
                 window: int) -> Iterator[R]:
    """``pool.map`` in input order with at most ``window`` futures alive."""
    pending: list[concurrent.futures.Future] = []
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.pop(0).result()
    for fut in pending:
        yield fut.result()


def write_counts(url: str, counts: Sequence[int],
                 storage_options: Mapping[str, Any] | None = None) -> str:
    """Record ``data_list_key_count`` in the wdinfo at ``url``, atomically.

    Returns ``written`` (the field was absent), ``corrected`` (it held other values) or
    ``unchanged``. Other fields keep their values and order; the new field goes right after
    ``data_list``.
    """
    so = dict(storage_options or {})
    try:
        doc = json.loads(remote.read_bytes(url, so))
    except (OSError, IngestError, ValueError) as exc:
        raise CatalogError(f"{url}: cannot read wdinfo.json to record counts ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data_list"), list) \
            or len(doc["data_list"]) != len(counts):
        raise CatalogError(f"{url}: data_list changed while indexing; run the index again")
    new = [int(c) for c in counts]
    old = doc.get("data_list_key_count")
    if old == new:
        return "unchanged"
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if k == "data_list_key_count":
            continue
        out[k] = v
        if k == "data_list":
            out["data_list_key_count"] = new
    data = (json.dumps(out, indent=2) + "\n").encode()
    fs, path = fsspec.core.url_to_fs(url, **so)
    if remote.is_local_url(url):
        tmp = path + ".tmp"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)  # a rename: readers see the old file or the new one, never half
    else:
        fs.pipe_file(path, data)  # one object write replaces the object atomically
    return "written" if old is None else "corrected"


def index_dataset(
    paths: str | Sequence[str],
    modalities: Sequence[str] | None = None,
    *,
    counts: bool = True,
    force: bool = False,
    num_workers: int = 8,
    storage_options: Mapping[str, Any] | None = None,
    root: str = "wdinfo",
) -> IndexReport:
    """Write the key index of every tar of every wdinfo under ``paths`` (see module docstring).

    Args:
        paths: wdinfo.json files or folders searched for them.
        modalities: modalities to index (default: each wdinfo's ``data_keys``); the first one's
            member counts are the shard counts.
        counts: record ``data_list_key_count`` in each wdinfo.
        force: rebuild indexes that look current.
        num_workers: tars indexed concurrently (threads: the work is I/O).
        storage_options: fsspec options.
        root: ``wdinfo`` (the wdinfo's ``root``) or ``folder`` (the folder holding it).

    Raises:
        CatalogError: a wdinfo is bad, or a tar of the first modality is missing.
        TarFormatError: a tar is corrupt (the message names it).
    """
    check_root_mode(root)
    if num_workers < 1:
        raise CatalogError(f"num_workers: expected >= 1, got {num_workers}")
    so = dict(storage_options or {})
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise CatalogError("no dataset paths given")
    report = IndexReport()
    urls = [u for p in paths for u in discover(p, so)]
    with concurrent.futures.ThreadPoolExecutor(num_workers) as pool:
        for url in urls:
            w = read_wdinfo(url, modalities, storage_options=so, root=root)
            mods = tuple(modalities) if modalities else (w.data_keys or DEFAULT_MODALITIES)
            w = w._replace(modalities=mods)
            check_roots([w], [so], root)
            rep = WdinfoIndexReport(wdinfo=url, shards=len(w), modalities=list(mods),
                                    total_key_count=w.total_key_count)
            per: dict[str, list[int | None]] = {}
            for m in mods:
                tars = (u for a in range(0, len(w), _URL_BATCH)
                        for u in w.urls(m, a, a + _URL_BATCH))
                got = _bounded_map(pool, lambda u: (u, *index_tar(u, so, force)), tars,
                                   num_workers * _WINDOW_PER_WORKER)
                per[m] = []
                absent, first_absent = 0, None
                for tar, c, wrote in got:
                    per[m].append(c)
                    rep.written += wrote
                    rep.kept += c is not None and not wrote
                    if c is None:
                        absent += 1
                        first_absent = first_absent or tar
                if absent:
                    if m == mods[0]:
                        raise CatalogError(f"{url}: {absent} of {len(w)} {m} tars are "
                                           f"missing (first: {first_absent})")
                    rep.missing[m] = [absent, first_absent]
            first = per[mods[0]]
            for i, c in enumerate(first):
                other = {m: per[m][i] for m in mods[1:] if per[m][i] not in (None, c)}
                if other:
                    rep.num_mismatches += 1
                    if len(rep.mismatches) < 5:
                        rep.mismatches.append([w.paths[i].as_py(), {mods[0]: c, **other}])
            shard_counts = [int(c) for c in first]  # type: ignore[arg-type]
            rep.samples = sum(shard_counts)
            if counts:
                rep.counts = write_counts(url, shard_counts, so)
            log.info("%s: %d shards x %d modalities indexed (%d written, %d kept); "
                     "data_list_key_count %s", url, len(w), len(mods), rep.written, rep.kept,
                     rep.counts)
            report.wdinfos.append(rep)
    return report


__all__ = ["IndexReport", "WdinfoIndexReport", "index_dataset", "index_tar", "write_counts"]
