"""A token-authenticated Ray head on 127.0.0.1 for tests, as ``cluster.yaml`` starts one.

``ray start --head --block`` runs as a child process with ``RAY_AUTH_MODE=token`` and the
token file the test gives (``RAY_AUTH_TOKEN_PATH``), the dashboard bound to 127.0.0.1, every
port it listens on chosen free, and its own temp folder (its session logs stay there, for the
test to search). :meth:`TokenHead.stop` ends only that process tree, by pid: never
``ray stop``, which would end every Ray on the machine (other people's too).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.proctree import stop_tree

RAY_BIN = os.path.join(os.path.dirname(sys.executable), "ray")
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    """This environment without any Ray address or token, the venv's ``bin`` first on PATH
    (the job's ``python`` must be the venv's)."""
    env = {k: v for k, v in os.environ.items() if k not in (*_AUTH_VARS, "RAY_ADDRESS")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def token_env(token_path: str | os.PathLike) -> dict[str, str]:
    """A client (or node) that holds the cluster's token."""
    return {**base_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def driver_probe(address: str, env: dict[str, str], timeout: float = 180) \
        -> subprocess.CompletedProcess:
    """``ray.init(address=...)`` in a new process with ``env``, trying twice: a refused
    driver retries once a second for ~20 s by default, and is refused alike each time."""
    return subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='{address}')"],
        env={**env, "RAY_gcs_server_port_wait_time_s": "2"}, capture_output=True, text=True,
        timeout=timeout)


def anonymous_env(home: str | os.PathLike) -> dict[str, str]:
    """A client without any token: no variable, and a HOME without ``~/.ray/auth_token``."""
    return {**base_env(), "RAY_AUTH_MODE": "disabled", "HOME": str(home)}


class TokenHead:
    """``ray start --head --block`` with token authentication; ``address`` (GCS) and
    ``dashboard`` (the job API, ``http://127.0.0.1:PORT``)."""

    def __init__(self, token_path: str | os.PathLike, num_cpus: int = 6):
        self.env = token_env(token_path)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_port = free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        # short: unix socket paths under it must stay below 108 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="ritk-", dir="/tmp")
        self.log_path = os.path.join(self.temp_dir, "head.log")
        ports = {"--ray-client-server-port": free_port(),
                 "--dashboard-agent-listen-port": free_port(),
                 "--dashboard-agent-grpc-port": free_port(),
                 "--runtime-env-agent-port": free_port(),
                 "--metrics-export-port": free_port()}
        with open(self.log_path, "w") as log:
            self.head = subprocess.Popen(
                [RAY_BIN, "start", "--head", "--block", f"--port={self.port}",
                 "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                 "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                 f"--dashboard-port={self.dashboard_port}", f"--temp-dir={self.temp_dir}",
                 "--disable-usage-stats", *(f"{k}={v}" for k, v in ports.items())],
                env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def ray(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
            check: bool = False) -> subprocess.CompletedProcess:
        """The ``ray`` CLI against this head (``env``: whose credentials; default the token's)."""
        return subprocess.run([RAY_BIN, *args], env=env or self.env, capture_output=True,
                              text=True, timeout=timeout, check=check)

    def wait_for_jobs(self, timeout: float = 120) -> None:
        """Until the job API answers an authenticated client (it starts after ``ray start``)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.head.poll() is not None:
                raise RuntimeError(f"ray start exited: {Path(self.log_path).read_text()[-3000:]}")
            probe = self.ray(["job", "list", "--address", self.dashboard], timeout=60)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"job API not up: {probe.stdout[-2000:]}{probe.stderr[-2000:]}")
            time.sleep(2)

    def stop(self) -> None:
        """End this head's process tree only (its raylet, GCS, dashboard, workers, job)."""
        stop_tree(self.head)

    def remove(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def files_holding(secret: str, roots: list[str | os.PathLike],
                  exclude: tuple[str | os.PathLike, ...] = ()) -> list[str]:
    """Every regular file under ``roots`` whose bytes hold ``secret`` (as UTF-8), but
    ``exclude``: the files where the test itself wrote it."""
    import stat

    needle = secret.encode()
    skip = {os.path.realpath(p) for p in exclude}
    hits = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    if not stat.S_ISREG(os.lstat(path).st_mode) or os.path.realpath(path) in skip:
                        continue
                    with open(path, "rb") as f:
                        if needle in f.read():
                            hits.append(path)
                except OSError:
                    continue  # removed meanwhile (Ray's files come and go)
    return hits
