"""Process faults: a decode actor killed mid-epoch is restarted by Ray and the stream goes on
with nothing lost, nothing duplicated and nothing reordered.

The test runs the rank's own decode pool (``decode.compute: actors`` with ``loader.fused_read``
left true: ``execution/pool.py``, not Ray Data). Its actors read their items themselves, so the
kill also interrupts a read. The pool starts them with ``max_restarts=-1`` and
``max_task_retries=-1``: the actor process comes back under the same actor id and Ray re-runs
the calls it had in flight from the start of their items; a call returns its item's blocks all
at once, so none is returned twice. The test learns the actor id from the ``__actor__`` column
the Decoder emits, its pid from the GCS actor table (the session Ray has no dashboard, so no
State API) and sends SIGKILL — a crash, not a polite shutdown.
"""

from __future__ import annotations

import collections
import hashlib
import os
import signal
import time

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.decode.decoder import Decoder
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.state import slot_stream
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import read_shard

pytestmark = pytest.mark.ray

TOPO = Topology(world_size=1, rank=0, read_workers=1)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "ds"
    synth_dataset(str(out), samples=40, shard_size=4, seed=9, min_side=16, max_side=40)
    return out


@pytest.fixture
def backpressure(ray_local):
    """A tiny Ray Data object-store budget (it bounds only a Ray Data execution: the pool here
    keeps at most 2 calls in flight on its one actor, so the actor has work left when killed)."""
    from ray.data import DataContext, ExecutionResources

    options = DataContext.get_current().execution_options
    saved = options.resource_limits
    options.resource_limits = ExecutionResources(object_store_memory=1)
    yield
    options.resource_limits = saved


def actor_info(actor_id: str) -> dict:
    import ray

    return ray._private.state.actors(actor_id)  # GCS actor table: works without a dashboard


def test_killed_decode_actor_is_restarted_and_nothing_is_lost(dataset, backpressure,
                                                              remote_figures):
    cfg = config_from_dict({
        "data": {"paths": [str(dataset)]},
        "decode": {"resolution": 16, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "compute": "actors"},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 4, "read_workers": 1, "read_num_cpus": 0.25, "block_rows": 4,
                   "prefetch_batches": 1, "seed": 4},
    })
    catalog = load_catalog([str(dataset)])
    loader = IngestLoader(cfg, TOPO, catalog=catalog)
    plan = [(sl.shard, sl.start + k)
            for sl in slot_stream(loader.state, catalog.counts, catalog.chunk_size, TOPO.slot)
            for k in range(sl.count) if not sl.pad]
    decoder = Decoder(cfg.decode, seed=cfg.loader.seed)
    want = {}
    for sid, shard in enumerate(catalog.shards):
        for row in read_shard(shard):
            row.update({"__sid__": sid, "__bucket__": ""})
            want[(sid, row["__index__"])] = hashlib.sha1(
                decoder.decode_row(row)["image"].tobytes()).hexdigest()

    t0 = time.monotonic()
    order: list[tuple[int, int]] = []
    got: dict[tuple[int, int], str] = {}
    killed = None
    after_kill = 0
    for _, batches in loader.epochs(1):
        for b in batches:
            images = b["image"].numpy()
            for j, (s, i, pad) in enumerate(zip(b.sids, b.indices, b.pads, strict=True)):
                if not pad:
                    order.append((s, i))
                    got[(s, i)] = hashlib.sha1(images[j].tobytes()).hexdigest()
            if killed is None:
                (killed,) = loader.actors_seen  # the pool's only actor
                info = actor_info(killed)
                assert info["State"] == "ALIVE", info  # still has work: mid-epoch
                os.kill(info["Pid"], signal.SIGKILL)
                killed_pid = info["Pid"]
            else:
                after_kill += 1

    info = actor_info(killed)
    counts = collections.Counter(order)
    lost = len(set(plan) - set(order))
    duplicated = sum(n - 1 for n in counts.values())
    remote_figures.record(kind="decode actor SIGKILL", layer="IngestLoader (Ray)",
                          faulted=1, retries=info["NumRestarts"],
                          bytes_compared=16 * 16 * 3 * len(got), samples=len(order),
                          mismatches=sum(got[k] != want[k] for k in got), lost=lost,
                          duplicated=duplicated, seconds=round(time.monotonic() - t0, 1))
    assert info["NumRestarts"] >= 1 and info["Pid"] != killed_pid, info  # restarted by Ray
    assert after_kill > 0  # the stream went on after the crash
    assert order == plan  # nothing lost, nothing duplicated, same order
    assert got == want  # and decode-identical to a local decode
    assert loader.metrics()["skips_total"] == 0
