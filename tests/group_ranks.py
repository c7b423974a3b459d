"""Ranks of parallel groups for the group-share tests, without Ray Train.

``run_ranks`` runs one process per rank (spawned), joined in a real ``torch.distributed`` gloo
world, each with an :class:`~ray_ingest.loader.ingest.IngestLoader` whose read and decode stages run
in the process (ray_ingest/execution/local.py) and whose group share is the real
:func:`~ray_ingest.loader.group.dist_channel`. ``ThreadChannel`` is an in-process channel for the
stage tests that need no processes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any

from ray_ingest.loader.group import BATCH


class ThreadChannel:
    """The leader's messages queued for each follower (in one process, in order)."""

    def __init__(self, queues: list[queue.Queue], index: int, name: str = "group 0"):
        self.queues, self.index, self.name = queues, index, name
        self.leader = index == 0

    @classmethod
    def group(cls, size: int, name: str = "group 0") -> list[ThreadChannel]:
        queues: list[queue.Queue] = [queue.Queue() for _ in range(size)]
        return [cls(queues, i, name) for i in range(size)]

    def send(self, kind: int, header: dict[str, Any], tensors) -> None:
        # through JSON, as on the wire: a follower must not share the leader's objects
        raw = json.dumps(header)
        for q in self.queues[1:]:
            q.put((kind, json.loads(raw), [t.clone() for t in tensors] if kind == BATCH else []))

    def recv(self, timeout: float = 60.0):
        return self.queues[self.index].get(timeout=timeout)


def _rank_main(rank: int, world: int, job: dict[str, Any]) -> None:
    out = os.path.join(job["out"], f"rank_{rank}.json")
    try:
        import torch.distributed as dist

        from ray_ingest.catalog.load import load_catalog
        from ray_ingest.config import config_from_dict
        from ray_ingest.execution.local import LocalExecution
        from ray_ingest.loader.group import (
            GroupShare,
            dist_channel,
        )
        from ray_ingest.loader.ingest import IngestLoader
        from ray_ingest.plan.state import ReadState
        from ray_ingest.plan.topology import Topology
        from tests.test_stream_goldens import _record

        dist.init_process_group("gloo", init_method=f"file://{job['out']}/pg", rank=rank,
                                world_size=world)
        cfg = config_from_dict(job["cfg"])
        catalog = load_catalog(list(cfg.data.paths))
        topo = Topology(world, rank, cfg.loader.read_workers, 0, job["group"])
        share = None
        if job["share"]:
            share = GroupShare(dist_channel(topo, None, job.get("timeout_s")))
        state = ReadState.from_dict(job["state"]) if job.get("state") else None
        opened = []

        def opener(items):
            opened.append(len(items))
            return LocalExecution(cfg, catalog, items)

        loader = IngestLoader(cfg, topo, catalog=catalog, state=state, open_execution=opener,
                              share=share)
        records: list[Any] = []
        error = None
        fail = job.get("fail") or {}
        try:
            for epoch, batches in loader.epochs(job["epochs"]):
                for b in batches:
                    records.append(_record(epoch, b))
                    if rank == fail.get("rank") and len(records) == fail["after"]:
                        if fail["how"] == "exit":
                            os._exit(3)  # the leader process dies without a word
                        time.sleep(fail["sleep_s"])  # the leader hangs
                    if job.get("stop_after") and len(records) == job["stop_after"]:
                        batches.close()
                        raise StopIteration
        except StopIteration:
            pass
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if job.get("ckpt"):
            loader.save(job["ckpt"])
        result = {"records": records, "state": loader.state.to_dict(), "error": error,
                  "executions": opened, "clock": loader.clock.to_dict(),
                  "skips_by_kind": loader.skips_by_kind}
    except BaseException:
        result = {"crash": traceback.format_exc()}
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    # no destroy_process_group: a follower of a dead leader must not block on a barrier


def run_ranks(tmp: str, world: int, job: dict[str, Any], timeout: float = 240.0
              ) -> dict[int, dict[str, Any]]:
    """Run every rank of the job in its own process; each rank's result (None: it died)."""
    os.makedirs(tmp, exist_ok=True)
    job = {**job, "out": tmp}
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, job)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results: dict[int, dict[str, Any]] = {}
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"rank {r} still running after {timeout} s (a hang)")
        path = os.path.join(tmp, f"rank_{r}.json")
        results[r] = None
        if os.path.exists(path):
            with open(path) as f:
                results[r] = json.load(f)
        if results[r] is not None and "crash" in results[r]:
            raise AssertionError(f"rank {r} crashed:\n{results[r]['crash']}")
    return results
