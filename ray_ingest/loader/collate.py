"""Conversion to torch: a batch's numpy columns -> a :class:`Batch` on the device.

Every field of the rows (every listed modality and every field a hook added) is in
``Batch.data`` under its name: arrays of one shape and dtype (per batch, i.e. per bucket) and
numbers become tensors, pinned and copied with ``non_blocking`` when the device is a GPU;
anything else (text, JSON documents, bytes, arrays of varying shapes) stays a Python list
(the default Ray collate fails on strings, ray_notes §7). Optional modalities carry presence
(``Batch.present``). With ``decode.device: cuda`` the primary image arrives as JPEG bytes and
placements, which the loader's device decoder turns into a tensor before the batch is handed
out (:mod:`ray_ingest.loader.device_decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ray_ingest.columns import BOOKKEEPING, INDEX, KEY, PAD, PLACEMENT, PROVENANCE, SEQ, SID
from ray_ingest.config import DecodeConfig

#: Columns that are not sample fields.
NOT_FIELDS = frozenset({*PROVENANCE, *BOOKKEEPING, SEQ, PLACEMENT})


@attrs.define
class Batch:
    """One training batch: tensors (on the device) plus per-sample provenance."""

    data: dict[str, Any]
    #: Sample keys (``__key__``), one per row.
    sample_keys: list[str]
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
    #: Per optional modality (``data.optional_modalities``): which rows have it.
    present: dict[str, list[bool]] = attrs.field(factory=dict)
    #: ``decode.device: cuda``: the CUDA event of the GPU decode the train loop's stream waits
    #: for before using the batch (ray_ingest.loader.device_decode.handover).
    ready: Any = attrs.field(default=None, repr=False, eq=False)

    def __getitem__(self, name: str) -> Any:
        return self.data[name]


def on_accelerator(device: Any) -> bool:
    return device is not None and getattr(device, "type", str(device)) != "cpu"


def stackable(col: np.ndarray, out: Any = None) -> np.ndarray | None:
    """The column as one numeric array (rows stacked, into ``out`` when given one of the
    right shape and dtype), or None where it is not one: an object column of arrays of one
    shape and dtype, or of plain numbers, is stacked."""
    if col.dtype != object:
        return col
    values = list(col)
    if not values:
        return None
    first = values[0]
    if isinstance(first, np.ndarray) and first.dtype != object and all(
            isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype
            for v in values):
        if out is not None:
            return np.stack(values, out=out(len(values), first.shape, first.dtype))
        return np.stack(values)
    if all(isinstance(v, (bool, int, float, np.number, np.bool_)) for v in values):
        return np.asarray(values)
    return None


def _pinned(n: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A page-locked array for a batch (torch's caching host allocator reuses freed ones)."""
    import torch

    t = torch.empty((n, *shape), dtype=torch.from_numpy(np.empty(0, dtype)).dtype,
                    pin_memory=True)
    return t.numpy()


def to_tensor(arr: np.ndarray, device: Any) -> Any:
    """A numeric array as a tensor on ``device`` (through pinned memory to a GPU)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(arr))
    if on_accelerator(device):
        if not t.is_pinned():
            t = t.pin_memory()
        t = t.to(device, non_blocking=True)
    return t


def to_batch(cols: dict[str, np.ndarray], cfg: DecodeConfig, device: Any, *, bucket: str,
             epoch: int, step: int, optional: Sequence[str] = (),
             skip: Sequence[str] = ()) -> Batch:
    """Tensors for the stackable fields, lists for the rest (see module docstring).

    ``skip``: fields left out of ``data`` (the device decoder fills them in).
    """
    data: dict[str, Any] = {}
    for name, col in cols.items():
        if name in NOT_FIELDS or name in skip or name == cfg.caption_modality:
            continue  # (the caption: strings, below)
        # rows of a GPU batch are stacked straight into pinned memory: one copy to the host
        # staging buffer, then the DMA (not a stack, a pin and the DMA)
        pin = _pinned if on_accelerator(device) and col.dtype == object else None
        arr = stackable(col, pin)
        if arr is not None and arr.dtype.kind in "biuf":
            data[name] = to_tensor(arr, device)
        else:
            data[name] = [_item(v) for v in col]
    captions = None
    if cfg.caption_modality is not None and cfg.caption_modality in cols:
        captions = [str(c) for c in cols[cfg.caption_modality]]
        data[cfg.caption_modality] = captions
    present = {m: [v is not None for v in cols[m]] for m in optional if m in cols}
    return Batch(
        data=data,
        sample_keys=[str(k) for k in cols[KEY]],
        captions=captions,
        sids=[int(s) for s in cols[SID]],
        indices=[int(i) for i in cols[INDEX]],
        pads=[bool(p) for p in cols[PAD]],
        bucket=bucket,
        epoch=epoch,
        step_in_epoch=step,
        present=present,
    )


def _item(v: Any) -> Any:
    """A list element as plain Python where it is a numpy scalar or string."""
    if isinstance(v, np.generic):
        return v.item()
    return v
