"""Closing figures of failure handling: per fault kind, what was injected, what it cost, and that
nothing was lost or duplicated.

Remote faults (reset, 503, stall, truncate, and all four mixed) are injected by the loopback
fault proxy of the test suite (``tests/support/faultproxy.py``) between gcsfs and a real GCS
emulator;
``read_shard`` reads every shard of a synthetic twin-tar dataset through it, in this process,
with gcsfs's own retries off so every fault reaches :mod:`ray_ingest.twintar.remote`. Rows are
compared byte for byte with the local copy.

Corrupt data (the kinds of ``tests/decode/test_corrupt.py``: corrupt/truncated JPEG, truncated tar,
missing twin tar, misaligned keys, bad header checksum, oversized member, decompression bombs)
is read with ``on_error=skip`` through the same read task and decoder the Ray pipeline runs;
every good sample must come out once and decode-identical to the pristine copy, every bad one
must be recorded as a skip.

With ``--ray`` the corrupt dataset and the mixed remote faults also go through
``IngestLoader`` on a local Ray (the faults then hit gcsfs's own retries in the workers first;
"retries" is then the number of requests beyond a fault-free run).

Usage::

    .venv/bin/python bench/faults.py [--rate 0.2] [--ray] [--json figures.json]

Exit status 1 if any row lost, duplicated or corrupted a sample.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_ingest.catalog.load import load_catalog  # noqa: E402
from ray_ingest.decode.decoder import Decoder  # noqa: E402
from ray_ingest.execution.read import (  # noqa: E402
    ReadItem,
    read_item,
)
from ray_ingest.tools.synth import synth_dataset  # noqa: E402
from ray_ingest.train.auth import secure_local_ray  # noqa: E402
from ray_ingest.twintar.reader import (  # noqa: E402
    ReadOptions,
    read_shard,
)
from ray_ingest.twintar.remote import (  # noqa: E402
    RetryPolicy,
    remote_stats,
)
from tests.decode import test_corrupt as corrupt  # noqa: E402  (the damage catalogue)
from tests.support.faultproxy import RANDOM_KINDS, FaultProxy  # noqa: E402
from tests.support.fixtures_gcs import BUCKET, free_port, upload_tree  # noqa: E402

COLUMNS = ("kind", "layer", "requests", "faulted", "retries", "bytes_compared", "samples",
           "skipped", "lost", "duplicated", "mismatches", "seconds")
#: Fast retries; a stalled response ends in a client timeout well before the proxy's 1.5 s.
POLICY = RetryPolicy(attempts=12, backoff_base_s=0.005, backoff_max_s=0.05, read_timeout_s=0.3)


@contextlib.contextmanager
def emulator() -> Iterator[tuple[int, dict[str, Any]]]:
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    starter.join(timeout=10)
    if starter.is_alive():
        raise SystemExit("could not start the GCS emulator on 127.0.0.1")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    try:
        yield port, {"token": "anon", "project": "test", "endpoint_url": f"http://127.0.0.1:{port}"}
    finally:
        server.stop()


@contextlib.contextmanager
def gcsfs_retries_off() -> Iterator[None]:
    """As the ``fault_proxy`` fixture: every injected fault reaches ray_ingest.twintar.remote."""
    import gcsfs.retry

    saved = gcsfs.retry.is_retriable
    gcsfs.retry.is_retriable = lambda exc: False
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        gcsfs.retry.is_retriable = saved


def all_rows(root: str, opts: ReadOptions) -> list[dict[str, Any]]:
    cat = load_catalog([f"{root}/wdinfo.json"], storage_options=opts.storage_options)
    return [row for shard in cat.shards for row in read_shard(shard, opts=opts)]


def compare_rows(got: list[dict], want: list[dict]) -> dict[str, int]:
    seen = collections.Counter((r["__shard__"], r["__key__"]) for r in got)
    out = {"lost": sum(1 for r in want if (r["__shard__"], r["__key__"]) not in seen),
           "duplicated": sum(n - 1 for n in seen.values()), "samples": len(got),
           "bytes_compared": 0, "mismatches": abs(len(got) - len(want))}
    for g, w in zip(got, want, strict=False):
        for col, value in w.items():
            if isinstance(value, bytes):
                out["bytes_compared"] += len(value)
            out["mismatches"] += int(g.get(col) != value)
    return out


def remote_rows(local: Path, gs_root: str, port: int, rate: float, seed: int) -> list[dict]:
    want = all_rows(str(local), ReadOptions())
    rows = []
    proxy = FaultProxy(port, rate=0.0, seed=seed, stall_s=1.5, io_timeout_s=5.0).start()
    options = {"token": "anon", "project": "test", "endpoint_url": proxy.endpoint,
               "skip_instance_cache": True}
    try:
        with gcsfs_retries_off():
            for kind in (*RANDOM_KINDS, "mixed"):
                kinds = RANDOM_KINDS if kind == "mixed" else (kind,)
                proxy.configure(rate=rate, kinds=kinds, seed=seed)
                proxy.reset_counts()
                t0, before = time.monotonic(), remote_stats()
                got = all_rows(gs_root, ReadOptions(storage_options=options, retry=POLICY))
                counts = proxy.counts()
                rows.append({"kind": kind, "layer": "read_shard", "requests": counts["requests"],
                             "faulted": counts["faulted"],
                             "retries": remote_stats().retries - before.retries, "skipped": 0,
                             **compare_rows(got, want),
                             "seconds": round(time.monotonic() - t0, 2)})
    finally:
        proxy.stop()
    return rows


def corrupt_rows(pristine: Path, work: Path) -> list[dict]:
    """Each damage kind read with on_error=skip by the read task + decoder of the pipeline."""
    cfg = corrupt.cfg_for(pristine)
    want = decoded(pristine, cfg)
    rows = []
    for kind, (_, shard_no, positions, _, _) in corrupt.KINDS.items():
        t0 = time.monotonic()
        root = corrupt.damaged_copy(pristine, work / kind, [kind])
        cat = load_catalog([str(root)])
        sid = {s.path: i for i, s in enumerate(cat.shards)}[corrupt.rel(shard_no)]
        bad = {(sid, p) for p in positions}
        decoder = Decoder(cfg.decode, on_error="skip")
        delivered, skipped, mismatches, compared = [], [], 0, 0
        for s, shard in enumerate(cat.shards):
            item = ReadItem(0, s, 0, shard.count)
            for block in read_item(shard, item, ReadOptions(), cfg.loader.block_rows, "skip"):
                out = decoder(block)
                for j, err in enumerate(out["__error__"]):
                    k = (int(out["__sid__"][j]), int(out["__index__"][j]))
                    if err:
                        skipped.append(k)
                        continue
                    delivered.append(k)
                    compared += out["image"][j].nbytes
                    mismatches += int(sha(out["image"][j]) != want[k])
        counts = collections.Counter(delivered)
        good = {k for k in want if k not in bad}
        rows.append({"kind": kind, "layer": "read task + decoder", "requests": "-",
                     "faulted": len(bad), "retries": 0, "bytes_compared": compared,
                     "samples": len(delivered), "skipped": len(skipped),
                     "lost": len(good - set(delivered)) + len(set(skipped) - bad),
                     "duplicated": sum(n - 1 for n in counts.values()) + len(skipped)
                     - len(set(skipped)),
                     "mismatches": mismatches + len(bad - set(skipped)),
                     "seconds": round(time.monotonic() - t0, 2)})
    return rows


def sha(array: Any) -> str:
    return hashlib.sha1(array.tobytes()).hexdigest()


def decoded(root: Path, cfg: Any) -> dict[tuple[int, int], str]:
    cat = load_catalog([str(root)])
    decoder = Decoder(cfg.decode)
    out = {}
    for sid, shard in enumerate(cat.shards):
        for row in read_shard(shard):
            row.update({"__sid__": sid, "__bucket__": ""})
            out[(sid, row["__index__"])] = sha(decoder.decode_row(row)["image"])
    return out


def ray_rows(pristine: Path, work: Path, local: Path, gs_root: str, port: int,
             rate: float, seed: int) -> list[dict]:
    """IngestLoader on a private local Ray: all corrupt kinds at once, and mixed remote faults."""
    import ray

    from ray_ingest.config import config_from_dict
    from ray_ingest.loader.ingest import IngestLoader
    from ray_ingest.plan.state import slot_stream
    from ray_ingest.plan.topology import Topology

    secure_local_ray()  # token authentication on (a one-off token if none is set up)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}})
    topo = Topology(world_size=1, rank=0, read_workers=1)
    rows = []
    try:
        # corrupt data: one damaged shard per kind, one run
        root = corrupt.damaged_copy(pristine, work / "all", list(corrupt.KINDS))
        cfg = corrupt.cfg_for(root, on_error="skip", max_skips_per_shard=None,
                              max_skips_per_epoch=None)
        t0 = time.monotonic()
        delivered, skipped, loader = corrupt.run(cfg)
        bad = set(corrupt.expected_skips(loader.catalog))
        planned = {(s, i) for s, sh in enumerate(loader.catalog.shards) for i in range(sh.count)}
        counts = collections.Counter(delivered)
        rows.append({"kind": "all corrupt kinds", "layer": "IngestLoader (Ray)", "requests": "-",
                     "faulted": len(bad), "retries": 0, "bytes_compared": "-",
                     "samples": len(delivered), "skipped": len(skipped),
                     "lost": len((planned - bad) - set(counts)),
                     "duplicated": sum(n - 1 for n in counts.values()),
                     "mismatches": len(bad ^ {(s, i) for s, i, _ in skipped}),
                     "seconds": round(time.monotonic() - t0, 2)})
        # remote faults in Ray workers (gcsfs retries on there): requests beyond a clean run
        proxy = FaultProxy(port, rate=0.0, seed=seed, stall_s=1.5, io_timeout_s=5.0).start()
        options = {"token": "anon", "project": "test", "endpoint_url": proxy.endpoint,
                   "skip_instance_cache": True}
        try:
            cfg = config_from_dict({
                "data": {"paths": [f"{gs_root}/wdinfo.json"], "storage_options": options},
                "decode": {"resolution": 16, "pool_min": 1, "pool_max": 2, "num_cpus": 0.25},
                "loader": {"batch_size": 8, "read_workers": 1, "read_num_cpus": 0.25,
                           "block_rows": 64, "prefetch_batches": 1},
            })
            cat = load_catalog(list(cfg.data.paths), storage_options=options)
            want = decoded(local, cfg)
            runs = []
            for r in (0.0, rate):
                proxy.configure(rate=r, kinds=RANDOM_KINDS, seed=seed)
                proxy.reset_counts()
                t0 = time.monotonic()
                loader = IngestLoader(cfg, topo, catalog=cat)
                plan = [(sl.shard, sl.start + k)
                        for sl in slot_stream(loader.state, cat.counts, cat.chunk_size, 0)
                        for k in range(sl.count) if not sl.pad]
                order, mismatches, compared = [], 0, 0
                for _, batches in loader.epochs(1):
                    for b in batches:
                        images = b["image"].numpy()
                        for j, (s, i, p) in enumerate(zip(b.sids, b.indices, b.pads,
                                                          strict=True)):
                            if not p:
                                order.append((s, i))
                                compared += images[j].nbytes
                                mismatches += int(sha(images[j]) != want[(s, i)])
                runs.append((proxy.counts(), order, plan, mismatches, compared,
                             time.monotonic() - t0))
            base, (counts, order, plan, mismatches, compared, seconds) = runs[0][0], runs[1]
            seen = collections.Counter(order)
            rows.append({"kind": "mixed", "layer": "IngestLoader (Ray)",
                         "requests": counts["requests"], "faulted": counts["faulted"],
                         "retries": counts["requests"] - base["requests"],
                         "bytes_compared": compared, "samples": len(order), "skipped": 0,
                         "lost": len(set(plan) - set(order)),
                         "duplicated": sum(n - 1 for n in seen.values()),
                         "mismatches": mismatches + int(order != plan),
                         "seconds": round(seconds, 2)})
        finally:
            proxy.stop()
    finally:
        ray.shutdown()
    return rows


def print_table(rows: list[dict]) -> None:
    cells = [[str(r.get(c, "")) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=0.2, help="fraction of requests faulted")
    ap.add_argument("--shards", type=int, default=32, help="shards of the remote dataset")
    ap.add_argument("--shard-size", type=int, default=8, help="samples per remote shard")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray", action="store_true", help="also run IngestLoader on a local Ray")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        local = work / "remote_ds"
        synth_dataset(str(local), samples=args.shards * args.shard_size,
                      shard_size=args.shard_size, seed=args.seed, min_side=32, max_side=128)
        pristine = work / "pristine"
        synth_dataset(str(pristine), samples=corrupt.NUM_SHARDS * corrupt.SHARD_SIZE,
                      shard_size=corrupt.SHARD_SIZE, seed=5, min_side=16, max_side=40)
        with emulator() as (port, direct):
            gs_root = f"gs://{BUCKET}/bench_faults"
            upload_tree(local, gs_root, direct)
            rows += remote_rows(local, gs_root, port, args.rate, args.seed)
            rows += corrupt_rows(pristine, work / "corrupt")
            if args.ray:
                rows += ray_rows(pristine, work / "corrupt_ray", local, gs_root, port,
                                 args.rate, args.seed)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    bad = [r["kind"] for r in rows if r["lost"] or r["duplicated"] or r["mismatches"]]
    if bad:
        print(f"FAILED: samples lost, duplicated or corrupted in {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
