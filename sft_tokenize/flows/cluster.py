"""Dask and Ray task runners, and the check that their workers can do the job before any slice runs.

A slice is a description (file paths or URLs and a range), so a task can run on any machine that has
what the description points at. Every worker needs: this package (`pip install 'sft-tokenize[dask]'` or
`[ray]`, the same versions as the flow's machine), the local inputs and the tokenizer directory at the
same paths (or inputs on object storage), the cache root on a filesystem it shares with the flow (the
workers write the shards, the flow publishes them), and the Prefect API (`PREFECT_API_URL`). The
tokenizer is loaded once per worker process (`sft_tokenize.build.workers.process_encoding`), never sent with a task.

A task that raises is retried by Prefect (`retries`). A worker process that dies raises nothing for
Prefect to see: Dask's nanny restarts the process and the scheduler runs the task again on a live worker,
which finds no finished shard and writes it. After `distributed.scheduler.allowed-failures` deaths (3)
the slice fails with KilledWorker, and running the command again redoes only that slice.
"""

from __future__ import annotations

import importlib
import os
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from sft_tokenize.encoding.pool import tokenizer_env
from sft_tokenize.errors import BadInput

if TYPE_CHECKING:  # workers import this module for `probe`: keep it light
    from prefect.task_runners import TaskRunner

    from sft_tokenize.build.plan import Plan

# The runners that need an optional extra, and the module that extra installs.
EXTRAS = {"dask": "prefect_dask", "ray": "prefect_ray"}
WORKER_WAIT_SECONDS = 60


def require_extra(runner: str) -> None:
    """Fail with the install command when a runner's integration is not installed."""
    module = EXTRAS.get(runner)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise BadInput(f"runner {runner!r} needs the {runner} extra, which is not installed ({error}): "
                       f"pip install 'sft-tokenize[{runner}]'") from None


def dask_runner(address: str | None, workers: int, tokenizer_threads: int) -> TaskRunner:
    require_extra("dask")
    from prefect_dask import DaskTaskRunner

    if address:  # the operator's cluster: its workers' threads and environment are the operator's choice
        return DaskTaskRunner(address=address)
    # A temporary cluster on this machine: one single-threaded worker process per slice at a time.
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                          "dashboard_address": ":0", "env": tokenizer_env(tokenizer_threads)})


def ray_runner(address: str | None, workers: int, tokenizer_threads: int) -> TaskRunner:
    require_extra("ray")
    from prefect_ray import RayTaskRunner

    if address:
        return RayTaskRunner(address=address)
    # A temporary local Ray instance ("local": not whichever cluster `ray start` last recorded on this machine);
    # each task takes one CPU, so `workers` tasks run at once.
    return RayTaskRunner(init_kwargs={"address": "local", "num_cpus": workers, "include_dashboard": False,
                                      "runtime_env": {"env_vars": tokenizer_env(tokenizer_threads)}})


def probe(plan_dir: str, token: str, must_read: list[str], api_url: str | None) -> list[str]:
    """Run on a worker: what keeps it from tokenizing this plan's slices (an empty list if nothing)."""
    host = f"{socket.gethostname()} (pid {os.getpid()})"
    store = Path(plan_dir)
    problems = []
    if missing := [path for path in must_read if not os.path.exists(path)]:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        problems.append(f"{host} cannot find {missing[0]}{more}: the tokenizer and local inputs must be at the "
                        "same paths on every worker (or the inputs on object storage)")
    if not (store / token).exists():
        problems.append(f"{host} does not see the shard store {store} that the flow sees: the cache "
                        "root must be one filesystem shared by the flow and every worker (the same mount, at "
                        "the same path)")
    else:
        probe_file = store / f".probe-{uuid.uuid4().hex}"
        try:
            probe_file.write_bytes(b"")
            probe_file.unlink()
        except OSError as error:
            problems.append(f"{host} cannot write to the shard store {store} ({error.strerror})")
    if api_url:
        import httpx

        try:
            httpx.get(f"{api_url.rstrip('/')}/health", timeout=10)
        except httpx.HTTPError as error:
            problems.append(f"{host} cannot reach the Prefect API at {api_url} ({type(error).__name__}): run "
                            "a Prefect server the workers reach and set PREFECT_API_URL to it")
    return problems


def local_paths(plan: Plan) -> list[str]:
    """What a worker reads from its own disk: the tokenizer directory and the local input files."""
    inputs = {part.url for slice_ in plan.slices for part in slice_.parts if "://" not in part.url}
    return [plan.job.tokenizer_dir, *sorted(inputs)]


def _run_on_dask(runner, args: tuple) -> dict[str, list[str]]:
    client = runner.client
    try:
        client.wait_for_workers(1, timeout=WORKER_WAIT_SECONDS)
    except TimeoutError:
        raise BadInput(f"no Dask worker joined the scheduler at {client.scheduler.address} within "
                       f"{WORKER_WAIT_SECONDS} s") from None
    # On every worker, not only the ones a task would land on; a worker that cannot even run the check
    # (this package missing there, say) is reported like the others.
    found = {}
    for worker, result in client.run(probe, *args, on_error="return").items():
        if isinstance(result, BaseException):
            result = [f"worker {worker} cannot run the check ({type(result).__name__}: {result}): is "
                      "sft-tokenize installed there?"]
        found[worker] = result
    return found


def _run_on_ray(args: tuple) -> dict[str, list[str]]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote_probe = ray.remote(num_cpus=0)(probe)
    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    refs = [remote_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
            for node in nodes]
    return dict(zip(nodes, ray.get(refs), strict=True))


def check_workers(runner_name: str, runner, plan: Plan) -> str:
    """Before any slice is submitted: every worker sees the flow's shard store and can write there,
    reads the tokenizer and the local inputs, and reaches the Prefect API. Says what it checked (every
    Dask worker, or one process on every Ray node); raises BadInput naming each problem."""
    from prefect.settings import get_current_settings

    plan.store.mkdir(parents=True, exist_ok=True)
    token = f".probe-{uuid.uuid4().hex}"
    (plan.store / token).write_bytes(b"")  # a worker that does not see it has another disk at this path
    api_url = get_current_settings().api.url
    args = (str(plan.store), token, local_paths(plan), api_url)
    try:
        found = _run_on_dask(runner, args) if runner_name == "dask" else _run_on_ray(args)
    finally:
        (plan.store / token).unlink(missing_ok=True)
    problems = sorted({problem for worker_problems in found.values() for problem in worker_problems})
    if problems:
        raise BadInput(f"the {runner_name} workers cannot tokenize into {plan.store}: " + "; ".join(problems))
    what = "Dask worker" if runner_name == "dask" else "Ray node"
    return f"{len(found)} {what}{'s' if len(found) != 1 else ''}"
