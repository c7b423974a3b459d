"""Catalog: the columnar, sorted, fingerprinted view of one or more twin-tar datasets.

Reads ``wdinfo.json`` exactly as PiD's sharder writes it (``data_list``, ``total_key_count``,
optional ``chunk_size``, ``data_list_key_count``, ``data_keys``, ``root``) over fsspec, so
local paths, ``gs://`` and ``memory://`` all work. Unlike PiD, discovery is **sorted** and
datasets combine in a stable order (the order given, then sorted wdinfo paths within each), so
two runs on the same data always see the same shard list.

Columnar: a catalog keeps its shards as arrays, not objects. ``paths`` (the ``data_list``
entries, one Arrow string array), ``counts`` (int64) and, per shard, the number of the wdinfo it
came from; root, modalities, dataset and aspect bucket are stored once per wdinfo. A
:class:`TarSample` is made only when a shard is touched (``catalog.shard(i)``,
``catalog.shards[i]``), so a million-shard catalog loads in a fraction of a second and pickles
(``ray.put``) as a handful of buffers. Big wdinfo files are read straight into those arrays:
plainly written ones by :mod:`ray_ingest.catalog.scan` (vectorized), others by pyarrow's JSON
reader; anything unusual falls back to ``json`` and its exact checks.

Per-shard counts, in order of preference: ``data_list_key_count``; else ``chunk_size`` for
every shard when ``total_key_count == chunk_size * len(data_list)`` (PiD's own assumption);
else the key index ``<tar>.idx.json`` of the first modality's tar (read once, lazily, when the
counts are first needed; ``ray-ingest index`` writes them); else one error that says which.

Roots: a wdinfo's ``root`` is used verbatim (PiD's rule, ``root="wdinfo"``) or replaced by the
folder holding the wdinfo (``root="folder"``). When the two differ, one existence check per
distinct folder says whether a moved dataset is being read from its old place (logged once per
wdinfo, or an error naming the setting when the old place is gone).

No Ray, no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import pyarrow as pa

from ray_ingest.catalog.arrays import (
    CountArray,
    _bools,
    _count_view,
    _ints,
    _offsets,
    _strings,
    _text,
)
from ray_ingest.catalog.discovery import _MANY_INDEXES, _counts_from_indexes
from ray_ingest.catalog.shard import (
    DEFAULT_MODALITIES,
    TarSample,
    _ShardSeq,
    _tuple_of_str,
    warn_renamed,
)
from ray_ingest.catalog.wdinfo import Wdinfo, _modalities_arg
from ray_ingest.errors import CatalogError
from ray_ingest.twintar.fsio import join_url

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the catalog


@attrs.frozen
class _Group:
    """What shards of one wdinfo (or one legacy shard group) share."""

    root: str
    modalities: tuple[str, ...]
    dset_id: str
    bucket: str | None
    sample_keys_full_list: str | None = None
    #: Index into ``catalog.wdinfos`` (-1: built from shard objects).
    wdinfo: int = -1


class Catalog:
    """All shards of one or more datasets, in a stable order, with a content fingerprint.

    Columnar (see the module docstring): ``paths``, ``counts``, ``group_index`` and small
    per-wdinfo tables; ``shards``/``shard(i)`` make :class:`TarSample` objects on access.
    ``load_catalog`` builds catalogs; this constructor builds one from shard objects.
    """

    __slots__ = ("_complete", "_count_error", "_counts", "_fingerprint", "_group", "_groups",
                 "_lock", "_modalities", "_paths", "_starts", "_storage", "_wdinfos",
                 "chunk_size")

    def __init__(self, shards: Iterable[TarSample] = (), wdinfos: Sequence[Wdinfo] = (),
                 chunk_size: int | None = None, modalities: Iterable[str] | None = None, *,
                 keys: Iterable[str] | None = None) -> None:
        modalities = _modalities_arg(modalities, keys, "Catalog")  # type: ignore[arg-type]
        shards = list(shards)
        codes: dict[_Group, int] = {}
        group = np.empty(len(shards), dtype=np.int32)
        for i, s in enumerate(shards):
            g = _Group(s.root, s.modalities, s.dset_id, s.bucket, s.sample_keys_full_list)
            group[i] = codes.setdefault(g, len(codes))
        counts = np.array([-1 if s.count is None else s.count for s in shards], dtype=np.int64)
        if chunk_size is None:
            chunk_size = wdinfos[0].chunk_size if wdinfos else 1
        self._setup(_strings([s.path for s in shards]), counts, group,
                    tuple(codes), tuple(wdinfos), None, int(chunk_size),
                    _tuple_of_str(modalities or (shards[0].modalities if shards
                                                 else DEFAULT_MODALITIES)), ())

    def _setup(self, paths: pa.Array, counts: np.ndarray, group: np.ndarray,
               groups: tuple[_Group, ...], wdinfos: tuple[Wdinfo, ...], starts: np.ndarray | None,
               chunk_size: int, modalities: tuple[str, ...],
               storage: tuple[dict[str, Any], ...], fingerprint: str | None = None,
               count_error: str | None = None) -> None:
        group.flags.writeable = False
        self._paths = paths
        self._counts = counts
        self._group = group
        self._groups = groups
        self._wdinfos = wdinfos
        self._starts = starts
        self.chunk_size = chunk_size
        self._modalities = modalities
        self._storage = storage
        self._fingerprint = fingerprint
        self._count_error = count_error
        self._complete = not len(counts) or bool(counts.min() >= 0)
        self._lock = threading.Lock()

    @classmethod
    def from_wdinfos(cls, wdinfos: Sequence[Wdinfo], modalities: Sequence[str] | None = None,
                     storage_options: Sequence[dict[str, Any]] | None = None) -> Catalog:
        """Concatenate parsed wdinfos (in order) into one catalog, without per-shard objects."""
        if not wdinfos:
            raise CatalogError("no wdinfo files given")
        lengths = np.array([len(w) for w in wdinfos], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        paths = (wdinfos[0].paths if len(wdinfos) == 1
                 else pa.concat_arrays([w.paths for w in wdinfos]))
        if len(wdinfos) == 1 and wdinfos[0].counts is not None:
            counts = np.asarray(wdinfos[0].counts)  # read-only; replaced, never written
        else:
            counts = np.full(int(starts[-1]), -1, dtype=np.int64)
            for w, a in zip(wdinfos, starts, strict=False):
                if w.counts is not None:
                    counts[a:a + len(w)] = w.counts
        group = np.repeat(np.arange(len(wdinfos), dtype=np.int32), lengths)
        groups = tuple(_Group(w.root, w.modalities, w.dset_id, w.bucket, None, i)
                       for i, w in enumerate(wdinfos))
        cat = object.__new__(cls)
        cat._setup(paths, counts, group, groups, (), starts, wdinfos[0].chunk_size,
                   _tuple_of_str(modalities or wdinfos[0].modalities),
                   tuple(storage_options or ({} for _ in wdinfos)))
        cat._wdinfos = cat._views(wdinfos)
        return cat

    def _views(self, wdinfos: Sequence[Wdinfo]) -> tuple[Wdinfo, ...]:
        """The wdinfos re-pointed at slices of the catalog's arrays (no second copy)."""
        out = []
        for i, w in enumerate(wdinfos):
            a, b = int(self._starts[i]), int(self._starts[i + 1])
            known = w.count_source is not None
            out.append(w._replace(paths=self._paths.slice(a, b - a),
                                  counts=_count_view(self._counts[a:b]) if known else None))
        return tuple(out)

    # --- pickling (ray.put): arrays and small tables only ---------------------------------
    def __getstate__(self) -> dict[str, Any]:
        paths = self._paths
        if paths.offset or len(paths.buffers()) != 3:
            paths = pa.concat_arrays([paths])  # compact: a slice would pickle its whole buffers
        if self._starts is not None:
            wdinfos: Any = [w._replace(paths=None, counts=None).__getstate__()
                            for w in self._wdinfos]
        else:
            wdinfos = self._wdinfos
        return {"paths": paths, "counts": self._counts, "group": np.array(self._group),
                "groups": self._groups, "wdinfos": wdinfos, "starts": self._starts,
                "chunk_size": self.chunk_size, "modalities": self._modalities,
                "storage": self._storage, "fingerprint": self._fingerprint,
                "count_error": self._count_error}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._setup(state["paths"], state["counts"], state["group"], state["groups"], (),
                    state["starts"], state["chunk_size"], state["modalities"], state["storage"],
                    state["fingerprint"], state["count_error"])
        if self._starts is None:
            self._wdinfos = tuple(state["wdinfos"])
            return
        shells = []
        for doc in state["wdinfos"]:
            w = object.__new__(Wdinfo)
            w.__setstate__(doc)
            shells.append(w)
        self._wdinfos = self._views(shells)

    def __repr__(self) -> str:
        return (f"Catalog({len(self)} shards from {len(self._wdinfos)} wdinfo files, "
                f"modalities={list(self._modalities)}, chunk_size={self.chunk_size})")

    # --- columns and small tables ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self._paths)

    @property
    def num_shards(self) -> int:
        return len(self._paths)

    @property
    def modalities(self) -> tuple[str, ...]:
        """Modality folders read by default, in reading order; the first drives alignment."""
        return self._modalities

    @property
    def keys(self) -> tuple[str, ...]:
        """Deprecated name of :attr:`modalities`."""
        warn_renamed("Catalog.keys", "modalities")
        return self._modalities

    @property
    def wdinfos(self) -> tuple[Wdinfo, ...]:
        return self._wdinfos

    @property
    def paths(self) -> pa.Array:
        """``data_list`` path of every shard (an Arrow string array)."""
        return self._paths

    def path(self, i: int) -> str:
        return self._paths[i].as_py()

    def paths_at(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """``data_list`` paths of the shards ``indices`` (a worker list), in that order."""
        return self._paths.take(_ints(np.asarray(indices, dtype=np.int64))).to_pylist()

    @property
    def group_index(self) -> np.ndarray:
        """Per shard: its row in :attr:`groups` (the wdinfo it came from), int32, read-only."""
        return self._group

    @property
    def groups(self) -> tuple[_Group, ...]:
        """What the shards of each wdinfo share: root, modalities, dataset id, bucket."""
        return self._groups

    @property
    def roots(self) -> tuple[str, ...]:
        """Root in use per group (index with :attr:`group_index`)."""
        return tuple(g.root for g in self._groups)

    @property
    def dataset_index(self) -> np.ndarray:
        """Per shard: the number of its dataset (``"dset: i"`` -> ``i``), int32."""
        ids: dict[str, int] = {}
        table = np.array([ids.setdefault(g.dset_id, _dset_number(g.dset_id, len(ids)))
                          for g in self._groups], dtype=np.int32)
        return table[self._group] if len(table) else np.zeros(0, dtype=np.int32)

    @property
    def buckets(self) -> np.ndarray:
        """Per shard: its aspect bucket label (``"16_9"``; ``""`` when unbucketed), object array."""
        table = np.array([g.bucket or "" for g in self._groups] or [""], dtype=object)
        return table[self._group]

    @property
    def known_counts(self) -> np.ndarray:
        """Per-shard counts known without reading anything (-1 where unknown), read-only."""
        view = self._counts.view()
        view.flags.writeable = False
        return view

    @property
    def counts(self) -> CountArray:
        """Per-shard sample counts (int64, see :class:`CountArray`).

        Shards whose wdinfo records none get them from their key indexes, read once here;
        raises :class:`CatalogError` saying what is missing when neither exists.
        """
        if not self._complete:
            self._resolve_counts()
        return _count_view(self._counts)

    def _try_counts(self) -> None:
        """Resolve counts from key indexes when possible; leave them unknown otherwise."""
        with contextlib.suppress(CatalogError):
            self.counts  # noqa: B018

    def require_counts(self) -> CountArray:
        """:attr:`counts`: call before ``ray.put`` so ranks receive resolved counts."""
        return self.counts

    def _resolve_counts(self) -> None:
        with self._lock:
            if self._count_error is None and not self._complete:
                self._count_error = self._fill_counts()
                self._complete = self._count_error is None
            if self._count_error is not None:
                raise CatalogError(self._count_error)

    def _fill_counts(self) -> str | None:
        """Fill unknown counts from key indexes; the error text when some stay unknown."""
        if self._starts is None:
            i = int(np.argmax(self._counts < 0))
            return (f"shard {self.path(i)} (index {i}): wdinfo has no 'data_list_key_count'; "
                    "per-shard counts are required here")
        for k, w in enumerate(self._wdinfos):
            if w.count_source is not None:
                continue
            t0 = time.perf_counter()
            if len(w) > _MANY_INDEXES:
                log.warning("%s: reading %d key indexes for per-shard counts (once); "
                            "`ray-ingest index %s` records them in the wdinfo instead",
                            w.source, len(w), w.folder)
            found, missing = _counts_from_indexes(w, self._storage[k])
            if found is None:
                return (f"{w.source}: no per-shard sample counts: field 'data_list_key_count' "
                        f"is missing, total_key_count ({w.total_key_count}) is not chunk_size "
                        f"({w.chunk_size}) x {len(w)} shards, and the key index {missing} does "
                        f"not exist; run `ray-ingest index {w.folder}` to write them")
            a = int(self._starts[k])
            counts = self._counts.copy()  # arrays handed out earlier stay as they were
            counts[a:a + len(w)] = found
            self._counts = counts
            self._wdinfos = self._views([x if j != k else x._replace(count_source="key index")
                                         for j, x in enumerate(self._wdinfos)])
            log.info("%s: counts of %d shards from their %s key indexes (%.2f s)", w.source,
                     len(w), w.modalities[0], time.perf_counter() - t0)
        self._fingerprint = None
        return None

    @property
    def total_key_count(self) -> int:
        return sum(w.total_key_count for w in self._wdinfos)

    # --- shard objects --------------------------------------------------------------------
    def shard(self, i: int) -> TarSample:
        """Shard ``i`` as a :class:`TarSample` (made now; nothing per shard is kept)."""
        n = len(self._paths)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"shard index {i} out of range ({n} shards)")
        g = self._groups[self._group[i]]
        c = int(self._counts[i])
        return TarSample(self._paths[i].as_py(), g.root, g.modalities, None if c < 0 else c,
                         g.dset_id, g.sample_keys_full_list, g.bucket)

    @property
    def shards(self) -> Sequence[TarSample]:
        """Every shard as a read-only sequence of :class:`TarSample`, made on access."""
        return _ShardSeq(self.shard, len(self._paths))

    def url(self, i: int, modality: str) -> str:
        """URL of shard ``i``'s tar for ``modality``."""
        return join_url(self._groups[self._group[i]].root, modality, self.path(i))

    # --- fingerprint ----------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 over the modalities and every shard's dataset id, path and count (not roots:
        a copy in gs:// matches). Counts are those in use (null where none can be had)."""
        if self._fingerprint is None:
            self._try_counts()
            self._fingerprint = _fingerprint(self._modalities, self._paths, self._counts,
                                             self._group, self._groups)
        return self._fingerprint

    def describe_change(self, other_fingerprint_doc: dict[str, Any]) -> str:
        """Human-readable difference against :meth:`fingerprint_doc` of another catalog."""
        mine = self.fingerprint_doc()
        diffs = [
            f"{k}: saved {other_fingerprint_doc.get(k)!r}, now {mine[k]!r}"
            for k in mine
            if other_fingerprint_doc.get(k) != mine[k]
        ]
        return "; ".join(diffs) or "no difference"

    def fingerprint_doc(self) -> dict[str, Any]:
        """Small summary stored next to the fingerprint so a mismatch can say what changed.

        Its ``keys`` entry (the modalities) keeps that name: saved read states hold it.
        """
        self._try_counts()
        n = len(self._paths)
        return {
            "keys": list(self._modalities),
            "num_shards": n,
            "num_samples": int(self._counts[self._counts >= 0].sum()),
            "first_shard": self.path(0) if n else None,
            "last_shard": self.path(n - 1) if n else None,
        }


def _dset_number(dset_id: str, fallback: int) -> int:
    head, _, tail = dset_id.partition(": ")
    return int(tail) if head == "dset" and tail.isdigit() else fallback


#: Bytes that JSON writes verbatim inside a string (printable ASCII but ``"`` and ``\``).
_JSON_PLAIN = np.zeros(256, dtype=bool)
_JSON_PLAIN[0x20:0x7F] = True
_JSON_PLAIN[[0x22, 0x5C]] = False


def _fingerprint(modalities: Sequence[str], paths: pa.Array, counts: np.ndarray,
                 group: np.ndarray, groups: Sequence[_Group]) -> str:
    """sha256(json(modalities) + json([dset_id, path, count]) per shard)[:16], vectorised.

    The same bytes as hashing ``json.dumps([s.dset_id, s.path, s.count])`` shard by shard
    (the object catalog's definition); paths needing JSON escapes (rare) take that literal
    loop. Built in chunks of :data:`_FINGERPRINT_CHUNK` shards to bound memory.
    """
    import pyarrow.compute as pc

    h = hashlib.sha256()
    h.update(json.dumps(list(modalities)).encode())
    if not len(paths):
        return h.hexdigest()[:16]
    offsets = _offsets(paths)
    data = np.frombuffer(paths.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]
    if not _JSON_PLAIN[data].all():
        for i, p in enumerate(paths.to_pylist()):
            c = int(counts[i])
            h.update(json.dumps([groups[group[i]].dset_id, p, None if c < 0 else c]).encode())
        return h.hexdigest()[:16]
    heads = [f"[{json.dumps(g.dset_id)}, \"" for g in groups]
    one_head = _text(heads[0]) if len(set(heads)) == 1 else None
    sep, end, null = _text('", '), _text("]"), _text("null")
    for a in range(0, len(paths), _FINGERPRINT_CHUNK):
        part = paths.slice(a, _FINGERPRINT_CHUNK)
        c = counts[a:a + len(part)]
        head = one_head if one_head is not None else _strings(heads).take(
            _ints(group[a:a + len(part)]))
        text = pc.cast(_ints(c), pa.string())
        if (c < 0).any():
            text = pc.if_else(_bools(c < 0), null, text)
        lines = pc.binary_join_element_wise(head, part, sep, text, end, _text(""))
        off = _offsets(lines)
        h.update(memoryview(lines.buffers()[2])[int(off[0]):int(off[-1])])
    return h.hexdigest()[:16]


#: Shards per chunk of the vectorised fingerprint (~50 MB of text at a time).
_FINGERPRINT_CHUNK = 1 << 20
