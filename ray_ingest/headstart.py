"""Head start: the first read items decoded in the consumer's process while the pool starts.

A Ray Data execution's decode actors are new processes; on a small node they take seconds to
start (each imports ``ray.data``) before the first block arrives, once per job and once per
resume. Meanwhile the consumer's process, which already has the read and decode code loaded,
reads and decodes the first items itself, in a helper thread, one item ahead of the consumer.
The Ray execution reads *all* items from the first, in order; its rows that the head already
delivered are dropped as they arrive, and the head stops as soon as the execution delivers a row
the head has not (or after ``loader.head_start_rows`` rows); a head that delivers every item
ends the execution unused. The delivered rows are the same
either way (the same read and decode code, in stream order); what the head costs is the
duplicated work of the items both decoded, during start-up only.

Only for ordered executions (rows counted in stream order tell what was delivered). Errors of
the head never surface: the head stops, and the execution, which reads the same items, reports
what is really wrong. No Ray, no torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ray_ingest.catalog import Catalog
from ray_ingest.columns import ACTOR, SEQ
from ray_ingest.config import Config
from ray_ingest.decode import Decoder
from ray_ingest.plan.epoch import ReadItem
from ray_ingest.reader import read_options
from ray_ingest.sizing import block_rows
from ray_ingest.source import read_item
from ray_ingest.window import Execution

log = logging.getLogger(__name__)

Block = dict[str, np.ndarray]

#: ``__actor__`` of the rows the head decoded (not a decode actor of the pool).
HEAD_ACTOR = "head-start"
HEAD_THREAD = "ray_ingest-head"


class _QuietHead(logging.Filter):
    """Drops the read and decode stages' "skip …" lines in the head's thread: the loader's
    skip filter logs every skip once, with its rank (in a decode actor they go to its log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.threadName == HEAD_THREAD and str(record.msg).startswith("skip"))


for _name in ("ray_ingest.source", "ray_ingest.decode"):
    logging.getLogger(_name).addFilter(_QuietHead())


class LocalExecution:
    """Read and decode ``items`` in this process: what the Ray edge computes, without Ray."""

    def __init__(self, cfg: Config, catalog: Catalog, items: Sequence[ReadItem],
                 metric_tags: dict[str, str] | None = None):
        self.cfg, self.catalog, self.items = cfg, catalog, list(items)
        self.decoder = Decoder(cfg.decode, seed=cfg.loader.seed, on_error=cfg.loader.on_error)
        self.metric_tags = metric_tags
        self.opts = read_options(cfg)
        self.rows_per_block = block_rows(cfg)
        self.closed = False
        self.read = 0

    @classmethod
    def factory(cls, cfg: Config, catalog: Catalog):
        return lambda items: cls(cfg, catalog, items)

    def item_blocks(self, item: ReadItem) -> Iterator[Block]:
        """The decoded blocks of one read item."""
        self.read += 1
        for table in read_item(self.catalog.shard(item.sid), item, self.opts,
                               self.rows_per_block, self.cfg.loader.on_error, self.metric_tags):
            yield self.decoder(table)

    def blocks(self) -> Iterator[Block]:
        for item in self.items:
            if self.closed:
                return
            yield from self.item_blocks(item)

    def stats(self) -> str:
        return f"local: {self.read} read items"

    def close(self) -> None:
        self.closed = True


class HeadStart:
    """An :class:`~ray_ingest.window.Execution`: ``local`` serves the first items, ``remote``
    the rest (see module docstring).

    Args:
        local: decodes single items in this process (:class:`LocalExecution`).
        remote: the ordered execution reading every one of ``items``.
        items: the read items, in stream order.
        max_rows: the most rows the head decodes.
    """

    def __init__(self, local: LocalExecution, remote: Execution, items: Sequence[ReadItem],
                 max_rows: int):
        self._local, self._remote = local, remote
        self._items = [it for it in items if it.count > 0]
        self._max_rows = max_rows
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._switched = threading.Event()  # the remote took over: head and pump stop
        self._closed = False
        self._unused = False
        self._local_go = threading.Semaphore(1)  # the head works one item ahead
        self._remote_go = threading.Semaphore(1)  # the pump holds one remote block at a time
        self._gen: Iterator[Block] | None = None
        self._threads: list[threading.Thread] = []
        #: Rows the head delivered, and remote rows dropped because the head had delivered them.
        self.head_rows = 0
        self.dropped_rows = 0

    def start(self) -> None:
        """Start both: the head decodes its first item, the remote execution starts."""
        if self._gen is not None:
            return
        self._gen = self._remote.blocks()
        start = getattr(self._remote, "start", None)
        if start is not None:
            start()
        for target, name in ((self._head, HEAD_THREAD), (self._pump, "ray_ingest-pump")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _head(self) -> None:
        rows, complete = 0, False
        try:
            for item in self._items:
                if rows >= self._max_rows:
                    break
                self._local_go.acquire()
                if self._switched.is_set():
                    return
                blocks = []
                for block in self._local.item_blocks(item):
                    block[ACTOR] = np.full(len(block[SEQ]), HEAD_ACTOR, dtype=object)
                    blocks.append(block)
                rows += item.count
                self._events.put(("local", blocks))
            else:
                complete = True
        except Exception as exc:  # the remote reads the same items and reports the truth
            log.debug("head start stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._events.put(("local_end", complete))

    def _pump(self) -> None:
        """Pulls remote blocks while the head serves; hands the generator back when switched."""
        try:
            while True:
                self._remote_go.acquire()
                if self._switched.is_set():
                    return
                block = next(self._gen, None)
                self._events.put(("remote", block))
                if block is None:
                    return
        except BaseException as exc:
            self._events.put(("error", exc))

    def blocks(self) -> Iterator[Block]:
        self.start()
        delivered = seen = 0  # rows the head delivered; remote rows received
        while True:
            kind, value = self._events.get()
            if kind == "error":
                raise value
            if kind == "local" and not self._switched.is_set():
                self._local_go.release()  # the next item is decoded while this one trains
                n = sum(len(b[SEQ]) for b in value)
                delivered += n
                self.head_rows += n
                yield from value
            elif kind == "remote":
                if value is None:
                    return  # the remote ended inside what the head delivered: all delivered
                n = len(value[SEQ])
                if seen + n > delivered:  # a row the head has not delivered: switch
                    first = value if seen >= delivered else {
                        k: v[delivered - seen:] for k, v in value.items()}
                    self.dropped_rows += max(0, delivered - seen)
                    break
                seen += n
                self.dropped_rows += n
                self._remote_go.release()
            elif kind == "local_end" and value and not self._switched.is_set():
                self._unused = True  # the head delivered every item: nothing is left for
                self._remote.close()  # the remote
                return
            # else the head stopped early: wait for the remote to pass what it delivered
        self._switch()
        log.debug("head start: %d rows decoded in this process, %d remote rows dropped",
                  self.head_rows, self.dropped_rows)
        yield first
        yield from self._gen

    def _switch(self) -> None:
        """Stop the head and the pump; the consumer's thread iterates the remote from here."""
        self._switched.set()
        self._local_go.release()
        self._remote_go.release()
        # the pump waits for its go (it handed over the block that switched): it ends at once;
        # an item the head is decoding meanwhile is dropped (the remote delivers it)
        self._threads[1].join()

    def stats(self) -> str | None:
        text = None if self._unused else self._remote.stats()
        head = (f"head start: {self.head_rows} rows decoded in the consumer's process, "
                f"{self.dropped_rows} rows of the execution dropped")
        return f"{text}\n{head}" if text else head

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._switched.set()
        self._local_go.release()
        self._remote_go.release()
        self._local.close()
        self._remote.close()
