"""Mutated twin-tar datasets through ``ray-ingest cat`` (in process, as a user runs it).

A small twin dataset (image + caption, two shards of four samples) is copied and one or more of
its tars are mutated the way ``tests/twintar/test_tario_fuzz.py`` mutates tars (header fields at
edge values with or without a fixed checksum, bytes set, inserted, deleted, the file truncated),
its key index kept or dropped. ``cat`` (``--align strict`` or ``merge``) must then

* exit 0 with rows, or exit 2 with one line on stderr (``ray-ingest: error: ...``): never a
  traceback, never a hang;
* print only rows ``tarfile`` sees: each modality's member of a row (key, extension, SHA-1)
  is a member ``tarfile`` reads from that tar, in ``tarfile``'s order.

The number of datasets is the fuzz budget's (``tests/support/fuzz.py``; the counts are printed
at the end of the run).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_ingest.cli.main import main
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.tario import index_url, split_name
from tests.support.fuzz import fuzz_settings, tally, within
from tests.twintar.test_tario_fuzz import mutate, mutation, reference

pytestmark = pytest.mark.fuzz

SHARDS = ("part_000000/000000.tar", "part_000000/000001.tar")
MODALITIES = ("image", "caption")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cat_mutated") / "pristine"
    synth_dataset(str(root), samples=8, shard_size=4, seed=3, min_side=16, max_side=32)
    return root


def tarfile_members(tar: Path) -> list[tuple[str, str, str]]:
    """(key, ext, sha1) of every regular file tarfile reads from ``tar`` (up to its error)."""
    out = []
    for name, data in reference(tar.read_bytes() if tar.exists() else b"")[0]:
        parsed = split_name(name)
        if parsed is not None:
            out.append((*parsed, hashlib.sha1(data).hexdigest()))
    return out


def cat(root: Path, align: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["cat", str(root), "--align", align])
    return rc, out.getvalue(), err.getvalue()


targets = st.lists(st.tuples(st.sampled_from(MODALITIES), st.sampled_from(SHARDS),
                             st.lists(mutation, min_size=1, max_size=3)), min_size=1, max_size=3)


def _check_rows(root: Path, stdout: str) -> int:
    rows = [json.loads(line) for line in stdout.splitlines()]
    position: dict[Path, int] = {}
    members: dict[Path, list] = {}
    for rec in rows:
        for m in MODALITIES:
            if rec.get(m) is None:
                continue
            tar = root / m / rec["shard"]
            if tar not in members:
                members[tar] = tarfile_members(tar)
            seen = (rec["key"], rec[m]["ext"], rec[m]["sha1"])
            later = members[tar][position.get(tar, 0):]
            # a row tarfile does not see, or out of tarfile's order, fails here
            assert seen in later, (m, rec["shard"], seen, later[:3])
            position[tar] = position.get(tar, 0) + later.index(seen) + 1
    return len(rows)


@fuzz_settings(ci_examples=100)
@given(targets=targets, keep_index=st.booleans(), align=st.sampled_from(["strict", "merge"]))
def test_cat_on_mutated_tars_prints_rows_tarfile_sees_or_one_line(pristine, targets, keep_index,
                                                                 align):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ds"
        shutil.copytree(pristine, root)
        for modality, shard, mutations in targets:
            tar = root / modality / shard
            tar.write_bytes(mutate(tar.read_bytes(), mutations))
            if not keep_index:
                Path(index_url(str(tar))).unlink(missing_ok=True)
        with within(30, "ray-ingest cat"):
            rc, stdout, stderr = cat(root, align)
        assert "Traceback" not in stderr, stderr
        if rc == 0:
            outcome = "exit 0"
        else:
            assert rc == 2, (rc, stderr)
            assert stderr.startswith("ray-ingest: error: ") and stderr.count("\n") == 1, stderr
            outcome = "exit 2, one line"
        rows = _check_rows(root, stdout)
        tally("ray-ingest cat on mutated twin tars", outcome)
        tally("ray-ingest cat on mutated twin tars (rows printed)", f"{rows} rows" if rows < 8
              else "all 8 rows")


def test_regression_a_key_with_a_line_break_stays_on_one_line(pristine, tmp_path):
    """Found by the test above: a member named "0 path=x\\n..." made the alignment error (and
    with it ``cat``'s error) two lines; keys that are not printable are shown with repr."""
    root = tmp_path / "ds"
    shutil.copytree(pristine, root)
    tar = root / "image" / SHARDS[0]
    tar.write_bytes(mutate(tar.read_bytes(), [("field", 0, "name", b"0 path=x\n.jpg",
                                               "unsigned")]))
    rc, stdout, stderr = cat(root, "strict")
    assert rc == 2 and stderr.count("\n") == 1, stderr
    assert "modalities disagree at position 0: image='0 path=x\\n', caption=s00000000" in stderr
    assert stdout == ""
