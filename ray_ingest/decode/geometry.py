"""One geometry per sample: where a stored image lands in its output, decided once.

A sample's :class:`Placement` comes from the primary image's header (its size, whether it is a
JPEG libjpeg can scale while decoding) and the per-sample seed, before any pixel is decoded:

1. ``scale``: the DCT reduction a CPU decode asks libjpeg for (Pillow's ``draft`` rule: the
   largest of 8, 4, 2, 1 that still covers the output), so CPU decode equals Pillow's pixels;
2. ``cover``: the size the (decoded) image is resized to, shorter side covering the output;
3. ``box``: the crop in cover coordinates (center, or drawn from the sample's seed);
4. ``flip``: a horizontal flip (``decode.flip``), drawn from the same seed.

Every consumer applies the same placement: the CPU decoder (DCT scale, resize, crop, flip), the
other image-like modalities of the sample (resized from their own size to ``cover``: a
half-resolution depth map lands on the same pixels), and a GPU decoder that receives the
compressed bytes with their placement (it decodes at full size and resizes to ``cover``). So
crops, flips and pixel alignment do not depend on which worker, mode or device decoded the
sample, and a resumed run draws the same ones. Pure Python (no Ray, no torch, no Pillow).
"""

from __future__ import annotations

import hashlib
import math
import random

import attrs

#: DCT reductions libjpeg offers that Pillow's ``draft`` uses, largest first.
DRAFT_SCALES = (8, 4, 2, 1)



@attrs.frozen
class Geometry:
    """Target output shape and crop policy for one image."""

    height: int
    width: int
    crop: str = "center"
    #: Flip horizontally with probability 1/2, drawn from the sample's seed.
    flip: bool = False


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


def sample_seed(seed: int, epoch: int, shard: int, index: int) -> int:
    """The seed of one sample's crop and flip: (run seed, epoch, shard id, index), hashed."""
    digest = hashlib.sha256(f"ray_ingest:crop:{seed}:{epoch}:{shard}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def draft_size(size: tuple[int, int], geom: Geometry) -> tuple[int, int] | None:
    """The size asked of libjpeg when the output is at most half the source, else None."""
    w, h = size
    scale = max(geom.width / w, geom.height / h)
    if scale > 0.5:
        return None
    return math.ceil(w * scale), math.ceil(h * scale)


def draft_scale(size: tuple[int, int], geom: Geometry) -> int:
    """The DCT reduction ``Image.draft`` picks for :func:`draft_size`'s request (1: none)."""
    request = draft_size(size, geom)
    if request is None:
        return 1
    q = min(size[0] // request[0], size[1] // request[1])
    return next(s for s in DRAFT_SCALES if q >= s)


def scaled(size: tuple[int, int], scale: int) -> tuple[int, int]:
    """The size libjpeg decodes ``size`` to at a reduction of ``scale`` (rounded up)."""
    return (size[0] + scale - 1) // scale, (size[1] + scale - 1) // scale


@attrs.frozen
class Placement:
    """Where one sample's stored image lands in the output (see module docstring)."""

    #: (width, height) of the stored image.
    source: tuple[int, int]
    #: DCT reduction of a CPU decode (1, 2, 4 or 8; always 1 for what libjpeg does not decode).
    scale: int
    #: (width, height) the decoded image is resized to.
    cover: tuple[int, int]
    #: (left, top, right, bottom) crop in ``cover`` coordinates.
    box: tuple[int, int, int, int]
    flip: bool = False

    @property
    def decoded(self) -> tuple[int, int]:
        """(width, height) of the CPU decode (the source at ``scale``)."""
        return scaled(self.source, self.scale)

    @property
    def out(self) -> tuple[int, int]:
        """(width, height) of the output."""
        left, top, right, bottom = self.box
        return right - left, bottom - top

    def to_list(self) -> list[int]:
        """Flat ints (the compressed transport's per-sample column)."""
        return [*self.source, self.scale, *self.cover, *self.box, int(self.flip)]

    @classmethod
    def from_list(cls, v) -> Placement:
        v = [int(x) for x in v]
        return cls((v[0], v[1]), v[2], (v[3], v[4]), (v[5], v[6], v[7], v[8]), bool(v[9]))


def place(source: tuple[int, int], geom: Geometry, rng_seed: int | None, scalable: bool
          ) -> Placement:
    """The placement of an image of ``source`` size (see module docstring).

    Args:
        source: (width, height) from the header.
        geom: target shape and crop policy.
        rng_seed: the sample's seed (:func:`sample_seed`); None draws nothing (center, no flip).
        scalable: a JPEG the CPU decoder may DCT-scale (Pillow drafts only plain JPEGs).
    """
    scale = draft_scale(source, geom) if scalable else 1
    w, h = scaled(source, scale)
    s = max(geom.width / w, geom.height / h)
    nw, nh = max(geom.width, round(w * s)), max(geom.height, round(h * s))
    flip = False
    if geom.crop == "random" and rng_seed is not None:
        rng = random.Random(rng_seed)
        left = rng.randint(0, nw - geom.width)
        top = rng.randint(0, nh - geom.height)
    else:
        left = (nw - geom.width) // 2
        top = (nh - geom.height) // 2
    if geom.flip and rng_seed is not None:
        flip = _flip(rng_seed)
    return Placement(source, scale, (nw, nh), (left, top, left + geom.width, top + geom.height),
                     flip)


def _flip(rng_seed: int) -> bool:
    """A coin of its own from the sample's seed (the crop's draws stay what they were)."""
    return hashlib.sha256(f"ray_ingest:flip:{rng_seed}".encode()).digest()[0] & 1 == 1


def map_size(source: tuple[int, int], primary: tuple[int, int]) -> bool:
    """Whether an image of ``source`` size is the primary's picture at another resolution
    (the same aspect, up to rounding of either side), so its placement maps proportionally."""
    w, h = source
    pw, ph = primary
    return abs(w - round(pw * h / ph)) <= 1 or abs(h - round(ph * w / pw)) <= 1
