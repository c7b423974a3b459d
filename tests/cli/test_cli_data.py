"""CLI data plane: shard -> cat round trip, info, synth, and one-line errors (exit 2)."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_ingest.cli.main import main
from tests.support.datagen import RAW_SIZES, write_json, write_raw_folders, write_twin

SHARD = "part_000000/000000.tar"


def run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("ray-ingest: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


# --------------------------------------------------------------------------- round trip


def test_shard_then_cat_round_trip(tmp_path, capsys):
    raw = write_raw_folders(tmp_path / "in")
    out = tmp_path / "out"
    rc, text, _ = run(capsys, "shard", raw, out, "--shard-size", "2", "--classify-aspect-ratio",
                      "--num-workers", "3")
    assert rc == 0 and "wrote 10 samples" in text and "dropped from umt5/" in text
    rc, text, err = run(capsys, "cat", out)
    assert rc == 0 and err == ""
    recs = records(text)
    assert sorted(r["key"] for r in recs) == [s[0] for s in RAW_SIZES]  # each once
    for r in recs:
        assert set(r) == {"key", "shard", "index", "image", "caption", "umt5"}
        for m in ("image", "caption", "umt5"):
            (src,) = (raw / m).glob(f"{r['key']}.*")
            data = src.read_bytes()
            assert r[m] == {"ext": src.suffix[1:], "bytes": len(data),
                            "sha1": hashlib.sha1(data).hexdigest()}
    # wdinfo counts match the tars, for every leaf
    for wd in sorted(out.rglob("wdinfo.json")):
        doc = json.loads(wd.read_text())
        for m in doc["data_keys"]:
            counts = []
            for rel in doc["data_list"]:
                with tarfile.open(wd.parent / m / rel) as tf:
                    counts.append(sum(1 for x in tf.getmembers() if x.isreg()))
            assert counts == doc["data_list_key_count"]
    # buckets: each key sits under the bucket of its image size
    by_key = {s[0]: s[3] for s in RAW_SIZES}
    rc, text, _ = run(capsys, "info", out, "--json")
    summary = json.loads(text)
    assert summary["samples"] == 10 and summary["datasets"] == len(set(by_key.values()))
    for w in summary["wdinfos"]:
        rc, text, _ = run(capsys, "cat", w["wdinfo"])
        assert {by_key[r["key"]] for r in records(text)} == {w["bucket"]}
    assert summary["buckets"] == {b: list(by_key.values()).count(b) for b in set(by_key.values())}
    tar_bytes = {m: sum(p.stat().st_size for p in out.glob(f"*/{m}/**/*.tar"))
                 for m in ("image", "caption", "umt5")}
    assert summary["bytes"] == tar_bytes


def test_synth_info_cat(tmp_path, capsys):
    out = tmp_path / "syn"
    rc, text, _ = run(capsys, "synth", out, "--samples", "9", "--shard-size", "4",
                      "--modalities", "image,caption,umt5", "--aspect-ratios", "16:9,1:1",
                      "--json")
    assert rc == 0
    report = json.loads(text)
    assert report["samples"] == 9 and report["shards"] == 3
    rc, text, _ = run(capsys, "info", out)
    assert rc == 0
    assert "samples:    9" in text and "shards:     3" in text
    assert "modalities: image, caption, umt5" in text
    rc, text, _ = run(capsys, "cat", out / "wdinfo.json", "--modalities", "caption,image",
                      "--limit", "5")
    recs = records(text)
    assert [r["key"] for r in recs] == [f"s{i:08d}" for i in range(5)]
    assert [r["index"] for r in recs] == [0, 1, 2, 3, 0]
    assert all(set(r) == {"key", "shard", "index", "caption", "image"} for r in recs)
    assert recs[4]["shard"] == "part_000000/000001.tar"


def test_cat_decode_prints_dtypes_and_shapes(tmp_path, capsys):
    out = tmp_path / "mm"
    rc, _, _ = run(capsys, "synth", out, "--samples", "4", "--shard-size", "2", "--modalities",
                   "image,caption,mask,depth,label", "--min-side", "96", "--max-side", "128")
    assert rc == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {{paths: [{out}], modalities: [image, caption, mask, depth, label]}}\n"
                   "decode: {resolution: 48, crop: random, transform: "
                   "'tests.support.hooks:Scale', transform_kwargs: {factor: 2}}\n")
    rc, text, _ = run(capsys, "cat", out, "--limit", "2", "--config", cfg)
    assert rc == 0
    recs = records(text)
    assert [r["key"] for r in recs] == ["s00000000", "s00000001"]
    for r in recs:
        assert r["image"]["dtype"] == "uint8" and r["image"]["shape"] == [48, 48, 3]
        assert r["depth"]["dtype"] == "uint16" and r["depth"]["shape"] == [48, 48]
        assert r["mask"]["dtype"] == "uint8" and r["mask"]["shape"] == [48, 48]
        assert r["label"]["type"] == "int64" and r["caption"]["type"] == "str"
        assert r["scaled_label"]["value"] == 2 * r["label"]["value"]  # the hook's field
    rc, text, _ = run(capsys, "cat", out, "--limit", "1", "--decode")
    assert records(text)[0]["image"]["shape"] == [256, 256, 3]


def test_cat_merge_prints_stats(tmp_path, capsys):
    wd = write_twin(tmp_path, {SHARD: {"image": ["a", "b", "c", "d"],
                                       "caption": ["b", "a", "x", "d", "d"]}})
    rc, text, err = run(capsys, "cat", wd, "--align", "merge")
    assert rc == 0
    assert [r["key"] for r in records(text)] == ["a", "b", "d"]
    assert err.count("\n") == 1 and err.startswith("ray-ingest cat: merge stats: ")
    stats = json.loads(err.split("stats: ", 1)[1])
    assert stats == {"emitted": 3, "counts": {"caption": {
        "missing": 1, "extra": 1, "duplicate": 1, "reordered": 1}}}


def test_cat_index_and_optional(tmp_path, capsys):
    wd = write_twin(tmp_path, {SHARD: {"image": ["a", "b", "c"], "caption": ["a", "b", "c"],
                                       "umt5": ["b"]}}, data_keys=["image", "caption", "umt5"])
    index = tmp_path / "keys.parquet"
    pq.write_table(pa.table({"key": ["c.jpg", "a.jpg", "zz"]}), index)
    rc, text, err = run(capsys, "cat", wd, "--align", "index", "--index", index,
                        "--optional", "umt5")
    assert rc == 0
    recs = records(text)
    assert [(r["key"], r["index"]) for r in recs] == [("c", 0), ("a", 1)]
    assert all(r["umt5"] is None for r in recs)
    assert "index stats" in err
    rc, text, _ = run(capsys, "cat", wd, "--optional", "umt5")
    assert [r["umt5"] is not None for r in records(text)] == [False, True, False]


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def good(tmp_path) -> Path:
    return write_twin(tmp_path / "ds", {
        SHARD: {"image": ["a", "b", "c"], "caption": ["a", "b", "c"]},
        "part_000000/000001.tar": {"image": ["d", "e"], "caption": ["d", "e"]},
    })


# --------------------------------------------------------------------------- renamed names

def test_modalities_flag_and_no_keys_flag(tmp_path, capsys, good):
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    sids = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    recs = [{"event": "start", "rank": 0, "world": 1, "slot": 0, "resume_step": 0, "epoch": 0,
             "attempt": 0}]
    recs += [{"epoch": 0, "step": n, "rank": 0, "slot": 0, "batch": n - 1, "keys": [f"k{n}"],
              "sids": [sid], "indices": [idx], "pads": [False], "skipped": []}
             for n, (sid, idx) in enumerate(sids, start=1)]
    recs.append({"event": "epoch_end", "epoch": 0, "rank": 0, "step": len(sids)})
    (ledger / "rank_00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    calls = {"info": [good, "--json"], "cat": [good],
             "plan": [good, "--world-size", "1", "--read-workers", "1", "--json"],
             "audit": [ledger, "--data", good]}
    outs = {}
    for cmd, args in calls.items():
        rc, new, err = run(capsys, cmd, *args, "--modalities", "caption")
        assert rc == 0 and err == "", (cmd, err)
        outs[cmd] = new
        # --keys, the old name, was dropped (docs/release_notes.md)
        rc, _, err = run(capsys, cmd, *args, "--keys", "caption")
        assert rc == 2 and "No such option '--keys'" in err, (cmd, err)
    assert json.loads(outs["info"])["modalities"] == ["caption"]
    assert {tuple(r) for r in records(outs["cat"])} == {("key", "shard", "index", "caption")}
    assert json.loads(outs["audit"])["status"] == "exactly-once"


def test_library_modalities_arguments(good):
    from ray_ingest.tools.summary import iter_records, summarize

    assert summarize(str(good), ["caption"])["modalities"] == ["caption"]
    assert set(next(iter_records(str(good), modalities=["caption"]))) == {
        "key", "shard", "index", "caption"}
    with pytest.raises(TypeError, match="keys"):
        summarize(str(good), keys=["caption"])


def test_missing_wdinfo(tmp_path, capsys):
    missing = tmp_path / "nope" / "wdinfo.json"
    assert_one_line_error(*run(capsys, "cat", missing)[::2], str(missing), "not found")
    assert_one_line_error(*run(capsys, "info", tmp_path / "nope")[::2], "no such file")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*run(capsys, "cat", tmp_path / "empty")[::2], "no wdinfo.json")


@pytest.mark.parametrize(("doc", "needle"), [
    (None, "malformed JSON"),
    ({"total_key_count": 3}, "missing field 'data_list'"),
    ({"data_list": ["a.tar"]}, "missing field 'total_key_count'"),
    ({"data_list": ["a.tar"], "total_key_count": 3, "chunk_size": 0}, "'chunk_size' must be > 0"),
    ({"data_list": [], "total_key_count": 0}, "'data_list' is empty"),
])
@pytest.mark.parametrize("cmd", ["cat", "info"])
def test_bad_wdinfo(tmp_path, capsys, doc, needle, cmd):
    wd = tmp_path / "wdinfo.json"
    if doc is None:
        wd.write_text('{"data_list": [')
    else:
        write_json(wd, doc)
    assert_one_line_error(*run(capsys, cmd, wd)[::2], str(wd), needle)


def test_missing_twin_tar(good, capsys):
    (good.parent / "caption" / "part_000000" / "000001.tar").unlink()
    rc, out, err = run(capsys, "cat", good)
    assert len(records(out)) == 3  # the first shard was fine
    assert_one_line_error(rc, err, "shard part_000000/000001.tar", "missing caption tar",
                          "caption/part_000000/000001.tar")
    assert_one_line_error(*run(capsys, "info", good)[::2], "caption tars are missing")


def test_truncated_tar(good, capsys):
    tar = good.parent / "image" / SHARD
    tar.write_bytes(tar.read_bytes()[: 512 * 3 + 100])  # header of b, data cut short
    rc, out, err = run(capsys, "cat", good)
    assert_one_line_error(rc, err, str(tar), "truncated tar", "member 'b.jpg'")


def test_truncated_header(good, capsys):
    tar = good.parent / "caption" / SHARD
    tar.write_bytes(tar.read_bytes()[: 512 * 2 + 300])
    assert_one_line_error(*run(capsys, "cat", good)[::2], str(tar), "truncated tar: header")


def test_corrupt_header_checksum(good, capsys):
    tar = good.parent / "caption" / SHARD
    data = bytearray(tar.read_bytes())
    data[1024 + 3] ^= 0x55  # second member's header
    tar.write_bytes(bytes(data))
    rc, out, err = run(capsys, "cat", good)
    assert_one_line_error(rc, err, str(tar), "corrupt tar header at byte 1024")


def test_not_a_tar(good, capsys):
    tar = good.parent / "image" / SHARD
    tar.write_text("hello, I am not a tar" * 40)
    assert_one_line_error(*run(capsys, "cat", good)[::2], str(tar), "checksum")


def test_strict_mismatch(tmp_path, capsys):
    wd = write_twin(tmp_path, {SHARD: {"image": ["a", "b", "c"], "caption": ["a", "c", "b"]}})
    rc, out, err = run(capsys, "cat", wd)
    assert [r["key"] for r in records(out)] == ["a"]
    assert_one_line_error(rc, err, f"shard {SHARD}", "position 1", "image=b", "caption=c")
    wd = write_twin(tmp_path / "short", {SHARD: {"image": ["a", "b"], "caption": ["a"]}})
    assert_one_line_error(*run(capsys, "cat", wd)[::2], "position 1", "caption=<end of tar>")


def test_other_bad_arguments(tmp_path, capsys, good):
    assert_one_line_error(*run(capsys, "cat", good, "--align", "index")[::2], "--index")
    assert_one_line_error(*run(capsys, "cat", good, "--align", "index", "--index",
                               tmp_path / "no.parquet")[::2], "index file not found")
    assert_one_line_error(*run(capsys, "cat", good, "--modalities", "image,umt5")[::2],
                          "missing umt5 tar")
    assert_one_line_error(*run(capsys, "shard", tmp_path / "nope", tmp_path / "o")[::2],
                          "input folder not found")
    assert_one_line_error(*run(capsys, "synth", tmp_path / "s", "--samples", "0",
                               "--shard-size", "1")[::2], "samples")
    assert_one_line_error(*run(capsys, "synth", tmp_path / "s", "--samples", "2",
                               "--shard-size", "1", "--aspect-ratios", "wide")[::2],
                          "aspect_ratios")
    rc, _, err = run(capsys, "cat", good, "--align", "zip")
    assert rc == 2 and "Traceback" not in err
