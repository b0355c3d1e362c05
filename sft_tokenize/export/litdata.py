"""`litdata` exports: an optimized dataset, as `litdata.optimize` writes one, that `litdata.StreamingDataset` reads.

    OUT/chunk-<key>-0.bin, ...              rows, each {"input_ids": int32 array, "loss_mask": int8 array}: the
                                            chunks of each cache data file, named by its digest
    OUT/index.json                          the chunks and the items' layout, written after them

Each item is the dict litdata's PyTreeLoader makes of two 1-D numpy arrays, serialized headerless
(`no_header_numpy`) (FORMAT.md beside this module).
"""

from __future__ import annotations

import json
import time

import numpy as np

from sft_tokenize.export.chunks import plan_files, write_chunks
from sft_tokenize.export.output import ExportOutput
from sft_tokenize.read.row_batches import Rows

INDEX = "index.json"
DATA_FORMAT = ["no_header_numpy:2", "no_header_numpy:0"]  # litdata's numpy dtype indices: int32, int8
# torch's pytree spec of {"input_ids": leaf, "loss_mask": leaf}, as litdata stores it
DATA_SPEC = json.dumps([1, {"type": "builtins.dict", "context": json.dumps(["input_ids", "loss_mask"]),
                            "children_spec": [{"type": None, "context": None, "children_spec": []}] * 2}])


def _prefixes(length: int) -> tuple[bytes, bytes]:
    return b"", b""


def write_litdata(cache: Rows, out: ExportOutput, batch_rows: int, chunk_bytes: int) -> dict:
    """The chunks and index.json of every row, in order."""
    lengths = cache.lengths.astype(np.int64)
    chunks, names = plan_files(cache, 8 + 5 * lengths, 0, chunk_bytes,
                               lambda key, j: f"chunk-{key}-{j}.bin" if key else f"chunk-0-{j}.bin")
    write_chunks(cache, out, chunks, names, b"", _prefixes, batch_rows)
    config = {"chunk_bytes": chunk_bytes, "chunk_size": None, "compression": None, "compression_batch_size": None,
              "compression_level": None, "data_format": DATA_FORMAT, "data_spec": DATA_SPEC, "encryption": None,
              "ipc_compression": None, "item_loader": "PyTreeLoader",
              "types": {"input_ids": "json", "loss_mask": "json"}}
    index = {"chunks": [{"chunk_bytes": int(c.offsets[-1]), "chunk_size": c.stop - c.first, "dim": None,
                         "filename": name} for c, name in zip(chunks, names, strict=True)],
             "config": config, "updated_at": str(time.time())}
    out.write(INDEX, json.dumps(index, sort_keys=True).encode())
    return {"rows": len(cache), "tokens": int(lengths.sum()), "chunks": len(chunks)}
