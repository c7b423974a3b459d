"""Any modality, any preprocessing, through the loader: every listed modality in every batch,
values intact and pixel-aligned, a hook given as an import path adding fields with the same
draws in every mode, across runs and across a stop and resume at any step."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.execution.local import LocalExecution
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.topology import Topology
from tests.support import multimodal
from tests.support.roundtrip import LoaderNode, run_save_load

EPOCHS = 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("multimodal")
    return str(multimodal.write_dataset(Path(root), samples=22, shard_size=6))


def _cfg(path: str, compute: str = "threads", **decode):
    return config_from_dict({
        "data": {"paths": [path], "modalities": list(multimodal.MODALITIES)},
        "decode": {"resolution": 40, "crop": "random", "flip": True, "compute": compute,
                   "transform": "tests.support.hooks:draws", "pool_min": 1, "pool_max": 2,
                   "num_cpus": 0.25, "threads": 2, **decode},
        "loader": {"batch_size": 4, "seed": 9, "read_workers": 2, "block_rows": 4,
                   "head_start_batches": 0},
    })


def _record(epoch: int, b) -> list:
    d = b.data
    return [epoch, b.step_in_epoch, list(b.sample_keys), d["label"].tolist(),
            hashlib.sha1(d["image"].numpy().tobytes()).hexdigest(),
            hashlib.sha1(d["depth"].numpy().tobytes()).hexdigest(),
            hashlib.sha1(d["mask"].numpy().tobytes()).hexdigest(),
            d["rng_draw"].tolist(), d["py_draw"].tolist(), d["np_draw"].tolist(),
            d["torch_draw"].tolist(), list(d["caption"]), list(d["key_seen"])]


def _check_batch(b) -> None:
    d = b.data
    assert {"image", "caption", "depth", "mask", "label", "rng_draw", "torch_draw"} <= set(d)
    assert d["image"].dtype == torch.uint8 and tuple(d["image"].shape) == (4, 40, 40, 3)
    assert d["depth"].dtype == torch.uint16 and tuple(d["depth"].shape) == (4, 40, 40)
    assert d["mask"].dtype == torch.uint8 and d["label"].dtype == torch.int64
    assert b.captions == d["caption"] == [f"sample {k}" for k in d["label"].tolist()]
    assert [f"k{k:05d}" for k in d["label"].tolist()] == b.sample_keys
    for i in range(4):
        img, dep, msk = (d[k][i].numpy() for k in ("image", "depth", "mask"))
        assert multimodal.alignment(img, dep, msk) > 0.95, b.sample_keys[i]


def _run(cfg, catalog, local: bool, state=None, stop_after: int | None = None):
    opener = LocalExecution.factory(cfg, catalog) if local else None
    loader = IngestLoader(cfg, Topology(2, 1, cfg.loader.read_workers), catalog=catalog,
                          state=state, open_execution=opener)
    out = []
    for epoch, batches in loader.epochs(EPOCHS):
        for b in batches:
            _check_batch(b)
            out.append(_record(epoch, b))
            if stop_after is not None and len(out) == stop_after:
                batches.close()
                return out, loader
    return out, loader


_BASE: dict[str, list] = {}


def _baseline(dataset: str) -> list:
    if dataset not in _BASE:
        cfg = _cfg(dataset)
        _BASE[dataset] = _run(cfg, load_catalog([dataset]), local=True)[0]
    return _BASE[dataset]


def test_every_modality_in_every_batch_and_the_same_draws_run_to_run(dataset):
    base = _baseline(dataset)
    assert len(base) >= 6
    again = _run(_cfg(dataset), load_catalog([dataset]), local=True)[0]
    assert again == base
    other = _run(_cfg(dataset), load_catalog([dataset]), local=False)[0]  # threads
    assert other == base


@pytest.mark.ray
@pytest.mark.parametrize("compute", ["process", "actors", "tasks"])
def test_every_mode_gets_the_same_batches_and_draws(ray_local, dataset, compute):
    got = _run(_cfg(dataset, compute), load_catalog([dataset]), local=False)[0]
    assert got == _baseline(dataset)


@pytest.mark.ray
def test_the_ray_data_engine_gets_the_same_batches_and_draws(ray_local, dataset):
    """``loader.fused_read: false``: the read tasks and decode actors of a Ray Data execution
    (Arrow blocks between them) carry every modality and every hook field too."""
    doc = _cfg(dataset, "actors").to_dict()
    doc["loader"]["fused_read"] = False
    got = _run(config_from_dict(doc), load_catalog([dataset]), local=False)[0]
    assert got == _baseline(dataset)


def _node(dataset: str) -> LoaderNode:
    """The loader taken batch by batch (the round-trip helper's stage)."""
    cfg = _cfg(dataset)
    catalog = load_catalog([dataset])
    loader = IngestLoader(cfg, Topology(2, 1, 2), catalog=catalog,
                          open_execution=LocalExecution.factory(cfg, catalog))
    return LoaderNode(loader, EPOCHS, _record)


def test_stop_and_resume_at_any_step_gives_the_same_draws(dataset):
    per_epoch = sum(1 for r in _baseline(dataset) if r[0] == 0)
    steps = [LoaderNode.next] * (len(_baseline(dataset)) + 1)
    res = run_save_load(lambda: _node(dataset), steps,
                        {"initial": 0, "mid-epoch": 1, "end-of-epoch": per_epoch,
                         "next-epoch": per_epoch + 1})
    before, after = res[0]
    assert (before + after)[:-1] == _baseline(dataset)


def test_optional_modality_carries_presence(tmp_path, dataset):
    """``depth`` optional and missing for some samples: the batch says which have it."""
    import shutil
    import tarfile

    from tests.support.datagen import write_tar

    root = tmp_path / "ds"
    shutil.copytree(Path(dataset).parent, root)
    tar = root / "depth" / "part_000000" / "000000.tar"
    with tarfile.open(tar) as tf:
        ms = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
    write_tar(tar, [m for i, m in enumerate(ms) if i % 2 == 0], index=True)
    cfg = config_from_dict({
        "data": {"paths": [str(root)], "modalities": list(multimodal.MODALITIES),
                 "optional_modalities": ["depth"], "align": "merge"},
        "decode": {"resolution": 40, "compute": "threads", "threads": 1},
        "loader": {"batch_size": 4, "seed": 9, "read_workers": 1},
    })
    loader = IngestLoader(cfg, Topology(1, 0, 1))
    seen = []
    for _, batches in loader.epochs(1):
        for b in batches:
            present = b.present["depth"]
            assert len(present) == 4
            for i, p in enumerate(present):
                assert (b.data["depth"][i] is not None) == p
                seen.append((b.sample_keys[i], p))
    by_key = dict(seen)
    assert by_key["k00000"] and not by_key["k00001"] and by_key["k00002"]
