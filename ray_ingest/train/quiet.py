"""Quiet, meaningful output from an embedded Ray: our lines, Ray's warnings, not its chatter.

Where Ray's noise comes from, and what is done about it (the lines are verbatim in the tests):

* ``Failed to query Ray Train Controller actor state. State API may be temporarily unavailable``,
  once a second: Ray Train's ``PlacementGroupCleaner`` actor polls the State API, which the
  dashboard serves. Fixed at the source: when the dashboard's packages are installed
  (``ray[default]``) the embedded Ray starts its dashboard on a free port, and the workers are
  pointed at it (``RAY_API_SERVER_ADDRESS``); otherwise the cleaner would also look up the
  machine's *latest* Ray instance, possibly another user's. With ``ray[data,train]`` alone
  there is no State API: the line is dropped by a filter matching exactly that message.
* ``core_worker.cc: Actor with class name … has constructor arguments in the object store and
  max_restarts > 0`` (Ray Data's actor pool, Ray Train's ``PreemptionWatcher``) and the
  raylet's ``WARNING: N PYTHON worker processes have been started …`` (fractional CPUs start
  many workers on a small machine): informational, from processes we do not own; dropped by
  exact-message filters on the lines Ray forwards to the driver.
* Ray's INFO chatter: ``Started a local Ray instance`` (driver ``ray`` logger), Ray Train's
  worker-group and checkpoint reports (``ray.train`` logger, ``RunConfig.logging_config``),
  Ray Data's execution banners (``DataContext.print_on_execution_start``, the ``ray.data``
  console handler; its log file under the session folder keeps everything).
* ``(gcs_server) gcs_actor_scheduler.cc: Failed to kill actor … Socket closed``: at the end of
  a run, killing an actor whose process already exited; dropped by an exact-message filter.
* ``(raylet) Task MapWorker(MapBatches(Decoder)).submit failed … killed by `ray.kill```: Ray Data
  killing the decode pool of an epoch the train loop stopped early (``max_steps``); dropped by
  an exact-message filter.
* ``(TrainController) Failed to send resource request for train-… it's safe to ignore this
  error`` followed by a ``GetTimeoutError`` traceback: Ray Train's controller asks its
  autoscaling coordinator for resources with a 5 s timeout, which an overloaded machine misses
  (seen once in a test run beside other tests). Ray calls it harmless when transient; the
  message stays, its traceback is dropped (:class:`TracebackTrimmer`), so a persistent failure
  still shows, in one line each time.

Nothing here hides a warning or an error of ours, or any other line of Ray's.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: Exact messages of harmless Ray lines (matched anywhere in a line, Ray adds prefixes).
NOISE: tuple[re.Pattern[str], ...] = (
    re.compile(r"Failed to query Ray Train Controller actor state\. State API may be "
               r"temporarily unavailable\. Continuing to monitor\."),
    re.compile(r"core_worker\.cc:\d+: Actor with class name: '[^']*' and ID: '[0-9a-f]+' has "
               r"constructor arguments in the object store and max_restarts > 0\."),
    re.compile(r"WARNING: \d+ PYTHON worker processes have been started on node: \S+ with "
               r"address: \S+, which is \d+x the maximum expected startup concurrency"),
    re.compile(r"gcs_actor_scheduler\.cc:\d+: Failed to kill actor [0-9a-f]+, return status: "
               r"Invalid: KillActor RPC failed for actor [0-9a-f]+: RpcError: RPC error: Socket "
               r"closed"),
    re.compile(r"Task MapWorker\(MapBatches\(Decoder\)\)\.submit failed\. There are infinite "
               r"retries remaining, so the task will be retried\. Error: The actor is dead "
               r"because it was killed by `ray\.kill`\."),
)
#: Ray's warnings that call themselves harmless when transient and come with a traceback
#: (``logger.warning(..., exc_info=True)``): the message is kept, the traceback dropped.
TRANSIENT: tuple[re.Pattern[str], ...] = (
    re.compile(r"Failed to send resource request for \S+\. If this only happens transiently "
               r"during network partition or CPU being overloaded, it's safe to ignore this "
               r"error\."),
    re.compile(r"Failed to cancel resource request for \S+\. The request will still expire "
               r"after the timeout of \d+ seconds\."),
)
_PROGRESS_BARS_OFF = "Progress bars disabled. To enable, set"
_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
#: The line that ends a traceback: ``module.ExceptionName: message`` (or the name alone).
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(:\s|:?$)")
#: The summary Ray's log deduplication prints for a line other processes repeated
#: (``ray._private.ray_logging.DedupState.formatted``: the line, then this, coloured).
_REPEATED = re.compile(r"\s*(\x1b\[[\d;]*m)*\s*\[repeated \d+x across cluster\].*$")
#: Dropped traceback lines remembered, to drop Ray's later repeat summaries of them.
_REMEMBER = 256


def _matches(line: str, patterns: Iterable[re.Pattern[str]]) -> bool:
    return any(p.search(line) for p in patterns)


def is_noise(line: str) -> bool:
    """True for a line of one of the known-harmless Ray messages (:data:`NOISE`)."""
    return _matches(line, NOISE)


def without_noise(lines: Iterable[str]) -> list[str]:
    return [line for line in lines if not is_noise(line)]


class TracebackTrimmer:
    """Drops the traceback that follows a :data:`TRANSIENT` message of the same process.

    Ray forwards a process's output in batches of lines, and a message's traceback may arrive
    in the next batch, so where each process is in a traceback is kept between calls. Only a
    traceback that starts on the line right after such a message is dropped (with the chained
    ones Python prints after it); any other line, a traceback of its own included, passes.

    Ray's log deduplication runs before this filter: a line another process printed a moment
    ago (a ``Traceback`` header, a common frame) is taken out of the batch and printed later
    as ``… [repeated Nx across cluster]``. So the traceback may start at a frame line, it ends
    only at a line shaped like an exception (any other line is kept), and a repeat summary of
    a line dropped here is dropped too.
    """

    _EXPECT, _FRAMES, _AFTER = "expect", "frames", "after"

    def __init__(self, canonical: Callable[[str], str]) -> None:
        """``canonical``: the key Ray's deduplication gives a line (lines with equal keys are
        one line to it)."""
        self._canonical = canonical
        self._state: dict[tuple, str] = {}
        self._dropped: dict[str, None] = {}  # canonical lines, oldest first

    def __call__(self, source: tuple, lines: Iterable[str]) -> list[str]:
        state = self._state.pop(source, None)
        kept: list[str] = []
        for line in lines:
            if state == self._EXPECT:
                state = self._FRAMES if line.startswith((_TRACEBACK, " ", "\t")) else None
            elif state == self._FRAMES:
                # indented frame lines, then the exception's own line ends the traceback
                if not line.startswith((" ", "\t")):
                    state = self._AFTER if _EXCEPTION.match(line) else None
            elif state == self._AFTER:
                # a chained exception: a blank line, its header, a blank line, its traceback
                if line.startswith(_TRACEBACK):
                    state = self._FRAMES
                elif not (line.strip() == "" or line.startswith(_CHAINED)):
                    state = None
            if state is None:
                if not self._repeats_dropped(line):
                    kept.append(line)
                if _matches(line, TRANSIENT):
                    state = self._EXPECT
            elif state != self._EXPECT:
                self._remember(line)
        if state is not None:
            self._state[source] = state
        return kept

    def _remember(self, line: str) -> None:
        """A dropped line of the traceback's own (its frames and exception, not the lines
        every traceback has)."""
        key = self._canonical(line)
        if key and not line.startswith((_TRACEBACK, *_CHAINED)):
            self._dropped.pop(key, None)
            self._dropped[key] = None
            if len(self._dropped) > _REMEMBER:
                del self._dropped[next(iter(self._dropped))]

    def _repeats_dropped(self, line: str) -> bool:
        """Ray's repeat summary of a line dropped here."""
        base, n = _REPEATED.subn("", line)
        return n == 1 and self._canonical(base) in self._dropped


def dashboard_available() -> bool:
    """Whether the dashboard's packages (``ray[default]``) are installed."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_ray_kwargs(num_cpus: int, env_vars: Mapping[str, str] | None = None,
                        quiet: bool = True) -> dict[str, Any]:
    """``ray.init`` arguments for a private local Ray (the demo, the job without a cluster).

    ``address="local"`` never joins another Ray instance on the machine. With ``ray[default]``
    the dashboard runs on a free port (never the shared default 8265) and the workers' State
    API calls go to it; with ``quiet`` the driver's ``ray`` logger shows warnings only.
    """
    env = dict(env_vars or {})
    kw: dict[str, Any] = {"address": "local", "num_cpus": num_cpus}
    if dashboard_available():
        port = free_port()
        kw.update(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port)
        env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    else:
        kw["include_dashboard"] = False
    kw["runtime_env"] = {"env_vars": env}
    if quiet:
        kw["logging_level"] = logging.WARNING
    return kw


def filter_driver_output() -> bool:
    """Drop :data:`NOISE` lines, and the tracebacks of :data:`TRANSIENT` ones, from what Ray
    prints on this driver for its other processes.

    Both of Ray's paths to the driver's console, worker output (``log_to_driver``) and raylet
    error messages, end in ``ray._private.worker.print_worker_logs``; it is wrapped so that
    known-noise lines are dropped and everything else passes unchanged. Returns False (and
    changes nothing) when Ray's internals differ from 2.60's.
    """
    try:
        import ray._private.worker as ray_worker
        from ray._private.ray_logging import _canonicalise_log_line
    except ImportError:
        return False
    original = getattr(ray_worker, "print_worker_logs", None)
    if original is None:
        return False
    if getattr(original, "_ray_ingest_filter", False):
        return True

    trim = TracebackTrimmer(_canonicalise_log_line)

    def print_worker_logs(data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        lines = data.get("lines") if isinstance(data, dict) else None
        if lines:
            source = (data.get("ip"), data.get("pid"), data.get("is_err"))
            kept = trim(source, without_noise(lines))
            if not kept:
                return None
            if len(kept) != len(lines):
                data = {**data, "lines": kept}
        return original(data, *args, **kwargs)

    print_worker_logs._ray_ingest_filter = True  # type: ignore[attr-defined]
    ray_worker.print_worker_logs = print_worker_logs
    return True


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_worker() -> None:
    """In a Ray Train worker, which runs the loader's Ray Data executions:

    * Ray Data: no execution banners or INFO lines on the console (its log file keeps them),
      and not its warning that progress bars are off, which the loader turns off on purpose;
      its other warnings stay.
    * Ray Train's ``Reporting training result …`` INFO line, from a logger named after its
      source file (``getLogger(__file__)``, outside ``ray.train``, so ``RunConfig``'s log level
      misses it): that one logger shows warnings only, like the rest of Ray Train.
    """
    import ray.data

    try:
        from ray.train.v2._internal.execution import context as train_context
    except ImportError:
        pass
    else:
        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)

    ray.data.DataContext.get_current().print_on_execution_start = False
    for handler in logging.getLogger("ray.data").handlers:
        if type(handler).__name__ == "PlainRayHandler":  # the console one, not the files
            handler.setLevel(logging.WARNING)
    progress = logging.getLogger("ray.data._internal.progress")
    if not any(isinstance(f, _DropMessage) for f in progress.filters):
        progress.addFilter(_DropMessage(_PROGRESS_BARS_OFF))
