"""Parquet: row groups; a slice reads only its row groups and only the columns it needs."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import pyarrow.parquet as pq

from sft_tokenize.errors import BadInput, one_line
from sft_tokenize.sources.formats.format_reader import READ_BATCH_ROWS, FormatReader, RowBatch
from sft_tokenize.sources.records import Part, is_local


class ParquetReader(FormatReader):
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
