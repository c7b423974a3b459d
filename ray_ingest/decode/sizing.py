"""Object-store sizing: decoded bytes per sample and per block, and a rank's bytes in flight.

Pure arithmetic over the config (no Ray): the loader uses :func:`block_rows` to cut blocks, the
rank's decode pool (``execution/pool.py``) sizes its window of calls with it, docs/operations.md
and ``tests/execution/test_multinode.py`` use :func:`in_flight_bytes`.

Where the decoded blocks of one rank sit at once:

* on the decode nodes: each decode actor of the rank's pool holds up to ``T`` = 2 calls (one
  running, one queued), and a finished call's blocks stay in the plasma store of the actor's
  node until the rank takes them, in stream order: ``A × T × block`` for ``A`` actors (an item
  of several blocks holds more), within the rank's window of calls in flight (2 ×
  ``pool_max``, 2 × its companions in ``process`` mode, lowered by
  ``loader.object_store_limit``). With ``loader.fused_read: false``,
  Ray Data 2.60 also sends ``T`` tasks to an actor (``max_tasks_in_flight_per_actor``:
  ``max_concurrency`` 1 × factor 2), plus the decode operator's output queue (in ordered mode
  also the blocks waiting for an earlier one), which Ray Data bounds only by its object-store
  budget;
* on the consumer's node (the Train worker): ``prefetch_batches`` blocks fetched ahead by Ray
  Data's iterator, plus the one being batched: ``(P + 1) × block`` (the Ray Data figure; the
  pool takes one finished item at a time).

Ray Data's budget is ``0.5 ×`` the object store of the *whole cluster* per executor, capped for
each rank's executor by ``loader.object_store_limit`` (unset with several ranks: the cluster's
store / the number of ranks): it does not see that one node's store is small. What exceeds a
node's store is spilled to disk (decode side) or allocated in filesystem-backed fallback memory
(consumer side): slower, never lost.
"""

from __future__ import annotations

from typing import Any

from ray_ingest.config import Config, DecodeConfig
from ray_ingest.decode.augment import (
    bucket_shape,
    parse_bucket,
)

#: Calls in flight per decode actor: the pool's ``PER_WORKER``; Ray Data 2.60's
#: max_concurrency (1) × DEFAULT_ACTOR_MAX_TASKS_IN_FLIGHT_TO_MAX_CONCURRENCY_FACTOR.
TASKS_IN_FLIGHT_PER_ACTOR = 2


#: Bytes of a high-quality JPEG per output pixel (about 2.4 bits), the estimate of a
#: ``decode.device: cuda`` sample, which travels compressed (a 3840x2160 photo ~3 MB).
JPEG_BYTES_PER_PIXEL = 0.3


def decoded_sample_bytes(cfg: DecodeConfig) -> int:
    """Bytes of one decoded image (uint8 RGB) at the largest configured output shape; with
    ``decode.device: cuda``, of its JPEG (estimated), which is what travels."""
    shapes = [(cfg.resolution, cfg.resolution)]
    shapes += [bucket_shape(parse_bucket(b), cfg.resolution) for b in cfg.buckets]
    if cfg.image_modality is None:
        return 0
    pixels = max(h * w for h, w in shapes)
    return int(pixels * JPEG_BYTES_PER_PIXEL) if cfg.device == "cuda" else pixels * 3


def block_rows(cfg: Config) -> int:
    """Rows per block: ``loader.block_rows``, lowered so one decoded block stays within
    ``loader.max_block_bytes`` (at least one row)."""
    per_sample = decoded_sample_bytes(cfg.decode)
    if per_sample <= 0:
        return cfg.loader.block_rows
    return max(1, min(cfg.loader.block_rows, cfg.loader.max_block_bytes // per_sample))


def in_flight_bytes(cfg: Config, actors: int | None = None) -> dict[str, Any]:
    """Decoded bytes one rank keeps in object stores at once (lower bound, see module doc).

    Args:
        cfg: the run configuration.
        actors: decode actors of this rank (default ``decode.pool_max``).

    Returns:
        ``block_rows``, ``sample_bytes``, ``block_bytes``, ``decode_side`` (A × T blocks,
        spread over the decode nodes), ``consumer_side`` ((P + 1) blocks on the trainer's
        node) and ``total``.
    """
    rows = block_rows(cfg)
    sample = decoded_sample_bytes(cfg.decode)
    block = rows * sample
    a = cfg.decode.pool_max if actors is None else actors
    decode_side = a * TASKS_IN_FLIGHT_PER_ACTOR * block
    consumer_side = (cfg.loader.prefetch_batches + 1) * block
    return {"block_rows": rows, "sample_bytes": sample, "block_bytes": block,
            "decode_side": decode_side, "consumer_side": consumer_side,
            "total": decode_side + consumer_side}
