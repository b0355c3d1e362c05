"""The lengths report (`inspect --lengths`, and the run's summary artifact): read/length_costs' numbers drawn as
histograms and a table of candidate lengths, in the terminal (text) or in the Prefect UI (markdown)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

from sft_tokenize.read.length_costs import RowTokens, length_costs, mixture_costs, report_of
from sft_tokenize.read.mixed_rows import MixedRows
from sft_tokenize.read.packing_index import open_rows


def _truncation(manifest: dict[str, Any]) -> Literal["truncate", "drop"]:
    """The policy the cache was built with (recorded among the fingerprint's inputs; truncate if none)."""
    return (manifest.get("fingerprint_inputs") or {}).get("truncation") or "truncate"


def cache_costs(path: str, at: Iterable[int] = (), pack: bool = True) -> dict[str, Any]:
    """The lengths report of the published cache or mixture index at `path` (its truncation: the build's)."""
    rows = open_rows(path)
    truncation = _truncation(rows.caches[0].manifest)
    if isinstance(rows, MixedRows):
        return mixture_costs([c.table for c in rows.caches], rows.index.sources, rows.index.rows, rows.index.meta,
                             at, truncation, pack)
    if rows.table is None:
        return report_of(RowTokens(*(np.empty(0, dtype=np.int64),) * 2, {}), [], truncation, pack)
    return length_costs(rows.table, at, truncation, pack)


BAR_WIDTH = 40
EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(count: int, largest: int, width: int = BAR_WIDTH) -> str:
    """A bar of `count` against `largest`, in eighths of a character; any count above zero shows."""
    if largest <= 0 or count <= 0:
        return ""
    eighths = max(1, round(8 * width * count / largest))
    return "█" * (eighths // 8) + (EIGHTHS[eighths % 8] if eighths % 8 else "")


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0.0%"


def _range(low: int, high: int) -> str:
    return f"{low:,}" if high == low + 1 else f"{low:,}–{high - 1:,}"


def histogram_lines(bins: list[tuple[int, int, int]]) -> list[str]:
    """One line per bin: its range, a bar, the count."""
    largest = max((c for _, _, c in bins), default=0)
    labels = [_range(low, high) for low, high, _ in bins]
    width = max((len(label) for label in labels), default=0)
    return [f"  {label:>{width}}  {bar(count, largest):<{BAR_WIDTH}}  {count:,}"
            for label, (_, _, count) in zip(labels, bins, strict=True)]


COLUMNS = ("length", "rows truncated", "rows dropped", "tokens lost", "trained tokens lost", "packed bins", "fill")


def candidate_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """The table's cells: per candidate length, what training there loses, and its packing."""
    out = []
    for c in report["candidates"]:
        lost, trained_lost = c["tokens_lost"], c["trained_tokens_lost"]
        out.append((f"{c['length']:,}", f"{c['rows_truncated']:,}", f"{c['rows_dropped']:,}",
                    f"{lost:,} ({_share(lost, report['tokens'])})",
                    f"{trained_lost:,} ({_share(trained_lost, report['trained_tokens'])})",
                    f"{c['pack_bins']:,}" if "pack_bins" in c else "-",
                    f"{100 * c['pack_fill']:.1f}%" if "pack_fill" in c else "-"))
    return out


def text_report(report: dict[str, Any]) -> str:
    """For the terminal: both histograms, then the table of candidate lengths."""
    lines = [f"{report['rows']:,} rows, {report['tokens']:,} tokens, {report['trained_tokens']:,} trained",
             "", "tokens per row:", *histogram_lines(report["lengths_histogram"]),
             "", "trained tokens per row:", *histogram_lines(report["trained_histogram"]),
             "", f"at each length (truncation: {report['truncation']}; packing: the bins of `pack --length`):"]
    table = [COLUMNS, *candidate_rows(report)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines += ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join(lines)


def _markdown_histogram(title: str, bins: list[tuple[int, int, int]]) -> list[str]:
    largest = max((c for _, _, c in bins), default=0)
    lines = [f"**{title}**", "", "| tokens | rows | |", "|---:|---:|:---|"]
    lines += [f"| {_range(low, high)} | {count:,} | `{bar(count, largest) or ' '}` |" for low, high, count in bins]
    return lines + [""]


def markdown_report(report: dict[str, Any]) -> str:
    """For a Prefect artifact: the histograms as bar charts and the table of candidate lengths."""
    lines = [f"{report['rows']:,} rows, {report['tokens']:,} tokens, {report['trained_tokens']:,} trained", ""]
    lines += _markdown_histogram("Tokens per row", report["lengths_histogram"])
    lines += _markdown_histogram("Trained tokens per row", report["trained_histogram"])
    lines += [f"**At each length** (truncation: {report['truncation']}; packing: the bins of `pack --length`)", "",
              "| " + " | ".join(COLUMNS) + " |", "|" + "---:|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in candidate_rows(report)]
    return "\n".join(lines)


def _source_shares(report: dict[str, Any]) -> list[tuple[str, str, str, int, int]]:
    """(source, measure, times, part, whole) for each source's rows, tokens and trained tokens."""
    out = []
    for source in report["sources"]:
        seen = source["times_seen"]
        times = f"{source['epochs']:.2f} epochs, each row {seen['min']}–{seen['max']}×"
        for measure, key in (("rows", "rows"), ("tokens", "tokens"), ("trained", "trained_tokens")):
            out.append((source["name"], measure, times, source[key], report[key]))
    return out


def _per_source_losses(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """Per candidate length, each source's trained tokens lost there."""
    return [(f"{c['length']:,}", *(f"{s['candidates'][k]['trained_tokens_lost']:,} "
                                    f"({_share(s['candidates'][k]['trained_tokens_lost'], s['trained_tokens'])})"
                                    for s in report["sources"]))
            for k, c in enumerate(report["candidates"])]


def mixture_text_report(report: dict[str, Any]) -> str:
    """A mixture's report: the mixed rows as one cache, each source's shares as bars, and what each length
    costs each source."""
    lines = [text_report(report), "", "each source's share of the mixture:"]
    shares = _source_shares(report)
    name_width = max(len(name) for name, *_ in shares)
    for k, (name, measure, times, part, whole) in enumerate(shares):
        label = name if k % 3 == 0 else ""
        share = part / whole if whole else 0.0
        lines.append(f"  {label:<{name_width}}  {measure:<7}  {bar(round(share * 1000), 1000):<{BAR_WIDTH}}  "
                     f"{share:6.1%}  {part:,}" + (f"   {times}" if k % 3 == 0 else ""))
    table = [("length", *(s["name"] for s in report["sources"])), *_per_source_losses(report)]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["", "trained tokens each source loses at each length:"]
    lines += ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join(lines)


def mixture_markdown_report(report: dict[str, Any]) -> str:
    """The same for a Prefect artifact."""
    lines = [markdown_report(report), "", "**Each source's share of the mixture**", "",
             "| source | of | share | | count | epochs, repeats |", "|:---|:---|---:|:---|---:|:---|"]
    for k, (name, measure, times, part, whole) in enumerate(_source_shares(report)):
        share = part / whole if whole else 0.0
        lines.append(f"| {name if k % 3 == 0 else ''} | {measure} | {share:.1%} | `{bar(round(share * 1000), 1000)}` "
                     f"| {part:,} | {times if k % 3 == 0 else ''} |")
    names = [s["name"] for s in report["sources"]]
    lines += ["", "**Trained tokens each source loses at each length**", "",
              "| length | " + " | ".join(names) + " |", "|" + "---:|" * (len(names) + 1)]
    lines += ["| " + " | ".join(row) + " |" for row in _per_source_losses(report)]
    return "\n".join(lines)
