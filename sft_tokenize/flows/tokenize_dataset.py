"""The tokenize_dataset flow: plan the slices, tokenize them in parallel into shards, publish the cache.

The runner is a parameter, not a decorator argument: the flow opens a task runner built from its
parameters and maps the slices inside it, so a deployment run that only passes parameters picks its
runner the same way the CLI does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import BrokenExecutor, CancelledError
from contextlib import contextmanager, nullcontext
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.futures import as_completed

from sft_tokenize.build.plan import Plan
from sft_tokenize.build.protocol import build_cache
from sft_tokenize.build.shard import finished_shard
from sft_tokenize.build.store import collect_garbage, discard_shards, remove_cache
from sft_tokenize.build.timeline import mark
from sft_tokenize.build.workers import encoding_processes, warm_encoder
from sft_tokenize.errors import BadInput
from sft_tokenize.flows.artifacts import artifact_key, report, report_packing
from sft_tokenize.flows.cluster import check_workers
from sft_tokenize.flows.interrupts import stopping_workers
from sft_tokenize.flows.report import describe_slice, markdown_table
from sft_tokenize.flows.run_options import TokenizeRun
from sft_tokenize.flows.runners import result_storage, started_task_runner, where
from sft_tokenize.tasks.pack_cache import pack_cache
from sft_tokenize.tasks.plan_slices import plan_slices
from sft_tokenize.tasks.publish_cache import publish_cache
from sft_tokenize.tasks.tokenize_slice import NOT_RETRIED, tokenize_slice


class SlicesFailed(RuntimeError):
    """Slices that failed (after their retries, where retrying can help); the shards that finished stay in the
    shard store for the next run."""


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
    if plan.cache_path.exists():
        remove_cache(plan.cache_path)
        get_run_logger().info("force: deleted the published cache %s", plan.cache_path)
    if plan.cached:
        plan = plan_slices(options, min_slices=options.worker_count)
    if removed := discard_shards(plan.job, plan.slices):
        get_run_logger().info("force: deleted %d shards of this plan from %s", removed, plan.store)
    return plan


def tokenize_all(plan: Plan, options: TokenizeRun, staged: set[int]) -> dict:
    """Tokenize every slice on the chosen runner (those in `staged` have a shard in the store already);
    raise naming every slice that failed (raise_failures)."""
    logger = get_run_logger()
    total = len(plan.slices)
    workers = max(1, min(options.worker_count, total))
    # Threads share one GIL: their batches are rendered, masked and encoded by a process per core instead.
    processes = options.encode_process_count(sum(s.nbytes for s in plan.slices if s.index not in staged))
    if options.runner == "threads" and not processes:
        warm_encoder(plan.job)  # this process encodes: its fast encoder builds while the slices are submitted
    cached_task = tokenize_slice.with_options(retries=options.retries, **result_storage(options))
    # A slice without a finished shard on disk runs even if Prefect remembers a result for its key.
    fresh_task = cached_task.with_options(refresh_cache=True)
    logger.info("tokenizing %d slices (%d already in the shard store) on %s", total, len(staged),
                where(options, workers) + (f", their batches encoded by {processes} processes" if processes else ""))
    progress = create_progress_artifact(0.0, description=f"{plan.name}: 0 of {total} slices")
    _notify(0, total, 0)
    started = time.monotonic()
    rows, finished, failures = 0, 0, {}
    with encoding_processes(plan.job, processes) if processes else nullcontext(), \
            started_task_runner(options.runner, workers, options.cluster_address) as runner, \
            stopping_workers(runner, [plan.job.shard_path(s) for s in plan.slices]):
        if options.runner in ("dask", "ray"):
            checked = check_workers(options.runner, runner, plan)
            logger.info("checked %s: they read the inputs and write to %s", checked, plan.store)
        # Slices to tokenize first: in an incremental run, the new work starts at once rather than after the
        # reused slices' (quick) task runs have gone through the workers.
        futures = {runner.submit(cached_task if s.index in staged else fresh_task, {"job": plan.job, "slice_": s}): s
                   for s in sorted(plan.slices, key=lambda s: s.index in staged)}
        for future in as_completed(list(futures)):
            slice_ = futures[future]
            try:
                slice_rows = future.result()
            except Exception as error:  # noqa: BLE001 - every failure is reported below, by slice
                failures[slice_.index] = error
                logger.warning("tokenize-%05d failed: %s: %s", slice_.index, type(error).__name__, first_line(error))
            else:
                rows, finished = rows + slice_rows, finished + 1
                logger.info("tokenize-%05d: %d rows (%d of %d slices done)", slice_.index, slice_rows, finished, total)
            update_progress_artifact(progress, 100 * (finished + len(failures)) / total,
                                     description=f"{plan.name}: {finished} of {total} slices, {rows:,} rows"
                                     + (f", {len(failures)} failed" if failures else ""))
            _notify(finished, total, rows)
    seconds = time.monotonic() - started
    if failures:
        raise_failures(failures, plan, options.retries)
    tokenized = [finished_shard(plan.job, s) for s in plan.slices if s.index not in staged]
    return {"runner": options.runner, "workers": workers, "tokenize_seconds": round(seconds, 3),
            "tokens_tokenized": sum(meta["tokens"] for meta in tokenized if meta)}


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def reason(error: BaseException) -> str:
    """A failed slice's error in one line: bad input's own message names its file and row, others their type."""
    return first_line(error) if isinstance(error, BadInput) else f"{type(error).__name__}: {first_line(error)}"


LISTED = 20  # failed slices a run's message names; its failure artifact lists every one


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def rerun_hint(failures: dict[int, BaseException], total: int, store: Path | str, retry_in_ui: bool) -> str:
    """What stays and what a rerun or a Retry redoes: every slice but the failed ones is in the shard store."""
    finished, failed = total - len(failures), len(failures)
    kept = (f"the {_count(finished, 'finished shard stays', 'finished shards stay')} in the shard store {store}"
            if finished else "no slice finished")
    fix = "fix those rows (or skip them: --on-bad-row skip), then " if any(
        isinstance(e, BadInput) for e in failures.values()) else ""
    again = "Retry the flow run in the Prefect UI (or run it again)" if retry_in_ui else "run the same command again"
    return f"{kept}: {fix}{again} to tokenize only {'this slice' if failed == 1 else f'these {failed} slices'}"


def _retried(error: BaseException) -> bool:
    """Whether Prefect retried the slice's task before it failed with `error`: not if the task decided so
    (NOT_RETRIED: bad input, a full disk, an interrupt), nor if its worker died under it (the executor's error,
    not the task's)."""
    return not isinstance(error, (*NOT_RETRIED, BrokenExecutor, CancelledError))


def _failed(failures: dict[int, BaseException], total: int, retries: int) -> tuple[str, set[int], str]:
    """The message's head ("3 of 42 slices failed on bad input"), the slices Prefect retried, and the words
    that say so where only some were: "after N retries" appears only where Prefect did retry."""
    retried = {i for i, e in failures.items() if retries and _retried(e)}
    after = f" after {_count(retries, 'retry', 'retries')}"
    head = f"{len(failures)} of {total} slices failed"
    if all(isinstance(e, BadInput) for e in failures.values()):
        return head + " on bad input", retried, ""
    if retried == set(failures):
        return head + after, retried, ""
    return head, retried, after


def failure_message(failures: dict[int, BaseException], total: int, store: Path | str, retries: int,
                    retry_in_ui: bool = False, listed: int = LISTED) -> str:
    """One line for a run whose slices failed: each failed slice with its reason (the first `listed` slices;
    those failed the same way named together), then what stays and what a rerun redoes."""
    head, retried, after = _failed(failures, total, retries)
    alike: dict[str, list[int]] = {}
    for i, error in sorted(failures.items()):
        alike.setdefault(f"{after if i in retried else ''}: {reason(error)}", []).append(i)
    named, shown = [], 0
    for said, indices in alike.items():
        if shown < listed:
            names = indices[:listed - shown]
            shown += len(names)
            named.append(", ".join(f"tokenize-{i:05d}" for i in names) + said)
    if shown < len(failures):
        named.append(f"and {len(failures) - shown} more slices (the run's failure artifact lists every one)")
    return f"{head}: {'; '.join(named)}; {rerun_hint(failures, total, store, retry_in_ui)}"


def _is_deployment_run() -> bool:
    """Whether this flow run, or the run it is a subflow of, has a deployment: only those can be retried."""
    from prefect.runtime import deployment, flow_run

    try:
        return bool(deployment.id or flow_run.parent_deployment_id)
    except Exception:  # noqa: BLE001 - the API unreachable: the hint names the rerun, which works anyway
        return False


def raise_failures(failures: dict[int, BaseException], plan: Plan, retries: int) -> None:
    """Report the failed slices (the failure artifact) and fail the run naming them all: as BadInput (exit 2)
    if any failed on bad input, since rerunning alone would fail the same way, else as SlicesFailed."""
    total, retry_in_ui = len(plan.slices), _is_deployment_run()
    message = failure_message(failures, total, plan.store, retries, retry_in_ui)
    by_index = {s.index: s for s in plan.slices}
    rows = [(f"tokenize-{i:05d}", describe_slice(by_index[i]), reason(e)) for i, e in sorted(failures.items())]
    hint = rerun_hint(failures, total, plan.store, retry_in_ui)
    head = _failed(failures, total, retries)[0]
    try:
        create_markdown_artifact(
            markdown_table(f"Failed: {plan.name}, {head}", rows, header=("slice", "reads", "reason"), code=True)
            + f"\n{hint[0].upper()}{hint[1:]}.\n",
            key=artifact_key("sft-cache-failed", plan.name), description=head)
    except Exception as error:  # noqa: BLE001 - the run's own error, below, says it all and must not be lost
        get_run_logger().warning("could not create the failure artifact: %s", reason(error))
    if any(isinstance(e, BadInput) for e in failures.values()):
        raise BadInput(message)
    raise SlicesFailed(message)


@flow(name="tokenize-dataset", description="Tokenize an SFT dataset into a memory-mapped Arrow cache.")
def tokenize_dataset(options: TokenizeRun) -> str:
    """Plan, tokenize every slice into its own shard, publish the shards as the cache; return its path."""
    mark("flow")
    logger = get_run_logger()
    started = time.monotonic()
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
        logger.info("cache hit, nothing to tokenize: %s", plan.cache_path)
    elif built.outcome == "published meanwhile":
        logger.info("another run published the cache while this one waited: %s", plan.cache_path)
    else:
        mark("published")
        logger.info("published %s (%d slices reused, %d tokenized)", plan.cache_path, built.reused,
                    len(plan.slices) - built.reused)
        if options.keep_versions:
            done = collect_garbage(options.cache_root, options.keep_versions, names={plan.name})
            logger.info("removed %d older versions of %s and %d unused shards (%s bytes)",
                        len(done.removed), plan.name, done.shards_removed, f"{done.bytes_freed:,}")
    report(plan.cache_path)
    if options.pack is not None:
        report_packing(pack_cache(plan.cache_path, options.pack))
    return str(plan.cache_path)
