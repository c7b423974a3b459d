"""A real multi-node Ray cluster on this machine, every node bound to 127.0.0.1.

Each node is its own raylet (own object store, own logical CPUs, own labels), started with
``ray.cluster_utils.Cluster``; nodes are labelled like ``cluster.yaml``'s node types
(``pool: cpu-decode`` / ``pool: gpu-train``; no GPU here, so train nodes are CPU nodes with
the train label). The driver is the calling process.

Loopback only: Ray rewrites a ``127.0.0.1`` address into the machine's routable IP before
connecting (``services.resolve_ip_for_localhost``) unless ``ray_constants.ENABLE_RAY_CLUSTER``
is false, so :func:`loopback` switches that flag off while a cluster is up (nodes get
``node_ip_address="127.0.0.1"`` explicitly; the GCS then listens on loopback only).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs

LOOPBACK = "127.0.0.1"
DECODE = {"pool": "cpu-decode"}
TRAIN = {"pool": "gpu-train"}
MB = 1024**2
START_TIMEOUT_S = 180
#: Failure detection tuned for tests: a dead raylet is declared dead after ~1.5 s
#: (defaults: 5 failed health checks 3 s apart).
SYSTEM_CONFIG = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 1000,
}


@contextlib.contextmanager
def loopback() -> Iterator[None]:
    """Keep Ray from rewriting 127.0.0.1 into the routable IP (see module docstring)."""
    import ray._private.ray_constants as rc

    saved = rc.ENABLE_RAY_CLUSTER
    rc.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        rc.ENABLE_RAY_CLUSTER = saved


@attrs.define
class NodeInfo:
    """One raylet of the cluster, as started."""

    node: Any  # ray._private.node.Node
    node_id: str
    role: str
    labels: dict[str, str]
    num_cpus: float
    object_store_memory: int


class LoopbackCluster:
    """Head (no CPUs: nothing but the driver's own work runs there) plus labelled nodes."""

    def __init__(self, head_object_store: int = 128 * MB,
                 system_config: dict[str, Any] | None = None):
        from ray._private.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        self.nodes: dict[str, NodeInfo] = {}
        # Cluster() records its address in /tmp/ray/ray_current_cluster, where any bare
        # ray.init() on this machine (other people's jobs) would find and join it: put back
        # whatever was there.
        address_file = get_ray_address_file(None)
        saved = None
        if os.path.exists(address_file):
            with open(address_file) as f:
                saved = f.read()
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": LOOPBACK,
                "include_dashboard": False,
                "object_store_memory": head_object_store,
                "labels": {"pool": "head"},
                "_system_config": {**SYSTEM_CONFIG, **(system_config or {})},
            },
        )
        if saved is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(address_file)
        else:
            with open(address_file, "w") as f:
                f.write(saved)
        head = self._cluster.head_node
        self.head = NodeInfo(head, head.node_id, "head", {"pool": "head"}, 0, head_object_store)

    @property
    def address(self) -> str:
        return self._cluster.address

    def add(self, role: str, num_cpus: float, object_store_memory: int = 128 * MB,
            wait: bool = True) -> NodeInfo:
        """A node labelled for ``role`` ("decode" or "train")."""
        labels = dict({"decode": DECODE, "train": TRAIN}[role])
        node = self._cluster.add_node(
            wait=False, num_cpus=num_cpus, node_ip_address=LOOPBACK, labels=labels,
            object_store_memory=object_store_memory)
        if wait:  # (Cluster's own wait gives up after 30 s: too short on a busy machine)
            self._cluster._wait_for_node(node, timeout=START_TIMEOUT_S)
        info = NodeInfo(node, node.node_id, role, labels, num_cpus, object_store_memory)
        self.nodes[node.node_id] = info
        return info

    def wait_for_nodes(self) -> None:
        self._cluster.wait_for_nodes(timeout=START_TIMEOUT_S)

    def alive(self, role: str | None = None) -> list[NodeInfo]:
        import ray

        live = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return [i for i in self.nodes.values()
                if i.node_id in live and (role is None or i.role == role)]

    def kill(self, info: NodeInfo) -> float:
        """SIGKILL the node's raylet (a preempted VM, not a polite shutdown), then reap the rest
        of its processes; returns the time of the kill (``time.monotonic()``)."""
        raylet = info.node.all_processes["raylet"][0].process
        t = time.monotonic()
        os.kill(raylet.pid, signal.SIGKILL)
        self._cluster.remove_node(info.node, allow_graceful=False)
        self.nodes.pop(info.node_id, None)
        return t

    def drain(self, info: NodeInfo, deadline_s: float = 30.0) -> float:
        """Ask the GCS to drain the node (``DrainNode``, reason PREEMPTION, as the autoscaler
        and a SIGTERMed raylet do): no new work lands there; running work may finish. Then the
        node is shut down (gracefully). Returns the time the drain was accepted."""
        from ray._raylet import GcsClient
        from ray.core.generated import autoscaler_pb2

        gcs = GcsClient(address=self.address)
        deadline_ms = int((time.time() + deadline_s) * 1000)
        accepted, why = gcs.drain_node(
            info.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "ray_ingest multinode test", deadline_ms)
        if not accepted:
            raise RuntimeError(f"drain of node {info.node_id} rejected: {why}")
        return time.monotonic()

    def remove(self, info: NodeInfo) -> None:
        """Graceful shutdown of a node's processes (what follows a drain)."""
        self._cluster.remove_node(info.node, allow_graceful=True)
        self.nodes.pop(info.node_id, None)

    def shutdown(self) -> None:
        """Cluster.shutdown() without its reset_ray_address(), which deletes
        /tmp/ray/ray_current_cluster even when it names somebody else's cluster."""
        import ray

        for node in list(self._cluster.worker_nodes):
            self._cluster.remove_node(node)
        if self._cluster.head_node is not None:
            self._cluster.remove_node(self._cluster.head_node)
        ray.experimental.internal_kv._internal_kv_reset()
        ray._private.services.find_gcs_addresses.cache_clear()
        self.nodes.clear()


def store_stats(node: NodeInfo) -> dict[str, int]:
    """The node's plasma store counters, asked of its raylet (``GetNodeStats``)."""
    from ray._private.internal_api import node_stats

    reply = node_stats(node.node.node_ip_address, node.node.node_manager_port,
                       include_memory_info=False)
    s = reply.store_stats
    return {"used": int(s.object_store_bytes_used), "avail": int(s.object_store_bytes_avail),
            "primary": int(s.object_store_bytes_primary_copy),
            "fallback": int(s.object_store_bytes_fallback),
            "spilled": int(s.spilled_bytes_total), "restored": int(s.restored_bytes_total),
            "created": int(s.cumulative_created_bytes)}


class StoreSampler:
    """Samples the object store of every live node of ``cluster`` in a thread; keeps the peak
    per node (nodes killed meanwhile keep the peak seen before)."""

    def __init__(self, cluster: LoopbackCluster, period_s: float = 0.1):
        self.cluster = cluster
        self.limits: dict[str, int] = {}
        self.period_s = period_s
        self.peak: dict[str, dict[str, int]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StoreSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # final counters (spilled totals)

    def peak_used(self, node_ids: set[str]) -> int:
        """The highest store use seen on any of ``node_ids``."""
        return max((p["used"] for nid, p in list(self.peak.items()) if nid in node_ids),
                   default=0)

    def wait_used(self, node_ids: set[str], at_least: float, timeout_s: float) -> None:
        """Waits until one of ``node_ids`` has held ``at_least`` bytes, or the timeout."""
        deadline = time.monotonic() + timeout_s
        while self.peak_used(node_ids) < at_least and time.monotonic() < deadline:
            time.sleep(self.period_s)

    def _sample(self) -> None:
        for info in [self.cluster.head, *list(self.cluster.nodes.values())]:
            self.limits[info.node_id] = info.object_store_memory
            try:
                s = store_stats(info)
            except Exception:  # a node that was killed on purpose
                continue
            peak = self.peak.setdefault(info.node_id, dict.fromkeys(s, 0))
            for k, v in s.items():
                peak[k] = max(peak[k], v)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()
