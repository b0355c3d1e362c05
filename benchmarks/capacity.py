"""The capacity model of docs/scale-out.md: a run's wall time and the orchestration's share, from measured constants.

    python benchmarks/capacity.py --table      # the model's tables, as docs/scale-out.md shows them
    python benchmarks/capacity.py --check      # the model against a run measured on this machine (within 25 %)

The model (`predict`): a run of T tokens is B = T × bytes-per-token of input, cut into n = ⌈B / S⌉ slices of S bytes,
run as tasks of g slices (tokenize_slices.group_size) on W = nodes × cores workers. Its wall is

    fixed + planning + n × flow-per-slice + max(tokenizing + run-side orchestration / W,  server)

- tokenizing: the tasks run in waves of W; a task takes g × (S / (bytes-per-token × tokens-per-core-second) + the
  slice's own overhead: its shard created, fsynced and renamed);
- run-side orchestration: per task and per slice CPU, spent by the workers (Prefect's task engine runs there);
- server: the Prefect server's CPU per task and per slice, one process: it records at most 1 / that many a second,
  while the workers tokenize;
- planning: per input file (listing, identity, the column check, the cut), on the flow's machine;
- flow-per-slice: what the flow's machine does per slice one after the other (its content key, its shard checked
  and linked at publishing).

The orchestration's share is its CPU (run side and server) over all the CPU the run spends.

`--check` calibrates what depends on the machine and the tokenizer on this machine (tokens per core-second and the
fixed cost, from a run of 2 large slices; a slice's overhead on its worker, from a run of a tenth of the input in a
tenth of the slices), then predicts a run cut into thousands of tiny slices, whose wall the per-slice costs
decide, and measures it. Results go to --out as capacity.json and capacity.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

MB = 10**6
DEFAULT_SLICE = 256 * MB
SMALLEST_SLICE = 16 * MB  # below this, a slice's fixed costs (a shard, its requests) are no longer negligible
NODE_CORES = 16
TOLERANCE = 0.25


@dataclass(frozen=True)
class Constants:
    """Measured on 2 cores (Intel Xeon), December 2026; each one's source beside it."""

    # benchmarks/results/short-qwen/results.md, 8x: 224.6M tokens tokenized in 63.3 s by 2 cores (Qwen's 151k BPE,
    # short multi-turn chats); 768 MB of JSONL for them.
    tokens_per_core_second: float = 1.78e6
    input_bytes_per_token: float = 3.42
    # docs/scale-out.md, "Orchestration" (tiny slices, embedded SQLite server): a task per slice costs 8.0 ms in
    # the run's process and 11.2 ms in the server; in groups of 16, 1.5 and 1.2 ms a slice, so a slice inside a
    # task costs 1.5 - 8.0 / 16 = 1.0 ms and 1.2 - 11.2 / 16 = 0.5 ms.
    run_ms_per_task: float = 8.0
    server_ms_per_task: float = 11.2
    run_ms_per_slice: float = 1.0
    server_ms_per_slice: float = 0.5
    # benchmarks/results/planning.md: a plan's cost per input file, local (hashed) and in a bucket (moto), 10,000
    # small files on a loaded machine.
    plan_ms_per_local_file: float = 2.0
    plan_ms_per_bucket_file: float = 22.3
    # benchmarks/results/short-qwen/results.md: wall minus planning, tokenizing and publishing (interpreter,
    # imports, the server's start, the flow): 4.4-4.9 s.
    fixed_seconds: float = 5.0
    # benchmarks/results/capacity.md, its 300-slice calibration: a slice's wall on its worker beyond tokenizing (its
    # shard and sidecar created, fsynced and renamed, its input checked before and after), on this machine's disk.
    slice_overhead_seconds: float = 0.032
    # The same run: per slice on the flow's machine, one after the other (its content key at planning, its shard
    # checked and linked at publishing).
    flow_ms_per_slice: float = 1.4
    input_file_bytes: float = 1e9  # the model's inputs: 1 GB files
    read_request_bytes: float = 2**20  # sources/formats/format_reader.py READ_CHUNK_BYTES: one ranged GET
    shard_bytes_per_token: float = 5.0  # int32 ids + int8 mask (the default schema), offsets aside
    upload_part_bytes: float = 50 * 2**20  # s3fs put_file's multipart chunk


def group_size(slices: int, workers: int, slice_bytes: float) -> int:
    from sft_tokenize.tasks.tokenize_slices import group_size as flow_group_size

    return flow_group_size(slices, workers, slice_bytes=slice_bytes)


def recommended_slice(tokens: float, workers: int, c: Constants = Constants()) -> int:
    """At least 4 slices per worker (the last wave then idles at most a quarter of the cores), within
    [SMALLEST_SLICE, DEFAULT_SLICE], rounded down to a power of two of MB."""
    wanted = tokens * c.input_bytes_per_token / (4 * workers)
    size = max(SMALLEST_SLICE, min(DEFAULT_SLICE, wanted))
    return MB * 2 ** int(math.log2(size / MB))


def predict(tokens: float, nodes: int, slice_bytes: float = DEFAULT_SLICE, cores: int = NODE_CORES,
            bucket: bool = True, c: Constants = Constants(), slices: int | None = None) -> dict:
    """The model's wall seconds and its parts for T tokens on nodes × cores workers at slices of `slice_bytes`
    (or exactly `slices` slices)."""
    workers = nodes * cores
    input_bytes = tokens * c.input_bytes_per_token
    n = slices or max(1, math.ceil(input_bytes / slice_bytes))
    slice_seconds = input_bytes / n / c.input_bytes_per_token / c.tokens_per_core_second + c.slice_overhead_seconds
    g = group_size(n, workers, input_bytes / n)
    tasks = math.ceil(n / g)
    waves = math.ceil(tasks / workers)
    tokenizing = waves * g * slice_seconds if tasks >= workers else g * slice_seconds
    tokenizing = max(tokenizing, n * slice_seconds / workers)
    run_cpu = (tasks * c.run_ms_per_task + n * c.run_ms_per_slice) / 1000
    server = (tasks * c.server_ms_per_task + n * c.server_ms_per_slice) / 1000
    files = max(1, math.ceil(input_bytes / c.input_file_bytes))
    planning = files * (c.plan_ms_per_bucket_file if bucket else c.plan_ms_per_local_file) / 1000
    working = tokenizing + run_cpu / workers
    serial = n * c.flow_ms_per_slice / 1000
    wall = c.fixed_seconds + planning + serial + max(working, server)
    tokenize_cpu = tokens / c.tokens_per_core_second
    limits = {"tokenizing": tokenizing if tasks >= workers else 0, "too few slices for the cores":
              tokenizing if tasks < workers else 0, "the Prefect server": server, "planning": planning}
    requests = (math.ceil(slice_bytes / c.read_request_bytes)
                + math.ceil(slice_bytes / c.input_bytes_per_token * c.shard_bytes_per_token / c.upload_part_bytes) + 4)
    return {"tokens": tokens, "nodes": nodes, "workers": workers, "slice_bytes": slice_bytes, "slices": n,
            "slices_per_task": g, "tasks": tasks, "wall_seconds": wall, "tokenizing_seconds": tokenizing,
            "server_seconds": server, "planning_seconds": planning, "run_orchestration_cpu": run_cpu,
            "orchestration_share": (run_cpu + server) / (tokenize_cpu + run_cpu + server),
            "limit": max(limits, key=limits.__getitem__), "bucket_requests_per_slice": requests}


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def table(c: Constants = Constants()) -> str:
    """docs/scale-out.md's table: 1B, 100B and 1T tokens on 1, 8 and 64 nodes of 16 cores, at the default slice
    size and at the recommended one."""
    lines = ["| tokens | nodes | slice | slices (per task) | wall | orchestration | limited by |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for tokens, label in ((1e9, "1B"), (1e11, "100B"), (1e12, "1T")):
        for nodes in (1, 8, 64):
            sizes = [DEFAULT_SLICE]
            if (best := recommended_slice(tokens, nodes * NODE_CORES, c)) != DEFAULT_SLICE:
                sizes.append(best)
            for size in sizes:
                p = predict(tokens, nodes, size, c=c)
                mark = "" if size == DEFAULT_SLICE else " (rec.)"
                lines.append(f"| {label} | {nodes} | {size // MB} MB{mark} | {p['slices']:,} ({p['slices_per_task']}) "
                             f"| {duration(p['wall_seconds'])} | {p['orchestration_share']:.2%} | {p['limit']} |")
    return "\n".join(lines)


def _run(data: Path, cache: Path, shard_size: str, env: dict) -> tuple[float, dict]:
    command = [str(Path(sys.executable).with_name("sft-tokenize")), "run", str(data), "--tokenizer",
               str(ROOT / "examples" / "tokenizer"), "--cache-dir", str(cache), "--shard-size", shard_size,
               "--workers", "2"]
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    [version] = [p for p in cache.iterdir() if (p / "manifest.json").is_file()]
    return wall, json.loads((version / "manifest.json").read_text())


def check(megabytes: float, slices: int, out: Path) -> dict:
    """Calibrate on 2 large slices, predict `slices` tiny ones of the same size of input, measure them."""
    from orchestration import write_input
    from run import machine

    scratch = Path(tempfile.mkdtemp(prefix="sft-tokenize-capacity-"))
    env = {**os.environ, "PREFECT_HOME": str(scratch / "prefect-home"), "SFT_TOKENIZE_HOME": str(scratch / "sft"),
           "SFT_TOKENIZE_RESIDENT": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "SFT_TOKENIZE_SERVER_IDLE": "600"}
    rows_slices = round(megabytes * MB / 1400)  # write_input's slices of one ~1.4 kB example row each
    warm = write_input(scratch / "warm", 2, 0)
    _run(warm, scratch / "warm-cache", "256MB", env)  # the server's database made, the tokenizer prepared
    calibration_input = write_input(scratch / "calibrate", rows_slices, 1)
    size = sum(p.stat().st_size for p in calibration_input.iterdir())
    wall, manifest = _run(calibration_input, scratch / "calibrate-cache", f"{size // 2 + 1}B", env)
    timings, tokens = manifest["timings"], manifest["tokens"]
    constants = replace(Constants(), tokens_per_core_second=tokens / (2 * timings["tokenize_seconds"]),
                        input_bytes_per_token=size / tokens,
                        fixed_seconds=wall - timings["tokenize_seconds"] - timings.get("plan_seconds", 0))
    # The slice's overhead: a run of a tenth of the input in a tenth of the slices (the same slice size).
    small_input = write_input(scratch / "overhead", rows_slices // 10, 3)
    small_size = sum(p.stat().st_size for p in small_input.iterdir())
    shard_size = max(1, small_size // (slices // 10))
    small_wall, small_manifest = _run(small_input, scratch / "overhead-cache", f"{shard_size}B", env)
    t, n_small = small_manifest["timings"], len(small_manifest["shards"])
    small = predict(small_manifest["tokens"], 1, cores=2, bucket=False, c=replace(constants, slice_overhead_seconds=0),
                    slices=n_small)
    constants = replace(constants, flow_ms_per_slice=1000 * (t.get("plan_seconds", 0) + t["publish_seconds"]) / n_small,
                        slice_overhead_seconds=max(0.0, (t["tokenize_seconds"] - small["tokenizing_seconds"]
                                                         - small["run_orchestration_cpu"] / 2) * 2 / n_small))
    measured_input = write_input(scratch / "measure", rows_slices, 2)
    measured_size = sum(p.stat().st_size for p in measured_input.iterdir())
    measured_wall, measured_manifest = _run(measured_input, scratch / "measure-cache", f"{shard_size}B", env)
    n = len(measured_manifest["shards"])
    predicted = predict(measured_manifest["tokens"], 1, cores=2, bucket=False, c=constants, slices=n)
    error = predicted["wall_seconds"] / measured_wall - 1
    subprocess.run([str(Path(sys.executable).with_name("sft-tokenize")), "server", "stop"], env=env,
                   capture_output=True)
    report = {"command": " ".join(["python", "benchmarks/capacity.py", *sys.argv[1:]]), "machine": machine(),
              "calibration": {"wall_seconds": round(wall, 2), "tokens": tokens, "input_bytes": size,
                              "timings": timings, "overhead_run": {"slices": n_small, "timings": t,
                                                                   "wall_seconds": round(small_wall, 2)}},
              "constants": asdict(constants), "measured": {"slices": n, "tokens": measured_manifest["tokens"],
                                                           "wall_seconds": round(measured_wall, 2)},
              "measured_timings": measured_manifest["timings"], "predicted": predicted, "error": round(error, 3),
              "within": abs(error) <= TOLERANCE}
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "capacity.md").write_text(
        "# The capacity model against a measured run\n\n"
        f"`{report['command']}` at {report['machine']['git'].get('commit', '?')[:10]}; "
        f"{report['machine']['cores']} cores, load {report['machine']['load_average_at_start']}.\n\n"
        f"Calibrated on 2 slices of {size / MB:.1f} MB ({tokens:,} tokens): "
        f"{constants.tokens_per_core_second:,.0f} tokens per core-second, {constants.fixed_seconds:.1f} s fixed; "
        f"on {len(small_manifest['shards']):,} slices of a tenth of the input ({small_wall:.1f} s): "
        f"{1000 * constants.slice_overhead_seconds:.0f} ms of overhead a slice on its worker, "
        f"{constants.flow_ms_per_slice:.1f} ms a slice on the flow's machine (planning and publishing).\n\n"
        f"| run | slices | tasks | predicted wall | measured wall | error |\n|---|---:|---:|---:|---:|---:|\n"
        f"| {measured_size / MB:.1f} MB | {n:,} | {predicted['tasks']:,} | {predicted['wall_seconds']:.1f} s | "
        f"{measured_wall:.1f} s | {error:+.1%} |\n\n"
        f"Within {TOLERANCE:.0%}: {'yes' if report['within'] else 'NO'}.\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the model's table for docs/scale-out.md")
    parser.add_argument("--check", action="store_true", help="check the model against a run measured here")
    parser.add_argument("--megabytes", type=float, default=20, help="--check's input size (default 20 MB)")
    parser.add_argument("--slices", type=int, default=3000, help="--check's measured run's slices (default 3,000)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where --check's results go")
    args = parser.parse_args(argv)
    if args.table:
        print(table())
    if args.check:
        report = check(args.megabytes, args.slices, args.out)
        print(json.dumps({k: report[k] for k in ("measured", "error", "within")}))
        if not report["within"]:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
