"""The catalog's columns: Arrow string arrays built from buffers, read-only count arrays.

Built without ``pa.array`` on Python objects (which imports pandas, ~0.4 s): a million-shard
catalog is a handful of buffers, cheap to build and to pickle. No Ray, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)


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
