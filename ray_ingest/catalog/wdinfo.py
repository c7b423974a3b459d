"""One ``wdinfo.json`` read and validated into a :class:`Wdinfo` (arrays, not objects).

Reads the file exactly as PiD's sharder writes it (``data_list``, ``total_key_count``,
optional ``chunk_size``, ``data_list_key_count``, ``data_keys``, ``root``) over fsspec. Big
files go straight into arrays: plainly written ones through :mod:`ray_ingest.catalog.scan`,
others through pyarrow's JSON reader; anything unusual falls back to ``json`` and its exact
checks, so every error message is the same whichever parser ran. No Ray, no torch.
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ray_ingest.catalog.arrays import _count_view, _offsets, _string_array, _strings, _text
from ray_ingest.catalog.entries import check_entries
from ray_ingest.catalog.scan import max_nesting, scan_wdinfo
from ray_ingest.catalog.shard import (
    DEFAULT_MODALITIES,
    Shard,
    _bucket_of,
    _notice,
    _ShardSeq,
    _tuple_of_str,
    check_root_mode,
)
from ray_ingest.errors import CatalogError, IngestError
from ray_ingest.twintar import remote
from ray_ingest.twintar.fsio import _is_absolute, join_url, url_dirname
from ray_ingest.twintar.safepath import check_folder_name

log = logging.getLogger(__name__)


#: wdinfo files at least this big are read into arrays by wdinfo_scan or pyarrow's JSON reader
#: (json.loads below: their start-up costs more than they save on small files).
FAST_PARSE_BYTES = 1 << 20
_INT64_MAX = 2**63 - 1
#: Documents nested deeper than this (an upper bound, see ``scan.max_nesting``) never reach
#: pyarrow's JSON reader, which crashes the process a few thousand levels down.
MAX_FAST_NESTING = 64
_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")


# --------------------------------------------------------------------------- one wdinfo


class Wdinfo:
    """One parsed wdinfo.json (PiD's ``Wdinfo``), columnar, plus where it came from.

    ``paths`` is an Arrow string array of the ``data_list`` entries; ``counts`` an int64 array
    (None while unknown); ``tar_files`` makes :class:`Shard` objects on access.
    """

    __slots__ = ("bucket", "chunk_size", "count_source", "counts", "dset_id", "listed_modalities",
                 "modalities", "paths", "root", "source", "total_key_count", "wdinfo_root")

    def __init__(
        self,
        source: str,
        tar_files: Sequence[Shard] | None = None,
        total_key_count: int = 0,
        chunk_size: int = 1,
        listed_modalities: Iterable[str] = (),
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
        self.listed_modalities = _tuple_of_str(listed_modalities)
        self.root = root if root is not None else url_dirname(source)
        self.wdinfo_root = wdinfo_root if wdinfo_root is not None else self.root
        self.modalities = _tuple_of_str(modalities or self.listed_modalities or DEFAULT_MODALITIES)
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

    def shard(self, i: int) -> Shard:
        """Shard ``i`` of this wdinfo as a :class:`Shard`."""
        count = None if self.counts is None else int(self.counts[i])
        return Shard(self.paths[i].as_py(), self.root, self.modalities, count, self.dset_id,
                         None, self.bucket)

    @property
    def tar_files(self) -> Sequence[Shard]:
        """The shards as :class:`Shard` objects, made on access."""
        return _ShardSeq(self.shard, len(self.paths))

    def urls(self, modality: str, start: int = 0, stop: int | None = None) -> list[str]:
        """Tar URLs of shards ``[start, stop)`` for ``modality`` (vectorised ``Shard.url``)."""
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


def parse_wdinfo(
    doc: Any,
    url: str,
    modalities: Sequence[str] | None = None,
    dset_id: str = "dset: 0",
    *,
    root: str = "wdinfo",
) -> Wdinfo:
    """Validate a decoded wdinfo document; every error names ``url`` and the field."""
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
    _check_int64(url, total, None, None)
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
        _check_int64(url, 0, chunk, None)
    root_field = doc.get("root")
    if root_field is not None and not isinstance(root_field, str):
        chunk_of(url, chunk, counts, total, len(data_list))  # report chunk_size first, as before
        raise CatalogError(f"{url}: field 'root' must be str, got {type(root_field).__name__}")
    data_keys = doc.get("data_keys") or ()
    if not isinstance(data_keys, (list, tuple)):
        chunk_of(url, chunk, counts, total, len(data_list))
        raise CatalogError(
            f"{url}: field 'data_keys' must be a list, got {type(data_keys).__name__}")
    for i, k in enumerate(data_keys):
        if not isinstance(k, str):  # (was read as the folder str(k): 'None', '1')
            chunk_of(url, chunk, counts, total, len(data_list))
            raise CatalogError(
                f"{url}: field 'data_keys[{i}]' must be a string, got {k!r}")
    _check_unicode(url, data_list, root_field, data_keys)
    return _make_wdinfo(
        url, _strings(data_list),
        None if counts is None else np.array(counts, dtype=np.int64), total, chunk, root_field,
        tuple(data_keys), modalities, dset_id, root)


def _check_unicode(url: str, data_list: list[str], root: str | None,
                   data_keys: Sequence[str]) -> None:
    """JSON escapes can spell a lone surrogate (``"\\ud800"``), which no path can hold (UTF-8
    has no encoding for it): refused, naming the field."""
    fields = [("data_list", data_list), ("data_keys", list(data_keys))]
    if root is not None:
        fields.append(("root", [root]))
    for name, texts in fields:
        try:
            "".join(texts).encode("utf-8")
        except UnicodeEncodeError:
            i = next(i for i, t in enumerate(texts) if not _encodable(t))
            where = name if name == "root" else f"{name}[{i}]"
            raise CatalogError(f"{url}: field {where!r} is not valid Unicode (a lone "
                               f"surrogate): {texts[i]!r}") from None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    _check_int64(url, total, chunk_field, counts)
    check_entries(url, paths)  # plain relative tar paths, each once, whoever wrote the wdinfo
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
        url, total_key_count=total, chunk_size=chunk, listed_modalities=data_keys, paths=paths,
        counts=counts, count_source=source,
        root=folder if root_mode == "folder" else wdinfo_root, wdinfo_root=wdinfo_root,
        modalities=modalities or DEFAULT_MODALITIES, dset_id=dset_id, bucket=_bucket_of(url))


def _check_int64(url: str, total: int, chunk: int | None, counts: np.ndarray | None) -> None:
    """Counts are int64 from here on (arrays, plans, read states): larger ones are refused."""
    for name, value in (("total_key_count", total), ("chunk_size", chunk)):
        if value is not None and value > _INT64_MAX:
            raise CatalogError(f"{url}: field {name!r} must be <= {_INT64_MAX}, got {value}")
    if counts is not None and len(counts) and int(counts.max()) > _INT64_MAX // len(counts):
        total_counts = sum(int(c) for c in counts)  # numpy's sum would wrap around
        if total_counts > _INT64_MAX:
            raise CatalogError(f"{url}: field 'data_list_key_count' sums to {total_counts}, "
                               f"over {_INT64_MAX}")


def _fast_parse(raw: bytes, url: str, modalities: Sequence[str] | None, dset_id: str,
                root_mode: str) -> Wdinfo | None:
    """Parse with pyarrow's JSON reader straight into arrays; None unless the document is a
    plainly valid wdinfo (the json path then parses it again and names what is wrong)."""
    import pyarrow.json as pj  # not pyarrow.compute: importing it costs ~0.3 s

    # pyarrow 26's reader crashes the process (SIGSEGV) on a top-level null and a few thousand
    # levels of nesting: such documents (never a wdinfo) are left to json, which names them
    if _OBJECT_START.match(raw) is None or max_nesting(raw) > MAX_FAST_NESTING:
        return None
    try:
        table = pj.read_json(
            io.BytesIO(raw),
            read_options=pj.ReadOptions(use_threads=False, block_size=len(raw) + 1),
            parse_options=pj.ParseOptions(newlines_in_values=True),
            # the system allocator hands the parser's scratch memory back to the OS
            memory_pool=pa.system_memory_pool())
        names = set(table.column_names)  # (a name that is not UTF-8: UnicodeDecodeError)
        table.validate(full=True)  # every string UTF-8, as json.loads requires
    except (pa.ArrowException, OverflowError, ValueError):
        return None
    if table.num_rows != 1 or not {"data_list", "total_key_count"} <= names:
        return None
    # one block gives one chunk; combine_chunks() would copy it (1.2 s at 10M shards)
    row = {name: (col.chunk(0) if col.num_chunks == 1 else col.combine_chunks())
           for name, col in zip(table.column_names, table.columns, strict=True)}

    def strings(arr: pa.Array) -> pa.Array | None:
        if not pa.types.is_list(arr.type) or arr.null_count:
            return None
        values = arr.flatten()
        if pa.types.is_null(values.type):  # [] (or [null, ...]: json names that)
            return _strings([]) if len(values) == 0 else None
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
) -> Wdinfo:
    """Read and validate one wdinfo.json over fsspec (remote reads retry, see ``remote``).

    ``root``: ``wdinfo`` reads the tars under the wdinfo's ``root`` (PiD), ``folder`` under the
    folder holding it.
    """
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
    except RecursionError:
        raise CatalogError(f"{url}: malformed JSON (nested too deeply to read)") from None
    del raw
    return parse_wdinfo(doc, url, modalities=modalities, dset_id=dset_id, root=root)
