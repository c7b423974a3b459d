"""gs:// end to end: read_shard and the Ray pipeline over the GCS emulator, direct and through
the fault-injecting proxy, compared sample by sample with the same data read locally.

- ``read_shard`` in this process, per fault kind (reset, 503, stall, truncate): gcsfs's own
  retries are off here (``fault_proxy``), so every fault reaches ``ray_ingest.twintar.remote``; rows
  must be byte-identical to the local read, with nothing lost or duplicated.
- the catalog: wdinfo reads retry; ``load_catalog(..., cache=True)`` does not re-read.
- ``IngestLoader`` on the session Ray reading ``gs://`` through the proxy: the Ray workers are
  other processes with gcsfs's retries on, so the proxy keeps faulting >= 5% of requests and
  ``RetryingReader`` absorbs what gcsfs lets through (truncated bodies always reach it). Every
  planned sample is delivered exactly once, decode-identical to a local decode.
"""

from __future__ import annotations

import collections
import hashlib
import time
from pathlib import Path

import numpy as np
import pytest

from ray_ingest.catalog import load as load_mod
from ray_ingest.catalog.load import (
    clear_catalog_cache,
    load_catalog,
)
from ray_ingest.config import config_from_dict
from ray_ingest.decode.decoder import Decoder
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.state import slot_stream
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_shard,
)
from ray_ingest.twintar.remote import (
    RetryPolicy,
    remote_stats,
)
from tests.support import faultproxy
from tests.support.fixtures_gcs import upload_tree

pytestmark = pytest.mark.gcs

SHARDS, SHARD_SIZE = 4, 6
#: Fast retries; a stalled response must end in a client timeout well before the proxy's 1.5 s.
POLICY = RetryPolicy(attempts=8, backoff_base_s=0.005, backoff_max_s=0.05, read_timeout_s=0.3)
TOPO = Topology(world_size=1, rank=0, read_workers=1)
#: Fault rate of the read_shard tests: high enough for dozens of faults, low enough that 8
#: attempts in a row (about two requests each) practically never all fail.
RATE = 0.15


@pytest.fixture(scope="module")
def datasets(gcs_server, tmp_path_factory):
    """The same synthetic twin tars locally and under gs://test-bucket/pipeline/ (with idx)."""
    local = tmp_path_factory.mktemp("gcs_pipeline") / "ds"
    synth_dataset(str(local), samples=SHARDS * SHARD_SIZE, shard_size=SHARD_SIZE, seed=11,
                  min_side=16, max_side=40, modalities=("image", "caption", "umt5"))
    gs_root = gcs_server.url("pipeline")
    upload_tree(local, gs_root, gcs_server.storage_options)
    return local, gs_root


def rows_of(root: str, opts: ReadOptions, slices=None) -> list[dict]:
    cat = load_catalog([f"{root}/wdinfo.json"], storage_options=opts.storage_options)
    slices = slices or [(sid, 0, None) for sid in range(len(cat.shards))]
    return [row for sid, start, count in slices
            for row in read_shard(cat.shards[sid], start, count, opts)]


def compare(got: list[dict], want: list[dict]) -> collections.Counter:
    """Counts bytes compared, mismatches, samples lost and duplicated (by shard, key)."""
    out = collections.Counter()
    seen = collections.Counter((r["__shard__"], r["__key__"]) for r in got)
    out["lost"] = sum(1 for r in want if (r["__shard__"], r["__key__"]) not in seen)
    out["duplicated"] = sum(n - 1 for n in seen.values())
    for g, w in zip(got, want, strict=False):
        for col, value in w.items():
            if isinstance(value, bytes):
                out["bytes_compared"] += len(value)
            out["mismatches"] += int(g.get(col) != value)
    out["mismatches"] += abs(len(got) - len(want))
    out["samples"] = len(got)
    return out


#: (shard id, start, count) read by the read_shard tests: whole shards and resumed slices.
SLICES = [(0, 0, None), (1, 1, 2), (1, 4, None), (2, 3, None), (3, 0, 4), (3, 5, 1)]


def test_read_shard_over_gs_equals_local(datasets, gcs_server):
    local, gs_root = datasets
    want = rows_of(str(local), ReadOptions(), SLICES)
    got = rows_of(gs_root, ReadOptions(storage_options=gcs_server.storage_options), SLICES)
    totals = compare(got, want)
    assert totals["mismatches"] == 0 and totals["lost"] == 0 and totals["duplicated"] == 0
    assert totals["samples"] == sum(SHARD_SIZE - s if c is None else c for _, s, c in SLICES)


@pytest.mark.parametrize("kind", ["reset", "http503", "stall", "truncate"])
def test_read_shard_through_faults_equals_local(datasets, fault_proxy, remote_figures, kind):
    local, gs_root = datasets
    want = rows_of(str(local), ReadOptions(), SLICES)
    seed = int(hashlib.sha256(kind.encode()).hexdigest()[:8], 16)
    opts = ReadOptions(storage_options=fault_proxy.storage_options, retry=POLICY)
    t0, before = time.monotonic(), remote_stats()
    fault_proxy.configure(rate=RATE, kinds=(kind,), seed=seed)
    got = rows_of(gs_root, opts, SLICES)
    counts = fault_proxy.counts()
    after = remote_stats()
    totals = compare(got, want)
    retries = after.retries - before.retries
    remote_figures.record(kind=kind, layer="read_shard", rate=RATE, requests=counts["requests"],
                          faulted=counts["faulted"], retries=retries,
                          bytes_compared=totals["bytes_compared"], samples=totals["samples"],
                          mismatches=totals["mismatches"], lost=totals["lost"],
                          duplicated=totals["duplicated"],
                          seconds=round(time.monotonic() - t0, 1))
    assert totals["mismatches"] == 0 and totals["lost"] == 0 and totals["duplicated"] == 0
    assert counts[kind] > 0 and retries > 0, (counts, retries)  # really injected, and absorbed
    # (fewer retries than faults: gcsfs's open sends an object GET and a prefix listing at
    # once, so one failed attempt may hold two faults, and a faulted listing may not matter)


def test_catalog_reads_retry_through_faults(datasets, fault_proxy):
    local, gs_root = datasets
    want = load_catalog([str(local)])
    fault_proxy.inject("reset", 1)  # the metadata request of the open
    fault_proxy.inject("http503", 2)  # ... and its retries
    got = load_catalog([f"{gs_root}/wdinfo.json"], storage_options=fault_proxy.storage_options)
    assert fault_proxy.counts()["faulted"] == 3
    assert got.fingerprint == want.fingerprint
    assert [s.path for s in got.shards] == [s.path for s in want.shards]
    assert got.shards[0].root == gs_root


def test_catalog_cache_reads_once_per_content(tmp_path, datasets, fault_proxy, monkeypatch):
    local, gs_root = datasets
    requests: list[str] = []
    draw = faultproxy.FaultProxy._draw

    def logging_draw(self, head: bytes):
        requests.append(head.split(b"\r\n", 1)[0].decode())
        return draw(self, head)

    monkeypatch.setattr(faultproxy.FaultProxy, "_draw", logging_draw)
    reads = collections.Counter()
    real = load_mod.read_wdinfo

    def counting(url, *args, **kwargs):
        reads[url] += 1
        return real(url, *args, **kwargs)

    monkeypatch.setattr(load_mod, "read_wdinfo", counting)
    clear_catalog_cache()
    # local folder: parsed once, the same object handed out again
    first = load_catalog([str(local)], cache=True)
    assert load_catalog([str(local)], cache=True) is first
    assert load_catalog([str(local)], modalities=("image", "caption"), cache=True) is not first
    assert load_catalog([str(local)]) is not first  # cache=False still reads
    assert sum(reads.values()) == 3
    # a rewritten wdinfo.json (new size/mtime) is read again
    copy = tmp_path / "copy"
    copy.mkdir()
    wd = copy / "wdinfo.json"
    wd.write_text((local / "wdinfo.json").read_text())
    a = load_catalog([str(wd)], cache=True)
    wd.write_text((local / "wdinfo.json").read_text() + "\n")
    b = load_catalog([str(wd)], cache=True)
    assert a is not b and a.fingerprint == b.fingerprint and reads[str(wd)] == 2
    # gs://: a repeated call costs a metadata lookup, no download
    url = f"{gs_root}/wdinfo.json"
    gs_first = load_catalog([url], storage_options=fault_proxy.storage_options, cache=True)
    assert sum("alt=media" in r for r in requests) == 1
    requests.clear()
    assert load_catalog([url], storage_options=fault_proxy.storage_options,
                        cache=True) is gs_first
    assert requests and not any("alt=media" in r for r in requests), requests
    assert reads[url] == 1
    clear_catalog_cache()


# --- the Ray pipeline over gs:// ------------------------------------------------------------


def pipeline_cfg(paths: list[str], storage_options: dict):
    return config_from_dict({
        "data": {"paths": paths, "modalities": ["image", "caption", "umt5"],
                 "storage_options": storage_options},
        # the rank's own pool: every run starts cold workers, so the fault-free run's request
        # count is the baseline of the faulted one (the job's pool would lend the second run
        # the first run's warm gcsfs caches, and fewer requests)
        "decode": {"resolution": 16, "embedding_modality": "umt5", "pool_min": 1, "pool_max": 2,
                   "num_cpus": 0.25, "compute": "actors", "pool_scope": "rank"},
        "loader": {"head_start_batches": 0,  # the Ray edge alone
                   "batch_size": 4, "read_workers": 1, "read_num_cpus": 0.25, "block_rows": 8,
                   "seed": 3, "prefetch_batches": 1},
    })


def run_epoch(cfg, catalog) -> tuple[list[tuple[int, int]], dict[tuple[int, int], tuple],
                                     IngestLoader]:
    loader = IngestLoader(cfg, TOPO, catalog=catalog)
    order: list[tuple[int, int]] = []
    samples: dict[tuple[int, int], tuple] = {}
    for _, batches in loader.epochs(1):
        for b in batches:
            assert not b.skipped
            images = b["image"].numpy()
            for j, (s, i, pad) in enumerate(zip(b.sids, b.indices, b.pads, strict=True)):
                if pad:
                    continue
                order.append((s, i))
                samples[(s, i)] = (images[j].tobytes(), b.captions[j],
                                   np.asarray(b["umt5"][j]).tobytes())
    return order, samples, loader


def local_decode(local: Path, cfg) -> dict[tuple[int, int], tuple]:
    """The samples decoded in this process from the local copy (no Ray, no gs://)."""
    cat = load_catalog([str(local)], modalities=cfg.data.modalities)
    decoder = Decoder(cfg.decode, seed=cfg.loader.seed, epoch=0)
    out = {}
    for sid, shard in enumerate(cat.shards):
        for row in read_shard(shard):
            row.update({"__sid__": sid, "__bucket__": ""})
            d = decoder.decode_row(row)
            out[(sid, row["__index__"])] = (d["image"].tobytes(), d["caption"],
                                            d["umt5"].tobytes())
    return out


@pytest.mark.ray
def test_pipeline_over_gs_through_faults_delivers_every_sample_once(
        ray_local, datasets, fault_proxy, remote_figures):
    local, gs_root = datasets
    cfg = pipeline_cfg([f"{gs_root}/wdinfo.json"], fault_proxy.storage_options)
    want = local_decode(local, cfg)
    # parsed once on the driver and shipped with the tasks, as ray_ingest.train does (the
    # catalog's own retries are tested above): every request counted below is a worker's
    fault_proxy.configure(rate=0.0)
    cat = load_catalog(list(cfg.data.paths), modalities=cfg.data.modalities,
                       storage_options=cfg.data.storage_options)
    assert cat.fingerprint == load_catalog([str(local)], modalities=cfg.data.modalities).fingerprint
    loader0 = IngestLoader(cfg, TOPO, catalog=cat)
    plan = [(sl.shard, sl.start + k)
            for sl in slot_stream(loader0.state, cat.counts, cat.chunk_size, TOPO.slot)
            for k in range(sl.count) if not sl.pad]

    # fault-free through the proxy: the request count every read needs
    fault_proxy.reset_counts()
    order0, got0, _ = run_epoch(cfg, cat)
    baseline = fault_proxy.counts()["requests"]
    assert order0 == plan
    assert got0 == want  # decode-identical to the local read

    # 10% of requests faulted (gcsfs retries resets/503s/stalls itself in the workers, sleeping
    # 1-2 s each; truncated bodies look complete to it and always reach RetryingReader)
    fault_proxy.configure(rate=0.1, kinds=("reset", "http503", "stall", "truncate"), seed=7)
    fault_proxy.reset_counts()
    fault_proxy.inject("reset", 2)  # whatever the draws: the first two requests fail
    t0 = time.monotonic()
    order, got, loader = run_epoch(cfg, cat)
    counts = fault_proxy.counts()
    dup = sum(n - 1 for n in collections.Counter(order).values())
    lost = len(set(plan) - set(order))
    bytes_compared = sum(len(a) + len(c) for a, _, c in got.values())
    remote_figures.record(kind="mixed", layer="IngestLoader (Ray)", rate=0.1,
                          requests=counts["requests"], faulted=counts["faulted"],
                          retries=counts["requests"] - baseline, bytes_compared=bytes_compared,
                          samples=len(order), mismatches=sum(got[k] != want[k] for k in got),
                          lost=lost, duplicated=dup, seconds=round(time.monotonic() - t0, 1))
    assert order == plan  # same order, nothing lost, nothing duplicated
    assert got == want
    assert counts["faulted"] >= 2 and counts["requests"] > baseline, (counts, baseline)
    assert loader.metrics()["skips_total"] == 0
