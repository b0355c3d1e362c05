"""What a max_length or a packing length would cost, from a published cache's rows alone.

For each candidate length L it counts what training at L would lose: the rows longer than L (truncated to
their first L tokens, or dropped with `truncation="drop"`), the rows whose trained tokens all lie past L (a
truncated row with no trained token left is dropped, as the build drops it), the input tokens and the
**trained** tokens lost, and the bins and fill of the packing index `pack --length L` would build (its
packing algorithm, on the same lengths).

Lengths come from the Arrow list offsets; trained tokens from one pass over `loss_mask` (or `labels`), about a
million values at a time, which records for every row how many of its trained tokens lie within each
candidate length. Memory is rows × candidates counters, never the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sft_tokenize.flags import MAX_SEQUENCE_TOKENS
from sft_tokenize.read.bin_packing import ALGORITHMS
from sft_tokenize.read.layouts import IGNORE_INDEX
from sft_tokenize.read.numpy_views import numpy_of

SMALLEST_CANDIDATE = 512
CHUNK_TOKENS = 1 << 20  # mask values per pass: 8 MB of running counts, reused, whatever the rows' lengths


@dataclass(frozen=True)
class RowTokens:
    """Per row: its tokens, its trained tokens, and its trained tokens within each of `within`'s lengths."""

    lengths: np.ndarray  # int64
    trained: np.ndarray  # int64
    within: dict[int, np.ndarray]  # L -> int64 trained tokens among the row's first L

    def take(self, rows: np.ndarray) -> RowTokens:
        """These rows (repeats included), as a mixture sees them."""
        return RowTokens(self.lengths[rows], self.trained[rows], {n: w[rows] for n, w in self.within.items()})

    @staticmethod
    def concat(parts: list[RowTokens]) -> RowTokens:
        return RowTokens(np.concatenate([p.lengths for p in parts]), np.concatenate([p.trained for p in parts]),
                         {n: np.concatenate([p.within[n] for p in parts]) for n in parts[0].within})


def candidate_lengths(longest: int, extra: Iterable[int] = ()) -> list[int]:
    """Powers of two from 512 up to the first that holds the longest row, and any lengths asked for (each from 1 to
    MAX_SEQUENCE_TOKENS: packing allocates per token of length)."""
    extra = [int(n) for n in extra]
    if bad := [n for n in extra if not 1 <= n <= MAX_SEQUENCE_TOKENS]:
        raise ValueError(f"length {bad[0]:,}: a cost report's lengths are 1 to {MAX_SEQUENCE_TOKENS:,} tokens")
    out, length = set(), SMALLEST_CANDIDATE
    while True:
        out.add(length)
        if length >= longest:
            break
        length *= 2
    return sorted(out | {int(n) for n in extra})


def _trained_flags(values: pa.Array, name: str) -> np.ndarray:
    flat = numpy_of(values)
    return flat != IGNORE_INDEX if name == "labels" else flat.astype(bool, copy=False)


def _list_chunks(column: pa.ChunkedArray, tokens: int) -> Iterator[tuple[np.ndarray, pa.Array]]:
    """(offsets from 0, flat values) of runs of rows of about `tokens` values: the column's own record batches
    (no copy), a large one cut by rows."""
    for chunk in column.chunks:
        offsets = numpy_of(chunk.offsets)
        start = 0
        while start < len(chunk):
            # the last row boundary within `tokens` values from here (at least one row)
            end = max(start + 1, int(np.searchsorted(offsets, offsets[start] + tokens, side="right")) - 1)
            cut = offsets[start:end + 1]
            yield cut - cut[0], chunk.values.slice(int(cut[0]), int(cut[-1] - cut[0]))
            start = end


def row_tokens(table: pa.Table, lengths: Sequence[int] = ()) -> RowTokens:
    """One pass over the table's trained-token column (`loss_mask`, else `labels`): every row's tokens, trained
    tokens, and trained tokens within each of `lengths`."""
    name = "loss_mask" if "loss_mask" in table.column_names else "labels"
    if name not in table.column_names:
        raise ValueError(f"the cache has neither a loss_mask nor a labels column ({', '.join(table.column_names)})")
    rows = table.num_rows
    row_lengths = np.empty(rows, dtype=np.int64)
    trained = np.empty(rows, dtype=np.int64)
    within = {int(n): np.empty(rows, dtype=np.int64) for n in lengths}
    running = np.zeros(1, dtype=np.int64)  # trained tokens before each position of a run; reused: no page faults
    row = 0
    for offsets, values in _list_chunks(table.column(name), CHUNK_TOKENS):
        count, size = len(offsets) - 1, int(offsets[-1])
        if len(running) <= size:
            running = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(_trained_flags(values, name), out=running[1:size + 1])
        first, sizes = offsets[:-1], np.diff(offsets)
        done = slice(row, row + count)
        row_lengths[done] = sizes
        trained[done] = running[offsets[1:]] - running[first]
        for n, out in within.items():
            out[done] = running[first + np.minimum(sizes, n)] - running[first]
        row += count
    return RowTokens(row_lengths, trained, within)


def log_histogram(values: np.ndarray, per_octave: int = 2) -> list[tuple[int, int, int]]:
    """(low, high, count) bins with `per_octave` bins per doubling, low ≤ value < high, from the smallest
    value's bin to the largest's; the counts add up to len(values). Zeros get a bin [0, 1) of their own."""
    values = np.asarray(values, dtype=np.int64)
    if not len(values):
        return []
    edges = sorted({int(round(2 ** (k / per_octave))) for k in range(0, per_octave * 64)})
    edges = [0, *edges]
    lo_edge = max(i for i, e in enumerate(edges) if e <= values.min())
    hi_edge = min(i for i, e in enumerate(edges) if e > values.max())
    edges = edges[lo_edge:hi_edge + 1]
    counts = np.histogram(values, bins=edges)[0]  # the last bin of np.histogram is closed: its edge is above max
    return [(edges[i], edges[i + 1], int(c)) for i, c in enumerate(counts)]


def cost_at(rows: RowTokens, length: int, truncation: Literal["truncate", "drop"] = "truncate",
            pack: bool = True, algorithm: str = "bfd") -> dict[str, Any]:
    """What training at `length` loses, and the packing index at `length`."""
    if length not in rows.within:
        raise ValueError(f"length {length} was not among the lengths counted ({sorted(rows.within)})")
    over = rows.lengths > length
    if truncation == "drop":
        dropped = over
        truncated = np.zeros_like(over)
        tokens_lost = int(rows.lengths[over].sum())
    else:
        dropped = over & (rows.within[length] == 0)  # truncated away: no trained token left
        truncated = over & ~dropped
        tokens_lost = int((rows.lengths[truncated] - length).sum() + rows.lengths[dropped].sum())
    kept_trained = np.where(dropped, 0, rows.within[length] if truncation == "truncate" else rows.trained)
    out = {
        "length": length,
        "rows_truncated": int(truncated.sum()),
        "rows_dropped": int(dropped.sum()),
        "tokens_lost": tokens_lost,
        "trained_tokens_lost": int(rows.trained.sum() - kept_trained.sum()),
    }
    if pack:  # the bins of the index `sft-tokenize pack --length L` builds: every row, cut to its first L tokens
        cut = np.minimum(rows.lengths, length)
        bins = len(ALGORITHMS[algorithm](cut, length)[1]) - 1 if len(cut) else 0
        out["pack_bins"] = bins
        out["pack_fill"] = round(int(cut.sum()) / (bins * length), 6) if bins else 0.0
    return out


def report_of(rows: RowTokens, candidates: list[int], truncation: Literal["truncate", "drop"], pack: bool
            ) -> dict[str, Any]:
    return {
        "rows": int(len(rows.lengths)),
        "tokens": int(rows.lengths.sum()),
        "trained_tokens": int(rows.trained.sum()),
        "truncation": truncation,
        "lengths_histogram": log_histogram(rows.lengths),
        "trained_histogram": log_histogram(rows.trained),
        "candidates": [cost_at(rows, n, truncation, pack) for n in candidates],
    }


def length_costs(table: pa.Table, at: Iterable[int] = (), truncation: Literal["truncate", "drop"] = "truncate",
                 pack: bool = True) -> dict[str, Any]:
    """The histograms and the table of candidate lengths for a cache's rows."""
    lengths = numpy_of(pc.list_value_length(table.column(table.column_names[0])))
    candidates = candidate_lengths(int(lengths.max(initial=0)), at)
    return report_of(row_tokens(table, candidates), candidates, truncation, pack)


def mixture_costs(tables: list[pa.Table], sources: np.ndarray, rows: np.ndarray, meta: dict[str, Any],
                  at: Iterable[int] = (), truncation: Literal["truncate", "drop"] = "truncate",
                  pack: bool = True) -> dict[str, Any]:
    """The same for a mixture index (its source caches' tables, its `sources` and `rows` arrays and its
    mixture.json): over the mixed rows as a trainer sees them (a row taken three times counts three times),
    then per source its shares, epochs and repeats (from mixture.json) and what each length costs it."""
    per_table = [rows[sources == s] for s in range(len(tables))]
    longest = max((int(pc.max(pc.list_value_length(t.column(t.column_names[0]))).as_py() or 0) for t in tables
                   if t.num_rows), default=0)
    candidates = candidate_lengths(longest, at)
    taken = [row_tokens(t, candidates).take(r) for t, r in zip(tables, per_table, strict=True)]
    out = report_of(RowTokens.concat(taken), candidates, truncation, pack)
    out["sources"] = []
    for recorded, mine in zip(meta["sources"], taken, strict=True):
        described = {k: recorded[k] for k in ("name", "asked", "rows", "tokens", "trained_tokens", "share",
                                              "epochs", "times_seen", "caps") if k in recorded}
        described["candidates"] = [cost_at(mine, n, truncation, pack=False) for n in candidates]
        out["sources"].append(described)
    return out

