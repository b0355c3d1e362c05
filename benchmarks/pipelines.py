"""The pipelines under comparison (except this project's, which is its own CLI), and the output checksum.

Each runs as its own subprocess, started by run.py, and prints one JSON line on stdout:

    python benchmarks/pipelines.py ceiling --tokenizer DIR --workers 2 --out DIR FILE...
    python benchmarks/pipelines.py hf      ...     # load_dataset("json") + map(num_proc=W) + save_to_disk
    python benchmarks/pipelines.py hf-fastokens ... # the same, written as a user would, fastokens patched in
    python benchmarks/pipelines.py spawn   ...     # the SkyRL PR #1971 design: spawn pool, ArrowWriter shards
    python benchmarks/pipelines.py floor   ...     # encode_batch alone on pre-rendered rows: the tokenizer's cost

All of them but `hf-fastokens` tokenize with the project's own `ChatEncoder` (the ceiling with the plain template
render and one batch-encode call). `hf-fastokens` is what a user writes without this project: the chat template
rendered by `apply_chat_template`, each text cut at its assistant turns, the pieces encoded by the tokenizer that
`fastokens.patch_transformers()` accelerated. Every one's input_ids and loss_mask must be identical to this
project's cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # sft_tokenize, when run from anywhere

from sft_tokenize.build.job import features  # noqa: E402
from sft_tokenize.encoding.chat_encoder import ChatEncoder, EncodedBatch  # noqa: E402
from sft_tokenize.encoding.tokenizer import load_tokenizer  # noqa: E402
from sft_tokenize.sources.conversations import Conversation  # noqa: E402
from sft_tokenize.sources.formats.format_reader import READ_BATCH_BYTES, READ_BATCH_ROWS  # noqa: E402

WRITER_BATCH_ROWS = 1000  # SkyRL's _TOKENIZE_WRITER_BATCH_ROWS


def encode_batch_rows(files: list[str], rows: int | None = None) -> int:
    """Rows per encode call: as many as the project's reader hands its encoder on these files (at most
    READ_BATCH_ROWS rows and READ_BATCH_BYTES of input), so the pipelines differ in design, not batch size.
    `rows`: the files' row count when known; otherwise every file is read to count it."""
    size = sum(os.path.getsize(name) for name in files)
    if rows is None:
        rows = 0
        for name in files:
            with open(name, "rb") as f:
                rows += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 24), b""))
    return max(1, min(READ_BATCH_ROWS, READ_BATCH_BYTES * rows // max(1, size)))


# -- checksum ----------------------------------------------------------------------------------------------------


class ColumnDigest:
    """An exact checksum of a list column: its row lengths (int64) and its values, hashed in row order, so
    the result does not depend on how the rows are chunked."""

    def __init__(self, dtype: type):
        self.dtype = dtype
        self.lengths, self.values = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        self.rows = self.tokens = 0

    def update(self, lengths: np.ndarray, values: np.ndarray) -> None:
        self.lengths.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
        self.values.update(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.rows += len(lengths)
        self.tokens += len(values)

    def update_arrow(self, chunk: pa.ListArray) -> None:
        self.update(pc.list_value_length(chunk).to_numpy(zero_copy_only=False), chunk.flatten().to_numpy())

    def hexdigest(self) -> str:
        return f"{self.lengths.hexdigest()}:{self.values.hexdigest()}"


def cache_digest(path: Path) -> dict:
    """Rows, tokens and the checksums of input_ids and loss_mask of a `save_to_disk` directory (memory-mapped)."""
    from datasets import load_from_disk

    table = load_from_disk(str(path)).data.table
    digests = {"input_ids": ColumnDigest(np.int32), "loss_mask": ColumnDigest(np.int8)}
    for name, digest in digests.items():
        for chunk in table.column(name).chunks:
            digest.update_arrow(chunk)
    return {"rows": table.num_rows, "tokens": digests["input_ids"].tokens,
            **{name: digest.hexdigest() for name, digest in digests.items()}}


# -- shared pieces ---------------------------------------------------------------------------------------------


def list_array(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


def as_table(batch: EncodedBatch) -> pa.Table:
    """The encoded rows as the cache's columns, built from the flat arrays (no per-row Python objects)."""
    bad = [outcome for outcome in batch.outcomes if not isinstance(outcome, int | str)]
    if bad:
        raise bad[0]
    return pa.table({"input_ids": list_array(batch.offsets, batch.input_ids),
                     "loss_mask": list_array(batch.offsets, batch.loss_mask)})


_encoders: dict[str, ChatEncoder] = {}


def encoder(tokenizer_dir: str) -> ChatEncoder:
    """One encoder per process, made on first use (in the worker, never inherited through fork)."""
    if tokenizer_dir not in _encoders:
        _encoders[tokenizer_dir] = ChatEncoder(load_tokenizer(tokenizer_dir))
    return _encoders[tokenizer_dir]


def jsonl_batches(files: list[str], rows: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for name in files:
        with open(name, "rb") as lines:
            for line in lines:
                batch.append(json.loads(line))
                if len(batch) == rows:
                    yield batch
                    batch = []
    if batch:
        yield batch


# -- ceiling ---------------------------------------------------------------------------------------------------


def ceiling(files: list[str], tokenizer_dir: str, batch_rows: int, checksum: bool = True) -> dict:
    """Render every row's chat template and batch-encode it, in this one process; write nothing."""
    tokenizer = load_tokenizer(tokenizer_dir)
    backend = tokenizer.backend_tokenizer
    digest = ColumnDigest(np.int32)
    rows = tokens = 0
    for batch in jsonl_batches(files, batch_rows):
        texts = tokenizer.apply_chat_template([row["messages"] for row in batch], tokenize=False)
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        rows += len(encodings)
        if checksum:
            ids = [encoding.ids for encoding in encodings]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            digest.update(lengths, np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())))
        else:
            tokens += sum(map(len, encodings))
    if checksum:
        return {"rows": rows, "tokens": digest.tokens, "input_ids": digest.hexdigest()}
    return {"rows": rows, "tokens": tokens}


def encode_floor(files: list[str], tokenizer_dir: str, batch_rows: int) -> dict:
    """The tokenizer's own cost, which bounds every pipeline: all rows are rendered first (untimed), then
    only `encode_batch` is timed, over the same batches the other pipelines encode."""
    tokenizer = load_tokenizer(tokenizer_dir)
    backend = tokenizer.backend_tokenizer
    batches = [tokenizer.apply_chat_template([row["messages"] for row in batch], tokenize=False)
               for batch in jsonl_batches(files, batch_rows)]
    started = time.perf_counter()
    tokens = sum(len(encoded) for texts in batches for encoded in backend.encode_batch(texts, add_special_tokens=False))
    seconds = time.perf_counter() - started
    return {"rows": sum(map(len, batches)), "tokens": tokens, "encode_seconds": round(seconds, 3),
            "encode_tokens_per_second": round(tokens / seconds)}


# -- HF datasets: load_dataset + map(num_proc) + save_to_disk ----------------------------------------------------


def encode_for_map(batch: dict, tokenizer_dir: str) -> pa.Table:
    examples = [Conversation(messages) for messages in batch["messages"]]
    return as_table(encoder(tokenizer_dir).encode_batch(examples))


def hf_datasets(files: list[str], tokenizer_dir: str, workers: int, out: Path) -> dict:
    from datasets import load_dataset

    source = load_dataset("json", data_files=files, split="train", cache_dir=str(out.parent / "hf-cache"))
    tokenized = source.map(encode_for_map, batched=True, num_proc=workers, remove_columns=source.column_names,
                           features=features(), fn_kwargs={"tokenizer_dir": tokenizer_dir})
    tokenized.save_to_disk(str(out))
    return {"rows": len(tokenized)}


# -- datasets.map with fastokens patched in: what a user writes without this project ---------------------------

# An assistant turn of a ChatML-style template (Qwen's among them): trained from after its header to its end
# token. fastokens keeps no character offsets, so each text is cut there and the pieces are encoded apart, which
# is exact because every cut falls on a special token or on a newline that the pre-tokenizer splits anyway.
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def fastokens_map(files: list[str], tokenizer_dir: str, workers: int, out: Path) -> dict:
    import fastokens

    fastokens.patch_transformers()
    from datasets import Features, List, Value, load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def tokenize(batch: dict) -> dict:
        pieces, trained, ends = [], [], []
        for text in tokenizer.apply_chat_template(batch["messages"], tokenize=False):
            start = 0
            for turn in ASSISTANT_TURN.finditer(text):
                pieces += [text[start:turn.start(1)], turn.group(1)]
                trained += [0, 1]
                start = turn.end(1)
            pieces.append(text[start:])
            trained.append(0)
            ends.append(len(pieces))
        encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
        input_ids, loss_mask, first = [], [], 0
        for end in ends:
            input_ids.append([i for k in range(first, end) for i in encoded[k]])
            loss_mask.append([m for k in range(first, end) for m in [trained[k]] * len(encoded[k])])
            first = end
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    source = load_dataset("json", data_files=files, split="train", cache_dir=str(out.parent / "hf-cache"))
    schema = Features({"input_ids": List(Value("int32")), "loss_mask": List(Value("int8"))})
    tokenized = source.map(tokenize, batched=True, num_proc=workers, remove_columns=source.column_names,
                           features=schema)
    tokenized.save_to_disk(str(out))
    return {"rows": len(tokenized)}


# -- spawn pool: the reference design (SkyRL PR #1971) -----------------------------------------------------------


def spawn_worker(files: list[str], cache_dir: str, tokenizer_dir: str, start: int, stop: int, shard: str,
                 batch_rows: int) -> int:
    """As SkyRL's worker: load the whole dataset again, select this worker's rows, stream them to a shard."""
    from datasets import load_dataset
    from datasets.arrow_writer import ArrowWriter

    rows = load_dataset("json", data_files=files, split="train", cache_dir=cache_dir).select(range(start, stop))
    chat = encoder(tokenizer_dir)
    writer = ArrowWriter(path=shard, features=features(), writer_batch_size=WRITER_BATCH_ROWS)
    written = 0
    for batch in rows.iter(batch_size=batch_rows):
        table = as_table(chat.encode_batch([Conversation(messages) for messages in batch["messages"]]))
        writer.write_table(table)
        written += table.num_rows
    writer.finalize()
    return written


def spawn_pool(files: list[str], tokenizer_dir: str, workers: int, out: Path, batch_rows: int) -> dict:
    import multiprocessing

    from datasets import Dataset, concatenate_datasets, load_dataset

    cache_dir = str(out.parent / "hf-cache")
    total = len(load_dataset("json", data_files=files, split="train", cache_dir=cache_dir))  # the controller's load
    shards = out.parent / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    paths = [str(shards / f"shard-{k:05d}.arrow") for k in range(workers)]
    jobs = [(files, cache_dir, tokenizer_dir, total * k // workers, total * (k + 1) // workers, paths[k], batch_rows)
            for k in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        counts = pool.starmap(spawn_worker, jobs)
    merged = concatenate_datasets([Dataset.from_file(path) for path in paths])
    merged.save_to_disk(str(out))  # copies the shards into the cache
    shutil.rmtree(shards)
    return {"rows": sum(counts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pipeline", choices=["ceiling", "hf", "hf-fastokens", "spawn", "floor"])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, help="the cache directory to write (hf, spawn)")
    parser.add_argument("--no-checksum", action="store_true", help="ceiling: count tokens only")
    parser.add_argument("--rows", type=int, help="the files' row count, if known (else they are read to count it)")
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    batch_rows = encode_batch_rows(args.files, args.rows)
    started = time.perf_counter()
    if args.pipeline == "ceiling":
        result = ceiling(args.files, args.tokenizer, batch_rows, checksum=not args.no_checksum)
    elif args.pipeline == "floor":
        result = encode_floor(args.files, args.tokenizer, batch_rows)
    elif args.pipeline == "hf":
        result = hf_datasets(args.files, args.tokenizer, args.workers, args.out)
    elif args.pipeline == "hf-fastokens":
        result = fastokens_map(args.files, args.tokenizer, args.workers, args.out)
    else:
        result = spawn_pool(args.files, args.tokenizer, args.workers, args.out, batch_rows)
    print(json.dumps({**result, "inner_seconds": round(time.perf_counter() - started, 3)}))


if __name__ == "__main__":
    main()
