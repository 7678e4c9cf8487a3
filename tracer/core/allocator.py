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


STREAMED_MMAP_BYTES = 4 << 20  # a streamed run: weight tensors (4 MB and up) mapped and unmapped

_raised = False  # reuse_freed_memory() was called in this process


def reuse_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc."""
    global _raised
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _raised = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    return _raised


def map_streamed_weights() -> bool:
    """For a run that streams its weights: blocks from `STREAMED_MMAP_BYTES` up get their own
    mapping again, where `reuse_freed_memory` had raised the threshold (else nothing changes).

    Each forward allocates and frees every weight of the model once (read, converted); in the heap
    those blocks, interleaved with the trace's points that stay, fragment it: measured on the
    Llama-3.2-1B shape, 64 tokens, 6.94 GB peak anonymous memory against 2.52 GB with glibc's
    defaults. Mapped, each weight goes back to the kernel when freed.
    """
    mallopt = _mallopt() if _raised else None
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, STREAMED_MMAP_BYTES))


def _mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries without mallopt
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
