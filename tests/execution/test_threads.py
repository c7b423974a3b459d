"""``decode.compute: threads`` (ray_ingest/execution/threads.py): the Ray edge's rows, decoded on
threads of this process, and ``auto``'s choice between threads and actors. No Ray."""

from __future__ import annotations

import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.columns import ACTOR, SEQ
from ray_ingest.config import DecodeConfig, config_from_dict
from ray_ingest.errors import ConfigError, IngestError, StallError
from ray_ingest.execution.local import LocalExecution
from ray_ingest.execution.threads import (
    AHEAD_PER_THREAD,
    THREAD_ACTOR,
    ThreadedExecution,
    decode_threads,
    describe_compute,
    resolve_compute,
    usable_cores,
)
from ray_ingest.plan.epoch import plan_window
from ray_ingest.plan.state import initial_state
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from tests.support.datagen import write_tar


def _setup(root: str, **decode):
    cfg = config_from_dict({"data": {"paths": [root]},
                            "decode": {"resolution": 16, **decode},
                            "loader": {"batch_size": 8, "block_rows": 8, "seed": 3}})
    catalog = load_catalog([root])
    topo = Topology(1, 0, 1)
    state = initial_state(catalog.fingerprint, cfg.loader.plan_params(), 0, topo,
                          catalog.fingerprint_doc(), 8)
    plans = plan_window(state, topo, catalog.counts, catalog.chunk_size, 8, 2, block_rows=8,
                        first_rows=8)
    return cfg, catalog, [it for p in plans for it in p.items]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("threads") / "ds")
    synth_dataset(out, samples=120, shard_size=20, seed=4, min_side=32, max_side=48)
    return _setup(out)


def _columns(blocks) -> dict[str, list]:
    out: dict[str, list] = {}
    for b in blocks:
        for k, v in b.items():
            if k == ACTOR or k.startswith("__t_"):  # who decoded it, and CPU timings, differ
                continue
            # images row by row: blocks of other sizes hold the same rows
            out.setdefault(k, []).extend(v.tolist() if v.dtype != np.uint8
                                         else [row.tobytes() for row in v])
    return out


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_threads_deliver_the_in_process_rows_in_order(setup, threads):
    cfg, catalog, items = setup
    want = list(LocalExecution(cfg, catalog, items).blocks())
    ex = ThreadedExecution(cfg, catalog, items, threads=threads)
    got = list(ex.blocks())
    assert [len(b[SEQ]) for b in got] == [len(b[SEQ]) for b in want]
    assert _columns(got) == _columns(want)
    assert all((b[ACTOR] == THREAD_ACTOR).all() for b in got)
    assert ex.read == len([it for it in items if it.count])
    assert f"on {threads} threads" in ex.stats()
    ex.close()


def test_units_of_at_most_a_batch_are_handed_out_as_each_is_decoded(setup, monkeypatch):
    """An item of many rows comes out a batch at a time, the first before the rest is done."""
    import attrs

    cfg, catalog, items = setup
    cfg = attrs.evolve(cfg, loader=attrs.evolve(cfg.loader, block_rows=128, batch_size=4))
    want = _columns(LocalExecution(cfg, catalog, items).blocks())
    got = list(ThreadedExecution(cfg, catalog, items, threads=3).blocks())
    assert max(len(b[SEQ]) for b in got) == 4
    assert _columns(got) == want

    release = threading.Event()
    decode = ThreadedExecution._decode

    def held(self, cols):  # every unit but the stream's first waits for the release
        if cols[SEQ][0] != items[0].seq:
            assert release.wait(10)
        return decode(self, cols)

    monkeypatch.setattr(ThreadedExecution, "_decode", held)
    ex = ThreadedExecution(cfg, catalog, items, threads=3)
    first = next(ex.blocks())  # would wait 10 s if the whole item had to be decoded first
    assert first[SEQ].tolist() == list(range(items[0].seq, items[0].seq + 4))
    release.set()
    ex.close()


def test_reads_ahead_a_bounded_number_of_items(setup):
    cfg, catalog, items = setup
    ex = ThreadedExecution(cfg, catalog, items, threads=2)
    ex.start()  # decoding begins before the first block is asked for
    assert ex._next == min(len(items), 2 * AHEAD_PER_THREAD)
    it = ex.blocks()
    next(it)
    assert ex._next - ex.read <= 2 * AHEAD_PER_THREAD
    ex.close()


def test_an_items_error_surfaces_in_stream_order(tmp_path):
    root = str(tmp_path / "ds")
    synth_dataset(root, samples=60, shard_size=20, seed=1, min_side=32, max_side=40)
    path = Path(root) / "image" / "part_000000" / "000001.tar"
    with tarfile.open(path) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
    members[2] = (members[2][0], b"\xff\xd8 not a jpeg")
    write_tar(path, members, index=True)
    cfg, catalog, items = _setup(root)
    ex = ThreadedExecution(cfg, catalog, items, threads=4)
    seen: list[int] = []
    with pytest.raises(IngestError, match=r"shard \S*000001\S* key \S+ index 2: cannot decode"):
        for block in ex.blocks():
            seen += block[SEQ].tolist()
    # every row planned before the broken item's came first (the later items were decoded,
    # but not handed out past the error)
    bad = next(i for i, it in enumerate(items)
               if it.sid == 1 and it.start <= 2 < it.start + it.count)
    assert len(seen) == sum(it.count for it in items[:bad])
    ex.close()


def test_close_stops_the_threads_without_hanging(setup):
    cfg, catalog, items = setup
    ex = ThreadedExecution(cfg, catalog, items, threads=3)
    it = ex.blocks()
    next(it)
    t0 = time.monotonic()
    ex.close()
    assert list(it) == []  # nothing after close
    while any(t.name.startswith("ray_ingest-decode") for t in threading.enumerate()):
        assert time.monotonic() - t0 < 10, "decode threads still running 10 s after close()"
        time.sleep(0.05)


def test_auto_decodes_off_the_trainer_whenever_ray_is_up():
    auto = DecodeConfig()
    assert auto.compute == "auto"
    # a small one-node cluster: the companion process on the rank's node, not threads
    assert resolve_compute(auto, nodes=1, cores=2) == "process"
    assert resolve_compute(auto, nodes=1, cores=4) == "process"
    # no Ray running: this process is all there is
    assert resolve_compute(auto, nodes=None, cores=4) == "threads"
    assert resolve_compute(auto, nodes=None, cores=64) == "threads"
    assert resolve_compute(auto, nodes=1, cores=5) == "actors"
    assert resolve_compute(auto, nodes=2, cores=2) == "actors"  # cores beyond this node
    assert resolve_compute(DecodeConfig(label_selector={"pool": "cpu-decode"}), 1, 2) == "actors"
    assert resolve_compute(DecodeConfig(small_node_cores=0), 1, 1) == "actors"
    for mode in ("actors", "tasks", "threads", "process"):
        assert resolve_compute(DecodeConfig(compute=mode), nodes=1, cores=2) == mode
        assert resolve_compute(DecodeConfig(compute=mode), nodes=8, cores=64) == mode
        assert resolve_compute(DecodeConfig(compute=mode), nodes=None, cores=2) == mode


def test_the_resolved_mode_is_said_in_words():
    assert describe_compute("process", 1).startswith("process: companion decode processes on "
                                                     "each rank's own node, off the trainer")
    assert describe_compute("process", 2).endswith(", 2 per rank")
    assert "inside the trainer's process" in describe_compute("threads", 4)
    assert describe_compute("actors").startswith("actors: the job's shared, elastic pool")
    assert describe_compute("actors", scope="rank").startswith("actors: each rank's own")
    assert describe_compute("tasks").startswith("tasks: Ray tasks off the trainer's process")


def test_thread_count_defaults_to_twice_the_usable_cores_shared_by_the_nodes_pipelines():
    assert usable_cores() >= 1
    assert decode_threads(DecodeConfig()) == 2 * usable_cores()
    assert decode_threads(DecodeConfig(threads=3)) == 3
    # several pipelines on one node share its cores (at least one thread each)
    assert decode_threads(DecodeConfig(), node_pipelines=2) == max(1, usable_cores())
    assert decode_threads(DecodeConfig(), node_pipelines=10 ** 6) == 1
    assert decode_threads(DecodeConfig(threads=3), node_pipelines=2) == 3  # as set
    with pytest.raises(ConfigError, match=r"decode.threads: expected a number >= 1, got 0"):
        DecodeConfig(threads=0)


def test_a_stuck_read_raises_a_stall_error_naming_the_item(setup, monkeypatch):
    import attrs

    cfg, catalog, items = setup
    cfg = attrs.evolve(cfg, loader=attrs.evolve(cfg.loader, stall_timeout_s=1.0))
    release = threading.Event()

    def stuck(self, item, rows=None):
        release.wait(10)
        return iter(())

    monkeypatch.setattr(LocalExecution, "read_columns", stuck)
    ex = ThreadedExecution(cfg, catalog, items, threads=2)
    first = items[0]
    with pytest.raises(StallError, match=rf"stall_timeout_s \(1 s\) of waiting: reading or "
                       rf"decoding \S+ rows {first.start}..{first.start + first.count - 1} "
                       r"is stuck"):
        list(ex.blocks())
    release.set()
    ex.close()


def test_column_lists_read_and_decode_as_the_arrow_blocks(setup):
    """Column lists (decoders in the reading process) = Arrow blocks (read tasks)."""
    from ray_ingest.columns import T_READ
    from ray_ingest.decode.decoder import Decoder
    from ray_ingest.execution.read import read_item
    from ray_ingest.twintar.reader import read_options

    cfg, catalog, items = setup
    opts = read_options(cfg)
    decoder = Decoder(cfg.decode, seed=cfg.loader.seed)
    for item in items[:4]:
        shard = catalog.shard(item.sid)
        tables = list(read_item(shard, item, opts, 8))
        lists = list(read_item(shard, item, opts, 8, arrow=False))
        assert [t.num_rows for t in tables] == [len(c["__key__"]) for c in lists]
        for table, cols in zip(tables, lists, strict=True):
            assert table.schema.names == list(cols)
            want = table.drop_columns([T_READ]).to_pylist()
            got = [dict(zip(cols, v, strict=True)) for v in zip(*cols.values(), strict=True)]
            assert [{k: v for k, v in r.items() if k != T_READ} for r in got] == want
            assert _columns([decoder(table)]) == _columns([decoder(cols)])
