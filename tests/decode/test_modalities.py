"""Every listed modality decoded and kept: decoders by extension or spec, one geometry per
sample for image-like modalities (masks and depth pixel-aligned with the image), values intact."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from ray_ingest.config import DecodeConfig, config_from_dict
from ray_ingest.decode import modalities as mods
from ray_ingest.decode.decoder import Decoder
from ray_ingest.decode.geometry import Geometry, map_size, place
from ray_ingest.errors import ConfigError, IngestError, UnsafeFormatError
from ray_ingest.twintar.twin import ext_column
from tests.support import multimodal


def _png(arr: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG")
    return buf.getvalue()


def block(indices, **extra) -> dict[str, list]:
    """A block of the coordinate dataset's samples (tests/support/multimodal.py)."""
    cols: dict[str, list] = {"__key__": [], "__shard__": [], "__index__": [], "__sid__": [],
                             "__epoch__": [], "__pad__": [], "__bucket__": [], "__error__": []}
    for m in multimodal.MODALITIES:
        cols[m], cols[ext_column(m)] = [], []
    for i in indices:
        ms = multimodal.members(i)
        for k, v in (("__key__", f"k{i:05d}"), ("__shard__", "s.tar"), ("__index__", i),
                     ("__sid__", 0), ("__epoch__", 0), ("__pad__", False), ("__bucket__", ""),
                     ("__error__", "")):
            cols[k].append(v)
        for m in multimodal.MODALITIES:
            cols[m].append(ms[m])
            cols[ext_column(m)].append(multimodal.EXT[m])
    for k, v in extra.items():
        cols[k] = v
    return cols


def test_specs_by_extension_and_by_name():
    assert mods.spec_for("jpg") == "image" and mods.spec_for("PNG") == "image"
    assert mods.spec_for("tiff") == "image" and mods.spec_for("npy") == "npy"
    assert mods.spec_for("cls") == "int" and mods.spec_for("txt") == "text"
    assert mods.spec_for("json") == "json" and mods.spec_for("pkl") == "pickle"
    assert mods.spec_for("weird") == "bytes" and mods.spec_for(None) == "bytes"
    assert mods.spec_for("png", "l8") == "gray" and mods.spec_for("png", "rgb8") == "rgb"
    assert mods.spec_for("json", "bytes") == "bytes"


@pytest.mark.parametrize("doc, message", [
    ({"decoders": {"depth": "tiff16"}}, "decode.decoders.depth: expected one of"),
    ({"decoders": {"nope": "bytes"}}, "decode.decoders.nope: not a modality of data.modalities"),
    ({"resample": {"mask": "cubic"}}, "decode.resample.mask: expected one of"),
    ({"transform": "not a ref"}, "decode.transform: expected 'package.module:name'"),
    ({"transform_kwargs": {"a": 1}}, "decode.transform_kwargs: set without decode.transform"),
])
def test_bad_decoder_settings_are_one_line_errors(doc, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"data": {"paths": ["x"], "modalities": list(multimodal.MODALITIES)},
                          "decode": doc})


def test_values_by_kind_are_intact():
    d16 = (np.arange(12 * 10, dtype=np.uint16).reshape(10, 12) * 521)  # beyond 8 bits
    assert mods.decode_value(_png(d16), "png", "image", False, 10**9).dtype == np.uint16
    np.testing.assert_array_equal(mods.decode_value(_png(d16), "png", "image", False, 10**9), d16)
    grey = (np.arange(30, dtype=np.uint8).reshape(5, 6))
    out = mods.decode_value(_png(grey, "L"), "png", "image", False, 10**9)
    assert out.shape == (5, 6) and out.dtype == np.uint8
    pal = Image.fromarray(grey % 4, "L").convert("P")
    buf = io.BytesIO()
    pal.save(buf, "PNG")
    assert mods.decode_value(buf.getvalue(), "png", "image", False, 10**9).ndim == 2
    rgba = np.zeros((4, 4, 4), np.uint8)
    assert mods.decode_value(_png(rgba, "RGBA"), "png", "image", False, 10**9).shape == (4, 4, 3)
    assert mods.decode_value(_png(grey, "L"), "png", "rgb", False, 10**9).shape == (5, 6, 3)
    assert mods.decode_value(b" 7\n", "cls", "int", False, 0) == 7
    assert mods.decode_value("héllo".encode(), "txt", "text", False, 0) == "héllo"
    assert mods.decode_value(b'{"a": [1]}', "json", "json", False, 0) == {"a": [1]}
    assert mods.decode_value(b"\x00\x01", "bin", "bytes", False, 0) == b"\x00\x01"
    with pytest.raises(UnsafeFormatError):
        mods.decode_value(b"x", "pkl", "pickle", False, 0)


def test_every_listed_modality_is_decoded_and_aligned_with_the_image():
    cfg = DecodeConfig(resolution=48, crop="random", flip=True)
    out = Decoder(cfg, seed=5)(block(range(12)))
    assert out["image"].shape == (12, 48, 48, 3) and out["image"].dtype == np.uint8
    assert out["depth"].shape == (12, 48, 48) and out["depth"].dtype == np.uint16
    assert out["mask"].shape == (12, 48, 48) and out["mask"].dtype == np.uint8
    assert out["label"].tolist() == list(range(12)) and out["label"].dtype.kind == "i"
    assert out["caption"].tolist() == [f"sample {i}" for i in range(12)]
    assert out["depth"].max() > 255  # 16-bit values kept
    flipped = 0
    for i in range(12):
        assert multimodal.alignment(out["image"][i], out["depth"][i], out["mask"][i]) > 0.95, i
        # the flip and the crop were drawn: x grows to the right unless flipped
        row = out["depth"][i][0].astype(int)
        flipped += row[0] > row[-1]
    assert 0 < flipped < 12


def test_a_misaligned_mask_would_be_caught():
    out = Decoder(DecodeConfig(resolution=48, crop="random"), seed=5)(block(range(4)))
    shifted = [multimodal.alignment(out["image"][i], out["depth"][i][:, ::-1],
                                    out["mask"][i][::-1]) for i in range(4)]
    assert max(shifted) < 0.5


def test_resample_none_keeps_a_modality_at_its_own_size():
    cfg = DecodeConfig(resolution=32, resample={"mask": "none"})
    out = Decoder(cfg)(block([1, 3]))  # sizes differ: a list, not a stacked array
    assert out["mask"].dtype == object
    assert [m.shape for m in out["mask"]] == [(h, w) for w, h in map(multimodal.sample_size,
                                                                      (1, 3))]


def test_a_shape_that_cannot_be_mapped_names_sample_and_modality():
    cols = block([1, 2])
    cols["mask"][0] = _png(np.zeros((10, 90), np.uint8), "L")  # not the image's aspect
    with pytest.raises(IngestError, match=r"key k00001 index 1: cannot decode: SampleError: "
                                          r"mask: 90x10 cannot be mapped onto the image"):
        Decoder(DecodeConfig(resolution=32))(cols)
    out = Decoder(DecodeConfig(resolution=32), on_error="skip", log_skips=False)(cols)
    assert "mask: 90x10 cannot be mapped" in out["__error__"][0] and not out["__error__"][1]
    assert out["mask"].shape == (2, 32, 32)  # the skipped row is a placeholder


def test_optional_modality_absent_is_none_not_dropped():
    cols = block([0, 1])
    cols["depth"][1] = None
    cols[ext_column("depth")][1] = None
    out = Decoder(DecodeConfig(resolution=32))(cols)
    assert out["depth"].dtype == object and out["depth"][1] is None
    assert out["depth"][0].shape == (32, 32)


def test_unknown_extension_arrives_as_bytes():
    cols = block([0])
    cols["meta"], cols[ext_column("meta")] = [b"\x01\x02opaque"], ["xyz"]
    out = Decoder(DecodeConfig(resolution=32))(cols)
    assert out["meta"].tolist() == [b"\x01\x02opaque"]


def test_decoder_override_by_name():
    cols = block([0])
    out = Decoder(DecodeConfig(resolution=32, decoders={"caption": "bytes", "label": "text"},
                               caption_modality=None))(cols)
    assert json.loads(out["caption"][0]) == {"prompt": "sample 0"}
    assert out["label"][0] == "0"


def test_placement_maps_half_resolution_proportionally():
    assert map_size((50, 36), (100, 72)) and map_size((51, 36), (101, 72))
    assert not map_size((90, 10), (100, 72))
    p = place((100, 72), Geometry(32, 32, "random"), 12345, scalable=True)
    assert p.to_list() == type(p).from_list(p.to_list()).to_list()
    assert p.out == (32, 32)


def test_large_samples_stay_separate_arrays_and_the_batch_stacks_them_once():
    """A block keeps samples of STACK_BYTES or more as separate arrays (no stacking copy in the
    worker); the batcher and collate deliver the same tensor as stacked blocks would."""
    from ray_ingest.decode.decoder import STACK_BYTES
    from ray_ingest.loader.batcher import concat
    from ray_ingest.loader.collate import to_batch

    cfg = DecodeConfig(resolution=640)
    assert 640 * 640 * 3 >= STACK_BYTES > 48 * 48 * 3
    cols = block(range(3))
    cols["image"][1] = b"not an image"
    out = Decoder(cfg, on_error="skip", log_skips=False)(cols)
    assert out["image"].dtype == object and [a.shape for a in out["image"]] == [(640, 640, 3)] * 3
    assert not out["image"][1].any()  # the skipped sample's placeholder
    assert out["depth"].dtype == np.uint16 and out["depth"].shape == (3, 640, 640)  # 0.8 MB each
    out["__seq__"] = np.arange(3)
    both = concat([{k: v[:2] for k, v in out.items()}, {k: v[2:] for k, v in out.items()}])
    batch = to_batch(both, cfg, None, bucket="", epoch=0, step=0)
    assert tuple(batch["image"].shape) == (3, 640, 640, 3)
    np.testing.assert_array_equal(batch["image"][2].numpy(), out["image"][2])
