"""A published cache's rows, a batch at a time, as flat numpy arrays over the memory-mapped Arrow buffers.

    for batch in row_batches(cache, rows=65536):           # a TokenizedCache, or a mixture's MixedRows
        batch.offsets, batch.input_ids, batch.loss_mask    # offsets from 0; ids int32, mask int8 (views)

Only one batch's offsets (and, for a cache without `loss_mask`, its mask derived from `labels`) is made in memory;
the ids and a stored mask are views of the mapped files. A batch never spans two data files' record batches, so
its size is at most `rows` rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import TokenizedCache
from sft_tokenize.read.mixed_rows import MixedRows
from sft_tokenize.read.numpy_views import numpy_of

IGNORE_INDEX = -100
DEFAULT_BATCH_ROWS = 1 << 16
Rows = TokenizedCache | MixedRows  # what a batch's rows come from: a published cache, or a mixture index's rows


@dataclass
class RowBatch:
    """Rows [first, first + len(self)) of a cache: `offsets` (int64, from 0) into the flat `input_ids` and
    `loss_mask`."""

    first: int
    offsets: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _flat(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column's offsets (from 0, int64) and its values in those rows (a view, no copy)."""
    offsets = numpy_of(column.offsets)
    start, stop = int(offsets[0]), int(offsets[-1])
    return (offsets - start).astype(np.int64), numpy_of(column.values.slice(start, stop - start))


def _mask_column(cache: TokenizedCache | MixedRows) -> str:
    columns = set(cache.columns)
    if "input_ids" not in columns or not columns & {"loss_mask", "labels"}:
        raise CacheError(f"{cache.path}: its columns are {', '.join(cache.columns)}; this needs input_ids and "
                         "loss_mask (or labels)")
    return "loss_mask" if "loss_mask" in columns else "labels"


def _mixed_batches(mixed: MixedRows, rows: int, mask_name: str) -> Iterator[RowBatch]:
    """A mixture's rows in its order, gathered row by row from its sources' mapped caches."""
    for first in range(0, len(mixed), rows):
        items = [mixed[i] for i in range(first, min(first + rows, len(mixed)))]
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum([len(item["input_ids"]) for item in items], out=offsets[1:])
        ids = np.concatenate([item["input_ids"] for item in items]).astype(np.int32, copy=False)
        mask = np.concatenate([item[mask_name] for item in items])
        if mask_name == "labels":
            mask = mask != IGNORE_INDEX
        yield RowBatch(first, offsets, ids, mask.astype(np.int8, copy=False))


def row_batches(cache: TokenizedCache | MixedRows, rows: int = DEFAULT_BATCH_ROWS) -> Iterator[RowBatch]:
    """The cache's rows in order (a mixture's: in the mixture's order), at most `rows` per batch. A cache holds
    `input_ids` and either `loss_mask` or `labels` (-100 where not trained); anything else is refused naming the
    cache."""
    mask_name = _mask_column(cache)
    if not isinstance(cache, TokenizedCache):
        yield from _mixed_batches(cache, rows, mask_name)
        return
    if cache.table is None:
        return
    first = 0
    for record_batch in cache.table.select(["input_ids", mask_name]).to_batches(max_chunksize=rows):
        offsets, ids = _flat(record_batch.column(0))
        mask_offsets, mask = _flat(record_batch.column(1))
        if not np.array_equal(offsets, mask_offsets):
            lengths = np.diff(offsets) != np.diff(mask_offsets)
            row = first + int(np.argmax(lengths))
            raise CacheError(f"{cache.path}: row {row}: input_ids and {mask_name} differ in length")
        if mask_name == "labels":
            mask = (mask != IGNORE_INDEX).astype(np.int8)
        yield RowBatch(first, offsets, ids.astype(np.int32, copy=False), mask.astype(np.int8, copy=False))
        first += record_batch.num_rows
