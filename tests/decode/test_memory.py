"""Decoding processes keep freed memory: the malloc settings and the environment Ray starts
decode processes with (ray_ingest/decode/memory.py)."""

from __future__ import annotations

from ray_ingest.decode.memory import ARENA_MAX_ENV, ONE_ARENA_FROM_BYTES, decode_env

#: A decoded 2048x2048 RGB sample (4K to 2048), and a 256x256 one.
LARGE, SMALL = 2048 * 2048 * 3, 256 * 256 * 3


def test_processes_decoding_large_samples_get_one_malloc_arena(monkeypatch):
    monkeypatch.delenv(ARENA_MAX_ENV, raising=False)
    monkeypatch.delenv("RAY_INGEST_KEEP_FREED_MEMORY", raising=False)
    assert decode_env(LARGE) == {"MALLOC_ARENA_MAX": "1"}
    assert decode_env(ONE_ARENA_FROM_BYTES) == {"MALLOC_ARENA_MAX": "1"}
    # small samples keep glibc's arenas (one arena's lock cost more than it saved at 256²)
    assert decode_env(SMALL) == {} and decode_env(ONE_ARENA_FROM_BYTES - 1) == {}


def test_the_operator_s_arena_setting_wins(monkeypatch):
    monkeypatch.setenv(ARENA_MAX_ENV, "4")
    assert decode_env(LARGE) == {}


def test_glibc_s_own_behaviour_on_request(monkeypatch):
    monkeypatch.delenv(ARENA_MAX_ENV, raising=False)
    monkeypatch.setenv("RAY_INGEST_KEEP_FREED_MEMORY", "0")
    assert decode_env(LARGE) == {}
