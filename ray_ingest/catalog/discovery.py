"""Finding a dataset's pieces: wdinfo files under a path (sorted), where its tars really are
(``root`` checks), and per-shard counts from the tars' key indexes when the wdinfo has none.

No Ray, no torch.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import posixpath
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from ray_ingest.catalog.shard import _notice, check_root_mode
from ray_ingest.catalog.wdinfo import Wdinfo
from ray_ingest.errors import CatalogError, IngestError, TarFormatError
from ray_ingest.twintar import remote
from ray_ingest.twintar.fsio import join_url, same_place
from ray_ingest.twintar.layout import WDINFO_NAME
from ray_ingest.twintar.tario import TarIndex, index_url, split_name

log = logging.getLogger(__name__)


#: Threads reading key indexes for counts (small files; latency-bound on object stores).
INDEX_READ_THREADS = 16
#: Above this many shards, reading their key indexes for counts is worth a warning (~0.1-0.2 ms
#: per index locally, tens of ms on an object store).
_MANY_INDEXES = 10_000
def discover(path: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """wdinfo.json URLs under ``path`` in **sorted** order (or ``[path]`` if it is one)."""
    fs, fspath = fsspec.core.url_to_fs(path, **(storage_options or {}))
    protocol = fs.protocol[0] if isinstance(fs.protocol, (list, tuple)) else fs.protocol
    prefix = "" if protocol in ("file", "local") else f"{protocol}://"

    def full(p: str) -> str:
        return p if (not prefix or p.startswith(prefix)) else prefix + p.lstrip("/")

    if path.endswith(".json"):
        return [path]
    if not fs.exists(fspath):
        raise CatalogError(f"{path}: no such file or folder")
    if fs.isfile(fspath):
        raise CatalogError(f"{path}: expected a wdinfo.json or a folder, got another file")
    found = sorted(p for p in fs.find(fspath) if posixpath.basename(p) == WDINFO_NAME)
    if not found:
        raise CatalogError(f"{path}: no {WDINFO_NAME} found under this folder")
    return [full(p) for p in found]


def check_roots(wdinfos: Sequence[Wdinfo], storage_options: Sequence[dict[str, Any]],
                root: str = "wdinfo") -> None:
    """Say when a wdinfo's ``root`` is not the folder holding it and that folder holds the
    modality folders too (a moved or copied dataset).

    Only wdinfos whose two candidates differ are looked at, with one existence check per
    distinct ``<candidate>/<first modality>``; each finding is logged once per process. Raises
    :class:`CatalogError` naming the ``root`` setting when the chosen place lacks the modality
    folder and the other one has it.
    """
    check_root_mode(root)
    seen: dict[str, bool] = {}

    def holds(base: str, modality: str, so: dict[str, Any]) -> bool:
        url = join_url(base, modality)
        if url not in seen:
            try:
                fs, path = fsspec.core.url_to_fs(url, **so)
                seen[url] = bool(fs.exists(path))
            except Exception as exc:  # cannot tell: never claim a folder is missing
                log.debug("%s: existence check failed (%s)", url, exc)
                seen[url] = True
        return seen[url]

    for w, so in zip(wdinfos, storage_options, strict=True):
        folder, recorded = w.folder, w.wdinfo_root
        if same_place(folder, recorded):
            continue
        m = w.modalities[0]
        at_root, at_folder = holds(recorded, m, so), holds(folder, m, so)
        if root == "wdinfo":
            if not at_root and at_folder:
                raise CatalogError(
                    f"{w.source}: root {recorded} does not hold the modality folder {m}/, but "
                    f"the folder holding this wdinfo ({folder}) does: the dataset was moved or "
                    f"copied; set data.root: folder (--root folder) to read {folder}")
            if at_root and at_folder:
                _notice(("root", w.source, recorded, root), logging.WARNING,
                        "%s: the wdinfo's root %s and the folder holding it %s both hold the "
                        "modality folder %s/; reading the wdinfo's root (data.root: wdinfo, "
                        "PiD's rule); set data.root: folder (--root folder) to read %s",
                        w.source, recorded, folder, m, folder)
            elif not at_root:
                _notice(("root", w.source, recorded, root), logging.WARNING,
                        "%s: neither the wdinfo's root %s nor the folder holding it %s holds "
                        "the modality folder %s/; reads will fail", w.source, recorded, folder, m)
        else:
            if at_root and not at_folder:
                raise CatalogError(
                    f"{w.source}: data.root is folder, but {folder} does not hold the modality "
                    f"folder {m}/ and the wdinfo's root {recorded} does; set data.root: wdinfo "
                    f"(--root wdinfo)")
            _notice(("root", w.source, recorded, root), logging.INFO if at_folder
                    else logging.WARNING, "%s: reading %s (data.root: folder), not the wdinfo's "
                    "root %s%s", w.source, folder, recorded,
                    "" if at_folder else f"; neither holds the modality folder {m}/, reads "
                    "will fail")


# --------------------------------------------------------------------------- counts from indexes


def _index_count(tar_url: str, storage_options: dict[str, Any]) -> int | None:
    """Samples in a tar according to its key index (named members), None without a usable one."""
    try:
        raw = remote.read_bytes(index_url(tar_url), storage_options)
        idx = TarIndex.from_dict(json.loads(raw), index_url(tar_url))
    except (FileNotFoundError, OSError, IngestError, ValueError, TarFormatError):
        return None
    return sum(1 for n in idx.names if split_name(n) is not None)


def _counts_from_indexes(w: Wdinfo, storage_options: dict[str, Any]
                         ) -> tuple[np.ndarray | None, str | None]:
    """(counts, None) from the first modality's key indexes, or (None, first missing URL).

    Reads in growing batches on a bounded thread pool and stops at the first missing index.
    """
    n = len(w)
    out = np.empty(n, dtype=np.int64)
    pos, batch = 0, 64
    with concurrent.futures.ThreadPoolExecutor(min(INDEX_READ_THREADS, n)) as pool:
        while pos < n:
            part = w.urls(w.modalities[0], pos, pos + batch)
            got = list(pool.map(lambda u: _index_count(u, storage_options), part))
            for j, c in enumerate(got):
                if c is None:
                    return None, index_url(part[j])
            out[pos:pos + len(part)] = got
            pos += len(part)
            batch = min(batch * 4, 16384)
    return out, None
