"""A cache root shared with other people's files, on a real S3 API (moto's server, support/s3.py) and on a local
disk: gc removes only what it proves this tool wrote, and a build keeps its shards however long it runs."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.caches import EXAMPLE_SLICES
from support.cli import run_args
from support.faults import FAULT_FILE_ENV
from support.paths import EXAMPLE_DATA
from support.proxy import tcp_proxy
from support.runs import Background
from support.s3 import bucket_in_environment

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.cli.main import main
from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import open_cache

pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
pytest.importorskip("s3fs", reason="s3fs is in the dev extra")

BUCKET = f"shared-{uuid.uuid4().hex[:8]}"  # moto's buckets outlive its server: one of this module's own


@pytest.fixture(scope="module")
def s3_root() -> Iterator:
    """The module's S3 server with a bucket of its own, reached through AWS_* variables."""
    with bucket_in_environment(BUCKET) as server:
        yield server


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


# Other people's folders that look like a cache version to a careless eye: a manifest.json with a `name`
FOREIGN = {
    "app-v1/manifest.json": {"name": "app", "version": 1},
    "app-v2/manifest.json": {"name": "app", "version": 2},
    "model-export/manifest.json": {"name": "model", "files": [{"name": "weights.bin", "bytes": 7}]},
    "model-export-old/manifest.json": {"name": "model", "files": []},
}
FOREIGN_FILES = {"app-v2/index.js": b"console.log(1)", "model-export/weights.bin": b"weights",
                 ".shards/README.txt": b"notes", ".shards/not-a-key.arrow": b"someone's arrow file",
                 ".shards/" + "a" * 32 + ".bin": b"a key-like name, not a shard's suffix"}


def test_gc_on_a_shared_bucket_removes_only_its_own_versions_and_shards(s3_root, home, capsys):
    url = f"s3://{BUCKET}/gc-shared"
    fs = s3_root.filesystem()
    old = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url, name="data", max_length=96))
    kept = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url, name="data"))
    # a version of ours someone put a file of their own into: not provably ours as a whole, so left alone
    visited = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url, name="visited", max_length=64))
    run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url, name="visited", max_length=128))
    fs.pipe_file(f"{visited.removeprefix('s3://')}/notes.txt", b"mine")
    for path, manifest in FOREIGN.items():
        fs.pipe_file(f"{BUCKET}/gc-shared/{path}", json.dumps(manifest).encode())
    for path, data in FOREIGN_FILES.items():
        fs.pipe_file(f"{BUCKET}/gc-shared/{path}", data)
    stale_result = f"{BUCKET}/gc-shared/.prefect-results/{'b' * 32}"  # a task result no version names
    fs.pipe_file(stale_result, b"{}")
    fs.pipe_file(f"{BUCKET}/gc-shared/.prefect-results/notes.txt", b"someone else's")
    assert main(["gc", url, "--keep", "1", "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert not fs.exists(stale_result) and fs.exists(f"{BUCKET}/gc-shared/.prefect-results/notes.txt")
    for path in [*FOREIGN, *FOREIGN_FILES]:
        assert fs.exists(f"{BUCKET}/gc-shared/{path}"), f"gc removed someone else's {path}"
    assert not fs.exists(f"{old.removeprefix('s3://')}/manifest.json")  # ours, older: removed
    assert fs.exists(f"{kept.removeprefix('s3://')}/manifest.json")
    assert fs.exists(f"{visited.removeprefix('s3://')}/manifest.json") and fs.exists(
        f"{visited.removeprefix('s3://')}/notes.txt")
    assert f"left {visited}: it holds objects sft-tokenize did not write (notes.txt)" in out
    assert "removed 1 versions" in out


def test_gc_on_a_shared_local_root_removes_only_its_own_versions_and_shards(tmp_path, capsys):
    root = tmp_path / "root"
    old = Path(run_locally(TokenizeOptions(**EXAMPLE_SLICES, max_length=96, cache_dir=str(root),
                                           name="data")))
    visited = Path(run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(root), name="visited",
                                               max_length=64)))
    run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(root), name="visited", max_length=128))
    kept = Path(run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(root), name="data")))
    (visited / "notes.txt").write_text("mine")
    for path, data in FOREIGN_FILES.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    assert main(["gc", str(root), "--keep", "1"]) == 0
    out = capsys.readouterr().out
    for path in FOREIGN_FILES:
        assert (root / path).exists(), f"gc removed someone else's {path}"
    assert not old.exists() and kept.exists()
    assert (visited / "notes.txt").exists() and (visited / "manifest.json").exists()
    assert f"left {visited}: it holds files sft-tokenize did not write (notes.txt)" in out


def test_a_build_longer_than_gcs_grace_keeps_its_shards_because_it_renews_its_lease(s3_root, home, tmp_path,
                                                                                     monkeypatch, capsys):
    from sft_tokenize.build import remote_store

    grace = 3.0
    # well within the grace, however loaded the machine
    monkeypatch.setattr(remote_store, "LEASE_RENEW_SECONDS", 0.2, raising=False)
    url = f"s3://{BUCKET}/long-build"
    fs = s3_root.filesystem()
    fault = tmp_path / "faults"
    fault.write_text("hold:1")  # slice 0 is uploaded, then slice 1 takes as long as the test says
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    outcome: dict = {}

    def build() -> None:
        try:
            outcome["version"] = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url))
        except BaseException as error:  # noqa: BLE001 - the test's thread reports it
            outcome["error"] = error

    started = time.monotonic()
    thread = threading.Thread(target=build)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not fs.glob(f"{BUCKET}/long-build/.shards/*.json") and time.monotonic() < deadline:
            time.sleep(0.1)
        first = fs.glob(f"{BUCKET}/long-build/.shards/*")
        assert first, "slice 0 was never uploaded"
        while time.monotonic() - started < grace + 1.5:  # the build is now older than gc's grace
            time.sleep(0.1)
        assert main(["gc", url, "--keep", "1", "--grace", str(grace)]) == 0
        assert "1 running builds" in capsys.readouterr().out
        assert all(fs.exists(path) for path in first)  # its lease is young: its shards stay
    finally:
        fault.write_text("")
        thread.join(120)
    assert "error" not in outcome, outcome.get("error")
    assert len(open_cache(outcome["version"], local_dir=home / "copy")) > 0


def test_shards_gone_while_a_build_publishes_withdraw_the_version(s3_root, home, monkeypatch, capsys):
    from sft_tokenize.build import remote_publish

    url = f"s3://{BUCKET}/raced"
    stamp = remote_publish.stamp

    def gc_then_stamp(*args, **kwargs):  # a gc with a grace shorter than the build, after the shard check
        assert main(["gc", url, "--keep", "1", "--grace", "0"]) == 0
        return stamp(*args, **kwargs)

    monkeypatch.setattr(remote_publish, "stamp", gc_then_stamp)
    with pytest.raises(CacheError, match=r"went from .* while this build published .* run the same command again"):
        run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url))
    out = capsys.readouterr().out
    assert re.search(rf"ignored and removed the lease {url}/\.staging/[0-9a-f]{{16}}\.lease\.json: last written "
                     r"\d+ s ago, longer than --grace 0 s", out), out
    fs = s3_root.filesystem()
    assert not fs.glob(f"{BUCKET}/raced/*/manifest.json")  # nothing published
    monkeypatch.setattr(remote_publish, "stamp", stamp)
    version = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url))  # the same command again
    assert len(open_cache(version, local_dir=home / "copy")) > 0


@pytest.mark.parametrize("fault", ["silent", "refuse"])
def test_an_endpoint_that_goes_quiet_or_refuses_mid_run_ends_it_naming_the_endpoint_and_the_failed_slices(
        s3_root, api_url, cli_home, home, tmp_path, fault):
    url = f"s3://{BUCKET}/{fault}"
    fs = s3_root.filesystem()
    faults = tmp_path / "faults"
    faults.write_text("hold:1")  # slice 0 is uploaded; slice 1 waits for the endpoint to go
    with tcp_proxy(s3_root.endpoint) as proxy:
        env = {**s3_root.environment, "AWS_ENDPOINT_URL": proxy.endpoint, FAULT_FILE_ENV: str(faults),
               "SFT_TOKENIZE_HOME": str(home)}
        # one file of two slices: each request of a failing slice waits out the timeout twice, so one failing
        # slice ends the run sooner than three
        args = run_args([EXAMPLE_DATA / "chat-00000.jsonl"], url,  # type: ignore[arg-type]
                        "--request-timeout", "1", "--retries", "0")
        run = Background(args, cli_home, tmp_path / "logs", api_url, **env)
        run.wait_until(lambda: fs.invalidate_cache() or bool(fs.glob(f"{BUCKET}/{fault}/.shards/*.json")),
                       "slice 0 is uploaded")
        getattr(proxy, fault)()
        faults.write_text("")
        started = time.monotonic()
        code = run.ended_within(300, "the endpoint went")
        seconds = time.monotonic() - started
    last = run.stderr.strip().splitlines()[-1]
    assert code == 1, run.stderr
    reason = "no answer within 1 s (--request-timeout)" if fault == "silent" else "connection refused"
    assert "1 of 2 slices failed: tokenize-00001" in last, last
    assert f"{url} (endpoint {proxy.endpoint}): {reason}" in last, last
    assert f"the 1 finished shard stays in the shard store {url}/.shards: run the same command again" in last, last
    # a request waits 1 s and is tried once more (10.5 and 4.5 min before): bounds with room to spare
    assert seconds < (120 if fault == "silent" else 60), run.stderr


def test_plan_only_on_a_bucket_shows_the_version_url_and_the_shard_objects_the_run_reuses(s3_root, home, capsys):
    url = f"s3://{BUCKET}/planned"
    version = run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=url))
    manifest = json.loads(s3_root.filesystem().cat_file(f"{version.removeprefix('s3://')}/manifest.json"))
    s3_root.filesystem().rm_file(f"{version.removeprefix('s3://')}/manifest.json")  # unpublished; shards stay
    args = ["run", *EXAMPLE_SLICES["sources"], "--tokenizer", EXAMPLE_SLICES["tokenizer"], "--cache-dir", url,
            "--shard-size", EXAMPLE_SLICES["shard_size"], "--workers", "1", "--plan-only"]
    assert main(args) == 0
    out = capsys.readouterr().out
    shards = len(manifest["shards"])
    assert f"cache     {version}: not published" in out, out
    assert f"{shards} slices' shards are in the store and would be reused" in out, out


def test_gc_collects_the_task_results_of_the_shards_it_removes(prefect_harness, tmp_path, capsys):
    from support.flows import run_flow

    from sft_tokenize.flows.tokenize_dataset import TokenizeRun

    root = tmp_path / "root"
    for max_length in (96, None):  # an older version, then the one kept: their slices' keys differ
        state, _ = run_flow(TokenizeRun(**EXAMPLE_SLICES, cache_dir=str(root), name="data", max_length=max_length,
                                        workers=2))
        assert state.is_completed(), state.message
    kept = json.loads((Path(state.result()) / "manifest.json").read_text())
    results = root / ".prefect-results"
    (results / "notes.txt").write_text("someone else's")
    before = {p.name for p in results.iterdir()}
    assert len(before) > len(kept["shards"]) + 1  # both versions' slices left a result
    assert main(["gc", str(root), "--keep", "1"]) == 0
    assert f"and {len(before) - len(kept['shards']) - 1} task results" in capsys.readouterr().out
    assert {p.name for p in results.iterdir()} == {s["key"] for s in kept["shards"]} | {"notes.txt"}


@pytest.mark.parametrize("url", ["s3://", "s3:///"])
def test_a_bucket_url_without_a_bucket_is_named_as_written(url, home, capsys):
    assert main(["gc", url]) == 2
    err = capsys.readouterr().err
    assert f"cache dir {url}: no bucket in the URL: write s3://BUCKET/PREFIX" in err, err
