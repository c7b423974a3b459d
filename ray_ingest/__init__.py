"""ray_ingest: twin-tar WebDataset ingest on Ray.

Packages follow the data flow: ``twintar`` (tars on storage) -> ``catalog`` (which shards) ->
``plan`` (which rank reads what) -> ``decode`` -> ``execution`` (threads of the rank's process,
the rank's own Ray decode actors, tasks or companion actor, or Ray Data) -> ``loader`` (the
per-rank :class:`IngestLoader`) -> ``train`` (the TorchTrainer job); ``datasets`` holds
``read_twin_tars``/``write_twin_tars``, ``tools`` the offline commands, ``cli`` the
``ray-ingest`` entry point. Ray is imported only by ``execution.pool``, ``execution.raydata``,
``datasets``, ``train`` and where a tool runs on Ray.

``read_twin_tars``, ``write_twin_tars`` and ``IngestLoader`` are importable from here; they load
on first use, so ``import ray_ingest`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"
__all__ = ["IngestLoader", "read_twin_tars", "write_twin_tars"]

_LAZY = {"IngestLoader": "ray_ingest.loader.ingest",
         "read_twin_tars": "ray_ingest.datasets.read",
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
