"""Ray metrics (``ray_ingest.metrics``), read back from the session Ray's metrics endpoint.

The session Ray runs the metrics agent that ``ray[default]`` brings (the same exporter the
dashboard and Prometheus scrape): one loader epoch on a rank of a 2-slot topology, with one
oversized member per shard (a counted read skip), and remote reads retried through a scripted
flaky filesystem, must show up on ``http://127.0.0.1:<metrics_export_port>/metrics`` under
the loader's rank/slot/dataset tags, equal to the loader's own counters. Ray exports every
``metrics_report_interval_ms`` (10 s by default, 2 s in the suite: tests/conftest.py), so the
scrape waits, boundedly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from ray_ingest import metrics
from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar import remote
from tests.support.datagen import write_tar
from tests.twintar.test_remote import FAST, _flaky

#: How long the scrape may wait for the exporter (its default interval is 10 s).
SCRAPE_TIMEOUT_S = 60
_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``name -> [(labels, value)]`` of the ray_ingest series on the metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1).startswith("ray_ingest_"):
            out[m.group(1)].append((dict(_LABEL.findall(m.group(2))), float(m.group(3))))
    return out


def total(series, name: str, **labels: str) -> float | None:
    """Sum over the series of ``name`` whose labels include ``labels`` (one per process)."""
    values = [v for lab, v in series.get(name, [])
              if all(lab.get(k) == x for k, x in labels.items())]
    return sum(values) if values else None


def test_recorder_is_a_no_op_without_ray(monkeypatch):
    monkeypatch.setattr(metrics, "running_ray", lambda: None)
    monkeypatch.setattr(metrics, "_METRICS", {})
    rec = metrics.LoaderMetrics(0, 0, "fp")
    rec.on_wait(0.5)
    rec.on_batch(4)
    rec.on_skip("SampleError")
    rec.on_actors(["a", "b"])
    rec.set_epoch(3)
    metrics.on_bytes_read(10)
    metrics.on_remote_retry()
    assert metrics._METRICS == {}


def test_read_scopes_of_concurrent_threads_keep_their_own_tags():
    """The reader threads of ``decode.compute: threads`` read at once: a scope that ends in one
    thread must neither clear nor leak another's tags."""
    import threading

    entered, leave = threading.Barrier(2), threading.Event()
    seen: dict[str, dict[str, str]] = {}

    def read(rank: str) -> None:
        with metrics.read_scope({"rank": rank, "slot": "0", "dataset": "fp"}):
            entered.wait(5)
            if rank == "1":
                leave.wait(5)  # thread 0 leaves its scope while this one still reads
            seen[rank] = metrics._read_tags()

    threads = [threading.Thread(target=read, args=(r,)) for r in ("0", "1")]
    for t in threads:
        t.start()
    threads[0].join(5)
    leave.set()
    threads[1].join(5)
    assert seen["0"]["rank"] == "0" and seen["1"]["rank"] == "1"
    assert metrics._read_tags()["rank"] == ""  # nothing leaks into this thread


def test_pure_layers_import_without_ray():
    """Metrics hooks in remote/reader/twin/tario must not pull Ray into a process without it."""
    code = ("import sys, ray_ingest.metrics, ray_ingest.twintar.remote, ray_ingest.twintar.reader, "
            "ray_ingest.twintar.twin, ray_ingest.twintar.tario, ray_ingest.tools.audit; "
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0


def test_remote_retries_call_the_metric_hook(monkeypatch):
    calls = []
    monkeypatch.setattr(metrics, "on_remote_retry", lambda: calls.append(1))
    assert remote.read_bytes(_flaky(b"y" * 100, reads=["conn", "short"]), retry=FAST) == b"y" * 100
    assert len(calls) == 2


def _oversize_first_member(tar: Path) -> None:
    with tarfile.open(tar) as tf:
        ms = [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]
    ms[0] = (ms[0][0], ms[0][1] + b"\0" * 70_000)  # still a JPEG, over the 64 KiB limit
    write_tar(tar, ms, index=True)


@pytest.mark.ray
def test_loader_and_read_metrics_reach_the_metrics_endpoint(ray_local, tmp_path):
    from ray_ingest.loader.ingest import IngestLoader

    port = ray_local._private.worker.global_worker.node.metrics_export_port
    root = tmp_path / "ds"
    synth_dataset(str(root), samples=40, shard_size=10, seed=3, min_side=16, max_side=24)
    for tar in sorted((root / "image").rglob("*.tar")):
        _oversize_first_member(tar)
    cfg = config_from_dict({
        "data": {"paths": [str(root)]},
        # the rank's own pool of one actor: the pool-size gauge is exactly 1 (the job's pool
        # may grow to pool_max x the job's 2 ranks; its metrics: tests/execution/test_jobpool)
        "decode": {"resolution": 16, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "compute": "actors", "pool_scope": "rank",
                   "max_member_bytes": 64 * 1024},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 4, "read_workers": 1, "shuffle": False, "equal_work": False,
                   "on_error": "skip", "block_rows": 5},
    })
    loader = IngestLoader(cfg, Topology(world_size=2, rank=1, read_workers=1), start_epoch=2)
    seen: set[tuple[int, int]] = set()
    for _, batches in loader.epochs(3):
        for b in batches:
            seen |= {(s, i) for s, i, p in zip(b.sids, b.indices, b.pads, strict=True) if not p}
            seen |= {(s, i) for s, i, _ in b.skipped}
    fp = load_catalog([str(root)]).fingerprint
    tags = {"rank": "1", "slot": "1", "dataset": fp}
    m = loader.metrics()
    assert m["skips_by_kind"] == {"read/OversizedMemberError": 2}  # slot 1 reads 2 of 4 shards
    # bytes read = payloads of every sample the slot read, the oversized members excepted
    want_bytes = 0
    for sid, idx in seen:
        shard = loader.catalog.shards[sid]
        for mod in shard.modalities:
            with tarfile.open(shard.url(mod)) as tf:
                member = [x for x in tf if x.isfile()][idx]
            want_bytes += 0 if (mod == "image" and idx == 0) else member.size
    assert m["bytes_read"] == want_bytes > 0

    flaky_tags = {**tags, "dataset": f"flaky-{fp}"}
    with metrics.read_scope(flaky_tags):  # a read-task process: here the test's own
        data = remote.read_bytes(_flaky(b"x" * 5000, reads=["conn", "timeout", "short"]),
                                 retry=FAST)
    assert len(data) == 5000

    want = {
        ("ray_ingest_samples_total", ()): m["samples"],
        ("ray_ingest_batches_total", ()): m["batches"],
        ("ray_ingest_batch_wait_seconds_count", ()): m["batches"],
        ("ray_ingest_skips_total", (("kind", "read/OversizedMemberError"),)): 2,
        ("ray_ingest_bytes_read_total", ()): want_bytes,
        ("ray_ingest_decode_pool_size", ()): 1,
        ("ray_ingest_epoch", ()): 2,
    }
    want[("ray_ingest_remote_retries_total", (("dataset", f"flaky-{fp}"),))] = 3
    # Each value counts once seen: counters only grow, and gauges of a loader that stopped are
    # dropped by Ray's exporter about two report intervals after their last update.
    got: dict = {}
    wait = None
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        series = scrape(port)
        for k in want:
            value = total(series, k[0], **{**tags, **dict(k[1])})
            if value is not None and got.get(k) != want[k]:
                got[k] = value
        wait = total(series, "ray_ingest_data_wait_seconds_total", **tags) or wait
        if got == want and wait is not None:
            break
        if time.monotonic() > deadline:
            found = {n: [(lab, v) for lab, v in s if lab.get("dataset") in (fp, f"flaky-{fp}")]
                     for n, s in series.items()}
            pytest.fail(f"metrics on :{port} after {SCRAPE_TIMEOUT_S}s: want {want}, got {got}; "
                        f"ray_ingest series now: {found}")
        time.sleep(1.0)
    assert wait == pytest.approx(m["wait"], rel=1e-6) and wait > 0
