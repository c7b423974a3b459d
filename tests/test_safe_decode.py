"""Safe decoding: members that execute code when loaded (.pkl, .pickle, .pt, .pth) are refused
unless ``decode.allow_pickle`` opts in.

The payloads here are real: a pickle whose ``__reduce__`` creates a marker file, so a refusal
is checked by the marker *not* existing (nothing was unpickled), and the opt-in by the decoded
value (and, for the hostile pickle, by the marker appearing: which is why it is opt-in).
"""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from ray_ingest.config import DecodeConfig, config_from_dict
from ray_ingest.decode.decoder import (
    UNSAFE_EXTS,
    Decoder,
    load_array,
)
from ray_ingest.errors import IngestError, UnsafeFormatError
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import (
    make_sample,
    synth_dataset,
)
from tests.datagen import write_tar


class Hostile:
    """Unpickling this creates ``path``: stands for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def row(embedding: bytes, ext: str, image_ext: str = "jpg", image: bytes | None = None) -> dict:
    key, members = make_sample(0, 3, ("image", "caption"))
    return {"__key__": key, "__shard__": "part_000000/000000.tar", "__index__": 3,
            "__sid__": 0, "__seq__": 3, "__pad__": False, "__bucket__": "", "__t_read__": 0.0,
            "__error__": "",
            "image": image if image is not None else members["image"][1],
            "image__ext": image_ext,
            "caption": members["caption"][1], "caption__ext": "json",
            "umt5": embedding, "umt5__ext": ext}


def serialize(value, ext: str) -> bytes:
    buf = io.BytesIO()
    if ext in ("pt", "pth"):
        import torch

        torch.save(value, buf)
    else:
        pickle.dump(value, buf)
    return buf.getvalue()


def decoder(allow: bool, on_error: str = "raise") -> Decoder:
    cfg = DecodeConfig(resolution=16, embedding_key="umt5", allow_pickle=allow)
    return Decoder(cfg, on_error=on_error)


def table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pylist(rows)


@pytest.mark.parametrize("ext", sorted(UNSAFE_EXTS))
def test_refused_by_default_and_never_loaded(tmp_path, ext):
    marker = tmp_path / "executed"
    data = serialize(Hostile(marker), ext)
    with pytest.raises(IngestError) as info:
        decoder(allow=False)(table([row(data, ext)]))
    assert str(info.value) == (
        f"shard part_000000/000000.tar key s00000003 index 3: cannot decode: "
        f"UnsafeFormatError: .{ext} members execute code when loaded; "
        f"set decode.allow_pickle: true to opt in")
    with pytest.raises(UnsafeFormatError):
        load_array(data, ext, allow_pickle=False)
    # under skip: a placeholder row carrying the reason, never delivered
    out = decoder(allow=False, on_error="skip")(table([row(data, ext)]))
    assert out["__error__"].tolist() == [
        f"UnsafeFormatError: .{ext} members execute code when loaded; "
        f"set decode.allow_pickle: true to opt in"]
    assert out["umt5"].tolist() == [None]
    assert not marker.exists()


@pytest.mark.parametrize("ext", ["pt", "pkl"])
def test_unsafe_member_in_the_image_slot_is_refused(tmp_path, ext):
    marker = tmp_path / "executed"
    data = serialize(Hostile(marker), ext)
    with pytest.raises(IngestError, match=rf"UnsafeFormatError: \.{ext} members execute code"):
        decoder(allow=False)(table([row(serialize(np.zeros(2), "pkl"), "npy", ext, data)]))
    assert not marker.exists()


def test_pickle_named_as_json_or_npy_is_not_executed(tmp_path):
    """Renaming does not help: .npy loads with allow_pickle=False, captions are JSON."""
    marker = tmp_path / "executed"
    data = pickle.dumps(Hostile(marker))
    out = decoder(allow=False, on_error="skip")(table([row(data, "npy")]))
    assert out["__error__"][0].startswith("ValueError: ")  # numpy refuses the pickle
    bad_caption = row(serialize(np.zeros(2), "npy"), "npy")
    bad_caption["caption"] = data
    out = decoder(allow=True, on_error="skip")(table([bad_caption]))
    assert out["__error__"][0].startswith(("UnicodeDecodeError: ", "JSONDecodeError: "))
    assert not marker.exists()


@pytest.mark.parametrize("ext", sorted(UNSAFE_EXTS))
def test_opt_in_decodes(ext):
    value = np.arange(12, dtype=np.float16).reshape(3, 4)
    if ext in ("pt", "pth"):
        import torch

        value = torch.from_numpy(value)
    out = decoder(allow=True)(table([row(serialize(value, ext), ext)]))
    assert out["__error__"].tolist() == [""]
    np.testing.assert_array_equal(out["umt5"][0], np.arange(12, dtype=np.float16).reshape(3, 4))


def test_opt_in_really_runs_the_code(tmp_path):
    """Why it is opt-in: with allow_pickle the hostile payload executes."""
    marker = tmp_path / "executed"
    decoder(allow=True, on_error="skip")(table([row(pickle.dumps(Hostile(marker)), "pkl")]))
    assert marker.exists()


def test_config_default_is_refusal():
    assert DecodeConfig().allow_pickle is False
    cfg = config_from_dict({"data": {"paths": ["x"]}})
    assert cfg.decode.allow_pickle is False


# --- through the Ray pipeline: the decode actors refuse as well --------------------------------


@pytest.mark.ray
def test_pipeline_refuses_pickled_embeddings(ray_local, tmp_path):
    root = tmp_path / "ds"
    synth_dataset(str(root), samples=8, shard_size=4, seed=2, min_side=16, max_side=32,
                  modalities=("image", "caption", "umt5"))
    marker = tmp_path / "executed"
    umt5 = root / "umt5" / "part_000000" / "000001.tar"
    with tarfile.open(umt5) as tf:
        names = [m.name for m in tf if m.isfile()]
    # shard 1's embeddings become pickles (one of them hostile), same keys
    members = [(n.replace(".npy", ".pkl"), pickle.dumps(Hostile(marker) if i == 2 else
                                                        np.zeros((2, 4), np.float16)))
               for i, n in enumerate(names)]
    write_tar(umt5, members, index=True)
    cfg = config_from_dict({
        "data": {"paths": [str(root)], "modalities": ["image", "caption", "umt5"]},
        "decode": {"resolution": 16, "embedding_key": "umt5", "pool_min": 1, "pool_max": 1,
                   "num_cpus": 0.25},
        "loader": {"batch_size": 4, "read_workers": 1, "read_num_cpus": 0.25, "block_rows": 4,
                   "shuffle": False, "equal_work": False, "on_error": "skip"},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, num_workers=1))
    delivered, skipped = [], []
    for _, batches in loader.epochs(1):
        for b in batches:
            delivered += [(s, i) for s, i, p in zip(b.sids, b.indices, b.pads, strict=True)
                          if not p]
            skipped += b.skipped
    sid = next(i for i, s in enumerate(loader.catalog.shards) if s.path.endswith("000001.tar"))
    assert sorted((s, i) for s, i, _ in skipped) == [(sid, i) for i in range(4)]
    assert {r for _, _, r in skipped} == {
        "UnsafeFormatError: .pkl members execute code when loaded; "
        "set decode.allow_pickle: true to opt in"}
    assert sorted(delivered) == [(1 - sid, i) for i in range(4)]
    assert loader.metrics()["skips_by_kind"] == {"UnsafeFormatError": 4}
    assert not marker.exists()
