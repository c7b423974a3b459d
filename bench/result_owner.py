"""CPU per decode call by who owns the result: the caller, or a controller that hands out refs.

Why: the job's decode pool (``ray_ingest/execution/service.py``) has the controller call the
worker and answer the rank with the result's reference, so the rank borrows an object the
controller owns; a rank's own pool calls the worker itself. This measures what that costs per
call, apart from any decoding: a worker returns a fresh array of ``--mb`` MB per call, four calls
in flight, and the CPU of every process on the machine (``/proc``) is divided by the calls.

* ``direct``: the caller calls the worker (it owns the result).
* ``grant``: the caller asks the controller first (a small reply), then calls the worker.
* ``controller``: the controller calls the worker and answers with ``[ref]`` (the job pool).

    .venv/bin/python bench/result_owner.py --mb 3 --calls 600 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ingest.tools.cpu_roles import read_proc  # noqa: E402


def cpu_seconds() -> float:
    """CPU seconds (user + system) of every process now running."""
    procs = (read_proc(int(pid), cmd=False) for pid in os.listdir("/proc") if pid.isdigit())
    return sum(p.cpu_s for p in procs if p is not None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=3, help="MB per result")
    p.add_argument("--calls", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the modes")
    args = p.parse_args()

    import numpy as np
    import ray

    @ray.remote(num_cpus=0.5)
    class Worker:
        def __init__(self, mb: int):
            self.buf = np.ones(mb * 1024 * 1024, np.uint8)

        async def decode(self, i: int) -> list[dict]:
            return [{"image": self.buf.copy(), "i": i}]

    @ray.remote(num_cpus=0)
    class Controller:
        def __init__(self, worker):
            self.worker = worker

        async def submit(self, i: int) -> list:
            return [self.worker.decode.remote(i)]

        async def grant(self, i: int) -> int:
            return 0

    ray.init(num_cpus=4, include_dashboard=False)
    worker = Worker.remote(args.mb)
    ctl = Controller.remote(worker)
    ray.get([worker.decode.remote(0), ctl.submit.remote(0), ctl.grant.remote(0)])

    def call(mode: str, i: int):
        if mode == "direct":
            return worker.decode.remote(i)
        if mode == "grant":
            ray.get(ctl.grant.remote(i))
            return worker.decode.remote(i)
        return ctl.submit.remote(i)

    def take(mode: str, ref) -> None:
        if mode == "controller":
            ref = ray.get(ref)[0]
        out = ray.get(ref)
        assert out[0]["image"].nbytes == args.mb * 1024 * 1024

    def run(mode: str) -> tuple[float, float]:
        q: collections.deque = collections.deque()
        t0, c0 = time.perf_counter(), cpu_seconds()
        for i in range(args.calls):
            q.append(call(mode, i))
            if len(q) >= 4:
                take(mode, q.popleft())
        while q:
            take(mode, q.popleft())
        return ((cpu_seconds() - c0) / args.calls * 1e3,
                (time.perf_counter() - t0) / args.calls * 1e3)

    for _ in range(args.rounds):
        for mode in ("direct", "grant", "controller"):
            cpu, wall = run(mode)
            print(f"{mode:10s} {args.mb} MB: CPU {cpu:.2f} ms/call, wall {wall:.2f} ms/call",
                  flush=True)


if __name__ == "__main__":
    main()
