"""A fault-injecting HTTP/1.x proxy on loopback, for exercising remote-read retries.

It sits between a client (gcsfs/aiohttp) and a local server (the GCS emulator), forwards
one request per client connection (it answers ``Connection: close``) and, with a seeded RNG,
turns a configurable fraction of the requests into faults:

- ``reset``: send the response head and half of the body, then reset the connection (RST);
- ``http503``: answer ``503 Service Unavailable`` without asking the server;
- ``stall``: send the head and half of the body, then go silent for ``stall_s`` seconds
  (longer than the client's read timeout) and reset;
- ``truncate``: for media downloads (``alt=media``) only, answer a consistent but short
  response (``Content-Length`` halved): the client sees a clean, premature end of stream;
- ``http403``: answer ``403 Forbidden`` (only when listed explicitly; not retriable).

Faults may also be forced for the next N requests with :meth:`FaultProxy.inject`. Every loop
is bounded (socket timeouts, a stop event), so :meth:`FaultProxy.stop` returns promptly.
Listens and connects on 127.0.0.1 only.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import socket
import struct
import threading
from collections.abc import Iterable

RANDOM_KINDS = ("reset", "http503", "stall", "truncate")
ALL_KINDS = (*RANDOM_KINDS, "http403")
LOOPBACK = "127.0.0.1"
_MAX_HEAD = 64 * 1024


class FaultProxy:
    """Threaded TCP proxy that speaks just enough HTTP/1.x to inject faults.

    Args:
        upstream_port: Port of the server on 127.0.0.1.
        rate: Fraction of requests to fault, in [0, 1].
        kinds: Fault kinds drawn from (uniformly among those applicable to a request).
        seed: Seed of the RNG that picks faulted requests and kinds.
        stall_s: How long a ``stall`` stays silent.
        io_timeout_s: Socket timeout for every read and write.
    """

    def __init__(
        self,
        upstream_port: int,
        *,
        rate: float = 0.0,
        kinds: Iterable[str] = RANDOM_KINDS,
        seed: int = 0,
        stall_s: float = 2.0,
        io_timeout_s: float = 10.0,
    ) -> None:
        self.upstream = (LOOPBACK, int(upstream_port))
        self.stall_s = float(stall_s)
        self.io_timeout_s = float(io_timeout_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._forced: collections.deque[str] = collections.deque()
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.port = 0
        self.configure(rate=rate, kinds=kinds, seed=seed)
        self.reset_counts()

    # -- control --------------------------------------------------------------------------

    def configure(self, *, rate: float | None = None, kinds: Iterable[str] | None = None,
                  seed: int | None = None) -> None:
        """Change the fault rate, the kinds drawn from, or reseed the RNG."""
        with self._lock:
            if rate is not None:
                if not 0.0 <= rate <= 1.0:
                    raise ValueError(f"FaultProxy.rate: expected a value in [0, 1], got {rate!r}")
                self.rate = float(rate)
            if kinds is not None:
                kinds = tuple(kinds)
                bad = [k for k in kinds if k not in ALL_KINDS]
                if bad or not kinds:
                    raise ValueError(f"FaultProxy.kinds: expected some of {ALL_KINDS}, got {kinds}")
                self.kinds = kinds
            if seed is not None:
                self._rng = random.Random(seed)

    def inject(self, kind: str, count: int = 1) -> None:
        """Force ``kind`` onto the next ``count`` requests (before any random draw)."""
        if kind not in ALL_KINDS:
            raise ValueError(f"FaultProxy.inject: expected one of {ALL_KINDS}, got {kind!r}")
        with self._lock:
            self._forced.extend([kind] * count)

    def reset_counts(self) -> None:
        with self._lock:
            self._counts = {"requests": 0, **{k: 0 for k in ALL_KINDS}}

    def counts(self) -> dict[str, int]:
        """Requests seen and faults applied, by kind (``faulted`` is their sum)."""
        with self._lock:
            out = dict(self._counts)
        out["faulted"] = sum(out[k] for k in ALL_KINDS)
        return out

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, 0))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept",
                                          daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=self.io_timeout_s + 1)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), name="faultproxy-conn",
                                 daemon=True)
            with self._lock:
                self._threads = {x for x in self._threads if x.is_alive()}
                self._threads.add(t)
            t.start()

    def _draw(self, head: bytes) -> str | None:
        request_line = head.split(b"\r\n", 1)[0]
        is_media = request_line.startswith(b"GET ") and b"alt=media" in request_line
        with self._lock:
            self._counts["requests"] += 1
            if self._forced:
                return self._forced.popleft()
            if self.rate <= 0 or self._rng.random() >= self.rate:
                return None
            kinds = [k for k in self.kinds if k != "truncate" or is_media]
            return self._rng.choice(kinds) if kinds else None

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.io_timeout_s)
        try:
            request = _read_request(conn)
            if request is None:
                return
            head, body = request
            kind = self._draw(head)
            if kind in ("http503", "http403"):
                self._count(kind)
                conn.sendall(_error_response(503 if kind == "http503" else 403))
                return
            status, resp_head, resp_body = self._forward(head, body)
            if kind == "truncate" and status in (200, 206) and len(resp_body) >= 2:
                self._count(kind)
                resp_body = resp_body[: len(resp_body) // 2]
                conn.sendall(_rewrite_head(resp_head, len(resp_body)) + resp_body)
                return
            out = _rewrite_head(resp_head, None) + resp_body
            if kind in ("reset", "stall"):
                self._count(kind)
                cut = len(out) - len(resp_body) // 2 if len(resp_body) >= 2 else len(out) // 2
                conn.sendall(out[:cut])
                if kind == "stall":
                    self._stop.wait(self.stall_s)
                _abort(conn)
                return
            conn.sendall(out)
        except OSError:
            pass  # the client went away: nothing to forward to
        finally:
            conn.close()

    def _forward(self, head: bytes, body: bytes) -> tuple[int, bytes, bytes]:
        with socket.create_connection(self.upstream, timeout=self.io_timeout_s) as up:
            up.sendall(_request_head_close(head) + body)
            chunks = []
            while True:
                chunk = up.recv(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        raw = b"".join(chunks)
        resp_head, sep, resp_body = raw.partition(b"\r\n\r\n")
        if not sep:
            raise OSError("upstream closed before a complete response head")
        status = int(resp_head.split(b" ", 2)[1])
        length = _header(resp_head, b"content-length")
        if length is not None:
            resp_body = resp_body[: int(length)]
        return status, resp_head + b"\r\n\r\n", resp_body


def _read_request(conn: socket.socket) -> tuple[bytes, bytes] | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > _MAX_HEAD:
            raise OSError("request head too large")
    head, _, body = buf.partition(b"\r\n\r\n")
    head += b"\r\n\r\n"
    if (_header(head, b"transfer-encoding") or b"").lower() == b"chunked":
        raise OSError("chunked request bodies are not supported by the fault proxy")
    length = int(_header(head, b"content-length") or 0)
    while len(body) < length:
        chunk = conn.recv(min(1 << 20, length - len(body)))
        if not chunk:
            return None
        body += chunk
    return head, body[:length]


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


def _without(head: bytes, names: tuple[bytes, ...]) -> list[bytes]:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    return [lines[0]] + [ln for ln in lines[1:]
                         if ln.partition(b":")[0].strip().lower() not in names]


def _request_head_close(head: bytes) -> bytes:
    lines = _without(head, (b"connection", b"keep-alive"))
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _rewrite_head(head: bytes, content_length: int | None) -> bytes:
    drop = (b"connection", b"keep-alive") + ((b"content-length",) if content_length is not None
                                             else ())
    lines = _without(head, drop)
    if content_length is not None:
        lines.append(b"Content-Length: %d" % content_length)
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _error_response(code: int) -> bytes:
    reason = {503: b"Service Unavailable", 403: b"Forbidden"}[code]
    body = json.dumps({"error": {"code": code, "message": "injected by faultproxy"}}).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (code, reason, len(body), body))


def _abort(conn: socket.socket) -> None:
    """Close with RST instead of FIN, like a peer that crashed."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
