"""Chaos soak: the training job under a seeded random schedule of every fault kind it claims to
survive, then the exactly-once audit.

    .venv/bin/python bench/chaos.py [--duration-s 600] [--seed 0] [--json chaos.json]

The project's TorchTrainer job (:mod:`ray_ingest.train.job`, what ``jobs/train.py`` runs) trains
on a loopback multi-node Ray cluster (``tests/support/multinode.py``: a head with no CPUs, two
``pool: gpu-train`` nodes, two ``pool: cpu-decode`` nodes, each its own raylet and object store)
with token authentication on, reading ``gs://`` twin tars from the GCS emulator through the
fault-injecting proxy (``tests/support/faultproxy.py``), ``loader.on_error: skip``, the job's
decode pool (``decode.compute: actors``, the default ``pool_scope: job``: one controller, its
workers on the decode nodes), checkpoints every 2 steps, ``max_failures: -1``.
For ``--duration-s`` the main thread (the job runs in another) injects faults drawn from
``random.Random(seed)``:

* ``decode_actor_kill``: SIGKILL a live decode actor's process;
* ``decode_node_loss``: SIGKILL a decode node's raylet (never the last one), add a fresh
  decode node back after a seeded delay;
* ``train_worker_kill``: SIGKILL a Ray Train worker process (Ray Train restarts the group from
  the last checkpoint);
* ``gs_reset`` / ``gs_stall``: the proxy cuts the next 1-3 responses mid-body, or stalls one
  (then cuts it);
* ``object_store_pressure``: an actor on a random node fills 70% of that node's object store
  for a few seconds, then frees it;
* ``corrupt_member``: planted before the run (seeded: corrupt and truncated JPEGs among the
  members), hit once per epoch and recorded as skips.

Heavy faults (node loss, train worker kill) wait until training has moved past the previous
one. At the end of the duration a stop file ends the job at the next epoch end
(``jobs/train.py --stop-file``). The duration counts from the job's first steps (Ray Train
takes 10-30 s to start its worker group here). The table gives, per kind: faults injected, recovered
(training moved past the step it was at; for node loss the node came back, for a train worker
kill the group restarted; corrupt members: recorded as skips in an exactly-once epoch) and
time lost (wall time from the fault until the job stepped past the step it was at, less one
median step; faults that overlap each count their own). Exit status 1 unless every epoch
audits exactly-once, the job ended cleanly and every fault recovered.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")

KINDS = ("decode_actor_kill", "decode_node_loss", "train_worker_kill", "gs_reset", "gs_stall",
         "object_store_pressure", "corrupt_member")
#: Scheduled kinds and their weights in the draw (corrupt members are planted, not scheduled).
WEIGHTS = {"decode_actor_kill": 4, "decode_node_loss": 1, "train_worker_kill": 1,
           "gs_reset": 4, "gs_stall": 2, "object_store_pressure": 2}
HEAVY = ("decode_node_loss", "train_worker_kill")
MB = 1024**2
DECODE_CPUS, TRAIN_NODES, DECODE_NODES = 4, 2, 2
STORE_MB = 160


# --- the schedule -------------------------------------------------------------------------------


def fault_plan(seed: int, duration_s: float) -> list[dict[str, Any]]:
    """The seeded schedule: kind, pause before it and its parameters, for up to the duration
    (more than fits: a fault waits for the previous heavy one to be over)."""
    rng = random.Random(seed)
    kinds, weights = zip(*WEIGHTS.items(), strict=True)
    plan, t = [], 0.0
    while t < duration_s:
        kind = rng.choices(kinds, weights)[0]
        pause = rng.uniform(3.0, 9.0)
        t += pause
        plan.append({"kind": kind, "pause_s": round(pause, 2), "pick": rng.random(),
                     "count": rng.randint(1, 3), "hold_s": round(rng.uniform(3.0, 8.0), 2),
                     "return_after_s": round(rng.uniform(4.0, 12.0), 2)})
    return plan


# --- the data: synthetic twin tars with planted corrupt members, on the GCS emulator ------------


def make_data(work: Path, shards: int, shard_size: int, seed: int, corrupt: int
              ) -> tuple[Path, list[tuple[str, int, str]]]:
    """A local twin dataset with ``corrupt`` image members replaced (seeded: random bytes or a
    JPEG cut in half); returns it and the planted (shard path, index, how)."""
    from ray_ingest.tools.synth import synth_dataset
    from tests.decode.test_corrupt import members, replace_member

    root = work / "ds"
    synth_dataset(str(root), samples=shards * shard_size, shard_size=shard_size, seed=seed,
                  min_side=24, max_side=48)
    rng = random.Random(seed + 1)
    data_list = json.loads((root / "wdinfo.json").read_text())["data_list"]
    planted = []
    for shard, index in sorted(rng.sample([(s, i) for s in range(shards)
                                           for i in range(shard_size)], corrupt)):
        path = root / "image" / data_list[shard]
        if rng.random() < 0.5:
            replace_member(path, index, rng.randbytes(700))
            how = "random bytes"
        else:
            data = members(path)[index][1]
            replace_member(path, index, data[:len(data) // 2])
            how = "truncated JPEG"
        planted.append((data_list[shard], index, how))
    return root, planted


@contextlib.contextmanager
def gcs_emulator():
    from gcp_storage_emulator.server import create_server

    from tests.support.fixtures_gcs import BUCKET, _quiet_disconnects, free_port

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    starter.join(timeout=10)
    if starter.is_alive():
        raise SystemExit("could not start the GCS emulator on 127.0.0.1")
    httpd = getattr(getattr(server, "_api", None), "_httpd", None)
    if httpd is not None:
        _quiet_disconnects(httpd)
    try:
        yield port
    finally:
        server.stop()


# --- watching the job: the ledger as it is written ---------------------------------------------


class Timeline:
    """Polls the job's ledger files and stamps every new record with the time it appeared: the
    job's progress in wall time (the ledger itself carries no clock)."""

    def __init__(self, audit_dir: str, period_s: float = 0.05):
        self.audit_dir = audit_dir
        self.period_s = period_s
        self.steps: list[tuple[float, int, int]] = []  # (time, rank, step)
        self.starts: list[tuple[float, int]] = []  # (time, rank)
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-timeline", daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()

    def _poll(self) -> None:
        now = time.monotonic()
        for path in glob.glob(os.path.join(self.audit_dir, "rank_*.jsonl")):
            with open(path) as f:
                f.seek(self._offsets.get(path, 0))
                text = f.read()
            complete = text[:text.rfind("\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                rec = json.loads(line)
                with self._lock:
                    if rec.get("event") == "start":
                        self.starts.append((now, rec["rank"]))
                    elif "keys" in rec:
                        self.steps.append((now, rec["rank"], rec["step"]))

    def step_now(self) -> int:
        """The highest step rank 0 has logged since its last (re)start (-1: none yet)."""
        with self._lock:
            last_start = max((t for t, r in self.starts if r == 0), default=-1.0)
            steps = [s for t, r, s in self.steps if r == 0 and t >= last_start]
        return max(steps, default=-1)

    def passed(self, step: int, since: float) -> float | None:
        """When rank 0 first logged a step past ``step`` after ``since`` (None: not yet)."""
        with self._lock:
            return next((t for t, r, s in self.steps if r == 0 and t > since and s > step), None)

    def restarted(self, since: float) -> bool:
        with self._lock:
            return any(t > since for t, _ in self.starts)

    def median_step_s(self) -> float:
        with self._lock:
            times = [t for t, r, _ in self.steps if r == 0]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > a]
        return statistics.median(gaps) if gaps else 0.0


# --- injecting faults ---------------------------------------------------------------------------


class Pressure:
    """Holds ~``mb`` MB in its node's object store (ray.put of zeros) until released."""

    def __init__(self) -> None:
        self.refs: list[Any] = []

    def fill(self, mb: int) -> int:
        import numpy as np
        import ray

        self.refs = [ray.put(np.zeros(8 * MB, dtype=np.uint8)) for _ in range(mb // 8)]
        return len(self.refs) * 8

    def release(self) -> None:
        self.refs = []


class Injector:
    """One method per fault kind; each returns what it did (a ``detail`` dict) or None when it
    could not be injected now (then nothing was done)."""

    def __init__(self, cluster: Any, proxy: Any, timeline: Timeline, log_line: Any):
        self.cluster = cluster
        self.proxy = proxy
        self.timeline = timeline
        self.say = log_line

    @staticmethod
    def _actors(pattern: str) -> list[dict[str, Any]]:
        import ray

        return [a for a in ray._private.state.actors().values()
                if pattern in a["ActorClassName"] and a["State"] == "ALIVE" and a.get("Pid")]

    def decode_actor_kill(self, f: dict[str, Any]) -> dict[str, Any] | None:
        actors = sorted(self._actors("DecodeWorker"), key=lambda a: a["ActorID"])
        if not actors:
            return None
        victim = actors[int(f["pick"] * len(actors))]
        os.kill(victim["Pid"], signal.SIGKILL)
        return {"actor": victim["ActorID"][:12], "pid": victim["Pid"]}

    def train_worker_kill(self, f: dict[str, Any]) -> dict[str, Any] | None:
        workers = sorted(self._actors("RayTrainWorker"), key=lambda a: a["ActorID"])
        if len(workers) < 2:
            return None  # the group is (re)starting
        victim = workers[int(f["pick"] * len(workers))]
        os.kill(victim["Pid"], signal.SIGKILL)
        return {"actor": victim["ActorID"][:12], "pid": victim["Pid"]}

    def decode_node_loss(self, f: dict[str, Any]) -> dict[str, Any] | None:
        alive = sorted(self.cluster.alive("decode"), key=lambda i: i.node_id)
        if len(alive) < 2:
            return None  # never the last decode node
        victim = alive[int(f["pick"] * len(alive))]
        self.cluster.kill(victim)
        time.sleep(f["return_after_s"])
        detail = {"node": victim.node_id[:12], "down_s": f["return_after_s"],
                  "returned_as": None}
        try:  # (a node that does not come back is reported, not fatal here)
            detail["returned_as"] = self.cluster.add("decode", DECODE_CPUS,
                                                     STORE_MB * MB).node_id[:12]
        except Exception as exc:
            detail["return_error"] = f"{type(exc).__name__}: {exc}"
        return detail

    def gs_reset(self, f: dict[str, Any]) -> dict[str, Any] | None:
        self.proxy.inject("reset", f["count"])
        return {"responses_cut": f["count"]}

    def gs_stall(self, f: dict[str, Any]) -> dict[str, Any] | None:
        self.proxy.inject("stall", 1)
        return {"stalled_s": self.proxy.stall_s}

    def object_store_pressure(self, f: dict[str, Any]) -> dict[str, Any] | None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted([*self.cluster.alive("decode"), *self.cluster.alive("train")],
                       key=lambda i: i.node_id)
        if not nodes:
            return None
        node = nodes[int(f["pick"] * len(nodes))]
        actor = ray.remote(num_cpus=0)(Pressure).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
        try:
            held = ray.get(actor.fill.remote(int(STORE_MB * 0.7)), timeout=60)
            time.sleep(f["hold_s"])
            ray.get(actor.release.remote(), timeout=60)
        finally:
            ray.kill(actor)
        return {"node": node.node_id[:12], "role": node.role, "held_mb": held,
                "hold_s": f["hold_s"]}


#: How long the job may take to start training before the soak gives up on it.
START_TIMEOUT_S = 600.0


def run_schedule(plan: list[dict[str, Any]], injector: Injector, timeline: Timeline,
                 duration_s: float, stop: threading.Event, faults: list[dict[str, Any]]) -> None:
    """Inject ``plan`` for ``duration_s`` from the job's first steps (or until ``stop``);
    heavy faults wait for the previous heavy one to be over (training moved past it)."""
    started = time.monotonic()
    while timeline.step_now() < 1 and not stop.wait(0.5):  # the job trains
        if time.monotonic() > started + START_TIMEOUT_S:
            injector.say(f"[chaos] the job did not train within {START_TIMEOUT_S:.0f} s")
            return
    deadline = time.monotonic() + duration_s
    last_heavy: dict[str, Any] | None = None
    for f in plan:
        if stop.wait(f["pause_s"]) or time.monotonic() > deadline:
            return
        if f["kind"] in HEAVY and last_heavy is not None:
            while (timeline.passed(last_heavy["step_at"], last_heavy["t"]) is None
                   and time.monotonic() < deadline and not stop.wait(0.5)):
                pass
        t, step = time.monotonic(), timeline.step_now()
        try:
            detail = getattr(injector, f["kind"])(f)
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            detail = {"not_injected": f"{type(exc).__name__}: {exc}"}
        if detail is None or "not_injected" in detail:
            injector.say(f"[chaos] {f['kind']}: not injected now ({detail})")
            continue
        rec = {"kind": f["kind"], "t": t, "step_at": step, **detail}
        faults.append(rec)
        if f["kind"] in HEAVY:
            last_heavy = rec
        injector.say(f"[chaos] {time.monotonic() - timeline_start(timeline):7.1f}s step {step}: "
                     f"{f['kind']} {json.dumps(detail)}")


def timeline_start(timeline: Timeline) -> float:
    with timeline._lock:
        return timeline.steps[0][0] if timeline.steps else time.monotonic()


# --- the run ------------------------------------------------------------------------------------


def job_config(path: Path, gs_root: str, endpoint: str, epochs: int) -> None:
    import yaml

    cfg = {
        "data": {"paths": [f"{gs_root}/wdinfo.json"], "modalities": ["image", "caption"],
                 "storage_options": {"token": "anon", "project": "test",
                                     "endpoint_url": endpoint}},
        "decode": {"resolution": 32, "compute": "actors", "pool_min": 1, "pool_max": 2,
                   "num_cpus": 0.5, "label_selector": {"pool": "cpu-decode"},
                   "scale_down_hold_s": 5.0},
        "loader": {"batch_size": 8, "seed": 4, "read_workers": 1, "block_rows": 8,
                   "head_start_batches": 0, "prefetch_batches": 1, "on_error": "skip",
                   "max_skips_per_shard": None, "max_skips_per_epoch": None,
                   "stall_timeout_s": 300},
        "train": {"num_workers": 2, "cpus_per_worker": 1, "checkpoint_every": 2,
                  "log_every": 1000, "max_failures": -1, "epochs": epochs,
                  "label_selector": {"pool": "gpu-train"}},
    }
    path.write_text(yaml.safe_dump(cfg))


def fault_table(faults: list[dict[str, Any]], timeline: Timeline, proxy_counts: dict[str, int],
                reports: list[dict[str, Any]], planted: int, end: float) -> list[dict[str, Any]]:
    """Per kind: injected, recovered, time lost (s)."""
    median = timeline.median_step_s()
    rows: dict[str, dict[str, Any]] = {k: {"kind": k, "injected": 0, "recovered": 0,
                                           "time_lost_s": 0.0} for k in KINDS}
    for f in faults:
        kind = f["kind"]
        row = rows[kind]
        count = f.get("responses_cut", 1) if kind == "gs_reset" else 1
        row["injected"] += count
        passed = timeline.passed(f["step_at"], f["t"])
        ok = passed is not None and passed <= end
        if kind == "train_worker_kill":
            ok = ok and timeline.restarted(f["t"])
        if kind == "decode_node_loss":
            ok = ok and bool(f.get("returned_as"))
        f["recovered"] = ok
        if ok:
            row["recovered"] += count
            f["time_lost_s"] = round(max(0.0, passed - f["t"] - median), 2)
            row["time_lost_s"] += f["time_lost_s"]
    # what the proxy applied (forced faults wait for requests; none may be left over)
    for kind, proxy_kind in (("gs_reset", "reset"), ("gs_stall", "stall")):
        applied = proxy_counts.get(proxy_kind, 0)
        if applied != rows[kind]["injected"]:
            rows[kind]["note"] = f"proxy applied {applied}"
            rows[kind]["recovered"] = min(rows[kind]["recovered"], applied)
            rows[kind]["injected"] = applied
    skips = sum(r["skipped"] for r in reports)
    rows["corrupt_member"].update(
        injected=skips, recovered=sum(r["skipped"] for r in reports if r["exactly_once"]),
        note=f"{planted} planted, skipped in each of {len(reports)} epochs")
    for row in rows.values():
        row["time_lost_s"] = round(row["time_lost_s"], 1)
    return list(rows.values())


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ("kind", "injected", "recovered", "time_lost_s", "note")
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    total = ["total", str(sum(r["injected"] for r in rows)),
             str(sum(r["recovered"] for r in rows)),
             str(round(sum(r["time_lost_s"] for r in rows), 1)), ""]
    widths = [max(len(c), *(len(x[i]) for x in [*cells, total])) for i, c in enumerate(cols)]
    for line in ([list(cols)] + cells + [total]):
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0,
                    help="how long faults are injected, from the job's first steps (the job "
                         "then ends at its next epoch end)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the schedule and the data")
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--shard-size", type=int, default=8)
    ap.add_argument("--corrupt", type=int, default=3, help="corrupt image members planted")
    ap.add_argument("--min-faults", type=int, default=0,
                    help="exit 1 with fewer scheduled faults injected (corrupt members aside)")
    ap.add_argument("--json", help="write the table, the faults and the audit here")
    ap.add_argument("--workdir", help="keep the run's files here (default: a temporary folder)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return soak(args, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


def soak(args: argparse.Namespace, work: Path) -> int:
    import ray

    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.tools.audit import audit, read_ledgers, summary_line
    from ray_ingest.train.auth import secure_local_ray
    from ray_ingest.train.job import main as train_main
    from tests.support.faultproxy import FaultProxy
    from tests.support.fixtures_gcs import BUCKET, upload_tree
    from tests.support.multinode import LoopbackCluster, loopback

    secure_local_ray()  # token authentication on, as deployed (a one-off token if none is set)
    local, planted = make_data(work, args.shards, args.shard_size, args.seed, args.corrupt)
    plan = fault_plan(args.seed, args.duration_s)
    audit_dir, stop_file = str(work / "audit"), work / "stop"
    faults: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def say(line: str) -> None:
        print(line, flush=True)

    with gcs_emulator() as port, loopback():
        gs_root = f"gs://{BUCKET}/chaos"
        upload_tree(local, gs_root, {"token": "anon", "project": "test",
                                     "endpoint_url": f"http://127.0.0.1:{port}"})
        proxy = FaultProxy(port, rate=0.0, seed=args.seed, stall_s=2.0, io_timeout_s=10.0)
        proxy.start()
        cluster = LoopbackCluster()
        try:
            for _ in range(TRAIN_NODES):
                cluster.add("train", 1, STORE_MB * MB, wait=False)
            for _ in range(DECODE_NODES):
                cluster.add("decode", DECODE_CPUS, STORE_MB * MB, wait=False)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False,
                     runtime_env={"env_vars": {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                                               "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
                                               "PYTHONPATH": REPO}})
            job_config(work / "job.yaml", gs_root, proxy.endpoint, epochs=100_000)
            stop, result = threading.Event(), {"rc": None}

            def job() -> None:
                try:
                    result["rc"] = train_main(
                        ["--config", str(work / "job.yaml"), "--storage-path",
                         str(work / "runs"), "--name", "chaos", "--audit-dir", audit_dir,
                         "--stop-file", str(stop_file)])
                finally:
                    stop.set()  # the job is over: no more faults

            with Timeline(audit_dir) as timeline:
                injector = Injector(cluster, proxy, timeline, say)
                # the job in a thread (Ray Train allows it), the faults in the main thread:
                # starting a node (a decode node's return) registers signal handlers
                trainer = threading.Thread(target=job, name="chaos-job", daemon=True)
                trainer.start()
                run_schedule(plan, injector, timeline, args.duration_s, stop, faults)
                stop_file.write_text("stop")  # the job ends at its next epoch end
                trainer.join()
                rc = result["rc"]
                end = time.monotonic()
            proxy_counts = proxy.counts()
        finally:
            with contextlib.suppress(Exception):
                ray.shutdown()
            cluster.shutdown()
            proxy.stop()
    reports = audit(read_ledgers(audit_dir), load_catalog([str(local)]))
    rows = fault_table(faults, timeline, proxy_counts, reports, len(planted), end)
    for r in reports:
        say(f"[chaos] audit {summary_line(r)}")
    elapsed = end - t0
    say(f"[chaos] job exit {rc}; {len(reports)} epochs; wall {elapsed:.0f} s "
        f"(faults injected for {args.duration_s:.0f} s); median step "
        f"{timeline.median_step_s():.2f} s")
    print_table(rows)
    scheduled = [r for r in rows if r["kind"] != "corrupt_member"]
    n_scheduled = sum(r["injected"] for r in scheduled)
    ok = (rc == 0 and reports and all(r["exactly_once"] for r in reports)
          and all(r["recovered"] == r["injected"] for r in rows)
          and n_scheduled >= args.min_faults)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "rows": rows, "faults": faults, "audit": reports,
             "planted": planted, "job_exit": rc, "wall_s": round(elapsed, 1),
             "kinds_injected": sum(1 for r in rows if r["injected"]),
             "scheduled_faults": n_scheduled,
             "ok": bool(ok)}, indent=1, default=str))
    once = bool(reports) and all(r["exactly_once"] for r in reports)
    say(f"[chaos] {'OK' if ok else 'FAILED'}: {n_scheduled} scheduled faults of "
        f"{sum(1 for r in scheduled if r['injected'])} kinds "
        f"({sum(r['recovered'] for r in scheduled)} recovered) and "
        f"{rows[-1]['injected']} corrupt-member skips; every epoch "
        f"{'exactly-once' if once else 'NOT exactly-once'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
