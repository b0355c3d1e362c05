"""A slice's rows, read by each part's format reader and checked for changes before and after.

Each format is a module of sources/formats/ (format_reader.py says what a reader gives: columns, pieces, the
rows of one part in bounded batches), and formats/table.py the one table that names its reader:

    jsonl    jsonl_reader.py: byte ranges aligned to line starts; a slice seeks to its range and reads only it
    parquet  parquet_reader.py: row groups; a slice reads only its row groups and only the columns it needs
    arrow    arrow_reader.py: row ranges of Arrow IPC (stream or file) files, e.g. a `save_to_disk` directory
    json     json_reader.py (an array of objects) and csv_reader.py: whole files, one piece each

A compressed file is decompressed as it is read (compressed.py): it is one piece, read whole by one slice.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sft_tokenize.errors import BadInput, BadRow, Failed
from sft_tokenize.files import REQUEST_TIMEOUT, network_failure
from sft_tokenize.remote_requests import unanswered
from sft_tokenize.sources.conversations import ColumnMap, Conversation, to_example
from sft_tokenize.sources.formats.format_reader import READ_BATCH_BYTES, READ_BATCH_ROWS, FormatReader
from sft_tokenize.sources.formats.jsonl_reader import JsonLinesReader, parse_line
from sft_tokenize.sources.formats.table import FORMATS
from sft_tokenize.sources.records import Part, Slice, SourceFile, filesystem


def reader(source: SourceFile | Part, storage_options: dict | None = None,
           max_row_bytes: int | None = None, timeout: float = REQUEST_TIMEOUT) -> FormatReader:
    return FORMATS[source.kind].reader(source, storage_options, max_row_bytes, timeout)


def _change(part: Part, appended_ok: bool) -> str | None:
    """How a local part's file differs from its identity when planned ("size X → Y bytes"), or None. With
    `appended_ok`, a JSONL byte range that the file still holds is not a change: rows appended after it leave
    its bytes alone, and an edit inside it is caught when the slice's bytes are hashed again (shard.py)."""
    if len(part.identity) < 3 or part.identity[0] != "local":
        return None  # a remote object's version is in its key, which is checked after tokenizing
    planned_size, planned_mtime = part.identity[1:3]
    try:
        st = os.stat(part.url)
    except FileNotFoundError:
        return f"size {planned_size:,} bytes → deleted"
    if (st.st_size, st.st_mtime_ns) == (planned_size, planned_mtime):
        return None
    if appended_ok and FORMATS[part.kind].byte_ranges and 0 <= part.stop <= st.st_size:
        return None
    if st.st_size == planned_size:
        return f"size {planned_size:,} bytes, rewritten"
    return f"size {planned_size:,} → {st.st_size:,} bytes"


def _changed(url: str, change: str) -> str:
    return f"{url}: changed while it was being tokenized ({change}); run again"


def change_while_read(slice_: Slice, appended_ok: bool = True, always: bool = False) -> str | None:
    """The one-line error for a slice whose input changed since it was planned, or None if its files' size and
    mtime are as planned (`always`: the error anyway, for bytes known to differ)."""
    for part in slice_.parts:
        if change := _change(part, appended_ok):
            return _changed(part.url, change)
    return _changed(slice_.parts[0].url, "its bytes are not those planned") if always else None


def read_slice(slice_: Slice, columns: list[str], storage_options: dict | None = None,
               max_row_bytes: int | None = None, raw: bool = False, timeout: float = REQUEST_TIMEOUT
               ) -> Iterator[tuple[list[Any], Callable[[int], str], Part]]:
    """The slice's rows in batches, each with the part it comes from, holding the run's columns that each file
    has (an optional one may be in some files only); a JSON line over `max_row_bytes` comes as a BadRow
    `row_too_large`. With `raw`, a JSON line comes as its bytes (see `Rows`). Each local file's size and mtime
    are checked against the plan's before and after its part is read (two stats): a file changed under the
    slice fails it with one line instead of giving it a mix of old and new rows. A remote file's request waits
    at most `timeout` seconds to connect and for each answer; one refused or unanswered fails the slice in one
    line naming the file and its endpoint."""
    for part in slice_.parts:
        part_reader = None
        try:
            if change := _change(part, appended_ok=True):
                raise BadInput(_changed(part.url, change))
            part_reader = reader(part, storage_options, max_row_bytes, timeout)
            if not part_reader.schemaless:
                present = set(part_reader.columns(skip_bad_rows=True))
                columns = [name for name in columns if name in present]
            batches = part_reader.read(part, columns, raw=True) if raw and isinstance(part_reader, JsonLinesReader) \
                else part_reader.read(part, columns)
            for rows, locate in batches:
                yield rows, locate, part
            if change := _change(part, appended_ok=True):
                raise BadInput(_changed(part.url, change))
        except Exception as error:
            if network_failure(error):
                fs = part_reader.fs if part_reader is not None else filesystem(part.url, storage_options, timeout)[0]
                raise Failed(f"{unanswered(error, fs, part.url, timeout)}; check that the endpoint is up and reachable "
                             "from here, then run the same command again") from error
            raise


class _JoinedLocator:
    """Where row i of batches joined end to end is: the locator of the batch that holds it, at its own index."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.locators: list[Callable[[int], str]] = []

    def __call__(self, i: int) -> str:
        k = bisect_right(self.starts, i) - 1
        return self.locators[k](i - self.starts[k])


def _weight(rows: list[Any]) -> int:
    """A batch's input bytes as the JSONL reader counts them: a raw line its length, a line over --max-row-bytes
    the whole bound (nothing is joined after it); a parsed row nothing (the other readers bound by rows only)."""
    return sum(len(row) if type(row) is bytes else
               READ_BATCH_BYTES if isinstance(row, BadRow) and row.reason == "row_too_large" else 0 for row in rows)


def joined(batches: Iterable[tuple[list[Any], Callable[[int], str], Part]]
           ) -> Iterator[tuple[list[Any], Callable[[int], str]]]:
    """read_slice's batches with consecutive small ones joined, within the readers' bounds (READ_BATCH_ROWS rows,
    READ_BATCH_BYTES of lines): a slice of many small files is encoded in full batches, not a batch a file
    (20,000 one-row files: 20,000 encoder calls before). A batch at a bound goes at once, as the reader gave it:
    only a part's last, short batch waits for the next part's. Rows keep their order and each its location."""
    rows: list[Any] = []
    locate = _JoinedLocator()
    weight = 0
    for batch, batch_locate, _ in batches:
        batch_weight = _weight(batch)
        if rows and (len(rows) + len(batch) > READ_BATCH_ROWS or weight + batch_weight > READ_BATCH_BYTES):
            yield rows, locate
            rows, locate, weight = [], _JoinedLocator(), 0
        locate.starts.append(len(rows))
        locate.locators.append(batch_locate)
        rows.extend(batch)
        weight += batch_weight
        if len(rows) >= READ_BATCH_ROWS or weight >= READ_BATCH_BYTES:
            yield rows, locate
            rows, locate, weight = [], _JoinedLocator(), 0
    if rows:
        yield rows, locate


@dataclass(frozen=True)
class Rows:
    """A read batch on its way to an encoder: JSON lines still as bytes, parsed and turned into conversations
    where they are encoded (an encode pool's process, when there is one, so the slice's thread does no per-row
    work), with what that needs. Each row becomes its example or the BadRow that says what is wrong with it."""

    rows: list[Any]  # bytes (a JSON line), a dict, or a BadRow
    columns: ColumnMap
    system_prompt: str | None

    def examples(self) -> list[Conversation | str | BadRow]:
        out: list[Conversation | str | BadRow] = []
        for raw in self.rows:
            row = parse_line(raw) if type(raw) is bytes else raw
            if not isinstance(row, BadRow):
                try:
                    row = to_example(row, self.columns, self.system_prompt)
                except BadRow as bad:
                    row = bad
            out.append(row)
        return out
