"""Scale-out simulation on a loopback multi-node Ray cluster (issue 29, part 4).

    .venv/bin/python bench/scale_out.py [--actors 1,2,4,8] [--ranks 16,64] [--runs 3]
        [--compute actors] [--rank-compute tasks] [--sim-cost-s 0.02] [--json-out F]

A real multi-node Ray cluster on 127.0.0.1 (``tests/multinode.py``: every node its own raylet
and object store, labelled like ``cluster.yaml``'s node types): a head with no CPUs (the
driver, this process, and Ray's singletons), ``--decode-nodes`` ``pool: cpu-decode`` nodes and
``--train-nodes`` ``pool: gpu-train`` nodes. Decoding costs a fixed, seeded sleep per sample
(``decode.sim_cost_s``, benchmarks only) on 32 px images, so decode capacity is the number of
decoders over the sleep, not this machine's two cores.

1. *Decode actors* (``--actors``): one consumer, a plain Ray actor on a train node running
   :class:`~ray_ingest.stream.IngestLoader`'s loop as rank 0 of 1, with ``pool_min = pool_max
   = n`` decoders on the decode nodes; delivered samples/s (steady: from the batch where every
   decoder had delivered, to the last) and the ratio to n = 1.
2. *Simulated ranks* (``--ranks``): R plain Ray actors, rank r of a world of R each, each
   running the loader's loop with its own pipeline. Per rank: time to first batch, batches, and
   whether the delivered (shard, index, pad) sequence equals the one the planner gives for that
   rank (:func:`planned_batches`, computed here from ``ray_ingest.plan`` alone). Cluster-wide:
   CPU seconds of the driver, the GCS (``gcs_server``), the raylets and every other kind of
   Ray process (from /proc, this process's descendants only: other people's Ray processes on
   the machine are not counted) over the streaming window and over the whole phase (actor
   start-up included), per delivered sample; peak RSS and PSS per process kind.

The harness uses only IngestLoader's public API and config, so it runs unchanged on any
``decode.compute`` mode (``--compute`` for part 1, ``--rank-compute`` for part 2).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from ray_ingest.plan.assign import PlanParams  # noqa: E402
from ray_ingest.plan.slices import iter_samples, plan_epoch  # noqa: E402

Sample = tuple[int, int, bool]  # (shard id, index in shard, pad)

# --- the plan, computed without the loader ----------------------------------------------------


def planned_batches(counts: Sequence[int], chunk_size: int, params: PlanParams, world: int,
                    rank: int, num_workers: int, batch_size: int, epochs: int
                    ) -> list[list[Sample]]:
    """The batches rank ``rank`` of ``world`` (group size 1) must deliver, in order, from the
    planner alone (``plan_epoch``): each epoch's slot stream cut into ``batch_size`` batches, a
    partial last batch padded with marked duplicates of its own rows, as the batcher documents.

    Raises ValueError where the epoch would need pad-only batches (slots of unequal length
    without ``equal_work``): choose a dataset that does not.
    """
    out: list[list[Sample]] = []
    for epoch in range(epochs):
        streams = plan_epoch(counts, chunk_size, world, num_workers, params, epoch)
        need = [math.ceil(sum(sl.count for sl in s) / batch_size) for s in streams]
        mine = list(iter_samples(streams[rank]))
        total = max(need) if params.equal_work else need[rank]
        if math.ceil(len(mine) / batch_size) != total:
            raise ValueError(f"rank {rank} epoch {epoch}: {len(mine)} samples but {total} "
                             f"planned batches of {batch_size}: pad-only batches not modelled")
        for b in range(total):
            batch = mine[b * batch_size:(b + 1) * batch_size]
            own = list(batch)
            while len(batch) < batch_size:
                batch += [(sid, idx, True) for sid, idx, _ in own[:batch_size - len(batch)]]
            out.append(batch)
    return out


def compare(delivered: Sequence[Sequence[Sample]], planned: Sequence[Sequence[Sample]],
            prefix: bool = False) -> str | None:
    """None when ``delivered`` is exactly ``planned`` batch by batch (with ``prefix``: its first
    ``len(delivered)`` batches); else one line naming the first difference."""
    if not prefix and len(delivered) != len(planned):
        return f"{len(delivered)} batches delivered, {len(planned)} planned"
    if len(delivered) > len(planned):
        return f"{len(delivered)} batches delivered, only {len(planned)} planned"
    for i, (got, want) in enumerate(zip(delivered, planned, strict=False)):
        got = [tuple(s) for s in got]
        want = [tuple(s) for s in want]
        if got != want:
            j = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                     min(len(got), len(want)))
            return (f"batch {i} differs at row {j}: got {got[j] if j < len(got) else None}, "
                    f"planned {want[j] if j < len(want) else None} ({len(got)} vs {len(want)} "
                    f"rows)")
    return None


# --- who uses the CPU: /proc, this process's descendants only ------------------------------

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat(pid: int) -> tuple[int, float, int] | None:
    """(ppid, user+system CPU seconds, RSS bytes) of ``pid`` (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rfind(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[21]) * PAGE


def _machine_busy() -> float:
    """CPU seconds the machine spent busy since boot (every process, not only ours)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:]]
    return (sum(t[:8]) - t[3] - t[4]) / TICK  # all but idle and iowait


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _pss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: Kinds a process may leave (a worker before it runs a task or an actor, or between tasks; a
#: child forked but not yet exec'd).
TRANSIENT = ("idle_worker", "starting_worker", "forked_driver", "forked")
#: The kind of a child forked but not yet exec'd, by its parent's kind (else ``forked``): it
#: shows its parent's command line, and is not another process of its parent's kind.
FORKED_BY = {"raylet": "starting_worker", "driver": "forked_driver",
             "forked_driver": "forked_driver"}


def kind_of(cmd: str, pid: int, driver: int) -> str:
    """A process's kind from its command line (Ray sets ``ray::<actor or task>`` titles)."""
    if pid == driver:
        return "driver"
    if cmd.startswith("ray::"):
        title = cmd[5:].split(" ")[0]
        if title in ("IDLE", "IDLE_SPILL_WORKER", "IDLE_RESTORE_WORKER"):
            return "idle_worker"
        if title.startswith(("MapWorker", "MapBatches", "_map_task", "ReadDecoder", "Decoder")):
            return "decode_worker"
        return title.split(".")[0].split("(")[0]
    words = cmd.split(" ")
    exe = os.path.basename(words[0])
    if exe in ("gcs_server", "raylet"):
        return exe
    # Python processes: the script (or -m module) names them
    script = next((w for w in words[1:3] if not w.startswith("-")), "")
    name = os.path.basename(script)
    if name in ("default_worker.py", "setup_worker.py"):
        return "starting_worker"
    if script.endswith("dashboard/agent.py"):
        return "dashboard_agent"
    if script.endswith("runtime_env/agent/main.py"):
        return "runtime_env_agent"
    if name.endswith(".py"):
        return name.removesuffix(".py")
    return "other:" + (exe or "?")[:30]


class ProcSampler:
    """Samples CPU and RSS of every descendant of this process (the cluster it started) in a
    thread; :meth:`mark` takes a snapshot now. A process keeps the most specific kind seen
    (a task worker is ``idle_worker`` between tasks)."""

    def __init__(self, period_s: float = 0.25, pss_every: int = 8):
        self.driver = os.getpid()
        self.period_s, self.pss_every = period_s, pss_every
        self.cpu: dict[int, float] = {}
        self.kind: dict[int, str] = {}
        self.peak_rss: dict[int, int] = {}
        self.rss: dict[int, int] = {}
        self.live: set[int] = set()
        self.peak_pss: dict[int, int] = {}
        self.marks: dict[str, dict[int, float]] = {}
        #: CPU seconds this sampler's own thread used (taken off the driver's).
        self.self_cpu = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="proc-sampler")
        self._n = 0

    def __enter__(self) -> ProcSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _descendants(self) -> dict[int, tuple[int, float, int]]:
        table: dict[int, tuple[int, float, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(int(name))
                if st is not None:
                    table[int(name)] = st
        children: dict[int, list[int]] = collections.defaultdict(list)
        for pid, (ppid, _, _) in table.items():
            children[ppid].append(pid)
        out, todo = {}, [self.driver]
        while todo:
            pid = todo.pop()
            if pid in table:
                out[pid] = table[pid]
            todo.extend(children.get(pid, ()))
        return out

    def sample(self, pss: bool = False) -> None:
        t0 = time.thread_time()
        procs = self._descendants()
        with self._lock:
            self.live = set(procs)
            for pid, (ppid, cpu, rss) in procs.items():
                self.cpu[pid] = cpu
                self.rss[pid] = rss
                self.peak_rss[pid] = max(self.peak_rss.get(pid, 0), rss)
                kind = self.kind.get(pid)
                if kind is None or kind in TRANSIENT or kind.startswith("other:"):
                    cmd = _cmdline(pid)
                    kind = kind_of(cmd, pid, self.driver)
                    if kind != "driver" and cmd and cmd == _cmdline(ppid):
                        kind = FORKED_BY.get(self.kind.get(ppid, ""), "forked")
                    self.kind[pid] = kind
                if pss:
                    p = _pss(pid)
                    if p is not None:
                        self.peak_pss[pid] = max(self.peak_pss.get(pid, 0), p)
        if threading.current_thread() is self._thread:
            self.self_cpu += time.thread_time() - t0

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._n += 1
            self.sample(pss=self._n % self.pss_every == 0)

    def mark(self, name: str) -> None:
        self.sample(pss=True)
        with self._lock:
            self.marks[name] = {**self.cpu, -1: self.self_cpu, -2: _machine_busy()}

    def machine_between(self, a: str, b: str) -> float:
        """CPU seconds the whole machine was busy between two marks (everyone's processes)."""
        return self.marks[b][-2] - self.marks[a][-2]

    def cpu_between(self, a: str, b: str) -> dict[str, float]:
        """CPU seconds per kind between two marks (a process's last sample if it ended)."""
        m0, m1 = self.marks[a], self.marks[b]
        out: dict[str, float] = collections.defaultdict(float)
        for pid, cpu in m1.items():
            if pid < 0:
                continue
            out[self.kind.get(pid, "?")] += cpu - m0.get(pid, 0.0)
        # processes that ended between the marks: their last sample
        with self._lock:
            for pid, cpu in self.cpu.items():
                if pid not in m1 and pid in self.kind:
                    out[self.kind[pid]] += cpu - m0.get(pid, 0.0)
        # the sampler thread runs in the driver: not the driver's work
        out["driver"] -= m1[-1] - m0[-1]
        return dict(out)

    def memory(self, pids: set[int] | None = None) -> dict[str, dict[str, float]]:
        """Peak RSS / PSS (MB) per kind: count, median and max per process."""
        by: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        with self._lock:
            for pid, rss in self.peak_rss.items():
                if pids is None or pid in pids:
                    by[self.kind.get(pid, "?")].append((rss, self.peak_pss.get(pid, 0)))
        mb = 1024**2
        return {k: {"n": len(v),
                    "rss_median_mb": round(statistics.median(r for r, _ in v) / mb),
                    "rss_max_mb": round(max(r for r, _ in v) / mb),
                    "pss_median_mb": round(statistics.median(p for _, p in v) / mb),
                    "pss_max_mb": round(max(p for _, p in v) / mb)}
                for k, v in sorted(by.items())}

    def rss_mb(self, kinds: Sequence[str]) -> dict[str, int]:
        """Current RSS (MB) of the processes of ``kinds`` (the latest sample; summed per kind)."""
        out: dict[str, int] = {}
        with self._lock:
            for pid, rss in self.rss.items():
                k = self.kind.get(pid)
                if k in kinds and pid in self.live:
                    out[k] = out.get(k, 0) + rss // 1024**2
        return out

    def pids_since(self, mark: str) -> set[int]:
        with self._lock:
            return set(self.cpu) - set(self.marks[mark])


# --- what the GCS was asked: its own per-handler counters ----------------------------------

_DUMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*\(gcs_server\) "
                   r"gcs_server\.cc:\d+: (.+?) Event stats:")
_HANDLER = re.compile(r"^\t(\S+) - (\d+) total \(\d+ active.*?\), Execution time: mean = "
                      r"[-\d.]+ms, total = ([-\d.]+)ms")


class GcsEventStats:
    """The GCS's cumulative per-handler counts and execution times, which it prints into
    ``gcs_server.out`` every ``event_stats_print_interval_ms`` (the bench sets a few seconds).

    :meth:`snapshot` waits for the first dump after the call, so two snapshots bracket a
    phase (plus up to one interval of whatever followed it).
    """

    def __init__(self, logs_dir: str, interval_s: float):
        self.path = os.path.join(logs_dir, "gcs_server.out")
        self.interval_s = interval_s
        self._offset = 0
        self._partial = ""
        #: (dump time, {section: {handler: (count, total execution ms)}}) of the last dump.
        self.latest: tuple[float, dict[str, dict[str, tuple[int, float]]]] = (0.0, {})
        self._section: str | None = None

    def _read(self) -> None:
        import datetime

        try:
            with open(self.path) as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except OSError:
            return
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # an unfinished last line
        t, sections = self.latest
        for line in lines:
            m = _DUMP.match(line)
            if m:
                when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
                when += int(m.group(2)) / 1000
                if when > t + 0.5:  # a new dump: its sections follow
                    t, sections = when, {}
                self._section = m.group(3)
                sections[self._section] = {}
                continue
            h = _HANDLER.match(line)
            if h and self._section is not None:
                sections[self._section][h.group(1)] = (int(h.group(2)), float(h.group(3)))
        self.latest = (t, sections)

    def snapshot(self, timeout_s: float | None = None) -> dict[str, tuple[int, float]]:
        """Counters of the first complete dump after now: {"section/handler": (count, ms)}."""
        now = time.time()
        deadline = now + (timeout_s or 3 * self.interval_s + 5)
        while True:
            self._read()
            t, sections = self.latest
            # a dump is complete once a later one started or a moment after it was written
            if t > now and time.time() > t + 0.5:
                self._read()
                t, sections = self.latest
                return {f"{sec}/{name}": v for sec, hs in sections.items()
                        for name, v in hs.items()}
            if time.time() > deadline:
                return {}
            time.sleep(0.2)


def gcs_delta(a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]],
              top: int = 30) -> dict[str, dict[str, float]]:
    """The handlers called most between two snapshots: calls and execution ms (for gRPC
    handlers the ``.HandleRequestImpl`` entries, the GCS's own work)."""
    rows = {}
    for name, (n1, ms1) in b.items():
        n0, ms0 = a.get(name, (0, 0.0))
        if name.endswith(".HandleRequestImpl") or ".grpc_" not in name:
            rows[name.split("/", 1)[1].removesuffix(".HandleRequestImpl")] = (n1 - n0, ms1 - ms0)
    best = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return {k: {"calls": n, "ms": round(ms, 1)} for k, (n, ms) in best if n > 0}


# --- the simulated rank -------------------------------------------------------------------------


class SimRanks:
    """A plain Ray actor running the loader's loop for ``ranks`` of a world of ``world``, each
    rank with its own :class:`~ray_ingest.stream.IngestLoader` and pipeline (no Train).

    One rank per process is what a job has. Several (``--ranks-per-process``) share one process
    only to fit many ranks into this machine's memory (a rank's process holds torch and
    ray.data, ~250 MB PSS): each still runs its own loop in its own thread with its own
    execution. Their executions are opened one at a time (a lock around the loader's
    :class:`~ray_ingest.executions.Executions`), because Ray Data builds a dataset under a
    process-wide current DataContext.
    """

    def __init__(self, doc: dict, catalog: Any, world: int, ranks: Sequence[int],
                 wait_for_min_actors_s: float = 0):
        import ray
        from ray.data import DataContext

        if wait_for_min_actors_s:
            DataContext.get_current().wait_for_min_actors_s = int(wait_for_min_actors_s)
        DataContext.get_current().enable_progress_bars = False
        self.configure(doc, catalog, world, ranks)
        self.node = ray.get_runtime_context().get_node_id()

    def configure(self, doc: dict, catalog: Any, world: int, ranks: Sequence[int]) -> int:
        """New loaders (another config, dataset or world) for the next phase, in this process
        (part 3 keeps its rank processes from phase to phase)."""
        from ray_ingest.config import config_from_dict
        from ray_ingest.execution.opener import Executions
        from ray_ingest.loader.ingest import IngestLoader
        from ray_ingest.plan.topology import Topology

        cfg = config_from_dict(doc)
        self.loaders = {}
        lock = threading.Lock()
        for rank in ranks:
            topo = Topology(world_size=world, rank=rank, read_workers=cfg.loader.read_workers)
            opener = None
            if len(ranks) > 1:
                executions = Executions(cfg, catalog, topo)

                def opener(items: list, _ex: Executions = executions) -> Any:
                    with lock:
                        return _ex(items)

            self.loaders[rank] = IngestLoader(cfg, topo, catalog=catalog,
                                              open_execution=opener)
            if opener is not None:
                self.loaders[rank].compute = executions.compute
        return len(self.loaders)

    def run_steps(self, barrier: Any, steps: int, compute_s: float) -> list[dict[str, Any]]:
        """Part 3: every rank takes ``steps`` synchronous steps (bench/sync_steps.py); the
        process arrives at the barrier once for its ranks."""
        import ray

        from bench.sync_steps import BARRIER_TIMEOUT_S, rank_loop

        local = threading.Barrier(len(self.loaders), timeout=BARRIER_TIMEOUT_S)

        def sync(step: int) -> None:
            if local.wait() == 0:
                ray.get(barrier.arrive.remote(step, len(self.loaders)),
                        timeout=BARRIER_TIMEOUT_S)
            local.wait()

        def abort(error: str) -> None:
            """This process's ranks and every other process's stop at the barrier."""
            local.abort()
            barrier.abort.remote(error)

        return self._per_rank(
            lambda rank: {"rank": rank, **rank_loop(self.loaders[rank], steps, compute_s, sync)},
            on_error=abort)

    def _per_rank(self, body: Any, on_error: Any = None) -> list[dict[str, Any]]:
        """``body(rank)`` for every rank, each in its own thread; an exception is reported as
        the rank's ``error``, not lost in the thread (then ``on_error(error)``)."""
        out: dict[int, Any] = {}

        def one(rank: int) -> None:
            try:
                out[rank] = body(rank)
            except BaseException as exc:
                error = f"{type(exc).__name__}: {exc}"
                out[rank] = {"rank": rank, "error": error}
                if on_error is not None:
                    on_error(f"rank {rank}: {error}")

        threads = [threading.Thread(target=one, args=(r,)) for r in self.loaders]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out[r] for r in self.loaders]

    def ready(self) -> tuple[int, str]:
        return os.getpid(), self.node

    def run(self, epochs: int = 1, max_batches: int | None = None) -> list[dict[str, Any]]:
        """Every rank consumes up to ``max_batches`` batches in its own thread."""
        return self._per_rank(lambda rank: self._consume(rank, epochs, max_batches))

    def _consume(self, rank: int, epochs: int, max_batches: int | None) -> dict[str, Any]:
        loader = self.loaders[rank]
        t_start, p0 = time.time(), time.perf_counter()
        batches: list[list[Sample]] = []
        times: list[tuple[float, int, int]] = []  # (time, samples so far, decoders seen)
        first = None
        samples = 0
        for _, epoch_batches in loader.epochs(epochs):
            for b in epoch_batches:
                now = time.perf_counter()
                if first is None:
                    first = now - p0
                batches.append(list(zip(b.sids, b.indices, b.pads, strict=True)))
                samples += len(b.sids)
                times.append((now - p0, samples, len(loader.actors_seen)))
                if max_batches is not None and len(batches) >= max_batches:
                    break
            if max_batches is not None and len(batches) >= max_batches:
                break
        end = time.perf_counter() - p0
        m = loader.metrics()
        return {"rank": rank, "node": self.node, "pid": os.getpid(), "t_start": t_start,
                "ttfb_s": first, "elapsed_s": end, "batches": batches, "times": times,
                "samples": samples, "decode_compute": loader.compute,
                "decoders_seen": m["actors_seen"], "decode_nodes": m["decode_nodes"],
                "wait_s": m.get("wait_s")}


# --- the phases ---------------------------------------------------------------------------------


def loader_doc(args: argparse.Namespace, data: str, compute: str, pool: int,
               cpu_limit: float | None) -> dict:
    return {
        "data": {"paths": [data]},
        "decode": {"resolution": 32, "compute": compute, "pool_min": pool, "pool_max": pool,
                   "threads": pool, "num_cpus": args.decode_num_cpus,
                   "label_selector": {"pool": "cpu-decode"}, "scale_down_hold_s": 0,
                   "sim_cost_s": args.sim_cost_s, "sim_cost_jitter": args.jitter},
        "loader": {"batch_size": args.batch, "block_rows": args.block_rows, "read_workers": 1,
                   "seed": args.seed, "head_start_batches": 0, "prefetch_batches": 1,
                   "cpu_limit": cpu_limit, "stall_timeout_s": 600.0},
    }


def make_data(root: str, samples: int, shard_size: int, seed: int) -> str:
    from ray_ingest.tools.synth import synth_dataset

    path = os.path.join(root, f"ds_{samples}_{shard_size}")
    if not os.path.exists(path):
        synth_dataset(path, samples=samples, shard_size=shard_size, seed=seed, min_side=32,
                      max_side=40)
    return path


def _plan_for(doc: dict, catalog: Any, world: int, rank: int, epochs: int) -> list[list[Sample]]:
    from ray_ingest.config import config_from_dict

    cfg = config_from_dict(doc)
    return planned_batches(catalog.counts, catalog.chunk_size, cfg.loader.plan_params(), world,
                           rank, cfg.loader.read_workers, cfg.loader.batch_size, epochs)


def _steady_rate(times: list[tuple[float, int, int]]) -> tuple[float, float]:
    """(samples/s from the first batch, samples/s from the batch where the decoders seen
    reached their final number) over a consumer's (time, samples, decoders) log."""
    if len(times) < 2:
        return float("nan"), float("nan")
    (t0, s0, _), (t1, s1, n1) = times[0], times[-1]
    whole = (s1 - s0) / max(t1 - t0, 1e-9)
    k = next(i for i, (_, _, n) in enumerate(times) if n == n1)
    if len(times) - k < 4:  # too little left after the last decoder joined
        return whole, float("nan")
    tk, sk, _ = times[k]
    return whole, (s1 - sk) / max(t1 - tk, 1e-9)


def actors_phase(args: argparse.Namespace, remote: Any, data: str, catalog: Any, cat_ref: Any,
                 n: int) -> dict:
    import ray

    doc = loader_doc(args, data, args.compute, n, None)
    batches = args.samples_per_decoder * n // args.batch
    actor = remote.options(num_cpus=args.consumer_cpus,
                           label_selector={"pool": "gpu-train"}).remote(
        doc, cat_ref, 1, [0], wait_for_min_actors_s=args.wait_min_actors_s)
    ray.get(actor.ready.remote())
    (res,) = ray.get(actor.run.remote(1, batches))
    ray.kill(actor)
    if "error" in res:
        raise RuntimeError(f"decoders {n}: {res['error']}")
    whole, steady = _steady_rate(res["times"])
    bad = compare(res["batches"], _plan_for(doc, catalog, 1, 0, 1), prefix=True)
    return {"decoders": n, "batches": len(res["batches"]), "samples": res["samples"],
            "ttfb_s": round(res["ttfb_s"], 2), "elapsed_s": round(res["elapsed_s"], 2),
            "samples_per_s": round(whole, 1), "steady_samples_per_s": round(steady, 1),
            "decoders_seen": res["decoders_seen"], "decode_nodes": len(res["decode_nodes"]),
            "decode_compute": res["decode_compute"], "exact": bad is None, "mismatch": bad,
            "loadavg_1m": os.getloadavg()[0]}


def ranks_phase(args: argparse.Namespace, remote: Any, data: str, catalog: Any, cat_ref: Any,
                world: int, sampler: ProcSampler, tag: str, per_process: int | None = None,
                max_batches: int | None = None, keep_batches: bool = False,
                gcs: GcsEventStats | None = None) -> dict:
    import ray

    cpu_limit = args.rank_cpu_limit if args.rank_cpu_limit > 0 else None
    doc = loader_doc(args, data, args.rank_compute, args.rank_pool, cpu_limit)
    k = max(1, per_process or args.ranks_per_process)
    g0 = gcs.snapshot() if gcs is not None else {}
    t_g0 = time.time()
    sampler.mark(f"{tag}:create")
    singletons_before = sampler.rss_mb(SINGLETON_KINDS)
    actors = [remote.options(num_cpus=args.rank_cpus * len(range(r, min(r + k, world))),
                             label_selector={"pool": "gpu-train"})
              .remote(doc, cat_ref, world, list(range(r, min(r + k, world))))
              for r in range(0, world, k)]
    t_create = time.time()
    ready = ray.get([a.ready.remote() for a in actors])
    t_ready = time.time()
    sampler.mark(f"{tag}:ready")
    t0 = time.time()
    results = [r for rs in ray.get([a.run.remote(1, max_batches) for a in actors]) for r in rs]
    t1 = time.time()
    errors = {r["rank"]: r["error"] for r in results if "error" in r}
    results = [r for r in results if "error" not in r]
    sampler.mark(f"{tag}:done")
    rank_pids = {pid for pid, _ in ready}
    new_pids = sampler.pids_since(f"{tag}:create")
    g1 = gcs.snapshot() if gcs is not None else {}
    t_g1 = time.time()
    for a in actors:
        ray.kill(a)
    samples = sum(r["samples"] for r in results)
    exact, mismatches = 0, {}
    for r in results:
        bad = compare(r["batches"], _plan_for(doc, catalog, world, r["rank"], 1),
                      prefix=max_batches is not None)
        if bad is None:
            exact += 1
        else:
            mismatches[r["rank"]] = bad
    ttfb = sorted(r["ttfb_s"] for r in results if r["ttfb_s"] is not None)
    # first-batch times against the common start (the driver's run() calls)
    first_abs = sorted(r["t_start"] + r["ttfb_s"] - t0 for r in results if r["ttfb_s"])
    stream = sampler.cpu_between(f"{tag}:ready", f"{tag}:done")
    whole = sampler.cpu_between(f"{tag}:create", f"{tag}:done")
    mem_pids = new_pids | rank_pids
    ours = sum(stream.values()) + sampler.marks[f"{tag}:done"][-1] - sampler.marks[
        f"{tag}:ready"][-1]
    return {
        "ranks": world, "ranks_per_process": k, "processes": len(actors), "samples": samples,
        "exact_ranks": exact, "mismatches": mismatches, "errors": errors,
        "batches_per_rank": sorted({len(r["batches"]) for r in results}),
        "start_s": round(t_ready - t_create, 1), "stream_s": round(t1 - t0, 2),
        "samples_per_s": round(samples / (t1 - t0), 1),
        "ttfb_s": _spread(ttfb), "first_batch_after_start_s": _spread(first_abs),
        # per rank: (rank, first batch, last batch), seconds after the common start
        "per_rank_s": sorted((r["rank"], round(r["t_start"] + (r["ttfb_s"] or 0) - t0, 2),
                              round(r["t_start"] + r["elapsed_s"] - t0, 2)) for r in results),
        "decode_compute": sorted({r["decode_compute"] for r in results}),
        "decoders_seen_per_rank": statistics.median(r["decoders_seen"] for r in results),
        "cpu_s_stream": {k: round(v, 2) for k, v in sorted(stream.items(), key=lambda kv: -kv[1])
                         if abs(v) >= 0.005},
        "cpu_s_with_start": {k: round(v, 2) for k, v in
                             sorted(whole.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.005},
        "cpu_ms_per_sample_stream": per_sample(stream, samples),
        "cpu_ms_per_sample_with_start": per_sample(whole, samples),
        "cpu_s_per_s_stream": {k: round(v / (t1 - t0), 4) for k, v in stream.items()
                               if k in SINGLETON_KINDS},
        "memory": sampler.memory(mem_pids),
        "singletons_rss_mb": {"before": singletons_before,
                              "after": sampler.rss_mb(SINGLETON_KINDS)},
        # what else ran: the machine's busy CPU-s over the stream, this cluster's share of it
        "machine_busy_cores_stream": round(
            sampler.machine_between(f"{tag}:ready", f"{tag}:done") / (t1 - t0), 2),
        "cluster_busy_cores_stream": round(ours / (t1 - t0), 2),
        "loadavg_1m": os.getloadavg()[0],
        # the GCS's handlers over the phase (start-up included, plus up to one dump interval)
        "gcs_handlers": ({"window_s": round(t_g1 - t_g0, 1), **gcs_delta(g0, g1)}
                         if g0 and g1 else None),
        **({"delivered": {r["rank"]: r["batches"] for r in results}} if keep_batches else {}),
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    """min, median, p90 and max of ``values`` (sorted), seconds rounded to 10 ms."""
    if not values:
        return None
    return {"min": round(values[0], 2), "median": round(statistics.median(values), 2),
            "p90": round(values[int(0.9 * (len(values) - 1))], 2), "max": round(values[-1], 2)}


#: The driver and the cluster-wide processes (one each however many ranks: the GCS and Ray
#: Data's singletons on the head, ActorLocationTracker where the first actor pool started).
SINGLETON_KINDS = ("driver", "gcs_server", "_StatsActor", "_AutoscalingCoordinatorActor",
                   "ActorLocationTracker", "monitor", "log_monitor")


def per_sample(cpu: dict[str, float], samples: int) -> dict[str, float]:
    ms = {k: 1e3 * v / max(samples, 1) for k, v in cpu.items()}
    out = {k: ms.get(k, 0.0) for k in (*SINGLETON_KINDS, "raylet")}
    out["driver+gcs"] = out["driver"] + out["gcs_server"]
    out["ray_data_singletons"] = (out["_StatsActor"] + out["_AutoscalingCoordinatorActor"])
    out["all"] = sum(ms.values())
    return {k: round(v, 4) for k, v in out.items()}


def _wait_for_singletons() -> None:
    """Until the actors :func:`~ray_ingest.pipeline.warm_up` started answer (their start-up
    is not idle time)."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )
    from ray.data._internal.stats import get_or_create_stats_actor

    ray.get([get_or_create_stats_actor().__ray_ready__.remote(),
             get_or_create_autoscaling_coordinator().__ray_ready__.remote()], timeout=300)
    time.sleep(1.0)


def idle_rates(sampler: ProcSampler, seconds: float) -> dict[str, float]:
    """CPU seconds per second of each kind with nothing running (health checks, heartbeats)."""
    sampler.mark("idle:0")
    time.sleep(seconds)
    sampler.mark("idle:1")
    return {k: round(v / seconds, 4) for k, v in sampler.cpu_between("idle:0", "idle:1").items()
            if abs(v) >= 0.001}


# --- main ---------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _specs(text: str) -> list[str]:
    """``R`` or ``R/k`` (k ranks per process) items; checked here, parsed by :func:`spec`."""
    out = [x for x in text.split(",") if x]
    for x in out:
        spec(x, 1)
    return out


def spec(text: str, default_k: int) -> tuple[int, int]:
    world, _, k = text.partition("/")
    return int(world), int(k) if k else default_k


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--actors", type=_ints, default=[1, 2, 4, 8], help="decoders, part 1")
    p.add_argument("--ranks", type=_specs, default=["16", "64", "16/1"],
                   help="simulated ranks of part 2: R or R/k (k ranks per process)")
    p.add_argument("--runs", type=int, default=1, help="interleaved runs (medians)")
    p.add_argument("--compute", default="actors", help="decode.compute of part 1")
    p.add_argument("--rank-compute", default="tasks", help="decode.compute of part 2")
    p.add_argument("--rank-pool", type=int, default=1, help="pool_min = pool_max, part 2")
    p.add_argument("--decode-nodes", type=int, default=4)
    p.add_argument("--decode-cpus", type=float, default=2, help="logical CPUs per decode node")
    p.add_argument("--decode-num-cpus", type=float, default=1.0, help="decode.num_cpus")
    p.add_argument("--train-nodes", type=int, default=4)
    p.add_argument("--train-cpus", type=float, default=4, help="logical CPUs per train node")
    p.add_argument("--consumer-cpus", type=float, default=0.5, help="CPUs of part 1's consumer")
    p.add_argument("--rank-cpus", type=float, default=0.0625, help="CPUs per simulated rank")
    p.add_argument("--ranks-per-process", type=int, default=4,
                   help="simulated ranks sharing one actor process (memory: see SimRanks)")
    p.add_argument("--rank-cpu-limit", type=float, default=0.0,
                   help="loader.cpu_limit per rank (0: the loader's default share)")
    p.add_argument("--sim-cost-s", type=float, default=0.05, help="decode.sim_cost_s")
    p.add_argument("--jitter", type=float, default=0.2, help="decode.sim_cost_jitter")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block-rows", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=16)
    p.add_argument("--samples-per-decoder", type=int, default=320, help="part 1 run length")
    p.add_argument("--batches-per-rank", type=int, default=4, help="part 2 run length")
    p.add_argument("--wait-min-actors-s", type=float, default=120,
                   help="part 1: the pool's actors are all up before the first block")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="no unrecorded rank phase before each run's measured ones")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--gcs-stats-interval-s", type=float, default=3.0,
                   help="how often the GCS prints its handler counters")
    p.add_argument("--object-store-mb", type=int, default=128, help="per node")
    p.add_argument("--sync-ranks", type=_ints, default=[16, 64],
                   help="part 3: ranks taking synchronous steps (empty: skip part 3)")
    p.add_argument("--sync-phases", default="below,above,churn",
                   help="part 3 phases: below (capacity below demand), above, churn")
    p.add_argument("--sync-steps", type=int, default=8, help="steps of the below phase")
    p.add_argument("--sync-compute-s", type=float, default=0.05,
                   help="simulated step (below and churn phases)")
    p.add_argument("--sync-above-ratio", type=float, default=0.5,
                   help="above phase: demand / decode capacity (sets the step time)")
    p.add_argument("--sync-above-s", type=float, default=120.0,
                   help="above phase: about this long (steps follow from the step time)")
    p.add_argument("--sync-churn-steps", type=int, default=12)
    p.add_argument("--sync-churn-at", type=_ints, default=[3, 7],
                   help="churn phase: kill decode nodes after step A, add them back after B")
    p.add_argument("--sync-churn-nodes", type=int, default=2)
    p.add_argument("--sync-pool-max", type=int, default=1,
                   help="part 3: decode.pool_max per rank (the job pool holds up to R x it)")
    p.add_argument("--sync-hold-s", type=float, default=30.0, help="decode.scale_down_hold_s")
    p.add_argument("--sync-head-start", type=int, default=0,
                   help="part 3: loader.head_start_batches of the ranks and of the single "
                        "rank on the whole capacity (their first batches decoded in the "
                        "rank's own process despite decode.label_selector); 0: off")
    p.add_argument("--no-sync-prestart", dest="sync_prestart", action="store_false",
                   help="part 3: the first rank starts the pool (not the driver, before the "
                        "ranks: jobs/train.py's way)")
    p.add_argument("--workdir", default=None, help="datasets (default: a temporary folder)")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    import ray

    from ray_ingest.catalog.load import load_catalog
    from tests.support.multinode import MB, LoopbackCluster, loopback

    tmp = args.workdir or tempfile.mkdtemp(prefix="scale_out_")
    max_n = max(args.actors, default=1)
    datasets = {"actors": make_data(tmp, args.samples_per_decoder * max_n, args.shard_size,
                                    args.seed)}
    for world in {spec(x, 1)[0] for x in args.ranks}:
        datasets[world] = make_data(tmp, world * args.batches_per_rank * args.batch,
                                    args.shard_size, args.seed)
    report: dict[str, Any] = {"args": vars(args), "runs": []}
    with ProcSampler() as sampler, loopback():
        cluster = LoopbackCluster(system_config={
            "event_stats_print_interval_ms": int(args.gcs_stats_interval_s * 1000)})
        gcs = GcsEventStats(cluster.head.node.get_logs_dir_path(), args.gcs_stats_interval_s)
        try:
            for _ in range(args.decode_nodes):
                cluster.add("decode", args.decode_cpus, args.object_store_mb * MB, wait=False)
            for _ in range(args.train_nodes):
                cluster.add("train", args.train_cpus, args.object_store_mb * MB, wait=False)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, log_to_driver=False,
                     runtime_env={"env_vars": {"RAY_DATA_DISABLE_PROGRESS_BARS": "1",
                                               "PYTHONPATH": REPO}})
            # as the job does: Ray Data's cluster singletons (stats actor, autoscaling
            # coordinator) start on the driver's node, the head, before any execution
            from ray_ingest.execution.raydata import warm_up

            warm_up()
            _wait_for_singletons()
            g0, t_g0 = gcs.snapshot(), time.time()
            report["idle_cpu_s_per_s"] = idle_rates(sampler, args.idle_s)
            g1 = gcs.snapshot()
            report["idle_gcs_handlers"] = {"window_s": round(time.time() - t_g0, 1),
                                           **gcs_delta(g0, g1)}
            print(f"idle CPU-s/s: {report['idle_cpu_s_per_s']}", flush=True)
            remote = ray.remote(SimRanks)
            catalogs = {k: load_catalog([v]) for k, v in datasets.items()}
            refs = {k: ray.put(c) for k, c in catalogs.items()}
            for run in range(args.runs):
                rec: dict[str, Any] = {"actors": [], "ranks": []}
                # alternate the order: whatever runs first in a sitting is not always the same
                order = args.actors if run % 2 == 0 else args.actors[::-1]
                for n in order:
                    r = actors_phase(args, remote, datasets["actors"], catalogs["actors"],
                                     refs["actors"], n)
                    print(f"run {run} decoders {n}: {json.dumps(r)}", flush=True)
                    rec["actors"].append(r)
                if args.ranks and args.warmup:
                    # decode task workers start once per job (and again after part 1's
                    # actors took their CPUs): not in the first measured phase's figures
                    w = min(spec(x, 1)[0] for x in args.ranks)
                    r = ranks_phase(args, remote, datasets[w], catalogs[w], refs[w], w,
                                    sampler, f"warmup{run}", max_batches=1)
                    print(f"warm-up ranks {w}: exact {r['exact_ranks']}, {r['stream_s']} s",
                          flush=True)
                for item in (args.ranks if run % 2 == 0 else args.ranks[::-1]):
                    world, k = spec(item, args.ranks_per_process)
                    r = ranks_phase(args, remote, datasets[world], catalogs[world], refs[world],
                                    world, sampler, f"r{run}w{world}k{k}", per_process=k,
                                    gcs=gcs)
                    print(f"run {run} ranks {world}/{k}: {json.dumps(r)}", flush=True)
                    rec["ranks"].append(r)
                report["runs"].append(rec)
            if args.sync_ranks:
                report["sync"] = sync_part(args, cluster, remote, tmp)
        finally:
            ray.shutdown()
            cluster.shutdown()
        report["memory_all"] = sampler.memory()
    report["summary"] = summarize(report)
    print_summary(report)
    if report.get("sync"):
        report["sync_summary"] = summarize_sync(report["sync"])
        print_sync(report["sync_summary"])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


# --- part 3: synchronous steps (bench/sync_steps.py) -----------------------------------------


def decode_slots(args: argparse.Namespace, nodes: int) -> int:
    """Decode workers ``nodes`` decode nodes have room for."""
    return nodes * int(args.decode_cpus // args.decode_num_cpus)


def sync_doc(args: argparse.Namespace, data: str, pool_max: int, sim_cost_s: float) -> dict:
    """Part 3's loader config: decode actors on the job's pool (the default scope), sized by
    its controller between 1 and ``pool_max`` per rank."""
    doc = loader_doc(args, data, "actors", pool_max, None)
    doc["decode"].update(pool_min=1, pool_max=pool_max, sim_cost_s=sim_cost_s,
                         scale_down_hold_s=args.sync_hold_s)
    doc["loader"]["head_start_batches"] = args.sync_head_start
    return doc


def phase_plan(args: argparse.Namespace, phase: str, world: int) -> tuple[int, float]:
    """(steps, simulated step seconds) of a phase."""
    cap = decode_slots(args, args.decode_nodes) / args.sim_cost_s
    if phase == "below":
        return args.sync_steps, args.sync_compute_s
    if phase == "churn":
        return args.sync_churn_steps, args.sync_compute_s
    if phase == "above":
        step = world * args.batch / (args.sync_above_ratio * cap)
        return max(args.sync_steps, math.ceil(args.sync_above_s / step)), step
    raise SystemExit(f"--sync-phases: unknown phase {phase!r} (below, above, churn)")


def _decode_idle(cluster: Any, timeout_s: float = 90.0) -> None:
    """Until no decode CPU is held (the last phase's controller ended with its workers)."""
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        avail = state.available_resources_per_node()
        alive = cluster.alive("decode")
        if all(avail.get(i.node_id, {}).get("CPU", 0.0) >= i.num_cpus for i in alive):
            return
        time.sleep(0.5)


#: Seconds between two looks at the job controller's stats during a phase.
CONTROLLER_POLL_S = 5.0


def _controller(name: str) -> dict | None:
    import ray

    try:
        return ray.get(ray.get_actor(name).stats.remote(), timeout=10)
    except Exception:  # not started yet, or ended
        return None


def prestart(args: argparse.Namespace, doc: dict, catalog: Any, world: int) -> Any:
    """As jobs/train.py's driver does: start the job's pool before the ranks ask (None with
    ``--no-sync-prestart``)."""
    if not args.sync_prestart:
        return None
    from ray_ingest.config import config_from_dict
    from ray_ingest.execution import service

    return (time.time(), service.prestart(config_from_dict(doc), world, catalog.fingerprint))


def pool_up(started: Any, timeout_s: float = 120.0) -> float | None:
    """Seconds from the pre-start until every worker the pool asked for is up (or no more
    can be placed), waited for here: the job's driver has Ray Train's start (~20 s) for it."""
    import ray

    if started is None:
        return None
    t, handle = started
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = ray.get(handle.stats.remote())["history"]
        if h and h[-1]["held"] and (h[-1]["pending"] == 0 or h[-1]["free"] == 0):
            return round(time.time() - t, 2)
        time.sleep(0.25)
    return None


def sync_run(args: argparse.Namespace, cluster: Any, actors: list, doc: dict, catalog: Any,
             world: int, phase: str, steps: int, compute_s: float) -> dict:
    """One phase on ``actors`` (already configured): the figures of bench/sync_steps.py."""
    import ray

    from bench.sync_steps import StepBarrier, summarize_phase
    from ray_ingest.config import config_from_dict
    from ray_ingest.execution.service import service_name
    from tests.support.multinode import MB

    name = service_name(config_from_dict(doc), catalog.fingerprint)
    per_node = decode_slots(args, 1)
    barrier = ray.remote(StepBarrier).options(num_cpus=0, label_selector={"pool": "head"}).remote(
        world)  # on the head: decode nodes come and go
    # up before the ranks start, as a job's process group is before its first step: its
    # process's start (~1 CPU-s) is the harness's, not the ranks'
    ray.get(barrier.progress.remote())
    slot_events = [(time.time(), per_node * len(cluster.alive("decode")))]
    churn: dict[str, Any] = {}
    hist = None
    busy = _BusySampler()
    t0 = time.time()
    refs = [a.run_steps.remote(barrier, steps, compute_s) for a in actors]
    polled = 0.0
    while True:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        # the controller's history grows all phase: every few seconds (the driver's CPU is
        # the ranks' too on this machine), and once the ranks are done (it ends
        # LINGER_S after its last rank leaves)
        if len(done) == len(refs) or time.monotonic() - polled >= CONTROLLER_POLL_S:
            hist, polled = _controller(name) or hist, time.monotonic()
        if len(done) == len(refs):
            break
        if phase != "churn":
            continue
        n = len(ray.get(barrier.progress.remote()))
        alive = cluster.alive("decode")  # one look at the nodes per poll
        if "kill" not in churn and n >= args.sync_churn_at[0]:
            victims = alive[:args.sync_churn_nodes]
            churn["kill"] = {"t": time.time(), "step": n, "nodes": len(victims)}
            for v in victims:
                cluster.kill(v)
            alive = alive[len(victims):]
        elif "kill" in churn and "add" not in churn and n >= args.sync_churn_at[1]:
            churn["add"] = {"t": time.time(), "step": n}
            for _ in range(args.sync_churn_nodes):
                cluster.add("decode", args.decode_cpus, args.object_store_mb * MB, wait=False)
        elif "add" in churn and "up" not in churn and len(alive) >= args.decode_nodes:
            churn["up"] = {"t": time.time(), "step": n}
        # each returning node's slots count from when it is up, not when the last one is
        slots = per_node * len(alive)
        if slots != slot_events[-1][1]:
            slot_events.append((time.time(), slots))
    busy.stop()
    results = [r for rs in ray.get(refs) for r in rs]
    released = ray.get(barrier.progress.remote())
    ray.kill(barrier)
    errors = {r["rank"]: r["error"] for r in results if "error" in r}
    results = [r for r in results if "error" not in r]
    exact, mismatches = 0, {}
    for r in results:
        bad = compare(r["batches"], _plan_for(doc, catalog, world, r["rank"], 1))
        if bad is None and not r["left_over_batches"]:
            exact += 1
        else:
            mismatches[r["rank"]] = bad or f"{r['left_over_batches']} batches left over"
    out = {"ranks": world, "phase": phase, "steps_planned": steps, "compute_s": compute_s,
           "exact_ranks": exact, "mismatches": mismatches, "errors": errors,
           "decode_compute": sorted({r["decode_compute"] for r in results})}
    if released and results:
        out.update(summarize_phase(results, released, t0, world, args.batch, slot_events,
                                   args.sim_cost_s, hist))
    elif hist:  # a failed phase: what the controller saw last, to tell why
        out["pool"] = {k: hist.get(k) for k in ("started", "retired", "lost", "target",
                                                "reason", "dispatched", "ranks")}
        out["pool_history_tail"] = hist["history"][-40:]
        out["released_steps"] = len(released)
    if released:  # how loaded this 2-core machine was until the first step (all ranks start)
        out["machine_busy_cores_to_first_step"] = busy.cores(t0, min(released.values()))
        out["cpu_s_to_first_step_by_kind"] = busy.cpu_by_kind(t0, min(released.values()))
    out["churn"] = {k: {**v, "t": round(v["t"] - t0, 1)} for k, v in churn.items()}
    if phase == "churn":
        out["decode_slots"] = [(round(t - t0, 1), n) for t, n in slot_events]
    out["pool_stats"] = sorted({x for r in results for x in r["stats"]})[:3]
    return out


class _BusySampler:
    """The machine's busy CPU seconds, sampled every ``period_s`` in a thread: a time series,
    because the first step's time is known only after the phase (:class:`ProcSampler`'s marks
    are snapshots taken when called). Every ``kinds_every``-th sample also walks this cluster's
    processes (:class:`ProcSampler`, too heavy for every 0.1 s) for CPU seconds per kind."""

    def __init__(self, period_s: float = 0.1, kinds_every: int = 5):
        self.samples = [(time.time(), _machine_busy())]
        self._procs = ProcSampler()
        self.kinds: list[tuple[float, dict[str, float]]] = []
        self._kinds_sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s, kinds_every),
                                        daemon=True)
        self._thread.start()

    def _kinds_sample(self) -> None:
        ps = self._procs
        ps.sample()
        by: dict[str, float] = collections.defaultdict(float)
        for pid, cpu in ps.cpu.items():  # ended processes keep their last sample
            by[ps.kind.get(pid, "?")] += cpu
        self.kinds.append((time.time(), dict(by)))

    def _run(self, period_s: float, kinds_every: int) -> None:
        n = 0
        while not self._stop.wait(period_s):
            self.samples.append((time.time(), _machine_busy()))
            n += 1
            if n % kinds_every == 0:
                self._kinds_sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cores(self, t0: float, t1: float) -> float | None:
        """Mean busy cores between the samples nearest ``t0`` and ``t1``."""
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        return round((b[1] - a[1]) / (b[0] - a[0]), 2) if b[0] > a[0] else None

    def cpu_by_kind(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per process kind between the walks nearest ``t0`` and ``t1`` (this
        cluster's processes; the driver's includes this sampler), the largest first."""
        a = min(self.kinds, key=lambda s: abs(s[0] - t0))[1]
        b = min(self.kinds, key=lambda s: abs(s[0] - t1))[1]
        out = {k: round(v - a.get(k, 0.0), 2) for k, v in b.items()}
        return dict(sorted(((k, v) for k, v in out.items() if v >= 0.01),
                           key=lambda kv: -kv[1]))


def single_rank(args: argparse.Namespace, cluster: Any, remote: Any, tmp: str, world: int,
                fair: bool) -> dict:
    """Time to the first batch of one rank alone: on the job pool at its fair share of the
    capacity (one worker, the cost × R / slots), or on the whole capacity (``fair`` False)."""
    slots = decode_slots(args, args.decode_nodes)
    from ray_ingest.catalog.load import load_catalog

    data = make_data(tmp, args.batch, args.shard_size, args.seed)  # one batch: one step

    cat = load_catalog([data])
    cost = args.sim_cost_s * world / slots if fair else args.sim_cost_s
    doc = sync_doc(args, data, 1 if fair else slots, cost)
    if fair:  # the pool's share alone: a head start would decode at the scaled-up cost
        doc["decode"]["pool_max"] = 1
        doc["loader"]["head_start_batches"] = 0
    import ray

    _decode_idle(cluster)
    started = prestart(args, doc, cat, 1)
    actor = remote.options(num_cpus=args.rank_cpus, label_selector={"pool": "gpu-train"}).remote(
        doc, ray.put(cat), 1, [0])
    ray.get(actor.ready.remote())
    up = pool_up(started)
    r = sync_run(args, cluster, [actor], doc, cat, 1, "single", 1, 0.0)
    ray.kill(actor)
    if started is not None:  # a head start may have served the whole batch: no rank came to
        ray.kill(started[1])  # the pre-started pool, which would hold its workers for
        # service.PRESTART_WAIT_S (they end with it, their owner)
    return {"fair_share": fair, "sim_cost_s": round(cost, 4), "pool_up_s": up,
            "head_start_batches": doc["loader"]["head_start_batches"],
            "first_step_s": r.get("first_step_s"), "exact": r["exact_ranks"] == 1,
            "machine_busy_cores_to_first_step": r.get("machine_busy_cores_to_first_step"),
            "cpu_s_to_first_step_by_kind": r.get("cpu_s_to_first_step_by_kind")}


def sync_part(args: argparse.Namespace, cluster: Any, remote: Any, tmp: str) -> dict:
    """Part 3, ``--runs`` times: per world size, the single-rank references, then every phase
    on the same rank processes (reconfigured between phases)."""
    import ray

    from ray_ingest.catalog.load import load_catalog

    out: dict[str, Any] = {"slots": decode_slots(args, args.decode_nodes), "runs": []}
    phases = [p for p in args.sync_phases.split(",") if p]
    for run in range(args.runs):
        rows: list[dict] = []
        for world in (args.sync_ranks if run % 2 == 0 else args.sync_ranks[::-1]):
            ref = {"fair": single_rank(args, cluster, remote, tmp, world, True),
                   "whole": single_rank(args, cluster, remote, tmp, world, False)}
            print(f"run {run} single rank for {world}: {json.dumps(ref)}", flush=True)
            k = args.ranks_per_process
            groups = [list(range(r, min(r + k, world))) for r in range(0, world, k)]
            actors: list = []
            for phase in phases:
                steps, compute_s = phase_plan(args, phase, world)
                data = make_data(tmp, world * steps * args.batch, args.shard_size, args.seed)
                cat = load_catalog([data])
                cat_ref = ray.put(cat)
                doc = sync_doc(args, data, args.sync_pool_max, args.sim_cost_s)
                _decode_idle(cluster)
                started = prestart(args, doc, cat, world)
                if not actors:
                    actors = [remote.options(num_cpus=args.rank_cpus * len(g),
                                             label_selector={"pool": "gpu-train"})
                              .remote(doc, cat_ref, world, g) for g in groups]
                    ray.get([a.ready.remote() for a in actors])
                else:
                    ray.get([a.configure.remote(doc, cat_ref, world, g)
                             for a, g in zip(actors, groups, strict=True)])
                up = pool_up(started)
                r = sync_run(args, cluster, actors, doc, cat, world, phase, steps, compute_s)
                r["pool_up_s"], r["single_rank"] = up, ref
                if r.get("first_step_s") and ref["fair"]["first_step_s"]:
                    r["first_step_over_single_fair"] = round(
                        r["first_step_s"] / ref["fair"]["first_step_s"], 2)
                    r["first_step_over_single_whole"] = round(
                        r["first_step_s"] / ref["whole"]["first_step_s"], 2)
                print(f"run {run} sync {world} {phase}: {json.dumps(r)}", flush=True)
                rows.append(r)
            for a in actors:
                ray.kill(a)
        out["runs"].append(rows)
    return out


def summarize_sync(sync: dict) -> dict:
    """Medians over the runs per (ranks, phase) of the figures the issue asks for."""
    by: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for rows in sync["runs"]:
        for r in rows:
            by[(r["ranks"], r["phase"])].append(r)
    out = {}
    for (world, phase), rows in sorted(by.items()):
        def med(key: str, rows: list = rows) -> float | None:
            vals = [r[key] for r in rows if r.get(key) is not None]
            return round(statistics.median(vals), 3) if vals else None

        def med2(a: str, b: str, rows: list = rows) -> float | None:
            vals = [r[a][b] for r in rows if r.get(a) and r[a].get(b) is not None]
            return round(statistics.median(vals), 3) if vals else None

        out[f"{world} {phase}"] = {
            "runs": len(rows), "all_exact": all(r["exact_ranks"] == world for r in rows),
            "efficiency": med("efficiency"), "efficiency_per_run": [r.get("efficiency")
                                                                   for r in rows],
            "sync_samples_per_s": med("sync_samples_per_s"),
            "capacity_samples_per_s": med("capacity_samples_per_s"),
            "first_step_s": med("first_step_s"),
            "first_step_over_single_fair": med("first_step_over_single_fair"),
            "first_step_over_single_whole": med("first_step_over_single_whole"),
            "machine_busy_cores_to_first_step": med("machine_busy_cores_to_first_step"),
            "data_wait_share_median": med2("data_wait_share_of_step", "median"),
            "data_wait_share_max": med2("data_wait_share_of_step", "max"),
            "held_over_busy": med2("decode_cpus", "held_over_busy"),
            "held_over_busy_after_60s": med2("decode_cpus_after_60s", "held_over_busy"),
            "held_cpus_after_60s": med2("decode_cpus_after_60s", "held_cpus"),
            "busy_cpus_after_60s": med2("decode_cpus_after_60s", "busy_cpus"),
        }
    return out


def print_sync(summary: dict) -> None:
    print("\nsynchronous steps (medians of the runs): ranks phase  exact  efficiency  "
          "sync/s of capacity/s  first step s (x single rank at fair share, x whole)  "
          "data-wait % of step (median, max)  decode CPUs held/busy (after 60 s)")
    for key, v in summary.items():
        print(f"{key:12s} {str(v['all_exact']):5s}  {v['efficiency']}  "
              f"{v['sync_samples_per_s']} of {v['capacity_samples_per_s']}  "
              f"{v['first_step_s']} ({v['first_step_over_single_fair']}x, "
              f"{v['first_step_over_single_whole']}x)  "
              f"{v['data_wait_share_median']}, {v['data_wait_share_max']}  "
              f"{v['held_over_busy']} ({v['held_over_busy_after_60s']})")


def summarize(report: dict) -> dict:
    out: dict[str, Any] = {"actors": {}, "ranks": {}}
    runs = report["runs"]
    for n in report["args"]["actors"]:
        rows = [r for rec in runs for r in rec["actors"] if r["decoders"] == n]
        out["actors"][n] = {
            "steady_samples_per_s": statistics.median(r["steady_samples_per_s"] for r in rows),
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
            "all_exact": all(r["exact"] for r in rows), "runs": len(rows)}
    base = out["actors"].get(1)
    if base:
        for v in out["actors"].values():
            v["ratio_to_1"] = round(v["steady_samples_per_s"] / base["steady_samples_per_s"], 2)
    default_k = report["args"]["ranks_per_process"]
    keys = {}
    for item in report["args"]["ranks"]:
        world, k = spec(item, default_k)
        keys[(world, k)] = f"{world}/{k}"
        rows = [r for rec in runs for r in rec["ranks"]
                if (r["ranks"], r["ranks_per_process"]) == (world, k)]
        med = {m: statistics.median(r["cpu_ms_per_sample_stream"][m] for r in rows)
               for m in rows[0]["cpu_ms_per_sample_stream"]}
        medw = {m: statistics.median(r["cpu_ms_per_sample_with_start"][m] for r in rows)
                for m in rows[0]["cpu_ms_per_sample_with_start"]}
        rate = {m: statistics.median(r["cpu_s_per_s_stream"].get(m, 0.0) for r in rows)
                for m in SINGLETON_KINDS}
        out["ranks"][f"{world}/{k}"] = {
            "ranks": world, "ranks_per_process": k,
            "all_exact": all(r["exact_ranks"] == world for r in rows),
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rows),
            "errors": sum(len(r["errors"]) for r in rows),
            "ttfb_median_s": statistics.median(r["ttfb_s"]["median"] for r in rows),
            "ttfb_max_s": statistics.median(r["ttfb_s"]["max"] for r in rows),
            "cpu_ms_per_sample_stream": med, "cpu_ms_per_sample_with_start": medw,
            "cpu_s_per_s_stream": rate, "runs": len(rows)}
    # the ratios between the smallest and the largest world of the same packing
    for k in sorted({k for _, k in keys}):
        worlds = sorted(w for w, kk in keys if kk == k)
        if len(worlds) < 2:
            continue
        lo, hi = out["ranks"][keys[(worlds[0], k)]], out["ranks"][keys[(worlds[-1], k)]]
        for key in ("cpu_ms_per_sample_stream", "cpu_ms_per_sample_with_start"):
            a, b = lo[key]["driver+gcs"], hi[key]["driver+gcs"]
            out[f"driver+gcs ratio {worlds[-1]}/{worlds[0]} ranks, {k} per process ({key})"] = (
                round(b / a, 2) if a else None)
    return out


def print_summary(report: dict) -> None:
    s = report["summary"]
    print("\ndecoders  steady samples/s  from-first samples/s  ratio  exact")
    for n, v in s["actors"].items():
        print(f"{n:8}  {v['steady_samples_per_s']:16.1f}  {v['samples_per_s']:20.1f}  "
              f"{v.get('ratio_to_1', float('nan')):5.2f}  {v['all_exact']}")
    print("\nranks/k  exact  samples/s  ttfb med/max s  CPU ms/sample in the stream (+start-up): "
          "driver  gcs  Ray Data singletons  raylets")
    for w, v in s["ranks"].items():
        a, b = v["cpu_ms_per_sample_stream"], v["cpu_ms_per_sample_with_start"]
        print(f"{w:7}  {str(v['all_exact']):5}  {v['samples_per_s']:9.1f}  "
              f"{v['ttfb_median_s']:6.2f}/{v['ttfb_max_s']:6.2f}  "
              + "  ".join(f"{a[m]:.3f} ({b[m]:.3f})" for m in
                          ("driver", "gcs_server", "ray_data_singletons", "raylet")))
    for k, v in s.items():
        if k.startswith("driver+gcs ratio"):
            print(f"{k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
