"""ray_ingest.decode.jpeg decodes JPEGs without Image.open, and must give Image.open's bytes."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from ray_ingest.config import DecodeConfig
from ray_ingest.decode import jpeg
from ray_ingest.decode.augment import (
    Geometry,
    draft_for,
)
from ray_ingest.decode.decoder import Decoder
from ray_ingest.twintar.twin import ext_column


def _image(w: int, h: int, seed: int) -> Image.Image:
    """Smooth gradients plus noise: compresses like a photo, exercises every DCT band."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w, 1), y * 255 // max(h, 1), (x + y) % 256], -1)
    noise = rng.integers(-40, 40, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def _jpeg(img: Image.Image, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **{"quality": 90, **options})
    return buf.getvalue()


def _pillow(data: bytes, geom: Geometry) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    draft_for(img, geom)
    img.load()
    return np.asarray(img)


SAVES = ({}, {"subsampling": 0}, {"subsampling": 1}, {"progressive": True},
         {"restart_marker_blocks": 3}, {"optimize": True, "quality": 40})


def test_the_fast_path_gives_pillows_bytes_at_every_scale():
    rnd = random.Random(0)
    scales = set()
    for i in range(60):
        w, h = rnd.randint(1, 700), rnd.randint(1, 700)
        data = _jpeg(_image(w, h, i), **SAVES[i % len(SAVES)])
        side = rnd.choice([1, 8, 33, 64, 224])
        geom = Geometry(rnd.choice([side, 17]), side, rnd.choice(["center", "random"]))
        got = jpeg.decode(data, geom, None)
        assert got is not None, (w, h, SAVES[i % len(SAVES)])
        want = _pillow(data, geom)
        assert np.array_equal(np.asarray(got), want), (w, h, geom, SAVES[i % len(SAVES)])
        scales.add(w // got.size[0] if got.size[0] > 1 else None)
    assert {1, 2, 4, 8} <= scales  # full size and every DCT scale were covered


def test_exif_icc_and_comments_do_not_matter():
    img = _image(120, 90, 1)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: neither path rotates
    data = _jpeg(img, exif=exif.tobytes(), icc_profile=b"\0" * 300, comment=b"hello")
    geom = Geometry(40, 40)
    assert np.array_equal(np.asarray(jpeg.decode(data, geom, None)), _pillow(data, geom))


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_other_component_counts_take_pillows_path(mode):
    data = _jpeg(_image(64, 48, 2).convert(mode))
    assert jpeg.header(data) is None
    assert jpeg.decode(data, Geometry(16, 16), None) is None


def test_not_a_jpeg_or_a_malformed_header_takes_pillows_path():
    png = io.BytesIO()
    _image(20, 20, 3).save(png, "PNG")
    data = _jpeg(_image(64, 48, 3))
    sof = data.index(b"\xff\xc0")
    for bad in (png.getvalue(), b"", b"\xff\xd8", data[:sof + 5],  # cut inside the frame header
                data[:2] + b"\x00" + data[3:],  # no marker after SOI
                data[:sof + 4] + b"\x0c" + data[sof + 5:],  # 12-bit samples
                data[:sof + 5] + b"\x00\x00" + data[sof + 7:]):  # height 0 (a DNL file)
        assert jpeg.decode(bad, Geometry(16, 16), None) is None


def test_a_multi_picture_file_takes_pillows_path():
    buf = io.BytesIO()
    _image(64, 48, 4).save(buf, "MPO", save_all=True, append_images=[_image(64, 48, 5)])
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO"  # which draft_for leaves alone
    assert jpeg.header(data) is None


def test_truncated_and_oversized_images_take_pillows_path():
    data = _jpeg(_image(300, 200, 6))
    assert jpeg.decode(data[:len(data) // 2], Geometry(32, 32), None) is None
    assert jpeg.decode(data, Geometry(32, 32), 300 * 200 - 1) is None
    assert jpeg.decode(data, Geometry(32, 32), 300 * 200) is not None


def test_the_probe_accepts_the_installed_pillow():
    assert jpeg.usable()


def _rows(datas: list[bytes]) -> dict[str, list]:
    n = len(datas)
    return {"image": datas, ext_column("image"): ["jpg"] * n, "caption": [b'{"prompt": "x"}'] * n,
            ext_column("caption"): ["json"] * n, "__sid__": [0] * n, "__index__": list(range(n)),
            "__shard__": ["s"] * n, "__key__": [f"k{i}" for i in range(n)]}


@pytest.mark.parametrize("crop", ["center", "random"])
def test_the_decoder_gives_the_same_rows_and_errors_with_and_without_it(monkeypatch, crop):
    good = [_jpeg(_image(200 + 37 * i, 150 + 11 * i, i), **SAVES[i % len(SAVES)])
            for i in range(8)]
    datas = [*good, good[0][:3000], _jpeg(_image(50, 50, 9).convert("L"))]
    dec = Decoder(DecodeConfig(resolution=64, crop=crop), seed=3, on_error="skip",
                  log_skips=False)
    fast = dec(_rows(datas))
    monkeypatch.setattr(jpeg, "usable", lambda: False)
    slow = dec(_rows(datas))
    assert fast.keys() == slow.keys()
    for col in fast:
        assert np.array_equal(fast[col], slow[col]) or col == "__t_decode__", col
    assert "truncated" in str(fast["__error__"][8])
