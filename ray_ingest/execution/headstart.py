"""Head start: an execution's first items decoded in the consumer's process while the pool starts.

A Ray Data execution's decode actors are new processes; on a small node they take seconds to
start (each imports ``ray.data``) before the first block arrives, once per job and once per
resume. The consumer's process already has the read and decode code loaded: it reads and decodes
the first ``loader.head_start_batches`` batches' items itself, in a helper thread one block ahead
of the consumer, while the Ray execution, which reads only the items after them, is built and
started in another (its imports and its controller's connection are not on the head's path). The
delivered rows are the same (the same read and decode code, in stream order) and no item is
decoded twice. What it buys is the train loop's first steps (and their one-off costs: CUDA
context, autotuning, compilation) overlapping the pool's start, and errors in the data or the
decode settings reported in a fraction of a second; the pool's first block arrives when it would
have. No Ray, no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ray_ingest.columns import ACTOR, SEQ
from ray_ingest.execution.handoff import (
    Execution,
    Handoff,
)
from ray_ingest.execution.local import LocalExecution
from ray_ingest.plan.epoch import ReadItem

Block = dict[str, np.ndarray]

#: ``__actor__`` of the rows the head decoded (not a decode actor of the pool).
HEAD_ACTOR = "head-start"
HEAD_THREAD = "ray_ingest-head"
START_THREAD = "ray_ingest-start"


def split_head(items: Sequence[ReadItem], rows: int) -> tuple[list[ReadItem], list[ReadItem]]:
    """The leading items holding at least ``rows`` rows (at least one item), and the rest."""
    items = [it for it in items if it.count > 0]
    n = total = 0
    while n < len(items) and (n == 0 or total < rows):
        total += items[n].count
        n += 1
    return items[:n], items[n:]


class HeadStart:
    """An :class:`~ray_ingest.execution.handoff.Execution`: ``local`` serves the head items, then
    the remote execution the rest (see module docstring).

    Args:
        local: reads and decodes the head items in this process (:class:`LocalExecution`).
        open_remote: opens the execution reading the items after them, in a helper thread
            (None: the head is everything).
        after_first_block: open the remote once the head has decoded its first block, not when
            the head starts (see :meth:`start`).
    """

    def __init__(self, local: LocalExecution, open_remote: Callable[[], Execution] | None,
                 after_first_block: bool = False):
        self._local, self._open_remote = local, open_remote
        self._after_first_block = after_first_block
        self._remote: Execution | None = None
        self._head = Handoff(self._marked(), None, ahead=True, name=HEAD_THREAD)
        self._started = self._closed = False
        #: Guards opening the remote against :meth:`close` (the head's thread may open it).
        self._lock = threading.Lock()
        #: The helper thread opening the remote (None: not opened).
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        #: Rows the head delivered.
        self.head_rows = 0

    def _marked(self) -> Iterator[Block]:
        for block in self._local.blocks():
            block[ACTOR] = np.full(len(block[SEQ]), HEAD_ACTOR, dtype=object)
            self._open()
            yield block
        self._open()  # a head of no blocks

    def start(self) -> None:
        """Start both: the head decodes its first block, and the remote execution is opened and
        started in a helper thread, at once or, with ``after_first_block``, once that block is
        decoded. Neither waits on the other: opening the job pool's execution imports its
        modules (~5 ms of CPU on an idle node) and its start waits for the controller's answer
        (~1 s on a busy node when the controller is new).

        ``after_first_block`` is for a job's shared pool: its ranks all join the controller as
        their loops start, and on a node whose cores they share, those joins (the rank's and
        the controller's CPU) came before the first batches every rank's first step waits for
        (bench/scale_out.py part 3, 64 ranks on 2 cores: docs/benchmarks.md). The pool's first
        block is needed only after the head's, which the rest of the head covers."""
        if self._started:
            return
        self._started = True
        self._head.prime()
        if not self._after_first_block:
            self._open()

    def _open(self) -> None:
        """Open and start the remote in a helper thread (once; not after :meth:`close`)."""
        with self._lock:
            if self._open_remote is None or self._starting is not None or self._closed:
                return
            self._starting = threading.Thread(target=self._start_remote, name=START_THREAD,
                                              daemon=True)
            self._starting.start()

    def _start_remote(self) -> None:
        try:
            self._remote = self._open_remote()
            start = getattr(self._remote, "start", None)
            if start is not None:
                start()
        except BaseException as exc:  # raised in the consumer's thread (_remote_started)
            self._start_error = exc

    def _remote_started(self) -> None:
        """Wait for the remote's start to finish; its error, if any, raised here."""
        if self._starting is not None:
            self._starting.join()
        if self._start_error is not None:
            raise self._start_error

    def blocks(self) -> Iterator[Block]:
        self.start()
        for block in self._head:
            self.head_rows += len(block[SEQ])
            yield block
        if self._open_remote is not None:
            self._remote_started()
            yield from self._remote.blocks()

    def stats(self) -> str | None:
        text = self._remote.stats() if self._remote is not None else None
        head = f"head start: {self.head_rows} rows decoded in the consumer's process"
        return f"{text}\n{head}" if text else head

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._local.close()
        self._head.close()
        if self._starting is not None:  # closed while the remote starts: let it finish first
            self._starting.join()
        if self._remote is not None:
            self._remote.close()
