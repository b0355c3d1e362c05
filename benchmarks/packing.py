"""Packing benchmark: the global index against TRL's per-batch BFD and the lower bounds; build time at 1M rows.

    python benchmarks/packing.py                       # the benchmark corpus at 1x (11,000 conversations)
    python benchmarks/packing.py --scale 0.1 --rows 100000 --out /tmp/packing   # a quick dry run

1. Inputs: the corpus and tokenizer of build_inputs.py (built or found under benchmarks/data/), tokenized once
   with the project's plain pipeline into --work (a cache reused on the next run).
2. For N = 4096 and 8192, on the cache's row lengths:
   - this project's index (bfd and ffd, R = 1; bfd at R = 8 for the rank balance), built with pack_cache;
   - TRL's `pack_dataset(dataset, N, strategy="bfd")` as SFTTrainer calls it: `Dataset.map(batched=True)` with
     its default 1,000-row batches (`keep_in_memory=True`, so nothing is written beside the cache);
   - lower bounds on any packing: ceil(tokens / N) bins, and Martello and Toth's L2 bound (which also counts
     the rows longer than N/2, one bin each).
   Efficiency is tokens / (bins × N), with rows longer than N truncated to N in every case (TRL's policy too).
3. Build time and memory at --rows rows: lengths drawn with replacement from the corpus's own lengths
   (numpy default_rng(seed)), planned and written with the project's functions; peak traced memory.
Results go to --out as packing.json and packing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from build_inputs import CorpusSpec, add_tokenizer_argument, build, tokenizer_for  # noqa: E402
from measure import git_state  # noqa: E402

from sft_tokenize.build.options import TokenizeOptions  # noqa: E402
from sft_tokenize.build.protocol import run_locally  # noqa: E402
from sft_tokenize.read.cache import open_cache  # noqa: E402
from sft_tokenize.read.packing_index import PackOptions, lower_bound_bins, pack_cache, plan  # noqa: E402

LENGTHS = (4096, 8192)
REPEATS = 3


def corpus_cache(scale: float, units: int, work: Path, tokenizer_name: str = "bench") -> Path:
    spec = CorpusSpec(scale=scale)
    _, files = build(spec, units, tokenizer=tokenizer_name == "bench")
    tokenizer = tokenizer_for(tokenizer_name, spec)
    return run_locally(TokenizeOptions(sources=[str(f) for f in files], tokenizer=str(tokenizer),
                                       cache_dir=str(work / "packing-cache"), name="bench"))


def trl_bins(cache_path: Path, length: int) -> dict:
    import datasets
    import pyarrow.compute as pc
    from trl import pack_dataset

    dataset = datasets.load_from_disk(str(cache_path)).select_columns(["input_ids"])
    started = time.perf_counter()
    packed = pack_dataset(dataset, length, strategy="bfd", map_kwargs={"keep_in_memory": True})
    seconds = time.perf_counter() - started
    tokens = int(pc.sum(pc.list_value_length(packed.data.column("input_ids"))).as_py())
    return {"bins": len(packed), "tokens": tokens, "efficiency": tokens / (len(packed) * length),
            "seconds": round(seconds, 3)}


def corpus_rows(cache_path: Path, index_dir: Path) -> list[dict]:
    cache = open_cache(cache_path)
    lengths = cache.lengths.astype(np.int64)
    results = []
    for length in LENGTHS:
        effective = np.minimum(lengths, length)
        tokens = int(effective.sum())
        row = {"length": length, "rows": len(lengths), "tokens": tokens,
               "rows_longer_than_n": int((lengths > length).sum()),
               "bound_tokens": -(-tokens // length), "lower_bound": lower_bound_bins(effective, length)}
        for algorithm, ranks in (("bfd", 1), ("ffd", 1), ("bfd", 8)):
            index = pack_cache(cache, PackOptions(length=length, data_parallel=ranks, algorithm=algorithm,
                                                  index_dir=str(index_dir)))
            meta = index.meta
            row[f"{algorithm}_r{ranks}"] = {"bins": meta["bins"], "efficiency": meta["efficiency"],
                                            "seconds": index.build["seconds"], "balance": meta["balance"],
                                            "rows_per_bin": meta["rows_per_bin"]}
        row["trl"] = trl_bins(cache_path, length)
        results.append(row)
        print(f"N={length}: bfd {row['bfd_r1']['bins']} bins ({row['bfd_r1']['efficiency']:.2%}), "
              f"TRL {row['trl']['bins']} ({row['trl']['efficiency']:.2%}), bounds {row['bound_tokens']} / "
              f"{row['lower_bound']}", flush=True)
    return results


def build_time(lengths: np.ndarray, rows: int, seed: int) -> list[dict]:
    sample = np.random.default_rng(seed).choice(lengths.astype(np.int64), rows)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for length in LENGTHS:
            for algorithm, ranks in (("bfd", 1), ("ffd", 1), ("bfd", 8)):
                options = PackOptions(length=length, data_parallel=ranks, algorithm=algorithm)

                def build_and_write(options=options):
                    order, bins, stats = plan(sample, options)
                    np.save(os.path.join(scratch, "rows.npy"), order)
                    np.save(os.path.join(scratch, "bins.npy"), bins)
                    return stats

                seconds = float("inf")
                for _ in range(REPEATS):  # the best of a few: the machine is shared
                    started = time.perf_counter()
                    stats = build_and_write()
                    seconds = min(seconds, time.perf_counter() - started)
                tracemalloc.start()  # a second run, traced: tracing slows allocation down
                build_and_write()
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                results.append({"rows": rows, "length": length, "algorithm": algorithm, "ranks": ranks,
                                "seconds": round(seconds, 3), "peak_mib": round(peak / 2**20, 1),
                                "bytes_per_row": round(peak / rows, 1), "efficiency": stats["efficiency"],
                                "bins": stats["bins"],
                                "balance": stats["balance"]})
                print(f"{rows:,} rows, N={length}, {algorithm}, R={ranks}: {seconds:.2f} s, "
                      f"peak {peak / 2**20:.0f} MiB", flush=True)
    return results


def markdown(corpus: list[dict], timing: list[dict], args: argparse.Namespace) -> str:
    lines = ["# Packing benchmark", "",
             f"Corpus: the benchmark corpus at scale {args.scale}, {args.units} unit(s): {corpus[0]['rows']:,} "
             f"conversations. Command: `python benchmarks/packing.py --scale {args.scale} --units {args.units} "
             f"--rows {args.rows}`.", "",
             "| N | rows > N | bound ceil(tokens/N) | bound L2 | this index, bfd | ffd | "
             "TRL pack_dataset (bfd, 1,000-row batches) | bfd over ceil bound | bfd over L2 |",
             "|---:|---:|---:|---:|---|---|---|---:|---:|"]
    for row in corpus:
        bfd, ffd, trl = row["bfd_r1"], row["ffd_r1"], row["trl"]
        lines.append(
            f"| {row['length']} | {row['rows_longer_than_n']} | {row['bound_tokens']:,} | {row['lower_bound']:,} | "
            f"{bfd['bins']:,} bins, {bfd['efficiency']:.2%} | {ffd['bins']:,} bins, {ffd['efficiency']:.2%} | "
            f"{trl['bins']:,} bins, {trl['efficiency']:.2%} | +{bfd['bins'] / row['bound_tokens'] - 1:.2%} | "
            f"+{bfd['bins'] / row['lower_bound'] - 1:.2%} |")
    lines += ["", "Data-parallel R = 8 (bfd): tokens per rank per step, (most − fewest) / most.", "",
              "| N | bins | efficiency | worst step | mean step | steps over 1 % | whole epoch per rank |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in corpus:
        r8 = row["bfd_r8"]
        b = r8["balance"]
        lines.append(f"| {row['length']} | {r8['bins']:,} | {r8['efficiency']:.2%} | {b['step_spread_max']:.2%} | "
                     f"{b['step_spread_mean']:.3%} | {b['steps_over_1pct']} of {r8['bins'] // 8} | "
                     f"{b['rank_spread']:.3%} |")
    lines += ["", f"Build time at {args.rows:,} rows (lengths drawn from the corpus's, seed {args.seed}; plan and "
              "write the two arrays; the best of 3 runs; peak memory traced by tracemalloc in another run):", "",
              "| N | algorithm | R | seconds | peak MiB | bytes per row | efficiency | worst step | steps over 1 % |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in timing:
        steps = f"{t['balance']['steps_over_1pct']} of {t['bins'] // t['ranks']:,}" if t["ranks"] > 1 else ""
        lines.append(f"| {t['length']} | {t['algorithm']} | {t['ranks']} | {t['seconds']:.2f} | {t['peak_mib']} | "
                     f"{t['bytes_per_row']} | {t['efficiency']:.2%} | {t['balance']['step_spread_max']:.2%} | "
                     f"{steps} |")
    lines += ["", "The drawn lengths repeat the corpus's 11,000 values about 90 times each. With R = 8, most bins at "
              "N = 4096 hold one row longer than N/2, so a step whose 8 bins straddle two such values cannot be "
              "evened out; the last step also holds the bins split to give every rank as many."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="corpus scale (1 = 11,000 conversations a unit)")
    parser.add_argument("--units", type=int, default=1, help="corpus units to tokenize and pack")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows for the build-time measurement")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths drawn for the build time")
    add_tokenizer_argument(parser)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--work", type=Path, default=HERE / "work")
    args = parser.parse_args()
    cache_path = corpus_cache(args.scale, args.units, args.work, args.tokenizer)
    corpus = corpus_rows(cache_path, args.work / "packing-indexes")
    timing = build_time(open_cache(cache_path).lengths, args.rows, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    git = git_state(ROOT)
    (args.out / "packing.json").write_text(json.dumps({"git": git, "corpus": corpus, "build": timing}, indent=2) + "\n")
    (args.out / "packing.md").write_text(markdown(corpus, timing, args) + f"\nMeasured at commit `{git['commit']}`"
                                         f"{' with uncommitted changes' if git['dirty'] else ' (clean tree)'}.\n")
    print(args.out / "packing.md")


if __name__ == "__main__":
    main()
