"""GCS emulator and fault-injecting proxy fixtures (a pytest plugin, registered in conftest).

- ``gcs_server`` (session): an in-process ``gcp-storage-emulator`` on 127.0.0.1 with the bucket
  ``test-bucket``; sets ``STORAGE_EMULATOR_HOST`` while it runs.
- ``fault_proxy`` (function): a :class:`tests.support.faultproxy.FaultProxy` in front of the
emulator,
  with its own gcsfs storage options. While it is active gcsfs's own retries are switched off,
  so every injected fault reaches :mod:`ray_ingest.twintar.remote`.
- ``remote_figures`` (session): rows recorded by tests, printed as a table in the terminal
  summary (and written as JSON to ``$RAY_INGEST_REMOTE_FIGURES`` when set).
- :func:`upload_tree`: copy a local folder to a ``gs://`` prefix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import workers

# gcsfs >= 2026 otherwise asks the Storage Control API (gRPC) for every bucket's layout and
# stalls 60 s against the emulator. Must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "test-bucket"
_FIGURES: list[dict[str, Any]] = []


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsServer:
    """A running emulator: ``endpoint``, ``bucket`` and gcsfs ``storage_options``."""

    def __init__(self, server: Any, port: int, bucket: str) -> None:
        self.server = server
        self.port = port
        self.bucket = bucket
        self.endpoint = f"http://127.0.0.1:{port}"
        self.storage_options = {"token": "anon", "project": "test",
                                "endpoint_url": self.endpoint}

    def url(self, *parts: str) -> str:
        return "/".join([f"gs://{self.bucket}", *(p.strip("/") for p in parts)])


def _quiet_disconnects(httpd: Any) -> None:
    """Drop the emulator's tracebacks for clients that hung up mid-response (noise)."""
    original = httpd.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        original(request, client_address)

    httpd.handle_error = handle_error


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsServer]:
    from gcp_storage_emulator.server import create_server

    server, port = None, 0
    for _ in range(5):  # the probed port may be taken before the emulator binds it
        port = free_port()
        candidate = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
        # start() waits forever if the server thread fails to bind: bound the wait.
        starter = threading.Thread(target=candidate.start, daemon=True)
        starter.start()
        starter.join(timeout=10)
        if not starter.is_alive():
            server = candidate
            break
    if server is None:
        pytest.fail("could not start the GCS emulator on 127.0.0.1")
    httpd = getattr(getattr(server, "_api", None), "_httpd", None)
    if httpd is not None:
        _quiet_disconnects(httpd)
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    try:
        yield GcsServer(server, port, BUCKET)
    finally:
        server.stop()
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous


def upload_tree(local_dir: str | os.PathLike[str], gs_prefix: str,
                storage_options: dict[str, Any]) -> list[str]:
    """Upload every file under ``local_dir`` to ``gs_prefix/<relative path>``; return the URLs."""
    import fsspec

    fs, prefix = fsspec.core.url_to_fs(gs_prefix, **storage_options)
    root = Path(local_dir)
    urls = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        fs.pipe_file(f"{prefix.rstrip('/')}/{rel}", path.read_bytes())
        urls.append(f"{gs_prefix.rstrip('/')}/{rel}")
    fs.invalidate_cache()
    return urls


class ProxyHandle:
    """The running proxy plus gcsfs storage options that route through it."""

    def __init__(self, proxy: Any, server: GcsServer) -> None:
        self.proxy = proxy
        self.server = server
        self.endpoint = proxy.endpoint
        # A separate GCSFileSystem instance per open (never the emulator-direct one).
        self.storage_options = {"token": "anon", "project": "test",
                                "endpoint_url": proxy.endpoint, "skip_instance_cache": True}

    def configure(self, **kwargs: Any) -> None:
        self.proxy.configure(**kwargs)

    def inject(self, kind: str, count: int = 1) -> None:
        self.proxy.inject(kind, count)

    def counts(self) -> dict[str, int]:
        return self.proxy.counts()

    def reset_counts(self) -> None:
        self.proxy.reset_counts()


@pytest.fixture
def fault_proxy(gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[ProxyHandle]:
    import gcsfs.retry

    from tests.support.faultproxy import FaultProxy

    # gcsfs retries 5xx and aiohttp errors itself, sleeping 1-2 s, 2-3 s, …; switch that off so
    # every fault reaches ray_ingest.twintar.remote (timeouts leak through gcsfs anyway).
    monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda exc: False)
    # ... and it would log each of those as a "non-retriable exception" with a traceback.
    gcsfs_log = logging.getLogger("gcsfs")
    previous_level = gcsfs_log.level
    gcsfs_log.setLevel(logging.CRITICAL)
    proxy = FaultProxy(gcs_server.port, rate=0.0, seed=0, stall_s=1.5, io_timeout_s=5.0)
    proxy.start()
    try:
        yield ProxyHandle(proxy, gcs_server)
    finally:
        proxy.stop()
        gcsfs_log.setLevel(previous_level)


class FigureRecorder:
    def record(self, **row: Any) -> None:
        _FIGURES.append(row)


@pytest.fixture(scope="session")
def remote_figures() -> FigureRecorder:
    return FigureRecorder()


def pytest_sessionfinish(session: Any) -> None:
    workers.send(session.config, "ray_ingest_remote_figures", _FIGURES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _FIGURES.extend(workers.received(node, "ray_ingest_remote_figures") or [])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    columns: list[str] = []
    for row in _FIGURES:
        columns += [c for c in row if c not in columns]
    cells = [[str(row.get(c, "")) for c in columns] for row in _FIGURES]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    terminalreporter.section("remote read figures")
    terminalreporter.write_line("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        terminalreporter.write_line("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    target = os.environ.get("RAY_INGEST_REMOTE_FIGURES")
    if target:
        with contextlib.suppress(OSError):
            Path(target).write_text(json.dumps(_FIGURES, indent=2))
