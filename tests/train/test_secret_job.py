"""The planted secret: a real training job (``jobs/train.py`` on its embedded, token-
authenticated Ray, TorchTrainer, decode actors) reads a local dataset with credentials in
``data.storage_options`` (the local filesystem ignores them), with Ray's export API and Ray
Train's state tracking on, so that everything Ray records of the job's configuration (the Ray
Train run settings, Ray Data's operators) is written to the session folder too. The secrets
then show in none of: the job's stdout and stderr, the run folder (checkpoints, read states,
Ray Train's files), the audit ledger, the Ray session folder (every log, the exported events),
and the home folder the job ran with.

The job runs as a user without any Ray token would (no ``RAY_AUTH_*`` variable, a fresh
``HOME``): it makes a one-off token, runs with token authentication, says where the token was,
removes it when it exits, and writes nothing to ``~/.ray``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from ray_ingest.catalog.load import load_catalog
from ray_ingest.tools.audit import (
    audit,
    read_ledgers,
)
from ray_ingest.tools.synth import synth_dataset
from tests.support.tokencluster import files_holding

pytestmark = [pytest.mark.train]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "ya29.PLANTED-job-S3CRET-a41c07"
PASSWORD = "PLANTED-passw0rd-77e2"
KEY_LINE = "MIIEvQIBADANBgkqhkiG9w0PLANTEDkey"
OPTIONS = {"token": TOKEN, "password": PASSWORD, "project": "ray-ingest-test",
           "sa": {"type": "service_account",
                  "private_key": f"-----BEGIN PRIVATE KEY-----\n{KEY_LINE}\n"
                                 "-----END PRIVATE KEY-----\n"}}


def test_planted_secret_appears_nowhere(tmp_path):
    data = tmp_path / "ds"
    synth_dataset(str(data), samples=40, shard_size=10, seed=2, min_side=32, max_side=64)
    cfg = {
        "data": {"paths": [str(data)], "storage_options": OPTIONS},
        # decode actors: the config and read options travel into Ray Data operators too
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "compute": "actors"},
        "loader": {"batch_size": 8},
        "train": {"num_workers": 2, "cpus_per_worker": 0.25, "epochs": 1,
                  "checkpoint_every": 2, "log_every": 1, "storage_path": str(tmp_path / "runs"),
                  "name": "planted", "max_failures": 0},
    }
    config = tmp_path / "planted.yaml"
    config.write_text(yaml.safe_dump(cfg))
    home = tmp_path / "home"
    home.mkdir()
    ray_tmp = tempfile.mkdtemp(prefix="risec-", dir="/tmp")  # short: unix socket paths
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(home), RAY_TMPDIR=ray_tmp, RAY_enable_export_api_write="1",
               RAY_TRAIN_ENABLE_STATE_TRACKING="1", RAY_USAGE_STATS_ENABLED="0")
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "jobs" / "train.py"), "--config", str(config),
             "--audit-dir", str(tmp_path / "ledger"), "--num-cpus", "8"],
            env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "[train] step 1 " in proc.stdout and "[train] done: " in proc.stdout
        # token authentication on, with a one-off token, gone after the job
        said = re.search(r"token authentication on: a one-off token for this local Ray in (\S+) "
                         r"\(removed at exit\)", proc.stderr)
        assert said, proc.stderr[-3000:]
        assert not os.path.exists(said.group(1))
        assert not (home / ".ray").exists()
        # Ray recorded the job's configuration (what its dashboard and exports show)
        events = Path(ray_tmp) / "ray" / "session_latest" / "logs" / "export_events"
        train_state = (events / "event_EXPORT_TRAIN_STATE.log").read_text()
        assert "train_loop_config" in train_state
        # every sample once
        reports = audit(read_ledgers(str(tmp_path / "ledger")), load_catalog([str(data)]))
        assert [r["status"] for r in reports] == ["exactly-once"], reports
        assert list((tmp_path / "runs" / "planted").glob("checkpoint_*"))
        # the secrets: nowhere
        for secret in (TOKEN, PASSWORD, KEY_LINE):
            assert secret not in proc.stdout and secret not in proc.stderr
            assert files_holding(secret, [tmp_path, ray_tmp], exclude=(config,)) == [], secret
        assert TOKEN in config.read_text()  # (where the operator put it)
        # what Ray Train was given holds the options sealed: redacted
        sealed = re.findall(r'"storage_options": "(Sealed\(\{[^"]*\}\))"', train_state)
        assert sealed, train_state[:3000]
        assert "'token': '<redacted>'" in sealed[0] and "'password': '<redacted>'" in sealed[0]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
