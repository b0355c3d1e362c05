"""A run's startup timeline, for `benchmarks/startup.py`: when each step was reached, from the process's start.

With SFT_TOKENIZE_TRACE=FILE in the environment, `mark(event)` appends one JSON line to FILE,
`{"event": ..., "t": seconds since this process started, "pid": ...}`; without it, `mark` does nothing. The
start is the kernel's (/proc/self/stat), so the interpreter's own start and every import are counted.
"""

from __future__ import annotations

import json
import os
import time

TRACE_ENV = "SFT_TOKENIZE_TRACE"


def process_start() -> float:
    """This process's start on the CLOCK_BOOTTIME scale (seconds since boot), as /proc/uptime counts."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.clock_gettime(time.CLOCK_BOOTTIME)


_STARTED = process_start() if os.environ.get(TRACE_ENV) else 0.0


def count_from(started: float) -> None:
    """Count this process's events from `started` (process_start's scale): a resident process runs a command
    that started before it (cli/resident.py)."""
    global _STARTED
    _STARTED = started


def mark(event: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    line = {"event": event, "t": round(time.clock_gettime(time.CLOCK_BOOTTIME) - _STARTED, 4), "pid": os.getpid()}
    with open(path, "a") as trace:
        trace.write(json.dumps(line) + "\n")
