"""Trained character spans become trained tokens: a token holding any trained character is trained.

Byte-level BPE merges a template's separator with the first characters of an answer (`Assistant: ` and `Hello`
give the token " Hello"; ChatML's header newline and an answer's own leading newline give "\\n\\n"). Such a
token straddles the edge of a trained span, and it is trained: the model emits it, and a rule that left it out
would make the mask depend on how the template is written (transformers' `return_assistant_tokens_mask` trains it
for a `{% generation %}` template). Tokens trained because they straddle an edge are counted.

A row's tokens are given by where each starts and ends in its text (both non-decreasing, as byte-level
tokenizers and tokenizers' offsets give them), or by a tokenizers `Encoding`, whose offsets are read only at the
span edges.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np

from sft_tokenize.encoding.placement import FlatPlacement


def trained_regions(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans in order, empty ones left out and touching ones joined: each edge is then between a trained
    character and an untrained one (or the text's end)."""
    joined: list[tuple[int, int]] = []
    for begin, end in sorted(regions):
        if end <= begin:
            continue
        if joined and begin <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(end, joined[-1][1]))
        else:
            joined.append((begin, end))
    return joined


def joined_regions(row_regions: Sequence[Sequence[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row's spans joined as trained_regions joins them, for all rows at once: the row of each joined
    span, its first character and its end, in order of row and then of character."""
    counts = np.fromiter(map(len, row_regions), dtype=np.int64, count=len(row_regions))
    edges = np.fromiter(chain.from_iterable(chain.from_iterable(row_regions)), dtype=np.int64,
                        count=2 * int(counts.sum())).reshape(-1, 2)
    rows = np.repeat(np.arange(len(counts)), counts)
    begins, ends = edges[:, 0], edges[:, 1]
    if not (filled := ends > begins).all():
        rows, begins, ends = rows[filled], begins[filled], ends[filled]
    if not len(rows):
        return rows, begins, ends
    same_row = rows[1:] == rows[:-1]
    if (same_row & (begins[1:] < begins[:-1])).any():
        order = np.lexsort((begins, rows))
        rows, begins, ends = rows[order], begins[order], ends[order]
    # Each row's ends, shifted past every end of the rows before it: one running maximum for all rows.
    shift = rows * (int(ends.max()) + 1)
    reach = np.maximum.accumulate(ends + shift)[:-1] - shift[1:]  # the furthest end before each span, its row's
    opens = np.flatnonzero(np.concatenate(([True], ~same_row | (begins[1:] > reach))))
    return rows[opens], begins[opens], np.maximum.reduceat(ends, opens)


def span_edges(starts: np.ndarray, ends: np.ndarray, begins: np.ndarray, stops: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each region [begins[i], stops[i]) (joined, see trained_regions): the first token holding one of its
    characters and the first token after it, as arrays; and the tokens that straddle an edge (hold characters on
    both sides). Tokens are given by where each starts and ends (non-decreasing), in the regions' unit."""
    if not len(begins):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    first = np.searchsorted(ends, begins, side="right")  # the first token ending past the region's start
    stop = np.maximum(np.searchsorted(starts, stops, side="left"), first)  # the first starting at its end
    held = stop > first
    last = len(starts) - 1
    before = held & (starts[np.minimum(first, last)] < begins)
    after = held & (ends[np.maximum(stop - 1, 0)] > stops)
    return first, stop, np.unique(np.concatenate([first[before], stop[after] - 1]))


def flat_mask(row_regions: Sequence[Sequence[tuple[int, int]]], placement: FlatPlacement
              ) -> tuple[np.ndarray, np.ndarray]:
    """The loss mask of a placement's rows (every one placed), for all rows at once, and the tokens trained for
    straddling an edge. Found in bytes: each trained span's edges become bytes, and the tokens' byte ends say
    which tokens hold them (the same tokens as in characters: placement.py)."""
    rows, begins, ends = joined_regions(row_regions)
    byte_ends = placement.byte_ends
    first, stop, straddling = span_edges(byte_ends[:-1], byte_ends[1:], placement.token_bytes(rows, begins),
                                         placement.token_bytes(rows, ends))
    # Spans in order, so their token ranges are too (a token may end one and start the next): the mask is runs
    # of 0 and 1 between those edges.
    edges = np.empty(2 * len(first) + 2, dtype=np.int64)
    edges[0], edges[-1] = 0, len(placement.ids)
    edges[1:-1:2] = np.maximum(first, np.concatenate(([0], stop[:-1])))
    edges[2:-1:2] = stop
    runs = np.zeros(len(edges) - 1, dtype=np.int8)
    runs[1::2] = 1
    return np.repeat(runs, np.diff(edges)), straddling


def _first_holding(enc, position: int, n_tokens: int, n_chars: int) -> int:
    """Index of the first token holding a character at or after `position` (enc.offsets would build them all)."""
    while position < n_chars:
        token = enc.char_to_token(position)
        if token is not None:
            return token
        position += 1
    return n_tokens


def _first_at_or_after(enc, position: int, n_tokens: int, n_chars: int) -> int:
    """Index of the first token starting at or after `position`."""
    while position < n_chars:
        token = enc.char_to_token(position)
        if token is not None:
            return token if enc.token_to_chars(token)[0] >= position else token + 1
        position += 1
    return n_tokens


def encoding_spans(enc, regions: Sequence[tuple[int, int]], n_chars: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Token index ranges [first, stop) trained for a row's character regions, and the tokens trained for
    straddling an edge: from a tokenizers `Encoding`, or anything with `starts` and `ends` arrays."""
    regions = trained_regions(regions)
    if hasattr(enc, "starts"):
        at = np.asarray(regions, dtype=np.int64).reshape(-1, 2)
        first, stop, straddling = span_edges(enc.starts, enc.ends, at[:, 0], at[:, 1])
        return [(a, b) for a, b in zip(first.tolist(), stop.tolist(), strict=True) if b > a], straddling.tolist()
    n_tokens, spans, straddling = len(enc.ids), [], set()
    for begin, end in regions:
        first = _first_holding(enc, begin, n_tokens, n_chars)
        stop = max(_first_at_or_after(enc, end, n_tokens, n_chars), first)
        if stop > first:
            spans.append((first, stop))
            if enc.token_to_chars(first)[0] < begin:
                straddling.add(first)
            if enc.token_to_chars(stop - 1)[1] > end:
                straddling.add(stop - 1)
    return spans, sorted(straddling)
