"""Pipeline metrics through ``ray.util.metrics``: the Ray dashboard, Prometheus and Grafana.

Ray exports every ``ray.util.metrics`` metric on each node's metrics endpoint
(``http://<node>:<metrics_export_port>/metrics``) with the prefix ``ray_``; counters get the
suffix ``_total``. Tags:

* ``rank``: Ray Train world rank of the loader (read tasks carry the rank they read for);
* ``slot``: its data-parallel slot (ranks of one parallel group share a slot);
* ``dataset``: the catalog fingerprint (the ``[train] dataset: … fingerprint …`` line), stable
  for the same shards and counts, so dashboards of reruns line up and two datasets never mix;
* ``kind`` (skips only): the failure class, as in ``IngestLoader.metrics()["skips_by_kind"]``.

=========================================  ==========  =========================================
exported name                              type        what
=========================================  ==========  =========================================
``ray_ingest_data_wait_seconds_total``     Counter     seconds the train loop blocked on the loader
``ray_ingest_batch_wait_seconds``          Histogram   blocked seconds per delivered batch
``ray_ingest_samples_total``               Counter     samples delivered (planned pads included)
``ray_ingest_batches_total``               Counter     batches delivered
``ray_ingest_skips_total``                 Counter     samples skipped under ``on_error: skip``
``ray_ingest_remote_retries_total``        Counter     retried remote reads (read tasks)
``ray_ingest_bytes_read_total``            Counter     member payload bytes read (read tasks)
``ray_ingest_decode_pool_size``            Gauge       decode actors that delivered recently
``ray_ingest_epoch``                       Gauge       epoch the loader is reading
``ray_ingest_decode_cpus``                 Gauge       the job's decode pool (``kind``: target,
                                                       busy), this rank's share of it
``ray_ingest_job_decode_cpus``             Gauge       the job's decode pool, whole (``kind``:
                                                       target, held, pending, busy)
=========================================  ==========  =========================================

The decode-CPU gauges come from the job's decode controller
(:mod:`ray_ingest.execution.service`, ``decode.pool_scope: job``): ``target`` is what it sizes
the pool to (a rank's: an equal share), ``held`` the CPUs of the workers up, ``pending`` those
of workers no node has room for yet (what the autoscaler sees), ``busy`` the CPUs decoding,
averaged over 5 s (a rank's: the time spent on its own items). The job gauges are tagged
``job`` (the Ray job id) and ``dataset`` instead of ``rank``/``slot``.

Gauges are set again with delivered batches (Ray's exporter drops a gauge series that is not
refreshed for about two report intervals): they disappear soon after the loader stops.

Everything is a no-op in a process without a running Ray (``ray-ingest cat``, unit tests of
the pure layers): this module imports Ray only once Ray is initialised.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

TAG_KEYS = ("rank", "slot", "dataset")
#: Upper bounds (seconds) of the per-batch wait histogram.
WAIT_BUCKETS = (0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Blocks over which the decode pool size is counted (distinct actors among the last ones).
POOL_RECENT_BLOCKS = 32
#: Ray's exporter drops a gauge series not set again within about two report intervals, so the
#: loader sets its gauges again with a delivered batch at most this often (seconds).
GAUGE_REFRESH_S = 1.0

#: name -> (kind, description, extra tag keys)
DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "ingest_data_wait_seconds": ("counter", "Seconds the train loop blocked on the loader", ()),
    "ingest_batch_wait_seconds": ("histogram", "Seconds blocked on the loader per batch", ()),
    "ingest_samples": ("counter", "Samples delivered to the train loop (pads included)", ()),
    "ingest_batches": ("counter", "Batches delivered to the train loop", ()),
    "ingest_skips": ("counter", "Samples skipped under loader.on_error=skip", ("kind",)),
    "ingest_remote_retries": ("counter", "Retried remote reads (connection, 5xx, short read)",
                              ()),
    "ingest_bytes_read": ("counter", "Member payload bytes read by read tasks", ()),
    "ingest_decode_pool_size": ("gauge", "Decode actors that delivered recently", ()),
    "ingest_epoch": ("gauge", "Epoch the loader is reading", ()),
    "ingest_decode_cpus": ("gauge", "Decode CPUs of the job's pool for this rank, by kind "
                           "(target, busy)", ("kind",)),
    "ingest_job_decode_cpus": ("gauge", "Decode CPUs of the job's pool, by kind (target, held, "
                               "pending, busy)", ("kind",)),
}
#: Metrics tagged by job instead of rank and slot.
JOB_TAG_KEYS = ("job", "dataset")
JOB_METRICS = ("ingest_job_decode_cpus",)

_LOCK = threading.Lock()
_METRICS: dict[str, Any] = {}
#: Tags of the read running in each thread of this process: one read at a time per read-task
#: worker, but several at once in a process of decode threads (its reader threads).
_READ = threading.local()


def running_ray() -> Any | None:
    """The ``ray`` module when this process already imported it and runs or joined a Ray
    instance, else None: never imports, starts or joins one (importing it alone costs ~1 s)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def _metric(name: str) -> Any | None:
    """The process's metric object for ``name`` (created on first use), None without Ray."""
    m = _METRICS.get(name)
    if m is not None or running_ray() is None:
        return m
    with _LOCK:
        if name not in _METRICS:
            from ray.util import metrics as rm

            kind, description, extra = DEFINITIONS[name]
            keys = (JOB_TAG_KEYS if name in JOB_METRICS else TAG_KEYS) + extra
            if kind == "counter":
                m = rm.Counter(name, description=description, tag_keys=keys)
            elif kind == "gauge":
                m = rm.Gauge(name, description=description, tag_keys=keys)
            else:
                m = rm.Histogram(name, description=description, boundaries=list(WAIT_BUCKETS),
                                 tag_keys=keys)
            _METRICS[name] = m
        return _METRICS[name]


def tags(rank: int, slot: int, dataset: str) -> dict[str, str]:
    """The tag values of one loader (and of the read tasks it starts)."""
    return {"rank": str(rank), "slot": str(slot), "dataset": str(dataset)}


def _record(name: str, value: float, tag_values: Mapping[str, str], op: str) -> None:
    value = float(value)  # numpy scalars are neither int nor float to Ray
    if op == "inc" and value <= 0:
        return  # Ray counters only take positive increments
    m = _metric(name)
    if m is None:
        return
    try:
        getattr(m, op)(value, tags=dict(tag_values))
    except Exception:  # metrics are diagnostics: never fail a read or a batch over them
        return


class LoaderMetrics:
    """The recorder one :class:`~ray_ingest.loader.ingest.IngestLoader` calls at a few points.

    Args:
        rank: Ray Train world rank.
        slot: data-parallel slot of the rank.
        dataset: catalog fingerprint.
    """

    def __init__(self, rank: int, slot: int, dataset: str):
        self.tags = tags(rank, slot, dataset)
        self._wait_since_batch = 0.0
        self._recent: collections.deque[frozenset[str]] = collections.deque(
            maxlen=POOL_RECENT_BLOCKS)
        self._gauges: dict[str, float] = {}
        self._refreshed = 0.0

    def on_wait(self, seconds: float) -> None:
        """The train loop blocked ``seconds`` on the loader (building or pulling the pipeline)."""
        self._wait_since_batch += seconds
        _record("ingest_data_wait_seconds", seconds, self.tags, "inc")

    def on_batch(self, samples: int, batches: int = 1) -> None:
        """Batches were delivered; the wait since the previous one goes into the histogram."""
        _record("ingest_samples", samples, self.tags, "inc")
        _record("ingest_batches", batches, self.tags, "inc")
        _record("ingest_batch_wait_seconds", self._wait_since_batch, self.tags, "observe")
        self._wait_since_batch = 0.0
        now = time.monotonic()  # pacing only: no value depends on it
        if now - self._refreshed >= GAUGE_REFRESH_S:
            self._refreshed = now
            for name, value in self._gauges.items():
                _record(name, value, self.tags, "set")

    def on_skip(self, kind: str, n: int = 1) -> None:
        """``n`` samples were skipped (``kind``: ``SampleError``, ``read/TarFormatError``, …)."""
        _record("ingest_skips", n, {**self.tags, "kind": kind}, "inc")

    def set_epoch(self, epoch: int) -> None:
        self._set("ingest_epoch", epoch)

    def set_pool_size(self, n: int) -> None:
        self._set("ingest_decode_pool_size", n)

    def _set(self, name: str, value: float) -> None:
        self._gauges[name] = value
        _record(name, value, self.tags, "set")

    def on_actors(self, actor_ids: Iterable[str]) -> None:
        """Decode actors of one block: the pool size is the distinct actors of the last
        :data:`POOL_RECENT_BLOCKS` blocks (an elastic pool grows and shrinks; the set of all actors
        ever seen only grows)."""
        self._recent.append(frozenset(str(a) for a in actor_ids))
        self.set_pool_size(len(frozenset().union(*self._recent)))


def job_tags(job: str, dataset: str) -> dict[str, str]:
    """The tag values of a job's decode controller."""
    return {"job": str(job), "dataset": str(dataset)}


def record_job(kind: str, cpus: float, tag_values: Mapping[str, str]) -> None:
    """The job's decode CPUs of ``kind`` (target, held, pending, busy) now."""
    _record("ingest_job_decode_cpus", cpus, {**tag_values, "kind": kind}, "set")


def record_rank(kind: str, cpus: float, tag_values: Mapping[str, str]) -> None:
    """A rank's decode CPUs of ``kind`` (target, busy) in the job's pool now."""
    _record("ingest_decode_cpus", cpus, {**tag_values, "kind": kind}, "set")


@contextlib.contextmanager
def read_scope(tag_values: Mapping[str, str] | None) -> Iterator[None]:
    """Attribute what this process reads (bytes, remote retries) to a loader's tags."""
    previous = getattr(_READ, "tags", {})
    _READ.tags = dict(tag_values or {})
    try:
        yield
    finally:
        _READ.tags = previous


def _read_tags() -> dict[str, str]:
    tags = getattr(_READ, "tags", {})
    return {k: tags.get(k, "") for k in TAG_KEYS}


def on_bytes_read(n: int) -> None:
    """A read task read ``n`` member payload bytes (tags: the current :func:`read_scope`)."""
    if n:
        _record("ingest_bytes_read", n, _read_tags(), "inc")


def on_remote_retry() -> None:
    """A remote read is retried (called by :mod:`ray_ingest.twintar.remote`)."""
    _record("ingest_remote_retries", 1, _read_tags(), "inc")
