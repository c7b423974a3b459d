"""Head start (ray_ingest/headstart.py): the same rows in the same order, whoever decodes them.

No Ray: the "remote" is the in-process execution behind a start-up delay, as a Ray Data
execution is behind its decode actors' start-up.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ray_ingest.catalog import load_catalog
from ray_ingest.columns import ACTOR, SEQ
from ray_ingest.config import config_from_dict
from ray_ingest.errors import IngestError
from ray_ingest.headstart import HEAD_ACTOR, HeadStart, LocalExecution
from ray_ingest.plan.epoch import plan_window
from ray_ingest.plan.state import initial_state
from ray_ingest.plan.topology import Topology
from ray_ingest.synth import synth_dataset


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("head") / "ds")
    synth_dataset(out, samples=120, shard_size=20, seed=4, min_side=32, max_side=48)
    cfg = config_from_dict({"data": {"paths": [out]},
                            "decode": {"resolution": 16},
                            "loader": {"batch_size": 8, "block_rows": 8, "seed": 3}})
    catalog = load_catalog([out])
    topo = Topology(1, 0, 1)
    state = initial_state(catalog.fingerprint, cfg.loader.plan_params(), 0, topo,
                          catalog.fingerprint_doc(), 8)
    plans = plan_window(state, topo, catalog.counts, catalog.chunk_size, 8, 2, block_rows=8,
                        first_rows=8)
    items = [it for p in plans for it in p.items]
    return cfg, catalog, items


class Delayed:
    """The in-process execution, after ``delay`` seconds; raises at block ``fail_at``."""

    def __init__(self, inner: LocalExecution, delay: float, fail_at: int | None = None):
        self.inner, self.delay, self.fail_at = inner, delay, fail_at
        self.closed = False

    def start(self) -> None:
        self.t0 = time.monotonic()

    def blocks(self):
        time.sleep(self.delay)
        for i, block in enumerate(self.inner.blocks()):
            if self.closed:
                return
            if i == self.fail_at:
                raise IngestError("shard s.tar index 3: cannot decode: broken")
            yield block

    def stats(self) -> str:
        return "remote"

    def close(self) -> None:
        self.closed = True


def _rows(blocks) -> tuple[list[int], str]:
    seqs: list[int] = []
    digest = []
    for b in blocks:
        seqs += b[SEQ].tolist()
        digest.append(b["image"].tobytes())
    return seqs, str(hash(b"".join(digest)))


@pytest.mark.parametrize("delay, max_rows", [(0.5, 1024), (0.0, 1024), (0.5, 20), (2.0, 10**6)])
def test_head_start_delivers_the_executions_rows_in_order(setup, delay, max_rows):
    cfg, catalog, items = setup
    want = _rows(LocalExecution(cfg, catalog, items).blocks())
    head = HeadStart(LocalExecution(cfg, catalog, items),
                     Delayed(LocalExecution(cfg, catalog, items), delay), items, max_rows)
    got_blocks = list(head.blocks())
    assert _rows(got_blocks) == want
    assert head.head_rows <= max(max_rows, items[0].count) + 20
    if head.head_rows == len(want[0]):  # the head delivered everything first,
        assert head.dropped_rows == 0 and head._remote.closed  # the remote was left unused
        assert all((b[ACTOR] == HEAD_ACTOR).all() for b in got_blocks)
    else:  # the remote took over: what the head delivered was dropped from it
        assert head.dropped_rows == head.head_rows
    if delay >= 2.0:
        assert head.head_rows == len(want[0])
    if max_rows == 20:  # the head stops after its bound, the remote serves the rest
        assert 0 < head.head_rows < len(want[0])
        assert "head start" in head.stats() and "remote" in head.stats()
    head.close()


def test_remote_errors_surface_and_head_errors_do_not(setup, monkeypatch):
    cfg, catalog, items = setup
    head = HeadStart(LocalExecution(cfg, catalog, items),
                     Delayed(LocalExecution(cfg, catalog, items), 0.2, fail_at=30), items, 64)
    with pytest.raises(IngestError, match="index 3: cannot decode"):
        list(head.blocks())
    head.close()

    local = LocalExecution(cfg, catalog, items)

    def broken(item):
        raise OSError("this process cannot open the shard")
        yield

    monkeypatch.setattr(local, "item_blocks", broken)
    want = _rows(LocalExecution(cfg, catalog, items).blocks())
    head = HeadStart(local, Delayed(LocalExecution(cfg, catalog, items), 0.1), items, 1024)
    assert _rows(head.blocks()) == want
    assert head.head_rows == 0


def test_close_mid_stream_stops_both_without_hanging(setup):
    cfg, catalog, items = setup
    remote = Delayed(LocalExecution(cfg, catalog, items), 0.3)
    head = HeadStart(LocalExecution(cfg, catalog, items), remote, items, 1024)
    it = head.blocks()
    first = next(it)
    assert len(first[SEQ]) == items[0].count
    it.close()
    head.close()
    assert remote.closed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            t.name.startswith("ray_ingest-pump") and t.is_alive() for t in threading.enumerate()):
        time.sleep(0.05)
    assert not any(t.name.startswith("ray_ingest-pump") and t.is_alive()
                   for t in threading.enumerate())
    assert np.all(first[ACTOR] == HEAD_ACTOR)
