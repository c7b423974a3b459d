"""The audit orders restarts by logical counters (attempt, step), never by wall clocks, and
tells an epoch cut by ``max_steps`` (incomplete) from a violation. No Ray, no trainer: the
ledgers are written here, shaped like the ones ``jobs/train.py --audit-dir`` writes (the real
trainer's ledgers are audited in tests/train/test_resume_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ray_ingest.catalog.load import load_catalog
from ray_ingest.cli.audit import command as audit_command
from ray_ingest.errors import IngestError
from ray_ingest.tools.audit import (
    EXACTLY_ONCE,
    INCOMPLETE,
    VIOLATION,
    audit,
    read_ledgers,
    summary_line,
)
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.train.ledger import next_attempt


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("audit") / "ds"
    synth_dataset(str(root), samples=8, shard_size=4, seed=0, min_side=8, max_side=8)
    return str(root)


def batch(rank, slot, step, sid, idx, epoch=0, **extra):
    return {"epoch": epoch, "step": step, "rank": rank, "slot": slot, "batch": step - 1,
            "keys": [f"k{sid}{idx}"], "sids": [sid], "indices": [idx], "pads": [False],
            "skipped": [], **extra}


def start(rank, world, resume, attempt=None, **extra):
    rec = {"event": "start", "rank": rank, "world": world, "slot": rank, "resume_step": resume,
           "epoch": 0, **extra}
    if attempt is not None:
        rec["attempt"] = attempt
    return rec


def write(folder: Path, ledgers: dict[int, list[dict]]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for rank, recs in ledgers.items():
        (folder / f"rank_{rank:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(folder)


def crash_and_shrink(attempts: bool, clock: dict[int, float] | None) -> dict[int, list[dict]]:
    """2 ranks crash after the step-2 checkpoint; the re-run has 1 rank and re-plans the 4
    unconsumed samples. Rank 1's step 3 was rolled back although rank 1 never logged a restart.

    ``clock``: per rank, the offset of its wall clock (``t`` stamps as an older ledger had
    them); None: no stamps at all.
    """
    ticks = iter(range(100))

    def t(rank):
        return {} if clock is None else {"t": clock[rank] + next(ticks)}

    r0 = [start(0, 2, 0, 0 if attempts else None, **t(0))]
    r1 = [start(1, 2, 0, 0 if attempts else None, **t(1))]
    for step in (1, 2, 3):  # each slot reads its own shard; the checkpoint is at step 2
        r0.append(batch(0, 0, step, 0, step - 1, **t(0)))
        r1.append(batch(1, 1, step, 1, step - 1, **t(1)))
    r0.append(start(0, 1, 2, 1 if attempts else None, **t(0)))
    for step, (sid, idx) in zip(range(3, 7), [(0, 2), (0, 3), (1, 2), (1, 3)], strict=True):
        r0.append(batch(0, 0, step, sid, idx, **t(0)))
    r0.append({"event": "epoch_end", "epoch": 0, "rank": 0, "step": 6, **t(0)})
    return {0: r0, 1: r1}


@pytest.mark.parametrize("attempts", [True, False], ids=["attempt-field", "derived"])
@pytest.mark.parametrize("clock", [None, {0: 0.0, 1: 0.0}, {0: 0.0, 1: 3600.0},
                                   {0: 3600.0, 1: 0.0}],
                         ids=["no-stamps", "same-clock", "rank1-ahead", "rank1-behind"])
def test_rollback_follows_attempts_not_clocks(tmp_path, data, attempts, clock):
    """Rank 1's clock an hour ahead made the old wall-clock audit keep its rolled-back step 3
    (logged "after" rank 0's restart) and count a duplicate; an hour behind, or no stamps at all,
    must not matter either."""
    folder = write(tmp_path / "ledger", crash_and_shrink(attempts, clock))
    ledgers = read_ledgers(folder)
    assert [b["step"] for b in ledgers[1].batches] == [1, 2]
    assert [b["step"] for b in ledgers[0].batches] == [1, 2, 3, 4, 5, 6]
    assert ledgers[0].restarts == 2 and ledgers[1].restarts == 1
    [report] = audit(ledgers, load_catalog([data]))
    assert (report["seen"], report["duplicated"], report["missing"]) == (8, 0, 0), report
    assert report["complete"] and report["exactly_once"] and report["status"] == EXACTLY_ONCE


def test_same_resume_step_twice_is_ordered_by_attempt(tmp_path, data):
    """Two restarts from the same checkpoint (step 2): the first (2 ranks) logged step 3 on both
    ranks before failing again; the second has 1 rank. Only the attempt number can tell that
    rank 1's step 3 is older than rank 0's second restart."""
    r0 = [start(0, 2, 0, 0), batch(0, 0, 1, 0, 0), batch(0, 0, 2, 0, 1),
          start(0, 2, 2, 1), batch(0, 0, 3, 0, 2),
          start(0, 1, 2, 2)]
    r1 = [start(1, 2, 0, 0), batch(1, 1, 1, 1, 0), batch(1, 1, 2, 1, 1),
          start(1, 2, 2, 1), batch(1, 1, 3, 1, 2)]
    for step, (sid, idx) in zip(range(3, 7), [(0, 2), (0, 3), (1, 2), (1, 3)], strict=True):
        r0.append(batch(0, 0, step, sid, idx))
    r0.append({"event": "epoch_end", "epoch": 0, "rank": 0, "step": 6})
    for explicit in (True, False):
        recs = {r: [{k: v for k, v in x.items() if explicit or k != "attempt"} for x in rs]
                for r, rs in {0: r0, 1: r1}.items()}
        ledgers = read_ledgers(write(tmp_path / f"l{explicit}", recs))
        assert [b["step"] for b in ledgers[1].batches] == [1, 2], explicit
        [report] = audit(ledgers, load_catalog([data]))
        assert report["status"] == EXACTLY_ONCE and report["duplicated"] == 0, (explicit, report)


def test_a_start_that_matches_no_attempt_of_rank_0_is_an_error(tmp_path):
    recs = {0: [start(0, 2, 0)], 1: [start(1, 2, 0), start(1, 2, 4)]}
    with pytest.raises(IngestError, match=r"rank_00001\.jsonl:2: start event \(resume_step 4, "
                                          r"world 2\) has no matching start event"):
        read_ledgers(write(tmp_path / "ledger", recs))


def test_next_attempt_counts_start_events(tmp_path):
    path = tmp_path / "rank_00000.jsonl"
    assert next_attempt(str(path)) == 0
    write(tmp_path, {0: [start(0, 1, 0, 0), batch(0, 0, 1, 0, 0), start(0, 1, 1, 1)]})
    assert next_attempt(str(path)) == 2


def _one_rank(steps: list[tuple[int, int, int]], end: bool) -> dict[int, list[dict]]:
    recs = [start(0, 1, 0, 0)]
    for step, (sid, idx, epoch) in enumerate(steps, start=1):
        recs.append(batch(0, 0, step, sid, idx, epoch=epoch))
    if end:
        recs.append({"event": "epoch_end", "epoch": 0, "rank": 0, "step": len(steps)})
    return {0: recs}


def test_epoch_cut_by_max_steps_is_incomplete_not_a_violation(tmp_path, data):
    full = [(s, i, 0) for s in (0, 1) for i in range(4)]
    # epoch 0 complete, epoch 1 cut after 3 samples (max_steps)
    recs = _one_rank(full + [(1, 0, 1), (0, 2, 1), (0, 0, 1)], end=True)
    folder = write(tmp_path / "ledger", recs)
    reports = audit(read_ledgers(folder), load_catalog([data]))
    assert [r["status"] for r in reports] == [EXACTLY_ONCE, INCOMPLETE]
    cut = reports[1]
    assert cut["exactly_once"] is None and not cut["complete"] and cut["missing"] == 5
    assert summary_line(cut) == ("epoch 1: incomplete, not a violation: the run stopped inside "
                                 "it (train.max_steps); 3/8 samples, 0 padded, 0 skipped so "
                                 "far, none twice")
    assert summary_line(reports[0]) == "epoch 0: exactly-once (8/8 samples, 0 padded, 0 skipped)"
    res = CliRunner().invoke(audit_command, [folder, "--data", data])
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["status"] for x in res.stdout.splitlines()] == [EXACTLY_ONCE, INCOMPLETE]


@pytest.mark.parametrize("end", [False, True], ids=["cut", "ended"])
def test_duplicate_is_a_violation_even_in_an_incomplete_epoch(tmp_path, data, end):
    recs = _one_rank([(0, 0, 0), (0, 1, 0), (0, 0, 0)], end=end)
    folder = write(tmp_path / "ledger", recs)
    [report] = audit(read_ledgers(folder), load_catalog([data]))
    assert report["status"] == VIOLATION and report["exactly_once"] is False
    assert report["duplicated"] == 1
    line = summary_line(report)
    assert line.startswith("epoch 0: VIOLATION: 1 duplicated")
    assert ("missing" in line) == end  # a cut epoch is not missing what it has not read yet
    res = CliRunner().invoke(audit_command, [folder, "--data", data])
    assert res.exit_code == 1, res.output


def test_finished_epoch_with_missing_samples_is_a_violation(tmp_path, data):
    folder = write(tmp_path / "ledger", _one_rank([(0, 0, 0), (0, 1, 0)], end=True))
    [report] = audit(read_ledgers(folder), load_catalog([data]))
    assert report["status"] == VIOLATION and report["missing"] == 6
    assert summary_line(report).startswith("epoch 0: VIOLATION: 6 missing")
