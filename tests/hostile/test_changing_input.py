"""An input file appended to, truncated or replaced while it is being tokenized: a slice whose bytes changed
fails with one line naming the file and its sizes (never a shard of mixed rows, nor a misleading bad row),
rows appended past a JSONL slice leave the planned cache right, and a rerun once the file stays put equals a
clean build. Data plane only: the change happens between two slices of a build, or inside one slice's read."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.caches import contents, data_files
from support.data import example_rows
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build import shard
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import Plan, plan_slices
from sft_tokenize.build.protocol import build_cache, run_locally
from sft_tokenize.build.shard import tokenize_slice
from sft_tokenize.errors import BadInput
from sft_tokenize.sources.formats import jsonl_reader

FIRST = EXAMPLE_DATA / "chat-00000.jsonl"  # 212,963 bytes: slices [0, 100180) and [100180, 212963) at 100KB


def options(source: Path, cache: Path) -> TokenizeOptions:
    return TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(cache),
                           name="changing", shard_size="100KB")


def build_changing(source: Path, cache: Path, change: Callable[[], None]) -> Path:
    """Build the source's cache, `change` applied after the first slice is tokenized and before the second."""
    def tokenize(plan: Plan, reused: set[int]) -> None:
        assert len(plan.slices) >= 2
        for slice_ in plan.slices:
            if slice_.index == 1:
                change()
            tokenize_slice(plan.job, slice_)

    return build_cache(plan_slices(options(source, cache)), tokenize).cache_path


def assert_nothing_published(cache: Path) -> None:
    assert not [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert not list((cache / ".shards").glob("*.tmp-*"))


def assert_rerun_is_clean(source: Path, cache: Path, tmp_path: Path) -> None:
    """The cause gone (the file stays as it is now), the same build succeeds and equals a clean one."""
    assert contents(run_locally(options(source, cache))) == contents(run_locally(options(source, tmp_path / "clean")))


def line_start_after(data: bytes, offset: int) -> int:
    return data.index(b"\n", offset) + 1


@pytest.fixture
def jsonl(tmp_path) -> Path:
    return Path(shutil.copy(FIRST, tmp_path / "chat.jsonl"))


def test_rows_appended_past_the_slices_leave_the_planned_cache_right(jsonl, tmp_path):
    original = data_files(run_locally(options(Path(shutil.copy(FIRST, tmp_path / "copy.jsonl")), tmp_path / "a")))
    cache = tmp_path / "cache"
    more = b"".join(line + b"\n" for line in FIRST.read_bytes().splitlines()[:5])
    path = build_changing(jsonl, cache, lambda: jsonl.open("ab").write(more))
    assert data_files(path) == original  # the bytes the plan cut, not a mix with the appended rows
    assert_rerun_is_clean(jsonl, cache, tmp_path)  # a new version, with the appended rows


def truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:line_start_after(data, 150_000)])


def replaced(path: Path) -> None:
    """Another file of the same size renamed over it (its lines in reverse order)."""
    lines = path.read_bytes().splitlines(keepends=True)
    new = path.with_name("new.jsonl")
    new.write_bytes(b"".join(reversed(lines)))
    os.replace(new, path)


def rewritten_longer(path: Path) -> None:
    """Rewritten in place with a row changed inside the second slice, and longer: its size grew as an append's would."""
    data = path.read_bytes()
    at = line_start_after(data, 150_000)
    path.write_bytes(data[:at] + data[at:].replace(b'"content": "', b'"content": "EDITED ', 1))


CHANGES = {
    "truncated": (truncated, "(size 212,963 → 151,464 bytes)"),
    "replaced": (replaced, "(size 212,963 bytes, rewritten)"),
    "rewritten-longer": (rewritten_longer, "(size 212,963 → 212,970 bytes)"),
    "deleted": (os.remove, "(size 212,963 bytes → deleted)"),
}


@pytest.mark.parametrize("case", CHANGES)
def test_a_file_changed_between_two_slices_fails_the_slice_naming_it(jsonl, tmp_path, case):
    change, sizes = CHANGES[case]
    cache = tmp_path / "cache"
    with pytest.raises(BadInput) as raised:
        build_changing(jsonl, cache, lambda: change(jsonl))
    message = str(raised.value)
    assert message.startswith(f"{jsonl}: changed while it was being tokenized ") and message.endswith("; run again")
    assert sizes in message and "\n" not in message
    assert_nothing_published(cache)
    if jsonl.exists():
        assert_rerun_is_clean(jsonl, cache, tmp_path)


def test_a_file_cut_short_inside_a_slices_read_is_named_not_blamed_on_a_row(jsonl, tmp_path, monkeypatch):
    """Truncated mid-line while the slice reads it in small chunks: the reader meets a broken last line, which
    would be a malformed_json bad row; the error names the change instead."""
    monkeypatch.setattr(jsonl_reader, "READ_CHUNK_BYTES", 4096)  # the slice read a little at a time, in small batches:
    monkeypatch.setattr(jsonl_reader, "READ_BATCH_ROWS", 8)  # its first batch is out before most of its bytes are read
    real_read_slice = shard.read_slice

    def read_and_cut(slice_, *args, **kwargs):
        for n, batch in enumerate(real_read_slice(slice_, *args, **kwargs)):
            if n == 0 and slice_.index == 1:
                os.truncate(jsonl, 160_000)  # inside a line, inside this slice's range
            yield batch

    monkeypatch.setattr(shard, "read_slice", read_and_cut)
    cache = tmp_path / "cache"
    with pytest.raises(BadInput, match=r"chat.jsonl: changed while it was being tokenized \(size 212,963 → 160,000 "
                                       r"bytes\); run again$"):
        run_locally(options(jsonl, cache))
    assert_nothing_published(cache)


def test_a_parquet_file_replaced_between_two_slices_fails_the_slice(tmp_path):
    source = tmp_path / "chat.parquet"
    table = pa.Table.from_pylist(example_rows())  # 240 rows, over 100KB: cut at its row groups
    pq.write_table(table, source, row_group_size=40)
    cache = tmp_path / "cache"

    def replace() -> None:
        pq.write_table(table.slice(0, 200), tmp_path / "new.parquet", row_group_size=40)
        os.replace(tmp_path / "new.parquet", source)

    with pytest.raises(BadInput, match=r"chat.parquet: changed while it was being tokenized \(size [\d,]+ → [\d,]+ "
                                       r"bytes\); run again$"):
        build_changing(source, cache, replace)
    assert_nothing_published(cache)
    assert_rerun_is_clean(source, cache, tmp_path)
