"""loader.stall_timeout_s: a pipeline that makes no progress ends with a one-line StallError.

On a cluster the typical cause is a lost decode node whose actors cannot restart anywhere (seen
on the multi-node test cluster, but not deterministically: it needs the dead actor to have had a
task in flight; see docs/operations.md "Decode-node loss"). Here the same state is made certain:
no node carries the decode label, so read tasks and decode actors stay pending for good.
"""

from __future__ import annotations

import threading
import time

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.errors import StallError
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset

pytestmark = pytest.mark.ray


def test_no_progress_for_stall_timeout_raises_stall_error(ray_local, tmp_path):
    data = str(tmp_path / "ds")
    synth_dataset(data, samples=96, shard_size=8, seed=1, min_side=16, max_side=24)
    cfg = config_from_dict({
        "data": {"paths": [data]},
        "decode": {"resolution": 16, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "label_selector": {"pool": "nowhere"}},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 8, "read_workers": 1, "read_num_cpus": 0.25, "block_rows": 8,
                   "stall_timeout_s": 2},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, num_workers=1),
                          catalog=load_catalog([data]))
    t0 = time.monotonic()
    with pytest.raises(StallError) as err:
        for _, batches in loader.epochs(1):
            for _batch in batches:
                pass
    msg = str(err.value)
    assert "\n" not in msg and "loader.stall_timeout_s (2 s)" in msg
    assert "{'pool': 'nowhere'}" in msg
    assert time.monotonic() - t0 < 60
    # the stalled execution was shut down, not left running (its scheduling thread ends)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _executor_threads():
        time.sleep(0.1)
    assert not _executor_threads()


def _executor_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith("StreamingExecutor") and t.is_alive()]

