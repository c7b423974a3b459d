"""ray_ingest.decode.jpeg decodes JPEGs with simplejpeg, and must give Pillow's bytes.

The reference is what the loader did before (and what a user's Pillow code does):
``Image.open`` + ``draft`` (the DCT reduction for the output) + ``load`` + ``convert("RGB")``.
"""

from __future__ import annotations

import io
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ray_ingest.config import DecodeConfig
from ray_ingest.decode import jpeg
from ray_ingest.decode.augment import draft_for
from ray_ingest.decode.decoder import Decoder
from ray_ingest.decode.geometry import Geometry, draft_scale, scaled
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
    return np.asarray(img.convert("RGB"))


def _fast(data: bytes, geom: Geometry) -> np.ndarray | None:
    hdr = jpeg.header(data)
    if hdr is None:
        return None
    return jpeg.decode(data, hdr, draft_scale(hdr.size, geom), None)


SAVES = ({}, {"subsampling": 0}, {"subsampling": 1}, {"progressive": True},
         {"restart_marker_blocks": 3}, {"optimize": True, "quality": 40})


def test_simplejpeg_gives_pillows_bytes_at_every_scale():
    rnd = random.Random(0)
    scales = set()
    for i in range(80):
        w, h = rnd.randint(1, 700), rnd.randint(1, 700)
        img = _image(w, h, i)
        if i % 9 == 0:
            img = img.convert("L")
        data = _jpeg(img, **SAVES[i % len(SAVES)])
        side = rnd.choice([1, 8, 33, 64, 224])
        geom = Geometry(rnd.choice([side, 17]), side, rnd.choice(["center", "random"]))
        got = _fast(data, geom)
        want = _pillow(data, geom)
        if got is None:  # only tiny images, whose reduction simplejpeg could pick otherwise
            assert min(w, h) < 16, (w, h, geom)
            continue
        assert got.dtype == np.uint8 and np.array_equal(got, want), (w, h, geom, i)
        scales.add(w // got.shape[1] if got.shape[1] > 1 else None)
    assert {1, 2, 4, 8} <= scales  # full size and every DCT scale were covered


def test_tiny_images_never_take_another_reduction():
    """simplejpeg picks the largest reduction that reaches the size asked for; for tiny images
    a smaller factor can reach the same rounded size with other pixels: Pillow's path then."""
    taken = declined = 0
    for w in range(1, 40):
        for h in (1, 2, 3, 5, 9, 17):
            data = _jpeg(_image(w, h, w * 100 + h))
            for side in (1, 2, 3):
                geom = Geometry(side, side)
                got = _fast(data, geom)
                if got is None:
                    declined += 1
                    continue
                taken += 1
                assert np.array_equal(got, _pillow(data, geom)), (w, h, side)
    assert taken > 100 and declined > 0


def test_exif_icc_and_comments_do_not_matter():
    img = _image(120, 90, 1)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: neither path rotates (the stored pixels, docs/decode)
    data = _jpeg(img, exif=exif.tobytes(), icc_profile=b"\0" * 300, comment=b"hello")
    geom = Geometry(40, 40)
    assert np.array_equal(_fast(data, geom), _pillow(data, geom))


def test_cmyk_takes_pillows_path():
    data = _jpeg(_image(64, 48, 2).convert("CMYK"))
    hdr = jpeg.header(data)
    assert hdr is not None and not hdr.simple
    assert jpeg.decode(data, hdr, 1, None) is None


def test_not_a_jpeg_or_a_malformed_header_takes_pillows_path():
    png = io.BytesIO()
    _image(20, 20, 3).save(png, "PNG")
    data = _jpeg(_image(64, 48, 3))
    sof = data.index(b"\xff\xc0")
    for bad in (png.getvalue(), b"", b"\xff\xd8", data[:sof + 5],  # cut inside the frame header
                data[:2] + b"\x00" + data[3:],  # no marker after SOI
                data[:sof + 5] + b"\x00\x00" + data[sof + 7:]):  # height 0 (a DNL file)
        assert _fast(bad, Geometry(16, 16)) is None


def test_twelve_bit_samples_take_pillows_path():
    data = _jpeg(_image(64, 48, 3))
    sof = data.index(b"\xff\xc0")
    bad = data[:sof + 4] + b"\x0c" + data[sof + 5:]
    assert _fast(bad, Geometry(16, 16)) is None


def test_a_multi_picture_file_takes_pillows_path():
    buf = io.BytesIO()
    _image(64, 48, 4).save(buf, "MPO", save_all=True, append_images=[_image(64, 48, 5)])
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == "MPO"  # which draft_for leaves alone
    hdr = jpeg.header(data)
    assert hdr is not None and not hdr.simple


def test_truncated_and_oversized_images_take_pillows_path():
    data = _jpeg(_image(300, 200, 6))
    hdr = jpeg.header(data)
    assert jpeg.decode(data[:len(data) // 2], hdr, 1, None) is None
    assert jpeg.decode(data, hdr, 1, 300 * 200 - 1) is None
    assert jpeg.decode(data, hdr, 1, 300 * 200) is not None
    assert jpeg.decode(data, hdr, 2, None).shape == (*scaled((300, 200), 2)[::-1], 3)


def test_no_private_pillow_internals_are_used():
    src = pathlib.Path(jpeg.__file__).parent
    text = "\n".join(p.read_text() for p in src.glob("*.py"))
    for private in ("jpeg_decoder", "Image.Image()._new", "core.new("):
        assert private not in text


def _rows(datas: list[bytes]) -> dict[str, list]:
    n = len(datas)
    return {"image": datas, ext_column("image"): ["jpg"] * n, "caption": [b'{"prompt": "x"}'] * n,
            ext_column("caption"): ["json"] * n, "__sid__": [0] * n, "__index__": list(range(n)),
            "__shard__": ["s"] * n, "__key__": [f"k{i}" for i in range(n)]}


@pytest.mark.parametrize("crop", ["center", "random"])
def test_the_decoder_gives_the_same_rows_and_errors_with_and_without_it(monkeypatch, crop):
    good = [_jpeg(_image(200 + 37 * i, 150 + 11 * i, i), **SAVES[i % len(SAVES)])
            for i in range(8)]
    cmyk = _jpeg(_image(90, 70, 10).convert("CMYK"))
    datas = [*good, good[0][:3000], _jpeg(_image(50, 50, 9).convert("L")), cmyk]
    dec = Decoder(DecodeConfig(resolution=64, crop=crop, flip=crop == "random"), seed=3,
                  on_error="skip", log_skips=False)
    calls = []
    real = jpeg.decode
    monkeypatch.setattr(jpeg, "decode", lambda *a: calls.append(1) or real(*a))
    fast = dec(_rows(datas))
    assert len(calls) >= 9
    monkeypatch.setattr(jpeg, "decode", lambda *a: None)
    slow = dec(_rows(datas))
    assert fast.keys() == slow.keys()
    for col in fast:
        assert np.array_equal(fast[col], slow[col]) or col == "__t_decode__", col
    assert "truncated" in str(fast["__error__"][8])
    assert not any(fast["__error__"][i] for i in (0, 9, 10))


def test_a_padded_decode_is_the_rgb_decode_with_a_fourth_byte():
    rnd = random.Random(1)
    taken = 0
    for i in range(30):
        img = _image(rnd.randint(16, 500), rnd.randint(16, 500), i)
        if i % 5 == 0:
            img = img.convert("L")
        data = _jpeg(img, **SAVES[i % len(SAVES)])
        hdr = jpeg.header(data)
        for scale in (1, 2):
            rgb = jpeg.decode(data, hdr, scale, None)
            padded = jpeg.decode(data, hdr, scale, None, True)
            if rgb is None:
                assert padded is None
                continue
            taken += 1
            assert padded.shape == (*rgb.shape[:2], 4) and padded.dtype == np.uint8
            assert np.array_equal(padded[..., :3], rgb), (i, scale)
    assert taken >= 50


@pytest.mark.parametrize("crop", ["center", "random"])
def test_mapped_padded_decodes_render_the_same_bytes(monkeypatch, crop):
    """Pillow maps a padded decode (Image.fromarrow) where a resize follows: the rows are those
    of the RGB decode copied into a Pillow image, grey JPEGs, DCT scales and flips included."""
    from ray_ingest.decode import decoder as decoder_module

    if not decoder_module._MAPS_PADDED:
        pytest.skip("Pillow < 11.2: no Image.fromarrow, padded decodes are not taken")
    datas = [_jpeg(_image(200 + 97 * i, 150 + 61 * i, i), **SAVES[i % len(SAVES)])
             for i in range(10)]
    datas.append(_jpeg(_image(300, 180, 11).convert("L")))
    dec = Decoder(DecodeConfig(resolution=96, crop=crop, flip=crop == "random"), seed=5)
    padded = []
    real = jpeg.decode
    monkeypatch.setattr(jpeg, "decode", lambda *a: padded.append(a[4:] == (True,)) or real(*a))
    mapped = dec(_rows(datas))
    assert sum(padded) >= 8  # most samples resize after the decode
    monkeypatch.setattr(decoder_module, "_MAPS_PADDED", False)
    copied = dec(_rows(datas))
    for col in mapped:
        assert np.array_equal(mapped[col], copied[col]) or col == "__t_decode__", col


def test_decoding_imports_no_pandas():
    """A decode process's first resized JPEG imports nothing heavy: building the Arrow array
    Pillow maps with ``pa.array`` imported pandas (~0.13 s of CPU in every decode process's
    first call, seconds of wall time while a job's ranks start on the same cores)."""
    code = (
        "import io, sys\n"
        "import numpy as np\n"
        "from PIL import Image\n"
        "from ray_ingest.config import DecodeConfig\n"
        "from ray_ingest.decode.decoder import Decoder\n"
        "buf = io.BytesIO()\n"
        "Image.fromarray(np.arange(300 * 200 * 3, dtype=np.uint8).reshape(200, 300, 3))"
        ".save(buf, 'JPEG')\n"
        "from ray_ingest.twintar.twin import ext_column\n"
        "rows = {'image': [buf.getvalue()], ext_column('image'): ['jpg'],\n"
        "        'caption': [b'{\"prompt\": \"x\"}'], ext_column('caption'): ['json'],\n"
        "        '__sid__': [0],\n"
        "        '__index__': [0], '__shard__': ['s'], '__key__': ['k']}\n"
        "out = Decoder(DecodeConfig(resolution=96), seed=5)(rows)\n"
        "assert out['image'].shape == (1, 96, 96, 3), out['image'].shape\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pandas', 'ray', 'torch'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=pathlib.Path(__file__).resolve().parents[2]).stdout
    assert out.splitlines()[-1] == "[]"
