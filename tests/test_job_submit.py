"""A real `ray job submit` of jobs/train.py against a `ray start --head` cluster, on a dataset
whose wdinfo.json is as PiD documents it (no per-shard counts), checked by the audit."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

from ray_ingest.tools.synth import synth_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.train]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(args: list[str], env: dict[str, str], timeout: float, check: bool = True):
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    return subprocess.run([ray_bin, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=check)


def test_ray_job_submit_train_succeeds(tmp_path):
    data = str(tmp_path / "ds")
    synth_dataset(data, samples=65, shard_size=10, seed=0, min_side=48, max_side=96)
    # PiD's seed format: data_list, total_key_count, chunk_size only. The last shard is short,
    # so total != chunk_size x shards: the counts come from the tars' key indexes.
    wdinfo = os.path.join(data, "wdinfo.json")
    with open(wdinfo) as f:
        doc = json.load(f)
    doc = {k: doc[k] for k in ("data_list", "total_key_count", "chunk_size", "data_keys")
           if k in doc}
    assert doc["total_key_count"] == 65 and doc["chunk_size"] == 10
    with open(wdinfo, "w") as f:
        json.dump(doc, f)
    audit_dir = str(tmp_path / "ledger")
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "jobs", "train.py"), work / "jobs" / "train.py")
    cfg = {
        "data": {"paths": [data]},
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25},
        "loader": {"batch_size": 8},
        # one parallel group of 2: its leader reads and decodes, the other rank receives
        "train": {"num_workers": 2, "group_size": 2, "cpus_per_worker": 0.25, "epochs": 1,
                  "checkpoint_every": 2,
                  "log_every": 2, "storage_path": str(tmp_path / "runs"), "name": "submitted",
                  "max_failures": 0},
    }
    (work / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    port, dash = _free_port(), _free_port()
    _ray(["start", "--head", f"--port={port}", "--num-cpus=6", "--include-dashboard=true",
          "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--disable-usage-stats"],
         env, timeout=120)
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 60
        while True:  # the job API comes up a little after `ray start` returns
            probe = _ray(["job", "list", "--address", address], env, timeout=60, check=False)
            if probe.returncode == 0 or time.time() > deadline:
                break
            time.sleep(2)
        for attempt in range(40):  # "No available agent to submit job" while agents start
            sub = _ray(["job", "submit", "--address", address, "--working-dir", str(work),
                        "--submission-id", f"ray-ingest-test-{attempt}", "--",
                        "python", "jobs/train.py", "--config", "tiny.yaml",
                        "--audit-dir", audit_dir],
                       env, timeout=400, check=False)
            if "No available agent" not in sub.stderr + sub.stdout:
                break
            time.sleep(5)
        status = _ray(["job", "status", "--address", address, f"ray-ingest-test-{attempt}"], env,
                      timeout=60, check=False)
        assert "succeeded" in status.stdout.lower(), (sub.stdout[-3000:], sub.stderr[-3000:])
        assert "[train] done" in sub.stdout
        # every rank's final line, with what its own pipeline spent
        done = [json.loads(line.split("[train] done: ", 1)[1])
                for line in sub.stdout.splitlines() if "[train] done: " in line]
        by_rank = {d["rank"]: d for d in done}
        assert sorted(by_rank) == [0, 1], sub.stdout[-3000:]
        lead, follow = by_rank[0], by_rank[1]
        assert (lead["group_share"], follow["group_share"]) == ("leader", "follower")
        assert lead["decode_cpu_s"] > 0 and lead["bytes_read"] > 0
        assert follow["decode_cpu_s"] == 0 and follow["bytes_read"] == 0
        assert lead["samples"] == follow["samples"] > 0
        audit = subprocess.run([sys.executable, "-m", "ray_ingest.cli.main", "audit", audit_dir,
                                "--data", data, "--no-progress"], env=env, capture_output=True,
                               text=True, timeout=120)
        assert audit.returncode == 0, audit.stdout + audit.stderr
        reports = [json.loads(line) for line in audit.stdout.splitlines() if line.strip()]
        assert [r["status"] for r in reports] == ["exactly-once"], reports
        assert (reports[0]["seen"], reports[0]["duplicated"], reports[0]["missing"]) == (65, 0, 0)
    finally:
        _ray(["stop", "--force"], env, timeout=120, check=False)
