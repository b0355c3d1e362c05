"""What a published cache holds, as rows of (label, value): the flow's summary artifact and `inspect`; and
what a failed slice read, for the failure artifact."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sft_tokenize.build.publish import describe_drops
from sft_tokenize.files import human_size

if TYPE_CHECKING:
    from sft_tokenize.sources.records import Slice


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
        ("layout", f"{manifest.get('layout', 'skyrl')} ({', '.join(manifest['columns'])})"),
        ("rows", _count(manifest["rows"])),
        ("tokens", _count(manifest["tokens"])),
        ("trained tokens", _count(trained) + share),
        ("dropped rows", describe_drops(manifest["dropped"])),
        *mask_rows(manifest),
        ("lengths", describe_lengths(manifest["lengths"])),
        *image_rows(manifest),
        ("data files", f"{len(manifest['files'])} ({_count(sum(f['bytes'] for f in manifest['files']))} bytes)"),
    ]
    timings = manifest.get("timings") or {}
    if timings.get("tokenize_seconds"):
        seconds = timings["tokenize_seconds"]
        tokenized = timings.get("tokens_tokenized", manifest["tokens"])
        workers = f"{timings.get('workers', '?')} {timings.get('runner', 'workers')}"
        if timings.get("encode_processes"):
            workers += f", {timings['encode_processes']} encode processes"
        rows.append(("throughput", f"{tokenized / seconds:,.0f} tokens/s ({_count(tokenized)} tokens in "
                                   f"{seconds:.1f} s on {workers})"))
    build = manifest.get("build")
    if build:
        rows.append(("slices", f"{len(manifest['shards'])}: {build['slices_tokenized']} tokenized, "
                               f"{build['slices_reused']} reused from the shard store"))
    return rows


def image_rows(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """An image cache's images: how many, their vision tokens, their bytes and how they are kept."""
    images = manifest.get("images")
    if not images:
        return []
    kept = "embedded" if images["mode"] == "embed" else "referenced"
    return [("images", f"{_count(images['images'])} ({images['family']}), {_count(images['image_tokens'])} "
                       f"vision tokens, {_count(images['image_bytes'])} bytes {kept}"
                       + (f", {_count(images['pixel_bytes'])} bytes of pixel_values" if "pixel_bytes" in images
                          else ""))]


def mask_rows(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """How the masks came out: rows trained on every token (almost always a broken chat template), extra
    rows from --reasoning-turns expand, control-token text encoded as plain text."""
    masks = manifest.get("masks") or {}
    rows = []
    if masks.get("rows_all_trained"):
        rows.append(("rows trained whole", f"{_count(masks['rows_all_trained'])} rows have every token trained: "
                                           "check the chat template (sft-tokenize inspect CACHE --sample 3)"))
    if masks.get("rows_expanded"):
        rows.append(("expanded rows", f"{_count(masks['rows_expanded'])} rows added by --reasoning-turns expand"))
    if masks.get("rows_special_text"):
        rows.append(("control-token text", f"{_count(masks['rows_special_text'])} rows held a control token's text "
                                           "in a message, encoded as plain text"))
    fills = (manifest.get("build") or {}).get("skeletons") or {}
    if fills.get("rows_filled"):
        rows.append(("skeleton fills", f"{_count(fills['rows_filled'])} rows filled from a learned render, "
                                       f"{_count(fills.get('rows_checked', 0))} of them checked against a full one"))
    if fills.get("skeleton_mismatches"):
        rows.append(("skeleton mismatches", f"{_count(fills['skeleton_mismatches'])} fills differed from their full "
                                            "render: their slices were rendered in full, and nothing of them was "
                                            "published (report the template); sft-tokenize verify CACHE --all "
                                            "re-checks the cache"))
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
        elif key == "train_on":  # a message's own weight (OpenAI's fine-tuning format) wins for that message
            rows.append(("train on", f"{_describe_input(value)} (a message's \"weight\" of 0 or 1 overrides it)"))
        else:
            rows.append((key.replace("_", " "), _describe_input(value)))
    return rows


def show_row(tokenizer, input_ids: np.ndarray, loss_mask: np.ndarray, colour: bool,
             image_sizes: list | None = None, image_token_ids: list[int] | None = None) -> str:
    """A row's text with its trained tokens highlighted: black on green on a terminal, in [[…]] otherwise. With
    `image_token_ids` (the manifest's `images` record: margin, run token, margin) each image's run of vision
    tokens, margins included, is one item: `<image 1024×768 → 999 tokens>`, its size from `image_sizes`."""
    pieces, start = [], 0
    for n, (begin, end, run) in enumerate(_image_runs(input_ids, image_token_ids)):
        pieces.append(_show_text(tokenizer, input_ids[start:begin], loss_mask[start:begin], colour))
        height, width = image_sizes[n] if image_sizes is not None and n < len(image_sizes) else ("?", "?")
        pieces.append(f"<image {width}×{height} → {run:,} tokens>")
        start = end
    pieces.append(_show_text(tokenizer, input_ids[start:], loss_mask[start:], colour))
    return "".join(pieces)


def _image_runs(input_ids: np.ndarray, image_token_ids: list[int] | None) -> list[tuple[int, int, int]]:
    """(begin, end, run length) of each maximal run of the run token, widened over a margin token on each side."""
    if not image_token_ids:
        return []
    first, token, last = image_token_ids
    is_run = np.concatenate([[False], input_ids == token, [False]])
    edges = np.flatnonzero(np.diff(is_run.astype(np.int8)))
    spans = []
    for begin, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        run = end - begin
        begin -= int(begin > 0 and input_ids[begin - 1] == first)
        end += int(end < len(input_ids) and input_ids[end] == last)
        spans.append((begin, end, run))
    return spans


def _show_text(tokenizer, input_ids: np.ndarray, loss_mask: np.ndarray, colour: bool) -> str:
    cuts = np.flatnonzero(np.diff(loss_mask)) + 1
    pieces = []
    for ids, mask in zip(np.split(input_ids, cuts), np.split(loss_mask, cuts), strict=True):
        if not len(ids):
            continue
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if mask[0]:
            text = f"\x1b[30;42m{text}\x1b[0m" if colour else f"[[{text}]]"
        pieces.append(text)
    return "".join(pieces)


def _cell(value: str, code: bool) -> str:
    if code:  # a path or an error message, shown as written: no markdown read into its `*`, `_` or `<...>`
        return "`" + value.replace("`", "'").replace("|", "\\|") + "`"
    return value.replace("|", "/")


def markdown_table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...] = ("field", "value"),
                   code: bool = False) -> str:
    """A titled markdown table, its columns named by `header`; `code`: every cell but the first as code."""
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([first, *(_cell(v, code) for v in rest)]) + " |" for first, *rest in rows]
    return "\n".join(lines) + "\n"


def describe_slice(slice_: Slice) -> str:
    """What a slice reads: each part's file and, where it has one, its range (first to last, counted from 0)."""
    from sft_tokenize.sources.formats.table import FORMATS

    parts = []
    for part in slice_.parts:
        one, many = FORMATS[part.kind].unit or ("", "")
        if not one or part.stop < 0:  # a whole file: JSON, CSV, a compressed file
            parts.append(part.url)
        elif part.stop - part.start == 1:
            parts.append(f"{part.url} ({one} {part.start:,})")
        else:
            parts.append(f"{part.url} ({many} {part.start:,}-{part.stop - 1:,})")
    return ", ".join(parts)


def text_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def packing_summary(meta: dict[str, Any], build: dict[str, Any], index_path: str | Path) -> list[tuple[str, str]]:
    """What a packing index holds, from its index.json and build.json: `pack`, `inspect` and the artifact."""
    ranks, bins = meta["data_parallel"], meta["bins"]
    long_rows = meta["long_rows"]
    rows = [
        ("packing index", str(index_path)),
        ("packed for", f"N = {meta['length']:,} tokens, {ranks} data-parallel rank{'s' * (ranks > 1)}, "
                       f"{meta['algorithm']}"),
        ("bins", f"{_count(bins)} ({_count(meta['steps'])} steps of {ranks}); lower bound "
                 f"{_count(meta['lower_bound_bins'])}"),
        ("efficiency", f"{meta['efficiency']:.2%} of bins × N are tokens ({_count(meta['tokens'])} tokens)"),
        ("rows per bin", describe_lengths(meta["rows_per_bin"])),
        ("tokens per bin", describe_lengths(meta["tokens_per_bin"])),
        ("long rows", f"{_count(long_rows['rows'])} truncated to N ({_count(long_rows['tokens_cut'])} tokens cut)"
                      if long_rows["rows"] else "none"),
    ]
    if ranks > 1:
        balance = meta["balance"]
        rows.append(("rank balance", f"worst step {balance['step_spread_max']:.2%} between ranks (mean "
                                     f"{balance['step_spread_mean']:.3%}, {balance['steps_over_1pct']} steps over "
                                     f"1 %); whole epoch {balance['rank_spread']:.3%}"))
    rows.append(("build time", f"{build['seconds']:.2f} s"))
    return rows


def mixture_summary(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary artifact's rows: the mixture, then per source what was asked and what was achieved."""
    rows = [("index", meta["key"]), ("unit", meta["unit"]), ("budget", f"{meta['budget']:,}" if meta["budget"]
                                                                         else "none"), ("rows", f"{meta['rows']:,}")]
    for source in meta["sources"]:
        (kind, amount), = source["asked"].items()
        asked = f"asked {kind} {amount}"
        if "caps" in source:
            caps = {k: v for k, v in source["caps"].items() if k in ("max_epochs", "max_share")}
            bound = source["caps"]["capped_by"]
            asked += (f" ({', '.join(f'{k} {v:g}' for k, v in caps.items())}: "
                      + (f"capped by {bound}, planned share {source['caps']['planned_share']:.1%})" if bound
                         else "not reached)"))
        rows.append((source["name"], f"{asked}; achieved {source['rows']:,} rows, "
                                     f"{source['tokens']:,} tokens, {source['trained_tokens']:,} trained, share "
                                     f"{source['share']:.1%}, {source['epochs']:.2f} epochs"))
    rows += [("warning", warning) for warning in meta.get("warnings", [])]
    return rows


def plan_summary(cache_path: str | Path, found: dict[str, Any] | None, workers: int) -> list[tuple[str, str]]:
    """`run --plan-only`'s table: the cache, or what a run would tokenize and the estimate (build/dry_run.py)."""
    if found is None:
        return [("cache", f"{cache_path}: published, nothing to tokenize")]
    stored, sample = found["stored_slices"], found["sample"]
    seconds = found["estimated_seconds"]
    return [
        ("cache", f"{cache_path}: not published"),
        ("slices", f"{found['slices']:,} ({human_size(found['input_bytes'])} of input)"),
        ("stored", f"{len(stored):,} slices' shards are in the store and would be reused"
                   + (f" ({', '.join(map(str, stored[:10]))}{', …' if len(stored) > 10 else ''})" if stored else "")),
        ("estimate", f"about {found['estimated_rows']:,} rows, {found['estimated_tokens']:,} tokens, "
                     f"{found['estimated_trained_tokens']:,} trained"),
        *([("spread", f"{spread[0]:,} to {spread[1]:,} tokens, by the tokens per byte of each sampled chunk "
                      "alone" + ("; far apart: the input changes along its length, take the estimate as rough"
                                 if spread[1] > 2 * max(spread[0], 1) else ""))]
          if (spread := found.get("estimated_tokens_spread")) else []),
        ("time", f"about {seconds:,.1f} s of tokenizing on {workers} workers (at the sample's speed on one "
                 "thread; the fixed cost of a run comes on top)" if seconds is not None else "unknown"),
        ("sample", f"{sample['rows']:,} rows ({human_size(sample['bytes'])}) from slices "
                   f"{', '.join(map(str, sample['slices']))}, tokenized in {sample['seconds']:.2f} s"),
    ]
