"""The flow on real Dask clusters: a scheduler and two worker processes started with the `dask` CLI on
127.0.0.1, and a temporary cluster. Each writes the same bytes as the threads runner; a worker that dies
mid-shard is replaced and its slice rescheduled; workers that cannot reach the cache root fail the run before any
slice is tokenized. Every process a test starts is stopped by process group, and the test checks that none is
left. Ray's cluster is tests/workflow/test_ray.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support.caches import EXAMPLE_SLICE_TASKS, EXAMPLE_SLICES, data_files
from support.cli import free_port
from support.clusters import cluster_env, started, wait_for_port
from support.faults import FAULT_FILE_ENV
from support.flows import assert_image_run_writes, flow_log, run_flow
from support.paths import BIN, EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.store import collect_garbage
from sft_tokenize.build.workers import process_encoding
from sft_tokenize.cli.arguments import build_parser, options_from
from sft_tokenize.cli.main import main
from sft_tokenize.flows.console import CONSOLE_ENV
from sft_tokenize.flows.tokenize_dataset import TokenizeRun, tokenize_dataset
from sft_tokenize.format.layout import DIGEST_BOOK

# Two input files cut into four slices, one of them spanning both files.
SOURCES = EXAMPLE_SLICES


def dask_client(address: str):
    import distributed

    return distributed.Client(address, timeout=30, set_as_default=False)


def dask_workers(address: str, count: int) -> dict[str, int]:
    """Worker address → pid, once `count` workers are connected."""
    with dask_client(address) as client:
        client.wait_for_workers(count, timeout=90)
        return client.run(os.getpid)


def run_options(cache_dir: Path, **overrides) -> dict:
    """The flow's parameters as a deployment run passes them: JSON."""
    return TokenizeRun(**{**SOURCES, "cache_dir": str(cache_dir), "workers": 2, **overrides}).model_dump(mode="json")


@pytest.fixture(scope="module")
def threads_cache(tmp_path_factory, prefect_harness) -> dict[str, bytes]:
    """The data files the threads runner writes: what every cluster must match byte for byte."""
    state, _ = run_flow(run_options(tmp_path_factory.mktemp("threads")))
    assert state.is_completed()
    files = data_files(state.result())
    assert len(files) == 4  # the four slices': what every runner's cache must equal
    return files


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A Dask scheduler and two single-threaded worker processes (each under a nanny that restarts it),
    started with the `dask` CLI; yields the scheduler address and the fault file the workers read at once,
    while they start (a test waits for them with `dask_workers`)."""
    base = tmp_path_factory.mktemp("dask")
    fault_file = base / "faults"
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = cluster_env(base / "prefect-home", **{FAULT_FILE_ENV: str(fault_file)})
    with started([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                 [str(BIN / "dask"), "worker", address, "--nworkers", "2", "--nthreads", "1", "--no-dashboard"],
                 env=env, logs=base / "logs"):
        yield address, fault_file


@pytest.mark.usefixtures("prefect_harness")
def test_dask_cluster_writes_the_same_bytes_and_loads_the_tokenizer_once_per_worker(dask_cluster, threads_cache,
                                                                                     tmp_path):
    address, _ = dask_cluster
    dask_workers(address, 2)
    with dask_client(address) as client:
        before = client.run(process_encoding.cache_info)
    state, task_runs = run_flow(run_options(tmp_path, runner="dask", dask_address=address))
    assert state.is_completed(), state.message
    assert sorted(name for name in task_runs if name.startswith("tokenize-")) == EXAMPLE_SLICE_TASKS
    assert data_files(state.result()) == threads_cache
    assert "checked 2 Dask workers: they read the inputs and write to" in flow_log(state)
    with dask_client(address) as client:
        after = client.run(process_encoding.cache_info)
    assert after.keys() == before.keys()
    # Each worker process that ran slices made its encoder once (workers.encoder_for), loading the tokenizer once.
    calls = {w: (after[w].hits + after[w].misses) - (before[w].hits + before[w].misses) for w in after}
    loads = {w: after[w].misses - before[w].misses for w in after}
    assert 1 <= sum(calls.values()) <= len(after) and max(loads.values()) <= 1, (calls, loads)


@pytest.mark.usefixtures("prefect_harness")
def test_a_dask_worker_that_dies_mid_shard_is_replaced_and_its_slice_rescheduled(dask_cluster, threads_cache,
                                                                                 tmp_path):
    address, fault_file = dask_cluster
    pids = dask_workers(address, 2)
    fault_file.write_text("exit:1")  # the worker that first takes slice 1 exits mid-shard, without a word
    try:
        state, task_runs = run_flow(run_options(tmp_path, runner="dask", dask_address=address))
    finally:
        fault_file.unlink()
    assert Path(f"{fault_file}.exited-1").exists()  # a worker did die
    assert state.is_completed(), state.message
    assert task_runs["tokenize-00001"].state.is_completed()
    assert data_files(state.result()) == threads_cache
    # The dead worker's partial shard is never read; gc removes it (no running build leases its key).
    assert len(list(tmp_path.rglob("*.tmp-*"))) == 1
    collect_garbage(tmp_path)
    assert not list(tmp_path.rglob("*.tmp-*"))
    # The nanny replaced the dead worker process: one pid changed, and the cluster is whole again.
    new_pids = dask_workers(address, 2)
    assert len(set(new_pids.values()) - set(pids.values())) == 1


@pytest.mark.usefixtures("prefect_harness")
def test_image_rows_on_dask_workers_and_worker_processes_write_the_local_runs_bytes(dask_cluster, image_chats,
                                                                                    tmp_path):
    """Image rows take the same slices and runners as text: the processor is rebuilt in each worker from the
    job, the images are read where the slice runs."""
    options, want = image_chats
    address, _ = dask_cluster
    dask_workers(address, 2)
    for runner, extra in (("dask", {"dask_address": address}), ("processes", {})):
        assert_image_run_writes(want, options, tmp_path / runner, runner, **extra)


def own_mount_namespace_works() -> str | None:
    """None if this user can give a process its own mount namespace, else why not."""
    if not shutil.which("unshare"):
        return "unshare is not installed"
    result = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    return None if result.returncode == 0 else f"unshare --mount fails here: {result.stderr.strip()}"


@pytest.mark.cluster  # a scheduler and two workers of its own
@pytest.mark.usefixtures("prefect_harness")
def test_workers_that_cannot_write_to_the_cache_root_fail_the_run_before_any_slice(tmp_path):
    """One worker has its own empty disk mounted at the cache root's path (a node without the shared
    mount, so without the tokenizer kept there either), the other sees the shared directory read-only: the
    run fails at plan time naming both."""
    if why_not := own_mount_namespace_works():
        pytest.skip(f"needs a worker in its own mount namespace (root, unshare --mount): {why_not}")
    cache = tmp_path / "cache"
    (cache / ".staging").mkdir(parents=True)
    tokenizer = shutil.copytree(EXAMPLE_TOKENIZER, cache / "tokenizer")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    worker = [str(BIN / "dask"), "worker", address, "--nthreads", "1", "--no-dashboard"]

    def in_own_mounts(mount: str) -> list[str]:
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mount} && exec "$@"', "sh", *worker]

    with started([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                 in_own_mounts(f"mount -t tmpfs tmpfs {cache}"),
                 in_own_mounts(f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache}"),
                 env=cluster_env(tmp_path / "prefect-home"), logs=tmp_path / "logs"):
        wait_for_port(port, "the Dask scheduler")
        dask_workers(address, 2)
        state, task_runs = run_flow(run_options(cache, runner="dask", dask_address=address, tokenizer=str(tokenizer)))
    assert state.is_failed()
    store = cache / ".shards"
    assert f"cannot tokenize into {store}" in state.message
    assert f"does not see the shard store {store}" in state.message
    assert f"cannot write to the shard store {store} (Read-only file system)" in state.message
    assert f"cannot find {tokenizer}: the tokenizer and local inputs must be at the same paths" in state.message
    assert not [name for name in task_runs if name.startswith("tokenize-")]
    # The probe's files are gone and no shard was started: the store holds its lock and the plan's digest book.
    assert sorted(p.name for p in store.iterdir()) == sorted([".gc.lock", DIGEST_BOOK])


@pytest.mark.cluster  # a cluster of its own, started and stopped
@pytest.mark.usefixtures("prefect_harness")
def test_a_temporary_dask_cluster_writes_the_same_bytes_and_leaves_no_process(threads_cache, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    state, _ = run_flow(run_options(tmp_path, runner="dask", workers=1))  # one worker process: the same bytes
    assert state.is_completed(), state.message
    assert data_files(state.result()) == threads_cache

    def left() -> list[psutil.Process]:
        # multiprocessing's resource tracker, started once per process, stays until this process exits.
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in before
                and p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline())]

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), [p.cmdline() for p in left()]


# The CLI's new options, rejected before Prefect starts.

@pytest.fixture
def cli_env(monkeypatch):
    """`main` sets these in its process's environment: restore them after the test."""
    for name in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "PREFECT_SERVER_ANALYTICS_ENABLED", CONSOLE_ENV):
        monkeypatch.delenv(name, raising=False)


def test_storage_options_are_parsed_into_the_run_options():
    args = build_parser().parse_args(["run", "s3://bucket/data", "--tokenizer", "t", "--cache-dir", "c",
                                      "--storage-options", '{"anon": true, "client_kwargs": {"region_name": "x"}}'])
    options = TokenizeRun(**options_from(args))
    assert options.storage_options == {"anon": True, "client_kwargs": {"region_name": "x"}}


@pytest.mark.parametrize("text, expected", [("{anon: true}", "not valid JSON"), ('["anon"]', "expected a JSON object")])
def test_storage_options_that_are_not_a_json_object_exit_2(text, expected, capsys, cli_env):
    assert main(["run", "s3://bucket/data", "--tokenizer", "t", "--cache-dir", "c", "--storage-options", text]) == 2
    assert f"argument --storage-options: {expected}" in capsys.readouterr().err


def test_an_address_without_its_runner_exits_2(tmp_path, capsys, cli_env):
    code = main(["run", str(EXAMPLE_DATA), "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(tmp_path),
                 "--dask-address", "tcp://127.0.0.1:8786"])
    assert code == 2
    assert "--dask-address: Value error, " not in (err := capsys.readouterr().err)
    assert "sft-tokenize: error: --dask-address: an address for dask needs runner dask (--runner dask)" in err


def test_a_runner_whose_extra_is_missing_exits_2_with_the_install_command(tmp_path, capsys, monkeypatch, cli_env):
    monkeypatch.setitem(sys.modules, "prefect_ray", None)  # what an install without the extra sees: no module
    code = main(["run", str(EXAMPLE_DATA), "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(tmp_path),
                 "--runner", "ray"])
    assert code == 2
    err = capsys.readouterr().err
    assert "runner 'ray' needs the ray extra" in err and "pip install 'sft-tokenize[ray]'" in err
    assert not (tmp_path / ".staging").exists()  # nothing was planned


def test_the_flow_form_offers_the_cluster_runners():
    form = tokenize_dataset.parameters.definitions["TokenizeRun"]["properties"]
    assert form["runner"]["enum"] == ["threads", "processes", "dask", "ray"]
    assert {"dask_address", "ray_address"} <= set(form)
    assert json.loads(TokenizeRun(**SOURCES, cache_dir="c").model_dump_json())["dask_address"] is None
