"""tokenize_slice: read one slice, tokenize it in batches, stream the rows into its own Arrow shard.

Memory is bounded by the reader's batch and the writer's batch, never by the slice. The shard is written
into the shard store under a temporary name and renamed to its content key when complete; its JSON
sidecar, written last, is the completion marker. A shard whose sidecar names the slice's key is reused
without tokenizing, by any run and any version that reads the same bytes the same way.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from sft_tokenize.build.keys import DIGEST_BOOK, forget, slice_key
from sft_tokenize.build.stopping import raise_if_stopping
from sft_tokenize.build.timeline import mark
from sft_tokenize.encoding.chat_encoder import ChatEncoder, EncodedBatch, load_tokenizer
from sft_tokenize.encoding.exact import VERIFY_ROWS, FastEncoder, choose_encoder
from sft_tokenize.encoding.pool import DEPTH, EncodePool
from sft_tokenize.encoding.prepared import prepared_encoding
from sft_tokenize.errors import BadInput, BadRow, OutOfSpace
from sft_tokenize.read.layouts import COLUMN_TYPES, column_values, layout_columns
from sft_tokenize.sources.conversations import ColumnMap, to_example
from sft_tokenize.sources.readers import read_slice
from sft_tokenize.sources.resolve import Slice, filesystem


@dataclass(frozen=True)
class Job:
    """What every slice's task needs besides its slice: small and picklable, the same for all slices."""

    fingerprint: str
    staging: str
    tokenizer_dir: str
    chat_template: str | None
    columns: ColumnMap
    train_on: str = "all_assistant"
    template_kwargs: dict = field(default_factory=dict)
    reasoning_turns: str = "as-rendered"
    special_text: str = "literal"
    encoder: str = "auto"  # not in the fingerprint: every encoder gives the same bytes
    max_length: int | None = None
    truncation: str = "truncate"
    on_bad_row: str = "raise"
    max_row_bytes: int | None = None
    extra_columns: tuple[str, ...] = ()
    layout: str = "skyrl"
    writer_batch_rows: int = 1000
    writer_batch_bytes: int = 64_000_000
    trust_remote_code: bool = False
    storage_options: dict = field(default_factory=dict)
    store: str = ""  # the shard store: finished shards by content key, shared by every cache under the root
    tokenization: str = ""  # the fingerprint of everything that changes how a row is tokenized
    prepared: str = ""  # where the tokenizer is kept prepared (prepared.py); empty: loaded and checked each time

    def shard_path(self, slice_: Slice) -> Path:
        return Path(self.store) / f"{slice_.key}.arrow"

    @property
    def digest_book(self) -> Path:
        return Path(self.store) / DIGEST_BOOK


def features(extra_columns: tuple[str, ...] = (), layout: str = "skyrl"):
    """The cache's row schema as `datasets` Features: the layout's columns (see layouts.py), extras on request."""
    from datasets import Features, List, Value

    return Features({name: List(Value(COLUMN_TYPES[name])) for name in layout_columns(layout, extra_columns)})


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

    def __init__(self, stream, extra_columns: tuple[str, ...], batch_rows: int, batch_bytes: int,
                 layout: str = "skyrl"):
        from datasets.arrow_writer import ArrowWriter

        self.columns = layout_columns(layout, extra_columns)
        self._token_bytes = sum(np.dtype(COLUMN_TYPES[name]).itemsize for name in self.columns)
        self.batch_rows, self.batch_bytes = batch_rows, batch_bytes
        self._writer = ArrowWriter(stream=stream, features=features(extra_columns, layout),
                                   writer_batch_size=batch_rows)
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
            self._bytes += int(b - a) * self._token_bytes
            self.max_buffered_rows = max(self.max_buffered_rows, self._rows)
            if self._rows >= self.batch_rows or self._bytes >= self.batch_bytes:
                self.flush()
            start = stop

    def flush(self) -> None:
        if not self._chunks:
            return
        ids, mask, lengths = (np.concatenate(parts) for parts in zip(*self._chunks, strict=True))
        self._writer.write_table(pa.table({name: _list_array(lengths, column_values(name, ids, mask))
                                           for name in self.columns}))
        self._chunks, self._rows, self._bytes = [], 0, 0

    def close(self) -> None:
        """Write what is buffered and the end of stream; an empty shard is still a valid Arrow file."""
        self.flush()
        self._writer.finalize(close_stream=False)


@dataclass
class ShardStats:
    trains_every_token: bool = False  # train_on all: a wholly trained row is the point, not a warning sign
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    rows_exact: int = 0  # rows whose mask took the exact (prefix-rendering) path
    rows_expanded: int = 0  # extra rows made by --reasoning-turns expand
    rows_special_text: int = 0  # rows with a control token's text inside a message, encoded as plain text
    rows_all_trained: int = 0  # rows whose every token is trained: almost always a broken template
    max_buffered_rows: int = 0
    dropped: Counter = field(default_factory=Counter)
    lengths: Counter = field(default_factory=Counter)

    def add(self, batch: EncodedBatch) -> None:
        self.rows += batch.rows
        self.rows_exact += batch.rows_exact
        self.rows_expanded += batch.rows_expanded
        self.rows_special_text += batch.rows_special_text
        self.tokens += len(batch.input_ids)
        self.trained_tokens += int(batch.loss_mask.sum(dtype=np.int64))
        if batch.rows and not self.trains_every_token:  # every kept row has a token
            trained = np.add.reduceat(batch.loss_mask, batch.offsets[:-1], dtype=np.int64)
            self.rows_all_trained += int(np.count_nonzero(trained == np.diff(batch.offsets)))
        values, counts = np.unique(np.diff(batch.offsets), return_counts=True)
        self.lengths.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))

    def as_json(self) -> dict:
        values = sorted(self.lengths)
        return {"rows": self.rows, "tokens": self.tokens, "trained_tokens": self.trained_tokens,
                "rows_exact": self.rows_exact, "rows_expanded": self.rows_expanded,
                "rows_special_text": self.rows_special_text, "rows_all_trained": self.rows_all_trained,
                "max_buffered_rows": self.max_buffered_rows,
                "dropped": dict(sorted(self.dropped.items())),
                "lengths": {"values": values, "counts": [self.lengths[v] for v in values]}}


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


# Drop reasons that are not bad rows: the same under on_bad_row="raise" and "skip".
NOT_BAD_ROWS = frozenset({"no_assistant_turn", "too_long", "truncated_away", "no_trained_tokens"})


def finished_shard(job: Job, slice_: Slice) -> dict | None:
    """The sidecar of a complete shard of this slice's key, or None if it must be (re)written."""
    shard = job.shard_path(slice_)
    try:
        meta = json.loads(sidecar_path(shard).read_text())
        size = shard.stat().st_size
    except (OSError, ValueError):
        return None
    if meta.get("key") != slice_.key or meta.get("bytes") != size:
        return None
    if job.on_bad_row == "raise" and set(meta.get("dropped", {})) - NOT_BAD_ROWS:
        return None  # written by a run that skipped bad rows: this run must stop at them instead
    return meta


@lru_cache(maxsize=4)
def process_encoding(tokenizer_dir: str, chat_template: str | None, trust_remote_code: bool, encoder: str,
                     prepared: str = "") -> tuple[Any, FastEncoder | None]:
    """One tokenizer and fast encoder per process, shared by its threads (encoding does not mutate them), and by
    the plan that checked them when the slices run in the planning process (the threads runner). With a
    `prepared` directory (prepared.py) they come from there, made once per tokenizer content."""
    def load():
        return load_tokenizer(tokenizer_dir, None, trust_remote_code)

    if prepared:
        tokenizer, fast = prepared_encoding(Path(prepared), load, encoder)
    else:
        tokenizer = load()
        fast = choose_encoder(tokenizer, encoder)
    mark("encoding")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer, fast


def encoder_settings(job: Job) -> dict:
    """The job's ChatEncoder arguments besides the tokenizer and the fast encoder."""
    return {"train_on": job.train_on, "max_length": job.max_length, "truncation": job.truncation,
            "template_kwargs": job.template_kwargs, "reasoning_turns": job.reasoning_turns,
            "special_text": job.special_text}


def _process_encoding(job: Job) -> tuple[Any, FastEncoder | None]:
    """This process's tokenizer and fast encoder for the job."""
    return process_encoding(job.tokenizer_dir, job.chat_template, job.trust_remote_code, job.encoder, job.prepared)


def warm_encoder(job: Job) -> None:
    """This process is about to encode the job's slices itself: start building its fast encoder now."""
    fast = _process_encoding(job)[1]
    if fast is not None:
        fast.warm()


_encoders: dict[str, ChatEncoder] = {}
_making_encoder = threading.Lock()


def encoder_for(job: Job) -> ChatEncoder:
    """This process's ChatEncoder for the job, made once (compiling and probing a template takes a few hundred
    ms) and shared by its slices' threads: it holds no state between batches."""
    key = json.dumps([job.tokenizer_dir, job.chat_template, job.trust_remote_code, job.encoder, job.prepared,
                      encoder_settings(job)], sort_keys=True, default=str)
    with _making_encoder:
        if key not in _encoders:
            if len(_encoders) >= 4:  # as many as process_encoding keeps: a long-lived worker's jobs come and go
                _encoders.pop(next(iter(_encoders)))
            tokenizer, fast = _process_encoding(job)
            _encoders[key] = ChatEncoder(tokenizer, fast=fast, **encoder_settings(job))
        return _encoders[key]


_pools: list[tuple[Job, EncodePool]] = []  # the encode pools of this process's runs in progress


@contextmanager
def encoding_processes(job: Job, processes: int) -> Iterator[None]:
    """While in it, this process's slices of `job` have their batches encoded by `processes` processes (see
    encode_pool.py); they are terminated if it ends with an error or an interrupt."""
    entry = (job, EncodePool(encoder_for(job), encoder_settings(job), processes))
    _pools.append(entry)
    ended = False
    try:
        yield
        ended = True
    finally:
        _pools.remove(entry)
        entry[1].close(now=not ended)


class _InlineEncoding:
    """A slice's batches encoded in its own thread, with the pool's interface."""

    def __init__(self, encoder: ChatEncoder):
        self.encoder = encoder

    def submit(self, examples: list, verify_rows: int) -> Future:
        done: Future = Future()
        try:
            done.set_result(self.encoder.encode_batch(examples, verify_rows))
        except Exception as error:  # raised where the pool's future would raise it
            done.set_exception(error)
        return done


def _encoding(job: Job) -> tuple[EncodePool | _InlineEncoding, int]:
    """Where this slice's batches are encoded, and how many may be in flight."""
    for pool_job, pool in _pools:
        if pool_job == job:
            return pool, DEPTH
    return _InlineEncoding(encoder_for(job)), 0


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stream_rows(job: Job, slice_: Slice, stream) -> ShardStats:
    """Read, tokenize and write the slice's rows batch by batch, in order; bad rows raise or are counted."""
    encoding, depth = _encoding(job)
    stats = ShardStats(trains_every_token=job.train_on == "all")
    writer = ShardWriter(stream, job.extra_columns, job.writer_batch_rows, job.writer_batch_bytes, job.layout)
    in_flight: deque[tuple[Future, list[int], Any]] = deque()  # (encoded batch, its rows' positions, locate)
    verified = 0  # the slice's rows the fast encoder gave that HF checked: VERIFY_ROWS, then no more

    def reject(bad: BadRow, locate, i: int) -> None:
        if job.on_bad_row == "raise":
            raise bad.at(locate(i))
        stats.dropped[bad.reason] += 1

    def write_oldest() -> None:
        nonlocal verified
        encoded, positions, locate = in_flight.popleft()
        batch = encoded.result()
        verified += batch.rows_verified
        for outcome, origin in zip(batch.outcomes, batch.origins, strict=True):
            if isinstance(outcome, BadRow):
                reject(outcome, locate, positions[origin])
            elif isinstance(outcome, str):
                stats.dropped[outcome] += 1
        writer.add(batch)
        stats.add(batch)

    try:
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
                    if job.on_bad_row == "raise":
                        while in_flight:  # the batches before it first: the error names the first bad row
                            write_oldest()
                    reject(bad, locate, i)
            in_flight.append((encoding.submit(examples, max(0, VERIFY_ROWS - verified)), positions, locate))
            while len(in_flight) > depth:
                write_oldest()
        while in_flight:
            write_oldest()
    finally:
        for encoded, _, _ in in_flight:
            encoded.cancel()
    writer.close()
    stats.max_buffered_rows = writer.max_buffered_rows
    return stats


def tokenize_slice(job: Job, slice_: Slice) -> int:
    """Tokenize one slice into `<key>.arrow` in the store (reusing a finished one); return its row count."""
    done = finished_shard(job, slice_)
    if done is not None:
        return done["rows"]
    started = time.monotonic()
    mark("first_slice")
    shard = job.shard_path(slice_)
    tmp = shard.with_name(f"{shard.name}.tmp-{uuid.uuid4().hex}")
    try:
        shard.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as stream:
            stats = _stream_rows(job, slice_, stream)
            stream.flush()
            os.fsync(stream.fileno())
        # A shard is stored under the key of the bytes the plan hashed: if they changed since, it must not be.
        if slice_key(slice_, job.tokenization, job.storage_options) != slice_.key:
            for part in slice_.parts:  # the plan's digest is not the bytes' now: the next plan hashes them
                forget(job.digest_book, filesystem(part.url, job.storage_options)[1])
            raise BadInput(f"{slice_.parts[0].url}: changed while it was being tokenized; run again")
        os.replace(tmp, shard)
        meta = {"key": slice_.key, "slice": slice_.describe(), "bytes": shard.stat().st_size,
                **stats.as_json(), "seconds": round(time.monotonic() - started, 3)}
        _write_atomically(sidecar_path(shard), json.dumps(meta).encode())
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise OutOfSpace(f"{shard}: cannot write the shard ({error.strerror}); free space under "
                             f"{shard.parent.parent} and run the same command again: finished shards "
                             "are kept") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return stats.rows
