"""Test helpers: write (deliberately imperfect) twin tars and wdinfo files.

Unlike :class:`ray_ingest.twintar.writer.ShardWriter`, these helpers write whatever member list they
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

import numpy as np
from PIL import Image

from ray_ingest.twintar.tario import (
    build_index,
    index_url,
)

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


# --------------------------------------------------------------------------- raw folders

#: (stem, width, height) of the clean samples; the bucket each must land in.
RAW_SIZES = [("s00", 160, 90, "16_9"), ("s01", 100, 100, "1_1"), ("s02", 90, 160, "9_16"),
             ("s03", 210, 90, "21_9"), ("s04", 120, 80, "3_2"), ("s05", 120, 90, "4_3"),
             ("s06", 90, 120, "3_4"), ("s07", 80, 120, "2_3"), ("s08", 64, 64, "1_1"),
             ("s09", 300, 170, "16_9")]


def _jpeg(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def write_raw_folders(root: Path, extra_anomalies: bool = True) -> Path:
    """Input for ``ray-ingest shard``: image/ caption/ umt5/ with the :data:`RAW_SIZES`
    samples, plus (``extra_anomalies``) files every drop reason applies to."""
    for d in ("image", "caption", "umt5"):
        (root / d).mkdir(parents=True)
    for i, (stem, w, h, _) in enumerate(RAW_SIZES):
        ext = "png" if i == 3 else "jpg"
        if ext == "png":
            buf = io.BytesIO()
            Image.new("RGB", (w, h), (i, 2 * i, 3 * i)).save(buf, "PNG")
            (root / "image" / f"{stem}.{ext}").write_bytes(buf.getvalue())
        else:
            (root / "image" / f"{stem}.{ext}").write_bytes(_jpeg(w, h, i))
        (root / "caption" / f"{stem}.json").write_text(json.dumps({"prompt": f"sample {i}"}))
        arr = np.full((i + 1, 4), i, dtype=np.float16)
        with open(root / "umt5" / f"{stem}.npy", "wb") as f:
            np.save(f, arr)
    if extra_anomalies:
        (root / "image" / "lonely.jpg").write_bytes(_jpeg(10, 10, 99))   # image only
        (root / "caption" / "lonely2.json").write_text("{}")             # caption only
        (root / "caption" / ".DS_Store").write_text("x")                 # hidden
        (root / "umt5" / "README").write_text("x")                       # no extension
        for d, ext in (("image", "jpg"), ("caption", "json"), ("umt5", "npy")):
            (root / d / f"dup.{ext}").write_bytes(b"1")
        (root / "umt5" / "dup.pkl").write_bytes(b"2")                     # ambiguous stem
        for stem in ("c.d", "c-d"):                                       # keys collide
            for d, ext in (("image", "jpg"), ("caption", "json"), ("umt5", "npy")):
                (root / d / f"{stem}.{ext}").write_bytes(b"3")
        for d, ext in (("image", "jpg"), ("caption", "json")):
            (root / d / f"broken.{ext}").write_bytes(b"4")
        os.symlink(root / "nowhere", root / "umt5" / "broken.npy")        # a link: never read
        (root / "notes.txt").write_text("top-level files are ignored")
        (root / "image" / "subdir").mkdir()                               # ignored
    return root
