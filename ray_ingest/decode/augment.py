"""Resampling: a decoded image rendered into its output by its sample's placement.

:func:`render` applies a :class:`~ray_ingest.decode.geometry.Placement` (resize to the cover
size, crop, flip) computing only the pixels the crop keeps, giving the textbook
resize-then-crop's bytes for less CPU; :func:`render_array` does the same for the other
image-like modalities of a sample (masks and depth maps: nearest by default, any dtype).
:func:`resize_crop` and :func:`resize_then_crop` place and render in one call (tests and the
benchmark's baselines). Pure Pillow + numpy (no Ray, no torch).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import PIL
from PIL import Image

from ray_ingest.decode.geometry import (
    Geometry,
    Placement,
    bucket_shape,
    draft_size,
    parse_bucket,
    place,
    sample_seed,
)
from ray_ingest.decode.modalities import as_mode

__all__ = ["Geometry", "bucket_shape", "draft_for", "mirrored", "oriented", "parse_bucket",
           "render", "render_array", "resamples_as_image", "resize_crop", "resize_then_crop",
           "sample_seed"]

log = logging.getLogger(__name__)


def _cover(img: Image.Image, geom: Geometry, rng_seed: int | None
           ) -> tuple[Image.Image, tuple[int, int], tuple[int, int, int, int]]:
    """RGB image, the size that covers ``geom`` (shorter side scaled) and the crop box in it."""
    p = place(img.size, geom, rng_seed, scalable=False)
    return as_mode(img), p.cover, p.box


def resize_then_crop(img: Image.Image, geom: Geometry, rng_seed: int | None = None
                     ) -> np.ndarray:
    """The textbook transform: resize the whole image, then crop (torchvision's Resize +
    CenterCrop on a PIL image). :func:`resize_crop` gives the same bytes for less work; the
    benchmark's baselines run this, as their users would."""
    arr = np.asarray(_whole(*_cover(img, geom, rng_seed)), dtype=np.uint8)
    flip = place(img.size, geom, rng_seed, scalable=False).flip
    return np.ascontiguousarray(arr[:, ::-1]) if flip else arr


def _whole(img: Image.Image, size: tuple[int, int], box: tuple[int, int, int, int]
           ) -> Image.Image:
    if size != img.size:
        img = _resample(img, size)
    return _crop(img, box)


def resize_crop(img: Image.Image, geom: Geometry, rng_seed: int | None = None) -> np.ndarray:
    """Resize so the image covers ``geom`` (shorter side scaled), then crop; uint8 HWC RGB.

    Bit for bit :func:`resize_then_crop`, resampling only what the crop keeps (:func:`render`).
    """
    return render(as_mode(img), place(img.size, geom, rng_seed, scalable=False))


def render(img: Image.Image, p: Placement) -> np.ndarray:
    """An RGB image decoded at ``p.decoded`` rendered into its output: uint8 HWC.

    Bit for bit resize-then-crop (bilinear), resampling only the kept pixels
    (:func:`_resize_kept`): ~10 % less resize time on the throughput bench's 512-768 px JPEGs,
    0.84x the whole Decoder's time at 1920x1080 -> 1024² (docs/operations.md). Falls back to
    the textbook path when the installed Pillow's pass order is not one this module knows
    (:func:`pass_order`).
    """
    order = pass_order()
    if p.cover == img.size or order is None:
        out = _whole(img, p.cover, p.box)
    else:
        out = _resize_kept(img, p.cover, p.box, order)
    if p.flip:  # Pillow moves whole pixels: ~6x faster than numpy's reversed copy at 256²
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out, dtype=np.uint8)


def mirrored(arr: np.ndarray) -> np.ndarray:
    """``arr`` ((H, W) or (H, W, C), any dtype) flipped left to right, C-contiguous.

    Why not ``np.ascontiguousarray(arr[:, ::-1])`` alone: numpy copies a reversed (H, W, 3)
    array through a 3-long inner loop, ~10x a plain copy (0.48 ms at 256x256 RGB, 30 ms at
    2048x1152); each pixel viewed as one opaque item of C values moves whole, in about half
    that."""
    if arr.ndim == 3:
        if arr.strides[2] != arr.itemsize:
            arr = np.ascontiguousarray(arr)
        pixel = np.dtype((np.void, arr.shape[2] * arr.itemsize))
        return np.ascontiguousarray(arr.view(pixel)[:, ::-1]).view(arr.dtype).reshape(arr.shape)
    return np.ascontiguousarray(arr[:, ::-1])


def oriented(arr: np.ndarray, flip: bool) -> np.ndarray:
    """``arr`` C-contiguous, :func:`mirrored` when the placement flips: the last step of every
    array renderer."""
    return mirrored(arr) if flip else np.ascontiguousarray(arr)


def resamples_as_image(arr: np.ndarray, resample: str) -> bool:
    """Whether :func:`render_array` resamples ``arr`` as the primary image is: ``bilinear`` on
    uint8 grey or RGB (the torch resizer takes the same ones)."""
    return (resample == "bilinear" and arr.dtype == np.uint8
            and (arr.ndim == 2 or arr.shape[2] == 3))


def render_array(arr: np.ndarray, p: Placement, resample: str = "nearest") -> np.ndarray:
    """Another image-like modality of the sample (any size of the same aspect, any dtype, 2-D
    or HWC) rendered by the primary image's placement: resized from its own size to
    ``p.cover``, cropped to ``p.box``, flipped as it is. ``nearest`` keeps values (labels,
    depth); ``bilinear`` resamples uint8 grey or RGB as the primary image is, other dtypes in
    float32, rounded back to integer dtypes."""
    h, w = arr.shape[:2]
    if resamples_as_image(arr, resample):
        return render(Image.fromarray(np.ascontiguousarray(arr)), p)
    nw, nh = p.cover
    left, top, right, bottom = p.box
    if resample == "nearest":
        # Pillow's nearest rule, only at the kept pixels: source = floor((x + 0.5) * w / nw)
        xs = np.minimum(((np.arange(left, right) + 0.5) * (w / nw)).astype(np.int64), w - 1)
        ys = np.minimum(((np.arange(top, bottom) + 0.5) * (h / nh)).astype(np.int64), h - 1)
        out = arr[ys[:, None], xs[None, :]]
    else:
        chans = [arr] if arr.ndim == 2 else [arr[..., c] for c in range(arr.shape[2])]
        planes = [np.asarray(Image.fromarray(np.ascontiguousarray(c, dtype=np.float32), "F")
                             .resize((nw, nh), Image.BILINEAR, box=None, reducing_gap=None)
                             .crop(p.box)) for c in chans]
        out = planes[0] if arr.ndim == 2 else np.stack(planes, -1)
        if np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool:
            info = np.iinfo(arr.dtype) if arr.dtype != bool else None
            out = np.rint(out)
            if info is not None:
                out = np.clip(out, info.min, info.max)
            out = out.astype(arr.dtype)
    return oriented(out, p.flip)


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


#: Held while :func:`pass_order` probes.
_PROBING = threading.Lock()
#: The probe's answer once it ran (empty: not yet).
_ORDER: list[PassOrder | None] = []


def pass_order() -> PassOrder | None:
    """The installed Pillow's pass order, or None (then :func:`resize_crop` resizes whole).

    Probed once per process (:func:`_probe_pass_order`), also when several threads render
    their first images at once (decode threads, ranks sharing a process): they wait for one
    probe, ~5 ms of CPU, where ``functools.cache`` would run it in each.
    """
    if not _ORDER:
        with _PROBING:
            if not _ORDER:
                _ORDER.append(_probe_pass_order())
    return _ORDER[0]


pass_order.cache_clear = _ORDER.clear  # type: ignore[attr-defined]  # the next call probes again


def _probe_pass_order() -> PassOrder | None:
    """:func:`_resize_kept` must equal Pillow's one-call resize on noise images whose passes
    run in either order; a rule that fails any probe is not used."""
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


def draft_for(img: Image.Image, geom: Geometry) -> None:
    """Ask libjpeg for DCT-scaled decoding when the target is at most half the source size
    (the reduction :func:`ray_ingest.decode.geometry.draft_scale` predicts)."""
    if img.format != "JPEG":
        return
    request = draft_size(img.size, geom)
    if request is not None:
        # draft picks the largest power-of-two reduction still >= the requested size
        img.draft("RGB", request)
