"""The flow on a real Ray cluster, as the Dask tests run theirs: a head and two workers started as separate `ray
start` processes, each in its own working and temporary directory and user cache, one cluster for the module (a
Ray head takes about 15 s to start on two cores). A run into a local cache root writes a local run's bytes,
text rows and image rows. With only a bucket (moto's S3 server) in common with the flow's process, a run with
`--cache-dir s3://…` publishes the local run's rows, and a grown input reuses the stored shards: only the new
slices' shards are uploaded."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pytest
from support.caches import EXAMPLE_SLICE_TASKS, EXAMPLE_SLICES, data_files
from support.cli import free_port
from support.clusters import RAY_AUTH, cluster_env, started, wait_for_port
from support.flows import assert_image_run_writes, flow_log, run_flow
from support.paths import BIN, EXAMPLE_DATA
from support.s3 import bucket_in_environment

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.remote_root import working_dir
from sft_tokenize.flows.tokenize_dataset import TokenizeRun

pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
pytest.importorskip("s3fs", reason="s3fs is in the dev extra")
# Found, not imported: Ray reads its auth mode once a process, which the cluster's fixture sets before the first
# import (support/clusters.py, RAY_AUTH).
if importlib.util.find_spec("prefect_ray") is None:
    pytest.skip("the ray extra is not installed: pip install 'sft-tokenize[ray]'", allow_module_level=True)

BUCKET = f"ray-{uuid.uuid4().hex[:8]}"  # moto's buckets outlive its server: one of this module's own


@pytest.fixture(scope="module")
def s3_root() -> Iterator:
    """The module's S3 server with a bucket of its own; this process (the flow's) reaches it through AWS_*."""
    with bucket_in_environment(BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory, s3_root) -> Iterator[SimpleNamespace]:
    """A Ray head (no CPU of its own: it runs no slice) and two one-CPU workers, `ray start` processes each in its
    own directory with its own TMPDIR, SFT_TOKENIZE_HOME and Ray temp dir; the bucket's credentials in their
    environment. Yields the address and the workers' directories.

    This process stays connected to the cluster as its driver until the module ends: the flows' RayTaskRunner
    finds Ray initialized and runs in that one job. Ray starts its worker processes per job, each importing the
    task's code (3-6 s of CPU), so they start once for the module, not again for each of its four flow runs."""
    base = tmp_path_factory.mktemp("ray")
    auth = RAY_AUTH  # the driver (this process) and the cluster share it (support/clusters.py)
    port, client = free_port(), free_port()
    temps = [tempfile.mkdtemp(prefix="ray-") for _ in range(3)]  # Ray's socket paths must stay short
    places = [base / name for name in ("head", "worker-0", "worker-1")]
    common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    head = [str(BIN / "ray"), "start", "--head", "--port", str(port), "--num-cpus", "0", "--include-dashboard",
            "false", "--ray-client-server-port", str(client), "--temp-dir", temps[0], *common]
    workers = [[str(BIN / "ray"), "start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1", "--temp-dir", temp,
                *common] for temp in temps[1:]]
    env = cluster_env(base / "prefect-home", **auth, **s3_root.environment)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in auth.items():
            patch.setenv(name, value)
        try:
            with started(head, *workers, env=env, logs=base / "logs", grace=3, places=places):
                wait_for_port(port, "the Ray head")
                with driver(f"127.0.0.1:{port}"):
                    wait_for_nodes(3)
                    yield SimpleNamespace(address=f"127.0.0.1:{port}", workers=places[1:])
        finally:
            for temp in temps:
                shutil.rmtree(temp, ignore_errors=True)


@contextmanager
def driver(address: str) -> Iterator[None]:
    import ray

    ray.init(address=address, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()


def wait_for_nodes(count: int, timeout: float = 120) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while sum(node["Alive"] for node in ray.nodes()) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{count} Ray nodes did not join within {timeout} s: {ray.nodes()}")
        time.sleep(0.5)


def published_rows(server, url: str) -> tuple[dict, pa.Table]:
    fs = server.filesystem()
    root, version = url.removeprefix("s3://").rsplit("/", 1)
    manifest = json.loads(fs.cat_file(f"{root}/{version}/manifest.json"))
    tables = [pa.ipc.open_stream(fs.cat_file(f"{root}/.shards/{entry['key']}.arrow")).read_all()
              for entry in manifest["files"]]
    return manifest, pa.concat_tables(tables)


def assert_same_rows(server, url: str, local_cache: Path) -> dict:
    manifest, table = published_rows(server, url)
    rows = datasets.load_from_disk(str(local_cache))
    assert table.column("input_ids").to_pylist() == rows["input_ids"]
    assert table.column("loss_mask").to_pylist() == rows["loss_mask"]
    assert manifest["fingerprint"] == json.loads((local_cache / "manifest.json").read_text())["fingerprint"]
    return manifest


@pytest.mark.cluster  # three `ray start` processes
@pytest.mark.usefixtures("prefect_harness")
def test_a_ray_cluster_writes_a_local_runs_bytes_for_text_and_image_rows(ray_cluster, example_cache, image_chats,
                                                                          tmp_path):
    local = data_files(example_cache)  # the local run of EXAMPLE_SLICES
    ray_run = {"runner": "ray", "ray_address": ray_cluster.address, "workers": 2}
    state, task_runs = run_flow(TokenizeRun(**EXAMPLE_SLICES, cache_dir=str(tmp_path / "cache"), **ray_run))
    assert state.is_completed(), state.message
    assert sorted(name for name in task_runs if name.startswith("tokenize-")) == EXAMPLE_SLICE_TASKS
    assert data_files(state.result()) == local and len(local) == 4
    assert "checked 3 Ray nodes: they read the inputs and write to" in flow_log(state)  # the head and two workers
    # Image rows: the processor rebuilt in the workers, the images read there.
    options, want = image_chats
    assert_image_run_writes(want, options, tmp_path / "images", "ray", ray_address=ray_cluster.address)


@pytest.mark.cluster  # three `ray start` processes
@pytest.mark.usefixtures("prefect_harness")
def test_a_ray_cluster_sharing_only_the_bucket_publishes_the_local_runs_rows_and_reuses_them_when_grown(
        ray_cluster, s3_root, tmp_path, monkeypatch):
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    fs = s3_root.filesystem()
    fs.put(f"{EXAMPLE_SLICES['tokenizer']}/", f"{BUCKET}/tokenizer/", recursive=True)
    url = f"s3://{BUCKET}/ray"
    data = tmp_path / "data"
    shutil.copytree(EXAMPLE_DATA, data)
    options = {**EXAMPLE_SLICES, "sources": [str(data)], "tokenizer": f"s3://{BUCKET}/tokenizer"}
    local = {**options, "tokenizer": EXAMPLE_SLICES["tokenizer"]}
    ray_run = {"runner": "ray", "ray_address": ray_cluster.address, "workers": 2}

    state, _ = run_flow(TokenizeRun(**options, cache_dir=url, **ray_run))
    assert state.is_completed(), state.message
    assert_same_rows(s3_root, state.result(), run_locally(TokenizeOptions(**local, cache_dir=str(tmp_path / "a"))))
    assert sorted(working_dir(url).rglob("*.arrow")) == []  # the flow's machine wrote no shard
    for place in ray_cluster.workers:  # each kept no shard; what it wrote, it wrote in its own home
        assert list((place / "home").rglob("*.arrow")) == [] and not (place / "s3:").exists()
    assert any((place / "home" / "builds").is_dir() for place in ray_cluster.workers)

    # Grown: a new file. Only its slices' shards are uploaded; the stored ones are reused.
    (data / "chat-00002.jsonl").write_text((EXAMPLE_DATA / "chat-00001.jsonl").read_text().replace("the", "a"))
    before = {p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/ray/.shards/") if p.endswith(".arrow")}
    state, _ = run_flow(TokenizeRun(**options, cache_dir=url, **ray_run))
    assert state.is_completed(), state.message
    manifest = assert_same_rows(s3_root, state.result(),
                                run_locally(TokenizeOptions(**local, cache_dir=str(tmp_path / "b"))))
    after = {p.rsplit("/", 1)[-1] for p in fs.find(f"{BUCKET}/ray/.shards/") if p.endswith(".arrow")}
    keys = [f"{entry['key']}.arrow" for entry in manifest["files"]]
    new = set(keys) - before
    plan = plan_slices(TokenizeOptions(**local, cache_dir=str(tmp_path / "plan")))
    grown = [s for s in plan.slices if any(p.url.endswith("chat-00002.jsonl") for p in s.parts)]
    assert grown and len(new) <= len(grown) < len(keys)  # only slices reading the new file are new
    assert after == before | new
