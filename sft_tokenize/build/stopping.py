"""A run's request to stop (Ctrl-C, SIGTERM): tokenizing threads check it between batches.

A slice that sees it raises Stopped and leaves no file under a finished name (its temporary shard is
removed as on any failure); the slices that finished keep their shards for the next run. A wait that can
last (a remote image's read, bounded only by its timeout) runs `interruptible`, so a stop does not wait for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
POLL_SECONDS = 0.2

_stop = threading.Event()
_stopped_threads: set[int] = set()  # threads told to stop alone (stop_threads): the rest of the process goes on


class Stopped(RuntimeError):
    """The run was interrupted; this slice gave up before finishing its shard."""


def request_stop() -> None:
    _stop.set()


def stop_threads(idents: set[int], stop: bool = True) -> None:
    """Stop these threads' slices only (`stop=False`: forget them again, once they have ended)."""
    if stop:
        _stopped_threads.update(idents)
    else:
        _stopped_threads.difference_update(idents)


def raise_if_stopping() -> None:
    if _stop.is_set() or threading.get_ident() in _stopped_threads:
        raise Stopped("the run was interrupted")


def interruptible(work: Callable[[], T]) -> T:
    """`work()`, run in a daemon thread and waited for here a moment at a time: a stop request raises Stopped
    at once instead of waiting for it (the run's thread pool would otherwise wait for this thread on its way
    out); the thread left behind ends with its own timeout, or with the process."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # handed to the waiting thread as it is
            outcome["error"] = error

    thread = threading.Thread(target=run, name="sft-tokenize-remote-read", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(POLL_SECONDS)
        raise_if_stopping()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextlib.contextmanager
def in_background(work: Callable[[], None], name: str, stop: threading.Event | None = None) -> Iterator[None]:
    """Run `work` in a daemon thread while the block runs; at its end, set `stop` (the work's signal to end) if
    given, and join the thread, so that nothing it does outlives the block."""
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        if stop is not None:
            stop.set()
        thread.join()
