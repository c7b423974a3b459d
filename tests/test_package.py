"""Package hygiene: no module of ray_ingest shadows a standard-library module.

A module named like one of the standard library's (``inspect``, ``io``, ``types`` …) is imported
*instead of* it whenever ``ray_ingest/`` itself is on ``sys.path`` — running a script from that
folder, a debugger, some test runners — and breaks unrelated imports (``dataclasses`` imports
``inspect``). ``ray_ingest/inspect.py`` was renamed ``summary.py`` for that reason (issue 14).
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ray_ingest"


def test_no_module_shadows_the_standard_library():
    clashes = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*")
        if (p.suffix == ".py" and p.stem != "__init__" and p.stem in sys.stdlib_module_names)
        or (p.is_dir() and (p / "__init__.py").exists() and p.name in sys.stdlib_module_names)
    )
    assert not clashes, f"modules named like standard-library modules: {clashes}"


def test_summary_module_replaces_inspect():
    from ray_ingest.tools import summary

    assert callable(summary.summarize) and callable(summary.iter_records)
    assert not (PACKAGE / "inspect.py").exists()
