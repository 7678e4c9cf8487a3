"""Large tensors served from memory the process already touched (glibc's malloc on Linux).

glibc hands every allocation above its mmap threshold (128 kB to 32 MB, adjusted as blocks are
freed) fresh pages from the kernel and gives them back on free: a (1, H, T, T) attention matrix of
a long prompt is page-faulted and zeroed by the kernel each time an op writes one. Eager attention
makes several per layer (scores, scaled, masked, softmax), on both sides of a run, so past ~1000
tokens the page faults cost more than the arithmetic (docs/measured.md has the figures). With the
threshold raised, freed blocks stay in the heap and the next op reuses them; the top of the heap is
still returned to the kernel past `TRIM_BYTES`, so an idle process does not hold a whole trace.

The `tracer` command (`tracer.cli.console_main`) calls `reuse_freed_memory()` for its own process;
a library import never changes the allocator of the process it is imported into.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_BYTES = 1 << 30  # allocations above this still get their own mapping
TRIM_BYTES = 1 << 30


def reuse_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries without mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
