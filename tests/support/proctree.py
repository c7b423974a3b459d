"""Ending a Ray head started as a subprocess, with everything it started."""

from __future__ import annotations

import contextlib
import signal
import subprocess


def stop_tree(head: subprocess.Popen) -> None:
    """SIGTERM ``head``'s process tree (its raylet, GCS, dashboard, workers, jobs), SIGKILL
    what is left after 15 s, then reap ``head``."""
    import psutil

    try:
        tree = psutil.Process(head.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [*tree, head]:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    try:
        head.wait(15)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait(15)
