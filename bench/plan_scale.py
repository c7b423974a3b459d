"""Planning at scale: catalog load + one rank's plan for million-shard datasets.

Three parts, every measurement in a fresh process, medians of ``--repeats`` runs:

1. **Catalog load + plan**: ``load_catalog`` on a ``wdinfo.json`` of N shards (written once
   under ``--data``, PiD's layout: indent 2, ``data_list_key_count``), then ``catalog.counts``
   and one rank's stream (``plan_slot``: all its workers and the equal-work padding), for
   ``--shards`` (1,000,000) and ``--big-shards`` (10,000,000). Prints wall time, RSS
   high-water growth over the imports, and for the first size the fingerprint time and the
   pickle (``ray.put``) size and times. Goals: 1M < 1 s and < 300 MB; 10M < 10 s.
2. **Parse**: the catalog's vectorized reader (``wdinfo_scan``, taken for plainly written
   files) against pyarrow's JSON reader (its fallback) and ``json.loads`` plus building the
   arrays, on the same file.
3. **``ray-ingest plan``** on the 1M-shard wdinfo as a subprocess: wall time including the
   interpreter's start-up (goal < 2 s), with the exact command.
4. **Planning only** (counts in memory), against PiD's literal list construction run in the
   same sitting.

    .venv/bin/python bench/plan_scale.py [--shards N] [--big-shards N] [--repeats R]
        [--data DIR] [--world-size W] [--num-workers K] [--skip-big] [--skip-baseline]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from ray_ingest.plan import PlanParams, Topology, plan_slot, total

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mib() -> float:
    """Peak RSS of this process in MiB: VmHWM (reset by exec, unlike ru_maxrss, which a child
    inherits from the parent's memory at fork time)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- data


def wdinfo_path(data: str, n: int) -> str:
    """``<data>/<n>/wdinfo.json`` with n shards (written once; PiD's layout and indent)."""
    folder = os.path.join(data, f"shards_{n}")
    path = os.path.join(folder, "wdinfo.json")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    counts = np.random.default_rng(0).integers(500, 1500, n)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:  # streamed: json.dumps of a 10M-entry document needs GBs
        f.write('{\n  "data_list": [\n')
        for a in range(0, n, 100_000):
            f.write(",\n".join(f'    "part_{i // 1000:06d}/{i % 1000:06d}.tar"'
                               for i in range(a, min(n, a + 100_000))))
            f.write(",\n" if a + 100_000 < n else "\n")
        f.write('  ],\n  "data_list_key_count": [\n')
        for a in range(0, n, 100_000):
            f.write(",\n".join(f"    {c}" for c in counts[a:a + 100_000].tolist()))
            f.write(",\n" if a + 100_000 < n else "\n")
        f.write(f'  ],\n  "total_key_count": {int(counts.sum())},\n  "chunk_size": 1000,\n'
                '  "data_keys": [\n    "image",\n    "caption"\n  ],\n  "root": "."\n}\n')
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- cases (own process)


def case_load(args: argparse.Namespace, n: int, extras: bool) -> dict:
    """Load + counts + one rank's plan, in this fresh process; extras: fingerprint, pickle."""
    from ray_ingest.catalog.load import load_catalog

    path = wdinfo_path(args.data, n)
    topo = Topology(args.world_size, args.rank, args.num_workers)
    params = PlanParams(seed=0)
    gc.collect()
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    cat = load_catalog(path)
    t1 = time.perf_counter()
    plan = plan_slot(cat.counts, cat.chunk_size, topo.slot, topo.slots, topo.num_workers,
                     params, args.epoch)
    t2 = time.perf_counter()
    out = {"shards": len(cat), "load_s": t1 - t0, "plan_s": t2 - t1, "total_s": t2 - t0,
           "rss_mib": _rss_mib() - rss0, "slices": len(plan), "samples": total(plan)}
    if extras:
        t = time.perf_counter()
        _ = cat.fingerprint
        out["fingerprint_s"] = time.perf_counter() - t
        t = time.perf_counter()
        blob = pickle.dumps(cat, protocol=5)
        out["pickle_s"] = time.perf_counter() - t
        out["pickle_mib"] = len(blob) / 2**20
        t = time.perf_counter()
        back = pickle.loads(blob)
        out["unpickle_s"] = time.perf_counter() - t
        assert back.fingerprint == cat.fingerprint
    return out


def case_parse(args: argparse.Namespace, n: int) -> dict:
    """json.loads + arrays vs pyarrow's JSON reader vs wdinfo_scan, on the same bytes."""
    import pyarrow as pa

    from ray_ingest import catalog as catalog_mod

    path = wdinfo_path(args.data, n)
    with open(path, "rb") as f:
        raw = f.read()
    out = {}
    gc.collect()
    t0 = time.perf_counter()
    doc = json.loads(raw)
    t1 = time.perf_counter()
    paths = catalog_mod._strings(doc["data_list"])
    counts = np.array(doc["data_list_key_count"], dtype=np.int64)
    t2 = time.perf_counter()
    out["json_loads_s"], out["json_arrays_s"] = t1 - t0, t2 - t1
    del doc, paths, counts
    gc.collect()
    t0 = time.perf_counter()
    w = catalog_mod._fast_parse(raw, path, None, "dset: 0", "wdinfo")
    out["arrow_s"] = time.perf_counter() - t0
    assert w is not None and len(w) == n and isinstance(w.paths, pa.Array)
    del w
    gc.collect()
    t0 = time.perf_counter()
    w = catalog_mod._scan_parse(raw, path, None, "dset: 0", "wdinfo")
    out["scan_s"] = time.perf_counter() - t0
    assert w is not None and len(w) == n and isinstance(w.paths, pa.Array)
    return out


def _measure(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(median seconds, tracemalloc peak MiB, RSS high-water growth MiB of the first call)."""
    gc.collect()
    rss0 = _rss_mib()
    fn()
    rss = _rss_mib() - rss0
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return statistics.median(times), peak / 2**20, rss


def pid_literal(urls: list[int], slot: int, slots: int, num_workers: int) -> list[list[int]]:
    """PiD ShardlistBasic (§6), per worker, as the reference implements it."""
    import random

    out = []
    n = len(urls)
    for w in range(num_workers):
        t = slots * num_workers
        lst = [urls[i % n] for i in range(math.ceil(n / t) * t)]
        lst = lst[slot::slots][w::num_workers]
        random.Random(slot * num_workers + w).shuffle(lst)
        out.append(lst)
    return out


PLAN_CASES = {
    "epoch mode (default)": PlanParams(seed=0),
    "pid mode, repeat": PlanParams(seed_mode="pid", repeat=True),
    # Slow path: with a start-index skip the equal-work target needs every worker's shuffle.
    "epoch + start-index skip": PlanParams(seed=0, start_index=64_000),
}


def case_plan(args: argparse.Namespace, name: str) -> dict:
    topo = Topology(args.world_size, args.rank, args.num_workers)
    counts = np.random.default_rng(0).integers(500, 1500, args.shards)
    if name == "baseline":
        urls = list(range(args.shards))
        sec, peak, rss = _measure(
            lambda: pid_literal(urls, topo.slot, topo.slots, topo.num_workers), args.repeats)
        return {"s": sec, "peak_mib": peak, "rss_mib": rss, "what": "lists only, no padding"}
    params = PLAN_CASES[name]

    def run() -> tuple:
        return plan_slot(counts, 1000, topo.slot, topo.slots, topo.num_workers, params,
                         args.epoch)

    sec, peak, rss = _measure(run, args.repeats)
    plan = run()
    return {"s": sec, "peak_mib": peak, "rss_mib": rss,
            "what": f"{len(plan)} slices ({sum(s.pad for s in plan)} pad), "
                    f"{total(plan):,} samples"}


# --------------------------------------------------------------------------- driver


def _child(args: argparse.Namespace, case: str) -> dict:
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--case")]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--case",
                          case], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    return json.loads(out.strip().splitlines()[-1])


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=1_000_000)
    ap.add_argument("--big-shards", type=int, default=10_000_000)
    ap.add_argument("--data", default="/tmp/ray_ingest_plan_scale",
                    help="where the generated wdinfo files are kept between runs")
    ap.add_argument("--world-size", type=int, default=4096)
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--rank", type=int, default=37)
    ap.add_argument("--epoch", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-big", action="store_true", help="skip the --big-shards catalog")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        kind, _, arg = args.case.partition(":")
        if kind == "load":
            n, extras = arg.split(",")
            result = case_load(args, int(n), extras == "1")
        elif kind == "parse":
            result = case_parse(args, int(arg))
        else:
            result = case_plan(args, arg)
        print(json.dumps(result))
        return

    topo = Topology(args.world_size, args.rank, args.num_workers)
    print(f"{topo.world_size:,} ranks x {topo.num_workers} workers; rank {topo.rank} "
          f"(slot {topo.slot}), epoch {args.epoch}; medians of {args.repeats} runs, each in a "
          "fresh process; RSS = high-water growth over the imports")
    sizes = [args.shards] + ([] if args.skip_big else [args.big_shards])
    for n in sizes:
        wdinfo_path(args.data, n)

    print("\n1. catalog load + one rank's plan (load_catalog, counts, plan_slot)")
    for n in sizes:
        reps = args.repeats if n <= 2_000_000 else min(args.repeats, 3)
        rows = [_child(args, f"load:{n},{int(i == 0)}") for i in range(reps)]
        print(f"  {n:>11,} shards: load {_median(rows, 'load_s'):6.3f} s + plan "
              f"{_median(rows, 'plan_s'):6.3f} s = {_median(rows, 'total_s'):6.3f} s, "
              f"RSS +{_median(rows, 'rss_mib'):6.0f} MiB   ({reps} runs)")
        first = rows[0]
        print(f"  {'':>11}         fingerprint {first['fingerprint_s']:.3f} s; pickle "
              f"{first['pickle_mib']:.1f} MiB, dumps {first['pickle_s']:.3f} s, loads "
              f"{first['unpickle_s']:.3f} s (one run)")

    print("\n2. parsing the wdinfo: json.loads + arrays, pyarrow's JSON reader, wdinfo_scan "
          "(one run)")
    for n in sizes:
        r = _child(args, f"parse:{n}")
        print(f"  {n:>11,} shards: json.loads {r['json_loads_s']:.3f} s + arrays "
              f"{r['json_arrays_s']:.3f} s = {r['json_loads_s'] + r['json_arrays_s']:.3f} s; "
              f"pyarrow.json {r['arrow_s']:.3f} s; wdinfo_scan (ours) {r['scan_s']:.3f} s")

    print(f"\n3. ray-ingest plan on the {args.shards:,}-shard wdinfo (subprocess, wall incl. "
          "start-up)")
    cmd = [sys.executable, "-m", "ray_ingest.cli.main", "plan", wdinfo_path(args.data,
           args.shards), "--world-size", str(args.world_size), "--num-workers",
           str(args.num_workers), "--rank", str(args.rank), "--epoch", str(args.epoch),
           "--json"]
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ,
                                                                  "PYTHONPATH": ROOT})
        walls.append(time.perf_counter() - t0)
    print(f"  $ {' '.join(cmd[1:])}")
    print(f"  median {statistics.median(walls):.3f} s (min {min(walls):.3f}, max "
          f"{max(walls):.3f})")

    print(f"\n4. planning only, counts in memory ({args.shards:,} shards)")
    cases = [*PLAN_CASES] + ([] if args.skip_baseline else ["baseline"])
    results = {}
    for case in cases:
        r = results[case] = _child(args, f"plan:{case}")
        label = "PiD literal (baseline)" if case == "baseline" else case
        print(f"  {label:26s} {r['s'] * 1e3:8.1f} ms  peak {r['peak_mib']:6.1f} MiB  "
              f"RSS +{r['rss_mib']:6.1f} MiB  | {r['what']}")
    if "baseline" in results:
        for case in PLAN_CASES:
            print(f"  speedup {case} vs PiD literal: "
                  f"{results['baseline']['s'] / results[case]['s']:.1f}x")


if __name__ == "__main__":
    main()
