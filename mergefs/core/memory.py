"""Process memory tuning for merging: keep freed unit buffers in the heap for reuse.

Every merged unit allocates buffers of a few MiB (source reads, float32 scratch, the output).
glibc serves allocations that large with fresh ``mmap`` pages and returns them to the kernel
when freed, so every unit pays a page fault and a kernel page clear per 4 KiB of every buffer
(measured: about half the CPU time of a merge, warm). :func:`keep_freed_memory` raises glibc's
mmap threshold to its maximum (32 MiB) and its trim threshold, so freed buffers are reused from
the heap instead. The cost: the heap keeps its peak size (the transient working set of the
merges in flight, on top of the unit cache) instead of shrinking after each unit.

Call it once, at the start of a command that merges (main thread). A no-op where glibc's
``mallopt`` is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENA_MAX = 2  # one heap per core: fewer heaps holding freed memory (each keeps its own)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 32 << 20  # give memory back only when this much is free at the top of a heap

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc as described above (once per process); True when it took effect."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no glibc mallopt: malloc left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_ARENA_MAX, ARENA_MAX))
    _done = ok
    return ok
