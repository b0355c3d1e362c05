"""Planning at scale: a plan over ten thousand input files, in a local directory and in a bucket.

    python benchmarks/planning.py                        # 10,000 files
    python benchmarks/planning.py --files 500 --out /tmp/plan   # a quick check

Each file is a small JSONL file (two of the example's rows, ~3 kB), so the plan's cost is per file, not per byte.
The plan is `sft_tokenize.build.plan.plan_slices` in this process (the flow's first task, without Prefect), timed
with cProfile's cumulative times of its steps: listing and each file's identity (`resolve`), the column check,
the cut (`cut_slices`) and the slices' content keys (`slice_key`: local byte ranges hashed, remote objects keyed by
URL and ETag). Runs:

    local cold   a local directory, no digest book yet: every file read and hashed
    local warm   the same again: the digest book (`.shards/.digests`) answers for every unchanged file
    bucket       the same files in a bucket on moto's S3 server (127.0.0.1): listed, never downloaded

For the bucket, moto's request log is read: the GETs of objects (whole or ranged) against the number of files.
A plan must not read every byte of a remote input. Results go to --out as planning.json and planning.md.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from measure import serving  # noqa: E402
from object_storage import BUCKET, S3_ENV, moto_server  # noqa: E402
from run import machine  # noqa: E402

EXAMPLE = ROOT / "examples"
STEPS = {"resolve": "resolve", "columns": "_columns", "tokenizer": "process_encoding", "cut": "cut_slices",
         "keys": "slice_key"}
assert serving  # moto_server's


def write_files(directory: Path, files: int) -> int:
    """`files` JSONL files of two example rows each; their total bytes."""
    rows = [line for path in sorted((EXAMPLE / "data").glob("*.jsonl")) for line in path.read_text().splitlines()]
    directory.mkdir(parents=True)
    total = 0
    for i in range(files):
        text = "\n".join(rows[(2 * i + j) % len(rows)] for j in range(2)) + "\n"
        (directory / f"part-{i:06d}.jsonl").write_text(text)
        total += len(text.encode())
    return total


def timed_plan(sources: str, cache: Path, storage_options: dict) -> dict:
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.plan import plan_slices

    options = TokenizeOptions(sources=[sources], tokenizer=str(EXAMPLE / "tokenizer"), cache_dir=str(cache),
                              storage_options=storage_options)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    plan = plan_slices(options)
    profile.disable()
    seconds = time.perf_counter() - started
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    steps = {}
    for step, function in STEPS.items():
        steps[step] = round(sum(cumulative for (_, _, name), (_, _, _, cumulative, _) in stats.items()
                                if name == function), 3)
    return {"seconds": round(seconds, 3), "slices": len(plan.slices), "steps": steps}


def object_gets(log: Path, prefix: str) -> int:
    """GETs of objects under `prefix` in moto's request log (listings are GETs of the bucket, not counted)."""
    pattern = re.compile(rf'"GET /{BUCKET}/{re.escape(prefix)}[^ ?]+ HTTP')
    return sum(1 for line in log.read_text(errors="replace").splitlines() if pattern.search(line))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000, help="input files (default 10,000)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the results go")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="sft-tokenize-planning-"))
    os.environ["SFT_TOKENIZE_HOME"] = str(scratch / "sft-home")
    report: dict = {"command": " ".join(["python", "benchmarks/planning.py", *sys.argv[1:]]), "machine": machine(),
                    "files": args.files, "runs": {}}
    try:
        data = scratch / "data"
        report["bytes"] = write_files(data, args.files)
        timed_plan(str(EXAMPLE / "data"), scratch / "warm-up", {})  # imports, the tokenizer prepared: not timed
        for name in ("local cold", "local warm"):
            report["runs"][name] = timed_plan(str(data), scratch / "cache", {})
            print(name, json.dumps(report["runs"][name]), flush=True)
        logs = scratch / "logs"
        logs.mkdir()
        with moto_server(logs) as endpoint:
            import s3fs

            os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": endpoint})
            fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=S3_ENV["AWS_ACCESS_KEY_ID"],
                                   secret=S3_ENV["AWS_SECRET_ACCESS_KEY"])
            fs.put(str(data) + "/", f"{BUCKET}/data/", recursive=True)
            before = object_gets(logs / "moto-server.log", "data/")
            run = timed_plan(f"s3://{BUCKET}/data/", scratch / "bucket-cache", {})
            run["object_gets"] = object_gets(logs / "moto-server.log", "data/") - before
            report["runs"]["bucket"] = run
            print("bucket", json.dumps(run), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_report(report, args.out)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "planning.json").write_text(json.dumps(report, indent=2) + "\n")
    git, files = report["machine"]["git"], report["files"]
    lines = ["# Planning at scale", "",
             f"`{report['command']}` at {git.get('commit', '?')[:10]}; {report['machine']['cores']} cores, load "
             f"{report['machine']['load_average_at_start']}; {files:,} JSONL files, {report['bytes'] / 1e6:.1f} MB.",
             "", "| plan | seconds | ms per file | slices | " + " | ".join(STEPS) + " | object GETs |",
             "|---|---:|---:|---:|" + "---:|" * len(STEPS) + "---:|"]
    for name, run in report["runs"].items():
        steps = " | ".join(f"{run['steps'][s]:.2f}" for s in STEPS)
        lines.append(f"| {name} | {run['seconds']:.2f} | {1000 * run['seconds'] / files:.2f} | {run['slices']:,} | "
                     f"{steps} | {run.get('object_gets', '')} |")
    lines += ["", "Steps: cProfile's cumulative seconds of each step's function (the profiler adds its own overhead "
              "to the total); `tokenizer` is the tokenizer's check, the same whatever the number of files."]
    (out / "planning.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
