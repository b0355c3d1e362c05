"""What a source format's reader gives: its columns, its pieces (the cut points that slicing.py packs into
slices) and the rows of one part, in bounded batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sft_tokenize.errors import BadRow
from sft_tokenize.files import REQUEST_TIMEOUT
from sft_tokenize.sources.compressed import compression_of, open_decompressed
from sft_tokenize.sources.records import Part, SourceFile, filesystem

# Rows handed to the tokenizer at a time: at most this many, and (JSONL) at most this much input. A batch's
# tokenizer output (~100 bytes a token until it is packed into numpy) is what sets a worker's peak memory.
READ_BATCH_ROWS = 256
READ_BATCH_BYTES = 1 << 20
READ_CHUNK_BYTES = 1 << 20  # one read (one range request remotely) of a JSONL slice

# A batch of rows read from a part: each row is a dict, or the BadRow it could not be read as; and a
# function that names where row i is (file and line or row), called only to report an error.
RowBatch = tuple[list[Any], Callable[[int], str]]


class FormatReader:
    """One file format: its columns, its pieces (cut points with byte weights) and how to read a part. A new
    format subclasses it in a module of its own and adds its row to FORMATS (table.py)."""

    schemaless = False  # rows are JSON objects whose keys may differ from row to row
    first_bad: tuple[str, BadRow] | None = None  # after columns() found only bad rows: where the first is, and why

    def __init__(self, source: SourceFile | Part, storage_options: dict | None, max_row_bytes: int | None = None,
                 timeout: float = REQUEST_TIMEOUT):
        self.url = source.url
        self.fs, self.path = filesystem(source.url, storage_options, timeout)
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
