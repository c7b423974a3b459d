"""read_shard: slices and resume (with and without the key index), index files, bad tars."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_ingest.catalog.shard import TarSample
from ray_ingest.errors import IngestError, TarFormatError
from ray_ingest.twintar.reader import (
    ReadOptions,
    load_index_keys,
    read_shard,
)
from ray_ingest.twintar.tario import index_url
from ray_ingest.twintar.twin import (
    INDEX,
    KEY,
    AlignStats,
)
from tests.datagen import write_tar, write_twin

SHARD = "part_000000/000000.tar"
KEYS = [f"id{i:02d}" for i in range(9)]


def _shard(root: Path, modalities=("image", "caption")) -> TarSample:
    return TarSample(path=SHARD, root=str(root), modalities=modalities, count=None)


def _strip(rows):
    return [{k: v for k, v in r.items()} for r in rows]


@pytest.fixture(params=[True, False], ids=["with-index", "no-index"])
def aligned(request, tmp_path):
    write_twin(tmp_path, {SHARD: {"image": KEYS, "caption": KEYS}}, index=request.param)
    assert Path(index_url(str(tmp_path / "image" / SHARD))).exists() == request.param
    return _shard(tmp_path)


@pytest.mark.parametrize("align", ["strict", "merge"])
def test_slices_equal_full_read(aligned, align):
    opts = ReadOptions(align=align)
    full = list(read_shard(aligned, opts=opts))
    assert [r[KEY] for r in full] == KEYS
    for start in range(len(KEYS) + 2):
        for count in (0, 1, 3, None):
            got = list(read_shard(aligned, start=start, count=count, opts=opts))
            end = None if count is None else start + count
            assert _strip(got) == _strip(full[start:end]), (start, count)


@pytest.mark.parametrize("use_index", [True, False])
def test_merge_slices_of_a_messy_shard(tmp_path, use_index):
    image = ["a", "b", "c", "b", "d", "e", "f", "g"]  # duplicate b at position 3
    caption = ["x", "c", "a", "d", "e", "g", "f", "b"]  # reordered, extra x, no gaps
    write_twin(tmp_path, {SHARD: {"image": image, "caption": caption}}, index=True)
    shard = _shard(tmp_path)
    opts = ReadOptions(align="merge", use_index=use_index)
    full = list(read_shard(shard, opts=opts))
    assert [r[KEY] for r in full] == ["a", "b", "c", "d", "e", "f", "g"]
    for start in range(len(image) + 1):
        for count in (1, 2, None):
            got = list(read_shard(shard, start=start, count=count, opts=opts))
            want = [r for r in full if r[INDEX] >= start]
            want = want if count is None else want[:count]
            assert _strip(got) == _strip(want), (start, count)


@pytest.mark.parametrize("use_index", [True, False])
def test_strict_slice_with_optional_modality_gaps(tmp_path, use_index):
    write_twin(tmp_path, {SHARD: {"image": KEYS, "caption": KEYS,
                                  "umt5": KEYS[1::2]}}, index=True)
    shard = _shard(tmp_path, ("image", "caption", "umt5"))
    opts = ReadOptions(align="strict", optional=("umt5",), use_index=use_index)
    full = list(read_shard(shard, opts=opts))
    assert [r["umt5"] is not None for r in full] == [i % 2 == 1 for i in range(len(KEYS))]
    for start in range(len(KEYS)):
        got = list(read_shard(shard, start=start, count=3, opts=opts))
        assert _strip(got) == _strip(full[start : start + 3]), start


def test_stale_index_is_ignored(tmp_path):
    for m, ext in (("image", "jpg"), ("caption", "json")):
        write_tar(tmp_path / m / SHARD, [(f"{k}.{ext}", b"x" * 2000) for k in KEYS], index=True)
    # rewrite both tars with small members; the old indexes (other offsets) stay behind
    for m, ext in (("image", "jpg"), ("caption", "json")):
        idx_path = Path(index_url(str(tmp_path / m / SHARD)))
        old_index = idx_path.read_text()
        write_tar(tmp_path / m / SHARD, [(f"{k}.{ext}", b"y") for k in KEYS])
        idx_path.write_text(old_index)
    rows = list(read_shard(_shard(tmp_path), start=2, count=2))
    assert [(r[KEY], r[INDEX], r["image"]) for r in rows] == [
        (KEYS[2], 2, b"y"), (KEYS[3], 3, b"y")]


def test_broken_index_falls_back_to_streaming(tmp_path):
    write_twin(tmp_path, {SHARD: {"image": KEYS, "caption": KEYS}}, index=True)
    Path(index_url(str(tmp_path / "image" / SHARD))).write_text("{not json")
    Path(index_url(str(tmp_path / "caption" / SHARD))).write_text(json.dumps({"version": 99}))
    rows = list(read_shard(_shard(tmp_path), start=4, count=2))
    assert [r[KEY] for r in rows] == KEYS[4:6]


def test_index_mode_reads_parquet_key_list(tmp_path):
    write_twin(tmp_path, {SHARD: {"image": KEYS, "caption": KEYS},
                          "part_000000/000001.tar": {"image": ["q1", "q2"],
                                                     "caption": ["q1", "q2"]}})
    index = tmp_path / "keys.parquet"
    pq.write_table(pa.table({
        "sample": ["id03.jpg", "id01.jpg", "nope.jpg", "q2.jpg", "id05"],
        "shard": [SHARD, SHARD, SHARD, "part_000000/000001.tar", SHARD],
    }), index)
    assert load_index_keys(str(index), SHARD) == ["id03", "id01", "nope", "id05"]
    stats = AlignStats()
    rows = list(read_shard(_shard(tmp_path), opts=ReadOptions(align="index",
                                                              index_path=str(index)), stats=stats))
    assert [r[KEY] for r in rows] == ["id03", "id01", "id05"]
    assert stats.get("image", "missing") == 1 and stats.get("caption", "missing") == 1
    # no shard column: the list applies to every shard
    flat = tmp_path / "flat.parquet"
    pq.write_table(pa.table({"key": ["id02", "id00"]}), flat)
    rows = list(read_shard(_shard(tmp_path), opts=ReadOptions(align="index",
                                                              index_path=str(flat))))
    assert [r[KEY] for r in rows] == ["id02", "id00"]


def test_index_mode_errors(tmp_path):
    write_twin(tmp_path, {SHARD: {"image": KEYS, "caption": KEYS}})
    with pytest.raises(IngestError, match="needs an index file"):
        list(read_shard(_shard(tmp_path), opts=ReadOptions(align="index")))
    with pytest.raises(IngestError, match="index file not found"):
        list(read_shard(_shard(tmp_path),
                        opts=ReadOptions(align="index", index_path=str(tmp_path / "no.parquet"))))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(IngestError, match="cannot read parquet key index"):
        list(read_shard(_shard(tmp_path), opts=ReadOptions(align="index", index_path=str(bad))))


def test_missing_driver_tar_names_it(tmp_path):
    write_twin(tmp_path, {SHARD: {"image": KEYS, "caption": KEYS}})
    (tmp_path / "caption" / SHARD).unlink()
    with pytest.raises(IngestError, match=r"shard part_000000/000000.tar: missing caption tar"):
        list(read_shard(_shard(tmp_path)))


def test_truncated_member_is_a_tar_format_error(tmp_path):
    write_twin(tmp_path, {SHARD: {"image": KEYS, "caption": KEYS}})
    tar = tmp_path / "caption" / SHARD
    data = tar.read_bytes()
    tar.write_bytes(data[: 512 * 7 + 5])  # inside the 4th member's payload
    with pytest.raises(TarFormatError, match="truncated tar"):
        list(read_shard(_shard(tmp_path)))


def test_memory_filesystem(tmp_path):
    import fsspec

    from ray_ingest.twintar.writer import write_shard

    leaf = "memory://reader-test/ds"
    write_shard(leaf, SHARD, ["image", "caption"],
                [(k, {"image": ("jpg", k.encode()), "caption": ("json", b"{}")}) for k in KEYS])
    try:
        shard = TarSample(path=SHARD, root=leaf, modalities=("image", "caption"), count=None)
        assert [r[KEY] for r in read_shard(shard, start=3, count=2)] == KEYS[3:5]
    finally:
        fsspec.filesystem("memory").rm("/reader-test", recursive=True)
