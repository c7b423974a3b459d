"""Writing twin-tar datasets: one tar per modality per shard, a key index beside each tar,
and one ``wdinfo.json`` per leaf folder.

Layout written (the one :mod:`ray_ingest.catalog` reads)::

    <leaf>/<modality>/<rel_path>            one tar per modality, members ``<key>.<ext>``
    <leaf>/<modality>/<rel_path>.idx.json   key index (names, header offsets, sizes, tar size)
    <leaf>/wdinfo.json                      data_list, counts, chunk_size, data_keys, root "."

Every modality's tar of a shard holds the same keys in the same order, so strict alignment
always succeeds on what this module writes. Headers are written here (POSIX ustar/pax via
``tarfile.TarInfo.tobuf``) with fixed metadata (mtime 0, uid/gid 0, mode 0644), so the same
input gives byte-identical tars. All output goes through fsspec.

Crash safety: a tar (and its key index) is written under ``<name>.partial`` and renamed to its
final name only when complete, so a crashed or aborted write never leaves a partial tar under a
final name. :func:`existing_shard` tells a re-run which shards are already complete.

No Ray, no torch.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import sys
import tarfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import attrs
import fsspec

from ray_ingest.catalog import WDINFO_NAME, join_url
from ray_ingest.errors import ConfigError, IngestError, TarFormatError
from ray_ingest.safepath import check_folder_name, check_member_name, check_rel_path, name_problem
from ray_ingest.tario import BLOCK, TarIndex, index_url, split_name

log = logging.getLogger(__name__)

#: Aspect-ratio buckets (width, height), in PiD's tie-breaking order (the first wins a tie).
ASPECT_RATIOS: tuple[tuple[int, int], ...] = (
    (21, 9), (16, 9), (3, 2), (4, 3), (1, 1), (3, 4), (2, 3), (9, 16),
)
#: Folder prefix of an aspect-ratio bucket (``aspect_ratio_16_9``).
BUCKET_PREFIX = "aspect_ratio_"
#: Tars are padded to a multiple of this, like ``tarfile`` and GNU tar do.
RECORD_SIZE = tarfile.RECORDSIZE
#: Fixed member metadata: byte-identical output for identical input.
_MTIME = 0
_MODE = 0o644
#: Suffix of a file being written; renamed away when the file is complete.
PARTIAL_SUFFIX = ".partial"

#: One sample as handed to the writer: modality -> (extension, payload).
Members = Mapping[str, tuple[str, bytes]]


# --------------------------------------------------------------------------- layout helpers


def aspect_bucket(width: int, height: int,
                  ratios: Sequence[tuple[int, int]] = ASPECT_RATIOS) -> str:
    """Nearest bucket (``"16_9"``) by ``|log(w/h) - log(W/H)|``; the first wins a tie."""
    if width <= 0 or height <= 0:
        raise ConfigError(f"image size: expected positive width and height, got {width}x{height}")
    r = math.log(width / height)
    best = min(range(len(ratios)),
               key=lambda i: (abs(r - math.log(ratios[i][0] / ratios[i][1])), i))
    w, h = ratios[best]
    return f"{w}_{h}"


def bucket_dir(bucket: str) -> str:
    """Folder name of a bucket: ``aspect_ratio_16_9``."""
    return f"{BUCKET_PREFIX}{bucket}"


def shard_rel_path(shard_id: int, part_size: int = 1000) -> str:
    """``part_{id // part_size:06d}/{id:06d}.tar``, or ``{id:08d}.tar`` when part_size is 0."""
    if shard_id < 0:
        raise ConfigError(f"shard id: expected >= 0, got {shard_id}")
    if part_size < 0:
        raise ConfigError(f"part_size: expected >= 0, got {part_size}")
    if part_size == 0:
        return f"{shard_id:08d}.tar"
    return f"part_{shard_id // part_size:06d}/{shard_id:06d}.tar"


def check_key(key: str) -> None:
    """Reject keys that readers would see differently (see :func:`ray_ingest.tario.split_name`)."""
    parsed = split_name(f"{key}.x") if isinstance(key, str) else None
    if parsed is None or parsed[0] != key or "." in key or name_problem(key) is not None:
        raise ConfigError(
            f"sample key: expected a non-empty name without '.' that is not a __metadata__ "
            f"entry, an absolute path or holds a NUL byte, got {key!r}"
        )


def _open_write(url: str, storage_options: Mapping[str, Any] | None) -> BinaryIO:
    """Open ``url`` for writing through fsspec, creating its parent folder first."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    return fs.open(path, "wb")


def partial_url(url: str) -> str:
    """Temporary name ``url`` is written under until it is complete."""
    return url + PARTIAL_SUFFIX


def _fs_path(url: str, storage_options: Mapping[str, Any] | None
             ) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def rename_file(src: str, dst: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Move ``src`` over ``dst``: an atomic replace on a local disk; on object stores a
    server-side copy then a delete (the object appears only once the copy is complete).

    NOTE: not ``fs.mv`` there: gcsfs tries the ``moveTo`` API first, which emulators lack (its
    retries then stall for minutes before the copy fallback).
    """
    fs, src_path = _fs_path(src, storage_options)
    dst_path = _fs_path(dst, storage_options)[1]
    protocol = fs.protocol[0] if isinstance(fs.protocol, (list, tuple)) else fs.protocol
    if protocol in ("file", "local"):
        fs.mv(src_path, dst_path)
        return
    fs.copy(src_path, dst_path)
    fs.rm(src_path)


def _remove(url: str, storage_options: Mapping[str, Any] | None) -> None:
    fs, path = _fs_path(url, storage_options)
    if fs.exists(path):
        fs.rm(path)


def write_file_atomic(url: str, data: bytes,
                      storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``data`` to ``<url>.partial``, then rename it to ``url``."""
    tmp = partial_url(url)
    with _open_write(tmp, storage_options) as f:
        f.write(data)
    rename_file(tmp, url, storage_options)


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = _MTIME
    info.mode = _MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")


def _padding(size: int) -> bytes:
    return b"\0" * ((-size) % BLOCK)


# --------------------------------------------------------------------------- one shard


@attrs.frozen
class ShardInfo:
    """What :class:`ShardWriter` wrote for one shard."""

    #: Relative tar path, as listed in ``data_list`` (``part_000000/000000.tar``).
    path: str
    #: Samples written (members per modality tar).
    count: int
    #: Tar size in bytes, per modality.
    bytes: dict[str, int]
    #: Leaf folder URL the shard lives under.
    leaf: str = ""


class _TarStream:
    """One open output tar: writes headers and payloads, remembers the index."""

    def __init__(self, url: str, f: BinaryIO, target: str | None = None):
        self.url = url
        #: Where the bytes go (``url`` itself, or its ``.partial`` name).
        self.target = target or url
        self.f = f
        self.pos = 0
        self.names: list[str] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []

    def add(self, name: str, data: bytes) -> None:
        header = _tar_header(name, len(data))
        self.offsets.append(self.pos)
        self.names.append(name)
        self.sizes.append(len(data))
        self.f.write(header)
        self.f.write(data)
        pad = _padding(len(data))
        self.f.write(pad)
        self.pos += len(header) + len(data) + len(pad)

    def finish(self) -> TarIndex:
        end = self.pos + 2 * BLOCK
        end += (-end) % RECORD_SIZE
        self.f.write(b"\0" * (end - self.pos))
        self.pos = end
        self.f.close()
        return TarIndex(self.names, self.offsets, self.sizes, self.pos)


class ShardWriter:
    """Write one twin shard: ``<leaf>/<modality>/<path>`` for every modality, plus key indexes.

    Use as a context manager (files are opened on entry, finished on a clean exit and removed
    when the block raises)::

        with ShardWriter(leaf, "part_000000/000000.tar", ["image", "caption"]) as w:
            w.add("id_0", {"image": ("jpg", jpeg), "caption": ("json", text)})
        info = w.info

    Args:
        leaf: dataset leaf folder URL (where ``wdinfo.json`` goes).
        path: relative tar path inside each modality folder.
        modalities: modality folder names; every sample must supply each of them.
        storage_options: fsspec options for the output filesystem.
        write_index: also write ``<tar>.idx.json`` per modality.
        atomic: write every tar under ``<name>.partial`` and rename it when the shard is
            complete (``close``): the final names never hold a partial tar, and an existing
            tar (an in-place rewrite) stays intact until its replacement is complete. Abort
            removes only the partial files.
    """

    def __init__(
        self,
        leaf: str,
        path: str,
        modalities: Sequence[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        write_index: bool = True,
        atomic: bool = True,
    ):
        if not modalities:
            raise ConfigError("modalities: expected at least one, got none")
        if len(set(modalities)) != len(modalities):
            raise ConfigError(f"modalities: expected distinct names, got {list(modalities)}")
        if not path.endswith(".tar") or path.startswith("/"):
            raise ConfigError(f"shard path: expected a relative '*.tar' path, got {path!r}")
        check_rel_path(f"shard {path}", path)  # never a tar outside <leaf>/<modality>/
        for m in modalities:
            check_folder_name(f"shard {path}: modality", m)
        self.leaf = leaf
        self.path = path
        self.modalities = tuple(modalities)
        self.storage_options = dict(storage_options or {})
        self.write_index = write_index
        self.atomic = atomic
        self._streams: dict[str, _TarStream] = {}
        self._keys: set[str] = set()
        self._info: ShardInfo | None = None

    def url(self, modality: str) -> str:
        """Output URL of this shard's tar for ``modality``."""
        return join_url(self.leaf, modality, self.path)

    def open(self) -> ShardWriter:
        if self._streams or self._info is not None:
            raise ConfigError(f"shard {self.path}: writer already opened")
        try:
            for m in self.modalities:
                url = self.url(m)
                target = partial_url(url) if self.atomic else url
                try:
                    f = _open_write(target, self.storage_options)
                except OSError as exc:
                    raise IngestError(f"shard {self.path}: cannot create {target}: "
                                      f"{type(exc).__name__}: {exc}") from None
                self._streams[m] = _TarStream(url, f, target)
        except BaseException:
            self.abort()
            raise
        return self

    def add(self, key: str, members: Members, *,
            member_names: Mapping[str, str] | None = None) -> None:
        """Append one sample; ``members`` maps every modality to ``(ext, payload)``.

        ``member_names`` optionally gives a modality's member name (default ``<key>.<ext>``);
        a reader must derive ``key`` and ``ext`` from it (``a.b.npy`` is key ``a-b``), so
        rewriting a tar can keep its member names.
        """
        if not self._streams:
            raise ConfigError(f"shard {self.path}: writer is not open")
        if isinstance(key, str):
            check_member_name(f"shard {self.path}: sample key", key)
        check_key(key)
        if key in self._keys:
            raise ConfigError(f"shard {self.path}: duplicate sample key {key!r}")
        lacking = [m for m in self.modalities if m not in members]
        unknown = [m for m in members if m not in self._streams]
        if lacking or unknown:
            raise ConfigError(
                f"shard {self.path}: sample {key!r} must supply exactly the modalities "
                f"{list(self.modalities)}, lacks {lacking}, has unknown {unknown}"
            )
        names = {}
        for m in self.modalities:
            ext, data = members[m]
            ext = ext.lstrip(".")
            if not ext or "/" in ext or "." in ext:
                raise ConfigError(
                    f"sample {key!r}: {m} extension must be a plain suffix, got {ext!r}")
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise ConfigError(
                    f"sample {key!r}: {m} payload must be bytes, got {type(data).__name__}"
                )
            name = (member_names or {}).get(m, f"{key}.{ext}")
            if name != f"{key}.{ext}" and split_name(name) != (key, ext.lower()):
                raise ConfigError(
                    f"sample {key!r}: {m} member name {name!r} does not give key {key!r} "
                    f"and extension {ext!r}"
                )
            check_member_name(f"shard {self.path}", name)
            names[m] = name
        self._keys.add(key)
        for m in self.modalities:
            self._streams[m].add(names[m], bytes(members[m][1]))

    def close(self) -> ShardInfo:
        """Finish every tar (end blocks, record padding), write the indexes, return the info."""
        if self._info is not None:
            return self._info
        if not self._streams:
            raise ConfigError(f"shard {self.path}: writer is not open")
        sizes: dict[str, int] = {}
        indexes: dict[str, TarIndex] = {}
        try:
            for m, stream in self._streams.items():
                indexes[m] = stream.finish()
                sizes[m] = indexes[m].tar_size
        except BaseException:
            self.abort()
            raise
        for m, stream in self._streams.items():
            so = self.storage_options
            if self.atomic:
                # A stale index must never describe the new tar: drop it before the rename.
                _remove(index_url(stream.url), so)
                rename_file(stream.target, stream.url, so)
            if self.write_index:
                write_file_atomic(index_url(stream.url), indexes[m].dumps().encode(), so)
        self._info = ShardInfo(path=self.path, count=len(self._keys), bytes=sizes, leaf=self.leaf)
        self._streams = {}
        return self._info

    def abort(self) -> None:
        """Close and delete whatever was written (best effort). With ``atomic`` only the
        ``.partial`` files are removed: a tar under its final name is never touched."""
        for stream in self._streams.values():
            try:
                stream.f.close()
                _remove(stream.target, self.storage_options)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                log.warning("could not remove partial tar %s", stream.target)
        self._streams = {}

    @property
    def info(self) -> ShardInfo:
        if self._info is None:
            raise ConfigError(f"shard {self.path}: writer not closed yet")
        return self._info

    def __enter__(self) -> ShardWriter:
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def existing_shard(
    leaf: str,
    path: str,
    expected: Mapping[str, Sequence[tuple[str, int]]],
    storage_options: Mapping[str, Any] | None = None,
) -> ShardInfo | None:
    """The info of a shard already written with exactly the ``expected`` members, else None.

    ``expected`` maps each modality to its ``(member name, payload size)`` list, in order. A
    shard counts as written when every modality's key index lists those members and its tar
    has the size the index recorded: :class:`ShardWriter` renames the tar before writing the
    index, so that only holds once the whole tar is in place. Used to resume a write without
    rewriting finished shards.
    """
    sizes: dict[str, int] = {}
    count = None
    for m, members in expected.items():
        url = join_url(leaf, m, path)
        fs, tar_path = _fs_path(url, storage_options)
        try:
            with fs.open(_fs_path(index_url(url), storage_options)[1], "rb") as f:
                idx = TarIndex.from_dict(json.loads(f.read()), index_url(url))
            tar_size = fs.size(tar_path)
        except (FileNotFoundError, ValueError, TarFormatError):
            return None
        if (tar_size != idx.tar_size or list(idx.names) != [n for n, _ in members]
                or list(idx.sizes) != [n for _, n in members]):
            return None
        sizes[m] = int(tar_size)
        count = len(members)
    if count is None:
        return None
    return ShardInfo(path=path, count=count, bytes=sizes, leaf=leaf)


def write_shard(
    leaf: str,
    path: str,
    modalities: Sequence[str],
    samples: Iterable[tuple[str, Members]],
    storage_options: Mapping[str, Any] | None = None,
) -> ShardInfo:
    """Write ``samples`` (``(key, members)`` pairs) as one twin shard; see :class:`ShardWriter`."""
    with ShardWriter(leaf, path, modalities, storage_options=storage_options) as w:
        for key, members in samples:
            w.add(key, members)
    return w.info


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
