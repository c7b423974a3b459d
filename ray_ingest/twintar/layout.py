"""Names of a twin-tar dataset on disk: ``wdinfo.json``, shard paths, aspect-bucket folders,
sample keys (PiD's layout). No Ray, no torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ray_ingest.errors import ConfigError
from ray_ingest.twintar.safepath import name_problem
from ray_ingest.twintar.tario import split_name

log = logging.getLogger(__name__)


WDINFO_NAME = "wdinfo.json"



#: Aspect-ratio buckets (width, height), in PiD's tie-breaking order (the first wins a tie).
ASPECT_RATIOS: tuple[tuple[int, int], ...] = (
    (21, 9), (16, 9), (3, 2), (4, 3), (1, 1), (3, 4), (2, 3), (9, 16),
)
#: Folder prefix of an aspect-ratio bucket (``aspect_ratio_16_9``).
BUCKET_PREFIX = "aspect_ratio_"


# --------------------------------------------------------------------------- layout helpers


def aspect_bucket(width: int, height: int,
                  ratios: Sequence[tuple[int, int]] = ASPECT_RATIOS) -> str:
    """Nearest bucket (``"16_9"``) by ``|log(w/h) - log(W/H)|``; the first wins a tie."""
    if width <= 0 or height <= 0:
        raise ConfigError(f"image size: expected positive width and height, got {width}x{height}")
    r = math.log(width / height)
    best = min(range(len(ratios)),
               key=lambda i: (abs(r - math.log(ratios[i][0] / ratios[i][1])), i))
    w, h = ratios[best]
    return f"{w}_{h}"


def bucket_dir(bucket: str) -> str:
    """Folder name of a bucket: ``aspect_ratio_16_9``."""
    return f"{BUCKET_PREFIX}{bucket}"


def shard_rel_path(shard_id: int, part_size: int = 1000) -> str:
    """``part_{id // part_size:06d}/{id:06d}.tar``, or ``{id:08d}.tar`` when part_size is 0."""
    if shard_id < 0:
        raise ConfigError(f"shard id: expected >= 0, got {shard_id}")
    if part_size < 0:
        raise ConfigError(f"part_size: expected >= 0, got {part_size}")
    if part_size == 0:
        return f"{shard_id:08d}.tar"
    return f"part_{shard_id // part_size:06d}/{shard_id:06d}.tar"


def check_key(key: str) -> None:
    """Reject keys that readers would see differently (see
    :func:`ray_ingest.twintar.tario.split_name`)."""
    parsed = split_name(f"{key}.x") if isinstance(key, str) else None
    if parsed is None or parsed[0] != key or "." in key or name_problem(key) is not None:
        raise ConfigError(
            f"sample key: expected a non-empty name without '.' that is not a __metadata__ "
            f"entry, an absolute path or holds a NUL byte, got {key!r}"
        )


def pack_shards(stems: Sequence[str], sizes: Sequence[int], shard_size: int | None,
                max_bytes: int) -> list[list[str]]:
    """Split ``stems`` (in order) into shards by count, or by cumulative size (PiD's rule:
    start a new shard when the current one is non-empty and would exceed ``max_bytes``)."""
    if shard_size is not None:
        return [list(stems[i : i + shard_size]) for i in range(0, len(stems), shard_size)]
    out: list[list[str]] = []
    cur: list[str] = []
    total = 0
    for stem, size in zip(stems, sizes, strict=True):
        if cur and total + size > max_bytes:
            out.append(cur)
            cur, total = [], 0
        cur.append(stem)
        total += size
    if cur:
        out.append(cur)
    return out
