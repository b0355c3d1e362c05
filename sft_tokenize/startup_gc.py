"""The cyclic garbage collector paused while a process starts.

A run's process, and its embedded server's, import hundreds of thousands of objects (Prefect, pydantic, fastapi,
sqlalchemy). CPython starts a collection every few hundred allocations and, as the heap grows, full ones that
walk all of it again: about a fifth of an import's CPU (`import prefect.server.api.server`: 3.0-3.3 s of CPU
with the collector, 2.4-2.5 s without). Imports leave no cyclic garbage worth that. So a process that is
starting pauses the collector and resumes it once started, when what it imported is moved out of the collector's
sight (`gc.freeze`): later collections walk the objects made after that, not the modules.

Only a process that paused resumes: `resume_collector` does nothing in one that did not (a deployment's worker, a
training script that calls the Python API), whose collector is its own.
"""

from __future__ import annotations

import gc

_paused = False


def pause_collector() -> None:
    """Pause the collector until `resume_collector` (a child forked meanwhile starts paused, and resumes alike)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector() -> None:
    """Resume the collector if `pause_collector` paused it, the objects made until now frozen first."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
