"""ray_ingest: twin-tar WebDataset ingest on Ray.

Pure layers (no Ray, no torch): :mod:`ray_ingest.catalog`, :mod:`ray_ingest.twintar.tario`,
:mod:`ray_ingest.twintar.twin`, :mod:`ray_ingest.plan`, and the loader's stages. Ray lives in
:mod:`ray_ingest.execution.datasource`, :mod:`ray_ingest.execution.raydata` (the loader's Ray edge,
opened by
:mod:`ray_ingest.execution.opener`), :mod:`ray_ingest.train` and :mod:`ray_ingest.datasets`.

``read_twin_tars`` and ``write_twin_tars`` (:mod:`ray_ingest.datasets`) are importable from
here; they load Ray on first use, so ``import ray_ingest`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["read_twin_tars", "write_twin_tars"]

_LAZY = {"read_twin_tars": "ray_ingest.datasets.read",
         "write_twin_tars": "ray_ingest.datasets.write"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_ingest' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
