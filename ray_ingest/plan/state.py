"""ReadState: what a checkpoint stores so training resumes at the exact sample.

The state records what the trainer *consumed*, as ranges of stream positions per data-parallel
slot — not what the pipeline prefetched. Streams are recomputed from the plan, so the state
stays tiny (O(slots), not O(samples)):

* generation 0 is the epoch's plan on the topology the epoch started with;
* when a run resumes on a different topology (world size, group size, read workers), a new
  generation re-plans only the unconsumed, non-duplicate samples of the previous one across
  the new slots (:func:`ray_ingest.plan.slices.balance`), so the epoch stays exactly-once;
* ``skips`` lists samples skipped under ``on_error=skip`` in this epoch, so budgets and audits
  survive a restart.

Ranks of one parallel group read the same stream and therefore hold identical state.
No Ray, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from ray_ingest.errors import StateError
from ray_ingest.plan.assign import SEED_MODES, PlanParams
from ray_ingest.plan.settings import DEFAULT_SETTINGS, SETTING_NAMES
from ray_ingest.plan.slices import ShardSlice, balance, plan_epoch, plan_slot
from ray_ingest.plan.topology import Topology

STATE_VERSION = 1
STATE_KIND = "ray_ingest.ReadState"

Ranges = tuple[tuple[int, int], ...]


def add_range(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """Insert ``[lo, hi)`` into sorted disjoint ranges, merging neighbours."""
    if hi <= lo:
        return ranges
    out: list[tuple[int, int]] = []
    placed = False
    for a, b in ranges:
        if b < lo:
            out.append((a, b))
        elif hi < a:
            if not placed:
                out.append((lo, hi))
                placed = True
            out.append((a, b))
        else:
            lo, hi = min(lo, a), max(hi, b)
    if not placed:
        out.append((lo, hi))
    out.sort()
    return tuple(out)


def add_positions(ranges: Ranges, positions: Iterable[int]) -> Ranges:
    """Add single stream positions (merged into ranges)."""
    for lo, hi in _runs(sorted(positions)):
        ranges = add_range(ranges, lo, hi)
    return ranges


def _runs(sorted_positions: Sequence[int]) -> Iterable[tuple[int, int]]:
    start = prev = None
    for p in sorted_positions:
        if start is None:
            start = prev = p
        elif p == prev + 1:
            prev = p
        elif p == prev:
            continue
        else:
            yield start, prev + 1
            start = prev = p
    if start is not None:
        yield start, prev + 1


def covered(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


@attrs.frozen
class Generation:
    """One topology's share of an epoch: the slots and what each consumed."""

    world_size: int
    group_size: int
    read_workers: int
    #: Per slot: sorted, disjoint ``[lo, hi)`` ranges of consumed stream positions.
    consumed: tuple[Ranges, ...]
    #: Per slot: batches delivered in this generation (keeps per-rank batch counts equal).
    batches: tuple[int, ...] = ()
    #: Samples per batch these counts are in (0: unknown, a state saved before it was recorded).
    batch_size: int = 0

    @property
    def slots(self) -> int:
        return self.world_size // self.group_size

    def same_topology(self, topo: Topology) -> bool:
        return (self.world_size, self.group_size, self.read_workers) == (
            topo.world_size, topo.group_size, topo.read_workers)

    @classmethod
    def fresh(cls, topo: Topology, batch_size: int = 0) -> Generation:
        return cls(topo.world_size, topo.group_size, topo.read_workers,
                   tuple(() for _ in range(topo.slots)), tuple(0 for _ in range(topo.slots)),
                   batch_size)


@attrs.frozen
class ReadState:
    """Versioned, fingerprinted read offsets (see module docstring)."""

    #: Catalog fingerprint: restoring into different data fails.
    fingerprint: str
    seed: int
    seed_mode: str
    #: Plan parameters that shape streams (shuffle, repeat, equal_work, start_index).
    plan: dict[str, Any]
    epoch: int
    generations: tuple[Generation, ...]
    #: (shard id, index, reason) of samples skipped under on_error=skip in this epoch.
    skips: tuple[tuple[int, int, str], ...] = ()
    #: Summary of the dataset, so a fingerprint mismatch can say what changed.
    dataset: dict[str, Any] = attrs.field(factory=dict)
    version: int = STATE_VERSION

    @property
    def current(self) -> Generation:
        return self.generations[-1]

    def params(self) -> PlanParams:
        return PlanParams(seed=self.seed, seed_mode=self.seed_mode, **self.plan)

    # --- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "dataset": dict(self.dataset),
            "seed": self.seed,
            "seed_mode": self.seed_mode,
            "plan": dict(self.plan),
            "epoch": self.epoch,
            "generations": [
                # "num_workers": the state file's name for read workers (format version 1)
                {"world_size": g.world_size, "group_size": g.group_size,
                 "num_workers": g.read_workers,
                 "consumed": [[list(r) for r in rs] for rs in g.consumed],
                 "batches": list(g.batches), "batch_size": g.batch_size}
                for g in self.generations
            ],
            "skips": [list(s) for s in self.skips],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ReadState:
        """Parse and validate a saved state; errors name the field
        (``generations[1].consumed[0]``)."""
        if not isinstance(doc, Mapping):
            raise StateError(f"read state: expected a mapping, got {type(doc).__name__}")
        if doc.get("kind") != STATE_KIND:
            raise StateError(f"read state field 'kind': expected {STATE_KIND!r}, "
                             f"got {doc.get('kind')!r}")
        if doc.get("version") != STATE_VERSION:
            raise StateError(
                f"read state field 'version': expected {STATE_VERSION}, got {doc.get('version')!r}")
        seed_mode = _field(doc, "seed_mode", "", str)
        if seed_mode not in SEED_MODES:
            raise StateError(f"read state field 'seed_mode': expected one of "
                             f"{', '.join(SEED_MODES)}, got {seed_mode!r}")
        plan = _field(doc, "plan", "", Mapping)
        unknown = sorted(set(plan) - set(PLAN_FIELDS))
        if unknown:
            raise StateError(f"read state field 'plan.{unknown[0]}': unknown (expected one of "
                             f"{', '.join(PLAN_FIELDS)})")
        plan = {name: (_int(plan, name, "plan.", 0) if kind is int
                       else _field(plan, name, "plan.", bool))
                for name, kind in PLAN_FIELDS.items()}
        raw_gens = _field(doc, "generations", "", list)
        if not raw_gens:
            raise StateError("read state field 'generations': expected at least one, got none")
        gens = tuple(_generation(g, f"generations[{i}].") for i, g in enumerate(raw_gens))
        skips = []
        for i, sk in enumerate(_field(doc, "skips", "", list, default=[])):
            if (not isinstance(sk, list) or len(sk) != 3 or not isinstance(sk[2], str)
                    or any(not _is_int(v) or v < 0 for v in sk[:2])):
                raise StateError(f"read state field 'skips[{i}]': expected [shard id, index, "
                                 f"reason], got {sk!r}")
            skips.append((sk[0], sk[1], sk[2]))
        return cls(
            fingerprint=_field(doc, "fingerprint", "", str),
            seed=_int(doc, "seed", ""),
            seed_mode=seed_mode,
            plan=plan,
            epoch=_int(doc, "epoch", "", 0),
            generations=gens,
            skips=tuple(skips),
            dataset=dict(_field(doc, "dataset", "", Mapping, default={})),
        )

    # --- validation on restore -----------------------------------------------------------
    def check_compatible(self, fingerprint: str, params: PlanParams,
                         describe_change: Any = None) -> None:
        """Raise :class:`StateError` naming the first field that differs from this run."""
        if self.fingerprint != fingerprint:
            what = describe_change(self.dataset) if describe_change else ""
            raise StateError(
                f"read state field 'fingerprint': saved {self.fingerprint}, this dataset is "
                f"{fingerprint} (the data changed{': ' + what if what else ''})")
        mine = params_dict(params)
        for field, value in (("seed", self.seed), ("seed_mode", self.seed_mode),
                             *self.plan.items()):
            # start_index is a starting point (PiD's WDS_START_INDEX), not a property of the
            # run: the saved position supersedes whatever this run would have started from.
            if field != "start_index" and mine[field] != value:
                raise StateError(
                    f"read state field {field!r}: saved {value!r}, this run uses {mine[field]!r}")


#: Plan fields a state records under ``plan``, and their types: the planning settings
#: (:class:`~ray_ingest.plan.settings.PlanSettings`) other than seed and seed_mode, which are
#: top-level fields, plus PiD's start index.
PLAN_FIELDS: dict[str, type] = {
    **{name: type(getattr(DEFAULT_SETTINGS, name)) for name in SETTING_NAMES
       if name not in ("seed", "seed_mode")},
    "start_index": int,
}

_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(doc: Mapping[str, Any], name: str, where: str, kind: type | tuple[type, ...],
           default: Any = _MISSING) -> Any:
    if name not in doc:
        if default is not _MISSING:
            return default
        raise StateError(f"read state field '{where}{name}': missing")
    value = doc[name]
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise StateError(f"read state field '{where}{name}': expected {want}, got {value!r}")
    return value


def _int(doc: Mapping[str, Any], name: str, where: str, minimum: int | None = None) -> int:
    if name not in doc:
        raise StateError(f"read state field '{where}{name}': missing")
    value = doc[name]
    if not _is_int(value) or (minimum is not None and value < minimum):
        want = "an int" if minimum is None else f"an int >= {minimum}"
        raise StateError(f"read state field '{where}{name}': expected {want}, got {value!r}")
    return value


def _generation(doc: Any, where: str) -> Generation:
    if not isinstance(doc, Mapping):
        raise StateError(f"read state field '{where[:-1]}': expected a mapping, got {doc!r}")
    world = _int(doc, "world_size", where, 1)
    group = _int(doc, "group_size", where, 1)
    if world % group:
        raise StateError(f"read state field '{where}group_size': expected a divisor of "
                         f"world_size ({world}), got {group}")
    workers = _int(doc, "num_workers", where, 1)  # the file format's name for read workers
    slots = world // group
    consumed_doc = _field(doc, "consumed", where, list)
    batches_doc = _field(doc, "batches", where, list)
    for name, seq in (("consumed", consumed_doc), ("batches", batches_doc)):
        if len(seq) != slots:
            raise StateError(f"read state field '{where}{name}': expected {slots} slots "
                             f"(world_size {world} / group_size {group}), got {len(seq)}")
    consumed = []
    for s, rs in enumerate(consumed_doc):
        ranges: list[tuple[int, int]] = []
        ok = isinstance(rs, list)
        for r in rs if ok else ():
            ok = (isinstance(r, list) and len(r) == 2 and all(_is_int(v) for v in r)
                  and 0 <= r[0] < r[1] and (not ranges or ranges[-1][1] <= r[0]))
            if not ok:
                break
            ranges.append((r[0], r[1]))
        if not ok:
            raise StateError(f"read state field '{where}consumed[{s}]': expected sorted, "
                             f"disjoint [lo, hi) ranges with 0 <= lo < hi, got {rs!r}")
        consumed.append(tuple(ranges))
    batches = []
    for s, b in enumerate(batches_doc):
        if not _is_int(b) or b < 0:
            raise StateError(f"read state field '{where}batches[{s}]': expected an int >= 0, "
                             f"got {b!r}")
        batches.append(b)
    batch_size = _int(doc, "batch_size", where, 0) if "batch_size" in doc else 0
    return Generation(world, group, workers, tuple(consumed), tuple(batches), batch_size)


def params_dict(params: PlanParams) -> dict[str, Any]:
    return {**params.settings(), "start_index": params.start_index}


def initial_state(fingerprint: str, params: PlanParams, epoch: int, topo: Topology,
                  dataset: Mapping[str, Any] | None = None, batch_size: int = 0) -> ReadState:
    plan = {k: v for k, v in params_dict(params).items() if k not in ("seed", "seed_mode")}
    return ReadState(fingerprint=fingerprint, seed=params.seed, seed_mode=params.seed_mode,
                     plan=plan, epoch=epoch, generations=(Generation.fresh(topo, batch_size),),
                     dataset=dict(dataset or {}))


def next_epoch(state: ReadState, topo: Topology, batch_size: int | None = None) -> ReadState:
    """The state at the start of the following epoch (on the current topology).

    A PiD start index applies to the epoch it started in only: the next epoch reads everything.
    """
    bsz = state.current.batch_size if batch_size is None else batch_size
    return attrs.evolve(state, epoch=state.epoch + 1,
                        generations=(Generation.fresh(topo, bsz),),
                        skips=(), plan={**state.plan, "start_index": 0})


def with_topology(state: ReadState, topo: Topology, batch_size: int = 0) -> ReadState:
    """Continue ``state`` on ``topo``: a new generation when the topology changed, or the batch
    size (the generation's batch counts are in its batch size; 0 means unknown)."""
    cur = state.current
    if cur.same_topology(topo) and (not batch_size or not cur.batch_size
                                    or batch_size == cur.batch_size):
        return state
    return attrs.evolve(state, generations=(*state.generations,
                                            Generation.fresh(topo, batch_size)))


def subtract(stream: Sequence[ShardSlice], consumed: Ranges) -> list[tuple[int, ShardSlice]]:
    """Unconsumed parts of ``stream`` as ``(stream position, slice)`` pairs, in order."""
    out: list[tuple[int, ShardSlice]] = []
    starts = [a for a, _ in consumed]
    pos = 0
    for sl in stream:
        lo, hi = pos, pos + sl.count
        pos = hi
        if sl.count <= 0:
            continue
        cur = lo
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while cur < hi:
            while i < len(consumed) and consumed[i][1] <= cur:
                i += 1
            if i < len(consumed) and consumed[i][0] <= cur:
                cur = consumed[i][1]
                continue
            nxt = consumed[i][0] if i < len(consumed) else hi
            end = min(nxt, hi)
            out.append((cur, ShardSlice(sl.shard, sl.start + (cur - lo), end - cur, sl.pad)))
            cur = end
    return out


def generation_streams(state: ReadState, counts: Sequence[int], chunk_size: int,
                       upto: int | None = None) -> list[tuple[ShardSlice, ...]]:
    """Every slot's stream in generation ``upto`` (default: the current one)."""
    params = state.params()
    g0 = state.generations[0]
    streams = plan_epoch(counts, chunk_size, g0.slots, g0.read_workers, params, state.epoch)
    last = len(state.generations) - 1 if upto is None else upto
    for gi in range(1, last + 1):
        prev = state.generations[gi - 1]
        remainder = [sl for s, stream in enumerate(streams)
                     for _, sl in subtract(stream, prev.consumed[s]) if not sl.pad]
        streams = balance(remainder, state.generations[gi].slots)
    return streams


def slot_stream(state: ReadState, counts: Sequence[int], chunk_size: int,
                slot: int) -> tuple[ShardSlice, ...]:
    """The current generation's stream of one slot (cheap when there is one generation)."""
    if len(state.generations) == 1:
        g = state.current
        return plan_slot(counts, chunk_size, slot, g.slots, g.read_workers, state.params(),
                         state.epoch)
    return tuple(generation_streams(state, counts, chunk_size)[slot])


def with_progress(state: ReadState, slot: int, ranges: Ranges, batches: int,
                  skips: Sequence[tuple[int, int, str]] = ()) -> ReadState:
    """``state`` with one slot's consumed ranges and batch count replaced."""
    g = state.current
    consumed = list(g.consumed)
    consumed[slot] = ranges
    counts = list(g.batches)
    counts[slot] = batches
    gens = (*state.generations[:-1],
            attrs.evolve(g, consumed=tuple(consumed), batches=tuple(counts)))
    return attrs.evolve(state, generations=gens, skips=tuple(sorted({*state.skips, *skips})))


def merge_slot_states(states: Sequence[ReadState]) -> ReadState:
    """Combine per-rank states (each authoritative for its own slot of the current generation).

    Ranks of a group hold identical states; ranks of different slots differ only in their own
    slot's consumed ranges, whose union is the merged state.
    """
    if not states:
        raise StateError("read state: no per-rank states to merge")
    base = states[0]
    for other in states[1:]:
        for field in ("fingerprint", "seed", "seed_mode", "plan", "epoch"):
            if getattr(other, field) != getattr(base, field):
                raise StateError(
                    f"read state field {field!r}: ranks disagree ({getattr(base, field)!r} vs "
                    f"{getattr(other, field)!r})")
        if other.generations[:-1] != base.generations[:-1] or not other.current.same_topology(
                Topology(base.current.world_size, 0, base.current.read_workers, 0,
                         base.current.group_size)):
            raise StateError("read state field 'generations': ranks disagree")
    merged = list(base.current.consumed)
    batches = list(base.current.batches)
    skips = set(base.skips)
    for st in states[1:]:
        skips.update(st.skips)
        for s, rs in enumerate(st.current.consumed):
            for a, b in rs:
                merged[s] = add_range(merged[s], a, b)
            batches[s] = max(batches[s], st.current.batches[s])
    gens = (*base.generations[:-1],
            attrs.evolve(base.current, consumed=tuple(merged), batches=tuple(batches)))
    return attrs.evolve(base, generations=gens, skips=tuple(sorted(skips)))
