"""Chunk files of records, as both MDS shards and litdata chunks lay them out (FORMAT.md beside this module):

    u32 count | u32 offsets[count + 1] (from the file's start) | head (MDS: its config) | records

Chunks are cut within parts of the cache: a data file (of at least `limit` bytes of records), or consecutive data
files taken together up to `limit`. A part's chunks are named by its content key (`name(key, j)`), the digest the
manifest records for its data file (or of theirs): the same data files give the same chunk files under the same
names, so exporting again over an earlier export reuses the chunks of the parts the two caches share (output.py).

A record is one row: the byte sizes of its columns (u32 each), then each column's bytes, each behind its own
prefix (MDS: the array's shape; litdata: none). Rows are cut into chunks of at most `limit` bytes by their
sizes (from the cache's lengths) before any is written, and streamed in batches: a chunk's header comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import xxhash

from sft_tokenize.export.output import ExportOutput
from sft_tokenize.read.cache import TokenizedCache
from sft_tokenize.read.row_batches import RowBatch, Rows, row_batches

# a row's length → each column's prefix (bytes), per row: how a format spells an array's shape
Prefixes = Callable[[int], tuple[bytes, bytes]]
ITEMSIZES = (4, 1)  # input_ids int32, loss_mask int8


@dataclass
class Chunk:
    first: int  # its first row
    stop: int  # one past its last row
    offsets: np.ndarray  # u32, count + 1, from the file's start


def plan_chunks(lengths: np.ndarray, record_sizes: np.ndarray, head: int, limit: int) -> list[Chunk]:
    """Rows into chunks: each as many rows as fit in `limit` bytes (4 per row for its offset, the header),
    at least one."""
    ends = np.cumsum(record_sizes + 4, dtype=np.int64)
    chunks, first = [], 0
    while first < len(lengths):
        before = int(ends[first - 1]) if first else 0
        stop = max(int(np.searchsorted(ends, before + limit - head - 8, side="right")), first + 1)
        count = stop - first
        start = 4 + 4 * (count + 1) + head
        offsets = np.empty(count + 1, dtype=np.int64)
        offsets[0] = start
        np.cumsum(record_sizes[first:stop], out=offsets[1:])
        offsets[1:] += start
        if offsets[-1] >= 1 << 32:
            raise ValueError(f"row {first}: a chunk of {offsets[-1]} bytes does not fit u32 offsets")
        chunks.append(Chunk(first, stop, offsets.astype(np.uint32)))
        first = stop
    return chunks


def data_files(cache: Rows) -> list[tuple[int, int, str | None]]:
    """(first row, stop, digest) of each of the cache's data files, in row order (the digest the manifest records,
    None where it records none). A mixture's rows are one part without a digest."""
    if not isinstance(cache, TokenizedCache):
        return [(0, len(cache), None)]
    parts, first = [], 0
    for entry in cache.manifest["files"]:
        rows = int(entry.get("rows", len(cache) - first))
        parts.append((first, first + rows, entry.get("digest")))
        first += rows
    return parts if first == len(cache) else [(0, len(cache), None)]


def parts(cache: Rows, record_sizes: np.ndarray, limit: int) -> list[tuple[int, int, str | None]]:
    """(first row, stop, content key) of each part that chunks are cut within: consecutive data files taken together
    until their records reach `limit` bytes (a data file that large is a part alone, keyed by its digest; a part of
    several, by the digest of theirs), so small data files do not make small chunks. A part repeated whole gets a
    key of its own (`<key>-<n>`); without a digest for every data file, the rows are one part without a key."""
    files = data_files(cache)
    if any(digest is None for _, _, digest in files):
        return [(0, len(cache), None)]
    ends = np.concatenate([[0], np.cumsum(record_sizes, dtype=np.int64)])
    out, group, seen = [], [], {}
    for k, (first, stop, digest) in enumerate(files):
        group.append((first, stop, digest))
        if ends[stop] - ends[group[0][0]] < limit and k + 1 < len(files):
            continue
        key = group[0][2] if len(group) == 1 else xxhash.xxh3_128(",".join(d for _, _, d in group).encode()).hexdigest()
        seen[key] = seen.get(key, 0) + 1
        out.append((group[0][0], stop, key if seen[key] == 1 else f"{key}-{seen[key] - 1}"))
        group = []
    return out


def plan_files(cache: Rows, record_sizes: np.ndarray, head: int, limit: int,
               name: Callable[[str | None, int], str]) -> tuple[list[Chunk], list[str]]:
    """`plan_chunks` within each of `parts`, and each chunk's file name: `name(key, j)`, j counting the chunks of
    that part, or (no key) counting all chunks."""
    lengths = cache.lengths.astype(np.int64)
    chunks, names = [], []
    for first, stop, key in parts(cache, record_sizes, limit):
        for j, chunk in enumerate(plan_chunks(lengths[first:stop], record_sizes[first:stop], head, limit)):
            chunks.append(Chunk(chunk.first + first, chunk.stop + first, chunk.offsets))
            names.append(name(key, j if key else len(names)))
    return chunks, names


def encode_rows(batch: RowBatch, lo: int, hi: int, prefixes: Prefixes) -> bytes:
    """Rows [lo, hi) of `batch` (batch-relative) as records."""
    parts: list = []
    offsets, ids, mask = batch.offsets, batch.input_ids, batch.loss_mask
    for i in range(lo, hi):
        a, b = int(offsets[i]), int(offsets[i + 1])
        ids_prefix, mask_prefix = prefixes(b - a)
        sizes = np.array([len(ids_prefix) + 4 * (b - a), len(mask_prefix) + (b - a)], dtype="<u4")
        parts += (sizes.tobytes(), ids_prefix, ids[a:b].tobytes(), mask_prefix, mask[a:b].tobytes())
    return b"".join(parts)


def _rows(cache: Rows, batch_rows: int) -> Iterator[tuple[RowBatch, int, int]]:
    for batch in row_batches(cache, batch_rows):
        yield batch, batch.first, batch.first + len(batch)


def write_chunks(cache: Rows, out: ExportOutput, chunks: list[Chunk], names: list[str], head: bytes,
                 prefixes: Prefixes, batch_rows: int) -> None:
    """Every chunk's file, in order, its rows streamed a batch at a time; a chunk file the earlier export at the
    same place holds under the same name is reused as it is."""
    rows = _rows(cache, batch_rows)
    batch, start, stop = next(rows, (None, 0, 0))
    for chunk, name in zip(chunks, names, strict=True):
        if out.reuse(name):
            continue
        with ExitStack() as stack:
            f = stack.enter_context(out.open(name))
            f.write(np.uint32(chunk.stop - chunk.first).tobytes() + chunk.offsets.tobytes() + head)
            row = chunk.first
            while row < chunk.stop:
                while row >= stop:
                    batch, start, stop = next(rows)
                end = min(stop, chunk.stop)
                f.write(encode_rows(batch, row - start, end - start, prefixes))
                row = end
