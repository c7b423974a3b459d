"""Decoders per modality: member bytes to values, chosen by extension or by ``decode.decoders``.

Every listed modality reaches the batch: a member no decoder claims arrives as its bytes, never
dropped. Specs (``decode.decoders: {depth: image, meta: bytes}``), with webdataset's names as
aliases where it has them:

==========  ====================================================================================
``image``   any image Pillow opens (default for jpg, jpeg, png, ppm, pgm, pbm, pnm, webp, bmp,
            tif, tiff): colour → uint8 RGB (H, W, 3); one channel keeps its mode's dtype and
            (H, W): ``L`` and palette ``P`` (the indices: label masks) uint8, 16-bit ``I;16``
            uint16, ``I`` int32, ``F`` float32, ``1`` bool; alpha dropped
``rgb``     any image → uint8 RGB (H, W, 3) (``rgb8``; the primary image always)
``gray``    any image → uint8 (H, W) (``l8``, ``l``)
``npy``     a NumPy array (default for npy; pickled object arrays refused)
``int``     an int (default for cls, cls2, class, index, inx, id, label, count)
``text``    UTF-8 text (default for txt, text)
``json``    the JSON document (default for json, jsn)
``caption`` the caption rule: JSON ``prompt``, then ``prompt_medium``/``prompt_short``/… (the
            caption modality's, whatever its extension)
``bytes``   the member's bytes (default for every other extension)
``pickle``  pickle or torch files (default for pkl, pickle, pt, pth): refused unless
            ``decode.allow_pickle``: loading them runs code
==========  ====================================================================================

No Ray, no torch (torch only to load an opted-in ``.pt``).
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import numpy as np
from PIL import Image

from ray_ingest.config import DECODER_ALIASES, DECODER_SPECS
from ray_ingest.errors import UnsafeFormatError

SPECS = DECODER_SPECS
ALIASES = DECODER_ALIASES
#: Specs whose value is an image (they take the sample's geometry).
IMAGE_SPECS = frozenset({"image", "rgb", "gray"})
IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "webp", "bmp", "tif",
                        "tiff"})
UNSAFE_EXTS = frozenset({"pkl", "pickle", "pt", "pth"})
BY_EXT: dict[str, str] = {
    **{e: "image" for e in IMAGE_EXTS},
    "npy": "npy",
    **{e: "int" for e in ("cls", "cls2", "class", "index", "inx", "id", "label", "count")},
    "txt": "text", "text": "text", "json": "json", "jsn": "json",
    **{e: "pickle" for e in UNSAFE_EXTS},
}
CAPTION_FIELDS = ("prompt", "prompt_medium", "prompt_short", "caption", "text")
#: Pillow modes kept as one channel by ``image``, and their dtypes.
_ONE_CHANNEL = {"1": None, "L": None, "P": None, "I;16": np.uint16, "I;16L": np.uint16,
                "I;16B": np.uint16, "I;16N": np.uint16, "I": np.int32, "F": np.float32}


class SampleError(Exception):
    """One sample could not be decoded (reason text names the modality and the problem)."""


def canonical(spec: str) -> str:
    """A spec name with webdataset's aliases resolved."""
    return ALIASES.get(spec, spec)


def spec_for(ext: str | None, configured: str = "auto") -> str:
    """The spec that decodes a member: ``configured``, or by extension for ``auto``."""
    spec = canonical(configured)
    if spec != "auto":
        return spec
    return BY_EXT.get((ext or "").lower(), "bytes")


def caption_text(data: bytes, ext: str) -> str:
    """Caption text: JSON ``prompt``, falling back to ``prompt_medium``/``prompt_short``."""
    if ext in ("txt", "text"):
        return data.decode("utf-8")
    doc = json.loads(data)
    if isinstance(doc, str):
        return doc
    if isinstance(doc, dict):
        for field in CAPTION_FIELDS:
            value = doc.get(field)
            if isinstance(value, str) and value:
                return value
    raise SampleError(f"caption has none of the fields {', '.join(CAPTION_FIELDS)}")


def load_array(data: bytes, ext: str, allow_pickle: bool) -> np.ndarray:
    """An embedding: ``.npy`` (no pickled objects), or an opted-in pickle/torch file."""
    if ext in UNSAFE_EXTS:
        return np.asarray(load_pickle(data, ext, allow_pickle))
    if ext == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    raise SampleError(f"unsupported embedding format .{ext}")


def load_pickle(data: bytes, ext: str, allow_pickle: bool) -> Any:
    if not allow_pickle:
        raise UnsafeFormatError(
            f".{ext} members execute code when loaded; set decode.allow_pickle: true to opt in")
    if ext in ("pt", "pth"):
        import torch

        return torch.load(io.BytesIO(data), weights_only=False)
    return pickle.loads(data)  # noqa: S301 - explicit opt-in


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Pillow's image, refusing decompression bombs at Pillow's warning level as an error."""
    img = Image.open(io.BytesIO(data))  # DecompressionBombError beyond 2x the limit
    refuse_bomb(img.size, max_pixels)
    return img


def refuse_bomb(size: tuple[int, int], limit: int) -> None:
    """Pillow's warning level of its decompression-bomb check, as an error.

    Not ``warnings.catch_warnings``: its filters are the process's, and decode threads
    (``decode.compute: threads``) entering and leaving it at once would restore each other's,
    letting an over-limit image through. Same test and message as Pillow's.
    """
    pixels = max(1, size[0]) * max(1, size[1])
    if pixels > limit:
        raise Image.DecompressionBombWarning(
            f"Image size ({pixels} pixels) exceeds limit of {limit} pixels, "
            "could be decompression bomb DOS attack.")


def as_mode(img: Image.Image, mode: str = "RGB") -> Image.Image:
    """``img`` in ``mode``: converted only when it is in another (no copy otherwise)."""
    return img if img.mode == mode else img.convert(mode)


def image_array(img: Image.Image, spec: str) -> np.ndarray:
    """A loaded image as the array its spec asks for (see module docstring)."""
    if spec == "rgb":
        return np.asarray(as_mode(img))
    if spec == "gray":
        return np.asarray(as_mode(img, "L"))
    mode = img.mode
    if mode in ("LA", "La", "PA"):
        img, mode = img.convert(mode[0]), mode[0]
    if mode in _ONE_CHANNEL:
        arr = np.asarray(img)
        dtype = _ONE_CHANNEL[mode]
        return arr if dtype is None or arr.dtype == dtype else arr.astype(dtype)
    return np.asarray(as_mode(img))


def decode_value(data: bytes, ext: str, spec: str, allow_pickle: bool, max_pixels: int) -> Any:
    """A non-geometric member (or an image at its own size) decoded by ``spec``."""
    if spec in IMAGE_SPECS:
        img = open_image(data, max_pixels)
        img.load()
        return image_array(img, spec)
    if spec == "npy":
        return load_array(data, "npy" if ext not in UNSAFE_EXTS else ext, allow_pickle)
    if spec == "int":
        return int(data.decode("utf-8").strip())
    if spec == "text":
        return data.decode("utf-8")
    if spec == "json":
        return json.loads(data)
    if spec == "caption":
        return caption_text(data, ext)
    if spec == "pickle":
        return load_pickle(data, ext, allow_pickle)
    return bytes(data)
