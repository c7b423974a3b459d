"""JPEG decoding that skips Pillow's Python-level file parsing; the same bytes as ``Image.open``.

Why: decode threads (``decode.compute: threads``) run in parallel only while Pillow's C code
has let go of the GIL. ``Image.open`` + ``load`` spend ~0.15 ms per image holding it (the JPEG
plugin parses every marker segment in Python, then ``ImageFile.load`` sets up the decoder), the
largest share of the GIL a decode thread holds; while one thread holds it, the others wait and
a core idles. For the common case (an 8-bit, 3-component baseline, extended or progressive JPEG
that is not a multi-picture file) :func:`decode` reads the frame size from the header itself
and hands the whole member to the same libjpeg decoder with the arguments ``Image.open``,
``Image.draft`` and ``load`` would give it. Anything else, and any member the decoder does not
finish cleanly, returns None: the caller takes Pillow's own path, so unusual files and errors
come out exactly as before. :func:`usable` checks once per process that both paths give the
same bytes on probe images, as :func:`ray_ingest.decode.augment.pass_order` does for the
resize. Pure Pillow (no Ray, no torch).
"""

from __future__ import annotations

import functools
import io
import logging

import numpy as np
from PIL import Image

from ray_ingest.decode.augment import (
    Geometry,
    draft_for,
    draft_size,
)

log = logging.getLogger(__name__)

#: Start-of-frame markers handled here: baseline, extended sequential, progressive (Huffman).
_SOF = frozenset({0xC0, 0xC1, 0xC2})
#: Any other start-of-frame (lossless, hierarchical, arithmetic): Pillow's path.
_OTHER_SOF = frozenset(range(0xC3, 0xD0)) - {0xC4, 0xC8, 0xCC}


def header(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a JPEG this module decodes, else None.

    Walks the marker segments up to the first scan: exactly one handled frame header with
    8-bit samples and 3 components, no multi-picture (MPF) segment, nothing malformed.
    """
    if data[:3] != b"\xff\xd8\xff":
        return None
    size = None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xDA:  # start of scan: the header is complete
            return size
        if marker in (0x00, 0x01) or 0xD0 <= marker <= 0xD9:  # no segment here: malformed
            return None
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if length < 2 or i + 2 + length > n:
            return None
        if marker in _SOF:
            if size is not None or length < 8 or data[i + 4] != 8 or data[i + 9] != 3:
                return None
            h = int.from_bytes(data[i + 5:i + 7], "big")
            w = int.from_bytes(data[i + 7:i + 9], "big")
            if w == 0 or h == 0:
                return None
            size = (w, h)
        elif marker in _OTHER_SOF or marker == 0xE2 and data[i + 4:i + 8] == b"MPF\x00":
            return None
        i += 2 + length
    return None


def _scale(size: tuple[int, int], geom: Geometry) -> int:
    """The DCT scale ``Image.draft`` picks for the request of
    :func:`ray_ingest.decode.augment.draft_for`."""
    request = draft_size(size, geom)
    if request is None:
        return 1
    q = min(size[0] // request[0], size[1] // request[1])
    return next(s for s in (8, 4, 2, 1) if q >= s)


def decode(data: bytes, geom: Geometry, max_pixels: int | None) -> Image.Image | None:
    """The RGB image ``Image.open(data)`` + ``draft_for(img, geom)`` + ``load()`` give, or None
    where this fast path does not apply (then use Pillow's path, which raises what it raises).

    Images over ``max_pixels`` also return None: Pillow's path refuses them with its messages.
    """
    size = header(data)
    if size is None or (max_pixels is not None and size[0] * size[1] > max_pixels):
        return None
    s = _scale(size, geom)
    out = ((size[0] + s - 1) // s, (size[1] + s - 1) // s)
    core = Image.core.new("RGB", out)
    args = ("RGB", "RGB", "") if s == 1 else ("RGB", "RGB", "", s, 0)
    decoder = Image.core.jpeg_decoder(*args)
    try:
        decoder.setimage(core, (0, 0, *out))
        consumed, err = decoder.decode(data)  # releases the GIL while libjpeg runs
    finally:
        decoder.cleanup()
    if consumed >= 0 or err < 0:  # wants more data (truncated) or failed: Pillow's path
        return None
    return Image.Image()._new(core)


def _pillow(data: bytes, geom: Geometry) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    draft_for(img, geom)
    img.load()
    return np.asarray(img)


@functools.cache
def usable() -> bool:
    """Whether :func:`decode` gives Pillow's bytes with the installed Pillow (checked once).

    Probes: noise images saved with 4:2:0 and 4:4:4 subsampling, progressive, with restart
    markers, decoded at full size and DCT-scaled by 2, 4 and 8.
    """
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (70, 93, 3), dtype=np.uint8))
    saves = ({"subsampling": 2}, {"subsampling": 0}, {"progressive": True},
             {"restart_marker_rows": 1})
    geoms = (Geometry(60, 60), Geometry(30, 30), Geometry(16, 10), Geometry(8, 8))
    try:
        for options in saves:
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=90, **options)
            data = buf.getvalue()
            for geom in geoms:
                fast = decode(data, geom, None)
                if fast is None or not np.array_equal(np.asarray(fast), _pillow(data, geom)):
                    log.warning("Pillow %s: JPEGs are opened by Image.open (the fast path's "
                                "probe differs)", Image.__version__)
                    return False
    except Exception:  # a Pillow without these internals
        log.warning("Pillow %s: JPEGs are opened by Image.open (the fast path's probe failed)",
                    Image.__version__, exc_info=True)
        return False
    return True
