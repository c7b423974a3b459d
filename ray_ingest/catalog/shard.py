"""One shard of a twin-tar dataset, and the per-dataset options shards share.

A :class:`TarSample` names one shard (its ``data_list`` path, the root its modality folders
live under, its modalities and aspect bucket); the catalog makes them only when a shard is
touched. Also here: the root modes and the log-once notice the catalog's modules share.
No Ray, no torch.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from ray_ingest.errors import CatalogError
from ray_ingest.twintar.fsio import join_url

log = logging.getLogger(__name__)


DEFAULT_MODALITIES = ("image", "caption")
#: How a shard's tars are found: ``wdinfo`` uses the wdinfo's ``root`` verbatim (PiD's rule),
#: ``folder`` the folder holding the wdinfo (a moved or copied dataset).
ROOT_MODES = ("wdinfo", "folder")


# --------------------------------------------------------------------------- small helpers

_WARNED: set[str] = set()


_NOTICED: set[tuple[Any, ...]] = set()
_NOTICE_LOCK = threading.Lock()


def _notice(key: tuple[Any, ...], level: int, msg: str, *args: Any) -> None:
    """Log ``msg`` once per process for ``key`` (not per shard, rank or epoch)."""
    with _NOTICE_LOCK:
        if key in _NOTICED:
            return
        _NOTICED.add(key)
    log.log(level, msg, *args)


def warn_renamed(old: str, new: str) -> None:
    """DeprecationWarning for a renamed public name, once per process (hot paths use them)."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_KEYS":
        warn_renamed("ray_ingest.catalog.DEFAULT_KEYS", "DEFAULT_MODALITIES")
        return DEFAULT_MODALITIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    opts: dict[str, Any] = attrs.field(factory=dict)
    #: Modality folders for this dataset; empty means the reader's modalities.
    per_dataset_modalities: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    #: Human-readable source name.
    source: str = ""
    #: fsspec storage options (PiD: object_store_config).
    object_store_config: dict[str, Any] = attrs.field(factory=dict)

    def __init__(self, wdinfo: Iterable[str], opts: dict[str, Any] | None = None,
                 per_dataset_modalities: Iterable[str] = (), source: str = "",
                 object_store_config: dict[str, Any] | None = None, *,
                 per_dataset_keys: Iterable[str] | None = None) -> None:
        if per_dataset_keys is not None:
            warn_renamed("DatasetInfo(per_dataset_keys=...)", "per_dataset_modalities")
            if tuple(per_dataset_modalities):
                raise CatalogError("DatasetInfo: got both per_dataset_modalities and its old "
                                   "name per_dataset_keys; give only per_dataset_modalities")
            per_dataset_modalities = per_dataset_keys
        self.__attrs_init__(wdinfo, {} if opts is None else opts, per_dataset_modalities, source,
                            {} if object_store_config is None else object_store_config)

    @wdinfo.validator
    def _check_wdinfo(self, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise CatalogError("DatasetInfo.wdinfo: expected at least one path, got none")

    @property
    def per_dataset_keys(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`per_dataset_modalities`."""
        warn_renamed("DatasetInfo.per_dataset_keys", "per_dataset_modalities")
        return self.per_dataset_modalities


@attrs.frozen
class TarSample:
    """One twin shard: the same relative ``path`` exists under ``root/<m>/`` for every modality."""

    #: Relative tar path as listed in ``data_list`` (e.g. ``part_000000/000003.tar``).
    path: str
    #: Dataset root URL in use (see :data:`ROOT_MODES`).
    root: str
    #: Modality folders, in reading order; the first one drives alignment.
    modalities: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    #: Number of samples in the shard, or None when not known (yet).
    count: int | None
    #: Which dataset of the catalog this shard belongs to (``"dset: i"``, as PiD names it).
    dset_id: str = "dset: 0"
    #: Optional parquet key list fixing order and membership (``align="index"``).
    sample_keys_full_list: str | None = None
    #: Aspect-ratio bucket (``"16_9"``) when the shard lives under ``aspect_ratio_W_H/``.
    bucket: str | None = None

    def __init__(self, path: str, root: str, modalities: Iterable[str] | None = None,
                 count: int | None = None, dset_id: str = "dset: 0",
                 sample_keys_full_list: str | None = None, bucket: str | None = None, *,
                 keys: Iterable[str] | None = None) -> None:
        if keys is not None:
            warn_renamed("TarSample(keys=...)", "modalities")
            if modalities is not None:
                raise CatalogError("TarSample: got both modalities and its old name keys")
            modalities = keys
        if modalities is None:
            raise CatalogError(f"TarSample {path}: expected modalities, got none")
        self.__attrs_init__(path, root, modalities, count, dset_id, sample_keys_full_list, bucket)

    @property
    def keys(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`modalities`."""
        warn_renamed("TarSample.keys", "modalities")
        return self.modalities

    def url(self, modality: str) -> str:
        """URL of this shard's tar for ``modality``."""
        return join_url(self.root, modality, self.path)


class _ShardSeq(Sequence):
    """Read-only sequence of :class:`TarSample` made on access (``catalog.shards``)."""

    __slots__ = ("_make", "_n")

    def __init__(self, make: Callable[[int], TarSample], n: int) -> None:
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

    def __iter__(self) -> Iterator[TarSample]:
        return (self._make(i) for i in range(self._n))

    def __repr__(self) -> str:
        return f"<{self._n} shards>"
