"""Conversion to torch: a batch's numpy columns -> a :class:`Batch` of tensors on the device.

Images (and fixed-shape embeddings) become tensors, pinned and copied with ``non_blocking``
when the device is a GPU; keys, captions and provenance stay Python lists (the default Ray
collate fails on strings, ray_notes §7).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ray_ingest.columns import INDEX, KEY, PAD, SID
from ray_ingest.config import DecodeConfig


@attrs.define
class Batch:
    """One training batch: tensors (on the device) plus per-sample provenance."""

    data: dict[str, Any]
    keys: list[str]
    captions: list[str] | None
    sids: list[int]
    indices: list[int]
    pads: list[bool]
    bucket: str
    epoch: int
    #: Batch number within the epoch (0-based), identical on every rank.
    step_in_epoch: int
    #: Samples skipped (on_error=skip) and accounted with this batch: (shard id, index, reason).
    skipped: list[tuple[int, int, str]] = attrs.field(factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.data[name]


def _on_accelerator(device: Any) -> bool:
    return device is not None and getattr(device, "type", str(device)) != "cpu"


def to_batch(cols: dict[str, np.ndarray], cfg: DecodeConfig, device: Any, *, bucket: str,
             epoch: int, step: int) -> Batch:
    """Tensors for the image (and fixed-shape embedding) columns; lists for the rest."""
    import torch

    data: dict[str, Any] = {}
    tensor_keys = [k for k in (cfg.image_key,) if k is not None]
    if cfg.embedding_key is not None and cols.get(cfg.embedding_key) is not None:
        emb = cols[cfg.embedding_key]
        if emb.dtype != object:
            tensor_keys.append(cfg.embedding_key)
        else:
            data[cfg.embedding_key] = list(emb)
    for k in tensor_keys:
        arr = cols[k]
        if arr.dtype == object:
            arr = np.stack(list(arr))
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if _on_accelerator(device):
            t = t.pin_memory().to(device, non_blocking=True)
        data[k] = t
    captions = None
    if cfg.caption_key is not None and cfg.caption_key in cols:
        captions = [str(c) for c in cols[cfg.caption_key]]
    return Batch(
        data=data,
        keys=[str(k) for k in cols[KEY]],
        captions=captions,
        sids=[int(s) for s in cols[SID]],
        indices=[int(i) for i in cols[INDEX]],
        pads=[bool(p) for p in cols[PAD]],
        bucket=bucket,
        epoch=epoch,
        step_in_epoch=step,
    )
