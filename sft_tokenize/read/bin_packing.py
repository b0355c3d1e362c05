"""Bin packing of row lengths: best-fit and first-fit decreasing, exact, in O(rows) memory.

Both take integer lengths in [1, capacity] and return `(rows, offsets)`: bin b holds the row ids
`rows[offsets[b]:offsets[b + 1]]`, longest first, and bins are numbered in the order they were opened.
Rows are placed longest first, ties by row id, so the result is a function of the lengths alone.

A row-by-row loop costs a few microseconds of Python per row. Both run one length at a time instead:
rows of equal length L go, in order, to the bins that an item-by-item run would pick, and each such bin
takes floor(space / L) of them at once (after taking one it is still the best, or the first, that fits).
So the Python work is per distinct length and per group of bins touched, and numpy does the rest.

- best fit: bins are kept in buckets by remaining space (FIFO within a bucket, as TRL's `_pack_bfd`
  does, so a batch gives TRL's bins exactly); a block summary finds the non-empty buckets ≥ L.
- first fit: a max-segment tree over the bins' remaining space, searched level by level with numpy for
  the first bins (in opening order) that fit.
"""

from __future__ import annotations

import heapq

import numpy as np

BLOCK = 1024  # buckets per block of the best-fit summary
MAX_TAIL_STEPS = 4096  # the most steps of the data-parallel tail that are dealt again


def _check(lengths: np.ndarray, capacity: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError("lengths must be one-dimensional")
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"every length must be in [1, {capacity}]; got {lengths.min()}..{lengths.max()}")
    return lengths


def _longest_first(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row ids sorted by length (descending, ties by id), and the start and end of each run of one length."""
    order = np.argsort(-lengths, kind="stable")
    starts = np.flatnonzero(np.diff(lengths[order], prepend=-1))
    ends = np.append(starts[1:], len(order)) if len(order) else starts
    return order, starts, ends


def _as_bins(order: np.ndarray, bin_of: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by bin (stable: longest first within a bin) and the bins' offsets."""
    by_bin = np.argsort(bin_of, kind="stable")
    offsets = np.zeros(bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=bins), out=offsets[1:])
    return order[by_bin].astype(np.int64), offsets


class _Buckets:
    """Bins by remaining space, FIFO in each bucket, with a per-block count of non-empty buckets."""

    def __init__(self, capacity: int):
        # By space, only the non-empty buckets: a list per possible space took 2.7 s and 250 MB at 2^22 tokens.
        self.bins: dict[int, list[int]] = {}
        self.heads: dict[int, int] = {}  # bins[space][:heads[space]] have left the bucket
        self.nonempty = np.zeros(capacity + 1, dtype=bool)
        self.blocks = np.zeros(capacity // BLOCK + 1, dtype=np.int64)

    def add(self, space: int, bins) -> None:
        if space == 0:  # a full bin takes nothing more
            return
        self.bins.setdefault(space, []).extend(bins)
        if not self.nonempty[space]:
            self.nonempty[space] = True
            self.blocks[space // BLOCK] += 1

    def take(self, space: int, count: int) -> list[int]:
        bucket, head = self.bins.get(space, []), self.heads.get(space, 0)
        taken = bucket[head:head + count]
        head += len(taken)
        if head == len(bucket):
            self.bins.pop(space, None)
            self.heads.pop(space, None)
            self.nonempty[space] = False
            self.blocks[space // BLOCK] -= 1
        else:
            self.heads[space] = head
        return taken

    def size(self, space: int) -> int:
        return len(self.bins.get(space, ())) - self.heads.get(space, 0)

    def spaces_from(self, low: int):
        """Non-empty bucket spaces ≥ low, ascending (computed a block at a time, so buckets below `low`
        may change while this runs)."""
        first = low // BLOCK
        for block in np.flatnonzero(self.blocks[first:]) + first:
            start = max(int(block) * BLOCK, low)
            yield from (np.flatnonzero(self.nonempty[start:(int(block) + 1) * BLOCK]) + start).tolist()


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row, longest first, into the bin with the least space that still fits it, else a new bin."""
    lengths = _check(lengths, capacity)
    order, starts, ends = _longest_first(lengths)
    bin_of = np.empty(len(order), dtype=np.int64)  # bin of the i-th row of `order`
    buckets = _Buckets(capacity)
    opened = 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        length, placed, need = int(lengths[order[start]]), start, end - start
        for space in buckets.spaces_from(length):
            each = space // length
            chosen = buckets.take(space, min(buckets.size(space), need // each))
            if chosen:
                bin_of[placed:placed + len(chosen) * each] = np.repeat(chosen, each)
                placed, need = placed + len(chosen) * each, need - len(chosen) * each
                buckets.add(space - each * length, chosen)
            if need and buckets.size(space):  # fewer rows left than this bin could take
                (last,) = buckets.take(space, 1)
                bin_of[placed:placed + need] = last
                buckets.add(space - need * length, [last])
                placed, need = placed + need, 0
            if not need:
                break
        if need:  # new bins, each taking as many rows as fit
            each = capacity // length
            full, rest = divmod(need, each)
            new = list(range(opened, opened + full + bool(rest)))
            bin_of[placed:end] = np.repeat(new, [each] * full + ([rest] if rest else []))
            buckets.add(capacity - each * length, new[:full])
            if rest:
                buckets.add(capacity - rest * length, new[full:])
            opened += len(new)
    return _as_bins(order, bin_of, opened)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row, longest first, into the first opened bin that fits it, else a new bin."""
    lengths = _check(lengths, capacity)
    order, starts, ends = _longest_first(lengths)
    bin_of = np.empty(len(order), dtype=np.int64)
    leaves = 1 << max(0, (len(order) - 1).bit_length())  # at most one bin per row
    space = np.zeros(2 * leaves, dtype=np.int64)  # max remaining space under each node; unopened bins: 0
    opened = 0

    def set_space(bins: np.ndarray, values: np.ndarray) -> None:
        nodes = bins + leaves
        space[nodes] = values
        while nodes[0] > 1:
            nodes = np.unique(nodes >> 1)
            space[nodes] = np.maximum(space[2 * nodes], space[2 * nodes + 1])

    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        length, placed, need = int(lengths[order[start]]), start, end - start
        if space[1] >= length:
            # The first `need` fitting nodes of each level hold the first `need` fitting bins.
            nodes = np.array([1])
            while nodes[0] < leaves:
                children = np.stack((2 * nodes, 2 * nodes + 1), axis=1).ravel()
                nodes = children[space[children] >= length][:need]
            room = space[nodes]
            takes = np.minimum(room // length, need)
            cumulative = np.cumsum(takes)
            used = int(np.searchsorted(cumulative, need)) + 1  # bins until `need` rows are placed
            takes = takes[:used]
            if cumulative[min(used, len(cumulative)) - 1] > need:
                takes[-1] -= cumulative[used - 1] - need
            bins = nodes[:used] - leaves
            bin_of[placed:placed + int(takes.sum())] = np.repeat(bins, takes)
            placed, need = placed + int(takes.sum()), need - int(takes.sum())
            set_space(bins, room[:used] - takes * length)
        if need:
            each = capacity // length
            full, rest = divmod(need, each)
            new = np.arange(opened, opened + full + bool(rest))
            counts = np.array([each] * full + ([rest] if rest else []))
            bin_of[placed:end] = np.repeat(new, counts)
            set_space(new, capacity - counts * length)
            opened += len(new)
    return _as_bins(order, bin_of, opened)


ALGORITHMS = {"bfd": best_fit_decreasing, "ffd": first_fit_decreasing}


def _spread(loads: np.ndarray, ranks: int) -> float:
    """The worst step's (most - fewest) / most tokens, the loads sorted and dealt `ranks` at a time."""
    steps = np.sort(loads)[::-1].reshape(-1, ranks)
    return float(((steps[:, 0] - steps[:, -1]) / np.maximum(steps[:, 0], 1)).max()) if len(steps) else 0.0


def _deal_longest_first(lengths: np.ndarray, rows: np.ndarray, bins: int, capacity: int) -> list[list[int]] | None:
    """Rows, longest first (ties by id), each onto the bin with the fewest tokens (ties: the lowest bin):
    near-equal bins. None if a row would overflow `capacity`."""
    loads = [(0, b) for b in range(bins)]
    heapq.heapify(loads)
    dealt: list[list[int]] = [[] for _ in range(bins)]
    for row in rows[np.lexsort((rows, -lengths[rows]))].tolist():
        load, b = heapq.heappop(loads)
        load += int(lengths[row])
        if load > capacity:
            return None
        dealt[b].append(row)
        heapq.heappush(loads, (load, b))
    return dealt


def _split_for_ranks(lengths: np.ndarray, rows: np.ndarray, bin_of: np.ndarray, tokens: np.ndarray,
                     longest: np.ndarray, ranks: int) -> np.ndarray:
    """Split bins until their count is a multiple of `ranks`: each time the bin whose rows other than its
    longest hold the most tokens (so both halves are as large as they can be; ties: the first bin), its
    rows dealt longest first to the lighter half. Returns the tokens per bin; `bin_of` is updated in place.
    Stops early when every bin holds one row."""
    while len(tokens) % ranks:
        rest = tokens - longest
        if not len(rest) or rest.max() <= 0:
            break
        victim = int(np.argmax(rest))
        loads, new_bin, new_longest = [0, 0], len(tokens), 0
        for position in np.flatnonzero(bin_of == victim).tolist():  # longest first
            lighter = int(loads[1] < loads[0])
            length = int(lengths[rows[position]])
            if lighter:
                bin_of[position] = new_bin
                new_longest = new_longest or length
            loads[lighter] += length
        tokens[victim] = loads[0]
        tokens = np.append(tokens, loads[1])
        longest = np.append(longest, new_longest)
    return tokens


def arrange_for_ranks(lengths: np.ndarray, rows: np.ndarray, offsets: np.ndarray, ranks: int,
                      capacity: int, tolerance: float = 0.005) -> tuple[np.ndarray, np.ndarray]:
    """Bins reordered for `ranks` data-parallel ranks: bin s*ranks + r is rank r's bin at step s.

    1. The bin count is made a multiple of `ranks` by splitting bins with the most rows (empty bins are
       added only when every bin is down to one row).
    2. Bins are sorted by tokens, most first (ties by bin), and dealt out `ranks` at a time, so the bins of
       one step hold nearly the same number of tokens.
    3. Where that leaves the last steps uneven (the fullest and emptiest bin of a step more than `tolerance`
       apart), the bins of the last 1, 2, 4 … steps are made again: their rows, longest first, each onto
       the bin with the fewest tokens so far. The first tail within `tolerance` is kept, else the most even
       one if it beats the sorted order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bin_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))  # the bin of each position of `rows`
    tokens = np.bincount(bin_of, weights=lengths[rows], minlength=len(offsets) - 1).astype(np.int64)
    longest = lengths[rows[offsets[:-1]]] if len(rows) else np.zeros(0, dtype=np.int64)
    tokens = _split_for_ranks(lengths, rows, bin_of, tokens, longest, ranks)
    tokens = np.append(tokens, np.zeros(-len(tokens) % ranks, dtype=np.int64))
    order = np.argsort(-tokens, kind="stable")
    rank_of = np.empty(len(order), dtype=np.int64)
    rank_of[order] = np.arange(len(order))  # position of each bin in `order`
    best: tuple[float, int, list[list[int]]] = (0.0, len(order), [])  # (spread gained, tail start, tail bins)
    steps = 1
    while steps <= MAX_TAIL_STEPS:
        start = max(0, len(order) - steps * ranks)
        before = _spread(tokens[order[start:]], ranks)
        if before <= tolerance and steps >= 4:
            break
        dealt = _deal_longest_first(lengths, rows[rank_of[bin_of] >= start], len(order) - start, capacity)
        if dealt is not None:
            after = _spread(np.array([int(lengths[d].sum()) for d in dealt], dtype=np.int64), ranks)
            if before - after > best[0]:
                best = (before - after, start, dealt)
            if after <= tolerance:
                break
        if start == 0:
            break
        steps *= 2
    _, start, dealt = best
    kept_tokens = np.concatenate((tokens[order[:start]], np.array([int(lengths[d].sum()) for d in dealt],
                                                                    dtype=np.int64)))
    place = np.empty(len(kept_tokens), dtype=np.int64)
    place[np.argsort(-kept_tokens, kind="stable")] = np.arange(len(kept_tokens))
    in_body = rank_of[bin_of] < start
    dealt_rows = np.array([row for d in dealt for row in d], dtype=np.int64)
    dealt_bins = np.repeat(np.arange(start, start + len(dealt)), [len(d) for d in dealt]).astype(np.int64)
    all_rows = np.concatenate((rows[in_body], dealt_rows))
    all_places = place[np.concatenate((rank_of[bin_of[in_body]], dealt_bins))]
    final = np.lexsort((np.arange(len(all_rows)), all_places))  # by place, each bin's rows in their order
    new_offsets = np.zeros(len(kept_tokens) + 1, dtype=np.int64)
    np.cumsum(np.bincount(all_places, minlength=len(kept_tokens)), out=new_offsets[1:])
    return all_rows[final].astype(np.int64), new_offsets
