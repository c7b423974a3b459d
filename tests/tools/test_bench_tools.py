"""The benchmark tools of issue 29: ``ours:MODE`` contenders (ray_ingest/tools/benchmark.py), the
train-step benchmark's arithmetic, its seeded step, its loop's data-wait, and (``ray``) its
loop fed by each decode mode on a tiny dataset."""

from __future__ import annotations

import argparse
import time

import pytest

from ray_ingest.errors import ConfigError
from ray_ingest.tools import benchmark as tb
from ray_ingest.tools import train_bench as ts


def test_ours_mode_contenders():
    run = tb.contender("ours:actors")
    assert run.func is tb.run_ours and run.keywords == {"compute": "actors"}
    assert tb.contender("wds_dl_pw") is tb.run_wds_dl_pw
    for bad in ("ours:", "wds_dl_pw:x", "nope"):
        with pytest.raises(SystemExit, match="unknown contender"):
            tb.contender(bad)
    assert tb.ours_config("/d", 64, 8, "tasks").decode.compute == "tasks"
    assert tb.ours_config("/d", 64, 8).decode.compute == "auto"
    with pytest.raises(ConfigError, match="decode.compute"):
        tb.ours_config("/d", 64, 8, "fibers")
    cfg = tb.ours_config("/d", 64, 8,
                         "decode.compute=threads+decode.threads=3+loader.block_rows=64")
    assert (cfg.decode.compute, cfg.decode.threads, cfg.loader.block_rows) == ("threads", 3, 64)
    assert cfg.loader.batch_size == 8 and cfg.decode.resolution == 64
    with pytest.raises(SystemExit, match="not decode.FIELD=VALUE"):
        tb.ours_config("/d", 64, 8, "train.epochs=3")


def test_summarize_steps_leaves_warmup_out():
    # (epoch, wait s, step s, samples): a slow start, then 0.1 s steps with 0.01 s waits and
    # one 0.31 s stall at the epoch boundary
    steps = [(0, 2.0, 0.5, 32), (0, 0.5, 0.3, 32)]
    steps += [(0, 0.01, 0.1, 32)] * 4 + [(1, 0.31, 0.1, 32)] + [(1, 0.01, 0.1, 16)]
    s = ts.summarize_steps(steps, wall_s=4.0, warmup=2)
    assert s["steps"] == 8 and s["samples"] == 7 * 32 + 16
    assert s["step_ms"] == pytest.approx(100.0)
    assert s["wait_ms"] == pytest.approx(10.0)
    assert s["wait_mean_ms"] == pytest.approx((5 * 0.01 + 0.31) / 6 * 1e3)
    busy = 5 * 0.01 + 0.31 + 6 * 0.1
    assert s["wait_share"] == pytest.approx((5 * 0.01 + 0.31) / busy)
    assert s["per_step_ms"] == pytest.approx(busy / 6 * 1e3)
    assert s["samples_s"] == pytest.approx((7 * 32 + 16) / 4.0)
    assert s["steady_samples_s"] == pytest.approx((5 * 32 + 16) / busy)
    assert s["first_wait_s"] == 2.0
    assert ts.summarize_steps(steps[:2], 3.0, warmup=5)["step_ms"] == pytest.approx(400.0)
    with pytest.raises(ValueError, match="no batch"):
        ts.summarize_steps([], 1.0, 0)


def _run(step_ms, per_step_ms):
    return {k: 1.0 for k in ts.MEDIAN_KEYS} | {"step_ms": step_ms, "per_step_ms": per_step_ms}


def test_compare_steps_inflation_against_predecoded():
    runs = {
        ts.PREDECODED: [_run(100, 100), _run(80, 80), _run(90, 90)],
        "ours:threads": [_run(150, 160), _run(120, 130), _run(135, 140)],
        "ours:actors": [_run(99, 200), _run(100, 210)],
    }
    med = ts.compare_steps(runs)
    assert med[ts.PREDECODED]["inflation"] == 1.0
    assert med["ours:threads"]["inflation"] == pytest.approx(135 / 90)
    assert med["ours:threads"]["pace"] == pytest.approx(140 / 90)
    assert med["ours:threads"]["per_run_inflation"] == pytest.approx([1.5, 1.5, 1.5])
    assert med["ours:actors"]["inflation"] == pytest.approx(99.5 / 90)
    assert med["ours:actors"]["per_run_inflation"] == pytest.approx([0.99, 1.25])
    lines = ts.format_steps(med)
    assert len(lines) == 4 and "1.50x" in lines[2]
    alone = ts.compare_steps({"ours:threads": runs["ours:threads"]})
    assert "inflation" not in alone["ours:threads"]
    assert "-" in ts.format_steps(alone)[1]


def test_step_is_seeded_and_learns():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs it; OpenMP's spinning is slow when shared
    try:
        g = torch.Generator().manual_seed(1)
        images = torch.randint(0, 256, (8, 32, 32, 3), dtype=torch.uint8, generator=g)
        a = ts.make_step(width=4, depth=2, classes=4, lr=0.1, seed=3)
        b = ts.make_step(width=4, depth=2, classes=4, lr=0.1, seed=3)
        la = [a(images) for _ in range(8)]
        assert la == [b(images) for _ in range(8)]
        assert la[-1] < la[0]
        c = ts.make_step(width=4, depth=2, classes=4, lr=0.1, seed=4)
        assert c(images) != la[0]
    finally:
        torch.set_num_threads(threads)


def test_run_loop_measures_wait_and_step_apart():
    def items():
        for i in range(4):
            time.sleep(0.05 if i == 2 else 0.0)
            yield 0, i, 10

    wall, steps = ts.run_loop(items(), lambda x: time.sleep(0.02))
    assert [n for *_, n in steps] == [10] * 4
    assert steps[2][1] >= 0.05 and all(s >= 0.02 for _, _, s, _ in steps)
    assert wall >= sum(w + s for _, w, s, _ in steps)


@pytest.mark.ray
def test_train_loop_on_each_decode_mode(ray_local, tmp_path):
    """Every decode mode and the DataLoader feed the loop the same number of samples, as
    uint8 (B, res, res, 3) batches; pre-decoded batches are ours' first epoch."""
    from ray_ingest.tools.synth import synth_dataset

    root = tmp_path / "ds"
    synth_dataset(str(root), samples=48, shard_size=16, seed=0, min_side=40, max_side=64)
    args = argparse.Namespace(data=str(root), res=32, batch=8, epochs=2, cores=1)
    seen = {}
    for name in ("ours:threads", "ours:tasks", "ours:actors", "wds_dl_pw"):
        shapes = []

        def step(images, shapes=shapes):
            shapes.append((tuple(images.shape), str(images.dtype)))
            return 0.0

        _, steps = ts.run_loop(ts.contender_items(name, args, None), step)
        seen[name] = sum(n for *_, n in steps)
        assert {e for e, *_ in steps} == {0, 1}, name
        assert set(shapes) == {((8, 32, 32, 3), "torch.uint8")}, name
    assert seen == dict.fromkeys(seen, 96)


@pytest.mark.ray
def test_fourk_sizes_the_object_store_per_sample(ray_local, tmp_path):
    """bench/fourk.py's transport figure on a small photo-like dataset: with decode.device:
    cuda a sample costs about its JPEG in the object store, decoded pixels far more."""
    from bench.fourk import decode_costs, object_store_bytes
    from ray_ingest.tools.synth import synth_dataset

    synth_dataset(str(tmp_path / "p"), samples=6, shard_size=6, seed=0, min_side=1280,
                  max_side=1280, aspect_ratios=[(16, 9)], image_style="photo")
    got = object_store_bytes(str(tmp_path / "p"), res=512, buckets=False, n=4)
    assert got["cuda_over_jpeg"] <= 1.1 and got["cpu_over_cuda"] > 1.5, got
    costs = decode_costs(str(tmp_path / "p"), res=512, reps=1)
    assert {"simplejpeg_decode_ms", "pillow_decode_ms", "pillow_resize_kept_ms"} <= set(costs)
