"""A run's request to stop (Ctrl-C, SIGTERM): tokenizing threads check it between batches.

A slice that sees it raises Stopped and leaves no file under a finished name (its temporary shard is
removed as on any failure); the slices that finished keep their shards for the next run.
"""

from __future__ import annotations

import threading

_stop = threading.Event()


class Stopped(RuntimeError):
    """The run was interrupted; this slice gave up before finishing its shard."""


def request_stop() -> None:
    _stop.set()


def raise_if_stopping() -> None:
    if _stop.is_set():
        raise Stopped("the run was interrupted")
