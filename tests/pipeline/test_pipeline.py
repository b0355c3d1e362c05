"""The data plane end to end: plan → tokenize_slice → publish, without Prefect."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from support.data import example_rows, write_jsonl
from support.edge_merges import build_edge_merging_tokenizer
from support.mask_oracle import oracle
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.publish import publish_cache
from sft_tokenize.build.shard import tokenize_slice
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.errors import BadInput, CacheError
from sft_tokenize.read.cache import open_cache


def options(tmp_path, **overrides) -> TokenizeOptions:
    base = {"sources": [str(EXAMPLE_DATA)], "tokenizer": str(EXAMPLE_TOKENIZER), "cache_dir": str(tmp_path / "cache")}
    return TokenizeOptions(**{**base, **overrides})


def cache_rows(path) -> list[tuple[list[int], list[int]]]:
    table = datasets.load_from_disk(str(path))
    return list(zip(table["input_ids"], table["loss_mask"], strict=True))


@pytest.fixture(scope="module")
def reference():
    """Materialize everything: datasets reads every row, the oracle tokenizes and masks each one."""
    tokenizer = load_tokenizer(EXAMPLE_TOKENIZER)
    files = sorted(str(p) for p in EXAMPLE_DATA.glob("*.jsonl"))
    table = datasets.load_dataset("json", data_files=files, split="train")
    return [oracle(tokenizer, row["messages"]) for row in table]


@pytest.mark.parametrize(("shard_size", "slices"), [("1GB", 1), ("60KB", 6), ("7KB", 49)])
def test_any_slice_count_gives_the_reference_rows(tmp_path, reference, shard_size, slices):
    # Two files of 213 kB and 127 kB: under 1GB they are one group; smaller targets cut each file on its own.
    opts = options(tmp_path, shard_size=shard_size)
    assert len(plan_slices(opts).slices) == slices
    path = run_locally(opts)
    assert cache_rows(path) == [tuple(r) for r in reference]


def test_writer_flush_boundaries_do_not_change_rows(tmp_path, reference):
    path = run_locally(options(tmp_path, writer_batch_rows=2))
    assert cache_rows(path) == [tuple(r) for r in reference]
    batches = sum(len(list(pa.ipc.open_stream(pa.memory_map(str(f))))) for f in sorted(path.glob("data-*.arrow")))
    assert batches == -(-len(reference) // 2)  # one record batch per two rows


def test_load_from_disk_and_open_cache_agree_and_meet_the_pretokenized_contract(tmp_path):
    path = run_locally(options(tmp_path, shard_size="60KB"))
    hf = datasets.load_from_disk(str(path))
    cache = open_cache(path)
    assert len(cache) == len(hf) == len(example_rows())
    assert hf.features["input_ids"].feature.dtype == "int32" and hf.features["loss_mask"].feature.dtype == "int8"
    for i in range(len(cache)):
        row = cache[i]
        assert row["input_ids"].tolist() == hf[i]["input_ids"] and row["loss_mask"].tolist() == hf[i]["loss_mask"]
        assert len(row["input_ids"]) == len(row["loss_mask"])
        assert set(np.unique(row["loss_mask"])) <= {0, 1} and row["loss_mask"].any()
    assert cache.lengths.tolist() == [len(x) for x in hf["input_ids"]]
    # Source order: the first row's text comes back first.
    tokenizer = load_tokenizer(EXAMPLE_TOKENIZER)
    assert example_rows()[0]["messages"][0]["content"] in tokenizer.decode(cache[0]["input_ids"])
    # It pickles as a path, and the manifest adds up.
    import pickle

    clone = pickle.loads(pickle.dumps(cache))
    assert len(pickle.dumps(cache)) < 500 and clone.path == cache.path and len(clone) == len(cache)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["rows"] == len(cache) and manifest["tokens"] == int(cache.lengths.sum())
    assert manifest["lengths"]["max"] == int(cache.lengths.max())
    assert manifest["lengths"]["p50"] == int(np.percentile(cache.lengths, 50, method="inverted_cdf"))


def test_publish_links_the_shards_and_reads_no_row(tmp_path):
    plan = plan_slices(options(tmp_path, shard_size="60KB"))
    for slice_ in plan.slices:
        tokenize_slice(plan.job, slice_)
    staged = {plan.job.shard_path(s).stat().st_ino for s in plan.slices}
    staged_bytes = sum(plan.job.shard_path(s).stat().st_size for s in plan.slices)
    before = _bytes_read()
    path = publish_cache(plan.job, plan.slices, plan.cache_path, plan.inputs, plan.name)
    read = _bytes_read() - before
    assert {f.stat().st_ino for f in path.glob("data-*.arrow")} == staged
    # Publishing reads sidecars and writes metadata; it never reads the shards' rows.
    assert read < staged_bytes / 4, (read, staged_bytes)
    assert not list(plan.staging.parent.glob("*.publish-*"))


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_finished_shards_are_reused_not_rewritten(tmp_path):
    plan = plan_slices(options(tmp_path, shard_size="60KB"))
    first = [tokenize_slice(plan.job, s) for s in plan.slices]
    stamps = [os.stat(plan.job.shard_path(s)) for s in plan.slices]
    assert [tokenize_slice(plan.job, s) for s in plan.slices] == first
    again = [os.stat(plan.job.shard_path(s)) for s in plan.slices]
    assert [(s.st_ino, s.st_mtime_ns) for s in stamps] == [(s.st_ino, s.st_mtime_ns) for s in again]
    # A shard truncated on disk is not "finished": it is rewritten.
    victim = plan.job.shard_path(plan.slices[1])
    victim.write_bytes(victim.read_bytes()[:100])
    assert tokenize_slice(plan.job, plan.slices[1]) == first[1]
    assert victim.stat().st_size == stamps[1].st_size


def test_a_second_run_is_a_cache_hit(tmp_path):
    path = run_locally(options(tmp_path))
    plan = plan_slices(options(tmp_path, shard_size="1KB"))
    assert plan.cached and plan.cache_path == path and plan.slices == []


def test_fingerprint_follows_what_changes_the_output(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(EXAMPLE_DATA, data)
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(EXAMPLE_TOKENIZER, tokenizer)
    template = tmp_path / "template.jinja"
    template.write_text((EXAMPLE_TOKENIZER / "chat_template.jinja").read_text() + "{# edited #}")

    def fp(**kw):
        return plan_slices(options(tmp_path, sources=[str(data)], tokenizer=str(tokenizer), **kw)).job.fingerprint

    base = fp()
    assert fp(shard_size="10KB") == base and fp(shard_size="1GB") == base, "slice count must not matter"
    assert fp(name="other") == base
    # A skip run may hold fewer rows than a raise run would accept: never the same cache.
    changed = {fp(max_length=128), fp(train_on="last_assistant"), fp(chat_template=str(template)),
               fp(extra_columns=["labels"]), fp(on_bad_row="skip")}
    assert base not in changed and len(changed) == 5
    config = tokenizer / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "padding_side": "left"}', 1))
    assert fp() != base
    shutil.copytree(EXAMPLE_TOKENIZER, tokenizer, dirs_exist_ok=True)
    assert fp() == base
    victim = data / "chat-00001.jsonl"
    text = victim.read_text()
    victim.write_text(text.replace("Dataset", "Datasets", 1))
    assert fp() != base


def test_extra_columns_on_request(tmp_path):
    path = run_locally(options(tmp_path, extra_columns=["labels", "attention_mask"]))
    row = datasets.load_from_disk(str(path))[3]
    expected = [t if m else -100 for t, m in zip(row["input_ids"], row["loss_mask"], strict=True)]
    assert row["labels"] == expected and row["attention_mask"] == [1] * len(row["input_ids"])


def test_every_row_dropped_is_an_error_and_publishes_nothing(tmp_path):
    data = write_jsonl(tmp_path / "questions.jsonl",
                       [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(5)])
    opts = options(tmp_path, sources=[str(data)])
    with pytest.raises(BadInput, match=r"no row has a trained token: 5 rows dropped \(no_assistant_turn: 5\)"):
        run_locally(opts)
    assert not [p for p in Path(opts.cache_dir).iterdir() if not p.name.startswith(".")]


def test_a_slice_with_no_row_leaves_a_readable_empty_shard(tmp_path):
    rows = example_rows()[:20]
    only_questions = [{"messages": [{"role": "user", "content": "q"}]}] * 200
    data = write_jsonl(tmp_path / "mixed.jsonl", only_questions + rows)
    plan = plan_slices(options(tmp_path, sources=[str(data)], shard_size="2KB"))
    counts = [tokenize_slice(plan.job, s) for s in plan.slices]
    assert counts[0] == 0 and sum(counts) == 20
    empty = pa.ipc.open_stream(pa.memory_map(str(plan.job.shard_path(plan.slices[0])))).read_all()
    assert empty.num_rows == 0 and empty.column_names == ["input_ids", "loss_mask"]
    path = publish_cache(plan.job, plan.slices, plan.cache_path, plan.inputs, plan.name)
    assert len(open_cache(path)) == 20
    assert json.loads((path / "manifest.json").read_text())["dropped"] == {"no_assistant_turn": 200}


def test_bad_rows_are_named_or_counted(tmp_path):
    rows = [json.dumps(r) for r in example_rows()[:30]]
    rows[12] = '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 7}]}'
    rows[21] = '{"messages": [oops'
    rows[25] = '{"messages": [{"role": "narrator", "content": "x"}]}'
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    opts = options(tmp_path, sources=[str(data)], shard_size="4KB")
    with pytest.raises(BadInput) as error:
        run_locally(opts)
    assert str(error.value) == f"{data}:13: messages[1].content must be a string or a list of text parts, got int"
    assert not list(Path(opts.cache_dir).glob("bad-*"))
    rows[12] = rows[0]
    write_jsonl(data, rows)
    with pytest.raises(BadInput, match=rf"^{data}:22: not valid JSON: Expecting value \(column 15\)$"):
        run_locally(options(tmp_path, sources=[str(data)], shard_size="4KB"))
    rows[12] = '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 7}]}'
    write_jsonl(data, rows)
    path = run_locally(options(tmp_path, sources=[str(data)], shard_size="4KB", on_bad_row="skip"))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["rows"] == 27
    assert manifest["dropped"] == {"bad_message": 1, "malformed_json": 1, "unknown_role": 1}


def test_not_utf8_is_named(tmp_path):
    data = tmp_path / "latin1.jsonl"
    good = json.dumps(example_rows()[0]).encode()
    head = '{"messages": [{"role": "user", "content": "caf'
    data.write_bytes(good + b"\n" + (head + '\xe9"}]}').encode("latin-1") + b"\n")
    with pytest.raises(BadInput, match=rf"^{data}:2: not valid UTF-8 \(byte 0xe9 at column {len(head) + 1}\)$"):
        run_locally(options(tmp_path, sources=[str(data)]))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tokenizer": "/nonexistent/tokenizer"}, "tokenizer directory not found: /nonexistent/tokenizer"),
    ({"max_length": 5}, "--max-length 5 leaves no room for content"),
    ({"format": "text"}, "missing column 'text' for format text"),
    ({"train_on": "all", "format": "chat", "columns": {"messages": "turns"}}, "missing column 'turns'"),
])
def test_plan_rejects_bad_options_before_tokenizing(tmp_path, overrides, message):
    with pytest.raises(BadInput, match=message):
        plan_slices(options(tmp_path, **overrides))


def test_a_tokenizer_without_a_chat_template_cannot_do_chat(tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(EXAMPLE_TOKENIZER, bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(BadInput, match="has no chat template"):
        plan_slices(options(tmp_path, tokenizer=str(bare)))


def test_a_cache_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match="exists and is not a directory"):
        plan_slices(options(tmp_path, cache_dir=str(tmp_path / "file")))


def test_open_cache_refuses_a_truncated_data_file(tmp_path):
    path = run_locally(options(tmp_path, shard_size="60KB"))
    victim = sorted(path.glob("data-*.arrow"))[1]
    victim.write_bytes(victim.read_bytes()[:-100])
    corrupt = rf"{victim.name}: \d+ bytes, the manifest says \d+ bytes: the cache is corrupt"
    with pytest.raises(CacheError, match=corrupt):
        open_cache(path)
    # The next run does not serve it: it rebuilds it.
    assert not plan_slices(options(tmp_path)).cached
    assert len(open_cache(run_locally(options(tmp_path)))) == len(example_rows())


# -- memory ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_rows(tmp_path_factory) -> Path:
    """60k rows of 161 words: 9.8M tokens, whose ids and mask alone would take 49 MB held at once."""
    path = tmp_path_factory.mktemp("big") / "rows.jsonl"
    words = ["cache", "token", "arrow", "shard", "slice", "flow", "mask", "batch", "retry", "stream"]
    with path.open("w") as out:
        for i in range(60_000):
            text = " ".join(words[(i * k) % 10] for k in range(1, 161))
            out.write(json.dumps({"text": f"{i} {text}"}) + "\n")
    return path


# In a process of its own: tracemalloc counts every thread's allocations, and a pytest worker's other threads
# (Prefect's, pytest-xdist's) would add theirs to the peak.
STREAMING_PEAK = """
import json, sys, tracemalloc
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.shard import tokenize_slice
from sft_tokenize.build.workers import encoder_for

plan = plan_slices(TokenizeOptions(**json.loads(sys.argv[1])))
encoder_for(plan.job)  # the tokenizer is loaded outside the measurement
tracemalloc.start()
rows = tokenize_slice(plan.job, plan.slices[0])
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"slices": len(plan.slices), "rows": rows, "peak": peak,
                  "sidecar": str(plan.job.shard_path(plan.slices[0]).with_suffix(".json"))}))
"""


@pytest.mark.slow  # 10M tokens under tracemalloc: about 13 s of a core
def test_memory_is_bounded_by_the_writer_batch(tmp_path, many_rows):
    """One slice of 60k long rows: the writer never holds more than its batch, and the peak Python allocation
    stays far below what holding every row costs (at least its ids and mask, 5 bytes a token)."""
    settings = {"sources": [str(many_rows)], "tokenizer": str(EXAMPLE_TOKENIZER), "cache_dir": str(tmp_path / "cache"),
                "format": "text", "train_on": "all", "writer_batch_rows": 1000}
    measured = subprocess.run([sys.executable, "-c", STREAMING_PEAK, json.dumps(settings)], capture_output=True,
                              text=True, timeout=300)
    assert measured.returncode == 0, measured.stderr
    result = json.loads(measured.stdout.splitlines()[-1])
    sidecar = json.loads(Path(result["sidecar"]).read_text())
    assert (result["slices"], result["rows"]) == (1, 60_000) and sidecar["max_buffered_rows"] <= 1000
    materialized_floor = sidecar["tokens"] * 5
    assert materialized_floor > 32 << 20
    assert result["peak"] < materialized_floor / 3, (result["peak"], materialized_floor)


def test_small_inputs_still_give_every_worker_a_slice(tmp_path):
    assert len(plan_slices(options(tmp_path)).slices) == 1  # 340 kB under the default 256MB slices
    # The target halves until 4 of it fit in 340 kB (62.5 kB), so it stays put while the input grows.
    assert len(plan_slices(options(tmp_path), min_slices=4).slices) == 6


def test_a_column_missing_from_the_first_jsonl_row_is_read_on_later_rows(tmp_path, family_tokenizer):
    """JSON lines have no schema: `tools` absent on row 1 and present on row 2 still reaches the template."""
    tool = {"type": "function", "function": {"name": "lookup_word", "description": "Look a word up.",
                                             "parameters": {"type": "object", "properties": {}}}}
    chat = [{"role": "user", "content": "Define cat."}, {"role": "assistant", "content": "A small feline."}]
    data = write_jsonl(tmp_path / "in" / "chat.jsonl", [{"messages": chat}, {"messages": chat, "tools": [tool]}])
    path = run_locally(options(tmp_path, sources=[str(data)], tokenizer=str(family_tokenizer("qwen2.5-instruct"))))
    tokenizer = load_tokenizer(family_tokenizer("qwen2.5-instruct"))
    first, second = (tokenizer.decode(ids) for ids, _ in cache_rows(path))
    assert "lookup_word" not in first and "lookup_word" in second


def test_the_manifest_counts_how_masks_were_made(tmp_path, family_tokenizer):
    rows = [{"messages": [{"role": "user", "content": "Echo <|im_end|>"},
                          {"role": "assistant", "content": "<|im_end|>"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    data = write_jsonl(tmp_path / "in" / "chat.jsonl", rows)
    # A broken template: only the replies, no roles, no turn ends, so every token of a row is trained.
    whole = "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    path = run_locally(options(tmp_path, sources=[str(data)], tokenizer=str(family_tokenizer("chatml"))))
    masks = json.loads((path / "manifest.json").read_text())["masks"]
    assert masks == {"rows_all_trained": 0, "rows_exact": 0, "rows_expanded": 0, "rows_special_text": 1,
                     "tokens_straddling": 0}
    broken = run_locally(options(tmp_path, sources=[str(data)], tokenizer=str(family_tokenizer("chatml")),
                                 chat_template=whole, special_text="keep"))
    assert json.loads((broken / "manifest.json").read_text())["masks"]["rows_all_trained"] == 2
    # A tokenizer that merges a space with the word after it: "Assistant: Hello." trains " H", which straddles
    # the turn's start; the answer "<|im_end|>" (kept as the control token) has none.
    colon = ("{% for m in messages %}{{ ('User: ' if m.role == 'user' else 'Assistant: ') + m.content + "
             "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")
    merging = build_edge_merging_tokenizer(tmp_path / "merging", colon)
    edges = run_locally(options(tmp_path, sources=[str(data)], tokenizer=str(merging), special_text="keep"))
    assert json.loads((edges / "manifest.json").read_text())["masks"]["tokens_straddling"] == 1
