"""Remote reads: fsspec files that survive transient faults by reopening at the byte offset.

Replaces PiD's ``RetryingStream`` (reference/pid_semantics.md §2) for every fsspec protocol:

1. :func:`open_url` opens ``url`` through ``fsspec.core.url_to_fs`` and ``fs.open(path, "rb")``.
   Local paths (no scheme, ``file://``, ``local://``) and ``memory://`` take a fast path: the
   plain file object, with no wrapper and no per-read overhead.
2. Any other protocol gets a :class:`RetryingReader`: an :class:`io.BufferedReader` (C-level
   buffering, so ``read(512)`` in a tar walk costs no Python call) over a raw reader that
   fetches ``buffer_size`` bytes per request and tracks its own byte offset.
3. A transient failure — a connection error, a timeout, an aiohttp client error, any other
   ``OSError`` that is not "not found"/"forbidden", an HTTP 5xx/408/429, or a premature end of
   stream (fewer bytes than asked although the object's size says more remain) — closes the
   fsspec file, sleeps :meth:`RetryPolicy.backoff_s` and reopens at the current offset (a seek
   on the new file: the next fetch is a range request). Bytes already received are kept.
4. "Not found" and "forbidden" (``FileNotFoundError``, ``PermissionError``, HTTP 404/401/403,
   gcsfs's ``OSError("Forbidden: …")``) fail at once, without retrying.
5. After ``RetryPolicy.attempts`` consecutive failures without progress it raises
   :class:`RemoteReadError`: one line naming the URL, the byte offset, the attempts and the
   last cause. A reopen that finds a different object (size or generation/etag changed) also
   raises instead of splicing two versions.

Retries, reopens and bytes read are counted per reader (:attr:`RetryingReader.stats`) and
for the whole process (:func:`remote_stats`), for tests; retries also go to the Ray metric
``ingest_remote_retries`` (:mod:`ray_ingest.metrics`, a no-op without Ray).

No Ray, no torch; gcsfs and aiohttp are only looked at when already imported.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
import fsspec

from ray_ingest import metrics
from ray_ingest.errors import ConfigError, IngestError
from ray_ingest.redact import register

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "DEFAULT_RETRY",
    "ObjectAccessError",
    "ObjectNotFoundError",
    "ReadStats",
    "RemoteReadError",
    "RetryPolicy",
    "RetryingReader",
    "is_local_url",
    "open_url",
    "read_bytes",
    "remote_stats",
    "reset_remote_stats",
]

#: Bytes fetched per request (and size of the reader's buffer). Large enough that per-request
#: latency is amortised, small enough that a reopen re-fetches little.
DEFAULT_BUFFER_SIZE = 4 * 2**20
#: Upper bound of one request when a caller asks for more at once (``read()`` of a big object).
_MAX_REQUEST = 16 * 2**20
_LOCAL_PROTOCOLS = frozenset({None, "file", "local"})
_NO_RETRY_PROTOCOLS = frozenset({"memory"})
_GCS_PROTOCOLS = frozenset({"gs", "gcs", "gcsfs"})
_CAUSE_MAX_CHARS = 300


# ---------------------------------------------------------------------------------------------
# Policy


def _check_attempts(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"RetryPolicy.{attribute.name}: expected an int >= 1, got {value!r}")


def _check_seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"RetryPolicy.{attribute.name}: expected seconds >= 0, got {value!r}")


def _check_timeout(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"RetryPolicy.{attribute.name}: expected seconds > 0, got {value!r}")


@attrs.frozen
class RetryPolicy:
    """How a remote read retries. Small, frozen and picklable (it travels in read tasks)."""

    #: Attempts per operation (open or read) before giving up; 1 disables retrying.
    attempts: int = attrs.field(default=6, validator=_check_attempts)
    #: Sleep before the first retry; doubles for each further retry.
    backoff_base_s: float = attrs.field(default=0.1, validator=_check_seconds)
    #: Cap of the doubled sleep.
    backoff_max_s: float = attrs.field(default=10.0, validator=_check_seconds)
    #: Per-request timeout; passed to gcsfs as ``requests_timeout`` unless storage options
    #: set one. Other protocols take their own timeout options.
    read_timeout_s: float = attrs.field(default=60.0, validator=_check_timeout)
    #: Add a deterministic jitter of up to half the sleep.
    jitter: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def backoff_s(self, url: str, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based) of ``url``.

        ``min(base * 2**retry, max)``, plus, with ``jitter``, a fraction of up to half of it
        drawn from ``random.Random`` seeded by ``sha256(url, retry)``: spread across objects,
        identical across runs, nothing from time or pid.
        """
        delay = min(self.backoff_base_s * 2.0 ** min(retry, 64), self.backoff_max_s)
        if self.jitter and delay > 0:
            digest = hashlib.sha256(f"{url}\x00{retry}".encode()).digest()
            delay += random.Random(int.from_bytes(digest[:8], "big")).uniform(0.0, delay / 2)
        return delay


#: The default policy (frozen, so safe as a shared default argument).
DEFAULT_RETRY = RetryPolicy()


# ---------------------------------------------------------------------------------------------
# Errors


def _describe(cause: BaseException | str) -> str:
    """``Type: message`` on one line, capped in length."""
    if isinstance(cause, BaseException):
        text = " ".join(str(cause).split())
        name = type(cause).__name__
        cause = f"{name}: {text}" if text else name
    cause = " ".join(str(cause).split())
    if len(cause) > _CAUSE_MAX_CHARS:
        cause = cause[: _CAUSE_MAX_CHARS - 1] + "…"
    return cause


class RemoteReadError(IngestError):
    """A remote object could not be read: one line naming the URL, offset, attempts and cause."""

    what = "read failed"

    def __init__(self, url: str, offset: int, attempts: int, cause: BaseException | str) -> None:
        self.url = url
        self.offset = offset
        self.attempts = attempts
        self.cause = _describe(cause)
        plural = "" if attempts == 1 else "s"
        super().__init__(
            f"{url}: {self.what} at byte {offset} after {attempts} attempt{plural}; "
            f"last cause: {self.cause}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.offset, self.attempts, self.cause))


class ObjectNotFoundError(RemoteReadError, FileNotFoundError):
    """The object does not exist (404); never retried. Also a ``FileNotFoundError``."""

    what = "object not found"


class ObjectAccessError(RemoteReadError, PermissionError):
    """Access to the object was denied (401/403); never retried. Also a ``PermissionError``."""

    what = "access denied"


class _PrematureEnd(OSError):
    """The stream ended before the object's size said it would."""


class _ObjectChanged(Exception):
    """A reopen found a different version of the object."""


# ---------------------------------------------------------------------------------------------
# Stats


@attrs.define
class ReadStats:
    """Counters of one reader, or (from :func:`remote_stats`) of the whole process."""

    #: Successful opens of an fsspec file, reopens included.
    opens: int = 0
    #: Opens after a failure (each resumes at the byte offset reached).
    reopens: int = 0
    #: Failed attempts that were followed by another attempt.
    retries: int = 0
    #: Readers that gave up (raised :class:`RemoteReadError` or a subclass).
    failures: int = 0
    #: Bytes delivered by remote readers (fast-path local reads are not counted).
    bytes_read: int = 0
    #: Failed attempts by cause (exception class name, ``premature_end`` for short reads).
    faults: dict[str, int] = attrs.field(factory=dict)

    def copy(self) -> ReadStats:
        return attrs.evolve(self, faults=dict(self.faults))


_TOTALS = ReadStats()
_TOTALS_LOCK = threading.Lock()


def remote_stats() -> ReadStats:
    """A snapshot of the process-wide counters (thread-safe)."""
    with _TOTALS_LOCK:
        return _TOTALS.copy()


def reset_remote_stats() -> None:
    """Zero the process-wide counters."""
    global _TOTALS
    with _TOTALS_LOCK:
        _TOTALS = ReadStats()


def _count(stats: ReadStats, field: str, n: int = 1, fault: str | None = None) -> None:
    setattr(stats, field, getattr(stats, field) + n)
    with _TOTALS_LOCK:
        setattr(_TOTALS, field, getattr(_TOTALS, field) + n)
        if fault is not None:
            _TOTALS.faults[fault] = _TOTALS.faults.get(fault, 0) + 1
    if fault is not None:
        stats.faults[fault] = stats.faults.get(fault, 0) + 1


# ---------------------------------------------------------------------------------------------
# Classification

_RETRY = "retry"
_NOT_FOUND = "not_found"
_DENIED = "denied"
_FATAL = "fatal"


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a gcsfs ``HttpError`` or an aiohttp ``ClientResponseError``."""
    gcs_retry = sys.modules.get("gcsfs.retry")
    if gcs_retry is not None and isinstance(exc, gcs_retry.HttpError):
        code = exc.code
    else:
        aiohttp = sys.modules.get("aiohttp")
        if aiohttp is None or not isinstance(exc, aiohttp.ClientResponseError):
            return None
        code = exc.status
    try:
        return int(code)
    except (TypeError, ValueError):
        return 0  # an HttpError without a usable code: treat as transient


def _classify(exc: BaseException) -> str | None:
    """``_RETRY``, a fatal kind, or None for errors that are not I/O failures (re-raised)."""
    if isinstance(exc, FileNotFoundError):
        return _NOT_FOUND
    if isinstance(exc, PermissionError):
        return _DENIED
    if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
        return _FATAL
    status = _http_status(exc)
    if status is not None:
        if status == 404:
            return _NOT_FOUND
        if status in (401, 403):
            return _DENIED
        if 400 <= status < 500 and status not in (408, 429):
            return _FATAL
        return _RETRY
    if isinstance(exc, OSError):
        # gcsfs turns a 403 into OSError("Forbidden: <path>\n<message>").
        if str(exc).startswith("Forbidden"):
            return _DENIED
        return _RETRY  # ConnectionError, TimeoutError (fsspec's too), requests' errors, …
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        return _RETRY
    return None


_FATAL_ERRORS: dict[str, type[RemoteReadError]] = {
    _NOT_FOUND: ObjectNotFoundError,
    _DENIED: ObjectAccessError,
    _FATAL: RemoteReadError,
}


def _version_tag(details: Mapping[str, Any] | None) -> tuple[Any, ...] | None:
    if not details:
        return None
    for key in ("generation", "etag", "ETag", "version_id", "VersionId"):
        if details.get(key):
            return (details.get("size"), key, details[key])
    return (details.get("size"),)


# ---------------------------------------------------------------------------------------------
# Readers


class _RetryingRaw(io.RawIOBase):
    """Unbuffered reader over one remote object; reopens at its own byte offset on failure."""

    def __init__(
        self,
        url: str,
        fs: Any,
        path: str,
        policy: RetryPolicy,
        offset: int,
        open_kwargs: Mapping[str, Any],
    ) -> None:
        super().__init__()
        self.name = url
        self.stats = ReadStats()
        self._url = url
        self._fs = fs
        self._path = path
        self._policy = policy
        self._open_kwargs = dict(open_kwargs)
        self._file: Any = None
        self._pos = offset
        self._seek_pending = True
        self._size: int | None = None
        self._version: tuple[Any, ...] | None = None
        self._seekable = True
        attempt = 0
        while True:  # open eagerly, so "not found" surfaces in open_url
            try:
                self._ensure_open()
                break
            except Exception as exc:
                attempt = self._failed(exc, attempt)

    # -- internals ------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        f = self._file
        if f is None:
            f = self._fs.open(self._path, "rb", **self._open_kwargs)
            try:
                details = getattr(f, "details", None)
                if isinstance(details, Mapping) and details.get("type") == "directory":
                    raise IsADirectoryError(f"{self._path} is a directory")
                version = _version_tag(details if isinstance(details, Mapping) else None)
                if self.stats.opens == 0:
                    self._version = version
                    size = getattr(f, "size", None)
                    self._size = int(size) if size is not None else None
                    self._seekable = bool(f.seekable())
                elif version != self._version:
                    raise _ObjectChanged(
                        f"object changed during read: {self._version} became {version}"
                    )
            except BaseException:
                _close_quietly(f)
                raise
            if self.stats.opens:
                _count(self.stats, "reopens")
            _count(self.stats, "opens")
            self._file = f
            self._seek_pending = True
        if self._seek_pending:
            if f.tell() != self._pos:
                f.seek(self._pos)  # on a fresh fsspec file: the next fetch is a range request
            self._seek_pending = False

    def _drop(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            _close_quietly(f)

    def _failed(self, exc: BaseException, attempt: int) -> int:
        """Handle a failed attempt: raise if fatal or out of attempts, else back off.

        Returns the number of failed attempts so far.
        """
        self._drop()
        attempt += 1
        if isinstance(exc, _ObjectChanged):
            _count(self.stats, "failures")
            raise RemoteReadError(self._url, self._pos, attempt, exc) from exc
        kind = _classify(exc)
        if kind is None:
            raise exc
        if kind != _RETRY:
            _count(self.stats, "failures")
            raise _FATAL_ERRORS[kind](self._url, self._pos, attempt, exc) from exc
        if attempt >= self._policy.attempts:
            _count(self.stats, "failures")
            raise RemoteReadError(self._url, self._pos, attempt, exc) from exc
        fault = "premature_end" if isinstance(exc, _PrematureEnd) else type(exc).__name__
        _count(self.stats, "retries", fault=fault)
        metrics.on_remote_retry()
        delay = self._policy.backoff_s(self._url, attempt - 1)
        log.warning(
            "%s: retry %d/%d at byte %d in %.2fs after %s",
            self._url, attempt, self._policy.attempts - 1, self._pos, delay, _describe(exc),
        )
        if delay > 0:
            time.sleep(delay)
        return attempt

    # -- RawIOBase ------------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        if not self._seekable:
            raise io.UnsupportedOperation(f"{self._url}: not seekable")
        if whence == io.SEEK_SET:
            new = pos
        elif whence == io.SEEK_CUR:
            new = self._pos + pos
        elif whence == io.SEEK_END:
            if self._size is None:
                raise io.UnsupportedOperation(f"{self._url}: size unknown, cannot seek from end")
            new = self._size + pos
        else:
            raise ValueError(f"invalid whence ({whence!r}, should be 0, 1 or 2)")
        if new < 0:
            raise ValueError(f"{self._url}: negative seek position {new}")
        if new != self._pos:
            self._pos = new
            self._seek_pending = True
        return new

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        view = memoryview(b).cast("B")
        want = min(len(view), _MAX_REQUEST)
        if self._size is not None:
            want = min(want, self._size - self._pos)
        if want <= 0:
            return 0
        filled = 0
        attempt = 0
        while filled < want:
            try:
                self._ensure_open()
                data = self._file.read(want - filled)
            except Exception as exc:
                attempt = self._failed(exc, attempt)
                continue
            got = len(data)
            view[filled : filled + got] = data
            filled += got
            self._pos += got
            if filled < want:
                if self._size is None:
                    break  # no size to hold the stream to: a short read is the end
                if got:
                    attempt = 0  # progress was made: start counting failures afresh
                short = _PrematureEnd(f"stream ended at byte {self._pos} of {self._size}")
                attempt = self._failed(short, attempt)
        if filled:
            _count(self.stats, "bytes_read", filled)
        return filled

    def readall(self) -> bytes:
        if self._size is not None:
            out = bytearray(max(self._size - self._pos, 0))
            view = memoryview(out)
            n = 0
            while n < len(out):
                got = self.readinto(view[n:])
                if not got:
                    break
                n += got
            view.release()
            del out[n:]
            return bytes(out)
        chunks = []
        buf = bytearray(DEFAULT_BUFFER_SIZE)
        while True:
            got = self.readinto(buf)
            if not got:
                return b"".join(chunks)
            chunks.append(bytes(buf[:got]))

    def close(self) -> None:
        if not self.closed:
            self._drop()
        super().close()


def _close_quietly(f: Any) -> None:
    try:
        f.close()
    except Exception as exc:  # closing a broken connection must not mask the real error
        log.debug("ignoring error while closing %r: %s", f, exc)


class RetryingReader(io.BufferedReader):
    """Buffered, read-only binary file over a remote object that retries transient faults.

    Supports ``read``, ``readinto``, ``read1``, ``peek``, ``seek``/``tell`` (when the fsspec
    file is seekable), iteration and use as a context manager. Not thread-safe (like any file).
    """

    raw: _RetryingRaw

    def __init__(self, raw: _RetryingRaw, buffer_size: int = DEFAULT_BUFFER_SIZE) -> None:
        super().__init__(raw, buffer_size)

    @property
    def stats(self) -> ReadStats:
        """This reader's counters: ``opens``, ``reopens``, ``retries``, ``bytes_read``, …"""
        return self.raw.stats

    @property
    def url(self) -> str:
        return self.raw.name

    @property
    def size(self) -> int | None:
        """Object size in bytes, as reported when it was opened."""
        return self.raw._size

    def __repr__(self) -> str:
        return f"<RetryingReader {self.raw.name!r}>"


# ---------------------------------------------------------------------------------------------
# Entry points


def is_local_url(url: str) -> bool:
    """True for plain paths and ``file://``/``local://`` URLs (read without any wrapper)."""
    if "::" in url:
        return False
    protocol, _ = fsspec.core.split_protocol(url)
    return protocol in _LOCAL_PROTOCOLS


def _open_local(url: str, offset: int) -> io.BufferedIOBase:
    path = fsspec.core.split_protocol(url)[1]
    try:
        f = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    except FileNotFoundError as exc:
        raise ObjectNotFoundError(url, offset, 1, exc) from exc
    except PermissionError as exc:
        raise ObjectAccessError(url, offset, 1, exc) from exc
    if offset:
        f.seek(offset)
    return f


def open_url(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = DEFAULT_RETRY,
    offset: int = 0,
    *,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> io.BufferedIOBase:
    """Open ``url`` for binary reading, positioned at byte ``offset``.

    Args:
        url: A local path, ``file://``, ``memory://``, ``gs://`` or any fsspec URL.
        storage_options: Keyword arguments of the fsspec filesystem (``token``, ``project``,
            ``endpoint_url``, …). For gcsfs, ``requests_timeout`` defaults to
            ``retry.read_timeout_s``.
        retry: Retry policy; None means :data:`DEFAULT_RETRY`.
        offset: Byte offset to start at.
        buffer_size: Bytes per request and size of the read buffer (remote only).

    Returns:
        The plain file object for local paths and ``memory://``, else a
        :class:`RetryingReader`. Close it (or use ``with``).

    Raises:
        ObjectNotFoundError: The object does not exist (a ``FileNotFoundError`` too).
        ObjectAccessError: Access was denied (a ``PermissionError`` too).
        RemoteReadError: Opening failed ``retry.attempts`` times in a row.
    """
    policy = DEFAULT_RETRY if retry is None else retry
    register(storage_options)  # an error or a retry log line never shows them
    if offset < 0:
        raise ConfigError(f"open_url offset: expected a byte offset >= 0, got {offset!r}")
    if buffer_size < 1:
        raise ConfigError(f"open_url buffer_size: expected bytes >= 1, got {buffer_size!r}")
    if is_local_url(url):
        return _open_local(url, offset)
    options = dict(storage_options or {})
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol in _GCS_PROTOCOLS:
        options.setdefault("requests_timeout", policy.read_timeout_s)
    fs, path = fsspec.core.url_to_fs(url, **options)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & _NO_RETRY_PROTOCOLS:
        try:
            f = fs.open(path, "rb")
        except FileNotFoundError as exc:
            raise ObjectNotFoundError(url, offset, 1, exc) from exc
        if offset:
            f.seek(offset)
        return f
    # The fsspec file does no caching of its own: the BufferedReader is the only buffer, and
    # each of its refills is one range request of ``buffer_size`` bytes.
    raw = _RetryingRaw(url, fs, path, policy, offset, {"cache_type": "none",
                                                     "block_size": buffer_size})
    return RetryingReader(raw, buffer_size)


def read_bytes(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = DEFAULT_RETRY,
) -> bytes:
    """The whole content of ``url``, read with :func:`open_url`'s retry semantics."""
    with open_url(url, storage_options, retry) as f:
        return f.read()
