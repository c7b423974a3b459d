"""One shard of a twin-tar dataset, and the per-dataset options shards share.

A :class:`Shard` names one shard (its ``data_list`` path, the root its modality folders
live under, its modalities and aspect bucket); the catalog makes them only when a shard is
touched. Also here: the root modes and the log-once notice the catalog's modules share.
No Ray, no torch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from ray_ingest.errors import CatalogError
from ray_ingest.redact import options_repr
from ray_ingest.twintar.fsio import join_url

log = logging.getLogger(__name__)


DEFAULT_MODALITIES = ("image", "caption")
#: How a shard's tars are found: ``wdinfo`` uses the wdinfo's ``root`` verbatim (PiD's rule),
#: ``folder`` the folder holding the wdinfo (a moved or copied dataset).
ROOT_MODES = ("wdinfo", "folder")


# --------------------------------------------------------------------------- small helpers



_NOTICED: set[tuple[Any, ...]] = set()
_NOTICE_LOCK = threading.Lock()


def _notice(key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
    """Log ``msg`` once per process for ``key`` (not per shard, rank or epoch)."""
    with _NOTICE_LOCK:
        if key in _NOTICED:
            return
        _NOTICED.add(key)
    log.log(level, msg, *args)


def _dict_or_empty(value: dict[str, Any] | None) -> dict[str, Any]:
    return {} if value is None else value


def _tuple_of_str(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


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


# --------------------------------------------------------------------------- shard objects


@attrs.frozen
class DatasetInfo:
    """One logical data source (PiD's ``DatasetInfo``): wdinfo files plus per-source options."""

    #: wdinfo.json URLs or folders searched recursively for them.
    wdinfo: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    #: Free-form per-dataset options (e.g. ``aspect_ratio``).
    opts: dict[str, Any] = attrs.field(factory=dict, converter=_dict_or_empty)
    #: Modality folders for this dataset; empty means the reader's modalities.
    per_dataset_modalities: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    #: Human-readable source name.
    source: str = ""
    #: fsspec storage options (PiD: object_store_config); redacted in its repr.
    object_store_config: dict[str, Any] = attrs.field(factory=dict, converter=_dict_or_empty,
                                                      repr=options_repr)

    @wdinfo.validator
    def _check_wdinfo(self, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise CatalogError("DatasetInfo.wdinfo: expected at least one path, got none")


@attrs.frozen
class Shard:
    """One twin shard: the same relative ``path`` exists under ``root/<m>/`` for every modality."""

    #: Relative tar path as listed in ``data_list`` (e.g. ``part_000000/000003.tar``).
    path: str
    #: Dataset root URL in use (see :data:`ROOT_MODES`).
    root: str
    #: Modality folders, in reading order; the first one drives alignment.
    modalities: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    #: Number of samples in the shard, or None when not known (yet).
    count: int | None = None
    #: Which dataset of the catalog this shard belongs to (``"dset: i"``, as PiD names it).
    dset_id: str = "dset: 0"
    #: Optional parquet key list fixing order and membership (``align="index"``).
    sample_keys_full_list: str | None = None
    #: Aspect-ratio bucket (``"16_9"``) when the shard lives under ``aspect_ratio_W_H/``.
    bucket: str | None = None

    def url(self, modality: str) -> str:
        """URL of this shard's tar for ``modality``."""
        return join_url(self.root, modality, self.path)


class _ShardSeq(Sequence):
    """Read-only sequence of :class:`Shard` made on access (``catalog.shards``)."""

    __slots__ = ("_make", "_n")

    def __init__(self, make: Callable[[int], Shard], n: int) -> None:
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

    def __iter__(self) -> Iterator[Shard]:
        return (self._make(i) for i in range(self._n))

    def __repr__(self) -> str:
        return f"<{self._n} shards>"
