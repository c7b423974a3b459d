"""Decode stage: raw member bytes -> every listed modality decoded, one geometry per sample.

:class:`Decoder` is what every execution runs on a block of rows (decode actors, tasks, the
companion process, threads, the Ray Data engine). For each sample it decides the primary
image's :class:`~ray_ingest.decode.geometry.Placement` once, from the header and the sample's
seed, and applies it to every image-like modality of the sample (the primary image with its
filter, masks and depth maps nearest unless ``decode.resample`` says otherwise), decodes the
other members by their decoders (:mod:`ray_ingest.decode.modalities`), then runs the user hook
(:mod:`ray_ingest.decode.hook`). With ``decode.device: cuda`` the primary image is not decoded
here: its JPEG bytes travel with their placement and the trainer decodes them on its GPU.

It is stateless across blocks, so a restarted actor produces exactly what the dead one would
have. Formats that execute code when loaded (pickle, torch) are refused unless the config opts
in: a tar from the internet must not be able to run code on the training cluster.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from typing import Any

import numpy as np
import pyarrow as pa
from PIL import Image

from ray_ingest.columns import (
    ACTOR,
    BUCKET,
    BYTES,
    EPOCH,
    ERROR,
    INDEX,
    KEY,
    NODE,
    PAD,
    PLACEMENT,
    PROVENANCE,
    READ_NODE,
    SHARD,
    SID,
    T_DECODE,
    T_READ,
    ext_column,
)
from ray_ingest.config import DecodeConfig
from ray_ingest.decode import hook as hooks
from ray_ingest.decode import jpeg
from ray_ingest.decode.augment import (
    draft_for,
    oriented,
    pass_order,
    render,
    render_array,
    resamples_as_image,
)
from ray_ingest.decode.geometry import (
    Geometry,
    Placement,
    bucket_shape,
    map_size,
    parse_bucket,
    place,
    sample_seed,
)
from ray_ingest.decode.memory import keep_freed_memory
from ray_ingest.decode.modalities import (  # noqa: F401 - re-exported (tests, notebook)
    CAPTION_FIELDS,
    IMAGE_EXTS,
    IMAGE_SPECS,
    UNSAFE_EXTS,
    SampleError,
    as_mode,
    caption_text,
    decode_value,
    load_array,
    open_image,
    spec_for,
)
from ray_ingest.decode.resize_torch import render_torch
from ray_ingest.errors import IngestError, UnsafeFormatError
from ray_ingest.metrics import running_ray

log = logging.getLogger(__name__)

#: Columns carried through decode unchanged.
PASSTHROUGH = (*PROVENANCE, T_READ, BYTES, READ_NODE)
DECODE_TIME = T_DECODE
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: Failures of one sample: recorded skips under ``on_error: skip``.
SAMPLE_ERRORS = (SampleError, UnsafeFormatError, OSError, ValueError, SyntaxError, EOFError,
                 Image.DecompressionBombError, Image.DecompressionBombWarning,
                 UnicodeDecodeError)
#: Skip reasons of samples a hook dropped (returned None): counted, outside the error budgets
#: (ray_ingest.loader.skips).
FILTERED = "filtered"


class HookError(SampleError):
    """The user hook failed on a sample (the message names the hook)."""


class Filtered(Exception):
    """The user hook returned None: skip the sample (not an error)."""


def sim_cost(cfg: DecodeConfig, seed: int, sid: int, index: int) -> float:
    """Seconds sample (``sid``, ``index``) sleeps under ``decode.sim_cost_s`` (benchmarks only):
    the base cost, varied by up to ``sim_cost_jitter`` of it either way by a hashlib draw of
    (seed, shard, index), so a run's costs do not depend on which decoder took the sample."""
    if not cfg.sim_cost_s:
        return 0.0
    if not cfg.sim_cost_jitter:
        return cfg.sim_cost_s
    digest = hashlib.sha256(f"ray_ingest:sim_cost:{seed}:{sid}:{index}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64  # [0, 1)
    return cfg.sim_cost_s * (1.0 + cfg.sim_cost_jitter * (2.0 * u - 1.0))


def prepare_process() -> None:
    """The one-off work of a process that decodes, done where it starts (a decode worker, a
    loader being built) rather than on its first sample: the resize's pass-order probe (~5 ms
    of CPU; more when many ranks start at once on a busy node, bench/scale_out.py part 3)."""
    pass_order()


def modalities_of(names) -> list[str]:
    """The modalities of a block: every column with an extension column beside it."""
    present = set(names)
    return [n for n in names if ext_column(n) in present]


class Decoder:
    """Callable on a block of rows (Arrow table or Python column lists): decoded numpy columns.

    Args:
        cfg: the decode settings.
        seed: the run seed (crops, flips, the hook's RNG).
        epoch: seeds rows without an ``__epoch__`` column (cat, tests).
        on_error: ``raise`` or ``skip`` (a failed sample becomes a recorded skip).
        log_skips: False where the loader's skip filter logs every skip (same process).
    """

    def __init__(self, cfg: DecodeConfig, seed: int = 0, epoch: int = 0, on_error: str = "raise",
                 log_skips: bool = True):
        prepare_process()
        self.cfg = cfg
        self.log_skips = log_skips
        self.seed = seed
        self.epoch = epoch
        self.on_error = on_error
        self.square = Geometry(cfg.resolution, cfg.resolution, cfg.crop, cfg.flip)
        self.bucket_geoms = {
            b.replace(":", "_"): Geometry(*bucket_shape(parse_bucket(b), cfg.resolution),
                                          cfg.crop, cfg.flip)
            for b in cfg.buckets
        }
        #: The GPU decodes the primary image (the workers ship its bytes and placement).
        self.compressed = cfg.device == "cuda"
        #: torch resizes (decode.resizer: torch), not Pillow: the renderers of a decoded array
        #: and of an image Pillow decoded, chosen once.
        self.torch_resize = cfg.resizer == "torch"
        self._render_array, self._render_image = (
            (render_torch, _render_torch_image) if self.torch_resize else (_render_rgb, render))
        if self.torch_resize:
            # its import (~1.2 CPU-s) while the worker starts, not inside its first item
            import torch  # noqa: F401
        self.hook = hooks.resolve(cfg.transform, cfg.transform_kwargs) if cfg.transform else None
        self.hook_name = hooks.describe(cfg.transform) if cfg.transform else ""
        Image.MAX_IMAGE_PIXELS = cfg.max_image_pixels
        keep_freed_memory()  # a 4K sample's buffers reused, not faulted in afresh
        self.actor_id, self.node_id = "local", "local"
        # Only ask a Ray already running: get_runtime_context() would start (or join) one.
        ray = running_ray()
        try:
            if ray is not None:
                ctx = ray.get_runtime_context()
                # a task (decode.compute: tasks) is named by its worker process
                worker = ctx.worker.mode == ray.WORKER_MODE
                self.actor_id = ctx.get_actor_id() or (
                    f"task-worker:{ctx.get_worker_id()}" if worker else "driver")
                self.node_id = ctx.get_node_id()
        except Exception:  # outside Ray (tests, cat)
            pass

    def geometry(self, bucket: str) -> Geometry:
        if self.bucket_geoms:
            geom = self.bucket_geoms.get(bucket)
            if geom is None:
                # A shard outside the configured buckets: fall back to the first bucket's shape.
                geom = next(iter(self.bucket_geoms.values()))
            return geom
        return self.square

    # --- one sample ----------------------------------------------------------------------
    def _seed(self, row: dict[str, Any], geom: Geometry) -> int | None:
        """The sample's crop and flip seed (None when nothing is drawn)."""
        if geom.crop != "random" and not geom.flip:
            return None
        epoch = row.get(EPOCH)
        return sample_seed(self.seed, self.epoch if epoch is None else epoch, row[SID],
                           row[INDEX])

    def _primary(self, data: bytes, ext: str, geom: Geometry, seed: int | None
                 ) -> tuple[Any, Placement]:
        """The primary image rendered by its placement (or, for the GPU, its JPEG bytes)."""
        if ext not in IMAGE_EXTS:
            if ext in UNSAFE_EXTS and not self.cfg.allow_pickle:
                raise UnsafeFormatError(
                    f".{ext} members execute code when loaded; "
                    "set decode.allow_pickle: true to opt in")
            raise SampleError(f"unsupported image format .{ext}")
        limit = self.cfg.max_image_pixels
        hdr = jpeg.header(data) if ext in ("jpg", "jpeg") else None
        if hdr is not None and hdr.simple and hdr.size[0] * hdr.size[1] <= limit:
            p = place(hdr.size, geom, seed, scalable=True)
            if self.compressed:  # the trainer's GPU decodes it, in this placement
                return data, p
            padded = _MAPS_PADDED and p.cover != p.decoded and not self.torch_resize
            arr = jpeg.decode(data, hdr, p.scale, limit, padded)
            if arr is not None:
                return self._render_array(arr, p), p
        img = open_image(data, limit)
        p = place(img.size, geom, seed, scalable=img.format == "JPEG")
        draft_for(img, geom)
        img.load()
        return self._render_image(as_mode(img), p), p

    def _other(self, modality: str, data: bytes | None, ext: str | None,
               placement: Placement | None) -> Any:
        """Any modality but the primary image, decoded by its spec; images placed."""
        cfg = self.cfg
        if modality == cfg.caption_modality:
            return "" if data is None else decode_value(data, ext or "", "caption", False, 0)
        if data is None:  # an optional modality this sample lacks
            return None
        if modality == cfg.embedding_modality:
            return load_array(data, ext or "", cfg.allow_pickle)
        spec = spec_for(ext, cfg.decoders.get(modality, "auto"))
        value = decode_value(data, ext or "", spec, cfg.allow_pickle, cfg.max_image_pixels)
        if spec not in IMAGE_SPECS or placement is None:
            return value
        mode = cfg.resample.get(modality) or ("bilinear" if value.ndim == 3 else "nearest")
        if mode == "none":
            return value
        size = (value.shape[1], value.shape[0])
        if not map_size(size, placement.source):
            raise SampleError(
                f"{modality}: {size[0]}x{size[1]} cannot be mapped onto the "
                f"{cfg.image_modality} ({placement.source[0]}x{placement.source[1]}): another "
                f"aspect ratio (decode.resample.{modality}: none keeps it unplaced)")
        if self.torch_resize and resamples_as_image(value, mode):
            return render_torch(value, placement)
        return render_array(value, placement, mode)

    def decode_row(self, row: dict[str, Any], modalities: list[str] | None = None
                   ) -> dict[str, Any]:
        """One sample's fields: every modality decoded, then the hook's changes."""
        cfg = self.cfg
        modalities = modalities_of(list(row)) if modalities is None else modalities
        for modality in modalities:
            data = row.get(modality)
            if data is not None and len(data) > cfg.max_member_bytes:
                raise SampleError(
                    f"{modality}: member of {len(data)} bytes exceeds decode.max_member_bytes "
                    f"({cfg.max_member_bytes})"
                )
        out: dict[str, Any] = {}
        placement = None
        primary = cfg.image_modality
        if primary is not None and primary in row:
            data = row[primary]
            if data is None:
                raise SampleError(f"{primary}: missing member")
            geom = self.geometry(row.get(BUCKET) or "")
            out[primary], placement = self._primary(data, row[ext_column(primary)], geom,
                                                    self._seed(row, geom))
        for m in modalities:
            if m != primary:
                out[m] = self._other(m, row.get(m), row.get(ext_column(m)), placement)
        if self.hook is not None:
            out = self._transform(out, row, placement)
        if placement is not None and self.compressed:
            out[PLACEMENT] = np.asarray(placement.to_list(), dtype=np.int64)
        return out

    def _transform(self, fields: dict[str, Any], row: dict[str, Any],
                   placement: Placement | None) -> dict[str, Any]:
        epoch = row.get(EPOCH)
        ctx = hooks.SampleContext(
            key=str(row.get(KEY, "")), shard=str(row.get(SHARD, "")), index=int(row[INDEX]),
            epoch=self.epoch if epoch is None else int(epoch), repeat=int(bool(row.get(PAD))),
            seed=self.seed, placement=placement)
        try:
            result = hooks.call(self.hook, fields, ctx)
        except Exception as exc:
            text = " ".join(str(exc).split())
            raise HookError(f"transform {self.hook_name} failed: {type(exc).__name__}: "
                            f"{text}") from None
        if result is None:
            raise Filtered(f"{FILTERED}: transform {self.hook_name} returned None")
        if not isinstance(result, dict):
            raise HookError(f"transform {self.hook_name} returned a {type(result).__name__}, "
                            f"expected a dict of fields or None")
        dropped = [m for m in fields if m not in result]
        if dropped:  # a listed modality never leaves the batch without a word
            raise HookError(f"transform {self.hook_name} dropped {', '.join(dropped)}: return "
                            f"every decoded modality (list in data.modalities only what you "
                            f"train on)")
        return {_field_name(self.hook_name, k): _plain(v) for k, v in result.items()}

    # --- a block -------------------------------------------------------------------------
    def __call__(self, batch: pa.Table | dict[str, list[Any]]) -> dict[str, np.ndarray]:
        # CPU seconds of this thread (decode_cpu_s): on a busy node wall time would count the
        # time other processes held the cores
        t0 = time.thread_time()
        if isinstance(batch, pa.Table):
            rows = batch.to_pylist()
            names = batch.column_names
        else:  # Python column lists (ray_ingest.execution.read.read_item(arrow=False))
            names = list(batch)
            rows = [dict(zip(names, values, strict=True))
                    for values in zip(*batch.values(), strict=True)]
        modalities = modalities_of(names)
        decoded: list[dict[str, Any] | None] = []
        errors: list[str] = []
        sleep = 0.0
        for row in rows:
            if row.get(ERROR):  # the read task already gave up on this sample
                decoded.append(None)
                errors.append(row[ERROR])
                continue
            try:
                decoded.append(self.decode_row(row, modalities))
                errors.append("")
                if self.cfg.sim_cost_s:
                    sleep += sim_cost(self.cfg, self.seed, row[SID], row[INDEX])
            except Filtered as exc:
                log.debug("shard %s key %s index %s: %s", row.get(SHARD), row.get(KEY),
                          row.get(INDEX), exc)
                decoded.append(None)
                errors.append(str(exc))
            except SAMPLE_ERRORS as exc:
                decoded.append(None)
                errors.append(self._failed(row, exc))
        if sleep:  # benchmarks only: the block's simulated cost in one sleep (no CPU, no GIL)
            time.sleep(sleep)
        out = self.assemble(rows, decoded, errors, modalities)
        out[DECODE_TIME] = np.full(len(rows), (time.thread_time() - t0) / max(len(rows), 1))
        return out

    def _failed(self, row: dict[str, Any], exc: BaseException) -> str:
        """The skip reason of a failed sample, or its one-line error under ``raise``."""
        reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        # "<_io.BytesIO object at 0x7f…>": the same text every run
        reason = _ADDRESS.sub("", reason)
        where = f"shard {row.get(SHARD)} key {row.get(KEY)} index {row.get(INDEX)}"
        if self.on_error == "raise":
            raise IngestError(f"{where}: cannot decode: {reason}") from None
        if self.log_skips:
            log.warning("skip %s: %s", where, reason)
        return reason

    def assemble(self, rows: list[dict[str, Any]], decoded: list[dict[str, Any] | None],
                 errors: list[str], modalities: list[str] | None = None
                 ) -> dict[str, np.ndarray]:
        """Numpy columns: provenance, then every field (stacked where shapes agree); a block
        whose samples were all skipped has its modalities' columns, of placeholders."""
        n = len(rows)
        out: dict[str, np.ndarray] = {}
        for col in PASSTHROUGH:
            if rows and col in rows[0]:
                values = [r[col] for r in rows]
                out[col] = np.array(values, dtype=object if isinstance(values[0], str) else None)
        names: dict[str, None] = {}
        primary = self.cfg.image_modality
        if primary is not None and rows and primary in rows[0] and not self.compressed:
            names[primary] = None  # kept even when every sample of the block was skipped
        for d in decoded:
            if d is not None:
                names.update(dict.fromkeys(d))
        if all(d is None for d in decoded):
            names.update(dict.fromkeys(modalities or ()))
        for name in names:
            values = [_SKIPPED if d is None else d.get(name, _MISSING) for d in decoded]
            fill = None
            if name == primary and not self.compressed:
                geom = self.geometry(rows[0].get(BUCKET) or "")
                fill = np.zeros((geom.height, geom.width, 3), np.uint8)
            out[name] = column(values, fill)
        out[ERROR] = np.array(errors, dtype=object)
        out[ACTOR] = np.array([self.actor_id] * n, dtype=object)
        out[NODE] = np.array([self.node_id] * n, dtype=object)
        return out


#: Placeholders of :func:`column`: a skipped sample's value, a field a sample lacks.
_SKIPPED = object()
_MISSING = object()


#: Samples at least this large stay separate arrays in a block (an object column) instead of
#: being stacked: stacking costs a copy of every pixel in the worker, and the trainer stacks
#: each batch once anyway (into pinned memory for a GPU). At 4K (12-42 MB a sample) that is
#: one full copy per sample saved; small images stack, one array per block.
STACK_BYTES = 1 << 20


def column(values: list[Any], fill: np.ndarray | None = None) -> np.ndarray:
    """One field of a block: arrays of one shape and dtype stacked (a skipped sample's row
    zeros, or ``fill``'s) unless they are :data:`STACK_BYTES` or more each, numbers as a
    numeric array, anything else an object array (a lacking or skipped sample's value None,
    or ``fill``)."""
    real = [v for v in values if v is not _SKIPPED]
    if not real and fill is not None:
        real = [fill]
    if real and not any(v is _MISSING for v in real):
        first = real[0]
        if isinstance(first, np.ndarray) and first.nbytes >= STACK_BYTES:
            arr = np.empty(len(values), dtype=object)
            zero = fill if fill is not None else np.zeros_like(first)
            arr[:] = [zero if v is _SKIPPED else v for v in values]
            return arr
        if isinstance(first, np.ndarray) and all(
                isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype
                for v in real):
            out = np.empty((len(values), *first.shape), first.dtype)
            for i, v in enumerate(values):
                out[i] = 0 if v is _SKIPPED else v
            return out
        if all(isinstance(v, (bool, int, float, np.number, np.bool_)) for v in real):
            kinds = {type(v) for v in real}
            dtype = bool if kinds <= {bool, np.bool_} else None
            return np.array([0 if v is _SKIPPED else v for v in values], dtype=dtype)
    arr = np.empty(len(values), dtype=object)
    arr[:] = [None if v is _SKIPPED or v is _MISSING else v for v in values]
    return arr


#: Pillow maps a padded (4 bytes a pixel) decode as an RGB image without copying it:
#: ``Image.fromarrow``, public since Pillow 11.2.
_MAPS_PADDED = hasattr(Image, "fromarrow")


def _render_rgb(arr: np.ndarray, p: Placement) -> np.ndarray:
    """A decoded RGB array, (H, W, 3) or padded (H, W, 4), rendered by its placement: by
    slicing when it needs no resize (then never padded)."""
    h, w = arr.shape[:2]
    if p.cover == (w, h):
        left, top, right, bottom = p.box
        out = arr[top:bottom, left:right, :3]
        return oriented(out, p.flip)
    if arr.shape[2] == 4:
        # Pillow's own layout, mapped: allocating an image and unpacking RGB into it held the
        # GIL for ~7 % of a 512 px sample's decode and cost ~5 ms of a 4K one. From buffers:
        # pa.array imports pandas (~0.13 s of CPU in a decode process's first call, ~2 s of
        # wall time while 64 ranks start on the scale-out bench's 2 cores)
        flat = pa.Array.from_buffers(pa.uint8(), arr.size, [None, pa.py_buffer(arr)])
        img = Image.fromarrow(flat, "RGB", (w, h))
    else:  # frombuffer would zero a new image before unpacking: allocate it uninitialised
        img = Image.new("RGB", (w, h), None)
        img.frombytes(arr, "raw", "RGB")
    return render(img, p)


def _render_torch_image(img: Image.Image, p: Placement) -> np.ndarray:
    """An RGB image Pillow decoded, rendered by torch (decode.resizer: torch)."""
    return render_torch(np.asarray(img), p)


def _field_name(hook_name: str, name: Any) -> str:
    if not isinstance(name, str) or not name or name.startswith("__"):
        raise HookError(f"transform {hook_name} returned the field {name!r}: field names are "
                        f"non-empty strings not starting with '__' (reserved for provenance)")
    return name


def _plain(value: Any) -> Any:
    """A hook's value in the forms blocks carry: torch tensors and PIL images as numpy."""
    if isinstance(value, Image.Image):
        return np.asarray(value)
    if type(value).__module__ == "torch" and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return value
