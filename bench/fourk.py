"""4K on the Ray path: photo-like 3840x2160 and 5120x2880 JPEGs, ours against the DataLoader.

    .venv/bin/python bench/fourk.py [--sizes 3840x2160,5120x2880] [--res 2048] [--runs 3]
        [--epochs 2] [--batch 4] [--samples 96] [--only ours:actors,ours:process,wds_dl_pw]
        [--buckets] [--json-out F]

Per source size, one sitting of ``bench/throughput.py`` (:mod:`ray_ingest.tools.benchmark`) on a
synthesized photo-like dataset (``synth --image-style photo``: ~2.5 MB per 3840x2160 JPEG at
quality 90), output ``--res`` (a square center crop, or with ``--buckets`` PiD's aspect
buckets at base ``--res``): samples/s per contender (medians of interleaved runs, ratios to
the persistent-worker DataLoader decoding with Pillow), CPU ms per sample and peak RSS per
process kind. Then the object-store bytes one sample costs: a block decoded on the CPU and the
same block with ``decode.device: cuda`` (JPEG bytes and placements), ``ray.put`` and sized by
Ray (``ray.experimental.get_object_locations``), against the JPEGs' size; and the CPU decode
cost per sample, simplejpeg against Pillow's decoder, Pillow's resize (kept pixels, and the
textbook resize-then-crop), torch's antialiased resize (the alternatives measured before
choosing), and the whole Decoder's CPU per sample with freed memory kept (the default,
ray_ingest.decode.memory) and with glibc's own behaviour, each in a fresh process.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from ray_ingest.tools import benchmark  # noqa: E402

BUCKETS = ("16:9", "3:2", "4:3", "1:1", "3:4", "2:3", "9:16")


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.partition("x")
    return int(w), int(h)


def dataset_args(args: argparse.Namespace, w: int, h: int) -> list[str]:
    """``bench/throughput.py`` flags for one source size (its dataset under /tmp, reused)."""
    g = np.gcd(w, h)
    data = f"/tmp/ray_ingest_bench_4k_{w}x{h}_{args.samples}"
    return ["--data", data, "--samples", str(args.samples), "--shard-size", "8",
            "--min-side", str(max(w, h)), "--max-side", str(max(w, h)),
            "--aspect-ratios", f"{w // g}:{h // g}", "--photo", "--res", str(args.res),
            "--batch", str(args.batch), "--epochs", str(args.epochs), "--runs", str(args.runs),
            "--only", args.only, "--idle-s", "0", "--cpu-ref", "wds_dl_pw"]


def object_store_bytes(data: str, res: int, buckets: bool, n: int = 8) -> dict[str, float]:
    """Bytes per sample in the object store: a block decoded on the CPU, and with
    ``decode.device: cuda`` (what travels to the trainer), against the JPEGs' own size."""
    import ray

    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.config import config_from_dict
    from ray_ingest.execution.local import ItemDecoder
    from ray_ingest.plan.epoch import ReadItem

    catalog = load_catalog([data])
    out: dict[str, float] = {}
    for device in ("cpu", "cuda"):
        cfg = config_from_dict({
            "data": {"paths": [data]},
            "decode": {"resolution": res, "device": device,
                       **({"buckets": list(BUCKETS)} if buckets else {})},
            "loader": {"block_rows": n}, "train": {"use_gpu": True}})
        dec = ItemDecoder(cfg)
        shard = catalog.shard(0)
        blocks = dec(shard, ReadItem(0, 0, 0, min(n, shard.count)))
        rows = sum(len(b["__key__"]) for b in blocks)
        refs = [ray.put(b) for b in blocks]
        sizes = ray.experimental.get_object_locations(refs)
        out[device] = sum(sizes[r]["object_size"] for r in refs) / rows
        if device == "cuda":
            out["jpeg"] = float(np.mean([len(v) for b in blocks for v in b["image"]
                                         if isinstance(v, bytes)]))
    out["cuda_over_jpeg"] = out["cuda"] / out["jpeg"]
    out["cpu_over_cuda"] = out["cpu"] / out["cuda"]
    return out


def decode_costs(data: str, res: int, reps: int = 3) -> dict[str, float]:
    """ms per sample on one core: simplejpeg vs Pillow's decoder, and the resizes tried."""
    from PIL import Image

    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.config import config_from_dict
    from ray_ingest.decode import jpeg
    from ray_ingest.decode.augment import render, resize_then_crop
    from ray_ingest.decode.geometry import Geometry, place
    from ray_ingest.twintar.reader import read_options, read_shard

    catalog = load_catalog([data])
    opts = read_options(config_from_dict({"data": {"paths": [data]}}))
    rows = read_shard(catalog.shard(0), opts=opts)
    datas = [next(rows)["image"] for _ in range(min(4, catalog.shard(0).count))]
    geom = Geometry(res, res)

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for d in datas:
                fn(d)
            times.append((time.perf_counter() - t0) / len(datas))
        return 1e3 * statistics.median(times)

    def pil_decode(d):
        img = Image.open(io.BytesIO(d))
        img.load()
        return img

    out = {"simplejpeg_decode_ms": timed(lambda d: jpeg.decode(d, jpeg.header(d), 1, None)),
           "pillow_decode_ms": timed(pil_decode)}
    img = pil_decode(datas[0])
    p = place(img.size, geom, None, scalable=False)
    out["pillow_resize_kept_ms"] = timed(lambda d: render(img, p))
    out["pillow_resize_then_crop_ms"] = timed(lambda d: resize_then_crop(img, geom))
    # decode.resizer: torch, the uint8 kernel on the decoded HWC memory (channels-last: its
    # vectorized path; a float32 NCHW copy, measured here before, took 186-256 ms)
    from ray_ingest.decode.resize_torch import render_torch

    arr = np.asarray(img)
    out["torch_uint8_resize_then_crop_ms"] = timed(lambda d: render_torch(arr, p))
    return out


_DECODER_CPU = """
import statistics, sys, time
from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.execution.local import ItemDecoder
from ray_ingest.plan.epoch import ReadItem
data, res = sys.argv[1], int(sys.argv[2])
dec = ItemDecoder(config_from_dict({"data": {"paths": [data]}, "decode": {"resolution": res},
                                    "loader": {"block_rows": 4}}))
cat = load_catalog([data])
blocks = [b for i in range(2) for b in dec.read_columns(cat.shard(i), ReadItem(0, i, 0, 8))]
n = sum(len(b["__key__"]) for b in blocks)
ts = []
for _ in range(3):
    t0 = time.thread_time()
    for b in blocks:
        dec.decoder(b)
    ts.append((time.thread_time() - t0) / n * 1e3)
print(statistics.median(ts))
"""


def decoder_cpu(data: str, res: int) -> dict[str, float]:
    """The Decoder's CPU ms per sample in a fresh process, freed memory kept (the default)
    and not (``RAY_INGEST_KEEP_FREED_MEMORY=0``)."""
    import subprocess

    out = {}
    for name, keep in (("decoder_keep_freed_memory_ms", "1"), ("decoder_glibc_default_ms", "0")):
        env = {**os.environ, "RAY_INGEST_KEEP_FREED_MEMORY": keep}
        res_ = subprocess.run([sys.executable, "-c", _DECODER_CPU, data, str(res)], env=env,
                              capture_output=True, text=True, check=True)
        out[name] = float(res_.stdout.split()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="3840x2160,5120x2880")
    p.add_argument("--res", type=int, default=2048)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", default="ours:actors,ours:process,wds_dl_pw")
    p.add_argument("--buckets", action="store_true", help="PiD's aspect buckets at --res")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]), flush=True)
    report: dict[str, dict] = {}
    for size in args.sizes.split(","):
        w, h = _size(size)
        flags = dataset_args(args, w, h)
        if args.buckets:
            flags += ["--set", f"decode.buckets={json.dumps(list(BUCKETS))}"]
        jpath = f"/tmp/ray_ingest_bench_4k_{w}x{h}.json"
        data = flags[1]
        print(f"\n=== {w}x{h} -> {args.res} ({'buckets' if args.buckets else 'square'}), "
              f"{args.samples} samples x {args.epochs} epochs, batch {args.batch}", flush=True)
        if args.skip_throughput:
            benchmark.ensure_dataset(benchmark.build_parser().parse_args(flags))
            entry: dict = {}
        else:
            benchmark.main([*flags, "--json-out", jpath])
            with open(jpath) as f:
                entry = {"throughput": json.load(f)["medians"]}
        import ray

        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            entry["object_store"] = object_store_bytes(data, args.res, args.buckets)
        finally:
            ray.shutdown()
        entry["decode_costs"] = {**decode_costs(data, args.res), **decoder_cpu(data, args.res)}
        print(f"object store bytes per sample: {json.dumps(entry['object_store'])}")
        print(f"decode costs (ms per sample, one core): {json.dumps(entry['decode_costs'])}",
              flush=True)
        report[size] = entry
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
