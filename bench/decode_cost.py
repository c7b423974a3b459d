"""Per-sample decode cost of the Decoder (JPEG decode + resize/crop) on one core, by resolution.

The figure behind decode sizing (docs/operations.md "Sizing the decode pool"): decode CPUs for a
target rate R samples/s are ``R × cost_s``, per GPU ``R_gpu × cost_s``. Runs the real
:class:`ray_ingest.decode.decoder.Decoder` in this process (no Ray), on synthetic JPEGs
(``ray_ingest.tools.synth.make_image``: gradients plus noise blocks, quality 90; natural photos of
the same size usually cost more to entropy-decode, so treat the figures as a lower bound). The
``Image.open`` column is the same Decoder decoding JPEGs with Pillow (``Image.open`` + draft)
instead of simplejpeg (``ray_ingest.decode.jpeg``); ``whole`` also resizes the whole image
before it crops (the textbook transform, ``augment.resize_then_crop``). All three give the
same bytes.

    .venv/bin/python bench/decode_cost.py [--images 8] [--repetitions 3] [--flip]

``--flip``: random crops and ``decode.flip`` on (about half the samples flipped), to time the
flip's share of a sample (compare two commits' runs).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import numpy as np

from ray_ingest.config import DecodeConfig
from ray_ingest.decode import (
    augment,
    jpeg,
)
from ray_ingest.decode.decoder import Decoder
from ray_ingest.tools.synth import (
    SampleSpec,
    make_image,
)
from ray_ingest.twintar.twin import ext_column

#: Timed paths, interleaved: the Decoder as configured (simplejpeg through
#: ray_ingest.decode.jpeg, kept-pixel resize); JPEGs through ``Image.open`` instead; and the
#: textbook path (``Image.open``, whole resize, then crop).
MODES = ("default", "Image.open", "whole")
#: (label, source width, source height, resolution, bucket): output = bucket shape at area res².
CASES = (
    ("512x384 -> 256x256", 512, 384, 256, None),
    ("1920x1080 -> 1024x1024", 1920, 1080, 1024, None),
    ("1920x1080 -> 16:9 at res 1024 (1368x768)", 1920, 1080, 1024, "16:9"),
    ("3840x2160 -> 16:9 at res 2880 (3840x2160)", 3840, 2160, 2880, "16:9"),
    ("3840x2160 -> 16:9 at res 3840 (5120x2880)", 3840, 2160, 3840, "16:9"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=8, help="distinct images per case")
    p.add_argument("--repetitions", type=int, default=3, help="timed passes (median kept)")
    p.add_argument("--flip", action="store_true", help="random crops, decode.flip on")
    args = p.parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    for label, w, h, res, bucket in CASES:
        images = [make_image(SampleSpec(f"s{i}", i, w, h, (16, 9), 0), seed=i)
                  for i in range(args.images)]
        cfg = DecodeConfig(resolution=res, buckets=(bucket,) if bucket else (),
                           caption_modality=None,
                           max_image_pixels=10**9,
                           **({"crop": "random", "flip": True} if args.flip else {}))
        dec = Decoder(cfg)
        rows = [{"image": data, ext_column("image"): "jpg", "__sid__": 0, "__index__": i,
                 "__bucket__": bucket.replace(":", "_") if bucket else ""}
                for i, data in enumerate(images)]
        dec.decode_row(rows[0])  # warm-up
        augment.pass_order()
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for rep in range(args.repetitions):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                real_order, real_jpeg = augment.pass_order, jpeg.decode
                if mode != "default":  # JPEGs through Image.open
                    jpeg.decode = lambda *a: None
                if mode == "whole":  # the textbook path: resize the whole image, then crop
                    augment.pass_order = lambda: None
                try:
                    t0 = time.perf_counter()
                    for row in rows:
                        out = dec.decode_row(row)
                    times[mode].append((time.perf_counter() - t0) / len(rows))
                finally:
                    augment.pass_order, jpeg.decode = real_order, real_jpeg
        cost, opened, whole = (statistics.median(times[mode]) for mode in MODES)
        shape = out["image"].shape
        print(f"{label:45s} out {shape[1]}x{shape[0]}  {cost * 1000:7.1f} ms/sample  "
              f"{1 / cost:7.1f} samples/s/core  Image.open {opened * 1000:7.1f} ms "
              f"({cost / opened:.2f}x)  whole {whole * 1000:7.1f} ms ({cost / whole:.2f}x)"
              f"  jpeg {np.mean([len(x) for x in images]) / 1024:.0f} KiB"
              f"  decoded {shape[0] * shape[1] * 3 / 1024**2:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
