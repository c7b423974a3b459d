"""Differential fuzzing of JPEG decoding against Pillow, through the public decode API.

JPEGs written by Pillow (sizes from 1 px, RGB, grey and CMYK, baseline, progressive, every
chroma subsampling, restart markers, optimised tables) are mutated: bytes set, inserted or
deleted (half of them in the headers: SOF sizes and component counts, Huffman and quantisation
tables, scan headers), segments cut, the file truncated. Each goes through
``Decoder(DecodeConfig(...), on_error="skip")`` on a one-row block — whatever decodes JPEGs
inside it — and through the reference: ``Image.open``, the documented DCT draft
(:func:`~ray_ingest.decode.augment.draft_for`), ``load()`` and
:func:`~ray_ingest.decode.augment.resize_then_crop` (RGB). For every input:

* both decode: the pixels are equal;
* the decoder refuses (the row's ``__error__``, one line): always allowed;
* the reference refuses and the decoder gives pixels: a divergence.

Never an exception out of the decoder, never a hang. The budget is ``tests/support/fuzz.py``'s.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from ray_ingest.config import DecodeConfig
from ray_ingest.decode.augment import Geometry, draft_for, resize_then_crop
from ray_ingest.decode.decoder import Decoder
from ray_ingest.twintar.twin import ext_column
from tests.support.fuzz import fuzz_settings, tally, within

pytestmark = pytest.mark.fuzz

MAX_PIXELS = 1 << 20  # decode.max_image_pixels here: mutated sizes stay cheap to refuse
SAVES = ({}, {"subsampling": 0}, {"subsampling": 1}, {"subsampling": 2}, {"progressive": True},
         {"restart_marker_blocks": 2}, {"optimize": True, "quality": 30}, {"quality": 100})


def _image(w: int, h: int, seed: int, mode: str) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w, 1), y * 255 // max(h, 1), (x + y) % 256], -1)
    noise = rng.integers(-30, 30, (h, w, 3))
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
    return img if mode == "RGB" else img.convert(mode)


@st.composite
def jpegs(draw) -> bytes:
    w, h = draw(st.integers(1, 96)), draw(st.integers(1, 96))
    mode = draw(st.sampled_from(["RGB", "RGB", "L", "CMYK"]))
    buf = io.BytesIO()
    options = {"quality": 85, **draw(st.sampled_from(SAVES))}
    _image(w, h, draw(st.integers(0, 3)), mode).save(buf, "JPEG", **options)
    return buf.getvalue()


def _header_end(data: bytes) -> int:
    """Where the first scan's entropy-coded data starts (after the SOS header)."""
    sos = data.find(b"\xff\xda")
    if sos < 0 or sos + 4 > len(data):
        return len(data)
    return min(len(data), sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big"))


mutation = st.tuples(st.sampled_from(["set", "set", "insert", "delete", "truncate", "cut"]),
                     st.booleans(), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=4))


def mutate(data: bytes, mutations: list) -> bytes:
    out = bytearray(data)
    for kind, in_header, at, value in mutations:
        span = max(1, _header_end(bytes(out)) if in_header else len(out))
        at %= span
        if kind == "set":
            out[at:at + len(value)] = value
        elif kind == "insert":
            out[at:at] = value
        elif kind == "delete":
            del out[at:at + value[0] % 16 + 1]
        elif kind == "truncate":
            del out[at:]
        else:  # cut a marker segment out (from a marker to the next one)
            start = out.find(b"\xff", at)
            end = out.find(b"\xff", start + 2) if start >= 0 else -1
            if start >= 0 and end > start:
                del out[start:end]
    return bytes(out)


def reference(data: bytes, geom: Geometry) -> np.ndarray | None:
    """Pillow's pixels, or None where Pillow (or the pixel limit) refuses the file."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(data))
            if img.size[0] * img.size[1] > MAX_PIXELS:
                return None  # decode.max_image_pixels
            draft_for(img, geom)
            img.load()
            return resize_then_crop(img, geom)
    except Exception:  # Pillow's refusals: OSError, SyntaxError, ValueError, ...
        return None


def decode(data: bytes, side: int) -> tuple[np.ndarray | None, str]:
    dec = Decoder(DecodeConfig(resolution=side, caption_modality=None,
                               max_image_pixels=MAX_PIXELS), seed=1, on_error="skip",
                  log_skips=False)
    row = {"image": [data], ext_column("image"): ["jpg"], "__sid__": [0], "__index__": [0],
           "__shard__": ["fuzz.tar"], "__key__": ["k0"]}
    out = dec(row)
    err = str(out["__error__"][0])
    return (None if err else np.asarray(out["image"][0])), err


@fuzz_settings(ci_examples=1000)
@given(data=jpegs(), mutations=st.lists(mutation, max_size=3), side=st.integers(8, 128))
def test_decoded_pixels_are_pillows_or_a_refusal(data, mutations, side):
    raw = mutate(data, mutations)
    geom = Geometry(side, side, "center")
    saved = Image.MAX_IMAGE_PIXELS  # the Decoder sets Pillow's global limit
    try:
        with within(20, "Decoder"):
            got, err = decode(raw, side)
            want = reference(raw, geom)
    finally:
        Image.MAX_IMAGE_PIXELS = saved
    if got is None:
        assert err and "\n" not in err, err
        tally("JPEG decode vs Pillow", "refused" if want is None
              else "refused (Pillow decodes)")
        return
    assert want is not None, ("pixels where Pillow refuses", raw[:64])
    assert got.shape == want.shape and np.array_equal(got, want), (got.shape, want.shape)
    tally("JPEG decode vs Pillow", "same pixels")
