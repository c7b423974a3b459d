"""Golden batch sequences: the loader delivers the same data, bit for bit, across redesigns.

Recorded once from the loader as it was before the stream was rebuilt as stages and one Ray Data
execution per job (``tests/goldens/stream.json``); every case must still reproduce them: keys,
shard ids, indices, pads, buckets, skips and the sha1 of every image tensor, per batch, per rank.

Every case also runs with the Ray edge replaced by the same read and decode code in this process
(ray_ingest/execution/local.py): the loader's other stages reproduce the goldens without a cluster;
and on ``decode.compute: threads`` (ray_ingest/execution/threads.py), the decode path of small
nodes.

Re-record only on purpose (a deliberate change of the delivered data), with
``RAY_INGEST_WRITE_GOLDENS=1 .venv/bin/python -m pytest tests/loader/test_goldens.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.execution.local import LocalExecution
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from tests.support.datagen import write_tar

GOLDEN = Path(__file__).parents[1] / "goldens" / "stream.json"
#: "ray" (the rank's decode actors, ray_ingest/execution/pool.py), "process" (its companion
#: process), "tasks" (``decode.compute: tasks``), "data" (Ray Data read tasks and decode actors,
#: ``loader.fused_read: false``), "local" (ray_ingest/execution/local.py) or "threads"
#: (``decode.compute: threads``, the loader's own in-process path), set per test.
ENGINE = ["ray"]
WRITE = os.environ.get("RAY_INGEST_WRITE_GOLDENS") == "1"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> str:
    """8 shards, the last one short (7 x 20 + 10)."""
    out = str(tmp_path_factory.mktemp("golden") / "plain")
    synth_dataset(out, samples=150, shard_size=20, seed=5, min_side=32, max_side=48)
    return out


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("golden") / "buckets")
    synth_dataset(out, samples=120, shard_size=10, seed=2, min_side=48, max_side=96,
                  classify_aspect_ratio=True)
    return out


@pytest.fixture(scope="module")
def corrupt(plain, tmp_path_factory) -> str:
    """``plain`` with two undecodable JPEGs (shard 2 position 3, shard 5 position 0)."""
    out = str(tmp_path_factory.mktemp("golden") / "corrupt")
    shutil.copytree(plain, out)
    for shard, pos in ((2, 3), (5, 0)):
        path = Path(out) / "image" / "part_000000" / f"{shard:06d}.tar"
        with tarfile.open(path) as tf:
            members = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
        members[pos] = (members[pos][0], b"\xff\xd8 not a jpeg")
        write_tar(path, members, index=True)
    return out


def _cfg(path: str, decode: dict[str, Any] | None = None, **loader: Any):
    if ENGINE[0] in RAY_ENGINES:  # the Ray edge alone (the head start is a test of its own)
        loader.setdefault("head_start_batches", 0)
    if ENGINE[0] == "data":
        loader.setdefault("fused_read", False)
    compute = {"tasks": "tasks", "threads": "threads", "process": "process"}.get(ENGINE[0],
                                                                               "actors")
    return config_from_dict({
        "data": {"paths": [path]},
        "decode": {"resolution": 24, "pool_min": 1, "pool_max": 2, "num_cpus": 0.25,
                   "compute": compute, **(decode or {})},
        "loader": {"batch_size": 8, "read_workers": 2, "seed": 11, "block_rows": 8,
                   "read_num_cpus": 0.25, **loader},
    })


def _record(epoch: int, b) -> list[Any]:
    return [epoch, b.step_in_epoch, b.bucket, list(b.sample_keys), list(b.sids), list(b.indices),
            list(b.pads), [list(s) for s in b.skipped],
            hashlib.sha1(b["image"].numpy().tobytes()).hexdigest()]




def _run(cfg, topo: Topology, epochs: int, state=None, stop_after: int | None = None,
         catalog=None) -> tuple[list[list[Any]], IngestLoader]:
    catalog = catalog or load_catalog(list(cfg.data.paths))
    opener = LocalExecution.factory(cfg, catalog) if ENGINE[0] == "local" else None
    loader = IngestLoader(cfg, topo, catalog=catalog, state=state, open_execution=opener)
    out: list[list[Any]] = []
    for epoch, batches in loader.epochs(epochs):
        for b in batches:
            out.append(_record(epoch, b))
            if stop_after is not None and len(out) == stop_after:
                batches.close()
                return out, loader
    return out, loader


def _ranks(cfg, world: int, epochs: int, group: int = 1) -> dict[str, list]:
    return {str(r): _run(cfg, Topology(world, r, cfg.loader.read_workers, 0, group), epochs)[0]
            for r in range(world)}


def _resume(cfg, world: int, new_world: int, stop_after: int, epochs: int, ckpt: Path
            ) -> dict[str, Any]:
    catalog = load_catalog(list(cfg.data.paths))
    before = {}
    for r in range(world):
        got, loader = _run(cfg, Topology(world, r, cfg.loader.read_workers), epochs,
                           stop_after=stop_after, catalog=catalog)
        before[str(r)] = got
        loader.save(str(ckpt))
    state = IngestLoader.restore_state(str(ckpt))
    after = {str(r): _run(cfg, Topology(new_world, r, cfg.loader.read_workers), epochs,
                          state=state, catalog=catalog)[0]
             for r in range(new_world)}
    return {"state": state.to_dict(), "before": before, "after": after}


CASES = {
    "epoch_mode": lambda d, tmp: _ranks(_cfg(d["plain"]), world=2, epochs=3),
    "pid_mode": lambda d, tmp: _ranks(_cfg(d["plain"], seed_mode="pid", repeat=True), 2, 2),
    "parallel_groups": lambda d, tmp: _ranks(_cfg(d["plain"]), world=4, epochs=2, group=2),
    "aspect_buckets": lambda d, tmp: _ranks(
        _cfg(d["bucketed"], {"buckets": ["16:9", "3:2", "4:3", "1:1", "3:4", "2:3", "9:16",
                                         "21:9"]}, batch_size=4), world=2, epochs=2),
    "skip_corrupt": lambda d, tmp: _ranks(_cfg(d["corrupt"], on_error="skip"), 1, 2),
    "resume_mid_epoch": lambda d, tmp: _resume(_cfg(d["plain"]), 2, 2, 5, 2, tmp),
    "resume_world_change": lambda d, tmp: _resume(_cfg(d["plain"]), 2, 3, 5, 2, tmp),
}


#: Cases run through the real Ray edge with decode actors (the default) too: a plain run and
#: one cut and resumed. The others differ from these in what is planned or decoded (the same
#: code in every engine): through actors they would test the same path again at 10-25 s each,
#: so they run through Ray with ``decode.compute: tasks`` (no actor processes to start: a few
#: seconds each). Every case also runs in-process.
RAY_CASES = ("epoch_mode", "resume_mid_epoch")
#: Engines on Ray.
RAY_ENGINES = ("ray", "process", "data", "tasks")


@pytest.mark.parametrize("case, engine", [
    *(pytest.param(c, e, marks=pytest.mark.ray) for c in sorted(RAY_CASES)
      for e in ("ray", "process", "data")),
    *(pytest.param(c, "tasks", marks=pytest.mark.ray) for c in sorted(set(CASES) - set(RAY_CASES))),
    *((c, "local") for c in sorted(CASES)),
    *((c, "threads") for c in sorted(CASES))])
def test_golden(request, plain, bucketed, corrupt, tmp_path, case, engine):
    if engine in RAY_ENGINES:
        request.getfixturevalue("ray_local")
    ENGINE[0] = engine
    got = json.loads(json.dumps(CASES[case]({"plain": plain, "bucketed": bucketed,
                                             "corrupt": corrupt}, tmp_path)))
    goldens = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if WRITE and (engine == "ray" or case not in RAY_CASES):
        goldens[case] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(goldens, indent=0, sort_keys=True) + "\n")
    assert case in goldens, f"no golden for {case}: record with RAY_INGEST_WRITE_GOLDENS=1"
    assert got == goldens[case]


def test_started_loader_delivers_the_goldens_from_one_execution(plain):
    """``IngestLoader.start`` opens the first window's execution before ``epochs`` asks (the
    job overlaps decode start-up with model setup); it consumes nothing: the same batches."""
    cfg = _cfg(plain)
    catalog = load_catalog(list(cfg.data.paths))
    opened: list[LocalExecution] = []

    def opener(items):
        opened.append(LocalExecution(cfg, catalog, items))
        return opened[-1]

    loader = IngestLoader(cfg, Topology(2, 0, cfg.loader.read_workers), catalog=catalog,
                          open_execution=opener)
    before = loader.state
    loader.start(3)
    assert len(opened) == 1 and loader.state == before and loader.clock.batches == 0
    got = [_record(epoch, b) for epoch, batches in loader.epochs(3) for b in batches]
    assert json.loads(json.dumps(got)) == json.loads(GOLDEN.read_text())["epoch_mode"]["0"]
    assert len(opened) == 1  # the started execution, not a second one
    # started for other epochs than asked: that window is closed, a new one opened
    loader = IngestLoader(cfg, Topology(2, 0, cfg.loader.read_workers), catalog=catalog,
                          open_execution=opener)
    loader.start(1)
    got = [_record(epoch, b) for epoch, batches in loader.epochs(3) for b in batches]
    assert json.loads(json.dumps(got)) == json.loads(GOLDEN.read_text())["epoch_mode"]["0"]
    assert len(opened) == 3 and opened[1].closed


@pytest.mark.ray
def test_head_start_then_the_pool_delivers_the_goldens(ray_local, plain):
    """The default head start: the first 2 batches' items decoded in this process, the rest by
    the decode actors: the same batches as either alone."""
    ENGINE[0] = "head"
    cfg = _cfg(plain, head_start_batches=2)
    runs = {str(r): _run(cfg, Topology(2, r, cfg.loader.read_workers), 3) for r in range(2)}
    got = json.loads(json.dumps({r: recs for r, (recs, _) in runs.items()}))
    assert got == json.loads(GOLDEN.read_text())["epoch_mode"]
    m = runs["0"][1].metrics()
    # whole leading items holding at least 2 batches, the rest from the pool's actors
    assert 2 * cfg.loader.batch_size <= m["head_start_rows"] < m["samples"]
    assert m["actors_seen"] >= 1
