"""Synthetic twin-tar datasets (``ray-ingest synth``): real JPEGs, captions, embeddings.

Every sample is a pure function of ``(seed, index)`` and the size/aspect settings:

* ``image``: a JPEG (quality 90) of a colour gradient with a few seeded noise blocks, sized
  from a seeded aspect ratio and long side in ``[min_side, max_side]``;
* ``caption``: JSON ``{"prompt", "prompt_medium", "prompt_short"}`` built from a small
  vocabulary (the long prompt states the image size);
* ``umt5``: an ``.npy`` float16 array of shape ``(L, 64)``, ``L`` in ``[8, 64]``;
* ``mask``: an 8-bit PNG at the image's size, 0 outside the noise blocks and ``k`` inside the
  ``k``-th (pixel-aligned with ``image``: a segmentation mask);
* ``depth``: a 16-bit PNG at half the image's size (rounded up): a smooth ramp, nearer (smaller)
  inside the blocks (a depth map at another resolution);
* ``label``: ``.cls``, the number of noise blocks.

Samples are written through :mod:`ray_ingest.twintar.writer` like ``ray-ingest shard`` output, so
the same arguments give byte-identical tars. Keys are ``s{index:08d}``.

No Ray, no torch.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ray_ingest.errors import ConfigError
from ray_ingest.twintar.dataset import (
    DatasetReport,
    ShardJob,
    finish_dataset,
    prepare_output,
    write_jobs,
)
from ray_ingest.twintar.layout import (
    ASPECT_RATIOS,
    aspect_bucket,
    bucket_dir,
    shard_rel_path,
)
from ray_ingest.twintar.writer import Members

#: Modalities synth can generate, and their member extension.
MODALITY_EXT: dict[str, str] = {"image": "jpg", "caption": "json", "umt5": "npy",
                                 "mask": "png", "depth": "png", "label": "cls"}
DEFAULT_MODALITIES = ("image", "caption")
#: Width of the synthetic text embedding.
EMBED_DIM = 64
EMBED_LEN = (8, 64)
JPEG_QUALITY = 90

_WORDS = (
    "a quiet harbour at dawn", "an old stone bridge", "a red bicycle", "a field of sunflowers",
    "a lighthouse", "a mountain lake", "a city street in the rain", "a bowl of oranges",
    "a wooden cabin", "a sleeping cat", "a paper kite", "a desert road", "a glass vase",
    "a snowy forest", "a market stall", "a sailing boat",
)
_STYLES = (
    "soft light", "high contrast", "muted colours", "film grain", "wide angle", "close-up",
    "long exposure", "overcast sky", "golden hour", "studio lighting",
)


def parse_aspect_ratios(text: str) -> tuple[tuple[int, int], ...]:
    """``"16:9,1:1"`` -> ``((16, 9), (1, 1))``."""
    out = []
    for part in text.split(","):
        w, sep, h = part.strip().partition(":")
        try:
            pair = (int(w), int(h))
        except ValueError:
            pair = (0, 0)
        if not sep or pair[0] <= 0 or pair[1] <= 0:
            raise ConfigError(f"aspect_ratios: expected W:H pairs like 16:9,1:1, got {part!r}")
        out.append(pair)
    if not out:
        raise ConfigError("aspect_ratios: expected at least one W:H pair, got none")
    return tuple(out)


def sample_seed(seed: int, index: int) -> int:
    """64-bit seed of sample ``index`` (sha256 of a canonical string, never ``hash()``)."""
    # NOTE: the string is frozen (the module once lived at ray_ingest.synth): changing it would
    # change every synthetic dataset, and with them the goldens.
    digest = hashlib.sha256(f"ray_ingest.synth:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


@attrs.frozen
class SampleSpec:
    """The declared shape of synthetic sample ``index`` (what its bytes will decode to)."""

    key: str
    index: int
    width: int
    height: int
    #: Aspect ratio drawn for it, (W, H).
    ratio: tuple[int, int]
    #: Rows of the ``umt5`` embedding.
    embed_len: int


def sample_spec(
    seed: int,
    index: int,
    *,
    min_side: int = 64,
    max_side: int = 256,
    aspect_ratios: Sequence[tuple[int, int]] = ASPECT_RATIOS,
) -> SampleSpec:
    """Size and embedding length of sample ``index``: the long side is uniform in
    ``[min_side, max_side]``, the short one follows the drawn aspect ratio (at least 8 px)."""
    rng = np.random.default_rng(sample_seed(seed, index))
    rw, rh = aspect_ratios[int(rng.integers(len(aspect_ratios)))]
    long_side = int(rng.integers(min_side, max_side + 1))
    if rw >= rh:
        width, height = long_side, max(8, round(long_side * rh / rw))
    else:
        width, height = max(8, round(long_side * rw / rh)), long_side
    embed_len = int(rng.integers(EMBED_LEN[0], EMBED_LEN[1] + 1))
    return SampleSpec(f"s{index:08d}", index, width, height, (rw, rh), embed_len)


def _rng(seed: int, index: int, what: str) -> np.random.Generator:
    return np.random.default_rng([sample_seed(seed, index),
                                  int.from_bytes(what.encode(), "little")])


#: ``image_style`` values: ``blocks`` (a gradient and noise blocks, the default), ``photo``
#: (smooth multi-scale colour fields with fine texture: compresses like a photograph, ~3 MB per
#: 3840x2160 JPEG at quality 90, for the 4K benchmarks).
IMAGE_STYLES = ("blocks", "photo")


def make_photo(spec: SampleSpec, seed: int, quality: int = JPEG_QUALITY) -> bytes:
    """Photo-like JPEG bytes: coarse and mid-scale colour fields (bicubic-upsampled seeded
    noise) plus per-pixel texture."""
    from PIL import Image

    rng = _rng(seed, spec.index, "photo")
    w, h = spec.width, spec.height
    img = np.zeros((h, w, 3), np.float32)
    for cell, amp in ((max(8, min(w, h) // 6), 1.0), (24, 0.35)):
        small = rng.integers(0, 256, (h // cell + 2, w // cell + 2, 3), dtype=np.uint8)
        img += amp * np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC),
                                np.float32)
    img = img / 1.35 + rng.normal(0.0, 6.0, (h, w, 1)).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB").save(
        buf, format="JPEG", quality=quality)
    return buf.getvalue()


def make_image(spec: SampleSpec, seed: int, quality: int = JPEG_QUALITY) -> bytes:
    """JPEG bytes: a two-axis colour gradient plus 1-4 seeded noise blocks."""
    from PIL import Image

    img, _ = _layers(spec, seed)
    buf = io.BytesIO()
    Image.fromarray(img, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _layers(spec: SampleSpec, seed: int) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """The image's pixels and its noise blocks ``(x, y, w, h)``, in drawing order."""
    rng = _rng(seed, spec.index, "image")
    w, h = spec.width, spec.height
    c = rng.integers(0, 256, size=(3, 3)).astype(np.float32)
    xs = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]
    ys = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None, None]
    img = c[0] + (c[1] - c[0]) * xs + (c[2] - c[0]) * ys
    img = np.clip(img, 0, 255).astype(np.uint8)
    blocks = []
    for _ in range(int(rng.integers(1, 5))):
        bw = int(rng.integers(1, max(2, w // 2)))
        bh = int(rng.integers(1, max(2, h // 2)))
        x = int(rng.integers(0, w - bw + 1))
        y = int(rng.integers(0, h - bh + 1))
        img[y : y + bh, x : x + bw] = rng.integers(0, 256, size=(bh, bw, 3), dtype=np.uint8)
        blocks.append((x, y, bw, bh))
    return img, blocks


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG")
    return buf.getvalue()


def make_mask(spec: SampleSpec, seed: int) -> bytes:
    """8-bit PNG: 0 outside the image's noise blocks, ``k`` in the ``k``-th (later on top)."""
    _, blocks = _layers(spec, seed)
    mask = np.zeros((spec.height, spec.width), np.uint8)
    for k, (x, y, bw, bh) in enumerate(blocks, start=1):
        mask[y : y + bh, x : x + bw] = k
    return _png(mask)


def make_depth(spec: SampleSpec, seed: int) -> bytes:
    """16-bit PNG at half the image's size: a ramp from near (top) to far, blocks nearer."""
    _, blocks = _layers(spec, seed)
    w, h = spec.width, spec.height
    depth = np.broadcast_to(np.linspace(20000, 60000, h)[:, None], (h, w)).copy()
    for k, (x, y, bw, bh) in enumerate(blocks, start=1):
        depth[y : y + bh, x : x + bw] = 4000 * k
    return _png(depth[::2, ::2].astype(np.uint16))


def make_label(spec: SampleSpec, seed: int) -> bytes:
    """``.cls``: the number of noise blocks."""
    return str(len(_layers(spec, seed)[1])).encode()


def make_caption(spec: SampleSpec, seed: int) -> bytes:
    """Caption JSON with ``prompt``, ``prompt_medium`` and ``prompt_short``."""
    rng = _rng(seed, spec.index, "caption")
    subjects = [_WORDS[i] for i in rng.choice(len(_WORDS), size=3, replace=False)]
    styles = [_STYLES[i] for i in rng.choice(len(_STYLES), size=2, replace=False)]
    short = subjects[0]
    medium = f"{subjects[0]} next to {subjects[1]}, {styles[0]}"
    long = (f"A {spec.width}x{spec.height} photograph of {subjects[0]} next to {subjects[1]}, "
            f"with {subjects[2]} in the background; {styles[0]}, {styles[1]}.")
    doc = {"prompt": long, "prompt_medium": medium, "prompt_short": short}
    return json.dumps(doc, sort_keys=True).encode()


def make_embedding(spec: SampleSpec, seed: int) -> bytes:
    """``np.save`` bytes of a float16 ``(embed_len, 64)`` array."""
    rng = _rng(seed, spec.index, "umt5")
    arr = rng.standard_normal((spec.embed_len, EMBED_DIM), dtype=np.float32).astype(np.float16)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


_MAKERS = {"image": make_image, "caption": make_caption, "umt5": make_embedding,
           "mask": make_mask, "depth": make_depth, "label": make_label}


def make_sample(
    seed: int,
    index: int,
    modalities: Sequence[str] = DEFAULT_MODALITIES,
    *,
    min_side: int = 64,
    max_side: int = 256,
    aspect_ratios: Sequence[tuple[int, int]] = ASPECT_RATIOS,
    image_style: str = "blocks",
) -> tuple[str, Members]:
    """``(key, {modality: (ext, bytes)})`` of sample ``index``, as the writer takes it."""
    spec = sample_spec(seed, index, min_side=min_side, max_side=max_side,
                       aspect_ratios=aspect_ratios)
    makers = {**_MAKERS, "image": make_photo} if image_style == "photo" else _MAKERS
    return spec.key, {m: (MODALITY_EXT[m], makers[m](spec, seed)) for m in modalities}


def _check(samples: int, shard_size: int, min_side: int, max_side: int,
           modalities: Sequence[str]) -> None:
    if samples < 1:
        raise ConfigError(f"samples: expected >= 1, got {samples}")
    if shard_size < 1:
        raise ConfigError(f"shard_size: expected >= 1, got {shard_size}")
    if not 8 <= min_side <= max_side:
        raise ConfigError(
            f"min_side/max_side: expected 8 <= min_side <= max_side, got {min_side}/{max_side}"
        )
    if not modalities:
        raise ConfigError("modalities: expected at least one, got none")
    unknown = [m for m in modalities if m not in MODALITY_EXT]
    if unknown or len(set(modalities)) != len(modalities):
        raise ConfigError(
            f"modalities: expected distinct names from {', '.join(MODALITY_EXT)}, "
            f"got {list(modalities)}"
        )


def _by_bucket(samples: int, seed: int, min_side: int, max_side: int,
               aspect_ratios: Sequence[tuple[int, int]], classify: bool) -> dict[str, list[int]]:
    """Sample indices per aspect bucket ("" for all without ``classify``)."""
    by_bucket: dict[str, list[int]] = {}
    for i in range(samples):
        bucket = ""
        if classify:
            spec = sample_spec(seed, i, min_side=min_side, max_side=max_side,
                               aspect_ratios=aspect_ratios)
            bucket = aspect_bucket(spec.width, spec.height)
        by_bucket.setdefault(bucket, []).append(i)
    return by_bucket


def synth_dataset(
    out_dir: str,
    *,
    samples: int,
    shard_size: int,
    seed: int = 0,
    min_side: int = 64,
    max_side: int = 256,
    aspect_ratios: Sequence[tuple[int, int]] = ASPECT_RATIOS,
    modalities: Sequence[str] = DEFAULT_MODALITIES,
    classify_aspect_ratio: bool = False,
    part_size: int = 1000,
    num_workers: int = 1,
    progress: bool | None = False,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    image_style: str = "blocks",
) -> DatasetReport:
    """Write a synthetic twin-tar dataset of ``samples`` samples to ``out_dir``.

    Args:
        out_dir: empty (or absent) output folder; any fsspec URL.
        samples: number of samples.
        shard_size: samples per shard (the last shard of a leaf may be smaller).
        seed: everything derives from it (and the other arguments).
        min_side, max_side: range of the images' long side, in pixels.
        aspect_ratios: (W, H) ratios drawn uniformly per sample.
        modalities: subset of :data:`MODALITY_EXT` (``image``, ``caption``, ``umt5``, ``mask``,
            ``depth``, ``label``); the first drives alignment.
        classify_aspect_ratio: write ``aspect_ratio_W_H/`` leaves (nearest of
            :data:`~ray_ingest.twintar.writer.ASPECT_RATIOS`), one wdinfo.json each.
        part_size: shards per ``part_XXXXXX`` folder (0: flat ``{id:08d}.tar``).
        num_workers: threads generating and writing shards (output does not depend on it).
        progress: tqdm bar on stderr (None: only on a terminal).
        overwrite: replace an output folder holding only a previously written dataset.
        storage_options: fsspec options.
        image_style: :data:`IMAGE_STYLES` (``photo``: photo-like images, for benchmarks).

    Returns:
        The :class:`~ray_ingest.twintar.writer.DatasetReport` (samples, shards, wdinfo URLs, bytes).
    """
    modalities = tuple(modalities)
    _check(samples, shard_size, min_side, max_side, modalities)
    if image_style not in IMAGE_STYLES:
        raise ConfigError(f"image_style: expected one of {', '.join(IMAGE_STYLES)}, "
                          f"got {image_style!r}")
    aspect_ratios = tuple(aspect_ratios)
    so = dict(storage_options or {})

    by_bucket = _by_bucket(samples, seed, min_side, max_side, aspect_ratios,
                           classify_aspect_ratio)
    jobs = []
    leaf_bucket: dict[str, str] = {}
    for bucket in sorted(by_bucket):
        leaf = out_dir.rstrip("/") + (f"/{bucket_dir(bucket)}" if bucket else "")
        if bucket:
            leaf_bucket[leaf] = bucket
        idx = by_bucket[bucket]
        for shard_id, start in enumerate(range(0, len(idx), shard_size)):
            jobs.append(ShardJob(leaf, shard_rel_path(shard_id, part_size),
                                 idx[start : start + shard_size]))

    prepare_output(out_dir, overwrite=overwrite, storage_options=so)

    def load(index: int) -> tuple[str, Members]:
        return make_sample(seed, index, modalities, min_side=min_side, max_side=max_side,
                           aspect_ratios=aspect_ratios, image_style=image_style)

    infos = write_jobs(jobs, modalities, load, num_workers=num_workers, progress=progress,
                       storage_options=so)
    report = finish_dataset(infos, modalities, DatasetReport(), chunk_size=shard_size,
                            storage_options=so)
    for info in infos:
        if info.leaf in leaf_bucket:
            b = leaf_bucket[info.leaf]
            report.buckets[b] = report.buckets.get(b, 0) + info.count
    return report
