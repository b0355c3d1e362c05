"""How a planned cache gets built, whoever runs its slices: the run lock, the check that it is not published
already, the lease on the shards it reuses, the slices tokenized, the cache published.

`run_locally` (one slice after another, in this process) and the tokenize_dataset flow (Prefect tasks on
a runner) differ only in how they tokenize the slices and publish, which they pass in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sft_tokenize.build import shard
from sft_tokenize.build.ahead import tokenized_ahead
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import Plan, plan_slices
from sft_tokenize.build.publish import building, is_published, publish_cache
from sft_tokenize.build.remote_publish import is_published_remote, publish_remote
from sft_tokenize.build.remote_store import remote_leased
from sft_tokenize.build.store import leased

# Tokenize every slice of the plan (those in the set have a shard in the store already); return the timings
# recorded in the manifest, or None.
TokenizeSlices = Callable[["Plan", set[int]], "dict | None"]
Publish = Callable[..., Path]  # publish.publish_cache's signature


@dataclass(frozen=True)
class Built:
    """What a build did."""

    plan: Plan  # the plan built (a rebuild may plan again)
    outcome: Literal["cached", "published meanwhile", "published"]
    reused: int = 0  # slices whose shards were in the store already

    @property
    def cache_path(self) -> Path:
        return self.plan.cache_path


def build_cache(plan: Plan, tokenize_slices: TokenizeSlices, publish: Publish | None = None,
                rebuild: Callable[[Plan], Plan] | None = None) -> Built:
    """Build the plan's cache unless it is published; `rebuild`, if given, is called under the run lock to
    delete the previous output, and returns the plan to build (a published cache is then built again)."""
    if plan.cached and rebuild is None:
        return Built(plan, "cached")
    remote = bool(plan.job.remote_root)
    publish = publish or publish_anywhere
    # One run per fingerprint at a time: a second one waits here, then finds the cache published. On a remote
    # root the lock is this machine's (in its working directory): runs elsewhere share only idempotent writes.
    with building(plan.job):
        if rebuild is not None:
            plan = rebuild(plan)
        if is_published_remote(plan.url, plan.job.storage_options) if remote else \
                is_published(plan.cache_path, plan.job.storage_options, plan.job.image_timeout):
            return Built(plan, "published meanwhile")
        # gc keeps these shards until the cache is published
        with (remote_leased if remote else leased)(plan.job, plan.slices) as stored:
            reused = stored - tokenized_ahead(plan.job, plan.slices)  # this run's own work, done before its flow
            timings = tokenize_slices(plan, reused)
            publish(plan.job, plan.slices, plan.url or plan.cache_path, plan.inputs, plan.name, timings, len(reused))
    return Built(plan, "published", len(reused))


def publish_anywhere(job, slices: list, cache_path, inputs: dict, name: str, timings: dict | None = None,
                     reused: int = 0) -> Path | str:
    """publish_cache for a local root, publish_remote (cache_path a URL) for a remote one."""
    if job.remote_root:
        return publish_remote(job, slices, str(cache_path), inputs, name, timings, reused)
    return publish_cache(job, slices, cache_path, inputs, name, timings, reused)


def run_locally(options: TokenizeOptions) -> Path | str:
    """The whole pipeline in this process, one slice after another: the reference the flow must match."""
    def one_after_another(plan: Plan, reused: set[int]) -> None:
        for slice_ in plan.slices:
            shard.tokenize_slice(plan.job, slice_)  # a reused slice's shard is found, not written

    built = build_cache(plan_slices(options), one_after_another)
    return built.plan.url or built.cache_path
