"""Rows as other tools write them, through the whole pipeline: a bad `weight` or ShareGPT `function_call` is named
by file, line and message; alpaca's `system`/`history` columns are read and fingerprinted; a first (or only) row
over --max-row-bytes is named as any later one is, or counted with --on-bad-row skip."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.bad_input import write_lines
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import BadInput
from sft_tokenize.read.cache import read_manifest


def _options(sources, root, **extra) -> TokenizeOptions:
    return TokenizeOptions(sources=[str(s) for s in sources], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(root),
                           **extra)


def _chat(*messages: dict) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}, *messages]})


@pytest.mark.parametrize(("bad", "detail"), [
    (_chat({"role": "assistant", "content": "yo", "weight": 2}),
     "messages[1].weight must be 0 (not trained) or 1 (trained), got 2"),
    (_chat({"role": "assistant", "content": "yo", "weight": "x"}),
     "messages[1].weight must be 0 (not trained) or 1 (trained), got 'x'"),
    (_chat({"from": "function_call", "value": '{"name": "f", "arguments": '}),
     "messages[1].value is not the JSON of a function call (Expecting value"),
])
def test_a_bad_weight_or_function_call_is_named_by_file_line_and_message(tmp_path, bad, detail):
    good = [json.dumps(row) for row in example_rows()[:3]]
    path = write_lines(tmp_path / "rows.jsonl", [*good, bad])
    with pytest.raises(BadInput) as error:
        run_locally(_options([path], tmp_path / "cache"))
    assert str(error.value).startswith(f"{path}:4: {detail}")


def test_weights_train_what_their_authors_asked(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "Uno.", "weight": w},
                          {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "Dos."}]}
            for w in (0, 1)]
    cache = run_locally(_options([write_jsonl(tmp_path / "rows.jsonl", rows)], tmp_path / "cache",
                                 train_on="last_assistant"))
    table = pa.ipc.open_stream(str(next(cache.glob("data-*.arrow")))).read_all()
    excluded, included = (sum(mask) for mask in table.column("loss_mask").to_pylist())
    assert included > excluded > 0  # "Uno." is trained only where its weight is 1


def test_alpaca_system_and_history_columns_change_the_fingerprint(tmp_path):
    rows = [{"instruction": "Three?", "output": "Tres.", "sys": "Be brief.", "turns": [["One?", "Uno."]]}] * 3
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    fingerprints = {
        str(columns): plan_slices(_options([tmp_path / "rows.parquet"], tmp_path / "cache", format="alpaca",
                                           columns=columns)).inputs["columns"]
        for columns in ({}, {"system": "sys"}, {"system": "sys", "history": "turns"})}
    assert len(set(map(json.dumps, fingerprints.values()))) == 3, fingerprints


@pytest.fixture
def huge_first(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 3000}]}
    return write_jsonl(tmp_path / "huge.jsonl", [row]), len(json.dumps(row).encode())


def test_an_only_row_over_max_row_bytes_is_named_by_its_line(tmp_path, huge_first):
    path, size = huge_first
    with pytest.raises(BadInput) as error:
        run_locally(_options([path], tmp_path / "cache", max_row_bytes="1KB"))
    assert str(error.value) == (f"{path}:1: the row is {size:,} bytes, over the 1,000-byte limit (--max-row-bytes; "
                                "--on-bad-row skip drops such rows)")
    # Skipping, the format cannot be told from it: the line says so, and naming the format counts the skip.
    with pytest.raises(BadInput) as error:
        run_locally(_options([path], tmp_path / "cache", max_row_bytes="1KB", on_bad_row="skip"))
    assert str(error.value).startswith(f"{path}:1: the row is {size:,} bytes, over the 1,000-byte limit")
    assert "pass --format to count them as skipped rows" in str(error.value)
    with pytest.raises(BadInput, match=r"no row has a trained token: 1 rows dropped \(row_too_large: 1\)"):
        run_locally(_options([path], tmp_path / "cache", max_row_bytes="1KB", on_bad_row="skip", format="chat"))


def test_a_file_of_one_row_over_max_row_bytes_among_others_is_a_counted_skip(tmp_path, huge_first):
    path, _ = huge_first
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": [{"role": "user", "content": f"Hi {n}"},
                                                               {"role": "assistant", "content": "Hello."}]}
                                                 for n in range(5)])
    cache = run_locally(_options([path, good], tmp_path / "cache", max_row_bytes="1KB", on_bad_row="skip"))
    manifest = read_manifest(cache)
    assert manifest["rows"] == 5 and manifest["dropped"] == {"row_too_large": 1}
