"""Train-step time with each decode mode, against the same loop on pre-decoded batches.

    .venv/bin/python bench/train_step.py [--samples 4800] [--epochs 2] [--runs 3]
        [--only predecoded,ours:threads,ours:tasks,ours:actors,wds_dl_pw]
        [--torch-threads 1] [--width 16] [--depth 3]

Loader throughput alone is the wrong figure: Meta's SPDL measured decode threads inside the
trainer's process slowing GPU training from 2.4 to 1.2 batches/s while the loader alone looked
faster. Here every contender feeds the same training loop, whose step does real compute (a
small conv net, forward + backward + SGD, ``torch.set_num_threads(--torch-threads)``) on the
uint8 batch turned into floats:
  predecoded   the batches of one epoch of ours, decoded once up front and kept in memory,
               replayed every epoch: the step's time with no loader running
  ours:MODE    IngestLoader with ``decode.compute: MODE`` (``threads``, ``tasks``, ``actors``,
               or any other mode the config accepts; ``SECTION.FIELD=VALUE`` items joined by
               ``+`` for other variants, as in bench/throughput.py); ``ours`` is the default
  wds_dl_pw    webdataset tar iterators in a torch DataLoader with ``--cores`` persistent
               workers (``wds_dl``: started afresh every epoch), as in bench/throughput.py
Per contender (medians of ``--runs`` interleaved runs, the first ``--warmup-steps`` steps of a
run left out of the per-step figures): the step time measured around the step only, the
data-wait per step (the time the loop waited for its next batch), samples/s, and the step-time
inflation over pre-decoded data (ratio of the median step times; per run against the same
repetition's pre-decoded run too). The CPU of every process by role is sampled as in
bench/throughput.py (ray_ingest/tools/cpu_roles.py). Size the net (``--width``, ``--depth``) so a
step takes about as long as decoding a batch does on the cores (the start-up line prints both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ray_ingest.tools import benchmark as tb
from ray_ingest.tools import cpu_roles

#: One delivered batch: (epoch, uint8 images (B, H, W, 3) tensor, samples that are not padding).
Item = tuple[int, Any, int]
#: One step of a run: (epoch, data-wait s, step s, samples).
Step = tuple[int, float, float, int]
PREDECODED = "predecoded"
DEFAULT_ONLY = "predecoded,ours:threads,ours:tasks,ours:actors,wds_dl_pw"


# --- the model and its step -----------------------------------------------------------------
def build_net(width: int, depth: int, classes: int):
    """``depth`` stride-2 3x3 convolutions of ``width`` channels, ReLU, pooled, linear."""
    import torch.nn as nn

    layers: list[nn.Module] = []
    c = 3
    for _ in range(depth):
        layers += [nn.Conv2d(c, width, 3, stride=2, padding=1), nn.ReLU(inplace=True)]
        c = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers)


def make_step(width: int, depth: int, classes: int, lr: float, seed: int,
              device: str = "cpu") -> Callable[[Any], float]:
    """A fresh net (seeded) and its train step on a uint8 (B, H, W, 3) batch: on ``device``
    (the host-to-device copy is part of the step), floats in [0, 1], forward, cross-entropy
    against fixed labels (``row % classes``), backward, SGD; ``loss.item()`` waits for the
    device, so the step's time is the device's too."""
    import torch

    torch.manual_seed(seed)
    net = build_net(width, depth, classes).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images) -> float:
        x = images.to(device).permute(0, 3, 1, 2).float().div_(255)
        y = torch.arange(x.shape[0], device=device) % classes
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def run_loop(items: Iterable[Item], step: Callable[[Any], float]
             ) -> tuple[float, list[Step]]:
    """Train on ``items``: (wall seconds from the start, including the loader's start-up,
    to the last step's end; per step (epoch, data-wait, step time, samples))."""
    out: list[Step] = []
    t_start = time.perf_counter()
    it = iter(items)
    while True:
        t0 = time.perf_counter()
        try:
            epoch, images, n = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        step(images)
        out.append((epoch, t1 - t0, time.perf_counter() - t1, n))
    return time.perf_counter() - t_start, out


# --- arithmetic (no torch) ------------------------------------------------------------------
def summarize_steps(steps: Sequence[Step], wall_s: float, warmup: int) -> dict[str, float]:
    """Figures of one run; the per-step ones leave out the first ``warmup`` steps (start-up,
    allocator warm-up) unless the run has no more than that.

    Returns: ``step_ms`` (median), ``step_p90_ms``, ``wait_ms`` (median data-wait per step),
    ``wait_mean_ms`` (mean: stalls count), ``wait_share`` (of the loop's time after warm-up),
    ``per_step_ms`` (mean step + wait after warm-up: the loop's pace), ``samples_s`` (every
    sample over the whole wall time, start-up included), ``steady_samples_s`` (after warm-up),
    ``first_wait_s``, ``steps``, ``samples``, ``wall_s``.
    """
    if not steps:
        msg = "summarize_steps: the run delivered no batch"
        raise ValueError(msg)
    kept = list(steps[warmup:]) if len(steps) > warmup else list(steps)
    waits = [w for _, w, _, _ in kept]
    times = sorted(s for _, _, s, _ in kept)
    busy = sum(waits) + sum(times)
    n_kept = sum(n for *_, n in kept)
    return {
        "step_ms": statistics.median(times) * 1e3,
        "step_p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))] * 1e3,
        "wait_ms": statistics.median(waits) * 1e3,
        "wait_mean_ms": statistics.fmean(waits) * 1e3,
        "wait_share": sum(waits) / busy if busy > 0 else 0.0,
        "per_step_ms": busy / len(kept) * 1e3,
        "samples_s": sum(n for *_, n in steps) / wall_s if wall_s > 0 else float("nan"),
        "steady_samples_s": n_kept / busy if busy > 0 else float("nan"),
        "first_wait_s": steps[0][1],
        "steps": len(steps),
        "samples": sum(n for *_, n in steps),
        "wall_s": wall_s,
    }


MEDIAN_KEYS = ("step_ms", "step_p90_ms", "wait_ms", "wait_mean_ms", "wait_share", "per_step_ms",
               "samples_s", "steady_samples_s", "first_wait_s")


def compare_steps(runs: Mapping[str, Sequence[Mapping[str, float]]], ref: str = PREDECODED
                  ) -> dict[str, dict[str, Any]]:
    """Medians per contender over its runs, and against ``ref`` (when it ran):
    ``inflation`` (median step time / ``ref``'s), ``per_run_inflation`` (each run's median
    step over the same repetition's ``ref`` run) and ``pace`` (median step + wait per step /
    ``ref``'s: how much slower training goes, data-wait included)."""
    out: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        if rs:
            out[name] = {k: statistics.median(r[k] for r in rs) for k in MEDIAN_KEYS}
    base = out.get(ref)
    for name, m in out.items():
        if base is None:
            break
        m["inflation"] = m["step_ms"] / base["step_ms"]
        m["pace"] = m["per_step_ms"] / base["per_step_ms"]
        m["per_run_inflation"] = [r["step_ms"] / b["step_ms"] for r, b in
                                  zip(runs[name], runs[ref], strict=False)]
    return out


def format_steps(med: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The summary table: one line per contender."""
    w = max(13, *map(len, med)) if med else 13
    lines = [f"  {'contender':{w}s} {'step ms':>8s} {'p90':>7s} {'wait ms':>8s} {'mean':>7s} "
             f"{'wait %':>6s} {'samples/s':>9s} {'steady':>7s} {'inflation':>9s} {'pace':>6s}"]
    for name, m in med.items():
        infl = f"{m['inflation']:8.2f}x" if "inflation" in m else f"{'-':>9s}"
        pace = f"{m['pace']:5.2f}x" if "pace" in m else f"{'-':>6s}"
        lines.append(f"  {name:{w}s} {m['step_ms']:8.1f} {m['step_p90_ms']:7.1f} "
                     f"{m['wait_ms']:8.1f} {m['wait_mean_ms']:7.1f} {m['wait_share'] * 100:5.1f}% "
                     f"{m['samples_s']:9.1f} {m['steady_samples_s']:7.1f} {infl} {pace}")
    return lines


# --- contenders -----------------------------------------------------------------------------
def predecode(args: argparse.Namespace) -> tuple[list[tuple[Any, int]], float, float]:
    """One epoch of ours (``decode.compute: threads``), kept: (batches, wall s, CPU-s of this
    process, which decoded them)."""
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology

    cfg = tb.ours_config(args.data, args.res, args.batch, "threads")
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=cfg.loader.read_workers))
    cpu0, t0 = _own_cpu_s(), time.perf_counter()
    kept = [(b[cfg.decode.image_modality].clone(), sum(1 for p in b.pads if not p))
            for _, batches in loader.epochs(1) for b in batches]
    return kept, time.perf_counter() - t0, _own_cpu_s() - cpu0


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def items_predecoded(batches: list[tuple[Any, int]], epochs: int) -> Iterator[Item]:
    for epoch in range(epochs):
        for images, n in batches:
            yield epoch, images, n


def items_ours(args: argparse.Namespace, compute: str | None) -> Iterator[Item]:
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology

    cfg = tb.ours_config(args.data, args.res, args.batch, compute)
    gpu = cfg.decode.device == "cuda"  # decoded on the step's device: batches arrive there
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=cfg.loader.read_workers),
                          device=args.device if gpu else None)
    tb.LAST_LOADER[:] = [loader]
    key = cfg.decode.image_modality
    for epoch, batches in loader.epochs(args.epochs):
        for b in batches:
            yield epoch, b[key], sum(1 for p in b.pads if not p)


def items_dataloader(args: argparse.Namespace, persistent: bool) -> Iterator[Item]:
    import torch.utils.data as tud

    pairs = list(zip(tb.shard_urls(args.data, "image"), tb.shard_urls(args.data, "caption"),
                     strict=True))
    dl = tud.DataLoader(tb._TwinWds(pairs, args.res, tb.BASELINE["resize"]),
                        batch_size=args.batch, num_workers=args.cores,
                        persistent_workers=persistent, prefetch_factor=4)
    with tb.gc_frozen():
        for epoch in range(args.epochs):
            for images, _caps in dl:
                yield epoch, images, len(images)


def contender_items(name: str, args: argparse.Namespace,
                    batches: list[tuple[Any, int]] | None) -> Iterator[Item]:
    """The batches ``name`` delivers (see the module's docstring for the names)."""
    base, sep, mode = name.partition(":")
    if name == PREDECODED and batches is not None:
        return items_predecoded(batches, args.epochs)
    if base == "ours":
        return items_ours(args, mode or None)
    if name in ("wds_dl_pw", "wds_dl"):
        return items_dataloader(args, persistent=name == "wds_dl_pw")
    msg = (f"--only: unknown contender {name!r}; expected {PREDECODED}, ours, ours:MODE "
           f"(a decode.compute value or SECTION.FIELD=VALUE items joined by +), wds_dl_pw "
           f"or wds_dl")
    raise SystemExit(msg)


# --- the sitting ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/train_step.py", description=__doc__.splitlines()[0])
    tb.add_data_args(p, "/tmp/ray_ingest_bench_train", 4800, 2, "DataLoader workers")
    p.add_argument("--only", default=DEFAULT_ONLY,
                   help="comma list: predecoded, ours, ours:MODE (decode.compute, or "
                        "SECTION.FIELD=VALUE items joined by +), wds_dl_pw, "
                        "wds_dl")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch.set_num_threads in the trainer (the step's cores)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the step (cuda: the batch is copied there in the step)")
    p.add_argument("--width", type=int, default=16, help="channels of each conv layer")
    p.add_argument("--depth", type=int, default=3, help="stride-2 conv layers")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed of every run's net")
    p.add_argument("--warmup-steps", type=int, default=5,
                   help="first steps of a run left out of the per-step figures")
    p.add_argument("--baseline-resize", choices=sorted(tb.BASELINE_RESIZE), default="whole",
                   help="the DataLoader's resize (as in bench/throughput.py)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="ours: a config override (YAML value), e.g. decode.threads=2")
    p.add_argument("--cpu-interval", type=float, default=0.2,
                   help="seconds between /proc samples of every process's CPU (0: off)")
    p.add_argument("--cpu-ref", default="ours:threads",
                   help="contender the others' CPU per sample is divided by")
    p.add_argument("--gap-s", type=float, default=1.0,
                   help="pause between runs, so the last run's decode workers are gone")
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    tb.BASELINE["resize"] = tb.BASELINE_RESIZE[args.baseline_resize]
    tb.apply_sets(args.set)
    names = [n for n in args.only.split(",") if n]
    for n in names:  # fail on a bad name or mode now, not after the other runs
        contender_items(n, args, [])
        if n.startswith("ours:"):
            tb.check_mode(args, n.partition(":")[2])
    import torch

    torch.set_num_threads(args.torch_threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)
    tb.ensure_dataset(args)
    ray = tb.start_ray(tb.uses_ray_data(names))
    batches = None
    if PREDECODED in names:
        batches, wall, cpu = predecode(args)
        mib = sum(b.numel() for b, _ in batches) / 2**20
        print(f"pre-decoded {len(batches)} batches ({mib:.0f} MiB) in {wall:.1f} s; decode "
              f"{cpu / len(batches) * 1e3:.0f} ms CPU per batch in this process (threads), "
              f"~{cpu / len(batches) / args.cores * 1e3:.0f} ms a batch on {args.cores} cores",
              flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.runs):
        for name in names:
            time.sleep(args.gap_s)
            step = make_step(args.width, args.depth, args.classes, args.lr, args.seed,
                             args.device)
            sampler = (cpu_roles.Sampler(interval=args.cpu_interval).start()
                       if args.cpu_interval > 0 else None)
            wall, steps = run_loop(contender_items(name, args, batches), step)
            s = summarize_steps(steps, wall, args.warmup_steps)
            if sampler is not None:
                s["cpu_roles"] = sampler.stop().to_dict()
            runs[name].append(s)
            print(f"run {r} {name:13s} {s['samples']} samples in {wall:6.2f} s: step "
                  f"{s['step_ms']:.1f} ms (p90 {s['step_p90_ms']:.1f}), data-wait "
                  f"{s['wait_ms']:.1f} ms median / {s['wait_mean_ms']:.1f} mean per step, "
                  f"{s['samples_s']:.1f} samples/s (steady {s['steady_samples_s']:.1f})",
                  flush=True)
            if sampler is not None:
                print("      " + cpu_roles.run_line(s["cpu_roles"], s["samples"]), flush=True)
            gpu = tb.LAST_LOADER[0].metrics().get("device_decode") if (
                tb.LAST_LOADER and name.startswith("ours")) else None
            if gpu:
                s["device_decode"] = gpu
                print(f"      GPU decode: {json.dumps(gpu)}", flush=True)
    med = compare_steps(runs)
    print(f"\nmedians of {args.runs} interleaved runs on {args.device}, {args.epochs} epochs, "
          f"net width "
          f"{args.width} depth {args.depth}, torch threads {args.torch_threads}, batch "
          f"{args.batch} (inflation: median step time / {PREDECODED}'s; pace: step + "
          f"data-wait per step / {PREDECODED}'s):")
    print("\n".join(format_steps(med)))
    for n, m in med.items():
        if "per_run_inflation" in m and n != PREDECODED:
            per = ", ".join(f"{x:.2f}" for x in m["per_run_inflation"])
            print(f"  {n}: step inflation per run {per}")
    cpu = None
    if args.cpu_interval > 0:
        cpu = cpu_roles.compare(runs, args.cpu_ref)
        table = {n: cpu["ms_per_sample"][n] for n in names if n in cpu["ms_per_sample"]}
        print("\nCPU per delivered sample by process role (medians; the step's compute is in "
              "the trainer):")
        print("\n".join(cpu_roles.format_table(table)))
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"medians": med, "runs": runs, "cpu": cpu, "args": vars(args)}, f,
                      indent=2)
    ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
