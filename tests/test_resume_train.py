"""Exact resume under a real TorchTrainer, verified by the audit ledger (``ray-ingest audit``).

One run name, two trainer runs, each adding ways to stop and come back:

1. 2 workers in one parallel group (group_size 2, whose leader, rank 0, reads and decodes for
   both: ``loader.group_share: broadcast``): the leader's process dies right after step 4's
   checkpoint (FailureConfig(max_failures=1) restarts the group), then the run stops at
   ``--max-steps`` in the middle of epoch 1;
2. re-run with the same name and storage path, and 4 workers (two groups of 2): it resumes
   mid-epoch 1, and the topology changed, so the rest of epoch 1 is re-planned across the new
   slots.

After each run the audit must report every complete epoch exactly-once with identical batches
on the ranks of a group. Each trainer start costs ~20 s on 2 cores, so the data is tiny.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import yaml
from click.testing import CliRunner

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.shard import TarSample
from ray_ingest.cli.main import cli
from ray_ingest.plan.state import ReadState
from ray_ingest.tools.audit import audit as audit_epochs
from ray_ingest.tools.audit import read_ledgers
from ray_ingest.tools.synth import synth_dataset

SAMPLES, SHARD, BATCH = 80, 20, 8  # 4 shards; one slot reads 10 batches per epoch
PER_EPOCH = SAMPLES // BATCH


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_train")
    data = str(root / "ds")
    synth_dataset(data, samples=SAMPLES, shard_size=SHARD, seed=9, min_side=32, max_side=40)
    cfg = {
        "data": {"paths": [data], "modalities": ["image", "caption"]},
        # decode tasks: no decode processes to start per execution (the subject is the
        # trainer's restarts; the multi-node train-node loss restarts with decode actors)
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "compute": "tasks"},
        "loader": {"batch_size": BATCH, "seed": 4, "read_workers": 2, "block_rows": 16,
                   "read_num_cpus": 0.25},
        "train": {"num_workers": 2, "group_size": 2, "cpus_per_worker": 0.25,
                  "checkpoint_every": 2, "log_every": 1000, "max_failures": 1},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return {"config": str(path), "data": data, "storage": str(root / "runs"),
            "audit": str(root / "audit"), "name": "exact"}


def train(job, *args: str) -> None:
    from ray_ingest.train.job import main

    argv = ["--config", job["config"], "--data", job["data"], "--storage-path", job["storage"],
            "--name", job["name"], "--audit-dir", job["audit"], *args]
    assert main(argv) == 0


def audit(job, *args: str) -> tuple[int, list[dict]]:
    res = CliRunner().invoke(cli, ["audit", job["audit"], "--data", job["data"], *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    print(f"ray-ingest audit {' '.join(args)} -> exit {res.exit_code}\n{res.output}")
    return res.exit_code, [json.loads(line) for line in res.output.splitlines() if line.strip()]


def check_exactly_once(report: dict) -> None:
    assert report["complete"], report
    assert (report["expected"], report["seen"], report["distinct"]) == (SAMPLES,) * 3, report
    assert (report["duplicated"], report["missing"], report["unknown"]) == (0, 0, 0), report
    assert report["group_mismatches"] == 0, report
    assert report["exactly_once"], report


def ledger(job) -> dict[int, list[dict]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(job["audit"], "rank_*.jsonl"))):
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        out[recs[0]["rank"]] = recs
    return out


def latest_states(job) -> dict[str, ReadState]:
    """The per-rank read states of the newest checkpoint (Ray Train merged the rank folders)."""
    ckpts = sorted(d for d in glob.glob(os.path.join(job["storage"], job["name"], "checkpoint_*"))
                   if os.path.isdir(d))  # named checkpoint_<timestamp>: sorted by time
    assert ckpts
    files = sorted(glob.glob(os.path.join(ckpts[-1], "ingest_state", "rank_*.json")))
    states = {}
    for path in files:
        with open(path) as f:
            states[os.path.basename(path)] = ReadState.from_dict(json.load(f))
    return states


@pytest.mark.ray
@pytest.mark.train
def test_failure_rerun_and_topology_change_are_exactly_once(ray_local, job):
    # 1. the group's leader (the rank that decodes for both) dies after step 4; the group
    # restarts from that checkpoint; stop at step 13
    train(job, "--num-workers", "2", "--group-size", "2", "--epochs", "3",
          "--max-steps", "13", "--fail-at-step", "4", "--fail-rank", "0", "--fail-hard")
    assert os.path.exists(os.path.join(job["storage"], f"{job['name']}.failed_once"))
    starts = {r: [x for x in recs if x.get("event") == "start"] for r, recs in ledger(job).items()}
    resumed = {r: [s["resume_step"] for s in v] for r, v in starts.items()}
    # A process that dies right after ray.train.report may die before Ray Train's controller
    # committed that checkpoint: the group then restarts from step 2's, and the audit below
    # rolls back the batches trained after it.
    assert resumed in ({0: [0, 4], 1: [0, 4]}, {0: [0, 2], 1: [0, 2]}), resumed
    # attempts are numbered by rank 0 and broadcast: the same on both ranks; no wall clock
    assert {r: [s["attempt"] for s in v] for r, v in starts.items()} == {0: [0, 1], 1: [0, 1]}
    assert not [x for recs in ledger(job).values() for x in recs if "t" in x]
    code, reports = audit(job)
    assert code == 0, reports
    assert [r["epoch"] for r in reports] == [0, 1]
    check_exactly_once(reports[0])
    assert not reports[1]["complete"] and reports[1]["distinct"] == 3 * BATCH
    states = latest_states(job)
    assert list(states) == ["rank_00000.json", "rank_00001.json"]
    assert states["rank_00000.json"] == states["rank_00001.json"]  # one group: identical state
    st = states["rank_00000.json"]
    assert (st.epoch, st.current.batches, st.current.consumed) == (1, (3,), (((0, 24),),))
    # --step/--rank: what a rank trained on at a step, after the rollback of the failure
    code, [row] = audit(job, "--step", "5", "--rank", "1")
    kept = [b for b in ledger(job)[0] if b.get("step") == 5][-1]
    assert code == 0 and row["keys"] == kept["keys"] and row["epoch"] == 0

    # 2. re-run with the same name and 4 workers (2 groups of 2): it resumes mid-epoch 1, and
    # the topology changed, so the rest of epoch 1 is re-planned on 2 slots
    train(job, "--num-workers", "4", "--group-size", "2", "--epochs", "3", "--max-steps", "1000")
    code, reports = audit(job)
    assert code == 0, reports
    assert [r["epoch"] for r in reports] == [0, 1, 2]
    for report in reports:
        check_exactly_once(report)
    recs = ledger(job)
    assert sorted(recs) == [0, 1, 2, 3]
    # the 4-worker run is the job's 3rd attempt on every rank, the new ranks 2 and 3 included
    assert {r: [x["attempt"] for x in v if x.get("event") == "start"] for r, v in recs.items()} \
        == {0: [0, 1, 2], 1: [0, 1, 2], 2: [2], 3: [2]}
    after = {r: [b for b in v if "keys" in b and b["epoch"] == 1 and b["step"] > 13]
             for r, v in recs.items()}
    # the 56 unconsumed samples of epoch 1, balanced over 2 slots: 28 each -> 4 batches each,
    # numbered on from the 3 batches epoch 1 had before
    assert {r: len(v) for r, v in after.items()} == {0: 4, 1: 4, 2: 4, 3: 4}
    assert all([b["batch"] for b in v] == list(range(3, 7)) for v in after.values())
    assert [b["keys"] for b in after[0]] == [b["keys"] for b in after[1]]
    assert [b["keys"] for b in after[2]] == [b["keys"] for b in after[3]]
    assert [b["keys"] for b in after[0]] != [b["keys"] for b in after[2]]
    states = latest_states(job)
    assert len(states) == 4
    assert states["rank_00000.json"] == states["rank_00001.json"]
    assert states["rank_00002.json"] == states["rank_00003.json"]
    assert all(s.epoch == 3 for s in states.values())


def test_audit_rolls_back_ranks_that_did_not_come_back(tmp_path):
    """2 ranks crash after the step-2 checkpoint; the re-run has 1 rank. Rank 1's step 3 was
    rolled back too, although rank 1 never logged a restart (no trainer: a written ledger)."""
    catalog = Catalog(shards=tuple(TarSample(f"{i}.tar", "/d", ("image",), 4) for i in (0, 1)),
                      wdinfos=(), chunk_size=4, modalities=("image",))
    clock = iter(range(100))

    def batch(rank, slot, step, sid, idx):
        return {"epoch": 0, "step": step, "rank": rank, "slot": slot, "batch": step - 1,
                "keys": [f"k{sid}{idx}"], "sids": [sid], "indices": [idx], "pads": [False],
                "skipped": [], "t": next(clock)}

    def start(rank, world, resume):
        return {"event": "start", "rank": rank, "world": world, "slot": rank,
                "resume_step": resume, "epoch": 0, "t": next(clock)}

    r0 = [start(0, 2, 0)]
    r1 = [start(1, 2, 0)]
    for step in (1, 2, 3):  # each slot reads its own shard; the checkpoint is at step 2
        r0.append(batch(0, 0, step, 0, step - 1))
        r1.append(batch(1, 1, step, 1, step - 1))
    r0.append(start(0, 1, 2))  # crash; re-run with 1 rank re-plans the 4 unconsumed samples
    for step, (sid, idx) in zip(range(3, 7), [(0, 2), (0, 3), (1, 2), (1, 3)], strict=True):
        r0.append(batch(0, 0, step, sid, idx))
    r0.append({"event": "epoch_end", "epoch": 0, "rank": 0, "step": 6, "t": next(clock)})
    for rank, recs in ((0, r0), (1, r1)):
        (tmp_path / f"rank_{rank:05d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs))
    [report] = audit_epochs(read_ledgers(str(tmp_path)), catalog)
    assert (report["seen"], report["duplicated"], report["missing"]) == (8, 0, 0), report
    assert report["complete"] and report["exactly_once"]
