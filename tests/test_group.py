"""Group share (ray_ingest/loader/group.py): one rank of a parallel group reads and decodes,
the group receives its batches, bit for bit what every rank would have decoded itself.

The per-rank goldens (tests/goldens/stream.json, recorded before the group share existed) are
the reference: planning works on data-parallel slots, so the ranks of slot ``s`` of a grouped
topology must deliver exactly what rank ``s`` of the ungrouped one delivered. In-process cases
use a queue channel; the gloo cases run one process per rank in a real torch.distributed world.
Neither needs Ray (the read and decode stages run in the rank's process).
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
import torch

from ray_ingest.catalog.load import load_catalog
from ray_ingest.errors import ConfigError, GroupError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.loader.collate import Batch
from ray_ingest.loader.group import (
    GroupShare,
    decode_batch,
    encode_batch,
)
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.state import ReadState
from ray_ingest.plan.topology import Topology
from tests.group_ranks import ThreadChannel, run_ranks
from tests.test_stream_goldens import (  # noqa: F401 - fixtures
    GOLDEN,
    _cfg,
    _record,
    bucketed,
    corrupt,
    plain,
)

GOLDENS = json.loads(GOLDEN.read_text())


def test_wire_format_round_trips_tensors_arrays_and_provenance():
    emb = [np.arange(6, dtype=np.float16).reshape(2, 3), np.full((1, 3), -1.5, np.float32)]
    batch = Batch(data={"image": torch.randint(0, 255, (2, 4, 5, 3), dtype=torch.uint8),
                        "umt5": emb},
                  keys=["a", "b"], captions=["ein Bild ü", ""], sids=[3, 3], indices=[0, 1],
                  pads=[False, True], bucket="16:9", epoch=2, step_in_epoch=7,
                  skipped=[(3, 5, "SampleError: bad")])
    header, tensors = encode_batch(batch, [10, -1, 12])
    header = json.loads(json.dumps(header))  # what crosses the wire: JSON, no pickle
    got, positions = decode_batch(header, tensors)
    assert positions == [10, -1, 12]
    assert torch.equal(got["image"], batch["image"])
    assert [a.dtype for a in got["umt5"]] == [np.float16, np.float32]
    assert all(np.array_equal(a, b) for a, b in zip(got["umt5"], emb, strict=True))
    for f in ("keys", "captions", "sids", "indices", "pads", "bucket", "epoch", "step_in_epoch",
              "skipped"):
        assert getattr(got, f) == getattr(batch, f), f


def _group_in_process(cfg, world: int, group: int, epochs: int, state=None,
                      stop_after: int | None = None, ckpt=None):
    """Every group of the topology: its leader runs first (its messages queue up), then its
    followers. Returns each rank's records and loader."""
    catalog = load_catalog(list(cfg.data.paths))
    out: dict[int, tuple[list, IngestLoader]] = {}
    for slot in range(world // group):
        channels = ThreadChannel.group(group, name=f"group {slot}")
        for i, ch in enumerate(channels):
            rank = slot * group + i
            topo = Topology(world, rank, cfg.loader.read_workers, 0, group)
            opened = []

            def opener(items, opened=opened):
                opened.append(items)
                return LocalExecution(cfg, catalog, items)

            loader = IngestLoader(cfg, topo, catalog=catalog, state=state, open_execution=opener,
                                  share=GroupShare(ch))
            loader.opened = opened
            records: list = []
            for epoch, batches in loader.epochs(epochs):
                for b in batches:
                    records.append(_record(epoch, b))
                    if stop_after is not None and len(records) == stop_after:
                        batches.close()
                        break
                else:
                    continue
                break
            if ckpt is not None:
                loader.save(str(ckpt))
            out[rank] = (json.loads(json.dumps(records)), loader)
    return out


def test_groups_deliver_the_per_rank_goldens(plain):  # noqa: F811
    got = _group_in_process(_cfg(plain), world=4, group=2, epochs=2)
    for rank, (records, loader) in got.items():
        assert records == GOLDENS["parallel_groups"][str(rank)], rank
        if rank % 2:  # followers build no pipeline, read and decode nothing
            assert loader.opened == [] and loader.clock.decode == 0
            assert loader.clock.bytes_read == 0
        else:
            assert loader.opened and loader.clock.decode > 0 and loader.clock.bytes_read > 0
    assert got[0][1].state == got[1][1].state and got[2][1].state == got[3][1].state
    assert got[0][1].state.epoch == 2


def test_groups_with_skips_and_buckets(corrupt, bucketed):  # noqa: F811
    # one slot of 2 ranks reads what the 1-rank golden read, skips and all
    got = _group_in_process(_cfg(corrupt, on_error="skip"), world=2, group=2, epochs=2)
    for records, _ in got.values():
        assert records == GOLDENS["skip_corrupt"]["0"]
    assert got[0][1].skips_by_kind == got[1][1].skips_by_kind
    assert sum(got[1][1].skips_by_kind.values()) > 0
    assert got[0][1].state == got[1][1].state and got[0][1].state.to_dict()
    # aspect buckets: 2 slots of 2 ranks = the 2-rank golden, slot by slot
    cfg = _cfg(bucketed, {"buckets": ["16:9", "3:2", "4:3", "1:1", "3:4", "2:3", "9:16",
                                      "21:9"]}, batch_size=4)
    got = _group_in_process(cfg, world=4, group=2, epochs=2)
    for rank, (records, _) in got.items():
        assert records == GOLDENS["aspect_buckets"][str(rank // 2)], rank


def test_group_resume_mid_epoch_and_after_a_change_of_group_count(plain, tmp_path):  # noqa: F811
    """2 groups of 2 stop after 5 batches; 3 groups of 2 resume: slot by slot the per-rank
    golden of a 2 -> 3 rank change, and the read state it saved."""
    cfg = _cfg(plain)
    golden = GOLDENS["resume_world_change"]
    ckpt = tmp_path / "ckpt"
    before = _group_in_process(cfg, world=4, group=2, epochs=2, stop_after=5, ckpt=ckpt)
    for rank, (records, _) in before.items():
        assert records == golden["before"][str(rank // 2)], rank
    files = [p.read_text() for p in sorted((ckpt / "ingest_state").glob("rank_*.json"))]
    assert len(files) == 4 and files[0] == files[1] and files[2] == files[3]  # byte-equal
    assert files[0] != files[2]
    state = IngestLoader.restore_state(str(ckpt))
    doc = json.loads(json.dumps(state.to_dict()))
    # the same consumed ranges per slot; only the topology it was saved on says "groups of 2"
    (gen,) = doc["generations"]
    assert (gen["world_size"], gen["group_size"]) == (4, 2)
    gen.update(world_size=2, group_size=1)
    assert doc == golden["state"]
    after = _group_in_process(cfg, world=6, group=2, epochs=2, state=state)
    for rank, (records, _) in after.items():
        assert records == golden["after"][str(rank // 2)], rank


def test_a_share_needs_groups(plain):  # noqa: F811
    cfg = _cfg(plain)
    with pytest.raises(ConfigError, match="group_size > 1"):
        IngestLoader(cfg, Topology(2, 0, 2), share=GroupShare(ThreadChannel.group(2)[0]))


def test_out_of_step_follower_names_the_group():
    leader, follower = ThreadChannel.group(2, name="group 5 (ranks 10-11, leader 10)")
    GroupShare(leader).send_end(3)
    with pytest.raises(GroupError, match=r"group 5 .*expected a message of epoch 2 batch 0, "
                                         r"got a end of epoch of epoch 3"):
        GroupShare(follower).receive(2)


# --- over gloo, one process per rank ----------------------------------------------------------
def _job(cfg, group: int, epochs: int, **kw):
    return {"cfg": cfg.to_dict(), "group": group, "share": True, "epochs": epochs, **kw}


def test_gloo_groups_deliver_the_per_rank_goldens(plain, tmp_path):  # noqa: F811
    res = run_ranks(str(tmp_path / "w"), 4, _job(_cfg(plain), 2, 2))
    for rank, r in res.items():
        assert r["error"] is None, r["error"]
        assert r["records"] == GOLDENS["parallel_groups"][str(rank)], rank
        if rank % 2:
            assert r["executions"] == [] and r["clock"]["decode"] == 0
            assert r["clock"]["bytes_read"] == 0 and r["clock"]["samples"] > 0
        else:
            assert r["executions"] and r["clock"]["decode"] > 0
    assert res[0]["state"] == res[1]["state"] and res[2]["state"] == res[3]["state"]
    ReadState.from_dict(res[1]["state"])  # a valid state


def test_gloo_leader_death_is_a_clear_bounded_error(plain, tmp_path):  # noqa: F811
    t0 = time.monotonic()
    res = run_ranks(str(tmp_path / "w"), 2,
                    _job(_cfg(plain), 2, 1, timeout_s=60,
                         fail={"rank": 0, "after": 3, "how": "exit"}))
    assert res[0] is None  # the leader died
    err = res[1]["error"]
    # the leader makes and sends batch k+1 while batch k trains: it died with batch 3 sent or not
    m = re.match(r"GroupError: group 0 \(ranks 0-1, leader 0\): no message from the leader for "
                 r"epoch 0 batch (\d+) ", err)
    assert m and int(m.group(1)) in (3, 4), err
    assert "\n" not in err
    assert len(res[1]["records"]) == int(m.group(1))  # everything that arrived, and no more
    assert time.monotonic() - t0 < 60  # a dead peer is noticed, not waited out


def test_gloo_leader_hang_is_bounded_by_the_group_timeout(plain, tmp_path):  # noqa: F811
    res = run_ranks(str(tmp_path / "w"), 2,
                    _job(_cfg(plain), 2, 1, timeout_s=2,
                         fail={"rank": 0, "after": 2, "how": "sleep", "sleep_s": 8}))
    err = res[1]["error"]
    # batch 2 was made and sent ahead while the leader's loop trained batch 1, then it hung
    assert err.startswith("GroupError: group 0 (ranks 0-1, leader 0): no message from the "
                          "leader for epoch 0 batch 3"), err
    assert "group_timeout_s" in err and len(res[1]["records"]) == 3
    # the leader wakes to a group without its follower: its next send fails, it does not hang
    assert res[0]["error"].startswith("GroupError: group 0"), res[0]["error"]


def test_gloo_leader_error_reaches_the_followers(corrupt, tmp_path):  # noqa: F811
    res = run_ranks(str(tmp_path / "w"), 2, _job(_cfg(corrupt), 2, 1))
    lead, follow = res[0]["error"], res[1]["error"]
    assert lead.startswith("IngestError: shard ") and "cannot decode" in lead, lead
    assert follow.startswith("GroupError: group 0 (ranks 0-1, leader 0): the leader failed at "
                             "epoch 0 batch "), follow
    assert lead.split(": ", 1)[1] in follow  # the leader's one-line reason, verbatim
    assert res[0]["records"] == res[1]["records"]
