"""Topology validation, detection from env / a Ray Train context, PiD resume variables."""

from __future__ import annotations

import subprocess
import sys
import types

import attrs
import pytest

from ray_ingest.errors import ConfigError
from ray_ingest.plan import Topology
from ray_ingest.train.detect import detect_topology, pid_env_start


def test_topology_derived_fields():
    t = Topology(world_size=8, rank=5, num_workers=4, worker_id=3, group_size=2)
    assert (t.slot, t.slots) == (2, 4)
    assert Topology(4).to_dict() == {"world_size": 4, "rank": 0, "num_workers": 1,
                                     "worker_id": 0, "group_size": 1}
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        t.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, r"Topology.world_size: expected >= 1, got 0"),
        ({"world_size": 4, "rank": 4},
         r"Topology.rank: expected 0 <= rank < world_size \(4\), got 4"),
        ({"world_size": 4, "rank": -1}, r"Topology.rank: .* got -1"),
        ({"world_size": 4, "num_workers": 0}, r"Topology.num_workers: expected >= 1, got 0"),
        ({"world_size": 4, "num_workers": 2, "worker_id": 2},
         r"Topology.worker_id: expected 0 <= worker_id < num_workers \(2\), got 2"),
        ({"world_size": 4, "group_size": 0}, r"Topology.group_size: expected >= 1, got 0"),
        ({"world_size": 6, "group_size": 4},
         r"Topology.group_size: expected a divisor of world_size \(6\), got 4"),
        ({"world_size": True}, r"Topology.world_size: expected an int, got True"),
        ({"world_size": 2.0}, r"Topology.world_size: expected an int, got 2.0"),
    ],
)
def test_topology_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Topology(**kwargs)


def test_detect_defaults_without_env():
    assert detect_topology(environ={}) == Topology(1)
    assert detect_topology(num_workers=4, group_size=1, environ={}) == Topology(1, 0, 4, 0, 1)


def test_detect_from_env():
    env = {"RANK": "5", "WORLD_SIZE": "8", "WORKER": "1", "NUM_WORKERS": "3", "GROUP_SIZE": "2"}
    assert detect_topology(environ=env) == Topology(8, 5, 3, 1, 2)
    # Explicit arguments win over the environment.
    assert detect_topology(num_workers=2, group_size=4, environ=env) == Topology(8, 5, 2, 0, 4)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"env RANK: expected an int, got 'x'"),
        ({"WORKER": "0"}, "NUM_WORKERS"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "Topology.rank"),
        ({"GROUP_SIZE": "two"}, "GROUP_SIZE"),
    ],
)
def test_detect_rejects_bad_env(env, message):
    with pytest.raises(ConfigError, match=message):
        detect_topology(environ=env)


def test_detect_prefers_active_ray_train_context(monkeypatch):
    ctx = types.SimpleNamespace(get_world_rank=lambda: 3, get_world_size=lambda: 4)
    train = types.ModuleType("ray.train")
    train.get_context = lambda: ctx
    ray = types.ModuleType("ray")
    ray.train = train
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.train", train)
    env = {"RANK": "0", "WORLD_SIZE": "1"}
    assert detect_topology(num_workers=2, group_size=2, environ=env) == Topology(4, 3, 2, 0, 2)


def test_detect_falls_back_when_ray_train_has_no_context(monkeypatch):
    def no_context():
        raise RuntimeError("get_context cannot be used outside of a Ray Train function")

    train = types.ModuleType("ray.train")
    train.get_context = no_context
    ray = types.ModuleType("ray")
    ray.train = train
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.train", train)
    assert detect_topology(environ={"RANK": "1", "WORLD_SIZE": "2"}) == Topology(2, 1)


def test_pid_env_start():
    assert pid_env_start({}) == (0, 0)
    assert pid_env_start({"WDS_START_INDEX": "4096", "WDS_EPOCH_NUM": "2"}) == (4096, 2)
    with pytest.raises(ConfigError, match="WDS_START_INDEX"):
        pid_env_start({"WDS_START_INDEX": "-1"})
    with pytest.raises(ConfigError, match="WDS_EPOCH_NUM"):
        pid_env_start({"WDS_EPOCH_NUM": "soon"})


def test_planning_imports_neither_ray_nor_torch():
    code = (
        "import sys, ray_ingest.plan, ray_ingest.cli.plan, ray_ingest.train.detect\n"
        "ray_ingest.train.detect.detect_topology(environ={})\n"
        "bad = sorted(m for m in ('ray', 'torch') if m in sys.modules)\n"
        "sys.exit(str(bad) if bad else 0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
