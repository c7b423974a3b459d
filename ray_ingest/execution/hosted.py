"""The job pool's controller hosted in the process of a job's only pipeline, and how a rank
reaches a controller of either kind.

A job of one decoding pipeline that no driver pre-started a pool for (a notebook, a script,
one rank) needs no shared actor: its rank runs the same
:class:`~ray_ingest.execution.service.DecodeService` on an event loop in a helper thread and
calls it in-process (:class:`InProcessController`). As an actor the controller was a process
of its own per run: ~0.4 CPU-s to start and ~15-20 ms of CPU a second after that, the one
process ``actors`` had beyond ``process`` (2-3 % of a 12-s 4K run's CPU on 2 cores,
docs/architecture.md). Its workers are the same Ray actors, owned by the rank's process (as
an actor, the controller was owned by the rank that started it: it ended with it too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import Any

import ray

from ray_ingest.config import Config
from ray_ingest.execution.service import DecodeService, connect, service_name


class _Method:
    """``controller.method.remote(*args)`` of an :class:`InProcessController`: a future of the
    answer (None once the controller has ended, as an ending actor answers: join again)."""

    def __init__(self, host: InProcessController, name: str):
        self._host, self._name = host, name

    def remote(self, *args: Any) -> concurrent.futures.Future:
        host = self._host
        with host.lock:
            if not host.ended:
                return asyncio.run_coroutine_threadsafe(
                    getattr(host.service, self._name)(*args), host.loop)
        ended: concurrent.futures.Future = concurrent.futures.Future()
        ended.set_result(None)
        return ended


class InProcessController:
    """A job's controller hosted in this process (:func:`controller`, see the module
    docstring): the same :class:`DecodeService` on an event loop of its own in a helper
    thread. Its methods are called like an actor handle's (``controller.join.remote(...)``)
    and answer with futures (:func:`answer`)."""

    def __init__(self, cfg: Config, pipelines: int, dataset: str, name: str):
        self.name = name
        self.lock = threading.Lock()
        self.ended = False
        self.loop = asyncio.new_event_loop()
        self.service = DecodeService(cfg, pipelines, dataset, on_exit=self._exit)
        self.join, self.submit = _Method(self, "join"), _Method(self, "submit")
        self.report, self.leave = _Method(self, "report"), _Method(self, "leave")
        self.stats, self.worker_handles = _Method(self, "stats"), _Method(self, "worker_handles")
        threading.Thread(target=self._serve, name="ray_ingest-controller", daemon=True).start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        tasks = asyncio.all_tasks(self.loop)
        for t in tasks:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()

    def _exit(self) -> None:
        """(In the loop) calls from now on answer None; the loop stops once the ones already
        sent have answered (an ending controller answers them at once)."""
        with self.lock:
            self.ended = True
            if _HOSTED.get(self.name) is self:
                del _HOSTED[self.name]
        self.loop.call_soon(self.loop.stop)


#: The controllers this process hosts, by name (:func:`controller`).
_HOSTED: dict[str, InProcessController] = {}


def controller(cfg: Config, pipelines: int, dataset: str) -> Any:
    """A rank's controller: the running one of this name, hosted here or an actor (as the
    job's driver pre-starts it), else a new one: hosted in this process for a job of one
    pipeline (:class:`InProcessController`), a shared actor otherwise (:func:`connect`)."""
    name = service_name(cfg, dataset)
    if pipelines > 1 and name not in _HOSTED:
        return connect(cfg, pipelines, dataset, name)
    with contextlib.suppress(ValueError):
        return _running(name)
    host = _HOSTED[name] = InProcessController(cfg, pipelines, dataset, name)
    return host


def find(cfg: Config, dataset: str) -> Any:
    """The running controller of this config and dataset (for tests and benchmarks)."""
    return _running(service_name(cfg, dataset))


def _running(name: str) -> Any:
    """The controller of this name hosted here, else the actor; ValueError if neither."""
    with contextlib.suppress(KeyError):
        return _HOSTED[name]
    return ray.get_actor(name)


def answered(calls: list[Any], timeout: float | None) -> list[Any]:
    """The controller calls of ``calls`` answered within ``timeout`` seconds (an actor's
    ObjectRefs, or an :class:`InProcessController`'s futures)."""
    if calls and isinstance(calls[0], concurrent.futures.Future):
        done, _ = concurrent.futures.wait(calls, timeout=timeout)
        return [c for c in calls if c in done]
    return ray.wait(calls, num_returns=len(calls), timeout=timeout)[0]


def answer(call: Any, timeout: float | None = None) -> Any:
    """A controller call's answer (:func:`answered`); None where the controller ended before
    answering (its actor died, or its hosted call was cancelled), as an ending one answers:
    the rank joins again."""
    try:
        if isinstance(call, concurrent.futures.Future):
            return call.result(timeout)
        return ray.get(call, timeout=timeout)
    except (ray.exceptions.RayActorError, concurrent.futures.CancelledError):
        return None
