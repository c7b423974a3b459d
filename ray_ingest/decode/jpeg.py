"""JPEG decoding with simplejpeg (libjpeg-turbo): Pillow's pixels, faster, without the GIL.

Why: ``Image.open`` + ``draft`` + ``load`` parses every marker segment in Python and decodes
with the GIL held part of the time; simplejpeg decodes from the bytes straight into a numpy
array in C with the GIL released, and scales in the DCT domain while decoding. Both libraries
run libjpeg-turbo's decoder with the same settings (accurate integer IDCT, fancy upsampling),
so for the JPEGs taken here the pixels are Pillow's, bit for bit (tests/decode/test_jpeg.py;
the goldens): 8-bit YCbCr, greyscale or RGB JPEGs, baseline or progressive, that are not
multi-picture files (Pillow opens those as MPO and does not draft them), decoded at the DCT
reduction Pillow's ``draft`` picks (:func:`ray_ingest.decode.geometry.draft_scale`).

Everything else returns None and takes Pillow's path, so unusual files and corrupt ones come
out exactly as before: CMYK/YCCK, 12-bit, arithmetic-coded, multi-picture, images over the
decompression-bomb limit, and anything libjpeg warns about (``strict``: Pillow decodes some of
those, with its own messages). No Ray, no torch.
"""

from __future__ import annotations

import attrs
import numpy as np
import simplejpeg

from ray_ingest.decode.geometry import scaled

#: Colour spaces whose RGB pixels simplejpeg gives exactly as Pillow does.
_TAKEN = frozenset({"YCbCr", "Gray", "RGB"})
#: The APP2 tag of a multi-picture (MPF) segment: Pillow's MPO path, never drafted.
_MPF = b"MPF\x00"
#: Smallest side of a DCT-scaled output taken here: below it (thumbnails, never training
#: images) the two libraries' builds were seen to differ (5x5 at 1/4: tests/decode/test_jpeg.py).
MIN_SCALED = 4
#: libjpeg-turbo's reductions below 1 (eighths), which simplejpeg chooses among.
_EIGHTHS = range(1, 8)


@attrs.frozen
class Header:
    """What libjpeg-turbo reads from a JPEG's header."""

    #: (width, height).
    size: tuple[int, int]
    colorspace: str
    #: simplejpeg decodes it to Pillow's pixels (see module docstring).
    simple: bool


def header(data: bytes) -> Header | None:
    """The JPEG's size and colour space (None: libjpeg-turbo cannot read its header)."""
    try:
        h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, RuntimeError, KeyError):
        return None
    if w <= 0 or h <= 0:
        return None
    return Header((w, h), colorspace, colorspace in _TAKEN and not _maybe_multi_picture(data))


#: Marker segments looked at before the answer is "maybe" (a real header has a dozen).
_MAX_SEGMENTS = 256


def _maybe_multi_picture(data: bytes) -> bool:
    """Whether the JPEG may carry a multi-picture (MPF) segment, which Pillow opens as MPO.

    Walks the marker segments before the first scan (their lengths only: a few steps, where
    searching the whole file costs ~1.5 ms at 4K) and answers True for an APP2 ``MPF`` segment
    and for anything unexpected, so a wrong answer can only send a file to Pillow's path."""
    i, n = 2, len(data)
    for _ in range(_MAX_SEGMENTS):
        if i + 4 > n or data[i] != 0xFF:
            return True
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xDA:  # start of scan: the header is over
            return False
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if length < 2 or marker in (0x00, 0x01) or 0xD0 <= marker <= 0xD9:
            return True
        if marker == 0xE2 and data[i + 4:i + 8] == _MPF:
            return True
        i += 2 + length
    return True


def decode(data: bytes, hdr: Header, scale: int, max_pixels: int | None,
           padded: bool = False) -> np.ndarray | None:
    """uint8 RGB (H, W, 3) at DCT reduction ``scale``, the pixels ``Image.open(data)`` +
    ``draft`` + ``load`` + ``convert("RGB")`` give; None where this path does not apply (then use
    Pillow's, which raises what it raises). ``padded``: (H, W, 4), each pixel followed by a byte
    of no meaning, the layout Pillow keeps an RGB image in (so it maps the array, uncopied:
    ``ray_ingest.decode.decoder``); libjpeg-turbo writes it as fast."""
    w, h = hdr.size
    if not hdr.simple or (max_pixels is not None and w * h > max_pixels):
        return None
    out_w, out_h = scaled(hdr.size, scale)
    if scale > 1 and (min(out_w, out_h) < MIN_SCALED or
                      _ambiguous(hdr.size, (out_w, out_h), 8 // scale)):
        return None
    try:
        img = simplejpeg.decode_jpeg(data, "RGBX" if padded else "RGB",
                                     min_height=out_h if scale > 1 else 0,
                                     min_width=out_w if scale > 1 else 0, strict=True)
    except (ValueError, RuntimeError):
        return None
    if img.shape != (out_h, out_w, 4 if padded else 3):  # not Pillow's reduction: its path
        return None
    return img


def _ambiguous(size: tuple[int, int], out: tuple[int, int], eighths: int) -> bool:
    """simplejpeg takes the largest reduction whose output is at least the size asked for: a
    smaller factor than ``eighths``/8 that gives the same rounded size (tiny images) would
    decode other pixels than Pillow's."""
    w, h = size
    return any(-(-w * m // 8) >= out[0] and -(-h * m // 8) >= out[1]
               for m in _EIGHTHS if m < eighths)
