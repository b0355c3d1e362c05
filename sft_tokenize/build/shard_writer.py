"""The shard writer: encoded batches streamed into one Arrow IPC stream file, in bounded record batches."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from sft_tokenize.build.image_rows import held_bytes
from sft_tokenize.build.job import arrow_schema
from sft_tokenize.encoding.chat_encoder import EncodedBatch
from sft_tokenize.encoding.memory import trim_malloc
from sft_tokenize.read.layouts import COLUMN_TYPES, column_values, layout_columns

_IMAGE_FIELDS = ("bytes", "path", "hash", "size")  # a stored image (FORMAT.md); beside it its grid and size


def _flat(values: np.ndarray) -> pa.Array:
    """A numeric numpy array as an Arrow array on the same memory: what `pa.array` makes of it, without the check for
    a pandas object that imports pandas (~0.5 s of a first run's CPU)."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _list_array(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(_flat(offsets), _flat(values))


class ShardWriter:
    """Streams rows into one Arrow IPC stream file, as `datasets.ArrowWriter` writes it (its schema metadata, a
    record batch of at most `batch_rows` rows at a time): `load_from_disk` opens it, and its bytes are that writer's.

    Rows are buffered as slices of encoded batches (numpy arrays, no per-row objects) and written as one
    record batch every `batch_rows` rows or `batch_bytes` bytes, whichever comes first. The buffer never
    holds more than `batch_rows` rows; `max_buffered_rows` records the most it held.
    """

    def __init__(self, stream, extra_columns: tuple[str, ...], batch_rows: int, batch_bytes: int,
                 layout: str = "skyrl", images: bool = False):
        self.columns = layout_columns(layout, extra_columns)
        self._token_bytes = sum(np.dtype(COLUMN_TYPES[name]).itemsize for name in self.columns)
        self.batch_rows, self.batch_bytes = batch_rows, batch_bytes
        self.schema = arrow_schema(extra_columns, layout, images)
        self._stream = stream
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None  # started at the first batch, as ArrowWriter's
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, mask, lengths)
        self._images: list[list[dict]] | None = [] if images else None  # each buffered row's stored images
        self._rows = self._bytes = 0
        self.max_buffered_rows = 0

    def add(self, batch: EncodedBatch, images: list[list[dict]] | None = None) -> None:
        """Buffer a batch's rows (with each row's stored images, in an image cache), flushing every `batch_rows`
        rows or as soon as `batch_bytes` is reached, whatever the rows' sizes."""
        lengths = np.diff(batch.offsets)
        sizes = lengths * self._token_bytes  # each row's bytes, tokens and images
        if self._images is not None and images is not None:
            sizes = sizes + np.fromiter(map(held_bytes, images), dtype=np.int64, count=batch.rows)
        start = 0
        while start < batch.rows:
            stop = min(batch.rows, start + self.batch_rows - self._rows)
            reached = np.cumsum(sizes[start:stop]) + self._bytes
            stop = min(stop, start + int(np.searchsorted(reached, self.batch_bytes)) + 1)  # through the row reaching it
            a, b = batch.offsets[start], batch.offsets[stop]
            self._chunks.append((batch.input_ids[a:b], batch.loss_mask[a:b], lengths[start:stop]))
            if self._images is not None:
                self._images += images[start:stop] if images is not None else [[] for _ in range(stop - start)]
            self._rows += stop - start
            self._bytes = int(reached[stop - start - 1])
            self.max_buffered_rows = max(self.max_buffered_rows, self._rows)
            if self._rows >= self.batch_rows or self._bytes >= self.batch_bytes:
                self.flush()
            start = stop

    def flush(self) -> None:
        if not self._chunks:
            return
        self._write_batch()
        if self._images is not None:
            trim_malloc()  # the batch's image bytes, just freed, would stay resident (encoding/memory.py)

    def _write_batch(self) -> None:
        ids, mask, lengths = (np.concatenate(parts) for parts in zip(*self._chunks, strict=True))
        columns = {name: _list_array(lengths, column_values(name, ids, mask)) for name in self.columns}
        if self._images is not None:
            stored = self._images
            columns["images"] = pa.array([[{k: v for k, v in image.items() if k in _IMAGE_FIELDS} for image in row]
                                          for row in stored], type=self.schema.field("images").type)
            for name in ("image_grid_thw", "image_sizes"):
                columns[name] = pa.array([[image[name] for image in row] for row in stored],
                                         type=self.schema.field(name).type)
            if "pixel_values" in self.schema.names:
                columns["pixel_values"] = self._pixel_values(stored)
            self._images = []
        self._write(pa.table(columns).cast(self.schema))
        self._chunks, self._rows, self._bytes = [], 0, 0

    def _pixel_values(self, stored: list[list[dict]]) -> pa.Array:
        """Each row's images' pixel rows end to end, `list<list<float>>` built from flat arrays (no per-float
        Python objects)."""
        rows = [image["pixels"] for row in stored for image in row]
        width = rows[0].shape[1] if rows else 0
        values = np.concatenate(rows) if rows else np.zeros((0, 0), dtype=np.float32)
        patches = np.array([sum(len(image["pixels"]) for image in row) for row in stored], dtype=np.int64)
        inner = _list_array(np.full(len(values), width), values.reshape(-1))
        offsets = np.zeros(len(stored) + 1, dtype=np.int32)
        np.cumsum(patches, out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), inner).cast(self.schema.field("pixel_values").type)

    def _write(self, table: pa.Table) -> None:
        if self._writer is None:
            self._writer = pa.ipc.new_stream(self._stream, self.schema)
        self._writer.write_table(table.combine_chunks(), self.batch_rows)

    def close(self) -> None:
        """Write what is buffered and the end of stream; an empty shard is still a valid Arrow file (its schema)."""
        self.flush()
        if self._writer is None:
            self._writer = pa.ipc.new_stream(self._stream, self.schema)
        self._writer.close()
