"""tokenize_slice: read one slice, tokenize it in batches, stream the rows into its own Arrow shard.

Memory is bounded by the reader's batch and the writer's batch, never by the slice. The shard is written
into the shard store under a temporary name and renamed to its content key when complete; its JSON
sidecar, written last, is the completion marker and records the shard's size and digest. A shard whose
sidecar names the slice's key, and whose file still has that size and digest, is reused without tokenizing,
by any run and any version that reads the same bytes the same way; any other is tokenized again.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from sft_tokenize.build.image_rows import ImageRows, held_bytes, pixel_bytes
from sft_tokenize.build.job import Job, features
from sft_tokenize.build.keys import Digests, forget, slice_key
from sft_tokenize.build.stopping import Stopped, raise_if_stopping
from sft_tokenize.build.timeline import mark
from sft_tokenize.build.workers import encoder_for, slice_encoding
from sft_tokenize.chat.skeleton import SkeletonMismatch
from sft_tokenize.encoding.chat_encoder import EncodedBatch
from sft_tokenize.encoding.exact import VERIFY_ROWS
from sft_tokenize.encoding.memory import trim_malloc
from sft_tokenize.errors import BadInput, BadRow, OutOfSpace
from sft_tokenize.files import atomic_path, atomic_write
from sft_tokenize.read.layouts import COLUMN_TYPES, column_values, layout_columns
from sft_tokenize.sources.conversations import to_example
from sft_tokenize.sources.images import changed_file, image_base
from sft_tokenize.sources.readers import Rows, change_while_read, read_slice
from sft_tokenize.sources.resolve import Slice, filesystem

logger = logging.getLogger("sft_tokenize")

_IMAGE_FIELDS = ("bytes", "path", "hash", "size")  # a stored image (FORMAT.md); beside it its grid and size


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
                 layout: str = "skyrl", images: bool = False):
        from datasets.arrow_writer import ArrowWriter

        self.columns = layout_columns(layout, extra_columns)
        self._token_bytes = sum(np.dtype(COLUMN_TYPES[name]).itemsize for name in self.columns)
        self.batch_rows, self.batch_bytes = batch_rows, batch_bytes
        self.schema = features(extra_columns, layout, images)
        self._writer = ArrowWriter(stream=stream, features=self.schema, writer_batch_size=batch_rows)
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, mask, lengths)
        self._images: list[list[dict]] | None = [] if images else None  # each buffered row's stored images
        self._rows = self._bytes = 0
        self.max_buffered_rows = 0

    def add(self, batch: EncodedBatch, images: list[list[dict]] | None = None) -> None:
        """Buffer a batch's rows (with each row's stored images, in an image cache), flushing every `batch_rows`
        rows or as soon as `batch_bytes` is reached, whatever the rows' sizes."""
        lengths = np.diff(batch.offsets)
        sizes = lengths * self._token_bytes  # each row's bytes, tokens and images
        if self._images is not None and images is not None:
            sizes = sizes + np.fromiter(map(held_bytes, images), dtype=np.int64, count=batch.rows)
        start = 0
        while start < batch.rows:
            stop = min(batch.rows, start + self.batch_rows - self._rows)
            reached = np.cumsum(sizes[start:stop]) + self._bytes
            stop = min(stop, start + int(np.searchsorted(reached, self.batch_bytes)) + 1)  # through the row reaching it
            a, b = batch.offsets[start], batch.offsets[stop]
            self._chunks.append((batch.input_ids[a:b], batch.loss_mask[a:b], lengths[start:stop]))
            if self._images is not None:
                self._images += images[start:stop] if images is not None else [[] for _ in range(stop - start)]
            self._rows += stop - start
            self._bytes = int(reached[stop - start - 1])
            self.max_buffered_rows = max(self.max_buffered_rows, self._rows)
            if self._rows >= self.batch_rows or self._bytes >= self.batch_bytes:
                self.flush()
            start = stop

    def flush(self) -> None:
        if not self._chunks:
            return
        self._write_batch()
        if self._images is not None:
            trim_malloc()  # the batch's image bytes, just freed, would stay resident (encoding/memory.py)

    def _write_batch(self) -> None:
        ids, mask, lengths = (np.concatenate(parts) for parts in zip(*self._chunks, strict=True))
        columns = {name: _list_array(lengths, column_values(name, ids, mask)) for name in self.columns}
        if self._images is not None:
            stored = self._images
            columns["images"] = pa.array([[{k: v for k, v in image.items() if k in _IMAGE_FIELDS} for image in row]
                                          for row in stored], type=self.schema.arrow_schema.field("images").type)
            for name in ("image_grid_thw", "image_sizes"):
                columns[name] = pa.array([[image[name] for image in row] for row in stored],
                                         type=self.schema.arrow_schema.field(name).type)
            if "pixel_values" in self.schema:
                columns["pixel_values"] = self._pixel_values(stored)
            self._images = []
        self._writer.write_table(pa.table(columns))
        self._chunks, self._rows, self._bytes = [], 0, 0

    def _pixel_values(self, stored: list[list[dict]]) -> pa.Array:
        """Each row's images' pixel rows end to end, `list<list<float>>` built from flat arrays (no per-float
        Python objects)."""
        rows = [image["pixels"] for row in stored for image in row]
        width = rows[0].shape[1] if rows else 0
        values = np.concatenate(rows) if rows else np.zeros((0, 0), dtype=np.float32)
        patches = np.array([sum(len(image["pixels"]) for image in row) for row in stored], dtype=np.int64)
        inner = _list_array(np.full(len(values), width), values.reshape(-1))
        offsets = np.zeros(len(stored) + 1, dtype=np.int32)
        np.cumsum(patches, out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), inner).cast(self.schema.arrow_schema.field(
            "pixel_values").type)

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
    images: int = 0  # images stored in the rows
    image_tokens: int = 0  # vision tokens in the rows
    image_bytes: int = 0  # encoded image bytes stored (embed) or referenced
    pixel_bytes: int = 0  # float32 pixel_values stored (--extra-column pixel_values)
    image_files: list[list] = field(default_factory=list)  # [url, *identity] of each image file read
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
                **({"images": self.images, "image_tokens": self.image_tokens, "image_bytes": self.image_bytes}
                   if self.images else {}),
                **({"pixel_bytes": self.pixel_bytes} if self.pixel_bytes else {}),
                **({"image_files": self.image_files} if self.image_files else {}),
                "dropped": dict(sorted(self.dropped.items())),
                "lengths": {"values": values, "counts": [self.lengths[v] for v in values]}}


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


# Drop reasons that are not bad rows: the same under on_bad_row="raise" and "skip".
NOT_BAD_ROWS = frozenset({"no_assistant_turn", "too_long", "truncated_away", "no_trained_tokens",
                          "image_truncated"})


# Digests of the store's shards this process has read (or written), under each shard's stat: a shard checked
# once is not read again in this process until its stat changes (a write, a truncation or a rename does).
_SHARD_DIGESTS = Digests()


def _checked_shard(job: Job, slice_: Slice) -> tuple[dict | None, str | None]:
    """(the sidecar of a complete shard of this slice's key, None), or (None, why a stored shard is not one:
    None when there is nothing to trust, a message when what is there is damaged)."""
    shard = job.shard_path(slice_)
    sidecar = sidecar_path(shard)
    try:
        meta = json.loads(sidecar.read_text())
        size = shard.stat().st_size
    except FileNotFoundError:  # not written yet, or a run was killed before the sidecar
        return None, None
    except (OSError, ValueError) as error:
        return None, f"{sidecar}: unreadable sidecar ({getattr(error, 'strerror', None) or error})"
    if not isinstance(meta, dict) or meta.get("key") != slice_.key:
        return None, f"{sidecar}: the sidecar is not this shard's (it names another key)"
    if "digest" not in meta or "bytes" not in meta:
        return None, None  # written before shards were digested: not trusted, quietly tokenized again
    if job.on_bad_row == "raise" and set(meta.get("dropped", {})) - NOT_BAD_ROWS:
        return None, None  # written by a run that skipped bad rows: this run must stop at them instead
    files = meta.get("image_files")
    if files and (changed := changed_file(files, job.storage_options, job.image_timeout)):
        return None, f"{changed}: the image changed since slice {slice_.index}'s shard was written"
    if meta["bytes"] != size:
        return None, f"{shard}: {size:,} bytes, its sidecar says {meta['bytes']:,}: the stored shard is corrupt"
    try:
        digest = _SHARD_DIGESTS.local(str(shard))
    except OSError as error:
        return None, f"{shard}: cannot read the stored shard ({error.strerror})"
    if digest != meta["digest"]:
        return None, f"{shard}: its bytes do not match its sidecar's digest: the stored shard is corrupt"
    return meta, None


def finished_shard(job: Job, slice_: Slice) -> dict | None:
    """The sidecar of a complete shard of this slice's key, its size and digest checked against the file; None
    if it must be (re)written."""
    return _checked_shard(job, slice_)[0]


def _image_rows(job: Job) -> ImageRows | None:
    """The job's image rows, with a processor; None without one."""
    if not job.processor_config:
        return None
    return ImageRows(encoder_for(job).images, job.images, job.max_image_bytes, job.storage_options,
                     pixels="pixel_values" in job.extra_columns, timeout=job.image_timeout)


def _stream_rows(job: Job, slice_: Slice, stream) -> ShardStats:
    """Read, tokenize and write the slice's rows batch by batch, in order; bad rows raise or are counted."""
    encoding, depth = slice_encoding(job)
    stats = ShardStats(trains_every_token=job.train_on == "all")
    image_rows = _image_rows(job)
    writer = ShardWriter(stream, job.extra_columns, job.writer_batch_rows, job.writer_batch_bytes, job.layout,
                         images=image_rows is not None)
    # (encoded batch, its rows' positions, locate, its examples' stored images)
    in_flight: deque[tuple[Future, list[int], Any, list]] = deque()
    verified = 0  # the slice's rows the fast encoder gave that HF checked: VERIFY_ROWS, then no more

    def reject(bad: BadRow, locate, i: int) -> None:
        if job.on_bad_row == "raise":
            raise bad.at(locate(i))
        stats.dropped[bad.reason] += 1

    def write_oldest() -> None:
        nonlocal verified
        encoded, positions, locate, stored = in_flight.popleft()
        try:
            batch = encoded.result()
        except SkeletonMismatch as mismatch:
            raise SkeletonMismatch(f"{locate(positions[mismatch.row])}: {mismatch}") from None
        verified += batch.rows_verified
        for outcome, origin in zip(batch.outcomes, batch.origins, strict=True):
            if isinstance(outcome, BadRow):
                reject(outcome, locate, positions[origin])
            elif isinstance(outcome, str):
                stats.dropped[outcome] += 1
        images = image_rows.rows(batch, stored) if image_rows is not None else None
        writer.add(batch, images)
        stats.add(batch)
        if images is not None:
            kept = [image for row in images for image in row]
            stats.images += len(kept)
            stats.image_tokens += image_rows.tokens(batch)
            stats.image_bytes += sum(image["size"] for image in kept)
            stats.pixel_bytes += pixel_bytes(kept)

    def submit(examples: list, positions: list[int], locate, stored: list) -> None:
        in_flight.append((encoding.submit(examples, max(0, VERIFY_ROWS - verified)), positions, locate, stored))
        while len(in_flight) > depth:
            write_oldest()

    try:
        for rows, locate, part in read_slice(slice_, job.columns.names, job.storage_options, job.max_row_bytes,
                                             raw=image_rows is None):
            raise_if_stopping()
            if image_rows is None:  # rows become conversations where they are encoded: no per-row work here
                submit(Rows(rows, job.columns, job.system_prompt), list(range(len(rows))), locate, [])
                continue
            examples, positions, stored, loaded = [], [], [], 0
            base = job.image_root or image_base(part.url)
            for i, row in enumerate(rows):
                try:
                    if isinstance(row, BadRow):
                        raise row
                    example = to_example(row, job.columns, job.system_prompt, images=image_rows is not None,
                                         image_base=base, image_access=job.image_access)
                    if image_rows is not None:
                        example, images = image_rows.load(example)
                        stored.append(images)
                        loaded += held_bytes(images)
                    examples.append(example)
                    positions.append(i)
                except BadRow as bad:
                    if job.on_bad_row == "raise":
                        while in_flight:  # the batches before it first: the error names the first bad row
                            write_oldest()
                    reject(bad, locate, i)
                if loaded >= job.writer_batch_bytes:  # images (and pixels) held: a writer batch's worth at a time
                    submit(examples, positions, locate, stored)
                    examples, positions, stored, loaded = [], [], [], 0
            submit(examples, positions, locate, stored)
        while in_flight:
            write_oldest()
    finally:
        for encoded, *_ in in_flight:
            encoded.cancel()
    writer.close()
    stats.max_buffered_rows = writer.max_buffered_rows
    if image_rows is not None:
        stats.image_files = image_rows.file_list()
    return stats


def tokenize_slice(job: Job, slice_: Slice) -> int:
    """Tokenize one slice into `<key>.arrow` in the store (reusing a finished one); return its row count."""
    done, damaged = _checked_shard(job, slice_)
    if done is not None:
        return done["rows"]
    if damaged:
        logger.warning("%s; tokenizing slice %d again", damaged, slice_.index)
    started = time.monotonic()
    mark("first_slice")
    shard = job.shard_path(slice_)
    try:
        shard.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(shard) as tmp:  # <key>.arrow.tmp-<uuid> until complete (FORMAT.md)
            with open(tmp, "wb") as stream:
                try:
                    stats = _stream_rows(job, slice_, stream)
                except Exception as error:
                    # A file cut short or rewritten under the reader shows up as a bad row or a format error:
                    # name the change instead, if there was one.
                    if not isinstance(error, Stopped) and (changed := change_while_read(slice_, appended_ok=False)):
                        raise BadInput(changed) from None
                    raise
            # A shard is stored under the key of the bytes the plan hashed: if they changed since, it must not be.
            if slice_key(slice_, job.tokenization, job.storage_options) != slice_.key:
                for part in slice_.parts:  # the plan's digest is not the bytes' now: the next plan hashes them
                    forget(job.digest_book, filesystem(part.url, job.storage_options)[1])
                raise BadInput(change_while_read(slice_, appended_ok=False, always=True))
        # One read of a file just written (from the page cache); remembered, so this process's later checks
        # of it (publish, the threads runner's lease) do not read it again.
        digest = _SHARD_DIGESTS.local(str(shard))
        meta = {"key": slice_.key, "slice": slice_.describe(), "bytes": shard.stat().st_size, "digest": digest,
                **stats.as_json(), "seconds": round(time.monotonic() - started, 3)}
        atomic_write(sidecar_path(shard), json.dumps(meta).encode())
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise OutOfSpace(f"{shard}: cannot write the shard ({error.strerror}); free space under "
                             f"{shard.parent.parent} and run the same command again: finished shards "
                             "are kept") from None
        raise
    return stats.rows
