"""Dask and Ray task runners, and the check that their workers can do the job before any slice runs.

A slice is a description (file paths or URLs and a range), so a task can run on any machine that has
what the description points at. Every worker needs: this package (`pip install 'sft-tokenize[dask]'` or
`[ray]`, the same versions as the flow's machine), the local inputs and the tokenizer directory at the
same paths (or inputs on object storage), the cache root on a filesystem it shares with the flow (the
workers write the shards, the flow publishes them) or in a bucket it can write to (a remote root: then no
disk is shared, see remote_root.py), and the Prefect API (`PREFECT_API_URL`). The
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
    problems += _api_problems(host, api_url)
    return problems


def probe_bucket(url: str, storage_options: dict, tokenizer: tuple, must_read: list[str],
                 api_url: str | None) -> list[str]:
    """Run on a worker, for a remote cache root: what keeps it from tokenizing this plan's slices (an empty list
    if nothing). It must write, read back and delete an object under the root, and load the tokenizer; it shares
    no disk with the flow."""
    from sft_tokenize.build.remote_root import probe_root
    from sft_tokenize.build.workers import process_encoding
    from sft_tokenize.encoding.prepared import prepared_here
    from sft_tokenize.encoding.tokenizer import fetch_tokenizer
    from sft_tokenize.errors import one_line
    from sft_tokenize.files import is_remote

    host = f"{socket.gethostname()} (pid {os.getpid()})"
    problems = []
    try:
        probe_root(url, storage_options)
    except BadInput as error:
        problems.append(f"{host}: {error}")
    if missing := [path for path in must_read if not os.path.exists(path)]:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        problems.append(f"{host} cannot find {missing[0]}{more}: the tokenizer and local inputs must be at the "
                        "same paths on every worker (or the inputs on object storage)")
    else:
        tokenizer_dir, chat_template, trust_remote_code, encoder, prepared = tokenizer
        try:  # kept by the process for its slices (process_encoding is cached); a URL is copied here first
            if is_remote(tokenizer_dir):
                tokenizer_dir = str(fetch_tokenizer(tokenizer_dir, storage_options))
            process_encoding(tokenizer_dir, chat_template, trust_remote_code, encoder,
                             str(prepared_here(prepared)) if prepared else "")
        except Exception as error:  # noqa: BLE001 - whatever keeps it from loading, said per worker
            problems.append(f"{host} cannot load the tokenizer {tokenizer_dir} ({type(error).__name__}: "
                            f"{one_line(error)})")
    problems += _api_problems(host, api_url)
    return problems


def _api_problems(host: str, api_url: str | None) -> list[str]:
    if not api_url:
        return []
    import httpx

    try:
        httpx.get(f"{api_url.rstrip('/')}/health", timeout=10)
    except httpx.HTTPError as error:
        return [f"{host} cannot reach the Prefect API at {api_url} ({type(error).__name__}): run a Prefect server "
                "the workers reach and set PREFECT_API_URL to it"]
    return []


def local_paths(plan: Plan) -> list[str]:
    """What a worker reads from its own disk: the tokenizer directory (unless it copies it from object storage)
    and the local input files."""
    inputs = {part.url for slice_ in plan.slices for part in slice_.parts if "://" not in part.url}
    return [*([] if plan.job.tokenizer_url else [plan.job.tokenizer_dir]), *sorted(inputs)]


def _run_on_dask(runner, args: tuple, check=probe) -> dict[str, list[str]]:
    client = runner.client
    try:
        client.wait_for_workers(1, timeout=WORKER_WAIT_SECONDS)
    except TimeoutError:
        raise BadInput(f"no Dask worker joined the scheduler at {client.scheduler.address} within "
                       f"{WORKER_WAIT_SECONDS} s") from None
    # On every worker, not only the ones a task would land on; a worker that cannot even run the check
    # (this package missing there, say) is reported like the others.
    found = {}
    for worker, result in client.run(check, *args, on_error="return").items():
        if isinstance(result, BaseException):
            result = [f"worker {worker} cannot run the check ({type(result).__name__}: {result}): is "
                      "sft-tokenize installed there?"]
        found[worker] = result
    return found


def _run_on_ray(args: tuple, check=probe) -> dict[str, list[str]]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote_probe = ray.remote(num_cpus=0)(check)
    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive")]
    refs = [remote_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
            for node in nodes]
    return dict(zip(nodes, ray.get(refs), strict=True))


def check_workers(runner_name: str, runner, plan: Plan) -> str:
    """Before any slice is submitted: every worker sees the flow's shard store and can write there (on a remote
    root: writes, reads back and deletes an object in the bucket, and loads the tokenizer), reads the tokenizer
    and the local inputs, and reaches the Prefect API. Says what it checked (every
    Dask worker, or one process on every Ray node); raises BadInput naming each problem."""
    from prefect.settings import get_current_settings

    api_url = get_current_settings().api.url
    if plan.job.remote_root:
        job = plan.job
        args = (job.remote_root, job.storage_options,
                (job.tokenizer_url or job.tokenizer_dir, job.chat_template, job.trust_remote_code, job.encoder,
                 job.prepared),
                local_paths(plan), api_url)
        found = _run_on_dask(runner, args, probe_bucket) if runner_name == "dask" else _run_on_ray(args, probe_bucket)
        return _checked(runner_name, found, job.remote_root)
    plan.store.mkdir(parents=True, exist_ok=True)
    token = f".probe-{uuid.uuid4().hex}"
    (plan.store / token).write_bytes(b"")  # a worker that does not see it has another disk at this path
    args = (str(plan.store), token, local_paths(plan), api_url)
    try:
        found = _run_on_dask(runner, args) if runner_name == "dask" else _run_on_ray(args)
    finally:
        (plan.store / token).unlink(missing_ok=True)
    return _checked(runner_name, found, str(plan.store))


def _checked(runner_name: str, found: dict[str, list[str]], store: str) -> str:
    problems = sorted({problem for worker_problems in found.values() for problem in worker_problems})
    if problems:
        raise BadInput(f"the {runner_name} workers cannot tokenize into {store}: " + "; ".join(problems))
    what = "Dask worker" if runner_name == "dask" else "Ray node"
    return f"{len(found)} {what}{'s' if len(found) != 1 else ''}"
