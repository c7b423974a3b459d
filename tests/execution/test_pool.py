"""The rank's own Ray workers (ray_ingest/execution/pool.py): the same blocks as the in-process
read and decode, in stream order, for decode actors, tasks and the companion process; the pool
grows while the rank waits and shrinks when idle; errors come out as one line; a stop ends the
workers. On the session Ray."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.columns import ACTOR, INDEX, KEY, SEQ, SID
from ray_ingest.config import config_from_dict
from ray_ingest.errors import IngestError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.execution.pool import PoolExecution
from ray_ingest.plan.epoch import read_items
from ray_ingest.plan.state import initial_state, slot_stream
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pool") / "ds")
    synth_dataset(out, samples=60, shard_size=10, seed=3, min_side=16, max_side=40)
    return out


def _cfg(path, **decode):
    return config_from_dict({
        "data": {"paths": [path]},
        "decode": {"resolution": 16, "pool_min": 1, "pool_max": 2, "num_cpus": 0.25,
                   **decode},
        "loader": {"batch_size": 4, "block_rows": 5, "read_workers": 1, "seed": 7},
    })


def _items(cfg, catalog):
    topo = Topology(world_size=1, rank=0, read_workers=1)
    state = initial_state(catalog.fingerprint, cfg.loader.plan_params(), 0, topo)
    return read_items(slot_stream(state, catalog.counts, catalog.chunk_size, 0), (), 5)


def _rows(blocks) -> list[tuple]:
    return [(int(b[SID][i]), int(b[INDEX][i]), int(b[SEQ][i]), str(b[KEY][i]),
             hashlib.sha1(b["image"][i].tobytes()).hexdigest())
            for b in blocks for i in range(len(b[SEQ]))]


@pytest.mark.parametrize("mode", ["actors", "tasks", "process"])
def test_pool_delivers_the_in_process_rows_in_order(ray_local, dataset, mode):
    cfg = _cfg(dataset, compute=mode, threads=2)
    catalog = load_catalog([dataset])
    items = _items(cfg, catalog)
    want = _rows(LocalExecution(cfg, catalog, items).blocks())
    ex = PoolExecution(cfg, catalog, items, threads=2)
    try:
        blocks = list(ex.blocks())
    finally:
        ex.close()
    assert _rows(blocks) == want and len(want) == 60
    assert [r[2] for r in _rows(blocks)] == list(range(60))  # stream order
    workers = {a for b in blocks for a in b[ACTOR]}
    if mode == "tasks":
        assert all(a.startswith("task-worker:") for a in workers)
    else:
        assert len(workers) <= 2 and "local" not in workers
    assert f"{mode}: {len(items)} read items decoded" in ex.stats()


def test_pool_grows_while_the_rank_waits_and_shrinks_when_idle(ray_local, dataset):
    """60 samples of 60 ms simulated decode on one actor: decode-bound, so the rank waits on a
    full pool, which starts a second actor. The test waits for that start to finish before it
    reads on (on a loaded 2-core machine an actor's start may outlast the 3.6 s of decode), so
    what it checks is the growing, not the race."""
    cfg = _cfg(dataset, compute="actors", sim_cost_s=0.06, scale_down_hold_s=0.0)
    catalog = load_catalog([dataset])
    ex = PoolExecution(cfg, catalog, _items(cfg, catalog))
    try:
        it = ex.blocks()
        got = [next(it)]
        assert len(ex.workers) + len(ex._starting) >= 1
        for block in it:
            got.append(block)
            if ex._starting:  # the pool asked for a second actor while the rank waited
                ex._admit(60.0)
        assert ex.peak_workers == 2 and sum(len(b[SEQ]) for b in got) == 60
        assert len({a for b in got for a in b[ACTOR]}) == 2  # both actors decoded
        # idle after the last item, past scale_down_hold_s: back to pool_min
        time.sleep(0.05)
        ex._maybe_shrink()
        assert len(ex.workers) == 1
    finally:
        ex.close()
    assert ex.workers == [] and ex.closed


def test_an_item_that_fails_is_one_line_naming_the_shard(ray_local, dataset, tmp_path):
    import shutil
    import tarfile

    from tests.support.datagen import write_tar

    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    tar = bad / "image" / "part_000000" / "000002.tar"
    with tarfile.open(tar) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
    members[3] = (members[3][0], b"\xff\xd8 not a jpeg")  # the JPEG cannot decode
    write_tar(tar, members, index=True)
    cfg = _cfg(str(bad), compute="actors")
    catalog = load_catalog([str(bad)])
    ex = PoolExecution(cfg, catalog, _items(cfg, catalog))
    try:
        with pytest.raises(IngestError) as err:
            list(ex.blocks())
    finally:
        ex.close()
    msg = str(err.value)
    assert "\n" not in msg and "part_000000/000002.tar" in msg, msg


def test_close_ends_the_workers_mid_stream(ray_local, dataset):
    import ray

    cfg = _cfg(dataset, compute="actors", sim_cost_s=0.01)
    catalog = load_catalog([dataset])
    ex = PoolExecution(cfg, catalog, _items(cfg, catalog))
    it = ex.blocks()
    first = next(it)
    assert len(first[SEQ]) > 0 and isinstance(first["image"], np.ndarray)
    handles = [w.handle for w in ex.workers]
    ex.close()
    assert list(it) == []  # nothing more after a close
    for h in handles:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(h.ready.remote(), timeout=30)


@pytest.mark.parametrize("mode", ["actors", "tasks", "job", "process"])
def test_decode_processes_decode_on_their_main_thread_without_an_environment(
        ray_local, dataset, mode, monkeypatch):
    """Decode actors, tasks and the ``process`` companions run their calls on their process's
    main thread, whose malloc arena keeps freed memory even for large samples: no environment
    of their own, so Ray may give them processes it prestarted. ``process`` starts
    ``decode.threads`` companions, one decoder each, pinned to the rank's node."""
    import threading

    import ray

    from ray_ingest.execution.service import DecodeService

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("RAY_INGEST_KEEP_FREED_MEMORY", raising=False)
    cfg = _cfg(dataset, compute="actors" if mode == "job" else mode, threads=2, resolution=2048)
    catalog = load_catalog([dataset])
    if mode == "job":
        opts = DecodeService(cfg, 1, catalog.fingerprint)._worker_options()
    else:
        ex = PoolExecution(cfg, catalog, _items(cfg, catalog), threads=2)
        opts = ex._task_options() if mode == "tasks" else ex._actor_options()
    assert "runtime_env" not in opts and "max_concurrency" not in opts
    if mode == "process":
        assert type(opts["scheduling_strategy"]).__name__ == "NodeAffinitySchedulingStrategy"
        assert opts["scheduling_strategy"].node_id == ray.get_runtime_context().get_node_id()
        ex.start()
        try:
            assert len(ex.workers) + len(ex._starting) == 2  # decode.threads companions
        finally:
            ex.close()

    def on_main() -> bool:
        return threading.current_thread() is threading.main_thread()

    if mode == "tasks":
        assert ray.get(ray.remote(on_main).options(**opts).remote())
    else:  # the worker itself, asked through Ray's hook for a call of the caller's own
        from ray_ingest.execution.pool import DecodeWorker
        from ray_ingest.execution.sharedworker import SharedDecodeWorker

        cls, args = (SharedDecodeWorker, (cfg,)) if mode == "job" else (DecodeWorker, (cfg, None))
        handle = ray.remote(cls).options(**opts).remote(*args)
        assert ray.get(handle.__ray_call__.remote(lambda self: on_main()))
        ray.kill(handle)
