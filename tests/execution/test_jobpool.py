"""The job's shared decode pool (ray_ingest/execution/service.py, jobpool.py) on the session Ray:
two ranks draw from one pool and each gets exactly its in-process rows in stream order; a
worker decodes its calls one at a time on its main thread and drops a cancelled one; the
controller hands out the earliest step first across ranks; a trainer-bound rank's
pool shrinks to what it keeps busy (long before it is idle), and the job's and the rank's
decode CPUs reach the metrics endpoint; a worker killed mid-stream costs nothing but a
resubmit; the controller ends once no rank uses it; a job of one pipeline hosts it in the rank's
process."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import types

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.columns import ACTOR, INDEX, KEY, SEQ, SID
from ray_ingest.config import config_from_dict
from ray_ingest.execution.local import LocalExecution
from ray_ingest.plan.epoch import read_items
from ray_ingest.plan.state import initial_state, slot_stream
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("jobpool") / "ds")
    synth_dataset(out, samples=80, shard_size=10, seed=5, min_side=16, max_side=40)
    return out


def _cfg(path, **decode):
    return config_from_dict({
        "data": {"paths": [path]},
        "decode": {"resolution": 16, "compute": "actors", "pool_min": 1, "pool_max": 2,
                   "num_cpus": 0.25, **decode},
        "loader": {"batch_size": 4, "block_rows": 5, "read_workers": 1, "seed": 11,
                   "head_start_batches": 0},
    })


def _items(cfg, catalog, world=1, rank=0):
    topo = Topology(world_size=world, rank=rank, read_workers=1)
    state = initial_state(catalog.fingerprint, cfg.loader.plan_params(), 0, topo)
    return read_items(slot_stream(state, catalog.counts, catalog.chunk_size, topo.slot), (), 5)


def _rows(blocks) -> list[tuple]:
    return [(int(b[SID][i]), int(b[INDEX][i]), int(b[SEQ][i]), str(b[KEY][i]),
             hashlib.sha1(b["image"][i].tobytes()).hexdigest())
            for b in blocks for i in range(len(b[SEQ]))]


def _service(cfg, catalog):
    """The running controller (an actor, or hosted in this process); ValueError if none."""
    from ray_ingest.execution.hosted import find

    return find(cfg, catalog.fingerprint)


def _ask(call):
    """A controller call's answer (an actor's or a hosted controller's)."""
    from ray_ingest.execution.hosted import answer

    return answer(call, 60)


def _one_rank(path, **decode):
    """A job of one decoding rank on a pool of two workers: (cfg, catalog, items, execution)."""
    from ray_ingest.execution.jobpool import JobPoolExecution

    cfg = _cfg(path, pool_min=2, pool_max=2, **decode)
    catalog = load_catalog([path])
    items = _items(cfg, catalog)
    return cfg, catalog, items, JobPoolExecution(cfg, catalog, items, rank=0, pipelines=1)


def _until(cond, timeout=30.0, period=0.1) -> bool:
    """Whether ``cond()`` came true within ``timeout`` seconds (polled every ``period``)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(period)
    return True


def _gone(cfg, catalog, timeout=30.0) -> bool:
    def gone() -> bool:
        try:
            _service(cfg, catalog)
        except ValueError:
            return True
        return False

    return _until(gone, timeout, 0.2)


def test_two_ranks_share_one_pool_and_get_their_rows_in_order(ray_local, dataset):
    from ray_ingest.execution.jobpool import JobPoolExecution

    cfg = _cfg(dataset, sim_cost_s=0.005)
    catalog = load_catalog([dataset])
    got: dict[int, list] = {}
    execs = {r: JobPoolExecution(cfg, catalog, _items(cfg, catalog, 2, r), {"rank": str(r)},
                                 rank=r, pipelines=2) for r in (0, 1)}

    def consume(rank: int) -> None:
        got[rank] = list(execs[rank].blocks())

    threads = [threading.Thread(target=consume, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    svc = _service(cfg, catalog)
    stats = _ask(svc.stats.remote())
    pool = {h._actor_id.hex() for h in _ask(svc.worker_handles.remote())}
    for ex in execs.values():
        ex.close()
    for r in (0, 1):
        want = _rows(LocalExecution(cfg, catalog, _items(cfg, catalog, 2, r)).blocks())
        assert _rows(got[r]) == want and len(want) == 40
        assert [row[2] for row in _rows(got[r])] == sorted(row[2] for row in want)
        assert execs[r].stats().startswith(f"job: {execs[r].done} read items decoded on a job "
                                           "pool of up to")
    actors = [{a for b in got[r] for a in b[ACTOR]} for r in (0, 1)]
    # one pool decoded for both ranks: every worker either rank saw is the one controller's,
    # and it counted both ranks' items (which worker took which rank's item is the order the
    # items came in: with 4 workers and the ranks' items alternating, ranks 0 and 1 can take
    # turns on workers 0, 2 and 1, 3)
    assert actors[0] and actors[1] and (actors[0] | actors[1]) <= pool, (actors, pool)
    assert set(stats["rank_busy_s"]) == {0, 1} and min(stats["rank_busy_s"].values()) > 0
    assert len(actors[0] | actors[1]) <= 4  # pool_max 2 x 2 pipelines
    assert stats["started"] <= 4 and stats["history"][-1]["ranks"] in (1, 2)
    assert max(h["ranks"] for h in stats["history"]) == 2
    assert _gone(cfg, catalog), "the controller did not end after its ranks left"


def _finish_order(refs: dict) -> list:
    import ray

    order, pending = [], dict(refs)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=60)
        assert done, "a decode call did not finish"
        order.append(pending.pop(done[0]))
    return order


def test_a_worker_decodes_its_calls_one_at_a_time_on_its_main_thread(ray_local, dataset):
    """In the order they came (the controller decides the order: it gives a worker at most two
    calls), on the process's main thread (whose malloc arena keeps freed memory: no
    environment of its own needed), a queued call cancelled; each call's first return is the
    seconds it took (the controller's busy time)."""
    import ray

    from ray_ingest.execution.service import DecodeService
    from ray_ingest.execution.sharedworker import SharedDecodeWorker

    cfg = _cfg(dataset, sim_cost_s=0.04)  # 5 rows: 0.2 s per item
    catalog = load_catalog([dataset])
    items = _items(cfg, catalog)
    opts = DecodeService(cfg, 1, catalog.fingerprint)._worker_options()  # the pool's own
    assert "runtime_env" not in opts
    worker = ray.remote(SharedDecodeWorker).options(**{**opts, "num_cpus": 0.25}).remote(cfg)
    ray.get(worker.ready.remote())

    def call(i):
        return worker.decode.remote(None, catalog.shard(items[i].sid), items[i])

    t0 = time.monotonic()
    calls = [call(i) for i in range(5)]
    ended, dropped = calls[3]
    ray.cancel(dropped)  # queued behind the others: never runs, and holds up no other call
    refs = {blocks: i for i, (_, blocks) in enumerate(calls) if i != 3}
    assert _finish_order(refs) == [0, 1, 2, 4]
    assert time.monotonic() - t0 < 10  # 4 x 0.2 s of decoding; not Ray's 30-s wait for a gap
    for i in (0, 1, 2, 4):
        busy, blocks = ray.get(list(calls[i]))
        assert 0.2 * 0.9 <= busy < 5.0
        assert [int(x) for b in blocks for x in b[INDEX]] == list(
            range(items[i].start, items[i].start + items[i].count))
    for ref in (ended, dropped):
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(ref)
    assert ray.get(worker.stats.remote())["main_thread"] is True
    ray.kill(worker)


def test_a_new_worker_takes_items_as_soon_as_it_is_up(ray_local, dataset):
    """Not at the controller's next control period: with a control loop that never ticks
    after the join's, the pool's first worker still comes up and decodes a rank's item."""
    import ray

    from ray_ingest.execution.fairshare import step_key
    from tests.support.controllers import NoTicks

    cfg = _cfg(dataset)
    catalog = load_catalog([dataset])
    item = _items(cfg, catalog)[0]
    svc = ray.remote(NoTicks).options(num_cpus=0).remote(cfg, 1, catalog.fingerprint)
    try:
        assert ray.get(svc.join.remote("c", 0, {"rank": "0"}), timeout=60) is not None
        answer = ray.get(svc.submit.remote("c", step_key(item, cfg.loader.batch_size),
                                           catalog.shard(item.sid), item), timeout=60)
        blocks = ray.get(answer[0], timeout=60)
        assert _rows(blocks) == _rows(LocalExecution(cfg, catalog, [item]).blocks())
        assert len(_ask(svc.stats.remote())["history"]) == 1  # the join's tick alone
    finally:
        ray.kill(svc)


def test_a_trainer_bound_rank_gives_back_workers_and_the_metrics_say_so(ray_local, dataset):
    from ray_ingest.loader.ingest import IngestLoader
    from tests.loader.test_metrics import SCRAPE_TIMEOUT_S, scrape, total

    cfg = _cfg(dataset, pool_min=1, pool_max=4, sim_cost_s=0.002, scale_down_hold_s=1.5)
    catalog = load_catalog([dataset])
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1), catalog=catalog)
    assert loader.compute == "actors" and "job's shared, elastic pool" in loader.describe_decode()
    seen, stats, first_wait = [], None, None
    for _, batches in loader.epochs(1):
        for b in batches:
            if first_wait is None:
                first_wait = loader.clock.wait  # the pool's start-up
            seen += list(zip(b.sids, b.indices, strict=True))
            time.sleep(0.25)  # the train step: this rank is trainer-bound
            if len(seen) == 80:  # the last batch (~5 s in): the rank still holds it, asking
                # for nothing, until the pool has shrunk (at most 30 s): its four workers may
                # take ~3 s to start on a loaded machine, and the shrink's hold starts after
                service = _service(cfg, catalog)
                _until(lambda s=service: _ask(s.stats.remote())["target"] == 1, 30.0, 0.25)
                stats = _ask(service.stats.remote())
    assert len(seen) == len(set(seen)) == 80
    hist = stats["history"]
    assert hist[0]["target"] == 4  # started with what the cluster had room for, within 4
    assert stats["target"] == 1 and stats["reason"].startswith("shrink"), (stats["reason"], hist)
    assert hist[-1]["ranks"] == 1 and stats["retired"] >= 3
    # after its first batch the rank hardly waited (19 steps of 0.25 s set the pace), before
    # and after the shrink
    assert loader.clock.wait - first_wait < 0.1 * 19 * 0.25, (loader.clock.wait, first_wait)
    port = ray_local._private.worker.global_worker.node.metrics_export_port
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    want = {("ray_ingest_job_decode_cpus", "target"): 0.25,
            ("ray_ingest_decode_cpus", "target"): 0.25}
    got: dict = {}
    while got != want and time.monotonic() < deadline:
        series = scrape(port)
        for name, kind in want:
            v = total(series, name, kind=kind, dataset=catalog.fingerprint)
            if v is not None:
                got[(name, kind)] = v
        time.sleep(1.0)
    assert got == want, (got, want)
    assert total(series, "ray_ingest_decode_cpus", kind="busy", rank="0",
                 dataset=catalog.fingerprint) is not None


def test_a_worker_killed_mid_stream_is_resubmitted_in_place(ray_local, dataset):
    import ray

    cfg, catalog, items, ex = _one_rank(dataset, sim_cost_s=0.05)  # 0.25 s per item
    try:
        it = ex.blocks()
        got = [next(it)]
        svc = _service(cfg, catalog)
        handles = _ask(svc.worker_handles.remote())
        while len(handles) < 2:  # both workers up
            got.append(next(it))
            handles = _ask(svc.worker_handles.remote())
        ray.kill(handles[0], no_restart=True)  # it holds calls: the pool keeps both busy
        got += list(it)
        stats = _ask(svc.stats.remote())
    finally:
        ex.close()
    assert _rows(got) == _rows(LocalExecution(cfg, catalog, items).blocks())
    assert ex.resubmitted >= 1 and f"{ex.resubmitted} resubmitted" in ex.stats()
    assert stats["lost"] == 1 and stats["started"] == 3  # replaced
    assert _gone(cfg, catalog)


def test_a_new_steps_report_goes_beside_an_unanswered_one_and_both_answers_count(
        ray_local, dataset):
    """A rank that takes a new step reports its rate at once (once REPORT_MIN_S has passed
    since its last report), beside a report still in flight, whose answer still counts: here
    the older answer (slow) says the controller forgot the rank, and the rank joins again (it
    was dropped before, and the rank went on with a controller that did not know it); the
    newer answer, first back, sizes the window and no older view is applied over it."""
    import asyncio

    import ray

    from ray_ingest.execution.fairshare import window_calls
    from ray_ingest.execution.jobpool import REPORT_MIN_S, JobPoolExecution
    from ray_ingest.execution.pool import PER_WORKER

    @ray.remote(num_cpus=0)
    class Reports:
        """Answers the first report after 1.5 s with None, the others at once."""

        def __init__(self):
            self.calls = 0

        async def report(self, client, wait_s, rate, *_):
            self.calls += 1
            if self.calls == 1:
                await asyncio.sleep(1.5)
                return None
            return {"workers": 2, "ranks": 1}

        async def count(self):
            return self.calls

    cfg = _cfg(dataset, pool_min=1, pool_max=4)
    catalog = load_catalog([dataset])
    ex = JobPoolExecution(cfg, catalog, _items(cfg, catalog), rank=0, pipelines=1)
    reports = Reports.remote()
    assert ray.get(reports.count.remote()) == 0  # up
    ex._service = reports
    try:
        ex._admit()  # the periodic report: answered in 1.5 s
        t0 = time.monotonic()
        ex._report_now = True  # what taking a new step sets
        ex._admit()  # not yet: the last report went less than REPORT_MIN_S ago
        assert len(ex._reports) == 1 and ex._report_now
        while ray.get(reports.count.remote()) < 2:  # the rank's loop admits as it goes
            assert time.monotonic() - t0 < 1.0, "the new step's report waited for the other"
            ex._admit()
            time.sleep(0.02)
        assert time.monotonic() - t0 >= REPORT_MIN_S
        two = window_calls(cfg.loader.batch_size, 5, 2, 1, PER_WORKER, ex._cap)
        deadline = time.monotonic() + 30
        while ex.window != two:
            assert time.monotonic() < deadline
            ex._admit(0.02)
        assert ex._service is reports and len(ex._reports) == 1
        while ex._service is reports:  # the older answer: join again (a real controller)
            assert time.monotonic() < deadline
            ex._admit(0.02)
        assert _ask(_service(cfg, catalog).stats.remote())["ranks"] == 1  # it knows the rank
    finally:
        ex.close()
    assert _gone(cfg, catalog)


def test_the_ranks_join_the_pool_the_driver_prestarted(ray_local, dataset):
    """jobs/train.py's driver starts the pool before Ray Train starts the ranks: a rank's
    config (the job's train_loop_config, storage options sealed and revealed, decode.compute
    resolved) names the same controller, and its items go to the pre-started workers."""
    from ray_ingest.execution.opener import prestart_job_pool, with_compute
    from ray_ingest.execution.service import service_name
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.train.job import job_config
    from ray_ingest.train.worker import worker_config

    cfg = config_from_dict({**_cfg(dataset, sim_cost_s=0.001).to_dict(),
                            "data": {"paths": [dataset], "storage_options": {"token": "s3cr3t"}}})
    catalog = load_catalog([dataset])
    rank_cfg = worker_config(job_config(cfg))
    assert service_name(with_compute(cfg, "actors"), "fp", job="01") == \
        service_name(with_compute(rank_cfg, "actors"), "fp", job="01")
    assert "s3cr3t" not in service_name(cfg, "fp", job="01")
    auto = config_from_dict({**cfg.to_dict(), "decode": {**cfg.to_dict()["decode"],
                                                        "compute": "auto"}})
    assert not prestart_job_pool(auto, catalog.fingerprint, 2)  # one small node: process
    assert prestart_job_pool(cfg, catalog.fingerprint, 2)
    svc = _service(cfg, catalog)
    before = _ask(svc.stats.remote())
    assert before["ranks"] == 0 and before["started"] == 4  # pool_max 2 x 2 pipelines
    loader = IngestLoader(rank_cfg, Topology(world_size=2, rank=0, read_workers=1),
                          catalog=catalog)
    n = sum(len(b.sids) for _, bs in loader.epochs(1) for b in bs)
    after = _ask(svc.stats.remote())
    assert n == 40 and after["started"] == 4 and after["dispatched"] > 0
    assert _gone(cfg, catalog)


def test_a_prestarted_pool_no_rank_comes_to_ends_with_its_workers(ray_local, dataset):
    """A pool the driver pre-started holds its workers while it waits for its ranks; if none
    comes within its wait, it ends with them (not as late as the driver), and a rank that
    comes afterwards starts a new pool and gets its rows."""
    import ray
    from ray._private import state

    from ray_ingest.execution import service
    from ray_ingest.loader.ingest import IngestLoader

    cfg = _cfg(dataset, sim_cost_s=0.0015)  # a pool of its own (the name hashes the config)
    catalog = load_catalog([dataset])

    def workers() -> dict[str, str]:
        """This Ray session's decode workers, by actor id: their state (the GCS's table)."""
        return {a["ActorID"]: a["State"] for a in state.actors().values()
                if a["ActorClassName"] == "SharedDecodeWorker"}

    before, t0 = set(workers()), time.monotonic()
    handle = service.prestart(cfg, 1, catalog.fingerprint, wait_s=5.0)
    stats = ray.get(handle.stats.remote())
    assert stats["ranks"] == 0 and stats["started"] == 2  # pool_max 2 x 1 pipeline
    assert _until(lambda: len(set(workers()) - before) == 2)  # registered (asynchronously)
    mine = set(workers()) - before
    assert all(workers()[w] != "DEAD" for w in mine)
    assert _gone(cfg, catalog)
    assert time.monotonic() - t0 >= 5.0
    assert _until(lambda: all(workers()[w] == "DEAD" for w in mine))  # they ended with it
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1), catalog=catalog)
    assert sum(len(b.sids) for _, bs in loader.epochs(1) for b in bs) == 80
    assert _gone(cfg, catalog)


def _completion_order(outer: dict) -> list:
    """The order in which the workers finished the submitted items: polled every 10 ms (an
    item takes 0.15 s), resolving the controller's answers (the results' refs) as they come."""
    import ray

    inner: dict = {}
    order: list = []
    deadline = time.monotonic() + 60
    while len(order) < len(outer) and time.monotonic() < deadline:
        ready, _ = ray.wait(list(outer), num_returns=len(outer), timeout=0)
        for ref in ready:
            if outer[ref] not in inner.values():
                inner[ray.get(ref)[0]] = outer[ref]
        done, _ = ray.wait(list(inner), num_returns=len(inner), timeout=0.01)
        order += [inner[r] for r in done if inner[r] not in order]
    assert sorted(order) == sorted(outer.values())
    return order


class _Ranks:
    """Ranks of one test talking to a controller directly: client ``c{rank}``, each step's
    item submitted with key ``(0, step)``. As a context manager, the ranks still joined at the
    end leave and the controller is waited out: a failed test must not leave its controller
    to the next test that names the same pool (it would get this one, sized for this job)."""

    def __init__(self, svc, catalog, items):
        self.svc, self.catalog, self.items = svc, catalog, items
        self.joined: set[int] = set()

    def __enter__(self) -> _Ranks:
        return self

    def __exit__(self, *exc) -> None:
        import ray

        if not self.joined:
            return
        with contextlib.suppress(ray.exceptions.RayError):
            for rank in sorted(self.joined):
                self.leave(rank)
        deadline = time.monotonic() + 30  # it ends LINGER_S after its last rank left
        while time.monotonic() < deadline:
            try:
                ray.get(self.svc.stats.remote(), timeout=5)
            except ray.exceptions.RayError:
                return
            time.sleep(0.2)

    def join(self, rank: int) -> None:
        import ray

        ray.get(self.svc.join.remote(f"c{rank}", rank, {"rank": str(rank)}))
        self.joined.add(rank)

    def leave(self, rank: int) -> None:
        import ray

        ray.get(self.svc.leave.remote(f"c{rank}"))
        self.joined.discard(rank)

    def stats(self) -> dict:
        import ray

        return ray.get(self.svc.stats.remote())

    def wait_held(self, workers: int, timeout: float = 60.0) -> None:
        """Until the controller holds ``workers`` workers up (a test failure, not a hang,
        when it never does)."""
        deadline = time.monotonic() + timeout
        while (held := self.stats()["history"][-1]["held"]) < workers:
            assert time.monotonic() < deadline, f"{held} of {workers} workers up in {timeout} s"
            time.sleep(0.1)

    def submit(self, rank: int, steps) -> dict:
        """Rank ``rank``'s ``steps``, one at a time, each received by the controller before
        the next is sent (Ray does not keep an async actor's calls from one caller in the
        order they were sent, and these tests are about the order): ``{outer ref: (rank,
        step)}``."""
        outer = {}
        for step in steps:
            before = self.stats()["submitted"]
            item = self.items[step]
            ref = self.svc.submit.remote(f"c{rank}", (0, step), self.catalog.shard(item.sid),
                                         item)
            outer[ref] = (rank, step)
            deadline = time.monotonic() + 30
            while self.stats()["submitted"] == before:
                assert time.monotonic() < deadline, (rank, step)
                time.sleep(0.002)
        return outer


def test_the_controller_hands_out_the_earliest_step_first_across_ranks(ray_local, dataset):
    """One worker. Rank 0 submits steps 0-5, rank 1 joins later and submits steps 0 and 1:
    rank 1's steps run before rank 0's later ones (the calls the worker already held
    excepted). Ranks 2 and 3 join together, rank 3 submits its first items 0.5 s after rank 2
    submitted steps 0-3: rank 2's later steps wait for rank 3's first (a rank that just
    joined is not overtaken by another's look-ahead)."""

    from ray_ingest.execution import service

    cfg = _cfg(dataset, pool_min=1, pool_max=1, sim_cost_s=0.03)  # 0.15 s per item
    catalog = load_catalog([dataset])
    with _Ranks(service.connect(cfg, 1, catalog.fingerprint), catalog,
                _items(cfg, catalog)) as ranks:
        ranks.join(0)
        ranks.wait_held(1)
        outer = ranks.submit(0, range(6))
        time.sleep(0.2)
        ranks.join(1)
        # what the worker got before rank 1 asked (two calls, a third once one finished):
        # from rank 1's joining to its first item, rank 0's later steps wait at the controller
        held = ranks.stats()["dispatched"]
        outer |= ranks.submit(1, range(2))
        order = _completion_order(outer)
        # rank 1's steps 0 and 1 overtake rank 0's later steps; only what the worker held runs
        # before them
        first_of_1 = order.index((1, 0))
        assert first_of_1 == held < 6 and order[first_of_1 + 1] == (1, 1), (held, order)
        assert order[first_of_1 + 2:] == [(0, s) for s in range(first_of_1, 6)], order
        _busy_ranks_and_gone(ranks, cfg, catalog, {0, 1}, 8)
    # Items of 0.8 s (another controller): rank 3's step 1 must reach the controller before
    # its step 0 is decoded to go before rank 2's step 2, and on a loaded machine two submits
    # one after the other took longer than a 0.15 s item.
    cfg = _cfg(dataset, pool_min=1, pool_max=1, sim_cost_s=0.16)
    with _Ranks(service.connect(cfg, 1, catalog.fingerprint), catalog,
                _items(cfg, catalog)) as ranks:
        ranks.join(2)
        ranks.wait_held(1)
        ranks.join(3)  # its grace (START_GRACE_S) runs from here, not from the pool's start
        outer = ranks.submit(2, range(4))
        time.sleep(0.5)  # less than service.START_GRACE_S
        outer |= ranks.submit(3, range(2))
        assert _completion_order(outer) == [(2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (2, 3)]
        _busy_ranks_and_gone(ranks, cfg, catalog, {2, 3}, 6)


def _busy_ranks_and_gone(ranks, cfg, catalog, busy: set[int], dispatched: int) -> None:
    """The controller counted busy time for exactly ``busy`` ranks and ``dispatched`` calls;
    once they leave, it ends."""
    deadline = time.monotonic() + 30  # the workers' busy time is read every control period
    while set((stats := ranks.stats())["rank_busy_s"]) != busy:
        assert time.monotonic() < deadline, stats["rank_busy_s"]
        time.sleep(0.2)
    assert stats["dispatched"] == dispatched
    for rank in sorted(busy):
        ranks.leave(rank)
    assert _gone(cfg, catalog)


def test_later_steps_wait_for_the_first_step_of_pipelines_still_to_come(ray_local, dataset):
    """A job of 2 pipelines (2 workers). Rank 0 submits steps 0-3, rank 1 joins 1 s later (it
    had not joined: no grace of a joined rank applies) and submits steps 0 and 1: rank 0's
    look-ahead waited for rank 1's first step instead of taking the workers (started 1 s
    late, rank 1's first step is not late by rank 0's look-ahead too). A job of 3 whose
    third never comes: the look-ahead waits at most START_WAIT_S after the first item."""

    from ray_ingest.execution import service

    catalog = load_catalog([dataset])
    for pipelines, cost in ((2, 0.03), (3, 0.031)):  # another cost: another controller
        cfg = _cfg(dataset, pool_min=1, pool_max=1, sim_cost_s=cost)  # 0.15 s per item
        with _Ranks(service.connect(cfg, pipelines, catalog.fingerprint), catalog,
                    _items(cfg, catalog)) as ranks:
            ranks.join(0)
            ranks.wait_held(pipelines)
            t0 = time.monotonic()
            outer = ranks.submit(0, range(4))
            time.sleep(1.0)
            # items handed to workers (one call running and one queued per worker at most):
            # rank 0's look-ahead waits for rank 1's first item, then goes with it
            alone = ranks.stats()["dispatched"]
            ranks.join(1)
            outer |= ranks.submit(1, [0])
            with_first = ranks.stats()["dispatched"]
            outer |= ranks.submit(1, [1])
            order = _completion_order(outer)
            waited = time.monotonic() - t0
            if pipelines == 2:
                # two calls a worker: rank 1's step 0 and rank 0's steps 1-3 at once
                assert (alone, with_first) == (1, 5) and order[0] == (0, 0), \
                    (alone, with_first, order)
                assert waited < service.START_WAIT_S, waited
            else:
                assert (alone, with_first) == (1, 2) and order[:2] == [(0, 0), (1, 0)], \
                    (alone, with_first, order)
                # the other 4 items (0.15-0.3 s on 3 workers) ran once START_WAIT_S was over
                assert service.START_WAIT_S <= waited < service.START_WAIT_S + 5.0, waited
            for rank in range(2):  # the controller ends by itself, its workers with it
                ranks.leave(rank)


def test_ranks_with_one_hook_callable_name_the_same_pool(dataset):
    """A hook given as a callable names the pool by its import path: every rank's process
    (where its repr holds a different address) joins one pool; another hook, another pool."""
    from ray_ingest.execution.service import service_name
    from tests.support import hooks

    base = _cfg(dataset, sim_cost_s=0.001).to_dict()

    def with_hook(fn):
        return config_from_dict({**base, "decode": {**base["decode"], "transform": fn}})

    # what another rank's process holds: the same function at another address
    other = types.FunctionType(hooks.draws.__code__, hooks.draws.__globals__, "draws")
    other.__qualname__ = hooks.draws.__qualname__
    assert repr(other) != repr(hooks.draws)
    names = {service_name(with_hook(fn), "fp", job="01") for fn in (hooks.draws, other)}
    assert len(names) == 1
    assert names != {service_name(with_hook(hooks.drop_odd), "fp", job="01")}


def _policy_controller(pipelines: int, workers: int):
    """A controller object in this process (no actor: :meth:`_lease` and :meth:`_view` are
    plain bookkeeping) with ``workers`` workers up, none started for real."""
    from ray_ingest.execution.service import DecodeService, _Worker

    svc = DecodeService(_cfg("/nowhere"), pipelines, "fp")
    for i in range(workers):
        svc.workers[f"w{i}"] = _Worker(handle=f"h{i}", wid=f"w{i}", ready_ref=None, up=True)
    return svc


def _leases(svc) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for w in svc.workers.values():
        if w.lease is not None and w.retired_at is None:
            out.setdefault(w.lease, []).append(w.wid)
    return out


def test_workers_are_leased_once_every_pipeline_can_have_one_and_leases_are_stable(ray_local):
    """Leases: none until every decoding rank joined, ``workers // ranks`` each after, the
    same workers kept while the share allows, none where the workers are fewer than the
    ranks (the shared queue, earliest step first, serves them), none for a client that does
    not take leases; a rank's view names its leased workers and their handles."""
    from ray_ingest.execution.service import _Rank

    svc = _policy_controller(pipelines=2, workers=5)
    svc.ranks["a"] = _Rank(0, {}, leases=True)
    svc._lease()
    assert _leases(svc) == {}  # rank 1 has not joined: the queue serves rank 0
    svc.ranks["b"] = _Rank(1, {}, leases=True)
    svc._lease()
    first = _leases(svc)
    assert sorted(len(v) for v in first.values()) == [2, 2] and set(first) == {"a", "b"}
    svc._lease()
    assert _leases(svc) == first  # stable
    view = svc._view("a")
    assert view["leases"] == first["a"] and view["workers"] == 5
    assert view["handles"] == {w: f"h{w[1:]}" for w in first["a"]}
    svc.ranks["a"].using = frozenset(first["a"][:1])  # its last report named one: the other
    assert svc._view("a")["handles"] == {first["a"][1]: f"h{first['a'][1][1:]}"}
    assert svc._view()["leases"] == [] and svc._view()["handles"] == {}
    svc.ranks["c"] = _Rank(2, {}, leases=False)  # a client without leases still counts
    svc._lease()
    now = _leases(svc)
    assert {k: len(v) for k, v in now.items()} == {"a": 1, "b": 1}
    assert set(now["a"]) <= set(first["a"]) and set(now["b"]) <= set(first["b"])
    svc.ranks["d"] = _Rank(3, {}, leases=True)
    svc.ranks["e"] = _Rank(4, {}, leases=True)
    svc.ranks["f"] = _Rank(5, {}, leases=True)
    svc._lease()
    assert _leases(svc) == {}  # 5 workers, 6 ranks: all shared
    for c in "cdef":
        del svc.ranks[c]
    svc._lease()
    assert sorted(len(v) for v in _leases(svc).values()) == [2, 2]


def test_a_retired_leased_worker_ends_only_once_its_rank_stops_naming_it(ray_local):
    """A leased worker retired by a shrink leaves its rank's view at once, but is killed only
    once a report its rank sent after the retirement no longer names it (its calls on it
    taken), or when the rank left: killing it earlier would fail calls the rank still holds.
    Leaving gives a rank's leases to the others."""
    from ray_ingest.execution.service import _Rank

    svc = _policy_controller(pipelines=1, workers=2)
    svc.ranks["a"] = _Rank(0, {}, leases=True)
    svc._lease()
    w = svc.workers["w0"]
    assert w.lease == "a" and svc.workers["w1"].lease == "a"
    w.retired_at = time.monotonic()
    svc._lease()
    assert svc._view("a")["leases"] == ["w1"] and w.lease == "a"
    r = svc.ranks["a"]
    r.using, r.using_t = frozenset({"w0", "w1"}), w.retired_at + 1  # still has calls on it
    assert not svc._drained(w)
    r.using, r.using_t = frozenset({"w1"}), w.retired_at - 1  # sent before the retirement
    assert not svc._drained(w)
    r.using_t = w.retired_at + 2
    assert svc._drained(w)
    r.using = frozenset({"w0", "w1"})
    del svc.ranks["a"]
    assert svc._drained(w)  # the rank left: its calls were cancelled
    svc.ranks["a"], svc.ranks["b"] = _Rank(0, {}, leases=True), _Rank(0, {}, leases=True)
    svc.workers.pop("w0")
    svc.workers["w2"] = type(w)(handle="h2", wid="w2", ready_ref=None, up=True)
    svc._lease()
    assert _leases(svc) == {"a": ["w1"], "b": ["w2"]}
    asyncio_run = __import__("asyncio").run
    asyncio_run(svc.leave("a"))
    assert _leases(svc) == {"b": ["w1", "w2"]}


def test_leased_calls_count_from_the_workers_stats_across_a_restart(ray_local):
    """A leased worker's calls reach the controller's accounts from its stats: the increase
    since the last read, and all of a restarted worker's (its new process counts from 0),
    even where the new process has counted past the old one by the next read."""
    svc = _policy_controller(pipelines=1, workers=1)
    w = svc.workers["w0"]
    for done, busy, process in ((3, {0: 0.3}, "p1"), (5, {0: 0.5, 1: 0.25}, "p1"),
                                (1, {1: 0.125}, "p2")):
        svc._count_leased(w, {"node": "n", "leased_done": done, "leased_busy": busy,
                              "process": process})
    assert (svc.completed, svc.leased_done) == (6, 6)
    assert w.by_rank == pytest.approx({0: 0.5, 1: 0.375}) and w.busy_s == pytest.approx(0.875)
    assert svc.rank_busy() == pytest.approx({0: 0.5, 1: 0.375})
    svc._count_leased(w, {"node": "n", "leased_done": 7, "leased_busy": {0: 0.75},
                          "process": "p3"})  # restarted again, and already past 1
    assert (svc.completed, svc.leased_done) == (13, 13)
    assert svc.rank_busy() == pytest.approx({0: 1.25, 1: 0.375})


def test_a_rank_alone_decodes_on_its_leased_workers_and_survives_losing_one(ray_local, dataset):
    """One decoding rank: once the controller has leased it the pool's two workers, it calls
    them itself (its items no longer pass through the controller), their busy time still
    reaches the controller's accounts, and a leased worker killed mid-stream costs a resubmit
    and no row: the rows are the in-process rows, in stream order."""
    import ray

    cfg, catalog, items, ex = _one_rank(dataset, sim_cost_s=0.03)  # 0.15 s per item
    try:
        it = ex.blocks()
        got = [next(it)]
        while len(ex._leases) < 2:
            got.append(next(it))
        victim = next(iter(ex._leases))
        assert any(c.wid == victim for c in ex._calls), "no call on the leased worker"
        ray.kill(ex._leases[victim], no_restart=True)
        got += list(it)
        svc = _service(cfg, catalog)
        deadline = time.monotonic() + 30  # leased calls are counted from the workers' stats
        while (stats := _ask(svc.stats.remote()))["leased_done"] < ex.leased - 2:
            assert time.monotonic() < deadline, (stats["leased_done"], ex.leased)
            time.sleep(0.2)
    finally:
        ex.close()
    assert _rows(got) == _rows(LocalExecution(cfg, catalog, items).blocks())
    assert ex.leased >= 4 and f"{ex.leased} on leased workers" in ex.stats()
    assert ex.resubmitted >= 1 and victim in ex._dead and victim not in ex._leases
    assert stats["dispatched"] + ex.leased >= len(items) and stats["lost"] == 1
    assert stats["dispatched"] < len(items)  # not round trips to the dead worker
    assert stats["rank_busy_s"][0] >= 0.1 * len(items)  # 0.15 s each
    assert _gone(cfg, catalog)


def test_a_job_of_one_pipeline_hosts_its_controller_in_the_ranks_process(ray_local, dataset):
    """No driver pre-started a pool and the job has one pipeline: its controller runs in the
    rank's process (no actor of its name), leases the rank its workers, ends with them
    LINGER_S after the rank left (its thread too), and the rank's next execution gets a new
    one; a pool the driver pre-started is joined instead (an actor)."""
    import ray
    from ray._private import state

    from ray_ingest.execution import hosted, service
    from ray_ingest.execution.jobpool import JobPoolExecution

    cfg, catalog, items, ex = _one_rank(dataset, sim_cost_s=0.02)

    def hosts() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "ray_ingest-controller"]

    try:
        got = list(ex.blocks())
        host = _service(cfg, catalog)
        assert isinstance(host, hosted.InProcessController) and hosts()
        with pytest.raises(ValueError):
            ray.get_actor(host.name)
        workers = {h._actor_id.hex() for h in _ask(host.worker_handles.remote())}
        stats = _ask(host.stats.remote())
    finally:
        ex.close()
    assert _rows(got) == _rows(LocalExecution(cfg, catalog, items).blocks())
    assert ex.leased > 0 and stats["started"] == 2 and stats["ranks"] == 1
    assert _gone(cfg, catalog) and _until(lambda: not hosts(), 10.0)
    assert _until(lambda: all(state.actors(w)["State"] == "DEAD" for w in workers))

    again = JobPoolExecution(cfg, catalog, items, rank=0, pipelines=1)  # a new controller
    try:
        assert _rows(list(again.blocks())) == _rows(got)
        assert _service(cfg, catalog) is not host
    finally:
        again.close()
    assert _gone(cfg, catalog)

    handle = service.prestart(cfg, 1, catalog.fingerprint)  # the driver's
    joined = JobPoolExecution(cfg, catalog, items, rank=0, pipelines=1)
    try:
        assert _rows(list(joined.blocks())) == _rows(got)
        assert _service(cfg, catalog)._actor_id == handle._actor_id
        assert _ask(handle.stats.remote())["ranks"] == 1
    finally:
        joined.close()
    assert _gone(cfg, catalog)
