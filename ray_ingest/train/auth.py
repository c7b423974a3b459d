"""Token authentication for the Ray instances this project starts (Ray's ``RAY_AUTH_MODE=token``).

Without it, anyone who can reach a Ray port (GCS, dashboard, job API) can run code on every
node. Every Ray process and client finds the cluster's token in, by priority,
``RAY_AUTH_TOKEN`` (the token), ``RAY_AUTH_TOKEN_PATH`` (a file) or ``~/.ray/auth_token``.

Ray 2.60 turns token mode on by itself for a new local instance when ``RAY_AUTH_MODE`` is not
set, and then *writes a new token to* ``~/.ray/auth_token`` when it finds none. This project
never leaves a token behind without saying so: :func:`secure_local_ray`, called before an
embedded ``ray.init(address="local")`` (``make demo``, ``jobs/train.py`` without
``RAY_ADDRESS``, the benchmarks), sets ``RAY_AUTH_MODE=token`` and, when there is no token
anywhere, writes a one-off token to a private temporary file (mode 0600 in a 0700 folder)
named by ``RAY_AUTH_TOKEN_PATH``, removed when the process exits. A ``RAY_AUTH_MODE`` the user
set (``disabled``) is respected, with a warning. docs/security.md has the whole trust model.

Wherever the project reads a token — an embedded Ray (:func:`secure_local_ray`), a job or a CLI
command joining a cluster (:func:`check_token_file`) — a token *file* that group or others may
read is named in one warning line: ``ray get-auth-token --generate`` writes ``~/.ray/auth_token``
with the process's umask (mode 0644 under the usual 022), and whoever reads the token can run
code on every node of the cluster.

No Ray import (Ray's cached settings are refreshed only when Ray is already imported).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["MODE_ENV", "TOKEN_ENV", "TOKEN_PATH_ENV", "check_token_file", "default_token_path",
           "exposed_token_file", "secure_local_ray", "token_source", "write_token_file"]

log = logging.getLogger(__name__)

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def default_token_path() -> Path:
    """Where Ray looks last: ``~/.ray/auth_token`` (what ``ray get-auth-token --generate``
    writes)."""
    return Path.home() / ".ray" / "auth_token"


def token_source(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Where this process's Ray would take its token from (the variable's name or the file's
    path), or None when there is none."""
    env = os.environ if environ is None else environ
    if env.get(TOKEN_ENV):
        return TOKEN_ENV
    path = env.get(TOKEN_PATH_ENV)
    if path:
        return path if os.path.isfile(path) else None
    default = default_token_path()
    return str(default) if default.is_file() else None


def exposed_token_file(environ: MutableMapping[str, str] | None = None
                       ) -> tuple[str, int] | None:
    """``(path, mode)`` of the token file this process's Ray reads when group or others may
    read it; None when it is private, when the token comes from ``RAY_AUTH_TOKEN`` (no file),
    when there is no token file, or when token authentication is off."""
    env = os.environ if environ is None else environ
    mode = env.get(MODE_ENV)
    if mode is not None and mode.lower() != "token":
        return None
    source = token_source(env)
    if source is None or source == TOKEN_ENV:
        return None
    try:
        bits = stat.S_IMODE(os.stat(source).st_mode)
    except OSError:
        return None
    return (source, bits) if bits & (stat.S_IRGRP | stat.S_IROTH) else None


def check_token_file(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Warn in one line when the token file in use is readable by group or others; returns
    its path then (None otherwise). Never changes the file: it is the operator's."""
    exposed = exposed_token_file(environ)
    if exposed is None:
        return None
    path, bits = exposed
    who = " and ".join(w for w, bit in (("group", stat.S_IRGRP), ("others", stat.S_IROTH))
                       if bits & bit)
    log.warning("%s: the Ray auth token file is readable by %s (mode %04o): other local users "
                "can take the token and run code on the cluster; make it private with "
                "`chmod 600 %s` (docs/security.md)", path, who, bits, path)
    return path


def write_token_file(path: str | os.PathLike) -> Path:
    """A new random token (256 bits, hex, as Ray makes them) in a new file only this user can
    read; an existing file is never overwritten."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def secure_local_ray(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Prepare this process to start a private local Ray with token authentication on.

    Returns the path of the one-off token file it wrote, or None when a token was already
    available (or the user turned authentication off with ``RAY_AUTH_MODE``).
    """
    env = os.environ if environ is None else environ
    mode = env.get(MODE_ENV)
    if mode is not None and mode.lower() != "token":
        log.warning("%s=%s: this Ray starts without token authentication; anyone who can reach "
                    "its ports can run code in it (docs/security.md)", MODE_ENV, mode)
        return None
    env[MODE_ENV] = "token"
    written = None
    check_token_file(env)
    if token_source(env) is None:
        folder = tempfile.mkdtemp(prefix="ray_ingest_auth_")  # 0700
        written = str(write_token_file(os.path.join(folder, "auth_token")))
        env[TOKEN_PATH_ENV] = written
        atexit.register(shutil.rmtree, folder, True)
        log.info("token authentication on: a one-off token for this local Ray in %s "
                 "(removed at exit)", written)
    if env is os.environ:
        _refresh_ray()
    return written


def _refresh_ray() -> None:
    """A Ray imported before the environment changed cached the old mode and token source."""
    ray = sys.modules.get("ray")
    if ray is None or (hasattr(ray, "is_initialized") and ray.is_initialized()):
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # another Ray version: it reads the environment when it starts
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
