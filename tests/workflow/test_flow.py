"""The tokenize_dataset flow on Prefect's test server: same cache as the plain pipeline, cache hits that
tokenize nothing, a failed slice that is the only one redone, and the same bytes on threads and processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from support.caches import EXAMPLE_SLICE_TASKS, EXAMPLE_SLICES, data_files, staged_slices
from support.faults import FAULT_FILE_ENV
from support.flows import run_flow

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.flows.tokenize_dataset import TokenizeRun, tokenize_dataset
from sft_tokenize.read.cache import open_cache, read_manifest

pytestmark = pytest.mark.usefixtures("prefect_harness")

SOURCES = EXAMPLE_SLICES  # two input files cut into four slices, one of them spanning both files


def run_options(cache_dir: Path, **overrides) -> TokenizeRun:
    return TokenizeRun(**SOURCES, cache_dir=str(cache_dir), workers=2, **overrides)


def tokenize_runs(task_runs: dict) -> dict:
    return {name: run for name, run in task_runs.items() if name.startswith("tokenize-")}


def assert_same_cache(actual: str | Path, expected: str | Path) -> None:
    assert data_files(actual) == data_files(expected)
    actual_rows, expected_rows = open_cache(actual), open_cache(expected)
    assert len(actual_rows) == len(expected_rows) == 240
    for i in (0, 71, 239):
        assert (actual_rows[i]["input_ids"] == expected_rows[i]["input_ids"]).all()
        assert (actual_rows[i]["loss_mask"] == expected_rows[i]["loss_mask"]).all()


@pytest.fixture
def reference(example_cache) -> Path:
    """The cache the plain pipeline builds from the same options, without Prefect."""
    return example_cache


@pytest.fixture(scope="module")
def threads_run(tmp_path_factory, prefect_harness):
    """One flow run on the default runner: its options, final state and task runs."""
    options = run_options(tmp_path_factory.mktemp("threads"))
    state, task_runs = run_flow(options)
    return options, state, task_runs


def test_flow_builds_the_same_cache_as_the_plain_pipeline(threads_run, reference):
    options, state, task_runs = threads_run
    assert state.is_completed()
    cache_path = state.result()
    assert Path(cache_path).parent == options.cache_root and Path(cache_path).name == reference.name
    assert_same_cache(cache_path, reference)
    assert sorted(tokenize_runs(task_runs)) == EXAMPLE_SLICE_TASKS
    assert {"plan-slices", "publish-cache"} <= set(task_runs)
    # Results are persisted as JSON next to the cache, not in ~/.prefect.
    records = [json.loads(p.read_text()) for p in sorted((options.cache_root / ".prefect-results").iterdir())]
    assert [r["metadata"]["serializer"]["type"] for r in records] == ["json"] * 4
    rows_by_file = [f["rows"] for f in read_manifest(cache_path)["files"]]
    assert sorted(json.loads(r["result"]) for r in records) == sorted(rows_by_file)


def test_flow_reports_progress_and_a_summary(threads_run):
    _, state, _ = threads_run
    artifact_filter = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        artifacts = {a.type: a for a in client.read_artifacts(artifact_filter=artifact_filter)}
    assert artifacts["progress"].data == 100
    summary = artifacts["markdown"].data
    for expected in ("| rows | 240 |", "| tokens |", "| dropped rows | none |", "p90", "tokens/s", state.result()):
        assert expected in summary
    # The lengths report: a bar per length bin, whose rows add up to the cache's, and the table of lengths.
    lengths = summary.split("### Lengths")[1]
    bins = lengths.split("**Tokens per row**")[1].split("**Trained tokens per row**")[0]
    counts = [int(line.split("|")[2].replace(",", "")) for line in bins.splitlines() if line.startswith("| ")
              and "`" in line]
    assert sum(counts) == 240 and "**At each length**" in lengths and "| 512 |" in lengths


def test_second_run_is_a_cache_hit_that_tokenizes_nothing(threads_run):
    options, first, _ = threads_run
    mtimes = {p.name: p.stat().st_mtime_ns for p in Path(first.result()).iterdir()}
    state, task_runs = run_flow(options)
    assert state.is_completed() and state.result() == first.result()
    assert tokenize_runs(task_runs) == {} and "publish-cache" not in task_runs
    assert {p.name: p.stat().st_mtime_ns for p in Path(first.result()).iterdir()} == mtimes


def test_a_threads_run_loads_the_tokenizer_once_for_its_plan_and_slices(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from sft_tokenize.build.workers import process_encoding

    process_encoding.cache_clear()
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "home"))  # not prepared yet: loaded by transformers
    loads = []
    load = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: loads.append(args) or
                        load(*args, **kwargs))
    state, task_runs = run_flow(run_options(tmp_path))
    assert state.is_completed() and len(tokenize_runs(task_runs)) == 4
    # The plan checked the tokenizer and chose the encoder; the slices, on threads of the same process, reuse both.
    assert len(loads) == 1, loads
    assert process_encoding.cache_info().misses == 1


def test_force_rebuilds_a_published_cache(tmp_path, reference):
    published = run_locally(TokenizeOptions(**SOURCES, cache_dir=str(tmp_path)))
    state, task_runs = run_flow(run_options(tmp_path, force=True))
    assert state.is_completed() and state.result() == str(published)
    assert sorted(run.state.name for run in tokenize_runs(task_runs).values()) == ["Completed"] * 4
    assert_same_cache(published, reference)


def test_failed_slice_fails_the_flow_and_a_rerun_redoes_only_that_slice(tmp_path, monkeypatch, reference):
    fault_file = tmp_path / "faults"
    fault_file.write_text("1\n")
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault_file))
    options = run_options(tmp_path / "cache", retries=1)

    state, task_runs = run_flow(options)
    assert state.is_failed()
    assert "tokenize-00001" in state.message and "1 of 4 slices failed" in state.message
    assert not [name for name in ("tokenize-00000", "tokenize-00002", "tokenize-00003") if name in state.message]
    failed = task_runs["tokenize-00001"]
    assert failed.state.is_failed() and failed.run_count == 2  # the first attempt and its one retry
    staged = staged_slices(options)
    assert sorted(staged) == [0, 2, 3]

    fault_file.unlink()
    state, task_runs = run_flow(options)
    assert state.is_completed()
    states = {name: run.state.name for name, run in tokenize_runs(task_runs).items()}
    assert states == {"tokenize-00000": "Cached", "tokenize-00001": "Completed", "tokenize-00002": "Cached",
                      "tokenize-00003": "Cached"}
    # The published data files are the staged shards themselves (hard links): untouched by the rerun.
    published = sorted(Path(state.result()).glob("data-*.arrow"))
    for index in (0, 2, 3):
        stat = published[index].stat()
        assert (stat.st_ino, stat.st_mtime_ns) == staged[index]
    assert_same_cache(state.result(), reference)


def test_threads_and_processes_write_the_same_bytes(threads_run, tmp_path):
    _, threads_state, _ = threads_run
    # Parameters as a deployment run passes them, JSON: the runner comes from the parameters alone.
    state, task_runs = run_flow(run_options(tmp_path, runner="processes").model_dump(mode="json"))
    assert state.is_completed()
    assert sorted(tokenize_runs(task_runs)) == EXAMPLE_SLICE_TASKS
    assert data_files(state.result()) == data_files(threads_state.result())
    assert "RAYON_NUM_THREADS" not in os.environ  # set in the worker processes only


def test_the_flow_parameters_are_one_typed_model():
    schema = tokenize_dataset.parameters
    assert list(schema.properties) == ["options"]
    form = schema.definitions["TokenizeRun"]["properties"]
    assert form["runner"]["enum"] == ["threads", "processes", "dask", "ray"]
    assert {"sources", "tokenizer", "cache_dir", "train_on", "workers", "force"} <= set(form)


def test_grouped_slices_fail_one_by_one_and_a_rerun_redoes_only_the_failed_slice(tmp_path, monkeypatch):
    """Past the threshold (here forced: two slices a task on average), a task tokenizes a group of slices, each
    into its own shard: a failed slice is named alone, its group's other shards stay, and a rerun redoes it only."""
    fine = {**SOURCES, "shard_size": "20KB"}
    reference = run_locally(TokenizeOptions(**fine, cache_dir=str(tmp_path / "plain")))
    slices = len(read_manifest(reference)["files"])
    fault_file = tmp_path / "faults"
    fault_file.write_text("5\n")
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault_file))
    options = TokenizeRun(**fine, cache_dir=str(tmp_path / "cache"), workers=2, retries=1, slices_per_task=2)

    state, task_runs = run_flow(options)
    assert state.is_failed()
    assert "tokenize-00005: RuntimeError" in state.message and f"1 of {slices} slices failed" in state.message
    groups = tokenize_runs(task_runs)
    assert 2 <= len(groups) < slices
    failed = [run for run in groups.values() if run.state.is_failed()]
    assert len(failed) == 1 and failed[0].run_count == 2  # its group, retried once
    first, _, last = failed[0].name.removeprefix("tokenize-").partition("-")
    assert int(first) <= 5 <= int(last or first)
    staged = staged_slices(options)
    assert sorted(staged) == [i for i in range(slices) if i != 5]  # the failed slice's group mates finished

    fault_file.unlink()
    state, task_runs = run_flow(options)
    assert state.is_completed()
    assert {run.state.name for name, run in tokenize_runs(task_runs).items() if name != failed[0].name} == {"Cached"}
    published = sorted(Path(state.result()).glob("data-*.arrow"))
    for index, stamp in staged.items():
        stat = published[index].stat()
        assert (stat.st_ino, stat.st_mtime_ns) == stamp
    assert data_files(state.result()) == data_files(reference)
