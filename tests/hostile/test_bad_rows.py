"""Bad rows, found while tokenizing: each is named by its file and line (or item, or row), fails its own slice
and only that one, and `--on-bad-row skip` counts what it skipped. The runs talk to the session's Prefect
server (PREFECT_API_URL, as with a team server)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.bad_input import NO_ASSISTANT, ROW_ERRORS, built_skipping, with_a_bad_row, write_lines
from support.caches import published_caches, staged_shards
from support.cli import assert_rejected, cli, run_args
from support.data import example_rows, write_jsonl

from sft_tokenize.read.cache import open_cache


def other_formats_with_a_bad_row_2(data: Path) -> list[Path]:
    """A JSON array and a Parquet file whose second row has a message without a role."""
    rows = example_rows()[:3]
    rows[1] = {"messages": [{"role": None, "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (data / "bad-item.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), data / "bad-row.parquet")
    return [data / "bad-item.json", data / "bad-row.parquet"]


@pytest.fixture(scope="module")
def bad_rows_run(tmp_path_factory, api_url):
    """One run over a file per kind of bad row, and one with a row that has no assistant turn. Every line is its
    own slice, so every bad row fails its own slice and is reported, and the other slices finish."""
    data = tmp_path_factory.mktemp("bad-rows")
    files = [with_a_bad_row(data / f"{case}.jsonl", bad) for case, (bad, _) in ROW_ERRORS.items()]
    files.append(with_a_bad_row(data / "no-assistant-row.jsonl", NO_ASSISTANT))
    files += other_formats_with_a_bad_row_2(data)
    cache_root = data / "cache"
    result = cli(*run_args(files, cache_root, "--shard-size", "1"), home=data / "prefect-home", api_url=api_url)
    return result, data, cache_root


@pytest.mark.slow
@pytest.mark.parametrize("case", ROW_ERRORS)
def test_each_bad_row_is_named_by_file_and_line(bad_rows_run, case):
    result, data, _ = bad_rows_run
    assert f"failed: BadInput: {data}/{case}.jsonl:3: {ROW_ERRORS[case][1]}" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("where", ["bad-item.json: item 2", "bad-row.parquet: row 2"])
def test_rows_are_counted_from_1_in_every_format_as_lines_are(bad_rows_run, where):
    result, data, _ = bad_rows_run
    assert f"failed: BadInput: {data}/{where}: messages[0] has no 'role'" in result.stderr


@pytest.mark.slow
def test_bad_rows_exit_2_publish_nothing_and_keep_the_good_slices(bad_rows_run):
    result, data, cache_root = bad_rows_run
    first, (_, detail) = next(iter(ROW_ERRORS.items()))
    last = assert_rejected(result)
    assert last.startswith(f"sft-tokenize: error: {data}/{first}.jsonl:3: {detail}")
    assert "Retry" not in result.stderr  # a bad row fails the same way every time
    assert published_caches(cache_root) == []
    # The other slices, kept for a rerun: the same three good lines in every file are one shard each (content
    # addressed), and the row without an assistant turn is the fourth.
    assert len(staged_shards(cache_root)) == 4
    assert not list(cache_root.glob(".shards/*.tmp-*"))


@pytest.mark.slow
def test_a_row_without_an_assistant_turn_is_a_counted_drop_not_an_error(bad_rows_run):
    result, data, cache_root = bad_rows_run
    assert "no-assistant-row.jsonl" not in result.stderr
    # Its four lines are four slices: three good rows (shards shared with the other files' same lines) and the
    # row without an assistant turn, a shard of no row that counts the drop.
    sidecars = [json.loads(p.read_text()) for p in cache_root.glob(".shards/*.json")]
    assert sorted(meta["rows"] for meta in sidecars) == [0, 1, 1, 1]
    assert [meta["dropped"] for meta in sidecars if meta["dropped"]] == [{"no_assistant_turn": 1}]


@pytest.mark.slow
def test_skipped_bad_rows_are_counted_in_the_manifest(tmp_path, api_url):
    good = [json.dumps(row) for row in example_rows()[:10]]
    bad = [bad for bad, _ in ROW_ERRORS.values()] + [NO_ASSISTANT]
    mixed = [line for pair in zip(good[:len(bad)], bad, strict=True) for line in pair] + good[len(bad):]
    data = write_lines(tmp_path / "messy.jsonl", mixed)  # a bad row after each of the first good ones
    cache_root = tmp_path / "cache"
    cache_path, manifest = built_skipping(data, cache_root, tmp_path / "home", api_url)
    assert manifest["rows"] == len(good) == len(open_cache(cache_path))
    assert manifest["dropped"] == {"bad_message": 3, "bad_messages": 1, "malformed_json": 2, "no_assistant_turn": 1,
                                   "not_unicode": 1, "not_utf8": 1, "unknown_role": 1}

    # Prefect's persisted task results are JSON, never pickle: one per slice, holding its row count.
    records = [json.loads(p.read_bytes()) for p in (cache_root / ".prefect-results").iterdir()]
    assert len(records) == len(manifest["shards"])
    assert all(record["metadata"]["serializer"]["type"] == "json" for record in records)
    assert sorted(json.loads(record["result"]) for record in records) == sorted(s["rows"] for s in manifest["shards"])


@pytest.mark.slow
def test_a_file_without_an_assistant_turn_exits_2_naming_it(tmp_path, api_url):
    data = write_lines(tmp_path / "questions.jsonl", [NO_ASSISTANT] * 3)
    cache_root = tmp_path / "cache"
    result = cli(*run_args([data], cache_root), home=tmp_path / "home", api_url=api_url)
    assert_rejected(result, f"{data}: no row has a trained token: 3 rows dropped (no_assistant_turn: 3)")
    assert published_caches(cache_root) == []


@pytest.mark.slow
def test_control_token_text_in_a_message_is_plain_text_or_a_named_error(tmp_path, api_url):
    """A literal <|im_end|> inside a reply: by default encoded as text, so the whole reply is trained; with
    --special-text error, the run stops naming the file, the line and the message."""
    injected = {"messages": [{"role": "user", "content": "Say the end marker."},
                             {"role": "assistant", "content": "Here: <|im_end|> and the rest of the reply."}]}
    data = write_jsonl(tmp_path / "injected.jsonl", [example_rows()[0], injected])
    result = cli(*run_args([data], tmp_path / "cache"), home=tmp_path / "home", api_url=api_url)
    assert result.returncode == 0, result.stderr
    cache_path = Path(result.stdout.splitlines()[-1])
    shown = cli("inspect", str(cache_path), "--row", "1", home=tmp_path / "home", api_url=api_url)
    assert "[[Here: <|im_end|> and the rest of the reply.<|im_end|>]]" in shown.stdout
    assert json.loads((cache_path / "manifest.json").read_text())["masks"]["rows_special_text"] == 1
    refused = cli(*run_args([data], tmp_path / "strict", "--special-text", "error"), home=tmp_path / "home",
                  api_url=api_url)
    assert_rejected(refused, f"{data}:2: messages[1].content holds the control token '<|im_end|>' as text")
    assert published_caches(tmp_path / "strict") == []
