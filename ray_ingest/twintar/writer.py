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
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, BinaryIO

import attrs

from ray_ingest.errors import ConfigError, IngestError, TarFormatError
from ray_ingest.twintar.fsio import (
    _fs_path,
    _open_write,
    _remove,
    join_url,
    partial_url,
    rename_file,
    write_file_atomic,
)
from ray_ingest.twintar.layout import check_key
from ray_ingest.twintar.safepath import (
    check_folder_name,
    check_member_name,
    check_rel_path,
)
from ray_ingest.twintar.tario import BLOCK, TarIndex, index_url, split_name

log = logging.getLogger(__name__)


#: Tars are padded to a multiple of this, like ``tarfile`` and GNU tar do.
RECORD_SIZE = tarfile.RECORDSIZE
#: Fixed member metadata: byte-identical output for identical input.
_MTIME = 0
_MODE = 0o644

#: One sample as handed to the writer: modality -> (extension, payload).
Members = Mapping[str, tuple[str, bytes]]


def check_shard_path(path: str) -> None:
    """Refuse a shard path that is not a relative ``*.tar`` inside its modality folder.

    :class:`ShardWriter` checks it; so does ``write_twin_tars`` on every row before any shard
    is written, so that a hostile row leaves no write task behind.
    """
    if not isinstance(path, str) or not path.endswith(".tar") or path.startswith("/"):
        raise ConfigError(f"shard path: expected a relative '*.tar' path, got {path!r}")
    check_rel_path(f"shard {path}", path)  # never a tar outside <leaf>/<modality>/


def check_sample_key(path: str, key: str) -> None:
    """Refuse a sample key that is an unsafe member name or that readers would see differently
    (``path``: the shard, for the error)."""
    if isinstance(key, str):
        check_member_name(f"shard {path}: sample key", key)
    check_key(key)


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
        check_shard_path(path)
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
        check_sample_key(self.path, key)
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
