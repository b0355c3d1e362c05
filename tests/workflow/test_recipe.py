"""`sft-tokenize run --recipe`: every source through the flow into its own cache, then the mixture index;
re-weighting re-tokenizes nothing; a bad recipe is one line naming the key, before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from support.caches import published_inodes
from support.cli import assert_clean_error, cli
from support.data import example_rows, write_jsonl
from support.faults import FAULT_FILE_ENV
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.recipe import load_recipe
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.mixture_index import load_mixture, open_mixture


def write_recipe(folder: Path, data: Path, **changes) -> Path:
    recipe = {"tokenizer": str(EXAMPLE_TOKENIZER), "cache_dir": str(folder / "caches"), "shard_size": "20KB",
              "mixture": {"unit": "trained_tokens", "budget": 20_000},
              "sources": [{"name": "first", "sources": [str(data / "first.jsonl")], "weight": 0.7},
                          {"name": "second", "sources": [str(data / "second.jsonl")], "weight": 0.3,
                           "system_prompt": "Answer briefly."}]}
    for key, value in changes.items():
        recipe[key] = value
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture
def data(tmp_path) -> Path:
    rows = example_rows()
    write_jsonl(tmp_path / "first.jsonl", rows[:120])
    write_jsonl(tmp_path / "second.jsonl", [{"messages": [m for m in r["messages"] if m["role"] != "system"]}
                                            for r in rows[120:]])
    return tmp_path


@pytest.mark.server
def test_a_recipe_builds_a_cache_per_source_and_a_reweighting_only_a_new_index(tmp_path, data, prefect_home,
                                                                               api_url):
    recipe = write_recipe(tmp_path, data)
    done = cli("run", "--recipe", str(recipe), "--workers", "2", home=prefect_home, api_url=api_url)
    assert done.returncode == 0, done.stderr
    index_path = Path(done.stdout.strip().splitlines()[-1])
    meta = json.loads((index_path / "mixture.json").read_text())
    assert [s["name"] for s in meta["sources"]] == ["first", "second"]
    shares = [s["share"] for s in meta["sources"]]
    assert shares == pytest.approx([0.7, 0.3], abs=0.02)
    caches = [Path(p) for p in meta["source_caches"]]
    second = open_cache(caches[1])
    assert all(second[i]["input_ids"].tolist() != [] for i in range(3))
    assert len(open_mixture(index_path)) == meta["rows"]
    inodes = [published_inodes(c) for c in caches]

    reweighted = write_recipe(tmp_path, data, sources=[
        {"name": "first", "sources": [str(data / "first.jsonl")], "weight": 0.4},
        {"name": "second", "sources": [str(data / "second.jsonl")], "weight": 0.6,
         "system_prompt": "Answer briefly."}])
    again = cli("run", "--recipe", str(reweighted), home=prefect_home, api_url=api_url)
    assert again.returncode == 0, again.stderr
    new_index = Path(again.stdout.strip().splitlines()[-1])
    assert new_index != index_path
    assert [published_inodes(c) for c in caches] == inodes  # the same caches, not one row re-tokenized
    assert json.loads((new_index / "mixture.json").read_text())["source_caches"] == meta["source_caches"]


@pytest.mark.parametrize("change, expected", [
    ({"max_lenght": 10}, "max_lenght: not a recipe key"),
    ({"sources": [{"sources": ["x.jsonl"], "weight": 1.0, "layout": "trl"}]},
     "sources[0].layout: not a shared option: it goes at the recipe's top"),
    ({"sources": [{"sources": ["a.jsonl"], "weight": 0.5}, {"name": "b", "sources": ["b.jsonl"], "weight": 0.6}]},
     "add up to 1.1"),
    ({"sources": [{"sources": ["a.jsonl"], "weight": 0.5, "epochs": 2}]}, "sources[0]: give exactly one of"),
    ({"sources": [{"sources": ["nothing-here/*.jsonl"], "epochs": 1}]}, "sources[0]"),
])
def test_a_bad_recipe_is_one_line_naming_the_key(tmp_path, data, change, expected):
    recipe = write_recipe(tmp_path, data, **change)
    result = cli("run", "--recipe", str(recipe), home=tmp_path / "home")
    assert_clean_error(result, 2, str(recipe), expected)
    assert not (tmp_path / "caches").exists() or not any((tmp_path / "caches").glob("*-*"))


@pytest.mark.usefixtures("prefect_harness")
def test_the_recipe_flow_retried_after_a_failed_slice_redoes_only_that_slice(tmp_path, data, monkeypatch):
    from sft_tokenize.flows.tokenize_recipe import tokenize_recipe

    write_jsonl(data / "first.jsonl", example_rows()[:10])  # one slice: the fault below spares it
    recipe = load_recipe(write_recipe(tmp_path, data))
    first, second = recipe.runs()
    assert len(plan_slices(first, content_keys=False).slices) == 1
    slices = plan_slices(second, content_keys=True)
    assert len(slices.slices) >= 3
    fault_file = tmp_path / "faults"
    fault_file.write_text("1\n")  # slice 1 of every source: only the second source has one
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault_file))
    state = tokenize_recipe(recipe, {"workers": 1, "retries": 0}, return_state=True)
    assert state.is_failed()
    shards = {s.index: slices.job.shard_path(s) for s in slices.slices}
    kept = {i: (p.stat().st_ino, p.stat().st_mtime_ns) for i, p in shards.items() if p.exists()}
    assert 1 not in kept and len(kept) == len(shards) - 1
    [first_cache] = [p for p in (tmp_path / "caches").glob("first-*") if p.is_dir()]
    first_inodes = published_inodes(first_cache)

    fault_file.unlink()
    state = tokenize_recipe(recipe, {"workers": 1, "retries": 0}, return_state=True)
    index_path = Path(state.result())
    assert {i: (shards[i].stat().st_ino, shards[i].stat().st_mtime_ns) for i in kept} == kept
    assert shards[1].exists() and published_inodes(first_cache) == first_inodes
    meta = load_mixture(index_path).meta
    assert meta["source_caches"][0] == str(first_cache)
    assert [s["name"] for s in meta["sources"]] == ["first", "second"]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    [summary] = [a.data for a in artifacts if a.key == f"sft-mixture-{meta['key']}"]
    assert "first" in summary and "asked weight 0.7" in summary and "second" in summary
