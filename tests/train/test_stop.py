"""``jobs/train.py --stop-file``: the run ends at the first epoch end after the file exists
(the chaos soak stops its job this way; tests/execution/test_chaos.py runs it whole)."""

from __future__ import annotations

from ray_ingest.train.job import build_parser
from ray_ingest.train.worker import _stop_requested


def test_the_flag_reaches_the_workers_config():
    args = build_parser().parse_args(["--config", "c.yaml", "--stop-file", "stop"])
    assert args.stop_file == "stop"
    assert build_parser().parse_args(["--config", "c.yaml"]).stop_file is None


def test_a_rank_stops_once_the_file_exists(tmp_path):
    path = tmp_path / "stop"
    assert not _stop_requested(None, 1, "cpu")
    assert not _stop_requested(str(path), 1, "cpu")
    path.write_text("")
    assert _stop_requested(str(path), 1, "cpu")
