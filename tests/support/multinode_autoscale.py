"""Ray's fake multi-node autoscaler on this machine, with cluster.yaml's node types.

``FakeMultiNodeProvider`` (``ray.autoscaler._private.fake_multi_node``) "launches" a node by
starting another raylet on this machine, so the real autoscaler (v2: the one that honours label
selectors) decides what to launch and when to remove it. Three things keep Ray's own helper
(``ray.cluster_utils.AutoscalingCluster``) from being usable here, and are done by hand:

* it runs ``ray stop --force`` (which would end every Ray process on the machine) and binds the
  default port 6379: here the head is ``ray start --head --block`` on a free port, and teardown
  ends only the processes of that head's process tree, by pid;
* the wheel lacks ``fake_multi_node/example.yaml``, the defaults file of provider type
  ``fake_multinode``, so ``prepare_config`` fails: the provider is loaded as
  ``type: external`` with the same class and the defaults are written out;
* fake nodes get the routable IP: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the monitor's
  environment makes ``get_node_ip_address()`` answer 127.0.0.1 (see tests/support/multinode.py).

Run as ``python -m tests.support.multinode_autoscale ADDRESS DATA`` it is the driver: it streams one
epoch through :class:`~ray_ingest.loader.ingest.IngestLoader` with ``decode.label_selector`` on a
cluster that has no decode node, then waits until the launched node is removed as idle, and
prints one JSON line (``RESULT {...}``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support.proctree import stop_tree

REPO = Path(__file__).resolve().parents[2]
PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
#: Node types taken from cluster.yaml (labels, min/max workers); CPUs scaled to this machine.
NODE_TYPES = ("cpu_decode", "gpu_train")
IDLE_TIMEOUT_MIN = 0.1  # 6 s (cluster.yaml: 10 min)
#: What example.yaml would have filled in (prepare_config indexes these keys).
EMPTY_DEFAULTS = {
    "auth": {}, "file_mounts": {}, "cluster_synced_files": [],
    "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
    "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaling_config(port: int, cluster_yaml: Path = REPO / "cluster.yaml") -> dict[str, Any]:
    from ray.autoscaler._private.fake_multi_node.node_provider import (
        FAKE_HEAD_NODE_ID,
        FAKE_HEAD_NODE_TYPE,
    )

    declared = yaml.safe_load(cluster_yaml.read_text())["available_node_types"]
    types: dict[str, Any] = {}
    for name in NODE_TYPES:
        t = declared[name]
        types[name] = {
            "min_workers": t.get("min_workers", 0),
            "max_workers": 1,
            "labels": dict(t["labels"]),
            # a 32-CPU VM becomes 2 logical CPUs and a 128 MB object store on this machine
            "resources": {**t["resources"], "CPU": 2, "object_store_memory": 128 * 1024**2},
            "node_config": {},
        }
    types[FAKE_HEAD_NODE_TYPE] = {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}
    return {
        **EMPTY_DEFAULTS,
        "cluster_name": "ray-ingest-fake",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MIN,
        "provider": {"type": "external", "module": PROVIDER,
                     "gcs_address": f"127.0.0.1:{port}", "head_node_id": FAKE_HEAD_NODE_ID,
                     "launch_multiple": True},
        "available_node_types": types,
        "head_node_type": FAKE_HEAD_NODE_TYPE,
    }


class FakeAutoscalingCluster:
    """``ray start --head --block`` with the fake provider and autoscaler v2; ``stop()`` ends
    the head's process tree (fake nodes are children of the autoscaler monitor)."""

    def __init__(self, workdir: str | None = None):
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # short: unix socket paths under it must stay below 108 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="rimn-as-", dir="/tmp")
        self.config_path = os.path.join(workdir or self.temp_dir, "autoscaling.yaml")
        Path(self.config_path).write_text(yaml.safe_dump(autoscaling_config(self.port)))
        self.env = {
            **os.environ,
            "RAY_FAKE_CLUSTER": "1",
            "RAY_enable_autoscaler_v2": "1",
            "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
            "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
        ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
        self.log_path = os.path.join(self.temp_dir, "head.log")
        with open(self.log_path, "w") as log:
            self.head = subprocess.Popen(
                [ray_bin, "start", "--head", "--block", f"--port={self.port}",
                 "--node-ip-address=127.0.0.1", "--num-cpus=0", f"--temp-dir={self.temp_dir}",
                 f"--autoscaling-config={self.config_path}", "--include-dashboard=false",
                 "--disable-usage-stats"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def driver_env(self) -> dict[str, str]:
        env = {k: v for k, v in self.env.items()
               if k not in ("RAY_CLOUD_INSTANCE_ID", "RAY_OVERRIDE_NODE_ID_FOR_TESTING")}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return env

    def stop(self) -> None:
        stop_tree(self.head)


def _driver(address: str, data: str) -> dict[str, Any]:
    import ray
    import ray._private.ray_constants as rc
    from ray.autoscaler.v2.sdk import get_cluster_status

    from ray_ingest.catalog.load import load_catalog
    from ray_ingest.config import config_from_dict
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.topology import Topology

    rc.ENABLE_RAY_CLUSTER = False  # 127.0.0.1 stays 127.0.0.1 (tests/support/multinode.py)
    ray.init(address=address, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False

    def alive() -> dict[str, dict[str, Any]]:
        return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}

    before = alive()
    cfg = config_from_dict({
        "data": {"paths": [data]},
        "decode": {"resolution": 32, "pool_min": 1, "pool_max": 1, "num_cpus": 1,
                   "label_selector": {"pool": "cpu-decode"}},
        "loader": {"batch_size": 8, "read_workers": 1, "read_num_cpus": 0.5, "block_rows": 8},
    })
    loader = IngestLoader(cfg, Topology(world_size=1, rank=0, read_workers=1),
                          catalog=load_catalog([data]))
    t0 = time.monotonic()
    first_batch = None
    keys: list[str] = []
    for _, batches in loader.epochs(1):
        for batch in batches:
            if first_batch is None:
                first_batch = time.monotonic() - t0
            keys += [k for k, pad in zip(batch.sample_keys, batch.pads, strict=True) if not pad]
    launched = {nid: n for nid, n in alive().items() if nid not in before}
    status = get_cluster_status(address)
    types = {n.node_id: n.ray_node_type_name for n in status.active_nodes + status.idle_nodes}
    t_idle = time.monotonic()
    while set(launched) & set(alive()):
        if time.monotonic() - t_idle > 120:
            break
        time.sleep(0.5)
    removed_after = time.monotonic() - t_idle
    return {
        "nodes_before": {nid: n["Labels"] for nid, n in before.items()},
        "launched": {nid: {"labels": n["Labels"], "type": types.get(nid),
                           "cpus": n["Resources"].get("CPU")} for nid, n in launched.items()},
        "decode_nodes": loader.metrics()["decode_nodes"],
        "read_nodes": loader.metrics()["read_nodes"],
        "samples": len(keys), "distinct": len(set(keys)),
        "first_batch_s": first_batch,
        "removed": not (set(launched) & set(alive())),
        "removed_after_idle_s": removed_after,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(_driver(sys.argv[1], sys.argv[2])), flush=True)
