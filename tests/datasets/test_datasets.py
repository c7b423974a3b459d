"""read_twin_tars / write_twin_tars on the session's real local Ray (and gs:// through the GCS
emulator): rows equal what ``cat`` reads, a read -> write round trip reproduces the tars byte
for byte, re-sharding does not depend on how Ray splits the data, a killed or aborted write
leaves no partial tar under a final name and a re-run completes it without rewriting finished
shards."""

from __future__ import annotations

import filecmp
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.errors import ConfigError, IngestError
from ray_ingest.tools.summary import iter_records
from ray_ingest.tools.synth import (
    make_caption,
    make_sample,
    sample_spec,
    synth_dataset,
)
from ray_ingest.twintar.layout import aspect_bucket
from ray_ingest.twintar.reader import read_shard
from ray_ingest.twintar.tario import (
    TarIndex,
    index_url,
    iter_members,
)
from tests.support.fixtures_gcs import upload_tree

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
MODS = ("image", "caption", "umt5")
SEED, SAMPLES = 7, 30
#: Small, fast Ray settings for every call (fractional CPUs: no deadlock on 2 cores).
RAY = {"num_cpus": 0.25}


@pytest.fixture(scope="module")
def buckets(tmp_path_factory) -> Path:
    """30 samples in aspect-ratio leaves, shards of 4: uneven shards in several leaves."""
    root = tmp_path_factory.mktemp("twin") / "x"
    synth_dataset(str(root), samples=SAMPLES, shard_size=4, seed=SEED, min_side=16,
                  max_side=40, modalities=MODS, classify_aspect_ratio=True)
    return root


def _records(root, **kw) -> list[dict]:
    return list(iter_records([str(root)], **kw))


def _tree(root: Path, suffixes=(".tar", ".idx.json")) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.name.endswith(suffixes))


def _same_files(a: Path, b: Path) -> None:
    names = _tree(a)
    assert names == _tree(b)
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == []


def _ordered(ray_local):
    ctx = ray_local.data.DataContext.get_current()
    previous = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    return ctx, previous


# --------------------------------------------------------------------------- reading


def test_rows_are_the_loader_rows_in_catalog_order(ray_local, buckets):
    import ray_ingest

    ctx, previous = _ordered(ray_local)
    try:
        ds = ray_ingest.read_twin_tars(str(buckets), **RAY)
        assert ds.schema().names == [
            "__key__", "__shard__", "__index__", "__leaf__", "__bucket__",
            "image", "image__ext", "caption", "caption__ext", "umt5", "umt5__ext"]
        rows = ds.take_all()
        sliced_rows = ray_ingest.read_twin_tars(str(buckets), override_num_blocks=20,
                                                **RAY).take_all()
        grouped_rows = ray_ingest.read_twin_tars(str(buckets), override_num_blocks=2,
                                                 **RAY).take_all()
    finally:
        ctx.execution_options.preserve_order = previous
    recs = _records(buckets)
    assert [(r["__shard__"], r["__key__"], r["__index__"]) for r in rows] == [
        (c["shard"], c["key"], c["index"]) for c in recs]
    for r in rows:
        key, members = make_sample(SEED, int(r["__key__"][1:]), MODS, min_side=16, max_side=40)
        assert r["__key__"] == key
        for m in MODS:
            assert r[m] == members[m][1] and r[f"{m}__ext"] == members[m][0]
        spec = sample_spec(SEED, int(key[1:]), min_side=16, max_side=40)
        assert r["__bucket__"] == aspect_bucket(spec.width, spec.height)
        assert r["__leaf__"] == f"aspect_ratio_{r['__bucket__']}"
    assert sliced_rows == rows and grouped_rows == rows


def test_read_tasks_slice_or_group_shards(buckets):
    """override_num_blocks: slices of shards above the shard count, runs of shards below."""
    from ray_ingest.datasets.read import _schema, _tasks, _unit
    from ray_ingest.execution.raydata import TwinTarDatasource, _read_units
    from ray_ingest.twintar.reader import ReadOptions

    shards = load_catalog(str(buckets)).shards
    units = [_unit(s, i, "", s.count) for i, s in enumerate(shards)]

    def covered(tasks) -> list[tuple[int, int]]:
        return [(u.item.sid, i) for t in tasks for u in t
                for i in range(u.item.start, u.item.start + u.item.count)]

    everything = [(i, j) for i, s in enumerate(shards) for j in range(s.count)]
    for n, expect in ((None, len(shards)), (len(shards), len(shards)), (3, 3)):
        tasks = _tasks(units, n)
        assert len(tasks) == expect and covered(tasks) == everything
    tasks = _tasks(units, SAMPLES)
    assert len(tasks) == SAMPLES and covered(tasks) == everything
    source = TwinTarDatasource(_tasks(units, 3), ReadOptions(), schema=_schema(["image"], False))
    metas = [t.metadata for t in source.get_read_tasks(3)]
    assert sum(m.num_rows for m in metas) == SAMPLES
    # a wdinfo without per-shard counts: whole shards, read to the end
    unknown = [_unit(s, i, "", None) for i, s in enumerate(shards)]
    tasks = _tasks(unknown, SAMPLES)
    assert [[u.item.sid for u in t] for t in tasks] == [[i] for i in range(len(shards))]
    schema = _schema(["image"], with_sid=False)
    rows = [r for t in tasks for b in _read_units(t, ReadOptions(), 3, "raise", schema, {})
            for r in b.to_pylist()]
    assert [(r["__shard__"], r["__index__"]) for r in rows] == [
        (shards[i].path, j) for i, j in everything]


def test_modalities_as_a_string(ray_local, buckets):
    import ray_ingest

    ds = ray_ingest.read_twin_tars(str(buckets), modalities="caption", **RAY)
    assert [n for n in ds.schema().names if not n.startswith("__")] == [
        "caption", "caption__ext"]
    with pytest.raises(TypeError, match="keys"):
        ray_ingest.read_twin_tars(str(buckets), keys=["caption"])


def test_decoded_columns_come_from_the_loader_decoder(ray_local, buckets):
    import ray_ingest
    from ray_ingest.config import DecodeConfig

    cfg = DecodeConfig(resolution=16, embedding_modality="umt5", pool_min=1, pool_max=1,
                       num_cpus=0.25)
    rows = ray_ingest.read_twin_tars(str(buckets), decode=cfg, **RAY).take_all()
    assert len(rows) == SAMPLES
    for r in rows:
        i = int(r["__key__"][1:])
        spec = sample_spec(SEED, i, min_side=16, max_side=40)
        assert r["image"].shape == (16, 16, 3) and r["image"].dtype == np.uint8
        assert r["caption"] == json.loads(make_caption(spec, SEED))["prompt"]
        raw = make_sample(SEED, i, MODS, min_side=16, max_side=40)[1]["umt5"][1]
        import io

        np.testing.assert_array_equal(r["umt5"], np.load(io.BytesIO(raw)))
        assert "image__ext" not in r and "__sid__" not in r
    # decode.compute: tasks decodes the same columns in Ray tasks
    tasks = attrs.evolve(cfg, compute="tasks")
    by_key = {r["__key__"]: r for r in
              ray_ingest.read_twin_tars(str(buckets), decode=tasks, **RAY).take_all()}
    assert sorted(by_key) == sorted(r["__key__"] for r in rows)
    for r in rows:
        t = by_key[r["__key__"]]
        assert r["caption"] == t["caption"]
        np.testing.assert_array_equal(r["image"], t["image"])


def test_every_modality_and_the_hook_as_decoded_columns(ray_local, tmp_path):
    """The loader's decoders and hook in read_twin_tars: depth uint16 and mask aligned with the
    image, label an int, the hook's fields, the same values as the Decoder gives directly."""
    import ray_ingest
    from ray_ingest.config import DecodeConfig
    from ray_ingest.decode.decoder import Decoder
    from tests.decode.test_modalities import block
    from tests.support import multimodal

    multimodal.write_dataset(tmp_path, samples=10, shard_size=5)
    cfg = DecodeConfig(resolution=24, crop="random", pool_min=1, pool_max=1, num_cpus=0.25)
    ctx = __import__("ray").data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    try:
        rows = ray_ingest.read_twin_tars(str(tmp_path), decode=cfg, seed=3,
                                         transform="tests.support.hooks:draws", **RAY).take_all()
    finally:
        ctx.execution_options.preserve_order = False
    assert [r["__key__"] for r in rows] == [f"k{i:05d}" for i in range(10)]
    direct = Decoder(attrs.evolve(cfg, transform="tests.support.hooks:draws"), seed=3)(
        block(range(10), __epoch__=[0] * 10, __sid__=[i // 5 for i in range(10)],
              __index__=[i % 5 for i in range(10)], __shard__=["part_000000/000000.tar"] * 10))
    for i, r in enumerate(rows):
        assert r["depth"].dtype == np.uint16 and r["depth"].shape == (24, 24)
        assert multimodal.alignment(r["image"], r["depth"], r["mask"]) > 0.95
        assert int(r["label"]) == i and r["caption"] == f"sample {i}"
        assert "depth__ext" not in r and "__error__" not in r
        np.testing.assert_array_equal(r["image"], direct["image"][i])
        np.testing.assert_array_equal(r["rng_draw"], direct["rng_draw"][i])


# --------------------------------------------------------------------------- writing


def test_round_trip_reproduces_the_tars_byte_for_byte(ray_local, buckets, tmp_path):
    """write_twin_tars(read_twin_tars(x), y): same tar names, members, order and payloads
    (checked with `cat`); the tars, written by the same writer, are even byte-identical."""
    import ray_ingest

    ds = ray_ingest.read_twin_tars(str(buckets), **RAY)
    y = tmp_path / "y"
    report = ray_ingest.write_twin_tars(ds, str(y), modalities=MODS, num_partitions=4, **RAY)
    assert report.samples == SAMPLES and report.kept == ()
    assert len(report.written) == report.shards == len(load_catalog(str(buckets)).shards)
    assert _records(y) == _records(buckets)
    _same_files(buckets, y)
    assert not list(y.rglob("*.partial"))
    # the same write again: every shard is complete already and kept as it is
    again = ray_ingest.write_twin_tars(ds, str(y), modalities=MODS, num_partitions=2, **RAY)
    assert again.written == () and again.kept == report.written


def test_reshard_does_not_depend_on_block_split(ray_local, buckets, tmp_path):
    import ray_ingest

    base = ray_ingest.read_twin_tars(str(buckets), **RAY)
    rows = base.take_all()
    random.Random(3).shuffle(rows)  # other order, other blocks (7 instead of one per shard)
    shuffled = ray_local.data.from_items(rows, override_num_blocks=7)
    outs = []
    for i, ds in enumerate((base, shuffled)):
        out = tmp_path / f"r{i}"
        report = ray_ingest.write_twin_tars(ds, str(out), modalities=MODS, shard_size=3,
                                            part_size=2, num_partitions=3 + i, **RAY)
        outs.append((out, report))
    (a, ra), (b, rb) = outs
    _same_files(a, b)
    assert ra.samples == rb.samples == SAMPLES
    # source order (leaf, shard, index), cut into shards of 3 per leaf
    recs = _records(buckets)
    by_leaf: dict[str, list[str]] = {}
    for wd in sorted(buckets.rglob("wdinfo.json")):
        leaf = wd.parent.name
        by_leaf[leaf] = [r["key"] for r in _records(wd)]
    for leaf, keys in by_leaf.items():
        got = [r["key"] for r in _records(a / leaf / "wdinfo.json")]
        assert got == keys
        doc = json.loads((a / leaf / "wdinfo.json").read_text())
        n = len(keys)
        assert doc["data_list_key_count"] == [3] * (n // 3) + ([n % 3] if n % 3 else [])
        assert doc["chunk_size"] == 3 and doc["data_list"][0] == "part_000000/000000.tar"
    assert sorted(r["key"] for r in recs) == sorted(k for ks in by_leaf.values() for k in ks)


def test_write_from_a_computed_dataset(ray_local, tmp_path):
    """Any Dataset: key order, bytes / str / numpy columns, extensions, bucket leaves."""
    import io

    import ray_ingest

    items = [{"__key__": f"k{i:02d}", "jpg": bytes([i]) * (10 + i), "text": f"caption {i}",
              "emb": np.full((1 + i % 3, 3), i, np.float32), "ar": "16_9" if i % 3 else "1_1"}
             for i in reversed(range(10))]
    ds = ray_local.data.from_items(items, override_num_blocks=4)
    out = tmp_path / "w"
    report = ray_ingest.write_twin_tars(ds, str(out), modalities=["jpg", "text", "emb"],
                                        max_shard_bytes=120, bucket_column="ar",
                                        extensions={"jpg": "jpg"}, part_size=0,
                                        num_partitions=2, **RAY)
    assert sorted(Path(u).parent.name for u in report.wdinfos) == [
        "aspect_ratio_16_9", "aspect_ratio_1_1"]
    for leaf, want in (("aspect_ratio_16_9", [i for i in range(10) if i % 3]),
                       ("aspect_ratio_1_1", [0, 3, 6, 9])):
        cat = load_catalog(str(out / leaf))
        rows = [r for s in cat.shards for r in read_shard(s)]
        assert [r["__key__"] for r in rows] == [f"k{i:02d}" for i in want]  # key order
        assert all(s.path.endswith(".tar") and "/" not in s.path for s in cat.shards)
        for r in rows:
            i = int(r["__key__"][1:])
            assert r["jpg"] == bytes([i]) * (10 + i) and r["jpg__ext"] == "jpg"
            assert r["text"] == f"caption {i}".encode() and r["text__ext"] == "txt"
            assert r["emb__ext"] == "npy"
            np.testing.assert_array_equal(np.load(io.BytesIO(r["emb"])),
                                          np.full((1 + i % 3, 3), i, np.float32))
        # size mode: a shard never exceeds 120 member bytes unless it holds one sample
        for s in cat.shards:
            sizes = [sum(len(r[m]) for m in ("jpg", "text", "emb"))
                     for r in read_shard(s)]
            assert len(sizes) == 1 or sum(sizes) <= 120


def test_write_errors_name_the_problem(ray_local, buckets, tmp_path):
    import ray_ingest

    ds = ray_local.data.from_items([{"__key__": "a", "image": b"x"}])
    with pytest.raises(ConfigError, match=r"lacks columns \['caption'\]"):
        ray_ingest.write_twin_tars(ds, str(tmp_path / "a"), modalities=["image", "caption"])
    with pytest.raises(ConfigError, match="no __shard__/__index__ to keep"):
        ray_ingest.write_twin_tars(ds, str(tmp_path / "b"), modalities=["image"])
    with pytest.raises(ConfigError, match="shard_size or max_shard_bytes, not both"):
        ray_ingest.write_twin_tars(ds, str(tmp_path / "c"), modalities=["image"],
                                   shard_size=1, max_shard_bytes=1)
    dup = ray_local.data.from_items([{"__key__": "a", "image": b"x"}] * 2)
    with pytest.raises(IngestError, match="'a' occurs more than once"):
        ray_ingest.write_twin_tars(dup, str(tmp_path / "d"), modalities=["image"],
                                   shard_size=5, extensions={"image": "bin"}, **RAY)
    report = ray_ingest.write_twin_tars(ds, str(tmp_path / "e"), modalities="image",
                                        shard_size=5, extensions={"image": "bin"},
                                        num_partitions=1, **RAY)
    assert report.samples == 1


# --------------------------------------------------------------------------- crash safety


def test_killed_writer_leaves_no_tar_under_a_final_name(tmp_path):
    """SIGKILL in the middle of a shard: only ``.partial`` files remain; readers and a re-run
    never mistake them for a shard."""
    leaf = tmp_path / "ds"
    code = f"""
import os, signal
from ray_ingest.twintar.writer import write_shard

def samples():
    for i in range(6):
        if i == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        yield f"k{{i}}", {{"image": ("jpg", b"x" * 5000), "caption": ("txt", b"c")}}

write_shard({str(leaf)!r}, "part_000000/000000.tar", ["image", "caption"], samples())
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    files = sorted(str(p.relative_to(leaf)) for p in leaf.rglob("*") if p.is_file())
    assert files == ["caption/part_000000/000000.tar.partial",
                     "image/part_000000/000000.tar.partial"]
    assert (leaf / "image/part_000000/000000.tar.partial").stat().st_size >= 3 * 5000
    from ray_ingest.twintar.writer import write_shard

    write_shard(str(leaf), "part_000000/000000.tar", ["image", "caption"],
                [(f"k{i}", {"image": ("jpg", b"x" * 5000), "caption": ("txt", b"c")})
                 for i in range(6)])
    assert not list(leaf.rglob("*.partial"))
    with open(leaf / "image/part_000000/000000.tar", "rb") as f:
        assert [m.key for m in iter_members(f)] == [f"k{i}" for i in range(6)]


def _complete_tars(root: Path) -> dict[str, tuple[int, int]]:
    """Every tar under a final name must be whole and match its key index."""
    out = {}
    for tar in sorted(root.rglob("*.tar")):
        idx = TarIndex.from_dict(json.loads(Path(index_url(str(tar))).read_text()))
        with open(tar, "rb") as f:
            members = list(iter_members(f, str(tar), read_data=False))
        assert [m.name for m in members] == list(idx.names)
        assert tar.stat().st_size == idx.tar_size
        st = tar.stat()
        out[str(tar.relative_to(root))] = (st.st_ino, st.st_mtime_ns)
    return out


def test_aborted_write_resumes_without_rewriting_finished_shards(ray_local, tmp_path):
    import ray_ingest

    x = tmp_path / "x"
    synth_dataset(str(x), samples=16, shard_size=2, seed=5, min_side=16, max_side=24,
                  part_size=2)  # shards 0..7 in part_000000..part_000003
    ds = ray_ingest.read_twin_tars(str(x), **RAY)
    y = tmp_path / "y"
    obstacle = y / "caption" / "part_000002"  # a file where shards 4 and 5 need a folder
    obstacle.parent.mkdir(parents=True)
    obstacle.write_text("in the way")
    # one partition and one write task at a time: shards are written in path order
    with pytest.raises(IngestError, match=r"shard part_000002/000004\.tar: cannot create"):
        ray_ingest.write_twin_tars(ds, str(y), modalities=["image", "caption"],
                                   num_partitions=1, concurrency=1, **RAY)
    finished = _complete_tars(y)
    shards = {p.split("/", 1)[1] for p in finished}
    assert shards == {f"part_00000{i // 2}/00000{i}.tar" for i in range(4)}
    assert len(finished) == 2 * len(shards)  # image and caption of each
    assert not (y / "wdinfo.json").exists()
    obstacle.unlink()
    report = ray_ingest.write_twin_tars(ds, str(y), modalities=["image", "caption"],
                                        num_partitions=3, **RAY)
    assert set(report.kept) == shards
    assert set(report.written) == {f"part_00000{i // 2}/00000{i}.tar" for i in range(4, 8)}
    after = _complete_tars(y)
    assert {p: after[p] for p in finished} == finished  # same inode, same mtime: not rewritten
    _same_files(x, y)
    assert _records(y) == _records(x)


# --------------------------------------------------------------------------- gs://


@pytest.mark.gcs
@pytest.mark.timeout(180)
def test_gcs_round_trip(ray_local, gcs_server, tmp_path):
    import fsspec

    import ray_ingest

    x = tmp_path / "x"
    synth_dataset(str(x), samples=8, shard_size=4, seed=3, min_side=16, max_side=24)
    so = gcs_server.storage_options
    src = gcs_server.url("dataset_api", "x")
    upload_tree(x, src, so)
    ds = ray_ingest.read_twin_tars(src, storage_options=so, **RAY)
    dst = gcs_server.url("dataset_api", "y")
    report = ray_ingest.write_twin_tars(ds, dst, modalities=["image", "caption"],
                                        storage_options=so, num_partitions=2, **RAY)
    assert report.samples == 8 and report.wdinfos == (f"{dst}/wdinfo.json",)
    assert list(iter_records([dst], storage_options=so)) == _records(x)
    fs = fsspec.filesystem("gs", **so)
    fs.invalidate_cache()
    written = sorted(p.removeprefix(dst.removeprefix("gs://") + "/")
                     for p in fs.find(dst.removeprefix("gs://")))
    assert written == sorted(["wdinfo.json", *_tree(x)])  # no .partial left
    for name in _tree(x):
        assert fs.cat_file(f"{dst.removeprefix('gs://')}/{name}") == (x / name).read_bytes()
