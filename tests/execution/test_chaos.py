"""A short run of the chaos soak (``bench/chaos.py``, docs/failure_handling.md "Chaos soak"):
the real training job on the loopback multi-node cluster, reading ``gs://`` through the fault
proxy, under 20 s of its seeded fault schedule (seed 4: decode actor kills and cut responses)
plus planted corrupt members; every epoch must audit exactly-once and every fault recover.

In a child process (the soak starts its own cluster and Ray driver), with this session's token.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multinode


def test_a_short_soak_audits_exactly_once(tmp_path):
    out = tmp_path / "chaos.json"
    res = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--duration-s", "20", "--seed", "4",
         "--shards", "8", "--shard-size", "8", "--corrupt", "2", "--min-faults", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=400, cwd=REPO)
    said = [ln for ln in res.stdout.splitlines() if ln.startswith(("[chaos]", "[train]", "kind",
                                                                  "decode_", "train_", "gs_",
                                                                  "object_", "corrupt_"))]
    assert res.returncode == 0, ("\n".join(said)[-4000:], res.stderr[-2000:])
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["job_exit"] == 0
    assert doc["audit"] and all(r["exactly_once"] and r["complete"] for r in doc["audit"])
    rows = {r["kind"]: r for r in doc["rows"]}
    # the schedule's first faults happened and training went on past each of them
    assert rows["decode_actor_kill"]["injected"] >= 1 and rows["gs_reset"]["injected"] >= 1
    assert all(r["recovered"] == r["injected"] for r in doc["rows"])
    # the planted corrupt members were skipped, and recorded, in every epoch
    assert all(r["skipped"] == 2 for r in doc["audit"])
    assert rows["corrupt_member"]["injected"] == 2 * len(doc["audit"])
    assert "[chaos] OK:" in res.stdout and "Traceback" not in res.stdout
