"""Decode modes alternated in one process, CPU per process kind: what a mode's own processes
cost beside its decoding.

Why: ``bench/throughput.py`` and ``bench/fourk.py`` say how fast each mode is and how much CPU
each role took; this says where one mode's extra CPU against another goes, per Ray process
kind (``ray::DecodeService`` is the job pool's controller, ``ray::SharedDecodeWorker`` its
workers, ``ray::DecodeWorker`` the ``process`` companions), with the rank's execution line
(how many items went to leased workers). Each run starts a new pool (the controller ends 3 s
after its last rank, and the script waits 4 s). CPU of this process's descendants by kind,
read every 0.2 s (``bench/scale_out.py``'s ``ProcSampler``: a process that ends with the run
keeps its last reading, the sampler's own CPU is left out).

    .venv/bin/python bench/pool_ab.py --data /tmp/ray_ingest_bench_4k_3840x2160_128 \\
        --res 2048 --batch 4 --modes process,actors --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.scale_out import ProcSampler  # noqa: E402


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
    with ProcSampler(period_s=0.2) as sampler:
        for rnd in range(args.rounds):
            for mode in args.modes.split(","):
                sampler.mark(f"{rnd}{mode}0")
                t0, n = time.perf_counter(), 0
                for _, k in benchmark.run_ours(args.data, args.res, args.batch, 2,
                                               args.epochs, compute=mode):
                    n += k
                wall = time.perf_counter() - t0
                sampler.mark(f"{rnd}{mode}1")
                by = sampler.cpu_between(f"{rnd}{mode}0", f"{rnd}{mode}1")
                per = {k: round(v / n * 1000, 1) for k, v in sorted(by.items()) if v > 0.05}
                stats = (benchmark.LAST_LOADER[0].data_stats[-1:] or [""])[0].split("\n")[0]
                print(f"round {rnd} {mode:8s} {n / wall:7.1f} samples/s; CPU ms/sample {per}; "
                      f"{stats}", flush=True)
                time.sleep(4.0)  # past the controller's linger: the next run starts a new pool


if __name__ == "__main__":
    main()
