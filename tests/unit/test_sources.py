"""Sources: every format reads the same rows, slices cover the input exactly once, errors name the place."""

from __future__ import annotations

import gzip
import json

import datasets
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_DATA

from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.flows.report import describe_slice
from sft_tokenize.sources.conversations import resolve_columns, to_example
from sft_tokenize.sources.formats.format_reader import READ_BATCH_BYTES, READ_BATCH_ROWS, FormatReader
from sft_tokenize.sources.formats.jsonl_reader import JsonLinesReader
from sft_tokenize.sources.formats.table import FORMATS, Format
from sft_tokenize.sources.readers import joined, read_slice
from sft_tokenize.sources.resolve import resolve
from sft_tokenize.sources.slicing import cut_slices


def rows_of(files, target=1 << 30, columns=("messages",)):
    out = []
    for slice_ in cut_slices(files, target):
        for rows, _, _ in read_slice(slice_, list(columns)):
            out += rows
    return out


@pytest.fixture(scope="module")
def rows():
    return example_rows()


@pytest.mark.parametrize("target", [1, 5_000, 37_000, 100_000, 1 << 30])
def test_jsonl_slices_cover_every_line_once_in_order(rows, target):
    files = resolve([str(EXAMPLE_DATA)])
    slices = cut_slices(files, target)
    got = rows_of(files, target)
    assert got == rows
    # Cut points fall on line starts, so every part of a JSONL file begins a line.
    for slice_ in slices:
        for part in slice_.parts:
            if part.start:
                with open(part.url, "rb") as f:
                    f.seek(part.start - 1)
                    assert f.read(1) == b"\n"


def test_slices_are_balanced_by_bytes():
    files = resolve([str(EXAMPLE_DATA)])
    total = sum(f.size for f in files)
    slices = cut_slices(files, total // 5)
    assert 5 <= len(slices) <= 6
    assert max(s.nbytes for s in slices[:-1]) < 1.2 * (total // 5)


def test_a_jsonl_slice_reads_only_its_byte_range(tmp_path, rows):
    """A broken first half does not stop a slice of the second half: the slice never decoded it."""
    path = write_jsonl(tmp_path / "half.jsonl", ["{broken json"] * 50 + [json.dumps(r) for r in rows[:50]])
    files = resolve([str(path)])
    slices = cut_slices(files, files[0].size // 2)
    last = slices[-1]
    got = [r for batch, _, _ in read_slice(last, ["messages"]) for r in batch]
    assert got and all(isinstance(r, dict) for r in got)
    first = [r for batch, _, _ in read_slice(slices[0], ["messages"]) for r in batch]
    assert any(isinstance(r, BadRow) for r in first)


def test_small_files_batches_are_joined_within_the_bounds_and_each_row_keeps_its_file_and_line(tmp_path, rows):
    # A file of a batch and a half, 300 files of 1-3 lines (the 200th's second line broken), and three files
    # whose lines are a third of the byte bound each.
    lines = [json.dumps(r) for r in rows]
    for i in range(300):
        write_jsonl(tmp_path / f"small-{i:03d}.jsonl", lines[i % 200:i % 200 + 1 + i % 3])
    (tmp_path / "small-199.jsonl").write_text(lines[0] + "\n{broken\n")
    write_jsonl(tmp_path / "middle.jsonl", (lines * 2)[:READ_BATCH_ROWS * 3 // 2])
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (READ_BATCH_BYTES // 3)}]})
    for i in range(3):
        write_jsonl(tmp_path / f"tall-{i}.jsonl", [big])
    (slice_,) = cut_slices(resolve([str(tmp_path)]), 1 << 30)
    read = list(read_slice(slice_, ["messages"], raw=True))
    batches = list(joined(read_slice(slice_, ["messages"], raw=True)))
    assert [row for batch, _ in batches for row in batch] == [row for batch, _, _ in read for row in batch]
    assert len(batches) < len(read) / 50
    for batch, _ in batches:
        assert len(batch) <= READ_BATCH_ROWS
        assert sum(len(row) for row in batch if isinstance(row, bytes)) <= READ_BATCH_BYTES
    tall = [sum(len(row) > READ_BATCH_BYTES // 4 for row in batch) for batch, _ in batches[-2:]]
    assert tall == [2, 1] and len(batches[-1][0]) == 1  # the third tall line would pass the byte bound
    where = [locate(i) for batch, locate in batches for i in range(len(batch))]
    assert where == [locate(i) for batch, locate, _ in read for i in range(len(batch))]
    bad = [locate(i) for batch, locate in batches for i, row in enumerate(batch) if row.startswith(b"{broken")]
    assert bad == [f"{tmp_path}/small-199.jsonl:2"]
    # A batch at a bound goes at once: the first (middle.jsonl's first 256 lines) before the next one is read.
    pulled = []

    def counted():
        for batch in read_slice(slice_, ["messages"], raw=True):
            pulled.append(batch)
            yield batch

    first = next(joined(counted()))
    assert len(first[0]) == READ_BATCH_ROWS and len(pulled) == 1


def test_every_format_reads_the_same_rows(tmp_path, rows):
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=17)
    (tmp_path / "rows.json").write_text(json.dumps(rows, ensure_ascii=False))
    with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=33):
            writer.write_batch(batch)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), max_shard_size="50KB")
    write_jsonl(tmp_path / "hubdir" / "train.jsonl", rows)
    for spec in ["rows.parquet", "rows.json", "rows.arrow", "saved"]:
        files = resolve([str(tmp_path / spec)])
        for target in (1, 20_000, 1 << 30):
            assert rows_of(files, target) == rows, (spec, target)
    # A hub name goes through datasets.load_dataset; a local dataset directory stands in for the hub here.
    files = resolve([f"hub:{tmp_path / 'hubdir'}"], split="train")
    assert {f.kind for f in files} == {"arrow"} and rows_of(files, 20_000) == rows


def test_a_format_is_its_reader_and_one_row_of_the_table(tmp_path, rows, monkeypatch):
    """Resolving finds a format by the table's suffixes, a slice reads it with the table's reader, a compressed
    file is refused as the table says, and a run's report names a part in the table's unit."""
    assert all(issubclass(row.reader, FormatReader) and row.suffixes for row in FORMATS.values())
    monkeypatch.setitem(FORMATS, "lines", Format("lines", (".lines",), JsonLinesReader, compressible=False,
                                                 unit=("line byte", "line bytes")))
    write_jsonl(tmp_path / "rows.lines", rows)
    files = resolve([str(tmp_path / "rows.lines")])
    assert [f.kind for f in files] == ["lines"]
    assert rows_of(files, 20_000) == rows
    assert describe_slice(cut_slices(files, 20_000)[0]).startswith(f"{files[0].url} (line bytes 0-")
    (tmp_path / "rows.lines.gz").write_bytes(gzip.compress((tmp_path / "rows.lines").read_bytes()))
    with pytest.raises(BadInput, match=r"rows\.lines\.gz: \.lines files cannot be read compressed"):
        resolve([str(tmp_path / "rows.lines.gz")])
    with pytest.raises(BadInput, match=r"supported: .*\.lines.*except \.parquet and \.arrow and \.lines$"):
        resolve([str(write_jsonl(tmp_path / "rows.txt", rows))])


def test_parquet_slices_are_row_groups(tmp_path, rows):
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=40)
    files = resolve([str(tmp_path / "rows.parquet")])
    slices = cut_slices(files, 1)
    assert [(p.start, p.stop) for s in slices for p in s.parts] == [(g, g + 1) for g in range(6)]


def test_csv_alpaca_rows(tmp_path):
    path = tmp_path / "alpaca.csv"
    pa_csv.write_csv(pa.table({"instruction": ["Add", "Sub"], "input": ["1 2", ""], "output": ["3", "0"]}), path)
    files = resolve([str(path)])
    columns = resolve_columns("auto", {}, ["instruction", "input", "output"], str(path))
    assert columns.format == "alpaca"
    got = [to_example(r, columns) for r in rows_of(files, columns=columns.names)]
    assert got[0].messages == [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}]
    assert got[1].messages[0]["content"] == "Sub"


def test_globs_and_directories_are_sorted(tmp_path, rows):
    write_jsonl(tmp_path / "b.jsonl", rows[:3])
    write_jsonl(tmp_path / "a.jsonl", rows[3:5])
    (tmp_path / "notes.md").write_text("not data")
    assert [f.url.rsplit("/", 1)[1] for f in resolve([str(tmp_path)])] == ["a.jsonl", "b.jsonl"]
    assert [f.url.rsplit("/", 1)[1] for f in resolve([str(tmp_path / "*.jsonl")])] == ["a.jsonl", "b.jsonl"]


@pytest.mark.parametrize(("setup", "message"), [
    (lambda d: str(d / "missing.jsonl"), "no such file: {d}/missing.jsonl"),
    (lambda d: str((d / "empty.jsonl").touch() or d / "empty.jsonl"), "{d}/empty.jsonl: the file is empty"),
    (lambda d: str((d / "x.txt").write_text("hi") and d / "x.txt"), "{d}/x.txt: unknown file format '.txt'"),
    (lambda d: str(d / "*.nothing"), "no files match {d}/*.nothing"),
])
def test_missing_and_unknown_files_are_named(tmp_path, setup, message):
    with pytest.raises(BadInput) as error:
        resolve([setup(tmp_path)])
    assert str(error.value).startswith(message.format(d=tmp_path))


def test_a_json_file_must_be_an_array(tmp_path):
    (tmp_path / "obj.json").write_text('"just a string"')
    [source] = resolve([str(tmp_path / "obj.json")])
    with pytest.raises(BadInput, match="obj.json: a .json file must hold an array of objects"):
        rows_of([source])


def test_corrupt_parquet_is_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 100)
    [source] = resolve([str(tmp_path / "bad.parquet")])
    with pytest.raises(BadInput, match="bad.parquet: not a readable Parquet file"):
        rows_of([source])


@pytest.mark.parametrize(("row", "reason", "detail"), [
    ({"messages": 3}, "bad_messages", "'messages' must be a list of messages, got int"),
    ({"messages": "hi"}, "bad_messages", "'messages' is a string that is not the JSON of a message list"),
    ({"messages": '{"role": "user"}'}, "bad_messages", "'messages' holds JSON text of dict, not a message list"),
    ({"messages": [{"content": "x"}]}, "bad_message", "messages[0] has no 'role'"),
    ({"messages": [{"role": "user"}]}, "bad_message", "messages[0] has no 'content'"),
    ({"messages": [{"role": "user", "content": 3}]}, "bad_message", 
     "messages[0].content must be a string or a list of text parts, got int"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown_role", "messages[0] has unknown role 'wizard'"),
    ({"messages": []}, "bad_messages", "'messages' is an empty list"),
])
def test_row_errors_say_what_is_wrong(row, reason, detail):
    columns = resolve_columns("chat", {}, ["messages"], "f")
    with pytest.raises(BadRow) as error:
        to_example(row, columns)
    assert error.value.reason == reason and str(error.value).startswith(detail)


def test_sharegpt_conversations_are_understood():
    columns = resolve_columns("auto", {}, ["conversations"], "f")
    conv = to_example({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, columns)
    assert conv.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_a_system_prompt_is_given_to_the_conversations_that_have_none():
    prompt = {"role": "system", "content": "Be brief."}
    chat = resolve_columns("chat", {}, ["messages", "system"], "f")
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
    assert to_example({"messages": own}, chat, "Be brief.").messages == own
    assert to_example({"messages": own[1:], "system": "Col."}, chat, "Be brief.").messages[0]["content"] == "Col."
    assert to_example({"messages": own[1:]}, chat, "Be brief.").messages == [prompt, own[1]]
    alpaca = to_example({"instruction": "Do.", "output": "Done."},
                        resolve_columns("alpaca", {}, ["instruction", "output"], "f"), "Be brief.")
    assert alpaca.messages[0] == prompt and alpaca.messages[alpaca.completion_start]["content"] == "Done."


def test_format_detection_says_when_it_cannot():
    with pytest.raises(BadInput, match="cannot tell the format from the columns"):
        resolve_columns("auto", {}, ["foo", "bar"], "data.jsonl")
    with pytest.raises(BadInput, match="missing column 'dialog' for format chat"):
        resolve_columns("chat", {"messages": "dialog"}, ["messages"], "data.jsonl")


@pytest.mark.parametrize("line", [3, 60_000])  # in the first block, which opening parses, and far past it
def test_a_ragged_csv_row_is_a_bad_row_at_its_line_and_the_others_are_read(tmp_path, line):
    lines = ["prompt,completion"] + [f"question {n},answer {n}" for n in range(2, 70_000)]  # line n holds row n
    lines[line - 1] = "a,b,c"
    (tmp_path / "rows.csv").write_text("\n".join(lines) + "\n")
    [source] = resolve([str(tmp_path / "rows.csv")])
    found = []
    for slice_ in cut_slices([source], 1 << 30):
        for batch, locate, _ in read_slice(slice_, ["prompt", "completion"]):
            found += [(row, locate(i)) for i, row in enumerate(batch)]
    bad = [(row, where) for row, where in found if isinstance(row, BadRow)]
    assert [(row.reason, row.detail, where) for row, where in bad] == [
        ("ragged_csv", "3 fields where the header has 2", f"{tmp_path}/rows.csv:{line}")]
    good = {row["prompt"]: where for row, where in found if not isinstance(row, BadRow)}
    assert len(good) == len(lines) - 2
    # Every other row is located at its own line, before the ragged one and after it.
    assert all(where == f"{tmp_path}/rows.csv:{prompt.split()[1]}" for prompt, where in good.items())


def test_a_source_url_of_an_unknown_protocol_is_one_line_naming_it():
    with pytest.raises(BadInput, match=r"^foo://x/y\.jsonl: cannot read it \(ValueError: Protocol not known: foo\)$"):
        resolve(["foo://x/y.jsonl"])
