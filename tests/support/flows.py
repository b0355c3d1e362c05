"""Flow runs in this process, on the test harness (the `prefect_harness` fixture: the run's shared server): a run's
final state and its task runs, read back from the API, its log and artifacts; and the check every runner's image
run passes."""

from __future__ import annotations

import time
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)

from sft_tokenize.flows.tokenize_dataset import TokenizeRun, tokenize_dataset


def run_flow(options: TokenizeRun | dict, settled: int | None = None):
    """Run tokenize_dataset to its end: (its final state, its task runs by name). Task run states reach the API as
    events, a moment after the flow returns, so this waits (up to 10 s) until every tokenize task run it reads is
    in a final state; with `settled`, also until there are that many."""
    state = tokenize_dataset(options, return_state=True)
    flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        for _ in range(50):
            runs = {run.name: run for run in client.read_task_runs(flow_run_filter=flow_runs)}
            tokenize = [run for name, run in runs.items() if name.startswith("tokenize-")]
            counted = settled is None or len(tokenize) == settled
            if counted and all(run.state and run.state.is_final() for run in tokenize):
                break
            time.sleep(0.2)
    return state, runs


def artifacts_of(state) -> dict:
    """A flow run's artifacts' data by type (markdown, progress, …)."""
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    return {artifact.type: artifact.data for artifact in artifacts}


def flow_log(state) -> str:
    """A flow run's log messages, one a line."""
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    return "\n".join(log.message for log in logs)


def assert_image_run_writes(want: dict[str, bytes], options: dict, cache_dir: Path, runner: str, **extra) -> None:
    """The flow on `runner` tokenizes the image chats (the `image_chats` fixture) into one slice per shard, the
    local run's bytes."""
    run = TokenizeRun(**options, cache_dir=str(cache_dir), workers=2, runner=runner, **extra)
    state, task_runs = run_flow(run.model_dump(mode="json"))
    assert state.is_completed(), (runner, state.message)
    assert len([name for name in task_runs if name.startswith("tokenize-")]) == len(want)
    got = {p.name: p.read_bytes() for p in sorted(Path(state.result()).glob("data-*.arrow"))}
    assert got == want, runner
