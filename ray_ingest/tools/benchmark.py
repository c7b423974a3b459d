"""Decoded samples/s delivered to a consumer over a multi-epoch job: ray_ingest vs baselines.

    .venv/bin/python bench/throughput.py [--samples 9600] [--epochs 3] [--runs 3]
    .venv/bin/ray-ingest bench [same flags]

Contenders (all decode the same bytes: Pillow + JPEG draft + resize/center crop; the baselines
resize the whole image, then crop, as their users write it, unless ``--baseline-resize kept``
gives them ours, ``augment.resize_crop``, which resamples only the kept pixels):
  ours       IngestLoader (TwinTarDatasource -> Decoder actor pool -> batches), one rank
  ours:MODE  the same with ``decode.compute: MODE`` (``ours:threads,ours:tasks,ours:actors``
             compares the decode modes in one sitting); ``ours:decode.threads=2+loader.X=Y``
             runs any other variant
  wds_dl     webdataset tar iterators zipped per twin shard (PiD's loader) in a torch
             DataLoader with ``--cores`` workers, started afresh every epoch
  wds_dl_pw  the same DataLoader with ``persistent_workers=True`` (start-up paid once)
  wds_dl_pw_torch  the same, resizing with torch's antialiased bilinear on uint8 (the kernel
             of torchvision's tensor ``Resize``): the baseline of ``decode.resizer: torch``
  ray_wds    ray.data.read_webdataset(image tars) + map_batches decode (no twin join)
  ceiling    single-process read+decode loop, throughput x cores
  ceiling_par  the same loop in ``--cores`` processes at once, each on its share of the image
             tars, sending back only counts: what the cores deliver with no transfer at all
Every contender runs ``--epochs`` epochs in one job. Per contender: the whole-run rate
(samples / wall time from the start of the job, start-up included), the steady-state rate
(samples after the first batch of each epoch / time from that batch to the epoch's last batch),
the time to the first batch, and the stall at each epoch boundary (the gap between an epoch's
last batch and the next epoch's first batch, minus the median gap between batches within
epochs). Prints medians over ``--runs`` interleaved runs and the ratios of ours to each.

Per run it also samples the CPU of every process involved from /proc (``--cpu-interval``;
ray_ingest/tools/cpu_roles.py): the trainer (split by thread), Ray's decode workers, idle
workers, Ray Data's actors, raylet, GCS, agents and the DataLoader's workers, per delivered
sample; before and after the runs, the idle CPU of Ray's daemons over ``--idle-s`` quiet
seconds (after the runs, Ray keeps idle workers and Ray Data's actors hold the sitting's
stats); and the ratios of total CPU per sample between contenders (``--cpu-ref``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import io
import itertools
import json
import os
import statistics
import sys
import tarfile
import time
from collections.abc import Callable, Iterator

import numpy as np
from PIL import Image

from ray_ingest.decode.augment import (
    Geometry,
    draft_for,
    resize_crop,
    resize_then_crop,
)
from ray_ingest.tools import cpu_roles

Batches = Iterator[tuple[int, int]]  # (epoch, samples) per delivered batch
Resize = Callable[..., np.ndarray]
#: The baselines' resize + crop (``--baseline-resize``); passed on explicitly, because the
#: contenders' worker processes (spawned, or Ray's) do not see this process's globals.
BASELINE_RESIZE: dict[str, Resize] = {"whole": resize_then_crop, "kept": resize_crop}
BASELINE: dict[str, Resize] = {"resize": resize_then_crop}


def decode_image(data: bytes, res: int, resize: Resize = resize_then_crop) -> np.ndarray:
    geom = Geometry(res, res, "center")
    img = Image.open(io.BytesIO(data))
    draft_for(img, geom)
    return resize(img, geom)


def resize_torch_then_crop(img: Image.Image, geom: Geometry, rng_seed: int | None = None
                           ) -> np.ndarray:
    """The textbook transform with torch's resize (``wds_dl_pw_torch``): what
    ``decode.resizer: torch`` computes, as a DataLoader user would write it."""
    from ray_ingest.decode.geometry import place
    from ray_ingest.decode.modalities import as_mode
    from ray_ingest.decode.resize_torch import render_torch

    return render_torch(np.asarray(as_mode(img)), place(img.size, geom, rng_seed, scalable=False))


def shard_urls(root: str, modality: str) -> list[str]:
    from ray_ingest.catalog.load import load_catalog

    cat = load_catalog([root])
    return [cat.shards[i].url(modality) for i in range(len(cat.shards))]


# --- contenders --------------------------------------------------------------------------
#: Config overrides of ``ours`` (flags ``--block-rows`` and ``--pool``), set by :func:`main`;
#: without them ``ours`` runs the default configuration, as a new user would.
OURS: dict[str, dict] = {"decode": {}, "loader": {}}
#: The last ``ours`` loader of the sitting (its stage profile is printed at the end).
LAST_LOADER: list = []


def variant(mode: str) -> dict[str, dict]:
    """The overrides of ``ours:MODE``: ``MODE`` alone is a ``decode.compute`` value; with an
    ``=`` it is ``SECTION.FIELD=VALUE`` items joined by ``+`` (YAML values), for a variant that
    is not a decode mode (``ours:decode.compute=threads+decode.threads=2``)."""
    import yaml

    if "=" not in mode:
        return {"decode": {"compute": mode}}
    out: dict[str, dict] = {"decode": {}, "loader": {}}
    for item in mode.split("+"):
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        if section not in out or not field:
            msg = (f"ours:{mode}: {item!r} is not decode.FIELD=VALUE or loader.FIELD=VALUE")
            raise SystemExit(msg)
        out[section][field] = yaml.safe_load(value)
    return out


def ours_config(root: str, res: int, batch: int, compute: str | None = None):
    """The ``ours`` configuration: ``OURS`` overrides, then those of ``ours:MODE``
    (``compute``: the MODE, see :func:`variant`)."""
    from ray_ingest.config import config_from_dict

    over = variant(compute) if compute else {}
    decode = {"resolution": res, **OURS["decode"], **over.get("decode", {})}
    loader = {"batch_size": batch, **OURS["loader"], **over.get("loader", {})}
    train = {"use_gpu": True} if decode.get("device") == "cuda" else {}
    return config_from_dict({"data": {"paths": [root]}, "decode": decode, "loader": loader,
                             "train": train})


def run_ours(root: str, res: int, batch: int, cores: int, epochs: int,
             compute: str | None = None) -> Batches:
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology

    cfg = ours_config(root, res, batch, compute)
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=cfg.loader.read_workers))
    LAST_LOADER[:] = [loader]
    for epoch, batches in loader.epochs(epochs):
        for b in batches:
            yield epoch, sum(1 for p in b.pads if not p)


class _TwinWds(__import__("torch").utils.data.IterableDataset):
    """PiD-style: per shard, zip webdataset tar iterators of both modalities; split by worker."""

    def __init__(self, pairs: list[tuple[str, str]], res: int, resize: Resize):
        self.pairs, self.res, self.resize = pairs, res, resize

    def __iter__(self):
        import torch.utils.data as tud
        from webdataset.tariterators import tar_file_iterator

        info = tud.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for img_url, cap_url in self.pairs[wid::nw]:
            with open(img_url, "rb") as fi, open(cap_url, "rb") as fc:
                for a, b in zip(tar_file_iterator(fi), tar_file_iterator(fc), strict=False):
                    yield (decode_image(a["data"], self.res, self.resize),
                           json.loads(b["data"])["prompt"])


def _dataloader(root: str, res: int, batch: int, cores: int, epochs: int,
                persistent: bool, resize: Resize | None = None) -> Batches:
    import torch.utils.data as tud

    pairs = list(zip(shard_urls(root, "image"), shard_urls(root, "caption"), strict=True))
    dl = tud.DataLoader(_TwinWds(pairs, res, resize or BASELINE["resize"]), batch_size=batch,
                        num_workers=cores, persistent_workers=persistent, prefetch_factor=4)
    with gc_frozen():
        for epoch in range(epochs):
            for imgs, _caps in dl:
                yield epoch, len(imgs)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Around a DataLoader whose workers fork from a process with Ray up: an ObjectRef freed by
    a worker's garbage collector would write to the raylet over this process's sockets (seen
    once: the plasma store died on "Invalid Plasma message type"; the train-step bench, which
    did not freeze, once had its next Ray run wait forever on its workers' first answers: the
    suspected cause, not proven). Garbage collected here, the rest frozen, so no worker
    collects what it inherited."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_wds_dl(root: str, res: int, batch: int, cores: int, epochs: int) -> Batches:
    return _dataloader(root, res, batch, cores, epochs, persistent=False)


def run_wds_dl_pw(root: str, res: int, batch: int, cores: int, epochs: int) -> Batches:
    return _dataloader(root, res, batch, cores, epochs, persistent=True)


def run_wds_dl_pw_torch(root: str, res: int, batch: int, cores: int, epochs: int) -> Batches:
    return _dataloader(root, res, batch, cores, epochs, persistent=True,
                       resize=resize_torch_then_crop)


def run_ray_wds(root: str, res: int, batch: int, cores: int, epochs: int) -> Batches:
    import ray

    ds = ray.data.read_webdataset(shard_urls(root, "image"), decoder=None, num_cpus=0.25)
    resize = BASELINE["resize"]

    def dec(b):
        return {"image": np.stack([decode_image(x, res, resize) for x in b["jpg"]])}

    ds = ds.map_batches(dec, batch_format="numpy", num_cpus=0.5, batch_size=32)
    for epoch in range(epochs):
        for b in ds.iter_batches(batch_size=batch, batch_format="numpy"):
            yield epoch, len(b["image"])


def _decoded_batches(urls: list[str], res: int, batch: int, resize: Resize) -> Iterator[int]:
    """Decode every image of ``urls`` (plain ``tarfile``); the size of each batch's worth."""
    n = 0
    for url in urls:
        with tarfile.open(url, "r|") as tf:
            for ti in tf:
                if ti.isfile():
                    decode_image(tf.extractfile(ti).read(), res, resize)
                    n += 1
                    if n == batch:
                        yield n
                        n = 0
    if n:
        yield n


def run_ceiling(root: str, res: int, batch: int, cores: int, epochs: int) -> Batches:
    for epoch in range(epochs):
        for n in _decoded_batches(shard_urls(root, "image"), res, batch, BASELINE["resize"]):
            yield epoch, n


def _ceiling_worker(urls: list[str], res: int, batch: int, resize: Resize, go, out) -> None:
    """One process of ``ceiling_par``: per epoch asked for on ``go``, decode ``urls``; counts."""
    while (epoch := go.get()) is not None:
        for n in _decoded_batches(urls, res, batch, resize):
            out.put((epoch, n))
        out.put((epoch, None))


def run_ceiling_par(root: str, res: int, batch: int, cores: int, epochs: int) -> Batches:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # not fork: this process runs Ray's threads
    urls = shard_urls(root, "image")
    out = ctx.Queue()
    gos = [ctx.Queue() for _ in range(cores)]
    resize = BASELINE["resize"]
    procs = [ctx.Process(target=_ceiling_worker,
                         args=(urls[w::cores], res, batch, resize, gos[w], out), daemon=True)
             for w in range(cores)]
    for p in procs:
        p.start()
    try:
        for epoch in range(epochs):
            for go in gos:
                go.put(epoch)
            done = 0
            while done < cores:
                e, n = out.get()
                if n is None:
                    done += 1
                elif n:
                    yield e, n
    finally:
        for go in gos:
            go.put(None)
        for p in procs:
            p.join(timeout=10)


CONTENDERS = {"ours": run_ours, "wds_dl": run_wds_dl, "wds_dl_pw": run_wds_dl_pw,
              "wds_dl_pw_torch": run_wds_dl_pw_torch,
              "ray_wds": run_ray_wds, "ceiling": run_ceiling,
              "ceiling_par": run_ceiling_par}
#: Ratios printed, with the goal of issue 10 where it sets one.
GOALS = {"wds_dl_pw": {"whole": 1.0, "steady": 1.1}}
#: Goals of issue 29 on total CPU per delivered sample, (contender, reference): at most.
CPU_GOALS = {("ours:actors", "ours:threads"): 1.15}


def check_mode(args: argparse.Namespace, mode: str) -> None:
    """Exit with the config's one-line reason when ``ours:MODE`` names no valid config."""
    from ray_ingest.errors import ConfigError

    try:
        ours_config(args.data, args.res, args.batch, mode)
    except ConfigError as e:
        raise SystemExit(f"--only ours:{mode}: {e}") from None


def contender(name: str) -> Callable[..., Batches]:
    """The run function of ``name``: a key of ``CONTENDERS`` or ``ours:MODE``."""
    base, sep, mode = name.partition(":")
    if base == "ours" and mode:
        return functools.partial(run_ours, compute=mode)
    if sep or base not in CONTENDERS:
        msg = (f"--only: unknown contender {name!r}; expected one of "
               f"{', '.join(CONTENDERS)} or ours:MODE (a decode.compute value, or "
               f"SECTION.FIELD=VALUE items joined by +)")
        raise SystemExit(msg)
    return CONTENDERS[base]


def _cpu_s() -> float:
    """CPU seconds of this process and its ended children (the DataLoader's and
    ``ceiling_par``'s workers end with their run; Ray's own processes are not counted)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def summarize(t0: float, events: list[tuple[int, float, int]], mult: int = 1) -> dict:
    """Figures of one run from ``(epoch, time, samples)`` per batch (times from perf_counter)."""
    total = sum(n for _, _, n in events)
    end = events[-1][1]
    by_epoch: dict[int, list[tuple[float, int]]] = {}
    for e, t, n in events:
        by_epoch.setdefault(e, []).append((t, n))
    gaps = [b[0] - a[0] for ev in by_epoch.values() for a, b in itertools.pairwise(ev)]
    step = statistics.median(gaps) if gaps else 0.0
    steady_n = sum(n for ev in by_epoch.values() for _, n in ev[1:])
    steady_t = sum(ev[-1][0] - ev[0][0] for ev in by_epoch.values())
    epochs = sorted(by_epoch)
    boundary = [by_epoch[b][0][0] - by_epoch[a][-1][0] for a, b in itertools.pairwise(epochs)]
    return {
        "samples": total,
        "whole": total / (end - t0) * mult,
        "steady": steady_n / steady_t * mult if steady_t > 0 else float("nan"),
        "first_batch_s": events[0][1] - t0,
        "wall_s": end - t0,
        "median_step_s": step,
        "boundary_gap_s": boundary,
        "boundary_stall_s": [max(0.0, g - step) for g in boundary],
    }


def print_idle(idle: cpu_roles.Account, when: str) -> None:
    rates = idle.per_second_ms()
    daemons = sum(rates.get(r, 0.0) for r in cpu_roles.RAY_DAEMONS)
    parts = ", ".join(f"{k} {v:.1f}" for k, v in rates.items()
                      if k not in ("total", cpu_roles.ACCOUNTING))
    print(f"idle CPU {when} over {idle.wall_s:.1f} s, Ray up, nothing running (CPU ms per s): "
          f"{parts}; "
          f"Ray's daemons {daemons:.1f} (other processes on the machine: "
          f"{max(0.0, idle.machine_busy_s - sum(idle.roles.values())) / idle.wall_s:.2f} cores)",
          flush=True)


def summarize_cpu(runs: dict[str, list[dict]], names: list[str], ref: str) -> dict:
    """Print the per-role table of CPU per delivered sample and the ratios to ``ref``."""
    cpu = cpu_roles.compare(runs, ref)
    med = {n: cpu["ms_per_sample"][n] for n in names if n in cpu["ms_per_sample"]}
    if not med:
        return cpu
    print("\nCPU per delivered sample by process role (medians of the runs; trainer = this "
          "process, the sampler's own thread apart):")
    print("\n".join(cpu_roles.format_table(med)))
    threads = {n: cpu["trainer_threads"][n] for n in names if n in cpu["trainer_threads"]}
    if threads:
        print("  the trainer's CPU by thread:")
        print("\n".join(cpu_roles.format_table(threads)))
    for n, r in cpu["ratio"].items():
        if r is None:
            continue
        goal = CPU_GOALS.get((n, ref))
        per = ", ".join(f"{x:.2f}" for x in cpu["per_run_ratios"][n])
        note = f" (goal <= {goal}x)" if goal else ""
        print(f"  CPU/sample {n} / {ref} = {r:.2f}x{note}; per run {per}")
    return cpu


def _idle_json(idle: cpu_roles.Account | None) -> dict | None:
    return None if idle is None else {"account": idle.to_dict(), "ms_per_s": idle.per_second_ms()}


def add_data_args(p: argparse.ArgumentParser, data: str, samples: int, epochs: int,
                  cores_help: str) -> None:
    """The dataset and run-shape flags every benchmark of this family takes."""
    p.add_argument("--data", default=data,
                   help="dataset folder (synthesized when it has no wdinfo.json, else reused)")
    p.add_argument("--samples", type=int, default=samples)
    p.add_argument("--shard-size", type=int, default=100)
    p.add_argument("--min-side", type=int, default=512)
    p.add_argument("--max-side", type=int, default=768)
    p.add_argument("--aspect-ratios", default=None,
                   help="W:H list the synthesized images draw from (default: PiD's buckets)")
    p.add_argument("--photo", action="store_true",
                   help="synthesize photo-like images (smooth colour fields and texture: "
                        "~3 MB per 3840x2160 JPEG) instead of gradients and noise blocks")
    p.add_argument("--res", type=int, default=224, help="output side (center crop)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=epochs, help="epochs per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help=cores_help)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/throughput.py", description=__doc__.splitlines()[0])
    add_data_args(p, "/tmp/ray_ingest_bench_tp", 9600, 3,
                  "DataLoader workers / ceiling multiplier")
    p.add_argument("--only", default=",".join(CONTENDERS))
    p.add_argument("--baseline-resize", choices=sorted(BASELINE_RESIZE), default="whole",
                   help="the baselines' resize: whole image then crop (default, as their users "
                        "write it) or ours, resampling only the kept pixels (same bytes)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--block-rows", type=int, default=None,
                   help="ours: loader.block_rows (default: the config default)")
    p.add_argument("--pool", type=int, default=None,
                   help="ours: decode actors, min = max (default: the config default)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="ours: a config override (YAML value), e.g. loader.fused_read=true")
    p.add_argument("--cpu-interval", type=float, default=0.2,
                   help="seconds between /proc samples of every process's CPU (0: off)")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="quiet seconds to measure Ray's idle CPU before and after the runs "
                        "(0: skip)")
    p.add_argument("--idle-settle-s", type=float, default=3.0,
                   help="wait before each idle measurement (workers Ray prestarts, and the "
                        "last run's, finish starting or ending)")
    p.add_argument("--cpu-ref", default="ours:threads",
                   help="contender the others' CPU per sample is divided by")
    p.add_argument("--gap-s", type=float, default=1.0,
                   help="pause between runs, so the last run's decode workers are gone")
    return p


def apply_sets(items: list[str]) -> None:
    """``--set SECTION.FIELD=VALUE`` (YAML values) into ``OURS``."""
    import yaml

    for item in items:
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        if section not in OURS or not field:
            raise SystemExit(f"--set {item!r}: expected decode.FIELD=VALUE or loader.FIELD=VALUE")
        OURS[section][field] = yaml.safe_load(value)


def ensure_dataset(args: argparse.Namespace) -> None:
    """Synthesize ``args.data`` unless it holds a dataset (reused as it is otherwise)."""
    from ray_ingest.tools.synth import parse_aspect_ratios, synth_dataset

    if not os.path.exists(os.path.join(args.data, "wdinfo.json")):
        extra = {}
        if getattr(args, "aspect_ratios", None):
            extra["aspect_ratios"] = parse_aspect_ratios(args.aspect_ratios)
        synth_dataset(args.data, samples=args.samples, shard_size=args.shard_size, seed=0,
                      min_side=args.min_side, max_side=args.max_side, overwrite=True,
                      image_style="photo" if getattr(args, "photo", False) else "blocks",
                      num_workers=os.cpu_count() or 1, **extra)


def uses_ray_data(names: list[str]) -> bool:
    """Whether a contender runs on Ray Data (``ray_wds``, ``loader.fused_read=false``)."""
    return any(n == "ray_wds" or "fused_read=false" in n.lower() for n in names)


def start_ray(warm: bool = False):
    """A private local Ray as the job's driver starts it (quiet; with ``warm``, Ray Data's
    cluster actors started now, as the job does on the Ray Data path)."""
    import ray
    import ray.data

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    if warm:
        from ray_ingest.execution.raydata import warm_up

        warm_up()  # as ray_ingest.train.job._start_ray does with loader.fused_read: false
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.verbose_progress = False
    return ray


def _run_one(args: argparse.Namespace, r: int, name: str, runner: Callable) -> dict:
    """One run of one contender: its summary (and its CPU by process role), printed."""
    mult = args.cores if name == "ceiling" else 1
    time.sleep(args.gap_s)
    sampler = (cpu_roles.Sampler(interval=args.cpu_interval).start()
               if args.cpu_interval > 0 else None)
    cpu0 = _cpu_s()
    t0 = time.perf_counter()
    events = [(e, time.perf_counter(), k) for e, k in
              runner(args.data, args.res, args.batch, args.cores, args.epochs)]
    s = summarize(t0, events, mult)
    s["cpu_s"] = _cpu_s() - cpu0
    if sampler is not None:
        s["cpu_roles"] = sampler.stop().to_dict()
    stalls = " ".join(f"{x:.2f}" for x in s["boundary_stall_s"])
    print(f"run {r} {name:9s} {s['samples']} samples in {s['wall_s']:6.2f} s: whole "
          f"{s['whole']:7.1f}/s steady {s['steady']:7.1f}/s first batch "
          f"{s['first_batch_s']:5.2f} s boundary stalls [{stalls}] s; CPU "
          f"{s['cpu_s'] / s['samples'] * 1e3:.2f} ms/sample, "
          f"{s['cpu_s'] / s['wall_s']:.2f} cores busy", flush=True)
    if sampler is not None:
        print("      " + cpu_roles.run_line(s["cpu_roles"], s["samples"]), flush=True)
    return s


def main(argv: list[str] | None = None) -> int:
    from ray_ingest.train.auth import secure_local_ray

    secure_local_ray()  # its local Ray runs with token authentication
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    BASELINE["resize"] = BASELINE_RESIZE[args.baseline_resize]
    if args.block_rows:
        OURS["loader"]["block_rows"] = args.block_rows
    if args.pool:
        OURS["decode"].update(pool_min=args.pool, pool_max=args.pool)
    apply_sets(args.set)
    ensure_dataset(args)
    names = [n for n in args.only.split(",") if n]
    ray = start_ray(uses_ray_data(names))
    runners = {n: contender(n) for n in names}
    for n in names:  # a bad ours:MODE fails now, not after the other contenders' runs
        if n.startswith("ours:"):
            check_mode(args, n.partition(":")[2])
    idle = None
    if args.idle_s > 0:
        idle = cpu_roles.measure_idle(args.idle_s, settle_s=args.idle_settle_s)
        print_idle(idle, "before the runs")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.runs):
        for name in names:
            runs[name].append(_run_one(args, r, name, runners[name]))
    idle_after = None
    if args.idle_s > 0:
        idle_after = cpu_roles.measure_idle(args.idle_s, settle_s=args.idle_settle_s)
        print_idle(idle_after, "after the runs")
    med = {n: {k: statistics.median(run[k] for run in v) for k in ("whole", "steady",
                                                                    "first_batch_s")}
           for n, v in runs.items()}
    for n, v in runs.items():
        per = list(zip(*(run["boundary_stall_s"] for run in v), strict=True))
        med[n]["boundary_stall_s"] = [statistics.median(x) for x in per]
    print(f"\nmedians of {args.runs} interleaved runs, {args.epochs} epochs "
          f"(ceiling = 1-process rate x cores; baselines resize: {args.baseline_resize}):")
    w = max(10, *map(len, names))
    print(f"  {'contender':{w}s} {'whole':>8s} {'steady':>8s} {'1st batch':>10s}  boundary stalls")
    for n in names:
        m = med[n]
        stalls = ", ".join(f"{x:.2f}" for x in m["boundary_stall_s"])
        print(f"  {n:{w}s} {m['whole']:8.1f} {m['steady']:8.1f} {m['first_batch_s']:9.2f}s  "
              f"[{stalls}] s")
    ours_names = [n for n in names if n == "ours" or n.startswith("ours:")]
    for o in ours_names:
        for n in names:
            if n in ours_names:
                continue
            goal = GOALS.get(n, {})
            wr, s = med[o]["whole"] / med[n]["whole"], med[o]["steady"] / med[n]["steady"]
            note = (f" (goal whole >= {goal['whole']}x, steady >= {goal['steady']}x)"
                    if goal else "")
            print(f"  {o} / {n:9s} = {wr:.2f}x whole run, {s:.2f}x steady state{note}")
    cpu = summarize_cpu(runs, names, args.cpu_ref) if args.cpu_interval > 0 else None
    if ours_names and LAST_LOADER:
        loader = LAST_LOADER[0]
        print(f"\nours, last run: stages {json.dumps(loader.metrics(), default=str)}")
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"medians": med, "runs": runs, "args": vars(args), "cpu": cpu,
                       "idle": _idle_json(idle), "idle_after": _idle_json(idle_after)},
                      f, indent=2)
    ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
