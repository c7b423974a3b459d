"""`ray-ingest plan` on a small wdinfo.json (no tars needed)."""

from __future__ import annotations

import json

import pytest

from ray_ingest.cli.main import main


def write_wdinfo(folder, n=10, prefix="part_000000"):
    folder.mkdir(parents=True, exist_ok=True)
    doc = {
        "data_keys": ["caption", "image"],
        "data_list": [f"{prefix}/{i:06d}.tar" for i in range(n)],
        "data_list_key_count": [10] * n,
        "total_key_count": 10 * n,
        "chunk_size": 10,
    }
    (folder / "wdinfo.json").write_text(json.dumps(doc))
    return folder / "wdinfo.json"


def tar(i):
    return f"part_000000/{i:06d}.tar"


def test_single_worker_lines_pid(tmp_path, capsys):
    path = write_wdinfo(tmp_path)
    rc = main(["plan", str(path), "--world-size", "2", "--read-workers", "2", "--rank", "1",
               "--worker", "1", "--seed-mode", "pid", "--repeat"])
    assert rc == 0
    # E2: rank 1 / worker 1 -> u7, u1, u3
    assert capsys.readouterr().out.splitlines() == [tar(7), tar(1), tar(3)]


def test_json_all_ranks_with_groups(tmp_path, capsys):
    write_wdinfo(tmp_path / "ds")
    rc = main(["plan", str(tmp_path), "--world-size", "4", "--read-workers", "2",
               "--group-size", "2", "--seed-mode", "pid", "--repeat", "--json"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["rank"], r["worker"], r["group"]) for r in rows] == [
        (r, w, r // 2) for r in range(4) for w in range(2)]
    by = {(r["rank"], r["worker"]): r["shards"] for r in rows}
    # E8
    assert by[0, 0] == by[1, 0] == [tar(0), tar(8), tar(4)]
    assert by[0, 1] == by[1, 1] == [tar(6), tar(0), tar(2)]
    assert by[2, 0] == by[3, 0] == [tar(5), tar(9), tar(1)]
    assert by[2, 1] == by[3, 1] == [tar(7), tar(1), tar(3)]


def test_json_one_rank_all_workers_and_flags(tmp_path, capsys):
    path = write_wdinfo(tmp_path)
    rc = main(["plan", str(path), "--world-size", "2", "--read-workers", "2", "--rank", "0",
               "--seed-mode", "pid", "--no-shuffle", "--no-repeat", "--json", "--modalities",
               "image,caption"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # E3 rank 0
    assert rows == [
        {"rank": 0, "worker": 0, "group": 0, "shards": [tar(0), tar(4), tar(8)]},
        {"rank": 0, "worker": 1, "group": 0, "shards": [tar(2), tar(6)]},
    ]


def test_epoch_mode_changes_with_epoch_and_start_index_skips(tmp_path, capsys):
    path = write_wdinfo(tmp_path, n=40)
    args = ["plan", str(path), "--world-size", "2", "--read-workers", "2", "--rank", "0",
            "--worker", "0", "--seed", "3"]
    outs = []
    for extra in ([], ["--epoch", "0"], ["--epoch", "1"], ["--start-index", "40"]):
        assert main(args + extra) == 0
        outs.append(capsys.readouterr().out.splitlines())
    assert outs[0] == outs[1] and len(outs[0]) == 10
    assert outs[2] != outs[0]
    # start_index 40 // chunk_size 10 = 4 chunks; 4 // 2 workers = 2 shards skipped.
    assert outs[3] == outs[0][2:]


def test_two_datasets_share_relative_paths(tmp_path, capsys):
    write_wdinfo(tmp_path / "a", n=2)
    write_wdinfo(tmp_path / "b", n=2)
    rc = main(["plan", str(tmp_path / "a"), str(tmp_path / "b"), "--world-size", "1",
               "--read-workers", "1", "--rank", "0", "--worker", "0", "--seed-mode", "pid",
               "--no-shuffle"])
    assert rc == 0
    assert capsys.readouterr().out.splitlines() == [tar(0), tar(1), tar(0), tar(1)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rank", "2", "--worker", "0"], "Topology.rank"),
        (["--rank", "0", "--worker", "5"], "Topology.worker_id"),
        (["--rank", "0"], "--rank/--worker"),
        (["--json", "--group-size", "3"], "Topology.group_size"),
        (["--json", "--start-index", "-1"], "start_index"),
        (["--json", "--epoch", "-1"], "epoch"),
        (["--json", "--seed-mode", "bogus"], "seed-mode"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, extra, message):
    path = write_wdinfo(tmp_path)
    rc = main(["plan", str(path), "--world-size", "2", "--read-workers", "2", *extra])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err


def test_missing_path_exits_2(tmp_path, capsys):
    rc = main(["plan", str(tmp_path / "nope"), "--world-size", "1", "--read-workers", "1",
               "--json"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file or folder" in err[0]
