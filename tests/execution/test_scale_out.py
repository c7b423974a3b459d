"""bench/scale_out.py's harness: its exactness check compares each simulated rank's delivered
(shard, index, pad) batches with the planner's, and fails on any wrong batch; a small loopback
run (2 nodes, 3 simulated ranks, two of them sharing a process) delivers every rank its exact
planned batches and accounts the driver's and the GCS's CPU.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys

import pytest

from bench.scale_out import compare, planned_batches
from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset

WORLD, BATCH = 3, 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """50 samples in shards of 8 (the last of 2): slots of unequal length padded to 24 samples
    (equal work), in batches of 5: the last batch of every epoch padded by the batcher."""
    path = str(tmp_path_factory.mktemp("scale") / "ds")
    synth_dataset(path, samples=50, shard_size=8, seed=6, min_side=24, max_side=32)
    return path


def _cfg(data: str, **decode):
    return config_from_dict({
        "data": {"paths": [data]},
        "decode": {"resolution": 16, "compute": "threads", "threads": 2, **decode},
        "loader": {"batch_size": BATCH, "read_workers": 2, "seed": 3, "head_start_batches": 0},
    })


def _plan(data: str, rank: int, epochs: int = 2):
    cfg = _cfg(data)
    cat = load_catalog([data])
    return planned_batches(cat.counts, cat.chunk_size, cfg.loader.plan_params(), WORLD, rank,
                           cfg.loader.read_workers, BATCH, epochs)


@pytest.mark.parametrize("rank", range(WORLD))
def test_plan_is_what_the_loader_delivers(data, rank):
    """The planner-only expectation equals what the real loader (decode threads, no Ray)
    delivers, padding included, over two epochs."""
    cfg = _cfg(data)
    loader = IngestLoader(cfg, Topology(world_size=WORLD, rank=rank, read_workers=2))
    got = [list(zip(b.sids, b.indices, b.pads, strict=True))
           for _, bs in loader.epochs(2) for b in bs]
    want = _plan(data, rank)
    assert compare(got, want) is None
    # both kinds of padding are exercised: the batcher's (the 25th row of every slot)...
    assert [pad for _, _, pad in want[4]][-1] is True and len(want) == 10
    if rank > 0:  # ...and the planner's equal-work duplicates (rank 0 has the longest slot)
        assert sum(pad for batch in want[:5] for _, _, pad in batch) > 1
    assert _plan(data, rank, 1) != _plan(data, (rank + 1) % WORLD, 1)


def _perturbations(plan):
    """(what, delivered) pairs that differ from ``plan`` in one way each."""
    out = []
    swapped = copy.deepcopy(plan)
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]
    out.append(("two rows swapped in a batch", swapped))
    shifted = copy.deepcopy(plan)  # the same sample order, other batch boundaries
    shifted[0].append(shifted[1].pop(0))
    out.append(("a batch boundary moved", shifted))
    flipped = copy.deepcopy(plan)
    sid, idx, pad = flipped[-1][-1]
    flipped[-1][-1] = (sid, idx, not pad)
    out.append(("a pad flag flipped", flipped))
    foreign = copy.deepcopy(plan)
    foreign[2][3] = (foreign[2][3][0], foreign[2][3][1] + 1, foreign[2][3][2])
    out.append(("another sample of the same shard", foreign))
    out.append(("the last batch missing", plan[:-1]))
    out.append(("an extra batch", [*plan, plan[0]]))
    out.append(("batches out of order", [plan[1], plan[0], *plan[2:]]))
    return out


def test_compare_fails_on_any_wrong_batch(data):
    plan = _plan(data, 1)
    assert compare(copy.deepcopy(plan), plan) is None
    assert compare(plan[:3], plan, prefix=True) is None
    for what, delivered in _perturbations(plan):
        assert delivered != plan, what
        assert compare(delivered, plan) is not None, what
    # another rank's (correct) stream is wrong for this rank
    assert compare(_plan(data, 0), plan) is not None
    msg = compare(_perturbations(plan)[0][1], plan)
    assert msg.startswith("batch 1 differs at row 0"), msg


# --- a small loopback run -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cluster():
    """Head (no CPUs) + one decode node + one train node, this process the driver."""
    import ray

    from bench.scale_out import REPO, _wait_for_singletons
    from ray_ingest.execution.raydata import warm_up
    from tests.conftest import init_local_ray
    from tests.support.multinode import LoopbackCluster, loopback

    had_session_ray = ray.is_initialized()
    if had_session_ray:
        ray.shutdown()
    with loopback():
        c = LoopbackCluster()
        try:
            c.add("decode", 2, wait=False)
            c.add("train", 2, wait=False)
            c.wait_for_nodes()
            ray.init(address=c.address, log_to_driver=False,
                     runtime_env={"env_vars": {"RAY_DATA_DISABLE_PROGRESS_BARS": "1",
                                               "PYTHONPATH": REPO}})
            warm_up()
            _wait_for_singletons()
            yield c
        finally:
            ray.shutdown()
            c.shutdown()
    if had_session_ray:
        init_local_ray()


@pytest.mark.multinode
@pytest.mark.parametrize("compute", ["tasks", "actors"])
def test_simulated_ranks_get_their_planned_batches(small_cluster, tmp_path, compute):
    import ray

    from bench.scale_out import (
        ProcSampler,
        SimRanks,
        _plan_for,
        loader_doc,
        make_data,
        parse,
        ranks_phase,
    )

    args = parse(["--rank-compute", compute, "--ranks-per-process", "2", "--batch", "8",
                  "--block-rows", "8", "--shard-size", "8", "--batches-per-rank", "3",
                  "--decode-num-cpus", "0.5", "--sim-cost-s", "0.005"])
    path = make_data(str(tmp_path), WORLD * 3 * 8, 8, 1)
    cat = load_catalog([path])
    with ProcSampler() as sampler:
        r = ranks_phase(args, ray.remote(SimRanks), path, cat, ray.put(cat), WORLD, sampler,
                        "test", keep_batches=True)
    assert r["errors"] == {}
    assert (r["exact_ranks"], r["mismatches"]) == (WORLD, {})
    assert r["processes"] == 2  # ranks 0 and 1 share one, rank 2 has its own
    assert r["batches_per_rank"] == [3] and r["samples"] == WORLD * 3 * 8
    assert r["decode_compute"] == [compute]
    # the check is against each rank's own plan: rank 0's batches are wrong for rank 1
    plan1 = _plan_for(loader_doc(args, path, compute, 1, None), cat, WORLD, 1, 1)
    assert compare(r["delivered"][1], plan1) is None
    assert compare(r["delivered"][0], plan1) is not None
    # the accounting saw this cluster's GCS, raylets and the ranks' processes
    assert r["cpu_s_with_start"].get("gcs_server", 0) > 0
    assert r["cpu_s_with_start"].get("raylet", 0) > 0
    assert r["memory"]["SimRanks"]["n"] == 2
    assert r["ttfb_s"]["max"] >= r["ttfb_s"]["min"] > 0


GCS_LOG = """[2026-12-04 16:01:34,147 I 43 43] (gcs_server) gcs_server.cc:1322: Main service Event stats:


Global stats: 21722 total (27 active)
Event stats:
\tHealthCheck - 8784 total (0 active), Execution time: mean = 0.01ms, total = 108.20ms, Queueing time: mean = 0.59ms
\tActorInfoGcsService.grpc_server.GetNamedActorInfo.HandleRequestImpl - 197 total (0 active), Execution time: mean = 0.24ms, total = 46.59ms, Queueing time: mean = 0.79ms
\tActorInfoGcsService.grpc_server.GetNamedActorInfo - 197 total (0 active), Execution time: mean = 1.98ms, total = 389.75ms, Queueing time: mean = 0.00ms
[2026-12-04 16:01:34,148 I 43 43] (gcs_server) gcs_server.cc:1326: pubsub_io_context Event stats:
Event stats:
\tPublisher.CheckDeadSubscribers - 10 total (1 active), Execution time: mean = 0.01ms, total = 0.10ms, Queueing time: mean = 0.01ms
"""  # noqa: E501


def test_a_forked_child_is_not_counted_as_its_parent_s_kind(tmp_path):
    """A child forked but not yet exec'd shows its parent's command line: the sampler counts it
    as ``forked``, not as a second process of its parent's kind (the likely cause of one run of
    the test below that counted three rank processes for two)."""
    from bench.scale_out import ProcSampler

    script = tmp_path / "forker.py"
    script.write_text("import os, sys, time\n"
                      "if os.fork() == 0:\n"
                      "    time.sleep(60)\n"
                      "    os._exit(0)\n"
                      "print('forked', flush=True)\n"
                      "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == b"forked\n"
        sampler = ProcSampler()
        sampler.sample()
        mem = sampler.memory()
        assert (mem["forker"]["n"], mem["forked"]["n"]) == (1, 1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_gcs_event_stats_are_parsed_and_differenced(tmp_path):
    from bench.scale_out import GcsEventStats, gcs_delta

    log = tmp_path / "gcs_server.out"
    log.write_text(GCS_LOG)
    stats = GcsEventStats(str(tmp_path), 1.0)
    stats._read()
    first = {f"{sec}/{n}": v for sec, hs in stats.latest[1].items() for n, v in hs.items()}
    assert first["Main service/HealthCheck"] == (8784, 108.2)
    assert first["pubsub_io_context/Publisher.CheckDeadSubscribers"] == (10, 0.1)
    later = (GCS_LOG.replace("16:01:34", "16:01:37").replace("8784 total", "8790 total")
             .replace("197 total", "261 total").replace("total = 46.59ms", "total = 60.00ms"))
    with open(log, "a") as f:
        f.write(later)
    stats._read()
    second = {f"{sec}/{n}": v for sec, hs in stats.latest[1].items() for n, v in hs.items()}
    delta = gcs_delta(first, second)
    # the handler's own work (HandleRequestImpl), not the RPC's time on the wire
    assert delta["ActorInfoGcsService.grpc_server.GetNamedActorInfo"] == {"calls": 64,
                                                                          "ms": 13.4}
    assert delta["HealthCheck"] == {"calls": 6, "ms": 0.0}
    assert "Publisher.CheckDeadSubscribers" not in delta  # unchanged


def test_held_busy_counts_whole_steps():
    """Behind a barrier the pool decodes each 13-s step's work (4 CPUs × 11 s = 44 CPU-s) in a
    burst: busy over whole steps is 44 / 13 = 3.38 CPUs, whatever the bursts' phase; a span
    that cuts steps would read anything from 2.6 to 3.7."""
    from bench.sync_steps import held_busy

    hist, busy = [], 0.0
    for k in range(131):  # one sample a second; 4 held, 4 busy for the first 11 s of a step
        t = float(k)
        hist.append({"t": t, "held": 4, "busy_s": busy})
        busy += 4.0 if (k - 5) % 13 < 11 else 0.0
    marks = [5.0 + 13 * i for i in range(10)]  # the steps' releases
    out = held_busy(hist, 1.0, marks)
    assert out["busy_cpus"] == pytest.approx(44 / 13, rel=0.01)
    assert out["held_over_busy"] == pytest.approx(4 / (44 / 13), rel=0.01)
    assert out["le_1_3_from_s"] == 0.0  # every whole-step window is at 1.18x
    hist = [dict(h, held=5) for h in hist]  # a fifth worker the bursts never use: 1.48x
    assert held_busy(hist, 1.0, marks)["le_1_3_from_s"] is None
    assert held_busy(hist, 1.0, marks[:1])["busy_cpus"] is None


def test_step_barrier_abort_releases_waiting_ranks():
    """A failed rank aborts the barrier: a rank waiting at it, and one arriving later, stop
    at once with the failure's reason (they waited BARRIER_TIMEOUT_S, 900 s, before); a step
    that was released stays released."""
    import asyncio

    from bench.sync_steps import BarrierAborted, StepBarrier

    async def scenario():
        b = StepBarrier(parties=2)
        first = asyncio.ensure_future(b.arrive(0, 1))
        second = await asyncio.wait_for(b.arrive(0, 1), 1.0)  # both there: released
        assert await first == second == b.released[0]
        waiting = asyncio.ensure_future(b.arrive(1, 1))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await b.abort("rank 3: ValueError: bad shard")
        with pytest.raises(BarrierAborted, match="step 1: rank 3: ValueError: bad shard"):
            await asyncio.wait_for(waiting, 1.0)
        with pytest.raises(BarrierAborted, match="step 2"):
            await asyncio.wait_for(b.arrive(2, 1), 1.0)
        assert sorted(await b.progress()) == [0]

    asyncio.run(scenario())
