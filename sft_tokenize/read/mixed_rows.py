"""The rows of a mixture index, as `open_cache` gives them (`trainers.mixture_dataset`: as one `Dataset`).

    rows = open_mixture(mixture.path)        # rows as open_cache gives them, source after source interleaved
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import TokenizedCache, open_cache
from sft_tokenize.read.mixture_index import check_sources, load_mixture


class MixedRows(Sequence):
    """The rows of a mixture index, as `open_cache` gives them, in the index's order; pickles as its path."""

    def __init__(self, path: str | Path):
        self.index = load_mixture(path)
        self.path = self.index.path
        check_sources(self.index)
        self.caches = [open_cache(p) for p in self.index.meta["source_caches"]]
        columns = [tuple(c.columns) for c in self.caches]
        if len(set(columns)) > 1:
            raise CacheError(f"{self.path}: the sources' caches have different columns ({columns})")
        self.columns = list(columns[0])

    def __len__(self) -> int:
        return len(self.index)

    @property
    def fingerprint(self) -> str:
        return self.index.meta["key"]

    def locate(self, i: int) -> tuple[int, int]:
        """(which of `caches`, which row of it) holds row `i` of the mixture."""
        return int(self.index.sources[i]), int(self.index.rows[i])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for a mixture of {len(self)} rows")
        source, row = self.locate(i % len(self))
        return self.caches[source][row]

    # Packed sequences of the mixed rows over their own packing index, built beside the mixture if missing.
    packed = TokenizedCache.packed

    @cached_property
    def lengths(self) -> np.ndarray:
        out = np.empty(len(self), dtype=np.int32)
        for s, cache in enumerate(self.caches):
            mine = self.index.sources == s
            out[mine] = cache.lengths[self.index.rows[mine]]
        return out

    def __reduce__(self):
        return open_mixture, (str(self.path),)

    def __repr__(self) -> str:
        return f"MixedRows({str(self.path)!r}, rows={len(self)}, sources={len(self.caches)})"


def open_mixture(path: str | Path) -> MixedRows:
    """The rows of the mixture index at `path` (a directory holding mixture.json)."""
    return MixedRows(path)
