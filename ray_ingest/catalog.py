"""Catalog: the columnar, sorted, fingerprinted view of one or more twin-tar datasets.

Reads ``wdinfo.json`` exactly as PiD's sharder writes it (``data_list``, ``total_key_count``,
optional ``chunk_size``, ``data_list_key_count``, ``data_keys``, ``root``) over fsspec, so
local paths, ``gs://`` and ``memory://`` all work. Unlike PiD, discovery is **sorted** and
datasets combine in a stable order (the order given, then sorted wdinfo paths within each), so
two runs on the same data always see the same shard list.

Columnar: a catalog keeps its shards as arrays, not objects. ``paths`` (the ``data_list``
entries, one Arrow string array), ``counts`` (int64) and, per shard, the number of the wdinfo it
came from; root, modalities, dataset and aspect bucket are stored once per wdinfo. A
:class:`TarSample` is made only when a shard is touched (``catalog.shard(i)``,
``catalog.shards[i]``), so a million-shard catalog loads in a fraction of a second and pickles
(``ray.put``) as a handful of buffers. Big wdinfo files are read straight into those arrays:
plainly written ones by :mod:`ray_ingest.wdinfo_scan` (vectorized), others by pyarrow's JSON
reader; anything unusual falls back to ``json`` and its exact checks.

Per-shard counts, in order of preference: ``data_list_key_count``; else ``chunk_size`` for
every shard when ``total_key_count == chunk_size * len(data_list)`` (PiD's own assumption);
else the key index ``<tar>.idx.json`` of the first modality's tar (read once, lazily, when the
counts are first needed; ``ray-ingest index`` writes them); else one error that says which.

Roots: a wdinfo's ``root`` is used verbatim (PiD's rule, ``root="wdinfo"``) or replaced by the
folder holding the wdinfo (``root="folder"``). When the two differ, one existence check per
distinct folder says whether a moved dataset is being read from its old place (logged once per
wdinfo, or an error naming the setting when the old place is gone).

No Ray, no torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import json
import logging
import os
import posixpath
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import fsspec
import numpy as np
import pyarrow as pa

from ray_ingest import remote
from ray_ingest.errors import CatalogError, IngestError, TarFormatError
from ray_ingest.redact import options_repr, register
from ray_ingest.safepath import check_folder_name, check_rel_path, first_unsafe_path
from ray_ingest.tario import TarIndex, index_url, split_name
from ray_ingest.wdinfo_scan import scan_wdinfo

log = logging.getLogger(__name__)

WDINFO_NAME = "wdinfo.json"
DEFAULT_MODALITIES = ("image", "caption")
#: How a shard's tars are found: ``wdinfo`` uses the wdinfo's ``root`` verbatim (PiD's rule),
#: ``folder`` the folder holding the wdinfo (a moved or copied dataset).
ROOT_MODES = ("wdinfo", "folder")
#: Catalogs kept by ``load_catalog(..., cache=True)`` (least recently used evicted first).
CACHE_SIZE = 16
#: wdinfo files at least this big are read into arrays by wdinfo_scan or pyarrow's JSON reader
#: (json.loads below: their start-up costs more than they save on small files).
FAST_PARSE_BYTES = 1 << 20
#: Threads reading key indexes for counts (small files; latency-bound on object stores).
INDEX_READ_THREADS = 16
#: Above this many shards, reading their key indexes for counts is worth a warning (~0.1-0.2 ms
#: per index locally, tens of ms on an object store).
_MANY_INDEXES = 10_000
#: Object metadata that changes when a wdinfo.json is rewritten (whichever the filesystem has).
_VERSION_FIELDS = ("size", "generation", "md5Hash", "crc32c", "etag", "ETag", "version_id",
                   "LastModified", "updated", "mtime", "created", "ino")
_INT64_MAX = 2**63 - 1

__all__ = [
    "CACHE_SIZE",
    "DEFAULT_MODALITIES",
    "ROOT_MODES",
    "WDINFO_NAME",
    "Catalog",
    "CountArray",
    "DatasetInfo",
    "TarSample",
    "Wdinfo",
    "check_root_mode",
    "check_roots",
    "clear_catalog_cache",
    "discover",
    "join_url",
    "load_catalog",
    "parse_wdinfo",
    "read_wdinfo",
    "same_place",
    "url_dirname",
    "warn_renamed",
]


# --------------------------------------------------------------------------- small helpers

_WARNED: set[str] = set()
_NOTICED: set[tuple[Any, ...]] = set()
_NOTICE_LOCK = threading.Lock()


def warn_renamed(old: str, new: str) -> None:
    """DeprecationWarning for a renamed public name, once per process (hot paths use them)."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def _notice(key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
    """Log ``msg`` once per process for ``key`` (not per shard, rank or epoch)."""
    with _NOTICE_LOCK:
        if key in _NOTICED:
            return
        _NOTICED.add(key)
    log.log(level, msg, *args)


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_KEYS":
        warn_renamed("ray_ingest.catalog.DEFAULT_KEYS", "DEFAULT_MODALITIES")
        return DEFAULT_MODALITIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def check_root_mode(value: Any, field: str = "root") -> str:
    """Validate a root mode (``wdinfo`` | ``folder``), naming ``field`` in the error."""
    if value not in ROOT_MODES:
        raise CatalogError(f"{field}: expected one of {', '.join(ROOT_MODES)}, got {value!r}")
    return str(value)


def _bucket_of(url: str) -> str | None:
    for part in url.split("/"):
        if part.startswith("aspect_ratio_"):
            return part[len("aspect_ratio_") :]
    return None


# NOTE: pa.array() and pa.scalar() import pandas (0.3-0.5 s) to look for pandas inputs; these
# helpers build the few Arrow arrays the catalog needs from buffers, so the plan CLI stays light.


def _strings(values: Sequence[str]) -> pa.Array:
    """Arrow string array of Python strings (from buffers, without pandas)."""
    values = list(values)
    joined = "".join(values)
    if joined.isascii():
        data = joined.encode("ascii")
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    else:
        encoded = [v.encode() for v in values]
        data = b"".join(encoded)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return _string_array(offsets, data)


def _string_array(offsets: np.ndarray, data: bytes) -> pa.Array:
    """Arrow string array over UTF-8 ``data`` split at ``offsets`` (large only past 2 GiB)."""
    if len(data) < 2**31:
        offsets = offsets.astype(np.int32)
    kind = pa.LargeStringArray if offsets.dtype == np.int64 else pa.StringArray
    return kind.from_buffers(len(offsets) - 1, pa.py_buffer(offsets), pa.py_buffer(data))


def _ints(values: np.ndarray) -> pa.Array:
    """Arrow int64 array over a numpy array (zero-copy, without pandas)."""
    arr = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(arr), [None, pa.py_buffer(arr)])


def _offsets(values: pa.Array) -> np.ndarray:
    """The value offsets of a (large) string array, as numpy (length ``len(values) + 1``)."""
    kind = np.int64 if pa.types.is_large_string(values.type) else np.int32
    return np.frombuffer(values.buffers()[1], dtype=kind)[
        values.offset:values.offset + len(values) + 1]


def _bools(values: np.ndarray) -> pa.Array:
    bits = np.packbits(np.asarray(values, dtype=bool), bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])


def _text(value: str) -> pa.Scalar:
    """An Arrow string scalar (for compute functions, without pa.scalar)."""
    return _strings([value])[0]


# --------------------------------------------------------------------------- shard objects


@attrs.frozen
class DatasetInfo:
    """One logical data source (PiD's ``DatasetInfo``): wdinfo files plus per-source options."""

    #: wdinfo.json URLs or folders searched recursively for them.
    wdinfo: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    #: Free-form per-dataset options (e.g. ``aspect_ratio``).
    opts: dict[str, Any] = attrs.field(factory=dict)
    #: Modality folders for this dataset; empty means the reader's modalities.
    per_dataset_modalities: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    #: Human-readable source name.
    source: str = ""
    #: fsspec storage options (PiD: object_store_config); redacted in its repr.
    object_store_config: dict[str, Any] = attrs.field(factory=dict, repr=options_repr)

    def __init__(self, wdinfo: Iterable[str], opts: dict[str, Any] | None = None,
                 per_dataset_modalities: Iterable[str] = (), source: str = "",
                 object_store_config: dict[str, Any] | None = None, *,
                 per_dataset_keys: Iterable[str] | None = None) -> None:
        if per_dataset_keys is not None:
            warn_renamed("DatasetInfo(per_dataset_keys=...)", "per_dataset_modalities")
            if tuple(per_dataset_modalities):
                raise CatalogError("DatasetInfo: got both per_dataset_modalities and its old "
                                   "name per_dataset_keys; give only per_dataset_modalities")
            per_dataset_modalities = per_dataset_keys
        self.__attrs_init__(wdinfo, {} if opts is None else opts, per_dataset_modalities, source,
                            {} if object_store_config is None else object_store_config)

    @wdinfo.validator
    def _check_wdinfo(self, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise CatalogError("DatasetInfo.wdinfo: expected at least one path, got none")

    @property
    def per_dataset_keys(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`per_dataset_modalities`."""
        warn_renamed("DatasetInfo.per_dataset_keys", "per_dataset_modalities")
        return self.per_dataset_modalities


@attrs.frozen
class TarSample:
    """One twin shard: the same relative ``path`` exists under ``root/<m>/`` for every modality."""

    #: Relative tar path as listed in ``data_list`` (e.g. ``part_000000/000003.tar``).
    path: str
    #: Dataset root URL in use (see :data:`ROOT_MODES`).
    root: str
    #: Modality folders, in reading order; the first one drives alignment.
    modalities: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    #: Number of samples in the shard, or None when not known (yet).
    count: int | None
    #: Which dataset of the catalog this shard belongs to (``"dset: i"``, as PiD names it).
    dset_id: str = "dset: 0"
    #: Optional parquet key list fixing order and membership (``align="index"``).
    sample_keys_full_list: str | None = None
    #: Aspect-ratio bucket (``"16_9"``) when the shard lives under ``aspect_ratio_W_H/``.
    bucket: str | None = None

    def __init__(self, path: str, root: str, modalities: Iterable[str] | None = None,
                 count: int | None = None, dset_id: str = "dset: 0",
                 sample_keys_full_list: str | None = None, bucket: str | None = None, *,
                 keys: Iterable[str] | None = None) -> None:
        if keys is not None:
            warn_renamed("TarSample(keys=...)", "modalities")
            if modalities is not None:
                raise CatalogError("TarSample: got both modalities and its old name keys")
            modalities = keys
        if modalities is None:
            raise CatalogError(f"TarSample {path}: expected modalities, got none")
        self.__attrs_init__(path, root, modalities, count, dset_id, sample_keys_full_list, bucket)

    @property
    def keys(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`modalities`."""
        warn_renamed("TarSample.keys", "modalities")
        return self.modalities

    def url(self, modality: str) -> str:
        """URL of this shard's tar for ``modality``."""
        return join_url(self.root, modality, self.path)


class CountArray(np.ndarray):
    """Per-shard sample counts: a read-only int64 array that also behaves like the tuple it
    replaced — equal to a tuple/list of the same ints, iterating and indexing as Python ints
    (so ``sum()``, ``json.dumps`` and ``range()`` keep working). ``np.asarray`` gives the plain
    array for vectorised code."""

    def __eq__(self, other: Any) -> Any:
        if isinstance(other, (tuple, list)):
            return self.ndim == 1 and self.tolist() == list(other)
        return super().__eq__(other)

    def __ne__(self, other: Any) -> Any:
        if isinstance(other, (tuple, list)):
            return not self.__eq__(other)
        return super().__ne__(other)

    __hash__ = None  # type: ignore[assignment]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist()) if self.ndim == 1 else super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        out = super().__getitem__(index)
        return int(out) if isinstance(out, np.integer) else out


def _count_view(arr: np.ndarray) -> CountArray:
    view = arr.view(CountArray)
    view.flags.writeable = False
    return view


class _ShardSeq(Sequence):
    """Read-only sequence of :class:`TarSample` made on access (``catalog.shards``)."""

    __slots__ = ("_make", "_n")

    def __init__(self, make: Callable[[int], TarSample], n: int) -> None:
        self._make = make
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self._make(i) for i in range(*index.indices(self._n)))
        i = int(index)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"shard index {index} out of range ({self._n} shards)")
        return self._make(i)

    def __iter__(self) -> Iterator[TarSample]:
        return (self._make(i) for i in range(self._n))

    def __repr__(self) -> str:
        return f"<{self._n} shards>"


# --------------------------------------------------------------------------- one wdinfo


class Wdinfo:
    """One parsed wdinfo.json (PiD's ``Wdinfo``), columnar, plus where it came from.

    ``paths`` is an Arrow string array of the ``data_list`` entries; ``counts`` an int64 array
    (None while unknown); ``tar_files`` makes :class:`TarSample` objects on access.
    """

    __slots__ = ("bucket", "chunk_size", "count_source", "counts", "data_keys", "dset_id",
                 "modalities", "paths", "root", "source", "total_key_count", "wdinfo_root")

    def __init__(
        self,
        source: str,
        tar_files: Sequence[TarSample] | None = None,
        total_key_count: int = 0,
        chunk_size: int = 1,
        data_keys: Iterable[str] = (),
        *,
        paths: pa.Array | Sequence[str] | None = None,
        counts: np.ndarray | Sequence[int] | None = None,
        count_source: str | None = None,
        root: str | None = None,
        wdinfo_root: str | None = None,
        modalities: Iterable[str] | None = None,
        dset_id: str = "dset: 0",
        bucket: str | None = None,
    ) -> None:
        if tar_files is not None:  # built from shard objects (tests, in-memory catalogs)
            tar_files = list(tar_files)
            paths = [t.path for t in tar_files]
            if tar_files and all(t.count is not None for t in tar_files):
                counts = [t.count for t in tar_files]
                count_source = count_source or "data_list_key_count"
            if tar_files:
                first = tar_files[0]
                root = root or first.root
                modalities = modalities or first.modalities
                dset_id, bucket = first.dset_id, first.bucket
        self.source = source
        self.paths = paths if isinstance(paths, pa.Array) else _strings(paths or ())
        self.counts = None if counts is None else _count_view(np.array(counts, dtype=np.int64))
        self.count_source = count_source if self.counts is not None else None
        self.total_key_count = int(total_key_count)
        self.chunk_size = int(chunk_size)
        self.data_keys = _tuple_of_str(data_keys)
        self.root = root if root is not None else url_dirname(source)
        self.wdinfo_root = wdinfo_root if wdinfo_root is not None else self.root
        self.modalities = _tuple_of_str(modalities or self.data_keys or DEFAULT_MODALITIES)
        self.dset_id = dset_id
        self.bucket = bucket

    def _replace(self, **changes: Any) -> Wdinfo:
        new = object.__new__(Wdinfo)
        for name in Wdinfo.__slots__:
            object.__setattr__(new, name, changes.get(name, getattr(self, name)))
        return new

    def __len__(self) -> int:
        return len(self.paths)

    def __repr__(self) -> str:
        return (f"Wdinfo({self.source!r}, {len(self)} shards, total_key_count="
                f"{self.total_key_count}, chunk_size={self.chunk_size}, root={self.root!r})")

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in Wdinfo.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in Wdinfo.__slots__:
            object.__setattr__(self, name, state[name])

    @property
    def folder(self) -> str:
        """The folder holding this wdinfo.json."""
        return url_dirname(self.source)

    def shard(self, i: int) -> TarSample:
        """Shard ``i`` of this wdinfo as a :class:`TarSample`."""
        count = None if self.counts is None else int(self.counts[i])
        return TarSample(self.paths[i].as_py(), self.root, self.modalities, count, self.dset_id,
                         None, self.bucket)

    @property
    def tar_files(self) -> Sequence[TarSample]:
        """The shards as :class:`TarSample` objects, made on access."""
        return _ShardSeq(self.shard, len(self.paths))

    def urls(self, modality: str, start: int = 0, stop: int | None = None) -> list[str]:
        """Tar URLs of shards ``[start, stop)`` for ``modality`` (vectorised ``TarSample.url``)."""
        import pyarrow.compute as pc

        stop = len(self.paths) if stop is None else stop
        part = self.paths.slice(start, max(0, stop - start))
        prefix = join_url(self.root, modality) + "/"
        return pc.binary_join_element_wise(_text(prefix), pc.utf8_trim(part, "/"),
                                           _text("")).to_pylist()


def _field(doc: dict[str, Any], name: str, url: str, types: type | tuple[type, ...]) -> Any:
    if name not in doc:
        raise CatalogError(f"{url}: missing field {name!r}")
    value = doc[name]
    if not isinstance(value, types) or isinstance(value, bool):
        tname = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise CatalogError(f"{url}: field {name!r} must be {tname}, got {type(value).__name__}")
    return value


def _modalities_arg(modalities: Sequence[str] | None, keys: Sequence[str] | None,
                    where: str) -> Sequence[str] | None:
    if keys is not None:
        warn_renamed(f"{where}(keys=...)", "modalities")
        if modalities is not None:
            raise CatalogError(f"{where}: got both modalities and its old name keys; give only "
                               "modalities")
        return keys
    return modalities


def parse_wdinfo(
    doc: Any,
    url: str,
    modalities: Sequence[str] | None = None,
    dset_id: str = "dset: 0",
    *,
    root: str = "wdinfo",
    keys: Sequence[str] | None = None,
) -> Wdinfo:
    """Validate a decoded wdinfo document; every error names ``url`` and the field."""
    modalities = _modalities_arg(modalities, keys, "parse_wdinfo")
    if not isinstance(doc, dict):
        raise CatalogError(f"{url}: expected a JSON object, got {type(doc).__name__}")
    data_list = _field(doc, "data_list", url, list)
    if not data_list:
        raise CatalogError(f"{url}: field 'data_list' is empty")
    for i, p in enumerate(data_list):
        if not isinstance(p, str) or not p:
            raise CatalogError(
                f"{url}: field 'data_list[{i}]' must be a non-empty string, got {p!r}")
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
            if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= _INT64_MAX:
                raise CatalogError(
                    f"{url}: field 'data_list_key_count[{i}]' must be an int >= 0, got {c!r}"
                )
    chunk = None
    if "chunk_size" in doc and doc["chunk_size"] is not None:
        chunk = _field(doc, "chunk_size", url, int)
    root_field = doc.get("root")
    if root_field is not None and not isinstance(root_field, str):
        chunk_of(url, chunk, counts, total, len(data_list))  # report chunk_size first, as before
        raise CatalogError(f"{url}: field 'root' must be str, got {type(root_field).__name__}")
    data_keys = doc.get("data_keys") or ()
    if not isinstance(data_keys, (list, tuple)):
        chunk_of(url, chunk, counts, total, len(data_list))
        raise CatalogError(
            f"{url}: field 'data_keys' must be a list, got {type(data_keys).__name__}")
    return _make_wdinfo(
        url, _strings(data_list),
        None if counts is None else np.array(counts, dtype=np.int64), total, chunk, root_field,
        tuple(str(k) for k in data_keys), modalities, dset_id, root)


def chunk_of(url: str, chunk: int | None, counts: Sequence[int] | np.ndarray | None, total: int,
             n: int) -> int:
    """``chunk_size`` in use: the field, else PiD's floored mean of the counts, else of the
    total."""
    if chunk is None:
        chunk = int(int(np.sum(counts)) / n) if counts is not None else int(total / n)
    if chunk <= 0:
        raise CatalogError(f"{url}: field 'chunk_size' must be > 0, got {chunk}")
    return chunk


def _make_wdinfo(url: str, paths: pa.Array, counts: np.ndarray | None, total: int,
                 chunk_field: int | None, root_field: str | None, data_keys: tuple[str, ...],
                 modalities: Sequence[str] | None, dset_id: str, root_mode: str) -> Wdinfo:
    n = len(paths)
    bad = first_unsafe_path(paths.buffers()[2], _offsets(paths))
    if bad is not None:  # a tar outside root/<modality>/: refused, whoever wrote the wdinfo
        check_rel_path(f"{url}: field 'data_list[{bad}]'", paths[bad].as_py())
    for k in data_keys:  # modality folders: root/<data key>/<path>
        check_folder_name(f"{url}: field 'data_keys'", k)
    chunk = chunk_of(url, chunk_field, counts, total, n)
    folder = url_dirname(url)
    if not root_field:
        wdinfo_root = folder
    elif _is_absolute(root_field):
        wdinfo_root = root_field.rstrip("/")
    else:
        scheme, sep, rest = folder.rpartition("://")
        # normalise "." and ".." (writers put root "."; object stores take names literally)
        wdinfo_root = f"{scheme}{sep}{posixpath.normpath(join_url(rest, root_field))}"
    source = "data_list_key_count" if counts is not None else None
    if counts is None and chunk * n == total:
        counts = np.full(n, chunk, dtype=np.int64)
        source = "chunk_size"
        _notice(("chunk", url), logging.INFO,
                "%s: no data_list_key_count; every shard counted as chunk_size=%d samples "
                "(total_key_count %d = chunk_size x %d shards, PiD's assumption)",
                url, chunk, total, n)
    return Wdinfo(
        url, total_key_count=total, chunk_size=chunk, data_keys=data_keys, paths=paths,
        counts=counts, count_source=source,
        root=folder if root_mode == "folder" else wdinfo_root, wdinfo_root=wdinfo_root,
        modalities=modalities or DEFAULT_MODALITIES, dset_id=dset_id, bucket=_bucket_of(url))


def _fast_parse(raw: bytes, url: str, modalities: Sequence[str] | None, dset_id: str,
                root_mode: str) -> Wdinfo | None:
    """Parse with pyarrow's JSON reader straight into arrays; None unless the document is a
    plainly valid wdinfo (the json path then parses it again and names what is wrong)."""
    import pyarrow.json as pj  # not pyarrow.compute: importing it costs ~0.3 s

    try:
        table = pj.read_json(
            io.BytesIO(raw),
            read_options=pj.ReadOptions(use_threads=False, block_size=len(raw) + 1),
            parse_options=pj.ParseOptions(newlines_in_values=True),
            # the system allocator hands the parser's scratch memory back to the OS
            memory_pool=pa.system_memory_pool())
    except (pa.ArrowException, OverflowError, ValueError):
        return None
    if table.num_rows != 1 or not {"data_list", "total_key_count"} <= set(table.column_names):
        return None
    # one block gives one chunk; combine_chunks() would copy it (1.2 s at 10M shards)
    row = {name: (col.chunk(0) if col.num_chunks == 1 else col.combine_chunks())
           for name, col in zip(table.column_names, table.columns, strict=True)}

    def strings(arr: pa.Array) -> pa.Array | None:
        if not pa.types.is_list(arr.type) or arr.null_count:
            return None
        values = arr.flatten()
        if pa.types.is_null(values.type):
            return _strings([])
        if not pa.types.is_string(values.type) or values.null_count:
            return None
        return values

    def scalar(name: str, kind: Callable[[pa.DataType], bool]) -> Any:
        arr = row.get(name)
        if arr is None or pa.types.is_null(arr.type):
            return None
        return arr[0].as_py() if kind(arr.type) and not arr.null_count else _BAD

    paths = strings(row["data_list"])
    total = scalar("total_key_count", pa.types.is_int64)
    if paths is None or total is None or total is _BAD:
        return None
    counts = None
    if "data_list_key_count" in row:
        arr = row["data_list_key_count"]
        if not pa.types.is_list(arr.type) or arr.null_count:
            return None
        values = arr.flatten()
        if not pa.types.is_int64(values.type) or values.null_count:
            return None
        counts = np.frombuffer(values.buffers()[1], dtype=np.int64)[
            values.offset:values.offset + len(values)]  # to_numpy() would import pandas
    chunk = scalar("chunk_size", pa.types.is_int64)
    root_field = scalar("root", pa.types.is_string)
    if chunk is _BAD or root_field is _BAD:
        return None
    data_keys: tuple[str, ...] = ()
    if "data_keys" in row and not pa.types.is_null(row["data_keys"].type):
        dk = strings(row["data_keys"])
        if dk is None:
            return None
        data_keys = tuple(dk.to_pylist())
    return _plain_wdinfo(url, paths, counts, total, chunk, root_field, data_keys, modalities,
                         dset_id, root_mode)


_BAD = object()


def _plain_wdinfo(url: str, paths: pa.Array, counts: np.ndarray | None, total: int,
                  chunk: int | None, root_field: str | None, data_keys: tuple[str, ...],
                  modalities: Sequence[str] | None, dset_id: str,
                  root_mode: str) -> Wdinfo | None:
    """The wdinfo from fields a fast parser has typed; None where a value is wrong (the json
    path then names it)."""
    n = len(paths)
    if n == 0 or np.diff(_offsets(paths)).min() == 0 or total < 0:
        return None
    if counts is not None and (len(counts) != n or counts.min() < 0):
        return None
    if chunk is not None and chunk <= 0:
        return None
    if chunk is None and int(counts.sum() if counts is not None else total) < n:
        return None  # chunk_size would be 0
    return _make_wdinfo(url, paths, counts, total, chunk, root_field, data_keys, modalities,
                        dset_id, root_mode)


def _scan_parse(raw: bytes, url: str, modalities: Sequence[str] | None, dset_id: str,
                root_mode: str) -> Wdinfo | None:
    """Parse a plainly written wdinfo with :mod:`wdinfo_scan` (10M shards: ~2 s against
    pyarrow's 6-8 s); None unless the document is plainly valid."""
    scanned = scan_wdinfo(raw)
    if scanned is None:
        return None
    rest = scanned.rest
    total, chunk, root_field = (rest.get(k) for k in ("total_key_count", "chunk_size", "root"))
    if not _is_int(total) or (chunk is not None and not _is_int(chunk)):
        return None
    if root_field is not None and not isinstance(root_field, str):
        return None
    data_keys = rest.get("data_keys")
    if data_keys is not None and not (isinstance(data_keys, list)
                                      and all(isinstance(k, str) for k in data_keys)):
        return None
    return _plain_wdinfo(url, _string_array(scanned.offsets, scanned.data), scanned.counts,
                         total, chunk, root_field, tuple(data_keys or ()), modalities, dset_id,
                         root_mode)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_wdinfo(
    url: str,
    modalities: Sequence[str] | None = None,
    dset_id: str = "dset: 0",
    storage_options: dict[str, Any] | None = None,
    *,
    root: str = "wdinfo",
    keys: Sequence[str] | None = None,
) -> Wdinfo:
    """Read and validate one wdinfo.json over fsspec (remote reads retry, see ``remote``).

    ``root``: ``wdinfo`` reads the tars under the wdinfo's ``root`` (PiD), ``folder`` under the
    folder holding it.
    """
    modalities = _modalities_arg(modalities, keys, "read_wdinfo")
    check_root_mode(root)
    try:
        raw = remote.read_bytes(url, storage_options)
    except FileNotFoundError:
        raise CatalogError(f"{url}: wdinfo.json not found") from None
    except (OSError, IngestError) as exc:
        raise CatalogError(f"{url}: cannot read wdinfo.json ({exc})") from None
    if len(raw) >= FAST_PARSE_BYTES:
        parsed = (_scan_parse(raw, url, modalities, dset_id, root)
                  or _fast_parse(raw, url, modalities, dset_id, root))
        if parsed is not None:
            return parsed
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CatalogError(f"{url}: malformed JSON ({exc})") from None
    del raw
    return parse_wdinfo(doc, url, modalities=modalities, dset_id=dset_id, root=root)


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


# --------------------------------------------------------------------------- roots


def same_place(a: str, b: str) -> bool:
    """Whether two folder URLs name the same place (local paths compared resolved)."""
    if a.rstrip("/") == b.rstrip("/"):
        return True
    if "://" in a or "://" in b:
        return False
    return os.path.realpath(a) == os.path.realpath(b)


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


# --------------------------------------------------------------------------- the catalog


@attrs.frozen
class _Group:
    """What shards of one wdinfo (or one legacy shard group) share."""

    root: str
    modalities: tuple[str, ...]
    dset_id: str
    bucket: str | None
    sample_keys_full_list: str | None = None
    #: Index into ``catalog.wdinfos`` (-1: built from shard objects).
    wdinfo: int = -1


class Catalog:
    """All shards of one or more datasets, in a stable order, with a content fingerprint.

    Columnar (see the module docstring): ``paths``, ``counts``, ``group_index`` and small
    per-wdinfo tables; ``shards``/``shard(i)`` make :class:`TarSample` objects on access.
    ``load_catalog`` builds catalogs; this constructor builds one from shard objects.
    """

    __slots__ = ("_complete", "_count_error", "_counts", "_fingerprint", "_group", "_groups",
                 "_lock", "_modalities", "_paths", "_starts", "_storage", "_wdinfos",
                 "chunk_size")

    def __init__(self, shards: Iterable[TarSample] = (), wdinfos: Sequence[Wdinfo] = (),
                 chunk_size: int | None = None, modalities: Iterable[str] | None = None, *,
                 keys: Iterable[str] | None = None) -> None:
        modalities = _modalities_arg(modalities, keys, "Catalog")  # type: ignore[arg-type]
        shards = list(shards)
        codes: dict[_Group, int] = {}
        group = np.empty(len(shards), dtype=np.int32)
        for i, s in enumerate(shards):
            g = _Group(s.root, s.modalities, s.dset_id, s.bucket, s.sample_keys_full_list)
            group[i] = codes.setdefault(g, len(codes))
        counts = np.array([-1 if s.count is None else s.count for s in shards], dtype=np.int64)
        if chunk_size is None:
            chunk_size = wdinfos[0].chunk_size if wdinfos else 1
        self._setup(_strings([s.path for s in shards]), counts, group,
                    tuple(codes), tuple(wdinfos), None, int(chunk_size),
                    _tuple_of_str(modalities or (shards[0].modalities if shards
                                                 else DEFAULT_MODALITIES)), ())

    def _setup(self, paths: pa.Array, counts: np.ndarray, group: np.ndarray,
               groups: tuple[_Group, ...], wdinfos: tuple[Wdinfo, ...], starts: np.ndarray | None,
               chunk_size: int, modalities: tuple[str, ...],
               storage: tuple[dict[str, Any], ...], fingerprint: str | None = None,
               count_error: str | None = None) -> None:
        group.flags.writeable = False
        self._paths = paths
        self._counts = counts
        self._group = group
        self._groups = groups
        self._wdinfos = wdinfos
        self._starts = starts
        self.chunk_size = chunk_size
        self._modalities = modalities
        self._storage = storage
        self._fingerprint = fingerprint
        self._count_error = count_error
        self._complete = not len(counts) or bool(counts.min() >= 0)
        self._lock = threading.Lock()

    @classmethod
    def from_wdinfos(cls, wdinfos: Sequence[Wdinfo], modalities: Sequence[str] | None = None,
                     storage_options: Sequence[dict[str, Any]] | None = None) -> Catalog:
        """Concatenate parsed wdinfos (in order) into one catalog, without per-shard objects."""
        if not wdinfos:
            raise CatalogError("no wdinfo files given")
        lengths = np.array([len(w) for w in wdinfos], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        paths = (wdinfos[0].paths if len(wdinfos) == 1
                 else pa.concat_arrays([w.paths for w in wdinfos]))
        if len(wdinfos) == 1 and wdinfos[0].counts is not None:
            counts = np.asarray(wdinfos[0].counts)  # read-only; replaced, never written
        else:
            counts = np.full(int(starts[-1]), -1, dtype=np.int64)
            for w, a in zip(wdinfos, starts, strict=False):
                if w.counts is not None:
                    counts[a:a + len(w)] = w.counts
        group = np.repeat(np.arange(len(wdinfos), dtype=np.int32), lengths)
        groups = tuple(_Group(w.root, w.modalities, w.dset_id, w.bucket, None, i)
                       for i, w in enumerate(wdinfos))
        cat = object.__new__(cls)
        cat._setup(paths, counts, group, groups, (), starts, wdinfos[0].chunk_size,
                   _tuple_of_str(modalities or wdinfos[0].modalities),
                   tuple(storage_options or ({} for _ in wdinfos)))
        cat._wdinfos = cat._views(wdinfos)
        return cat

    def _views(self, wdinfos: Sequence[Wdinfo]) -> tuple[Wdinfo, ...]:
        """The wdinfos re-pointed at slices of the catalog's arrays (no second copy)."""
        out = []
        for i, w in enumerate(wdinfos):
            a, b = int(self._starts[i]), int(self._starts[i + 1])
            known = w.count_source is not None
            out.append(w._replace(paths=self._paths.slice(a, b - a),
                                  counts=_count_view(self._counts[a:b]) if known else None))
        return tuple(out)

    # --- pickling (ray.put): arrays and small tables only ---------------------------------
    def __getstate__(self) -> dict[str, Any]:
        paths = self._paths
        if paths.offset or len(paths.buffers()) != 3:
            paths = pa.concat_arrays([paths])  # compact: a slice would pickle its whole buffers
        if self._starts is not None:
            wdinfos: Any = [w._replace(paths=None, counts=None).__getstate__()
                            for w in self._wdinfos]
        else:
            wdinfos = self._wdinfos
        return {"paths": paths, "counts": self._counts, "group": np.array(self._group),
                "groups": self._groups, "wdinfos": wdinfos, "starts": self._starts,
                "chunk_size": self.chunk_size, "modalities": self._modalities,
                "storage": self._storage, "fingerprint": self._fingerprint,
                "count_error": self._count_error}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["paths"], state["counts"], state["group"], state["groups"], (),
                    state["starts"], state["chunk_size"], state["modalities"], state["storage"],
                    state["fingerprint"], state["count_error"])
        if self._starts is None:
            self._wdinfos = tuple(state["wdinfos"])
            return
        shells = []
        for doc in state["wdinfos"]:
            w = object.__new__(Wdinfo)
            w.__setstate__(doc)
            shells.append(w)
        self._wdinfos = self._views(shells)

    def __repr__(self) -> str:
        return (f"Catalog({len(self)} shards from {len(self._wdinfos)} wdinfo files, "
                f"modalities={list(self._modalities)}, chunk_size={self.chunk_size})")

    # --- columns and small tables ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self._paths)

    @property
    def num_shards(self) -> int:
        return len(self._paths)

    @property
    def modalities(self) -> tuple[str, ...]:
        """Modality folders read by default, in reading order; the first drives alignment."""
        return self._modalities

    @property
    def keys(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`modalities`."""
        warn_renamed("Catalog.keys", "modalities")
        return self._modalities

    @property
    def wdinfos(self) -> tuple[Wdinfo, ...]:
        return self._wdinfos

    @property
    def paths(self) -> pa.Array:
        """``data_list`` path of every shard (an Arrow string array)."""
        return self._paths

    def path(self, i: int) -> str:
        return self._paths[i].as_py()

    def paths_at(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """``data_list`` paths of the shards ``indices`` (a worker list), in that order."""
        return self._paths.take(_ints(np.asarray(indices, dtype=np.int64))).to_pylist()

    @property
    def group_index(self) -> np.ndarray:
        """Per shard: its row in :attr:`groups` (the wdinfo it came from), int32, read-only."""
        return self._group

    @property
    def groups(self) -> tuple[_Group, ...]:
        """What the shards of each wdinfo share: root, modalities, dataset id, bucket."""
        return self._groups

    @property
    def roots(self) -> tuple[str, ...]:
        """Root in use per group (index with :attr:`group_index`)."""
        return tuple(g.root for g in self._groups)

    @property
    def dataset_index(self) -> np.ndarray:
        """Per shard: the number of its dataset (``"dset: i"`` -> ``i``), int32."""
        ids: dict[str, int] = {}
        table = np.array([ids.setdefault(g.dset_id, _dset_number(g.dset_id, len(ids)))
                          for g in self._groups], dtype=np.int32)
        return table[self._group] if len(table) else np.zeros(0, dtype=np.int32)

    @property
    def buckets(self) -> np.ndarray:
        """Per shard: its aspect bucket label (``"16_9"``; ``""`` when unbucketed), object array."""
        table = np.array([g.bucket or "" for g in self._groups] or [""], dtype=object)
        return table[self._group]

    @property
    def known_counts(self) -> np.ndarray:
        """Per-shard counts known without reading anything (-1 where unknown), read-only."""
        view = self._counts.view()
        view.flags.writeable = False
        return view

    @property
    def counts(self) -> CountArray:
        """Per-shard sample counts (int64, see :class:`CountArray`).

        Shards whose wdinfo records none get them from their key indexes, read once here;
        raises :class:`CatalogError` saying what is missing when neither exists.
        """
        if not self._complete:
            self._resolve_counts()
        return _count_view(self._counts)

    def _try_counts(self) -> None:
        """Resolve counts from key indexes when possible; leave them unknown otherwise."""
        with contextlib.suppress(CatalogError):
            self.counts  # noqa: B018

    def require_counts(self) -> CountArray:
        """:attr:`counts`: call before ``ray.put`` so ranks receive resolved counts."""
        return self.counts

    def _resolve_counts(self) -> None:
        with self._lock:
            if self._count_error is None and not self._complete:
                self._count_error = self._fill_counts()
                self._complete = self._count_error is None
            if self._count_error is not None:
                raise CatalogError(self._count_error)

    def _fill_counts(self) -> str | None:
        """Fill unknown counts from key indexes; the error text when some stay unknown."""
        if self._starts is None:
            i = int(np.argmax(self._counts < 0))
            return (f"shard {self.path(i)} (index {i}): wdinfo has no 'data_list_key_count'; "
                    "per-shard counts are required here")
        for k, w in enumerate(self._wdinfos):
            if w.count_source is not None:
                continue
            t0 = time.perf_counter()
            if len(w) > _MANY_INDEXES:
                log.warning("%s: reading %d key indexes for per-shard counts (once); "
                            "`ray-ingest index %s` records them in the wdinfo instead",
                            w.source, len(w), w.folder)
            found, missing = _counts_from_indexes(w, self._storage[k])
            if found is None:
                return (f"{w.source}: no per-shard sample counts: field 'data_list_key_count' "
                        f"is missing, total_key_count ({w.total_key_count}) is not chunk_size "
                        f"({w.chunk_size}) x {len(w)} shards, and the key index {missing} does "
                        f"not exist; run `ray-ingest index {w.folder}` to write them")
            a = int(self._starts[k])
            counts = self._counts.copy()  # arrays handed out earlier stay as they were
            counts[a:a + len(w)] = found
            self._counts = counts
            self._wdinfos = self._views([x if j != k else x._replace(count_source="key index")
                                         for j, x in enumerate(self._wdinfos)])
            log.info("%s: counts of %d shards from their %s key indexes (%.2f s)", w.source,
                     len(w), w.modalities[0], time.perf_counter() - t0)
        self._fingerprint = None
        return None

    @property
    def total_key_count(self) -> int:
        return sum(w.total_key_count for w in self._wdinfos)

    # --- shard objects --------------------------------------------------------------------
    def shard(self, i: int) -> TarSample:
        """Shard ``i`` as a :class:`TarSample` (made now; nothing per shard is kept)."""
        n = len(self._paths)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"shard index {i} out of range ({n} shards)")
        g = self._groups[self._group[i]]
        c = int(self._counts[i])
        return TarSample(self._paths[i].as_py(), g.root, g.modalities, None if c < 0 else c,
                         g.dset_id, g.sample_keys_full_list, g.bucket)

    @property
    def shards(self) -> Sequence[TarSample]:
        """Every shard as a read-only sequence of :class:`TarSample`, made on access."""
        return _ShardSeq(self.shard, len(self._paths))

    def url(self, i: int, modality: str) -> str:
        """URL of shard ``i``'s tar for ``modality``."""
        return join_url(self._groups[self._group[i]].root, modality, self.path(i))

    # --- fingerprint ----------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 over the modalities and every shard's dataset id, path and count (not roots:
        a copy in gs:// matches). Counts are those in use (null where none can be had)."""
        if self._fingerprint is None:
            self._try_counts()
            self._fingerprint = _fingerprint(self._modalities, self._paths, self._counts,
                                             self._group, self._groups)
        return self._fingerprint

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
        """Small summary stored next to the fingerprint so a mismatch can say what changed.

        Its ``keys`` entry (the modalities) keeps that name: saved read states hold it.
        """
        self._try_counts()
        n = len(self._paths)
        return {
            "keys": list(self._modalities),
            "num_shards": n,
            "num_samples": int(self._counts[self._counts >= 0].sum()),
            "first_shard": self.path(0) if n else None,
            "last_shard": self.path(n - 1) if n else None,
        }


def _dset_number(dset_id: str, fallback: int) -> int:
    head, _, tail = dset_id.partition(": ")
    return int(tail) if head == "dset" and tail.isdigit() else fallback


#: Bytes that JSON writes verbatim inside a string (printable ASCII but ``"`` and ``\``).
_JSON_PLAIN = np.zeros(256, dtype=bool)
_JSON_PLAIN[0x20:0x7F] = True
_JSON_PLAIN[[0x22, 0x5C]] = False


def _fingerprint(modalities: Sequence[str], paths: pa.Array, counts: np.ndarray,
                 group: np.ndarray, groups: Sequence[_Group]) -> str:
    """sha256(json(modalities) + json([dset_id, path, count]) per shard)[:16], vectorised.

    The same bytes as hashing ``json.dumps([s.dset_id, s.path, s.count])`` shard by shard
    (the object catalog's definition); paths needing JSON escapes (rare) take that literal
    loop. Built in chunks of :data:`_FINGERPRINT_CHUNK` shards to bound memory.
    """
    import pyarrow.compute as pc

    h = hashlib.sha256()
    h.update(json.dumps(list(modalities)).encode())
    if not len(paths):
        return h.hexdigest()[:16]
    offsets = _offsets(paths)
    data = np.frombuffer(paths.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]
    if not _JSON_PLAIN[data].all():
        for i, p in enumerate(paths.to_pylist()):
            c = int(counts[i])
            h.update(json.dumps([groups[group[i]].dset_id, p, None if c < 0 else c]).encode())
        return h.hexdigest()[:16]
    heads = [f"[{json.dumps(g.dset_id)}, \"" for g in groups]
    one_head = _text(heads[0]) if len(set(heads)) == 1 else None
    sep, end, null = _text('", '), _text("]"), _text("null")
    for a in range(0, len(paths), _FINGERPRINT_CHUNK):
        part = paths.slice(a, _FINGERPRINT_CHUNK)
        c = counts[a:a + len(part)]
        head = one_head if one_head is not None else _strings(heads).take(
            _ints(group[a:a + len(part)]))
        text = pc.cast(_ints(c), pa.string())
        if (c < 0).any():
            text = pc.if_else(_bools(c < 0), null, text)
        lines = pc.binary_join_element_wise(head, part, sep, text, end, _text(""))
        off = _offsets(lines)
        h.update(memoryview(lines.buffers()[2])[int(off[0]):int(off[-1])])
    return h.hexdigest()[:16]


#: Shards per chunk of the vectorised fingerprint (~50 MB of text at a time).
_FINGERPRINT_CHUNK = 1 << 20


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
    keys: Sequence[str] | None = None,
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
    modalities = _modalities_arg(modalities, keys, "load_catalog")
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
                all_mods = w.data_keys or DEFAULT_MODALITIES
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
