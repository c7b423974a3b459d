"""Multi-node: placement by label, elastic decode, node loss and object-store pressure on a real
multi-node Ray cluster on 127.0.0.1; the fake-provider autoscaler on cluster.yaml's node types.

One cluster for the module (tests/support/multinode.py): a head with no CPUs (the driver: this
process), three ``pool: gpu-train`` nodes with 1 logical CPU each (one Train worker per node; no
GPU here, ``use_gpu`` stays false) and ``pool: cpu-decode`` nodes of 4 logical CPUs that the
tests add, drain and kill. Every node is its own raylet with its own object store.

Why in this process: a multi-node test drives node events from the consumer loop (after N
batches add, drain or kill a node), so the driver must be connected to the multi-node cluster,
and one process holds one ``ray.init`` at a time. conftest orders ``multinode`` tests before
every test that uses the session Ray, so the two never meet; if the session Ray is already up
(a selection that bypasses that order), the fixture shuts it down and starts it again at
teardown. The autoscaler test runs its driver in a subprocess against its own head.

Figures (placement, pool size, time to the next batch after each node event, object-store peaks,
autoscaler timings) are printed at the end of the module (``pytest -s -m multinode``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml
from click.testing import CliRunner

from tests.support.multinode import MB, LoopbackCluster, StoreSampler, loopback
from tests.support.multinode_autoscale import REPO

pytestmark = pytest.mark.multinode

FIGURES: dict[str, dict] = {}
TRAIN_NODES, DECODE_CPUS = 3, 4
DRAIN_DEADLINE_S = 3.0  # notice a preempted decode node gets before it stops (GCP: 30 s)
TRAIN_STEP_S = 0.08  # 72 batches after the drain take >= 5.8 s: the deadline passes mid-epoch


@pytest.fixture(scope="module")
def cluster():
    import ray

    from tests.conftest import init_local_ray

    had_session_ray = ray.is_initialized()
    if had_session_ray:
        ray.shutdown()
    with loopback():
        c = LoopbackCluster()
        try:
            for _ in range(TRAIN_NODES):
                c.add("train", 1, wait=False)
            for _ in range(2):
                c.add("decode", DECODE_CPUS, wait=False)
            c.wait_for_nodes()
            ray.init(address=c.address, log_to_driver=False,
                     runtime_env={"env_vars": {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                                               "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}})
            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = False
            ctx.execution_options.verbose_progress = False
            yield c
        finally:
            ray.shutdown()
            c.shutdown()
    print("\nmulti-node figures:\n" + json.dumps(FIGURES, indent=1, default=str))
    if had_session_ray:
        init_local_ray()


def decode_nodes(cluster: LoopbackCluster, n: int, object_store_memory: int = 128 * MB):
    """Exactly ``n`` live decode nodes of DECODE_CPUS CPUs and the given store size (others
    removed gracefully)."""
    keep = [i for i in cluster.alive("decode") if i.object_store_memory == object_store_memory
            and i.num_cpus == DECODE_CPUS]
    for info in cluster.alive("decode"):
        if info not in keep[:n]:
            cluster.remove(info)
    for _ in range(n - len(keep[:n])):
        cluster.add("decode", DECODE_CPUS, object_store_memory=object_store_memory, wait=False)
    cluster.wait_for_nodes()
    return cluster.alive("decode")


def run_audit(audit_dir: str, data: str) -> tuple[int, list[dict]]:
    from ray_ingest.cli.main import cli

    res = CliRunner().invoke(cli, ["audit", audit_dir, "--data", data])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    return res.exit_code, [json.loads(line) for line in res.output.splitlines() if line.strip()]


def assert_exactly_once(reports: list[dict], samples: int) -> None:
    assert reports, "no epoch audited"
    for r in reports:
        assert r["complete"], r
        assert (r["expected"], r["seen"], r["distinct"]) == (samples,) * 3, r
        assert (r["duplicated"], r["missing"], r["unknown"]) == (0, 0, 0), r
        assert r["exactly_once"], r


def read_ledger(audit_dir: str) -> dict[int, list[dict]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(audit_dir, "rank_*.jsonl"))):
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        out[recs[0]["rank"]] = recs
    return out


def test_the_job_pool_controller_stays_on_the_node_that_starts_it(cluster):
    """The driver's node here is the head, which has no CPUs (as cluster.yaml's): the job's
    controller (0 CPUs) is placed there, not on a decode node whose removal would end it and,
    with it, the job's pool."""
    import ray

    from ray_ingest.config import config_from_dict
    from ray_ingest.execution import service

    cfg = config_from_dict({"data": {"paths": ["/nonexistent"]},
                            "decode": {"compute": "actors", "pool_min": 1, "pool_max": 1,
                                       "label_selector": {"pool": "cpu-decode"}}})
    here = ray.get_runtime_context().get_node_id()
    assert here == cluster.head.node_id
    handle = service.connect(cfg, 1, "placement-probe")
    ray.get(handle.stats.remote())  # up
    info = ray._private.state.actors(handle._actor_id.hex())
    assert info["Address"]["NodeID"] == here, info["Address"]
    ray.kill(handle, no_restart=True)
    service._HANDLES.clear()


# --- 1. Train placement and the loss of a Train worker's node ----------------------------------

def test_placement_by_label_and_train_node_loss(cluster, tmp_path, monkeypatch):
    """Train workers only on train nodes, decode actors and read tasks only on decode nodes (as
    they report themselves); the node of Train rank 1 is SIGKILLed mid-epoch: Ray Train restarts
    the group from the last checkpoint on the spare train node and the audit is exactly-once."""
    from ray_ingest.tools.synth import synth_dataset
    from ray_ingest.train.job import main

    decode_nodes(cluster, 2)
    train_ids = {i.node_id for i in cluster.alive("train")}
    decode_ids = {i.node_id for i in cluster.alive("decode")}
    samples = 160
    data = str(tmp_path / "ds")
    synth_dataset(data, samples=samples, shard_size=20, seed=9, min_side=32, max_side=40)
    cfg = {
        "data": {"paths": [data], "modalities": ["image", "caption"]},
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.5,
                   "label_selector": {"pool": "cpu-decode"}},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 8, "seed": 4, "read_workers": 2, "block_rows": 8,
                   "read_num_cpus": 0.25},
        "train": {"num_workers": 2, "cpus_per_worker": 1, "checkpoint_every": 2,
                  "log_every": 1000, "max_failures": 1, "epochs": 1,
                  "label_selector": {"pool": "gpu-train"}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    audit_dir = str(tmp_path / "audit")
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    kill_step, killed = 5, {}

    def kill_rank1_node() -> None:
        """Kill the node of rank 1 once rank 1 logged a batch past the step-4 checkpoint."""
        path = os.path.join(audit_dir, "rank_00001.jsonl")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as f:
                    recs = [json.loads(line) for line in f if line.strip()]
                starts = [r for r in recs if r.get("event") == "start"]
                steps = [r["step"] for r in recs if "keys" in r]
                if starts and steps and max(steps) >= kill_step:
                    info = cluster.nodes[starts[-1]["node"]]
                    killed.update(node=info.node_id, step=max(steps), wall=time.time())
                    cluster.kill(info)
                    break
            time.sleep(0.02)
        # the ledger carries no wall clock (the audit orders by attempt and step): time the
        # restart and the next batch from here, as the lines appear
        while killed and time.monotonic() < deadline and "next_batch" not in killed:
            with open(path) as f:
                recs = [json.loads(line) for line in f if line.strip()]
            starts = [i for i, r in enumerate(recs) if r.get("event") == "start"]
            if len(starts) > 1:
                killed.setdefault("restart", time.time())
                if any("keys" in r for r in recs[starts[1]:]):
                    killed["next_batch"] = time.time()
            time.sleep(0.02)

    killer = threading.Thread(target=kill_rank1_node, daemon=True)
    killer.start()
    t0 = time.monotonic()
    assert main(["--config", str(tmp_path / "job.yaml"), "--storage-path", str(tmp_path / "runs"),
                 "--name", "multinode", "--audit-dir", audit_dir]) == 0
    elapsed = time.monotonic() - t0
    killer.join(timeout=5)
    assert killed, "rank 1 never reached the kill step"

    ledger = read_ledger(audit_dir)
    starts = {r: [x for x in recs if x.get("event") == "start"] for r, recs in ledger.items()}
    # placement, reported by the Train workers themselves
    assert all(s["node"] in train_ids for v in starts.values() for s in v), starts
    # the kill restarted the whole group from a checkpoint taken before the kill
    assert [len(v) for v in starts.values()] == [2, 2], starts
    assert starts[1][0]["node"] == killed["node"] and starts[1][1]["node"] != killed["node"]
    resume = {s["resume_step"] for v in starts.values() for s in v[1:]}
    # the killer saw step >= kill_step; the rank may have gone a little further (and
    # checkpointed) before its node died: resume at most from its last step before the restart
    first = [r["step"] for r in ledger[1][:ledger[1].index(starts[1][1])] if "keys" in r]
    assert len(resume) == 1 and 0 < min(resume) <= max(first), (resume, killed, max(first))
    assert min(resume) % cfg["train"]["checkpoint_every"] == 0
    # each rank's last attempt ended the epoch once; the first attempt of the surviving rank
    # may have ended it too when the dead node's worker took a while to go (a loaded machine):
    # the audit below rolls that back
    last = {r: [x for x in recs[recs.index(starts[r][-1]):] if x.get("event") == "epoch_end"]
            for r, recs in ledger.items()}
    assert {r: len(v) for r, v in last.items()} == {0: 1, 1: 1}, last
    # decode actors and read tasks ran only on decode nodes (their own reports, per rank)
    ends = [x for recs in ledger.values() for x in recs if x.get("event") == "epoch_end"]
    for e in ends:
        assert e["decode_nodes"] and set(e["decode_nodes"]) <= decode_ids, e
        assert e["read_nodes"] and set(e["read_nodes"]) <= decode_ids, e
        assert e["node"] in train_ids and e["node"] != killed["node"]
    code, reports = run_audit(audit_dir, data)
    assert code == 0, reports
    assert_exactly_once(reports, samples)
    # batches the surviving rank logged between the kill and the teardown were rolled back:
    # the next batch that counts is the first one after the group's restart
    FIGURES["train_node_killed"] = {
        "killed_node": killed["node"][:12], "at_step": killed["step"],
        "resumed_from_step": min(resume), "restart_nodes": {r: v[1]["node"][:12]
                                                            for r, v in starts.items()},
        "train_nodes": sorted(n[:12] for n in train_ids),
        "decode_nodes_used": sorted({n[:12] for e in ends for n in e["decode_nodes"]}),
        "read_nodes_used": sorted({n[:12] for e in ends for n in e["read_nodes"]}),
        "samples_lost": reports[0]["missing"], "samples_duplicated": reports[0]["duplicated"],
        "kill_to_restart_s": round(killed["restart"] - killed["wall"], 2)
        if "restart" in killed else None,
        "kill_to_next_batch_s": round(killed["next_batch"] - killed["wall"], 2)
        if "next_batch" in killed else None,
        "job_s": round(elapsed, 1),
    }


# --- 2. Decode nodes: one joins, one is drained, one is killed, all mid-epoch ------------------

def decode_actor_nodes() -> dict[str, str]:
    """Live decode actors -> their node, from the GCS actor table."""
    import ray

    return {a["ActorID"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values()
            if re.search(r"DecodeWorker|MapBatches\((Read)?Decoder\)", a["ActorClassName"])
            and a["State"] == "ALIVE"}


@pytest.fixture
def small_data_budget(cluster):
    """Cap Ray Data's object-store budget (as docs/operations.md advises per rank), so the
    pipeline cannot decode the whole epoch ahead while the consumer waits for a node."""
    from ray.data import DataContext, ExecutionResources

    options = DataContext.get_current().execution_options
    saved = options.resource_limits
    options.resource_limits = ExecutionResources(object_store_memory=24 * MB)
    yield
    options.resource_limits = saved


def test_decode_pool_grows_onto_new_node_and_survives_drain_and_kill(cluster, tmp_path,
                                                                    small_data_budget):
    """One decode node with room for one actor of a pool that wants two; a second node joins
    mid-epoch: the pool grows onto it. Then a spare joins, a node that runs a decode actor is
    drained (GCS DrainNode, reason preemption) and stopped at the drain deadline, and another
    is SIGKILLed without notice: the ordered stream goes on, and the ledger audits
    exactly-once."""
    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.config import config_from_dict
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology
    from ray_ingest.tools.synth import synth_dataset
    from ray_ingest.train.ledger import append as ledger_append

    (first,) = decode_nodes(cluster, 1)
    samples = 1440
    data = str(tmp_path / "ds")
    synth_dataset(data, samples=samples, shard_size=48, seed=3, min_side=200, max_side=256)
    # 4-CPU decode nodes, 2.5 CPUs per actor: one actor per node, room for 2 read tasks
    cfg = config_from_dict({
        "data": {"paths": [data]},
        "decode": {"resolution": 224, "pool_min": 2, "pool_max": 3, "num_cpus": 2.5,
                   "label_selector": {"pool": "cpu-decode"}},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 16, "read_workers": 1, "read_num_cpus": 0.25, "block_rows": 16,
                   "prefetch_batches": 1, "seed": 1},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1),
                          catalog=load_catalog([data]))
    audit_dir = tmp_path / "audit"
    audit_dir.mkdir()
    ledger = str(audit_dir / "rank_00000.jsonl")
    ledger_append(ledger, {"event": "start", "rank": 0, "world": 1, "slot": 0,
                            "resume_step": 0, "epoch": 0})
    ever_decode = {first.node_id}
    events: dict[str, dict] = {}
    log: list[tuple[float, int, dict[str, int]]] = []  # (time, samples, decode_nodes)
    joined = drained = None
    step = 0
    for epoch, batches in loader.epochs(1):
        for batch in batches:
            now = time.monotonic()
            step += 1
            ledger_append(ledger, {"epoch": epoch, "step": step, "rank": 0, "slot": 0,
                                    "batch": batch.step_in_epoch, "keys": batch.sample_keys,
                                    "sids": batch.sids, "indices": batch.indices,
                                    "pads": batch.pads, "skipped": batch.skipped})
            log.append((now, loader.clock.samples, dict(loader.decode_nodes)))
            for ev in events.values():
                ev.setdefault("next_batch_s", now - ev["t"])
            if drained is not None and "kill" not in events:
                # a training step's compute between the drain and the kill: without it, a fast
                # decode finished the 90 batches before the drain deadline had passed (a fresh
                # clone on 2026-12-04 drained at batch 12 and was still at batch 86 then)
                time.sleep(TRAIN_STEP_S)
            if step == 4:  # a decode node joins
                events["join"] = {"t": time.monotonic(), "actors_before": len(loader.actors_seen),
                                  "nodes_before": len(loader.decode_nodes)}
                joined = cluster.add("decode", DECODE_CPUS)
                ever_decode.add(joined.node_id)
                events["join"]["start_s"] = time.monotonic() - events["join"]["t"]
                events["join"]["actors_on_nodes_before"] = len(set(decode_actor_nodes()
                                                                   .values()))
                # the pool's pending actor lands on the new node (GCS actor table)
                deadline = time.monotonic() + 120
                while (joined.node_id not in decode_actor_nodes().values()
                       and time.monotonic() < deadline):
                    time.sleep(0.1)
                events["join"]["actor_up_s"] = time.monotonic() - events["join"]["t"]
                events["join"]["actor_nodes_after"] = sorted(
                    n[:12] for n in set(decode_actor_nodes().values()))
            elif (joined and drained is None
                  and loader.decode_nodes.get(joined.node_id, 0) >= 2 * 16):
                # the pool grew onto the new node; a spare joins, the first node is drained
                events["join"].update(actors_after=len(loader.actors_seen),
                                      nodes_after=len(loader.decode_nodes), at_step=step,
                                      grown_until=time.monotonic())
                # 8 CPUs: room for the actors of both nodes that go away below (a lost node
                # whose actor cannot restart anywhere can stall the ordered stream: see
                # docs/operations.md "Decode-node loss")
                spare = cluster.add("decode", 2 * DECODE_CPUS)
                ever_decode.add(spare.node_id)
                drained = first
                events["drain"] = {"t": cluster.drain(drained, deadline_s=DRAIN_DEADLINE_S),
                                   "at_step": step, "node": drained.node_id[:12]}
            elif (drained is not None and "preempt" not in events
                  and time.monotonic() >= events["drain"]["t"] + DRAIN_DEADLINE_S):
                # the drain deadline passed: the preempted VM stops (no graceful shutdown)
                events["preempt"] = {"at_step": step, "t": cluster.kill(drained)}
            elif "preempt" in events and "kill" not in events and step >= \
                    events["preempt"]["at_step"] + 6:
                victim = joined  # runs a decode actor (it decoded since it joined)
                events["kill"] = {"node": victim.node_id[:12], "at_step": step,
                                  "t": cluster.kill(victim)}
        ledger_append(ledger, {"event": "epoch_end", "epoch": epoch, "rank": 0, "step": step})

    assert "kill" in events, f"the epoch ended before every node event happened: {events}"
    m = loader.metrics()
    # placement: decode and read only on decode nodes, as the actors and tasks report
    assert set(m["decode_nodes"]) <= ever_decode and set(m["read_nodes"]) <= ever_decode
    # growth: the pool spread onto the node that joined mid-epoch
    assert m["decode_nodes"].get(joined.node_id, 0) >= 2 * 16, m["decode_nodes"]
    assert events["join"]["nodes_after"] > events["join"]["nodes_before"]
    code, reports = run_audit(str(audit_dir), data)
    assert code == 0, reports
    assert_exactly_once(reports, samples)

    def rate(t0: float, t1: float) -> float:
        window = [(t, s) for t, s, _ in log if t0 <= t <= t1]
        if len(window) < 2:
            return float("nan")
        return (window[-1][1] - window[0][1]) / max(window[-1][0] - window[0][0], 1e-9)

    t_join_done = events["join"]["t"] + events["join"]["start_s"]
    grown = next(t for t, _, nodes in log if nodes.get(joined.node_id))
    # the longest wait for a batch between an event and the next one (or the end)
    starts = sorted((ev["t"], name) for name, ev in events.items())
    gaps = {}
    for (t_ev, name), (t_next, _) in zip(starts, [*starts[1:], (float("inf"), "")],
                                         strict=True):
        times = [t_ev] + [t for t, _, _ in log if t_ev < t <= t_next]
        gaps[name] = max((b - a for a, b in zip(times, times[1:], strict=False)), default=None)
    FIGURES["decode_nodes"] = {
        "pool_nodes_before_join": events["join"]["nodes_before"],
        "pool_nodes_after_join": events["join"]["nodes_after"],
        "actors_before_join": events["join"]["actors_before"],
        "actors_after_join": events["join"]["actors_after"],
        "node_start_s": round(events["join"]["start_s"], 2),
        "actor_on_new_node_after_s": round(events["join"]["actor_up_s"], 2),
        "actor_nodes_before_join (GCS)": events["join"]["actors_on_nodes_before"],
        "actor_nodes_after_join (GCS)": events["join"]["actor_nodes_after"],
        "first_batch_from_new_node_s": round(grown - t_join_done, 2),
        "samples_per_s_before_join": round(rate(log[0][0], events["join"]["t"]), 1),
        "samples_per_s_grown": round(rate(grown, events["join"]["grown_until"]), 1),
        "decode_nodes": {k[:12]: v for k, v in m["decode_nodes"].items()},
        **{f"{name}_next_batch_s": round(ev.get("next_batch_s", float("nan")), 3)
           for name, ev in events.items()},
        **{f"{name}_longest_gap_after_s": round(g, 2) for name, g in gaps.items() if g},
        "samples_lost": reports[0]["missing"], "samples_duplicated": reports[0]["duplicated"],
    }


# --- 3. Object-store pressure: 100 MB stores, 48 MB decoded blocks ----------------------------

@pytest.mark.parametrize("scope", ["rank", "job"])
def test_small_object_stores_spill_or_backpressure_never_lose_blocks(cluster, tmp_path, scope):
    """Decode nodes with 100 MB object stores and 48 MB decoded blocks (16 samples of 1024x1024
    RGB): Ray Data backpressure and plasma spilling/fallback absorb it. No node dies, no block is
    lost, every sample arrives once; peak use per node is reported against its limit. On the
    rank's own pool (one actor, two calls) and on the job's (one worker: the rank's window of
    three calls queues on it, so the pressure lands on one node, as the rank pool's does). One
    actor in both: a second one, on the other node, would split the window between the nodes.

    The trainer holds its first batch until a decode node has held two blocks at once: with a
    fast trainer and decode slowed by a busy machine, each block was consumed and freed before
    the next landed, so whether the pressure happened depended on the machine's load."""
    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.config import config_from_dict
    from ray_ingest.decode.sizing import in_flight_bytes
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology
    from ray_ingest.tools.synth import synth_dataset

    small = decode_nodes(cluster, 2, object_store_memory=100 * MB)
    samples, block_rows, res = 80, 16, 1024
    data = str(tmp_path / "ds")
    synth_dataset(data, samples=samples, shard_size=48, seed=5, min_side=200, max_side=256)
    cfg = config_from_dict({
        "data": {"paths": [data]},
        "decode": {"resolution": res, "pool_min": 1, "pool_max": 1, "num_cpus": 2.5,
                   "label_selector": {"pool": "cpu-decode"}, "pool_scope": scope},
        "loader": {"head_start_batches": 0, "batch_size": 8, "read_workers": 1,
                   "read_num_cpus": 0.25,
                   "block_rows": block_rows, "max_block_bytes": 64 * MB,
                   "prefetch_batches": 2, "seed": 1},
    })
    catalog = load_catalog([data])
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1), catalog=catalog)
    seen = []
    half = 0.5 * 100 * MB
    with StoreSampler(cluster, period_s=0.05) as sampler:
        for _, batches in loader.epochs(1):
            for batch in batches:
                if not seen:  # the window decodes ahead while the trainer holds a block
                    sampler.wait_used({i.node_id for i in small}, half, timeout_s=60)
                assert batch["image"].shape[1:] == (res, res, 3)
                seen += [(s, i) for s, i, p in zip(batch.sids, batch.indices, batch.pads,
                                                   strict=True) if not p]
    assert len(seen) == len(set(seen)) == samples  # nothing lost, nothing twice
    assert {i.node_id for i in cluster.alive("decode")} == {i.node_id for i in small}
    decoded = {i.node_id: sampler.peak[i.node_id] for i in small if i.node_id in sampler.peak}
    assert set(loader.metrics()["decode_nodes"]) <= set(decoded)
    for node_id, peak in decoded.items():
        # plasma never holds more primary copies than its capacity; overflow spills to disk
        # (spilled) or goes to filesystem-backed fallback allocations (fallback)
        assert peak["primary"] <= sampler.limits[node_id], (node_id, peak)
    # the pressure was real: some decode node filled at least half of its store
    assert max(p["used"] for p in decoded.values()) >= half, decoded
    formula = in_flight_bytes(cfg, actors=len(loader.actors_seen))
    FIGURES[f"object_store_{scope}_pool"] = {
        "block_mb": round(block_rows * res * res * 3 / MB, 1),
        "formula_mb": {k: round(formula[k] / MB, 1)
                       for k in ("decode_side", "consumer_side", "total")},
        "per_node": {
            ("head" if nid == cluster.head.node_id else "decode") + ":" + nid[:8]: {
                "limit_mb": round(sampler.limits[nid] / MB), **{
                    k: round(v / MB, 1) for k, v in p.items()
                    if k in ("used", "primary", "fallback", "spilled", "restored")}}
            for nid, p in sampler.peak.items()
            if nid == cluster.head.node_id or nid in decoded},
        "samples": len(seen), "store_polls": sampler.samples,
    }


def test_a_head_start_set_with_a_label_selector_decodes_the_first_batch_here(cluster, tmp_path):
    """Decode on labelled nodes turns the head start off unless the config sets it; set, the
    rank's first batch is decoded in its own process (the head here) and the rest on the
    decode nodes, and the delivered stream is the one without a head start."""
    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.config import config_from_dict
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology
    from ray_ingest.tools.synth import synth_dataset

    decode_ids = {i.node_id for i in decode_nodes(cluster, 2)}
    data = str(tmp_path / "ds")
    synth_dataset(data, samples=40, shard_size=16, seed=6, min_side=32, max_side=40)
    catalog = load_catalog([data])

    def stream(head_start: int | None) -> tuple[list, dict]:
        loader_cfg = {"batch_size": 8, "read_workers": 1, "block_rows": 8, "seed": 2}
        if head_start is not None:
            loader_cfg["head_start_batches"] = head_start
        cfg = config_from_dict({
            "data": {"paths": [data]},
            "decode": {"resolution": 32, "compute": "actors", "pool_min": 1, "pool_max": 1,
                       "num_cpus": 0.5, "label_selector": {"pool": "cpu-decode"}},
            "loader": loader_cfg})
        loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1),
                              catalog=catalog)
        out = [(list(b.sids), list(b.indices), b["image"].numpy().tobytes())
               for _, batches in loader.epochs(1) for b in batches]
        return out, loader.metrics()

    plain, unset = stream(None)
    head, started = stream(1)
    assert len(plain) == 5 and head == plain
    assert unset["head_start_rows"] == 0  # a selector alone: no head start
    assert 8 <= started["head_start_rows"] < 40  # the whole items holding one batch, here
    assert set(unset["decode_nodes"]) <= decode_ids, unset["decode_nodes"]
    # rows per node that decoded them: the head start's here, the rest on decode nodes
    nodes = dict(started["decode_nodes"])
    assert nodes.pop(cluster.head.node_id) == started["head_start_rows"], started
    assert nodes and set(nodes) <= decode_ids, started["decode_nodes"]
    assert sum(nodes.values()) == 40 - started["head_start_rows"]


# --- 4. Autoscaler: fake multi-node provider with cluster.yaml's node types --------------------

def test_autoscaler_launches_decode_node_for_labelled_demand_and_removes_it_idle(tmp_path):
    """Ray's autoscaler (v2, fake multi-node provider) on cluster.yaml's ``cpu_decode`` and
    ``gpu_train`` types: the loader's read tasks and decode actors (``decode.label_selector``)
    are pending on a head without decode nodes, a ``cpu_decode`` node is launched with its
    label, the epoch completes on it, and the idle node is removed after the idle timeout."""
    from ray_ingest.tools.synth import synth_dataset
    from tests.support.multinode_autoscale import IDLE_TIMEOUT_MIN, FakeAutoscalingCluster

    data = str(tmp_path / "ds")
    synth_dataset(data, samples=64, shard_size=16, seed=2, min_side=32, max_side=40)
    fake = FakeAutoscalingCluster(str(tmp_path))
    try:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tests.support.multinode_autoscale",
                               fake.address, data], env=fake.driver_env(), capture_output=True,
                              text=True, timeout=400, cwd=REPO)
        elapsed = time.monotonic() - t0
    finally:
        fake.stop()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-3000:])
    res = json.loads(lines[-1][len("RESULT "):])
    assert all("pool" not in labels for labels in res["nodes_before"].values())
    (launched_id, launched), = res["launched"].items()
    assert launched["type"] == "cpu_decode" and launched["labels"]["pool"] == "cpu-decode"
    assert set(res["decode_nodes"]) == set(res["read_nodes"]) == {launched_id}
    assert res["samples"] == res["distinct"] == 64
    assert res["removed"], res
    assert res["removed_after_idle_s"] >= IDLE_TIMEOUT_MIN * 60 * 0.5
    FIGURES["autoscaler"] = {
        "launched_type": launched["type"], "labels": launched["labels"],
        "first_batch_s (incl. node launch)": round(res["first_batch_s"], 1),
        "removed_after_idle_s": round(res["removed_after_idle_s"], 1),
        "idle_timeout_s": IDLE_TIMEOUT_MIN * 60, "total_s": round(elapsed, 1),
    }
