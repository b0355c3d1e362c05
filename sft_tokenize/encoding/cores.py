"""The cores a run may use, and from what input size its slices' batches go to an encode pool: read by the command
line's option declarations before anything of the encoder is imported (encoding/pool.py imports the encoder)."""

from __future__ import annotations

import os

# Below this much input to tokenize, starting the pool (~1 s of CPU a process) costs more than it saves.
POOL_MIN_BYTES = 64 * 10**6


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
