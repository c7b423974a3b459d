"""``ray-ingest convert --pickle-to-npy``: PiD-style datasets whose ``umt5`` members are pickled
numpy arrays become ``.npy`` datasets that train with ``decode.allow_pickle: false``.

The unpickler is checked against real pickles (numpy 2.x, protocols 0-5, numpy 1.x module
names) and hostile ones: a ``__reduce__`` that would create a marker file is refused, and the
marker never appears."""

from __future__ import annotations

import filecmp
import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.cli.main import main
from ray_ingest.errors import UnsafeFormatError
from ray_ingest.tools.convert import (
    RefusedPickle,
    convert_pickles,
    load_pickled_array,
)
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import read_shard
from ray_ingest.twintar.tario import (
    TarIndex,
    index_url,
    iter_members,
)
from tests.datagen import write_tar

MODS = ("image", "caption", "umt5")


class Hostile:
    """Unpickling this creates ``path``: stands for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


class HostileShell:
    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


ARRAYS = [
    np.zeros((3, 4), np.float16), np.arange(5, dtype=np.int64), np.array(True),
    np.ones((2, 3), np.float32, order="F"), np.arange(6).reshape(2, 3)[:, ::2],
    np.array(["ab", "c"]), np.array([b"x", b"yz"]), np.zeros(0), np.array([1 + 2j]),
    np.array(["2020-01-01"], dtype="datetime64[D]"), np.zeros(3, dtype=">f8"),
    np.zeros(2, dtype=[("a", "<f4"), ("b", ">i2")]), np.float32(3.5),
    np.random.default_rng(0).standard_normal((7, 64)).astype(np.float16),
]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_numpy_arrays_of_every_kind_load(protocol):
    for arr in ARRAYS:
        data = pickle.dumps(arr, protocol=protocol)
        got = load_pickled_array(data)
        want = np.asarray(pickle.loads(data))  # our own arrays: the stock unpickler is the oracle
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, arr)


def test_numpy_1x_module_names_load():
    data = pickle.dumps(np.arange(6, dtype=np.float32).reshape(2, 3), protocol=2)
    assert b"numpy._core.multiarray" in data
    old = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    np.testing.assert_array_equal(load_pickled_array(old), np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_hostile_and_non_array_pickles_are_refused(tmp_path, protocol):
    marker = tmp_path / "executed"
    refused = {
        "touch": Hostile(marker),
        "os.system": HostileShell(marker),
        "object array of a hostile": np.array([Hostile(marker), 1], dtype=object),
        "object array of ints": np.array([1, 2], dtype=object),
        "masked array": np.ma.masked_array([1, 2], mask=[0, 1]),
        "dict": {"a": np.zeros(2)},
        "list": [1.0, 2.0],
    }
    for what, obj in refused.items():
        with pytest.raises(RefusedPickle):
            load_pickled_array(pickle.dumps(obj, protocol=protocol))
        assert not marker.exists(), what
    # bytes(n) would allocate n bytes: refused before anything is allocated
    with pytest.raises(RefusedPickle, match="bytes"):
        load_pickled_array(b"c__builtin__\nbytes\n(I1000000000000\ntR.")
    with pytest.raises(RefusedPickle, match="latin1"):
        load_pickled_array(b"c_codecs\nencode\n(Vx\nVzlib\ntR.")


# --------------------------------------------------------------------------- datasets


def pidify(root: Path, hostile: tuple[str, Path] | None = None) -> dict[str, np.ndarray]:
    """Rewrite every umt5 tar PiD-style (tarfile, ``<key>.pkl`` pickles, protocol varying per
    shard, key index kept); returns the arrays by key. ``hostile`` = (key, marker path)."""
    arrays: dict[str, np.ndarray] = {}
    for i, tar in enumerate(sorted((root / "umt5").rglob("*.tar"))):
        members = []
        with open(tar, "rb") as f:
            for m in iter_members(f, str(tar)):
                arr = np.load(io.BytesIO(m.data))
                arrays[m.key] = arr
                obj = Hostile(hostile[1]) if hostile and m.key == hostile[0] else arr
                ext = "pickle" if i % 2 else "pkl"
                members.append((f"{m.key}.{ext}", pickle.dumps(obj, protocol=2 + i % 4)))
        write_tar(tar, members, index=True)
    return arrays


@pytest.fixture
def pid_data(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path / "pid"
    synth_dataset(str(root), samples=12, shard_size=4, seed=4, min_side=16, max_side=32,
                  modalities=MODS)
    return root, pidify(root)


def umt5_members(root: Path) -> dict[str, list[tuple[str, bytes]]]:
    out = {}
    for tar in sorted((root / "umt5").rglob("*.tar")):
        with open(tar, "rb") as f:
            out[str(tar.relative_to(root))] = [(m.name, m.data) for m in iter_members(f)]
    return out


def check_converted(root: Path, arrays: dict[str, np.ndarray]) -> None:
    """Only .npy members, same keys and order as the image tars, indexes and arrays right."""
    cat = load_catalog(str(root))
    seen = set()
    for shard in cat.shards:
        rows = list(read_shard(shard))
        for r in rows:
            assert r["umt5__ext"] == "npy"
            got = np.load(io.BytesIO(r["umt5"]), allow_pickle=False)
            np.testing.assert_array_equal(got, arrays[r["__key__"]])
            assert got.dtype == arrays[r["__key__"]].dtype
            seen.add(r["__key__"])
        url = shard.url("umt5")
        idx = TarIndex.from_dict(json.loads(Path(index_url(url)).read_text()))
        assert idx.tar_size == Path(url).stat().st_size
        assert [n.rsplit(".", 1)[0] for n in idx.names] == [r["__key__"] for r in rows]
    assert seen == set(arrays)
    assert not list(root.rglob("*.partial"))


@pytest.mark.ray
def test_in_place_conversion_trains_without_pickle(ray_local, pid_data):
    from ray_ingest.config import config_from_dict
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology

    root, arrays = pid_data
    images = {p: p.read_bytes() for p in (root / "image").rglob("*.tar")}
    report = convert_pickles(str(root), "umt5")
    assert (report.converted, report.pickles, report.unchanged) == (3, 12, 0)
    check_converted(root, arrays)
    assert all(p.read_bytes() == b for p, b in images.items())  # other modalities untouched
    # a re-run finds nothing to do and leaves the tars alone
    stamps = {p: p.stat().st_mtime_ns for p in (root / "umt5").rglob("*.tar")}
    again = convert_pickles(str(root), "umt5")
    assert (again.converted, again.unchanged) == (0, 3)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    # the loader, with decode.allow_pickle false, delivers the original arrays
    cfg = config_from_dict({
        "data": {"paths": [str(root)], "modalities": list(MODS)},
        "decode": {"resolution": 16, "embedding_key": "umt5", "allow_pickle": False,
                   "pool_min": 1, "pool_max": 1, "num_cpus": 0.25},
        "loader": {"batch_size": 4, "read_workers": 1, "read_num_cpus": 0.25,
                   "block_rows": 4, "shuffle": False, "equal_work": False},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, num_workers=1))
    delivered = 0
    for _, batches in loader.epochs(1):
        for b in batches:
            emb = b["umt5"]
            for j, key in enumerate(b.keys):
                got = emb[j] if isinstance(emb, list) else emb[j].numpy()
                np.testing.assert_array_equal(np.asarray(got), arrays[key])
                delivered += 1
    assert delivered == 12


def test_hostile_pickle_is_refused_and_never_runs(tmp_path, capsys):
    root = tmp_path / "pid"
    synth_dataset(str(root), samples=8, shard_size=4, seed=4, min_side=16, max_side=32,
                  modalities=MODS)
    marker = tmp_path / "executed"
    pidify(root, hostile=("s00000006", marker))
    before = umt5_members(root)
    with pytest.raises(UnsafeFormatError) as info:
        convert_pickles(str(root), "umt5")
    msg = str(info.value)
    assert msg.startswith("shard part_000000/000001.tar key s00000006: refusing to unpickle")
    assert "global builtins.getattr is not allowed" in msg  # Path.touch is getattr(Path, ...)
    assert not marker.exists()
    # the refused shard is untouched, nothing partial is left; the shard before it converted
    after = umt5_members(root)
    assert after["umt5/part_000000/000001.tar"] == before["umt5/part_000000/000001.tar"]
    assert [n for n, _ in after["umt5/part_000000/000000.tar"]] == [
        f"s0000000{i}.npy" for i in range(4)]
    assert not list(root.rglob("*.partial"))
    rc = main(["convert", str(root), "--modality", "umt5", "--pickle-to-npy"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "key s00000006" in err and "refusing to unpickle" in err
    assert not marker.exists()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.ray
def test_out_copy_with_ray_equals_local(ray_local, tmp_path, pid_data, capsys):
    root, arrays = pid_data
    original = umt5_members(root)
    outs = {}
    for flag in ("", "--ray"):
        out = tmp_path / f"out{flag}"
        args = ["convert", str(root), "--modality", "umt5", "--pickle-to-npy", "--out",
                str(out), "--json", *([flag] if flag else [])]
        assert main(args) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["converted"] == 3 and report["wdinfos"] == [str(out / "wdinfo.json")]
        outs[flag] = out
    a, b = outs[""], outs["--ray"]
    assert _files(a) == _files(b) == _files(root)
    _, mismatch, errors = filecmp.cmpfiles(a, b, _files(a), shallow=False)
    assert mismatch == errors == []
    check_converted(a, arrays)
    assert umt5_members(root) == original  # the source stays as it was
    for m in ("image", "caption"):
        _, mismatch, _ = filecmp.cmpfiles(root, a, [f for f in _files(root)
                                                    if f.startswith(m)], shallow=False)
        assert mismatch == []
    assert json.loads((a / "wdinfo.json").read_text())["root"] == "."
    # a re-run over a complete output has nothing left to do
    assert main(["convert", str(root), "--modality", "umt5", "--pickle-to-npy", "--out",
                 str(a), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["done"] == 3


def test_convert_cli_errors(tmp_path, pid_data, capsys):
    root, _ = pid_data
    assert main(["convert", str(root), "--modality", "umt5"]) == 2
    assert "--pickle-to-npy" in capsys.readouterr().err
    assert main(["convert", str(root), "--modality", "video", "--pickle-to-npy"]) == 2
    assert "'video' is not in data_keys" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main(["convert", str(root), "--modality", "umt5", "--pickle-to-npy", "--out",
                 str(tmp_path / "busy")]) == 2
    assert "holding other files" in capsys.readouterr().err


def test_members_without_a_key_are_counted(tmp_path):
    root = tmp_path / "pid"
    synth_dataset(str(root), samples=4, shard_size=4, seed=1, min_side=16, max_side=24,
                  modalities=MODS)
    tar = root / "umt5" / "part_000000" / "000000.tar"
    with tarfile.open(tar) as tf:
        members = [(m.name.replace(".npy", ".pkl"),
                    pickle.dumps(np.load(io.BytesIO(tf.extractfile(m).read()))))
                   for m in tf if m.isfile()]
    write_tar(tar, [("__meta__", b"{}"), *members])
    report = convert_pickles(str(root), "umt5")
    assert report.unnamed == 1 and report.pickles == 4
    with open(tar, "rb") as f:
        assert [m.name for m in iter_members(f)] == [f"s0000000{i}.npy" for i in range(4)]
