"""Where a rank's train-loop time goes: waiting for data, batching, transfer, the caller's step.

No Ray, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import attrs

T = TypeVar("T")


@attrs.define
class StageClock:
    """Wall time per stage seen by the train loop (seconds)."""

    wait: float = 0.0  # blocked on the pipeline (read+align+decode not ready, start-up)
    assemble: float = 0.0  # batching rows on the trainer
    transfer: float = 0.0  # host -> device (tensor creation, pinning, copy)
    compute: float = 0.0  # the caller's own step time (set by the train loop)
    read: float = 0.0  # read+align seconds spent by read tasks (parallel, other processes)
    decode: float = 0.0  # decode seconds spent by decode actors (parallel, other processes)
    batches: int = 0
    samples: int = 0
    bytes_read: int = 0  # member payload bytes this rank's read tasks read (``__bytes__``)

    def to_dict(self) -> dict[str, float]:
        return attrs.asdict(self)

    def breakdown(self, elapsed: float) -> dict[str, float]:
        """Fractions of ``elapsed`` train-loop time per stage; ``other`` is the unattributed rest.

        ``read_cpu_s``/``decode_cpu_s`` are seconds spent upstream by read tasks and decode
        actors in parallel: a high data-wait with high decode seconds means "add decoders".
        """
        if elapsed <= 0:
            return {}
        parts = {"data_wait": self.wait, "assemble": self.assemble, "transfer": self.transfer,
                 "compute": self.compute}
        out = {k: round(v / elapsed, 4) for k, v in parts.items()}
        out["other"] = round(max(0.0, 1.0 - sum(out.values())), 4)
        out["read_cpu_s"] = round(self.read, 3)
        out["decode_cpu_s"] = round(self.decode, 3)
        return out


def timed(items: Iterable[T], on_wait: Callable[[float], object]) -> Iterator[T]:
    """``items``, the consumer's wait for each one (and for the end) reported to ``on_wait``."""
    it = iter(items)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            on_wait(time.perf_counter() - t0)
        yield item
