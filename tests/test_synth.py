"""Synthetic datasets: byte-identical per seed, decodable, declared sizes, usable layout."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ray_ingest.catalog.load import load_catalog
from ray_ingest.errors import ConfigError
from ray_ingest.tools.synth import (
    EMBED_DIM,
    make_sample,
    parse_aspect_ratios,
    sample_spec,
    synth_dataset,
)
from ray_ingest.twintar.layout import aspect_bucket
from ray_ingest.twintar.reader import read_shard
from ray_ingest.twintar.twin import KEY

MODS = ("image", "caption", "umt5")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_same_seed_same_bytes(tmp_path):
    kw = dict(samples=23, shard_size=5, seed=7, modalities=MODS, classify_aspect_ratio=True)
    synth_dataset(str(tmp_path / "a"), **kw)
    synth_dataset(str(tmp_path / "b"), **kw, num_workers=4)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a == b and any(k.endswith(".tar") for k in a)
    synth_dataset(str(tmp_path / "c"), **{**kw, "seed": 8})
    c = _files(tmp_path / "c")
    assert [v for k, v in sorted(c.items()) if k.endswith(".tar")] != [
        v for k, v in sorted(a.items()) if k.endswith(".tar")]


def test_samples_decode_to_declared_sizes(tmp_path):
    report = synth_dataset(str(tmp_path), samples=12, shard_size=5, seed=3, modalities=MODS,
                           min_side=32, max_side=96, aspect_ratios=((16, 9), (1, 1), (2, 3)))
    assert report.samples == 12 and report.shards == 3
    cat = load_catalog(str(tmp_path))
    assert cat.modalities == MODS and cat.counts == (5, 5, 2) and cat.chunk_size == 5
    rows = [r for s in cat.shards for r in read_shard(s)]
    assert [r[KEY] for r in rows] == [f"s{i:08d}" for i in range(12)]
    for i, r in enumerate(rows):
        spec = sample_spec(3, i, min_side=32, max_side=96,
                           aspect_ratios=((16, 9), (1, 1), (2, 3)))
        assert 32 <= max(spec.width, spec.height) <= 96
        with Image.open(io.BytesIO(r["image"])) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert im.size == (spec.width, spec.height)
            im.load()
        caption = json.loads(r["caption"])
        assert set(caption) == {"prompt", "prompt_medium", "prompt_short"}
        assert all(isinstance(v, str) and v for v in caption.values())
        assert f"{spec.width}x{spec.height}" in caption["prompt"]
        emb = np.load(io.BytesIO(r["umt5"]), allow_pickle=False)
        assert emb.dtype == np.float16 and emb.shape == (spec.embed_len, EMBED_DIM)
        assert r["image__ext"] == "jpg" and r["caption__ext"] == "json"
        assert r["umt5__ext"] == "npy"


def test_make_sample_matches_written_bytes(tmp_path):
    synth_dataset(str(tmp_path), samples=3, shard_size=3, seed=11)
    (shard,) = load_catalog(str(tmp_path)).shards
    for i, row in enumerate(read_shard(shard)):
        key, members = make_sample(11, i)
        assert row[KEY] == key
        assert {m: row[m] for m in members} == {m: data for m, (_, data) in members.items()}


def test_buckets_match_declared_sizes(tmp_path):
    report = synth_dataset(str(tmp_path), samples=40, shard_size=4, seed=5,
                           classify_aspect_ratio=True, modalities=("image",))
    cat = load_catalog(str(tmp_path))
    assert sum(report.buckets.values()) == 40 == sum(cat.counts)
    for shard in cat.shards:
        for row in read_shard(shard):
            with Image.open(io.BytesIO(row["image"])) as im:
                assert aspect_bucket(*im.size) == shard.bucket


def test_parse_aspect_ratios():
    assert parse_aspect_ratios("16:9, 1:1") == ((16, 9), (1, 1))
    for bad in ("16x9", "0:1", "a:b", ""):
        with pytest.raises(ConfigError, match="aspect_ratios"):
            parse_aspect_ratios(bad)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"samples": 0}, "samples"),
    ({"shard_size": 0}, "shard_size"),
    ({"min_side": 300}, "min_side"),
    ({"min_side": 4, "max_side": 6}, "min_side"),
    ({"modalities": ("image", "video")}, "modalities"),
    ({"modalities": ("image", "image")}, "modalities"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    args = {"samples": 4, "shard_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        synth_dataset(str(tmp_path), **args)


def test_memory_filesystem_round_trip():
    import fsspec

    from ray_ingest.tools.summary import (
        iter_records,
        summarize,
    )

    try:
        report = synth_dataset("memory://synth-test/ds", samples=7, shard_size=3,
                               classify_aspect_ratio=True, modalities=MODS)
        assert all(u.startswith("memory://synth-test/ds/aspect_ratio_") for u in report.wdinfos)
        summary = summarize("memory://synth-test")
        assert summary["samples"] == 7 and summary["modalities"] == list(MODS)
        recs = list(iter_records("memory://synth-test"))
        assert sorted(r["key"] for r in recs) == [f"s{i:08d}" for i in range(7)]
    finally:
        fsspec.filesystem("memory").rm("/synth-test", recursive=True)
