"""The Prefect artifacts a run leaves: its cache's summary and its packing index's, under stable keys."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from sft_tokenize.flows.length_report import cache_costs, markdown_report, mixture_markdown_report
from sft_tokenize.flows.report import markdown_table, packing_summary, summary
from sft_tokenize.format.layout import INDEX_BUILD, PACKING_INDEX
from sft_tokenize.read.cache import read_manifest

# Above this many rows the summary's lengths table leaves out the packing columns (a packing per candidate
# length: about 0.2 s each per million rows); `sft-tokenize inspect --lengths` always has them.
PACK_IN_SUMMARY_ROWS = 1_000_000


def lengths_markdown(path: Path, rows: int) -> str:
    """The lengths report of a cache or a mixture index, for its summary artifact."""
    costs = cache_costs(str(path), pack=rows <= PACK_IN_SUMMARY_ROWS)
    return "### Lengths\n\n" + (mixture_markdown_report(costs) if "sources" in costs else markdown_report(costs))


def artifact_key(prefix: str, name: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) for `name`."""
    return f"{prefix}-" + "".join(c if c.isascii() and c.isalnum() else "-" for c in name.lower())


def report(cache_path: Path) -> None:
    manifest = read_manifest(cache_path)
    whole = (manifest.get("masks") or {}).get("rows_all_trained", 0)
    if whole:
        get_run_logger().warning("%d of %d rows have every token trained, which is almost always a broken chat "
                                 "template: look at a few with `sft-tokenize inspect %s --sample 3`", whole,
                                 manifest["rows"], cache_path)
    create_markdown_artifact(markdown_table(f"Tokenized cache {manifest['name']}", summary(manifest, cache_path))
                             + "\n" + lengths_markdown(cache_path, manifest["rows"]),
                             key=artifact_key("sft-cache", manifest["name"]),
                             description=f"{manifest['rows']:,} rows, {manifest['tokens']:,} tokens")


def report_packing(index_path: Path) -> None:
    meta, build = (json.loads((index_path / name).read_text()) for name in (PACKING_INDEX, INDEX_BUILD))
    create_markdown_artifact(markdown_table(f"Packing index {meta['key']}", packing_summary(meta, build, index_path)),
                             key=f"{artifact_key('sft-pack', index_path.parent.name)}-{meta['key']}",
                             description=f"{meta['bins']:,} bins, {meta['efficiency']:.2%} efficient")
