"""tokenize_slice: tokenize one slice into its own Arrow shard and return only its row count.

Re-running is cheap and safe at two levels. On disk (the ground truth), `sft_tokenize.build.shard.tokenize_slice`
reuses the shard store's finished shard of the slice's content key. In Prefect, the result (an int,
persisted as JSON) is cached under that same key, which holds no flow-run id and no cache version, so a
retried, re-run or incremental flow skips the slices already finished. The flow bypasses that cache
(`refresh_cache`) for a slice whose shard is not in the store, so a stale Prefect record can never stand in
for a missing shard.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.tasks import exponential_backoff

from sft_tokenize.build import shard
from sft_tokenize.build.job import Job
from sft_tokenize.build.stopping import Stopped
from sft_tokenize.errors import BadInput, OutOfSpace
from sft_tokenize.sources.records import Slice
from sft_tokenize.tasks import RETRIES

TAG = "sft-tokenize"  # cap parallel slices across runs with `prefect concurrency-limit create sft-tokenize N`
# A bad row fails the same way every time, and a full disk does not empty itself in seconds: retrying those
# only delays the error; an interrupted run wants no retry.
NOT_RETRIED = (BadInput, OutOfSpace, Stopped)


def slice_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """The slice's content key (the bytes it reads and how they are tokenized): the same for every flow run."""
    return parameters["slice_"].key


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Retry any failure but those of NOT_RETRIED."""
    return not isinstance(state.result(raise_on_failure=False), NOT_RETRIED)


# What a slice's task and a group's share: the tag, retries with backoff, a result persisted as JSON.
TASK_SETTINGS: dict[str, Any] = {
    "tags": [TAG], "retries": RETRIES, "retry_delay_seconds": exponential_backoff(backoff_factor=2),
    "retry_jitter_factor": 0.5, "persist_result": True, "result_serializer": "json"}


@task(
    name="tokenize_slice",
    task_run_name="tokenize-{slice_.index:05d}",
    retry_condition_fn=worth_retrying,
    cache_key_fn=slice_cache_key,
    **TASK_SETTINGS,
)
def tokenize_slice(job: Job, slice_: Slice) -> int:
    """Tokenize one slice into `<key>.arrow` in the shard store (reusing a finished one); return its rows."""
    return shard.tokenize_slice(job, slice_)
