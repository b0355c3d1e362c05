"""`mds` exports: mosaicml-streaming's MDS format, which `streaming.StreamingDataset` reads.

    OUT/shard.<key>.00000.mds, ...              rows, each {"input_ids": int32 array, "loss_mask": int8 array}:
                                                 the chunks of each cache data file, named by its digest
    OUT/index.json                               the shards, written after them

As MDSWriter writes with `columns={"input_ids": "ndarray:int32", "loss_mask": "ndarray:int8"}`, no compression,
no hashes, and `size_limit` = the export's shard bytes (FORMAT.md beside this module).
"""

from __future__ import annotations

import json

import numpy as np

from sft_tokenize.export.chunks import plan_files, write_chunks
from sft_tokenize.export.output import ExportOutput
from sft_tokenize.read.row_batches import Rows

COLUMNS = {"input_ids": "ndarray:int32", "loss_mask": "ndarray:int8"}
INDEX = "index.json"


def shard_config(size_limit: int) -> dict:
    """What MDSWriter.get_config gives for these columns; also written inside every shard after its offsets."""
    return {"version": 2, "format": "mds", "compression": None, "hashes": [], "size_limit": size_limit,
            "column_names": list(COLUMNS), "column_encodings": list(COLUMNS.values()), "column_sizes": [None, None]}


def _shape_width(length: int) -> int:
    """The byte width MDS's ndarray encoding gives a 1-D array's shape: the smallest uint that holds it."""
    return 1 if length < 1 << 8 else 2 if length < 1 << 16 else 4 if length < 1 << 32 else 8


_WIDTH_CODES = {1: 0, 2: 1, 4: 2, 8: 3}


def _prefixes(length: int) -> tuple[bytes, bytes]:
    width = _shape_width(length)
    prefix = bytes([(1 << 2) | _WIDTH_CODES[width]]) + length.to_bytes(width, "little")  # ndim 1, the shape dtype
    return prefix, prefix


def write_mds(cache: Rows, out: ExportOutput, batch_rows: int, size_limit: int) -> dict:
    """The shards and index.json of every row, in order."""
    config = shard_config(size_limit)
    head = json.dumps(config, sort_keys=True).encode()
    lengths = cache.lengths.astype(np.int64)
    widths = np.select([lengths < 1 << 8, lengths < 1 << 16], [1, 2], 4)
    sizes = 8 + 2 * (1 + widths) + 5 * lengths  # column sizes, shape prefixes, ids and mask
    chunks, names = plan_files(cache, sizes, len(head), size_limit,
                               lambda key, j: f"shard.{key}.{j:05d}.mds" if key else f"shard.{j:05d}.mds")
    write_chunks(cache, out, chunks, names, head, _prefixes, batch_rows)
    shards = [{"samples": c.stop - c.first, "raw_data": {"basename": name, "bytes": int(c.offsets[-1]), "hashes": {}},
               "zip_data": None, **config} for c, name in zip(chunks, names, strict=True)]
    out.write(INDEX, json.dumps({"version": 2, "shards": shards}, sort_keys=True).encode())
    return {"rows": len(cache), "tokens": int(lengths.sum()), "shards": len(chunks)}
