"""cluster.yaml: a valid Ray cluster-launcher config (Ray's own prepare_config +
validate_config, what `ray up` runs first), secure by default: token authentication on every
node with the token copied to each, the dashboard on the head's loopback only."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


def _config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _env_of(command: str) -> dict[str, str]:
    """Variables a start command exports before `ray start`."""
    env = {}
    for part in command.split(";"):
        words = shlex.split(part)
        if words and words[0] == "export":
            env.update(w.split("=", 1) for w in words[1:])
    return env


def test_ray_up_validates_the_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_config()))


def test_dashboard_is_bound_to_loopback_only():
    text = CLUSTER_YAML.read_text()
    assert "0.0.0.0" not in text
    (start,) = [c for c in _config()["head_start_ray_commands"] if "ray start" in c]
    assert re.search(r"--dashboard-host=127\.0\.0\.1(\s|$)", start), start


def test_every_node_starts_with_token_auth_and_gets_the_token():
    cfg = _config()
    assert "disabled" not in CLUSTER_YAML.read_text()
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in cfg[key] if "ray start" in c]
    assert len(starts) == 2
    paths = set()
    for command in starts:
        env = _env_of(command)
        assert env.get("RAY_AUTH_MODE") == "token", command
        paths.add(env["RAY_AUTH_TOKEN_PATH"])
    (token_path,) = paths
    # the token file the operator provides is copied to that path on every node
    assert token_path in cfg["file_mounts"], cfg["file_mounts"]
    assert cfg["file_mounts"][token_path].endswith("auth_token")
    assert any("chmod 600" in c and "auth_token" in c for c in cfg["setup_commands"])


def test_the_operator_steps_make_the_token_file_private():
    """``ray get-auth-token --generate`` alone leaves ~/.ray/auth_token mode 0644: every
    place that tells the operator to make the token also makes it 0600 (umask or chmod)."""
    repo = CLUSTER_YAML.parent
    header = "\n".join(ln for ln in CLUSTER_YAML.read_text().splitlines() if ln.startswith("#"))
    texts = {"cluster.yaml": header,
             **{p: (repo / p).read_text() for p in ("README.md", "docs/operations.md",
                                                     "docs/security.md")}}
    for name, text in texts.items():
        for line in text.splitlines():
            if "get-auth-token --generate" in line and "leaves it" not in line:
                assert "umask" in line, (name, line)
        assert "chmod 600 ~/.ray/auth_token" in text or name == "README.md", name
