"""``decode.sim_cost_s``: the benchmarks' simulated decode cost (bench/scale_out.py).

Off by default; when on, every decoded sample sleeps a deterministic time drawn from (seed,
shard, index) and the decoded rows are exactly those without it. No Ray.
"""

from __future__ import annotations

import statistics

import attrs
import numpy as np
import pyarrow as pa
import pytest

from ray_ingest.config import DecodeConfig, config_from_dict
from ray_ingest.decode.decoder import (
    DECODE_TIME,
    Decoder,
    sim_cost,
)
from ray_ingest.errors import ConfigError
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import (
    make_sample,
    synth_dataset,
)


def _rows(n: int, sid: int = 2) -> pa.Table:
    rows = []
    for i in range(n):
        key, members = make_sample(5, i, ("image", "caption"), min_side=24, max_side=40)
        rows.append({"__key__": key, "__shard__": "part_000000/000002.tar", "__index__": i,
                     "__sid__": sid, "__seq__": i, "__pad__": False, "__bucket__": "",
                     "__t_read__": 0.0, "__error__": "",
                     "image": members["image"][1], "image__ext": "jpg",
                     "caption": members["caption"][1], "caption__ext": "json"})
    return pa.Table.from_pylist(rows)


@pytest.fixture
def sleeps(monkeypatch):
    """Every time.sleep of the decode module, recorded instead of slept."""
    calls: list[float] = []
    monkeypatch.setattr("ray_ingest.decode.decoder.time.sleep", calls.append)
    return calls


def test_off_by_default(sleeps):
    cfg = config_from_dict({"data": {"paths": ["x"]}}).decode
    assert (cfg.sim_cost_s, cfg.sim_cost_jitter) == (0.0, 0.0)
    assert sim_cost(cfg, 1, 2, 3) == 0.0
    Decoder(DecodeConfig(resolution=16), seed=1)(_rows(4))
    assert sleeps == []


def test_costs_are_deterministic_per_sample_and_bounded():
    cfg = DecodeConfig(sim_cost_s=0.01, sim_cost_jitter=0.5)
    draws = [sim_cost(cfg, 7, sid, idx) for sid in range(4) for idx in range(250)]
    again = [sim_cost(cfg, 7, sid, idx) for sid in range(4) for idx in range(250)]
    assert draws == again  # nothing but (seed, shard, index) decides
    assert all(0.005 <= d <= 0.015 for d in draws)
    assert len(set(draws)) > 990  # a draw per sample, not per shard or per run
    assert statistics.fmean(draws) == pytest.approx(0.01, rel=0.05)
    other_seed = [sim_cost(cfg, 8, sid, idx) for sid in range(4) for idx in range(250)]
    assert other_seed != draws
    # without jitter every sample costs exactly the base
    flat = attrs.evolve(cfg, sim_cost_jitter=0.0)
    assert {sim_cost(flat, 7, s, i) for s in range(3) for i in range(9)} == {0.01}


def test_decoder_sleeps_the_block_cost_and_delivers_the_same_rows(sleeps):
    block = _rows(6)
    plain = Decoder(DecodeConfig(resolution=16), seed=3)(block)
    cfg = DecodeConfig(resolution=16, sim_cost_s=0.02, sim_cost_jitter=0.25)
    costly = Decoder(cfg, seed=3)(block)
    assert sleeps == [pytest.approx(sum(sim_cost(cfg, 3, 2, i) for i in range(6)))]
    assert sorted(plain) == sorted(costly)
    for col in plain:
        if col != DECODE_TIME:  # CPU seconds of this thread: differ run to run
            np.testing.assert_array_equal(plain[col], costly[col], err_msg=col)


def test_samples_that_failed_to_read_cost_nothing(sleeps):
    block = _rows(3).to_pylist()
    block[1]["__error__"] = "read: OSError: gone"
    cfg = DecodeConfig(resolution=16, sim_cost_s=0.5)
    out = Decoder(cfg, on_error="skip")(pa.Table.from_pylist(block))
    assert out["__error__"].tolist() == ["", "read: OSError: gone", ""]
    assert sleeps == [pytest.approx(1.0)]


@pytest.mark.parametrize(("field", "value"), [("sim_cost_s", -0.1), ("sim_cost_jitter", 1.5),
                                              ("sim_cost_jitter", -1)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"decode.{field}: expected"):
        config_from_dict({"data": {"paths": ["x"]}, "decode": {field: value}})


def test_loader_delivers_the_same_batches_with_the_cost(tmp_path, sleeps):
    """The whole in-process path (decode threads): same keys, provenance and pixels."""
    data = str(tmp_path / "ds")
    synth_dataset(data, samples=40, shard_size=10, seed=2, min_side=24, max_side=40)

    def batches(extra: dict) -> list:
        cfg = config_from_dict({
            "data": {"paths": [data]},
            "decode": {"resolution": 16, "compute": "threads", "threads": 2, **extra},
            "loader": {"batch_size": 8, "read_workers": 1, "seed": 4, "head_start_batches": 0},
        })
        # rank 0 of 1: tests/loader/test_metrics.py counts rank 1's metrics of a dataset of this
        # shape in the session Ray, which would add these
        loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1))
        return [(b.sample_keys, b.sids, b.indices, b.pads, b["image"].numpy().tobytes())
                for _, bs in loader.epochs(1) for b in bs]

    plain = batches({})
    assert sleeps == []
    assert batches({"sim_cost_s": 0.01, "sim_cost_jitter": 0.3}) == plain
    assert sleeps and sum(sleeps) == pytest.approx(0.01 * 40, rel=0.3)  # 40 samples
