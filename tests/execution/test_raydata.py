"""The Ray pipeline on a real local Ray: datasource rows, determinism, groups, equal batches,
elastic decode pool.

A test whose subject is the Ray edge (the datasource, the decode pool, one execution over
epochs, unordered delivery, pauses) runs through Ray. A test whose subject is what is planned
(group ranks, aspect buckets, the random crop's seeds) runs the same read and decode code in
this process (``local=True``: ray_ingest/execution/local.py, bit-identical to the Ray edge by the
stream goldens) where a Ray run would test the same rows again at ~5 s an execution; where the Ray
edge could differ (a per-process seed), one Ray run is compared with the in-process one.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.errors import ConfigError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.loader.ingest import (
    IngestLoader,
    plan_params,
)
from ray_ingest.plan.epoch import read_items
from ray_ingest.plan.state import initial_state, slot_stream
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.summary import iter_records
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_shard,
)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """11 shards of uneven size (the last one short) so equal-work padding is exercised."""
    out = str(tmp_path_factory.mktemp("pipe") / "ds")
    synth_dataset(out, samples=205, shard_size=19, seed=3, min_side=48, max_side=128)
    return out


def _cfg(path: str, **loader):
    return config_from_dict({
        "data": {"paths": [path]},
        # decode tasks: these tests are not about the actor pool (its own tests below)
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 2, "num_cpus": 0.25,
                   "compute": "tasks"},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 8, "read_workers": 2, "seed": 7, "block_rows": 16, **loader},
    })


def _run(cfg, topo: Topology, epochs: int = 1, local: bool = False):
    """Batch records of ``epochs``; ``local``: read and decode in this process, not on Ray."""
    opener = LocalExecution.factory(cfg, load_catalog(list(cfg.data.paths))) if local else None
    loader = IngestLoader(cfg, topo, open_execution=opener)
    out = []
    for epoch, batches in loader.epochs(epochs):
        for b in batches:
            digest = hashlib.sha1(b["image"].numpy().tobytes()).hexdigest()
            out.append((epoch, b.step_in_epoch, tuple(b.sample_keys), tuple(b.pads), digest))
    return out, loader


def test_decode_compute_is_auto_actors_tasks_or_threads(dataset):
    assert config_from_dict({"data": {"paths": [dataset]}}).decode.compute == "auto"
    with pytest.raises(ConfigError, match=r"decode.compute: expected one of auto, actors, tasks, "
                                          r"threads, process, got 'processes'"):
        config_from_dict({"data": {"paths": [dataset]}, "decode": {"compute": "processes"}})


def test_datasource_rows_equal_cat_for_the_same_plan(ray_local, dataset):
    import ray

    from ray_ingest.execution.raydata import ReadUnit, TwinTarDatasource

    cfg = _cfg(dataset)
    catalog = load_catalog([dataset])
    topo = Topology(world_size=3, rank=1, read_workers=2)
    state = initial_state(catalog.fingerprint, plan_params(cfg), 0, topo)
    stream = slot_stream(state, catalog.counts, catalog.chunk_size, topo.slot)
    items = read_items(stream, ())
    assert len(items) >= 3
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    source = TwinTarDatasource([[ReadUnit(catalog.shard(it.sid), it)] for it in items],
                               ReadOptions(), block_rows=5)
    rows = ray.data.read_datasource(source, num_cpus=0.25).take_all()
    assert [r["__seq__"] for r in rows] == list(range(sum(it.count for it in items)))
    # the same slices read directly (what `cat` prints, restricted to the plan)
    expected = [(catalog.shards[it.sid].path, r["__key__"], r["__index__"])
                for it in items
                for r in read_shard(catalog.shards[it.sid], it.start, it.count)]
    assert [(r["__shard__"], r["__key__"], r["__index__"]) for r in rows] == expected
    cat = {(rec["shard"], rec["key"]): rec for rec in iter_records([dataset])}
    for r in rows:
        rec = cat[(r["__shard__"], r["__key__"])]
        assert rec["index"] == r["__index__"]
        for m in ("image", "caption"):
            assert hashlib.sha1(r[m]).hexdigest() == rec[m]["sha1"]
            assert r[f"{m}__ext"] == rec[m]["ext"]


def test_a_ray_run_equals_an_independent_run_and_epochs_differ(ray_local, dataset):
    cfg = _cfg(dataset)
    topo = Topology(world_size=2, rank=0, read_workers=2)
    a, _ = _run(cfg, topo, epochs=2)
    b, _ = _run(cfg, topo, epochs=2, local=True)
    assert a == b
    e0 = [x[2] for x in a if x[0] == 0]
    e1 = [x[2] for x in a if x[0] == 1]
    assert e0 and e1 and e0 != e1


def test_group_ranks_identical_and_equal_batch_counts(dataset):
    cfg = _cfg(dataset)
    runs = {r: _run(cfg, Topology(world_size=6, rank=r, read_workers=2, group_size=2),
                    local=True)[0]
            for r in range(6)}
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[4] == runs[5]
    assert runs[0] != runs[2]
    counts = {r: len(v) for r, v in runs.items()}
    assert len(set(counts.values())) == 1, counts
    # every sample of the epoch delivered once across the three slots (pads aside)
    seen = [k for r in (0, 2, 4) for (_, _, keys, pads, _) in runs[r]
            for k, p in zip(keys, pads, strict=True) if not p]
    assert sorted(seen) == sorted(rec["key"] for rec in iter_records([dataset]))


def test_unordered_mode_delivers_the_same_multiset(ray_local, dataset):
    topo = Topology(world_size=2, rank=1, read_workers=2)
    ordered, _ = _run(_cfg(dataset), topo, local=True)
    unordered, _ = _run(_cfg(dataset, ordered=False), topo)
    flat = lambda runs: sorted(k for (_, _, keys, pads, _) in runs  # noqa: E731
                               for k, p in zip(keys, pads, strict=True) if not p)
    assert flat(ordered) == flat(unordered)
    assert len(ordered) == len(unordered)


def test_batches_are_tensors_with_provenance(ray_local, dataset):
    import torch

    cfg = _cfg(dataset)
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1))
    _, batches = next(loader.epochs(1))
    b = next(batches)
    assert isinstance(b["image"], torch.Tensor)
    assert b["image"].dtype == torch.uint8 and tuple(b["image"].shape) == (8, 32, 32, 3)
    assert len(b.sample_keys) == len(b.captions) == len(b.sids) == 8
    assert all(isinstance(c, str) and c for c in b.captions)
    batches.close()


def test_decode_pool_scales_between_min_and_max(ray_local, tmp_path):
    """Observed decode actors (ids reported by the actors themselves), not configured ones, in
    one execution that reads two epochs."""
    out = str(tmp_path / "big")
    synth_dataset(out, samples=360, shard_size=12, seed=1, min_side=256, max_side=384)
    cfg = config_from_dict({
        "data": {"paths": [out]},
        "decode": {"resolution": 192, "pool_min": 1, "pool_max": 3, "num_cpus": 0.25,
                   "compute": "actors"},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 12, "read_workers": 1, "block_rows": 4, "prefetch_batches": 8},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1))
    per_epoch = []
    for _, batches in loader.epochs(2):
        before = set(loader.actors_seen)
        for _ in batches:
            pass
        per_epoch.append(loader.actors_seen - before)
    assert loader.executions == 1
    assert 2 <= len(loader.actors_seen) <= 3, loader.actors_seen
    assert not per_epoch[1] - loader.actors_seen
    fixed = config_from_dict({
        "data": {"paths": [out]},
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "compute": "actors"},
        "loader": {"head_start_batches": 0, "batch_size": 12, "read_workers": 1, "block_rows": 4},
    })
    loader = IngestLoader(fixed, Topology(world_size=1, rank=0, read_workers=1))
    n = 0
    for _, batches in loader.epochs(2):
        n += sum(1 for _ in batches)
    assert n == 60 and len(loader.actors_seen) == 1 and loader.executions == 1


def test_one_execution_reads_a_window_of_epochs(ray_local, dataset):
    """The same batches whether one execution reads three epochs or each epoch gets its own."""
    topo = Topology(world_size=2, rank=1, read_workers=2)
    cfg = _cfg(dataset)
    one, loader = _run(cfg, topo, epochs=3)
    assert loader.executions == 1 and len(loader.data_stats) == 1
    # decode.compute: tasks: decoded by Ray tasks, named by their worker processes
    assert loader.actors_seen and all(a.startswith("task-worker:") for a in loader.actors_seen)
    three, loader = _run(_cfg(dataset, max_planned_items=1), topo, epochs=3,  # one epoch each
                         local=True)
    assert loader.executions == 3
    assert one == three
    assert [x[0] for x in one] == sorted(x[0] for x in one)


def test_random_crop_is_seeded_per_sample(ray_local, dataset):
    cfg = config_from_dict({
        "data": {"paths": [dataset]},
        "decode": {"resolution": 32, "crop": "random", "pool_min": 1, "pool_max": 2,
                   "num_cpus": 0.25, "compute": "tasks"},
        "loader": {"head_start_batches": 0, "batch_size": 8, "seed": 5},
    })
    topo = Topology(world_size=1, rank=0, read_workers=1)
    a, _ = _run(cfg, topo)  # the crops drawn in Ray's worker processes ...
    b, _ = _run(cfg, topo, local=True)  # ... equal those drawn in this process
    assert a == b
    centre, _ = _run(_cfg(dataset, seed=5), topo, local=True)
    assert [x[2] for x in centre] == [x[2] for x in a]  # same samples ...
    assert [x[4] for x in centre] != [x[4] for x in a]  # ... different pixels


def test_aspect_buckets_give_one_shape_per_batch(tmp_path):
    out = str(tmp_path / "buck")
    synth_dataset(out, samples=120, shard_size=10, seed=2, min_side=64, max_side=160,
                  classify_aspect_ratio=True)
    cfg = config_from_dict({
        "data": {"paths": [out]},
        "decode": {"resolution": 32, "buckets": ["16:9", "3:2", "4:3", "1:1", "3:4", "2:3",
                                                  "9:16", "21:9"],
                   "pool_min": 1, "pool_max": 2, "num_cpus": 0.25},
        "loader": {"head_start_batches": 0, "batch_size": 4},
    })
    counts = []
    for rank in range(2):
        loader = IngestLoader(cfg, Topology(world_size=2, rank=rank, read_workers=1),
                              open_execution=LocalExecution.factory(cfg, load_catalog([out])))
        shapes = set()
        n = 0
        for _, batches in loader.epochs(1):
            for b in batches:
                n += 1
                img = b["image"].numpy()
                assert img.shape[0] == 4
                shapes.add((b.bucket, img.shape[1:]))
                assert b.bucket
        counts.append(n)
        assert len({s for _, s in shapes}) >= 2  # several buckets, one shape each
        assert len(shapes) == len({b for b, _ in shapes})
    assert counts[0] == counts[1]
    assert np.all(np.array(counts) > 0)


@pytest.mark.parametrize("scope", ["rank", "job"])
def test_a_pause_in_the_train_loop_keeps_the_decode_pool(ray_local, tmp_path, scope):
    """A 12 s pause (a checkpoint, a validation pass) with a small object-store budget idles the
    decode actors; Ray's autoscaler would shrink the pool then grow it again with a new actor
    (seen with ``scale_down_hold_s: 0``). With the hold, no actor is retired across the pause
    (the pool may still grow to ``pool_max`` when the rank waits on it): the rank's own pool and
    the job's (whose controller counts its retirements)."""
    out = str(tmp_path / "pause")
    synth_dataset(out, samples=640, shard_size=32, seed=1, min_side=160, max_side=224)
    cfg = config_from_dict({
        "data": {"paths": [out]},
        "decode": {"resolution": 96, "pool_min": 1, "pool_max": 2, "num_cpus": 0.25,
                   "compute": "actors", "pool_scope": scope,
                   "scale_down_hold_s": 60},
        "loader": {"head_start_batches": 0, "batch_size": 16, "read_workers": 1, "block_rows": 16,
                   "object_store_limit": 16_000_000},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1))
    before: set[str] = set()
    for epoch, batches in loader.epochs(2):
        for n, _ in enumerate(batches):
            if epoch == 1 and n == 5:
                before = set(loader.actors_seen)
                time.sleep(12)
        if epoch == 1 and scope == "job":  # the execution is still open: the pool is up
            from ray_ingest.execution.hosted import answer, find

            svc = find(cfg, load_catalog([out]).fingerprint)  # hosted here: one pipeline
            job_stats = answer(svc.stats.remote())
    assert loader.executions == 1 and before
    assert before <= loader.actors_seen and len(loader.actors_seen) <= 2
    if scope == "rank":
        assert ", 0 retired idle," in loader.data_stats[-1], loader.data_stats
    else:
        assert job_stats["retired"] == 0 and job_stats["started"] <= 2, job_stats
