"""What an execution offers the loader, and the hand-off that bounds every wait for it.

:class:`Execution` is the protocol every execution (Ray Data, decode threads, in-process)
implements; :class:`Handoff` pulls an iterator in a helper thread so that a consumer's wait
can time out (a stall) while its pauses never count. No Ray, no torch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

Block = dict[str, np.ndarray]


class Execution(Protocol):
    """What :class:`ray_ingest.execution.raydata.Execution` offers the window."""

    def blocks(self) -> Iterator[Block]: ...

    def stats(self) -> str | None: ...

    # optional: ``start()`` begins reading before the first block is asked for

    def close(self) -> None: ...


class Handoff:
    """Pulls items from ``source`` in a helper thread, one per request, so waits can be bounded.

    A synchronous hand-off: the helper calls ``next(source)`` only when the consumer asks, so
    nothing is buffered beyond what ``source`` itself prefetches, and only time the consumer
    spends *waiting* counts toward ``timeout_s`` (a consumer that pauses never trips it).
    Exceptions raised by ``source`` re-raise in the consumer. :meth:`close` closes ``source`` in
    the helper thread (a generator must be closed by the thread that runs it).

    Args:
        source: the iterator to pull from (a generator is closed on :meth:`close`).
        timeout_s: longest wait for one item (None: forever).
        on_stall: builds the exception raised when a wait exceeds ``timeout_s`` (needed only
            with a timeout).
        ahead: ask for the next item as soon as one is handed over (one item in flight while
            the consumer works; :meth:`close` lets it finish, then closes ``source``).
        name: the helper thread's name.
    """

    def __init__(self, source: Iterator[Any], timeout_s: float | None,
                 on_stall: Callable[[float], BaseException] | None = None, *,
                 ahead: bool = False,
                 name: str = "ray_ingest-handoff"):
        if timeout_s is not None and on_stall is None:
            raise ValueError("Handoff: a timeout needs on_stall")
        self._source, self._timeout, self._on_stall = source, timeout_s, on_stall
        self._want: queue.Queue[bool] = queue.Queue()
        self._got: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._primed = False
        self._ahead = ahead
        self._name = name
        self._closing = False

    def prime(self) -> None:
        """Ask for the first item now, in the helper thread (the source starts working)."""
        if self._thread is None:
            self._start()
            self._want.put(True)
            self._primed = True

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._pump, name=self._name,
                                        daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[Any]:
        if self._thread is None:
            self._start()
        while True:
            if self._primed:
                self._primed = False
            else:
                self._want.put(True)
            try:
                ok, value = self._got.get(timeout=self._timeout)
            except queue.Empty:
                raise self._on_stall(self._timeout) from None
            if not ok:
                raise value
            if value is _END:
                return
            if self._ahead:  # the next item is made while the consumer works on this one
                self._want.put(True)
                self._primed = True
            yield value

    def _pump(self) -> None:
        try:
            while self._want.get():
                try:
                    value = next(self._source, _END)
                except BaseException as exc:  # handed to the consumer's thread
                    self._got.put((False, exc))
                    return
                self._got.put((True, value))
                if value is _END:
                    return
        finally:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()

    def close(self, join_s: float = 10.0) -> bool:
        """Stop pulling and close ``source`` (at once when the helper is idle); True when the
        helper has ended within ``join_s`` (calling again waits again)."""
        if self._thread is None:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()
            return True
        if not self._closing:
            self._closing = True
            self._want.put(False)
        self._thread.join(timeout=join_s)
        return not self._thread.is_alive()


_END = object()
