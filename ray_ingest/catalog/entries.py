"""What a ``data_list`` entry may be: a plain relative tar path, listed once.

Every entry is joined as ``<root>/<modality>/<entry>`` and opened through fsspec, so an entry
is refused, with one line naming the wdinfo, the index and the entry, when it

* could leave the root: absolute, a ``..`` part, a NUL byte (:mod:`ray_ingest.twintar.safepath`);
* is not a path but a URL or an fsspec chain: a scheme (``file:``, ``gs://``), ``://`` or
  ``::`` anywhere (fsspec would read it as a protocol: ``Protocol not known``);
* holds a control character (U+0000-U+001F, U+007F-U+009F) or a backslash (paths use ``/``;
  a backslash is a separator on Windows and an escape to many tools);
* is longer than :data:`MAX_ENTRY_BYTES` bytes (UTF-8), or one of its ``/``-separated parts
  longer than :data:`MAX_PART_BYTES` (a file name no filesystem takes);
* names nothing but the root (``.``, ``./``);
* names the same tar as an earlier entry, once ``.`` parts, empty parts and a trailing ``/``
  are left out (``a/b.tar``, ``./a/b.tar``, ``a//b.tar``): a shard is listed once. Read twice,
  it would be trained on twice per epoch and its read offsets, which the read state keeps per
  shard path, would mix.

(An empty entry is refused by the wdinfo parser itself.) The checks are vectorised over the
Arrow buffers of the entries (10M entries: well under a second when the list is written sorted,
as the sharders write it). No Ray, no torch.
"""

from __future__ import annotations

import posixpath
import re

import numpy as np
import pyarrow as pa

from ray_ingest.catalog.arrays import _offsets
from ray_ingest.errors import CatalogError, UnsafePathError
from ray_ingest.twintar.safepath import first_unsafe_path, name_problem

__all__ = ["MAX_ENTRY_BYTES", "MAX_PART_BYTES", "check_entries", "entry_problem"]

#: Longest entry taken, in UTF-8 bytes (object stores cap whole names at 1024 bytes).
MAX_ENTRY_BYTES = 1024
#: Longest ``/``-separated part of an entry (NAME_MAX of common filesystems).
MAX_PART_BYTES = 255
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:")
_CHUNK_BYTES = 1 << 24  # bytes handled at a time by the duplicate check (bounded scratch)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def entry_problem(entry: str) -> str | None:
    """Why ``entry`` is not a plain relative tar path (see the module doc), or None (a
    duplicate is a property of the list: :func:`check_entries`)."""
    problem = name_problem(entry)
    if problem is not None:
        return problem
    bad = next((c for c in entry if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F), None)
    if bad is not None:
        return f"a control character (U+{ord(bad):04X})"
    if "\\" in entry:
        return "a backslash (parts are separated by '/')"
    if "://" in entry or "::" in entry or _SCHEME.match(entry):
        return ("a URL scheme or fsspec chain: entries are paths relative to "
                "<root>/<modality>/, not URLs")
    size = len(entry.encode("utf-8", "surrogatepass"))
    if size > MAX_ENTRY_BYTES:
        return f"{size} bytes long, over the limit of {MAX_ENTRY_BYTES}"
    part = max(entry.split("/"), key=lambda p: len(p.encode("utf-8", "surrogatepass")))
    size = len(part.encode("utf-8", "surrogatepass"))
    if size > MAX_PART_BYTES:
        return f"a part of {size} bytes, over the limit of {MAX_PART_BYTES}"
    if _normal(entry) == ".":
        return "no file name (it names the folder itself)"
    return None


def check_entries(url: str, paths: pa.Array) -> None:
    """Refuse the first bad ``data_list`` entry of ``url`` (a string array), else return.

    Raises:
        UnsafePathError: ``<url>: field 'data_list[i]': unsafe path '<entry>': <why>; refused``
            (the entry could leave the root, or is not a plain path).
        CatalogError: ``<url>: field 'data_list[j]': '<entry>' names the same tar as
            data_list[i] ('<earlier>'); every shard is listed once; refused``.
    """
    offsets = _offsets(paths)
    data = paths.buffers()[2]
    if len(paths) == 0 or data is None:
        return
    view = np.frombuffer(data, dtype=np.uint8)
    where = f"{url}: field 'data_list[{{}}]'"
    empty = np.flatnonzero(np.diff(offsets) == 0)
    if empty.size:  # (the parsers refuse these first, in the same words)
        raise CatalogError(f"{where.format(int(empty[0]))} must be a non-empty string, got ''")
    bad = first_unsafe_path(data, offsets)  # absolute or climbing with ".."
    other = _first_problem(paths, view, offsets)
    if bad is None or (other is not None and other < bad):
        bad = other
    if bad is not None:
        entry = paths[bad].as_py()
        raise UnsafePathError(f"{where.format(bad)}: unsafe path {_shown(entry)}: "
                              f"{entry_problem(entry)}; refused")
    dup = _first_duplicate(paths, view, offsets)
    if dup is not None:
        first, again = dup
        raise CatalogError(
            f"{where.format(again)}: {paths[again].as_py()!r} names the same tar as "
            f"data_list[{first}] ({paths[first].as_py()!r}); every shard is listed once; "
            f"refused")


def _first_problem(paths: pa.Array, view: np.ndarray, offsets: np.ndarray) -> int | None:
    """Index of the first entry with an :func:`entry_problem`: entries over a length limit,
    ending in ``.`` or ``/``, or holding a suspect byte are checked one by one."""
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    base = int(offsets[0])
    last = view[offsets[1:] - 1]  # (entries are not empty: see check_entries)
    cands = [np.flatnonzero(lengths > MAX_PART_BYTES),
             np.flatnonzero((last == 0x2E) | (last == 0x2F))]
    found: int | None = None
    for s in range(base, int(offsets[-1]), _CHUNK_BYTES):
        hits = np.flatnonzero(_suspect(view[s:min(s + _CHUNK_BYTES, int(offsets[-1]))]))
        for i in np.unique(np.searchsorted(offsets, hits + s, side="right") - 1).tolist():
            if 0 <= i < n and entry_problem(paths[i].as_py()) is not None:
                found = i
                break
        if found is not None:
            break
    for i in np.unique(np.concatenate(cands)).tolist():
        if found is not None and i >= found:
            break
        if entry_problem(paths[i].as_py()) is not None:
            found = i
            break
    return found


def _shown(entry: str) -> str:
    """``repr(entry)``, cut short past 200 characters (an error stays one readable line)."""
    return repr(entry) if len(entry) <= 200 else f"{entry[:100]!r}... ({len(entry)} characters)"


def _suspect(chunk: np.ndarray) -> np.ndarray:
    """Bytes that may start a problem other than ``..``/absolute/NUL (each entry holding one is
    then checked as a name): control characters, backslash, ``:``, 0xC2 (which starts C1)."""
    mask = chunk < 0x20
    for byte in (0x7F, 0x5C, 0x3A, 0xC2):
        mask |= chunk == byte
    return mask


def _normal(entry: str) -> str:
    """The tar an entry names, as a path: ``.`` parts, empty parts and a trailing ``/`` left
    out (never ``..``: those entries are refused before)."""
    return posixpath.normpath(entry) if entry else entry


def _first_duplicate(paths: pa.Array, view: np.ndarray,
                     offsets: np.ndarray) -> tuple[int, int] | None:
    """``(i, j)``, ``i < j``, with entry ``j`` the first naming the same tar as an earlier
    entry ``i``; None when every entry is distinct."""
    n = len(offsets) - 1
    if n < 2:
        return None
    base, end = int(offsets[0]), int(offsets[-1])
    lengths = np.diff(offsets)
    trailing = view[offsets[1:] - 1] == 0x2F
    if trailing.any() or _has_empty_or_dot_part(view, base, end):
        return _first_equal([_normal(p) for p in paths.to_pylist()])  # rare: the slow way
    if (lengths == lengths[0]).all() and _strictly_increasing(view, base, n, int(lengths[0])):
        return None  # the sharders' lists: sorted, hence distinct
    hashes = _hashes(view, offsets, lengths)
    order = np.argsort(hashes, kind="stable")
    ranked = hashes[order]
    same = np.flatnonzero(ranked[1:] == ranked[:-1])
    if same.size == 0:
        return None
    cand = np.unique(np.concatenate([order[same], order[same + 1]]))
    groups = _first_equal([paths[int(i)].as_py() for i in cand])
    return None if groups is None else (int(cand[groups[0]]), int(cand[groups[1]]))


def _has_empty_or_dot_part(view: np.ndarray, base: int, end: int) -> bool:
    """Whether ``//`` or ``./`` occurs in ``view[base:end]`` (entries that normalise; a hit
    that straddles two entries only costs the slow, exact check)."""
    for s in range(base, end - 1, _CHUNK_BYTES):
        a = view[s:min(s + _CHUNK_BYTES, end - 1)]
        b = view[s + 1:s + 1 + len(a)]
        if ((b == 0x2F) & ((a == 0x2F) | (a == 0x2E))).any():
            return True
    return False


def _first_equal(values: list[str]) -> tuple[int, int] | None:
    seen: dict[str, int] = {}
    for j, v in enumerate(values):
        i = seen.setdefault(v, j)
        if i != j:
            return i, j
    return None


def _strictly_increasing(view: np.ndarray, base: int, n: int, length: int) -> bool:
    """Whether ``n`` entries of ``length`` bytes each, back to back from ``base``, are in
    strictly increasing byte order."""
    if length == 0:
        return False
    rows = view[base:base + n * length].reshape(n, length)
    step = max(1, _CHUNK_BYTES // length)
    for s in range(0, n - 1, step):
        a, b = rows[s:min(s + step, n - 1)], rows[s + 1:min(s + step, n - 1) + 1]
        differ = a != b
        first = differ.argmax(axis=1)
        pick = np.arange(len(a))
        if not (differ[pick, first].all() and (a[pick, first] < b[pick, first]).all()):
            return False
    return True


def _hashes(view: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A 64-bit hash per entry (equal entries, equal hashes; collisions are checked exactly
    by the caller). Entries are grouped by length (at most :data:`MAX_ENTRY_BYTES`) and hashed
    a block of rows at a time, 8 bytes per step."""
    n = len(lengths)
    out = np.empty(n, dtype=np.uint64)
    by_length = np.argsort(lengths.astype(np.uint16), kind="stable")  # a radix sort
    sorted_lengths = lengths[by_length]
    cuts = np.flatnonzero(np.diff(sorted_lengths)) + 1
    for group in np.split(by_length, cuts):
        length = int(lengths[group[0]])
        width = -(-length // 8) * 8
        step = max(1, _CHUNK_BYTES // max(width, 1))
        for s in range(0, len(group), step):
            idx = group[s:s + step]
            rows = np.zeros((len(idx), width), dtype=np.uint8)
            rows[:, :length] = view[offsets[idx][:, None] + np.arange(length)]
            words = rows.view(np.uint64)
            h = np.full(len(idx), (length * int(_MIX)) % 2**64, dtype=np.uint64)
            for k in range(words.shape[1]):
                h ^= words[:, k]
                h *= _MIX
                h ^= h >> np.uint64(29)
            out[idx] = h
    return out
