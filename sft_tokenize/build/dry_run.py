"""A dry run (`sft-tokenize run … --plan-only`): what a run would do, without doing it or writing anything.

It takes the run's plan (its slices, their bytes, their content keys, whether the cache is published), says
which slices the shard store already holds, and estimates the tokens and the time from a sample: rows from
up to SAMPLE_SLICES slices spread over the input, and within a slice from SAMPLE_OFFSETS places along it (line
starts of JSON lines, Parquet row groups), tokenized exactly as the run would (the same encoder, template,
max_length and drops). Each sampled chunk stands for the input bytes up to the next one: the estimate is its
tokens per byte weighted by those bytes, times the input's bytes, and the chunks' lowest and highest rates give
its spread (a file sorted by length, or whose rows change along it, shows a wide one). A JSON line's bytes are its
own, a Parquet row's its row group's share (its bytes over its rows); rows of another format are known by their
slice's bytes only, so such a slice is read whole (at most SAMPLE_WHOLE_SLICES of them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from sft_tokenize.build.job import Job
from sft_tokenize.build.remote_store import finished_all
from sft_tokenize.build.shard_check import finished_shard
from sft_tokenize.build.workers import encoder_for
from sft_tokenize.encoding.chat_encoder import EncodedBatch
from sft_tokenize.errors import BadRow
from sft_tokenize.sources.formats.table import FORMATS
from sft_tokenize.sources.readers import Rows, read_slice, reader
from sft_tokenize.sources.records import Slice, filesystem

SAMPLE_SLICES = 32
SAMPLE_ROWS = 256  # per sampled slice, of JSON lines, at most
SAMPLE_BUDGET = 2048  # rows of JSON lines in all: more slices sampled, fewer rows from each
SAMPLE_OFFSETS = 8  # places along a slice (of JSON lines, of Parquet row groups) where its sample is read
SAMPLE_WHOLE_SLICES = 2  # slices of other formats read whole (their bytes are known per slice only)


@dataclass
class Sample:
    rows: int = 0
    kept: int = 0  # rows the run would keep (not dropped for length, no assistant turn, a bad row skipped)
    tokens: int = 0
    trained: int = 0
    nbytes: float = 0.0
    seconds: float = 0.0
    slices: list[int] = field(default_factory=list)
    # each sampled chunk: (the input bytes it stands for, its tokens, trained tokens and kept rows per byte)
    strata: list[tuple[float, float, float, float]] = field(default_factory=list)

    def per_byte(self, which: int) -> float:
        """Tokens (1), trained tokens (2) or kept rows (3) per input byte: each chunk's rate weighted by the bytes
        it stands for, so a file whose rows change along it is not judged by where its slices begin."""
        weight = sum(stratum[0] for stratum in self.strata)
        return sum(stratum[0] * stratum[which] for stratum in self.strata) / weight if weight else 0.0

    @property
    def rates(self) -> list[float]:
        return [stratum[1] for stratum in self.strata]

    def add(self, batch: EncodedBatch, nbytes: float) -> None:
        self.rows += len(batch.outcomes)
        self.kept += len(batch.offsets) - 1
        self.tokens += int(batch.offsets[-1])
        self.trained += int(batch.loss_mask.sum())
        self.nbytes += nbytes


def spread(count: int, picks: int) -> list[int]:
    """Up to `picks` indices evenly over range(count), the first and the last included."""
    if count <= picks:
        return list(range(count))
    return sorted({round(k * (count - 1) / (picks - 1)) for k in range(picks)})


def offsets(slice_: Slice, storage_options: dict | None, count: int = SAMPLE_OFFSETS) -> list[Slice]:
    """The slice, and for a slice of one byte range (JSON lines) `count` slices starting at line starts spread over
    its bytes: a file sorted by length (or skewed along it) is sampled along each slice, not only where each slice
    begins."""
    parts = [p for p in slice_.parts if FORMATS[p.kind].byte_ranges]
    if len(parts) != len(slice_.parts) or len(parts) != 1 or count < 2:
        return [slice_]
    part = parts[0]
    fs, path = filesystem(part.url, storage_options)
    starts = [part.start]
    with fs.open(path, "rb") as file:
        for k in range(1, count):
            offset = part.start + k * (part.stop - part.start) // count
            file.seek(offset - 1)
            aligned = offset - 1 + len(file.readline())  # the next line's start (the line holding offset - 1 ends)
            if starts[-1] < aligned < part.stop:
                starts.append(aligned)
    return [replace(slice_, parts=(replace(part, start=start, stop=stop),), nbytes=stop - start)
            for start, stop in zip(starts, [*starts[1:], part.stop], strict=True)]


def row_groups(slice_: Slice, storage_options: dict | None, timeout: float,
               count: int = SAMPLE_OFFSETS) -> list[tuple[Slice, float]] | None:
    """For a slice of Parquet row groups, `count` of them spread over it, each as a slice of its own whose bytes are
    those it stands for (its own and those of the row groups up to the next one sampled), with its bytes per row;
    None for a slice of another format."""
    if any(part.kind != "parquet" for part in slice_.parts):
        return None
    groups = []  # (part, row group, its bytes, its rows)
    for part in slice_.parts:
        meta = reader(part, storage_options, timeout=timeout).file.metadata
        groups += [(part, g, meta.row_group(g).total_byte_size, meta.row_group(g).num_rows)
                   for g in range(part.start, part.stop)]
    picks = spread(len(groups), count)
    chunks = []
    for k, first in enumerate(picks):
        part, group, nbytes, rows = groups[first]
        stands_for = sum(g[2] for g in groups[first:picks[k + 1] if k + 1 < len(picks) else len(groups)])
        chunks.append((replace(slice_, parts=(replace(part, start=group, stop=group + 1),), nbytes=stands_for),
                       nbytes / max(rows, 1)))
    return chunks


def sample(job: Job, slices: list[Slice], rows_per_slice: int = SAMPLE_ROWS) -> Sample:
    """Tokenize a sample of the slices' rows as the run would, counting their input bytes and tokens; each sampled
    chunk's tokens per byte is kept for the estimate's spread."""
    encoder = encoder_for(job)
    out = Sample()
    started = time.perf_counter()
    whole_slices = 0
    picked = spread(len(slices), SAMPLE_SLICES)
    rows_per_slice = min(rows_per_slice, max(1, SAMPLE_BUDGET // max(len(picked), 1)))
    for index in picked:
        groups = row_groups(slices[index], job.storage_options, job.request_timeout)
        chunks = [(chunk, None) for chunk in offsets(slices[index], job.storage_options)] if groups is None \
            else groups
        per_chunk = max(1, rows_per_slice // len(chunks))
        for chunk, row_bytes in chunks:
            rows, whole = [], True
            for batch, _, _ in read_slice(chunk, job.columns.names, job.storage_options, job.max_row_bytes, raw=True,
                                          timeout=job.request_timeout):
                rows += batch
                if len(rows) >= per_chunk and (row_bytes is not None or all(type(row) is bytes for row in batch)):
                    whole = False  # JSON lines and Parquet rows know their bytes: no need to read on
                    break
            if row_bytes is not None:
                rows = rows[:per_chunk]
                nbytes = row_bytes * len(rows)
            elif all(type(row) is bytes for row in rows):
                rows = rows[:per_chunk]
                nbytes = float(sum(len(row) + 1 for row in rows))  # and its newline
            elif whole and whole_slices < SAMPLE_WHOLE_SLICES:
                nbytes, whole_slices = float(chunk.nbytes), whole_slices + 1
            else:
                continue
            examples = [row for row in Rows(rows, job.columns, job.system_prompt).examples()
                        if not isinstance(row, BadRow)]
            if index not in out.slices:
                out.slices.append(index)
            batch = encoder.encode_batch(examples, verify_rows=0)
            out.add(batch, nbytes)
            if nbytes:
                out.strata.append((float(chunk.nbytes), int(batch.offsets[-1]) / nbytes,
                                   int(batch.loss_mask.sum()) / nbytes, (len(batch.offsets) - 1) / nbytes))
    out.seconds = time.perf_counter() - started
    return out


def stored(job: Job, slices: list[Slice]) -> list[int]:
    """The slices whose finished shard the store holds, as the run would find them (size and digest checked; on a
    remote root, the shard objects checked against their sidecars as the run's lease does)."""
    if job.remote_root:
        return sorted(finished_all(job, [s for s in slices if s.key])[0])
    return [s.index for s in slices if s.key and finished_shard(job, s) is not None]


def dry_run(job: Job, slices: list[Slice], workers: int) -> dict[str, Any]:
    """The plan-only report: slices, input bytes, what is stored, and the estimated tokens and time."""
    total = sum(s.nbytes for s in slices)
    have = stored(job, slices)
    held = set(have)
    missing = [s for s in slices if s.index not in held]
    found = sample(job, missing or slices)
    per_byte = found.per_byte(1)
    rate = found.nbytes / found.seconds if found.seconds else 0.0  # input bytes per second, one thread
    to_do = sum(s.nbytes for s in missing)
    return {
        "slices": len(slices),
        "input_bytes": total,
        "stored_slices": have,
        "sample": {"slices": found.slices, "rows": found.rows, "kept": found.kept, "bytes": int(found.nbytes),
                   "tokens": found.tokens, "trained_tokens": found.trained, "seconds": round(found.seconds, 3)},
        "estimated_tokens": round(per_byte * total),
        # what the sample's chunks say one by one: far apart, the input changes along its length
        "estimated_tokens_spread": [round(min(found.rates) * total), round(max(found.rates) * total)]
        if found.rates else None,
        "estimated_trained_tokens": round(found.per_byte(2) * total),
        "estimated_rows": round(found.per_byte(3) * total),
        "estimated_seconds": round(to_do / (rate * max(workers, 1)), 1) if rate else None,
    }
