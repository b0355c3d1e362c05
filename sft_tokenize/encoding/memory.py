"""Process-wide memory settings for a process whose threads tokenize."""

from __future__ import annotations

import ctypes
import ctypes.util

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas. glibc gives each thread that contends for malloc an arena of its own (up to
    8 per core) and never reuses one arena's free memory in another, so the tokenizer's Rust threads and the
    worker threads fragment the heap: with two workers this was ~40 MiB of a ~300 MiB peak, at no cost in
    speed. Returns False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    return bool(mallopt and mallopt(M_ARENA_MAX, arenas))
