"""wdinfo.json reading (ours and PiD's), discovery order, and the errors that name the field."""

from __future__ import annotations

import json

import fsspec
import pytest

from ray_ingest.catalog.discovery import discover
from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.shard import DatasetInfo
from ray_ingest.catalog.wdinfo import read_wdinfo
from ray_ingest.errors import CatalogError, ConfigError
from ray_ingest.twintar.dataset import write_wdinfo
from tests.datagen import write_json, write_twin


def test_written_wdinfo_loads(tmp_path):
    url = write_wdinfo(str(tmp_path / "ds"), ["part_000000/000000.tar", "part_000000/000001.tar"],
                       [5, 3], ["image", "caption", "umt5"], chunk_size=5)
    doc = json.loads((tmp_path / "ds" / "wdinfo.json").read_text())
    assert doc == {"data_list": ["part_000000/000000.tar", "part_000000/000001.tar"],
                   "data_list_key_count": [5, 3], "total_key_count": 8, "chunk_size": 5,
                   "data_keys": ["image", "caption", "umt5"], "root": "."}
    assert (tmp_path / "ds" / "wdinfo.json").read_text().startswith('{\n  "data_list"')
    cat = load_catalog(url)
    assert cat.modalities == ("image", "caption", "umt5")
    assert cat.chunk_size == 5 and cat.total_key_count == 8 and cat.counts == (5, 3)
    assert [s.root for s in cat.shards] == [str(tmp_path / "ds")] * 2
    assert cat.shards[1].url("caption") == str(tmp_path / "ds/caption/part_000000/000001.tar")


def test_write_wdinfo_default_chunk_is_floored_mean(tmp_path):
    write_wdinfo(str(tmp_path), ["a.tar", "b.tar", "c.tar"], [4, 4, 3], ["image"])
    assert json.loads((tmp_path / "wdinfo.json").read_text())["chunk_size"] == 3


@pytest.mark.parametrize(("args", "match"), [
    (([], [], ["image"]), "data_list"),
    ((["a.tar"], [1, 2], ["image"]), "counts"),
    ((["a.tar", "a.tar"], [1, 2], ["image"]), "distinct"),
    ((["a.tar"], [1], []), "data_keys"),
    ((["a.tar"], [-1], ["image"]), "counts"),
])
def test_write_wdinfo_rejects(tmp_path, args, match):
    with pytest.raises(ConfigError, match=match):
        write_wdinfo(str(tmp_path), *args)


def test_pid_style_wdinfo(tmp_path):
    """Absolute root elsewhere, no chunk_size, data_keys: PiD's sharder output."""
    data_root = tmp_path / "data"
    write_twin(data_root, {"part_000000/000000.tar": {"image": ["a", "b", "c"],
                                                      "caption": ["a", "b", "c"]}}, wdinfo=False)
    wd = write_json(tmp_path / "meta" / "wdinfo.json", {
        "data_keys": ["caption", "image"],
        "data_list": ["part_000000/000000.tar", "part_000000/000001.tar",
                      "part_000000/000002.tar"],
        "data_list_key_count": [3, 3, 2],
        "root": str(data_root),
        "total_key_count": 8,
    })
    w = read_wdinfo(str(wd), modalities=("image", "caption"))
    assert w.chunk_size == 2  # int(8 / 3)
    assert w.data_keys == ("caption", "image")
    assert all(s.root == str(data_root) for s in w.tar_files)
    cat = load_catalog(str(wd))
    assert cat.modalities == ("caption", "image") and cat.chunk_size == 2
    cat = load_catalog(str(wd), modalities=["image", "caption"])
    assert cat.shards[0].modalities == ("image", "caption")
    assert cat.shards[0].url("image") == str(data_root / "image/part_000000/000000.tar")


def test_no_counts_falls_back_to_total(tmp_path):
    wd = write_json(tmp_path / "wdinfo.json", {"data_list": ["a.tar", "b.tar"],
                                               "total_key_count": 9})
    w = read_wdinfo(str(wd))
    assert w.chunk_size == 4 and [s.count for s in w.tar_files] == [None, None]
    with pytest.raises(CatalogError, match="data_list_key_count"):
        _ = load_catalog(str(wd)).counts


@pytest.mark.parametrize(("doc", "match"), [
    ({"total_key_count": 1}, "missing field 'data_list'"),
    ({"data_list": ["a.tar"]}, "missing field 'total_key_count'"),
    ({"data_list": [], "total_key_count": 0}, "'data_list' is empty"),
    ({"data_list": "a.tar", "total_key_count": 1}, "'data_list' must be list, got str"),
    ({"data_list": ["a.tar", 3], "total_key_count": 1}, r"data_list\[1\]"),
    ({"data_list": ["a.tar"], "total_key_count": True}, "'total_key_count' must be int"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "chunk_size": 0}, "'chunk_size' must be > 0"),
    ({"data_list": ["a.tar"], "total_key_count": 0}, "'chunk_size' must be > 0"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "data_list_key_count": [1, 2]},
     "has 2 entries, expected 1"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "data_list_key_count": [-1]},
     r"data_list_key_count\[0\]"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "root": 5}, "'root' must be str"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "data_keys": "image"}, "'data_keys' must be"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_wdinfo_names_file_and_field(tmp_path, doc, match):
    wd = write_json(tmp_path / "wdinfo.json", doc)
    with pytest.raises(CatalogError, match=match) as err:
        read_wdinfo(str(wd))
    assert str(err.value).startswith(str(wd))
    assert "\n" not in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(CatalogError, match="wdinfo.json not found"):
        read_wdinfo(str(tmp_path / "nope" / "wdinfo.json"))
    (tmp_path / "wdinfo.json").write_text("{ not json")
    with pytest.raises(CatalogError, match="malformed JSON"):
        read_wdinfo(str(tmp_path / "wdinfo.json"))
    with pytest.raises(CatalogError, match="no such file or folder"):
        load_catalog(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CatalogError, match="no wdinfo.json found"):
        load_catalog(str(tmp_path / "empty"))
    with pytest.raises(CatalogError, match="no dataset paths"):
        load_catalog([])


def test_discovery_is_sorted_and_buckets_are_tagged(tmp_path):
    for bucket in ("9_16", "16_9", "1_1"):
        write_wdinfo(str(tmp_path / f"aspect_ratio_{bucket}"), ["0.tar"], [2], ["image", "caption"])
    found = discover(str(tmp_path))
    assert found == sorted(found) and len(found) == 3
    cat = load_catalog(str(tmp_path))
    assert [s.bucket for s in cat.shards] == ["16_9", "1_1", "9_16"]
    assert [s.dset_id for s in cat.shards] == ["dset: 0"] * 3


def test_datasets_keep_given_order_and_fingerprint(tmp_path):
    a = write_wdinfo(str(tmp_path / "b_second"), ["0.tar"], [2], ["image", "caption"])
    b = write_wdinfo(str(tmp_path / "a_first"), ["0.tar", "1.tar"], [2, 1], ["image", "caption"])
    cat = load_catalog([a, DatasetInfo(wdinfo=(b,), per_dataset_modalities=("image",))])
    assert [(s.dset_id, s.path, s.modalities) for s in cat.shards] == [
        ("dset: 0", "0.tar", ("image", "caption")),
        ("dset: 1", "0.tar", ("image",)), ("dset: 1", "1.tar", ("image",))]
    assert load_catalog([a, b]).fingerprint == load_catalog([a, b]).fingerprint
    assert load_catalog([a, b]).fingerprint != load_catalog([b, a]).fingerprint


def test_memory_filesystem_wdinfo():
    fs = fsspec.filesystem("memory")
    try:
        url = write_wdinfo("memory://cat-test/ds", ["0.tar"], [4], ["image", "caption"])
        cat = load_catalog("memory://cat-test")
        assert cat.wdinfos[0].source == url
        assert cat.shards[0].url("image") == "memory://cat-test/ds/image/0.tar"
    finally:
        fs.rm("/cat-test", recursive=True)
