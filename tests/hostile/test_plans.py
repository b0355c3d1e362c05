"""`run --plan-only` shows the plan the run runs: the same slices (every worker gets one, as in the run), the same
check of the store, on a local root and on a bucket, and the version's URL where the run publishes one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.caches import EXAMPLE_SLICES
from support.flows import run_flow
from support.paths import EXAMPLE_DATA

from sft_tokenize.cli.main import main
from sft_tokenize.flows.tokenize_dataset import TokenizeRun

ONE_FILE = {**EXAMPLE_SLICES, "sources": [str(EXAMPLE_DATA / "chat-00000.jsonl")], "shard_size": "1MB"}


def plan_only(cache_dir: str, *extra: str) -> list[str]:
    return ["run", *ONE_FILE["sources"], "--tokenizer", ONE_FILE["tokenizer"], "--cache-dir", cache_dir,
            "--shard-size", ONE_FILE["shard_size"], "--plan-only", *extra]


def test_plan_only_cuts_the_slices_the_run_cut_and_finds_their_shards(prefect_harness, tmp_path, capsys):
    root = tmp_path / "root"
    # one file smaller than a slice: the run still gives each of its 3 workers a slice
    state, _ = run_flow(TokenizeRun(**ONE_FILE, cache_dir=str(root), workers=3))
    assert state.is_completed(), state.message
    cut = len(json.loads((Path(state.result()) / "manifest.json").read_text())["shards"])
    assert cut > 1
    shutil.rmtree(Path(state.result()))  # the version goes; its shards stay in the store
    assert main(plan_only(str(root), "--workers", "3")) == 0
    out = capsys.readouterr().out
    assert f"slices    {cut} (213 kB of input)" in out, out
    assert f"{cut} slices' shards are in the store and would be reused" in out, out


def sorted_rows(count: int = 1200) -> list[dict]:
    """Rows sorted by length; with max_length 256 and truncation drop, the longer half is dropped."""
    words = "the model answer river stone seven light careful token data question a".split()
    return [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " ".join(
        words[(i + k) % len(words)] for k in range(2 + i // 3))}]} for i in range(count)]


def test_plan_only_samples_along_a_length_sorted_file_and_shows_its_spread(tmp_path):
    from sft_tokenize.build.dry_run import dry_run
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.plan import plan_slices
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.read.cache import open_cache

    data = tmp_path / "sorted.jsonl"
    with data.open("w") as out:
        out.writelines(json.dumps(row) + "\n" for row in sorted_rows())
    run = TokenizeOptions(sources=[str(data)], tokenizer=EXAMPLE_SLICES["tokenizer"], cache_dir=str(tmp_path / "c"),
                          shard_size="100MB", max_length=256, truncation="drop")
    plan = plan_slices(run, dry=True)
    assert len(plan.slices) == 1
    report = dry_run(plan.job, plan.slices, workers=1)
    truth = int(open_cache(run_locally(run)).lengths.sum())
    assert abs(report["estimated_tokens"] - truth) <= 0.35 * truth, (report["estimated_tokens"], truth)
    low, high = report["estimated_tokens_spread"]
    assert low < truth < high  # the spread says how far apart the file's parts are


def test_plan_only_samples_row_groups_along_each_slice_of_a_length_sorted_parquet_file(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sft_tokenize.build.dry_run import dry_run
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.plan import plan_slices
    from sft_tokenize.build.protocol import run_locally
    from sft_tokenize.read.cache import open_cache

    data = tmp_path / "sorted.parquet"
    pq.write_table(pa.Table.from_pylist(sorted_rows()), data, row_group_size=40)  # 30 row groups
    run = TokenizeOptions(sources=[str(data)], tokenizer=EXAMPLE_SLICES["tokenizer"], cache_dir=str(tmp_path / "c"),
                          shard_size="150KB", max_length=256, truncation="drop")
    plan = plan_slices(run, dry=True)
    assert len(plan.slices) >= 4 and all(s.parts[0].stop - s.parts[0].start > 1 for s in plan.slices[:-1])
    report = dry_run(plan.job, plan.slices, workers=1)
    truth = int(open_cache(run_locally(run)).lengths.sum())
    assert abs(report["estimated_tokens"] - truth) <= 0.35 * truth, (report["estimated_tokens"], truth)
    low, high = report["estimated_tokens_spread"]
    assert low < truth < high
    assert main(["run", str(data), "--tokenizer", EXAMPLE_SLICES["tokenizer"], "--cache-dir", str(tmp_path / "c"),
                 "--shard-size", "150KB", "--max-length", "256", "--truncation", "drop", "--plan-only"]) == 0
    assert f"{low:,}" in capsys.readouterr().out  # the spread is printed
