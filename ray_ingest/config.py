"""Configuration: YAML files loaded into frozen attrs classes, validated at construction.

Every error names the field (``loader.batch_size``), the expected and the actual value.
Sections: ``data`` (what to read), ``decode`` (how samples become tensors), ``loader``
(planning, batching, resume, error policy), ``train`` (the Ray Train job).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import fsspec
import yaml

from ray_ingest.catalog.shard import (
    ROOT_MODES,
)
from ray_ingest.errors import ConfigError
from ray_ingest.plan.assign import PlanParams
from ray_ingest.plan.settings import PlanSettings
from ray_ingest.redact import options_repr, register
from ray_ingest.twintar.twin import ALIGN_MODES, DEFAULT_READ_AHEAD

log = logging.getLogger(__name__)

CROP_MODES = ("center", "random")
DEVICES = ("cpu", "cuda")
GPU_BACKENDS = ("auto", "nvimgcodec", "torchcodec", "torchvision")
#: ``decode.decoders`` spec names (what each decodes: ray_ingest.decode.modalities).
DECODER_SPECS = frozenset({"auto", "image", "rgb", "gray", "npy", "int", "text", "json",
                           "caption", "bytes", "pickle"})
#: webdataset's names for some of them.
DECODER_ALIASES = {"rgb8": "rgb", "l8": "gray", "l": "gray", "txt": "text", "cls": "int",
                   "raw": "bytes"}
#: ``decode.resample`` modes (ray_ingest.decode.geometry).
RESAMPLE_MODES = ("nearest", "bilinear", "none")
#: ``decode.resizer`` values (ray_ingest.decode.resize_torch).
RESIZERS = ("pillow", "torch")
ON_ERROR = ("raise", "skip")
COMPUTE_MODES = ("auto", "actors", "tasks", "threads", "process")
POOL_SCOPES = ("job", "rank")
GROUP_SHARE = ("broadcast", "off")


def _tuple(value: Any) -> tuple:
    if isinstance(value, str):
        return tuple(v for v in value.split(",") if v)
    return tuple(value)


def _one_of(choices: tuple[str, ...]):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ConfigError(
                f"{_section(inst)}.{attribute.name}: expected one of {', '.join(choices)}, "
                f"got {value!r}"
            )

    return check


def _at_least(lo: float):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo:
            raise ConfigError(
                f"{_section(inst)}.{attribute.name}: expected a number >= {lo}, got {value!r}")

    return check


def _opt_at_least(lo: float):
    inner = _at_least(lo)

    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None:
            inner(inst, attribute, value)

    return check


def _section(inst: Any) -> str:
    return getattr(type(inst), "SECTION", type(inst).__name__)


@attrs.frozen
class DataConfig:
    """Which twin-tar datasets to read and how to align them."""

    SECTION = "data"
    #: wdinfo.json files or folders searched for them (local, gs://, memory://).
    paths: tuple[str, ...] = attrs.field(converter=_tuple)
    #: Modality folders to read; the first drives alignment.
    modalities: tuple[str, ...] = attrs.field(default=("image", "caption"), converter=_tuple)
    #: Modalities that may be absent for a sample.
    optional_modalities: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    #: Where the tars are: the wdinfo's root (wdinfo, PiD's rule) or the folder holding it.
    root: str = attrs.field(default="wdinfo", validator=_one_of(ROOT_MODES))
    #: Twin alignment: strict | merge | index.
    align: str = attrs.field(default="strict", validator=_one_of(ALIGN_MODES))
    #: Parquet key list for align=index.
    index_path: str | None = None
    #: merge/index alignment: members a secondary modality may read ahead (and hold in memory)
    #: looking for a key; a key not found within them is an error, or a recorded skip under
    #: loader.on_error=skip. Tars with the sharder's key index need no read-ahead for absent keys.
    max_read_ahead: int = attrs.field(default=DEFAULT_READ_AHEAD, validator=_at_least(1))
    #: fsspec storage options for remote paths (e.g. token, project). Redacted wherever the
    #: config is shown (repr, the job's Ray Train config, logs, errors): ray_ingest.redact.
    storage_options: dict[str, Any] = attrs.field(factory=dict, repr=options_repr)

    def __attrs_post_init__(self) -> None:
        register(self.storage_options)

    @paths.validator
    def _paths(self, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise ConfigError("data.paths: expected at least one dataset path, got none")

    @modalities.validator
    def _modalities(self, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise ConfigError("data.modalities: expected at least one modality, got none")



@attrs.frozen
class DecodeConfig:
    """How raw members become arrays: image decode + resize/crop, captions, embeddings."""

    SECTION = "decode"
    #: Modality holding images (None: no image decode).
    image_modality: str | None = "image"
    #: Modality holding JSON/text captions (None: none).
    caption_modality: str | None = "caption"
    #: Modality holding .npy embeddings (None: none).
    embedding_modality: str | None = None
    #: Output side for square crops; with buckets, the base side (area = resolution**2).
    resolution: int = attrs.field(default=256, validator=_at_least(8))
    #: Aspect-ratio buckets ("16:9", ...) — resize each shard's images to its bucket's shape.
    buckets: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    #: center | random (random crops are seeded per sample from the run seed).
    crop: str = attrs.field(default="center", validator=_one_of(CROP_MODES))
    #: Allow pickle-like members (.pkl, .pickle, .pt, .pth): they execute code when loaded.
    allow_pickle: bool = False
    #: Largest member accepted, in bytes: checked from the tar header before the payload is
    #: read (a bigger member is an error, or a recorded skip under loader.on_error=skip).
    max_member_bytes: int = attrs.field(default=512 * 1024**2, validator=_at_least(1))
    #: Pillow's decompression-bomb limit in pixels.
    max_image_pixels: int = attrs.field(default=178_956_970, validator=_at_least(1))
    #: What decodes: ``actors``, an elastic pool of pool_min..pool_max decode actors of the
    #: rank's own (Ray core: execution/pool.py; with ``loader.fused_read: false``, Ray Data read
    #: tasks feeding a Ray Data actor pool); ``tasks``, one Ray task per read item on reused
    #: worker processes, at most 2 x pool_max in flight; ``process``, ``threads`` companion
    #: actors on the rank's node, one decoder each (decode off the trainer's process);
    #: ``threads``, ``threads`` threads of the rank's own process (no Ray); ``auto``, process on
    #: a small single-node cluster, actors on larger ones, threads without a running Ray
    #: (:func:`ray_ingest.execution.threads.resolve_compute`).
    compute: str = attrs.field(default="auto", validator=_one_of(COMPUTE_MODES))
    #: Decode threads of ``compute: threads``, companions of ``process`` (None: the cores this
    #: process may use, shared by the node's decoding pipelines; twice them for ``threads``,
    #: where a thread waiting for the GIL leaves its core to another).
    threads: int | None = attrs.field(default=None, validator=_opt_at_least(1))
    #: ``compute: auto`` decodes in threads on a one-node cluster whose node (as this process
    #: sees it) has at most this many cores, where decode actors cost more than they add.
    small_node_cores: int = attrs.field(default=4, validator=_at_least(0))
    #: Whose decode actors (``compute: actors`` on the rank's own pool): ``job``, one pool
    #: shared by every rank of the job, sized by a controller from all ranks' data-wait and
    #: the workers' busy time, run earliest step first (ray_ingest.execution.service); ``rank``,
    #: each rank's own pool of pool_min..pool_max actors (ray_ingest.execution.pool).
    pool_scope: str = attrs.field(default="job", validator=_one_of(POOL_SCOPES))
    #: Elastic decode actor pool: min..max actors (tasks: pool_max is the concurrency cap).
    #: With ``pool_scope: job``: the job keeps at least pool_min and at most pool_max x its
    #: decoding ranks.
    pool_min: int = attrs.field(default=1, validator=_at_least(1))
    pool_max: int = attrs.field(default=2, validator=_at_least(1))
    #: Logical CPUs per decode actor (fractional avoids small-cluster deadlocks).
    num_cpus: float = attrs.field(default=0.5, validator=_at_least(0.0))
    #: Ray placement label selector for decode actors and read tasks ({"pool": "cpu-decode"}).
    label_selector: dict[str, str] = attrs.field(factory=dict)
    #: Seconds the pool must stay under-used before it shrinks: a pause of the train loop
    #: (checkpoint, validation) shorter than this keeps its actors (0: Ray's default).
    scale_down_hold_s: float = attrs.field(default=30.0, validator=_at_least(0.0))
    #: Benchmarks only (bench/scale_out.py): seconds every decoded sample sleeps, a decode cost
    #: that holds no core and no GIL, so decode capacity scales with the decoders alone, not
    #: with this machine's cores (0: off; never set it for training).
    sim_cost_s: float = attrs.field(default=0.0, validator=_at_least(0.0))
    #: Benchmarks only: each sample's sleep varies by up to this fraction of ``sim_cost_s``
    #: either way, drawn from (loader.seed, shard, index) through hashlib (never time or pid).
    sim_cost_jitter: float = attrs.field(default=0.0, validator=_at_least(0.0))

    #: Decoder per modality, overriding the one its member extension picks (``auto``):
    #: ``{depth: image, meta: bytes}``; spec names in ray_ingest.decode.modalities.SPECS
    #: (docs/configuration.md "Decoders and roles").
    decoders: dict[str, str] = attrs.field(factory=dict)
    #: Resampling of an image-like modality other than ``image_modality`` when it takes the
    #: sample's geometry: ``nearest`` (single-channel: masks, depth, labels), ``bilinear``
    #: (colour images), or ``none`` (keep its own size, no crop or flip).
    resample: dict[str, str] = attrs.field(factory=dict)
    #: Flip each sample horizontally with probability 1/2 (drawn from its seed, like the crop).
    flip: bool = False
    #: Who resizes images on the CPU: ``pillow`` (bilinear, Pillow's bytes bit for bit) or
    #: ``torch`` (its antialiased bilinear on uint8: 2.6-3.8x faster with AVX2, pixels
    #: within 2 of Pillow's; ray_ingest.decode.resize_torch).
    resizer: str = attrs.field(default="pillow", validator=_one_of(RESIZERS))
    #: A user hook ``fn(sample, rng, ctx) -> dict | None`` run on every decoded sample in the
    #: decode workers: ``"package.module:function"`` (or a class, built once per worker with
    #: ``transform_kwargs``), or a callable in the Python API (ray_ingest.decode.hook).
    transform: Any = attrs.field(default=None)
    #: Keyword arguments of the hook's class (or bound to its function).
    transform_kwargs: dict[str, Any] = attrs.field(factory=dict)
    #: Where the primary image is decoded: ``cpu`` (the decode workers) or ``cuda`` (the
    #: workers decide each sample's geometry and ship the JPEG bytes; the trainer decodes the
    #: batch on its GPU: ray_ingest.loader.device_decode).
    device: str = attrs.field(default="cpu", validator=_one_of(DEVICES))
    #: GPU decoder of ``device: cuda``: nvImageCodec, TorchCodec, torchvision (``auto``: the
    #: first of these installed).
    gpu_backend: str = attrs.field(default="auto", validator=_one_of(GPU_BACKENDS))

    @property
    def decoded_modalities(self) -> tuple[str, ...]:
        """The image, caption and embedding modalities that are set, in that order."""
        return tuple(m for m in (self.image_modality, self.caption_modality,
                                 self.embedding_modality) if m is not None)

    def __attrs_post_init__(self) -> None:
        if self.sim_cost_jitter > 1:
            raise ConfigError(f"decode.sim_cost_jitter: expected a fraction in [0, 1], "
                              f"got {self.sim_cost_jitter!r}")
        if self.pool_max < self.pool_min:
            raise ConfigError(
                f"decode.pool_max: expected >= decode.pool_min ({self.pool_min}), "
                f"got {self.pool_max}"
            )
        for b in self.buckets:
            parts = b.replace("_", ":").split(":")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ConfigError(f"decode.buckets: expected entries like '16:9', got {b!r}")
        _check_decoders(self)


def _check_decoders(dc: DecodeConfig) -> None:
    """decode.decoders, resample and transform: known names, the right types."""
    for section, mapping, names in (("decoders", dc.decoders, DECODER_SPECS),
                                    ("resample", dc.resample, RESAMPLE_MODES)):
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"decode.{section}: expected a mapping of modality to name, got "
                              f"{type(mapping).__name__}")
        for modality, name in mapping.items():
            key = (DECODER_ALIASES.get(name, name) if section == "decoders"
                   and isinstance(name, str) else name)
            if key not in names:
                raise ConfigError(f"decode.{section}.{modality}: expected one of "
                                  f"{', '.join(sorted(names))}, got {name!r}")
    t = dc.transform
    if t is not None and not callable(t) and not (isinstance(t, str) and _object_ref(t)):
        raise ConfigError(f"decode.transform: expected 'package.module:name' or a callable, "
                          f"got {t!r}")
    if not isinstance(dc.transform_kwargs, Mapping):
        raise ConfigError(f"decode.transform_kwargs: expected a mapping, got "
                          f"{type(dc.transform_kwargs).__name__}")
    if dc.transform_kwargs and t is None:
        raise ConfigError("decode.transform_kwargs: set without decode.transform")


def _object_ref(text: str) -> bool:
    """``package.module:attr.path`` (the entry-point form) or ``package.module.attr``."""
    mod, sep, attr = text.partition(":")
    parts = [*mod.split("."), *(attr.split(".") if sep else [])]
    return all(p.isidentifier() for p in parts) and (bool(sep) or len(parts) > 1)


@attrs.frozen
class LoaderConfig(PlanSettings):
    """Planning, batching, resume and error policy.

    seed, seed_mode, shuffle, repeat and equal_work are :class:`PlanSettings` (declared once,
    shared with the planner and ``ray-ingest plan``).
    """

    SECTION = "loader"
    #: Samples per batch on each rank.
    batch_size: int = attrs.field(default=16, validator=_at_least(1))
    #: Read streams per rank (PiD's DataLoader workers): shapes the shard lists.
    read_workers: int = attrs.field(default=2, validator=_at_least(1))
    #: Logical CPUs per read task.
    read_num_cpus: float = attrs.field(default=0.25, validator=_at_least(0.0))
    #: Read tasks in flight per rank. Bounded on purpose: with fractional CPUs Ray would
    #: otherwise start dozens of worker processes (each importing ray.data) before decoding.
    read_concurrency: int = attrs.field(default=2, validator=_at_least(1))
    #: Samples per read task and per Arrow block (strict alignment cuts shards into tasks of
    #: this size so decode overlaps reading; other modes read whole slices in such blocks).
    block_rows: int = attrs.field(default=128, validator=_at_least(1))
    #: Upper bound on one decoded block (rows x H x W x 3 bytes): block_rows is lowered to fit,
    #: down to one row, so (prefetch_batches + 1) blocks fit a small object store
    #: (ray_ingest.decode.sizing; docs/operations.md "Object-store sizing").
    max_block_bytes: int = attrs.field(default=32 * 1024**2, validator=_at_least(1))
    #: Deterministic batch order (preserve_order). False trades determinism for throughput.
    ordered: bool = True
    #: Batches prefetched by the Ray iterator.
    prefetch_batches: int = attrs.field(default=2, validator=_at_least(0))
    #: Decode actors read their own items (no read tasks, no raw bytes through the object
    #: store); false: read tasks (``read_concurrency``, ``read_num_cpus``) feed the actors.
    fused_read: bool = True
    #: Batches of an execution's first items that the consumer's own process reads and
    #: decodes while the decode actors start (ray_ingest.execution.headstart); the execution reads
    #: the items after them. 0: off. Only with ordered delivery. None (default): 2, or 0 with
    #: a ``decode.label_selector`` (decoding is meant for those nodes then); a number set here
    #: holds with a label selector too: the first batches of each execution (the job's start,
    #: a resume, each window of epochs) then use the trainer's CPUs.
    head_start_batches: int | None = attrs.field(default=None, validator=_opt_at_least(0))
    #: Logical CPUs this rank's Ray Data execution (``fused_read: false``) may use (read tasks
    #: + decode actors). None: an equal share of the cluster, its CPUs / the number of ranks.
    #: The rank's own pool ignores it (its CPUs: pool_max x decode.num_cpus).
    cpu_limit: float | None = attrs.field(default=None, validator=_opt_at_least(0.0))
    #: Object-store bytes this rank's execution may hold (backpressure beyond it). The pool:
    #: items in flight capped at this / one decoded block (within its window), None: the window
    #: alone. Ray Data: the executor's budget, None: the cluster's store / the number of ranks.
    object_store_limit: int | None = attrs.field(default=None, validator=_opt_at_least(1))
    #: Read items one execution plans ahead: it reads as many whole epochs as fit (at least
    #: the current one), so start-up is paid once per job on small epochs, once per epoch on
    #: huge ones (on Ray Data every planned read task is ``ray.put`` when an execution starts).
    max_planned_items: int = attrs.field(default=4096, validator=_at_least(1))
    #: raise | skip (bad samples are logged, counted and recorded in the read state).
    on_error: str = attrs.field(default="raise", validator=_one_of(ON_ERROR))
    #: Skip budgets for on_error=skip (None: unlimited).
    max_skips_per_shard: int | None = attrs.field(default=16, validator=_opt_at_least(0))
    max_skips_per_epoch: int | None = attrs.field(default=1000, validator=_opt_at_least(0))
    #: Fail (StallError) when the train loop waits this long for the next decoded block, e.g.
    #: a lost decode node whose actors cannot restart anywhere (None: wait forever). Only time
    #: spent waiting counts: pauses of the train loop (checkpoints, validation) never trip it.
    stall_timeout_s: float | None = attrs.field(default=900.0, validator=_opt_at_least(1))
    #: How the ranks of a parallel group (train.group_size > 1) get their identical batches:
    #: ``broadcast``: the group's first rank reads and decodes, and broadcasts every batch to
    #: the others over torch.distributed (gloo on CPU, NCCL on GPUs); ``off``: every rank
    #: reads and decodes the same stream itself (G x the decode CPU and storage reads).
    group_share: str = attrs.field(default="broadcast", validator=_one_of(GROUP_SHARE))
    #: Longest wait of a group's rank for its leader's next batch (a lost leader, or one
    #: stuck on data): fails with a GroupError naming the group and the step.
    group_timeout_s: float = attrs.field(default=1800.0, validator=_at_least(1))
    #: Honour PiD's WDS_START_INDEX / WDS_EPOCH_NUM as a starting point (pid seed mode only).
    pid_env: bool = False

    def plan_params(self, start_index: int = 0) -> PlanParams:
        """The planner's parameters for this config (PiD's start index, if any, given)."""
        return PlanParams.from_settings(self, start_index)


@attrs.frozen
class TrainConfig:
    """The Ray Train job (jobs/train.py)."""

    SECTION = "train"
    #: Ray Train workers (ranks).
    num_workers: int = attrs.field(default=2, validator=_at_least(1))
    #: Ranks per parallel group (TP*CP*PP) that must see identical data.
    group_size: int = attrs.field(default=1, validator=_at_least(1))
    use_gpu: bool = False
    #: Logical CPUs per Train worker.
    cpus_per_worker: float = attrs.field(default=0.5, validator=_at_least(0.0))
    #: Stop after this many steps (None: run all epochs).
    max_steps: int | None = attrs.field(default=None, validator=_opt_at_least(1))
    epochs: int = attrs.field(default=1, validator=_at_least(1))
    learning_rate: float = attrs.field(default=1e-3, validator=_at_least(0.0))
    #: Report a checkpoint every N steps (and at the end).
    checkpoint_every: int = attrs.field(default=50, validator=_at_least(1))
    #: Log throughput and data-wait every N steps.
    log_every: int = attrs.field(default=20, validator=_at_least(1))
    #: RunConfig storage path (shared storage on multi-node clusters).
    storage_path: str = "/tmp/ray_ingest_runs"
    #: RunConfig name: re-running with the same name resumes.
    name: str = "ray_ingest_demo"
    #: FailureConfig.max_failures.
    max_failures: int = attrs.field(default=1, validator=_at_least(-1))
    #: Ray placement label selector for trainers ({"pool": "gpu-train"}).
    label_selector: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class Config:
    data: DataConfig
    decode: DecodeConfig = attrs.field(factory=DecodeConfig)
    loader: LoaderConfig = attrs.field(factory=LoaderConfig)
    train: TrainConfig = attrs.field(factory=TrainConfig)

    def __attrs_post_init__(self) -> None:
        listed = self.data.modalities
        for section in ("decoders", "resample"):
            for modality in getattr(self.decode, section):
                if modality not in listed:
                    raise ConfigError(f"decode.{section}.{modality}: not a modality of "
                                      f"data.modalities ({', '.join(listed)})")
        if self.decode.device == "cuda" and not self.train.use_gpu:
            raise ConfigError("decode.device: cuda decodes on the trainers' GPUs, so it needs "
                              "train.use_gpu: true (got false)")
        if self.decode.device == "cuda" and self.decode.image_modality not in listed:
            raise ConfigError(f"decode.device: cuda decodes decode.image_modality, which is "
                              f"not in data.modalities ({', '.join(listed)})")
        if self.train.num_workers % self.train.group_size:
            raise ConfigError(
                f"train.group_size: expected a divisor of train.num_workers "
                f"({self.train.num_workers}), got {self.train.group_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True, value_serializer=_plain)


def _plain(inst: Any, field: Any, value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "decode": DecodeConfig,
    "loader": LoaderConfig,
    "train": TrainConfig,
}


def _build(cls: type, doc: Any, section: str) -> Any:
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{section}: expected a mapping, got {type(doc).__name__}")
    doc = dict(doc)
    names = {a.name for a in attrs.fields(cls)}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]}: unknown field "
                          f"(expected one of {', '.join(sorted(names))})")
    try:
        return cls(**doc)
    except TypeError as exc:
        raise ConfigError(f"{section}: {exc}") from None


def config_from_dict(doc: Any, source: str = "<config>") -> Config:
    """Build a :class:`Config` from a decoded YAML/JSON document."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: expected a mapping at top level, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown section {unknown[0]!r} (expected {', '.join(SECTIONS)})")
    if "data" not in doc:
        raise ConfigError(f"{source}: missing section 'data'")
    parts = {name: _build(cls, doc.get(name), name) for name, cls in SECTIONS.items()}
    return Config(**parts)


def load_config(path: str, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read a YAML config (any fsspec URL) and apply ``{"section.field": value}`` overrides."""
    try:
        with fsspec.open(path, "r") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML ({str(exc).splitlines()[0]})") from None
    doc = dict(doc or {})
    for dotted, value in (overrides or {}).items():
        section, _, field = dotted.partition(".")
        doc.setdefault(section, {})
        doc[section] = {**(doc[section] or {}), field: value}
    return config_from_dict(doc, path)
