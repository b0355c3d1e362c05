"""JSON lines: byte ranges aligned to line starts; a slice seeks to its range and reads only it. Each line is
parsed into its row, or the BadRow that says why it is not one."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import orjson

from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.sources.formats.format_reader import (
    READ_BATCH_BYTES,
    READ_BATCH_ROWS,
    READ_CHUNK_BYTES,
    FormatReader,
    RowBatch,
)
from sft_tokenize.sources.records import Part


class JsonLinesReader(FormatReader):
    schemaless = True

    def columns(self, skip_bad_rows: bool = False) -> list[str] | None:
        """The first readable row's keys; None when skipping bad rows and every row is one (they are read, and
        counted, as the bad rows they are)."""
        self.first_bad = None
        for number, line in enumerate(self._lines(0, -1), start=1):
            if not isinstance(line, int) and not line.strip():
                continue
            # A row over max_row_bytes is not decoded, even to find the columns.
            row = _too_large(line, self.max_row_bytes) if isinstance(line, int) else parse_line(line)
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
                rows.append(line if raw else parse_line(line))
                lines.append(index)
                pending += len(line)
                if len(rows) >= READ_BATCH_ROWS or pending >= READ_BATCH_BYTES:
                    yield rows, _line_locator(self.url, first_line, lines)
                    rows, lines, pending = [], [], 0
        if rows:
            yield rows, _line_locator(self.url, first_line, lines)


class _LazyLineNumber:
    """The 1-based line number of a byte offset, counted only when an error needs it."""

    def __init__(self, reader: FormatReader, offset: int):
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
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
TOO_DEEP = BadRow("malformed_json", "not valid JSON: nested too deeply (more than about 1,000 levels)")


def _too_large(size: int, limit: int) -> BadRow:
    return BadRow("row_too_large", f"the row is {size:,} bytes, over the {limit:,}-byte limit (--max-row-bytes; "
                                   "--on-bad-row skip drops such rows)")


def parse_line(line: bytes) -> dict | BadRow:
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
    return unicode_checked(row) if SURROGATE_ESCAPE.search(line) else row


def unicode_checked(row: dict) -> dict | BadRow:
    """The row, or a BadRow if one of its strings holds a lone surrogate."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        escape = f"\\u{ord(error.object[error.start]):04x}"
        return BadRow("not_unicode", f"a lone surrogate {escape} in a string (half of a UTF-16 pair: not Unicode)")
    return row
