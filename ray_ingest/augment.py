"""Image geometry: aspect-ratio buckets, shorter-side resize, center or seeded random crop.

Pure Pillow + numpy (no Ray, no torch). Random crops draw from a seed derived with hashlib
from (run seed, epoch, shard, index), so a sample's crop does not depend on which actor
decoded it or when.
"""

from __future__ import annotations

import hashlib
import math
import random

import attrs
import numpy as np
from PIL import Image

#: PiD's sharder buckets, in its tie-break order.
ASPECT_RATIOS: tuple[tuple[int, int], ...] = (
    (21, 9), (16, 9), (3, 2), (4, 3), (1, 1), (3, 4), (2, 3), (9, 16),
)


def nearest_bucket(width: int, height: int,
                   choices: tuple[tuple[int, int], ...] = ASPECT_RATIOS) -> tuple[int, int]:
    """Nearest ratio by |log(w/h) - log(W/H)|; the first wins a tie (PiD's rule)."""
    r = math.log(width / height)
    return min(choices, key=lambda wh: abs(r - math.log(wh[0] / wh[1])))


def parse_bucket(name: str) -> tuple[int, int]:
    """``"16:9"`` or ``"16_9"`` -> (16, 9)."""
    w, h = name.replace("_", ":").split(":")
    return int(w), int(h)


def bucket_shape(bucket: tuple[int, int], base: int, multiple: int = 8) -> tuple[int, int]:
    """(height, width) with area ≈ base² and the bucket's aspect, rounded to ``multiple``."""
    w, h = bucket
    width = base * math.sqrt(w / h)
    height = base * math.sqrt(h / w)
    return (max(multiple, round(height / multiple) * multiple),
            max(multiple, round(width / multiple) * multiple))


@attrs.frozen
class Geometry:
    """Target output shape and crop policy for one image."""

    height: int
    width: int
    crop: str = "center"


def sample_seed(seed: int, epoch: int, shard: int, index: int) -> int:
    digest = hashlib.sha256(f"ray_ingest:crop:{seed}:{epoch}:{shard}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def resize_crop(img: Image.Image, geom: Geometry, rng_seed: int | None = None) -> np.ndarray:
    """Resize so the image covers ``geom`` (shorter side scaled), then crop; uint8 HWC RGB."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    scale = max(geom.width / w, geom.height / h)
    nw, nh = max(geom.width, round(w * scale)), max(geom.height, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), Image.BILINEAR, reducing_gap=None)
    if geom.crop == "random" and rng_seed is not None:
        rng = random.Random(rng_seed)
        left = rng.randint(0, nw - geom.width)
        top = rng.randint(0, nh - geom.height)
    else:
        left = (nw - geom.width) // 2
        top = (nh - geom.height) // 2
    if (left, top, nw, nh) != (0, 0, geom.width, geom.height):
        img = img.crop((left, top, left + geom.width, top + geom.height))
    return np.asarray(img, dtype=np.uint8)


def draft_for(img: Image.Image, geom: Geometry) -> None:
    """Ask libjpeg for DCT-scaled decoding when the target is at most half the source size."""
    if img.format != "JPEG":
        return
    w, h = img.size
    scale = max(geom.width / w, geom.height / h)
    if scale <= 0.5:
        # draft picks the largest power-of-two reduction still >= the requested size
        img.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))
