"""A failed run says everything once, and right: every failed slice with its reason, "after N retries" only where
Prefect retried, what stays and what a rerun (or a deployment run's Retry) redoes; its tables have named columns;
and a build, failed or not, leaves no lock file behind. The run that shows it end to end, on a server, with its
failure artifact, is test_bad_rows.py's."""

from __future__ import annotations

import json
from concurrent.futures.process import BrokenProcessPool

import pytest
from support.bad_input import with_a_bad_row
from support.data import write_jsonl
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.stopping import Stopped
from sft_tokenize.errors import BadInput, OutOfSpace
from sft_tokenize.flows.failures import failure_message
from sft_tokenize.flows.report import markdown_table, summary

STORE = "/data/cache/.shards"
FAULT = RuntimeError("injected fault\nsecond line of the error")


@pytest.mark.parametrize(("failures", "retries", "expected"), [
    ({1: FAULT}, 0, "1 of 4 slices failed: tokenize-00001: RuntimeError: injected fault; the 3 finished shards "
                    f"stay in the shard store {STORE}: run the same command again to tokenize only this slice"),
    ({1: FAULT, 3: FAULT}, 2, "2 of 4 slices failed after 2 retries: tokenize-00001, tokenize-00003: "
                              "RuntimeError: injected fault; the 2 finished shards stay"),
    ({0: OutOfSpace("no space left on /data"), 2: FAULT}, 1,  # a full disk is never retried
     "2 of 4 slices failed: tokenize-00000: OutOfSpace: no space left on /data; tokenize-00002 after 1 retry: "
     "RuntimeError: injected fault; the 2 finished shards"),
    ({2: Stopped("stopped")}, 2, "1 of 4 slices failed: tokenize-00002: Stopped: stopped; the 3 finished"),
    ({1: BrokenProcessPool("a worker died")}, 2,  # the worker died, not the task: Prefect did not retry it
     "1 of 4 slices failed: tokenize-00001: BrokenProcessPool: a worker died; the 3 finished"),
    ({0: BadInput("/d/a.jsonl:3: not valid JSON"), 3: BadInput("/d/b.parquet: row 2: messages[0] has no 'role'")}, 2,
     "2 of 4 slices failed on bad input: tokenize-00000: /d/a.jsonl:3: not valid JSON; tokenize-00003: "
     f"/d/b.parquet: row 2: messages[0] has no 'role'; the 2 finished shards stay in the shard store {STORE}: "
     "fix those rows (or skip them: --on-bad-row skip), then run the same command again to tokenize only these 2 "
     "slices"),
    ({0: FAULT, 1: FAULT, 2: FAULT, 3: FAULT}, 0, "4 of 4 slices failed: tokenize-00000, tokenize-00001, "
                                                  "tokenize-00002, tokenize-00003: RuntimeError: injected fault; no "
                                                  "slice finished: run the same command again to tokenize only "
                                                  "these 4 slices"),
], ids=["no-retries", "retried", "full-disk-and-retried", "interrupted", "worker-died", "bad-input", "all-failed"])
def test_a_failed_runs_message_names_each_failed_slice_and_what_a_rerun_redoes(failures, retries, expected):
    message = failure_message(failures, 4, STORE, retries)
    assert expected in message
    assert "\n" not in message and "second line" not in message
    assert ("after" in message) == (retries > 0 and any(type(e) is RuntimeError for e in failures.values()))


def test_a_deployment_runs_message_says_retry_and_a_long_list_is_cut_short():
    failures = {i: BadInput(f"/d/part-{i}.jsonl:1: not valid JSON") for i in range(30)}
    message = failure_message(failures, 100, STORE, 2, retry_in_ui=True, listed=20)
    assert message.startswith("30 of 100 slices failed on bad input: tokenize-00000: /d/part-0.jsonl:1:")
    assert "tokenize-00019: /d/part-19.jsonl:1:" in message and "part-20.jsonl" not in message
    assert message.endswith("; and 10 more slices (the run's failure artifact lists every one); the 70 finished shards "
                            f"stay in the shard store {STORE}: fix those rows (or skip them: --on-bad-row skip), "
                            "then Retry the flow run in the Prefect UI (or run it again) to tokenize only these 30 "
                            "slices")


def test_a_summary_table_has_named_columns(tmp_path):
    cache_path = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA / "chat-00001.jsonl")],
                                             tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path)))
    manifest = json.loads((cache_path / "manifest.json").read_text())
    lines = markdown_table("Tokenized cache", summary(manifest, cache_path)).splitlines()
    assert lines[:4] == ["### Tokenized cache", "", "| field | value |", "|---|---|"]
    assert lines[4] == f"| cache | {cache_path} |"
    assert not list((tmp_path / ".staging").iterdir())  # a build leaves no lock file (nor lease) behind


def test_a_failed_build_leaves_no_lock_file_and_its_rerun_publishes(tmp_path):
    data = with_a_bad_row(tmp_path / "rows.jsonl", '{"messages": [{"role": "user", "content": "hi"}')
    options = TokenizeOptions(sources=[str(data)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path / "c"))
    with pytest.raises(BadInput, match=f"{data}:3: not valid JSON"):
        run_locally(options)
    assert sorted(p.name for p in (tmp_path / "c" / ".staging").iterdir()) == []
    write_jsonl(data, [json.loads(line) for i, line in enumerate(data.read_text().splitlines()) if i != 2])
    assert run_locally(options).is_dir()
    assert sorted(p.name for p in (tmp_path / "c" / ".staging").iterdir()) == []
