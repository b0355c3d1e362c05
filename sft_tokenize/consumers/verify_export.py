"""An export read back by its consumer's own reader and checked row for row against the cache it was made from:
`sft-tokenize verify CACHE --trainer megatron|mds|litdata --export OUT`.

    megatron  Megatron-Core's IndexedDataset over OUT/tokens and OUT/loss_mask
    mds       mosaicml-streaming's StreamingDataset over OUT (local), in order
    litdata   litdata's StreamingDataset over OUT, in order

The first `batches` × `batch_size` rows (all of them when that covers the cache) must hold the cache's ids and
mask exactly, and the reader must count as many rows as the cache: a row dropped or duplicated changes the count.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.errors import BadInput
from sft_tokenize.read.cache import TokenizedCache

READERS = {"megatron": "megatron.core", "mds": "streaming", "litdata": "litdata"}
INSTALL = {"megatron": "pip install megatron-core (the export extra)",
           "mds": "pip install mosaicml-streaming, in an environment of its own (it pins transformers < 5)",
           "litdata": "pip install --no-deps litdata (the export extra has the rest)"}


def _reader(target: str, export: Path) -> Any:
    """A sequence whose item i is (ids, mask) as the consumer reads row i."""
    if target == "megatron":
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        tokens, mask = IndexedDataset(str(export / "tokens")), IndexedDataset(str(export / "loss_mask"))
        return _Pairs(len(tokens), lambda i: (tokens[i], mask[i]))
    if target == "litdata":
        from litdata import StreamingDataset

        dataset = StreamingDataset(str(export))
    else:
        from streaming import StreamingDataset

        dataset = StreamingDataset(local=str(export), shuffle=False, batch_size=1)
    return _Pairs(len(dataset), lambda i: (dataset[i]["input_ids"], dataset[i]["loss_mask"]))


class _Pairs:
    def __init__(self, count: int, get):
        self.count, self.get = count, get

    def __len__(self) -> int:
        return self.count


def verify_export(cache: TokenizedCache, target: str, export: str | Path, rows: int) -> tuple[int, int, int]:
    """Check the first `rows` rows of the export at `export` against `cache`; (rows, tokens, trained) checked.
    Raises BadInput naming the first row that differs, or what to install."""
    if importlib.util.find_spec(READERS[target].split(".")[0]) is None:
        raise BadInput(f"--trainer {target}: its reader ({READERS[target]}) is not installed here: {INSTALL[target]}")
    export = Path(export)
    if not export.is_dir():
        raise BadInput(f"{export}: no export here (--export names the directory `sft-tokenize export` wrote)")
    reader = _reader(target, export)
    if len(reader) != len(cache):
        raise BadInput(f"{export}: {target} reads {len(reader):,} rows, the cache {cache.path} has {len(cache):,}: "
                       "rows were dropped or duplicated (or it is another cache's export)")
    tokens = trained = 0
    for i in range(min(rows, len(cache))):
        ids, mask = (np.asarray(x) for x in reader.get(i))
        row = cache[i]
        expected_mask = row["loss_mask"] if "loss_mask" in row else (row["labels"] != -100).astype(np.int8)
        if not np.array_equal(ids, row["input_ids"]):
            raise BadInput(f"{cache.path}: row {i}: {target} reads other token ids from {export} "
                           f"({len(ids)} tokens, the cache {len(row['input_ids'])})")
        if not np.array_equal(mask.astype(np.int8), expected_mask):
            p = int(np.flatnonzero(mask.astype(np.int8) != expected_mask)[0])
            raise BadInput(f"{cache.path}: row {i}: {target} reads a loss mask from {export} that differs at token "
                           f"{p} ({int(mask[p])}, the cache {int(expected_mask[p])})")
        tokens += len(ids)
        trained += int(expected_mask.sum())
    return min(rows, len(cache)), tokens, trained
