"""The columnar catalog: same fingerprint as the object catalog it replaced, lazy shard objects,
cheap pickling, the pyarrow fast parse, PiD seed-format counts, roots, and the renamed names."""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from ray_ingest.catalog import discovery as discovery_mod
from ray_ingest.catalog import shard as shard_mod
from ray_ingest.catalog import wdinfo as wdinfo_mod
from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.shard import (
    DatasetInfo,
    TarSample,
)
from ray_ingest.catalog.wdinfo import (
    Wdinfo,
    read_wdinfo,
)
from ray_ingest.cli.main import main
from ray_ingest.config import config_from_dict
from ray_ingest.errors import CatalogError, ConfigError
from ray_ingest.twintar.dataset import write_wdinfo
from ray_ingest.twintar.tario import index_url
from tests.datagen import write_json, write_twin

SHARD = "part_000000/000000.tar"


def _fingerprint_dataset(root: Path) -> list:
    """Two bucketed leaves (counts recorded) and a PiD file (no counts, odd paths)."""
    write_wdinfo(str(root / "a" / "aspect_ratio_16_9"),
                 ["part_000000/000000.tar", "part_000000/000001.tar"], [7, 3],
                 ["image", "caption"], chunk_size=7)
    write_wdinfo(str(root / "a" / "aspect_ratio_1_1"), ["part_000000/000000.tar"], [5],
                 ["image", "caption"])
    (root / "pid").mkdir(parents=True)
    (root / "pid" / "wdinfo.json").write_text(json.dumps({
        "data_keys": ["image", "caption"], "data_list": ["x/0.tar", "x/ü 1.tar", 'x/q"2.tar'],
        "total_key_count": 10, "root": "/elsewhere"}))
    return [str(root / "a"), DatasetInfo(wdinfo=(str(root / "pid"),))]


def test_fingerprint_unchanged_from_the_object_catalog(tmp_path):
    """Values computed by the previous (one TarSample per shard) implementation on this data:
    saved read states and tests/goldens/stream.json depend on them."""
    paths = _fingerprint_dataset(tmp_path)
    cat = load_catalog(paths)
    assert cat.fingerprint == "68f7ac9c5d337917"
    assert cat.fingerprint_doc() == {
        "keys": ["image", "caption"], "num_shards": 6, "num_samples": 15,
        "first_shard": "part_000000/000000.tar", "last_shard": 'x/q"2.tar'}
    assert load_catalog(paths, modalities=["caption"]).fingerprint == "48129c5ad7cc801c"
    assert load_catalog(str(tmp_path / "a")).fingerprint == "35aa0145865ed1f1"  # vectorised path
    assert pickle.loads(pickle.dumps(cat)).fingerprint == cat.fingerprint


def test_shards_are_a_lazy_read_only_sequence(tmp_path):
    cat = load_catalog(_fingerprint_dataset(tmp_path))
    shards = cat.shards
    assert len(shards) == len(cat) == 6
    assert shards[1] == TarSample("part_000000/000001.tar", str(tmp_path / "a/aspect_ratio_16_9"),
                                  ("image", "caption"), 3, "dset: 0", None, "16_9")
    assert shards[-1] == shards[5] == cat.shard(5) == cat.shard(-1)
    assert shards[-1].count is None and shards[-1].dset_id == "dset: 1"
    assert shards[1:3] == (shards[1], shards[2]) and shards[::-2] == (shards[5], shards[3],
                                                                       shards[1])
    assert [s.path for s in shards] == cat.paths.to_pylist()
    with pytest.raises(IndexError):
        shards[6]
    with pytest.raises(IndexError):
        shards[-7]
    assert list(cat.wdinfos[0].tar_files) == list(shards[:2])
    assert cat.url(3, "caption") == shards[3].url("caption")


def test_array_accessors(tmp_path):
    cat = load_catalog(_fingerprint_dataset(tmp_path))
    assert cat.paths.to_pylist()[2:4] == ["part_000000/000000.tar", "x/0.tar"]
    assert cat.known_counts.tolist() == [7, 3, 5, -1, -1, -1]
    assert cat.group_index.tolist() == [0, 0, 1, 2, 2, 2]
    assert cat.roots == (str(tmp_path / "a/aspect_ratio_16_9"),
                         str(tmp_path / "a/aspect_ratio_1_1"), "/elsewhere")
    assert cat.buckets.tolist() == ["16_9", "16_9", "1_1", "", "", ""]
    assert cat.dataset_index.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        cat.known_counts[0] = 1  # read-only


def test_counts_array_keeps_tuple_behaviour(tmp_path):
    write_wdinfo(str(tmp_path), ["a.tar", "b.tar", "c.tar"], [5, 3, 4], ["image"])
    counts = load_catalog(str(tmp_path)).counts
    assert counts == (5, 3, 4) and counts == [5, 3, 4] and counts != (5, 3)
    assert sum(counts) == 12 and type(sum(counts)) is int and type(counts[1]) is int
    assert (json.dumps({"n": sum(counts), "counts": list(counts)})
            == '{"n": 12, "counts": [5, 3, 4]}')
    assert type(np.asarray(counts)) is np.ndarray and counts.dtype == np.int64
    assert (counts[1:] == np.array([3, 4])).all()
    with pytest.raises(ValueError):
        counts[0] = 1


def test_pickle_ships_arrays_not_objects(tmp_path):
    n = 20_000
    write_wdinfo(str(tmp_path / "ds"),
                 [f"part_{i // 1000:06d}/{i % 1000:06d}.tar" for i in range(n)],
                 [i % 7 + 1 for i in range(n)], ["image", "caption"])
    cat = load_catalog(str(tmp_path / "ds"))
    data = pickle.dumps(cat, protocol=5)
    assert len(data) < 40 * n  # paths + counts + group ids, not 20,000 TarSample objects
    back = pickle.loads(data)
    assert list(back.counts) == list(cat.counts) and back.paths.equals(cat.paths)
    assert back.shard(12_345) == cat.shard(12_345)
    assert back.wdinfos[0].source == cat.wdinfos[0].source and len(back.wdinfos[0]) == n
    assert back.fingerprint == cat.fingerprint


GOOD_DOCS = {
    "counts": {"data_list": ["a.tar", "b/c.tar"], "data_list_key_count": [4, 2],
               "total_key_count": 6, "chunk_size": 4, "data_keys": ["image", "caption"],
               "root": "."},
    "pid": {"data_keys": ["caption", "image"], "data_list": ["a.tar", "b.tar", "c.tar"],
            "data_list_key_count": [3, 3, 2], "root": "/abs/x", "total_key_count": 8},
    "seed": {"data_list": ["a.tar", "b.tar"], "total_key_count": 10, "chunk_size": 5,
             "root": None, "extra": {"nested": [1, "x"]}},
    "no_chunk": {"data_list": ["a.tar", "b.tar"], "total_key_count": 9, "data_keys": []},
}
BAD_DOCS = [
    ({"data_list": ["a.tar", 3], "total_key_count": 1}, r"data_list\[1\]"),
    ({"data_list": [], "total_key_count": 0}, "'data_list' is empty"),
    ({"data_list": ["a.tar"], "total_key_count": True}, "'total_key_count' must be int"),
    ({"data_list": ["a.tar"], "total_key_count": 1.0}, "'total_key_count' must be int"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "chunk_size": 0}, "'chunk_size' must be > 0"),
    ({"data_list": ["a.tar"], "total_key_count": 0}, "'chunk_size' must be > 0"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "data_list_key_count": [1, 2]},
     "has 2 entries, expected 1"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "data_list_key_count": [-1]},
     r"data_list_key_count\[0\]"),
    ({"data_list": ["a.tar", ""], "total_key_count": 1}, r"data_list\[1\]"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "root": 5}, "'root' must be str"),
    ({"data_list": ["a.tar"], "total_key_count": 1, "data_keys": "image"}, "'data_keys' must be"),
    ([1, 2], "expected a JSON object"),
]


@pytest.mark.parametrize("parser", ["_scan_parse", "_fast_parse"])
@pytest.mark.parametrize("name", sorted(GOOD_DOCS))
def test_fast_parse_equals_the_json_path(tmp_path, monkeypatch, name, parser):
    wd = write_json(tmp_path / "aspect_ratio_4_3" / "wdinfo.json", GOOD_DOCS[name])
    slow = read_wdinfo(str(wd))
    monkeypatch.setattr(wdinfo_mod, "FAST_PARSE_BYTES", 0)
    results = []
    real = getattr(wdinfo_mod, parser)
    monkeypatch.setattr(wdinfo_mod, parser, lambda *a: results.append(real(*a)) or results[-1])
    other = {"_scan_parse": "_fast_parse", "_fast_parse": "_scan_parse"}[parser]
    monkeypatch.setattr(wdinfo_mod, other, lambda *a: None)  # each fast parser on its own
    fast = read_wdinfo(str(wd))
    # pyarrow cannot type the mixed list of "extra": that one falls back to json
    assert len(results) == 1
    assert (results[0] is None) == (parser == "_fast_parse" and name == "seed")
    for field in ("chunk_size", "total_key_count", "data_keys", "root", "wdinfo_root",
                  "modalities", "bucket", "count_source"):
        assert getattr(fast, field) == getattr(slow, field), field
    assert fast.paths.equals(slow.paths)
    assert (fast.counts is None) == (slow.counts is None)
    if fast.counts is not None:
        assert fast.counts.tolist() == slow.counts.tolist()
    assert Catalog.from_wdinfos([fast]).fingerprint == Catalog.from_wdinfos([slow]).fingerprint


@pytest.mark.parametrize(("doc", "match"), BAD_DOCS)
def test_fast_parse_keeps_every_error_message(tmp_path, monkeypatch, doc, match):
    monkeypatch.setattr(wdinfo_mod, "FAST_PARSE_BYTES", 0)
    wd = write_json(tmp_path / "wdinfo.json", doc)
    with pytest.raises(CatalogError, match=match) as err:
        read_wdinfo(str(wd))
    assert str(err.value).startswith(str(wd)) and "\n" not in str(err.value)


def test_legacy_constructors_still_work():
    shards = tuple(TarSample(f"{i}.tar", "/d", ("image",), 4) for i in (0, 1))
    cat = Catalog(shards=shards, wdinfos=(), chunk_size=4, modalities=("image",))
    assert cat.counts == (4, 4) and cat.modalities == ("image",) and cat.shards[1] == shards[1]
    info = Wdinfo(source="/d/wdinfo.json", tar_files=shards, total_key_count=8, chunk_size=4,
                  data_keys=("image",))
    cat = Catalog(shards=shards, wdinfos=(info,), chunk_size=4, modalities=("image",))
    assert cat.total_key_count == 8 and list(info.tar_files) == list(shards)
    missing = Catalog((TarSample("x.tar", "/d", ("image",), None),), (), 4)
    with pytest.raises(CatalogError, match="data_list_key_count"):
        missing.counts  # noqa: B018


# --------------------------------------------------------------------------- PiD seed format


def _seed_format(tmp_path: Path, counts: list[int], chunk: int, index: bool) -> Path:
    """PiD's seed-format wdinfo (data_list, total_key_count, chunk_size; absolute root)."""
    shards = {f"part_000000/{i:06d}.tar": {"image": [f"s{i}_{j}" for j in range(c)],
                                           "caption": [f"s{i}_{j}" for j in range(c)]}
              for i, c in enumerate(counts)}
    root = tmp_path / "ds"
    write_twin(root, shards, index=index, wdinfo=False)
    return write_json(root / "wdinfo.json", {"data_list": list(shards),
                                             "total_key_count": sum(counts),
                                             "chunk_size": chunk, "root": str(root)})


def test_seed_format_counts_from_chunk_size(tmp_path):
    wd = _seed_format(tmp_path, [4, 4, 4], 4, index=False)
    cat = load_catalog(str(wd))
    assert cat.counts == (4, 4, 4) and cat.wdinfos[0].count_source == "chunk_size"


def test_seed_format_counts_from_key_indexes(tmp_path, monkeypatch):
    wd = _seed_format(tmp_path, [4, 4, 3], 4, index=True)  # 11 != 4 x 3: chunk rule refused
    recorded = write_twin(tmp_path / "rec", {f"part_000000/{i:06d}.tar": {
        "image": [f"s{i}_{j}" for j in range(c)], "caption": [f"s{i}_{j}" for j in range(c)]}
        for i, c in enumerate([4, 4, 3])}, chunk_size=4)
    cat = load_catalog(str(wd))
    assert cat.known_counts.tolist() == [-1, -1, -1]  # nothing read at load time
    assert cat.counts == (4, 4, 3) and cat.wdinfos[0].count_source == "key index"
    assert cat.shard(2).count == 3
    assert cat.fingerprint == load_catalog(str(recorded)).fingerprint  # same data, same print
    back = pickle.loads(pickle.dumps(cat))  # ranks receive resolved counts: no index reads
    monkeypatch.setattr(discovery_mod, "_index_count", lambda *a: pytest.fail("re-read"))
    assert back.counts == (4, 4, 3)


def test_seed_format_without_counts_or_indexes_is_one_clear_error(tmp_path, monkeypatch):
    wd = _seed_format(tmp_path, [4, 4, 3], 4, index=False)
    cat = load_catalog(str(wd))  # info, cat and plan need no counts
    reads = []
    real = discovery_mod._index_count
    monkeypatch.setattr(discovery_mod, "_index_count", lambda *a: reads.append(1) or real(*a))
    for _ in range(2):
        with pytest.raises(CatalogError) as err:
            cat.counts  # noqa: B018
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(str(wd))
        for needle in ("'data_list_key_count' is missing", "total_key_count (11)",
                       "chunk_size (4) x 3 shards", index_url(str(tmp_path / "ds/image" / SHARD)),
                       f"ray-ingest index {tmp_path / 'ds'}"):
            assert needle in msg, (needle, msg)
    assert len(reads) <= 64  # one bounded batch, and not again on the second access


def test_index_command_writes_indexes_and_counts(tmp_path, capsys):
    wd = _seed_format(tmp_path, [4, 4, 3], 4, index=False)
    before = json.loads(wd.read_text())
    assert main(["index", str(wd.parent)]) == 0
    out = capsys.readouterr().out
    assert "6 indexes written, 0 kept; 11 samples; data_list_key_count written" in out
    doc = json.loads(wd.read_text())
    assert list(doc) == ["data_list", "data_list_key_count", "total_key_count", "chunk_size",
                         "root"]
    assert doc["data_list_key_count"] == [4, 4, 3] and {**doc} == {**before, **doc}
    assert not list(wd.parent.glob("*.tmp"))
    assert (tmp_path / "ds/caption" / (SHARD + ".idx.json")).exists()
    cat = load_catalog(str(wd))
    assert cat.counts == (4, 4, 3) and cat.wdinfos[0].count_source == "data_list_key_count"
    assert main(["index", str(wd), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["written"], rep["kept"], rep["wdinfos"][0]["counts"]) == (0, 6, "unchanged")
    assert main(["index", str(wd), "--force", "--no-counts", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 6


def test_index_reports_disagreeing_and_missing_modalities(tmp_path, capsys):
    wd = write_twin(tmp_path, {SHARD: {"image": ["a", "b"], "caption": ["a", "b", "c"]},
                               "part_000000/000001.tar": {"image": ["d"]}},
                    data_keys=["image", "caption"])
    assert main(["index", str(wd)]) == 0
    out = capsys.readouterr().out
    assert "caption: 1 tars missing" in out and "1 shards whose modalities hold different" in out
    (tmp_path / "image" / SHARD).unlink()
    rc = main(["index", str(wd)])
    err = capsys.readouterr().err
    assert rc == 2 and "1 of 2 image tars are missing" in err and err.count("\n") == 1


def test_loader_accepts_a_seed_format_catalog(tmp_path):
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan import Topology

    wd = _seed_format(tmp_path, [4, 4, 3], 4, index=True)
    cfg = config_from_dict({"data": {"paths": [str(wd)]}, "loader": {"batch_size": 2}})
    loader = IngestLoader(cfg, Topology(2, 1, cfg.loader.read_workers),
                          catalog=load_catalog(str(wd)))
    assert list(loader.catalog.counts) == [4, 4, 3]
    assert loader.state.dataset["num_samples"] == 11


# --------------------------------------------------------------------------- roots


def _moved(tmp_path: Path, keep_old: bool) -> tuple[Path, Path]:
    """A dataset whose wdinfo names its absolute root, copied elsewhere (old copy kept or not)."""
    old = tmp_path / "old"
    write_twin(old, {SHARD: {"image": ["a", "b"], "caption": ["a", "b"]}}, wdinfo=False)
    new = tmp_path / "new"
    write_twin(new, {SHARD: {"image": ["a", "b"], "caption": ["a", "b"]}}, wdinfo=False)
    if not keep_old:
        for p in sorted(old.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    wd = write_json(new / "wdinfo.json", {"data_list": [SHARD], "data_list_key_count": [2],
                                          "total_key_count": 2, "root": str(old)})
    return wd, old


def test_moved_dataset_error_names_both_places_and_the_setting(tmp_path, capsys):
    wd, old = _moved(tmp_path, keep_old=False)
    with pytest.raises(CatalogError) as err:
        load_catalog(str(wd))
    msg = str(err.value)
    assert str(old) in msg and str(wd.parent) in msg and "data.root: folder" in msg
    cat = load_catalog(str(wd), root="folder")
    assert cat.shard(0).root == str(wd.parent) and cat.roots == (str(wd.parent),)
    rc, err_text = main(["cat", str(wd)]), capsys.readouterr().err
    assert rc == 2 and "--root folder" in err_text and err_text.count("\n") == 1
    assert main(["cat", str(wd), "--root", "folder"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_copied_dataset_warns_once_and_info_shows_the_root(tmp_path, caplog, capsys, monkeypatch):
    wd, old = _moved(tmp_path, keep_old=True)
    monkeypatch.setattr(shard_mod, "_NOTICED", set())
    checks = []
    from fsspec.implementations.local import LocalFileSystem

    real = LocalFileSystem.exists
    monkeypatch.setattr(LocalFileSystem, "exists",
                        lambda self, p, **kw: checks.append(p) or real(self, p, **kw))
    with caplog.at_level(logging.WARNING, logger="ray_ingest.catalog"):
        for _ in range(3):
            cat = load_catalog(str(wd))
    assert cat.shard(0).root == str(old)  # PiD's rule by default
    notes = [r.getMessage() for r in caplog.records if "both hold" in r.getMessage()]
    assert len(notes) == 1 and str(old) in notes[0] and str(wd.parent) in notes[0]
    root_checks = [p for p in checks if p.endswith("/image")]
    assert len(root_checks) == 2 * 3  # one per candidate root per load, never per shard
    assert main(["info", str(wd)]) == 0
    out = capsys.readouterr().out
    assert f"root: {old} (data.root: wdinfo); the other choice: {wd.parent} (--root folder)" in out
    assert main(["info", str(wd), "--root", "folder", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["wdinfos"][0]
    assert (entry["root"], entry["wdinfo_root"], entry["folder"]) == (
        str(wd.parent), str(old), str(wd.parent))


def test_data_root_setting(tmp_path):
    cfg = config_from_dict({"data": {"paths": ["x"]}})
    assert cfg.data.root == "wdinfo"
    assert config_from_dict({"data": {"paths": ["x"], "root": "folder"}}).data.root == "folder"
    with pytest.raises(ConfigError, match="data.root: expected one of wdinfo, folder, got 'up'"):
        config_from_dict({"data": {"paths": ["x"], "root": "up"}})
    with pytest.raises(CatalogError, match="root: expected one of wdinfo, folder"):
        load_catalog(str(tmp_path), root="up")


# --------------------------------------------------------------------------- renamed names


def test_old_names_still_work_with_a_deprecation_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_mod, "_WARNED", set())
    a = write_wdinfo(str(tmp_path / "a"), ["0.tar"], [2], ["image", "caption"])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        cat = load_catalog(a, keys=["image"])
        assert cat.keys == cat.modalities == ("image",)
        assert cat.shards[0].keys == ("image",)
        assert TarSample("x.tar", "/r", keys=("caption",)).modalities == ("caption",)
        info = DatasetInfo(wdinfo=(a,), per_dataset_keys=("caption",))
        assert info.per_dataset_keys == info.per_dataset_modalities == ("caption",)
        assert shard_mod.DEFAULT_KEYS == shard_mod.DEFAULT_MODALITIES
        assert Catalog(shards=cat.shards, keys=("image",)).modalities == ("image",)
    names = {str(w.message).split(" is deprecated")[0] for w in got
             if issubclass(w.category, DeprecationWarning)}
    assert names == {"load_catalog(keys=...)", "Catalog.keys", "TarSample.keys",
                     "TarSample(keys=...)", "DatasetInfo(per_dataset_keys=...)",
                     "DatasetInfo.per_dataset_keys", "ray_ingest.catalog.DEFAULT_KEYS",
                     "Catalog(keys=...)"}
    with pytest.raises(CatalogError, match="both"):
        load_catalog(a, modalities=["image"], keys=["image"])


def test_config_accepts_old_data_names(caplog):
    with pytest.warns(DeprecationWarning, match="data.keys is deprecated; use data.modalities"):
        cfg = config_from_dict({"data": {"paths": ["x"], "keys": ["image", "umt5"],
                                         "optional_keys": "umt5"}})
    assert cfg.data.modalities == ("image", "umt5") and cfg.data.optional_modalities == ("umt5",)
    assert cfg.data.keys == ("image", "umt5") and cfg.data.optional_keys == ("umt5",)
    assert any("data.optional_keys is deprecated" in r.getMessage() for r in caplog.records)
    assert "keys" not in cfg.to_dict()["data"]
    with pytest.raises(ConfigError, match="data.keys: old name of data.modalities; got both"):
        config_from_dict({"data": {"paths": ["x"], "keys": ["a"], "modalities": ["a"]}})
    with pytest.raises(ConfigError, match="data.modalities: expected at least one modality"):
        config_from_dict({"data": {"paths": ["x"], "modalities": []}})


# --------------------------------------------------------------------------- the plan CLI


def test_plan_cli_imports_nothing_heavy(tmp_path):
    write_wdinfo(str(tmp_path), [f"{i}.tar" for i in range(10)], [3] * 10, ["image"])
    code = ("import sys; from ray_ingest.cli.main import main; "
            f"rc = main(['plan', {str(tmp_path)!r}, '--world-size', '2', '--num-workers', '2', "
            "'--json']); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'pandas'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.splitlines()[-1] == "[]"
    assert len(out.splitlines()) == 5  # 2 ranks x 2 workers, then the module list
