"""Catalog: the typed, sorted, fingerprinted view of one or more twin-tar datasets.

Reads ``wdinfo.json`` exactly as PiD's sharder writes it (``data_list``, ``total_key_count``,
optional ``chunk_size``, ``data_list_key_count``, ``data_keys``, ``root``) over fsspec, so
local paths, ``gs://`` and ``memory://`` all work. Unlike PiD, discovery is **sorted** and
datasets combine in a stable order (the order given, then sorted wdinfo paths within each), so
two runs on the same data always see the same shard list.

No Ray, no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import fsspec

from ray_ingest import remote
from ray_ingest.errors import CatalogError, IngestError

log = logging.getLogger(__name__)

WDINFO_NAME = "wdinfo.json"
DEFAULT_KEYS = ("image", "caption")
#: Catalogs kept by ``load_catalog(..., cache=True)`` (least recently used evicted first).
CACHE_SIZE = 16
#: Object metadata that changes when a wdinfo.json is rewritten (whichever the filesystem has).
_VERSION_FIELDS = ("size", "generation", "md5Hash", "crc32c", "etag", "ETag", "version_id",
                   "LastModified", "updated", "mtime", "created", "ino")


def _tuple_of_str(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def join_url(root: str, *parts: str) -> str:
    """Join URL/path parts with ``/`` without mangling a ``scheme://`` prefix."""
    out = root.rstrip("/")
    for part in parts:
        if part:
            out = f"{out}/{part.strip('/')}"
    return out


def url_dirname(url: str) -> str:
    """Parent folder of a URL or local path (keeps ``scheme://``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return posixpath.dirname(url) or "."
    return f"{scheme}://{posixpath.dirname(rest)}"


def _is_absolute(url: str) -> bool:
    return "://" in url or url.startswith("/")


@attrs.frozen
class DatasetInfo:
    """One logical data source (PiD's ``DatasetInfo``): wdinfo files plus per-source options."""

    #: wdinfo.json URLs or folders searched recursively for them.
    wdinfo: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    #: Free-form per-dataset options (e.g. ``aspect_ratio``).
    opts: dict[str, Any] = attrs.field(factory=dict)
    #: Modality folders for this dataset; empty means the reader's keys.
    per_dataset_keys: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    #: Human-readable source name.
    source: str = ""
    #: fsspec storage options (PiD: object_store_config).
    object_store_config: dict[str, Any] = attrs.field(factory=dict)

    @wdinfo.validator
    def _check_wdinfo(self, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise CatalogError("DatasetInfo.wdinfo: expected at least one path, got none")


@attrs.frozen
class TarSample:
    """One twin shard: the same relative ``path`` exists under ``root/<key>/`` for every key."""

    #: Relative tar path as listed in ``data_list`` (e.g. ``part_000000/000003.tar``).
    path: str
    #: Absolute dataset root URL (the wdinfo's folder unless it names another).
    root: str
    #: Modality folders, in reading order; the first one drives alignment.
    keys: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    #: Number of samples in the shard (``data_list_key_count``), or None when not recorded.
    count: int | None
    #: Which dataset of the catalog this shard belongs to (``"dset: i"``, as PiD names it).
    dset_id: str = "dset: 0"
    #: Optional parquet key list fixing order and membership (``align="index"``).
    sample_keys_full_list: str | None = None
    #: Aspect-ratio bucket (``"16_9"``) when the shard lives under ``aspect_ratio_W_H/``.
    bucket: str | None = None

    def url(self, key: str) -> str:
        """URL of this shard's tar for modality ``key``."""
        return join_url(self.root, key, self.path)


@attrs.frozen
class Wdinfo:
    """One parsed wdinfo.json (PiD's ``Wdinfo``), plus where it came from."""

    #: URL of the wdinfo.json file.
    source: str
    tar_files: tuple[TarSample, ...]
    total_key_count: int
    chunk_size: int
    data_keys: tuple[str, ...] = ()


def _bucket_of(url: str) -> str | None:
    for part in url.split("/"):
        if part.startswith("aspect_ratio_"):
            return part[len("aspect_ratio_") :]
    return None


def _field(doc: dict[str, Any], name: str, url: str, types: type | tuple[type, ...]) -> Any:
    if name not in doc:
        raise CatalogError(f"{url}: missing field {name!r}")
    value = doc[name]
    if not isinstance(value, types) or isinstance(value, bool):
        tname = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise CatalogError(f"{url}: field {name!r} must be {tname}, got {type(value).__name__}")
    return value


def parse_wdinfo(
    doc: Any,
    url: str,
    keys: Sequence[str] = DEFAULT_KEYS,
    dset_id: str = "dset: 0",
) -> Wdinfo:
    """Validate a decoded wdinfo document; every error names ``url`` and the field."""
    if not isinstance(doc, dict):
        raise CatalogError(f"{url}: expected a JSON object, got {type(doc).__name__}")
    data_list = _field(doc, "data_list", url, list)
    if not data_list:
        raise CatalogError(f"{url}: field 'data_list' is empty")
    for i, p in enumerate(data_list):
        if not isinstance(p, str) or not p:
            raise CatalogError(f"{url}: field 'data_list[{i}]' must be a non-empty string, got {p!r}")
    total = _field(doc, "total_key_count", url, int)
    if total < 0:
        raise CatalogError(f"{url}: field 'total_key_count' must be >= 0, got {total}")
    counts: list[int] | None = None
    if "data_list_key_count" in doc:
        counts = _field(doc, "data_list_key_count", url, list)
        if len(counts) != len(data_list):
            raise CatalogError(
                f"{url}: field 'data_list_key_count' has {len(counts)} entries, "
                f"expected {len(data_list)} (one per data_list entry)"
            )
        for i, c in enumerate(counts):
            if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                raise CatalogError(
                    f"{url}: field 'data_list_key_count[{i}]' must be an int >= 0, got {c!r}"
                )
    if "chunk_size" in doc and doc["chunk_size"] is not None:
        chunk = _field(doc, "chunk_size", url, int)
    elif counts is not None:
        chunk = int(sum(counts) / len(data_list))  # PiD's fallback: floored mean
    else:
        chunk = int(total / len(data_list))
    if chunk <= 0:
        raise CatalogError(f"{url}: field 'chunk_size' must be > 0, got {chunk}")
    root_field = doc.get("root")
    base = url_dirname(url)
    if root_field is None or root_field == "":
        root = base
    elif not isinstance(root_field, str):
        raise CatalogError(f"{url}: field 'root' must be str, got {type(root_field).__name__}")
    elif _is_absolute(root_field):
        root = root_field.rstrip("/")
    else:
        scheme, sep, rest = base.rpartition("://")
        # normalise "." and ".." (writers put root "."; object stores take names literally)
        root = f"{scheme}{sep}{posixpath.normpath(join_url(rest, root_field))}"
    data_keys = doc.get("data_keys") or ()
    if not isinstance(data_keys, (list, tuple)):
        raise CatalogError(f"{url}: field 'data_keys' must be a list, got {type(data_keys).__name__}")
    bucket = _bucket_of(url)
    shards = tuple(
        TarSample(
            path=p,
            root=root,
            keys=tuple(keys),
            count=None if counts is None else counts[i],
            dset_id=dset_id,
            bucket=bucket,
        )
        for i, p in enumerate(data_list)
    )
    return Wdinfo(
        source=url,
        tar_files=shards,
        total_key_count=total,
        chunk_size=chunk,
        data_keys=tuple(str(k) for k in data_keys),
    )


def read_wdinfo(
    url: str,
    keys: Sequence[str] = DEFAULT_KEYS,
    dset_id: str = "dset: 0",
    storage_options: dict[str, Any] | None = None,
) -> Wdinfo:
    """Read and validate one wdinfo.json over fsspec (remote reads retry, see ``remote``)."""
    try:
        raw = remote.read_bytes(url, storage_options)
    except FileNotFoundError:
        raise CatalogError(f"{url}: wdinfo.json not found") from None
    except (OSError, IngestError) as exc:
        raise CatalogError(f"{url}: cannot read wdinfo.json ({exc})") from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CatalogError(f"{url}: malformed JSON ({exc})") from None
    return parse_wdinfo(doc, url, keys=keys, dset_id=dset_id)


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


@attrs.frozen
class Catalog:
    """All shards of one or more datasets, in a stable order, with a content fingerprint."""

    shards: tuple[TarSample, ...]
    wdinfos: tuple[Wdinfo, ...]
    #: Samples per shard used by PiD's ``start_index // chunk_size`` skip: the first wdinfo's.
    chunk_size: int
    keys: tuple[str, ...]

    @property
    def total_key_count(self) -> int:
        return sum(w.total_key_count for w in self.wdinfos)

    @property
    def counts(self) -> tuple[int, ...]:
        """Per-shard sample counts; raises when a wdinfo did not record them."""
        out = []
        for i, s in enumerate(self.shards):
            if s.count is None:
                raise CatalogError(
                    f"shard {s.path} (index {i}): wdinfo has no 'data_list_key_count'; "
                    "per-shard counts are required here"
                )
            out.append(s.count)
        return tuple(out)

    @property
    def fingerprint(self) -> str:
        """sha256 over the shard list, counts and modalities (not roots: a copy in gs:// matches)."""
        h = hashlib.sha256()
        h.update(json.dumps(list(self.keys)).encode())
        for s in self.shards:
            h.update(json.dumps([s.dset_id, s.path, s.count]).encode())
        return h.hexdigest()[:16]

    def describe_change(self, other_fingerprint_doc: dict[str, Any]) -> str:
        """Human-readable difference against :meth:`fingerprint_doc` of another catalog."""
        mine = self.fingerprint_doc()
        diffs = [
            f"{k}: saved {other_fingerprint_doc.get(k)!r}, now {mine[k]!r}"
            for k in mine
            if other_fingerprint_doc.get(k) != mine[k]
        ]
        return "; ".join(diffs) or "no difference"

    def fingerprint_doc(self) -> dict[str, Any]:
        """Small summary stored next to the fingerprint so a mismatch can say what changed."""
        counts = [s.count for s in self.shards]
        return {
            "keys": list(self.keys),
            "num_shards": len(self.shards),
            "num_samples": sum(c for c in counts if c is not None),
            "first_shard": self.shards[0].path if self.shards else None,
            "last_shard": self.shards[-1].path if self.shards else None,
        }


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
    keys: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    cache: bool = False,
) -> Catalog:
    """Build a catalog from paths (wdinfo.json or folders) and/or :class:`DatasetInfo` objects.

    Order: the datasets in the order given; within one, its wdinfo files sorted by URL; within a
    wdinfo, ``data_list`` order. ``keys`` defaults to the first wdinfo's ``data_keys`` filtered to
    modalities, else ``("image", "caption")``.

    With ``cache=True`` the parsed catalog is kept in this process (LRU of :data:`CACHE_SIZE`),
    keyed by the arguments, the wdinfo URLs found and each file's size/version metadata
    (generation, etag or mtime): a repeated call costs discovery plus one metadata request per
    wdinfo, and a rewritten wdinfo.json is read again.
    """
    if isinstance(paths, (str, DatasetInfo)):
        paths = [paths]
    if not paths:
        raise CatalogError("no dataset paths given")
    infos = [p if isinstance(p, DatasetInfo) else DatasetInfo(wdinfo=(p,)) for p in paths]
    resolved: list[tuple[DatasetInfo, dict[str, Any], list[str]]] = []
    for info in infos:
        so = {**(storage_options or {}), **info.object_store_config}
        urls: list[str] = []
        for p in info.wdinfo:
            urls.extend(discover(p, so))
        resolved.append((info, so, urls))
    cache_key = None
    tags = [[_content_tag(u, so) for u in urls] for _, so, urls in resolved] if cache else []
    if cache and all(t is not None for ts in tags for t in ts):
        cache_key = json.dumps(
            [list(keys) if keys else None,
             [[attrs.asdict(info), sorted(so.items()), ts]
              for (info, so, _), ts in zip(resolved, tags, strict=True)]],
            sort_keys=True, default=repr)
        with _CACHE_LOCK:
            hit = _CACHE.get(cache_key)
            if hit is not None:
                _CACHE.move_to_end(cache_key)
                return hit
    wdinfos: list[Wdinfo] = []
    all_keys: tuple[str, ...] | None = tuple(keys) if keys else None
    for i, (info, so, urls) in enumerate(resolved):
        for url in urls:
            ds_keys = info.per_dataset_keys or all_keys
            if ds_keys is None:
                probe = read_wdinfo(url, keys=DEFAULT_KEYS, dset_id=f"dset: {i}", storage_options=so)
                all_keys = ds_keys = probe.data_keys or DEFAULT_KEYS
                wdinfos.append(attrs.evolve(probe, tar_files=tuple(
                    attrs.evolve(t, keys=ds_keys) for t in probe.tar_files)))
                continue
            wdinfos.append(read_wdinfo(url, keys=ds_keys, dset_id=f"dset: {i}", storage_options=so))
    chunks = {w.chunk_size for w in wdinfos}
    if len(chunks) > 1:
        log.info("datasets have different chunk_size values %s; using the first (%d)",
                 sorted(chunks), wdinfos[0].chunk_size)
    shards = tuple(t for w in wdinfos for t in w.tar_files)
    catalog = Catalog(
        shards=shards,
        wdinfos=tuple(wdinfos),
        chunk_size=wdinfos[0].chunk_size,
        keys=tuple(all_keys or DEFAULT_KEYS),
    )
    if cache_key is not None:
        with _CACHE_LOCK:
            _CACHE[cache_key] = catalog
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    return catalog
