"""Test helpers: write (deliberately imperfect) twin tars and wdinfo files.

Unlike :class:`ray_ingest.writer.ShardWriter`, these helpers write whatever member list they
are given — duplicates, extras, gaps, any order — with ``tarfile``, so tests can build the
broken inputs the readers must cope with.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from ray_ingest.tario import build_index, index_url

#: Default member extension per modality.
EXT = {"image": "jpg", "caption": "json", "umt5": "npy"}


def payload(modality: str, name: str, occurrence: int = 0) -> bytes:
    """Recognisable member bytes: which modality, which member, which copy."""
    return f"{modality}:{name}:{occurrence}".encode()


def parse_payload(data: bytes) -> tuple[str, str, int]:
    modality, name, occurrence = data.decode().rsplit(":", 2)
    return modality, name, int(occurrence)


def tar_bytes(members: Sequence[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar (via ``tarfile``) holding ``members`` in order; names may repeat."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_tar(path: str | os.PathLike, members: Sequence[tuple[str, bytes]],
              *, index: bool = False, fmt: int = tarfile.PAX_FORMAT) -> Path:
    """Write a tar at ``path`` (parents created); with ``index``, its ``.idx.json`` too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = tar_bytes(members, fmt)
    path.write_bytes(data)
    if index:
        with open(path, "rb") as f:
            idx = build_index(f, str(path), tar_size=len(data))
        Path(index_url(str(path))).write_text(idx.dumps())
    return path


def member_name(modality: str, entry: str) -> str:
    """A bare key gets the modality's default extension; a name with a dot is kept."""
    return entry if "." in entry else f"{entry}.{EXT.get(modality, 'bin')}"


def write_twin(
    root: str | os.PathLike,
    shards: Mapping[str, Mapping[str, Sequence[str]]],
    *,
    index: bool = False,
    data_keys: Sequence[str] | None = None,
    counts: Sequence[int] | None = None,
    wdinfo: bool = True,
    chunk_size: int | None = None,
) -> Path:
    """Write twin tars and a wdinfo.json; return the wdinfo path (or root without one).

    Args:
        root: dataset leaf folder.
        shards: ``rel_path -> modality -> member keys/names`` (in tar order; repeats allowed).
            Member payloads are :func:`payload` with the occurrence number of that name.
        index: also write each tar's ``.idx.json``.
        data_keys: modalities listed in wdinfo (default: the first shard's, in order).
        counts: ``data_list_key_count`` (default: the first modality's member count).
        wdinfo: write ``wdinfo.json``.
        chunk_size: value to write (default: omitted, PiD style).
    """
    root = Path(root)
    data_list = list(shards)
    keys = list(data_keys) if data_keys is not None else list(next(iter(shards.values())))
    auto_counts = []
    for rel, per_modality in shards.items():
        for modality, entries in per_modality.items():
            seen: dict[str, int] = {}
            members = []
            for entry in entries:
                name = member_name(modality, entry)
                occurrence = seen.get(name, 0)
                seen[name] = occurrence + 1
                members.append((name, payload(modality, name, occurrence)))
            write_tar(root / modality / rel, members, index=index)
        auto_counts.append(len(per_modality.get(keys[0], ())))
    if not wdinfo:
        return root
    doc: dict = {
        "data_list": data_list,
        "data_list_key_count": list(counts) if counts is not None else auto_counts,
        "total_key_count": sum(counts) if counts is not None else sum(auto_counts),
        "data_keys": keys,
        "root": ".",
    }
    if chunk_size is not None:
        doc["chunk_size"] = chunk_size
    path = root / "wdinfo.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def write_json(path: str | os.PathLike, doc: object) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path
