"""sft-tokenize: SFT datasets tokenized into a memory-mapped Arrow cache, by a Prefect workflow.

The public API, importable from here (each loads only what it needs; reading a cache loads no build code,
no Prefect, no Jinja, no tokenizers):

    from sft_tokenize import tokenize, open_cache
    path = tokenize(["data/*.jsonl"], tokenizer="Qwen/Qwen2.5-0.5B-Instruct", cache_dir="/data/cache")
    cache = open_cache(path)                 # rows memory-mapped, checked against the manifest
    sequences = cache.packed(4096)           # packed sequences over a global packing index

The code follows the pipeline, one subpackage per step (docs/architecture.md is the map):

    sources/   where input comes from: resolving, listing, compressed files, per-format readers, slicing
    chat/      rendering a conversation as its template does, and finding its trained turns
    encoding/  tokenizers prepared once per content, exact fast encoders, the encode pool
    build/     options, recipes, plan, content keys, the shard writer, the shard store, publish
    read/      open_cache, layouts, trainer loaders, the packing index and its sampler, the mixture index
    export/    a published cache in other trainers' formats: Megatron, MDS, litdata (export_cache)
    format/    FORMAT.md, the on-disk format (beside the code that writes and checks it)
    server/    the ad-hoc runs' embedded Prefect server: its process, state, schema, and the resident finder
    flows/     the Prefect flows, their runners and what they report
    tasks/     thin Prefect tasks over the build's plain functions
    cli/       the `sft-tokenize` command line: entry point, arguments, the resident process
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sft_tokenize.version import __version__ as __version__

_API = {
    "tokenize": "sft_tokenize.flows.api",
    "open_cache": "sft_tokenize.read.cache",
    "read_manifest": "sft_tokenize.format.manifest",
    "TokenizedCache": "sft_tokenize.read.cache",
    "PackOptions": "sft_tokenize.read.packing_index",
    "pack_cache": "sft_tokenize.read.packing_index",
    "packed_sequences": "sft_tokenize.read.packed_sequences",
    "PackedSequences": "sft_tokenize.read.packed_sequences",
    "PackedSampler": "sft_tokenize.read.packed_sequences",
    "open_mixture": "sft_tokenize.read.mixed_rows",
    "mixture_dataset": "sft_tokenize.read.trainers",
    "mix_caches": "sft_tokenize.read.mixture_index",
    "MixtureOptions": "sft_tokenize.read.mixture_options",
    "MixtureSource": "sft_tokenize.read.mixture_options",
    "for_trl": "sft_tokenize.read.trainers",
    "for_axolotl": "sft_tokenize.read.trainers",
    "work_view": "sft_tokenize.read.trainers",
    "materialize": "sft_tokenize.read.remote_cache",
    "export_cache": "sft_tokenize.export",
    "ImageCollator": "sft_tokenize.read.image_collator",
    "verify_cache": "sft_tokenize.build.verify",
    "BadInput": "sft_tokenize.errors",
    "CacheError": "sft_tokenize.errors",
}
__all__ = ["BadInput", "CacheError", "ImageCollator", "MixtureOptions", "MixtureSource", "PackOptions", "PackedSampler",
           "PackedSequences", "TokenizedCache", "export_cache", "for_axolotl", "for_trl", "materialize", "mix_caches",
           "mixture_dataset", "open_cache", "open_mixture", "pack_cache", "packed_sequences", "read_manifest",
           "tokenize", "verify_cache", "work_view"]

if TYPE_CHECKING:
    from sft_tokenize.build.verify import verify_cache
    from sft_tokenize.errors import BadInput, CacheError
    from sft_tokenize.export import export_cache
    from sft_tokenize.flows.api import tokenize
    from sft_tokenize.format.manifest import read_manifest
    from sft_tokenize.read.cache import TokenizedCache, open_cache
    from sft_tokenize.read.image_collator import ImageCollator
    from sft_tokenize.read.mixed_rows import open_mixture
    from sft_tokenize.read.mixture_index import mix_caches
    from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSource
    from sft_tokenize.read.packed_sequences import PackedSampler, PackedSequences, packed_sequences
    from sft_tokenize.read.packing_index import PackOptions, pack_cache
    from sft_tokenize.read.remote_cache import materialize
    from sft_tokenize.read.trainers import for_axolotl, for_trl, mixture_dataset, work_view


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'sft_tokenize' has no attribute {name!r}")
