"""Head start (ray_ingest/execution/headstart.py): the same rows in the same order, whoever
decodes them.

No Ray: the "remote" is the in-process execution of the items after the head, behind a start-up
delay, as a Ray Data execution is behind its decode actors' start-up.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.columns import ACTOR, SEQ
from ray_ingest.config import config_from_dict
from ray_ingest.errors import IngestError
from ray_ingest.execution.headstart import (
    HEAD_ACTOR,
    HEAD_THREAD,
    START_THREAD,
    HeadStart,
    split_head,
)
from ray_ingest.execution.local import LocalExecution
from ray_ingest.plan.epoch import plan_window
from ray_ingest.plan.state import initial_state
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset


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


def test_split_head_takes_whole_leading_items(setup):
    _, _, items = setup
    head, rest = split_head(items, 16)
    assert head + rest == items and sum(it.count for it in head) >= 16
    assert sum(it.count for it in head[:-1]) < 16
    assert split_head(items, 0)[0] == items[:1]  # at least one item
    assert split_head(items, 10**9) == (items, [])


@pytest.mark.parametrize("rows, delay", [(16, 0.3), (1, 0.0), (10**9, 0.0)])
def test_head_then_remote_deliver_the_executions_rows_in_order(setup, rows, delay):
    cfg, catalog, items = setup
    want = _rows(LocalExecution(cfg, catalog, items).blocks())
    head, rest = split_head(items, rows)
    remote = Delayed(LocalExecution(cfg, catalog, rest), delay) if rest else None
    hs = HeadStart(LocalExecution(cfg, catalog, head), (lambda: remote) if rest else None)
    t0 = time.monotonic()
    blocks = hs.blocks()
    first = next(blocks)
    if delay:  # the head does not wait for the remote's start-up
        assert time.monotonic() - t0 < delay
    got = [first, *blocks]
    assert _rows(got) == want
    assert hs.head_rows == sum(it.count for it in head)
    marked = sum(len(b[SEQ]) for b in got if (b[ACTOR] == HEAD_ACTOR).all())
    assert marked == hs.head_rows
    assert "head start" in hs.stats() and ("remote" in hs.stats()) == bool(rest)
    hs.close()


class SlowStart(Delayed):
    """Starts in ``start_s`` seconds (the job pool's join of a new controller); its start
    raises ``fail`` if given."""

    def __init__(self, inner: LocalExecution, start_s: float, fail: Exception | None = None):
        super().__init__(inner, 0.0)
        self.start_s, self.fail, self.started_at = start_s, fail, None

    def start(self) -> None:
        time.sleep(self.start_s)
        if self.fail is not None:
            raise self.fail
        self.started_at = time.monotonic()


def _raises_after_the_head(hs: HeadStart, head: list, match: str) -> None:
    """``hs`` delivers every row of ``head``, then raises ``match`` in the consumer's thread."""
    seen = []
    with pytest.raises(IngestError, match=match):
        for b in hs.blocks():
            seen += b[SEQ].tolist()
    assert len(seen) == sum(it.count for it in head)
    hs.close()


def test_the_head_does_not_wait_for_the_remote_s_start(setup):
    cfg, catalog, items = setup
    want = _rows(LocalExecution(cfg, catalog, items).blocks())
    head, rest = split_head(items, 16)
    remote = SlowStart(LocalExecution(cfg, catalog, rest), 1.0)
    hs = HeadStart(LocalExecution(cfg, catalog, head), lambda: remote)
    t0 = time.monotonic()
    hs.start()
    assert time.monotonic() - t0 < 0.5  # the start goes on in a helper thread
    blocks = hs.blocks()
    first = next(blocks)
    assert remote.started_at is None and time.monotonic() - t0 < 1.0
    got = [first, *blocks]
    assert remote.started_at is not None and _rows(got) == want
    hs.close()

    # a failed start is raised in the consumer's thread, after the head's rows
    remote = SlowStart(LocalExecution(cfg, catalog, rest), 0.2,
                       fail=IngestError("decode pool: controller did not answer"))
    _raises_after_the_head(HeadStart(LocalExecution(cfg, catalog, head), lambda: remote),
                           head, "did not answer")


def test_the_remote_is_opened_in_the_helper_thread_not_before_the_head(setup):
    """Opening the remote (the job pool's imports, its controller's connection) is not on the
    head's path: the head's first block does not wait for it; a failed open is raised after
    the head's rows, in the consumer's thread."""
    cfg, catalog, items = setup
    want = _rows(LocalExecution(cfg, catalog, items).blocks())
    head, rest = split_head(items, 16)
    opened: list[str] = []

    def open_remote() -> Delayed:
        time.sleep(1.0)
        opened.append(threading.current_thread().name)
        return Delayed(LocalExecution(cfg, catalog, rest), 0.0)

    hs = HeadStart(LocalExecution(cfg, catalog, head), open_remote)
    t0 = time.monotonic()
    blocks = hs.blocks()
    first = next(blocks)
    assert time.monotonic() - t0 < 0.8 and not opened
    assert _rows([first, *blocks]) == want and opened == [START_THREAD]
    assert "remote" in hs.stats()
    hs.close()

    def refused() -> Delayed:
        raise IngestError("decode pool: cannot import its modules")

    _raises_after_the_head(HeadStart(LocalExecution(cfg, catalog, head), refused), head,
                           "cannot import")


def test_after_first_block_opens_the_remote_once_the_heads_first_block_is_decoded(setup):
    """A shared pool's head start (``after_first_block``): the remote is opened in the helper
    thread only after the head decoded its first block, and the rows are the same; closed
    before that block, it opens no remote at all."""
    cfg, catalog, items = setup
    want = _rows(LocalExecution(cfg, catalog, items).blocks())
    head, rest = split_head(items, 16)
    decoded: list[int] = []
    opened: list[tuple[str, int]] = []
    gate = threading.Event()

    def head_local() -> LocalExecution:
        """The head's execution; each block decoded once ``gate`` is set, then counted."""
        local = LocalExecution(cfg, catalog, head)
        real = local.item_blocks

        def counted(item):
            gate.wait(10)
            for block in real(item):
                decoded.append(len(block[SEQ]))
                yield block

        local.item_blocks = counted
        return local

    def open_remote() -> Delayed:
        opened.append((threading.current_thread().name, len(decoded)))
        return Delayed(LocalExecution(cfg, catalog, rest), 0.0)

    gate.set()
    hs = HeadStart(head_local(), open_remote, after_first_block=True)
    assert _rows(hs.blocks()) == want
    assert opened == [(START_THREAD, 1)]  # after the first block, before the second
    hs.close()

    # closed while the head waits to decode its first block: no remote is ever opened
    gate.clear()
    decoded.clear()
    opened.clear()
    hs = HeadStart(head_local(), open_remote, after_first_block=True)
    hs.start()
    threading.Timer(0.3, gate.set).start()  # the head goes on once close() has begun
    hs.close()  # waits for the head's thread
    assert opened == [] and not any(
        t.name == HEAD_THREAD and t.is_alive() for t in threading.enumerate())

    # as shipped for a rank's own pool: opened when the head starts, before its first block
    gate.clear()
    decoded.clear()
    hs = HeadStart(head_local(), open_remote)
    hs.start()
    deadline = time.monotonic() + 10
    while not opened and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opened == [(START_THREAD, 0)]
    gate.set()
    hs.close()


def test_errors_of_either_part_surface(setup):
    cfg, catalog, items = setup
    head, rest = split_head(items, 16)
    hs = HeadStart(LocalExecution(cfg, catalog, head),
                   lambda: Delayed(LocalExecution(cfg, catalog, rest), 0.1, fail_at=3))
    with pytest.raises(IngestError, match="index 3: cannot decode"):
        list(hs.blocks())
    hs.close()

    local = LocalExecution(cfg, catalog, head)

    def broken(item):
        raise IngestError(f"shard {item.sid}: cannot open")
        yield

    local.item_blocks = broken
    hs = HeadStart(local, lambda: Delayed(LocalExecution(cfg, catalog, rest), 0.0))
    with pytest.raises(IngestError, match="cannot open"):
        list(hs.blocks())
    hs.close()


def test_close_mid_stream_stops_both_without_hanging(setup):
    cfg, catalog, items = setup
    head, rest = split_head(items, 40)
    remote = Delayed(LocalExecution(cfg, catalog, rest), 0.3)
    hs = HeadStart(LocalExecution(cfg, catalog, head), lambda: remote)
    it = hs.blocks()
    first = next(it)
    assert len(first[SEQ]) == items[0].count and np.all(first[ACTOR] == HEAD_ACTOR)
    it.close()
    hs.close()
    assert remote.closed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            t.name == HEAD_THREAD and t.is_alive() for t in threading.enumerate()):
        time.sleep(0.05)
    assert not any(t.name == HEAD_THREAD and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize(("decode", "loader", "batches"), [
    ({}, {}, 2),                                                   # the default
    ({"label_selector": {"pool": "cpu-decode"}}, {}, 0),           # decoding belongs there
    ({"label_selector": {"pool": "cpu-decode"}}, {"head_start_batches": 1}, 1),  # asked for
    ({}, {"head_start_batches": 0}, 0),
    ({}, {"head_start_batches": 3}, 3),
])
def test_head_start_batches_resolve(decode, loader, batches):
    from ray_ingest.execution.opener import head_start_batches

    cfg = config_from_dict({"data": {"paths": ["/nowhere"]}, "decode": decode, "loader": loader})
    assert head_start_batches(cfg) == batches


@pytest.mark.parametrize(("world", "scope", "after"), [
    (4, "job", True),    # the job's shared pool: its controller joined after the first block
    (1, "job", False),   # one pipeline: the controller is hosted in the rank's process
    (4, "rank", False),  # the rank's own pool
])
def test_executions_open_a_shared_pool_after_the_heads_first_block(setup, monkeypatch, world,
                                                                  scope, after):
    """Which head starts wait for their first block; and the loader's construction probes the
    resize's pass order (its first batch does not)."""
    from ray_ingest.decode import augment
    from ray_ingest.execution import opener

    cfg, catalog, items = setup
    cfg = config_from_dict({**cfg.to_dict(), "decode": {"resolution": 16, "compute": "actors",
                                                        "pool_scope": scope}})
    monkeypatch.setattr(opener, "_ray_nodes", lambda: 2)
    augment.pass_order.cache_clear()
    ex = opener.Executions(cfg, catalog, Topology(world, 0, 1))
    assert augment._ORDER  # probed here, at construction
    assert ex.ray_module == ("jobpool" if scope == "job" else "pool")  # and its module imported
    hs = ex(items)  # not started: nothing is opened, no Ray is needed
    assert isinstance(hs, HeadStart) and hs._after_first_block is after
    hs.close()
