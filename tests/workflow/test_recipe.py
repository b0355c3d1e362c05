"""`sft-tokenize run --recipe`: every source through the flow into its own cache, then the mixture index;
re-weighting re-tokenizes nothing; a bad recipe is one line naming the key, before anything runs."""

from __future__ import annotations

import json
import shutil
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

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.recipe import load_recipe
from sft_tokenize.errors import BadInput
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.mixed_rows import open_mixture
from sft_tokenize.read.mixture_index import load_mixture


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
    # Refused before any source is tokenized: they used to tokenize everything, then fail or fill the memory.
    ({"sources": [{"name": "gold", "sources": ["a.jsonl"], "epochs": float("inf")}]},
     "sources[0] (gold): epochs: Input should be a finite number"),
    ({"sources": [{"name": "typo", "sources": ["a.jsonl"], "rows": 1_000_000_000}]},
     "source typo (rows 1,000,000,000) would make a mixture index of at least 1,000,000,000 rows"),
])
def test_a_bad_recipe_is_one_line_naming_the_key(tmp_path, data, change, expected, cli_home):
    recipe = write_recipe(tmp_path, data, **change)
    result = cli("run", "--recipe", str(recipe), home=cli_home)
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


def _recipe_text(folder: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(f"tokenizer: {EXAMPLE_TOKENIZER}\ncache_dir: {folder / 'caches'}\n" + text)
    return path


@pytest.mark.parametrize("text, line, key, first", [
    ("max_length: 100\nmax_length: 50000\nsources:\n  - {sources: [a.jsonl], epochs: 1}\n", 4, "max_length", 3),
    ("sources:\n  - {name: a, sources: [a.jsonl], epochs: 1}\nsources:\n  - {name: b, sources: [b.jsonl], epochs: 1}\n",
     5, "sources", 3),
    ("sources:\n  - name: a\n    sources: [a.jsonl]\n    weight: 0.5\n    weight: 1.0\n"
     "mixture: {budget: 100}\n", 7, "weight", 6),
    ("mixture: {budget: 100, budget: 200}\nsources:\n  - {sources: [a.jsonl], weight: 1}\n", 3, "budget", 3),
])
def test_a_key_given_twice_is_refused_naming_the_file_the_line_and_the_key(tmp_path, text, line, key, first):
    recipe = _recipe_text(tmp_path, text)
    with pytest.raises(BadInput) as raised:
        load_recipe(recipe)
    assert str(raised.value) == (f"{recipe}, line {line}: {key}: given twice (first on line {first}); give each "
                                 "key once")


def test_a_json_recipe_with_a_key_twice_is_refused_and_a_yaml_merge_may_still_override(tmp_path):
    recipe = tmp_path / "recipe.json"
    first = json.dumps({"tokenizer": str(EXAMPLE_TOKENIZER), "cache_dir": str(tmp_path)})[1:-1]
    recipe.write_text(f'{{{first},\n"sources": [{{"sources": ["a.jsonl"], "epochs": 1}}],\n"cache_dir": "x"}}')
    with pytest.raises(BadInput, match=r"recipe.json, line 3: cache_dir: given twice \(first on line 1\)"):
        load_recipe(recipe)
    merged = _recipe_text(tmp_path, "sources:\n  - &first {name: a, sources: [a.jsonl], epochs: 1}\n"
                          "  - {<<: *first, name: b, epochs: 2}\n")
    assert [r.name for r in load_recipe(merged).runs()] == ["a", "b"]


@pytest.mark.parametrize("data, expected", [
    ("sources: []\n".encode("utf-16"), "recipe.yaml: the recipe is UTF-16 (little-endian) text (it starts with that "
                                       "byte-order mark); save it as UTF-8"),
    (b"\xfe\xff" + "sources: []\n".encode("utf-16-be"), "recipe.yaml: the recipe is UTF-16 (big-endian) text"),
    ("sources: []\n".encode("utf-32"), "recipe.yaml: the recipe is UTF-32 (little-endian) text"),
    ("sources: []\n".encode("utf-16-le"), "recipe.yaml: not UTF-8 text (a NUL byte at offset 1: UTF-16 or UTF-32 "
                                          "without a byte-order mark?); save the recipe as UTF-8"),
    ("tokenizer: x\n# caf\u00e9\n".encode("latin-1"), "recipe.yaml, line 2: not UTF-8 text (byte 0xe9 at offset "
                                                      "18); save the recipe as UTF-8"),
])
def test_a_recipe_not_in_utf8_is_one_line_naming_the_file_and_the_encoding(tmp_path, data, expected):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(data)
    with pytest.raises(BadInput) as raised:
        load_recipe(recipe)
    assert str(raised.value).startswith(f"{tmp_path}/{expected}")


def test_a_recipe_with_a_utf8_byte_order_mark_is_read(tmp_path):
    recipe = _recipe_text(tmp_path, "sources:\n  - {name: a, sources: [a.jsonl], epochs: 1}\n")
    recipe.write_bytes(b"\xef\xbb\xbf" + recipe.read_bytes())
    assert load_recipe(recipe).runs()[0].tokenizer == str(EXAMPLE_TOKENIZER)


def test_epochs_zero_is_refused_naming_its_source(tmp_path):
    recipe = _recipe_text(tmp_path, "sources:\n  - {name: chat, sources: [a.jsonl], epochs: 1}\n"
                                    "  - {name: gold, sources: [b.jsonl], epochs: 0}\n")
    with pytest.raises(BadInput) as raised:
        load_recipe(recipe)
    assert str(raised.value) == f"{recipe}: sources[1] (gold): epochs: Input should be greater than 0"


@pytest.mark.parametrize("text, expected", [
    ("sources:\n  - {name: typo, sources: [a.jsonl], rows: 1000000000}\n",
     "source typo (rows 1,000,000,000) would make a mixture index of at least 1,000,000,000 rows (16.0 GB on disk, "
     "96.0 GB of memory to build it), over the bound of 100,000,000 rows (the mixture's max_index_rows"),
    ("sources:\n  - {name: chat, sources: [a.jsonl], epochs: 1}\n  - {name: gold, sources: [b.jsonl], epochs: .inf}\n",
     "sources[1] (gold): epochs: Input should be a finite number"),
    ("sources:\n  - {name: gold, sources: [b.jsonl], epochs: 1e9}\n",
     "source gold (epochs 1e+09) would make a mixture index of at least 1,000,000,000 rows"),
    ("max_length: 4096\nsources:\n  - {name: chat, sources: [a.jsonl], tokens: 1000000000000}\n",
     "source chat (tokens 1,000,000,000,000) would make a mixture index of at least 244,140,625 rows"),
    ("mixture: {unit: rows, budget: 300000000}\nsources:\n  - {name: a, sources: [a.jsonl], weight: 0.5}\n"
     "  - {name: b, sources: [b.jsonl], weight: 0.5}\n",
     "the weighted sources a, b (budget 300,000,000 rows) would make a mixture index of at least 300,000,000 rows"),
    ("mixture: {max_index_rows: 10}\nsources:\n  - {name: a, sources: [a.jsonl], rows: 6}\n"
     "  - {name: b, sources: [b.jsonl], rows: 5}\n",
     "source a (rows 6) would make a mixture index of at least 11 rows (176 bytes on disk, 1 kB of memory to build "
     "it, 6 of them its own), over the bound of 10 rows"),
])
def test_an_amount_too_large_for_an_index_is_refused_before_anything_runs(tmp_path, text, expected):
    recipe = _recipe_text(tmp_path, text)
    with pytest.raises(BadInput) as raised:
        load_recipe(recipe)
    assert str(raised.value).startswith(f"{recipe}: {expected}")


def test_the_index_bound_is_an_option(tmp_path):
    recipe = _recipe_text(tmp_path, "mixture: {max_index_rows: 11}\nsources:\n  - {name: a, sources: [a.jsonl], "
                                    "rows: 6}\n  - {name: b, sources: [b.jsonl], rows: 5}\n")
    assert load_recipe(recipe).mixture.max_index_rows == 11


def test_relative_paths_resolve_against_the_recipe_file_wherever_it_is_run(tmp_path, monkeypatch):
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE_TOKENIZER, project / "tokenizer")
    write_jsonl(project / "data" / "a.jsonl", example_rows()[:4])
    (project / "template.jinja").write_text((EXAMPLE_TOKENIZER / "chat_template.jinja").read_text())
    recipe = project / "recipe.yaml"
    recipe.write_text("tokenizer: tokenizer\ncache_dir: caches\nchat_template: template.jinja\n"
                      "mixture: {index_dir: ../indexes}\n"
                      "sources:\n  - {sources: [data/a.jsonl], epochs: 1}\n"
                      "  - {name: hub, sources: ['hub:org/set', 's3://bucket/b.jsonl', /abs/c.jsonl], epochs: 1}\n")
    monkeypatch.chdir(project)  # where such a recipe always worked: what it meant there, it means everywhere
    before = plan_slices(TokenizeOptions(sources=["data/a.jsonl"], tokenizer="tokenizer", cache_dir="caches",
                                         chat_template="template.jinja", name="a"), content_keys=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_recipe(Path("..") / "project" / "recipe.yaml", {"cache_dir": "from-the-command-line"})
    first, second = loaded.runs()
    assert first.sources == [str(project / "data" / "a.jsonl")] and first.name == "a"
    assert first.tokenizer == str(project / "tokenizer")
    assert first.chat_template == str(project / "template.jinja")
    assert loaded.mixture.index_dir == str(tmp_path / "indexes")
    assert second.sources == ["hub:org/set", "s3://bucket/b.jsonl", "/abs/c.jsonl"]  # not paths beside it
    assert first.cache_root == elsewhere / "from-the-command-line"  # the command line's: relative to where it runs
    after = plan_slices(first.model_copy(update={"cache_dir": str(project / "caches")}), content_keys=False)
    assert after.cache_path == before.cache_path  # the same cache: nothing is rebuilt


def test_a_hub_tokenizer_name_in_a_recipe_stays_a_hub_name(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("tokenizer: Qwen/Qwen2.5-0.5B-Instruct\ncache_dir: caches\n"
                      "sources:\n  - {name: a, sources: [a.jsonl], epochs: 1}\n")
    [run] = load_recipe(recipe).runs()
    assert run.tokenizer == "Qwen/Qwen2.5-0.5B-Instruct" and run.cache_root == tmp_path / "caches"
