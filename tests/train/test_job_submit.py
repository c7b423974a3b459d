"""A real `ray job submit` of jobs/train.py against a token-authenticated `ray start --head`
cluster on 127.0.0.1 (as cluster.yaml starts one), on a dataset whose wdinfo.json is as PiD
documents it (no per-shard counts), checked by the audit.

Submissions without the token, or with a wrong one, are refused before anything runs; the
authenticated one succeeds with every sample consumed exactly once. Its config carries a
planted secret in ``data.storage_options``: it shows in none of the job's output, files, run
folder, ledger or the cluster's session folder (logs, job logs, runtime resources).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from ray_ingest.tools.synth import synth_dataset
from ray_ingest.train.auth import write_token_file
from tests.support.tokencluster import (
    TokenHead,
    anonymous_env,
    driver_probe,
    files_holding,
    token_env,
)

pytestmark = [pytest.mark.cluster, pytest.mark.train]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "PLANTED-submit-S3CRET-4b1d9e"


def _dataset(tmp_path) -> str:
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
    return data


def _submit(head: TokenHead, env: dict[str, str], work, config: str, audit_dir: str,
            submission_id: str) -> subprocess.CompletedProcess:
    return head.ray(["job", "submit", "--address", head.dashboard, "--working-dir", str(work),
                     "--submission-id", submission_id, "--", "python", "jobs/train.py",
                     "--config", config, "--audit-dir", audit_dir], env=env, timeout=400)


def test_token_cluster_refuses_strangers_and_runs_the_job(tmp_path):
    data = _dataset(tmp_path)
    audit_dir = str(tmp_path / "ledger")
    work = tmp_path / "work"
    (work / "jobs").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "jobs", "train.py"), work / "jobs" / "train.py")
    cfg = {
        # a credential the local filesystem ignores: it must show nowhere
        "data": {"paths": [data], "storage_options": {"token": SECRET}},
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25},
        "loader": {"batch_size": 8},
        # one parallel group of 2: its leader reads and decodes, the other rank receives
        "train": {"num_workers": 2, "group_size": 2, "cpus_per_worker": 0.25, "epochs": 1,
                  "checkpoint_every": 2,
                  "log_every": 2, "storage_path": str(tmp_path / "runs"), "name": "submitted",
                  "max_failures": 0},
    }
    config = tmp_path / "tiny.yaml"  # outside the working dir: the job reads it in place
    config.write_text(yaml.safe_dump(cfg))
    (tmp_path / "token").mkdir()
    token = write_token_file(tmp_path / "token" / "auth_token")  # the operator's token
    (tmp_path / "stranger").mkdir()
    wrong = write_token_file(tmp_path / "stranger" / "auth_token")
    head = TokenHead(token)
    try:
        head.wait_for_jobs()
        # 1. no token, or the wrong one: refused at the door, nothing submitted
        for env, says, sid in (
                (anonymous_env(tmp_path / "stranger"), "Unauthorized: Missing authentication "
                 "token", "no-token"),
                (token_env(wrong), "Forbidden: Invalid authentication token", "wrong-token")):
            sub = _submit(head, env, work, str(config), audit_dir, f"ray-ingest-{sid}")
            out = sub.stdout + sub.stderr
            assert sub.returncode != 0 and says in out, out[-3000:]
            status_probe = head.ray(["job", "status", "--address", head.dashboard,
                                     f"ray-ingest-{sid}"], env=env)
            assert status_probe.returncode != 0
        listed = head.ray(["job", "list", "--address", head.dashboard])
        assert listed.returncode == 0 and "ray-ingest-" not in listed.stdout, listed.stdout
        # the GCS refuses a driver without the token too
        probe = driver_probe(head.address, token_env(wrong))
        assert probe.returncode != 0 and "uthentication" in probe.stdout + probe.stderr, (
            probe.stdout[-2000:] + probe.stderr[-2000:])
        # 2. with the token: the training job runs
        for attempt in range(40):  # "No available agent to submit job" while agents start
            sub = _submit(head, head.env, work, str(config), audit_dir,
                          f"ray-ingest-test-{attempt}")
            if "No available agent" not in sub.stderr + sub.stdout:
                break
            time.sleep(5)
        status = head.ray(["job", "status", "--address", head.dashboard,
                           f"ray-ingest-test-{attempt}"], timeout=60)
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
                                "--data", data, "--no-progress"], env=head.env,
                               capture_output=True, text=True, timeout=120)
        assert audit.returncode == 0, audit.stdout + audit.stderr
        reports = [json.loads(line) for line in audit.stdout.splitlines() if line.strip()]
        assert [r["status"] for r in reports] == ["exactly-once"], reports
        assert (reports[0]["seen"], reports[0]["duplicated"], reports[0]["missing"]) == (65, 0, 0)
        # 3. the planted secret: nowhere in what the job printed, wrote or logged
        logs = head.ray(["job", "logs", "--address", head.dashboard,
                         f"ray-ingest-test-{attempt}"], timeout=60)
        assert "[train] done" in logs.stdout
        for text in (sub.stdout, sub.stderr, logs.stdout, logs.stderr):
            assert SECRET not in text
        assert SECRET in config.read_text()  # (where the operator put it)
        assert files_holding(SECRET, [tmp_path, head.temp_dir], exclude=(config,)) == []
    finally:
        head.stop()
        head.remove()
