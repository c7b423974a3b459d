"""``decode.device: cuda`` without a GPU: what can be checked on the CPU, checked on the CPU.

The decode workers ship JPEG bytes and placements (the object store carries ~the JPEG, not
the pixels); the trainer-side decoder renders them by those placements (same samples, order,
crops, flips and read state as CPU decode; pixels within MAE 2 of it); a sample its backend
does not decode falls back to the CPU, alone; and the mode refuses a process without CUDA at
once. The backend here decodes with simplejpeg on the CPU where a GPU's would use nvJPEG: the
CUDA-only parts (streams, pinned staging, the hardware engine) run in ``bench/cuda_check.sh``
and in the CUDA test at the end, skipped without a GPU.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from ray_ingest.catalog.load import load_catalog
from ray_ingest.columns import PLACEMENT, ext_column
from ray_ingest.config import DecodeConfig, config_from_dict
from ray_ingest.decode.decoder import Decoder
from ray_ingest.errors import ConfigError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.loader import device_decode
from ray_ingest.loader.device_decode import Backend, DeviceDecoder
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset


class SimplejpegBackend(Backend):
    """A stand-in for the GPU decoder on the CPU: full-size decode, None for what it refuses
    (here CMYK, as nvJPEG's hardware path does), or for every sample in ``refuse``."""

    name = "simplejpeg-cpu"
    hardware = False

    def __init__(self, refuse: set[int] | None = None):
        self.calls = 0
        self.refuse = refuse or set()
        self.seen = 0

    def decode(self, datas, stream):
        self.calls += 1
        out = []
        for d in datas:
            i, self.seen = self.seen, self.seen + 1
            try:
                if i in self.refuse or simplejpeg.decode_jpeg_header(d)[2] not in (
                        "YCbCr", "Gray"):
                    out.append(None)
                    continue
                out.append(torch.from_numpy(simplejpeg.decode_jpeg(d, "RGB")))
            except ValueError:
                out.append(None)
        return out


def _photo(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC)).astype(np.int16)
    return Image.fromarray(np.clip(img + rng.integers(-10, 10, (h, w, 3)), 0, 255)
                           .astype(np.uint8))


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=92, **kw)
    return buf.getvalue()


def _block(datas: list[bytes]) -> dict[str, list]:
    n = len(datas)
    return {"__key__": [f"k{i}" for i in range(n)], "__shard__": ["s"] * n,
            "__index__": list(range(n)), "__sid__": [0] * n, "__epoch__": [0] * n,
            "__pad__": [False] * n, "__bucket__": [""] * n, "__error__": [""] * n,
            "image": datas, ext_column("image"): ["jpg"] * n,
            "caption": [b'{"prompt": "p"}'] * n, ext_column("caption"): ["json"] * n}


def test_workers_ship_the_jpeg_and_its_placement_not_pixels():
    datas = [_jpeg(_photo(1280, 720, i)) for i in range(3)]
    cfg = DecodeConfig(resolution=512, crop="random", flip=True, device="cuda")
    block = Decoder(cfg, seed=4)(_block(datas))
    assert [bytes(b) for b in block["image"]] == datas  # the member bytes, untouched
    assert block[PLACEMENT].shape == (3, 10)
    cpu = Decoder(attrs_evolve(cfg, device="cpu"), seed=4)(_block(datas))
    # the placement is the CPU decode's: rendering it on the CPU gives the CPU pixels exactly
    for i in range(3):
        p = device_decode.Placement.from_list(block[PLACEMENT][i])
        np.testing.assert_array_equal(device_decode.cpu_render(datas[i], p, 10**9),
                                      cpu["image"][i])
    # object-store bytes per sample: the JPEG and a little (the CPU path: 512x512x3 pixels)
    per_sample = len(pickle.dumps(block, protocol=5)) / 3
    assert per_sample <= 1.1 * np.mean([len(d) for d in datas])
    assert len(pickle.dumps(cpu, protocol=5)) / 3 > max(2 * per_sample, 512 * 512 * 3)


def attrs_evolve(cfg, **kw):
    import attrs

    return attrs.evolve(cfg, **kw)


def test_render_on_the_device_is_within_mae_2_of_cpu_decode():
    cases = [((1920, 1080), dict(resolution=512, crop="random", flip=True)),
             ((1280, 960), dict(resolution=224)),
             ((900, 600), dict(resolution=640, buckets=("3:2",))),
             ((640, 480), dict(resolution=300, crop="random"))]
    worst = 0.0
    for k, ((w, h), dc) in enumerate(cases):
        datas = [_jpeg(_photo(w, h, k * 10 + i)) for i in range(2)]
        cfg = DecodeConfig(**dc)
        rows = _block(datas)
        if cfg.buckets:
            rows["__bucket__"] = ["3_2"] * 2
        cpu = np.stack(list(Decoder(cfg, seed=1)(rows)["image"]))
        shipped = Decoder(attrs_evolve(cfg, device="cuda"), seed=1)(rows)
        dec = DeviceDecoder("cpu", backend=SimplejpegBackend())
        got, event = dec(list(shipped["image"]), shipped[PLACEMENT])
        assert event is None and got.dtype == torch.uint8 and tuple(got.shape) == cpu.shape
        mae = np.abs(got.numpy().astype(int) - cpu.astype(int)).mean(axis=(1, 2, 3))
        assert mae.max() <= 2.0, (w, h, dc, mae)
        worst = max(worst, float(mae.max()))
        assert dec.stats()["gpu_decoded"] == 2 and dec.stats()["cpu_fallbacks"] == 0
    print(f"device render vs CPU decode: max per-image MAE {worst:.3f}")


def test_a_sample_the_backend_refuses_falls_back_to_the_cpu_alone():
    datas = [_jpeg(_photo(400, 300, 1)), _jpeg(_photo(400, 300, 2).convert("CMYK")),
             _jpeg(_photo(400, 300, 3)), b"\xff\xd8\xff corrupt"]
    cfg = DecodeConfig(resolution=128, device="cuda")
    shipped = Decoder(cfg, on_error="skip", log_skips=False)(_block(datas))
    assert shipped["__error__"][3]  # corrupt: the worker could not read its header
    good = [0, 1, 2]
    assert isinstance(shipped["image"][1], np.ndarray)  # CMYK: the worker decoded it
    dec = DeviceDecoder("cpu", backend=SimplejpegBackend(refuse={1}))  # the 2nd JPEG it sees
    got, _ = dec([shipped["image"][i] for i in good], shipped[PLACEMENT][good])
    cpu = Decoder(attrs_evolve(cfg, device="cpu"))(_block(datas[:3]))["image"]
    s = dec.stats()
    assert (s["gpu_decoded"], s["cpu_fallbacks"], s["worker_decoded"]) == (1, 1, 1)
    for i in (1, 2):  # the fallbacks are the CPU's pixels exactly
        np.testing.assert_array_equal(got[i].numpy(), cpu[i])
    assert np.abs(got[0].numpy().astype(int) - cpu[0].astype(int)).mean() <= 2


def test_a_backend_that_raises_sends_the_batch_to_the_cpu():
    class Broken(Backend):
        name = "broken"

        def decode(self, datas, stream):
            raise RuntimeError("nvjpeg exploded")

    datas = [_jpeg(_photo(300, 200, i)) for i in range(2)]
    shipped = Decoder(DecodeConfig(resolution=64, device="cuda"))(_block(datas))
    dec = DeviceDecoder("cpu", backend=Broken())
    got, _ = dec(list(shipped["image"]), shipped[PLACEMENT])
    cpu = Decoder(DecodeConfig(resolution=64))(_block(datas))["image"]
    np.testing.assert_array_equal(got.numpy(), cpu)
    assert dec.stats()["cpu_fallbacks"] == 2


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("gpu") / "ds")
    synth_dataset(out, samples=30, shard_size=7, seed=3, min_side=96, max_side=160)
    return out


def _cfg(path: str, device: str):
    return config_from_dict({
        "data": {"paths": [path]},
        "decode": {"resolution": 64, "crop": "random", "flip": True, "device": device,
                   "compute": "threads", "threads": 2},
        "loader": {"batch_size": 4, "seed": 5, "read_workers": 2, "block_rows": 4},
        "train": {"use_gpu": True},
    })


def _records(loader, stop_after=None):
    out = []
    for epoch, batches in loader.epochs(2):
        for b in batches:
            out.append((epoch, b.step_in_epoch, b.sample_keys, b.sids, b.indices, b.pads,
                        b.captions, b["image"].numpy().copy()))
            if stop_after is not None and len(out) == stop_after:
                batches.close()
                return out
    return out


def test_the_loader_delivers_the_cpu_batches_decoded_here(small):
    catalog = load_catalog([small])
    topo = Topology(2, 1, 2)
    cpu = _records(IngestLoader(_cfg(small, "cpu"), topo, catalog=catalog))
    cfg = _cfg(small, "cuda")
    backend = SimplejpegBackend()
    loader = IngestLoader(cfg, topo, catalog=catalog, device="cpu",
                          image_decoder=DeviceDecoder("cpu", backend=backend))
    gpu = _records(loader)
    assert len(gpu) == len(cpu) > 4 and backend.calls == len(gpu)
    for a, b in zip(cpu, gpu, strict=True):
        assert a[:7] == b[:7]  # samples, order, pads, captions
        assert np.abs(a[7].astype(int) - b[7].astype(int)).mean() <= 2
    assert loader.metrics()["device_decode"]["gpu_decoded"] == sum(len(r[2]) for r in gpu)
    # a stop and resume continues the same sequence, from the same read state as on the CPU
    first = IngestLoader(cfg, topo, catalog=catalog, device="cpu",
                         image_decoder=DeviceDecoder("cpu", backend=SimplejpegBackend()),
                         open_execution=LocalExecution.factory(cfg, catalog))
    head = _records(first, stop_after=3)
    ref = IngestLoader(_cfg(small, "cpu"), topo, catalog=catalog)
    _records(ref, stop_after=3)
    assert first.state.to_dict() == ref.state.to_dict()
    rest = _records(IngestLoader(cfg, topo, catalog=catalog, device="cpu",
                                 state=first.state,
                                 image_decoder=DeviceDecoder("cpu", backend=SimplejpegBackend())))
    assert [r[:7] for r in head + rest] == [r[:7] for r in gpu]


def test_without_cuda_the_mode_fails_at_once_with_one_line(small):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as info:
        IngestLoader(_cfg(small, "cuda"), Topology(1, 0, 2), device="cpu")
    assert str(info.value) == (
        "decode.device: cuda needs a CUDA GPU in the training process "
        "(torch.cuda.is_available() is False here); set decode.device: cpu")
    with pytest.raises(ConfigError, match="needs train.use_gpu: true"):
        config_from_dict({"data": {"paths": [small]}, "decode": {"device": "cuda"}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_with_kernels_queued_on_the_train_stream(small):  # pragma: no cover
    """On a GPU: long kernels queued on the train loop's stream that read the previous batch
    while the next one decodes; the previous batch's values must be intact afterwards."""
    cfg = _cfg(small, "cuda")
    loader = IngestLoader(cfg, Topology(1, 0, 2), device="cuda")
    seen, sums = [], []
    for _, batches in loader.epochs(1):
        for b in batches:
            x = b["image"].float()
            for _ in range(50):  # queued work reading the batch while the next decodes
                x = torch.sqrt(x * x + 1.0)
            sums.append(x.sum())
            seen.append(b["image"].clone())
    torch.cuda.synchronize()
    for img, s in zip(seen, sums, strict=True):
        y = img.float()
        for _ in range(50):
            y = torch.sqrt(y * y + 1.0)
        assert torch.allclose(y.sum(), s)
