"""A real `ray job submit` of jobs/train.py against a `ray start --head` cluster."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

from ray_ingest.synth import synth_dataset

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
    synth_dataset(data, samples=60, shard_size=10, seed=0, min_side=48, max_side=96)
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "jobs", "train.py"), work / "jobs" / "train.py")
    cfg = {
        "data": {"paths": [data]},
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25},
        "loader": {"batch_size": 8},
        "train": {"num_workers": 2, "cpus_per_worker": 0.25, "epochs": 1, "checkpoint_every": 2,
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
                        "python", "jobs/train.py", "--config", "tiny.yaml"],
                       env, timeout=400, check=False)
            if "No available agent" not in sub.stderr + sub.stdout:
                break
            time.sleep(5)
        status = _ray(["job", "status", "--address", address, f"ray-ingest-test-{attempt}"], env,
                      timeout=60, check=False)
        assert "succeeded" in status.stdout.lower(), (sub.stdout[-3000:], sub.stderr[-3000:])
        assert "[train] done" in sub.stdout
    finally:
        _ray(["stop", "--force"], env, timeout=120, check=False)
