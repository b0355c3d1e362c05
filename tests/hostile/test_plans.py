"""`run --plan-only` shows the plan the run runs: the same slices (every worker gets one, as in the run), the same
check of the store, on a local root and on a bucket, and the version's URL where the run publishes one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.caches import EXAMPLE_SLICES
from support.flows import run_flow
from support.paths import EXAMPLE_DATA

from sft_tokenize.flows.cli import main
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
