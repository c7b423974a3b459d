"""Decode once per parallel group: decode CPU, storage bytes and data-wait per unique sample.

    .venv/bin/python bench/group_share.py [--samples 1536] [--workers 4] [--runs 2]

Runs the real training job (``jobs/train.py``: TorchTrainer, embedded local Ray) with the same
data, world size and seed for group_size 1, 2 and 4 (as far as ``--workers`` allows), each
group size with ``loader.group_share: off`` (every rank reads and decodes its group's stream)
and ``broadcast`` (the group's first rank decodes, the others receive). Every rank prints a
final ``[train] done`` line with its own ``decode_cpu_s``, ``bytes_read`` and ``data_wait_s``;
the totals are sums over the job's output. Unique delivered samples are those of one rank per
group (all ranks of a group train on the same ones). Prints medians over ``--runs`` interleaved
runs and the ratios to group_size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ray_ingest.tools.synth import synth_dataset  # noqa: E402

DONE = "[train] done: "


def job_config(data: str, args: argparse.Namespace, share: str, runs_dir: str) -> dict:
    return {
        "data": {"paths": [data]},
        "decode": {"resolution": args.res, "pool_min": 1, "pool_max": 1, "num_cpus": 0.5},
        "loader": {"batch_size": args.batch, "read_workers": 1, "seed": 1,
                   "group_share": share},
        "train": {"num_workers": args.workers, "cpus_per_worker": 0.25, "epochs": args.epochs,
                  "checkpoint_every": 10_000, "log_every": 10_000, "storage_path": runs_dir,
                  "max_failures": 0},
    }


def run_job(data: str, args: argparse.Namespace, group: int, share: str, tmp: str,
            tag: str) -> dict:
    cfg_path = os.path.join(tmp, f"{tag}.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(job_config(data, args, share, os.path.join(tmp, "runs")), f)
    cmd = [sys.executable, os.path.join(REPO, "jobs", "train.py"), "--config", cfg_path,
           "--group-size", str(group), "--name", tag, "--num-cpus", str(args.num_cpus)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}  # the job secures its own Ray
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"job {tag} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    ranks = {}
    for line in proc.stdout.splitlines():
        if DONE in line:
            d = json.loads(line.split(DONE, 1)[1])
            ranks[d["rank"]] = d
    if sorted(ranks) != list(range(args.workers)):
        raise SystemExit(f"job {tag}: final lines of ranks {sorted(ranks)}, expected "
                         f"{args.workers}:\n{proc.stdout[-3000:]}")
    unique = sum(d["samples"] for r, d in ranks.items() if r % group == 0)
    decode = sum(d["decode_cpu_s"] for d in ranks.values())
    read_bytes = sum(d["bytes_read"] for d in ranks.values())
    return {
        "group_size": group, "share": share, "job_wall_s": round(wall, 2),
        "unique_samples": unique,
        "decode_cpu_ms_per_unique": 1e3 * decode / unique,
        "bytes_per_unique": read_bytes / unique,
        "data_wait_s_mean": statistics.mean(d["data_wait_s"] for d in ranks.values()),
        "data_wait_frac_mean": statistics.mean(d["data_wait_frac"] for d in ranks.values()),
        "loop_s_mean": statistics.mean(d["elapsed_s"] for d in ranks.values()),
        "pipelines": sum(1 for d in ranks.values() if d["executions"]),
        "data_wait_s_by_rank": [round(ranks[r]["data_wait_s"], 3) for r in sorted(ranks)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=1536)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--res", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=4, help="Train workers (ranks)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--runs", type=int, default=2, help="interleaved repetitions (medians)")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray")
    p.add_argument("--data", help="dataset folder (made when missing)")
    p.add_argument("--json-out", help="write every run's figures here")
    args = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="group_share_")
    data = args.data or os.path.join(tmp, "ds")
    if not os.path.exists(os.path.join(data, "wdinfo.json")):
        synth_dataset(data, samples=args.samples, shard_size=args.shard_size, seed=7,
                      min_side=256, max_side=384)
    groups = [g for g in (1, 2, 4) if g <= args.workers and args.workers % g == 0]
    cases = [(1, "off")] + [(g, s) for g in groups[1:] for s in ("off", "broadcast")]
    rows: dict[tuple[int, str], list[dict]] = {c: [] for c in cases}
    for run in range(args.runs):
        for g, share in cases:
            r = run_job(data, args, g, share, tmp, f"g{g}_{share}_{run}")
            rows[(g, share)].append(r)
            print(json.dumps(r), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({f"{g}/{s}": v for (g, s), v in rows.items()}, f, indent=1)

    def med(c, k):
        return statistics.median(r[k] for r in rows[c])

    base = (1, "off")
    print(f"\n{args.workers} ranks, {args.samples} samples x {args.epochs} epoch(s), "
          f"{args.res} px, medians of {args.runs} runs")
    print("group  share      pipelines  decode ms/uniq  (x g1)  bytes/uniq  (x g1)  "
          "data-wait s  (x g1)  (x off)  wait frac")
    for c in cases:
        off = (c[0], "off")
        print(f"{c[0]:>5}  {c[1]:<9}  {med(c, 'pipelines'):>9.0f}  "
              f"{med(c, 'decode_cpu_ms_per_unique'):>14.2f}  "
              f"{med(c, 'decode_cpu_ms_per_unique') / med(base, 'decode_cpu_ms_per_unique'):>6.2f}"
              f"  {med(c, 'bytes_per_unique'):>10.0f}  "
              f"{med(c, 'bytes_per_unique') / med(base, 'bytes_per_unique'):>6.2f}  "
              f"{med(c, 'data_wait_s_mean'):>11.2f}  "
              f"{med(c, 'data_wait_s_mean') / med(base, 'data_wait_s_mean'):>6.2f}  "
              f"{med(c, 'data_wait_s_mean') / med(off, 'data_wait_s_mean'):>7.2f}  "
              f"{med(c, 'data_wait_frac_mean'):>9.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
