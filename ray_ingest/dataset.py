"""Twin-tar datasets as Ray Datasets, both directions.

:func:`read_twin_tars` opens twin tars as a :class:`ray.data.Dataset` (one row per aligned
sample, raw member bytes, optionally decoded), so a notebook or an offline job can filter,
aggregate or ``take()`` at cluster scale with the read path training uses.
:func:`write_twin_tars` writes any Dataset with ``__key__`` and modality columns as twin tars,
key indexes and ``wdinfo.json`` (PiD's layout, :mod:`ray_ingest.writer`).

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
   (:class:`~ray_ingest.writer.ShardWriter`: ``.partial`` names, renamed when complete).

A shard row cannot be split, so whichever task writes it, the tar names, members and their
order are the same. A re-run over a partly written output keeps every shard whose key indexes
already list exactly its members (names and sizes) and writes the rest; ``wdinfo.json`` is
written last, on the driver.

Ray lives here (and in :mod:`ray_ingest.source`); the tar logic stays in the pure modules.
"""

from __future__ import annotations

import logging
import math
import posixpath
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data.block import BlockAccessor, BlockMetadata
from ray.data.datasource import Datasink, Datasource, ReadTask

from ray_ingest.catalog import TarSample, discover, join_url, load_catalog, url_dirname
from ray_ingest.config import DecodeConfig
from ray_ingest.errors import ConfigError, IngestError
from ray_ingest.pipeline import decode_udf
from ray_ingest.reader import ReadOptions
from ray_ingest.redact import register
from ray_ingest.shard import _groups as group_into_shards
from ray_ingest.source import DEFAULT_SAMPLE_BYTES, ReadItem, read_item
from ray_ingest.twin import INDEX, KEY, SHARD, ext_column
from ray_ingest.writer import (
    DatasetReport,
    ShardInfo,
    ShardWriter,
    bucket_dir,
    existing_shard,
    finish_dataset,
    prepare_output,
    shard_rel_path,
)

log = logging.getLogger(__name__)

#: Folder of the sample's wdinfo.json relative to the path it was read from ("" at the top).
LEAF = "__leaf__"
#: Aspect-ratio bucket of the sample's shard (``16_9``), "" outside ``aspect_ratio_*`` leaves.
BUCKET = "__bucket__"
#: Provenance columns of every row, in order.
PROVENANCE = (KEY, SHARD, INDEX, LEAF, BUCKET)
_SID = "__sid__"
#: Row columns the write path adds (output leaf, output shard path, position in it).
_OUT_LEAF, _OUT_PATH, _OUT_POS = "__out_leaf__", "__out_path__", "__out_pos__"
_SIZE = "__size__"
#: "Read the whole shard" for shards whose wdinfo has no per-shard counts.
_ALL = 2**62


def _modalities(modalities: Sequence[str] | str | None, keys: Sequence[str] | str | None,
                where: str) -> tuple[str, ...] | None:
    """``modalities=``, or the deprecated ``keys=`` spelling (DeprecationWarning)."""
    if keys is not None:
        if modalities is not None:
            raise ConfigError(f"{where}: pass modalities= (keys= is its deprecated alias), "
                              "not both")
        warnings.warn(f"{where}: keys= is deprecated, use modalities=", DeprecationWarning,
                      stacklevel=3)
        modalities = keys
    if modalities is None:
        return None
    if isinstance(modalities, str):
        modalities = [m for m in modalities.split(",") if m]
    out = tuple(modalities)
    if not out or len(set(out)) != len(out) or not all(isinstance(m, str) and m for m in out):
        raise ConfigError(f"{where}: modalities: expected distinct names, got {list(out)}")
    return out


# =========================================================================== reading


@attrs.frozen
class _Unit:
    """A slice of one shard: ``count`` samples from ``start`` (count None: to the end)."""

    shard: TarSample
    sid: int
    leaf: str
    start: int = 0
    count: int | None = None


def _schema(modalities: Sequence[str], with_sid: bool) -> pa.Schema:
    fields = [pa.field(KEY, pa.string()), pa.field(SHARD, pa.string()),
              pa.field(INDEX, pa.int64()), pa.field(LEAF, pa.string()),
              pa.field(BUCKET, pa.string())]
    if with_sid:
        fields.append(pa.field(_SID, pa.int64()))
    for m in modalities:
        fields += [pa.field(m, pa.binary()), pa.field(ext_column(m), pa.string())]
    return pa.schema(fields)


def _read_units(units: Sequence[_Unit], opts: ReadOptions, block_rows: int,
                schema: pa.Schema) -> Iterator[pa.Table]:
    """Generator behind one ReadTask: the loader's read path, its internal columns dropped."""
    for u in units:
        item = ReadItem(seq=0, sid=u.sid, start=u.start, count=_ALL if u.count is None else u.count)
        for table in read_item(u.shard, item, opts, block_rows, on_error="raise"):
            n = table.num_rows
            cols = {}
            for f in schema:
                if f.name == LEAF:
                    cols[LEAF] = pa.array([u.leaf] * n, pa.string())
                else:
                    cols[f.name] = table.column(f.name).cast(f.type)
            yield pa.table(cols, schema=schema)


class TwinTarsDatasource(Datasource):
    """One ReadTask per shard, per shard slice (``override_num_blocks`` above the shard count)
    or per run of whole shards (below it). No plan, no epochs: the catalog in order."""

    def __init__(self, units: Sequence[_Unit], modalities: Sequence[str], opts: ReadOptions,
                 block_rows: int = 64, num_blocks: int | None = None, with_sid: bool = False):
        super().__init__()
        self._units = tuple(units)
        self._modalities = tuple(modalities)
        self._opts = opts
        self._block_rows = block_rows
        self._num_blocks = num_blocks
        self._schema = _schema(modalities, with_sid)

    def get_name(self) -> str:
        return "TwinTars"

    def estimate_inmemory_data_size(self) -> int | None:
        if any(u.count is None for u in self._units):
            return None
        return sum(u.count for u in self._units) * DEFAULT_SAMPLE_BYTES

    def _tasks(self) -> list[list[_Unit]]:
        units = list(self._units)
        want = self._num_blocks
        if not want or want == len(units):
            return [[u] for u in units]
        if want < len(units):  # contiguous runs of whole shards
            bounds = np.linspace(0, len(units), want + 1).round().astype(int)
            return [units[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        if any(u.count is None for u in units):
            return [[u] for u in units]  # slicing needs per-shard counts
        target = max(1, math.ceil(sum(u.count for u in units) / want))
        return [[attrs.evolve(u, start=s, count=min(target, u.count - s))]
                for u in units for s in range(0, u.count, target)]

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        # NOTE: called several times per execution: it only builds closures (no I/O).
        tasks = []
        for group in self._tasks():
            counts = [u.count for u in group]
            rows = None if None in counts else sum(counts)
            if rows == 0:
                continue
            meta = BlockMetadata(
                num_rows=rows,
                size_bytes=None if rows is None else int(rows * DEFAULT_SAMPLE_BYTES),
                input_files=[u.shard.url(u.shard.modalities[0]) for u in group],
                exec_stats=None,
            )
            tasks.append(ReadTask(_bind(group, self._opts, self._block_rows, self._schema),
                                  meta, schema=self._schema,
                                  per_task_row_limit=per_task_row_limit))
        return tasks


def _bind(units: Sequence[_Unit], opts: ReadOptions, block_rows: int, schema: pa.Schema):
    units = tuple(units)

    def read_fn() -> Iterator[pa.Table]:
        return _read_units(units, opts, block_rows, schema)

    return read_fn


def _leaves(paths: Sequence[str], storage_options: Mapping[str, Any]) -> dict[str, str]:
    """wdinfo URL -> its folder relative to the path it was found under."""
    import fsspec

    out: dict[str, str] = {}
    for p in paths:
        for url in discover(p, dict(storage_options)):
            if p.endswith(".json"):
                out.setdefault(url, "")
                continue
            base = fsspec.core.url_to_fs(p, **storage_options)[1].rstrip("/")
            leaf = fsspec.core.url_to_fs(url_dirname(url), **storage_options)[1].rstrip("/")
            rel = posixpath.relpath(leaf, base)
            out.setdefault(url, "" if rel == "." else rel)
    return out


def _default_decode(modalities: Sequence[str]) -> DecodeConfig:
    return DecodeConfig(
        image_key="image" if "image" in modalities else None,
        caption_key="caption" if "caption" in modalities else None,
        embedding_key=next((m for m in ("umt5", "t5", "embedding") if m in modalities), None),
    )


class _DecodeColumns:
    """``ray_ingest.decode.Decoder`` (the loader's decode) keeping the public columns."""

    def __init__(self, cfg: DecodeConfig, seed: int):
        from ray_ingest.decode import Decoder

        self.decoder = Decoder(cfg, seed=seed, on_error="raise")
        self.decoded = tuple(k for k in (cfg.image_key, cfg.caption_key, cfg.embedding_key)
                             if k is not None)

    def __call__(self, batch: pa.Table) -> dict[str, Any]:
        out = self.decoder(batch)
        result: dict[str, Any] = {}
        for name in batch.column_names:
            if name == _SID:
                continue
            if name in self.decoded:
                result[name] = out[name]
            elif not (name.endswith("__ext") and name[: -len("__ext")] in self.decoded):
                result[name] = batch.column(name).to_numpy(zero_copy_only=False)
        return result


def read_twin_tars(
    paths: str | Sequence[str],
    *,
    modalities: Sequence[str] | str | None = None,
    keys: Sequence[str] | str | None = None,
    align: str = "strict",
    optional: Sequence[str] = (),
    index_path: str | None = None,
    use_index: bool = True,
    decode: bool | DecodeConfig = False,
    seed: int = 0,
    block_rows: int = 64,
    storage_options: Mapping[str, Any] | None = None,
    override_num_blocks: int | None = None,
    concurrency: int | None = None,
    num_cpus: float | None = None,
    memory: float | None = None,
    label_selector: dict[str, str] | None = None,
) -> ray.data.Dataset:
    """Open twin-tar datasets as a :class:`ray.data.Dataset`, one row per aligned sample.

    Columns: ``__key__`` (str), ``__shard__`` (the shard's ``data_list`` path), ``__index__``
    (position in the shard), ``__leaf__`` (folder of the shard's wdinfo.json relative to the
    path it was found under; "" at the top), ``__bucket__`` (aspect bucket such as ``16_9``,
    "" outside ``aspect_ratio_*`` folders), then per modality ``<modality>`` (the member's
    bytes) and ``<modality>__ext`` (its extension). Rows come in catalog order within a read
    task; set ``DataContext.execution_options.preserve_order = True`` for catalog order overall.

    Args:
        paths: wdinfo.json files or folders searched for them (local, ``gs://``, ``memory://``).
        modalities: modality folders to read, the first drives alignment (default: the first
            wdinfo's ``data_keys``).
        keys: deprecated alias of ``modalities``.
        align: ``strict`` | ``merge`` | ``index`` (as the loader, :mod:`ray_ingest.twin`).
        optional: modalities that may lack a sample (their value is then None).
        index_path: parquet key list for ``align="index"``.
        use_index: seek with the ``<tar>.idx.json`` key indexes when slicing shards.
        decode: True or a :class:`~ray_ingest.config.DecodeConfig`: decode with the loader's
            :class:`~ray_ingest.decode.Decoder` on an autoscaling actor pool
            (``pool_min..pool_max`` actors, ``num_cpus`` each; ``compute="tasks"``: in at
            most ``pool_max`` Ray tasks). The decoded columns replace the
            raw ones: image -> uint8 ``(H, W, 3)`` resized/cropped to the config's resolution
            or bucket shape (a Ray tensor column), caption -> str (JSON ``prompt`` or text),
            embedding -> the ``.npy`` array (a variable-shaped tensor column). Other modalities
            keep their bytes and extension. True picks ``image``/``caption``/``umt5`` from
            ``modalities`` with default settings.
        seed: seed of random crops when decoding (``DecodeConfig.crop="random"``).
        block_rows: rows per Arrow block yielded by a read task.
        storage_options: fsspec options (``token``, ``project``, ``endpoint_url``).
        override_num_blocks: number of read tasks: more than the shards cuts shards into
            slices (needs per-shard counts), fewer groups whole shards; default one per shard.
        concurrency: maximum concurrent read tasks.
        num_cpus: logical CPUs per read task (Ray's default 1; fractions avoid deadlocks on
            small clusters running Train workers too).
        memory: heap memory per read task, in bytes.
        label_selector: node labels for the read tasks (``{"pool": "cpu-decode"}``).

    Raises:
        CatalogError, ConfigError: bad paths or arguments (before anything runs). Read errors
        (missing tar, strict misalignment) surface when the Dataset executes, naming the shard.
    """
    so = dict(storage_options or {})
    mods = _modalities(modalities, keys, "read_twin_tars")
    if isinstance(paths, str):
        paths = [paths]
    paths = list(paths)
    if block_rows < 1:
        raise ConfigError(f"block_rows: expected >= 1, got {block_rows}")
    if override_num_blocks is not None and override_num_blocks < 1:
        raise ConfigError(f"override_num_blocks: expected >= 1, got {override_num_blocks}")
    opts = ReadOptions(align=align, optional=tuple(optional), use_index=use_index,
                       index_path=index_path, storage_options=so)
    catalog = load_catalog(paths, modalities=mods, storage_options=so)
    leaf_of = _leaves(paths, so)
    units: list[_Unit] = []
    for w in catalog.wdinfos:
        for shard in w.tar_files:
            units.append(_Unit(shard=shard, sid=len(units), leaf=leaf_of.get(w.source, ""),
                               count=shard.count))
    cfg = None
    if decode is True:
        cfg = _default_decode(catalog.modalities)
    elif isinstance(decode, DecodeConfig):
        cfg = decode
    elif decode is not False:
        raise ConfigError(f"decode: expected a bool or a DecodeConfig, got {decode!r}")
    if cfg is not None:
        wanted = [k for k in (cfg.image_key, cfg.caption_key, cfg.embedding_key) if k]
        unknown = [k for k in wanted if k not in catalog.modalities]
        if unknown:
            raise ConfigError(f"decode: modalities {unknown} are not read "
                              f"(modalities: {list(catalog.modalities)})")
    source = TwinTarsDatasource(units, catalog.modalities, opts, block_rows=block_rows,
                                num_blocks=override_num_blocks, with_sid=cfg is not None)
    ds = ray.data.read_datasource(
        source, override_num_blocks=override_num_blocks, concurrency=concurrency,
        num_cpus=num_cpus, memory=memory, label_selector=label_selector)
    if cfg is None:
        return ds
    return ds.map_batches(
        **decode_udf(cfg, _DecodeColumns, {"cfg": cfg, "seed": seed}),
        num_cpus=cfg.num_cpus,
        batch_format="pyarrow",
        udf_modifying_row_count=False,
        label_selector=dict(cfg.label_selector) or None,
    )


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
        return (batch.append_column(_OUT_LEAF, pa.array(_leaf_column(batch, self.bucket_column),
                                                        pa.string()))
                .append_column(_OUT_PATH, batch.column(SHARD).cast(pa.string()))
                .append_column(_OUT_POS, batch.column(INDEX).cast(pa.int64())))


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
        groups = group_into_shards(keys[start:end], sizes[start:end], shard_size,
                                   max_shard_bytes or 0)
        for shard_id, group in enumerate(groups):
            path = shard_rel_path(shard_id, part_size)
            for pos in range(len(group)):
                out_leaf.append(leaves[start])
                out_path.append(path)
                out_pos.append(pos)
        start = end
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


def _ingest_cause(exc: BaseException) -> IngestError | None:
    """The IngestError behind a failed Ray execution (one line, names the shard), if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ray.exceptions.RayTaskError):
            cause = getattr(cur, "cause", None)
            cur = cause if isinstance(cause, BaseException) else cur.__cause__
            continue
        if isinstance(cur, IngestError):
            if cur.args and isinstance(cur.args[0], str) and "\n" in cur.args[0]:
                # Ray Data appends retry advice on new lines; our messages are one line.
                cur.args = (cur.args[0].split("\n", 1)[0], *cur.args[1:])
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def write_twin_tars(
    ds: ray.data.Dataset,
    path: str,
    *,
    modalities: Sequence[str] | str | None = None,
    keys: Sequence[str] | str | None = None,
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

    * *keep* (default; rows with ``__shard__`` and ``__index__``, as :func:`read_twin_tars`
      gives): each sample goes to its source shard path at its index's rank, under its
      ``__leaf__`` folder, so ``write_twin_tars(read_twin_tars(x), y)`` reproduces ``x``'s tar
      names, members and order;
    * *re-shard* (``shard_size`` or ``max_shard_bytes``): samples in source order (``__leaf__``,
      ``__shard__``, ``__index__``) when rows carry it, else by key, cut into shards of
      ``shard_size`` samples or of at most ``max_shard_bytes`` member bytes (a new shard starts
      when one would exceed it; PiD's rule), numbered ``part_XXXXXX/NNNNNN.tar`` per leaf.
      This plans on the driver from a first pass over keys and sizes (the input runs twice:
      ``materialize()`` an expensive one first).

    ``bucket_column`` puts each sample under ``aspect_ratio_<value>/`` (a leaf with its own
    wdinfo.json) instead of its ``__leaf__``. The output does not depend on how Ray splits the
    data into blocks and tasks. Each tar is written as ``<name>.partial`` and renamed when its
    shard is complete; re-running the same write over a partial output keeps the shards whose
    key indexes already list the same members (names and sizes) and writes the others.

    Args:
        ds: the Dataset.
        path: output folder (local, ``gs://``); absent, empty or a previous run's output.
        modalities: modality columns to write, in ``data_keys`` order (the first drives).
        keys: deprecated alias of ``modalities``.
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
    mods = _modalities(modalities, keys, "write_twin_tars")
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
    exts = {str(k): str(v).lstrip(".") for k, v in (extensions or {}).items()}
    schema = ds.schema(fetch_if_missing=True)
    names = list(schema.names) if schema is not None else []
    missing = [c for c in (KEY, *mods, *([bucket_column] if bucket_column else []))
               if c not in names]
    if missing:
        raise ConfigError(f"write_twin_tars: the dataset lacks columns {missing} "
                          f"(it has {names})")
    keep = shard_size is None and max_shard_bytes is None
    if keep and not (SHARD in names and INDEX in names):
        raise ConfigError(f"write_twin_tars: rows have no {SHARD}/{INDEX} to keep their "
                          "sharding; pass shard_size or max_shard_bytes")
    if overwrite:
        prepare_output(path, overwrite=True, storage_options=so)
    if keep:
        assigned = ds.map_batches(_KeepSharding(bucket_column), batch_format="pyarrow",
                                  num_cpus=num_cpus)
    else:
        try:
            plan = _plan_reshard(ds, mods, bucket_column, shard_size, max_shard_bytes,
                                 part_size, num_cpus)
        except Exception as exc:
            cause = _ingest_cause(exc)
            if cause is None:
                raise
            raise cause from None
        assigned = ds.map_batches(_AssignPlanned(ray.put(plan)), batch_format="pyarrow",
                                  num_cpus=num_cpus)
    packed = assigned.groupby([_OUT_LEAF, _OUT_PATH], num_partitions=num_partitions).map_groups(
        _pack_shard, fn_kwargs={"modalities": mods, "extensions": exts},
        batch_format="pyarrow", num_cpus=num_cpus)
    packed.context.raise_original_map_exception = True  # our one-line errors, not a wrapper
    sink = TwinTarsDatasink(path, mods, so, chunk_size=shard_size)
    remote_args: dict[str, Any] = {}
    if num_cpus is not None:
        remote_args["num_cpus"] = num_cpus
    if memory is not None:
        remote_args["memory"] = memory
    try:
        packed.write_datasink(sink, ray_remote_args=remote_args, concurrency=concurrency)
    except Exception as exc:
        cause = _ingest_cause(exc)
        if cause is None:
            raise
        raise cause from None
    if sink.report is None:  # on_write_complete did not run: nothing reached the sink
        raise IngestError(f"write_twin_tars: the dataset has no rows; nothing written to {path}")
    return sink.report
