"""Differential fuzzing support: Hypothesis budgets, a hang guard and outcome counts.

Two budgets, chosen by ``RAY_INGEST_FUZZ``: ``ci`` (the default: a bounded number of examples
per parser, so the fuzz share of the suite stays under a minute on 2 cores) and ``long``
(``make fuzz``: at least 10,000 examples per parser). Both are derandomized (the examples
follow from the test, never from the clock) and keep no example database.

Every fuzz test records what each example came to (``same`` as the reference, ``refused`` in
one line, ``declined`` to a slower parser, ...) with :func:`tally`; the counts are printed at
the end of the run ("differential fuzzing" section) and written as JSON to
``$RAY_INGEST_FUZZ_FIGURES`` when set. A divergence or an uncaught exception fails the test at
once (Hypothesis then shrinks it to a minimal example): the counts are of examples that agreed
with the reference, and a run whose fuzz tests all passed had no divergence, no uncaught
exception and no hang.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.support import workers

PROFILE_ENV = "RAY_INGEST_FUZZ"
FIGURES_ENV = "RAY_INGEST_FUZZ_FIGURES"
#: Examples per parser test in the long run (``make fuzz``).
LONG_EXAMPLES = 10_000
_COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class Hang(Exception):
    """An example ran past its time limit (a parser that loops or blocks)."""


def profile() -> str:
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in ("ci", "long"):
        raise ValueError(f"{PROFILE_ENV}: expected 'ci' or 'long', got {name!r}")
    return name


def fuzz_settings(ci_examples: int) -> settings:
    """Hypothesis settings of a fuzz test: ``ci_examples`` in CI, :data:`LONG_EXAMPLES` in the
    long run; no deadline (the hang guard bounds each example instead)."""
    long = profile() == "long"
    return settings(max_examples=LONG_EXAMPLES if long else ci_examples, deadline=None,
                    derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@contextlib.contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`Hang` if the block runs longer than ``seconds`` (SIGALRM: main thread)."""
    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{what}: no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tally(parser: str, outcome: str) -> None:
    """Count one example of ``parser`` that came to ``outcome``."""
    _COUNTS[parser][outcome] += 1


def counts() -> dict[str, dict[str, int]]:
    return {p: dict(sorted(c.items())) for p, c in sorted(_COUNTS.items())}


def pytest_sessionfinish(session: Any) -> None:
    workers.send(session.config, "ray_ingest_fuzz_counts", counts())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    for parser, outcomes in (workers.received(node, "ray_ingest_fuzz_counts") or {}).items():
        _COUNTS[parser].update(outcomes)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _COUNTS:
        return
    terminalreporter.section(f"differential fuzzing ({profile()} budget)")
    for parser, outcomes in counts().items():
        total = sum(outcomes.values())
        detail = ", ".join(f"{k} {v}" for k, v in outcomes.items())
        terminalreporter.write_line(f"{parser}: {total} examples agreed with the reference "
                                    f"({detail})")
    target = os.environ.get(FIGURES_ENV)
    if target:
        with contextlib.suppress(OSError), open(target, "w") as f:
            json.dump({"profile": profile(), "counts": counts()}, f, indent=2)
