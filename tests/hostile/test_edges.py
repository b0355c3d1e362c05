"""Option values at their edges and odd cells: each refused in one line naming the flag and its range (exit 2,
before Prefect starts), or the right cache: `--shard-size 1` cuts a slice per row and builds the same rows, and a
`messages` column of JSON text reads as the list it spells."""

from __future__ import annotations

import csv
import json

import pytest
from support.caches import published_caches
from support.cli import assert_rejected, cli
from support.data import example_rows
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import build_cache, run_locally
from sft_tokenize.build.shard import tokenize_slice
from sft_tokenize.errors import BadInput
from sft_tokenize.read.cache import TokenizedCache


def _options(sources, root, **extra) -> TokenizeOptions:
    return TokenizeOptions(sources=[str(s) for s in sources], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(root),
                           **extra)


@pytest.mark.parametrize(("args", "expected"), [
    (["run", str(EXAMPLE_DATA), "--max-length", "0"], "--max-length: must be at least 1, got 0"),
    (["run", str(EXAMPLE_DATA), "--workers", "0"], "--workers: must be at least 1, got 0"),
    (["run", str(EXAMPLE_DATA), "--shard-size", "0"], "--shard-size"),
])
def test_run_options_at_zero_are_refused_naming_the_flag(tmp_path, args, expected, cli_home):
    result = cli(*args, "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(tmp_path / "cache"),
                 home=cli_home)
    assert_rejected(result, expected)
    assert not (cli_home / "prefect.db").exists()  # refused before any Prefect server started
    assert published_caches(tmp_path / "cache") == []


@pytest.mark.parametrize(("args", "expected"), [
    (["pack", "{cache}", "--length", "0"], "--length: must be at least 1, got 0"),
    (["inspect", "{cache}", "--row", "-1"], "no row -1: the cache has 240 rows (0 to 239)"),
    (["inspect", "{cache}", "--row", "240"], "no row 240: the cache has 240 rows (0 to 239)"),
])
def test_read_side_options_at_their_edges_are_refused_naming_the_range(example_cache, args, expected, cli_home):
    result = cli(*(a.format(cache=example_cache) for a in args), home=cli_home)
    assert_rejected(result, expected)
    assert not list(example_cache.parent.glob(f"{example_cache.name}/packing*"))


def test_a_shard_size_of_one_byte_cuts_a_slice_per_row_and_builds_the_same_rows(tmp_path, example_cache):
    options = _options([EXAMPLE_DATA], tmp_path / "cache", shard_size="1")
    assert len(plan_slices(options).slices) == 240  # the smallest slice is one row, whatever the size asked
    tiny = TokenizedCache(run_locally(options))
    whole = TokenizedCache(example_cache)
    assert tiny.fingerprint == whole.fingerprint  # the slicing is not what a cache is
    for column in ("input_ids", "loss_mask"):
        assert tiny.table[column].to_pylist() == whole.table[column].to_pylist()


def test_a_messages_column_of_json_text_reads_as_the_list_it_spells(tmp_path):
    rows = example_rows()[:20]
    as_lists, as_text = tmp_path / "lists" / "rows.jsonl", tmp_path / "text" / "rows.jsonl"
    for path, encode in ((as_lists, lambda m: m), (as_text, json.dumps)):
        path.parent.mkdir()
        path.write_text("".join(json.dumps({"messages": encode(r["messages"])}) + "\n" for r in rows))
    text_cache = run_locally(_options([as_text], tmp_path / "cache"))
    list_cache = run_locally(_options([as_lists], tmp_path / "cache"))
    for column in ("input_ids", "loss_mask"):
        assert TokenizedCache(text_cache).table[column].to_pylist() == \
            TokenizedCache(list_cache).table[column].to_pylist()
    assert len(TokenizedCache(text_cache)) == 20


def test_a_messages_cell_of_bad_json_text_is_a_row_error_naming_its_line(tmp_path):
    rows = example_rows()[:3]
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps({"messages": json.dumps(r["messages"])}) for r in rows]
    lines[1] = json.dumps({"messages": json.dumps(rows[1]["messages"])[:-5]})  # cut short: not JSON
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BadInput, match=rf"^{path}:2: 'messages' is a string that is not the JSON of a message list"):
        run_locally(_options([path], tmp_path / "cache"))


@pytest.mark.slow  # 20,000 files written, planned and tokenized: seconds of CPU
def test_twenty_thousand_one_row_files_are_a_few_slices_holding_every_row_in_order(tmp_path):
    def row(i: int) -> dict:
        return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"{i}"}]}

    data = tmp_path / "many"
    data.mkdir()
    for i in range(20_000):
        (data / f"row-{i:05d}.jsonl").write_text(json.dumps(row(i)) + "\n")
    plan = plan_slices(_options([data], tmp_path / "cache"), min_slices=2)  # two workers' worth
    assert 2 <= len(plan.slices) <= 16  # small files are grouped: not a slice (a task, a shard) per file
    assert sum(len(s.parts) for s in plan.slices) == 20_000

    def one_after_another(plan, reused) -> None:  # as run_locally does, on this plan rather than another
        for slice_ in plan.slices:
            tokenize_slice(plan.job, slice_)

    cache = TokenizedCache(build_cache(plan, one_after_another).cache_path)
    assert len(cache) == 20_000
    ends = tmp_path / "ends.jsonl"  # the first and the last file's rows, tokenized on their own
    ends.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(19_999)) + "\n")
    expected = TokenizedCache(run_locally(_options([ends], tmp_path / "ends-cache")))
    assert [cache[0]["input_ids"].tolist(), cache[19_999]["input_ids"].tolist()] == \
        [expected[0]["input_ids"].tolist(), expected[1]["input_ids"].tolist()]


def test_a_csv_messages_cell_of_json_text_reads_as_its_list_and_bad_json_names_its_row(tmp_path):
    rows = example_rows()[:4]
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    for path, cut in ((good, None), (bad, 2)):
        with path.open("w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["messages"])
            for i, r in enumerate(rows):
                text = json.dumps(r["messages"])
                writer.writerow([text[:-3] if i == cut else text])
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    from_csv = TokenizedCache(run_locally(_options([good], tmp_path / "cache")))
    from_jsonl = TokenizedCache(run_locally(_options([jsonl], tmp_path / "cache")))
    assert from_csv.table["input_ids"].to_pylist() == from_jsonl.table["input_ids"].to_pylist()
    with pytest.raises(BadInput, match=rf"^{bad}:\d+: 'messages' is a string that is not the JSON of a message list "
                                       r"\(.+char"):
        run_locally(_options([bad], tmp_path / "cache"))
