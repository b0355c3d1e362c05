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

import numpy as np


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


def span_edges(starts: np.ndarray, ends: np.ndarray, regions: Sequence[tuple[int, int]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each region (joined, see trained_regions): the first token holding one of its characters and the
    first token after it, as arrays; and the tokens that straddle an edge (hold characters on both sides)."""
    if not regions:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    at = np.asarray(regions, dtype=np.int64)
    first = np.searchsorted(ends, at[:, 0], side="right")  # the first token ending past the region's start
    stop = np.maximum(np.searchsorted(starts, at[:, 1], side="left"), first)  # the first starting at its end
    held = stop > first
    last = len(starts) - 1
    before = held & (starts[np.minimum(first, last)] < at[:, 0])
    after = held & (ends[np.maximum(stop - 1, 0)] > at[:, 1])
    return first, stop, np.unique(np.concatenate([first[before], stop[after] - 1]))


def flat_mask(row_regions: Sequence[Sequence[tuple[int, int]]], text_lengths: np.ndarray, starts: np.ndarray,
              ends: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The loss mask of rows placed end to end (`counts` tokens each, their `starts` and `ends` in their own
    row), for all rows at once, and the tokens trained for straddling an edge."""
    base = np.zeros(len(text_lengths) + 1, dtype=np.int64)
    np.cumsum(text_lengths, out=base[1:])  # each row's first character, rows end to end
    shift = np.repeat(base[:-1], counts)
    regions = [(begin + int(base[j]), end + int(base[j])) for j, spans in enumerate(row_regions)
               for begin, end in trained_regions(spans)]
    first, stop, straddling = span_edges(starts + shift, ends + shift, regions)
    delta = np.zeros(len(starts) + 1, dtype=np.int32)
    np.add.at(delta, first, 1)
    np.add.at(delta, stop, -1)
    return (np.cumsum(delta[:-1]) > 0).astype(np.int8), straddling


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
        first, stop, straddling = span_edges(enc.starts, enc.ends, regions)
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
