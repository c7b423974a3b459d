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
    check_token_file,
    exposed_token_file,
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
    from tests.support.tokencluster import driver_probe

    if os.environ[MODE_ENV] != "token":
        pytest.skip("RAY_AUTH_MODE=disabled: the suite was run with authentication off")
    address = ray_local.get_runtime_context().gcs_address
    wrong = write_token_file(tmp_path / "wrong")
    probe = driver_probe(address, {**os.environ, TOKEN_PATH_ENV: str(wrong)}, timeout=300)
    assert probe.returncode != 0
    assert "uthentication" in probe.stdout + probe.stderr, probe.stderr[-2000:]


# --- a token file others can read: one warning line wherever a token is read ------------------


def _token_at(path, mode: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_token_file(path)
    os.chmod(path, mode)
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ray_ingest.train.auth" and r.levelno == logging.WARNING]


@pytest.mark.parametrize(("mode", "who"), [(0o644, "group and others"), (0o640, "group"),
                                           (0o604, "others"), (0o600, None), (0o400, None)])
def test_an_exposed_default_token_file_is_named_in_one_line(home, caplog, mode, who):
    path = _token_at(home / ".ray" / "auth_token", mode)
    env: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="ray_ingest.train.auth"):
        assert secure_local_ray(env) is None  # the user's token is used, never replaced
    got = _warnings(caplog)
    if who is None:
        assert got == [] and exposed_token_file(env) is None
        return
    assert len(got) == 1 and "\n" not in got[0], got
    assert got[0] == (f"{path}: the Ray auth token file is readable by {who} (mode {mode:04o}): "
                      f"other local users can take the token and run code on the cluster; make "
                      f"it private with `chmod 600 {path}` (docs/security.md)")
    assert stat.S_IMODE(os.stat(path).st_mode) == mode  # the operator's file is left alone


def test_the_token_path_variable_is_checked_and_a_token_variable_has_no_file(home, caplog,
                                                                            tmp_path):
    exposed = _token_at(tmp_path / "shared" / "token", 0o644)
    _token_at(home / ".ray" / "auth_token", 0o644)
    with caplog.at_level(logging.WARNING, logger="ray_ingest.train.auth"):
        assert check_token_file({TOKEN_PATH_ENV: str(exposed)}) == str(exposed)
        assert check_token_file({TOKEN_ENV: "abc"}) is None  # no file is read
        assert check_token_file({MODE_ENV: "disabled"}) is None  # no token is read
    assert len(_warnings(caplog)) == 1 and str(exposed) in _warnings(caplog)[0]


def test_a_job_joining_a_cluster_warns_before_it_connects(home, caplog, tmp_path, monkeypatch):
    """jobs/train.py with RAY_ADDRESS (ray job submit, a client): the token it will send."""
    from ray_ingest.train.job import main

    exposed = _token_at(tmp_path / "token", 0o644)
    monkeypatch.setenv(MODE_ENV, "token")
    monkeypatch.setenv(TOKEN_PATH_ENV, str(exposed))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with caplog.at_level(logging.WARNING, logger="ray_ingest.train.auth"):
        assert main(["--config", str(tmp_path / "missing.yaml")]) == 2  # stops before Ray
    assert len(_warnings(caplog)) == 1 and str(exposed) in _warnings(caplog)[0]


def test_cli_commands_that_start_ray_warn_first(home, caplog, tmp_path, monkeypatch):
    """``shard --ray`` / ``convert --ray`` (RayExecutor): checked before ``ray.init`` reads it."""
    import ray

    from ray_ingest.tools.tasks import RayExecutor

    exposed = _token_at(tmp_path / "token", 0o664)
    monkeypatch.setenv(MODE_ENV, "token")
    monkeypatch.setenv(TOKEN_PATH_ENV, str(exposed))
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    class Started(Exception):
        pass

    def init(*args, **kwargs):
        raise Started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with caplog.at_level(logging.WARNING, logger="ray_ingest.train.auth"), \
            pytest.raises(Started):
        RayExecutor(num_cpus=0.25).map(str, [1])
    assert len(_warnings(caplog)) == 1 and "group and others (mode 0664)" in _warnings(caplog)[0]
