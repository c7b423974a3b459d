"""Credentials stay where they are: storage options are redacted in everything we print or keep.

``data.storage_options`` (and the ``storage_options`` of the dataset API, ``shard``,
``convert``) carry what fsspec needs to reach the data: a GCS token, a service-account key, an
S3 secret. They reach the code that opens files, and nothing else:

* **Printed or persisted forms are redacted.** :func:`redact_options` keeps the keys and
  replaces every value by ``<redacted>``, except booleans, numbers, None, the gcsfs token
  *methods* (``google_default``, ``cloud``, ``anon``, ...), which name where credentials come
  from without being one, and the values of :data:`PUBLIC_KEYS` (``project``,
  ``endpoint_url``, ...: where the data is, not how to get in; a ``user:password@`` in them
  is still redacted). The config's ``repr``, :class:`~ray_ingest.reader.ReadOptions`,
  the dict the job hands to Ray Train (its ``train_loop_config`` is shown by the dashboard and
  exported), every log line and every :class:`~ray_ingest.errors.IngestError` go through it.
* **Free text is scrubbed.** Every secret string the process has seen (:func:`register`, at
  least :data:`MIN_SCRUB` characters: shorter ones would match ordinary words) is replaced in
  error messages (``IngestError.__str__``) and log records (a log-record factory installed on
  the first registration), and so are the credentials of ``scheme://user:password@host`` URLs.
* **The values travel sealed.** :class:`Sealed` holds options whose ``repr``/``str`` are
  redacted and whose pickle carries the real values: the job passes the options to its Ray
  Train workers that way, inside Ray's own transport (task arguments, in memory), never in a
  printed, logged or exported form.

No Ray, no torch.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "MIN_SCRUB",
    "REDACTED",
    "Sealed",
    "options_repr",
    "redact_config",
    "redact_options",
    "register",
    "scrub",
]

REDACTED = "<redacted>"
#: gcsfs ``token`` values that choose a way to find credentials and are no secret themselves.
TOKEN_METHODS = frozenset({"google_default", "cache", "cloud", "anon", "browser"})
#: Storage options that say where the data is or how to talk to it, never how to get in.
PUBLIC_KEYS = frozenset({
    "project", "endpoint_url", "default_location", "region_name", "requester_pays",
    "consistency", "cache_timeout", "version_aware", "skip_instance_cache", "requests_timeout",
    "timeout", "block_size", "use_ssl", "anon", "asynchronous", "auto_mkdir",
})
#: Shortest string scrubbed from free text (shorter ones would hit ordinary words).
MIN_SCRUB = 8
_USERINFO = re.compile(r"(?<=://)[^/\s@'\"]+@")

_LOCK = threading.Lock()
_SECRETS: set[str] = set()
_ORDERED: tuple[str, ...] = ()  # longest first: a secret inside another one goes second
_FACTORY_INSTALLED = False


def redact_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` with every secret value replaced by :data:`REDACTED` (keys kept)."""
    return {str(k): _redact(v, str(k)) for k, v in dict(options or {}).items()}


def _redact(value: Any, key: str = "") -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if key == "token" and isinstance(value, str) and value in TOKEN_METHODS:
        return value
    if key in PUBLIC_KEYS and isinstance(value, str):
        return _USERINFO.sub(REDACTED + "@", value)
    if isinstance(value, Mapping):
        return {str(k): _redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact(v) for v in value]
    return REDACTED


def options_repr(options: Mapping[str, Any] | None) -> str:
    """``repr`` of redacted options (an attrs ``repr=`` for storage-option fields)."""
    return repr(redact_options(options))


def redact_config(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A :meth:`Config.to_dict` document with ``data.storage_options`` redacted (a copy)."""
    out = dict(doc)
    data = out.get("data")
    if isinstance(data, Mapping) and "storage_options" in data:
        out["data"] = {**data, "storage_options": redact_options(data["storage_options"])}
    return out


def _leaves(value: Any, key: str = "") -> Iterator[str]:
    if key in PUBLIC_KEYS:
        return
    if isinstance(value, str):
        if not (key == "token" and value in TOKEN_METHODS):
            yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(v, str(k))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif value is not None and not isinstance(value, (bool, int, float)):
        yield str(value)


def register(options: Mapping[str, Any] | None) -> None:
    """Remember the secret strings of ``options``: from now on :func:`scrub` (error messages,
    log records of this process) replaces them. Cheap when nothing is new."""
    if not options:
        return
    found = set()
    for k, v in dict(options).items():
        for text in _leaves(v, str(k)):
            if len(text) >= MIN_SCRUB:
                found.add(text)
                escaped = repr(text)[1:-1]  # as it shows inside a repr (newlines of a key)
                if escaped != text:
                    found.add(escaped)
    global _ORDERED
    with _LOCK:
        if found <= _SECRETS:
            return
        _SECRETS.update(found)
        _ORDERED = tuple(sorted(_SECRETS, key=len, reverse=True))
    _install_log_scrubber()


def scrub(text: str) -> str:
    """``text`` without any registered secret or ``user:password@`` of a URL."""
    for secret in _ORDERED:
        if secret in text:
            text = text.replace(secret, REDACTED)
    if "@" in text and "://" in text:
        text = _USERINFO.sub(REDACTED + "@", text)
    return text


def _install_log_scrubber() -> None:
    """Every log record of this process, whichever library logs it, is scrubbed when made
    (its message, its arguments and the text of its exception)."""
    global _FACTORY_INSTALLED
    with _LOCK:
        if _FACTORY_INSTALLED:
            return
        _FACTORY_INSTALLED = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is the handler's to report
            return record
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            import traceback

            text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
            clean = scrub(text)
            if clean != text:
                record.exc_text = clean  # formatters use it instead of formatting again
        return record

    logging.setLogRecordFactory(factory)


class Sealed:
    """Storage options that travel to another process without showing: ``repr``/``str`` are
    redacted, a pickle carries the real values, :meth:`reveal` returns them (and registers
    them for scrubbing there)."""

    __slots__ = ("_options",)

    def __init__(self, options: Mapping[str, Any] | None):
        self._options = dict(options or {})

    def reveal(self) -> dict[str, Any]:
        register(self._options)
        return dict(self._options)

    def __repr__(self) -> str:
        return f"Sealed({options_repr(self._options)})"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (Sealed, (self._options,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sealed) and other._options == self._options

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._options)))
