"""The tokenize_dataset flow: plan the slices, tokenize them in parallel into shards, publish the cache.

The runner is a parameter, not a decorator argument: the flow opens a task runner built from its
parameters and maps the slices inside it, so a deployment run that only passes parameters picks its
runner the same way the CLI does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture, as_completed

from sft_tokenize.build.ahead import ahead_span, tokenized_ahead
from sft_tokenize.build.plan import Plan
from sft_tokenize.build.protocol import build_cache
from sft_tokenize.build.remote_store import collect_remote_garbage, finished_remote
from sft_tokenize.build.shard_check import finished_shard
from sft_tokenize.build.store import collect_garbage, discard_shards, remove_cache
from sft_tokenize.build.timeline import mark
from sft_tokenize.errors import BadInput, first_line
from sft_tokenize.flows.artifacts import report, report_packing
from sft_tokenize.flows.cluster import check_workers
from sft_tokenize.flows.failures import raise_failures
from sft_tokenize.flows.interrupts import stopping_workers
from sft_tokenize.flows.run_options import TokenizeRun
from sft_tokenize.flows.runners import result_storage, slice_encoding, started_task_runner, where
from sft_tokenize.tasks.pack_cache import pack_cache
from sft_tokenize.tasks.plan_slices import plan_slices
from sft_tokenize.tasks.publish_cache import publish_cache
from sft_tokenize.tasks.tokenize_slice import tokenize_slice
from sft_tokenize.tasks.tokenize_slices import GroupFailed, SliceGroup, group_size, group_slices, tokenize_slices

# (finished slices, all slices, rows in the finished slices): how the CLI draws its progress bar.
ProgressCallback = Callable[[int, int, int], None]
_progress_callbacks: list[ProgressCallback] = []


@contextmanager
def on_progress(callback: ProgressCallback) -> Iterator[None]:
    """Call `callback` once the slices are planned and again each time a slice finishes, in this process."""
    _progress_callbacks.append(callback)
    try:
        yield
    finally:
        _progress_callbacks.remove(callback)


def _notify(finished: int, total: int, rows: int) -> None:
    for callback in list(_progress_callbacks):
        callback(finished, total, rows)


def discard_previous_output(plan: Plan, options: TokenizeRun) -> Plan:
    """`force`: delete the published cache and this plan's shards in the store (other caches keep their
    links to them), planning again if the cache was there."""
    if plan.job.remote_root:
        raise BadInput(f"--force: not supported on a remote cache root ({plan.job.remote_root}); remove the version "
                       "with `sft-tokenize gc` or build under another --name")
    if plan.cache_path.exists():
        remove_cache(plan.cache_path)
        get_run_logger().info("force: deleted the published cache %s", plan.cache_path)
    if plan.cached:
        plan = plan_slices(options, min_slices=options.worker_count)
    if removed := discard_shards(plan.job, plan.slices):
        get_run_logger().info("force: deleted %d shards of this plan from %s", removed, plan.store)
    return plan


class Progress:
    """The run's progress artifact, updated as slices finish: at most once a second (each update is a request the
    server writes), and always at the end."""

    INTERVAL = 1.0

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total, self.last = name, total, time.monotonic()
        self.id = create_progress_artifact(0.0, description=f"{name}: 0 of {total} slices")

    def update(self, finished: int, rows: int, failed: int) -> None:
        now = time.monotonic()
        if finished + failed < self.total and now - self.last < self.INTERVAL:
            return
        self.last = now
        update_progress_artifact(self.id, 100 * (finished + failed) / self.total,
                                 description=f"{self.name}: {finished} of {self.total} slices, {rows:,} rows"
                                 + (f", {failed} failed" if failed else ""))


def _outcome(future: PrefectFuture, group: SliceGroup) -> tuple[dict[int, int], dict[int, BaseException]]:
    """What a task run of `group` left: the row counts of its finished slices and the errors of its failed ones."""
    indices = [s.index for s in group.slices]
    try:
        result = future.result()
    except GroupFailed as error:
        if error.failures:
            return error.rows, error.failures
        return {}, dict.fromkeys(indices, error)
    except Exception as error:  # noqa: BLE001 - every failure is reported by slice
        return {}, dict.fromkeys(indices, error)
    return dict(zip(indices, result if isinstance(result, list) else [result], strict=True)), {}


def tokenize_all(plan: Plan, options: TokenizeRun, staged: set[int]) -> dict:
    """Tokenize every slice on the chosen runner (those in `staged` have a shard in the store already);
    raise naming every slice that failed (raise_failures)."""
    with slice_encoding(plan, options, staged) as processes:
        return _tokenize_on_runner(plan, options, staged, processes)


def _tokenize_on_runner(plan: Plan, options: TokenizeRun, staged: set[int], processes: int) -> dict:
    logger = get_run_logger()
    total = len(plan.slices)
    workers = max(1, min(options.worker_count, total))
    size = group_size(total, workers, options.slices_per_task, sum(s.nbytes for s in plan.slices) / total)
    groups = group_slices(plan.slices, size)
    if size == 1:
        task, unit = tokenize_slice, "slice_"
    else:
        task, unit = tokenize_slices, "group"
    cached_task = task.with_options(retries=options.retries, **result_storage(options))
    # A slice without a finished shard on disk runs even if Prefect remembers a result for its key.
    fresh_task = cached_task.with_options(refresh_cache=True)
    logger.info("tokenizing %d slices (%d already in the shard store) on %s%s", total, len(staged),
                where(options, workers) + (f", their batches encoded by {processes} processes" if processes else ""),
                f", in {len(groups)} tasks of about {size} slices" if size > 1 else "")
    progress = Progress(plan.name, total)
    _notify(0, total, 0)
    started = time.monotonic()
    rows, finished, failures = 0, 0, {}
    with started_task_runner(options.runner, workers, options.cluster_address) as runner, \
            stopping_workers(runner, [plan.job.shard_path(s) for s in plan.slices]):
        if options.runner in ("dask", "ray"):
            checked = check_workers(options.runner, runner, plan)
            logger.info("checked %s: they read the inputs and write to %s", checked, plan.job.store)

        def reused(group: SliceGroup) -> bool:
            return all(s.index in staged for s in group.slices)

        # Slices to tokenize first: in an incremental run, the new work starts at once rather than after the
        # reused slices' (quick) task runs have gone through the workers.
        futures = {runner.submit(cached_task if reused(g) else fresh_task,
                                 {"job": plan.job, unit: g.slices[0] if size == 1 else g}): g
                   for g in sorted(groups, key=reused)}
        for future in as_completed(list(futures)):
            group = futures[future]
            done, failed = _outcome(future, group)
            for index, error in failed.items():
                logger.warning("tokenize-%05d failed: %s: %s", index, type(error).__name__, first_line(error))
            failures.update(failed)
            rows, finished = rows + sum(done.values()), finished + len(done)
            if done:
                logger.info("%s: %d rows (%d of %d slices done)", group.name, sum(done.values()), finished, total)
            progress.update(finished, rows, len(failures))
            _notify(finished, total, rows)
    seconds = time.monotonic() - started
    if (span := ahead_span(plan.job)) is not None and span[0] < started:
        # Slices this process tokenized while its server booted (build/ahead.py): the time they took too, not the wait.
        seconds += min(span[1], started) - span[0]
    if failures:
        raise_failures(failures, plan, options.retries)
    finished = finished_remote if plan.job.remote_root else finished_shard
    tokenized = [finished(plan.job, s) for s in plan.slices if s.index not in staged]
    return {"runner": options.runner, "workers": workers, "encode_processes": processes,
            "tokenize_seconds": round(seconds, 3), "tokenized_ahead": len(tokenized_ahead(plan.job, plan.slices)),
            "tokens_tokenized": sum(meta["tokens"] for meta in tokenized if meta)}


@flow(name="tokenize-dataset", description="Tokenize an SFT dataset into a memory-mapped Arrow cache.")
def tokenize_dataset(options: TokenizeRun) -> str:
    """Plan, tokenize every slice into its own shard, publish the shards as the cache; return its path."""
    mark("flow")
    logger = get_run_logger()
    started = time.monotonic()
    if options.remote_root and options.pack is not None:
        raise BadInput(f"--pack: a cache on {options.remote_root} is packed where it is read: pull it "
                       "(`sft-tokenize pull`), then `sft-tokenize pack` the local copy")
    plan = plan_slices(options, min_slices=options.worker_count)  # small inputs still give every worker a slice
    if plan.inputs.get("ignored_files"):
        logger.info("not data, not read: %s", ", ".join(plan.inputs["ignored_files"]))
    plan_seconds = round(time.monotonic() - started, 3)  # resolving, checking and hashing the inputs

    def on_the_runner(plan: Plan, staged: set[int]) -> dict:
        return {"plan_seconds": plan_seconds, **tokenize_all(plan, options, staged)}

    def discarding_previous_output(plan: Plan) -> Plan:
        return discard_previous_output(plan, options)

    built = build_cache(plan, on_the_runner, publish_cache, discarding_previous_output if options.force else None)
    plan = built.plan
    if built.outcome == "cached":
        logger.info("cache hit, nothing to tokenize: %s", plan.location)
    elif built.outcome == "published meanwhile":
        logger.info("another run published the cache while this one waited: %s", plan.location)
    else:
        mark("published")
        logger.info("published %s (%d slices reused, %d tokenized)", plan.location, built.reused,
                    len(plan.slices) - built.reused)
        if options.keep_versions:
            done = collect_remote_garbage(options.remote_root, options.keep_versions, names={plan.name},
                                          storage_options=options.storage_options) if options.remote_root \
                else collect_garbage(options.cache_root, options.keep_versions, names={plan.name})
            logger.info("removed %d older versions of %s and %d unused shards (%s bytes)",
                        len(done.removed), plan.name, done.shards_removed, f"{done.bytes_freed:,}")
    if plan.url:  # the summary artifact and packing read a local cache: `sft-tokenize pull` makes one
        return plan.url
    report(plan.cache_path)
    if options.pack is not None:
        report_packing(pack_cache(plan.cache_path, options.pack))
    return str(plan.cache_path)
