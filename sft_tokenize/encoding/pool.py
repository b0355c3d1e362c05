"""Every core does a slice's Python work: encoder processes, started once per run.

On the threads runner every slice runs in the flow's process, where template rendering, turn finding and
mask placement would share one GIL. While such a run tokenizes, an `EncodePool` keeps one process per core.
Each slice's thread still reads its rows and writes its shard; it hands its batches of examples to the
pool, at most `DEPTH` in flight, and takes the encoded batches back in order, so the shard's bytes are the
ones the thread would have written itself. Examples go out and encoded batches (numpy arrays, drop reasons)
come back pickled; nothing is shared. The other runners already give each worker its own process.

The processes import neither transformers' tokenizer classes nor torch. One clean process (started by the
forkserver, so it carries none of this process's imports or threads) is given the tokenizer as its parts
(`prepared.TokenizerParts`: the Rust tokenizer's JSON, the chat template, the special tokens, the token boundaries
the template learned: all that encoding reads of it) and the fast encoder this process chose and checked (or, for a
tokenizer seen for the first time, HF's answers to check it against: the pool's first call returns the verdict, and
a refused encoder leaves every row to HF), builds the `ChatEncoder` and fastokens' tables (~170 MB for a 151k
vocabulary) once, and only then forks the encoding processes: they share those pages, which nothing writes, instead
of each building its own copy. It starts no thread before it forks (fastokens builds its tables without one, and its
own threads start at the first encode, in the processes). HF's tokenizer (~25 MB a process for a 151k vocabulary) is
built there only for a row the fast encoder cannot place: each slice's first rows, which are checked against HF's,
come back unchecked and are checked here, in the slice's thread, by this process's encoder.

Batches go out on one queue that every encoding process reads, and come back on another that a thread here
reads. A process that dies (killed, out of memory) breaks the pool, as it breaks a ProcessPoolExecutor: the
process that forked it stops the others and exits, and every batch in flight fails with BrokenProcessPool; their
slices fail and are retried, and the next batch submitted starts a new set of processes. The pool also ends when
the process that started it ends, however it ends (killed outright too): the forking process watches a pipe only
that process holds open, and an encoding process whose parent is gone ends (Linux's parent-death signal). At that
process's exit, a pool no run closed (a resident's, its command a cache hit) is terminated first: multiprocessing's
own exit function would otherwise wait for ever on the forking process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import itertools
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait
from typing import Any

from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder, EncodedBatch
from sft_tokenize.encoding.cores import available_cores
from sft_tokenize.encoding.exact import rebuilt_encoder
from sft_tokenize.encoding.memory import limit_malloc_arenas, trim_malloc
from sft_tokenize.encoding.prepared import PartsTokenizer, TokenizerParts
from sft_tokenize.encoding.vision import VisionFamily

DEPTH = 2  # a slice's batches in flight: one being encoded while its thread reads the next


def tokenizer_env(tokenizer_threads: int) -> dict[str, str]:
    """HF tokenizers (rayon) and fastokens size their thread pools from these; by default every process would
    take all the cores, and each fastokens thread keeps its own buffers (~30 MiB on a 32k vocabulary)."""
    return {"RAYON_NUM_THREADS": str(tokenizer_threads), "FASTOKENS_BPE_THREADS": str(tokenizer_threads),
            "TOKENIZERS_PARALLELISM": "true" if tokenizer_threads > 1 else "false"}


_encoder: ChatEncoder | None = None  # in a pool process: the run's encoder
_verdict: str | None = None  # in a pool process: the fast encoder's check, if the pool ran it ("" accepted)


def _start(parts: TokenizerParts, masks: MaskSettings, vision: VisionFamily | None, tokenizer_threads: int) -> None:
    """In the process that forks the encoding processes: the encoder they share, fastokens' tables built (and,
    for a tokenizer seen for the first time, checked against HF's answers: `_ready` returns the verdict)."""
    global _encoder, _verdict
    os.environ.update(tokenizer_env(tokenizer_threads))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group; the run closes the pool
    limit_malloc_arenas()
    fast = rebuilt_encoder(parts.backend_json, *parts.fast, cases=parts.check) if parts.fast else None
    if fast is not None:
        fast.warm()  # its tables build while the encoder below is made
    _encoder = ChatEncoder(PartsTokenizer(parts), masks, fast=fast, vision=vision)
    if fast is not None:
        _verdict = fast.verdict(say=False) if parts.check is not None else None  # refused: HF encodes every row
        if not fast.refused:
            fast.native  # noqa: B018 - built here, before the fork, once for every process
        for thread in threading.enumerate():  # the build's thread has ended (it sets the result, then returns)
            if thread.name == "fastokens-build":
                thread.join()


def _encode(examples: list, verify_rows: int) -> EncodedBatch:
    return _encoder.encode_batch(examples, verify_rows, defer_verify=True)


_PR_SET_PDEATHSIG = 1


def _end_with_parent() -> None:
    """This process is killed when its parent ends, however it ends (Linux; elsewhere the run's close ends it)."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(1)


def _serve(tasks, results) -> None:
    """An encoding process: run the calls on `tasks` until None comes, putting (id, ok, value) on `results`."""
    _end_with_parent()  # the forking process, which ends with the process that started the pool
    while (task := tasks.get()) is not None:
        ident, function, args = task
        try:
            answer = (ident, True, function(*args))
        except BaseException as error:  # noqa: BLE001 - raised where the batch is taken
            answer = (ident, False, error)
        try:
            results.put(answer)
        except Exception as error:  # noqa: BLE001 - an exception that does not pickle, said as text
            sent = type(answer[2]).__name__
            results.put((ident, False, RuntimeError(f"{type(error).__name__}: {error} (sending a {sent})")))


def _fork_processes(initargs: tuple, processes: int, tasks, results, started_by) -> None:
    """The forking process: build the encoder, fork `processes` encoding processes, and watch them. One that dies
    breaks the pool: the others are killed and this process exits with 1 (the run sees it); 0 once all ended.
    `started_by`: the read end of a pipe that only the process that started the pool writes to; its end (that
    process gone, however it ended) ends the pool the same way. The forkserver is no parent to watch: it lives
    as long as any process it started, these included."""
    _start(*initargs)
    gc.freeze()  # the encoder's objects stay where they are: a collection in a child would copy their pages
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_serve, args=(tasks, results), daemon=True) for _ in range(processes)]
    for child in children:
        child.start()

    def stop(*_: Any) -> None:
        for child in children:
            if child.is_alive():
                child.kill()
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    running = list(children)
    while running:
        for sentinel in wait([started_by, *(child.sentinel for child in running)]):
            if sentinel is started_by:
                stop()
            child = next(c for c in running if c.sentinel == sentinel)
            child.join()
            running.remove(child)
            if child.exitcode != 0:
                stop()


def _ready() -> str | None:
    """Called once per process at the start, so that they start while the run submits its slices; the verdict of
    the fast encoder's check if the pool ran it."""
    return _verdict


class _Checked:
    """A pool's encoded batch, its first rows checked against HF's in the thread that takes it."""

    def __init__(self, encoded: Future, checker: ChatEncoder):
        self.encoded, self.checker = encoded, checker

    def result(self) -> EncodedBatch:
        return self.checker.verify(self.encoded.result())

    def cancel(self) -> bool:
        return self.encoded.cancel()


class _Processes:
    """One set of encoding processes, their forking process, the two queues and the thread that reads results."""

    def __init__(self, initargs: tuple, processes: int):
        context = multiprocessing.get_context("forkserver")
        # Nothing preloaded: not __main__, the default, which would bring the CLI's imports (Prefect) along.
        context.set_forkserver_preload([])
        self.processes = processes
        self.tasks, self.results = context.SimpleQueue(), context.SimpleQueue()
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.broken = False
        self.ids = itertools.count()
        started_by, self.alive = context.Pipe(duplex=False)  # never written: closed when this process ends
        self.forking = context.Process(target=_fork_processes,
                                       args=(initargs, processes, self.tasks, self.results, started_by),
                                       name="sft-tokenize-encode-pool")  # not daemonic: it has children
        # Python's forkserver, started by this process's first pool, imports for a moment before it ignores SIGINT:
        # a Ctrl-C then printed its traceback on the user's terminal. Spawned with SIGINT blocked, it keeps it
        # blocked, as does every process it forks (they ignore it anyway); here a Ctrl-C waits until the unblock.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.forking.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        started_by.close()
        # Only the processes hold these ends now: once they are all gone, a read here sees the end of the stream
        # and a write a broken pipe, rather than waiting for ever.
        self.results._writer.close()
        self.tasks._reader.close()
        self.reader = threading.Thread(target=self._read, name="encode-pool-results", daemon=True)
        self.reader.start()
        _open.add(self)
        self.ready = [self.call(_ready) for _ in range(processes)][0]

    def call(self, function: Callable, *args: Any) -> Future:
        with self.lock:
            if self.broken:
                raise BrokenProcessPool("an encoding process died")
            ident, future = next(self.ids), Future()
            self.pending[ident] = future
        with contextlib.suppress(OSError):  # no process reads any more: the reader fails it with the others
            self.tasks.put((ident, function, args))
        return future

    def _read(self) -> None:
        while True:
            ready = wait([self.results._reader, self.forking.sentinel])
            if self.results._reader in ready:
                try:
                    ident, ok, value = self.results.get()
                except (EOFError, OSError):  # every process is gone, one in the middle of an answer perhaps
                    ready = [self.forking.sentinel]
                else:
                    with self.lock:
                        future = self.pending.pop(ident, None)
                    if future is not None and future.set_running_or_notify_cancel():
                        future.set_result(value) if ok else future.set_exception(value)
                    continue
            self.forking.join()
            with self.lock:  # ended: by close() (nothing pending), or broken
                self.broken = True
                pending, self.pending = self.pending, {}
            for future in pending.values():
                if future.set_running_or_notify_cancel():
                    future.set_exception(BrokenProcessPool(f"an encoding process died (exit {self.forking.exitcode})"))
            return

    def pids(self) -> list[int]:
        """The encoding processes' ids (not the forking process's)."""
        import psutil

        try:
            return [child.pid for child in psutil.Process(self.forking.pid).children()]
        except psutil.Error:
            return []

    def close(self, now: bool) -> None:
        _open.discard(self)
        if now:
            self.forking.terminate()  # it kills its encoding processes
        else:
            for _ in range(self.processes):
                self.tasks.put(None)
        self.forking.join(None if not now else 10)
        if self.forking.is_alive():
            self.forking.kill()
            self.forking.join()
        self.reader.join()
        self.tasks.close()
        self.results.close()
        self.alive.close()


_open: set[_Processes] = set()  # the sets of processes started here and not closed yet


@atexit.register  # after multiprocessing.util's (imported above), so it runs before it: last registered, first run
def _close_open() -> None:
    for processes in list(_open):
        processes.close(now=True)


def _settle(fast, ready: Future) -> None:
    if ready.exception() is None and ready.result() is not None:
        fast.settle(ready.result())


class EncodePool:
    """`processes` processes that encode batches with a ChatEncoder like this process's: its mask settings and
    vision family."""

    def __init__(self, encoder: ChatEncoder, processes: int):
        """`encoder`: this process's. It checks the processes' first rows of each slice, and
        lends them what its template learned with HF's tokenizer: they build HF's only for a row the fast encoder
        cannot place."""
        self.processes = processes
        threads = max(1, available_cores() // processes)
        self._checker = encoder
        learned = encoder.template.learned_boundaries if encoder.template else {}
        vision = encoder.images.vision if encoder.images is not None else None  # picklable, no tokenizer
        self._initargs = (TokenizerParts.of(encoder.tokenizer, encoder.fast, learned), encoder.masks, vision, threads)
        if encoder.fast is not None:  # the processes encode: this one keeps no second copy of fastokens' tables
            encoder.fast.release()
            trim_malloc()  # the tables' pages go back to the system: glibc would keep most of them (~160 MB)
        self._lock = threading.Lock()
        self._current = _Processes(self._initargs, processes)
        self.ready: Future = self._current.ready  # done once the first encoding process takes calls
        if self._initargs[0].check is not None:  # the processes check the fast encoder: their verdict is its own
            self.ready.add_done_callback(lambda ready: _settle(encoder.fast, ready))

    def call(self, function: Callable, *args: Any) -> Future:
        """`function(*args)` in one of the processes (a picklable function of a module they import)."""
        with self._lock:
            try:
                return self._current.call(function, *args)
            except BrokenProcessPool:  # a process died: its batches' slices fail and retry on new processes
                self._current.close(now=True)
                self._current = _Processes(self._initargs, self.processes)
                return self._current.call(function, *args)

    def submit(self, examples: list, verify_rows: int) -> _Checked:
        """The encoded batch of `examples`, HF checking the fast encoder's first `verify_rows` rows."""
        return _Checked(self.call(_encode, examples, verify_rows), self._checker)

    def pids(self) -> list[int]:
        """The encoding processes' ids, once started."""
        return self._current.pids()

    def close(self, now: bool = False) -> None:
        """Let the processes finish and exit; `now`, terminate them (a stopped or failed run)."""
        with self._lock:
            current = self._current
        current.close(now)
