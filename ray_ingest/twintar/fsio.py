"""URLs and atomic writes over fsspec (local paths, ``gs://``, ``memory://``).

Joining URLs without mangling ``scheme://``, comparing places, and writing files so that a
reader sees the old file or the new one, never half (a rename locally, one object write on
object stores). No Ray, no torch.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Mapping
from typing import Any, BinaryIO

import fsspec

log = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------- roots


def same_place(a: str, b: str) -> bool:
    """Whether two folder URLs name the same place (local paths compared resolved)."""
    if a.rstrip("/") == b.rstrip("/"):
        return True
    if "://" in a or "://" in b:
        return False
    return os.path.realpath(a) == os.path.realpath(b)


#: Suffix of a file being written; renamed away when the file is complete.
PARTIAL_SUFFIX = ".partial"


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
