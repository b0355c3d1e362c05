"""verify_cache: a published cache's rows tokenized again from its recorded sources, every row rendered in full
(`--render full`), and compared with the rows it holds, column by column.

The options come from the manifest's fingerprint inputs (what changes the rows is recorded there by value), the
slices from its shards, so each shard's rows are its slice's rows again, in order. A cache whose sources or
tokenizer changed since is refused: its rows could not be told from a changed input's.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.build.options import TokenizeOptions, declared
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.workers import encoder_for
from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.layouts import column_values
from sft_tokenize.sources.readers import Rows, joined, read_slice
from sft_tokenize.sources.records import Part, Slice

SHOWN = 5  # differing rows named, at most


@dataclass
class Verified:
    """What `verify_cache` checked: rows compared, seconds, and the differing rows (cache row, file:line, what)."""

    rows_checked: int = 0
    seconds: float = 0.0
    differences: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def verify_cache(path: str | Path, sample: int | None = None, tokenizer: str | None = None,
                 chat_template: str | None = None, seed: int | None = None) -> Verified:
    """Tokenize rows of the published cache at `path` again, every row rendered in full, and compare every
    column: all rows, or with `sample` the slices that hold `sample` rows drawn at random (`seed`), each up to
    its last drawn row. `tokenizer`: where the tokenizer it was built with is now (default: the recorded path);
    `chat_template`: the template file it was built with, where it was given one."""
    started = time.monotonic()
    path = Path(path)
    manifest = read_manifest(path)
    if manifest.get("images"):
        raise BadInput(f"{path}: an image cache: verify re-tokenizes text and chat caches only")
    cache = open_cache(path)
    starts = np.cumsum([0] + [shard["rows"] for shard in manifest["shards"]])
    if sample is None:
        wanted = {k: int(starts[k + 1]) for k in range(len(manifest["shards"])) if starts[k + 1] > starts[k]}
    else:
        drawn = random.Random(seed).sample(range(len(cache)), min(sample, len(cache)))
        wanted = {}
        for row in drawn:
            k = int(np.searchsorted(starts, row, side="right")) - 1
            wanted[k] = max(wanted.get(k, 0), row + 1)
    with tempfile.TemporaryDirectory(prefix="sft-tokenize-verify-") as scratch:
        job = _job(manifest, path, scratch, tokenizer, chat_template)
        encoder = encoder_for(job)
        result = Verified()
        for k, stop in sorted(wanted.items()):
            _check_slice(job, encoder, manifest, cache, k, int(starts[k]), stop, result)
    result.seconds = time.monotonic() - started
    return result


def _job(manifest: dict, path: Path, scratch: str, tokenizer: str | None, chat_template: str | None):
    """The job that built the cache, planned again from its recorded inputs, rendering every row in full."""
    inputs = manifest["fingerprint_inputs"]
    if inputs.get("chat_template_override") and chat_template is None:
        raise BadInput(f"{path}: it was built with a chat template given on the command line: pass --chat-template "
                       "FILE with that template")
    values: dict[str, Any] = {}
    for name, _, option in declared():
        if option.fingerprint == "value" and inputs.get(name) is not None:
            value = inputs[name]
            values[name] = str(value) if name == "max_row_bytes" else value
    options = TokenizeOptions(sources=[source[0] for source in inputs["sources"]],
                              tokenizer=tokenizer or manifest["tokenizer"], format=inputs["format"],
                              columns=inputs["columns"], chat_template=chat_template, cache_dir=scratch,
                              render="full", **values)
    plan = plan_slices(options, content_keys=False, dry=True)
    ignored = ("ignored_files", "render")
    changed = sorted(key for key in {*inputs, *plan.inputs} if key not in ignored
                     and inputs.get(key) != plan.inputs.get(key))
    if changed:
        raise BadInput(f"{path}: its inputs changed since it was built ({', '.join(changed)}): its rows cannot be "
                       "tokenized again as they were")
    return replace(plan.job, render="full")


def _check_slice(job, encoder, manifest: dict, cache, k: int, first: int, stop: int, result: Verified) -> None:
    """Shard k's rows [first, stop) of the cache against its slice tokenized again."""
    described = manifest["shards"][k]["slice"]
    slice_ = Slice(k, tuple(Part(url, kind, start, end) for url, kind, start, end in described), 0)
    columns = manifest["columns"]
    row = first
    for rows, locate in joined(read_slice(slice_, job.columns.names, job.storage_options, job.max_row_bytes,
                                          raw=True, timeout=job.request_timeout)):
        batch = encoder.encode_batch(Rows(rows, job.columns, job.system_prompt))
        for outcome, origin in zip(batch.outcomes, batch.origins, strict=True):
            if row >= stop:
                return
            if isinstance(outcome, BadRow) and job.on_bad_row == "raise":
                result.differences.append((row, locate(origin), f"now a bad row: {outcome}"))
                return
            if not isinstance(outcome, int):
                continue
            encoded = batch.row(outcome)
            held = cache[row]
            result.rows_checked += 1
            for name in columns:
                want = column_values(name, encoded.input_ids, encoded.loss_mask)
                if not np.array_equal(np.asarray(held[name]), want):
                    result.differences.append((row, locate(origin), f"{name} differs from the full render's"))
                    break
            row += 1
    if row < stop:
        result.differences.append((row, f"shard {k}", f"the slice gives {row - first} rows, the cache holds "
                                                      f"{stop - first} there"))
