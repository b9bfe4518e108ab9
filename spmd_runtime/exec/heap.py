"""The process heap keeps the memory it frees, so a training step's fresh outputs reuse pages the last step
released instead of faulting new ones in.

A program's outputs are fresh arrays every run (the caller keeps them); the state a training step returns is
the model again (the reference step: 24 MiB per rank per step). glibc returns freed memory to the kernel
(``mmap``'d chunks on free, the heap's top by trimming), so every step faulted those pages back in, zeroed:
5,700 minor faults per one-rank step here, 2-8 us each in this VM. With trimming and ``mmap`` off, a step
faults nothing after the first (``getrusage`` minor faults 0 vs 5,696 per step; step 125-143 ms vs
136-169 ms, ``scripts/profile_step.py``'s config at batch 4). MVAPICH sets the same two options for its
registration cache; the price is that the process's resident size stays at its high-water mark.

Set once per process by ``Runtime.world()``. ``$SPMD_HEAP_KEEP=0`` leaves the allocator as it is; a C library
other than glibc is left alone.
"""
from __future__ import annotations

import ctypes
import os

KEEP_ENV = "SPMD_HEAP_KEEP"
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(environ=os.environ) -> bool:
    """Tell glibc's malloc never to trim its heap and never to ``mmap`` (so nothing freed goes back to the
    kernel); True when done."""
    if environ.get(KEEP_ENV, "1") == "0":
        return False
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_TRIM_THRESHOLD, -1)) and bool(libc.mallopt(M_MMAP_MAX, 0))


def _glibc():
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return libc
