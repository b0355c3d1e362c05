"""What a process that tokenizes slices keeps between them: its tokenizer and fast encoder, its ChatEncoders, and
the encode pools of its runs in progress.

Loading a tokenizer, building a fast encoder and compiling a template take from a hundred ms to seconds: each
process does it once per job and shares the result with its threads (none of them holds state between
batches), whether the process is the one that planned (the threads runner) or a worker of a pool or cluster.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from sft_tokenize.build.job import Job
from sft_tokenize.build.timeline import mark
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.exact import FastEncoder, choose_encoder
from sft_tokenize.encoding.pool import DEPTH, EncodePool
from sft_tokenize.encoding.prepared import PartsTokenizer, keep_boundaries, prepared_encoding, prepared_here
from sft_tokenize.encoding.tokenizer import fetch_tokenizer, load_tokenizer
from sft_tokenize.encoding.vision import VisionFamily, load_family

_made: list[tuple] = []  # process_encoding's arguments, as this process first asked for each


@lru_cache(maxsize=4)
def process_encoding(tokenizer_dir: str, chat_template: str | None, trust_remote_code: bool, encoder: str,
                     prepared: str = "") -> tuple[Any, FastEncoder | None]:
    """One tokenizer and fast encoder per process, shared by its threads (encoding does not mutate them), and by
    the plan that checked them when the slices run in the planning process (the threads runner). With a
    `prepared` directory (prepared.py) they come from there, made once per tokenizer content."""
    _made.append((tokenizer_dir, chat_template, trust_remote_code, encoder, prepared))
    del _made[:-4]

    def load():
        return load_tokenizer(tokenizer_dir, None, trust_remote_code)

    if prepared:
        tokenizer, fast = prepared_encoding(Path(prepared), load, encoder)
    else:
        tokenizer = load()
        fast = choose_encoder(tokenizer, encoder)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer, fast


def encodings_made(forget: bool = False) -> list[tuple]:
    """The arguments of this process's last four process_encoding calls that made an encoding: what a resident
    process prepares for the next run (cli/resident.py). `forget`: and start the list again (a resident that
    begins a command, so that the next one prepares what that command used, not what this one prepared)."""
    made = list(_made)
    if forget:
        _made.clear()
    return made


def prepare_encodings(made: list[tuple], pooled: list[tuple[Job, int]] = ()) -> None:
    """process_encoding of each of `made`, with HF's Rust tokenizer and fastokens' tables built: the next run in
    this process finds its encoder ready (for a 151k vocabulary, ~0.4 s holding the GIL and ~1 s of a core). The
    encoders of `pooled`'s jobs are made too, without the tables: a pool of theirs encodes (start_early)."""
    pooled_encodings = {_encoding_arguments(job) for job, _ in pooled}
    for arguments in made:
        with suppress(Exception):  # a tokenizer gone or changed: the run prepares its own
            tokenizer, fast = process_encoding(*arguments)
            tokenizer.backend_tokenizer  # noqa: B018 - built here
            if fast is not None and tuple(arguments) not in pooled_encodings and not fast.verdict():
                fast.native  # noqa: B018 - built here (and checked first, for a tokenizer seen for the first time)
    for job, _ in pooled:
        with suppress(Exception):
            encoder_for(job)


def tokenizer_here(job: Job) -> str:
    """The job's tokenizer directory in this process: its own copy of a tokenizer on object storage (a worker that
    shares only the bucket has no path of the planning machine), else the directory the plan resolved."""
    if job.tokenizer_url:
        return str(fetch_tokenizer(job.tokenizer_url, job.storage_options))
    return job.tokenizer_dir


def _encoding_arguments(job: Job) -> tuple:
    """process_encoding's arguments for the job in this process."""
    return tokenizer_here(job), job.chat_template, job.trust_remote_code, job.encoder, prepared_path(job)


def _process_encoding(job: Job) -> tuple[Any, FastEncoder | None]:
    """This process's tokenizer and fast encoder for the job."""
    return process_encoding(*_encoding_arguments(job))


def prepared_path(job: Job) -> str:
    """Where this process keeps the job's tokenizer prepared: with a remote root, under its own user cache (a
    worker that shares only the bucket has no path of the flow's machine)."""
    return str(prepared_here(job.prepared)) if job.remote_root and job.prepared else job.prepared


def warm_encoder(job: Job) -> None:
    """This process is about to encode the job's slices itself: start building its fast encoder now, and HF's
    Rust tokenizer, against which each slice's first rows are checked."""
    tokenizer, fast = _process_encoding(job)
    if fast is not None:
        fast.warm()
        if isinstance(tokenizer, PartsTokenizer):
            tokenizer.build_backend_soon()


def settle_encoder(job: Job) -> None:
    """Run the job's fast encoder check here if it is still to run (a tokenizer seen for the first time): the
    workers of the processes, dask and ray runners then read its verdict in the prepared entry instead of each
    preparing the tokenizer again."""
    _, fast = _process_encoding(job)
    if fast is not None:
        fast.verdict()


_encoders: dict[tuple, ChatEncoder] = {}
_making_encoder = threading.Lock()


def _encoder_key(job: Job) -> tuple:
    """What a job's encoder is made of: jobs with the same key encode alike."""
    return (job.tokenizer_dir, job.chat_template, job.trust_remote_code, job.encoder, prepared_path(job),
            job.processor_config, job.masks)


def vision_family(job: Job) -> VisionFamily | None:
    """The job's vision family (None without a processor): its processor's configuration read with this process's
    tokenizer, the one the plan loaded and checked. Publishing an image cache records it without an encoder."""
    if not job.processor_config:
        return None
    return load_family(json.loads(job.processor_config), _process_encoding(job)[0])


_runs: dict[tuple, str] = {}  # encoder key -> the run its encoder last learned skeletons for
_in_full: set[tuple[str, tuple]] = set()  # (run, encoder key) whose skeletons a mismatch dropped in this process


def skeletons_dropped(job: Job) -> None:
    """A fill of the job's template differed from its full render here: this process renders the rest in full."""
    _in_full.add((job.run, _encoder_key(job)))


def rendering(job: Job) -> Job:
    """The job as this process renders it: with --render full once its skeletons were dropped in this run."""
    if job.render == "full" or (job.run, _encoder_key(job)) not in _in_full:
        return job
    return replace(job, render="full")


def encoder_for(job: Job) -> ChatEncoder:
    """This process's ChatEncoder for the job, made once (compiling and probing a template takes a few hundred
    ms) and shared by its slices' threads: it holds no state between batches, and its skeletons are learned
    anew for each run (a run never fills rows from what another learned)."""
    key = _encoder_key(job)
    with _making_encoder:
        if key in _encoders and _runs.get(key) != job.run:
            skeletons = _encoders[key].turns.skeletons if _encoders[key].turns is not None else None
            if skeletons is not None:
                skeletons.reset()
        _runs[key] = job.run
        if key not in _encoders:
            if len(_encoders) >= 4:  # as many as process_encoding keeps: a long-lived worker's jobs come and go
                _encoders.pop(next(iter(_encoders)))
            tokenizer, fast = _process_encoding(job)
            vision = vision_family(job)
            encoder = _encoders[key] = ChatEncoder(tokenizer, job.masks, fast=fast, vision=vision)
            if encoder.template is not None:
                keep_boundaries(tokenizer, encoder.template.learned_boundaries)
                encoder.template.warn_header_difference(job.tokenizer_url or job.tokenizer_dir)
        return _encoders[key]


_pools: list[tuple[Job, EncodePool]] = []  # the encode pools of this process's runs in progress


_early: dict[tuple[tuple, int], EncodePool] = {}  # pools started before their run needs them (start_early)
_next_pool: list[tuple[Job, int]] | None = None  # the job of this process's last run, the pool its next would take


def _new_pool(job: Job, processes: int) -> EncodePool:
    encoder = encoder_for(job)
    pool = EncodePool(encoder, processes)

    def traced(ready: Future) -> None:
        if ready.exception() is None:
            mark("pool_ready")

    pool.ready.add_done_callback(traced)
    return pool


def start_early(job: Job, processes: int) -> None:
    """Start the encode pool a run of `job` is about to need: its processes build their encoder (seconds, for a
    large vocabulary) while the run joins its server and submits its slices. `encoding_processes` takes it;
    `close_early` ends one no run took."""
    key = (_encoder_key(job), processes)
    for other in [k for k in _early if k != key]:  # a resident's pool for another job: its memory, given back
        _early.pop(other).close(now=True)
    if processes and key not in _early:
        _early[key] = _new_pool(job, processes)


def ready_processes(job: Job) -> int:
    """The number of processes of a pool started early for `job` (a resident's, for the job of the run before),
    or 0: a run of that job encodes with it whatever its size, since its start is paid already."""
    key = _encoder_key(job)
    return next((processes for (k, processes) in _early if k == key), 0)


def keep_pool_ready(job: Job, processes: int) -> None:
    """Say that a next run of `job` would take a pool of `processes` processes, whatever its size: a resident
    process started after this run starts that pool while it waits (cli/resident.py)."""
    global _next_pool
    _next_pool = [(job, processes)] if processes else []


def next_pools() -> list[tuple[Job, int]] | None:
    """keep_pool_ready's job and count, if its tokenizer is a local one, the job without its storage options (they
    may hold credentials, and a pool reads no storage); None if no run here said."""
    if _next_pool is None:
        return None
    return [(replace(job, storage_options={}), processes) for job, processes in _next_pool if not job.tokenizer_url]


@contextmanager
def encoding_early(job: Job, processes: int) -> Iterator[None]:
    """While in it, this process's slices of `job` have their batches encoded by the pool start_early started for it,
    if there is one (slices tokenized ahead of their tasks: ahead.py); the pool stays for encoding_processes to
    take, with the run's job."""
    pool = _early.get((_encoder_key(job), processes))
    if pool is None:
        yield
        return
    entry = (job, pool)
    _pools.append(entry)
    try:
        yield
    finally:
        _pools.remove(entry)


def close_early() -> None:
    while _early:
        _early.popitem()[1].close(now=True)


@contextmanager
def encoding_processes(job: Job, processes: int) -> Iterator[None]:
    """While in it, this process's slices of `job` have their batches encoded by `processes` processes (see
    encoding/pool.py); they are terminated if it ends with an error or an interrupt."""
    pool = _early.pop((_encoder_key(job), processes), None) or _new_pool(job, processes)
    entry = (job, pool)
    _pools.append(entry)
    ended = False
    try:
        yield
        ended = True
    finally:
        _pools.remove(entry)
        entry[1].close(now=not ended)


class _InlineEncoding:
    """A slice's batches encoded in its own thread, with the pool's interface."""

    def __init__(self, encoder: ChatEncoder):
        self.encoder = encoder

    def submit(self, examples: list, verify_rows: int) -> Future:
        done: Future = Future()
        try:
            done.set_result(self.encoder.encode_batch(examples, verify_rows))
        except Exception as error:  # raised where the pool's future would raise it
            done.set_exception(error)
        return done


def slice_encoding(job: Job) -> tuple[EncodePool | _InlineEncoding, int]:
    """Where a slice's batches are encoded, and how many may be in flight."""
    for pool_job, pool in _pools:
        if pool_job == job:
            return pool, DEPTH
    return _InlineEncoding(encoder_for(job)), 0
