"""The tokenize-recipe flow: every source of a recipe through the tokenize-dataset flow, then the mixture index.

A deployment's parameters are a recipe (build/recipe.py, the same schema as a recipe file) and how its sources
run. Each source is a subflow run of tokenize-dataset, so it keeps everything a single run has: its own
cache, content-addressed slices in the shared store, retries per slice, its summary artifact. A retry of a
failed recipe run (the UI's Retry, or running it again) finds the published sources' caches and the failed
source's finished slices in the store: it tokenizes only the slices that failed, then mixes.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from sft_tokenize.build.recipe import Recipe
from sft_tokenize.flows.artifacts import artifact_key, lengths_markdown
from sft_tokenize.flows.report import markdown_table, mixture_summary
from sft_tokenize.flows.run_options import TokenizeRun
from sft_tokenize.flows.tokenize_dataset import tokenize_dataset
from sft_tokenize.read.mixture_index import mix_caches


@flow(name="tokenize-recipe", description="Tokenize several SFT datasets, each its own way, and mix them by tokens.")
def tokenize_recipe(recipe: Recipe, run: dict[str, Any] | None = None) -> str:
    """Build each source's cache (a tokenize-dataset subflow each), then the mixture index; return its path.

    `run` says how every source runs: TokenizeRun's runner, workers, encode_processes, retries, force,
    keep_versions."""
    logger = get_run_logger()
    recipe.check_sources()
    caches = []
    for options in recipe.runs():
        source_run = TokenizeRun(**options.model_dump(), **(run or {}))
        caches.append(tokenize_dataset.with_options(flow_run_name=f"{options.name}")(source_run))
    index = mix_caches(recipe.mixture_options(caches))
    logger.info("mixture %s: %s rows from %d sources", index.path, f"{len(index):,}", len(caches))
    for warning in index.meta.get("warnings", []):
        logger.warning("mixture %s: %s", index.meta["key"], warning)
    create_markdown_artifact(markdown_table(f"Mixture {index.meta['key']}", mixture_summary(index.meta))
                             + "\n" + lengths_markdown(index.path, len(index)),
                             key=artifact_key("sft-mixture", index.meta["key"]))
    return str(index.path)
