"""Shard assignment: which shards each (slot, worker) reads in one epoch, in which order.

Both seed modes share PiD's structure (``ShardlistBasic``, pid_semantics §6/§7)::

    base      = urls                      (pid)   |  urls[epoch_order(seed, epoch)]  (epoch)
    extended  = base[i % N] for i in range(ceil(N / T) * T)    T = slots * workers (repeat)
    worker    = extended[slot::slots][worker::workers]
              = extended[slot + slots*worker + slots*workers*j  for j = 0, 1, ...]
    shuffle   : random.Random(worker_seed).shuffle(worker)
    skip      : worker[(start_index // chunk_size) // workers:]

A worker's list is computed straight from that stride, never by materialising the extended
list, so one rank's lists cost O(its shards) (plus the O(N) owned permutation in epoch mode).
Entries whose extended index is ``>= N`` are the cyclic-repeat extras: planned duplicates,
flagged ``pad``.

numpy only; no Ray, no torch.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import attrs
import numpy as np

from ray_ingest.errors import ConfigError
from ray_ingest.plan.settings import SEED_MODES, PlanSettings, check_seed_mode  # noqa: F401
from ray_ingest.plan.topology import Topology, check_int

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MIX1_INV = np.uint64(pow(int(_MIX1), -1, 1 << 64))
_MIX2_INV = np.uint64(pow(int(_MIX2), -1, 1 << 64))


def _digest64(text: str) -> int:
    """First 8 bytes (big-endian) of sha256 over ``text``: stable across Python/numpy versions."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def epoch_key(seed: int, epoch: int) -> int:
    """64-bit key of the epoch permutation: sha256(``"ray_ingest:{seed}:{epoch}"``)[:8]."""
    return _digest64(f"ray_ingest:{seed}:{epoch}")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorized splitmix64 finaliser over uint64 (wrapping arithmetic)."""
    return _mix_inplace(np.array(x, dtype=np.uint64, copy=True))


def _mix_inplace(z: np.ndarray) -> np.ndarray:
    """splitmix64 of a uint64 array, overwriting it: no 80 MB temporaries at 10M shards."""
    t = np.empty_like(z)
    z += _GOLDEN
    for shift, mul in ((30, _MIX1), (27, _MIX2)):
        np.right_shift(z, np.uint64(shift), out=t)
        z ^= t
        z *= mul
    np.right_shift(z, np.uint64(31), out=t)
    z ^= t
    return z


def _unmix_inplace(z: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_mix_inplace` (splitmix64 is a bijection of uint64), in place."""
    t = np.empty_like(z)
    _unshift(z, t, 31)
    for shift, mul in ((27, _MIX2_INV), (30, _MIX1_INV)):
        z *= mul
        _unshift(z, t, shift)
    z -= _GOLDEN
    return z


def _unshift(z: np.ndarray, t: np.ndarray, shift: int) -> None:
    """Undo ``z ^= z >> shift`` in place: (I + S)^-1 = (I + S)(I + S^2)(I + S^4)... over GF(2)."""
    while shift < 64:
        np.right_shift(z, np.uint64(shift), out=t)
        z ^= t
        shift *= 2


def epoch_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """The owned global permutation of epoch ``epoch``: position i reads shard ``order[i]``.

    ``order = stable_argsort(splitmix64(epoch_key(seed, epoch) ^ arange(N)))``. Defined only
    by sha256, 64-bit wrapping integer maths and a stable sort, so it never changes with the
    Python or numpy version. Pinned by golden tests.

    splitmix64 is a bijection, so the mixed values are distinct and the argsort is the sorted
    values mapped back through the inverse mix: a plain sort, 5-10x faster than argsort at
    10M shards.
    """
    check_int("num_shards", num_shards, 0)
    check_int("seed", seed)
    check_int("epoch", epoch, 0)
    key = np.uint64(epoch_key(seed, epoch))
    order = np.arange(num_shards, dtype=np.uint64)
    order ^= key
    _mix_inplace(order).sort()
    _unmix_inplace(order)
    order ^= key
    return order.view(np.int64)


def worker_seed(seed_mode: str, seed: int, epoch: int, slot: int, worker: int,
                read_workers: int) -> int:
    """Seed of ``random.Random`` for one worker list.

    ``pid``: ``slot * read_workers + worker`` (PiD; ``seed`` and ``epoch`` unused).
    ``epoch``: sha256(``"ray_ingest:{seed}:{epoch}:{slot}:{worker}"``)[:8] as a big-endian int.
    """
    if check_seed_mode("seed_mode", seed_mode) == "pid":
        return slot * read_workers + worker
    return _digest64(f"ray_ingest:{seed}:{epoch}:{slot}:{worker}")


def extended_length(num_shards: int, slots: int, read_workers: int, repeat: bool) -> int:
    """Length of the (virtual) extended list: ``ceil(N/T)*T`` with repeat, else ``N``."""
    if not repeat or num_shards == 0:
        return num_shards
    t = slots * read_workers
    return -(-num_shards // t) * t


def skip_count(start_index: int, chunk_size: int, read_workers: int) -> int:
    """Entries PiD drops from the head of each worker list: ``start_index // chunk_size // K``."""
    check_int("start_index", start_index, 0)
    check_int("chunk_size", chunk_size, 1)
    return (start_index // chunk_size) // read_workers


def _start_index(inst: object, attribute: attrs.Attribute, value: object) -> None:
    check_int("PlanParams.start_index", value, 0)


@attrs.frozen
class PlanParams(PlanSettings):
    """How an epoch is planned (everything but the topology, the catalog and the epoch).

    The settings (seed, seed_mode, shuffle, repeat, equal_work) and their defaults come from
    :class:`~ray_ingest.plan.settings.PlanSettings`, shared with ``loader.*`` and
    ``ray-ingest plan``; ``LoaderConfig.plan_params()`` builds one from a config.
    """

    SECTION = "PlanParams"
    #: PiD's ``WDS_START_INDEX``: drop ``start_index // chunk_size // read_workers`` shards
    #: from the head of every worker list. 0 disables it.
    start_index: int = attrs.field(default=0, validator=_start_index)

    @classmethod
    def from_settings(cls, settings: PlanSettings, start_index: int = 0) -> PlanParams:
        """The planner's parameters for ``settings`` (a ``LoaderConfig`` works too)."""
        return cls(**settings.settings(), start_index=start_index)


#: The default parameters (epoch mode, seed 0, shuffle, no repeat, equal work).
DEFAULT_PARAMS = PlanParams()


@attrs.frozen
class WorkerShards:
    """One (slot, worker)'s ordered shard list for one epoch."""

    #: Data-parallel group id.
    slot: int
    #: Loader worker id within each rank of the group.
    worker: int
    #: Indices into ``catalog.shards``, in reading order.
    shards: tuple[int, ...]
    #: Per entry: True for a cyclic-repeat extra (a planned duplicate).
    pad: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.shards)


def _check_grid(num_shards: int, chunk_size: int, slots: int, read_workers: int,
                params: PlanParams, epoch: int) -> int:
    """Validate the common arguments; return the per-worker skip."""
    check_int("num_shards", num_shards, 0)
    check_int("slots", slots, 1)
    check_int("read_workers", read_workers, 1)
    check_int("epoch", epoch, 0)
    if not isinstance(params, PlanParams):
        raise ConfigError(f"params: expected a PlanParams, got {type(params).__name__}")
    return skip_count(params.start_index, chunk_size, read_workers)


def base_order(num_shards: int, params: PlanParams, epoch: int) -> np.ndarray | None:
    """Global order before splitting: None (identity) in pid mode, :func:`epoch_order` else."""
    if params.seed_mode == "pid":
        return None
    return epoch_order(num_shards, params.seed, epoch)


def _worker(num_shards: int, slot: int, slots: int, worker: int, read_workers: int,
            params: PlanParams, epoch: int, skip: int, order: np.ndarray | None) -> WorkerShards:
    ext = extended_length(num_shards, slots, read_workers, params.repeat)
    first = slot + slots * worker
    stride = slots * read_workers
    n = max(0, -(-(ext - first) // stride))
    pos = np.arange(n, dtype=np.int64) * stride + first
    idx = pos % num_shards if num_shards else pos
    shards = (idx if order is None else order[idx]).tolist()
    pad = (pos >= num_shards).tolist()
    if params.shuffle and n > 1:
        # Random.shuffle's swaps do not depend on the content: shuffle positions, then gather.
        perm = list(range(n))
        seed = worker_seed(params.seed_mode, params.seed, epoch, slot, worker, read_workers)
        random.Random(seed).shuffle(perm)
        shards = [shards[i] for i in perm]
        pad = [pad[i] for i in perm]
    return WorkerShards(slot=slot, worker=worker, shards=tuple(shards[skip:]),
                        pad=tuple(pad[skip:]))


def assign_slot(
    num_shards: int,
    chunk_size: int,
    slot: int,
    slots: int,
    read_workers: int,
    params: PlanParams = DEFAULT_PARAMS,
    epoch: int = 0,
    order: np.ndarray | None = None,
) -> tuple[WorkerShards, ...]:
    """Every worker list of one data-parallel slot.

    Args:
        num_shards: N, the number of shards in the catalog.
        chunk_size: Samples per shard for PiD's start-index skip (``catalog.chunk_size``).
        slot: Data-parallel group id, ``0 <= slot < slots``.
        slots: Number of data-parallel groups.
        read_workers: Loader workers per rank (K).
        params: Seed, seed mode, shuffle, repeat and start index.
        epoch: Epoch number (seeds the order in ``epoch`` mode; unused in ``pid`` mode).
        order: A precomputed :func:`base_order` to reuse across slots (optional).

    Returns:
        One :class:`WorkerShards` per worker, in worker order.
    """
    skip = _check_grid(num_shards, chunk_size, slots, read_workers, params, epoch)
    check_int("slot", slot, 0, slots, "slots")
    if order is None:
        order = base_order(num_shards, params, epoch)
    return tuple(
        _worker(num_shards, slot, slots, w, read_workers, params, epoch, skip, order)
        for w in range(read_workers)
    )


def assign_worker(
    num_shards: int,
    chunk_size: int,
    slot: int,
    slots: int,
    worker: int,
    read_workers: int,
    params: PlanParams = DEFAULT_PARAMS,
    epoch: int = 0,
    order: np.ndarray | None = None,
) -> WorkerShards:
    """One (slot, worker) list; arguments as in :func:`assign_slot`."""
    skip = _check_grid(num_shards, chunk_size, slots, read_workers, params, epoch)
    check_int("slot", slot, 0, slots, "slots")
    check_int("worker", worker, 0, read_workers, "read_workers")
    if order is None:
        order = base_order(num_shards, params, epoch)
    return _worker(num_shards, slot, slots, worker, read_workers, params, epoch, skip, order)


def assign_epoch(
    num_shards: int,
    chunk_size: int,
    slots: int,
    read_workers: int,
    params: PlanParams = DEFAULT_PARAMS,
    epoch: int = 0,
) -> list[tuple[WorkerShards, ...]]:
    """Worker lists of every slot (tests, audits, the CLI); arguments as in :func:`assign_slot`."""
    _check_grid(num_shards, chunk_size, slots, read_workers, params, epoch)
    order = base_order(num_shards, params, epoch)
    return [assign_slot(num_shards, chunk_size, s, slots, read_workers, params, epoch, order)
            for s in range(slots)]


def assign(num_shards: int, chunk_size: int, topology: Topology,
           params: PlanParams = DEFAULT_PARAMS, epoch: int = 0) -> WorkerShards:
    """The list of the worker a :class:`Topology` names (its ``slot`` and ``worker_id``)."""
    return assign_worker(num_shards, chunk_size, topology.slot, topology.slots,
                         topology.worker_id, topology.read_workers, params, epoch)


def shard_paths(paths: Sequence[str], worker: WorkerShards) -> list[str]:
    """Map a worker list's indices to shard paths (e.g. ``[s.path for s in catalog.shards]``)."""
    return [paths[i] for i in worker.shards]
