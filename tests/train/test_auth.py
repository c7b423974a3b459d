"""Token authentication for the Ray instances the project starts (ray_ingest.train.auth): a one-off
private token when none exists (never ~/.ray/auth_token), the user's token or opt-out kept."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from ray_ingest.train.auth import (
    MODE_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    secure_local_ray,
    token_source,
    write_token_file,
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def test_no_token_anywhere_gets_a_private_one_off_token(home):
    env: dict[str, str] = {}
    path = secure_local_ray(env)
    assert env[MODE_ENV] == "token" and env[TOKEN_PATH_ENV] == path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    from pathlib import Path

    token = Path(path).read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert not (home / ".ray").exists()  # never the user's default token file
    assert token_source(env) == path


def test_an_existing_token_is_used(home):
    env = {TOKEN_ENV: "abc"}
    assert secure_local_ray(env) is None and env[MODE_ENV] == "token"
    assert TOKEN_PATH_ENV not in env
    (home / ".ray").mkdir()
    write_token_file(home / ".ray" / "auth_token")
    env = {}
    assert secure_local_ray(env) is None
    assert env == {MODE_ENV: "token"} and token_source(env) == str(home / ".ray" / "auth_token")
    env = {TOKEN_PATH_ENV: str(home / "missing")}  # a path without a file is no token
    assert token_source(env) is None


def test_an_explicit_opt_out_is_respected_with_a_warning(home, caplog):
    env = {MODE_ENV: "disabled"}
    with caplog.at_level(logging.WARNING, logger="ray_ingest.train.auth"):
        assert secure_local_ray(env) is None
    assert env == {MODE_ENV: "disabled"}
    assert "without token authentication" in caplog.text


def test_a_token_file_is_never_overwritten(tmp_path):
    path = write_token_file(tmp_path / "t")
    with pytest.raises(FileExistsError):
        write_token_file(path)


def test_the_test_session_runs_with_token_auth():
    """conftest: every Ray this suite starts authenticates with a private session token."""
    if os.environ[MODE_ENV] == "disabled":
        pytest.skip("RAY_AUTH_MODE=disabled: the suite was run with authentication off")
    assert os.environ[MODE_ENV] == "token"
    assert token_source() == os.environ[TOKEN_PATH_ENV]
    assert not os.environ[TOKEN_PATH_ENV].startswith(os.path.expanduser("~"))


@pytest.mark.ray
def test_the_session_ray_refuses_a_driver_without_the_token(ray_local, tmp_path):
    import subprocess
    import sys

    if os.environ[MODE_ENV] != "token":
        pytest.skip("RAY_AUTH_MODE=disabled: the suite was run with authentication off")
    address = ray_local.get_runtime_context().gcs_address
    wrong = write_token_file(tmp_path / "wrong")
    env = {**os.environ, TOKEN_PATH_ENV: str(wrong)}
    probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}')"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode != 0
    assert "uthentication" in probe.stdout + probe.stderr, probe.stderr[-2000:]
