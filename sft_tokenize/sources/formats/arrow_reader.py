"""Arrow: row ranges of Arrow IPC (stream or file) files, e.g. a `save_to_disk` directory."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from sft_tokenize.errors import BadInput, one_line
from sft_tokenize.sources.formats.format_reader import READ_BATCH_ROWS, FormatReader, RowBatch
from sft_tokenize.sources.records import Part, is_local


class ArrowReader(FormatReader):
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
