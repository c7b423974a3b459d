"""Image geometry: aspect-ratio buckets, shorter-side resize, center or seeded random crop.

The resize computes only the pixels the crop keeps, giving the textbook
resize-then-crop's bytes for less CPU (:func:`resize_crop`). Pure Pillow + numpy (no Ray, no
torch). Random crops draw from a seed derived with hashlib from (run seed, epoch, shard, index),
so a sample's crop does not depend on which actor decoded it or when.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import random
from collections.abc import Callable

import attrs
import numpy as np
import PIL
from PIL import Image

log = logging.getLogger(__name__)

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


def _cover(img: Image.Image, geom: Geometry, rng_seed: int | None
           ) -> tuple[Image.Image, tuple[int, int], tuple[int, int, int, int]]:
    """RGB image, the size that covers ``geom`` (shorter side scaled) and the crop box in it."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    scale = max(geom.width / w, geom.height / h)
    nw, nh = max(geom.width, round(w * scale)), max(geom.height, round(h * scale))
    if geom.crop == "random" and rng_seed is not None:
        rng = random.Random(rng_seed)
        left = rng.randint(0, nw - geom.width)
        top = rng.randint(0, nh - geom.height)
    else:
        left = (nw - geom.width) // 2
        top = (nh - geom.height) // 2
    return img, (nw, nh), (left, top, left + geom.width, top + geom.height)


def resize_then_crop(img: Image.Image, geom: Geometry, rng_seed: int | None = None
                     ) -> np.ndarray:
    """The textbook transform: resize the whole image, then crop (torchvision's Resize +
    CenterCrop on a PIL image). :func:`resize_crop` gives the same bytes for less work; the
    benchmark's baselines run this, as their users would."""
    return _whole(*_cover(img, geom, rng_seed))


def _whole(img: Image.Image, size: tuple[int, int], box: tuple[int, int, int, int]
           ) -> np.ndarray:
    if size != img.size:
        img = _resample(img, size)
    return np.asarray(_crop(img, box), dtype=np.uint8)


def resize_crop(img: Image.Image, geom: Geometry, rng_seed: int | None = None) -> np.ndarray:
    """Resize so the image covers ``geom`` (shorter side scaled), then crop; uint8 HWC RGB.

    Bit for bit :func:`resize_then_crop`, but resampling only what the crop keeps
    (:func:`_resize_kept`): ~10 % less resize time on the throughput bench's 512-768 px JPEGs,
    0.84x the whole Decoder's time at 1920x1080 -> 1024² (docs/operations.md). Falls back to
    the textbook path when the installed Pillow's pass order is not one this module knows
    (:func:`pass_order`).
    """
    img, size, box = _cover(img, geom, rng_seed)
    order = pass_order()
    if size == img.size or order is None:
        return _whole(img, size, box)
    return np.asarray(_resize_kept(img, size, box, order), dtype=np.uint8)


# --- resampling only the kept pixels ------------------------------------------------------
#: Extra input lines read on each side of the computed window: cheap insurance against
#: rounding in :func:`_reads` (its arithmetic is Pillow's, but compilers may differ).
_MARGIN = 2
PassOrder = Callable[[int, int, int, int], bool]


def _crop(img: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
    return img if box == (0, 0, *img.size) else img.crop(box)


def _resample(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    return img.resize(size, Image.BILINEAR, reducing_gap=None)


def _reads(length: int, out: int, first: int, last: int) -> tuple[int, int]:
    """Input lines ``[lo, hi)`` that bilinear outputs ``[first, last)`` of ``length -> out``
    read, as Pillow's ``precompute_coeffs`` bounds them, widened by :data:`_MARGIN`."""
    scale = length / out
    support = max(scale, 1.0)  # bilinear support 1, stretched when downscaling
    lo = int((first + 0.5) * scale - support + 0.5)
    hi = int((last - 0.5) * scale + support + 0.5)
    return max(0, lo - _MARGIN), min(length, hi + _MARGIN)


def _resize_kept(img: Image.Image, size: tuple[int, int], box: tuple[int, int, int, int],
                 horizontal_first: PassOrder) -> Image.Image:
    """``img.resize(size).crop(box)`` (bilinear), computing only what the crop keeps.

    Pillow resizes in two separable passes, in the order ``horizontal_first`` says, rounding
    to uint8 in between. A pass's coefficients depend only on its axis' input and output
    lengths, and each output line reads a fixed window of input lines. So the passes are run
    one at a time: the first only over the lines that kept pixels read, the second only over
    the kept lines. Lines go back to their offsets before the second pass (``crop`` pads with
    zeros, which no kept pixel reads), so every coefficient, and every byte, is Pillow's own.
    """
    w, h = img.size
    nw, nh = size
    left, top, right, bottom = box
    kw, kh = right - left, bottom - top
    if nw == w:  # vertical pass only
        part = _resample(_crop(img, (left, 0, right, h)), (kw, nh))
        return _crop(part, (0, top, kw, bottom))
    if nh == h:  # horizontal pass only
        part = _resample(_crop(img, (0, top, w, bottom)), (nw, kh))
        return _crop(part, (left, 0, right, kh))
    if horizontal_first(w, h, nw, nh):
        r0, r1 = _reads(h, nh, top, bottom)
        part = _resample(_crop(img, (0, r0, w, r1)), (nw, r1 - r0))
        part = _resample(_crop(part, (left, -r0, right, h - r0)), (kw, nh))
        return _crop(part, (0, top, kw, bottom))
    c0, c1 = _reads(w, nw, left, right)
    part = _resample(_crop(img, (c0, 0, c1, h)), (c1 - c0, nh))
    part = _resample(_crop(part, (-c0, top, w - c0, bottom)), (nw, kh))
    return _crop(part, (left, 0, right, kh))


def _pillow13_order(w: int, h: int, nw: int, nh: int) -> bool:
    """Pillow >= 13: vertical first when the height shrinks by over twice what the width does."""
    return not (h - nh > 0 and h - nh > (w - nw) * 2)


def _horizontal_always(w: int, h: int, nw: int, nh: int) -> bool:
    """Pillow < 13: always horizontal first."""
    return True


#: (size, geometry) probes of :func:`pass_order`; they include both orders of each rule.
_PROBES = (((90, 40), Geometry(24, 24)), ((40, 90), Geometry(24, 24)),
           ((40, 200), Geometry(24, 24)), ((31, 97), Geometry(16, 40)),
           ((200, 45), Geometry(24, 24, "random")))


@functools.cache
def pass_order() -> PassOrder | None:
    """The installed Pillow's pass order, or None (then :func:`resize_crop` resizes whole).

    Checked once per process: :func:`_resize_kept` must equal Pillow's one-call resize on
    noise images whose passes run in either order; a rule that fails any probe is not used.
    """
    rng = np.random.default_rng(0)
    images = [(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), geom)
              for (w, h), geom in _PROBES]
    for rule in (_pillow13_order, _horizontal_always):
        try:
            if all(np.array_equal(resize_then_crop(img, geom, 7),
                                  np.asarray(_resize_kept(*_cover(img, geom, 7), rule)))
                   for img, geom in images):
                return rule
        except Exception:  # a Pillow whose crop or resize refuses what this path asks
            log.debug("pass order %s failed its probe", rule.__name__, exc_info=True)
    log.warning("unknown resize pass order of Pillow %s: images are resized whole, then cropped",
                PIL.__version__)
    return None


def draft_size(size: tuple[int, int], geom: Geometry) -> tuple[int, int] | None:
    """The size :func:`draft_for` asks libjpeg for, or None (no DCT scaling)."""
    w, h = size
    scale = max(geom.width / w, geom.height / h)
    if scale > 0.5:
        return None
    return math.ceil(w * scale), math.ceil(h * scale)


def draft_for(img: Image.Image, geom: Geometry) -> None:
    """Ask libjpeg for DCT-scaled decoding when the target is at most half the source size."""
    if img.format != "JPEG":
        return
    request = draft_size(img.size, geom)
    if request is not None:
        # draft picks the largest power-of-two reduction still >= the requested size
        img.draft("RGB", request)
