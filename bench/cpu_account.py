"""CPU seconds per process while a command runs: ``python bench/cpu_account.py CMD ...``.

Where a contender's cores go (docs/benchmarks.md): samples every process's utime/stime from
/proc once a second and prints, per process group (command line up to its first ``--``), the
CPU used between the command's start and its end, then the machine's user/nice/sys/idle totals.
Ray workers run at nice 15, so their user time is counted as "nice" in the machine totals.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def snapshot() -> dict[int, tuple[str, float, float]]:
    """pid -> (command line, user CPU-s, system CPU-s) of every readable process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:60]
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        name = cmd or stat[stat.find("(") + 1:stat.rfind(")")]
        out[int(pid)] = (name, int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def machine() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main(argv: list[str]) -> int:
    before, cpu0, wall0 = snapshot(), machine(), time.time()
    proc = subprocess.Popen(argv)
    last = dict(before)
    while proc.poll() is None:
        time.sleep(1.0)
        last.update(snapshot())  # a process's last sample before it exited
    cpu1, wall1 = machine(), time.time()
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for pid, (cmd, user, system) in last.items():
        u0, s0 = before[pid][1:] if pid in before else (0.0, 0.0)  # no pid reuse in one run
        if user - u0 + system - s0 >= 0.05:
            g = groups[cmd.split(" --")[0][:45]]
            g[0] += user - u0
            g[1] += system - s0
    for name, (user, system) in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"{user:8.2f} user {system:6.2f} sys  {name}", file=sys.stderr)
    d = [(b - a) / TICK for a, b in zip(cpu0, cpu1, strict=True)]
    print(f"wall {wall1 - wall0:.1f} s; machine CPU-s: user {d[0]:.1f} nice {d[1]:.1f} "
          f"sys {d[2]:.1f} idle {d[3]:.1f}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
