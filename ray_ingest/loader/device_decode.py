"""``decode.device: cuda``: the primary image decoded on the trainer's GPU, in its placement.

The decode workers read the twin tars in lockstep as ever and decide each sample's geometry on
the CPU (:class:`~ray_ingest.decode.geometry.Placement`: cover size, crop box, flip, from the
header and the sample's seed), but ship the JPEG bytes instead of pixels: ~3 MB through the
object store and the network per 4K sample instead of 24-42 MB. Here, in the trainer, a batch's
JPEGs are decoded on the GPU and rendered by their placements, so samples, order, crops, resume
state and group behaviour are those of CPU decode; the pixels differ within a small tolerance
(bilinear with antialias from the full-size decode instead of Pillow's resize of a DCT-scaled
one; nvJPEG's chroma upsampling), which ``tests/loader/test_device_decode.py`` bounds.

Backends (``decode.gpu_backend``): nvImageCodec (``nvidia-nvimgcodec-cu12``: the hardware JPEG
engine of A100/H100-class GPUs where present, else CUDA nvJPEG), TorchCodec's ``decode_jpeg``,
and torchvision's ``decode_jpeg(device="cuda")`` only as a last resort (deprecated upstream).
A sample the GPU does not decode (CMYK, some progressive files, corrupt data, a None result)
is decoded on the CPU for that sample alone, with the same placement; the batch never fails
for it. EXIF orientation is not applied on either path (the stored pixels, as Pillow's
``Image.open``, webdataset and torchvision decode by default).

Hazards handled: nvJPEG's hardware batched decode writes its output ignoring stream order
(torchvision#9606, torchcodec#1634), so every decode runs on a stream of its own after a host
wait for everything queued on it (no kernel still reads memory the allocator may hand the
decoder), and the train loop's stream waits for the decode's event before it uses a batch,
whose tensors are recorded on that stream. The batch's JPEGs are packed into a pinned host
buffer that is reused from batch to batch, and the loader decodes one batch ahead of the step
(:class:`~ray_ingest.execution.handoff.Handoff`). Imports torch; no Ray.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ray_ingest.decode import jpeg
from ray_ingest.decode.augment import render
from ray_ingest.decode.geometry import Placement, scaled
from ray_ingest.decode.modalities import as_mode, open_image
from ray_ingest.errors import ConfigError

log = logging.getLogger(__name__)

#: Backends in the order ``auto`` tries them.
BACKENDS = ("nvimgcodec", "torchcodec", "torchvision")


def cpu_render(data: bytes, p: Placement, max_pixels: int) -> np.ndarray:
    """A JPEG decoded on the CPU and rendered by its placement: the worker's CPU pixels (the
    fallback of a sample the GPU did not decode)."""
    hdr = jpeg.header(data)
    if hdr is not None:
        arr = jpeg.decode(data, hdr, p.scale, max_pixels)
        if arr is not None:
            from PIL import Image

            return render(Image.fromarray(arr), p)
    img = open_image(data, max_pixels)
    if img.format == "JPEG" and p.scale > 1:
        img.draft("RGB", scaled(img.size, p.scale))
    img.load()
    return render(as_mode(img), p)


def render_tensor(img: Any, p: Placement) -> Any:
    """A decoded image (uint8 HWC tensor, any size of the source's aspect) rendered by its
    placement on its device: bilinear with antialias to the cover size, crop, flip."""
    import torch
    import torch.nn.functional as F

    nw, nh = p.cover
    left, top, right, bottom = p.box
    x = img.permute(2, 0, 1)[None]
    if tuple(x.shape[-2:]) != (nh, nw):
        x = F.interpolate(x.float(), size=(nh, nw), mode="bilinear", antialias=True,
                          align_corners=False)
        x = x.round_().clamp_(0, 255).to(torch.uint8)
    x = x[..., top:bottom, left:right]
    if p.flip:
        x = x.flip(-1)
    return x[0].permute(1, 2, 0)


class Backend:
    """Decodes JPEG bytes (host views) into uint8 HWC RGB tensors on the device, or None."""

    name = "?"
    #: Whether the hardware JPEG engine decodes (for the start-up line).
    hardware: bool | None = None

    def decode(self, datas: Sequence[Any], stream: Any) -> list[Any]:  # pragma: no cover
        raise NotImplementedError


class NvImageCodec(Backend):
    name = "nvimgcodec"

    def __init__(self, device: Any):
        from nvidia import nvimgcodec

        self._nv = nvimgcodec
        self.device = device
        kinds = nvimgcodec.BackendKind
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                              color_spec=nvimgcodec.ColorSpec.RGB)
        self.decoder = nvimgcodec.Decoder(device_id=device.index or 0, backends=[
            nvimgcodec.Backend(kinds.HW_GPU_ONLY), nvimgcodec.Backend(kinds.GPU_ONLY),
            nvimgcodec.Backend(kinds.HYBRID_CPU_GPU)])
        self.hardware = _probe_hardware(nvimgcodec, device)

    def decode(self, datas: Sequence[Any], stream: Any) -> list[Any]:
        import torch

        images = self.decoder.decode(list(datas), params=self.params,
                                     cuda_stream=stream.cuda_stream if stream else 0)
        return [None if im is None else torch.as_tensor(im, device=self.device)
                for im in images]


def _probe_hardware(nvimgcodec: Any, device: Any) -> bool:
    """Whether the hardware JPEG engine decodes a baseline JPEG on this GPU."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 30)).save(buf, "JPEG", quality=90)
    try:
        hw = nvimgcodec.Decoder(device_id=device.index or 0, backends=[
            nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
        return hw.decode(buf.getvalue()) is not None
    except Exception:  # no engine on this GPU, or an nvImageCodec without it
        return False


class TorchCodec(Backend):
    name = "torchcodec"

    def __init__(self, device: Any):
        from torchcodec.decoders import decode_jpeg  # TorchCodec's nvJPEG decoder

        self._decode = decode_jpeg
        self.device = device

    def decode(self, datas: Sequence[Any], stream: Any) -> list[Any]:
        import torch

        out = self._decode([torch.as_tensor(d) for d in datas], device=self.device)
        return [None if t is None else t.permute(1, 2, 0) for t in out]


class Torchvision(Backend):
    """torchvision's ``decode_jpeg`` on CUDA: deprecated upstream, the last resort."""

    name = "torchvision"

    def __init__(self, device: Any):
        from torchvision.io import ImageReadMode, decode_jpeg

        self._decode, self._mode = decode_jpeg, ImageReadMode.RGB
        self.device = device

    def decode(self, datas: Sequence[Any], stream: Any) -> list[Any]:
        import torch

        tensors = [torch.as_tensor(d) for d in datas]
        try:
            out = self._decode(tensors, mode=self._mode, device=self.device,
                               apply_exif_orientation=False)
        except RuntimeError:  # one bad image fails the call: decode them one by one
            out = []
            for t in tensors:
                try:
                    out.append(self._decode(t, mode=self._mode, device=self.device,
                                            apply_exif_orientation=False))
                except RuntimeError:
                    out.append(None)
        return [None if t is None else t.permute(1, 2, 0) for t in out]


def make_backend(name: str, device: Any) -> Backend:
    """The configured GPU decoder (``auto``: the first of :data:`BACKENDS` installed)."""
    names = BACKENDS if name == "auto" else (name,)
    reasons = []
    for n in names:
        try:
            return {"nvimgcodec": NvImageCodec, "torchcodec": TorchCodec,
                    "torchvision": Torchvision}[n](device)
        except Exception as exc:  # not installed, or no usable GPU for it
            first = (str(exc).splitlines() or [""])[0]
            reasons.append(f"{n}: {type(exc).__name__}: {first}")
    raise ConfigError(f"decode.gpu_backend: no GPU JPEG decoder available "
                      f"({'; '.join(reasons)}); install ray_ingest[gpu] "
                      f"(nvidia-nvimgcodec-cu12) or set decode.device: cpu")


class PinnedStaging:
    """One pinned host buffer, reused batch after batch, that a batch's JPEGs are packed into
    (the decoder's host-to-device copies then run from page-locked memory)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffer: Any = None

    def stage(self, datas: Sequence[bytes]) -> list[np.ndarray]:
        import torch

        need = sum(len(d) for d in datas)
        if self.buffer is None or self.buffer.numel() < need:
            size = max(need, 2 * (0 if self.buffer is None else self.buffer.numel()))
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        host = self.buffer.numpy()
        views, at = [], 0
        for d in datas:
            host[at:at + len(d)] = np.frombuffer(d, np.uint8)
            views.append(host[at:at + len(d)])
            at += len(d)
        return views


class DeviceDecoder:
    """Decodes the primary image of a batch on ``device`` (see module docstring).

    Args:
        device: the trainer's torch device.
        backend: a :class:`Backend` (default: ``make_backend(gpu_backend, device)``).
        gpu_backend: ``decode.gpu_backend``.
        max_image_pixels: ``decode.max_image_pixels`` (the CPU fallback's bomb limit).
    """

    def __init__(self, device: Any, backend: Backend | None = None, gpu_backend: str = "auto",
                 max_image_pixels: int = 178_956_970):
        import torch

        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.backend = backend or make_backend(gpu_backend, self.device)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.staging = PinnedStaging(pin=cuda)
        self.max_image_pixels = max_image_pixels
        #: Counters: samples, decoded on the GPU, decoded here on the CPU after the GPU did not,
        #: decoded by the workers (what they knew no GPU path takes: not a plain JPEG),
        #: host-to-device bytes, seconds.
        self.samples = self.gpu = self.fallbacks = self.worker_decoded = self.h2d_bytes = 0
        self.seconds = 0.0
        engine = {True: "in use", False: "not available", None: "unknown"}[self.backend.hardware]
        log.info("GPU decode on %s: backend %s, hardware JPEG engine %s", self.device,
                 self.backend.name, engine)

    def stats(self) -> dict[str, Any]:
        n = max(1, self.samples)
        return {"backend": self.backend.name, "hardware_engine": self.backend.hardware,
                "samples": self.samples, "gpu_decoded": self.gpu,
                "cpu_fallbacks": self.fallbacks, "worker_decoded": self.worker_decoded,
                "h2d_bytes_per_sample": self.h2d_bytes / n,
                "ms_per_sample": 1000 * self.seconds / n}

    def __call__(self, values: Sequence[Any], placements: np.ndarray) -> tuple[Any, Any]:
        """``(uint8 (B, H, W, 3) tensor on the device, the decode's CUDA event or None)``:
        the train loop's stream waits for the event before it uses the tensor."""
        import torch

        t0 = time.perf_counter()
        ps = [Placement.from_list(p) for p in placements]
        w, h = ps[0].out
        out = torch.empty((len(values), h, w, 3), dtype=torch.uint8, device=self.device)
        jpegs = [i for i, v in enumerate(values) if isinstance(v, (bytes, bytearray))]
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else _nullcontext()
        with ctx:
            if self.stream is not None:
                # nvJPEG's hardware decode ignores stream order: nothing queued on this stream
                # may still read memory the allocator can hand to the decoder's output
                self.stream.synchronize()
            failed = set(jpegs)
            if jpegs:
                views = self.staging.stage([values[i] for i in jpegs])
                self.h2d_bytes += sum(v.nbytes for v in views)
                try:
                    decoded = self.backend.decode(views, self.stream)
                except Exception as exc:  # the whole call failed: every sample on the CPU
                    log.warning("GPU decode of a batch failed (%s: %s); decoding it on the CPU",
                                type(exc).__name__, exc)
                    decoded = [None] * len(jpegs)
                for i, img in zip(jpegs, decoded, strict=True):
                    if img is not None and img.ndim == 3 and img.shape[2] == 3:
                        out[i] = render_tensor(img, ps[i])
                        failed.discard(i)
                        self.gpu += 1
            for i, v in enumerate(values):
                if i in failed:  # the GPU did not decode it: this sample on the CPU
                    self.fallbacks += 1
                    v = cpu_render(bytes(v), ps[i], self.max_image_pixels)
                elif isinstance(v, (bytes, bytearray)):
                    continue
                else:
                    self.worker_decoded += 1
                arr = torch.from_numpy(np.require(v, requirements=["C", "W"]))
                out[i] = arr.to(self.device, non_blocking=False)
                self.h2d_bytes += arr.numel()
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        self.samples += len(values)
        self.seconds += time.perf_counter() - t0
        return out, event


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def handover(tensor: Any, event: Any) -> None:
    """In the train loop's thread: its current stream waits for the decode, and the tensor's
    memory is recorded as used by that stream (the allocator keeps it until the stream's work
    on it is done)."""
    if event is None:
        return
    import torch

    stream = torch.cuda.current_stream(tensor.device)
    stream.wait_event(event)
    tensor.record_stream(stream)


def check_device(device: Any) -> None:
    """``decode.device: cuda`` needs a CUDA device in this process: one line otherwise."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("decode.device: cuda needs a CUDA GPU in the training process "
                          "(torch.cuda.is_available() is False here); set decode.device: cpu")
    if device is not None and torch.device(device).type != "cuda":
        raise ConfigError(f"decode.device: cuda needs the loader's device to be a CUDA device, "
                          f"got {device}")
