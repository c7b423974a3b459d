"""Ending a Ray head started as a subprocess, with everything it started."""

from __future__ import annotations

import contextlib
import signal
import subprocess


def stop_tree(head: subprocess.Popen) -> None:
    """End ``head``'s process tree (its raylet, GCS, dashboard, workers, jobs), then reap
    ``head``: SIGTERM to ``head`` alone first (``ray start --block`` stops what it started in
    ~4 s when no job ran; SIGTERM to the whole tree at once left the GCS, the raylet and the
    head itself up until two 15 s timeouts ran out), then SIGTERM to whatever of the tree is
    left after 8 s, SIGKILL after 5 s more."""
    import psutil

    try:
        tree = psutil.Process(head.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        head.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(8)
    alive = [p for p in tree if p.is_running()]
    for p in [*alive, head]:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(alive, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    try:
        head.wait(5)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait(15)
