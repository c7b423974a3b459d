"""Quiet output: the noise filters drop exactly Ray's known-harmless lines (verbatim, as Ray
2.60 printed them in ``make demo``) and nothing else; the embedded Ray is started so that the
State API exists; the demo's output is short, clean and ends with a correct audit summary."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ray_ingest.train import quiet

ROOT = Path(__file__).resolve().parents[2]

NOISE_LINES = [
    "Failed to query Ray Train Controller actor state. State API may be temporarily unavailable. "
    "Continuing to monitor.",
    "[2026-12-01 08:04:40,471 E 11858 11886] core_worker.cc:2465: Actor with class name: "
    "'PreemptionWatcher' and ID: 'cc1787d44138b2fcfe941a3c01000000' has constructor arguments in "
    "the object store and max_restarts > 0. If the arguments in the object store go out of scope "
    "or are lost, the actor restart will fail. See https://github.com/ray-project/ray/issues/53727"
    " for more details.",
    "[2026-12-01 08:04:42,906 E 11973 12133] core_worker.cc:2465: Actor with class name: "
    "'MapWorker(MapBatches(Decoder))' and ID: 'c1156a0c014f77674fb0d55401000000' has constructor "
    "arguments in the object store and max_restarts > 0. If the arguments in the object store go "
    "out of scope or are lost, the actor restart will fail.",
    "WARNING: 8 PYTHON worker processes have been started on node: "
    "90cfdf3b5342ebc71ba55734e0d81ee62f4c9384d84bb84e4eadafbe with address: 192.0.2.2, which is "
    "4x the maximum expected startup concurrency (2). This could be a result of using a large "
    "number of actors, tasks blocked in ray.get() calls, or tasks with fractional CPU requests "
    "(e.g., num_cpus=0.1) allowing high concurrency.",
    "Task MapWorker(MapBatches(Decoder)).submit failed. There are infinite retries remaining, so "
    "the task will be retried. Error: The actor is dead because it was killed by `ray.kill`.",
    "[2026-12-01 08:42:50,928 E 20661 20661] (gcs_server) gcs_actor_scheduler.cc:538: Failed to "
    "kill actor b51c488cbf37422174d9469a01000000, return status: Invalid: KillActor RPC failed for "
    "actor b51c488cbf37422174d9469a01000000: RpcError: RPC error: Socket closed rpc_code: 14",
]
KEPT_LINES = [
    "[train] step 25 epoch 0 loss 0.0338 samples/s 34.4 data-wait 80.6% stages {}",
    "rank 0: skip shard part_000000/000000.tar key s00000001 index 1: UnidentifiedImageError: x",
    "[2026-12-01 08:04:40,471 E 11858 11886] core_worker.cc:2465: Actor with class name: "
    "'Decoder' and ID: 'cc17' died unexpectedly",  # a different message of the same file
    "Task MapWorker(MapBatches(Decoder)).submit failed. There are infinite retries remaining, so "
    "the task will be retried. Error: The actor died because of an error raised in its creation "
    "task",  # a real actor failure is not noise
    "WARNING: 8 PYTHON worker processes have been started on node: x with address: y",
    "Failed to query Ray Train Controller actor state.",
    "Traceback (most recent call last):",
    "(gcs_server) gcs_actor_scheduler.cc:538: Failed to kill actor b51c, return status: Invalid: "
    "KillActor RPC failed for actor b51c: RpcError: RPC error: Deadline Exceeded",
]


@pytest.mark.parametrize("line", NOISE_LINES)
def test_noise_lines_are_recognised(line):
    assert quiet.is_noise(line)
    assert quiet.is_noise(f"\x1b[36m(PlacementGroupCleaner pid=11942)\x1b[0m {line}")


@pytest.mark.parametrize("line", KEPT_LINES)
def test_other_lines_are_kept(line):
    assert not quiet.is_noise(line)


def _filtered_print(monkeypatch):
    """Ray's ``print_worker_logs``, wrapped by the driver filter (restored after the test)."""
    import ray._private.worker as ray_worker

    monkeypatch.setattr(ray_worker, "_worker_logs_enabled", True, raising=False)
    monkeypatch.setattr(ray_worker, "print_worker_logs", ray_worker.print_worker_logs)
    assert quiet.filter_driver_output()
    return ray_worker.print_worker_logs


def test_driver_filter_drops_noise_from_both_of_rays_paths(monkeypatch):
    import ray._private.worker as ray_worker

    _filtered_print(monkeypatch)
    assert quiet.filter_driver_output()  # idempotent: wraps once
    assert ray_worker.print_worker_logs._ray_ingest_filter
    out = io.StringIO()
    batch = {"ip": "127.0.0.1", "pid": 1234, "task_name": "", "actor_name": "", "is_err": True,
             "localhost": "127.0.0.1", "lines": [NOISE_LINES[0], KEPT_LINES[0], NOISE_LINES[2]]}
    ray_worker.print_worker_logs(batch, out)
    raylet = {"pid": "raylet", "is_err": False, "lines": [NOISE_LINES[3]]}  # error channel
    ray_worker.print_worker_logs(raylet, out)
    text = out.getvalue()
    assert KEPT_LINES[0] in text and "State API" not in text and "core_worker" not in text
    assert "PYTHON worker" not in text and len(text.splitlines()) == 1


#: Ray Train's controller on an overloaded machine (verbatim from a test run's demo output,
#: the site-packages path shortened): a warning that calls itself harmless, with a traceback.
TRANSIENT_WARNING = [
    "Failed to send resource request for train-74fceefc04a24f568fb6268e79759307. If this only "
    "happens transiently during network partition or CPU being overloaded, it's safe to ignore "
    "this error. If this error persists, file a GitHub issue.",
    "Traceback (most recent call last):",
    '  File "/venv/ray/train/v2/_internal/execution/scaling_policy/autoscaling_coordinator_'
    'client.py", line 58, in send_resource_request',
    "    ray.get(",
    '  File "/venv/ray/_private/worker.py", line 3009, in get',
    "    values, debugger_breakpoint = worker.get_objects(",
    "                                  ^^^^^^^^^^^^^^^^^^^",
    '  File "python/ray/includes/common.pxi", line 107, in ray._raylet.check_status',
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.",
]
CHAINED = ["", "During handling of the above exception, another exception occurred:", "",
           "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
           "RuntimeError: raised while handling it"]
OTHER_TRACEBACK = ["Traceback (most recent call last):", '  File "ours.py", line 9, in f',
                   "ValueError: a failure of ours"]


def _printed(monkeypatch, batches):
    """What the filtered ``print_worker_logs`` prints for ``batches`` of (pid, lines)."""
    print_worker_logs = _filtered_print(monkeypatch)
    out = io.StringIO()
    for pid, lines in batches:
        print_worker_logs(
            {"ip": "127.0.0.1", "pid": pid, "actor_name": "TrainController", "task_name": "",
             "is_err": True, "localhost": "127.0.0.1", "lines": lines}, out)
    return [re.sub(r"^.*pid=\d+\)\S* ", "", x) for x in out.getvalue().splitlines()]


def test_a_transient_warning_keeps_its_line_and_loses_its_traceback(monkeypatch):
    assert not quiet.is_noise(TRANSIENT_WARNING[0])
    after = "[train] step 3 epoch 1 loss 0.05"
    assert _printed(monkeypatch, [(7, [*TRANSIENT_WARNING, after])]) == [
        TRANSIENT_WARNING[0], after]


@pytest.mark.parametrize("cut", range(1, len(TRANSIENT_WARNING) + 1))
def test_the_traceback_is_dropped_across_batches_and_others_pass(monkeypatch, cut):
    """Cut anywhere; another process's traceback in between and one of its own afterwards
    are printed whole."""
    batches = [(7, TRANSIENT_WARNING[:cut]), (8, OTHER_TRACEBACK),
               (7, TRANSIENT_WARNING[cut:] + CHAINED), (7, ["done", *OTHER_TRACEBACK])]
    assert _printed(monkeypatch, [b for b in batches if b[1]]) == [
        TRANSIENT_WARNING[0], *OTHER_TRACEBACK, "done", *OTHER_TRACEBACK]


def test_only_a_traceback_right_after_the_warning_is_dropped(monkeypatch):
    lines = [TRANSIENT_WARNING[0], "an unrelated line", *OTHER_TRACEBACK]
    assert _printed(monkeypatch, [(7, lines)]) == lines


def test_the_traceback_is_dropped_when_rays_deduplication_took_its_header(monkeypatch):
    """Ray's log deduplication runs first: a ``Traceback`` header another process printed a
    moment ago is not in the batch, so the traceback starts at a frame line."""
    after = "[train] step 3 epoch 1 loss 0.05"
    lines = [TRANSIENT_WARNING[0], *TRANSIENT_WARNING[2:], after]
    assert _printed(monkeypatch, [(7, lines)]) == [TRANSIENT_WARNING[0], after]


def test_rays_repeat_summary_of_a_dropped_line_is_dropped_and_others_pass(monkeypatch):
    """The summary Ray prints later for a line that other processes repeated
    (``DedupState.formatted``, verbatim colours): dropped when the line was one of the
    transient traceback's, printed otherwise."""
    from ray._private.ray_logging import DedupState

    def summary(line):
        return DedupState(0, 3, line, {}, {("127.0.0.1", 7)}).formatted()

    frame, other = TRANSIENT_WARNING[4], OTHER_TRACEBACK[1]
    got = _printed(monkeypatch, [(7, TRANSIENT_WARNING), (8, [summary(frame)]),
                                 (8, [summary(other)]), (8, [summary(TRANSIENT_WARNING[1])])])
    assert len(got) == 3 and got[0] == TRANSIENT_WARNING[0]
    assert got[1].startswith(other) and "[repeated 3x across cluster]" in got[1]
    # the header every traceback has is not remembered: its summary is printed
    assert got[2].startswith(TRANSIENT_WARNING[1])


def test_a_line_that_is_not_an_exception_ends_the_traceback_and_is_kept(monkeypatch):
    """Ray's deduplication may also take the exception's own line: the next line of the
    process that is not shaped like an exception is printed."""
    after = "[train] step 3 epoch 1 loss 0.05"
    lines = [*TRANSIENT_WARNING[:-1], after, "done"]
    assert _printed(monkeypatch, [(7, lines)]) == [TRANSIENT_WARNING[0], after, "done"]


def test_embedded_ray_gets_a_private_address_and_a_state_api(monkeypatch):
    monkeypatch.setattr(quiet, "dashboard_available", lambda: True)
    kw = quiet.embedded_ray_kwargs(4, {"A": "1"})
    port = kw["dashboard_port"]
    assert kw["address"] == "local" and kw["include_dashboard"] and port not in (8265, 0)
    assert kw["runtime_env"]["env_vars"] == {"A": "1",
                                             "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
    assert kw["logging_level"] == logging.WARNING
    monkeypatch.setattr(quiet, "dashboard_available", lambda: False)
    kw = quiet.embedded_ray_kwargs(4, {"A": "1"}, quiet=False)
    assert not kw["include_dashboard"] and "logging_level" not in kw
    assert kw["runtime_env"]["env_vars"] == {"A": "1"}


def test_quiet_worker_keeps_ray_data_warnings_and_files(monkeypatch):
    import ray.data
    from ray.train.v2._internal.execution import context as train_context

    data_logger = logging.getLogger("ray.data")
    handlers = [(h, h.level) for h in data_logger.handlers]
    ctx = ray.data.DataContext.get_current()
    monkeypatch.setattr(ctx, "print_on_execution_start", True)
    report_logger = logging.getLogger(train_context.__file__)
    level = report_logger.level
    progress = logging.getLogger("ray.data._internal.progress")
    filters = list(progress.filters)
    try:
        quiet.quiet_worker()
        assert not ctx.print_on_execution_start
        console = [h for h in data_logger.handlers if type(h).__name__ == "PlainRayHandler"]
        assert console and all(h.level == logging.WARNING for h in console)
        files = [h for h in data_logger.handlers if type(h).__name__ != "PlainRayHandler"]
        assert all(h.level < logging.WARNING for h in files)  # the log file keeps INFO
        assert report_logger.level == logging.WARNING
        record = logging.LogRecord("ray.data._internal.progress", logging.WARNING, "f", 1,
                                   "Progress bars disabled. To enable, set `x`", (), None)
        assert not progress.filter(record)
        record.msg = "some other warning"
        assert progress.filter(record)
    finally:
        for h, lv in handlers:
            h.setLevel(lv)
        report_logger.setLevel(level)
        progress.filters[:] = filters


@pytest.mark.train
def test_demo_output_is_short_clean_and_ends_with_the_audit(tmp_path):
    """`ray-ingest demo` on its own embedded Ray (a fresh one, as `make demo` starts it)."""
    cfg = tmp_path / "demo.yaml"
    text = (ROOT / "configs" / "demo.yaml").read_text()
    text = re.sub(r"resolution: \d+", "resolution: 16", text)
    text = re.sub(r"log_every: \d+", "log_every: 1", text)
    cfg.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run(
        [sys.executable, "-m", "ray_ingest.cli.main", "demo", "--out", str(tmp_path / "demo"),
         "--samples", "32", "--shard-size", "16", "--config", str(cfg), "--max-steps", "3",
         "--num-workers", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    print(out)
    assert res.returncode == 0, out
    lines = out.splitlines()
    assert "State API" not in out and "Traceback" not in out
    assert not [x for x in lines if quiet.is_noise(x)]
    assert not [x for x in lines if "Reporting training result" in x or "Started a local" in x]
    # each train line once (Ray Train's print patch printed them twice)
    steps = [x for x in lines if "[train] step " in x]
    assert len(steps) == 3 and len(set(steps)) == 3, steps
    assert len(lines) <= 40, len(lines)
    # the demo says in words which decode mode ran: on this small single node with Ray up,
    # auto decodes off the trainer, in companion processes on the rank's node
    decode = [x for x in lines if "[train] decode: " in x]
    assert len(decode) == 1, decode
    assert decode[0].split("[train] decode: ", 1)[1].startswith(
        "process: companion decode processes on each rank's own node, off the trainer's "
        "process"), decode
    done = [json.loads(x.split("[train] done: ", 1)[1]) for x in lines if "[train] done: " in x]
    assert [d["decode_compute"] for d in done] == ["process"], done
    audit = [x.split("[demo] audit ", 1)[1] for x in lines if "[demo] audit " in x]
    # 32 samples, 1 rank, batch 16: 2 batches per epoch; step 3 is in epoch 1
    assert len(audit) == 2, audit
    assert audit[0] == "epoch 0: exactly-once (32/32 samples, 0 padded, 0 skipped)", audit
    assert audit[1] == ("epoch 1: incomplete, not a violation: the run stopped inside it "
                        "(train.max_steps); 16/32 samples, 0 padded, 0 skipped so far, none twice")
