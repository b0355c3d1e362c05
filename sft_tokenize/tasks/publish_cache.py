"""publish_cache: turn the finished shards into the published cache, in one atomic rename."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from sft_tokenize.build import protocol
from sft_tokenize.build.job import Job
from sft_tokenize.sources.records import Slice


# Never cached: publishing checks every shard on disk and must see the state it leaves behind.
@task(name="publish_cache", task_run_name="publish-cache", cache_policy=NO_CACHE)
def publish_cache(job: Job, slices: list[Slice], cache_path: Path | str, inputs: dict, name: str,
                  timings: dict | None = None, reused: int = 0) -> Path | str:
    """Check every shard and publish them as the cache at `cache_path` (a URL on a remote root); returns it."""
    return protocol.publish_anywhere(job, slices, cache_path, inputs, name, timings, reused)
