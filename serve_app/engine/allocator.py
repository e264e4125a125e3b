"""CPU memory for the hot path: freed blocks kept for the next step, not handed back to the OS.

A decode step allocates the same large tensors every time: logits of [rows, vocabulary] (82 MB for 160
rows of a 128k vocabulary in float32), their float copies, the temporaries of a logsumexp. glibc's
malloc serves blocks that large with a fresh mmap and unmaps them at free, so each step touches tens of
megabytes of new pages and takes a page fault for every 4 KB of them; threads beyond the first get
their own arenas, which do the same for anything over 64 MB. Measured on the 2-core machine (16 MB
clone + 82 MB fill + 16 MB exp, allocated and freed 30 times): 52-54 ms a round by default, 13-15 with
the settings below, from any thread. The offline step at a 128k vocabulary, batch 32, fixed:4:
greedy 94-130 -> 75-99 ms, sampled 151-185 -> 122-137 ms.

The settings: one arena for every thread, blocks up to 1 GB from the heap, the heap's free top kept
(never trimmed) and grown 1 GB at a time (address space; without it the heap still gave pages back
step after step). The process then holds on to its peak memory, which a server does anyway. vLLM's CPU
backend gets the same from tcmalloc by LD_PRELOAD; these are glibc's own knobs, nothing to install.
They reach a process two ways: `ALLOCATOR_ENV` in its environment before it starts (glibc reads them at
its first allocation): the `specserve` command starts itself again with them, so everything it
launches inherits them, and the Routers pass them to their model actors (Ray's runtime_env) whoever
started the cluster; and `keep_freed_memory()` (mallopt) for a process already running (a library
user, the tests), which reaches its main thread once the heap has grown, not the threads that have an
arena of their own already (tests/test_allocator.py). A variable the user set stays as set;
`SPECSERVE_KEEP_FREED_MEMORY=0` turns all of it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ALLOCATOR_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_TOP_PAD_": str(1 << 30),
}
"""glibc malloc's environment variables for a process that serves a model on a CPU."""
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2}
"""mallopt's parameter numbers (malloc.h: M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD)."""


def wanted() -> bool:
    return os.environ.get("SPECSERVE_KEEP_FREED_MEMORY", "1") != "0"


def allocator_env() -> dict[str, str]:
    """The variables to start a model-serving process with: ALLOCATOR_ENV less any the user set (empty when off)."""
    return {k: v for k, v in ALLOCATOR_ENV.items() if k not in os.environ} if wanted() else {}


@functools.cache
def keep_freed_memory() -> bool:
    """Apply ALLOCATOR_ENV to this process with mallopt (once; the variables the user set are left alone).
    False where the C library is not glibc or it is off."""
    if not wanted():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for name, value in ALLOCATOR_ENV.items():
        if name not in os.environ:
            ok &= bool(mallopt(_MALLOPT[name], min(int(value), 2**31 - 1)))
    return ok
