"""Export throughput: MB of cache per second that `export_cache` writes as each target, on one core.

    python benchmarks/export.py CACHE [--copies 600] [--targets megatron,mds,litdata] [--out DIR]

CACHE is any published cache (the bundled example's, as `make example` builds it, is 240 rows of ~236 tokens:
short rows, the per-row cost's worst case). A larger cache is made from it in the work directory by listing its
data files `--copies` times (hard links, no byte copied; a published cache open_cache accepts), then each target is
exported from it once to a local directory, pinned to one core (sched_setaffinity). Reported per target: wall and
CPU seconds (the process's user + system time, writes into the page cache included), MB of cache (its Arrow data
files) per wall and per CPU second, the export's bytes, and peak RSS (which counts the mapped cache's pages read).
On a shared machine the wall figure is the one core's share the process got; the CPU figure is what one core does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import git_state  # noqa: E402

from sft_tokenize.export import export_cache  # noqa: E402
from sft_tokenize.format.layout import MANIFEST, STATE, data_file  # noqa: E402
from sft_tokenize.read.cache import open_cache  # noqa: E402


def enlarged(cache: Path, copies: int, work: Path) -> Path:
    """`cache`'s data files listed `copies` times, as a published cache in `work`."""
    manifest = json.loads((cache / MANIFEST).read_text())
    state = json.loads((cache / STATE).read_text())
    target = work / f"{cache.name}-x{copies}"
    target.mkdir(parents=True)
    count = len(manifest["files"]) * copies
    files = []
    for k in range(count):
        entry = manifest["files"][k % len(manifest["files"])]
        name = data_file(k, count)
        os.link(cache / entry["name"], target / name)
        files.append({**entry, "name": name})
    for key in ("rows", "tokens", "trained_tokens"):
        manifest[key] *= copies
    manifest["files"] = files
    state["_data_files"] = [{"filename": f["name"]} for f in files]
    (target / MANIFEST).write_text(json.dumps(manifest))
    (target / STATE).write_text(json.dumps(state))
    shutil.copyfile(cache / "dataset_info.json", target / "dataset_info.json")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache")
    parser.add_argument("--copies", type=int, default=600)
    parser.add_argument("--targets", default="megatron,mds,litdata")
    parser.add_argument("--out", default=None, help="where export.json and export.md go (default: print only)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

    results = {"git": git_state(Path(__file__).resolve().parents[1]), "load_average": os.getloadavg(),
               "copies": args.copies, "targets": {}}
    with tempfile.TemporaryDirectory(prefix="export-bench-") as work:
        big = enlarged(Path(args.cache).absolute(), args.copies, Path(work))
        cache = open_cache(big)
        cache_bytes = sum(f["bytes"] for f in cache.manifest["files"])
        results.update(rows=len(cache), tokens=int(cache.lengths.sum()), cache_bytes=cache_bytes)
        for target in args.targets.split(","):
            out = Path(work) / f"out-{target}"
            wall, cpu = time.perf_counter(), time.process_time()
            record = export_cache(cache, target, out, record=False)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            results["targets"][target] = {
                "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "cache_mb_per_s": round(cache_bytes / wall / 1e6, 1),
                "cache_mb_per_cpu_s": round(cache_bytes / max(cpu, 1e-9) / 1e6, 1),
                "export_bytes": sum(f["bytes"] for f in record["files"]),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
            shutil.rmtree(out)
    lines = [f"# Export throughput, one core ({results['rows']:,} rows, {results['tokens']:,} tokens, "
             f"{cache_bytes / 1e6:,.0f} MB of cache)", "",
             f"commit {results['git'].get('commit')} (dirty: {results['git'].get('dirty')}), load average "
             f"{', '.join(f'{x:.2f}' for x in results['load_average'])}", "",
             "| target | wall s | CPU s | MB of cache / wall s | MB of cache / CPU s | export MB | peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for target, r in results["targets"].items():
        lines.append(f"| {target} | {r['wall_s']} | {r['cpu_s']} | {r['cache_mb_per_s']} | {r['cache_mb_per_cpu_s']} | "
                     f"{r['export_bytes'] / 1e6:,.0f} | {r['peak_rss_mb']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "export.json").write_text(json.dumps(results, indent=2))
        (Path(args.out) / "export.md").write_text(text)


if __name__ == "__main__":
    main()
