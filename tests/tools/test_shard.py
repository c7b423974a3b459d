"""The sharding tool: intersection, drop report, grouping, layout, buckets, determinism."""

from __future__ import annotations

import filecmp
import json
import tarfile
from pathlib import Path

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.errors import ConfigError
from ray_ingest.tools.shard import (
    AMBIGUOUS,
    BEYOND_LIMIT,
    COLLISION,
    HIDDEN,
    NO_EXTENSION,
    NOT_EVERYWHERE,
    OTHER_FOLDER,
    SPECIAL,
    TOO_LARGE,
    UNREADABLE,
    shard_folders,
)
from ray_ingest.twintar.layout import aspect_bucket, pack_shards
from ray_ingest.twintar.reader import read_shard
from ray_ingest.twintar.twin import KEY
from tests.support.datagen import RAW_SIZES as SIZES
from tests.support.datagen import write_raw_folders as make_raw


def _read_all(out: Path):
    cat = load_catalog(str(out))
    return cat, [row for shard in cat.shards for row in read_shard(shard)]


def test_every_sample_once_byte_identical(tmp_path):
    raw = make_raw(tmp_path / "in")
    report = shard_folders(str(raw), str(tmp_path / "out"), shard_size=3)
    cat, rows = _read_all(tmp_path / "out")
    assert cat.modalities == ("image", "caption", "umt5")
    assert sorted(r[KEY] for r in rows) == [s[0] for s in SIZES]
    assert [r[KEY] for r in rows] == [s[0] for s in SIZES]  # sorted order
    for r in rows:
        for m in ("image", "caption", "umt5"):
            (src,) = (raw / m).glob(f"{r[KEY]}.*")
            assert r[m] == src.read_bytes()
            assert r[f"{m}__ext"] == src.suffix[1:]
    assert report.samples == 10 and report.shards == 4
    assert report.modalities == ("image", "caption", "umt5")
    assert report.dropped == {
        "image": {NOT_EVERYWHERE: 1, OTHER_FOLDER: 2, COLLISION: 2},
        "caption": {NOT_EVERYWHERE: 1, HIDDEN: 1, OTHER_FOLDER: 2, COLLISION: 2},
        "umt5": {NO_EXTENSION: 1, AMBIGUOUS: 2, SPECIAL: 1, COLLISION: 2},
    }
    # every input file is accounted for: written or dropped
    for m in ("image", "caption", "umt5"):
        files = [p for p in (raw / m).iterdir() if not p.is_dir()]
        assert len(files) == 10 + sum(report.dropped[m].values())


def test_wdinfo_counts_match_tars(tmp_path):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    shard_folders(str(raw), str(tmp_path / "out"), shard_size=4, part_size=2)
    doc = json.loads((tmp_path / "out" / "wdinfo.json").read_text())
    assert doc["data_list"] == ["part_000000/000000.tar", "part_000000/000001.tar",
                                "part_000001/000002.tar"]
    assert doc["chunk_size"] == 4 and doc["root"] == "."
    assert doc["data_keys"] == ["image", "caption", "umt5"]
    for m in doc["data_keys"]:
        counts = []
        for rel in doc["data_list"]:
            with tarfile.open(tmp_path / "out" / m / rel) as tf:
                counts.append(sum(1 for x in tf.getmembers() if x.isreg()))
            assert (tmp_path / "out" / m / (rel + ".idx.json")).exists()
        assert counts == doc["data_list_key_count"] == [4, 4, 2]
    assert doc["total_key_count"] == 10


def test_flat_names_with_part_size_zero(tmp_path):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    shard_folders(str(raw), str(tmp_path / "out"), shard_size=6, part_size=0)
    doc = json.loads((tmp_path / "out" / "wdinfo.json").read_text())
    assert doc["data_list"] == ["00000000.tar", "00000001.tar"]


def test_size_mode_follows_pid_rule(tmp_path):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    sizes = [(raw / "image" / f"{s[0]}.{'png' if i == 3 else 'jpg'}").stat().st_size
             for i, s in enumerate(SIZES)]
    budget = max(sizes) * 2 + 1
    shard_folders(str(raw), str(tmp_path / "out"), max_shard_size_mb=budget / 2**20)
    doc = json.loads((tmp_path / "out" / "wdinfo.json").read_text())
    want = pack_shards([s[0] for s in SIZES], sizes, None, budget)
    assert doc["data_list_key_count"] == [len(g) for g in want]
    assert all(sum(sizes[int(k[1:])] for k in g) <= budget for g in want)
    assert doc["chunk_size"] == int(10 / len(want))


def test_groups_oversize_sample_is_its_own_shard():
    assert pack_shards(list("abcde"), [1, 5, 1, 1, 1], None, 3) == [["a"], ["b"], ["c", "d", "e"]]
    assert pack_shards(list("abcde"), [0] * 5, 2, 0) == [["a", "b"], ["c", "d"], ["e"]]


def test_aspect_buckets(tmp_path):
    raw = make_raw(tmp_path / "in")
    report = shard_folders(str(raw), str(tmp_path / "out"), shard_size=100,
                           classify_aspect_ratio=True)
    want: dict[str, list[str]] = {}
    for stem, _, _, bucket in SIZES:
        want.setdefault(bucket, []).append(stem)
    assert report.buckets == {b: len(v) for b, v in want.items()}
    assert sorted(Path(u).parent.name for u in report.wdinfos) == sorted(
        f"aspect_ratio_{b}" for b in want)
    cat, rows = _read_all(tmp_path / "out")
    for shard in cat.shards:
        keys = [r[KEY] for r in read_shard(shard)]
        assert keys == want[shard.bucket]
    assert report.dropped["umt5"][SPECIAL] == 1


def test_unreadable_image_header_is_dropped_when_classifying(tmp_path):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    (raw / "image" / "s04.jpg").write_bytes(b"not an image")
    report = shard_folders(str(raw), str(tmp_path / "out"), shard_size=100,
                           classify_aspect_ratio=True)
    assert report.samples == 9
    assert report.dropped == {"image": {UNREADABLE: 1}, "caption": {OTHER_FOLDER: 1},
                              "umt5": {OTHER_FOLDER: 1}}


def test_aspect_bucket_rule():
    assert aspect_bucket(1920, 1080) == "16_9"
    assert aspect_bucket(1000, 1000) == "1_1"
    assert aspect_bucket(2520, 1080) == "21_9"
    assert aspect_bucket(1080, 1920) == "9_16"
    # a square is equally far from 2:1 and 1:2 in log space: the first listed wins
    assert aspect_bucket(50, 50, ((2, 1), (1, 2))) == "2_1"
    assert aspect_bucket(50, 50, ((1, 2), (2, 1))) == "1_2"
    with pytest.raises(ConfigError):
        aspect_bucket(0, 10)


def test_shuffle_is_seeded(tmp_path):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    orders = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        shard_folders(str(raw), str(tmp_path / name), shard_size=100, shuffle=True, seed=seed)
        orders.append([r[KEY] for r in _read_all(tmp_path / name)[1]])
    assert orders[0] == orders[1]
    assert sorted(orders[0]) == [s[0] for s in SIZES]
    assert orders[0] != [s[0] for s in SIZES] and orders[0] != orders[2]


def test_dataset_name_limit_and_file_size(tmp_path):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    (raw / "umt5" / "s01.npy").write_bytes(b"x" * 2**20)
    report = shard_folders(str(raw), str(tmp_path / "out"), shard_size=100,
                           dataset_name="ds", limit=5, max_file_size_mb=0.5)
    keys = [r[KEY] for r in _read_all(tmp_path / "out")[1]]
    assert keys == ["ds__s00", "ds__s02", "ds__s03", "ds__s04", "ds__s05"]
    assert report.dropped == {"image": {OTHER_FOLDER: 1, BEYOND_LIMIT: 4},
                              "caption": {OTHER_FOLDER: 1, BEYOND_LIMIT: 4},
                              "umt5": {TOO_LARGE: 1, BEYOND_LIMIT: 4}}
    with tarfile.open(tmp_path / "out" / "image" / "part_000000" / "000000.tar") as tf:
        assert tf.getnames()[2] == "ds__s03.png"  # original extension kept


def test_parallel_output_is_identical(tmp_path):
    raw = make_raw(tmp_path / "in")
    shard_folders(str(raw), str(tmp_path / "one"), shard_size=2, num_workers=1)
    shard_folders(str(raw), str(tmp_path / "many"), shard_size=2, num_workers=4)
    cmp = filecmp.dircmp(tmp_path / "one", tmp_path / "many")
    files = [p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file()]
    assert len(files) == 5 * 3 * 2 + 1
    assert not cmp.diff_files and not cmp.left_only and not cmp.right_only
    for rel in files:
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "many" / rel).read_bytes()


def test_output_protection(tmp_path):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    out = tmp_path / "out"
    shard_folders(str(raw), str(out), shard_size=100)
    with pytest.raises(ConfigError, match="not empty"):
        shard_folders(str(raw), str(out), shard_size=100)
    report = shard_folders(str(raw), str(out), shard_size=5, overwrite=True)
    assert report.shards == 2
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        shard_folders(str(raw), str(out), shard_size=5, overwrite=True)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"shard_size": 0}, "shard_size"),
    ({"max_shard_size_mb": 0}, "max_shard_size_mb"),
    ({"num_workers": 0}, "num_workers"),
    ({"size_based_on": "video"}, "size_based_on"),
    ({"dataset_name": "a.b"}, "dataset_name"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    raw = make_raw(tmp_path / "in", extra_anomalies=False)
    with pytest.raises(ConfigError, match=match):
        shard_folders(str(raw), str(tmp_path / "out"), **kwargs)


def test_no_usable_sample(tmp_path):
    (tmp_path / "in" / "image").mkdir(parents=True)
    (tmp_path / "in" / "caption").mkdir()
    (tmp_path / "in" / "image" / "a.jpg").write_bytes(b"1")
    (tmp_path / "in" / "caption" / "b.json").write_bytes(b"1")
    with pytest.raises(ConfigError, match="no sample is usable.*not in every folder=1"):
        shard_folders(str(tmp_path / "in"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="input folder not found"):
        shard_folders(str(tmp_path / "nope"), str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="no modality subfolders"):
        shard_folders(str(tmp_path / "in" / "image"), str(tmp_path / "out"))


@pytest.mark.ray
def test_shard_ray_output_is_byte_identical(ray_local, tmp_path, capsys):
    """`shard --ray` (Ray tasks, groups of shards) writes exactly what the local run writes,
    and reports the same drops."""
    from ray_ingest.cli.main import main

    raw = make_raw(tmp_path / "in")
    reports = {}
    for flag in ("", "--ray"):
        out = tmp_path / f"out{flag}"
        args = ["shard", str(raw), str(out), "--shard-size", "2", "--part-size", "3",
                "--classify-aspect-ratio", "--json"]
        if flag:
            args += [flag, "--shards-per-task", "2"]
        assert main(args) == 0
        report = json.loads(capsys.readouterr().out)
        report["wdinfos"] = [Path(u).relative_to(out).as_posix() for u in report["wdinfos"]]
        reports[flag] = (out, report)
    (a, ra), (b, rb) = reports[""], reports["--ray"]
    assert ra == rb and ra["samples"] == 10
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert any(f.endswith(".tar") for f in files)
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert mismatch == errors == []
