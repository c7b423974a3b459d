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
every page faults in afresh (a companion decoding 4K on two threads took 977k page faults in
15 s). So every decode process Ray runs decodes on its main thread (actors, tasks, the
``process`` companions); ``decode.compute: threads`` decodes on the trainer's threads and keeps
glibc's arenas there (the trainer's environment is the user's). No Ray, no torch.
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


#: Set to ``0``: glibc's own malloc behaviour (no mallopt).
OPT_OUT_ENV = "RAY_INGEST_KEEP_FREED_MEMORY"
#: glibc's variables for the same settings: where the operator set one, theirs wins.
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def keep_freed_memory() -> bool:
    """Tune this process's malloc as the module docstring says; True when it was applied."""
    if any(v in os.environ for v in GLIBC_ENV) or os.environ.get(OPT_OUT_ENV) == "0":
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
