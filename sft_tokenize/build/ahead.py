"""Slices tokenized ahead of their tasks: a run's first seconds spent on its work rather than on waiting.

A first run waits seconds for its Prefect server to boot (in its own process) before the flow's first task can
start. As soon as its plan exists, the run's process tokenizes slices into the shard store instead, in threads of
its own, with the encoder (and the encode pool) the run's tasks will use. The flow then runs as ever: every slice
is still a task run it records, and each task finds its shard:

    claimed(job, slice_)   called by shard.tokenize_slice before anything else: if a thread here took the slice,
                           waits for it and raises its error, once (a retry of the task tokenizes the slice again,
                           as any retry does); else makes sure no thread here takes it. The task then finds the
                           shard in the store as any finished one (or, had something removed it, tokenizes it)

so no slice is tokenized twice, and a slice that failed ahead fails its task with the same error. The threads stop
taking slices at the first claim: from then on the flow's own workers tokenize. `build_cache` counts the slices
tokenized here as this run's work (tokenized_ahead), not as shards the store held already.

Only the threads runner's local runs tokenize ahead, and only while a server the run launched boots
(flows/api.py): the other runners' workers are other processes, and a server already up leaves nothing to overlap.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from sft_tokenize.build.job import Job
from sft_tokenize.build.shard_check import finished_shard
from sft_tokenize.build.stopping import Stopped, stop_threads
from sft_tokenize.sources.records import Slice

Tokenize = Callable[[Job, Slice], int]
_in_ahead = threading.local()  # set in the threads that tokenize ahead: their own calls claim nothing


class Ahead:
    """Threads that tokenize a plan's slices, in order, until a task claims one (module docstring)."""

    def __init__(self, job: Job, slices: list[Slice], threads: int, tokenize: Tokenize) -> None:
        """`tokenize`: how a slice is tokenized (shard.tokenize_slice, as the tasks call it)."""
        self.job, self.tokenize = job, tokenize
        self.pending: deque[Slice] = deque(slices)
        self.outcomes: dict[str, Future] = {}  # shard path -> its slice's outcome, until a task claims it
        self.written: set[str] = set()  # shard paths whose slice a thread here tokenized
        self.started: float | None = None  # time.monotonic() as the first slice started
        self.ended: float | None = None  # and as the last one ended
        self.taking = True
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._work, name=f"tokenize-ahead-{i}", daemon=True)
                        for i in range(max(1, min(threads, len(slices))))]

    def start(self) -> None:
        with _registry_lock:
            _aheads.append(self)
        for thread in self.threads:
            thread.start()

    def _next(self) -> tuple[Slice, Future] | None:
        with self.lock:
            while self.taking and self.pending:
                slice_ = self.pending.popleft()
                if finished_shard(self.job, slice_) is not None:
                    continue  # in the store already: the task finds it there
                future: Future = Future()
                future.set_running_or_notify_cancel()
                self.outcomes[str(self.job.shard_path(slice_))] = future
                if self.started is None:
                    self.started = time.monotonic()
                return slice_, future
            return None

    def _work(self) -> None:
        _in_ahead.active = True
        while (taken := self._next()) is not None:
            slice_, future = taken
            try:
                rows = self.tokenize(self.job, slice_)
            except BaseException as error:  # noqa: BLE001 - handed to the slice's task as it is
                future.set_exception(error)
                if not isinstance(error, Exception):
                    return
                continue
            with self.lock:
                self.written.add(str(self.job.shard_path(slice_)))
                self.ended = time.monotonic()
            future.set_result(rows)

    def claim(self, path: str) -> Future | None:
        with self.lock:
            self.taking = False
            return self.outcomes.pop(path, None)

    def close(self) -> None:
        """Take no more slices; stop the slices still being tokenized (a run that ends before its tasks claimed them:
        a failure or an interrupt) and wait for the threads."""
        with self.lock:
            self.taking = False
        idents = {thread.ident for thread in self.threads if thread.ident is not None}
        stop_threads(idents)
        try:
            for thread in self.threads:
                if thread.ident is not None:
                    thread.join()
        finally:
            stop_threads(idents, stop=False)
            with _registry_lock:
                if self in _aheads:
                    _aheads.remove(self)

    def __enter__(self) -> Ahead:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_aheads: list[Ahead] = []  # this process's runs tokenizing ahead
_registry_lock = threading.Lock()


def _same_build(ahead: Ahead, job: Job) -> bool:
    return ahead.job.fingerprint == job.fingerprint and ahead.job.store == job.store


def claimed(job: Job, slice_: Slice) -> int | None:
    """The rows of the slice if a thread here tokenized it ahead (waited for if it is still at it), its error raised
    if it failed there; None if none took it (the caller tokenizes it, and no thread here will). The caller checks
    the store either way."""
    if getattr(_in_ahead, "active", False):
        return None
    path = str(job.shard_path(slice_))
    with _registry_lock:
        aheads = [ahead for ahead in _aheads if _same_build(ahead, job)]
    for ahead in aheads:
        future = ahead.claim(path)
        if future is not None:
            try:
                return future.result()
            except Stopped:
                return None  # stopped alone, not by the run: the task tokenizes it
    return None


def tokenized_ahead(job: Job, slices: list[Slice]) -> set[int]:
    """The indices of the slices whose shard a thread here wrote for this build: this run's work, not reused."""
    with _registry_lock:
        aheads = [ahead for ahead in _aheads if _same_build(ahead, job)]
    written = set().union(*(ahead.written for ahead in aheads)) if aheads else set()
    return {s.index for s in slices if str(job.shard_path(s)) in written}


def ahead_span(job: Job) -> tuple[float, float] | None:
    """When this process began tokenizing the build's slices ahead and when the last it wrote ended
    (time.monotonic()), or None if it wrote none."""
    with _registry_lock:
        spans = [(ahead.started, ahead.ended) for ahead in _aheads
                 if _same_build(ahead, job) and ahead.started is not None and ahead.ended is not None]
    return (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
