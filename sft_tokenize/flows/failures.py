"""A run whose slices failed: its one line (each failed slice and why, what stays, what a rerun redoes) and
its failure artifact."""

from __future__ import annotations

from concurrent.futures import BrokenExecutor, CancelledError
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from sft_tokenize.build.plan import Plan
from sft_tokenize.errors import BadInput, first_line
from sft_tokenize.flows.artifacts import artifact_key
from sft_tokenize.flows.report import describe_slice, markdown_table
from sft_tokenize.tasks.tokenize_slice import NOT_RETRIED


class SlicesFailed(RuntimeError):
    """Slices that failed (after their retries, where retrying can help); the shards that finished stay in the
    shard store for the next run."""


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
    store = plan.job.store  # a remote root's store is a URL, which a Path would cut to `s3:/bucket/...`
    message = failure_message(failures, total, store, retries, retry_in_ui)
    by_index = {s.index: s for s in plan.slices}
    rows = [(f"tokenize-{i:05d}", describe_slice(by_index[i]), reason(e)) for i, e in sorted(failures.items())]
    hint = rerun_hint(failures, total, store, retry_in_ui)
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
