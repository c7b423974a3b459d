"""CPU seconds per role of the processes a benchmark run involves, read from /proc (Linux).

The trainer's ``os.times()`` misses most of what Ray costs: the raylet, the GCS, decode actors,
task workers and Ray Data's own actors are other processes, not children this process waits
for. With ``ray.init(address="local")`` they are all in the driver's process tree (the GCS,
raylet, dashboard and monitors are the driver's children; workers and agents the raylet's), so
:class:`Sampler` follows that tree, reads every member's utime + stime a few times a second and
sums the growth per role (:func:`classify`); the driver's own CPU is split by thread
(:func:`thread_group`). :class:`Tracker` does the arithmetic on snapshots, without I/O.

What it cannot see (written down in :class:`Account`): a process that vanishes is read for
the last time at the sample before; when its parent waits for it (the trainer waits for its
DataLoader workers) the rest comes back exactly through the parent's cutime + cstime, but the
raylet lets the kernel reap its workers, so their last interval is lost (estimated in
``est_missed_s``) and a worker living less than one interval is not seen at all. A process
whose parent ended before it was first seen is outside the tree. No Ray, no torch.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import attrs

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

TRAINER = "trainer"
ACCOUNTING = "accounting (this sampler)"
LOADER_PROCS = "loader processes"
DECODE = "ray decode workers"
IDLE = "ray idle workers"
DATA_ACTORS = "ray data actors"
RAYLET = "raylet"
GCS = "gcs_server"
AGENTS = "ray agents"
OTHER = "other"
#: Table order. A tail of ended children nobody sampled is named ``unseen children of ROLE``.
ROLES = (TRAINER, LOADER_PROCS, DECODE, IDLE, DATA_ACTORS, RAYLET, GCS, AGENTS, OTHER)
#: Ray's processes that run whatever the job does (their idle rate is measured on its own).
RAY_DAEMONS = (RAYLET, GCS, AGENTS, DATA_ACTORS, IDLE)
#: Titles (``ray::TITLE``) of Ray Data's own actors, and of Ray's agents.
DATA_ACTOR_TITLES = ("_StatsActor", "_AutoscalingCoordinatorActor", "AutoscalingRequester",
                     "SplitCoordinator", "ActorLocationTracker", "_StatsSummaryActor",
                     "_UsageCollectionActor", "_BlockPretcher")
AGENT_TITLES = ("DashboardAgent", "RuntimeEnvAgent")
#: Ray's daemons that are Python scripts (their command line, not a title).
AGENT_SCRIPTS = ("/dashboard/dashboard.py", "/dashboard/agent.py", "/_private/log_monitor.py",
                 "/autoscaler/_private/monitor.py", "/runtime_env/agent/main.py")

#: Groups of the trainer's threads (:func:`thread_group`).
T_MAIN = "main thread"
T_DECODE = "decode threads"
T_LOADER = "loader threads"
T_DATA = "ray data threads"
T_RAY_PY = "ray python threads"
T_NATIVE = "native threads"
T_OTHER = "other python threads"
T_ENDED = "ended threads (unsampled)"
THREAD_GROUPS = (T_MAIN, T_DECODE, T_LOADER, T_DATA, T_RAY_PY, T_NATIVE, T_OTHER, T_ENDED,
                 ACCOUNTING)
#: ray_ingest's decode pool (``decode.compute: threads``) and head start; its other threads
#: (the handoff from Ray Data's iterator) are ``T_LOADER``.
DECODE_THREAD_PREFIXES = ("ray_ingest-decode", "ray_ingest-read", "ray_ingest-head")
DATA_THREAD_PREFIXES = ("StreamingExecutor", "Prefetcher", "iter_threaded", "map_tp_",
                        "ray-data-")
RAY_THREAD_PREFIXES = ("ray_", "import_thread", "ray-")


@attrs.frozen
class ProcStat:
    """One process (or thread) as /proc showed it at one moment."""

    pid: int
    ppid: int
    #: Start time after boot, in clock ticks: tells a reused pid apart.
    start: int
    comm: str
    #: Command line, NULs as spaces; a Ray worker's is its title (``ray::IDLE``).
    cmd: str
    #: utime + stime, seconds.
    cpu_s: float
    #: cutime + cstime: ended children this process waited for, seconds.
    child_cpu_s: float = 0.0
    #: Resident set size, bytes.
    rss: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start


def parse_stat(pid: int, text: str, cmd: str = "") -> ProcStat:
    """A ``/proc/PID/stat`` line (the comm may hold spaces and parentheses)."""
    comm = text[text.find("(") + 1:text.rfind(")")]
    f = text[text.rfind(")") + 2:].split()
    return ProcStat(pid=pid, ppid=int(f[1]), start=int(f[19]), comm=comm, cmd=cmd,
                    cpu_s=(int(f[11]) + int(f[12])) / TICK,
                    child_cpu_s=(int(f[13]) + int(f[14])) / TICK,
                    rss=int(f[21]) * PAGE if len(f) > 21 else 0)


def read_proc(pid: int, proc: str = "/proc", cmd: bool = True) -> ProcStat | None:
    """``/proc/PID`` now, or None when it has exited."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            text = f.read()
        line = ""
        if cmd:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError):
        return None
    return parse_stat(pid, text, line)


def read_threads(pid: int, proc: str = "/proc") -> list[ProcStat]:
    """The threads of ``pid`` now (tid as ``pid``; comm is the kernel's thread name)."""
    out = []
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/stat") as f:
                out.append(parse_stat(int(tid), f.read()))
        except (OSError, ValueError):
            continue
    return out


def machine_cpu_s(proc: str = "/proc") -> tuple[float, float]:
    """(busy, idle) CPU-s of the whole machine since boot (all users; iowait counts idle)."""
    with open(f"{proc}/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / TICK, idle / TICK


def worker_title(cmd: str) -> str | None:
    """A Ray worker's title without ``ray::`` and without the method it runs now
    (``MapWorker(MapBatches(Decoder)).submit`` -> ``MapWorker(MapBatches(Decoder))``)."""
    if not cmd.startswith("ray::"):
        return None
    title = cmd[5:].split(" ")[0]
    return re.sub(r"\.[A-Za-z_]\w*$", "", title)


def classify(p: ProcStat, titles: Iterable[str], trainer_pid: int, parent_role: str | None
             ) -> str:
    """The role of a process over a run.

    Args:
        p: its last snapshot.
        titles: the Ray titles it showed during the run (a task worker shows ``IDLE`` between
            tasks: one other title makes it a decode worker for the whole run).
        trainer_pid: the benchmark's process.
        parent_role: its parent's role (None when the parent was not seen).
    """
    if p.pid == trainer_pid:
        return TRAINER
    if p.comm == "raylet" or "/raylet/raylet" in p.cmd:
        return RAYLET
    if p.comm == "gcs_server" or "/gcs/gcs_server" in p.cmd:
        return GCS
    seen = [t for t in titles if t]
    if seen or p.cmd.startswith("ray::"):
        names = {t for t in seen if t != "IDLE"}
        if _known(names, AGENT_TITLES):
            return AGENTS
        if _known(names, DATA_ACTOR_TITLES):
            return DATA_ACTORS
        return DECODE if names else IDLE
    if any(s in p.cmd for s in AGENT_SCRIPTS):
        return AGENTS
    if parent_role in (TRAINER, LOADER_PROCS):
        return LOADER_PROCS  # a DataLoader's or a multiprocessing pool's worker
    return OTHER


#: Characters of a title in a comm (15, less ``ray::``): all a zombie or an unreadable
#: cmdline leaves.
COMM_TITLE = 10


def _known(titles: Iterable[str], known: Iterable[str]) -> bool:
    """Whether a title is one of ``known``, or the start of one cut to a comm's length."""
    return any(t == k or (len(t) == COMM_TITLE and k.startswith(t))
               for t in titles for k in known)


def thread_group(name: str | None, comm: str, sampler: bool = False) -> str:
    """The group of one of the trainer's threads, from its Python name (None: a thread Python
    did not start: Ray's core worker, gRPC, torch's or OpenMP's pools)."""
    if sampler:
        return ACCOUNTING
    if name is None:
        return T_NATIVE
    if name == "MainThread":
        return T_MAIN
    if name.startswith(DECODE_THREAD_PREFIXES):
        return T_DECODE
    if name.startswith("ray_ingest-"):
        return T_LOADER
    if name.startswith(DATA_THREAD_PREFIXES):
        return T_DATA
    if name.startswith(RAY_THREAD_PREFIXES):
        return T_RAY_PY
    return T_OTHER


@attrs.define
class _Seen:
    """One process (or thread) over an interval."""

    base_cpu: float  # CPU when the interval began (0 for one born inside it)
    base_child: float
    last: ProcStat
    last_t: float
    prev_cpu: float  # CPU at the sample before ``last`` (a rate for what was missed)
    prev_t: float
    titles: list[str] = attrs.Factory(list)
    ended_t: float | None = None  # first sample that no longer found it
    peak_rss: int = 0


class Tracker:
    """Growth per process between snapshots of a process tree; no I/O.

    Args:
        t0: time of the first snapshot.
        procs: every member alive at ``t0``: what they used before is not the interval's.
    """

    def __init__(self, t0: float, procs: Iterable[ProcStat]):
        self.t0 = self.t = t0
        self.snapshots = 1
        self.seen: dict[tuple[int, int], _Seen] = {}
        for p in procs:
            self.seen[p.key] = _Seen(p.cpu_s, p.child_cpu_s, p, t0, p.cpu_s, t0,
                                     _titles(p))

    def observe(self, t: float, procs: Iterable[ProcStat]) -> None:
        """Every member alive at ``t``; a member missing now has ended."""
        before, self.t = self.t, t
        self.snapshots += 1
        now = set()
        for p in procs:
            now.add(p.key)
            s = self.seen.get(p.key)
            if s is None:  # born after the last sample: all its CPU is the interval's
                self.seen[p.key] = _Seen(0.0, 0.0, p, t, 0.0, before, _titles(p))
                continue
            s.prev_cpu, s.prev_t = s.last.cpu_s, s.last_t
            s.last, s.last_t = p, t
            s.peak_rss = max(s.peak_rss, p.rss)
            s.ended_t = None
            for title in _titles(p, from_comm=not s.titles):
                if title not in s.titles:
                    s.titles.append(title)
        for key, s in self.seen.items():
            if key not in now and s.ended_t is None:
                s.ended_t = t

    def peak_rss(self, trainer_pid: int) -> dict[str, int]:
        """The largest resident set any one process of each role reached, in bytes."""
        out: dict[str, int] = {}
        for key, role in self.roles(trainer_pid).items():
            s = self.seen[key]
            out[role] = max(out.get(role, 0), s.peak_rss, s.last.rss)
        return out

    def growth(self) -> dict[tuple[int, int], float]:
        """CPU-s each member used in the interval (up to its last sample)."""
        return {k: max(0.0, s.last.cpu_s - s.base_cpu) for k, s in self.seen.items()}

    def roles(self, trainer_pid: int) -> dict[tuple[int, int], str]:
        """Role of every member (parents first, so a DataLoader worker knows its parent)."""
        out: dict[tuple[int, int], str] = {}

        def role(key: tuple[int, int], depth: int = 0) -> str:
            if key in out:
                return out[key]
            s = self.seen[key]
            parent = self._parent(s.last)
            prole = role(parent, depth + 1) if parent is not None and depth < 64 else None
            out[key] = classify(s.last, s.titles, trainer_pid, prole)
            return out[key]

        for key in self.seen:
            role(key)
        return out

    def _parent(self, p: ProcStat) -> tuple[int, int] | None:
        """The member that started ``p``: its ppid, started no later than ``p``."""
        best = None
        for key in self.seen:
            if key[0] == p.ppid and key[1] <= p.start and (best is None or key[1] > best[1]):
                best = key
        return best

    def account(self, trainer_pid: int) -> tuple[dict[str, float], int, float]:
        """(CPU-s per role, processes ended in the interval, estimated CPU-s missed).

        An ended process's CPU after its last sample is recovered from its parent's
        cutime + cstime when the parent waited for it (a ``unseen children`` tail: what the
        parent reaped beyond the children's last samples, also children never sampled);
        otherwise it is lost and estimated as its last rate times the time it went unseen.
        """
        roles = self.roles(trainer_pid)
        out: dict[str, float] = {}
        for key, g in self.growth().items():
            out[roles[key]] = out.get(roles[key], 0.0) + g
        kids: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for key, s in self.seen.items():
            parent = self._parent(s.last)
            if parent is not None and s.ended_t is not None:
                kids.setdefault(parent, []).append(key)
        ended = sum(1 for s in self.seen.values() if s.ended_t is not None)
        missed = 0.0
        for key, s in self.seen.items():
            reaped = s.last.child_cpu_s - s.base_child
            gone = kids.get(key, [])
            last_totals = sum(self.seen[k].last.cpu_s + self.seen[k].last.child_cpu_s
                              for k in gone)
            slack = 2.0 / TICK * (len(gone) + 1)  # tick rounding
            if reaped > 0 and reaped >= last_totals - slack:
                tail = max(0.0, reaped - last_totals)
                if tail > 0:
                    kid_roles = {roles[k] for k in gone}
                    name = (kid_roles.pop() if len(kid_roles) == 1
                            else f"unseen children of {roles[key]}")
                    out[name] = out.get(name, 0.0) + tail
                continue
            for k in gone:  # the parent does not wait (the raylet): the rest is lost
                c = self.seen[k]
                rate = ((c.last.cpu_s - c.prev_cpu) / (c.last_t - c.prev_t)
                        if c.last_t > c.prev_t else 0.0)
                missed += rate * max(0.0, (c.ended_t or c.last_t) - c.last_t)
        return out, ended, missed

    def titles(self) -> dict[str, float]:
        """CPU-s per Ray worker title (a worker's non-IDLE titles joined), for the detail."""
        out: dict[str, float] = {}
        for key, g in self.growth().items():
            s = self.seen[key]
            if not s.titles:
                continue
            names = [t for t in s.titles if t != "IDLE"] or ["IDLE"]
            name = "+".join(sorted(names))
            out[name] = out.get(name, 0.0) + g
        return out


def _titles(p: ProcStat, from_comm: bool = True) -> list[str]:
    """The Ray title of ``p``; from its comm (the title cut to 15 characters) only when its
    cmdline is empty (a zombie) and ``from_comm``."""
    t = worker_title(p.cmd) if p.cmd else worker_title(p.comm) if from_comm else None
    return [t] if t else []


def thread_split(base: Mapping[tuple[int, int], ProcStat], last: Mapping[tuple[int, int],
                 ProcStat], groups: Mapping[tuple[int, int], str], process_growth: float
                 ) -> dict[str, float]:
    """The trainer's CPU-s by thread group: each thread's growth from ``base`` (0 when born
    later) to its last sample; what the process used beyond them is ``T_ENDED`` (threads
    that ended, or lived between two samples)."""
    out = {g: 0.0 for g in THREAD_GROUPS}
    for key, p in last.items():
        b = base.get(key)
        out[groups[key]] += max(0.0, p.cpu_s - (b.cpu_s if b is not None else 0.0))
    out[T_ENDED] = max(0.0, process_growth - sum(out.values()))
    return out


@attrs.frozen
class Account:
    """CPU of one run (or one quiet interval) by role."""

    wall_s: float
    #: CPU-s per role; ``TRAINER`` excludes the sampler's own thread (``ACCOUNTING``).
    roles: dict[str, float]
    #: The trainer's CPU-s by thread group (sums to TRAINER + ACCOUNTING); empty when off.
    threads: dict[str, float]
    #: CPU-s per Ray worker title (detail of the worker roles).
    titles: dict[str, float]
    #: Processes that ended during the run.
    ended: int
    #: CPU-s of ended processes after their last sample that no parent's cutime returned.
    est_missed_s: float
    snapshots: int
    #: CPU-s the whole machine was busy (every user's processes: the noise of a shared box).
    machine_busy_s: float
    #: Peak resident set of one process of each role, bytes.
    peak_rss: dict[str, int] = attrs.field(factory=dict)

    @property
    def total_s(self) -> float:
        """CPU-s of every role but the sampler's own."""
        return sum(v for k, v in self.roles.items() if k != ACCOUNTING)

    def per_sample_ms(self, samples: int) -> dict[str, float]:
        """CPU ms per delivered sample, per role and ``total``."""
        out = {k: v / samples * 1e3 for k, v in self.roles.items()}
        out["total"] = self.total_s / samples * 1e3
        return out

    def per_second_ms(self) -> dict[str, float]:
        """CPU ms per wall second, per role and ``total`` (idle rates)."""
        out = {k: v / self.wall_s * 1e3 for k, v in self.roles.items()}
        out["total"] = self.total_s / self.wall_s * 1e3
        return out

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def tree_members(procs: Mapping[int, ProcStat], root: int) -> list[ProcStat]:
    """``root`` and every process descending from it, among ``procs`` (pid -> stat)."""
    kids: dict[int, list[int]] = {}
    for p in procs.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            out.append(procs[pid])
        todo.extend(k for k in kids.get(pid, []) if k != pid)
    return out


class Sampler:
    """Samples the CPU of ``root``'s process tree (default: this process) on a thread.

    ``start()`` takes the first snapshot, ``stop()`` the last and returns the
    :class:`Account`. The thread's own CPU is reported as ``ACCOUNTING``, not ``TRAINER``.

    Args:
        interval: seconds between samples (Ray workers the raylet lets end are seen last at
            the sample before their end).
        threads: also split the trainer's CPU by thread (``root`` must be this process).
        proc: the /proc mount.
        thread_names: native thread id -> Python thread name (default: ``threading``).
    """

    def __init__(self, root: int | None = None, interval: float = 0.2, threads: bool = True,
                 proc: str = "/proc",
                 thread_names: Callable[[], dict[int, str]] | None = None):
        if interval <= 0:
            msg = f"Sampler: interval must be > 0 seconds, got {interval}"
            raise ValueError(msg)
        self.root = os.getpid() if root is None else root
        self.interval, self.proc = interval, proc
        self.threads = threads and self.root == os.getpid()
        self._names = thread_names or _python_thread_names
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._members: dict[int, int] = {}  # pid -> start of the tree's processes
        self._foreign: set[int] = set()  # pids outside the tree (never re-read)
        self._account: Account | None = None
        self._error: BaseException | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="ray_ingest-cpu-sampler",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> Account:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if self._account is None:
            msg = "Sampler.stop: called before start()"
            raise RuntimeError(msg)
        return self._account

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the sampling thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._sample_until_stopped()
        except BaseException as e:  # handed to start()/stop()
            self._error = e
            self._ready.set()

    def _sample_until_stopped(self) -> None:
        cpu0 = time.thread_time()
        busy0, _ = machine_cpu_s(self.proc)
        t0 = time.perf_counter()
        tracker = Tracker(t0, self._scan())
        me = threading.get_native_id()
        tbase: dict[tuple[int, int], ProcStat] = {}
        tlast: dict[tuple[int, int], ProcStat] = {}
        names: dict[int, str] = {}  # tid -> Python name, kept after the thread ends
        if self.threads:
            tbase = {t.key: t for t in read_threads(self.root, self.proc)}
            tlast = dict(tbase)
            names.update(self._names())
        self._ready.set()
        while not self._stop.wait(self.interval):
            tracker.observe(time.perf_counter(), self._scan())
            if self.threads:
                self._sample_threads(tlast, names)
        tracker.observe(time.perf_counter(), self._scan())
        if self.threads:
            self._sample_threads(tlast, names)
        wall = time.perf_counter() - t0
        busy1, _ = machine_cpu_s(self.proc)
        roles, ended, missed = tracker.account(self.root)
        own = time.thread_time() - cpu0
        roles[ACCOUNTING] = own
        roles[TRAINER] = max(0.0, roles.get(TRAINER, 0.0) - own)
        split: dict[str, float] = {}
        if self.threads:
            trainer = [k for k in tracker.seen if k[0] == self.root]
            grown = sum(tracker.growth()[k] for k in trainer)
            groups = {k: thread_group(names.get(t.pid), t.comm, sampler=t.pid == me)
                      for k, t in tlast.items()}
            split = thread_split(tbase, tlast, groups, grown)
        self._account = Account(wall_s=wall, roles=roles, threads=split,
                                titles=tracker.titles(), ended=ended,
                                est_missed_s=missed, snapshots=tracker.snapshots,
                                machine_busy_s=busy1 - busy0,
                                peak_rss=tracker.peak_rss(self.root))

    def _scan(self) -> list[ProcStat]:
        """The tree's processes now: known members re-read, new pids placed by their ppid."""
        pids = {int(p) for p in os.listdir(self.proc) if p.isdigit()}
        self._foreign &= pids
        now: dict[int, ProcStat] = {}
        for pid in [p for p in self._members if p in pids]:
            s = read_proc(pid, self.proc)
            if s is not None and s.start == self._members[pid]:
                now[pid] = s
        fresh = {}
        for pid in pids - self._foreign - set(now):
            s = read_proc(pid, self.proc)
            if s is not None:
                fresh[pid] = s
        grew = True
        while grew:  # a new child of a new child: place parents first
            grew = False
            for pid, s in list(fresh.items()):
                if pid == self.root or s.ppid in now:
                    now[pid] = fresh.pop(pid)
                    grew = True
        self._foreign |= set(fresh)
        self._members = {pid: s.start for pid, s in now.items()}
        return list(now.values())

    def _sample_threads(self, last: dict[tuple[int, int], ProcStat], names: dict[int, str]
                        ) -> None:
        """Every thread's CPU now, and the Python names of the threads alive (grouped at the
        end: a thread just started has its native id, hence its name, a moment later)."""
        last.update({t.key: t for t in read_threads(self.root, self.proc)})
        names.update(self._names())


def _python_thread_names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def measure_idle(seconds: float, interval: float = 0.5, settle_s: float = 0.0) -> Account:
    """The tree's CPU over ``seconds`` of doing nothing (after ``settle_s``): Ray's idle cost."""
    time.sleep(settle_s)
    s = Sampler(interval=interval, threads=False).start()
    time.sleep(seconds)
    return s.stop()


# --- summaries over runs (pure) -----------------------------------------------------------
def median_per_sample(runs: Iterable[tuple[Account | dict, int]]) -> dict[str, float]:
    """Median CPU ms per delivered sample per role over runs, and the median ``total``
    (not the sum of the medians). ``runs``: (account or its dict, samples delivered)."""
    per = []
    for acc, n in runs:
        a = acc if isinstance(acc, Account) else Account(**acc)
        per.append(a.per_sample_ms(n))
    if not per:
        return {}
    keys = sorted({k for p in per for k in p}, key=_role_order)
    return {k: statistics.median(p.get(k, 0.0) for p in per) for k in keys}


def _role_order(name: str) -> tuple[float, str]:
    order = (*ROLES, *THREAD_GROUPS, "total")
    return (order.index(name) if name in order else len(ROLES) - 0.5, name)


def ratio(medians: Mapping[str, Mapping[str, float]], num: str, den: str) -> float | None:
    """``num``'s median total CPU per sample over ``den``'s (None when either is missing)."""
    a, b = medians.get(num, {}).get("total"), medians.get(den, {}).get("total")
    return a / b if a is not None and b else None


def format_table(medians: Mapping[str, Mapping[str, float]], unit: str = "ms/sample"
                 ) -> list[str]:
    """Roles as rows, contenders as columns (``medians``: contender -> role -> value)."""
    names = list(medians)
    roles = sorted({r for m in medians.values() for r in m}, key=_role_order)
    width = max([len(r) for r in roles] + [10])
    cols = [max(len(n), 9) for n in names]
    lines = [f"  {'CPU ' + unit:{width}s} " + " ".join(f"{n:>{c}s}" for n, c in
                                                       zip(names, cols, strict=True))]
    for r in roles:
        cells = [f"{medians[n][r]:{c}.3f}" if r in medians[n] else " " * (c - 1) + "-"
                 for n, c in zip(names, cols, strict=True)]
        lines.append(f"  {r:{width}s} " + " ".join(cells))
    return lines


def compare(runs: Mapping[str, Iterable[Mapping]], ref: str) -> dict:
    """CPU per delivered sample of a sitting's contenders, and ratios to ``ref``.

    Args:
        runs: contender -> its runs, each a mapping with ``samples`` and ``cpu_roles`` (an
            :class:`Account` as a dict); runs without ``cpu_roles`` are left out.
        ref: the contender every other one is divided by (its ratios are left out when it
            did not run).

    Returns:
        ``ms_per_sample`` (contender -> role -> median, ``total`` the median of the totals),
        ``trainer_threads`` (contender -> thread group -> median ms/sample), ``ratio``
        (contender -> ratio of the median totals to ``ref``'s) and ``per_run_ratios``
        (contender -> total / ``ref``'s total of the same repetition, in order).
    """
    runs = {n: [r for r in rs if r.get("cpu_roles")] for n, rs in runs.items()}
    runs = {n: rs for n, rs in runs.items() if rs}
    med = {n: median_per_sample((r["cpu_roles"], r["samples"]) for r in rs)
           for n, rs in runs.items()}
    threads = {}
    for n, rs in runs.items():
        per = [{k: v / r["samples"] * 1e3 for k, v in r["cpu_roles"]["threads"].items()}
               for r in rs if r["cpu_roles"].get("threads")]
        if per:
            threads[n] = {k: statistics.median(p.get(k, 0.0) for p in per)
                          for k in THREAD_GROUPS}
    out: dict = {"ref": ref, "ms_per_sample": med, "trainer_threads": threads, "ratio": {},
                 "per_run_ratios": {}}
    if ref not in runs:
        return out
    totals = {n: [Account(**r["cpu_roles"]).per_sample_ms(r["samples"])["total"] for r in rs]
              for n, rs in runs.items()}
    for n in runs:
        if n == ref:
            continue
        out["ratio"][n] = ratio(med, n, ref)
        out["per_run_ratios"][n] = [a / b for a, b in zip(totals[n], totals[ref],
                                                          strict=False) if b]
    return out


def run_line(acc: Account | Mapping, samples: int) -> str:
    """One run's CPU per sample by role, and how busy the machine was (others' load)."""
    a = acc if isinstance(acc, Account) else Account(**acc)
    per = a.per_sample_ms(samples)
    parts = ", ".join(f"{k} {per[k]:.2f}" for k in sorted(a.roles, key=_role_order)
                      if per[k] >= 0.005)
    ours = sum(a.roles.values())
    rss = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(
        a.peak_rss.items(), key=lambda kv: _role_order(kv[0])) if v)
    return (f"CPU ms/sample: {parts}; total {per['total']:.2f}. Machine busy "
            f"{a.machine_busy_s / a.wall_s:.2f} cores, other processes "
            f"{max(0.0, a.machine_busy_s - ours) / a.wall_s:.2f}; {a.ended} ended, "
            f"~{a.est_missed_s:.2f} CPU-s missed" + (f"; peak RSS MiB per process: {rss}"
                                                     if rss else ""))
