"""Deployments against a real `prefect server start` on a free loopback port, as operators use them: registered
with `prefect deploy --all`, served by deployments/serve.py, triggered with `prefect deployment run`, retried
the way the UI's Retry button and `prefect flow-run retry` do it, scheduled, and capped by a tag limit.

The flow runs go to a server on PostgreSQL (what Prefect recommends once several runs or workers write at once);
`prefect deploy` is also tried on one on SQLite (Prefect's default). The project's code reaches the database only
through Prefect's API, and every run on the embedded server keeps its state in SQLite, so running each flow here
on both databases would test Prefect's database layer twice and this project's code no more. One server and one
serve process; every client (CLI, serve, the flow runs it starts) runs with its own PREFECT_HOME and
PREFECT_API_URL pointing at that server.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import DeploymentScheduleCreate, WorkPoolCreate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.client.schemas.schedules import IntervalSchedule
from prefect.deployments import run_deployment
from prefect.deployments.steps.core import run_steps
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import AwaitingRetry
from prefect.utilities.asyncutils import run_coro_as_sync
from prefect.workers.process import ProcessWorker
from support.caches import data_files, staged_slices
from support.cli import client_env
from support.faults import FAULT_FILE_ENV
from support.paths import BIN, EXAMPLE_DATA, EXAMPLE_TOKENIZER, ROOT
from support.servers import prefect_server, stop

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.recipe import Recipe
from sft_tokenize.flows.tokenize_dataset import TokenizeRun
from sft_tokenize.tasks.tokenize_slice import TAG

FLOW = "tokenize-dataset"
ENTRYPOINT = "flows/tokenize_dataset.py:tokenize_dataset"
TIMEOUT = 180  # seconds for one flow run on a busy 2-core machine; a healthy one takes about ten


@pytest.fixture(scope="module", params=["postgresql"])
def server(request, tmp_path_factory) -> Iterator[str]:
    """A Prefect server on a free loopback port; yields its API URL. PostgreSQL: the module's own server, on a
    database of its own in the session's cluster. SQLite: the run's shared server (`api_url`), a `prefect server
    start` on SQLite too; its one test here only registers deployments, which it deletes again."""
    if request.param == "sqlite":
        yield request.getfixturevalue("api_url")
        return
    # The scheduler looks for schedules to fill every second, not every minute.
    env = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
           "PREFECT_API_DATABASE_CONNECTION_URL": request.getfixturevalue("postgres_cluster").database(
               f"prefect_{uuid.uuid4().hex}")}
    with prefect_server(tmp_path_factory.mktemp("server-home"), **env) as url:
        yield url


def api(server: str) -> SyncPrefectClient:
    """A client of the test server, whatever API this process is configured with (maybe the suite's harness)."""
    return SyncPrefectClient(server)


def options(cache_dir: Path, **overrides) -> dict:
    """The bundled example (two files, four slices) as the flow's `options` parameter, as JSON."""
    return TokenizeRun(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(cache_dir),
                       shard_size="100KB", workers=2, **overrides).model_dump(mode="json", exclude_unset=True)


def wait_final(client: SyncPrefectClient, flow_run_id, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        flow_run = client.read_flow_run(flow_run_id)
        if flow_run.state and flow_run.state.is_final() or time.monotonic() > deadline:
            return flow_run
        time.sleep(0.5)


def tokenize_runs(client: SyncPrefectClient, flow_run, attempt: int | None = None) -> dict:
    """The tokenize task runs of a flow run by name; of one attempt when the flow run was retried."""
    task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    return {run.name: run for run in task_runs
            if run.name.startswith("tokenize-") and attempt in (None, run.flow_run_run_count)}


def published(cache_root: Path) -> Path:
    [cache_path] = [p for p in cache_root.iterdir() if (p / "manifest.json").is_file()]
    return cache_path


def assert_only_the_failed_shard_was_redone(cache_root: Path, before: dict, failed: int) -> None:
    """The shards that had finished before the retry are the published data files (same inode and mtime):
    published as they were, not rewritten."""
    assert sorted(before) == [i for i in range(4) if i != failed]
    cache_path = published(cache_root)
    for index, (inode, mtime) in before.items():
        data_file = cache_path / f"data-{index:05d}-of-00004.arrow"
        assert (data_file.stat().st_ino, data_file.stat().st_mtime_ns) == (inode, mtime)


@pytest.fixture(scope="module")
def served(server, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """deployments/serve.py, started outside the repository (it runs from the checkout wherever it starts),
    polling every second. Its flow runs inherit the fault-injection file, which tests fill and delete."""
    tmp = tmp_path_factory.mktemp("serve")
    fault_file, log = tmp / "faults", tmp / "serve.log"
    env = client_env(server, tmp / "home", PREFECT_RUNNER_POLL_FREQUENCY="1", **{FAULT_FILE_ENV: str(fault_file)})
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, str(ROOT / "deployments" / "serve.py")], cwd=tmp, env=env,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with api(server) as client:
            deployments = wait_until_polled(client, process, log)
        yield SimpleNamespace(process=process, fault_file=fault_file, log=log, deployments=deployments)
    finally:
        stop(process)


def wait_until_polled(client: SyncPrefectClient, process: subprocess.Popen, log: Path) -> dict:
    """serve.py's deployments by name, once it has polled the server for their runs (they show as Ready)."""
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        with suppress(ObjectNotFound):
            deployments = {name: client.read_deployment_by_name(f"{FLOW}/{name}") for name in ("nightly", "on-demand")}
            if all(deployment.last_polled for deployment in deployments.values()):
                return deployments
        time.sleep(0.3)
    pytest.fail(f"serve.py did not start polling:\n{log.read_text()[-3000:]}")


def fail_then_retry_ad_hoc(server: str, tmp: Path) -> SimpleNamespace:
    """An ad-hoc `sft-tokenize run` on the server in which slice 2 fails, then `prefect flow-run retry` of
    that run with the fault gone, and with slice 3's persisted result deleted, as if results were lost."""
    cache_root, fault_file = tmp / "cache", tmp / "faults"
    fault_file.write_text("2")
    env = client_env(server, tmp / "home", **{FAULT_FILE_ENV: str(fault_file)})
    failed = subprocess.run([str(BIN / "sft-tokenize"), "run", str(EXAMPLE_DATA), "--tokenizer", str(EXAMPLE_TOKENIZER),
                             "--cache-dir", str(cache_root), "--shard-size", "100KB", "--workers", "2",
                             "--retries", "0"], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert failed.returncode == 1, failed.stderr
    with api(server) as client:
        [flow_run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(is_null_=True),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.FAILED]))))
    staged = staged_slices(TokenizeRun(**options(cache_root)))

    fault_file.unlink()
    plan = plan_slices(TokenizeRun(**options(cache_root)))
    lost = cache_root / ".prefect-results" / plan.slices[3].key
    lost.unlink()
    retried = subprocess.run([str(BIN / "prefect"), "flow-run", "retry", str(flow_run.id), "--entrypoint", ENTRYPOINT],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    return SimpleNamespace(cache_root=cache_root, failed=failed, flow_run_id=flow_run.id, staged=staged,
                           lost_result=lost, retried=retried)


@pytest.fixture(scope="module")
def ad_hoc(server, tmp_path_factory) -> Iterator[Future]:
    """fail_then_retry_ad_hoc, in a thread beside the served runs (it waits on subprocesses): its future."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(fail_then_retry_ad_hoc, server, tmp_path_factory.mktemp("ad-hoc"))


@pytest.fixture(scope="module")
def deployment_run(ad_hoc, served, server, tmp_path_factory) -> SimpleNamespace:
    """`prefect deployment run` of the served on-demand deployment, watched until it finishes (the ad-hoc
    runs go on meanwhile)."""
    tmp = tmp_path_factory.mktemp("deployment-run")
    result = subprocess.run([str(BIN / "prefect"), "deployment", "run", f"{FLOW}/on-demand",
                             "--params", json.dumps({"options": options(tmp / "cache")}),
                             "--watch", "--watch-timeout", str(TIMEOUT)],
                            env=client_env(server, tmp / "home"), capture_output=True, text=True, timeout=TIMEOUT + 30)
    created = re.search(r"UUID: ([0-9a-f-]{36})", result.stdout)
    return SimpleNamespace(cache_root=tmp / "cache", result=result, flow_run_id=created and created.group(1))


def git(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


# PostgreSQL first, as the fixture has it: then this test shares the module's server, and runs before serve.py's
@pytest.mark.parametrize("server", ["postgresql", "sqlite"], indirect=True)
def test_prefect_deploy_registers_both_deployments_on_a_process_pool(server, tmp_path, monkeypatch):
    with api(server) as client:
        client.create_work_pool(WorkPoolCreate(name="sft-tokenize", type="process",
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
    head = git("rev-parse", "HEAD").stdout.strip()
    origin = git("remote", "get-url", "origin")
    repository = origin.stdout.strip() if origin.returncode == 0 else str(ROOT)
    if os.path.isdir(repository):
        repository = os.path.realpath(repository)
    if git("ls-remote", repository, "HEAD").returncode != 0:
        repository = str(ROOT)
    result = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all",
                             "--prefect-file", "deployments/prefect.yaml"], cwd=ROOT,
                            env=client_env(server, tmp_path / "home"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

    with api(server) as client:
        nightly = client.read_deployment_by_name(f"{FLOW}/nightly")
        on_demand = client.read_deployment_by_name(f"{FLOW}/on-demand")
        try:
            for deployment in (nightly, on_demand):
                assert deployment.work_pool_name == "sft-tokenize" and deployment.entrypoint == ENTRYPOINT
                TokenizeRun(**deployment.parameters["options"])  # parameters the flow accepts
            [schedule] = nightly.schedules
            assert schedule.active and schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone
            assert on_demand.schedules == [] and on_demand.parameters["options"]["sources"] == ["examples/data"]

            # The pull steps clone the deployed commit of this checkout's origin (or of the checkout itself,
            # which has none here); the clone holds the entrypoint the worker loads.
            assert nightly.pull_steps == on_demand.pull_steps == [{"prefect.deployments.steps.git_clone": {
                "repository": repository, "commit_sha": head}}]
            monkeypatch.chdir(tmp_path)
            with temporary_settings(updates={PREFECT_API_URL: server}):
                clone = tmp_path / run_coro_as_sync(run_steps(nightly.pull_steps))["directory"]
            assert (clone / ENTRYPOINT.partition(":")[0]).is_file()
            assert git("rev-parse", "HEAD", cwd=clone).stdout.strip() == head
            recipe = client.read_deployment_by_name("tokenize-recipe/recipe")
            assert recipe.entrypoint == "flows/tokenize_recipe.py:tokenize_recipe"
            assert recipe.work_pool_name == "sft-tokenize"
            Recipe(**recipe.parameters["recipe"])  # a recipe the flow accepts
            client.delete_deployment(recipe.id)
        finally:
            # The served deployments of the next tests take the same names: serve.py registers its own.
            for deployment in (nightly, on_demand):
                client.delete_deployment(deployment.id)


def test_deployment_run_publishes_the_same_cache_as_an_ad_hoc_run(deployment_run, ad_hoc):
    ad_hoc = ad_hoc.result()
    assert deployment_run.result.returncode == 0, deployment_run.result.stdout + deployment_run.result.stderr
    assert "Flow run finished successfully in 'Completed'" in deployment_run.result.stdout
    assert data_files(published(deployment_run.cache_root)) == data_files(published(ad_hoc.cache_root))


def retry_from_the_ui(client: SyncPrefectClient, flow_run):
    """The UI's Retry button (retryFlowRun in its bundle): POST /flow_runs/{id}/set_state with a Scheduled state
    named AwaitingRetry, not forced; the server accepts it because the run has a deployment. Returns the run
    once it has finished again, completed, on its second attempt."""
    retry = client.set_flow_run_state(flow_run.id, AwaitingRetry(message="Retry from the UI"), force=False)
    assert retry.status == SetStateStatus.ACCEPT, retry.details
    flow_run = wait_final(client, flow_run.id)
    assert flow_run.state.is_completed(), flow_run.state
    assert flow_run.run_count == 2
    return flow_run


def test_ui_retry_of_a_failed_deployment_run_redoes_only_the_failed_shard(server, served, deployment_run,
                                                                         tmp_path):
    cache_root = tmp_path / "cache"
    served.fault_file.write_text("1")
    try:
        with temporary_settings(updates={PREFECT_API_URL: server}):
            flow_run = run_deployment(f"{FLOW}/on-demand", parameters={"options": options(cache_root, retries=0)},
                                      timeout=TIMEOUT, poll_interval=0.5)
    finally:
        served.fault_file.unlink()
    assert flow_run.state.is_failed(), flow_run.state
    assert "tokenize-00001" in flow_run.state.message
    assert "Retry the flow run in the Prefect UI (or run it again) to tokenize only this slice" in \
        flow_run.state.message  # a deployment run's message names the UI's Retry
    staged = staged_slices(TokenizeRun(**options(cache_root)))

    with api(server) as client:
        flow_run = retry_from_the_ui(client, flow_run)
        states = {name: run.state.name for name, run in tokenize_runs(client, flow_run, attempt=2).items()}
    assert states == {"tokenize-00000": "Cached", "tokenize-00001": "Completed", "tokenize-00002": "Cached",
                      "tokenize-00003": "Cached"}
    assert_only_the_failed_shard_was_redone(cache_root, staged, failed=1)
    assert data_files(published(cache_root)) == data_files(published(deployment_run.cache_root))


def test_flow_run_retry_of_a_failed_ad_hoc_run_redoes_only_the_failed_shard(server, ad_hoc, deployment_run):
    ad_hoc = ad_hoc.result()
    assert ad_hoc.failed.returncode == 1 and "tokenize-00002" in ad_hoc.failed.stderr
    assert ad_hoc.retried.returncode == 0, ad_hoc.retried.stdout + ad_hoc.retried.stderr
    with api(server) as client:
        flow_run = client.read_flow_run(ad_hoc.flow_run_id)
        assert flow_run.state.is_completed() and flow_run.run_count == 2
        states = {name: run.state.name for name, run in tokenize_runs(client, flow_run, attempt=2).items()}
    # Slice 3's result record was lost: its task ran again, found its shard on disk and left it alone.
    assert states == {"tokenize-00000": "Cached", "tokenize-00001": "Cached", "tokenize-00002": "Completed",
                      "tokenize-00003": "Completed"}
    assert ad_hoc.lost_result.is_file()  # and it is recorded again
    assert_only_the_failed_shard_was_redone(ad_hoc.cache_root, ad_hoc.staged, failed=2)
    assert data_files(published(ad_hoc.cache_root)) == data_files(published(deployment_run.cache_root))


def test_schedules_create_runs_that_the_served_deployment_executes(server, served, tmp_path):
    with api(server) as client:
        # The nightly cron: the scheduler has already created its next runs, at 02:00 in its timezone.
        nightly = served.deployments["nightly"]
        [schedule] = nightly.schedules
        assert schedule.schedule.cron == "0 2 * * *"
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[nightly.id])))
        assert runs and all(run.auto_scheduled and run.state.is_scheduled() for run in runs)
        local_starts = [run.expected_start_time.astimezone(ZoneInfo(schedule.schedule.timezone)) for run in runs]
        assert {(start.hour, start.minute) for start in local_starts} == {(2, 0)}

        # A schedule due in ten seconds, with its own parameters, as an operator adds one in the UI. (The
        # scheduler only creates runs still ahead of it: on a loaded machine three seconds were not enough.)
        anchor = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=10)
        on_demand = served.deployments["on-demand"]
        [added] = client.create_deployment_schedules(on_demand.id, [DeploymentScheduleCreate(
            schedule=IntervalSchedule(interval=datetime.timedelta(days=1), anchor_date=anchor),
            parameters={"options": options(tmp_path / "cache")})])
        try:
            run = wait_for_scheduled_run(client, on_demand.id, anchor)
        finally:
            client.delete_deployment_schedule(on_demand.id, added.id)
    assert run.state.is_completed(), run.state
    assert (published(tmp_path / "cache") / "manifest.json").is_file()


def wait_for_scheduled_run(client: SyncPrefectClient, deployment_id, start: datetime.datetime):
    """The run the scheduler creates for `start`, once it has finished."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id])))
        due = [run for run in runs if run.auto_scheduled and run.expected_start_time == start]
        if due and due[0].state.is_final():
            return due[0]
        time.sleep(0.5)
    pytest.fail(f"no finished run scheduled at {start}: {[(r.expected_start_time, r.state_name) for r in runs]}")


def test_a_concurrency_limit_on_the_tag_runs_one_slice_at_a_time(server, served, deployment_run, tmp_path):
    with api(server) as client:
        client.create_concurrency_limit(tag=TAG, concurrency_limit=1)
        try:
            with temporary_settings(updates={PREFECT_API_URL: server}):
                flow_run = run_deployment(f"{FLOW}/on-demand", parameters={"options": options(tmp_path / "cache")},
                                          timeout=TIMEOUT, poll_interval=0.5)
            limited = spans(tokenize_runs(client, flow_run))
        finally:
            client.delete_concurrency_limit_by_tag(TAG)
        unlimited = spans(tokenize_runs(client, client.read_flow_run(deployment_run.flow_run_id)))
    assert flow_run.state.is_completed(), flow_run.state
    # Two workers, four slices: without a limit the first two run together; with one slot, none overlap.
    assert len(limited) == len(unlimited) == 4
    assert overlapping(unlimited) and not overlapping(limited)


def spans(task_runs: dict) -> list[tuple]:
    return sorted((run.start_time, run.end_time) for run in task_runs.values())


def overlapping(intervals: list[tuple]) -> bool:
    """Whether two of these intervals, sorted by start, overlap (then two neighbours do)."""
    return any(start < end for (_, end), (start, _) in zip(intervals, intervals[1:], strict=False))


def test_a_recipe_deployment_run_retried_from_the_ui_redoes_only_the_failed_slice(server, served, tmp_path):
    cache_root = tmp_path / "cache"
    files = sorted(EXAMPLE_DATA.glob("*.jsonl"))
    recipe = {"tokenizer": str(EXAMPLE_TOKENIZER), "cache_dir": str(cache_root), "shard_size": "50KB",
              "mixture": {"unit": "trained_tokens", "budget": 50_000},
              "sources": [{"name": "a", "sources": [str(files[0])], "weight": 0.5},
                          {"name": "b", "sources": [str(files[1])], "weight": 0.5}]}
    first = TokenizeOptions(sources=[str(files[0])], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(cache_root),
                            shard_size="50KB", name="a")
    plan = plan_slices(first, min_slices=2)
    assert len(plan.slices) >= 2
    served.fault_file.write_text("1")
    try:
        with temporary_settings(updates={PREFECT_API_URL: server}):
            flow_run = run_deployment("tokenize-recipe/recipe", parameters={"recipe": recipe, "run": {
                "workers": 2, "retries": 0}}, timeout=TIMEOUT, poll_interval=0.5)
    finally:
        served.fault_file.unlink()
    assert flow_run.state.is_failed(), flow_run.state
    shards = {s.index: plan.job.shard_path(s) for s in plan.slices}
    kept = {i: (p.stat().st_ino, p.stat().st_mtime_ns) for i, p in shards.items() if p.exists()}
    assert 1 not in kept and len(kept) == len(shards) - 1

    with api(server) as client:
        retry_from_the_ui(client, flow_run)
    assert {i: (shards[i].stat().st_ino, shards[i].stat().st_mtime_ns) for i in kept} == kept
    [index] = [p for p in (cache_root / ".mixtures").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert [s["name"] for s in json.loads((index / "mixture.json").read_text())["sources"]] == ["a", "b"]


def test_stopping_serve_leaves_the_schedules_active(server, served):
    """pause_on_shutdown=False: the server keeps scheduling while serve is down (a reboot, an upgrade)."""
    stop(served.process)
    with api(server) as client:
        nightly = client.read_deployment_by_name(f"{FLOW}/nightly")
    assert not nightly.paused and all(schedule.active for schedule in nightly.schedules)
