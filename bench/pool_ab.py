"""Decode modes alternated in one process, CPU per process kind: what a mode's own processes
cost beside its decoding.

Why: ``bench/throughput.py`` and ``bench/fourk.py`` say how fast each mode is and how much CPU
each role took; this says where one mode's extra CPU against another goes, per Ray process
kind (``ray::DecodeService`` is the job pool's controller, ``ray::SharedDecodeWorker`` its
workers, ``ray::DecodeWorker`` the ``process`` companions), with the rank's execution line
(how many items went to leased workers). Each run starts a new pool (the controller ends 3 s
after its last rank, and the script waits 4 s). CPU from ``/proc`` before and after each run,
per process, by its Ray title (the method running at the time is cut off), read every 0.2 s
while it runs (a process that ends with the run keeps its last reading).

    .venv/bin/python bench/pool_ab.py --data /tmp/ray_ingest_bench_4k_3840x2160_128 \\
        --res 2048 --batch 4 --modes process,actors --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ray_ingest.tools.cpu_roles import read_proc  # noqa: E402


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds) of this process and every Ray worker process now."""
    out = {}
    me = os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        p = read_proc(int(pid))
        if p is None or (p.pid != me and not p.cmd.startswith("ray::")):
            continue
        kind = "this process" if p.pid == me else p.cmd.split()[0].split(".")[0]
        out[p.pid] = (kind, p.cpu_s)
    return out


class LastSeen:
    """:func:`cpu_by_process` every ``period_s`` in a thread, each process's last reading kept:
    a ``process`` companion ends with its run, before a reading after the run could see it
    (it loses at most ``period_s`` of its CPU)."""

    def __init__(self, period_s: float = 0.2):
        self.period_s = period_s
        self.seen: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LastSeen:
        self.seen = cpu_by_process()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.seen.update(cpu_by_process())

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.seen.update(cpu_by_process())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a dataset bench/fourk.py or throughput.py made")
    p.add_argument("--res", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--modes", default="process,actors", help="decode.compute values, alternated")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    import ray

    from ray_ingest.tools import benchmark

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    for rnd in range(args.rounds):
        for mode in args.modes.split(","):
            with LastSeen() as seen:
                before, t0, n = dict(seen.seen), time.perf_counter(), 0
                for _, k in benchmark.run_ours(args.data, args.res, args.batch, 2,
                                               args.epochs, compute=mode):
                    n += k
                wall = time.perf_counter() - t0
            by: dict[str, float] = {}
            for pid, (kind, cpu) in seen.seen.items():
                old = before.get(pid)
                by[kind] = by.get(kind, 0.0) + cpu - (old[1] if old else 0.0)
            per = {k: round(v / n * 1000, 1) for k, v in sorted(by.items()) if v > 0.05}
            stats = (benchmark.LAST_LOADER[0].data_stats[-1:] or [""])[0].split("\n")[0]
            print(f"round {rnd} {mode:8s} {n / wall:7.1f} samples/s; CPU ms/sample {per}; "
                  f"{stats}", flush=True)
            time.sleep(4.0)  # past the controller's linger: the next run starts a new pool


if __name__ == "__main__":
    main()
