"""Shared fixtures: one real local Ray per session; GCS emulator fixtures live in fixtures_gcs."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

pytest_plugins = ("tests.fixtures_gcs",)


def pytest_collection_modifyitems(config, items):
    """Run `cluster` tests (own `ray start`/`ray stop`) before anything starts the session Ray:
    `ray stop` ends every Ray process on the machine."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("cluster") else 1)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session (logical CPUs > cores avoids Data/Train deadlocks)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # a private instance even when `ray start` runs on this machine
            num_cpus=8,
            include_dashboard=False,
            object_store_memory=768 * 1024**2,
            runtime_env={"env_vars": {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                                      "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}},
            log_to_driver=False,
        )
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.execution_options.verbose_progress = False
    yield ray
    ray.shutdown()
