"""Megatron exports: Megatron-Core `IndexedDataset` pairs, and Megatron-Bridge's packed SFT file.

    OUT/tokens.bin, tokens.idx           IndexedDataset("OUT/tokens"): row i is the cache's input_ids of row i
    OUT/loss_mask.bin, loss_mask.idx     IndexedDataset("OUT/loss_mask"): its loss_mask, same lengths (int8)
    OUT/training_<L>.npy                 with pack_length L: Megatron-Bridge's GPTSFTPackedDataset file, a bin of
    OUT/<L>_metadata.jsonl               the cache's packing index per item; and its packing metadata

The layouts are specified in FORMAT.md beside this module. `.bin` files are the cache's flat values copied batch
by batch; an `.idx` is written after its `.bin` from the cache's row lengths (read from the Arrow offsets).
"""

from __future__ import annotations

import io
import json
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sft_tokenize.errors import BadInput
from sft_tokenize.export.output import ExportOutput
from sft_tokenize.read.bin_packing import best_fit_decreasing
from sft_tokenize.read.packed_sequences import PackedSequences
from sft_tokenize.read.packing_options import PackOptions
from sft_tokenize.read.row_batches import Rows, row_batches

INDEX_HEADER = b"MMIDIDX\x00\x00"  # Megatron-Core's _INDEX_HEADER, then version 1 as <Q
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.uint16): 8}
INDEXED = {"tokens": ("input_ids", np.int32), "loss_mask": ("loss_mask", np.int8)}  # prefix → column, dtype
CHUNK = 1 << 20  # rows of pointers and document indices made at a time while an .idx is written


def write_index(f, lengths: np.ndarray, dtype: np.dtype) -> None:
    """An IndexedDataset `.idx`: header, version, dtype code, sequence and document counts, then the lengths
    (int32), the byte pointers (int64) and the document indices (int64, one document per sequence)."""
    dtype = np.dtype(dtype)
    count = len(lengths)
    f.write(INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[dtype]))
    f.write(struct.pack("<Q", count) + struct.pack("<Q", count + 1))
    f.write(np.ascontiguousarray(lengths, dtype=np.int32).tobytes())
    pointer = 0
    for start in range(0, count, CHUNK):
        part = lengths[start:start + CHUNK].astype(np.int64) * dtype.itemsize
        ends = np.cumsum(part) + pointer
        f.write((ends - part).tobytes())
        pointer = int(ends[-1])
    for start in range(0, count + 1, CHUNK):
        f.write(np.arange(start, min(start + CHUNK, count + 1), dtype=np.int64).tobytes())


def write_indexed(cache: Rows, out: ExportOutput, batch_rows: int) -> dict:
    """tokens.bin/.idx and loss_mask.bin/.idx: every row of the cache, in order."""
    handles = {prefix: out.open(f"{prefix}.bin") for prefix in INDEXED}
    files = {prefix: handle.__enter__() for prefix, handle in handles.items()}
    try:
        for batch in row_batches(cache, batch_rows):
            files["tokens"].write(batch.input_ids)
            files["loss_mask"].write(batch.loss_mask)
    except BaseException as error:
        for handle in handles.values():
            handle.__exit__(type(error), error, error.__traceback__)
        raise
    for handle in handles.values():
        handle.__exit__(None, None, None)
    lengths = cache.lengths
    for prefix, (_, dtype) in INDEXED.items():
        with out.open(f"{prefix}.idx") as f:
            write_index(f, lengths, dtype)
    return {"rows": len(cache), "tokens": int(lengths.sum(dtype=np.int64)),
            "prefixes": {prefix: column for prefix, (column, _) in INDEXED.items()}}


# -- Megatron-Bridge's packed SFT file -----------------------------------------------------------------------------
# np.load(path, allow_pickle=True) of an object array runs pickle.load on what follows the .npy header. The array is
# pickled here as the call numpy.array([item, item, ...]) whose list is extended by APPENDS a few items at a time,
# each item pickled alone without a memo (fast mode): the file is written one bin at a time.
_PICKLE_START = b"\x80\x02cnumpy\narray\n]"  # PROTO 2, GLOBAL numpy.array, EMPTY_LIST
_PICKLE_END = b"\x85R."  # TUPLE1, REDUCE, STOP
APPENDS_ITEMS = 256


def _pickled(item: dict) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.fast = True  # no memo: items pickled apart concatenate into one stream
    pickler.dump(item)
    return buffer.getvalue()[2:-1]  # less PROTO and STOP


def _npy_header(count: int) -> bytes:
    header = repr({"descr": "|O", "fortran_order": False, "shape": (count,)}).encode("latin1")
    pad = 64 - (10 + len(header) + 1) % 64
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header) + pad + 1) + header + b" " * pad + b"\n"


def eos_id(cache: Rows) -> int:
    """The EOS id of the tokenizer the cache was built with, read from its files (tokenizer_config.json's
    `eos_token`, its id in tokenizer.json): Megatron-Bridge pads packed rows with it and its collator takes it for
    padding. BadInput, asking for the id, where the tokenizer's files are not on this machine."""
    directory = Path(str(cache.caches[0].manifest.get("tokenizer") or ""))
    try:
        token = json.loads((directory / "tokenizer_config.json").read_text())["eos_token"]
        token = token["content"] if isinstance(token, dict) else token
        spec = json.loads((directory / "tokenizer.json").read_text())
        ids = {added["content"]: added["id"] for added in spec.get("added_tokens", [])}
        vocab = spec.get("model", {}).get("vocab")
        return int(ids[token] if token in ids else vocab[token])
    except (OSError, ValueError, KeyError, TypeError):
        raise BadInput(f"{cache.path}: the EOS id of the tokenizer it was built with ({directory}) cannot be read "
                       "here: pass the id to pad with (--pad-id)") from None


@dataclass
class _Bins:
    """Bins of rows as PackedSequences reads an index: bin b holds rows[offsets[b]:offsets[b + 1]]."""

    rows: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def bin(self, b: int) -> np.ndarray:
        return self.rows[self.offsets[b]:self.offsets[b + 1]]


def _bins(cache: Rows, length: int, multiple: int, index_dir: str | None) -> PackedSequences:
    """The bins to write: the cache's packing index for `length`; with `multiple` > 1, bins (best fit
    decreasing) of rows padded as Megatron-Bridge pads them for context parallelism, at most `length` input
    positions each."""
    if multiple == 1:
        return cache.packed(length, index_dir=index_dir)
    bins = _Bins(*best_fit_decreasing(padded_inputs(np.minimum(cache.lengths, length), multiple), length))
    return PackedSequences(cache, bins, PackOptions(length=length, index_dir=index_dir))


def padded_inputs(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """Each row's input positions in Megatron-Bridge's collator once padded to `multiple` (its packer's
    `pad_seq_to_mult`): its length rounded up to the multiple; a row is then that many + 1 tokens in the file."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths - 1 if multiple == 1 else -(-lengths // multiple) * multiple


def packed_items(packed: PackedSequences, multiple: int = 1, pad_id: int = 0) -> Iterator[dict]:
    """Each bin of `packed`, as GPTSFTPackedDataset reads an item: the rows' input_ids end to end, `seq_start_id`
    (each row's start) and `loss_mask` rolled by one within each row (position j says whether token j+1 is
    trained: it lines up with the labels, the ids shifted by one). With `multiple` > 1 each row is followed by
    `pad_id` tokens (untrained) up to its padded length + 1, as Megatron-Bridge's packer pads with
    `pad_seq_to_mult`."""
    for i in range(len(packed)):
        item = packed[i]
        cu = item["cu_seqlens"].tolist()
        trained = item["loss_mask"] == 1 if "loss_mask" in item else item["labels"] != -100
        sizes = padded_inputs(np.diff(cu), multiple) + 1
        starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        ids = np.full(int(starts[-1]), pad_id, dtype=np.int64)
        mask = np.zeros(int(starts[-1]), dtype=bool)
        for k in range(len(sizes)):
            a, b, at = cu[k], cu[k + 1], int(starts[k])
            ids[at:at + b - a] = item["input_ids"][a:b]
            mask[at:at + b - a - 1] = trained[a + 1:b]
        yield {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_start_id": starts[:-1].tolist()}


def write_packed(cache: Rows, out: ExportOutput, length: int, multiple: int = 1, pad_id: int = 0,
                 index_dir: str | None = None) -> dict:
    """training_<length>.npy and <length>_metadata.jsonl: the bins of `_bins`, and Megatron-Bridge's packing
    metadata for them (as its create_packing_strategy computes it, over each row's input positions)."""
    packed = _bins(cache, length, multiple, index_dir)
    bins = len(packed)
    rows_per_bin, inputs_per_bin = np.zeros(bins, np.int64), np.zeros(bins, np.int64)
    longest = 0
    with out.open(f"training_{length}.npy") as f:
        f.write(_npy_header(bins) + _PICKLE_START)
        chunk: list[bytes] = []
        for i, item in enumerate(packed_items(packed, multiple, pad_id)):
            inputs = np.diff([*item["seq_start_id"], len(item["input_ids"])]) - 1
            rows_per_bin[i], inputs_per_bin[i] = len(inputs), int(inputs.sum())
            longest = max(longest, int(inputs.max(initial=0)))
            chunk.append(_pickled(item))
            if len(chunk) == APPENDS_ITEMS:
                f.write(b"(" + b"".join(chunk) + b"e")
                chunk = []
        if chunk:
            f.write(b"(" + b"".join(chunk) + b"e")
        f.write(_PICKLE_END)
    metadata = {"dataset_max_seqlen": longest,
                "max_samples_per_bin": int(rows_per_bin.max(initial=0)),
                "packing_factor": round(len(cache) / max(bins, 1), 2),
                "packing_efficiency": round(float(inputs_per_bin.sum()) / max(bins, 1) / length * 100, 2),
                "pack_size": length, "min_packed_seqlen": int(inputs_per_bin.min()) if bins else 0}
    out.write(f"{length}_metadata.jsonl", json.dumps([metadata]).encode())
    return {"bins": bins, "pack_length": length, "pad_to_multiple_of": multiple, "packing": metadata}
