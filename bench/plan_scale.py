"""Planning at scale: one rank's plan (all its workers + equal-work padding) for a big catalog.

Default: 1,000,000 shards, 4,096 ranks x 8 workers. Prints the median wall time of several
runs and the peak extra memory (tracemalloc peak; RSS high-water growth), against a baseline
run in the same sitting: PiD's literal per-worker list construction (materialise the extended
url list in Python, then slice), once per worker of the rank.

    .venv/bin/python bench/plan_scale.py [--shards N] [--world-size W] [--num-workers K]
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from ray_ingest.plan import PlanParams, Topology, plan_slot, total


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


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(median seconds, tracemalloc peak MiB, RSS high-water growth MiB of the first call)."""
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB on Linux
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


def run_case(case: str, args: argparse.Namespace) -> None:
    """Measure one case in this (fresh) process and print one line."""
    topo = Topology(args.world_size, args.rank, args.num_workers, 0, args.group_size)
    counts = np.random.default_rng(0).integers(500, 1500, args.shards)  # input, not the plan
    if case == "baseline":
        urls = list(range(args.shards))
        sec, peak, rss = measure(
            lambda: pid_literal(urls, topo.slot, topo.slots, topo.num_workers), args.repeats)
        print(f"{'PiD literal (baseline)':24s} {sec * 1e3:8.1f} ms  peak {peak:6.1f} MiB  "
              f"RSS +{rss:6.1f} MiB  | lists only, no padding")
        return
    params = CASES[case]

    def run() -> tuple:
        return plan_slot(counts, 1000, topo.slot, topo.slots, topo.num_workers, params,
                         args.epoch)

    sec, peak, rss = measure(run, args.repeats)
    plan = run()
    npad = sum(s.pad for s in plan)
    print(f"{case:24s} {sec * 1e3:8.1f} ms  peak {peak:6.1f} MiB  RSS +{rss:6.1f} MiB  | "
          f"{len(plan)} slices ({npad} pad), {total(plan):,} samples")


CASES = {
    "epoch mode (default)": PlanParams(seed=0),
    "pid mode": PlanParams(seed_mode="pid"),
    # Slow path: with a start-index skip the equal-work target needs every worker's shuffle.
    "epoch + start-index skip": PlanParams(seed=0, start_index=64_000),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=1_000_000)
    ap.add_argument("--world-size", type=int, default=4096)
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=1)
    ap.add_argument("--rank", type=int, default=37)
    ap.add_argument("--epoch", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--case", choices=[*CASES, "baseline"], help="run one case (internal)")
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args()
    if args.case:
        run_case(args.case, args)
        return

    topo = Topology(args.world_size, args.rank, args.num_workers, 0, args.group_size)
    print(f"catalog {args.shards:,} shards; {topo.world_size:,} ranks x {topo.num_workers} "
          f"workers (group {topo.group_size}); rank {topo.rank} -> slot {topo.slot}; "
          f"median of {args.repeats} runs; each case in a fresh process; peak = tracemalloc "
          "peak during one call; RSS = high-water growth during the first call")
    passthrough = [a for a in sys.argv[1:] if a != "--skip-baseline"]
    cases = [*CASES] + ([] if args.skip_baseline else ["baseline"])
    lines = {}
    for case in cases:
        out = subprocess.run([sys.executable, __file__, *passthrough, "--case", case],
                             check=True, capture_output=True, text=True).stdout.strip()
        lines[case] = out
        print("  " + out)
    if "baseline" in lines:
        base = float(lines["baseline"].split("ms")[0].split()[-1])
        for case in CASES:
            ms = float(lines[case].split("ms")[0].split()[-1])
            print(f"  speedup {case} vs PiD literal: {base / ms:.1f}x")


if __name__ == "__main__":
    main()
