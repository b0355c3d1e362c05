"""A dry run writes nothing under the cache root, and its token estimate is within 10 % of the tokens a run makes,
on the bundled example and on a synthetic corpus (JSON lines and Parquet)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.data import write_jsonl
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.dry_run import dry_run, spread
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.read.cache import open_cache

WORDS = "the a model answer question data token river stone light seven careful quickly".split()


def synthetic_rows(count: int, seed: int) -> list[dict]:
    """Chats of 1 to 4 exchanges, messages of 2 to 120 words: lengths spread over two orders of magnitude."""
    rng = np.random.default_rng(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS, int(rng.integers(2, 120))))

    return [{"messages": [m for _ in range(int(rng.integers(1, 5)))
                          for m in ({"role": "user", "content": text()}, {"role": "assistant", "content": text()})]}
            for _ in range(count)]


def files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def estimate_and_truth(tmp_path, sources: list[str], **options) -> tuple[dict, int]:
    run = TokenizeOptions(sources=sources, tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path / "cache"),
                          **options)
    plan = plan_slices(run, dry=True)
    report = dry_run(plan.job, plan.slices, workers=2)
    assert files_under(tmp_path / "cache") == set()  # nothing written: no staging, no digests, no shard
    truth = int(open_cache(run_locally(run)).lengths.sum())
    return report, truth


def test_the_bundled_example(tmp_path):
    report, truth = estimate_and_truth(tmp_path, [str(EXAMPLE_DATA)], shard_size="100KB")
    assert abs(report["estimated_tokens"] - truth) <= 0.10 * truth, (report, truth)
    # each place sampled along a slice reads its own rows only: no row is sampled twice
    assert report["sample"]["rows"] <= 240 and report["sample"]["bytes"] <= report["input_bytes"], report
    assert report["stored_slices"] == [] and report["input_bytes"] == sum(
        p.stat().st_size for p in EXAMPLE_DATA.glob("*.jsonl"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_synthetic_corpus_sampled_from_spread_slices(tmp_path, fmt):
    rows = synthetic_rows(6000, seed=3)
    data = tmp_path / f"chats.{fmt}"
    if fmt == "jsonl":
        write_jsonl(data, rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), data, row_group_size=500)
    report, truth = estimate_and_truth(tmp_path, [str(data)], shard_size="256KB")
    assert report["slices"] > 8 and len(report["sample"]["slices"]) >= 2
    assert report["sample"]["rows"] < len(rows) / 2  # a sample, not the corpus
    assert abs(report["estimated_tokens"] - truth) <= 0.10 * truth, (report, truth)


def test_a_published_cache_and_the_slices_the_store_holds_are_found(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for path in EXAMPLE_DATA.glob("*.jsonl"):
        (data / path.name).write_bytes(path.read_bytes())
    run = TokenizeOptions(sources=[str(data)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path / "cache"))
    run_locally(run)
    assert plan_slices(run, dry=True).cached
    write_jsonl(data / "more.jsonl", synthetic_rows(50, seed=1))  # the input grows by a file
    before = files_under(tmp_path / "cache")
    plan = plan_slices(run, dry=True)
    report = dry_run(plan.job, plan.slices, workers=1)
    assert not plan.cached and files_under(tmp_path / "cache") == before
    new = [s.index for s in plan.slices if any(p.url.endswith("more.jsonl") for p in s.parts)]
    assert new and report["stored_slices"] == [s.index for s in plan.slices if s.index not in new]


def test_spread_takes_the_first_and_the_last():
    assert spread(3, 8) == [0, 1, 2]
    assert spread(100, 8)[0] == 0 and spread(100, 8)[-1] == 99 and len(spread(100, 8)) == 8
