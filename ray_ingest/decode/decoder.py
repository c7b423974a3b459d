"""Decode stage: raw member bytes -> uint8 images, caption text, embedding arrays.

:class:`Decoder` is the callable class run by ``map_batches`` on an elastic actor pool
(``ActorPoolStrategy(min_size, max_size)``). It is stateless across batches, so a restarted
actor produces exactly what the dead one would have. Formats that execute code when loaded
(pickle, torch) are refused unless the config opts in: a tar from the internet must not be
able to run code on the training cluster.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
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
    PROVENANCE,
    READ_NODE,
    SHARD,
    SID,
    T_DECODE,
    T_READ,
    ext_column,
)
from ray_ingest.config import DecodeConfig
from ray_ingest.decode import jpeg
from ray_ingest.decode.augment import (
    Geometry,
    bucket_shape,
    draft_for,
    parse_bucket,
    resize_crop,
    sample_seed,
)
from ray_ingest.errors import IngestError, UnsafeFormatError
from ray_ingest.metrics import running_ray

log = logging.getLogger(__name__)

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "webp", "bmp"})
UNSAFE_EXTS = frozenset({"pkl", "pickle", "pt", "pth"})
CAPTION_FIELDS = ("prompt", "prompt_medium", "prompt_short", "caption", "text")
#: Columns carried through decode unchanged.
PASSTHROUGH = (*PROVENANCE, T_READ, BYTES, READ_NODE)
DECODE_TIME = T_DECODE
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class SampleError(Exception):
    """One sample could not be decoded (reason text names the modality and the problem)."""


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
    if ext in UNSAFE_EXTS:
        if not allow_pickle:
            raise UnsafeFormatError(
                f".{ext} members execute code when loaded; set decode.allow_pickle: true to opt in"
            )
        if ext in ("pt", "pth"):
            import torch

            return np.asarray(torch.load(io.BytesIO(data), weights_only=False))
        return np.asarray(pickle.loads(data))  # noqa: S301 - explicit opt-in
    if ext == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    raise SampleError(f"unsupported embedding format .{ext}")


def _refuse_bomb(size: tuple[int, int], limit: int) -> None:
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


class Decoder:
    """Callable class for ``Dataset.map_batches(..., batch_format="pyarrow")``."""

    def __init__(self, cfg: DecodeConfig, seed: int = 0, epoch: int = 0, on_error: str = "raise",
                 log_skips: bool = True):
        # ``epoch`` seeds random crops of rows without an ``__epoch__`` column (cat, tests).
        # ``log_skips`` false where the loader's skip filter logs every skip (same process).
        self.cfg = cfg
        self.log_skips = log_skips
        self.seed = seed
        self.epoch = epoch
        self.on_error = on_error
        self.square = Geometry(cfg.resolution, cfg.resolution, cfg.crop)
        self.bucket_geoms = {
            b.replace(":", "_"): Geometry(*bucket_shape(parse_bucket(b), cfg.resolution), cfg.crop)
            for b in cfg.buckets
        }
        Image.MAX_IMAGE_PIXELS = cfg.max_image_pixels
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

    def _image(self, data: bytes, ext: str, geom: Geometry, rng_seed: int | None
               ) -> np.ndarray:
        if ext not in IMAGE_EXTS:
            if ext in UNSAFE_EXTS and not self.cfg.allow_pickle:
                raise UnsafeFormatError(
                    f".{ext} members execute code when loaded; "
                    "set decode.allow_pickle: true to opt in"
                )
            raise SampleError(f"unsupported image format .{ext}")
        img = None
        if ext in ("jpg", "jpeg") and jpeg.usable():
            # the same bytes as below, holding the GIL less (ray_ingest.decode.jpeg)
            img = jpeg.decode(data, geom, self.cfg.max_image_pixels)
        if img is None:
            img = Image.open(io.BytesIO(data))  # DecompressionBombError beyond 2x the limit
            _refuse_bomb(img.size, self.cfg.max_image_pixels)
            draft_for(img, geom)
            img.load()
        return resize_crop(img, geom, rng_seed)

    def decode_row(self, row: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        out: dict[str, Any] = {}
        for modality in cfg.decoded_modalities:
            data = row.get(modality)
            if data is not None and len(data) > cfg.max_member_bytes:
                raise SampleError(
                    f"{modality}: member of {len(data)} bytes exceeds decode.max_member_bytes "
                    f"({cfg.max_member_bytes})"
                )
        if cfg.image_modality is not None:
            data = row[cfg.image_modality]
            if data is None:
                raise SampleError(f"{cfg.image_modality}: missing member")
            geom = self.geometry(row.get(BUCKET) or "")
            seed = None
            if geom.crop == "random":  # a center crop draws nothing
                epoch = row.get(EPOCH)
                seed = sample_seed(self.seed, self.epoch if epoch is None else epoch, row[SID],
                                   row[INDEX])
            ext = row[ext_column(cfg.image_modality)]
            out[cfg.image_modality] = self._image(data, ext, geom, seed)
        if cfg.caption_modality is not None:
            data = row[cfg.caption_modality]
            out[cfg.caption_modality] = "" if data is None else caption_text(
                data, row[ext_column(cfg.caption_modality)])
        if cfg.embedding_modality is not None:
            data = row.get(cfg.embedding_modality)
            out[cfg.embedding_modality] = None if data is None else load_array(
                data, row[ext_column(cfg.embedding_modality)], cfg.allow_pickle)
        return out

    def placeholder(self, row: dict[str, Any]) -> dict[str, Any]:
        """Output of a skipped sample: right shapes, zero content, never delivered to training."""
        cfg = self.cfg
        out: dict[str, Any] = {}
        if cfg.image_modality is not None:
            geom = self.geometry(row.get(BUCKET) or "")
            out[cfg.image_modality] = np.zeros((geom.height, geom.width, 3), np.uint8)
        if cfg.caption_modality is not None:
            out[cfg.caption_modality] = ""
        if cfg.embedding_modality is not None:
            out[cfg.embedding_modality] = None
        return out

    def __call__(self, batch: pa.Table | dict[str, list[Any]]) -> dict[str, np.ndarray]:
        # CPU seconds of this thread (decode_cpu_s): on a busy node wall time would count the
        # time other processes held the cores
        t0 = time.thread_time()
        if isinstance(batch, pa.Table):
            rows = batch.to_pylist()
        else:  # Python column lists (ray_ingest.execution.read.read_item(arrow=False))
            names = list(batch)
            rows = [dict(zip(names, values, strict=True))
                    for values in zip(*batch.values(), strict=True)]
        decoded: list[dict[str, Any]] = []
        errors: list[str] = []
        sleep = 0.0
        for row in rows:
            if row.get(ERROR):  # the read task already gave up on this sample
                decoded.append(self.placeholder(row))
                errors.append(row[ERROR])
                continue
            try:
                decoded.append(self.decode_row(row))
                errors.append("")
                if self.cfg.sim_cost_s:
                    sleep += sim_cost(self.cfg, self.seed, row[SID], row[INDEX])
            except (SampleError, UnsafeFormatError, OSError, ValueError, SyntaxError, EOFError,
                    Image.DecompressionBombError, Image.DecompressionBombWarning,
                    UnicodeDecodeError) as exc:
                reason = f"{type(exc).__name__}: {exc}".replace("\n", " ")
                # "<_io.BytesIO object at 0x7f…>": the same text every run
                reason = _ADDRESS.sub("", reason)
                where = (f"shard {row.get(SHARD)} key {row.get(KEY)} "
                         f"index {row.get(INDEX)}")
                if self.on_error == "raise":
                    raise IngestError(f"{where}: cannot decode: {reason}") from None
                if self.log_skips:
                    log.warning("skip %s: %s", where, reason)
                decoded.append(self.placeholder(row))
                errors.append(reason)
        if sleep:  # benchmarks only: the block's simulated cost in one sleep (no CPU, no GIL)
            time.sleep(sleep)
        out = self.assemble(rows, decoded, errors)
        out[DECODE_TIME] = np.full(len(rows), (time.thread_time() - t0) / max(len(rows), 1))
        return out

    def assemble(self, rows: list[dict[str, Any]], decoded: list[dict[str, Any]],
                 errors: list[str]) -> dict[str, np.ndarray]:
        cfg = self.cfg
        n = len(rows)
        out: dict[str, np.ndarray] = {}
        for col in PASSTHROUGH:
            if rows and col in rows[0]:
                values = [r[col] for r in rows]
                out[col] = np.array(values, dtype=object if isinstance(values[0], str) else None)
        if cfg.image_modality is not None:
            images = [d[cfg.image_modality] for d in decoded]
            shapes = {im.shape for im in images}
            if len(shapes) <= 1:
                out[cfg.image_modality] = (np.stack(images) if images
                                           else np.zeros((0, 1, 1, 3), np.uint8))
            else:
                arr = np.empty(n, dtype=object)
                arr[:] = images
                out[cfg.image_modality] = arr
        if cfg.caption_modality is not None:
            captions = [d[cfg.caption_modality] for d in decoded]
            out[cfg.caption_modality] = np.array(captions, dtype=object)
        if cfg.embedding_modality is not None:
            arr = np.empty(n, dtype=object)
            arr[:] = [d[cfg.embedding_modality] for d in decoded]
            out[cfg.embedding_modality] = arr
        out[ERROR] = np.array(errors, dtype=object)
        out[ACTOR] = np.array([self.actor_id] * n, dtype=object)
        out[NODE] = np.array([self.node_id] * n, dtype=object)
        return out
