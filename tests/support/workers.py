"""Figures counted in pytest-xdist workers, handed to the controller that prints the summary.

``make test`` runs the suite in workers (``-n``): a plugin's module-level tallies fill in the
worker that ran the test, while ``pytest_terminal_summary`` runs in the controller. A worker
sends its share at the end of its session (``workeroutput``, JSON) and the controller merges
each share when that worker goes down. Without xdist neither hook has anything to do.
"""

from __future__ import annotations

import json
from typing import Any


def send(config: Any, key: str, value: Any) -> None:
    """In a worker (``pytest_sessionfinish``): hand ``value`` to the controller."""
    out = getattr(config, "workeroutput", None)
    if out is not None:
        out[key] = json.dumps(value)


def received(node: Any, key: str) -> Any:
    """In the controller (``pytest_testnodedown``): what the worker sent, or None."""
    raw = getattr(node, "workeroutput", {}).get(key)
    return None if raw is None else json.loads(raw)
