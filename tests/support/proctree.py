"""Ending a Ray head started as a subprocess, with everything it started."""

from __future__ import annotations

import contextlib
import subprocess


def stop_tree(head: subprocess.Popen) -> None:
    """End ``head``'s process tree (its raylet, GCS, dashboard, workers, jobs) at once, then
    reap it: SIGKILL to ``head`` and to every process under it.

    The tests that start such a head have read all they check from it before they stop it,
    and its session folder is theirs alone, so nothing needs a graceful stop. A graceful one
    cost most of a test's teardown: SIGTERM to ``ray start --block`` took ~4 s when no job had
    run and did not finish in 8 s after one had (13.8 s with the fallback SIGTERM to the
    tree), and SIGTERM to the whole tree at once left the GCS, the raylet and the head up
    until two 15 s timeouts ran out."""
    import psutil

    try:
        tree = psutil.Process(head.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        head.kill()
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(tree, timeout=15)
    head.wait(15)
