"""Packed sequences over a cache and its packing index, for padding-free training.

    packed = open_cache(path).packed(4096, data_parallel=8)     # builds the index beside the cache if missing
    seq = packed[0]      # input_ids, loss_mask, labels, position_ids, seq_lengths, cu_seqlens, row_ids
    sampler = PackedSampler(packed, rank=r, seed=0)             # this rank's bin per step; set_epoch(e)

Item i is bin i of the index; for R ranks, bin s*R + r is rank r's bin at step s. Values are numpy views
of the memory-mapped Arrow buffers where a bin is one row (no copy), else one concatenation of the rows'
views. A row longer than N contributes its first N tokens (the index's long-row policy). The object
pickles as the cache path and the packing options, so dataloader workers re-map the files.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sft_tokenize.read.cache import TokenizedCache
from sft_tokenize.read.numpy_views import numpy_of
from sft_tokenize.read.packing_index import PackingIndex, PackOptions, open_rows, pack_cache

if TYPE_CHECKING:
    from sft_tokenize.read.mixed_rows import MixedRows

IGNORE_INDEX = -100


class _Column:
    """One list column as numpy views per Arrow chunk: (offsets, values), found by row through chunk starts."""

    def __init__(self, chunked):
        self.offsets = [numpy_of(chunk.offsets) for chunk in chunked.chunks]
        self.values = [numpy_of(chunk.values) for chunk in chunked.chunks]
        self.starts = np.cumsum([0] + [len(chunk) for chunk in chunked.chunks])

    def row(self, row: int, keep: int) -> np.ndarray:
        chunk = int(np.searchsorted(self.starts, row, side="right")) - 1
        local = row - int(self.starts[chunk])
        start = int(self.offsets[chunk][local])
        stop = min(int(self.offsets[chunk][local + 1]), start + keep)
        return self.values[chunk][start:stop]


class PackedSequences(Sequence):
    """A map-style dataset of packed sequences: item i is bin i of the packing index."""

    def __init__(self, cache: TokenizedCache | MixedRows, index: PackingIndex, options: PackOptions):
        self.cache, self.index, self.options = cache, index, options
        self.length, self.ranks = options.length, options.data_parallel
        # Per cache whose rows these are (one, or a mixture's sources): its columns as numpy views.
        self._columns = [{name: _Column(c.table.column(name)) for name in cache.columns} for c in cache.caches]

    def __len__(self) -> int:
        return len(self.index)

    @property
    def steps(self) -> int:
        return len(self) // self.ranks

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"packed sequence {i} out of range for {len(self)} sequences")
        rows = self.index.bin(i % len(self)).tolist()
        item = {}
        located = [self.cache.locate(row) for row in rows]
        for name in self.cache.columns:
            parts = [self._columns[source][name].row(row, self.length) for source, row in located]
            item[name] = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.empty(0, np.int32)
        seq_lengths = np.array([len(part) for part in parts] if rows else [], dtype=np.int32)
        cu_seqlens = np.zeros(len(seq_lengths) + 1, dtype=np.int32)
        np.cumsum(seq_lengths, out=cu_seqlens[1:])
        if "labels" not in item:
            item["labels"] = np.where(item["loss_mask"] == 1, item["input_ids"], IGNORE_INDEX).astype(np.int32)
        item["position_ids"] = (np.arange(cu_seqlens[-1], dtype=np.int32)
                                - np.repeat(cu_seqlens[:-1], seq_lengths)).astype(np.int32)
        item["seq_lengths"] = seq_lengths
        item["cu_seqlens"] = cu_seqlens
        item["row_ids"] = np.asarray(rows, dtype=np.int64)
        return item

    def step_order(self, epoch: int = 0, seed: int = 0, shuffle: bool = True) -> np.ndarray:
        """The steps of one epoch: a permutation seeded by (seed, epoch), the same on every rank."""
        if not shuffle:
            return np.arange(self.steps)
        return np.random.default_rng([seed, epoch]).permutation(self.steps)

    def global_order(self, epoch: int = 0, seed: int = 0, shuffle: bool = True) -> list[int]:
        """Every bin of one epoch, step after step, rank 0..R-1 within a step: for a trainer that deals a
        sequential order out to its ranks round-robin (one sequence per rank per step)."""
        steps = self.step_order(epoch, seed, shuffle)
        return (steps[:, None] * self.ranks + np.arange(self.ranks)).ravel().tolist()

    def ordered(self, epochs: int = 1, seed: int = 0, shuffle: bool = True) -> OrderedSequences:
        """`epochs` epochs of `global_order` as one map-style dataset, for a trainer that reads its dataset in
        order and deals it out to its ranks (transformers/TRL with `train_sampling_strategy="sequential"`)."""
        order = [i for epoch in range(epochs) for i in self.global_order(epoch, seed, shuffle)]
        return OrderedSequences(self, order)

    def iterable_dataset(self, epochs: int = 1, seed: int = 0, columns: tuple[str, ...] = ("input_ids", "labels",
                         "seq_lengths")):
        """`ordered(epochs, seed)` as a `datasets.IterableDataset` of `columns`, for trainers that accept only
        datasets' types (TRL's SFTTrainer). Rows stream from the mapped cache; nothing is copied to disk."""
        import datasets

        return datasets.IterableDataset.from_generator(
            # a tuple: datasets would read a list in gen_kwargs as shards, one per element
            _stream, gen_kwargs={"ordered": self.ordered(epochs, seed), "columns": tuple(columns)})

    @property
    def column_names(self) -> list[str]:
        """The keys of every item, as `datasets.Dataset.column_names` (trainers look for them)."""
        return [*self.cache.columns, *(["labels"] if "labels" not in self.cache.columns else []),
                "position_ids", "seq_lengths", "cu_seqlens", "row_ids"]

    def __reduce__(self):
        return packed_sequences, (str(self.cache.path), self.options.model_dump())

    def __repr__(self) -> str:
        return (f"PackedSequences({str(self.cache.path)!r}, {self.options.key}, sequences={len(self)}, "
                f"efficiency={self.index.meta['efficiency']:.2%})")


class OrderedSequences(Sequence):
    """Packed sequences in a given order of bins (see `PackedSequences.ordered`)."""

    def __init__(self, packed: PackedSequences, order: list[int]):
        self.packed, self.order = packed, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.packed[self.order[i]]

    @property
    def column_names(self) -> list[str]:
        return self.packed.column_names


class PackedSampler:
    """The bins one rank trains on, one per step, steps in `step_order`: a sampler for torch's DataLoader
    (`batch_size=1`) or any loop. Call `set_epoch(e)` before each epoch, as with DistributedSampler."""

    def __init__(self, packed: PackedSequences, rank: int = 0, seed: int = 0, shuffle: bool = True):
        if not 0 <= rank < packed.ranks:
            raise ValueError(f"rank {rank} out of range for an index packed for {packed.ranks} ranks")
        self.packed, self.rank, self.seed, self.shuffle, self.epoch = packed, rank, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        steps = self.packed.step_order(self.epoch, self.seed, self.shuffle)
        return iter((steps * self.packed.ranks + self.rank).tolist())

    def __len__(self) -> int:
        return self.packed.steps


def _stream(ordered: OrderedSequences, columns: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
    for item in ordered:
        yield {name: item[name] for name in columns}


def packed_sequences(cache: str | TokenizedCache | MixedRows, options: PackOptions | dict) -> PackedSequences:
    """Packed sequences of `cache` (or of a mixture's rows) for `options`, building and publishing the index
    first if it is missing."""
    cache = open_rows(cache) if isinstance(cache, (str, Path)) else cache
    options = options if isinstance(options, PackOptions) else PackOptions(**options)
    return PackedSequences(cache, pack_cache(cache, options), options)

