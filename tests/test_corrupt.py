"""Corrupt data under ``loader.on_error: raise | skip``, with skip budgets.

A synthetic dataset is copied into ``tmp_path`` and damaged one shard per kind of bad input:
corrupt JPEG, truncated JPEG, truncated tar, missing twin tar, misaligned keys (strict mode),
unreadable member (bad header checksum), oversized member (``decode.max_member_bytes``, caught
from the tar header by the read task: the payload is never read) and decompression bombs
(``decode.max_image_pixels``, Pillow's warning and error levels).

- ``raise``: every kind fails with one line naming the shard, the index/key and the reason —
  checked for every kind on the read task + decoder directly, and through ``IngestLoader`` on
  the session Ray for a read-level and a decode-level kind.
- ``skip``: one ``IngestLoader`` run over the whole damaged dataset records exactly the bad
  samples (shard id, index, reason) in ``Batch.skipped``, the read state, the metrics and the
  log, and delivers every other sample exactly once; a run interrupted and resumed from its
  saved read state makes the same skips and delivers the same samples.
- budgets: ``SkipBudgetExceeded`` names the shard (per shard) or the epoch (per epoch).
"""

from __future__ import annotations

import collections
import io
import logging
import random
import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from ray_ingest.catalog.load import load_catalog
from ray_ingest.config import config_from_dict
from ray_ingest.decode.decoder import Decoder
from ray_ingest.errors import IngestError, SkipBudgetExceeded
from ray_ingest.execution.local import LocalExecution
from ray_ingest.execution.read import (
    ReadItem,
    read_item,
)
from ray_ingest.loader.ingest import IngestLoader
from ray_ingest.plan.state import ReadState
from ray_ingest.plan.topology import Topology
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import read_options
from ray_ingest.twintar.tario import index_url
from tests.datagen import write_tar

SHARD_SIZE = 6
#: Bytes a member may have in these tests (synthetic JPEGs are 1-2 KB; the oversized one 96 KB).
MAX_MEMBER_BYTES = 64 * 1024
#: Pillow warns above this many pixels and refuses above twice as many.
MAX_PIXELS = 1_000_000


def rel(shard: int) -> str:
    return f"part_000000/{shard:06d}.tar"


def key(shard: int, pos: int) -> str:
    return f"s{shard * SHARD_SIZE + pos:08d}"


def members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]


def replace_member(path: Path, pos: int, data: bytes | None = None,
                   name: str | None = None) -> None:
    """Rewrite the tar at ``path`` with member ``pos`` given new bytes and/or a new name."""
    ms = members(path)
    old_name, old_data = ms[pos]
    ms[pos] = (name or old_name, old_data if data is None else data)
    write_tar(path, ms, index=True)


def jpeg(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height), 128).save(buf, format="JPEG", quality=50)
    return buf.getvalue()


# --- the damage, one shard per kind ------------------------------------------------------------
# Each entry: shard number, positions skipped, regex of the skip reason, regex of the raise text.


def _corrupt_jpeg(root: Path, s: int) -> None:
    replace_member(root / "image" / rel(s), 1, random.Random(s).randbytes(900))


def _truncated_jpeg(root: Path, s: int) -> None:
    path = root / "image" / rel(s)
    data = members(path)[4][1]
    replace_member(path, 4, data[: len(data) // 2])


def _truncated_tar(root: Path, s: int) -> None:
    path = root / "image" / rel(s)
    offset = _offsets(path)[3]
    path.write_bytes(path.read_bytes()[: offset + 512 + 300])  # header of member 3 + 300 bytes


def _missing_twin(root: Path, s: int) -> None:
    path = root / "caption" / rel(s)
    path.unlink()
    Path(index_url(str(path))).unlink()


def _misaligned(root: Path, s: int) -> None:
    replace_member(root / "caption" / rel(s), 5, name="s99999999.json")


def _bad_header(root: Path, s: int) -> None:
    path = root / "image" / rel(s)
    offset = _offsets(path)[4]
    data = bytearray(path.read_bytes())
    data[offset + 3] ^= 0x01  # a bit of the member name: the header checksum no longer matches
    path.write_bytes(bytes(data))


def _oversized(root: Path, s: int) -> None:
    path = root / "image" / rel(s)
    data = members(path)[0][1]
    replace_member(path, 0, data + b"\0" * (96 * 1024))  # still a valid JPEG, just too big


def _bomb(root: Path, s: int) -> None:
    replace_member(root / "image" / rel(s), 5, jpeg(1500, 1500))  # 2.25 Mpx > 2 x MAX_PIXELS


def _bomb_warning(root: Path, s: int) -> None:
    replace_member(root / "image" / rel(s), 3, jpeg(1100, 1000))  # 1.1 Mpx > MAX_PIXELS


def _offsets(path: Path) -> list[int]:
    import json

    return json.loads(Path(index_url(str(path))).read_text())["offsets"]


KINDS: dict[str, tuple[Any, int, tuple[int, ...], str, str]] = {
    # kind: (damage, shard, skipped positions, skip reason, raise text)
    "corrupt_jpeg": (_corrupt_jpeg, 0, (1,), r"^UnidentifiedImageError: cannot identify image",
                     r"key {k1} index 1: cannot decode: UnidentifiedImageError"),
    "truncated_jpeg": (_truncated_jpeg, 1, (4,), r"^OSError: .*[Tt]runcated",
                       r"key {k4} index 4: cannot decode: OSError: .*[Tt]runcated"),
    "truncated_tar": (_truncated_tar, 2, (3, 4, 5), r"^read: TarFormatError: .*truncated tar",
                      r"index 3 \(after key {k2}\): .*image/{rel}: truncated tar: member "
                      r"'{k3}\.jpg'"),
    "missing_twin": (_missing_twin, 3, (0, 1, 2, 3, 4, 5),
                     r"^read: IngestError: shard {rel}: missing caption tar",
                     r"index 0: missing caption tar .*caption/{rel}"),
    "misaligned": (_misaligned, 4, (5,), r"^read: AlignmentError: .*modalities disagree",
                   r"index 5 \(after key {k4}\): modalities disagree at position 5: "
                   r"image={k5}, caption=s99999999"),
    "bad_header": (_bad_header, 5, (4, 5), r"^read: TarFormatError: .*checksum mismatch",
                   r"index 4 \(after key {k3}\): .*image/{rel}: corrupt tar header at byte "
                   r"\d+ \(checksum mismatch\)"),
    "oversized": (_oversized, 6, (0,), r"^read: OversizedMemberError: shard {rel}: key {k0}: "
                  r"image member {k0}\.jpg is \d+ bytes, over the member size limit of 65536 "
                  r"\(decode\.max_member_bytes\); not read$",
                  r"index 0: key {k0}: image member {k0}\.jpg is \d+ bytes, over the member size "
                  r"limit of 65536 \(decode\.max_member_bytes\); not read$"),
    "bomb": (_bomb, 7, (5,), r"^DecompressionBombError: Image size \(2250000 pixels\)",
             r"key {k5} index 5: cannot decode: DecompressionBombError"),
    "bomb_warning": (_bomb_warning, 8, (3,), r"^DecompressionBombWarning: Image size",
                     r"key {k3} index 3: cannot decode: DecompressionBombWarning"),
}
NUM_SHARDS = 10  # one clean shard after the damaged ones


def _fill(pattern: str, s: int) -> str:
    subs = {"rel": re.escape(rel(s)), **{f"k{p}": key(s, p) for p in range(SHARD_SIZE)}}
    return pattern.format(**subs)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corrupt") / "pristine"
    synth_dataset(str(root), samples=NUM_SHARDS * SHARD_SIZE, shard_size=SHARD_SIZE, seed=5,
                  min_side=16, max_side=40)
    return root


def damaged_copy(pristine: Path, dest: Path, kinds: list[str]) -> Path:
    shutil.copytree(pristine, dest)
    for kind in kinds:
        damage, shard = KINDS[kind][:2]
        damage(dest, shard)
    return dest


@pytest.fixture(scope="module")
def damaged(pristine, tmp_path_factory) -> Path:
    """Every kind of damage, each in its own shard."""
    return damaged_copy(pristine, tmp_path_factory.mktemp("corrupt") / "all", list(KINDS))


def cfg_for(path: Path, compute: str = "actors", **loader: Any):
    """The Ray edge's decode actors unless ``compute`` says otherwise (``threads``: the rank's
    own threads, what ``auto`` picks on a small node)."""
    return config_from_dict({
        "data": {"paths": [str(path)]},
        "decode": {"resolution": 16, "pool_min": 1, "pool_max": 1, "num_cpus": 0.25,
                   "compute": compute,
                   "max_member_bytes": MAX_MEMBER_BYTES, "max_image_pixels": MAX_PIXELS},
        "loader": {"batch_size": 4, "read_workers": 1, "read_num_cpus": 0.25, "block_rows": 4,
                   "shuffle": False, "equal_work": False, "prefetch_batches": 1, **loader},
    })


TOPO = Topology(world_size=1, rank=0, num_workers=1)


def run(cfg, state: ReadState | None = None, stop_after: int | None = None, local: bool = False):
    """Consume an epoch (or ``stop_after`` batches); returns (delivered, skipped, loader).

    ``local``: the same read and decode code in this process instead of the Ray edge, for the
    tests whose subject is the loader's skip filter and budgets (the driver side); the skips'
    trip through Ray's actors and error unwrapping are tested through Ray.
    """
    opener = LocalExecution.factory(cfg, load_catalog(list(cfg.data.paths))) if local else None
    loader = IngestLoader(cfg, TOPO, state=state, open_execution=opener)
    delivered: list[tuple[int, int]] = []
    skipped: list[tuple[int, int, str]] = []
    for _, batches in loader.epochs(1):
        for n, b in enumerate(batches, start=1):
            delivered += [(s, i) for s, i, p in zip(b.sids, b.indices, b.pads, strict=True)
                          if not p]
            skipped += b.skipped
            if stop_after is not None and n >= stop_after:
                break
    return delivered, skipped, loader


def expected_skips(catalog) -> dict[tuple[int, int], str]:
    sid = {s.path: i for i, s in enumerate(catalog.shards)}
    out = {}
    for kind, (_, shard, positions, _, _) in KINDS.items():
        for p in positions:
            out[(sid[rel(shard)], p)] = kind
    return out


# --- raise: every kind, one line naming shard, index/key and reason (no Ray) ----------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_raise_names_shard_key_and_reason(pristine, tmp_path, kind):
    root = damaged_copy(pristine, tmp_path / "ds", [kind])
    shard_no = KINDS[kind][1]
    cfg = cfg_for(root)
    catalog = load_catalog([str(root)])
    sid = next(i for i, s in enumerate(catalog.shards) if s.path == rel(shard_no))
    item = ReadItem(0, sid, 0, SHARD_SIZE)
    decoder = Decoder(cfg.decode, on_error="raise")
    with pytest.raises(IngestError) as info:
        for block in read_item(catalog.shards[sid], item, read_options(cfg), 4, on_error="raise"):
            decoder(block)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"shard {rel(shard_no)} "), text
    assert re.search(_fill(KINDS[kind][4], shard_no), text), text


@pytest.mark.ray
@pytest.mark.parametrize("compute", ["actors", "threads"])
def test_raise_through_the_loader_is_one_line(ray_local, pristine, tmp_path, compute):
    # decode-level: the IngestError from the decode actor, not a Ray traceback
    root = damaged_copy(pristine, tmp_path / "jpeg", ["corrupt_jpeg"])
    with pytest.raises(IngestError) as info:
        run(cfg_for(root, compute))
    text = str(info.value)
    assert "\n" not in text and type(info.value) is IngestError
    assert re.fullmatch(rf"shard {re.escape(rel(0))} key {key(0, 1)} index 1: cannot decode: "
                        r"UnidentifiedImageError: cannot identify image file .*", text), text
    # read-level: the read task's TarFormatError keeps its type
    root = damaged_copy(pristine, tmp_path / "header", ["bad_header"])
    with pytest.raises(IngestError) as info:
        run(cfg_for(root, compute))
    text = str(info.value)
    assert "\n" not in text and type(info.value).__name__ == "TarFormatError"
    # (the loader cuts a shard into tasks of block_rows samples: the one at index 4 read no key)
    assert re.fullmatch(rf"shard {re.escape(rel(5))} index 4( \(after key {key(5, 3)}\))?: "
                        rf".*image/{re.escape(rel(5))}: corrupt tar header at byte \d+ "
                        r"\(checksum mismatch\)", text), text


# --- skip: one run over every kind ----------------------------------------------------------


@pytest.fixture(scope="module")
def skip_run(ray_local, damaged):
    cfg = cfg_for(damaged, on_error="skip", max_skips_per_shard=6, max_skips_per_epoch=100)
    return run(cfg)


@pytest.mark.ray
def test_skip_records_every_bad_sample_with_its_reason(skip_run, damaged, remote_figures):
    delivered, skipped, loader = skip_run
    catalog = load_catalog([str(damaged)])
    want = expected_skips(catalog)
    got = {(s, i): reason for s, i, reason in skipped}
    for kind, (_, shard, positions, _, _) in KINDS.items():  # per kind, for the figures table
        sid = next(j for j, s in enumerate(catalog.shards) if s.path == rel(shard))
        mine = [i for s, i in delivered if s == sid]
        remote_figures.record(
            kind=kind, layer="IngestLoader skip", faulted=len(positions),
            skipped=sum(1 for s, _, _ in skipped if s == sid), samples=len(mine),
            lost=len(set(range(SHARD_SIZE)) - set(positions) - set(mine)),
            duplicated=len(mine) - len(set(mine)))
    assert len(got) == len(skipped), "a sample was skipped twice"
    assert set(got) == set(want)
    for (s, i), kind in want.items():
        pattern = _fill(KINDS[kind][3], int(catalog.shards[s].path[-10:-4]))
        assert re.search(pattern, got[(s, i)]), (kind, got[(s, i)])
    # nothing lost, nothing duplicated: every other planned sample delivered exactly once
    planned = {(s, i) for s, shard in enumerate(catalog.shards) for i in range(shard.count)}
    counts = collections.Counter(delivered)
    assert set(counts) == planned - set(want)
    assert max(counts.values()) == 1
    # metrics count them by kind
    m = loader.metrics()
    assert m["skips_total"] == len(want)
    assert m["skips_by_kind"]["read/TarFormatError"] == 3 + 2
    assert m["skips_by_kind"]["read/AlignmentError"] == 1
    assert m["skips_by_kind"]["read/IngestError"] == 6
    assert m["skips_by_kind"]["read/OversizedMemberError"] == 1  # from the header, not decode
    assert "SampleError" not in m["skips_by_kind"]


def test_skip_is_logged_with_provenance(pristine, tmp_path, caplog):
    root = damaged_copy(pristine, tmp_path / "ds", ["corrupt_jpeg"])
    with caplog.at_level(logging.WARNING, logger="ray_ingest.loader.ingest"):
        _, skipped, _ = run(cfg_for(root, on_error="skip"), local=True)
    assert [(i, r.split(":")[0]) for _, i, r in skipped] == [(1, "UnidentifiedImageError")]
    lines = [r.getMessage() for r in caplog.records if "skip shard" in r.getMessage()]
    assert len(lines) == 1
    assert re.fullmatch(rf"rank 0: skip shard {re.escape(rel(0))} key {key(0, 1)} index 1: "
                        r"UnidentifiedImageError: cannot identify image file .*", lines[0])


@pytest.mark.ray
def test_resumed_run_makes_the_same_skips(skip_run, damaged):
    """Stopped and resumed in-process, against the uninterrupted Ray run."""
    full_delivered, full_skipped, _ = skip_run
    cfg = cfg_for(damaged, on_error="skip", max_skips_per_shard=6, max_skips_per_epoch=100)
    first, skipped_a, loader = run(cfg, stop_after=7, local=True)
    saved = loader.state.to_dict()
    assert saved["epoch"] == 0 and saved["skips"], "the interruption should follow some skips"
    assert sorted(tuple(s) for s in saved["skips"]) == sorted(skipped_a)
    rest, skipped_b, _ = run(cfg, state=ReadState.from_dict(saved), local=True)
    assert sorted(first + rest) == sorted(full_delivered)  # exactly once across the restart
    assert sorted(skipped_a + skipped_b) == sorted(full_skipped)  # the same skips, once each


# --- budgets --------------------------------------------------------------------------------


def test_shard_budget_names_the_shard(damaged):
    cfg = cfg_for(damaged, on_error="skip", max_skips_per_shard=3, max_skips_per_epoch=None)
    with pytest.raises(SkipBudgetExceeded) as info:
        run(cfg, local=True)
    text = str(info.value)
    # only the missing-twin shard (6 skips) has more than 3 bad samples
    assert re.fullmatch(rf"shard {re.escape(rel(3))}: 4 samples skipped, over "
                        r"loader.max_skips_per_shard \(3\); last: read: IngestError: .*",
                        text), text


def test_epoch_budget_names_the_epoch(damaged):
    cfg = cfg_for(damaged, on_error="skip", max_skips_per_shard=None, max_skips_per_epoch=2)
    with pytest.raises(SkipBudgetExceeded) as info:
        run(cfg, local=True)
    text = str(info.value)
    assert re.fullmatch(r"epoch 0: 3 samples skipped, over loader.max_skips_per_epoch \(2\); "
                        r"last: .* \(shard part_000000/\d{6}\.tar\)", text), text
    assert "\n" not in text
