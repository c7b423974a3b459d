"""``decode.resizer: torch``: the placement's resize done by torch's antialiased bilinear on
uint8 (the kernel torchvision's ``Resize`` runs on tensors), instead of Pillow's.

Why: resampling is most of a CPU decode (56 % of a decode actor's time at 512 px, two thirds at
4K: docs/benchmarks.md) and Pillow's resampler is scalar C; torch's uint8 kernel is vectorized
(AVX2) when the image is in channels-last order, which a decoded HWC array already is: 2.6x
faster at 685x385 -> 455x256, 3.8x at 3840x2160 -> 2048x1152 (one thread). The price: the
pixels are not Pillow's bit for bit (its fixed-point coefficients have other precision: at
most 2 apart, 0.07 % of values on the throughput bench's photos). They depend neither on the
thread count nor on the kernel torch picks for the CPU (``ATEN_CPU_CAPABILITY`` default, avx2
and avx512 give the same bytes: tests/decode/test_resize_torch.py); without AVX2 it is slower
than Pillow (6.6 ms against ~2.4 ms at 685x385). So the default stays ``pillow`` (the goldens
are Pillow's bytes); this is for jobs that want the decode CPU back more than Pillow's exact
bytes. Torch is imported here on the first call (a Decoder imports it when built). No Ray.
"""

from __future__ import annotations

import numpy as np

from ray_ingest.decode.augment import oriented
from ray_ingest.decode.geometry import Placement


def render_torch(arr: np.ndarray, p: Placement) -> np.ndarray:
    """A uint8 image (H, W), (H, W, 3) or padded (H, W, 4, the 4th byte ignored) decoded at
    ``p.decoded``, resized to ``p.cover`` by torch, cropped to ``p.box`` and flipped as ``p``
    says: uint8, contiguous, (H, W) or (H, W, 3)."""
    import torch

    grey = arr.ndim == 2
    if not grey and arr.shape[2] == 4:
        arr = arr[..., :3]
    h, w = arr.shape[:2]
    if p.cover != (w, h):
        planes = np.ascontiguousarray(arr[..., None] if grey else arr)
        if not planes.flags.writeable:  # torch warns on read-only memory (it only reads it)
            planes = planes.copy()
        # (1, C, H, W) over the HWC memory: channels-last, the layout of the fast kernel
        t = torch.from_numpy(planes).permute(2, 0, 1).unsqueeze(0)
        out = torch.nn.functional.interpolate(t, size=p.cover[::-1], mode="bilinear",
                                              antialias=True, align_corners=False)
        arr = out[0].permute(1, 2, 0).numpy()
        if grey:
            arr = arr[..., 0]
    left, top, right, bottom = p.box
    kept = arr[top:bottom, left:right]
    return oriented(kept, p.flip)
