"""pack_cache: build (or find) the global packing index of a published cache."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from sft_tokenize.read import packing_index as packing


# Never cached: the index on disk is the record; a valid one is reused without building.
@task(name="pack_cache", task_run_name="pack-{options.key}", cache_policy=NO_CACHE)
def pack_cache(cache_path: Path, options: packing.PackOptions) -> Path:
    """The path of the cache's packing index for `options`, built and published if it is missing."""
    return packing.pack_cache(cache_path, options).path
