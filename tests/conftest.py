"""Shared fixtures: one real local Ray per pytest session (``make test`` runs two sessions at
once, pytest-xdist workers, each with its own); GCS emulator fixtures live in fixtures_gcs."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

from ray_ingest.train.auth import write_token_file

# Token authentication on, as users run it (docs/security.md): one token for every Ray this
# session starts (the session Ray, `ray start` heads, jobs/train.py subprocesses), in a private
# temporary file, never the user's ~/.ray/auth_token. RAY_AUTH_MODE=disabled opts out.
_TOKEN_DIR = tempfile.mkdtemp(prefix="ray_ingest_test_auth_")
atexit.register(shutil.rmtree, _TOKEN_DIR, True)
os.environ.pop("RAY_AUTH_TOKEN", None)
os.environ["RAY_AUTH_TOKEN_PATH"] = str(write_token_file(os.path.join(_TOKEN_DIR, "auth_token")))
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Ray Train's controller sees its workers finish (and fail) at its next poll, every 2 s by
# default: ~4 s at the end of every TorchTrainer run (the demo's last step to its result line:
# 5.9 s, 1.9 s at 0.5 s). The session Ray, `ray start` heads and the jobs' own Rays inherit it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray exports metrics every 10 s by default; the tests that scrape them waited for it (the
# metrics test 10.2 s, 3.8 s at 2 s).
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")

pytest_plugins = ("tests.support.fixtures_gcs", "tests.support.fuzz")


def _order(item) -> int:
    if item.get_closest_marker("cluster"):
        return 0
    return 1 if item.get_closest_marker("multinode") else 2


def pytest_collection_modifyitems(config, items):
    """Run `cluster` tests (own `ray start` heads, each ended by its process tree, never
    `ray stop`) before anything starts the session Ray. Then `multinode` tests, whose driver is
    this process connected to a private multi-node cluster (one ray.init per process), so that
    they normally never meet the session Ray (tests/execution/test_multinode.py restores it
    otherwise). Under pytest-xdist (``--dist loadfile``) every worker sorts alike and is handed
    whole files in this order, so these long files start first."""
    items.sort(key=_order)


def init_local_ray():
    """The session's local Ray (logical CPUs > cores avoids Data/Train deadlocks)."""
    import ray

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


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session."""
    import ray

    if not ray.is_initialized():
        init_local_ray()
    yield ray
    ray.shutdown()
