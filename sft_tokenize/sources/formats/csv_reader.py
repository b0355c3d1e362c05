"""CSV: whole files, one piece each; every column read as text, a ragged row a BadRow naming its line."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.csv as pa_csv

from sft_tokenize.errors import BadInput, BadRow, one_line
from sft_tokenize.sources.formats.format_reader import READ_BATCH_BYTES, READ_BATCH_ROWS, FormatReader, RowBatch
from sft_tokenize.sources.records import Part


class CsvReader(FormatReader):
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
