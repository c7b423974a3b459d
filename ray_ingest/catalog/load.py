"""``load_catalog``: wdinfo files -> one :class:`~ray_ingest.catalog.catalog.Catalog`, cached.

A catalog is cached per process (least recently used evicted first) under its paths, options
and the wdinfo files' version metadata, so a rewritten wdinfo is read again while repeated
loads of the same data (every rank of a test, a notebook cell run twice) are free.
No Ray, no torch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import fsspec

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.discovery import check_roots, discover
from ray_ingest.catalog.shard import DEFAULT_MODALITIES, DatasetInfo, check_root_mode
from ray_ingest.catalog.wdinfo import Wdinfo, read_wdinfo
from ray_ingest.errors import CatalogError
from ray_ingest.redact import register

log = logging.getLogger(__name__)


#: Catalogs kept by ``load_catalog(..., cache=True)`` (least recently used evicted first).
CACHE_SIZE = 16
#: Object metadata that changes when a wdinfo.json is rewritten (whichever the filesystem has).
_VERSION_FIELDS = ("size", "generation", "md5Hash", "crc32c", "etag", "ETag", "version_id",
                   "LastModified", "updated", "mtime", "created", "ino")


# --------------------------------------------------------------------------- loading

_CACHE: OrderedDict[str, Catalog] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def clear_catalog_cache() -> None:
    """Forget every catalog kept by ``load_catalog(..., cache=True)``."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _content_tag(url: str, storage_options: dict[str, Any]) -> list[Any] | None:
    """``[url, (field, value)...]``: size and version metadata of a wdinfo, without reading it.

    None when the metadata cannot be had: the catalog is then read (with retries) uncached.
    """
    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        info = fs.info(path)
    except Exception as exc:  # the cache is an optimisation: never fail over its metadata
        log.debug("%s: no metadata for the catalog cache (%s)", url, exc)
        return None
    return [url, *((k, str(info[k])) for k in _VERSION_FIELDS if info.get(k) is not None)]


def load_catalog(
    paths: str | DatasetInfo | Sequence[str | DatasetInfo],
    modalities: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    cache: bool = False,
    root: str = "wdinfo",
) -> Catalog:
    """Build a catalog from paths (wdinfo.json or folders) and/or :class:`DatasetInfo` objects.

    Order: the datasets in the order given; within one, its wdinfo files sorted by URL; within a
    wdinfo, ``data_list`` order. ``modalities`` defaults to the first wdinfo's ``data_keys``,
    else ``("image", "caption")``. ``root``: ``wdinfo`` (PiD's rule: the wdinfo's ``root``
    verbatim) or ``folder`` (the folder holding each wdinfo); see :func:`check_roots`.

    With ``cache=True`` the parsed catalog is kept in this process (LRU of :data:`CACHE_SIZE`),
    keyed by the arguments, the wdinfo URLs found and each file's size/version metadata
    (generation, etag or mtime): a repeated call costs discovery plus one metadata request per
    wdinfo, and a rewritten wdinfo.json is read again.
    """
    check_root_mode(root)
    if isinstance(paths, (str, DatasetInfo)):
        paths = [paths]
    if not paths:
        raise CatalogError("no dataset paths given")
    infos = [p if isinstance(p, DatasetInfo) else DatasetInfo(wdinfo=(p,)) for p in paths]
    resolved: list[tuple[DatasetInfo, dict[str, Any], list[str]]] = []
    for info in infos:
        so = {**(storage_options or {}), **info.object_store_config}
        register(so)  # their secrets never show in this process's errors or logs
        urls: list[str] = []
        for p in info.wdinfo:
            urls.extend(discover(p, so))
        resolved.append((info, so, urls))
    cache_key = None
    tags = [[_content_tag(u, so) for u in urls] for _, so, urls in resolved] if cache else []
    if cache and all(t is not None for ts in tags for t in ts):
        cache_key = json.dumps(
            [list(modalities) if modalities else None, root,
             [[attrs.asdict(info), sorted(so.items()), ts]
              for (info, so, _), ts in zip(resolved, tags, strict=True)]],
            sort_keys=True, default=repr)
        with _CACHE_LOCK:
            hit = _CACHE.get(cache_key)
            if hit is not None:
                _CACHE.move_to_end(cache_key)
                return hit
    wdinfos: list[Wdinfo] = []
    options: list[dict[str, Any]] = []
    all_mods: tuple[str, ...] | None = tuple(modalities) if modalities else None
    for i, (info, so, urls) in enumerate(resolved):
        for url in urls:
            ds_mods = info.per_dataset_modalities or all_mods
            w = read_wdinfo(url, modalities=ds_mods or DEFAULT_MODALITIES, dset_id=f"dset: {i}",
                            storage_options=so, root=root)
            if ds_mods is None:
                all_mods = w.listed_modalities or DEFAULT_MODALITIES
                w = w._replace(modalities=all_mods)
            wdinfos.append(w)
            options.append(so)
    check_roots(wdinfos, options, root)
    chunks = {w.chunk_size for w in wdinfos}
    if len(chunks) > 1:
        log.info("datasets have different chunk_size values %s; using the first (%d)",
                 sorted(chunks), wdinfos[0].chunk_size)
    catalog = Catalog.from_wdinfos(wdinfos, all_mods or DEFAULT_MODALITIES, options)
    if cache_key is not None:
        with _CACHE_LOCK:
            _CACHE[cache_key] = catalog
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    return catalog
