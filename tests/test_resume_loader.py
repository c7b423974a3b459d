"""Exact resume of the per-rank IngestLoader (no trainer).

One checkpoint round-trip helper, :func:`run_save_load`, drives every case: run, stop after
``stop_after`` batches, save the per-rank state files, merge them back, resume, and compare
what was delivered before + after with an uninterrupted run. The uninterrupted reference is
read and decoded in this process by the same code as the Ray edge
(``ray_ingest/execution/local.py``, bit-identical to it by the stream goldens). The runs that stop
and resume go through Ray where the Ray edge is the subject (an execution closed mid-epoch and a new
one started from the saved state, with and without key indexes; unordered delivery); where the
subject is what is re-planned (topology and batch-size changes, several ranks, pid start, buckets)
they run in-process too (``all_local``), as a Ray run would test the same rows again at ~5 s each.
"""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
from collections.abc import Callable, Sequence

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.errors import ConfigError, StateError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.loader.ingest import (
    IngestLoader,
    state_file,
)
from ray_ingest.plan import PlanParams, iter_samples, plan_slot
from ray_ingest.plan.state import ReadState
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.train.detect import pid_env_start

SAMPLES, SHARD = 150, 20  # 8 shards, the last one short: 7 x 20 + 10
BATCH = 8

#: ``make(state, rank, local=False)``: a rank's loader; ``local`` for the in-process reference.
LoaderFactory = Callable[..., IngestLoader]
Record = tuple


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("resume") / "ds")
    synth_dataset(out, samples=SAMPLES, shard_size=SHARD, seed=5, min_side=32, max_side=48)
    return out


@pytest.fixture(scope="module")
def dataset_no_index(dataset, tmp_path_factory):
    """The same tars without their key indexes: resume streams past payloads instead."""
    out = str(tmp_path_factory.mktemp("resume_noidx") / "ds")
    shutil.copytree(dataset, out, ignore=shutil.ignore_patterns("*.idx.json"))
    assert not [f for _, _, fs in os.walk(out) for f in fs if f.endswith(".idx.json")]
    return out


def make_cfg(path: str, **loader):
    return config_from_dict({
        "data": {"paths": [path]},
        # decode tasks: an execution cut and restarted is the subject, not the actor pool
        # (the stream goldens resume through actors)
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "compute": "tasks"},
        "loader": {"batch_size": BATCH, "read_workers": 2, "seed": 11, "block_rows": 8,
                   "read_num_cpus": 0.25, **loader},
    })


def factory(path: str, world: int = 1, group: int = 1, all_local: bool = False,
            **loader) -> LoaderFactory:
    """``all_local``: every loader it makes reads in-process (not only the references)."""
    cfg = make_cfg(path, **loader)
    catalog = load_catalog([path])

    def make(state: ReadState | None, rank: int, local: bool = False) -> IngestLoader:
        topo = Topology(world_size=world, rank=rank, num_workers=cfg.loader.read_workers,
                        group_size=group)
        return IngestLoader(cfg, topo, catalog=catalog, state=state,
                            open_execution=LocalExecution.factory(cfg, catalog)
                            if local or all_local else None)

    return make


def record(epoch: int, b) -> Record:
    digest = hashlib.sha1(b["image"].numpy().tobytes()).hexdigest()[:12]
    return (epoch, b.step_in_epoch, tuple(b.keys), tuple(b.sids), tuple(b.indices),
            tuple(b.pads), digest)


def collect(loader: IngestLoader, epochs: int, stop_after: int | None = None) -> list[Record]:
    """Delivered batches, stopping (like a trainer's max_steps) after ``stop_after`` of them."""
    out: list[Record] = []
    if stop_after == 0:
        return out
    for epoch, batches in loader.epochs(epochs):
        for b in batches:
            out.append(record(epoch, b))
            if stop_after is not None and len(out) == stop_after:
                batches.close()  # release the Ray iterator now, as a stopping trainer would
                return out
    return out


def real_samples(records: Sequence[Record], epoch: int) -> collections.Counter:
    return collections.Counter((sid, idx) for r in records if r[0] == epoch
                               for sid, idx, pad in zip(r[3], r[4], r[5], strict=True) if not pad)


def run_save_load(loader_factory: LoaderFactory, stop_after: int, ckpt_dir,
                  *, ranks: Sequence[int] = (0,), epochs: int = 2, same_sequence: bool = True,
                  baseline: dict[int, list[Record]] | None = None):
    """Stop every rank after ``stop_after`` batches, save, merge, resume; compare with a full run.

    With ``same_sequence`` (ordered loaders) the batches must be exactly the uninterrupted
    sequence (keys, provenance, pixels, batch numbers); otherwise (unordered delivery, aspect
    buckets) the same number of batches and, per epoch, the same multiset of samples.
    Returns ``(baseline, restored state, before, after)``.
    """
    if baseline is None:
        baseline = {r: collect(loader_factory(None, r, local=True), epochs) for r in ranks}
    before = {}
    for r in ranks:
        loader = loader_factory(None, r)
        before[r] = collect(loader, epochs, stop_after)
        assert os.path.basename(loader.save(str(ckpt_dir))) == os.path.basename(state_file(r))
    state = IngestLoader.restore_state(str(ckpt_dir))
    assert state is not None
    after = {r: collect(loader_factory(state, r), epochs) for r in ranks}
    for r in ranks:
        got = before[r] + after[r]
        assert len(before[r]) == min(stop_after, len(baseline[r]))
        if same_sequence:
            assert got == baseline[r]
        else:
            assert len(got) == len(baseline[r])
            for e in range(epochs):
                assert real_samples(got, e) == real_samples(baseline[r], e)
    return baseline, state, before, after


_BASELINES: dict[str, dict[int, list[Record]]] = {}


def baseline_of(key: str, loader_factory: LoaderFactory, epochs: int = 2,
                ranks: Sequence[int] = (0,)) -> dict[int, list[Record]]:
    if key not in _BASELINES:
        _BASELINES[key] = {r: collect(loader_factory(None, r, local=True), epochs)
                           for r in ranks}
    return _BASELINES[key]


def every_sample() -> collections.Counter:
    sizes = [SHARD] * (SAMPLES // SHARD) + ([SAMPLES % SHARD] if SAMPLES % SHARD else [])
    return collections.Counter((sid, i) for sid, c in enumerate(sizes) for i in range(c))


PER_EPOCH = -(-SAMPLES // BATCH)  # one slot reads everything; the last batch is padded


@pytest.mark.parametrize("where", [
    "initial", pytest.param("mid-epoch", marks=pytest.mark.ray), "end-of-epoch",
    pytest.param("next-epoch", marks=pytest.mark.ray)])
def test_round_trip(request, dataset, dataset_no_index, tmp_path, where):
    """Mid-epoch reads the same tars without key indexes (the resumed shard is streamed past,
    not seeked); next-epoch resumes mid-shard with the indexes. Those two stop and resume Ray
    executions; initial and end-of-epoch (no execution is cut) run in-process."""
    on_ray = where in ("mid-epoch", "next-epoch")
    if on_ray:
        request.getfixturevalue("ray_local")
    stop = {"initial": 0, "mid-epoch": 3, "end-of-epoch": PER_EPOCH,
            "next-epoch": PER_EPOCH + 2}[where]
    base = baseline_of("world1", factory(dataset))
    assert len(base[0]) == 2 * PER_EPOCH
    for e in (0, 1):
        assert real_samples(base[0], e) == every_sample()
    make = factory(dataset_no_index if where == "mid-epoch" else dataset, all_local=not on_ray)
    _, state, _, after = run_save_load(make, stop, tmp_path, baseline=base)
    # what the checkpoint recorded: consumed stream positions and batches, never prefetch
    want_epoch, done = divmod(stop, PER_EPOCH) if stop != PER_EPOCH else (0, PER_EPOCH)
    assert state.epoch == want_epoch
    assert state.current.batches == (done,)
    assert state.current.consumed == (((0, min(done * BATCH, SAMPLES)),) if done else (),)
    assert (done * BATCH) % SHARD or where in ("initial", "end-of-epoch")  # mid-shard resumes
    if where == "end-of-epoch":
        assert after[0][0][:2] == (1, 0)  # the finished epoch yields nothing more


@pytest.mark.ray
def test_unordered_mode_is_exactly_once(ray_local, dataset, tmp_path):
    make = factory(dataset, ordered=False)
    base, state, before, after = run_save_load(make, 4, tmp_path, epochs=1,
                                                 same_sequence=False)
    assert real_samples(before[0] + after[0], 0) == every_sample()
    assert sum(b - a for a, b in state.current.consumed[0]) == 4 * BATCH


def test_ranks_save_their_own_files_and_merge(dataset, tmp_path):
    """Two slots: each rank writes its own file; the merged state resumes both exactly."""
    make = factory(dataset, world=2, all_local=True)
    base, state, before, after = run_save_load(make, 3, tmp_path, ranks=(0, 1), epochs=1)
    assert sorted(os.listdir(tmp_path / "ingest_state")) == ["rank_00000.json", "rank_00001.json"]
    assert state.current.batches == (3, 3)
    assert all(len(rs) == 1 and rs[0][0] == 0 for rs in state.current.consumed)
    got = before[0] + after[0] + before[1] + after[1]
    assert real_samples(got, 0) == every_sample()
    assert len(before[0] + after[0]) == len(before[1] + after[1])  # equal work


def test_topology_change_replans_only_the_rest(dataset, tmp_path):
    """Two slots consume part of the epoch; three slots finish it: exactly-once overall."""
    old = factory(dataset, world=2, all_local=True)
    before = []
    for r in (0, 1):
        loader = old(None, r)
        before += collect(loader, 1, 4)
        loader.save(str(tmp_path))
    state = IngestLoader.restore_state(str(tmp_path))
    new = factory(dataset, world=3, all_local=True)
    after = {r: collect(new(state, r), 1) for r in range(3)}
    assert len({len(v) for v in after.values()}) == 1  # every new rank runs the same steps
    # batch numbers continue the epoch's count on every new rank
    assert all([b[1] for b in v] == list(range(4, 4 + len(v))) for v in after.values())
    resumed = new(state, 0).state
    assert len(resumed.generations) == 2 and resumed.current.slots == 3
    got = before + [b for v in after.values() for b in v]
    assert real_samples(got, 0) == every_sample()


def test_fingerprint_mismatch_names_what_changed(dataset, tmp_path):
    saved = factory(dataset)(None, 0)
    saved.save(str(tmp_path / "ckpt"))
    state = IngestLoader.restore_state(str(tmp_path / "ckpt"))
    other = str(tmp_path / "other")
    synth_dataset(other, samples=SAMPLES - 10, shard_size=SHARD, seed=5, min_side=32, max_side=32)
    with pytest.raises(StateError, match=r"'fingerprint'.*num_shards: saved 8, now 7.*"
                                         r"num_samples: saved 150, now 140"):
        factory(other)(state, 0)
    with pytest.raises(StateError, match="'seed': saved 11, this run uses 12"):
        factory(dataset, seed=12)(state, 0)
    with pytest.raises(StateError, match="'shuffle'"):
        factory(dataset, shuffle=False)(state, 0)


def test_pid_start_index_is_a_starting_point(dataset, tmp_path):
    """WDS_START_INDEX/WDS_EPOCH_NUM (pid seed mode) pick the start; a checkpoint then wins."""
    env = {"WDS_START_INDEX": str(SHARD * 2), "WDS_EPOCH_NUM": "1"}
    start_index, start_epoch = pid_env_start(env)
    cfg = make_cfg(dataset, seed_mode="pid", pid_env=True)
    catalog = load_catalog([dataset])
    topo = Topology(world_size=1, num_workers=2)

    def make(state: ReadState | None, rank: int, local: bool = False) -> IngestLoader:
        # as train.py does: the env starting point only when there is no checkpoint
        kw = {} if state is not None else {"start_index": start_index, "start_epoch": start_epoch}
        return IngestLoader(cfg, topo, catalog=catalog, state=state,
                            open_execution=LocalExecution.factory(cfg, catalog), **kw)

    base = baseline_of("pid-start", make, epochs=3)
    params = PlanParams(seed_mode="pid", seed=11, repeat=False, start_index=SHARD * 2)
    plan = plan_slot(catalog.counts, catalog.chunk_size, 0, 1, 2, params, 1)
    want = collections.Counter((s, i) for s, i, pad in iter_samples(plan) if not pad)
    # (40 // chunk 20) // 2 workers = one shard dropped from the head of each worker list
    dropped = every_sample() - want
    assert len({sid for sid, _ in dropped}) == 2
    assert all(sum(1 for s, _ in dropped if s == sid) == catalog.counts[sid] for sid, _ in dropped)
    assert {r[0] for r in base[0]} == {1, 2}  # starts at WDS_EPOCH_NUM
    assert real_samples(base[0], 1) == want
    assert real_samples(base[0], 2) == every_sample()  # the next epoch reads everything
    run_save_load(make, 4, tmp_path, epochs=3, baseline=base)


def test_restore_needs_a_file_for_every_slot(dataset, tmp_path):
    """A checkpoint missing a slot's rank files cannot resume exactly: that slot's progress
    would be lost and its samples read twice. Bad files are named."""
    for r in (0, 1):
        factory(dataset, world=2)(None, r).save(str(tmp_path / "two_slots"))
        factory(dataset, world=2, group=2)(None, r).save(str(tmp_path / "one_group"))
    folder = tmp_path / "two_slots" / "ingest_state"
    (folder / "rank_00001.json").unlink()
    with pytest.raises(StateError, match=r"slot\(s\) \[1\].*rank_00001\.json"):
        IngestLoader.restore_state(str(tmp_path / "two_slots"))
    (folder / "rank_00001.json").write_text('{"kind": "other"}')
    with pytest.raises(StateError, match=r"rank_00001\.json: read state field 'kind'"):
        IngestLoader.restore_state(str(tmp_path / "two_slots"))
    # one parallel group: either rank's file holds the slot's state
    (tmp_path / "one_group" / "ingest_state" / "rank_00000.json").unlink()
    assert IngestLoader.restore_state(str(tmp_path / "one_group")).current.slots == 1
    assert IngestLoader.restore_state(str(tmp_path / "none")) is None


def test_resume_with_another_batch_size_is_exactly_once(dataset, tmp_path):
    """Same topology, batch 8 -> 20: the rest of the epoch is re-planned in batches of 20."""
    loader = factory(dataset, all_local=True)(None, 0)
    before = collect(loader, 1, 5)
    loader.save(str(tmp_path))
    state = IngestLoader.restore_state(str(tmp_path))
    cfg = make_cfg(dataset, batch_size=20)
    resumed = IngestLoader(cfg, Topology(world_size=1, num_workers=2), state=state,
                           open_execution=LocalExecution.factory(cfg, load_catalog([dataset])))
    after = collect(resumed, 1)
    assert real_samples(before + after, 0) == every_sample()
    assert [len(b[2]) for b in after] == [20] * 6  # 110 samples left: 6 batches, the last padded
    assert [b[1] for b in after] == list(range(5, 11))


def test_parallel_groups_need_ordered_delivery(dataset):
    """Unordered ranks of one group would see different batches and save diverging states."""
    with pytest.raises(ConfigError, match=r"loader.ordered: expected true .*group_size 2"):
        factory(dataset, world=4, group=2, ordered=False)(None, 0)
    factory(dataset, world=4, group=1, ordered=False)(None, 0)  # independent slots: fine


def test_aspect_buckets_resume_exactly_once(tmp_path):
    """Bucketed batches: rows buffered in a bucket when the checkpoint was taken were not
    consumed, so they are read again; the epoch stays exactly-once with the same batch count."""
    out = str(tmp_path / "buckets")
    synth_dataset(out, samples=60, shard_size=10, seed=2, min_side=32, max_side=64,
                  classify_aspect_ratio=True)
    cfg = config_from_dict({
        "data": {"paths": [out]},
        "decode": {"resolution": 32, "buckets": ["16:9", "3:2", "4:3", "1:1", "3:4", "2:3",
                                                  "9:16", "21:9"],
                   "pool_min": 1, "pool_max": 1, "num_cpus": 0.25},
        "loader": {"batch_size": 4, "read_num_cpus": 0.25},
    })
    catalog = load_catalog([out])
    assert len({s.bucket for s in catalog.shards}) >= 2

    def make(state: ReadState | None, rank: int, local: bool = False) -> IngestLoader:
        return IngestLoader(cfg, Topology(world_size=1, num_workers=2), catalog=catalog,
                            state=state, open_execution=LocalExecution.factory(cfg, catalog))

    base, state, before, after = run_save_load(make, 5, tmp_path / "ckpt", epochs=1,
                                               same_sequence=False)
    want = collections.Counter((sid, i) for sid, c in enumerate(catalog.counts) for i in range(c))
    assert real_samples(before[0] + after[0], 0) == want
