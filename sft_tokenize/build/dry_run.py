"""A dry run (`sft-tokenize run … --plan-only`): what a run would do, without doing it or writing anything.

It takes the run's plan (its slices, their bytes, their content keys, whether the cache is published), says
which slices the shard store already holds, and estimates the tokens and the time from a sample: rows from
up to SAMPLE_SLICES slices spread over the input, tokenized exactly as the run would (the same encoder,
template, max_length and drops). Tokens per input byte in the sample, times the input's bytes, is the
estimate. A JSON line's bytes are its own; rows of another format are known by their slice's bytes only, so
such a slice is read whole (at most SAMPLE_WHOLE_SLICES of them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sft_tokenize.build.job import Job
from sft_tokenize.build.remote_store import finished_all
from sft_tokenize.build.shard_check import finished_shard
from sft_tokenize.build.workers import encoder_for
from sft_tokenize.encoding.chat_encoder import EncodedBatch
from sft_tokenize.errors import BadRow
from sft_tokenize.sources.readers import Rows, read_slice
from sft_tokenize.sources.resolve import Slice

SAMPLE_SLICES = 8
SAMPLE_ROWS = 256  # per sampled slice, of JSON lines
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


def sample(job: Job, slices: list[Slice], rows_per_slice: int = SAMPLE_ROWS) -> Sample:
    """Tokenize a sample of the slices' rows as the run would, counting their input bytes and tokens."""
    encoder = encoder_for(job)
    out = Sample()
    started = time.perf_counter()
    whole_slices = 0
    for index in spread(len(slices), SAMPLE_SLICES):
        slice_, rows, whole = slices[index], [], True
        for batch, _, _ in read_slice(slice_, job.columns.names, job.storage_options, job.max_row_bytes, raw=True):
            rows += batch
            if len(rows) >= rows_per_slice and all(type(row) is bytes for row in batch):
                whole = False  # JSON lines count their own bytes: no need to read on
                break
        if all(type(row) is bytes for row in rows):
            rows = rows[:rows_per_slice]
            nbytes = float(sum(len(row) + 1 for row in rows))  # and its newline
        elif whole and whole_slices < SAMPLE_WHOLE_SLICES:
            nbytes, whole_slices = float(slice_.nbytes), whole_slices + 1
        else:
            continue
        examples = [row for row in Rows(rows, job.columns, job.system_prompt).examples()
                    if not isinstance(row, BadRow)]
        out.slices.append(index)
        out.add(encoder.encode_batch(examples, verify_rows=0), nbytes)
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
    per_byte = found.tokens / found.nbytes if found.nbytes else 0.0
    rate = found.nbytes / found.seconds if found.seconds else 0.0  # input bytes per second, one thread
    to_do = sum(s.nbytes for s in missing)
    return {
        "slices": len(slices),
        "input_bytes": total,
        "stored_slices": have,
        "sample": {"slices": found.slices, "rows": found.rows, "kept": found.kept, "bytes": int(found.nbytes),
                   "tokens": found.tokens, "trained_tokens": found.trained, "seconds": round(found.seconds, 3)},
        "estimated_tokens": round(per_byte * total),
        "estimated_trained_tokens": round(found.trained / found.nbytes * total) if found.nbytes else 0,
        "estimated_rows": round(found.kept / found.nbytes * total) if found.nbytes else 0,
        "estimated_seconds": round(to_do / (rate * max(workers, 1)), 1) if rate else None,
    }
