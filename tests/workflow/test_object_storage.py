"""A cache root on object storage (a real S3 API: moto's server, support/s3.py, one per module): the build side.

Runs to `s3://BUCKET/...` on the threads runner and on a Dask cluster whose workers share nothing with the flow
but the bucket publish the rows a local run publishes; a grown input uploads only its new slices; a corrupted
shard object is found before reuse; a run killed mid-upload leaves no visible shard and resumes; gc removes
what no kept version names; a bad URL, a missing bucket and denied credentials stop the CLI at once."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import datasets
import psutil
import pyarrow as pa
import pytest
from support.caches import EXAMPLE_SLICES
from support.cli import assert_rejected, cli, environment, free_port, run_args
from support.faults import FAULT_FILE_ENV
from support.flows import run_flow
from support.paths import BIN, EXAMPLE_DATA
from support.s3 import bucket_in_environment

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.cli.main import main
from sft_tokenize.flows.tokenize_dataset import TokenizeRun
from sft_tokenize.read.cache import open_cache

pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
pytest.importorskip("s3fs", reason="s3fs is in the dev extra")

BUCKET = f"caches-{uuid.uuid4().hex[:8]}"  # moto's buckets outlive its server: one of this module's own


@pytest.fixture(scope="module")
def s3_root() -> Iterator:
    """The module's S3 server with a bucket of its own (BUCKET); this process (the flow's) reaches it through
    AWS_* variables."""
    with bucket_in_environment(BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory) -> tuple[datasets.Dataset, str]:
    """The example's cache built under a local root, and its fingerprint: what every remote build must publish."""
    path = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(tmp_path_factory.mktemp("local"))))
    return datasets.load_from_disk(str(path)), json.loads((Path(path) / "manifest.json").read_text())["fingerprint"]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """This process's user cache (its working directories for remote roots), and a working directory where a
    root taken for a local path would show up as `s3:`."""
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def published(server, url: str) -> tuple[dict, pa.Table]:
    """A remote version's manifest and its rows, read from the shard objects its manifest names."""
    fs = server.filesystem()
    root, version = url.removeprefix("s3://").rsplit("/", 1)
    manifest = json.loads(fs.cat_file(f"{root}/{version}/manifest.json"))
    tables = []
    for entry in manifest["files"]:
        data = fs.cat_file(f"{root}/.shards/{entry['key']}.arrow")
        assert len(data) == entry["bytes"]
        tables.append(pa.ipc.open_stream(data).read_all())
    return manifest, pa.concat_tables(tables)


def assert_same_rows(server, url: str, reference: tuple[datasets.Dataset, str]) -> dict:
    manifest, table = published(server, url)
    rows, fingerprint = reference
    assert table.column("input_ids").to_pylist() == rows["input_ids"]
    assert table.column("loss_mask").to_pylist() == rows["loss_mask"]
    assert manifest["fingerprint"] == fingerprint
    return manifest


def shard_puts(server, prefix: str) -> int:
    return server.puts(f"{BUCKET}/{prefix}/.shards/")


def local_shards(url: str) -> list[Path]:
    """The shards left in this process's working directory for the remote root `url`."""
    from sft_tokenize.build.remote_root import working_dir

    return sorted(working_dir(url).rglob("*.arrow"))


def test_a_threads_run_to_a_bucket_publishes_the_local_runs_rows(prefect_harness, s3_root, local_reference, home):
    url = f"s3://{BUCKET}/threads"
    state, _ = run_flow(TokenizeRun(**EXAMPLE_SLICES, cache_dir=url, workers=2))
    assert state.is_completed(), state.message
    version = state.result()
    assert version.startswith(f"{url}/")
    assert_same_rows(s3_root, version, local_reference)
    assert local_shards(url) == [] and not Path("s3:").exists()  # uploaded, then removed; nothing local named s3:
    assert s3_root.filesystem().ls(f"{BUCKET}/threads/.prefect-results")  # the task results, in the bucket
    s3_root.clear()
    again, _ = run_flow(TokenizeRun(**EXAMPLE_SLICES, cache_dir=url, workers=2))
    assert again.result() == version and shard_puts(s3_root, "threads") == 0  # a cache hit: nothing written
    # The read side opens what the build side printed: the same rows as the local cache, mapped from a local copy
    opened = open_cache(version, local_dir=home / "copies")
    assert opened.path.is_relative_to(home / "copies") and len(opened) == len(local_reference[0])
    assert [list(opened[i]["input_ids"]) for i in range(len(opened))] == local_reference[0]["input_ids"]


def test_a_grown_input_uploads_only_its_new_slices(s3_root, local_reference, home, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(EXAMPLE_DATA, data)
    options = TokenizeOptions(sources=[str(data)], tokenizer=EXAMPLE_SLICES["tokenizer"], shard_size="40KB",
                              cache_dir=f"s3://{BUCKET}/grow")
    before = {s.key for s in plan_slices(options).slices}  # planned before it is published (then: no slices)
    first = run_locally(options)
    grown = sorted(data.glob("*.jsonl"))[-1]
    with grown.open("a") as out:  # appended lines: the file's earlier slices keep their keys
        out.writelines((EXAMPLE_DATA / "chat-00001.jsonl").read_text().splitlines(keepends=True)[:40])
    after = {s.key for s in plan_slices(options).slices}
    new = after - before
    assert 0 < len(new) < len(after)
    s3_root.clear()
    second = run_locally(options)
    assert second != first
    assert shard_puts(s3_root, "grow") == 2 * len(new)  # each new slice's shard and sidecar, nothing else


def test_a_corrupted_shard_object_is_found_before_reuse_and_tokenized_again(s3_root, local_reference, home, caplog):
    url = f"s3://{BUCKET}/corrupt"
    run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url, name="first"))
    fs = s3_root.filesystem()
    shard = sorted(fs.glob(f"{BUCKET}/corrupt/.shards/*.arrow"))[1]
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF  # the same size: only its bytes (and so its ETag) tell
    fs.pipe_file(shard, bytes(data))
    s3_root.clear()
    with caplog.at_level(logging.WARNING, logger="sft_tokenize"):
        version = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url, name="second"))
    assert f"s3://{shard}: " in caplog.text and "replaced or corrupted" in caplog.text
    assert shard_puts(s3_root, "corrupt") == 2  # that shard and its sidecar, again
    assert_same_rows(s3_root, version, local_reference)


def test_gc_removes_what_no_kept_version_names_and_keeps_the_rest(s3_root, home, tmp_path, capsys):
    url = f"s3://{BUCKET}/gc"
    fs = s3_root.filesystem()
    more = tmp_path / "more"
    shutil.copytree(EXAMPLE_DATA, more)
    (more / "extra.jsonl").write_text("".join(reversed((EXAMPLE_DATA / "chat-00001.jsonl").read_text()
                                                       .splitlines(keepends=True))))
    run_locally(TokenizeOptions(sources=[str(more)], tokenizer=EXAMPLE_SLICES["tokenizer"], cache_dir=url,
                                shard_size="100KB", name="data"))
    kept = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url, name="data"))  # newer, without extra.jsonl
    orphan = f"{BUCKET}/gc/.shards/{'0' * 32}.arrow"
    fs.pipe_file(orphan, b"left by a crashed writer")
    fs.call_s3("create_multipart_upload", Bucket=BUCKET, Key=f"gc/.shards/{'1' * 32}.arrow")
    before = set(fs.ls(f"{BUCKET}/gc/.shards", refresh=True))
    assert main(["gc", url, "--keep", "1", "--grace", "0"]) == 0
    out = capsys.readouterr().out
    versions = [p for p in fs.ls(f"{BUCKET}/gc", refresh=True) if not p.rsplit("/", 1)[-1].startswith(".")]
    assert versions == [kept.removeprefix("s3://")]
    manifest, _ = published(s3_root, kept)  # every object the kept version names is still there
    names = {f"{BUCKET}/gc/.shards/{f['key']}{suffix}" for f in manifest["files"] for suffix in (".arrow", ".json")}
    assert set(fs.ls(f"{BUCKET}/gc/.shards", refresh=True)) == names
    assert orphan in before and len(before) > len(names) + 1  # the orphan and the old version's own shards went
    assert "removed 1 versions" in out and "1 incomplete uploads aborted" in out
    assert fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix="gc/").get("Uploads", []) == []


def test_a_run_killed_mid_upload_leaves_no_visible_shard_and_the_same_command_resumes(s3_root, api_url, cli_home,
                                                                                    home, tmp_path):
    url = f"s3://{BUCKET}/killed"
    fault = tmp_path / "faults"
    fault.write_text("exit-upload:1")
    env = {**s3_root.environment, FAULT_FILE_ENV: str(fault), "SFT_TOKENIZE_HOME": str(home)}
    args = run_args([EXAMPLE_DATA], url)  # type: ignore[arg-type]  # a URL where the helper takes a path
    killed = cli(*args, home=cli_home, api_url=api_url, env=env)
    assert killed.returncode != 0, killed.stderr
    options = TokenizeOptions(**{**EXAMPLE_SLICES, "shard_size": "100KB"}, cache_dir=url)
    key = plan_slices(options, min_slices=2).slices[1].key
    fs = s3_root.filesystem()
    uploads = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix="killed/").get("Uploads", [])
    assert [u["Key"] for u in uploads] == [f"killed/.shards/{key}.arrow"]  # begun, never completed
    assert not fs.exists(f"{BUCKET}/killed/.shards/{key}.arrow")  # and so not visible
    resumed = cli(*args, home=cli_home, api_url=api_url, env=env)
    assert resumed.returncode == 0, resumed.stderr
    version = resumed.stdout.strip().splitlines()[-1]
    assert version.startswith(f"{url}/") and fs.exists(f"{BUCKET}/killed/.shards/{key}.arrow")
    assert fs.exists(f"{version.removeprefix('s3://')}/manifest.json")


def test_a_bad_url_a_missing_bucket_a_missing_tokenizer_and_denied_credentials_stop_the_run_at_once(
        s3_root, cli_home, home):
    import moto.settings

    env = {**s3_root.environment, "SFT_TOKENIZE_HOME": str(home)}
    for url, expected in (("nosuch://bucket/caches", "unknown protocol 'nosuch'"),
                          (f"s3://missing-{BUCKET}/caches", "the bucket does not exist"),
                          ("s3:///caches", "no bucket in the URL")):
        assert_rejected(cli(*run_args([EXAMPLE_DATA], url), home=cli_home, env=env),  # type: ignore[arg-type]
                        f"cache dir {url.rstrip('/')}", expected)
    s3_root.filesystem().pipe(f"{BUCKET}/data-only/rows.jsonl", b"{}\n")
    for tokenizer, expected in ((f"s3://missing-{BUCKET}/tokenizer", "not found (no such bucket or directory)"),
                                (f"s3://{BUCKET}/data-only", "no tokenizer files there")):
        args = run_args([EXAMPLE_DATA], home / "local-cache", "--tokenizer", tokenizer)  # type: ignore[arg-type]
        assert_rejected(cli(*args, home=cli_home, env=env), f"tokenizer {tokenizer}: {expected}")
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from now on the server checks keys: `test` is nobody's
    try:
        denied = cli(*run_args([EXAMPLE_DATA], f"s3://{BUCKET}/denied"), home=cli_home, env=env)  # type: ignore[arg-type]
    finally:
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")
    assert_rejected(denied, f"cache dir s3://{BUCKET}/denied: access denied")
    assert not Path("s3:").exists() and not s3_root.filesystem().exists(f"{BUCKET}/denied")


@pytest.fixture(scope="module")
def bucket_dask_cluster(tmp_path_factory, s3_root) -> Iterator[tuple[str, list[Path]]]:
    """A Dask scheduler and two workers started with the `dask` CLI, each worker in its own working directory
    with its own TMPDIR and SFT_TOKENIZE_HOME: they share nothing with the flow's process but the bucket. Yields
    the scheduler's address and the workers' directories."""
    base = tmp_path_factory.mktemp("dask-bucket")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    common = environment(base / "prefect-home", startup_timeout=None, HF_HUB_OFFLINE="1", **s3_root.environment)
    processes, places = [], []
    commands = [([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                 base / "scheduler")]
    commands += [([str(BIN / "dask"), "worker", address, "--nthreads", "1", "--no-dashboard"], base / f"worker-{i}")
                 for i in range(2)]
    try:
        for command, place in commands:
            (place / "tmp").mkdir(parents=True)
            env = {**common, "TMPDIR": str(place / "tmp"), "SFT_TOKENIZE_HOME": str(place / "home")}
            with open(place / "log", "wb") as log:
                processes.append(subprocess.Popen(command, cwd=place, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
            places.append(place)
        yield address, places[1:]
    finally:
        tree = [psutil.Process(p.pid) for p in processes if p.poll() is None]
        tree += [child for parent in list(tree) for child in parent.children(recursive=True)]
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=10)
        for process in alive:
            process.kill()
        for process in processes:
            process.wait(timeout=10)


@pytest.mark.usefixtures("prefect_harness")
def test_a_dask_cluster_sharing_only_the_bucket_publishes_the_local_runs_rows(bucket_dask_cluster, s3_root,
                                                                              local_reference, home):
    import distributed

    address, workers = bucket_dask_cluster
    with distributed.Client(address, timeout=30, set_as_default=False) as client:
        client.wait_for_workers(2, timeout=90)
    url = f"s3://{BUCKET}/dask"
    # The tokenizer is in the bucket too: each worker copies it into its own home, and the fingerprint is the
    # local run's (it hashes the tokenizer's files, not where they are)
    s3_root.filesystem().put(f"{EXAMPLE_SLICES['tokenizer']}/", f"{BUCKET}/tokenizer/", recursive=True)
    options = {**EXAMPLE_SLICES, "tokenizer": f"s3://{BUCKET}/tokenizer"}
    state, _ = run_flow(TokenizeRun(**options, cache_dir=url, workers=2, runner="dask", dask_address=address))
    assert state.is_completed(), state.message
    manifest = assert_same_rows(s3_root, state.result(), local_reference)
    assert manifest["tokenizer"] == options["tokenizer"]
    assert local_shards(url) == []  # the flow's machine wrote none
    for place in workers:  # each worker copied and prepared the tokenizer in its own home, and kept no shard
        assert list((place / "home" / "tokenizer-copies").iterdir())
        assert list((place / "home" / "tokenizers").iterdir())
        assert list((place / "home").rglob("*.arrow")) == [] and not (place / "s3:").exists()
    assert any((place / "home" / "builds").is_dir() for place in workers)  # where they wrote before uploading
