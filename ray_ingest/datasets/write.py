"""``write_twin_tars``: any Dataset with ``__key__`` and modality columns written as twin tars,
key indexes and ``wdinfo.json`` (PiD's layout, :mod:`ray_ingest.twintar.layout`).

Deterministic output whatever Ray does with blocks
--------------------------------------------------
Ray hands blocks to write tasks in whatever split and order execution produced. So the write
does not depend on it:

1. every row gets its output shard and its position in that shard from the data alone:
   *keep* mode (the default when rows carry ``__shard__``/``__index__``, as read_twin_tars
   rows do) reuses the source shard path and index; *re-shard* mode (``shard_size`` or
   ``max_shard_bytes``) first runs a cheap pass over keys, sort columns and sizes, and the
   driver plans the shards (sorted order, PiD's grouping rule, numbered per leaf);
2. ``groupby(output shard).map_groups`` packs every output shard into **one row** holding its
   members sorted by position;
3. a :class:`~ray.data.Datasink` writes each such row as one twin shard
   (:class:`~ray_ingest.twintar.writer.ShardWriter`: ``.partial`` names, renamed when complete).

A shard row cannot be split, so whichever task writes it, the tar names, members and their
order are the same. A re-run over a partly written output keeps every shard whose key indexes
already list exactly its members (names and sizes) and writes the rest; ``wdinfo.json`` is
written last, on the driver.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink

from ray_ingest.datasets.read import (
    _OUT_LEAF,
    _OUT_PATH,
    _OUT_POS,
    _SIZE,
    LEAF,
    _modalities,
)
from ray_ingest.errors import ConfigError, IngestError
from ray_ingest.execution.pool import ingest_cause
from ray_ingest.redact import register
from ray_ingest.twintar.dataset import DatasetReport, finish_dataset, prepare_output
from ray_ingest.twintar.fsio import join_url
from ray_ingest.twintar.layout import bucket_dir, pack_shards, shard_rel_path
from ray_ingest.twintar.twin import INDEX, KEY, SHARD, ext_column
from ray_ingest.twintar.writer import (
    ShardInfo,
    ShardWriter,
    check_sample_key,
    check_shard_path,
    existing_shard,
)

log = logging.getLogger(__name__)


# =========================================================================== writing


@attrs.frozen
class TwinWriteReport:
    """What :func:`write_twin_tars` wrote."""

    #: Samples in the output.
    samples: int
    #: Shards in the output.
    shards: int
    #: Modalities, in ``data_keys`` order.
    modalities: tuple[str, ...]
    #: wdinfo.json URLs written, sorted.
    wdinfos: tuple[str, ...]
    #: Tar bytes per modality.
    bytes: dict[str, int]
    #: Shards written by this call (``<leaf>/<path>``), sorted.
    written: tuple[str, ...]
    #: Shards found complete and kept (a re-run), sorted.
    kept: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False, value_serializer=lambda i, a, v: (
            list(v) if isinstance(v, tuple) else v))


def _bucket_leaf(bucket: Any) -> str:
    """Output leaf of a bucket value: ``aspect_ratio_<value>``; "" or null: the top folder."""
    b = "" if bucket is None else str(bucket)
    if not b:
        return ""
    if "/" in b or b in (".", ".."):
        raise ConfigError(f"bucket column: expected a folder-safe bucket name like 16_9, "
                          f"got {b!r}")
    return bucket_dir(b)


def _source_leaf(leaf: Any) -> str:
    text = "" if leaf is None else str(leaf)
    if text.startswith("/") or ".." in text.split("/"):
        raise ConfigError(f"{LEAF}: expected a relative folder, got {text!r}")
    return text.strip("/")


def _leaf_column(batch: pa.Table, bucket_column: str | None) -> list[str]:
    """Output leaf (relative folder) per row: from ``bucket_column``, else ``__leaf__``."""
    if bucket_column:
        return [_bucket_leaf(b) for b in batch.column(bucket_column).to_pylist()]
    if LEAF in batch.column_names:
        return [_source_leaf(v) for v in batch.column(LEAF).to_pylist()]
    return [""] * batch.num_rows


@attrs.frozen
class _KeepSharding:
    """Output shard = the row's source shard, position = its index there."""

    bucket_column: str | None

    def __call__(self, batch: pa.Table) -> pa.Table:
        leaves = pa.array(_leaf_column(batch, self.bucket_column), pa.string())
        paths = batch.column(SHARD).cast(pa.string())
        _check_rows(paths.to_pylist(), batch.column(KEY).to_pylist())
        return (batch.append_column(_OUT_LEAF, leaves)
                .append_column(_OUT_PATH, paths)
                .append_column(_OUT_POS, batch.column(INDEX).cast(pa.int64())))


def _check_rows(paths: Sequence[str], keys: Sequence[Any]) -> None:
    """The writer's path and key checks, run before the shuffle: a hostile row then fails the
    write before any shard is written, and no write task outlives the error."""
    for path in dict.fromkeys(paths):
        check_shard_path(path)
    for path, key in zip(paths, keys, strict=True):
        check_sample_key(path, str(key))  # written as str (_pack_shard)


def _payload_sizes(batch: pa.Table, modalities: Sequence[str]) -> pa.Array:
    total = pa.array(np.zeros(batch.num_rows, np.int64))
    for m in modalities:
        col = batch.column(m)
        if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type) or \
                pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            lengths = pc.fill_null(pc.binary_length(col), 0).cast(pa.int64())
        else:  # tensors: .npy bytes are the array bytes plus a small header
            lengths = pa.array([len(_as_bytes(v, m, "")) if v is not None else 0
                                for v in _values(col)], pa.int64())
        total = pc.add(total, lengths)
    return total


@attrs.frozen
class _PlanColumns:
    """The planning pass's narrow rows: key, leaf, sort columns and payload bytes."""

    modalities: tuple[str, ...]
    bucket_column: str | None
    sizes: bool

    def __call__(self, batch: pa.Table) -> pa.Table:
        cols: dict[str, Any] = {KEY: batch.column(KEY).cast(pa.string()),
                                _OUT_LEAF: pa.array(_leaf_column(batch, self.bucket_column),
                                                    pa.string())}
        for name in (LEAF, SHARD, INDEX):
            if name in batch.column_names:
                cols[name] = batch.column(name)
        cols[_SIZE] = (_payload_sizes(batch, self.modalities) if self.sizes
                       else pa.array(np.zeros(batch.num_rows, np.int64)))
        return pa.table(cols)


def _plan_reshard(ds: ray.data.Dataset, modalities: Sequence[str], bucket_column: str | None,
                  shard_size: int | None, max_shard_bytes: int | None, part_size: int,
                  num_cpus: float | None) -> pa.Table:
    """Driver-side plan: (key, output leaf, output path, position), from one narrow pass."""
    narrow = ds.map_batches(
        _PlanColumns(tuple(modalities), bucket_column, max_shard_bytes is not None),
        batch_format="pyarrow", num_cpus=num_cpus)
    narrow.context.raise_original_map_exception = True  # our one-line errors, not a wrapper
    tables = [t for t in narrow.iter_batches(batch_size=None, batch_format="pyarrow")
              if t.num_rows]
    if not tables:
        raise IngestError("write_twin_tars: the dataset has no rows; nothing to write")
    table = pa.concat_tables(tables, promote_options="permissive")
    order = [(_OUT_LEAF, "ascending")]
    if SHARD in table.column_names and INDEX in table.column_names:
        order += [(n, "ascending") for n in (LEAF, SHARD, INDEX) if n in table.column_names]
    order.append((KEY, "ascending"))
    table = table.take(pc.sort_indices(table, sort_keys=order))
    keys = table.column(KEY).to_pylist()
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise ConfigError(f"write_twin_tars: sample key {dup!r} occurs more than once")
    leaves = table.column(_OUT_LEAF).to_pylist()
    sizes = table.column(_SIZE).to_pylist()
    out_leaf, out_path, out_pos = [], [], []
    start = 0
    while start < len(keys):
        end = start
        while end < len(keys) and leaves[end] == leaves[start]:
            end += 1
        shards = pack_shards(keys[start:end], sizes[start:end], shard_size, max_shard_bytes or 0)
        for shard_id, members in enumerate(shards):
            path = shard_rel_path(shard_id, part_size)
            for pos in range(len(members)):
                out_leaf.append(leaves[start])
                out_path.append(path)
                out_pos.append(pos)
        start = end
    _check_rows(out_path, keys)  # before any write task starts
    return pa.table({KEY: keys, _OUT_LEAF: out_leaf, _OUT_PATH: out_path,
                     _OUT_POS: pa.array(out_pos, pa.int64())})


class _AssignPlanned:
    """Looks every row's key up in the driver's plan (an object-store reference)."""

    def __init__(self, plan_ref: Any):
        self.plan_ref = plan_ref
        self._plan: pa.Table | None = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self._plan is None:
            self._plan = ray.get(self.plan_ref)
        plan = self._plan
        keys = batch.column(KEY).cast(pa.string())
        idx = pc.index_in(keys, value_set=plan.column(KEY))
        if idx.null_count:
            missing = keys.filter(pc.is_null(idx))[0].as_py()
            raise IngestError(
                f"write_twin_tars: sample key {missing!r} was not in the planning pass; the "
                "dataset must give the same rows each time it runs (materialize() it first)")
        for name in (_OUT_LEAF, _OUT_PATH, _OUT_POS):
            batch = batch.append_column(name, plan.column(name).take(idx))
        return batch


def _values(col: pa.ChunkedArray | pa.Array) -> list[Any]:
    """Python values of a column; tensor extension columns give numpy arrays."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col.type, pa.ExtensionType):
        arr = col.to_numpy(zero_copy_only=False)
        return list(arr)
    return col.to_pylist()


def _as_bytes(value: Any, modality: str, key: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, np.ndarray):
        import io

        if value.dtype.hasobject:
            raise ConfigError(f"sample {key!r}: {modality} array has dtype object; "
                              "only plain arrays are written (as .npy)")
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    raise ConfigError(f"sample {key!r}: {modality} must be bytes, str or a numpy array, "
                      f"got {type(value).__name__}")


def _default_ext(col_type: pa.DataType) -> str | None:
    if isinstance(col_type, pa.ExtensionType):
        return "npy"
    if pa.types.is_string(col_type) or pa.types.is_large_string(col_type):
        return "txt"
    return None


def _pack_shard(batch: pa.Table, modalities: Sequence[str],
                extensions: Mapping[str, str]) -> pa.Table:
    """One output shard's rows -> one row: its members sorted by position."""
    batch = batch.take(pc.sort_indices(batch, sort_keys=[(_OUT_POS, "ascending")]))
    leaf = batch.column(_OUT_LEAF)[0].as_py()
    path = batch.column(_OUT_PATH)[0].as_py()
    where = f"shard {join_url(leaf, path) if leaf else path}"
    positions = batch.column(_OUT_POS).to_pylist()
    for a, b in zip(positions, positions[1:], strict=False):
        if a == b:
            raise ConfigError(f"{where}: two samples have index {a} "
                              f"(expected one sample per {INDEX})")
    keys = [str(k) for k in batch.column(KEY).to_pylist()]
    out: dict[str, pa.Array] = {
        _OUT_LEAF: pa.array([leaf], pa.string()),
        _OUT_PATH: pa.array([path], pa.string()),
        KEY: pa.array([keys], pa.list_(pa.string())),
    }
    for m in modalities:
        col = batch.column(m)
        values = _values(col)
        ecol = ext_column(m)
        if ecol in batch.column_names:
            exts = [e or extensions.get(m) or _default_ext(col.type)
                    for e in batch.column(ecol).to_pylist()]
        else:
            exts = [extensions.get(m) or _default_ext(col.type)] * len(keys)
        payloads = []
        for key, value, ext in zip(keys, values, exts, strict=True):
            if value is None:
                raise ConfigError(f"{where}: sample {key!r} has no {m} member "
                                  "(every sample needs every modality)")
            if not ext:
                raise ConfigError(f"{where}: sample {key!r}: no extension for {m} (add a "
                                  f"{ecol!r} column or pass extensions={{{m!r}: 'jpg'}})")
            payloads.append(_as_bytes(value, m, key))
        out[m] = pa.array([payloads], pa.list_(pa.large_binary()))
        out[ecol] = pa.array([exts], pa.list_(pa.string()))
    return pa.table(out)


class TwinTarsDatasink(Datasink):
    """Writes shard rows (from :func:`_pack_shard`) as twin shards; wdinfo.json at the end."""

    def __init__(self, path: str, modalities: Sequence[str],
                 storage_options: Mapping[str, Any] | None = None,
                 chunk_size: int | None = None):
        self.path = path.rstrip("/")
        self.modalities = tuple(modalities)
        self.storage_options = dict(storage_options or {})
        self.chunk_size = chunk_size
        self.report: TwinWriteReport | None = None

    def get_name(self) -> str:
        return "TwinTars"

    def write(self, blocks: Iterable[Any], ctx: Any) -> list[dict[str, Any]]:
        register(self.storage_options)  # a write task's errors never show them
        results = []
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            for i in range(table.num_rows):
                results.append(self._write_shard(table.slice(i, 1).to_pylist()[0]))
        return results

    def _write_shard(self, row: dict[str, Any]) -> dict[str, Any]:
        leaf_rel, path, keys = row[_OUT_LEAF], row[_OUT_PATH], row[KEY]
        leaf = join_url(self.path, leaf_rel) if leaf_rel else self.path
        so = self.storage_options
        expected = {m: [(f"{k}.{e}", len(p)) for k, e, p in
                        zip(keys, row[ext_column(m)], row[m], strict=True)]
                    for m in self.modalities}
        info = existing_shard(leaf, path, expected, so)
        written = info is None
        if info is None:
            with ShardWriter(leaf, path, self.modalities, storage_options=so) as w:
                for j, key in enumerate(keys):
                    w.add(key, {m: (row[ext_column(m)][j], row[m][j]) for m in self.modalities})
            info = w.info
        return {"leaf": leaf_rel, "path": path, "count": info.count, "bytes": info.bytes,
                "written": written}

    def on_write_complete(self, write_result: Any) -> None:
        rows = [r for ret in write_result.write_returns for r in (ret or [])]
        if not rows:
            raise IngestError(f"write_twin_tars: the dataset has no rows; nothing written to "
                              f"{self.path}")
        infos = [ShardInfo(path=r["path"], count=r["count"], bytes=r["bytes"],
                           leaf=join_url(self.path, r["leaf"]) if r["leaf"] else self.path)
                 for r in rows]
        report = finish_dataset(infos, self.modalities, DatasetReport(),
                                chunk_size=self.chunk_size, storage_options=self.storage_options)

        def name(r: dict[str, Any]) -> str:
            return f"{r['leaf']}/{r['path']}" if r["leaf"] else r["path"]

        self.report = TwinWriteReport(
            samples=report.samples, shards=report.shards, modalities=report.modalities,
            wdinfos=tuple(report.wdinfos), bytes=dict(report.bytes),
            written=tuple(sorted(name(r) for r in rows if r["written"])),
            kept=tuple(sorted(name(r) for r in rows if not r["written"])))


def write_twin_tars(
    ds: ray.data.Dataset,
    path: str,
    *,
    modalities: Sequence[str] | str | None = None,
    shard_size: int | None = None,
    max_shard_bytes: int | None = None,
    bucket_column: str | None = None,
    extensions: Mapping[str, str] | None = None,
    part_size: int = 1000,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    num_partitions: int | None = None,
    concurrency: int | None = None,
    num_cpus: float | None = None,
    memory: float | None = None,
) -> TwinWriteReport:
    """Write ``ds`` as twin tars under ``path``: one tar per modality per shard (PiD's layout),
    a key index per tar and a ``wdinfo.json`` per leaf folder.

    Rows need ``__key__`` and one column per modality (bytes; str is written as UTF-8, numpy
    arrays/tensor columns as ``.npy``); member extensions come from ``<modality>__ext``
    columns, else ``extensions``. Output sharding:

    * *keep* (default; rows with ``__shard__``/``__index__``, as :func:`read_twin_tars` gives):
      ``write_twin_tars(read_twin_tars(x), y)`` reproduces ``x``'s tar names, members, order;
    * *re-shard* (``shard_size`` or ``max_shard_bytes``): source order (else by key) cut by
      count or by member bytes (PiD's rule), ``part_XXXXXX/NNNNNN.tar`` per leaf, planned on
      the driver from a first pass (the input runs twice: ``materialize()`` a costly one).

    ``bucket_column`` puts each sample under ``aspect_ratio_<value>/`` (a leaf with its own
    wdinfo.json) instead of its ``__leaf__``. The output does not depend on how Ray splits the
    data, and a re-run over a partial output keeps its complete shards (module docstring).

    Args:
        ds: the Dataset.
        path: output folder (local, ``gs://``); absent, empty or a previous run's output.
        modalities: modality columns to write, in ``data_keys`` order (the first drives).
        shard_size, max_shard_bytes: re-shard by count or by member bytes (one of them).
        bucket_column: column naming each sample's aspect bucket (``16_9``; "" or null: top).
        extensions: default member extension per modality (``{"image": "jpg"}``).
        part_size: shards per ``part_XXXXXX`` folder in re-shard mode (0: flat names).
        overwrite: first delete ``path`` if it holds only a dataset written by ray_ingest.
        storage_options: fsspec options of the output (and of nothing else).
        num_partitions: hash partitions of the group-by that gathers each shard's rows
            (default: Ray's ``DataContext.default_hash_shuffle_parallelism``).
        concurrency: maximum concurrent write tasks.
        num_cpus: logical CPUs per task of the write stages (Ray's default 1).
        memory: heap memory per write task, in bytes.

    Returns:
        :class:`TwinWriteReport`: samples, shards, wdinfo URLs, bytes, shards written and kept.
    """
    so = dict(storage_options or {})
    register(so)
    mods = _write_modalities(modalities, shard_size, max_shard_bytes, part_size)
    exts = {str(k): str(v).lstrip(".") for k, v in (extensions or {}).items()}
    keep = _check_columns(ds, mods, bucket_column, shard_size is None and max_shard_bytes is None)
    if overwrite:
        prepare_output(path, overwrite=True, storage_options=so)
    if keep:
        assigned = ds.map_batches(_KeepSharding(bucket_column), batch_format="pyarrow",
                                  num_cpus=num_cpus)
    else:
        with _one_line_errors():
            plan = _plan_reshard(ds, mods, bucket_column, shard_size, max_shard_bytes,
                                 part_size, num_cpus)
        assigned = ds.map_batches(_AssignPlanned(ray.put(plan)), batch_format="pyarrow",
                                  num_cpus=num_cpus)
    packed = assigned.groupby([_OUT_LEAF, _OUT_PATH], num_partitions=num_partitions).map_groups(
        _pack_shard, fn_kwargs={"modalities": mods, "extensions": exts},
        batch_format="pyarrow", num_cpus=num_cpus)
    packed.context.raise_original_map_exception = True  # our one-line errors, not a wrapper
    sink = TwinTarsDatasink(path, mods, so, chunk_size=shard_size)
    remote_args = {k: v for k, v in (("num_cpus", num_cpus), ("memory", memory)) if v is not None}
    with _one_line_errors():
        packed.write_datasink(sink, ray_remote_args=remote_args, concurrency=concurrency)
    if sink.report is None:  # on_write_complete did not run: nothing reached the sink
        raise IngestError(f"write_twin_tars: the dataset has no rows; nothing written to {path}")
    return sink.report


def _write_modalities(modalities: Sequence[str] | str | None, shard_size: int | None,
                      max_shard_bytes: int | None, part_size: int) -> tuple[str, ...]:
    """The modalities to write, the sharding arguments checked."""
    mods = _modalities(modalities, "write_twin_tars")
    if mods is None:
        raise ConfigError("write_twin_tars: modalities: expected the modality columns to "
                          "write, got none")
    if shard_size is not None and max_shard_bytes is not None:
        raise ConfigError("write_twin_tars: pass shard_size or max_shard_bytes, not both")
    if shard_size is not None and shard_size < 1:
        raise ConfigError(f"shard_size: expected >= 1, got {shard_size}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes: expected >= 1, got {max_shard_bytes}")
    if part_size < 0:
        raise ConfigError(f"part_size: expected >= 0, got {part_size}")
    return mods


def _check_columns(ds: ray.data.Dataset, mods: Sequence[str], bucket_column: str | None,
                   keep: bool) -> bool:
    """The columns the write needs are there (keep mode: the source shard and index too);
    returns ``keep``."""
    schema = ds.schema(fetch_if_missing=True)
    names = list(schema.names) if schema is not None else []
    missing = [c for c in (KEY, *mods, *([bucket_column] if bucket_column else []))
               if c not in names]
    if missing:
        raise ConfigError(f"write_twin_tars: the dataset lacks columns {missing} "
                          f"(it has {names})")
    if keep and not (SHARD in names and INDEX in names):
        raise ConfigError(f"write_twin_tars: rows have no {SHARD}/{INDEX} to keep their "
                          "sharding; pass shard_size or max_shard_bytes")
    return keep


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """Re-raise an execution's failure as the one-line IngestError behind it, when there is
    one (not Ray's wrapper with its advice)."""
    try:
        yield
    except Exception as exc:
        cause = ingest_cause(exc)
        if cause is None:
            raise
        raise cause from None
