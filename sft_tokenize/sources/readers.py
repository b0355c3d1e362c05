"""How each source format is inspected, cut and read: its columns, its pieces (the cut points that slicing.py
packs into slices) and the rows of one part, in bounded batches.

    jsonl    byte ranges aligned to line starts; a slice seeks to its range and reads only it
    parquet  row groups; a slice reads only its row groups and only the columns it needs
    arrow    row ranges of Arrow IPC (stream or file) files, e.g. a `save_to_disk` directory
    json     (an array of objects) and csv: whole files, one piece each

A compressed file is decompressed as it is read (compressed.py): it is one piece, read whole by one slice.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from sft_tokenize.errors import BadInput, BadRow, one_line
from sft_tokenize.sources.compressed import compression_of, open_decompressed
from sft_tokenize.sources.conversations import ColumnMap, Conversation, to_example
from sft_tokenize.sources.resolve import Part, Slice, SourceFile, filesystem, is_local

# Rows handed to the tokenizer at a time: at most this many, and (JSONL) at most this much input. A batch's
# tokenizer output (~100 bytes a token until it is packed into numpy) is what sets a worker's peak memory.
READ_BATCH_ROWS = 256
READ_BATCH_BYTES = 1 << 20
READ_CHUNK_BYTES = 1 << 20  # one read (one range request remotely) of a JSONL slice

# A batch of rows read from a part: each row is a dict, or the BadRow it could not be read as; and a
# function that names where row i is (file and line or row), called only to report an error.
RowBatch = tuple[list[Any], Callable[[int], str]]


class _Reader:
    """One file format: its columns, its pieces (cut points with byte weights) and how to read a part."""

    schemaless = False  # rows are JSON objects whose keys may differ from row to row
    first_bad: tuple[str, BadRow] | None = None  # after columns() found only bad rows: where the first is, and why

    def __init__(self, source: SourceFile | Part, storage_options: dict | None, max_row_bytes: int | None = None):
        self.url = source.url
        self.fs, self.path = filesystem(source.url, storage_options)
        self.compressed = compression_of(source.url) is not None
        self.max_row_bytes = max_row_bytes

    def open(self, exact: bool = False):
        # exact: every read is one range request of exactly its size, no read-ahead past a slice.
        # Otherwise small blocks: finding a line start should not fetch megabytes of object storage.
        options = {"cache_type": "none"} if exact and not self.compressed else {"block_size": 1 << 16}
        return open_decompressed(self.fs, self.path, self.url, READ_CHUNK_BYTES, **options)

    def columns(self, skip_bad_rows: bool = False) -> list[str] | None:
        """The columns, from the schema or the first row (the first readable one, when skipping bad rows; None
        when there is none, only bad rows)."""
        raise NotImplementedError

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        """(start, stop, bytes) in the format's unit, the file's own cut points (where the format can be cut):
        they depend on this file's bytes and `target` only, so other files never move them."""
        raise NotImplementedError

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        raise NotImplementedError


class _JsonLines(_Reader):
    schemaless = True

    def columns(self, skip_bad_rows: bool = False) -> list[str] | None:
        """The first readable row's keys; None when skipping bad rows and every row is one (they are read, and
        counted, as the bad rows they are)."""
        self.first_bad = None
        for number, line in enumerate(self._lines(0, -1), start=1):
            if not isinstance(line, int) and not line.strip():
                continue
            # A row over max_row_bytes is not decoded, even to find the columns.
            row = _too_large(line, self.max_row_bytes) if isinstance(line, int) else _parse_line(line)
            if isinstance(row, BadRow):
                if skip_bad_rows:
                    self.first_bad = self.first_bad or (f"{self.url}:{number}", row)
                    continue
                raise row.at(f"{self.url}:{number}")
            return list(row)
        if self.first_bad:
            return None
        raise BadInput(f"{self.url}: the file has no rows")

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        if self.compressed:
            return [(0, -1, size)]
        # Cut at the first line start at or after each multiple of `target`, counted from the file's start:
        # appending rows moves no earlier cut, and an edit that shifts bytes rarely moves a later one.
        cuts = [0]
        with self.open() as f:
            offset = target
            while offset < size:
                f.seek(offset - 1)
                f.readline()  # to the start of the next line (offset itself if a line starts there)
                if f.tell() >= size:
                    break
                cuts.append(f.tell())
                offset = (f.tell() // target + 1) * target  # the next multiple past a line longer than target
        if len(cuts) > 1 and size - cuts[-1] < target // 4:
            cuts.pop()  # no sliver of a slice at the end: the last piece takes it
        cuts.append(size)
        return [(a, b, b - a) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    def _lines(self, start: int, stop: int) -> Iterator[bytes | int]:
        """The lines of bytes [start, stop) (stop -1: to the end), which begin and end on line starts, read in
        bounded chunks. Exactly that range is read: on object storage a slice fetches its own bytes and no
        others. A line longer than max_row_bytes is never held whole: its length (an int) stands for it."""
        limit = self.max_row_bytes
        with self.open(exact=True) as f:
            if start:
                f.seek(start)
            position, carry, skipped = start, [], 0  # carry: the pieces of an unfinished line
            while stop < 0 or position < stop:
                chunk = f.read(READ_CHUNK_BYTES if stop < 0 else min(stop - position, READ_CHUNK_BYTES))
                if not chunk:
                    break
                position += len(chunk)
                lines = chunk.split(b"\n")
                last = lines.pop()
                for line in lines:
                    whole = skipped + len(line) if skipped else b"".join([*carry, line]) if carry else line
                    yield len(whole) if limit is not None and not isinstance(whole, int) and len(whole) > limit \
                        else whole
                    carry, skipped = [], 0
                if skipped:
                    skipped += len(last)
                else:
                    carry.append(last)
                    if limit is not None and sum(map(len, carry)) > limit:
                        skipped, carry = sum(map(len, carry)), []
            if skipped:
                yield skipped
            elif any(carry):
                yield b"".join(carry)

    def read(self, part: Part, columns: list[str], raw: bool = False) -> Iterator[RowBatch]:
        """With `raw`, each line comes as its bytes, parsed where it is turned into a conversation (`Rows`)."""
        first_line = _LazyLineNumber(self, part.start)
        rows: list[Any] = []
        lines: list[int] = []  # line index of each row, relative to the part's first line
        pending = 0
        for index, line in enumerate(self._lines(part.start, part.stop)):
            if isinstance(line, int):
                rows.append(_too_large(line, self.max_row_bytes))
                lines.append(index)
                pending += READ_BATCH_BYTES  # alone in its batch: the rows before it need not wait
            elif line.strip():
                rows.append(line if raw else _parse_line(line))
                lines.append(index)
                pending += len(line)
                if len(rows) >= READ_BATCH_ROWS or pending >= READ_BATCH_BYTES:
                    yield rows, _line_locator(self.url, first_line, lines)
                    rows, lines, pending = [], [], 0
        if rows:
            yield rows, _line_locator(self.url, first_line, lines)


class _LazyLineNumber:
    """The 1-based line number of a byte offset, counted only when an error needs it."""

    def __init__(self, reader: _Reader, offset: int):
        self.reader, self.offset = reader, offset

    @cached_property
    def value(self) -> int:
        newlines, remaining = 0, self.offset
        with self.reader.open() as f:
            while remaining > 0:
                chunk = f.read(min(remaining, 16 << 20))
                if not chunk:
                    break
                newlines += chunk.count(b"\n")
                remaining -= len(chunk)
        return newlines + 1


def _line_locator(url: str, first: _LazyLineNumber, lines: list[int]) -> Callable[[int], str]:
    return lambda i: f"{url}:{first.value + lines[i]}"


# A \\uD800-\\uDFFF escape: JSON can spell a lone surrogate, which is not Unicode and no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
TOO_DEEP = BadRow("malformed_json", "not valid JSON: nested too deeply (more than about 1,000 levels)")


def _too_large(size: int, limit: int) -> BadRow:
    return BadRow("row_too_large", f"the row is {size:,} bytes, over the {limit:,}-byte limit (--max-row-bytes; "
                                   "--on-bad-row skip drops such rows)")


def _parse_line(line: bytes) -> dict | BadRow:
    line = line.removeprefix(codecs.BOM_UTF8)  # a byte order mark opens files written by some Windows tools
    try:
        row = orjson.loads(line)  # faster, and stricter: no lone surrogate, NaN, invalid UTF-8 or huge integer
    except orjson.JSONDecodeError:
        pass  # the standard library's answer, its row or its error message, is the row's
    else:
        if isinstance(row, dict):
            return row
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return BadRow("not_utf8", f"not valid UTF-8 (byte 0x{line[error.start]:02x} at column {error.start + 1})")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        return BadRow("malformed_json", f"not valid JSON: {error.msg} (column {error.colno})")
    except RecursionError:
        return TOO_DEEP
    if not isinstance(row, dict):
        return BadRow("malformed_json", f"expected a JSON object, got {type(row).__name__}")
    return _unicode_checked(row) if _SURROGATE_ESCAPE.search(line) else row


def _unicode_checked(row: dict) -> dict | BadRow:
    """The row, or a BadRow if one of its strings holds a lone surrogate."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        escape = f"\\u{ord(error.object[error.start]):04x}"
        return BadRow("not_unicode", f"a lone surrogate {escape} in a string (half of a UTF-16 pair: not Unicode)")
    return row


class _JsonArray(_Reader):
    schemaless = True

    @cached_property
    def items(self) -> list:
        with self.open() as f:
            raw = f.read()
        self.may_hold_surrogates = bool(_SURROGATE_ESCAPE.search(raw))
        try:
            data = json.loads(raw.decode("utf-8-sig"))  # with or without a byte order mark
        except UnicodeDecodeError as error:
            raise BadInput(f"{self.url}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            where = f"{self.url}:{error.lineno}"
            raise BadInput(f"{where}: not valid JSON: {error.msg} (column {error.colno})") from None
        except RecursionError:
            raise BadInput(f"{self.url}: {TOO_DEEP.detail}") from None
        if not isinstance(data, list):
            raise BadInput(f"{self.url}: a .json file must hold an array of objects (or be JSON lines), "
                           f"got a JSON {type(data).__name__}")
        return data

    def columns(self, skip_bad_rows: bool = False) -> list[str]:
        objects = [item for item in self.items if isinstance(item, dict)]
        if not objects:
            raise BadInput(f"{self.url}: the array holds no objects")
        return list(objects[0])

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        return [(0, -1, size)]

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        items = self.items
        for start in range(0, len(items), READ_BATCH_ROWS):
            rows = [(_unicode_checked(item) if self.may_hold_surrogates else item) if isinstance(item, dict) else
                    BadRow("malformed_json", f"expected a JSON object, got {type(item).__name__}")
                    for item in items[start:start + READ_BATCH_ROWS]]
            yield rows, (lambda i, s=start: f"{self.url}: item {s + i + 1}")


class _Parquet(_Reader):
    @cached_property
    def file(self) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self.path if is_local(self.fs) else self.open(exact=True))
        except Exception as error:
            raise BadInput(f"{self.url}: not a readable Parquet file ({error})") from None

    def columns(self, skip_bad_rows: bool = False) -> list[str]:
        return self.file.schema_arrow.names

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        meta = self.file.metadata
        return [(g, g + 1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        meta = self.file.metadata
        row = sum(meta.row_group(g).num_rows for g in range(part.start))
        try:
            batches = self.file.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=range(part.start, part.stop),
                                             columns=columns)
            for batch in batches:
                yield batch.to_pylist(), (lambda i, r=row: f"{self.url}: row {r + i + 1}")
                row += batch.num_rows
        except OSError as error:
            raise BadInput(f"{self.url}: row {row + 1}: cannot read Parquet data ({one_line(error)})") from None


class _Arrow(_Reader):
    def _open(self) -> pa.ipc.RecordBatchFileReader | pa.ipc.RecordBatchStreamReader:
        source = pa.memory_map(self.path) if is_local(self.fs) else self.open()
        try:
            try:
                return pa.ipc.open_file(source)
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_stream(source)
        except pa.ArrowInvalid as error:
            raise BadInput(f"{self.url}: not a readable Arrow IPC file ({one_line(error)})") from None

    def _batches(self) -> Iterator[pa.RecordBatch]:
        reader = self._open()
        try:
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                yield from reader
        except pa.ArrowInvalid as error:
            raise BadInput(f"{self.url}: not a readable Arrow IPC file ({one_line(error)})") from None

    def columns(self, skip_bad_rows: bool = False) -> list[str]:
        if not any(batch.num_rows for batch in self._batches()):
            raise BadInput(f"{self.url}: the Arrow file has no rows (no record batch holds any)")
        return self._open().schema.names

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        pieces, row = [], 0
        for batch in self._batches():
            pieces.append((row, row + batch.num_rows, batch.nbytes))
            row += batch.num_rows
        return pieces

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        row = 0
        for batch in self._batches():
            begin, end = max(part.start - row, 0), min(part.stop - row, batch.num_rows)
            if begin < end:
                chosen = batch.slice(begin, end - begin).select(columns)
                for start in range(0, chosen.num_rows, READ_BATCH_ROWS):
                    rows = chosen.slice(start, READ_BATCH_ROWS).to_pylist()
                    yield rows, (lambda i, r=row + begin + start: f"{self.url}: row {r + i + 1}")
            row += batch.num_rows
            if row >= part.stop:
                break


class _Csv(_Reader):
    def _reader(self, column_types: dict | None = None, ragged: list | None = None):
        """A streaming CSV reader; a row with the wrong number of fields is recorded in `ragged` as
        (line, fields, expected) and left out (single-threaded, so the line number is known)."""
        def on_ragged(row) -> str:
            if ragged is not None:
                ragged.append((row.number, row.actual_columns, row.expected_columns))
            return "skip"

        # Every column is text: "3" in an output column is the string "3", not a number.
        try:
            return pa_csv.open_csv(self.open(), read_options=pa_csv.ReadOptions(block_size=READ_BATCH_BYTES,
                                                                                use_threads=False),
                                   parse_options=pa_csv.ParseOptions(invalid_row_handler=on_ragged),
                                   convert_options=pa_csv.ConvertOptions(column_types=column_types))
        except pa.ArrowInvalid as error:
            raise BadInput(f"{self.url}: not a readable CSV file ({one_line(error)})") from None

    def columns(self, skip_bad_rows: bool = False) -> list[str]:
        ragged: list[tuple[int, int, int]] = []  # in the first block, which opening the reader parses
        names = self._reader(ragged=ragged).schema.names
        if ragged and not skip_bad_rows:
            line, fields, expected = ragged[0]
            raise BadInput(f"{self.url}:{line}: {fields} fields where the header has {expected}")
        return names

    def pieces(self, size: int, target: int, first: int) -> list[tuple[int, int, int]]:
        return [(0, -1, size)]

    def _ragged_rows(self, ragged: list[tuple[int, int, int]]) -> RowBatch:
        found = list(ragged)
        return ([BadRow("ragged_csv", f"{fields} fields where the header has {expected}") for _, fields, expected
                 in found], lambda i: f"{self.url}:{found[i][0]}")

    def read(self, part: Part, columns: list[str]) -> Iterator[RowBatch]:
        read = 0  # rows read so far
        ragged: list[tuple[int, int, int]] = []  # found while parsing the block under way
        skipped: list[int] = []  # the lines of every ragged row so far, ascending

        def line_of(row: int, skipped: tuple[int, ...]) -> int:
            """The line of a row (0-based, after the header): row + 2, plus every ragged line before it."""
            line = row + 2
            for ragged_line in skipped:
                if ragged_line > line:
                    break
                line += 1
            return line

        try:
            for batch in self._reader({name: pa.string() for name in self._reader().schema.names}, ragged):
                if ragged:  # the block of this batch held them: report them, and count their lines
                    skipped += [line for line, _, _ in ragged]
                    yield self._ragged_rows(ragged)
                    ragged.clear()
                table = batch.select(columns)
                for start in range(0, table.num_rows, READ_BATCH_ROWS):
                    rows = table.slice(start, READ_BATCH_ROWS).to_pylist()
                    yield rows, (lambda i, r=read + start, s=tuple(skipped): f"{self.url}:{line_of(r + i, s)}")
                read += table.num_rows
            if ragged:  # a last block of ragged rows only gives no batch
                yield self._ragged_rows(ragged)
        except pa.ArrowInvalid as error:
            raise BadInput(f"{self.url}: near line {line_of(read, tuple(skipped))}: cannot parse CSV "
                           f"({one_line(error)})") from None


READERS: dict[str, type[_Reader]] = {"jsonl": _JsonLines, "json": _JsonArray, "parquet": _Parquet, "arrow": _Arrow,
                                     "csv": _Csv}


def reader(source: SourceFile | Part, storage_options: dict | None = None,
           max_row_bytes: int | None = None) -> _Reader:
    return READERS[source.kind](source, storage_options, max_row_bytes)


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
    if appended_ok and part.kind == "jsonl" and 0 <= part.stop <= st.st_size:
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
               max_row_bytes: int | None = None, raw: bool = False
               ) -> Iterator[tuple[list[Any], Callable[[int], str], Part]]:
    """The slice's rows in batches, each with the part it comes from, holding the run's columns that each file
    has (an optional one may be in some files only); a JSON line over `max_row_bytes` comes as a BadRow
    `row_too_large`. With `raw`, a JSON line comes as its bytes (see `Rows`). Each local file's size and mtime
    are checked against the plan's before and after its part is read (two stats): a file changed under the
    slice fails it with one line instead of giving it a mix of old and new rows."""
    for part in slice_.parts:
        if change := _change(part, appended_ok=True):
            raise BadInput(_changed(part.url, change))
        part_reader = reader(part, storage_options, max_row_bytes)
        if not part_reader.schemaless:
            present = set(part_reader.columns(skip_bad_rows=True))
            columns = [name for name in columns if name in present]
        batches = part_reader.read(part, columns, raw=True) if raw and isinstance(part_reader, _JsonLines) \
            else part_reader.read(part, columns)
        for rows, locate in batches:
            yield rows, locate, part
        if change := _change(part, appended_ok=True):
            raise BadInput(_changed(part.url, change))


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
            row = _parse_line(raw) if type(raw) is bytes else raw
            if not isinstance(row, BadRow):
                try:
                    row = to_example(row, self.columns, self.system_prompt)
                except BadRow as bad:
                    row = bad
            out.append(row)
        return out
