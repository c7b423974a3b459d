"""Resume cost: time to first batch after resuming at 10%, 50% and 90% of an epoch vs a fresh start.

Runs :class:`ray_ingest.loader.ingest.IngestLoader` directly (no trainer) on one local Ray. A
resumed start reads the saved per-rank state file back (``IngestLoader.restore_state``), plans only
the unconsumed samples and seeks into the first partial shard with its key index; a fresh start
reads from the top. Every round runs all cases in a rotating order; the table shows medians.
Optional baselines from the same sitting: the same resume on tars without key indexes (the
partial shard is streamed past), and Ray's upstream pattern, replaying the epoch from the start
and dropping the first N batches (``--replay``, one run per offset).

It also prints the size of the ReadState JSON for a 100,000-shard catalog (built in memory,
no tars) in the middle of an epoch, before and after a topology change.

    .venv/bin/python bench/resume.py [--samples 6000] [--shard-size 500] [--runs 5] [--replay]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

from ray_ingest.catalog.catalog import Catalog  # noqa: E402
from ray_ingest.catalog.load import load_catalog  # noqa: E402
from ray_ingest.catalog.shard import Shard  # noqa: E402
from ray_ingest.catalog.wdinfo import Wdinfo  # noqa: E402
from ray_ingest.config import Config, config_from_dict  # noqa: E402
from ray_ingest.loader.ingest import (  # noqa: E402
    IngestLoader,
    plan_params,
)
from ray_ingest.plan import PlanParams, Topology  # noqa: E402
from ray_ingest.plan.epoch import read_items  # noqa: E402
from ray_ingest.plan.state import (  # noqa: E402
    generation_streams,
    initial_state,
    slot_stream,
    with_progress,
    with_topology,
)
from ray_ingest.tools.synth import synth_dataset  # noqa: E402
from ray_ingest.train.auth import secure_local_ray  # noqa: E402

OFFSETS = (0.1, 0.5, 0.9)


def make_cfg(path: str, args: argparse.Namespace) -> Config:
    return config_from_dict({
        "data": {"paths": [path]},
        "decode": {"resolution": args.resolution, "pool_min": 1, "pool_max": 2,
                   "num_cpus": 0.25},
        "loader": {"batch_size": args.batch_size, "read_workers": 2, "seed": 0,
                   "read_num_cpus": 0.25, "block_rows": 64},
    })


def saved_state_dir(cfg: Config, catalog: Catalog, topo: Topology, frac: float,
                    root: str) -> tuple[str, int]:
    """A checkpoint folder holding the state after ``frac`` of the epoch's batches."""
    state = initial_state(catalog.fingerprint, plan_params(cfg), 0, topo,
                          catalog.fingerprint_doc())
    n = sum(sl.count for sl in slot_stream(state, catalog.counts, catalog.chunk_size, 0))
    bsz = cfg.loader.batch_size
    batches = int(frac * (n // bsz))
    state = with_progress(state, 0, ((0, batches * bsz),), batches)
    folder = os.path.join(root, f"ckpt_{int(frac * 100)}")
    IngestLoader(cfg, topo, catalog=catalog, state=state).save(folder)
    return folder, batches


def first_batch(cfg: Config, catalog: Catalog, topo: Topology, ckpt: str | None,
                skip_batches: int = 0) -> tuple[float, tuple[int, int]]:
    """Seconds from (restoring and) building the loader to holding the first batch."""
    gc.collect()
    t0 = time.perf_counter()
    state = IngestLoader.restore_state(ckpt) if ckpt else None
    loader = IngestLoader(cfg, topo, catalog=catalog, state=state)
    _, batches = next(iter(loader.epochs(1)))
    for _ in range(skip_batches):  # the replay baseline drops what was consumed before
        next(batches)
    b = next(batches)
    dt = time.perf_counter() - t0
    batches.close()  # stop the Ray Data pipeline before the next case
    return dt, (b.sids[0], b.indices[0])


def bookkeeping(cfg: Config, catalog: Catalog, topo: Topology, ckpt: str | None) -> float:
    """Seconds of resume-specific work: read + merge the state files, validate, plan the rest."""
    t0 = time.perf_counter()
    state = IngestLoader.restore_state(ckpt) if ckpt else None
    loader = IngestLoader(cfg, topo, catalog=catalog, state=state)
    st = loader.state
    stream = slot_stream(st, catalog.counts, catalog.chunk_size, topo.slot)
    read_items(stream, st.current.consumed[topo.slot], cfg.loader.block_rows)
    return time.perf_counter() - t0


def bench_first_batch(args: argparse.Namespace) -> None:
    import ray

    data = args.data or os.path.join(tempfile.gettempdir(),
                                     f"ray_ingest_bench_resume_{args.samples}_{args.shard_size}")
    if not os.path.exists(os.path.join(data, "wdinfo.json")):
        synth_dataset(data, samples=args.samples, shard_size=args.shard_size, seed=0,
                      min_side=args.resolution, max_side=2 * args.resolution, num_workers=2,
                      overwrite=True)
    noidx = data + "_noindex"
    if not os.path.exists(noidx):
        shutil.copytree(data, noidx, ignore=shutil.ignore_patterns("*.idx.json"))
    secure_local_ray()  # token authentication on (a one-off token if none is set up)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=512 * 1024**2)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    topo = Topology(world_size=1, read_workers=2)
    variants = {"index": data, "no index": noidx}
    setups = {}
    with tempfile.TemporaryDirectory() as root:
        for name, path in variants.items():
            cfg = make_cfg(path, args)
            catalog = load_catalog([path])
            ckpts = {f: saved_state_dir(cfg, catalog, topo, f, os.path.join(root, name))
                     for f in OFFSETS}
            setups[name] = (cfg, catalog, ckpts)
        cfg, catalog, ckpts = setups["index"]
        per_epoch = ckpts[0.5][1] * 2
        print(f"dataset {data}: {len(catalog.shards)} shards x {args.shard_size} samples, "
              f"{catalog.total_key_count} samples; 1 rank x 2 read workers, batch "
              f"{args.batch_size}, {args.resolution}px; ~{per_epoch} batches per epoch; "
              f"median of {args.runs} runs")
        first_batch(cfg, catalog, topo, None)  # warm-up: worker processes, imports
        cases = [("fresh", "index", None)] + [
            (f"{int(f * 100)}%", v, f) for v in variants for f in OFFSETS]
        times: dict[tuple[str, str], list[float]] = {(c, v): [] for c, v, _ in cases}
        for r in range(args.runs):
            for c, v, f in cases[r % len(cases):] + cases[:r % len(cases)]:
                cfg, catalog, ckpts = setups[v]
                dt, where = first_batch(cfg, catalog, topo, ckpts[f][0] if f else None)
                times[(c, v)].append(dt)
        fresh = statistics.median(times[("fresh", "index")])
        def plan_ms(v: str, f: float | None) -> float:
            cfg, catalog, ckpts = setups[v]
            ck = ckpts[f][0] if f else None
            return 1e3 * statistics.median(bookkeeping(cfg, catalog, topo, ck) for _ in range(5))

        print(f"  {'start':8s} {'tars':9s} {'first batch (s)':>16s} {'vs fresh':>9s} "
              f"{'plan (ms)':>10s}   runs (s)")
        print(f"  {'fresh':8s} {'index':9s} {fresh:16.2f} {1.0:8.2f}x "
              f"{plan_ms('index', None):10.1f}"
              f"   {' '.join(f'{t:.2f}' for t in times[('fresh', 'index')])}")
        for v in variants:
            for f in OFFSETS:
                c = f"{int(f * 100)}%"
                med = statistics.median(times[(c, v)])
                print(f"  {c:8s} {v:9s} {med:16.2f} {med / fresh:8.2f}x {plan_ms(v, f):10.1f}"
                      f"   {' '.join(f'{t:.2f}' for t in times[(c, v)])}")
        print("  plan = restoring the state files, validating them and planning the unconsumed "
              "read tasks (no Ray): the only work a resume adds")
        if args.replay:
            cfg, catalog, ckpts = setups["index"]
            print("  baseline: replay from the epoch start and drop the consumed batches "
                  "(Ray's skip-N-batches pattern), one run each")
            for f in OFFSETS:
                dt, _ = first_batch(cfg, catalog, topo, None, skip_batches=ckpts[f][1])
                print(f"  {int(f * 100):3d}%     replay    {dt:16.2f} {dt / fresh:8.2f}x")
    ray.shutdown()


def big_catalog(num_shards: int, seed: int = 0) -> Catalog:
    """A catalog of ``num_shards`` shards of 900..1100 samples, in memory (no tars)."""
    counts = np.random.default_rng(seed).integers(900, 1101, num_shards).tolist()
    root = "gs://bucket/dataset"
    shards = tuple(Shard(path=f"part_{i // 1000:06d}/{i % 1000:06d}.tar", root=root,
                             modalities=("image", "caption"), count=c)
                   for i, c in enumerate(counts))
    info = Wdinfo(source=f"{root}/wdinfo.json", tar_files=shards, total_key_count=sum(counts),
                  chunk_size=1000, data_keys=("image", "caption"))
    return Catalog(shards=shards, wdinfos=(info,), chunk_size=1000, modalities=("image", "caption"))


def bench_state_size(args: argparse.Namespace) -> None:
    catalog = big_catalog(args.catalog_shards)
    counts, chunk = catalog.counts, catalog.chunk_size
    params = PlanParams(seed=0)
    world, workers, bsz = args.world_size, 8, 32
    topo = Topology(world_size=world, read_workers=workers)
    print(f"ReadState size, {len(catalog.shards):,}-shard catalog ({catalog.total_key_count:,} "
          f"samples), {world} ranks x {workers} read workers, batch {bsz}:")

    def size(state) -> int:
        return len(json.dumps(state.to_dict(), separators=(",", ":")).encode())

    state = initial_state(catalog.fingerprint, params, 3, topo, catalog.fingerprint_doc())
    def show(label: str, nbytes: int, extra: str = "") -> None:
        print(f"  {label:46s} {nbytes:7,d} bytes{extra}")

    show("epoch start", size(state))
    t0 = time.perf_counter()
    stream = slot_stream(state, counts, chunk, 0)
    t_plan = time.perf_counter() - t0
    per_slot = sum(sl.count for sl in stream)
    done = per_slot // 2 // bsz
    for slot in range(world):
        state = with_progress(state, slot, ((0, done * bsz),), done)
    show(f"mid-epoch ({done} of ~{per_slot // bsz} batches per rank)", size(state))
    # unordered loaders consume out of order: a few holes per rank
    frag = state
    for slot in range(world):
        holes = tuple((a, a + bsz) for a in range(0, done * bsz, done * bsz // 8))
        frag = with_progress(frag, slot, holes, done)
    show("mid-epoch, unordered (8 ranges per rank)", size(frag))
    new_world = world * 3 // 4
    t0 = time.perf_counter()
    moved = with_topology(state, Topology(world_size=new_world, read_workers=workers))
    streams = generation_streams(moved, counts, chunk)
    t_replan = time.perf_counter() - t0
    left = sum(sl.count for sl in streams[0])
    for slot in range(new_world):
        moved = with_progress(moved, slot, ((0, left // 2 // bsz * bsz),), left // 2 // bsz)
    show(f"after {world} -> {new_world} ranks, mid-way again", size(moved),
         f" ({len(moved.generations)} generations)")
    skipped = with_progress(moved, 0, moved.current.consumed[0], moved.current.batches[0],
                            [(i * 37, i, "decode: broken JPEG") for i in range(100)])
    show("... plus 100 samples skipped (on_error=skip)", size(skipped))
    print(f"  one rank's plan: {t_plan * 1e3:.0f} ms; re-plan of every slot after the change: "
          f"{t_replan:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="twin-tar dataset (default: synthesised into the temp dir)")
    ap.add_argument("--samples", type=int, default=6000)
    ap.add_argument("--shard-size", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5, help="rounds (medians; at least 3)")
    ap.add_argument("--replay", action="store_true", help="also time the skip-N-batches baseline")
    ap.add_argument("--catalog-shards", type=int, default=100_000)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--state-only", action="store_true", help="only the ReadState sizes")
    args = ap.parse_args()
    if args.runs < 3:
        ap.error("--runs: expected at least 3 (medians)")
    if not args.state_only:
        bench_first_batch(args)
    bench_state_size(args)


if __name__ == "__main__":
    main()
