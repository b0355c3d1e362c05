"""tokenize_slice: tokenize one slice into its own Arrow shard and return only its row count.

Re-running is cheap and safe at two levels. On disk (the ground truth), `sft_tokenize.build.shard.tokenize_slice`
reuses the shard store's finished shard of the slice's content key. In Prefect, the result (an int,
persisted as JSON) is cached under that same key, which holds no flow-run id and no cache version, so a
retried, re-run or incremental flow skips the slices already finished. The flow bypasses that cache
(`refresh_cache`) for a slice whose shard is not in the store, so a stale Prefect record can never stand in
for a missing shard.

Fault injection, for tests only: when the environment variable SFT_TOKENIZE_FAULT_FILE names a file
that exists, every attempt at a slice whose index is listed in it (whitespace-separated integers) raises
a RuntimeError before touching the data. Delete the file and the next attempt succeeds. A word `exit:N`
instead kills the worker process (`os._exit(1)`, no exception, no cleanup) on the first attempt at slice
N only, leaving a partial temporary shard as a worker dying mid-shard does; the marker file
`<fault file>.exited-N`, created atomically, makes it once across processes and machines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import task
from prefect.tasks import exponential_backoff

from sft_tokenize.build import shard
from sft_tokenize.build.shard import Job
from sft_tokenize.build.stopping import Stopped
from sft_tokenize.errors import BadInput, OutOfSpace
from sft_tokenize.sources.resolve import Slice

TAG = "sft-tokenize"  # cap parallel slices across runs with `prefect concurrency-limit create sft-tokenize N`
RETRIES = 2
FAULT_FILE_ENV = "SFT_TOKENIZE_FAULT_FILE"


def slice_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """The slice's content key (the bytes it reads and how they are tokenized): the same for every flow run."""
    return parameters["slice_"].key


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """A bad row fails the same way every time, and a full disk does not empty itself in seconds:
    retrying those only delays the error; an interrupted run wants no retry."""
    return not isinstance(state.result(raise_on_failure=False), (BadInput, OutOfSpace, Stopped))


def raise_injected_fault(job: Job, slice_: Slice) -> None:
    index = slice_.index
    fault_file = os.environ.get(FAULT_FILE_ENV)
    if not fault_file:
        return
    try:
        words = Path(fault_file).read_text().split()
    except FileNotFoundError:
        return
    if f"exit:{index}" in words:
        try:
            os.close(os.open(f"{fault_file}.exited-{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # this slice's worker already died once
        shard_file = job.shard_path(slice_)
        shard_file.parent.mkdir(parents=True, exist_ok=True)
        shard_file.with_name(f"{shard_file.name}.tmp-{os.getpid()}").write_bytes(b"partial shard")
        os._exit(1)
    if str(index) in words:
        raise RuntimeError(f"injected fault in slice {index} ({FAULT_FILE_ENV}={fault_file})")


@task(
    name="tokenize_slice",
    task_run_name="tokenize-{slice_.index:05d}",
    tags=[TAG],
    retries=RETRIES,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=worth_retrying,
    cache_key_fn=slice_cache_key,
    persist_result=True,
    result_serializer="json",
)
def tokenize_slice(job: Job, slice_: Slice) -> int:
    """Tokenize one slice into `<key>.arrow` in the shard store (reusing a finished one); return its rows."""
    raise_injected_fault(job, slice_)
    return shard.tokenize_slice(job, slice_)
