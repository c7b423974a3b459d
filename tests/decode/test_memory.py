"""Decoding processes keep freed memory (ray_ingest/decode/memory.py): glibc's malloc told to
keep its heap once per process, unless the operator chose otherwise. (Where decode runs, on
the main thread of every decode process Ray starts: tests/execution/test_pool.py.)"""

from __future__ import annotations

import platform

import pytest

from ray_ingest.decode import memory

CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", memory.OPT_OUT_ENV)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for var in CHOICES:
        monkeypatch.delenv(var, raising=False)
    memory.keep_freed_memory.cache_clear()
    yield
    memory.keep_freed_memory.cache_clear()


def test_glibc_is_told_to_keep_freed_memory():
    on_glibc = platform.libc_ver()[0] == "glibc"
    assert memory.keep_freed_memory() is on_glibc


@pytest.mark.parametrize("var, value", [("MALLOC_TRIM_THRESHOLD_", "0"),
                                        ("MALLOC_MMAP_THRESHOLD_", "65536"),
                                        (memory.OPT_OUT_ENV, "0")])
def test_the_operator_s_choice_wins(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    assert memory.keep_freed_memory() is False
