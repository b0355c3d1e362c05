"""The runner policy: which Prefect task runner a run's slices go to, how its workers are set up, and where
Prefect keeps the slices' results."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from prefect.context import get_run_context
from prefect.filesystems import WritableFileSystem
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import Plan
from sft_tokenize.build.workers import (
    encoding_processes,
    keep_pool_ready,
    ready_processes,
    settle_encoder,
    warm_encoder,
)
from sft_tokenize.encoding.cores import available_cores
from sft_tokenize.encoding.memory import limit_malloc_arenas
from sft_tokenize.encoding.pool import tokenizer_env
from sft_tokenize.files import with_timeouts
from sft_tokenize.fingerprint import fingerprint
from sft_tokenize.flows.cluster import dask_runner, ray_runner
from sft_tokenize.flows.console import configure_console
from sft_tokenize.flows.interrupts import ignore_sigint
from sft_tokenize.flows.run_options import TokenizeRun
from sft_tokenize.format.layout import PREFECT_RESULTS


def prepare_worker(tokenizer_threads: int) -> None:
    """Run in each process-pool worker before its first task."""
    os.environ.update(tokenizer_env(tokenizer_threads))
    ignore_sigint()
    limit_malloc_arenas()
    configure_console(worker=True)


@contextmanager
def workers_share_this_api() -> Iterator[None]:
    """Without a configured API URL, each spawned worker would start its own embedded Prefect server
    (seconds each, one more client of the same database): point them at this flow run's server."""
    if get_current_settings().api.url:
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: str(get_run_context().client.api_url)}):
        yield


@contextmanager
def started_task_runner(runner: str, workers: int, address: str | None = None) -> Iterator[TaskRunner]:
    if runner == "threads":
        # Threads share the process's one tokenizer thread pool, so they cannot oversubscribe the cores.
        limit_malloc_arenas()
        with ThreadPoolTaskRunner(max_workers=workers) as pool:
            yield pool
        return
    tokenizer_threads = max(1, available_cores() // workers)  # local workers × tokenizer threads ≤ cores
    if runner == "processes":
        pool = ProcessPoolTaskRunner(max_workers=workers, initializer=prepare_worker, initargs=(tokenizer_threads,))
    elif runner == "dask":
        pool = dask_runner(address, workers, tokenizer_threads)
    else:
        pool = ray_runner(address, workers, tokenizer_threads)
    with workers_share_this_api(), pool:
        try:
            yield pool
        finally:
            if runner == "processes":
                forget_unsent_messages(pool)


def forget_unsent_messages(pool: ProcessPoolTaskRunner) -> None:
    """Let this process exit without flushing the workers' message queue. A worker killed (OOM killer, `kill
    -9`) while it sends a log or an event to this process dies holding the queue's lock: the queue's feeder thread
    here then never gets it, and the interpreter would wait for that thread at exit, forever."""
    if (messages := getattr(pool, "_subprocess_message_queue", None)) is not None:
        messages.cancel_join_thread()


@contextmanager
def slice_encoding(plan: Plan, options: TokenizeRun, staged: set[int]) -> Iterator[int]:
    """Where the batches of the plan's slices are encoded, decided once for the run; yields the encode processes (0:
    none). On the threads runner, by an encode pool of a process per core when the slices to tokenize (not in
    `staged`) are large enough or a pool was started for the job already (workers.start_early), else by the
    slices' threads, this process's fast encoder warmed now; on the other runners, by their workers, which read the
    fast encoder's verdict that this process settles first. The pool ends with the block (terminated if it raised).
    A resident process started after this run keeps the pool a run like it would take ready."""
    processes = options.encode_process_count(sum(s.nbytes for s in plan.slices if s.index not in staged),
                                             ready_processes(plan.job))
    if options.runner == "threads" and not processes:
        warm_encoder(plan.job)  # this process encodes: its fast encoder builds while the slices are submitted
    elif options.runner != "threads":
        settle_encoder(plan.job)
    keep_pool_ready(plan.job, options.ready_pool_count)
    with encoding_processes(plan.job, processes) if processes else nullcontext():
        yield processes


def where(options: TokenizeRun, workers: int) -> str:
    if options.cluster_address:
        return f"the {options.runner} cluster at {options.cluster_address}"
    if options.runner in ("dask", "ray"):
        return f"a temporary {options.runner} cluster of {workers} workers"
    return f"{workers} {options.runner}"


def result_storage(options: TokenizeOptions) -> dict:
    """Prefect's result records live beside the cache they describe, unless the operator set a storage block: on
    a remote root, in the bucket (Prefect's own RemoteFileSystem), so that workers sharing only it share them."""
    if get_current_settings().results.default_storage_block:
        return {}
    if options.remote_root:
        return {"result_storage": bucket_results(options.remote_root, with_timeouts(
            options.remote_root, options.storage_options, options.request_timeout))}
    return {"result_storage": options.cache_root / PREFECT_RESULTS}


def bucket_results(url: str, storage_options: dict) -> WritableFileSystem:
    """Prefect's RemoteFileSystem on URL/.prefect-results, saved as a block (Prefect wants task result storage
    saved server-side) named by what it holds: the storage options go where the run's parameters already hold
    them, the server's database."""
    from prefect.filesystems import RemoteFileSystem

    basepath = f"{url}/{PREFECT_RESULTS}"
    block = RemoteFileSystem(basepath=basepath, settings=storage_options)
    block.save(f"sft-tokenize-results-{fingerprint({'basepath': basepath, 'settings': storage_options})}",
               overwrite=True)
    return block
