"""A job process keeps the memory it frees for its next allocation (docs/internals.md).

A window settled in the driver allocates and frees hundreds of megabytes of Arrow buffers and numpy arrays.
Handed back to the kernel at once, that memory was faulted in again by the next chunk: a third of
a 10M window's CPU time was the kernel's (docs/benchmarks.md). Two settings keep it in the process:

- Arrow's allocator (mimalloc, in pyarrow's wheels) reads its options from the environment when
  pyarrow loads: `MIMALLOC_PURGE_DELAY` (`arrow_env`, run when `spark_jobs` is imported, before
  any of its modules imports pyarrow) is the delay before it returns freed pages.
- glibc's malloc (numpy's arrays) gets a trim threshold and an mmap threshold
  (`keep_freed_memory`, run by `build_spark`: the process is then a job's driver).

An operator's own `MIMALLOC_PURGE_DELAY` wins; `MSGAUDIT_KEEP_FREED_MEMORY=0` turns both off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV_OFF = "MSGAUDIT_KEEP_FREED_MEMORY"
PURGE_DELAY_ENV = "MIMALLOC_PURGE_DELAY"
PURGE_DELAY_MS = -1  # never: a job process's peak is what it needs again for the next chunk or window
# glibc: freed heap above this stays in the process; allocations below this come from the heap
TRIM_THRESHOLD = (1 << 31) - 1
MMAP_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>


def _on() -> bool:
    return os.environ.get(ENV_OFF, "1") != "0"


def arrow_env() -> bool:
    """Set Arrow's purge delay for this process (and the processes it starts) unless the operator
    set one, or turned this off; True when pyarrow will read it (it is not loaded yet)."""
    if not _on():
        return False
    os.environ.setdefault(PURGE_DELAY_ENV, str(PURGE_DELAY_MS))
    return "pyarrow" not in sys.modules


def keep_freed_memory() -> bool:
    """Keep glibc's freed memory in this process; True when set (glibc only, and not turned off)."""
    if not _on():
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False  # not glibc: its allocator keeps its own defaults
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
