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
from collections import deque
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from sft_tokenize.build.ahead import claimed
from sft_tokenize.build.image_rows import ImageRows, held_bytes, pixel_bytes
from sft_tokenize.build.job import Job
from sft_tokenize.build.keys import forget, slice_key
from sft_tokenize.build.remote_store import checked_remote, upload_shard
from sft_tokenize.build.shard_check import SHARD_DIGESTS, checked_shard, sidecar_path
from sft_tokenize.build.shard_stats import ShardStats
from sft_tokenize.build.shard_writer import ShardWriter
from sft_tokenize.build.stopping import Stopped, raise_if_stopping
from sft_tokenize.build.timeline import mark
from sft_tokenize.build.workers import encoder_for, rendering, skeletons_dropped, slice_encoding
from sft_tokenize.encoding.exact import VERIFY_ROWS
from sft_tokenize.errors import BadInput, BadRow, OutOfSpace
from sft_tokenize.files import atomic_path, atomic_write
from sft_tokenize.sources.conversations import to_example
from sft_tokenize.sources.images import image_base
from sft_tokenize.sources.readers import Rows, change_while_read, joined, read_slice
from sft_tokenize.sources.records import Slice, filesystem

logger = logging.getLogger("sft_tokenize")


def _image_rows(job: Job) -> ImageRows | None:
    """The job's image rows, with a processor; None without one."""
    if not job.processor_config:
        return None
    return ImageRows(encoder_for(job).images, job.images, job.max_image_bytes, job.storage_options,
                     pixels="pixel_values" in job.extra_columns, timeout=job.image_timeout)


class _RenderAgain(Exception):
    """A skeleton's fill differed from its full render: the slice is tokenized again, rendering every row."""

    def __init__(self, mismatches: int):
        super().__init__(mismatches)
        self.mismatches = mismatches


def _stream_rows(job: Job, slice_: Slice, stream) -> ShardStats:
    """Read, tokenize and write the slice's rows batch by batch, in order; bad rows raise or are counted. A fill
    that differs from its full render is never written: the slice starts again with every row rendered in full."""
    try:
        return _stream_rows_as(rendering(job), slice_, stream)
    except _RenderAgain as again:
        stream.seek(0)
        stream.truncate()
        stats = _stream_rows_as(replace(job, render="full"), slice_, stream)
        stats.skeleton_mismatches += again.mismatches
        return stats


def _stream_rows_as(job: Job, slice_: Slice, stream) -> ShardStats:
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
        batch = encoded.result()
        if batch.skeletons_dropped and job.render == "skeleton":
            skeletons_dropped(job)
            if stats.rows_filled or batch.rows_filled:
                # Rows this slice filled before may have come from the skeleton that failed: all of them again.
                raise _RenderAgain(stats.skeleton_mismatches + batch.skeleton_mismatches)
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

    def submit_with_images(rows: list, locate, part) -> None:
        """A read batch's examples with their images loaded, a writer batch's worth of image bytes at a time."""
        examples, positions, stored, loaded = [], [], [], 0
        base = job.image_root or image_base(part.url)
        for i, row in enumerate(rows):
            try:
                if isinstance(row, BadRow):
                    raise row
                example = to_example(row, job.columns, job.system_prompt, images=True, image_base=base,
                                     image_access=job.image_access)
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
            if loaded >= job.writer_batch_bytes:
                submit(examples, positions, locate, stored)
                examples, positions, stored, loaded = [], [], [], 0
        submit(examples, positions, locate, stored)

    batches = read_slice(slice_, job.columns.names, job.storage_options, job.max_row_bytes,
                         raw=image_rows is None, timeout=job.request_timeout)
    try:
        if image_rows is None:  # rows become conversations where they are encoded: no per-row work here
            for rows, locate in joined(batches):
                raise_if_stopping()
                submit(Rows(rows, job.columns, job.system_prompt), list(range(len(rows))), locate, [])
        else:
            for rows, locate, part in batches:
                raise_if_stopping()
                submit_with_images(rows, locate, part)
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
    """Tokenize one slice into `<key>.arrow` in the store (reusing a finished one); return its row count. On a
    remote root, the shard object is checked first, and a new shard is written into this process's working
    store, uploaded, and removed there (remote_store.py). A slice this process is tokenizing ahead of its task
    (ahead.py) is waited for, its error raised; its shard is then found in the store like any finished one (or
    tokenized again, had something removed it meanwhile)."""
    claimed(job, slice_)
    if not job.remote_root:
        return _tokenize_into_store(job, slice_)
    done, damaged = checked_remote(job, slice_)
    if done is not None:
        return done["rows"]
    if damaged:
        logger.warning("%s; tokenizing slice %d again", damaged, slice_.index)
    rows = _tokenize_into_store(job, slice_)  # a local shard left by an upload cut short is checked and reused
    upload_shard(job, slice_)
    return rows


def _tokenize_into_store(job: Job, slice_: Slice) -> int:
    done, damaged = checked_shard(job, slice_)
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
            if slice_key(slice_, job.tokenization, job.storage_options, timeout=job.request_timeout) != slice_.key:
                for part in slice_.parts:  # the plan's digest is not the bytes' now: the next plan hashes them
                    forget(job.digest_book, filesystem(part.url, job.storage_options)[1])
                raise BadInput(change_while_read(slice_, appended_ok=False, always=True))
        # One read of a file just written (from the page cache); remembered, so this process's later checks
        # of it (publish, the threads runner's lease) do not read it again.
        digest = SHARD_DIGESTS.local(str(shard))
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
