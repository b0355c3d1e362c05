"""What a published cache holds, as rows of (label, value): the flow's summary artifact and `inspect`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sft_cache.publish import describe_drops


def _count(n: int) -> str:
    return f"{n:,}"


def describe_lengths(lengths: dict[str, float]) -> str:
    return " · ".join(f"{key} {value:,}" for key, value in lengths.items()) or "no rows"


def summary(manifest: dict[str, Any], cache_path: str | Path) -> list[tuple[str, str]]:
    """Rows, tokens, drops by reason, length percentiles and throughput of a cache, from its manifest."""
    trained = manifest["trained_tokens"]
    share = f" ({trained / manifest['tokens']:.1%} of tokens)" if manifest["tokens"] else ""
    rows = [
        ("cache", str(cache_path)),
        ("rows", _count(manifest["rows"])),
        ("tokens", _count(manifest["tokens"])),
        ("trained tokens", _count(trained) + share),
        ("dropped rows", describe_drops(manifest["dropped"])),
        ("lengths", describe_lengths(manifest["lengths"])),
        ("data files", f"{len(manifest['files'])} ({_count(sum(f['bytes'] for f in manifest['files']))} bytes)"),
    ]
    timings = manifest.get("timings") or {}
    if timings.get("tokenize_seconds"):
        seconds = timings["tokenize_seconds"]
        tokenized = timings.get("tokens_tokenized", manifest["tokens"])
        workers = f"{timings.get('workers', '?')} {timings.get('runner', 'workers')}"
        rows.append(("throughput", f"{tokenized / seconds:,.0f} tokens/s ({_count(tokenized)} tokens in "
                                   f"{seconds:.1f} s on {workers})"))
    build = manifest.get("build")
    if build:
        rows.append(("slices", f"{len(manifest['shards'])}: {build['slices_tokenized']} tokenized, "
                               f"{build['slices_reused']} reused from the shard store"))
    return rows


def _short(value: Any) -> str:
    """A sha256 digest shortened to 12 hex digits: enough to tell two apart at a glance."""
    text = str(value)
    return text[:12] if re.fullmatch(r"[0-9a-f]{64}", text) else text


def _describe_input(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key}={_short(item)}" for key, item in value.items()) or "none"
    if isinstance(value, list):
        return ", ".join(map(_short, value)) or "none"
    return "none" if value is None else _short(value)


def fingerprint_inputs(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """What the fingerprint hashes, as recorded in the manifest: a change to any of these makes a new cache."""
    rows = [("fingerprint", manifest["fingerprint"]), ("name", manifest["name"])]
    for key, value in manifest["fingerprint_inputs"].items():
        if key == "sources":
            rows += [("source", f"{url} ({kind}, {', '.join(map(str, identity))})") for url, kind, *identity in value]
        else:
            rows.append((key.replace("_", " "), _describe_input(value)))
    return rows


def markdown_table(title: str, rows: list[tuple[str, str]]) -> str:
    lines = [f"### {title}", "", "| | |", "|---|---|"]
    lines += [f"| {label} | {value.replace('|', '/')} |" for label, value in rows]
    return "\n".join(lines) + "\n"


def text_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
