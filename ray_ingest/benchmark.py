"""Decoded samples/s delivered to a consumer: ray_ingest vs baselines, same data, same sitting.

    .venv/bin/python bench/throughput.py [--samples 2400] [--runs 3]
    .venv/bin/ray-ingest bench [same flags]

Contenders (all decode with the same function: Pillow + JPEG draft + resize/center crop):
  ours      IngestLoader (TwinTarDatasource -> Decoder actor pool -> batches), one rank
  wds_dl    webdataset tar iterators zipped per twin shard (PiD's loader) in a torch
            DataLoader with 2 workers, batch collate
  ray_wds   ray.data.read_webdataset(image tars) + map_batches decode (no twin join)
  ceiling   single-process read+decode loop, throughput x cores
Prints medians over --runs (interleaved) and the ratios ours/baseline.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tarfile
import time
from collections.abc import Iterator

import numpy as np
from PIL import Image

from ray_ingest.augment import Geometry, draft_for, resize_crop


def decode_image(data: bytes, res: int) -> np.ndarray:
    geom = Geometry(res, res, "center")
    img = Image.open(io.BytesIO(data))
    draft_for(img, geom)
    return resize_crop(img, geom)


def shard_urls(root: str, modality: str) -> list[str]:
    from ray_ingest.catalog import load_catalog

    cat = load_catalog([root])
    return [s.url(modality) for s in cat.shards]


# --- contenders --------------------------------------------------------------------------
#: Samples per read task / block for ``ours`` (``--block-rows``): per-task overhead dominates at
#: 32 on 2 cores; one task per 100-sample shard measured fastest (docs/benchmarks.md).
BLOCK_ROWS = [100]


def run_ours(root: str, res: int, batch: int, cores: int) -> Iterator[int]:
    from ray_ingest.config import config_from_dict
    from ray_ingest.plan.topology import Topology
    from ray_ingest.stream import IngestLoader

    cfg = config_from_dict({
        "data": {"paths": [root]},
        "decode": {"resolution": res, "pool_min": cores, "pool_max": cores, "num_cpus": 0.5},
        "loader": {"batch_size": batch, "read_workers": 1, "block_rows": BLOCK_ROWS[0],
                   "prefetch_batches": 4, "read_num_cpus": 0.25, "ordered": True},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, num_workers=1))
    for _, batches in loader.epochs(1):
        for b in batches:
            yield sum(1 for p in b.pads if not p)


class _TwinWds(__import__("torch").utils.data.IterableDataset):
    """PiD-style: per shard, zip webdataset tar iterators of both modalities; split by worker."""

    def __init__(self, pairs: list[tuple[str, str]], res: int):
        self.pairs, self.res = pairs, res

    def __iter__(self):
        import torch.utils.data as tud
        from webdataset.tariterators import tar_file_iterator

        info = tud.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for img_url, cap_url in self.pairs[wid::nw]:
            with open(img_url, "rb") as fi, open(cap_url, "rb") as fc:
                for a, b in zip(tar_file_iterator(fi), tar_file_iterator(fc), strict=False):
                    yield decode_image(a["data"], self.res), json.loads(b["data"])["prompt"]


def run_wds_dl(root: str, res: int, batch: int, cores: int) -> Iterator[int]:
    import torch.utils.data as tud

    pairs = list(zip(shard_urls(root, "image"), shard_urls(root, "caption"), strict=True))
    dl = tud.DataLoader(_TwinWds(pairs, res), batch_size=batch, num_workers=cores,
                        persistent_workers=False, prefetch_factor=4)
    for imgs, _caps in dl:
        yield len(imgs)


def run_ray_wds(root: str, res: int, batch: int, cores: int) -> Iterator[int]:
    import ray

    ds = ray.data.read_webdataset(shard_urls(root, "image"), decoder=None, num_cpus=0.25)

    def dec(b):
        return {"image": np.stack([decode_image(x, res) for x in b["jpg"]])}

    ds = ds.map_batches(dec, batch_format="numpy", num_cpus=0.5, batch_size=32)
    for b in ds.iter_batches(batch_size=batch, batch_format="numpy"):
        yield len(b["image"])


def run_ceiling(root: str, res: int, batch: int, cores: int) -> Iterator[int]:
    n = 0
    for url in shard_urls(root, "image"):
        with tarfile.open(url, "r|") as tf:
            for ti in tf:
                if ti.isfile():
                    decode_image(tf.extractfile(ti).read(), res)
                    n += 1
                    if n == batch:
                        yield n
                        n = 0
    if n:
        yield n


CONTENDERS = {"ours": run_ours, "wds_dl": run_wds_dl, "ray_wds": run_ray_wds,
              "ceiling": run_ceiling}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/throughput.py", description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/tmp/ray_ingest_bench_tp", help="dataset folder (reused)")
    p.add_argument("--samples", type=int, default=2400)
    p.add_argument("--shard-size", type=int, default=100)
    p.add_argument("--min-side", type=int, default=512)
    p.add_argument("--max-side", type=int, default=768)
    p.add_argument("--res", type=int, default=224, help="output side (center crop)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    p.add_argument("--only", default=",".join(CONTENDERS))
    p.add_argument("--json-out", default=None)
    p.add_argument("--block-rows", type=int, default=100,
                   help="ours: samples per read task and block (loader.block_rows)")
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    BLOCK_ROWS[0] = args.block_rows
    from ray_ingest.synth import synth_dataset

    if not os.path.exists(os.path.join(args.data, "wdinfo.json")):
        synth_dataset(args.data, samples=args.samples, shard_size=args.shard_size, seed=0,
                      min_side=args.min_side, max_side=args.max_side, overwrite=True)
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.verbose_progress = False
    names = [n for n in args.only.split(",") if n]
    full: dict[str, list[float]] = {n: [] for n in names}
    steady: dict[str, list[float]] = {n: [] for n in names}
    first: dict[str, list[float]] = {n: [] for n in names}
    counts: dict[str, int] = {}
    for r in range(args.runs):
        for name in names:
            mult = args.cores if name == "ceiling" else 1
            t0 = time.perf_counter()
            t_first, n, n_first = None, 0, 0
            for k in CONTENDERS[name](args.data, args.res, args.batch, args.cores):
                n += k
                if t_first is None:
                    t_first, n_first = time.perf_counter() - t0, k
            dt = time.perf_counter() - t0
            t_first = t_first or dt
            full[name].append(n / dt * mult)
            steady[name].append((n - n_first) / max(dt - t_first, 1e-9) * mult)
            first[name].append(t_first)
            counts[name] = n
            print(f"run {r} {name:8s} {n} samples in {dt:6.2f} s (first batch {t_first:5.2f} s)"
                  f" -> {full[name][-1]:8.1f} samples/s, after first batch "
                  f"{steady[name][-1]:8.1f}", flush=True)
    med = {n: statistics.median(v) for n, v in full.items()}
    med_steady = {n: statistics.median(v) for n, v in steady.items()}
    med_first = {n: statistics.median(v) for n, v in first.items()}
    print("\nmedians (ceiling = 1-process rate x cores):")
    print(f"  {'contender':9s} {'full pass':>10s} {'after 1st':>10s} {'1st batch':>10s}")
    for n in names:
        print(f"  {n:9s} {med[n]:10.1f} {med_steady[n]:10.1f} {med_first[n]:9.2f}s")
    if "ours" in med:
        for n, goal in (("wds_dl", 1.2), ("ray_wds", 3.0), ("ceiling", 0.75)):
            if n in med:
                print(f"  ours / {n:8s} = {med['ours'] / med[n]:.2f}x full pass, "
                      f"{med_steady['ours'] / med_steady[n]:.2f}x after first batch "
                      f"(goal >= {goal}x)")
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"median_full": med, "median_after_first": med_steady,
                       "median_first_batch_s": med_first, "full": full, "after_first": steady,
                       "counts": counts, "args": vars(args)}, f, indent=2)
    ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
