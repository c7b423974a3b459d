"""Notebook exploration: grids, lookup by key, statistics and plots checked against the data
generator; the docs notebook is executed with nbclient."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from PIL import Image

from ray_ingest.catalog.load import load_catalog
from ray_ingest.errors import IngestError
from ray_ingest.tools import explore
from ray_ingest.tools.synth import (
    make_caption,
    make_sample,
    sample_spec,
    synth_dataset,
)
from ray_ingest.twintar.dataset import write_wdinfo
from ray_ingest.twintar.layout import aspect_bucket
from ray_ingest.twintar.reader import read_shard
from ray_ingest.twintar.twin import KEY
from ray_ingest.twintar.writer import write_shard

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "docs" / "explore.ipynb"
MODS = ("image", "caption", "umt5")
#: The notebook's synth_dataset call (test_notebook_executes checks it is still this one).
NB_SYNTH = dict(samples=48, shard_size=8, seed=0, modalities=list(MODS),
                classify_aspect_ratio=True)
SEED = 5
SAMPLES = 30


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("explore") / "ds"
    synth_dataset(str(root), samples=SAMPLES, shard_size=4, seed=SEED, modalities=MODS,
                  classify_aspect_ratio=True, min_side=40, max_side=120)
    return str(root)


def _spec(i: int):
    return sample_spec(SEED, i, min_side=40, max_side=120)


def _index(key: str) -> int:
    return int(key[1:])


def _catalog_keys(root: str) -> list[str]:
    """Keys in catalog order, read without the explore module."""
    return [r[KEY] for s in load_catalog(root).shards for r in read_shard(s)]


def _cell_keys(html_text: str) -> list[str]:
    return re.findall(r'<figure class="ri-cell" data-key="([^"]+)"', html_text)


def test_show_renders_first_samples_as_inline_thumbnails(data):
    ds = explore.open_dataset(data)
    grid = ds.show(6, thumb=48)
    expected = _catalog_keys(data)[:6]
    assert grid.keys == expected
    page = grid._repr_html_()
    assert _cell_keys(page) == expected
    images = re.findall(r'src="data:image/jpeg;base64,([^"]+)"', page)
    assert len(images) == 6
    for b64 in images:
        with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
            assert im.format == "JPEG" and max(im.size) <= 48
    for key in expected:  # caption and true size under each thumbnail
        spec = _spec(_index(key))
        assert f"{spec.width}&times;{spec.height}" in page
    first = json.loads(make_caption(_spec(_index(expected[0])), SEED))["prompt"]
    assert first[:40] in page


def test_show_bucket_and_keys(data):
    ds = explore.open_dataset(data)
    bucket = max(ds.buckets, key=ds.buckets.get)
    grid = ds.show(100, bucket=bucket.replace("_", ":"))
    assert len(grid) == ds.buckets[bucket] and {s.bucket for s in grid} == {bucket}
    for s in grid:
        spec = _spec(_index(s.key))
        assert aspect_bucket(spec.width, spec.height) == bucket
    wanted = ["s00000017", "s00000002", "s00000029"]
    grid = ds.show(keys=wanted)
    assert grid.keys == wanted and _cell_keys(grid._repr_html_()) == wanted
    with pytest.raises(IngestError, match="bucket"):
        ds.show(3, bucket="5:4")
    assert ds.show(0).keys == [] and "no samples" in ds.show(0)._repr_html_()


def test_seeded_show_is_stable(data):
    ds = explore.open_dataset(data)
    a, b = ds.show(5, seed=1).keys, ds.show(5, seed=1).keys
    assert a == b and len(a) == 5 and set(a) <= set(_catalog_keys(data))


@pytest.mark.parametrize("with_index", [True, False])
def test_sample_by_key_is_byte_exact(data, tmp_path, with_index):
    root = data
    if not with_index:
        root = str(tmp_path / "noidx")
        shutil.copytree(data, root)
        removed = [p.unlink() for p in Path(root).rglob("*.idx.json")]
        assert removed
    ds = explore.open_dataset(root)
    for i in (0, 13, SAMPLES - 1):
        key, members = make_sample(SEED, i, MODS, min_side=40, max_side=120)
        s = ds.sample(key)
        assert s.key == key
        for m in MODS:
            assert s.members[m] == members[m]
        spec = _spec(i)
        assert s.image_size == (spec.width, spec.height)
        assert s.image().size == (spec.width, spec.height)
        assert s.array("umt5").shape == (spec.embed_len, 64)
        assert s.caption() == json.loads(members["caption"][1])["prompt"]
        assert s.bucket == aspect_bucket(spec.width, spec.height)
        html_text = s._repr_html_()
        assert f'data-key="{key}"' in html_text and "npy (" in html_text
        assert s.to_dict()["members"]["image"].startswith("jpg ")
    with pytest.raises(KeyError, match="s99999999"):
        ds.sample("s99999999")


def test_stats_match_the_generator(data):
    ds = explore.open_dataset(data)
    st = ds.stats()
    assert st["samples"] == st["scanned"] == SAMPLES == st["total"]["samples"]
    assert st["shards"] == len(load_catalog(data).shards)
    specs = [_spec(i) for i in range(SAMPLES)]
    by_bucket: dict[str, list] = {}
    for sp in specs:
        by_bucket.setdefault(aspect_bucket(sp.width, sp.height), []).append(sp)
    assert sorted(st["buckets"]) == sorted(by_bucket)
    for b, group in by_bucket.items():
        row = st["buckets"][b]
        assert row["samples"] == len(group)
        assert row["image_width"]["min"] == min(sp.width for sp in group)
        assert row["image_height"]["max"] == max(sp.height for sp in group)
        caps = [len(json.loads(make_caption(sp, SEED))["prompt"]) for sp in group]
        assert row["caption_chars"]["max"] == max(caps)
        assert row["caption_chars"]["min"] == min(caps)
    for m in MODS:
        total = sum(len(make_sample(SEED, i, MODS, min_side=40, max_side=120)[1][m][1])
                    for i in range(SAMPLES))
        assert st["modalities"][m]["bytes"] == total == st["total"]["bytes"][m]
        assert st["modalities"][m]["present"] == SAMPLES and st["modalities"][m]["absent"] == 0
    assert st["modalities"]["image"]["exts"] == {"jpg": SAMPLES}
    json.dumps(st)  # plain JSON-able dict
    page = st._repr_html_()
    assert "<table>" in page and all(b in page for b in by_bucket)
    limited = explore.open_dataset(data).stats(limit=5)
    assert limited["scanned"] == 5 and limited["total"]["samples"] == 5
    assert "scanned 5 of" in limited._repr_html_()


def test_plots_return_agg_figures(data):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ds = explore.open_dataset(data)
    figs = [ds.plot_aspect_ratios(), ds.plot_image_sizes(), ds.plot_caption_lengths(),
            ds.plot_caption_lengths(unit="words")]
    for fig in figs:
        assert isinstance(fig, Figure) and isinstance(fig.canvas, FigureCanvasAgg)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        assert buf.getvalue().startswith(b"\x89PNG")
    hist = figs[0].axes[0]
    assert sum(p.get_height() for p in hist.patches if p.get_height() > 0) >= SAMPLES - 1e-9
    scatter = figs[1].axes[0]
    assert sum(len(c.get_offsets()) for c in scatter.collections) == SAMPLES
    assert "pyplot" not in sys.modules or not __import__("matplotlib.pyplot").pyplot.get_fignums()
    with pytest.raises(IngestError, match="unit"):
        ds.plot_caption_lengths(unit="tokens")


def test_captions_and_keys_are_escaped(tmp_path):
    leaf = str(tmp_path / "esc")
    img = io.BytesIO()
    Image.new("RGBA", (20, 10), (255, 0, 0, 128)).save(img, format="PNG")
    caption = json.dumps({"prompt": '<script>alert("x")</script> & more'}).encode()
    write_shard(leaf, "000000.tar", ["image", "caption"],
                [("a&b", {"image": ("png", img.getvalue()), "caption": ("json", caption)}),
                 ("bad", {"image": ("jpg", b"not a jpeg"), "caption": ("txt", b"plain")})])
    write_wdinfo(leaf, ["000000.tar"], [2], ["image", "caption"])
    ds = explore.open_dataset(leaf)
    page = ds.show(2)._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert 'data-key="a&amp;b"' in page
    assert "data:image/png;base64," in page  # alpha kept as PNG
    assert "unreadable image" in page and "plain" in page
    st = ds.stats()
    assert st["buckets"][explore.NO_BUCKET]["image_width"] == {
        "min": 20, "median": 20, "mean": 20.0, "max": 20}


def test_memory_url(tmp_path):
    url = "memory://ri_explore_test/ds"
    synth_dataset(url, samples=6, shard_size=3, seed=1, overwrite=True)
    try:
        ds = explore.open_dataset(url)
        assert len(ds) == 6 and ds.sample("s00000004").key == "s00000004"
        assert ds.show(2).keys == ["s00000000", "s00000001"]
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/ri_explore_test", recursive=True)


def test_open_dataset_rejects_unknown_modality(data):
    with pytest.raises(IngestError, match="image_modality"):
        explore.open_dataset(data, image_modality="video")


def test_open_dataset_modalities(data):
    assert explore.open_dataset(data, ["caption", "image"]).modalities == ("caption", "image")
    ds = explore.open_dataset(data, modalities=["caption"])
    assert ds.modalities == ("caption",) and ds.image_modality is None
    with pytest.raises(TypeError, match="keys"):
        explore.open_dataset(data, keys=["caption"])


# --------------------------------------------------------------------------- the notebook


def _kernel_env(tmp_path, monkeypatch) -> None:
    """Make kernel "python3" resolvable and ray_ingest importable, without touching ~."""
    from jupyter_client.kernelspec import KernelSpecManager

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if "python3" in KernelSpecManager().find_kernel_specs():
        return
    from ipykernel.kernelspec import write_kernel_spec

    share = tmp_path / "jupyter"
    write_kernel_spec(str(share / "kernels" / "python3"))
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(
        [str(share), *filter(None, [os.environ.get("JUPYTER_PATH")])]))


def _outputs(nb, tag: str) -> list[dict]:
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert cells, f"no cell tagged {tag!r} in {NOTEBOOK}"
    return [o for c in cells for o in c.outputs]


def _html(nb, tag: str) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in _outputs(nb, tag))


def test_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _kernel_env(tmp_path, monkeypatch)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    setup = next(c.source for c in nb.cells if "setup" in c.metadata.get("tags", []))
    compact = re.sub(r"\s+", "", setup)
    for k, v in NB_SYNTH.items():
        literal = repr(v).replace(" ", "").replace("'", '"')
        assert f"{k}={literal}" in compact, f"the notebook's synth_dataset call changed ({k})"
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=180,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()

    # The same data, generated here: the grid must show its first 8 samples in catalog order.
    ref = tmp_path / "ref"
    synth_dataset(str(ref), **NB_SYNTH)
    first8 = _catalog_keys(str(ref))[:8]
    grid = _html(nb, "grid")
    assert _cell_keys(grid) == first8
    assert grid.count("data:image/jpeg;base64,") == 8
    bucket_keys = _cell_keys(_html(nb, "bucket-grid"))
    assert bucket_keys and all(
        aspect_bucket(sp.width, sp.height) == "9_16"
        for sp in (sample_spec(0, _index(k)) for k in bucket_keys))
    assert _cell_keys(_html(nb, "keys-grid")) == ["s00000003", "s00000011", "s00000042"]
    assert _cell_keys(_html(nb, "sample")) == ["s00000007"]
    assert "<table>" in _html(nb, "stats")
    pngs = [o for o in _outputs(nb, "plot") if "image/png" in o.get("data", {})]
    assert len(pngs) == 3
    # read_twin_tars + a Ray aggregation: samples, mean and longest caption per bucket
    rows = re.findall(r"<th>(\w+)</th>\s*<td>(\d+)</td>\s*<td>([\d.]+)</td>\s*<td>(\d+)</td>",
                      _html(nb, "ray-agg"))
    want: dict[str, list[int]] = {}
    for i in range(NB_SYNTH["samples"]):
        sp = sample_spec(0, i)
        want.setdefault(aspect_bucket(sp.width, sp.height), []).append(
            len(json.loads(make_caption(sp, 0))["prompt"]))
    assert [r[0] for r in rows] == sorted(want)
    for bucket, n, mean, longest in rows:
        assert int(n) == len(want[bucket]) and int(longest) == max(want[bucket])
        assert float(mean) == pytest.approx(sum(want[bucket]) / len(want[bucket]), abs=1e-5)
    # a decoded multimodal sample: the image, its mask over it and its depth map, every field
    mm = _html(nb, "multimodal")
    assert 'data-key="s00000002"' in mm and mm.count("data:image/png;base64,") == 3
    assert "mask over image" in mm and "depth (uint16" in mm
    for field in ("caption", "label", "&#x27;shape&#x27;: [192, 192]"):
        assert field in mm
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
