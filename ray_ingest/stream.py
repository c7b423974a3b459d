"""Per-rank stream into Ray Train: plan -> read tasks -> decode actors -> torch batches.

Inside ``train_loop_per_worker`` every rank builds its own Ray Data pipeline for the stream its
data-parallel slot is planned to read (ray_notes §6–§7: per-rank datasets, ``preserve_order``
for determinism, a custom batcher because the default collate fails on strings). Ranks of one
parallel group therefore see identical batches in identical order.

The loader records what the trainer *consumed* (stream positions of delivered batches plus
samples skipped under ``on_error=skip``), never what was prefetched; :meth:`IngestLoader.save`
writes it into the checkpoint directory under a per-rank file name.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from ray_ingest.catalog import Catalog, load_catalog
from ray_ingest.config import Config
from ray_ingest.errors import (
    ConfigError,
    IngestError,
    SkipBudgetExceeded,
    StallError,
    StateError,
)
from ray_ingest.plan.assign import PlanParams
from ray_ingest.plan.slices import ShardSlice, plan_epoch
from ray_ingest.plan.state import (
    Ranges,
    ReadState,
    add_positions,
    generation_streams,
    initial_state,
    merge_slot_states,
    next_epoch,
    slot_stream,
    subtract,
    with_progress,
    with_topology,
)
from ray_ingest.plan.topology import Topology
from ray_ingest.reader import ReadOptions
from ray_ingest.sizing import block_rows
from ray_ingest.source import ReadItem

log = logging.getLogger(__name__)

STATE_DIR = "ingest_state"
#: Epochs whose Ray Data stats text :attr:`IngestLoader.data_stats` keeps (the last ones).
DATA_STATS_KEPT = 4


def state_file(rank: int) -> str:
    """Per-rank file name: Ray Train merges all ranks' checkpoint folders into one."""
    return os.path.join(STATE_DIR, f"rank_{rank:05d}.json")


def plan_params(cfg: Config, start_index: int = 0) -> PlanParams:
    lc = cfg.loader
    return PlanParams(seed=lc.seed, seed_mode=lc.seed_mode, shuffle=lc.shuffle, repeat=lc.repeat,
                      equal_work=lc.equal_work, start_index=start_index)


def read_options(cfg: Config) -> ReadOptions:
    dc = cfg.data
    return ReadOptions(align=dc.align, optional=dc.optional_keys, index_path=dc.index_path,
                       storage_options=dict(dc.storage_options))


def read_items(stream: Sequence[ShardSlice], consumed: Ranges,
               max_rows: int | None = None) -> list[ReadItem]:
    """Unconsumed parts of a slot stream as read tasks (stream positions kept).

    With ``max_rows`` a slice is cut into tasks of at most that many samples: each task is one
    block, so decoding starts after the first block instead of after a whole shard (only valid
    for positional alignment, where a task can seek straight to its first sample).
    """
    out = []
    for seq, sl in subtract(stream, consumed):
        step = max_rows or sl.count
        for off in range(0, sl.count, step):
            n = min(step, sl.count - off)
            out.append(ReadItem(seq + off, sl.shard, sl.start + off, n, sl.pad))
    return out


def bucket_of_shards(catalog: Catalog, buckets: Sequence[str]) -> list[str]:
    """Batch group of each shard: its aspect bucket when bucketing, else one group."""
    if not buckets:
        return ["" for _ in catalog.shards]
    return [s.bucket or "" for s in catalog.shards]


def expected_batches(streams: Sequence[Sequence[ShardSlice]], shard_bucket: Sequence[str],
                     batch_size: int) -> int:
    """Batches every rank delivers in a generation: the most any slot needs (others pad)."""
    best = 0
    for stream in streams:
        per: dict[str, int] = {}
        for sl in stream:
            b = shard_bucket[sl.shard]
            per[b] = per.get(b, 0) + sl.count
        best = max(best, sum(math.ceil(n / batch_size) for n in per.values()))
    return best


@attrs.define
class Batch:
    """One training batch: tensors (on the device) plus per-sample provenance."""

    data: dict[str, Any]
    keys: list[str]
    captions: list[str] | None
    sids: list[int]
    indices: list[int]
    pads: list[bool]
    bucket: str
    epoch: int
    #: Batch number within the epoch (0-based), identical on every rank.
    step_in_epoch: int
    #: Samples skipped (on_error=skip) and accounted with this batch: (shard id, index, reason).
    skipped: list[tuple[int, int, str]] = attrs.field(factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.data[name]


@attrs.define
class StageClock:
    """Wall time per stage seen by the train loop (seconds)."""

    wait: float = 0.0  # blocked on the Ray iterator (read+align+decode not ready)
    assemble: float = 0.0  # batching rows on the trainer
    transfer: float = 0.0  # host -> device (tensor creation, pinning, copy)
    compute: float = 0.0  # the caller's own step time (set by the train loop)
    read: float = 0.0  # read+align seconds spent by read tasks (parallel, other processes)
    decode: float = 0.0  # decode seconds spent by decode actors (parallel, other processes)
    batches: int = 0
    samples: int = 0

    def to_dict(self) -> dict[str, float]:
        return attrs.asdict(self)


class IngestLoader:
    """The rank's loader. One per ``train_loop_per_worker``.

    Args:
        cfg: the run configuration.
        topology: this rank's topology (``detect_topology()`` inside Ray Train).
        catalog: parsed once on the driver and passed in (PiD's rank-0 parse-and-broadcast);
            loaded from ``cfg.data.paths`` when None.
        state: a restored read state (None: start at epoch 0).
        device: torch device for tensors (None: leave on CPU as numpy -> torch).
    """

    def __init__(self, cfg: Config, topology: Topology, catalog: Catalog | None = None,
                 state: ReadState | None = None, device: Any = None, start_index: int = 0,
                 start_epoch: int = 0):
        import torch  # noqa: F401 - imported here, not on the first batch of the hot path

        if topology.group_size > 1 and not cfg.loader.ordered:
            # unordered delivery differs between the ranks of a group: their batches and read
            # states would diverge, and the merged state would skip what only one rank saw
            raise ConfigError(f"loader.ordered: expected true with parallel groups "
                              f"(group_size {topology.group_size}), got false")
        self.cfg = cfg
        self.topology = topology
        self.catalog = catalog or load_catalog(list(cfg.data.paths), keys=cfg.data.keys,
                                               storage_options=cfg.data.storage_options,
                                               cache=True)
        self.counts = self.catalog.counts
        self.params = plan_params(cfg, start_index)
        self.device = device
        if state is None:
            state = initial_state(self.catalog.fingerprint, self.params, start_epoch, topology,
                                  self.catalog.fingerprint_doc(), cfg.loader.batch_size)
        else:
            state.check_compatible(self.catalog.fingerprint, self.params,
                                   self.catalog.describe_change)
            state = with_topology(state, topology, cfg.loader.batch_size)
        self.state = state
        self.clock = StageClock()
        self.data_stats: list[str] = []
        self.actors_seen: set[str] = set()
        #: Samples decoded / read per Ray node id, as reported by the decode actors and read
        #: tasks themselves (``__node__`` / ``__read_node__`` columns).
        self.decode_nodes: dict[str, int] = {}
        self.read_nodes: dict[str, int] = {}
        #: Samples skipped under on_error=skip since this loader was built, by kind of failure.
        self.skips_by_kind: dict[str, int] = {}
        self.shard_bucket = bucket_of_shards(self.catalog, cfg.decode.buckets)

    # --- checkpoints ---------------------------------------------------------------------
    @classmethod
    def restore_state(cls, checkpoint_dir: str | None) -> ReadState | None:
        """Merge the per-rank state files of a checkpoint (None when there is none)."""
        if not checkpoint_dir:
            return None
        folder = os.path.join(checkpoint_dir, STATE_DIR)
        if not os.path.isdir(folder):
            return None
        states = []
        slots_seen: set[int] = set()
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    try:
                        state = ReadState.from_dict(json.load(f))
                    except json.JSONDecodeError as exc:
                        raise StateError(f"{folder}/{name}: malformed JSON ({exc})") from None
                    except StateError as exc:
                        raise StateError(f"{folder}/{name}: {exc}") from None
                states.append(state)
                rank = name[len("rank_"):-len(".json")]
                if name.startswith("rank_") and rank.isdigit():
                    slots_seen.add(int(rank) // state.current.group_size)
        if not states:
            return None
        merged = merge_slot_states(states)
        # Every rank saves only its own slot's progress: a slot without any file would silently
        # re-read what it consumed (e.g. a checkpoint written by rank 0 alone).
        missing = sorted(set(range(merged.current.slots)) - slots_seen)
        if missing:
            group = merged.current.group_size
            names = ", ".join(os.path.basename(state_file(s * group + i))
                              for s in missing for i in range(group))
            raise StateError(f"{folder}: no read state for slot(s) {missing} (expected one of "
                             f"{names}); every rank must save its file into the checkpoint")
        return merged

    def save(self, checkpoint_dir: str) -> str:
        """Write this rank's state file into a checkpoint folder; returns its path."""
        path = os.path.join(checkpoint_dir, state_file(self.topology.rank))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.state.to_dict(), f, separators=(",", ":"))
        return path

    # --- iteration -----------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[tuple[int, Iterator[Batch]]]:
        """Yield ``(epoch, batches)`` from the saved epoch up to ``num_epochs`` (exclusive)."""
        while self.state.epoch < num_epochs:
            epoch = self.state.epoch
            yield epoch, self._epoch_batches()
            if self.state.epoch == epoch:  # the caller stopped early (max_steps): keep position
                return

    def _pipeline(self, items: list[ReadItem]):
        import ray
        from ray.data import ActorPoolStrategy

        from ray_ingest.decode import Decoder
        from ray_ingest.source import TwinTarDatasource

        cfg = self.cfg
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = cfg.loader.ordered
        ctx.enable_progress_bars = False
        ctx.execution_options.verbose_progress = False
        ctx.max_errored_blocks = 0  # never drop data silently
        # Keep an IngestError's type and one-line message (not a UserCodeException wrapper).
        ctx.raise_original_map_exception = True
        # A decode node lost with no room left for its actors' restarts stalls the (ordered)
        # execution: Ray Data's no-progress guard turns that into an error (default 30 min).
        if cfg.loader.stall_timeout_s is not None:
            ctx.execution_no_progress_timeout_s = cfg.loader.stall_timeout_s
        read_kw: dict[str, Any] = {}
        map_kw: dict[str, Any] = {}
        if cfg.decode.label_selector:
            read_kw["label_selector"] = dict(cfg.decode.label_selector)
            map_kw["label_selector"] = dict(cfg.decode.label_selector)
        source = TwinTarDatasource(self.catalog.shards, items, read_options(cfg),
                                   block_rows=block_rows(cfg), on_error=cfg.loader.on_error)
        ds = ray.data.read_datasource(source, num_cpus=cfg.loader.read_num_cpus,
                                      concurrency=cfg.loader.read_concurrency,
                                      override_num_blocks=max(1, len(items)), **read_kw)
        ds = ds.map_batches(
            Decoder,
            fn_constructor_kwargs={"cfg": cfg.decode, "seed": cfg.loader.seed,
                                   "epoch": self.state.epoch, "on_error": cfg.loader.on_error},
            compute=ActorPoolStrategy(min_size=cfg.decode.pool_min, max_size=cfg.decode.pool_max),
            num_cpus=cfg.decode.num_cpus,
            batch_size=None,
            batch_format="pyarrow",
            zero_copy_batch=True,
            udf_modifying_row_count=False,
            **map_kw,
        )
        return ds

    def _epoch_batches(self) -> Iterator[Batch]:
        cfg = self.cfg
        topo = self.topology
        slot = topo.slot
        state = self.state
        bsz = cfg.loader.batch_size
        gen = state.current
        if len(state.generations) == 1:
            if cfg.decode.buckets:
                streams = plan_epoch(self.counts, self.catalog.chunk_size, gen.slots,
                                     gen.num_workers, state.params(), state.epoch)
                stream = streams[slot]
            else:
                stream = slot_stream(state, self.counts, self.catalog.chunk_size, slot)
                streams = [stream]  # equal work: every slot has this many samples
        else:
            streams = generation_streams(state, self.counts, self.catalog.chunk_size)
            stream = streams[slot]
        total_batches = expected_batches(streams, self.shard_bucket, bsz)
        if not cfg.loader.equal_work and not cfg.decode.buckets:
            total_batches = math.ceil(sum(sl.count for sl in stream) / bsz)
        consumed = gen.consumed[slot]
        done_batches = gen.batches[slot]
        items = read_items(stream, consumed,
                           block_rows(cfg) if cfg.data.align == "strict" else None)
        log.info("rank %d slot %d epoch %d: %d read tasks, %d/%d batches done",
                 topo.rank, slot, state.epoch, len(items), done_batches, total_batches)
        skips_epoch = len(state.skips)
        skips_shard: dict[int, int] = {}
        for sid, _, _ in state.skips:
            skips_shard[sid] = skips_shard.get(sid, 0) + 1
        new_skips: list[tuple[int, int, str]] = []
        pending: list[int] = []  # stream positions consumed by the next delivered batch
        reported_skips = [0]
        buckets: dict[str, list[dict[str, np.ndarray]]] = {}
        bucket_rows: dict[str, int] = {}
        reservoir: list[tuple[str, dict[str, np.ndarray]]] = []
        step = done_batches
        # batches of this epoch delivered on earlier topologies (equal on every slot)
        earlier = sum(max(g.batches, default=0) for g in state.generations[:-1])

        def deliver(rows_parts: list[dict[str, np.ndarray]], bucket: str) -> Batch:
            nonlocal consumed, step
            t0 = time.perf_counter()
            cols = {k: np.concatenate([p[k] for p in rows_parts]) for k in rows_parts[0]}
            t1 = time.perf_counter()
            batch = self._to_batch(cols, bucket, earlier + step)
            t2 = time.perf_counter()
            self.clock.assemble += t1 - t0
            self.clock.transfer += t2 - t1
            seqs = [int(s) for s in cols["__seq__"] if s >= 0] + pending
            pending.clear()
            batch.skipped = new_skips[reported_skips[0]:]
            reported_skips[0] = len(new_skips)
            consumed = add_positions(consumed, seqs)
            step += 1
            self.state = with_progress(self.state, slot, consumed, step, new_skips)
            self.clock.batches += 1
            self.clock.samples += len(batch.keys)
            return batch

        def take(parts: list[dict[str, np.ndarray]], n: int) -> tuple[list, list]:
            out, rest, need = [], [], n
            for p in parts:
                m = len(p["__seq__"])
                if need >= m:
                    out.append(p)
                    need -= m
                elif need > 0:
                    out.append({k: v[:need] for k, v in p.items()})
                    rest.append({k: v[need:] for k, v in p.items()})
                    need = 0
                else:
                    rest.append(p)
            return out, rest

        if step < total_batches and items:
            t0 = time.perf_counter()
            ds = self._pipeline(items)
            it = iter(ds.iter_batches(batch_size=None, batch_format="numpy",
                                      prefetch_batches=cfg.loader.prefetch_batches))
            self.clock.wait += time.perf_counter() - t0  # building the pipeline blocks the loop too
            try:
                while True:
                    t0 = time.perf_counter()
                    try:
                        block = next(it, None)
                    except Exception as exc:
                        cause = _ingest_cause(exc)
                        if cause is None:
                            if type(exc).__name__ == "ExecutionTimeoutError":
                                raise self._stalled(exc) from exc
                            raise
                        raise cause from None  # one line naming shard, index/key and reason
                    self.clock.wait += time.perf_counter() - t0
                    if block is None:
                        self._keep_data_stats(ds)
                        break
                    if "__actor__" in block and len(block["__actor__"]):
                        self.actors_seen.update(set(block["__actor__"].tolist()))
                    _count_nodes(self.decode_nodes, block.pop("__node__", None))
                    _count_nodes(self.read_nodes, block.pop("__read_node__", None))
                    errors = block["__error__"]
                    bad = np.flatnonzero(errors != "") if len(errors) else np.array([], int)
                    if bad.size:
                        for i in bad:
                            sid, idx = int(block["__sid__"][i]), int(block["__index__"][i])
                            new_skips.append((sid, idx, str(errors[i])))
                            kind = _skip_kind(str(errors[i]))
                            self.skips_by_kind[kind] = self.skips_by_kind.get(kind, 0) + 1
                            log.warning("rank %d: skip shard %s key %s index %d: %s", topo.rank,
                                        self.catalog.shards[sid].path, block["__key__"][i] or "?",
                                        idx, errors[i])
                            pending.append(int(block["__seq__"][i]))
                            skips_epoch += 1
                            skips_shard[sid] = skips_shard.get(sid, 0) + 1
                            self._check_budget(sid, skips_shard[sid], skips_epoch, str(errors[i]))
                        good = np.flatnonzero(errors == "")
                        block = {k: v[good] for k, v in block.items()}
                    if not len(block["__seq__"]):
                        continue
                    block.pop("__actor__", None)
                    block.pop("__error__", None)
                    self.clock.read += float(block.pop("__t_read__").sum())
                    self.clock.decode += float(block.pop("__t_decode__").sum())
                    groups = self._split_groups(block)
                    for bucket, part in groups:
                        if all(b != bucket for b, _ in reservoir):
                            reservoir.append((bucket, {k: v[:bsz].copy() for k, v in part.items()}))
                        buckets.setdefault(bucket, []).append(part)
                        bucket_rows[bucket] = bucket_rows.get(bucket, 0) + len(part["__seq__"])
                        while bucket_rows[bucket] >= bsz and step < total_batches:
                            out, rest = take(buckets[bucket], bsz)
                            buckets[bucket] = rest
                            bucket_rows[bucket] -= bsz
                            yield deliver(out, bucket)
            finally:
                # An abandoned epoch (max_steps, an exception in the train loop) must stop its
                # Ray Data execution, or it keeps reading and decoding in the background.
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            # partial batches, in bucket order of first appearance, padded to full size
            for bucket, parts in buckets.items():
                if bucket_rows.get(bucket, 0) and step < total_batches:
                    yield deliver(self._pad(parts, bucket_rows[bucket], bsz, bucket, reservoir),
                                  bucket)
        while step < total_batches:  # rows lost to skips or alignment: pad batches
            if not reservoir:
                log.warning("rank %d: no sample to pad with; epoch %d ends after %d batches",
                            topo.rank, state.epoch, step)
                break
            bucket = reservoir[0][0]
            yield deliver(self._pad([], 0, bsz, bucket, reservoir), bucket)
        self.state = next_epoch(self.state, topo, bsz)

    def _stalled(self, exc: BaseException) -> StallError:
        dc = self.cfg.decode
        where = f"nodes with labels {dict(dc.label_selector)}" if dc.label_selector else "nodes"
        return StallError(
            f"rank {self.topology.rank} epoch {self.state.epoch}: the read/decode pipeline made "
            f"no progress for loader.stall_timeout_s ({self.cfg.loader.stall_timeout_s} s); "
            f"likely a decode node was lost and no {where} have room to restart its actors "
            f"({dc.num_cpus} CPUs each): add decode capacity, or raise loader.stall_timeout_s "
            f"if the train loop legitimately pauses that long")

    def _keep_data_stats(self, ds: Any) -> None:
        """Keep Ray Data's ``ds.stats()`` text of the finished epoch (``data_stats[-1]``)."""
        try:
            self.data_stats.append(ds.stats())
        except Exception as exc:  # diagnostics only: never fail an epoch over them
            log.warning("rank %d: Ray Data stats unavailable: %s", self.topology.rank, exc)
        del self.data_stats[:-DATA_STATS_KEPT]

    def _check_budget(self, sid: int, in_shard: int, in_epoch: int, reason: str) -> None:
        lc = self.cfg.loader
        shard = self.catalog.shards[sid].path
        if lc.max_skips_per_shard is not None and in_shard > lc.max_skips_per_shard:
            raise SkipBudgetExceeded(
                f"shard {shard}: {in_shard} samples skipped, over loader.max_skips_per_shard "
                f"({lc.max_skips_per_shard}); last: {reason}")
        if lc.max_skips_per_epoch is not None and in_epoch > lc.max_skips_per_epoch:
            raise SkipBudgetExceeded(
                f"epoch {self.state.epoch}: {in_epoch} samples skipped, over "
                f"loader.max_skips_per_epoch ({lc.max_skips_per_epoch}); last: {reason} "
                f"(shard {shard})")

    def _split_groups(self, block: dict[str, np.ndarray]) -> list[tuple[str, dict[str, np.ndarray]]]:
        if not self.cfg.decode.buckets:
            return [("", block)]
        labels = block["__bucket__"]
        out = []
        for b in dict.fromkeys(labels.tolist()):
            idx = np.flatnonzero(labels == b)
            out.append((b, {k: v[idx] for k, v in block.items()}))
        return out

    @staticmethod
    def _pad(parts: list[dict[str, np.ndarray]], have: int, bsz: int, bucket: str,
             reservoir: list[tuple[str, dict[str, np.ndarray]]]) -> list[dict[str, np.ndarray]]:
        """Fill a partial batch with marked duplicates of its own rows (an empty one: of the
        epoch's first rows seen). Never of rows a restart may have skipped: the padding, like
        the rest of the batch, must not depend on where the run resumed."""
        parts = list(parts)
        need = bsz - have
        if have:
            src = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        else:
            src = next((rows for b, rows in reservoir if b == bucket), reservoir[0][1])
        while need > 0:
            n = min(need, len(src["__seq__"]))
            pad = {k: v[:n].copy() for k, v in src.items()}
            pad["__seq__"] = np.full(n, -1, dtype=np.int64)  # not a consumption
            pad["__pad__"] = np.ones(n, dtype=bool)
            parts.append(pad)
            need -= n
        return parts

    def _to_batch(self, cols: dict[str, np.ndarray], bucket: str, step: int) -> Batch:
        cfg = self.cfg.decode
        data: dict[str, Any] = {}
        tensor_keys = [k for k in (cfg.image_key,) if k is not None]
        if cfg.embedding_key is not None and cols.get(cfg.embedding_key) is not None:
            emb = cols[cfg.embedding_key]
            if emb.dtype != object:
                tensor_keys.append(cfg.embedding_key)
            else:
                data[cfg.embedding_key] = list(emb)
        import torch

        for k in tensor_keys:
            arr = cols[k]
            if arr.dtype == object:
                arr = np.stack(list(arr))
            t = torch.from_numpy(np.ascontiguousarray(arr))
            if self.device is not None and getattr(self.device, "type", str(self.device)) != "cpu":
                t = t.pin_memory().to(self.device, non_blocking=True)
            data[k] = t
        captions = None
        if cfg.caption_key is not None and cfg.caption_key in cols:
            captions = [str(c) for c in cols[cfg.caption_key]]
        return Batch(
            data=data,
            keys=[str(k) for k in cols["__key__"]],
            captions=captions,
            sids=[int(s) for s in cols["__sid__"]],
            indices=[int(i) for i in cols["__index__"]],
            pads=[bool(p) for p in cols["__pad__"]],
            bucket=bucket,
            epoch=self.state.epoch,
            step_in_epoch=step,
        )

    def stage_breakdown(self, elapsed: float) -> dict[str, float]:
        """Fractions of ``elapsed`` train-loop time per stage; ``other`` is the unattributed rest.

        ``read_cpu_s``/``decode_cpu_s`` are seconds spent upstream by read tasks and decode
        actors in parallel: a high data-wait with high decode seconds means "add decoders".
        """
        c = self.clock
        if elapsed <= 0:
            return {}
        parts = {"data_wait": c.wait, "assemble": c.assemble, "transfer": c.transfer,
                 "compute": c.compute}
        out = {k: round(v / elapsed, 4) for k, v in parts.items()}
        out["other"] = round(max(0.0, 1.0 - sum(out.values())), 4)
        out["read_cpu_s"] = round(c.read, 3)
        out["decode_cpu_s"] = round(c.decode, 3)
        return out

    def metrics(self) -> dict[str, Any]:
        """Stage timings and counters collected so far (see docs/observability)."""
        return {**self.clock.to_dict(), "actors_seen": len(self.actors_seen),
                "decode_nodes": dict(self.decode_nodes), "read_nodes": dict(self.read_nodes),
                "skips_in_epoch": len(self.state.skips),
                "skips_total": sum(self.skips_by_kind.values()),
                "skips_by_kind": dict(self.skips_by_kind)}


def _count_nodes(counts: dict[str, int], nodes: np.ndarray | None) -> None:
    if nodes is None or not len(nodes):
        return
    for node, n in zip(*np.unique(nodes.astype(str), return_counts=True), strict=True):
        counts[str(node)] = counts.get(str(node), 0) + int(n)


def _ingest_cause(exc: BaseException) -> IngestError | None:
    """The :class:`IngestError` behind a Ray task error (``RayTaskError.cause``), if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        cause = getattr(cur, "cause", None)
        if not isinstance(cause, BaseException):
            if not isinstance(cur, IngestError):
                return None
            if cur.args and isinstance(cur.args[0], str) and "\n" in cur.args[0]:
                # Ray Data appends retry advice on new lines; our messages are one line.
                cur.args = (cur.args[0].split("\n", 1)[0], *cur.args[1:])
            return cur
        cur = cause
    return None


def _skip_kind(reason: str) -> str:
    """``SampleError`` / ``read/TarFormatError``: the failure class named by a skip reason."""
    parts = reason.split(": ", 2)
    return f"read/{parts[1]}" if parts[0] == "read" and len(parts) > 1 else parts[0]
