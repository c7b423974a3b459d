"""Decoding processes keep freed memory: the malloc settings and the environment Ray starts
decode processes with (ray_ingest/decode/memory.py)."""

from __future__ import annotations

from ray_ingest.decode.memory import ARENA_MAX_ENV, decode_env


def test_decode_processes_get_one_malloc_arena(monkeypatch):
    monkeypatch.delenv(ARENA_MAX_ENV, raising=False)
    monkeypatch.delenv("RAY_INGEST_KEEP_FREED_MEMORY", raising=False)
    assert decode_env() == {"MALLOC_ARENA_MAX": "1"}


def test_the_operator_s_arena_setting_wins(monkeypatch):
    monkeypatch.setenv(ARENA_MAX_ENV, "4")
    assert decode_env() == {}


def test_glibc_s_own_behaviour_on_request(monkeypatch):
    monkeypatch.delenv(ARENA_MAX_ENV, raising=False)
    monkeypatch.setenv("RAY_INGEST_KEEP_FREED_MEMORY", "0")
    assert decode_env() == {}
