"""A batch's tokens placed in its texts by their byte lengths: what the loss mask needs of a fast encoder's ids.

For byte-level BPE each id stands for a fixed run of UTF-8 bytes, so running totals of those lengths say where
every token starts and ends in its row's bytes. The mask is found in bytes: each trained character span becomes
a byte span (`TextBytes.byte_of`: a few positions a row), and the tokens holding it are found among the
tokens' byte ends (token_mask.py), with no per-token character arithmetic. A token's position in characters
(`FlatPlacement.row`, what HF's offsets say) is worked out only for the rows that ask: those checked against
HF's, and rows encoded one by one.

Characters and bytes meet at the continuation bytes (0x80-0xBF) of the batch's UTF-8, which are few: a character
starts at its lead byte, and a token whose first byte continues a character starts at that character (byte-level
BPE splits some). Both sides count the same characters, so a span's tokens are the same found either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np


def running_totals(values: np.ndarray) -> np.ndarray:
    """0, then the running total after each value (int64): without a concatenated copy."""
    totals = np.empty(len(values) + 1, dtype=np.int64)
    totals[0] = 0
    np.cumsum(values, out=totals[1:])
    return totals


_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class TextBytes:
    """Where a batch's texts' characters fall in their UTF-8 bytes, the texts end to end: each row's first
    character and first byte there, its byte count, and every continuation byte's position (none in ASCII)."""

    chars: np.ndarray  # int64 per row: its first character, the batch's texts end to end
    first_bytes: np.ndarray  # int64 per row: its first byte
    row_bytes: np.ndarray  # int64 per row: its length in bytes
    continuation: np.ndarray = field(default_factory=lambda: _NONE)  # int64: each continuation byte, ascending
    owner: np.ndarray = field(default_factory=lambda: _NONE)  # int64: the character each belongs to

    @classmethod
    def of(cls, texts: list[str]) -> TextBytes:
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        chars = running_totals(lengths)[:-1]
        if all(map(str.isascii, texts)):  # O(1) a text in CPython: one byte a character, no copy of the batch
            return cls(chars, chars, lengths)
        encoded = [text.encode("utf-8") for text in texts]
        row_bytes = np.fromiter(map(len, encoded), dtype=np.int64, count=len(texts))
        data = np.frombuffer(b"".join(encoded), dtype=np.int8)
        continuation = np.flatnonzero(data < -64)
        # Before the k-th continuation byte come k others: the lead bytes before it are its position less k, and
        # the last of them starts its character.
        owner = continuation - np.arange(1, len(continuation) + 1)
        return cls(chars, running_totals(row_bytes)[:-1], row_bytes, continuation, owner)

    @property
    def ascii(self) -> bool:
        return not len(self.continuation)

    def subset(self, rows: np.ndarray) -> TextBytes:
        """These rows only (their positions stay those of the whole batch)."""
        return replace(self, chars=self.chars[rows], first_bytes=self.first_bytes[rows], row_bytes=self.row_bytes[rows])

    def byte_of(self, rows: np.ndarray, chars: np.ndarray) -> np.ndarray:
        """The byte where character `chars[i]` of row `rows[i]` starts, in its row (its length at the row's end)."""
        if self.ascii:
            return chars
        at = self.chars[rows] + chars
        return at + np.searchsorted(self.owner, at, side="left") - self.first_bytes[rows]

    def chars_of(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Byte spans [starts, ends) of rows `rows` (in their row) as character spans: each from the character its
        first byte belongs to, to past the character of its last byte."""
        if self.ascii:
            return starts, ends
        base = self.first_bytes[rows]
        first, last = starts + base, ends + base
        before_first = np.searchsorted(self.continuation, first, side="left")  # continuation bytes before it
        inside = self.continuation[np.minimum(before_first, len(self.continuation) - 1)] == first
        characters = self.chars[rows]
        start_chars = first - before_first - inside - characters
        end_chars = last - np.searchsorted(self.continuation, last, side="left") - characters
        return start_chars, end_chars


@dataclass(frozen=True)
class FlatPlacement:
    """A batch's ids end to end (`bounds`: row k is [bounds[k], bounds[k+1])), the running total of their byte
    lengths (`byte_ends`: token t holds bytes [byte_ends[t], byte_ends[t+1]) of the rows' bytes end to end, when
    every row before it is placed), whether each row was placed (its tokens cover its text byte for byte), and
    the rows' texts as bytes."""

    ids: np.ndarray  # int32
    bounds: np.ndarray  # int64
    byte_ends: np.ndarray  # int64, tokens + 1
    placed: np.ndarray  # bool, per row
    text: TextBytes

    @classmethod
    def none(cls, rows: int) -> FlatPlacement:
        """No row placed (a refused encoder's)."""
        zeros = np.zeros(rows + 1, dtype=np.int64)
        return cls(np.zeros(0, np.int32), zeros, zeros[:1], np.zeros(rows, dtype=bool),
                   TextBytes(zeros[:-1], zeros[:-1], zeros[:-1]))

    def kept(self) -> FlatPlacement:
        """The placed rows only: their tokens' bytes then follow each other as their texts' do."""
        if self.placed.all():
            return self
        counts = np.diff(self.bounds)
        tokens = np.repeat(self.placed, counts)
        lengths = np.diff(self.byte_ends)[tokens]
        return FlatPlacement(self.ids[tokens], running_totals(counts[self.placed]), running_totals(lengths),
                             np.ones(int(self.placed.sum()), dtype=bool), self.text.subset(np.flatnonzero(self.placed)))

    def token_bytes(self, rows: np.ndarray, chars: np.ndarray) -> np.ndarray:
        """Character `chars[i]` of placed row `rows[i]` as a position among `byte_ends` (all rows placed)."""
        return self.byte_ends[self.bounds[rows]] + self.text.byte_of(rows, chars)

    def _positions(self, row_of: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens a to b's first and past-last characters in their rows (`row_of`: each one's row; 0 in an
        unplaced row: never read)."""
        row_first = self.byte_ends[self.bounds[row_of]]
        starts, ends = self.text.chars_of(row_of, self.byte_ends[a:b] - row_first,
                                          self.byte_ends[a + 1:b + 1] - row_first)
        token_placed = self.placed[row_of]
        return np.where(token_placed, starts, 0), np.where(token_placed, ends, 0)

    @cached_property
    def _all_positions(self) -> tuple[np.ndarray, np.ndarray]:
        counts = np.diff(self.bounds)
        return self._positions(np.repeat(np.arange(len(counts)), counts), 0, len(self.ids))

    def row(self, k: int) -> IdsEncoding | None:
        """Row k's ids and each token's character span (None if not placed)."""
        if not self.placed[k]:
            return None
        a, b = int(self.bounds[k]), int(self.bounds[k + 1])
        if "_all_positions" in self.__dict__:  # worked out for every row already
            starts, ends = (positions[a:b] for positions in self._all_positions)
        else:  # a few rows (those checked against HF's): only theirs
            starts, ends = self._positions(np.full(b - a, k), a, b)
        return IdsEncoding(self.ids[a:b].tolist(), starts, ends)

    def rows(self) -> list[IdsEncoding | None]:
        """Every row, as row(k), worked out for all of them at once."""
        starts, ends = self._all_positions
        return [IdsEncoding(self.ids[a:b].tolist(), starts[a:b], ends[a:b]) if placed else None
                for a, b, placed in zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), self.placed.tolist(),
                                        strict=True)]


@dataclass(frozen=True)
class IdsEncoding:
    """One row's ids and each token's character span, from byte lengths alone; the mask code's interface."""

    ids: list[int]
    starts: np.ndarray  # int64, character where each token starts
    ends: np.ndarray

    @property
    def offsets(self) -> list[tuple[int, int]]:
        return list(zip(self.starts.tolist(), self.ends.tolist(), strict=True))
