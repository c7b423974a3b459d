"""Twin-tar read throughput: lockstep expansion (reader.read_shard) vs plain ``tarfile``.

Builds a two-modality (image + caption) twin-tar dataset with ``ray_ingest.tools.synth``, then
times, in the same sitting and interleaved (alternating which goes first), over every shard:

(a) ``reader.read_shard`` in strict mode (and merge mode, for information): both modalities'
    tars opened and expanded in lockstep into aligned rows;
(b) the baseline: plain ``tarfile.open(f, "r|")`` stream iteration over the same tars of both
    modalities, reading every member's bytes (no pairing at all).

Prints the exact command line, the dataset, the median seconds and throughput of each, and the
ratio ours/baseline (goal: >= 0.8). Files are read from the page cache after a warm-up pass,
so this measures CPU cost per byte, not the disk.

    .venv/bin/python bench/tar_read.py [--samples 4000] [--repetitions 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.load import load_catalog
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_shard,
)

MODALITIES = ("image", "caption")


def read_ours(catalog: Catalog, align: str) -> tuple[int, int]:
    """(samples, payload bytes) through the lockstep reader."""
    opts = ReadOptions(align=align)
    samples = nbytes = 0
    for shard in catalog.shards:
        for row in read_shard(shard, opts=opts):
            samples += 1
            nbytes += sum(len(row[m]) for m in MODALITIES)
    return samples, nbytes


def read_tarfile(catalog: Catalog) -> tuple[int, int]:
    """(members of the first modality, payload bytes) with plain tarfile stream iteration."""
    samples = nbytes = 0
    for shard in catalog.shards:
        for m in MODALITIES:
            with open(shard.url(m), "rb") as f, tarfile.open(fileobj=f, mode="r|") as tf:
                for info in tf:
                    if not info.isfile():
                        continue
                    data = tf.extractfile(info).read()
                    nbytes += len(data)
                    if m == MODALITIES[0]:
                        samples += 1
    return samples, nbytes


def timed(fn: Callable[[], tuple[int, int]]) -> tuple[float, tuple[int, int]]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--shard-size", type=int, default=250)
    p.add_argument("--min-side", type=int, default=256)
    p.add_argument("--max-side", type=int, default=768)
    p.add_argument("--repetitions", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="Dataset folder (reused if it holds a dataset; default: a temp dir).")
    args = p.parse_args(argv)
    if args.repetitions < 1:
        p.error("--repetitions must be >= 1")

    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    tmp = None
    if args.out is None:
        tmp = tempfile.TemporaryDirectory(prefix="tar_read_")
        out = Path(tmp.name) / "ds"
    else:
        out = Path(args.out)
    if not (out / "wdinfo.json").exists():
        t0 = time.perf_counter()
        synth_dataset(str(out), samples=args.samples, shard_size=args.shard_size, seed=args.seed,
                      min_side=args.min_side, max_side=args.max_side, modalities=MODALITIES,
                      num_workers=os.cpu_count() or 1)
        print(f"synth: {time.perf_counter() - t0:.1f}s")
    catalog = load_catalog(str(out), modalities=MODALITIES)
    tar_bytes = sum(os.path.getsize(s.url(m)) for s in catalog.shards for m in MODALITIES)
    print(f"dataset: {out}: {len(catalog.shards)} shards, {sum(catalog.counts)} samples, "
          f"{tar_bytes / 2**20:.1f} MiB of tars ({', '.join(MODALITIES)})")

    runs: dict[str, Callable[[], tuple[int, int]]] = {
        "ours strict": lambda: read_ours(catalog, "strict"),
        "ours merge": lambda: read_ours(catalog, "merge"),
        "tarfile r|": lambda: read_tarfile(catalog),
    }
    results = {name: fn() for name, fn in runs.items()}  # warm-up: page cache, imports
    if len({r for r in results.values()}) != 1:
        print(f"MISMATCH: {results}")
        return 1
    samples, nbytes = results["tarfile r|"]
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.repetitions):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            t, _ = timed(runs[name])
            times[name].append(t)
    print(f"{'reader':<12} {'median s':>9} {'MiB/s':>8} {'samples/s':>10}  all runs")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"{name:<12} {med[name]:>9.3f} {nbytes / 2**20 / med[name]:>8.0f} "
              f"{samples / med[name]:>10.0f}  " + " ".join(f"{t:.3f}" for t in ts))
    ratio = med["tarfile r|"] / med["ours strict"]
    print(f"ratio ours strict / tarfile throughput: {ratio:.2f}x (goal >= 0.8)")
    print(f"ratio ours merge  / tarfile throughput: {med['tarfile r|'] / med['ours merge']:.2f}x")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
