"""Mixture index benchmark: time and memory to choose and order 1M rows of three sources.

    python benchmarks/mixture.py CACHE [--rows 1000000] [--out DIR]

CACHE is any published cache (e.g. the benchmark corpus's, as packing.py builds it). Three sources of
--rows rows in all (50 %, 30 %, 20 % of them) draw their rows' tokens and trained tokens with replacement from
CACHE's own (numpy default_rng(0)); the project's functions then choose each source's rows for token weights
0.5 / 0.3 / 0.2 of a budget of twice the trained tokens (so every source repeats) and order them, as
mix_caches does after reading the caches' lengths. Reported: seconds and peak traced memory (tracemalloc) of
that step, the achieved shares, and the worst share error over every 1 % prefix.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import git_state  # noqa: E402

from sft_tokenize.read.cache import open_cache  # noqa: E402
from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSource  # noqa: E402
from sft_tokenize.read.mixture_selection import SourceRows, choose_rows, interleave, trained_lengths  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    cache = open_cache(args.cache)
    tokens, trained = cache.lengths.astype(np.int64), trained_lengths(cache)
    rng = np.random.default_rng(0)
    weights = (0.5, 0.3, 0.2)
    sizes = [int(args.rows * w) for w in weights]
    budget = 2 * sum(int(trained[rng.integers(0, len(cache), n)].sum()) for n in sizes)
    options = MixtureOptions(sources=[MixtureSource(cache=f"source-{i}", name=f"source-{i}", weight=w)
                                      for i, w in enumerate(weights)], budget=budget)
    sources = []
    for spec, n in zip(options.sources, sizes, strict=True):
        picked = rng.integers(0, len(cache), n)
        source = SourceRows(spec, cache, trained[picked])
        source.tokens = tokens[picked]  # the sampled rows' own input tokens, in place of the cache's
        sources.append(source)

    tracemalloc.start()
    started = time.perf_counter()
    chosen = choose_rows(sources, options)
    source_ids, rows = interleave(sources, chosen, options)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()

    units = np.empty(len(rows), dtype=np.int64)
    for i, source in enumerate(sources):
        mine = source_ids == i
        units[mine] = source.units[rows[mine]]
    running = np.stack([np.cumsum(np.where(source_ids == i, units, 0)) for i in range(3)])
    worst = 0.0
    for percent in range(1, 101):
        k = len(rows) * percent // 100 - 1
        worst = max(worst, float(np.abs(running[:, k] / running[:, k].sum() - weights).max()))
    result = {"git": git_state(Path(__file__).resolve().parents[1]),
              "source_rows": sizes, "index_rows": int(len(rows)), "budget_trained_tokens": budget,
              "seconds": round(seconds, 3), "peak_traced_mib": round(peak / 2**20, 1),
              "bytes_per_index_row": round(peak / len(rows), 1),
              "shares": [round(float(running[i, -1] / running[:, -1].sum()), 6) for i in range(3)],
              "worst_1pct_prefix_share_error": round(worst, 6)}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "mixture.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
