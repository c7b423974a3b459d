"""Observability: the loader's stage breakdown accounts for the train loop's time, Ray Data's
own stats are kept, the job's log line carries the breakdown, and audit shows progress."""

from __future__ import annotations

import json
import time

import pytest

from ray_ingest.config import config_from_dict
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.train.worker import format_step_log, parse_step_log

STAGES = ("data_wait", "assemble", "transfer", "compute")
#: Fake compute per batch: large enough that compute is a visible share of the loop.
STEP_S = 0.15


@pytest.mark.ray
def test_stage_fractions_add_up_to_the_measured_loop_time(ray_local, tmp_path):
    from ray_ingest.loader.ingest import IngestLoader

    root = tmp_path / "ds"
    synth_dataset(str(root), samples=48, shard_size=12, seed=0, min_side=24, max_side=48)
    cfg = config_from_dict({
        "data": {"paths": [str(root)]},
        "decode": {"resolution": 16, "pool_min": 1, "pool_max": 1, "compute": "actors"},
        "loader": {"head_start_batches": 0, "batch_size": 8, "read_workers": 1},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1))

    compute = 0.0
    batches = 0
    t_start = time.perf_counter()  # the caller's own clock, independent of the loader's
    for _epoch, epoch_batches in loader.epochs(1):
        for batch in epoch_batches:
            t_step = time.perf_counter()
            time.sleep(STEP_S)  # the "model step"
            spent = time.perf_counter() - t_step
            loader.clock.compute += spent
            compute += spent
            batches += 1
            assert len(batch.sample_keys) == 8
    elapsed = time.perf_counter() - t_start
    assert batches == 6

    stages = loader.stage_breakdown(elapsed)
    print(f"loop {elapsed:.2f}s, compute {compute:.2f}s, stages {stages}")
    named = sum(stages[k] for k in STAGES)
    assert abs(named - 1.0) <= 0.10, (named, stages, elapsed)
    assert stages["other"] == pytest.approx(max(0.0, 1.0 - named), abs=1e-3)
    assert stages["compute"] == pytest.approx(compute / elapsed, abs=1e-3)
    assert stages["data_wait"] > 0 and stages["decode_cpu_s"] > 0 and stages["read_cpu_s"] > 0
    # the raw clock agrees with the fractions
    c = loader.clock
    assert abs((c.wait + c.assemble + c.transfer + c.compute) / elapsed - 1.0) <= 0.10
    m = loader.metrics()
    assert m["batches"] == 6 and m["samples"] == 48 and m["actors_seen"] >= 1
    # the execution's own stats are kept: decode actors read their own items by default
    # (loader.fused_read), on the job's shared pool (execution/jobpool.py)
    assert cfg.loader.fused_read and cfg.decode.pool_scope == "job"
    assert loader.data_stats and loader.data_stats[-1].startswith("job: ")
    assert "read items decoded on a job pool of up to" in loader.data_stats[-1]
    # the job's log line carries the same breakdown
    line = format_step_log(step=6, epoch=0, loss=0.5, samples_per_s=48 / elapsed,
                           data_wait=stages["data_wait"], stages=stages)
    assert parse_step_log(line)["stages"] == stages


def test_step_log_line_format():
    stages = {"data_wait": 0.25, "assemble": 0.01, "transfer": 0.04, "compute": 0.65,
              "other": 0.05, "read_cpu_s": 1.5, "decode_cpu_s": 3.25}
    line = format_step_log(step=40, epoch=1, loss=0.01234, samples_per_s=321.04,
                           data_wait=0.25, stages=stages)
    assert line.startswith("[train] step 40 epoch 1 loss 0.0123 samples/s 321.0 data-wait 25.0% ")
    parsed = parse_step_log(line)
    assert parsed == {"step": 40, "epoch": 1, "loss": 0.0123, "samples_per_s": 321.0,
                      "data_wait": 0.25, "stages": stages}
    assert sum(parsed["stages"][k] for k in (*STAGES, "other")) == pytest.approx(1.0)
    # one line, JSON after "stages "
    assert "\n" not in line and json.loads(line.split(" stages ", 1)[1]) == stages
    assert parse_step_log("[train] done: {}") is None


def test_train_loop_logs_with_the_formatter():
    """The job prints its periodic line through format_step_log (no second format to drift)."""
    import inspect

    from ray_ingest.train import worker

    src = inspect.getsource(worker.WorkerRun)
    assert "format_step_log(" in src and "stage_breakdown(" in src


def test_audit_progress_bar(tmp_path, monkeypatch):
    """`ray-ingest audit --progress` draws a tqdm bar on stderr, one tick per epoch."""
    from click.testing import CliRunner

    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.cli.audit import command

    root = tmp_path / "ds"
    synth_dataset(str(root), samples=6, shard_size=3, seed=0)
    cat = load_catalog(str(root))
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    recs = [{"event": "start", "rank": 0, "world": 1, "slot": 0, "resume_step": 0, "epoch": 0}]
    step = 0
    for epoch in (0, 1):
        for sid, shard in enumerate(cat.shards):
            step += 1
            recs.append({"epoch": epoch, "step": step, "rank": 0, "slot": 0, "batch": sid,
                         "keys": [f"k{sid}{i}" for i in range(shard.count)],
                         "sids": [sid] * shard.count, "indices": list(range(shard.count)),
                         "pads": [False] * shard.count, "skipped": []})
        recs.append({"event": "epoch_end", "epoch": epoch, "rank": 0, "step": step})
    (ledger / "rank_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    runner = CliRunner()
    res = runner.invoke(command, [str(ledger), "--data", str(root), "--progress"])
    assert res.exit_code == 0, res.output
    reports = [json.loads(x) for x in res.stdout.splitlines()]
    assert [r["epoch"] for r in reports] == [0, 1] and all(r["exactly_once"] for r in reports)
    assert "audit" in res.stderr and "2/2" in res.stderr
    quiet = runner.invoke(command, [str(ledger), "--data", str(root)])
    assert quiet.exit_code == 0 and quiet.stdout == res.stdout and "2/2" not in quiet.stderr
