"""A decode actor of the job's shared pool (:mod:`ray_ingest.execution.service`): called by the
job's controller, or, leased, by one rank directly (:mod:`ray_ingest.execution.jobpool`)."""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from ray_ingest.catalog.shard import Shard
from ray_ingest.config import Config
from ray_ingest.decode.decoder import prepare_process
from ray_ingest.execution.local import ItemDecoder
from ray_ingest.plan.epoch import ReadItem


class SharedDecodeWorker:
    """A decode actor of the job's pool: a plain actor, so it decodes one call at a time on
    its process's main thread, whose malloc arena keeps freed memory
    (:mod:`ray_ingest.decode.memory`): it needs no environment of its own, so Ray can give it a
    prestarted worker process. Which call runs next is the controller's decision, or, while
    it is leased, its rank's: either keeps :data:`~ray_ingest.execution.fairshare.PER_WORKER`
    calls on it (one running, one queued behind it)."""

    def __init__(self, cfg: Config):
        prepare_process()  # while the pool starts, not on the first item a rank waits for
        self.cfg = cfg
        self._decoders: dict[tuple, ItemDecoder] = {}
        self.node = ray.get_runtime_context().get_node_id()
        #: Whether its last call ran on the main thread (what its memory depends on).
        self.main_thread: bool | None = None
        #: Seconds spent on leased calls, by rank, and their number (this process's: a
        #: restarted worker starts again at 0), read by the controller through :meth:`stats`.
        self.leased_busy: dict[int, float] = {}
        self.leased_done = 0
        #: This process (Ray's worker id): a restarted actor answers with another, so the
        #: controller never adds a new process's counters to the old one's.
        self.process = ray.get_runtime_context().get_worker_id()

    def ready(self) -> str:
        return self.node

    def _decode(self, tags: dict[str, str] | None, shard: Shard,
                item: ReadItem) -> tuple[float, list[dict]]:
        t0 = time.monotonic()
        self.main_thread = threading.current_thread() is threading.main_thread()
        k = tuple(sorted((tags or {}).items()))
        if k not in self._decoders:
            self._decoders[k] = ItemDecoder(self.cfg, tags)
        blocks = self._decoders[k](shard, item)
        return time.monotonic() - t0, blocks

    @ray.method(num_returns=2)
    def decode(self, tags: dict[str, str] | None, shard: Shard,
               item: ReadItem) -> tuple[float, list[dict]]:
        """``(seconds it took, the item's blocks)``: two returns, so that the controller learns
        the call's end and busy time from the first (a few bytes in its reply, at once) and
        never fetches the blocks."""
        return self._decode(tags, shard, item)

    def decode_leased(self, rank: int, tags: dict[str, str] | None, shard: Shard,
                      item: ReadItem) -> list[dict]:
        """The item's blocks, for the rank this worker is leased to, which called it itself
        (and owns the result); its busy time reaches the controller through :meth:`stats`."""
        busy, blocks = self._decode(tags, shard, item)
        self.leased_busy[rank] = self.leased_busy.get(rank, 0.0) + busy
        self.leased_done += 1
        return blocks

    def stats(self) -> dict[str, Any]:
        """Its node (a restarted actor may be on another), whether it decodes on its main
        thread, its leased calls' busy seconds by rank and number, and its process; answered
        between two calls."""
        return {"node": self.node, "main_thread": self.main_thread, "process": self.process,
                "leased_busy": dict(self.leased_busy), "leased_done": self.leased_done}
