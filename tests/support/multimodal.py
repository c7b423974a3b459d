"""A multimodal twin-tar dataset whose modalities encode pixel coordinates, to check alignment.

Every sample has ``image`` (JPEG: red = x, green = y, as fractions of the image size),
``caption`` (JSON), ``depth`` (16-bit PNG at half or full resolution: x as a fraction of 65535),
``mask`` (8-bit PNG at full resolution: the y band, 0..15) and ``label`` (``.cls``: the sample
number). After any crop, resize and flip, a pixel's depth and red must name the same source x,
and its mask and green the same y band: :func:`alignment` measures that.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from tests.support.datagen import write_tar

MODALITIES = ("image", "caption", "depth", "mask", "label")
EXT = {"image": "jpg", "caption": "json", "depth": "png", "mask": "png", "label": "cls"}
BANDS = 16


def sample_size(i: int) -> tuple[int, int]:
    """(width, height): landscape and portrait, all larger than the test outputs."""
    return (96 + 8 * (i % 5), 72 + 6 * (i % 3)) if i % 2 else (70 + 4 * (i % 4), 100)


def members(i: int) -> dict[str, bytes]:
    w, h = sample_size(i)
    x = (np.arange(w) + 0.5) / w
    y = (np.arange(h) + 0.5) / h
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = np.round(x * 255)[None, :]
    img[..., 1] = np.round(y * 255)[:, None]
    img[..., 2] = 64
    out = {}
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=95, subsampling=0)
    out["image"] = buf.getvalue()
    out["caption"] = json.dumps({"prompt": f"sample {i}"}).encode()
    half = i % 3 == 0  # a half-resolution depth map for every third sample
    dw, dh = ((w + 1) // 2, (h + 1) // 2) if half else (w, h)
    dx = (np.arange(dw) + 0.5) / dw
    depth = np.broadcast_to(np.round(dx * 65535).astype(np.uint16)[None, :], (dh, dw))
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(depth)).save(buf, "PNG")  # mode I;16
    out["depth"] = buf.getvalue()
    mask = np.broadcast_to((np.floor(y * BANDS).astype(np.uint8))[:, None], (h, w))
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(mask), "L").save(buf, "PNG")
    out["mask"] = buf.getvalue()
    out["label"] = str(i).encode()
    return out


def write_dataset(root: Path, samples: int = 24, shard_size: int = 6) -> Path:
    """Twin tars of :data:`MODALITIES` and their wdinfo.json under ``root``."""
    data_list, counts = [], []
    for s, start in enumerate(range(0, samples, shard_size)):
        rel = f"part_000000/{s:06d}.tar"
        idx = range(start, min(samples, start + shard_size))
        per = {m: [] for m in MODALITIES}
        for i in idx:
            ms = members(i)
            for m in MODALITIES:
                per[m].append((f"k{i:05d}.{EXT[m]}", ms[m]))
        for m in MODALITIES:
            write_tar(root / m / rel, per[m], index=True)
        data_list.append(rel)
        counts.append(len(idx))
    doc = {"data_list": data_list, "data_list_key_count": counts, "total_key_count": samples,
           "chunk_size": shard_size, "data_keys": list(MODALITIES), "root": "."}
    (root / "wdinfo.json").write_text(json.dumps(doc))
    return root / "wdinfo.json"


def alignment(image: np.ndarray, depth: np.ndarray, mask: np.ndarray) -> float:
    """Fraction of pixels whose depth agrees with the image's x (within 3 % of the width) and
    whose mask agrees with the image's y band (within one band)."""
    x_img = image[..., 0].astype(np.float64) / 255
    x_depth = depth.astype(np.float64) / 65535
    y_band = np.floor(image[..., 1].astype(np.float64) / 255 * BANDS)
    ok = (np.abs(x_img - x_depth) <= 0.03) & (np.abs(y_band - mask.astype(np.float64)) <= 1)
    return float(ok.mean())
