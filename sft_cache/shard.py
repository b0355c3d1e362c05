"""tokenize_slice: read one slice, tokenize it in batches, stream the rows into its own Arrow shard.

Memory is bounded by the reader's batch and the writer's batch, never by the slice. The shard is written
under a temporary name and renamed when complete; its JSON sidecar, written last, is the completion
marker. A shard whose sidecar matches the slice and the fingerprint is reused without tokenizing.
"""

from __future__ import annotations

import errno
import json
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa

from .chat import ChatEncoder, EncodedBatch, load_tokenizer
from .errors import BadRow, OutOfSpace
from .fingerprint import fingerprint
from .formats import ColumnMap, to_example
from .sources import Slice, read_slice
from .stopping import raise_if_stopping


@dataclass(frozen=True)
class Job:
    """What every slice's task needs besides its slice: small and picklable, the same for all slices."""

    fingerprint: str
    staging: str
    tokenizer_dir: str
    chat_template: str | None
    columns: ColumnMap
    train_on: str = "all_assistant"
    max_length: int | None = None
    truncation: str = "truncate"
    on_bad_row: str = "raise"
    max_row_bytes: int | None = None
    extra_columns: tuple[str, ...] = ()
    writer_batch_rows: int = 1000
    writer_batch_bytes: int = 64_000_000
    trust_remote_code: bool = False
    storage_options: dict = field(default_factory=dict)

    def shard_path(self, index: int) -> Path:
        return Path(self.staging) / f"shard-{index:05d}.arrow"

    def slice_key(self, slice_: Slice) -> str:
        """The key of a slice's result: the same slice of the same fingerprint, whatever the flow run."""
        return f"{self.fingerprint}-{slice_.index:05d}-{fingerprint({'slice': slice_.describe()})}"


def features(extra_columns: tuple[str, ...] = ()):
    """The cache's row schema as `datasets` Features: list<int32> ids, list<int8> 0/1 mask, extras on request."""
    from datasets import Features, List, Value

    columns = {"input_ids": List(Value("int32")), "loss_mask": List(Value("int8"))}
    if "labels" in extra_columns:
        columns["labels"] = List(Value("int32"))
    if "attention_mask" in extra_columns:
        columns["attention_mask"] = List(Value("int8"))
    return Features(columns)


def _list_array(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


class ShardWriter:
    """Streams rows into one Arrow IPC stream file through `datasets.ArrowWriter`.

    Rows are buffered as slices of encoded batches (numpy arrays, no per-row objects) and written as one
    record batch every `batch_rows` rows or `batch_bytes` bytes, whichever comes first. The buffer never
    holds more than `batch_rows` rows; `max_buffered_rows` records the most it held.
    """

    def __init__(self, stream, extra_columns: tuple[str, ...], batch_rows: int, batch_bytes: int):
        from datasets.arrow_writer import ArrowWriter

        self.extra_columns = extra_columns
        self.batch_rows, self.batch_bytes = batch_rows, batch_bytes
        self._writer = ArrowWriter(stream=stream, features=features(extra_columns), writer_batch_size=batch_rows)
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, mask, lengths)
        self._rows = self._bytes = 0
        self.max_buffered_rows = 0

    def add(self, batch: EncodedBatch) -> None:
        lengths = np.diff(batch.offsets)
        start = 0
        while start < batch.rows:
            stop = min(batch.rows, start + self.batch_rows - self._rows)
            a, b = batch.offsets[start], batch.offsets[stop]
            self._chunks.append((batch.input_ids[a:b], batch.loss_mask[a:b], lengths[start:stop]))
            self._rows += stop - start
            self._bytes += int(b - a) * 5  # int32 id + int8 mask per token
            self.max_buffered_rows = max(self.max_buffered_rows, self._rows)
            if self._rows >= self.batch_rows or self._bytes >= self.batch_bytes:
                self.flush()
            start = stop

    def flush(self) -> None:
        if not self._chunks:
            return
        ids, mask, lengths = (np.concatenate(parts) for parts in zip(*self._chunks, strict=True))
        columns = {"input_ids": _list_array(lengths, ids), "loss_mask": _list_array(lengths, mask)}
        if "labels" in self.extra_columns:
            columns["labels"] = _list_array(lengths, np.where(mask == 1, ids, np.int32(-100)).astype(np.int32))
        if "attention_mask" in self.extra_columns:
            columns["attention_mask"] = _list_array(lengths, np.ones(len(ids), dtype=np.int8))
        self._writer.write_table(pa.table(columns))
        self._chunks, self._rows, self._bytes = [], 0, 0

    def close(self) -> None:
        """Write what is buffered and the end of stream; an empty shard is still a valid Arrow file."""
        self.flush()
        self._writer.finalize(close_stream=False)


@dataclass
class ShardStats:
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    rows_exact: int = 0  # rows whose mask took the exact (prefix-rendering) path
    max_buffered_rows: int = 0
    dropped: Counter = field(default_factory=Counter)
    lengths: Counter = field(default_factory=Counter)

    def add(self, batch: EncodedBatch) -> None:
        self.rows += batch.rows
        self.tokens += len(batch.input_ids)
        self.trained_tokens += int(batch.loss_mask.sum(dtype=np.int64))
        values, counts = np.unique(np.diff(batch.offsets), return_counts=True)
        self.lengths.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))

    def as_json(self) -> dict:
        values = sorted(self.lengths)
        return {"rows": self.rows, "tokens": self.tokens, "trained_tokens": self.trained_tokens,
                "rows_exact": self.rows_exact, "max_buffered_rows": self.max_buffered_rows,
                "dropped": dict(sorted(self.dropped.items())),
                "lengths": {"values": values, "counts": [self.lengths[v] for v in values]}}


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def finished_shard(job: Job, slice_: Slice) -> dict | None:
    """The sidecar of a complete shard for this slice and fingerprint, or None if it must be (re)written."""
    shard = job.shard_path(slice_.index)
    try:
        meta = json.loads(sidecar_path(shard).read_text())
        size = shard.stat().st_size
    except (OSError, ValueError):
        return None
    valid = meta.get("fingerprint") == job.fingerprint and meta.get("slice") == slice_.describe()
    return meta if valid and meta.get("bytes") == size else None


@lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str, chat_template: str | None, trust_remote_code: bool):
    """One tokenizer per worker process, shared by its threads (encoding does not mutate it)."""
    return load_tokenizer(tokenizer_dir, chat_template, trust_remote_code)


def encoder_for(job: Job) -> ChatEncoder:
    tokenizer = _tokenizer(job.tokenizer_dir, job.chat_template, job.trust_remote_code)
    return ChatEncoder(tokenizer, job.train_on, job.max_length, job.truncation)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stream_rows(job: Job, slice_: Slice, stream) -> ShardStats:
    """Read, tokenize and write the slice's rows batch by batch; bad rows raise or are counted."""
    encoder = encoder_for(job)
    stats = ShardStats()

    def reject(bad: BadRow, locate, i: int) -> None:
        if job.on_bad_row == "raise":
            raise bad.at(locate(i))
        stats.dropped[bad.reason] += 1

    writer = ShardWriter(stream, job.extra_columns, job.writer_batch_rows, job.writer_batch_bytes)
    for rows, locate in read_slice(slice_, job.columns.names, job.storage_options, job.max_row_bytes):
        raise_if_stopping()
        examples, positions = [], []
        for i, row in enumerate(rows):
            try:
                if isinstance(row, BadRow):
                    raise row
                examples.append(to_example(row, job.columns))
                positions.append(i)
            except BadRow as bad:
                reject(bad, locate, i)
        batch = encoder.encode_batch(examples)
        for outcome, i in zip(batch.outcomes, positions, strict=True):
            if isinstance(outcome, BadRow):
                reject(outcome, locate, i)
            elif isinstance(outcome, str):
                stats.dropped[outcome] += 1
        writer.add(batch)
        stats.add(batch)
    writer.close()
    stats.rows_exact = encoder.rows_exact
    stats.max_buffered_rows = writer.max_buffered_rows
    return stats


def tokenize_slice(job: Job, slice_: Slice) -> int:
    """Tokenize one slice into `shard-NNNNN.arrow` (reusing a finished one) and return its row count."""
    done = finished_shard(job, slice_)
    if done is not None:
        return done["rows"]
    started = time.monotonic()
    shard = job.shard_path(slice_.index)
    tmp = shard.with_name(f"{shard.name}.tmp-{uuid.uuid4().hex}")
    try:
        shard.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as stream:
            stats = _stream_rows(job, slice_, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, shard)
        meta = {"fingerprint": job.fingerprint, "slice": slice_.describe(), "bytes": shard.stat().st_size,
                **stats.as_json(), "seconds": round(time.monotonic() - started, 3)}
        _write_atomically(sidecar_path(shard), json.dumps(meta).encode())
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise OutOfSpace(f"{shard}: cannot write the shard ({error.strerror}); free space under "
                             f"{shard.parent.parent.parent} and run the same command again: finished shards "
                             "are kept") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return stats.rows
