"""ray_ingest/tools/cpu_roles.py: role classification, the per-run arithmetic on fake /proc
snapshots (ended children, reaping and non-reaping parents, reused pids), a fake /proc tree, a
real child process, and (``ray``) a real actor's CPU under its role."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ray_ingest.tools import cpu_roles as cr
from ray_ingest.tools.cpu_roles import ProcStat


def P(pid, ppid, cpu, child=0.0, cmd="", comm="python", start=None):  # noqa: N802
    return ProcStat(pid=pid, ppid=ppid, start=pid if start is None else start, comm=comm,
                    cmd=cmd, cpu_s=cpu, child_cpu_s=child)


def stat_line(pid, comm, ppid, utime, stime, cutime=0, cstime=0, start=None):
    """A /proc/PID/stat line (fields after the comm: state, ppid, ..., utime at 14)."""
    f = ["S", ppid, 0, 0, 0, 0, 0, 0, 0, 0, 0, utime, stime, cutime, cstime, 20, 0, 1, 0,
         pid if start is None else start, 0, 0]
    return f"{pid} ({comm}) " + " ".join(str(x) for x in f)


def test_parse_stat_comm_with_spaces_and_parentheses():
    t = cr.TICK
    p = cr.parse_stat(7, stat_line(7, "ray::Map (x) y", 3, 2 * t, t, 4 * t, 0, start=99), "c")
    assert (p.pid, p.ppid, p.start, p.comm, p.cmd) == (7, 3, 99, "ray::Map (x) y", "c")
    assert (p.cpu_s, p.child_cpu_s) == (3.0, 4.0)


@pytest.mark.parametrize(("cmd", "title"), [
    ("ray::IDLE", "IDLE"),
    ("ray::MapWorker(MapBatches(ReadDecoder)).submit", "MapWorker(MapBatches(ReadDecoder))"),
    ("ray::MapWorker(MapBatches(ReadDecoder))", "MapWorker(MapBatches(ReadDecoder))"),
    ("ray::_StatsActor.update_metrics", "_StatsActor"),
    ("ray::ReadTwinTar->MapBatches(decode)", "ReadTwinTar->MapBatches(decode)"),
    ("/usr/bin/python x.py", None),
])
def test_worker_title(cmd, title):
    assert cr.worker_title(cmd) == title


@pytest.mark.parametrize(("proc", "titles", "parent", "role"), [
    (P(100, 1, 0), [], None, cr.TRAINER),
    (P(5, 100, 0, comm="raylet", cmd="/x/ray/core/src/ray/raylet/raylet --a"), [], cr.TRAINER,
     cr.RAYLET),
    (P(6, 100, 0, comm="gcs_server"), [], cr.TRAINER, cr.GCS),
    (P(7, 5, 0, cmd="ray::IDLE"), ["IDLE"], cr.RAYLET, cr.IDLE),
    (P(8, 5, 0, cmd="ray::IDLE"), ["IDLE", "ReadTwinTar->MapBatches(f)"], cr.RAYLET, cr.DECODE),
    (P(9, 5, 0, cmd="ray::MapWorker(MapBatches(D))"), ["MapWorker(MapBatches(D))"], cr.RAYLET,
     cr.DECODE),
    (P(10, 5, 0, cmd="ray::_StatsActor"), ["_StatsActor"], cr.RAYLET, cr.DATA_ACTORS),
    (P(11, 5, 0, cmd="ray::ActorLocationTracker"), ["ActorLocationTracker"], cr.RAYLET,
     cr.DATA_ACTORS),
    (P(12, 5, 0, cmd="ray::DashboardAgent"), ["DashboardAgent"], cr.RAYLET, cr.AGENTS),
    (P(13, 100, 0, cmd="python -u /v/ray/_private/log_monitor.py --x"), [], cr.TRAINER,
     cr.AGENTS),
    (P(14, 100, 0, cmd="python bench/throughput.py"), [], cr.TRAINER, cr.LOADER_PROCS),
    (P(15, 14, 0, cmd="python -c x"), [], cr.LOADER_PROCS, cr.LOADER_PROCS),
    (P(16, 5, 0, cmd="/bin/sh -c y"), [], cr.RAYLET, cr.OTHER),
    (P(17, 1, 0, cmd="ray::IDLE", comm="ray::IDLE"), [], None, cr.IDLE),
    (P(18, 5, 0, comm="ray::_StatsActo"), ["_StatsActo"], cr.RAYLET, cr.DATA_ACTORS),
    (P(19, 5, 0, comm="ray::MapWorker("), ["MapWorker("], cr.RAYLET, cr.DECODE),
])
def test_classify(proc, titles, parent, role):
    assert cr.classify(proc, titles, 100, parent) == role


@pytest.mark.parametrize(("name", "group"), [
    ("MainThread", cr.T_MAIN), ("ray_ingest-decode_3", cr.T_DECODE),
    ("ray_ingest-read_0", cr.T_DECODE), ("ray_ingest-head", cr.T_DECODE),
    ("ray_ingest-handoff", cr.T_LOADER), ("StreamingExecutor-ds_1", cr.T_DATA),
    ("Prefetcher", cr.T_DATA), ("map_tp_filling_worker-1", cr.T_DATA),
    ("ray_listen_error_messages", cr.T_RAY_PY), ("PythonGCThread", cr.T_OTHER),
    (None, cr.T_NATIVE),
])
def test_thread_group(name, group):
    assert cr.thread_group(name, "python") == group
    assert cr.thread_group(name, "python", sampler=True) == cr.ACCOUNTING


def test_tracker_roles_tails_and_missed():
    """A run of 2 s: trainer, raylet, a decode actor the raylet lets end (its last interval is
    lost and estimated), a DataLoader worker born and ended inside the run (the trainer reaps
    it: the rest comes back through cutime), and a child of the trainer never sampled."""
    t = cr.Tracker(0.0, [
        P(100, 1, 10.0), P(200, 100, 1.0, comm="raylet"),
        P(300, 200, 0.5, cmd="ray::MapWorker(MapBatches(D))"),
    ])
    t.observe(1.0, [
        P(100, 1, 11.0), P(200, 100, 1.2, comm="raylet"),
        P(300, 200, 2.0, cmd="ray::MapWorker(MapBatches(D)).submit"),
        P(400, 100, 0.7, cmd="python bench/x.py"),
    ])
    t.observe(2.0, [  # 300 ended (the raylet did not wait); 400 ended, reaped at 1.0 + 0.3
        P(100, 1, 12.0, child=1.0 + 0.5), P(200, 100, 1.5, comm="raylet"),
    ])
    roles, ended, missed = t.account(100)
    assert ended == 2
    assert roles[cr.TRAINER] == pytest.approx(2.0)
    assert roles[cr.RAYLET] == pytest.approx(0.5)
    assert roles[cr.DECODE] == pytest.approx(1.5)  # 0.5 -> 2.0 while sampled
    # 400: 0.7 sampled + its 0.3 after the last sample; the unseen child's 0.5 too (one role)
    assert roles[cr.LOADER_PROCS] == pytest.approx(0.7 + 0.3 + 0.5)
    assert missed == pytest.approx(1.5 / 1.0 * 1.0)  # last rate 1.5 CPU-s/s, unseen for 1 s
    acc = cr.Account(wall_s=2.0, roles=roles, threads={}, titles=t.titles(), ended=ended,
                     est_missed_s=missed, snapshots=t.snapshots, machine_busy_s=4.0)
    per = acc.per_sample_ms(1000)
    assert per["total"] == pytest.approx((2.0 + 0.5 + 1.5 + 1.5) / 1000 * 1e3)
    assert per[cr.DECODE] == pytest.approx(1.5)
    assert acc.per_second_ms()[cr.RAYLET] == pytest.approx(250.0)
    assert t.titles() == {"MapWorker(MapBatches(D))": pytest.approx(1.5)}


def test_tracker_zombie_title_from_comm_only_when_none_seen():
    t = cr.Tracker(0.0, [P(100, 1, 0.0, start=0),
                         P(7, 100, 0.0, cmd="ray::_StatsActor", comm="ray::_StatsActo"),
                         P(8, 100, 0.0, comm="ray::_Autoscali")])  # first seen as a zombie
    t.observe(1.0, [P(100, 1, 0.0, start=0), P(7, 100, 0.5, comm="ray::_StatsActo"),
                    P(8, 100, 0.5, comm="ray::_Autoscali")])
    assert t.seen[(7, 7)].titles == ["_StatsActor"]
    assert t.seen[(8, 8)].titles == ["_Autoscali"]
    assert t.account(100)[0][cr.DATA_ACTORS] == pytest.approx(1.0)


def test_tracker_unseen_children_of_mixed_roles_and_reused_pid():
    t = cr.Tracker(0.0, [P(100, 1, 0.0, start=0), P(500, 100, 0.2, cmd="python w.py", start=1)])
    # 500 ends and its pid comes back as a new process (another start): two processes
    t.observe(1.0, [P(100, 1, 0.0, child=0.2 + 0.1, start=0),
                    P(500, 100, 0.4, cmd="ray::IDLE", start=2)])
    t.observe(2.0, [P(100, 1, 0.0, child=0.3, start=0),
                    P(500, 100, 0.9, cmd="ray::IDLE", start=2)])
    roles, ended, missed = t.account(100)
    assert ended == 1 and missed == 0.0
    assert roles[cr.LOADER_PROCS] == pytest.approx(0.0 + 0.1)  # grew 0 sampled, 0.1 reaped
    assert roles[cr.IDLE] == pytest.approx(0.9)  # born in the run: all of it


def test_thread_split_accounts_ended_threads():
    base = {(1, 1): P(1, 0, 1.0), (2, 2): P(2, 0, 0.5)}
    last = {(1, 1): P(1, 0, 2.0), (2, 2): P(2, 0, 0.7), (3, 3): P(3, 0, 0.4)}
    groups = {(1, 1): cr.T_MAIN, (2, 2): cr.T_DECODE, (3, 3): cr.T_DECODE}
    out = cr.thread_split(base, last, groups, process_growth=2.0)
    assert out[cr.T_MAIN] == pytest.approx(1.0)
    assert out[cr.T_DECODE] == pytest.approx(0.6)
    assert out[cr.T_ENDED] == pytest.approx(0.4)
    assert sum(out.values()) == pytest.approx(2.0)


def _acc(roles):
    return cr.Account(wall_s=1.0, roles=roles, threads={}, titles={}, ended=0,
                      est_missed_s=0.0, snapshots=2, machine_busy_s=0.0).to_dict()


def test_compare_medians_and_ratios():
    runs = {
        "ours:threads": [{"samples": 1000, "cpu_roles": _acc({cr.TRAINER: 3.0})},
                         {"samples": 1000, "cpu_roles": _acc({cr.TRAINER: 2.0})},
                         {"samples": 1000, "cpu_roles": _acc({cr.TRAINER: 2.5})}],
        "ours:actors": [{"samples": 1000, "cpu_roles": _acc({cr.TRAINER: 1.0, cr.DECODE: 2.0,
                                                              cr.ACCOUNTING: 9.0})},
                        {"samples": 500, "cpu_roles": _acc({cr.TRAINER: 0.5, cr.DECODE: 1.0})},
                        {"samples": 1000, "cpu_roles": _acc({cr.TRAINER: 1.0, cr.DECODE: 2.5})}],
        "wds_dl_pw": [{"samples": 1000}],  # sampling off: left out
    }
    out = cr.compare(runs, "ours:threads")
    assert out["ms_per_sample"]["ours:threads"]["total"] == pytest.approx(2.5)
    actors = out["ms_per_sample"]["ours:actors"]
    assert actors[cr.DECODE] == pytest.approx(2.0) and actors[cr.TRAINER] == pytest.approx(1.0)
    assert actors["total"] == pytest.approx(3.0)  # the sampler's own CPU is not counted
    assert out["ratio"] == {"ours:actors": pytest.approx(3.0 / 2.5)}
    assert out["per_run_ratios"]["ours:actors"] == pytest.approx([1.0, 1.5, 3.5 / 2.5])
    assert "wds_dl_pw" not in out["ms_per_sample"]
    assert cr.compare(runs, "ceiling")["ratio"] == {}
    lines = cr.format_table(out["ms_per_sample"])
    assert lines[0].split()[-2:] == ["ours:threads", "ours:actors"]
    assert [ln.split()[0] for ln in lines[1:]] == ["trainer", "ray", "accounting", "total"]


def _write_proc(root, pid, comm, ppid, cpu_ticks, cmd="", child_ticks=0, start=None):
    d = root / str(pid)
    d.mkdir(exist_ok=True)
    (d / "stat").write_text(stat_line(pid, comm, ppid, cpu_ticks, 0, child_ticks, 0, start))
    (d / "cmdline").write_bytes(cmd.replace(" ", "\0").encode())


def test_sampler_on_a_fake_proc_tree(tmp_path):
    """Members are the root's descendants (a grandchild listed before its parent too); other
    processes are never counted; an exited member is counted up to its last sample, and its
    pid taken by another user's process is not a member."""
    t = cr.TICK
    (tmp_path / "stat").write_text("cpu  100 0 100 1000 0 0 0 0 0 0\n")
    _write_proc(tmp_path, 1000, "python", 1, 5 * t, "python bench.py")
    _write_proc(tmp_path, 1001, "raylet", 1000, 1 * t, "/r/raylet/raylet --x")
    _write_proc(tmp_path, 990, "ray::IDLE", 1001, 1 * t, "ray::IDLE")  # pid below its parent
    _write_proc(tmp_path, 1002, "python", 1, 50 * t, "someone else's job")
    _write_proc(tmp_path, 1003, "ray::IDLE", 1001, 2 * t, "ray::IDLE")
    _write_proc(tmp_path, 1005, "ray::IDLE", 1001, 2 * t, "ray::IDLE", start=5)
    s = cr.Sampler(root=1000, interval=30.0, proc=str(tmp_path)).start()
    _write_proc(tmp_path, 1000, "python", 1, 7 * t, "python bench.py")
    _write_proc(tmp_path, 990, "ray::MapWor", 1001, 4 * t, "ray::MapWorker(MapBatches(D))")
    _write_proc(tmp_path, 1002, "python", 1, 90 * t, "someone else's job")
    _write_proc(tmp_path, 1004, "ray::_StatsAc", 1001, 1 * t, "ray::_StatsActor")  # new
    for f in (tmp_path / "1003").iterdir():
        f.unlink()
    (tmp_path / "1003").rmdir()
    _write_proc(tmp_path, 1005, "python", 1, 70 * t, "reused pid", start=6)
    (tmp_path / "stat").write_text("cpu  400 0 100 1100 0 0 0 0 0 0\n")
    acc = s.stop()
    assert acc.snapshots == 2 and acc.ended == 2 and not acc.threads
    assert acc.roles[cr.TRAINER] == pytest.approx(2.0 - acc.roles[cr.ACCOUNTING])
    assert acc.roles[cr.DECODE] == pytest.approx(3.0)
    assert acc.roles[cr.DATA_ACTORS] == pytest.approx(1.0)
    assert acc.roles[cr.RAYLET] == 0.0 and acc.roles[cr.IDLE] == 0.0
    assert cr.OTHER not in acc.roles  # 1002 is not in the tree
    assert acc.machine_busy_s == pytest.approx(300 / t)


def test_sampler_counts_a_real_child_process():
    """A child this process waits for: its CPU lands under ``loader processes`` (sampled, and
    the rest through this process's cutime), not under the trainer."""
    burn = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.4: pass"
    c0 = os.times()
    s = cr.Sampler(interval=0.05).start()
    subprocess.run([sys.executable, "-c", burn], check=True)
    acc = s.stop()
    c1 = os.times()
    child = c1.children_user + c1.children_system - c0.children_user - c0.children_system
    kids = sum(v for k, v in acc.roles.items()
               if k in (cr.LOADER_PROCS, f"unseen children of {cr.TRAINER}"))
    assert child >= 0.4
    assert kids == pytest.approx(child, abs=3 / cr.TICK)
    assert acc.roles[cr.TRAINER] < child
    assert sum(acc.threads.values()) == pytest.approx(
        acc.roles[cr.TRAINER] + acc.roles[cr.ACCOUNTING], abs=3 / cr.TICK)
    assert acc.roles[cr.ACCOUNTING] > 0


def test_sampler_splits_the_trainer_by_thread_name():
    """A thread started (and ended) inside the run is grouped by its Python name.

    The thread burns until the sampler has looked at the threads twice after its first 0.3 s
    (on a loaded machine the sampler's scan can take longer than the burn itself)."""
    import threading

    burnt = []
    looks = []

    def names():
        looks.append(time.monotonic())
        return cr._python_thread_names()

    def burn():
        t = time.thread_time()
        while time.thread_time() - t < 0.3:
            pass
        seen = len(looks)
        deadline = time.monotonic() + 30
        while len(looks) < seen + 2 and time.monotonic() < deadline:
            pass
        burnt.append(time.thread_time() - t)

    s = cr.Sampler(interval=0.05, thread_names=names).start()
    th = threading.Thread(target=burn, name="ray_ingest-decode_0")
    th.start()
    th.join()
    acc = s.stop()
    assert burnt[0] >= 0.3
    # sampled while it ran (up to one interval lost when it ended, counted as ended threads)
    assert acc.threads[cr.T_DECODE] + acc.threads[cr.T_ENDED] >= 0.3 - 2 / cr.TICK
    assert acc.threads[cr.T_DECODE] >= 0.25


@pytest.mark.ray
def test_sampler_sees_a_ray_actor_under_its_role(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0.1)
    class Burner:
        def burn(self, s):
            t = time.process_time()
            while time.process_time() - t < s:
                pass
            return time.process_time() - t

    a = Burner.remote()
    ray.get(a.burn.remote(0.0))  # started before the sampling
    s = cr.Sampler(interval=0.1).start()
    burnt = ray.get(a.burn.remote(0.5))
    acc = s.stop()
    ray.kill(a)
    assert burnt >= 0.5
    assert acc.roles[cr.DECODE] >= burnt - 2 / cr.TICK
    assert any("Burner" in k for k in acc.titles)
    assert cr.RAYLET in acc.roles and cr.GCS in acc.roles
