"""Every core does a slice's Python work: encoder processes, started once per run.

On the threads runner every slice runs in the flow's process, where template rendering, turn finding and
mask placement would share one GIL. While such a run tokenizes, an `EncodePool` keeps one process per core.
Each slice's thread still reads its rows and writes its shard; it hands its batches of examples to the
pool, at most `DEPTH` in flight, and takes the encoded batches back in order, so the shard's bytes are the
ones the thread would have written itself. Examples go out and encoded batches (numpy arrays, drop reasons)
come back pickled; nothing is shared. The other runners already give each worker its own process.

The processes import neither transformers' tokenizer classes nor torch. Each is given the tokenizer as its
parts (`prepared.TokenizerParts`: the Rust tokenizer's JSON, the chat template, the special tokens, the token
boundaries the template learned: all that encoding reads of it) and the fast encoder this process chose and
checked, and builds its `ChatEncoder` once. HF's tokenizer (~40 MB a process for a 151k vocabulary) is built there only
for a row the fast encoder cannot place: each slice's first rows, which are checked against HF's, come back
unchecked and are checked here, in the slice's thread, by this process's encoder. A process that dies
(killed, out of memory) fails the batches it held: their slices fail and are retried, and the next batch
submitted starts a new set of processes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from sft_tokenize.encoding.chat_encoder import ChatEncoder, EncodedBatch
from sft_tokenize.encoding.exact import rebuilt_encoder
from sft_tokenize.encoding.memory import limit_malloc_arenas
from sft_tokenize.encoding.prepared import PartsTokenizer, TokenizerParts

DEPTH = 2  # a slice's batches in flight: one being encoded while its thread reads the next
# Below this much input to tokenize, starting the pool (~1 s of CPU a process) costs more than it saves.
POOL_MIN_BYTES = 64 * 10**6


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def tokenizer_env(tokenizer_threads: int) -> dict[str, str]:
    """HF tokenizers (rayon) and fastokens size their thread pools from these; by default every process would
    take all the cores, and each fastokens thread keeps its own buffers (~30 MiB on a 32k vocabulary)."""
    return {"RAYON_NUM_THREADS": str(tokenizer_threads), "FASTOKENS_BPE_THREADS": str(tokenizer_threads),
            "TOKENIZERS_PARALLELISM": "true" if tokenizer_threads > 1 else "false"}


_encoder: ChatEncoder | None = None  # in a pool process: the run's encoder


def _start(parts: TokenizerParts, settings: dict, tokenizer_threads: int) -> None:
    global _encoder
    os.environ.update(tokenizer_env(tokenizer_threads))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group; the run closes the pool
    limit_malloc_arenas()
    fast = rebuilt_encoder(parts.backend_json, *parts.fast) if parts.fast else None
    if fast is not None:
        fast.warm()  # this process encodes: its tables build while the encoder below is made
    _encoder = ChatEncoder(PartsTokenizer(parts), fast=fast, **settings)


def _encode(examples: list, verify_rows: int) -> EncodedBatch:
    return _encoder.encode_batch(examples, verify_rows, defer_verify=True)


def _ready() -> None:
    """Submitted once per process at the start, so that they start while the run submits its slices."""


class _Checked:
    """A pool's encoded batch, its first rows checked against HF's in the thread that takes it."""

    def __init__(self, encoded: Future, checker: ChatEncoder):
        self.encoded, self.checker = encoded, checker

    def result(self) -> EncodedBatch:
        return self.checker.verify(self.encoded.result())

    def cancel(self) -> bool:
        return self.encoded.cancel()


class EncodePool:
    """`processes` processes that encode batches with the ChatEncoder of `settings` (its keyword arguments)."""

    def __init__(self, encoder: ChatEncoder, settings: dict, processes: int):
        """`encoder`: this process's, made with `settings`. It checks the processes' first rows of each slice, and
        lends them what its template learned with HF's tokenizer: they build HF's only for a row the fast encoder
        cannot place."""
        self.processes = processes
        threads = max(1, available_cores() // processes)
        self._checker = encoder
        learned = encoder.template.learned_boundaries if encoder.template else {}
        self._initargs = (TokenizerParts.of(encoder.tokenizer, encoder.fast, learned), settings, threads)
        if encoder.fast is not None:  # the processes encode: this one keeps no second copy of fastokens' tables
            encoder.fast.release()
        self._lock = threading.Lock()
        self._executor = self._start()

    def _start(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("forkserver")
        # Nothing preloaded: not __main__, the default, which would bring the CLI's imports (Prefect) along, and
        # not the encoder's modules either, whose memory each process would then count as its own as well.
        context.set_forkserver_preload([])
        executor = ProcessPoolExecutor(self.processes, context, initializer=_start, initargs=self._initargs)
        for _ in range(self.processes):
            executor.submit(_ready)
        return executor

    def submit(self, examples: list, verify_rows: int) -> _Checked:
        """The encoded batch of `examples`, HF checking the fast encoder's first `verify_rows` rows."""
        with self._lock:
            try:
                encoded = self._executor.submit(_encode, examples, verify_rows)
            except BrokenProcessPool:  # a process died: its batches' slices fail and retry on new processes
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._start()
                encoded = self._executor.submit(_encode, examples, verify_rows)
        return _Checked(encoded, self._checker)

    def close(self, now: bool = False) -> None:
        """Let the processes finish and exit; `now`, terminate them (a stopped or failed run)."""
        with self._lock:
            executor = self._executor
        processes = list((executor._processes or {}).values()) if now else []
        executor.shutdown(wait=not now, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(3)
            if process.is_alive():
                process.kill()
                process.join()
