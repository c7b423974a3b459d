"""Read one twin shard (or a slice of it) into aligned sample rows.

Opens every modality's tar through :mod:`ray_ingest.twintar.remote`, positions the streams at the
slice's first sample — seeking with the per-shard key index when one exists, streaming past
payloads otherwise, never decoding — and hands them to :func:`ray_ingest.twintar.twin.expand`.
The same function serves the Ray read tasks, ``ray-ingest cat`` and the benchmarks, so they
cannot disagree.

No Ray, no torch.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import attrs

from ray_ingest.errors import IngestError, TarFormatError
from ray_ingest.redact import options_repr, register
from ray_ingest.twintar import remote
from ray_ingest.twintar.safepath import check_folder_name, check_rel_path
from ray_ingest.twintar.tario import Member, TarIndex, index_url, iter_members
from ray_ingest.twintar.twin import DEFAULT_READ_AHEAD, AlignStats, check_align, expand

if TYPE_CHECKING:  # a shard of the catalog (the layer above) is only read here
    from ray_ingest.catalog.shard import Shard


@attrs.frozen
class ReadOptions:
    """How shards are read. Small and picklable: it travels inside every Ray read task."""

    #: ``strict`` | ``merge`` | ``index`` (see :mod:`ray_ingest.twintar.twin`).
    align: str = attrs.field(default="strict")
    #: Modalities that may lack a sample (or a whole tar).
    optional: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: Seek with ``<tar>.idx.json`` when present.
    use_index: bool = True
    #: Parquet key list for ``align="index"`` (applies to shards via its ``shard`` column,
    #: or to every shard when it has none).
    index_path: str | None = None
    #: Look-ahead members per secondary modality in merge/index mode (``data.max_read_ahead``):
    #: a key not found within it is an error, or a recorded skip under ``on_error="skip"``.
    read_ahead: int = DEFAULT_READ_AHEAD
    #: Members whose tar header declares more bytes are never read (``decode.max_member_bytes``):
    #: an error, or a recorded skip under ``on_error="skip"``. None: no limit.
    max_member_bytes: int | None = None
    #: fsspec storage options (``token``, ``project``, …); redacted in its repr.
    storage_options: dict[str, Any] = attrs.field(factory=dict, repr=options_repr)
    #: Retry policy for remote reads (None: remote's default).
    retry: Any = None

    @align.validator
    def _check(self, attribute: attrs.Attribute, value: str) -> None:
        check_align(value)

    def __attrs_post_init__(self) -> None:
        register(self.storage_options)


def read_options(cfg: Any) -> ReadOptions:
    """The read options a run configuration (:class:`ray_ingest.config.Config`) asks for."""
    dc = cfg.data
    return ReadOptions(align=dc.align, optional=dc.optional_modalities, index_path=dc.index_path,
                       storage_options=dict(dc.storage_options), read_ahead=dc.max_read_ahead,
                       max_member_bytes=cfg.decode.max_member_bytes)


def load_index_keys(path: str, shard: str | None = None,
                    storage_options: dict[str, Any] | None = None) -> list[str]:
    """Keys of a parquet key list: first column, cut at the first ``.`` (PiD's rule).

    When the file has a ``shard`` column, only rows of ``shard`` are returned.
    """
    import pyarrow.parquet as pq

    try:
        with remote.open_url(path, storage_options) as f:
            table = pq.read_table(f)
    except FileNotFoundError:
        raise IngestError(f"{path}: index file not found") from None
    except IngestError:
        raise
    except Exception as exc:  # pyarrow raises many types for a bad file
        raise IngestError(f"{path}: cannot read parquet key index ({exc})") from None
    if table.num_columns == 0:
        raise IngestError(f"{path}: parquet key index has no columns")
    key_col = next((n for n in table.column_names if n != "shard"), None)
    if key_col is None:
        raise IngestError(f"{path}: parquet key index has no key column")
    keys = [str(k).split(".", 1)[0] for k in table.column(key_col).to_pylist()]
    if shard is not None and "shard" in table.column_names:
        shards = table.column("shard").to_pylist()
        keys = [k for k, s in zip(keys, shards, strict=True) if s == shard]
    return keys


#: Parsed key indexes by tar URL, so the block-sized read tasks of one shard that run in the same
#: worker fetch and parse ``<tar>.idx.json`` once, not once per task. Validated against the
#: tar's size on every use, so a rewritten tar never uses a stale entry.
_INDEX_CACHE: OrderedDict[str, tuple[TarIndex, tuple[str | None, ...], list[int]]] = OrderedDict()
_INDEX_CACHE_SIZE = 256


def _read_index(url: str, storage_options: dict[str, Any], retry: Any = None
                ) -> tuple[TarIndex, tuple[str | None, ...], list[int]] | None:
    """(index, member keys, positions of named members) of ``url``, or None without an index."""
    hit = _INDEX_CACHE.get(url)
    if hit is not None:
        _INDEX_CACHE.move_to_end(url)
        return hit
    try:
        raw = remote.read_bytes(index_url(url), storage_options, retry)
    except (FileNotFoundError, IngestError, OSError):
        return None
    try:
        idx = TarIndex.from_dict(json.loads(raw), index_url(url))
    except (ValueError, TarFormatError):
        return None  # a broken index only costs speed: fall back to streaming
    keys = idx.keys  # derived from the names: compute once per index
    entry = (idx, keys, [i for i, k in enumerate(keys) if k is not None])
    _INDEX_CACHE[url] = entry
    if len(_INDEX_CACHE) > _INDEX_CACHE_SIZE:
        _INDEX_CACHE.popitem(last=False)
    return entry


def _size(f: BinaryIO) -> int | None:
    """Byte size of a seekable file (None when unknown); leaves the position unchanged."""
    try:
        if not f.seekable():
            return None
        here = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(here)
        return end
    except (OSError, ValueError):
        return None


def _position(f: BinaryIO, url: str, start: int, opts: ReadOptions) -> tuple[int, list[str]]:
    """Move ``f`` to named member ``start``; return (byte offset, keys passed over)."""
    if start <= 0:
        return 0, []
    entry = _read_index(url, opts.storage_options, opts.retry) if opts.use_index else None
    if entry is not None and entry[0].tar_size >= 0 and entry[0].tar_size != _size(f):
        _INDEX_CACHE.pop(url, None)
        entry = None  # stale index (the tar was rewritten): stream instead
    if entry is not None:
        idx, keys, named = entry
        if start < len(named):
            off = idx.offsets[named[start]]
            if f.seekable():
                f.seek(off)
                passed = [keys[i] for i in named[:start]]
                return off, passed  # type: ignore[return-value]
    passed: list[str] = []
    pos = 0
    for m in iter_members(f, url, read_data=False):
        if m.key is None:
            continue
        passed.append(m.key)
        if len(passed) == start:
            pos = f.tell()
            break
    else:
        with contextlib.suppress(OSError, ValueError):
            pos = f.tell()
    return pos, passed


def _known_keys(f: BinaryIO, url: str, opts: ReadOptions) -> frozenset[str] | None:
    """Every key of the tar at ``url`` from its key index (None without a fresh index)."""
    entry = _read_index(url, opts.storage_options, opts.retry) if opts.use_index else None
    if entry is None or (entry[0].tar_size >= 0 and entry[0].tar_size != _size(f)):
        return None
    return frozenset(k for k in entry[1] if k is not None)


def read_shard(
    shard: Shard,
    start: int = 0,
    count: int | None = None,
    opts: ReadOptions = ReadOptions(),
    stats: AlignStats | None = None,
    index_keys: Sequence[str] | None = None,
    on_error: str = "raise",
) -> Iterator[dict[str, Any]]:
    """Yield the aligned rows of ``shard`` from sample ``start`` (at most ``count`` of them).

    Rows hold ``__key__``, ``__shard__``, ``__index__`` and, per modality, its bytes and its
    extension (``<modality>__ext``). ``on_error="skip"``: a sample that cannot be read (a
    member over ``opts.max_member_bytes``, a key beyond the merge look-ahead) comes as a row
    whose :data:`~ray_ingest.twintar.twin.ERROR` holds the error, instead of raising.
    """
    register(opts.storage_options)  # options unpickled in a Ray task were never registered
    check_rel_path(f"shard {shard.path}", shard.path)  # catalogs refuse these; TarSample may not
    for m in shard.modalities:
        check_folder_name(f"shard {shard.path}: modality", m)
    stack = contextlib.ExitStack()
    with stack:
        streams: dict[str, Iterator[Member]] = {}
        skip_keys: list[str] = []
        known: dict[str, frozenset[str]] = {}
        limit = opts.max_member_bytes
        driver = shard.modalities[0]
        for m in shard.modalities:
            url = shard.url(m)
            try:
                f = stack.enter_context(remote.open_url(url, opts.storage_options, opts.retry))
            except FileNotFoundError:
                if m in opts.optional and m != driver:
                    streams[m] = iter(())  # absent tar: the column stays, every value None
                    continue
                raise IngestError(f"shard {shard.path}: missing {m} tar {url}") from None
            offset = 0
            if opts.align == "strict" and m != driver and m in opts.optional:
                # An optional modality may lack samples, so member ``start`` is not sample
                # ``start``: read from the top and drop the members of samples passed over.
                passed_set = frozenset(skip_keys)
                streams[m] = (x for x in iter_members(f, url, max_member_bytes=limit)
                              if x.key not in passed_set)
                continue
            if opts.align == "strict" or (opts.align == "merge" and m == driver):
                offset, passed = _position(f, url, start, opts)
                if m == driver:
                    skip_keys = passed
            elif opts.align in ("merge", "index"):
                tar_keys = _known_keys(f, url, opts)
                if tar_keys is not None:
                    known[m] = tar_keys
            streams[m] = iter_members(f, url, start_offset=offset, max_member_bytes=limit)
        if opts.align == "index":
            keys = index_keys
            if keys is None:
                if opts.index_path is None and shard.sample_keys_full_list is None:
                    raise IngestError(f"shard {shard.path}: align='index' needs an index file")
                keys = load_index_keys(opts.index_path or shard.sample_keys_full_list, shard.path,
                                       opts.storage_options)
            gen = expand(shard.path, streams, align="index", optional=opts.optional,
                         index_keys=keys, first_index=start, limit=count, stats=stats,
                         read_ahead=opts.read_ahead, on_error=on_error, known_keys=known)
        else:
            gen = expand(shard.path, streams, align=opts.align, optional=opts.optional,
                         first_index=start, limit=count, skip_keys=skip_keys, stats=stats,
                         read_ahead=opts.read_ahead, on_error=on_error, known_keys=known)
        yield from gen
