"""plan_slices: resolve and check the inputs, fingerprint the run, cut byte-balanced slices."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from sft_tokenize.build import plan
from sft_tokenize.build.options import TokenizeOptions


# Never cached: a plan must look at the disk as it is now (edited inputs, a cache published meanwhile).
@task(name="plan_slices", task_run_name="plan-slices", cache_policy=NO_CACHE)
def plan_slices(options: TokenizeOptions, min_slices: int = 1) -> plan.Plan:
    """The slices to tokenize (at least `min_slices`), or `plan.cached` when a cache with this fingerprint
    is already published."""
    return plan.plan_slices(options, min_slices)
