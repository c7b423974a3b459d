"""Freed memory reused, not returned to the kernel: glibc's malloc told to keep its heap.

Why: a 4K sample churns through ~150 MB of buffers (the decoded JPEG, Pillow's images before
and after each resize pass, the output), each up to ~33 MB. glibc serves allocations above its
(adaptive) mmap threshold with fresh ``mmap`` pages and trims its heap's free top back to the
kernel, so every sample pays a page fault and a zeroed page for each 4 KB it touches. Keeping
allocations up to 32 MB on the heap (``M_MMAP_THRESHOLD``, glibc's maximum) and not trimming
freed memory below 1 GB (``M_TRIM_THRESHOLD``) made the 3840x2160 -> 2048² decode take 0.76x the
CPU on our machine (docs/benchmarks.md, "4K"), and changed nothing at 512 px. The cost: a
decoding process keeps its peak heap (a few hundred MB at 4K) instead of returning it.

Applied once per process with ``mallopt`` (through ctypes); skipped where the C library is not
glibc, where the environment already sets ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` (the operator's choice wins), and with
``RAY_INGEST_KEEP_FREED_MEMORY=0`` (glibc's own behaviour; ``bench/fourk.py`` compares the two).

That keeps the *main* arena's memory. A thread other than the main one allocates from an arena
of its own, whose heaps (64 MB each) glibc unmaps as soon as they are empty, whatever the trim
threshold: with a 4K sample's 12-33 MB buffers such heaps fill and empty every sample, and
every page faults in afresh. The ``process`` companion decodes on Ray's threads: it took 977k
page faults in 15 s at 4K. So a companion decoding large samples gets ``MALLOC_ARENA_MAX=1``
(:func:`decode_env`; glibc reads it once, at the process's start, hence Ray's
``runtime_env``): every thread then allocates from the main arena, whose memory is kept.
Decode actors and tasks run their calls on their process's main thread and need no such
environment (a process with one cannot be one that Ray prestarted: it starts ~1 s later).
No Ray, no torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

#: glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Allocations up to this size come from the heap (glibc's upper limit on 64-bit).
MMAP_THRESHOLD = 32 * 1024**2
#: Free memory at the top of the heap kept rather than returned to the kernel.
TRIM_THRESHOLD = 1024**3


#: Set to ``0``: glibc's own malloc behaviour throughout (no mallopt, no one-arena environment).
OPT_OUT_ENV = "RAY_INGEST_KEEP_FREED_MEMORY"


def _left_alone(*variables: str) -> bool:
    """Whether the operator chose: one of ``variables`` set, or the opt-out."""
    return any(v in os.environ for v in variables) or os.environ.get(OPT_OUT_ENV) == "0"


@functools.cache
def keep_freed_memory() -> bool:
    """Tune this process's malloc as the module docstring says; True when it was applied."""
    if _left_alone("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu = libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        gnu.restype = ctypes.c_char_p
        log.debug("mallopt refused on glibc %s", gnu().decode())
    return ok


#: glibc's variable for the most malloc arenas a process makes (read at the process's start).
ARENA_MAX_ENV = "MALLOC_ARENA_MAX"
#: Decoded samples from this size up get one arena: measured to help at 12.6 MB (2048² RGB),
#: to hurt at 196 KB (256² RGB: the decode threads then contend for one arena's lock).
ONE_ARENA_FROM_BYTES = 4 * 1024**2


def decode_env(sample_bytes: int) -> dict[str, str]:
    """Environment variables for a process Ray starts to decode samples of ``sample_bytes``
    decoded bytes on threads other than its main one (the ``process`` companion): one malloc
    arena for large samples (see the module docstring).

    3840x2160 -> 2048², one rank, 2 cores: the ``process`` companion took 112 ms of CPU per
    sample instead of 125-126 and delivered 17.1-17.2 samples/s instead of 15.2-15.3. At 512 ->
    256 px the same setting cost its decode process 2.78 instead of 2.35 ms per sample (many
    small allocations from two threads on one arena's lock), so small samples keep glibc's
    arenas. Empty also where this process's environment sets ``MALLOC_ARENA_MAX`` (the
    operator's choice wins) or ``RAY_INGEST_KEEP_FREED_MEMORY=0``.
    """
    if sample_bytes < ONE_ARENA_FROM_BYTES or _left_alone(ARENA_MAX_ENV):
        return {}
    return {ARENA_MAX_ENV: "1"}
