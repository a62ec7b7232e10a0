"""How the process's C heap gives freed memory back: kept for reuse in a process that trains on CPU, a setting made by
an explicit call (the ``griffin`` commands that train make it first thing), as :mod:`griffin.threads`' are.

A CPU training step allocates and frees the same activations and gradients at every step, through torch's CPU
allocator, which is glibc's ``malloc``. glibc serves blocks above its mmap threshold (dynamic, from 128 KiB) with
fresh ``mmap`` pages and returns freed memory at the top of its heap to the OS once more than the trim threshold
(twice the mmap threshold) is free there. Blocks of a few MiB (the (B, T, D) tensors of the synthetic models, the
RG-LRU's inputs and gradients) then come back as new pages step after step: the OS faults in and zeroes each 4 KiB
page on its first write, which cost more than the RG-LRU kernel's own work (docs/performance.md, "The C heap").
Imports nothing of torch or griffin: it can run before either."""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
#: Blocks below this come from the heap, not from mmap: glibc's largest mmap threshold on 64-bit Linux
MMAP_THRESHOLD = 32 * 2**20
#: Free memory at the top of the heap is given back to the OS only beyond this
TRIM_THRESHOLD = 2**30
#: The environment's own malloc settings (or another allocator preloaded) win over :func:`keep_freed_memory`
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def keep_freed_memory() -> bool:
    """Keep memory the process frees for its next allocations (glibc: ``mallopt``): blocks up to
    :data:`MMAP_THRESHOLD` from the heap, and free memory at the heap's top given back to the OS only beyond
    :data:`TRIM_THRESHOLD`. The process then holds its peak heap, not its current use. Returns whether the setting was
    made: not on a C library other than glibc, nor where the environment sets glibc's malloc itself (``MALLOC_*_``
    variables, ``glibc.malloc`` tunables) or preloads another allocator (the user's choice wins). Takes effect for
    the allocations that follow; safe to call more than once."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]
