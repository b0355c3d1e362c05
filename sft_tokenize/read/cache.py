"""The trainer's side: open a published cache memory-mapped, checked against its manifest.

    cache = open_cache("/data/cache/ultrachat-3f2a9c1d0b7e4f65")
    len(cache), cache[0]["input_ids"], cache.lengths   # lengths from the Arrow list offsets
    cache.packed(4096, data_parallel=8)                 # packed sequences over a global packing index

The cache pickles as its path, so every dataloader worker maps the same files instead of copying rows.
See FORMAT.md for the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sft_tokenize.errors import CacheError
from sft_tokenize.format.manifest import read_manifest

LENGTH_CHUNK_ROWS = 1 << 20


class TokenizedCache(Sequence):
    """A map-style dataset over a published cache, memory-mapped: a row is read (and copied) when indexed."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()
        self.manifest = read_manifest(self.path)
        tables = []
        for entry in self.manifest["files"]:
            try:
                tables.append(pa.ipc.open_stream(pa.memory_map(str(self.path / entry["name"]))).read_all())
            except pa.ArrowInvalid as error:
                raise CacheError(f"{self.path / entry['name']}: unreadable Arrow data ({error})") from None
        self.table = pa.concat_tables(tables) if tables else None
        if len(self) != self.manifest["rows"]:
            raise CacheError(f"{self.path}: {len(self)} rows on disk, the manifest says {self.manifest['rows']}")
        self.columns = self.table.column_names if self.table is not None else []

    def __len__(self) -> int:
        return 0 if self.table is None else self.table.num_rows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """One row's columns as writable numpy arrays of their own (a copy of this row only), which
        `torch.as_tensor` and the default collate take without a "not writable" warning; the mapped
        cache itself is never written through them."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for a cache of {len(self)} rows")
        index %= len(self)
        return {name: np.array(self.table.column(name)[index].values) for name in self.columns}

    @cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per row, from the list offsets only, a chunk at a time: no row is materialized."""
        out = np.empty(len(self), dtype=np.int32)
        column = self.table.column("input_ids") if self.table is not None else None
        for start in range(0, len(self), LENGTH_CHUNK_ROWS):
            chunk = column.slice(start, LENGTH_CHUNK_ROWS)
            out[start:start + len(chunk)] = pc.list_value_length(chunk).to_numpy()
        return out

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def caches(self) -> list[TokenizedCache]:
        """The caches whose rows these are (a mixture has several): this one."""
        return [self]

    def locate(self, row: int) -> tuple[int, int]:
        """(which of `caches`, which row of it) holds row `row`."""
        return 0, row

    def packed(self, length: int, data_parallel: int = 1, algorithm: str = "bfd", index_dir: str | None = None):
        """Packed sequences of at most `length` tokens over the cache's global packing index, which is built
        and published beside the cache first if it is missing (see packed.py)."""
        from sft_tokenize.read.packed_sequences import packed_sequences

        return packed_sequences(self, {"length": length, "data_parallel": data_parallel, "algorithm": algorithm,
                                       "index_dir": index_dir})

    def __reduce__(self):
        return open_cache, (str(self.path),)

    def __repr__(self) -> str:
        return f"TokenizedCache({str(self.path)!r}, rows={len(self)})"


def open_cache(path: str | Path) -> TokenizedCache:
    return TokenizedCache(path)
