"""Object-storage benchmark: a run whose cache root is a bucket against the same run to a local directory.

    python benchmarks/object_storage.py                              # 2 units (~55M tokens), 2 repeats
    python benchmarks/object_storage.py --scale 0.05 --units 1 --out /tmp/s3bench   # a small run

On the benchmark corpus (build_inputs.py), each step a timed `sft-tokenize run` subprocess on a warm embedded
Prefect server (its boot is the same for both, and untimed), alternating so that the machine's load drifts over
both alike:

    local    --cache-dir a fresh local directory
    bucket   --cache-dir s3://bench/<a fresh prefix>, on moto's S3 server (`moto_server`, started first on
             127.0.0.1, untimed): every shard uploaded by the process that made it, the version's manifest last

Throughput is the run's tokens over its wall time. Target: bucket ≥ 80 % of local. moto keeps objects in its own
Python process, on the same cores as the run: a real S3 endpoint costs network bandwidth instead. Results go to
--out as object_storage.json and object_storage.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from build_inputs import CorpusSpec, add_tokenizer_argument, build, tokenizer_for  # noqa: E402
from measure import free_port, measure, serving  # noqa: E402
from run import machine, project_command, stop_server, warm_up_prefect, work_env  # noqa: E402

TARGET = 0.8
BUCKET = "bench"
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_server(logs: Path) -> Iterator[str]:
    """moto's S3 server on a free loopback port, with the bucket made; its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)]
    with serving(command, endpoint, logs / "moto-server.log", timeout=60):
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"), timeout=10)
        yield endpoint


def timed_run(name: str, data: Path, tokenizer: Path, cache: str, workers: int, env: dict, logs: Path,
              endpoint: str) -> dict:
    command = project_command([data], tokenizer, cache, workers, ["--name", "bench"])  # type: ignore[arg-type]
    run = measure(command, env=env, cwd=ROOT, log=logs / f"object-storage-{name}.log")
    where = run.stdout.strip().splitlines()[-1]
    if where.startswith("s3://"):
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=S3_ENV["AWS_ACCESS_KEY_ID"],
                               secret=S3_ENV["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)
        manifest = json.loads(fs.cat_file(f"{where.removeprefix('s3://')}/manifest.json"))
    else:
        manifest = json.loads((Path(where) / "manifest.json").read_text())
    return {"seconds": round(run.seconds, 2), "peak_anon_mib": round(run.peak_anon_mib, 1), "cache": where,
            "rows": manifest["rows"], "tokens": manifest["tokens"], "slices": len(manifest["shards"]),
            "digests": [f["digest"] for f in manifest["files"]],
            "tokens_per_second": round(manifest["tokens"] / run.seconds)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="rows per unit multiplier (default 1)")
    parser.add_argument("--units", type=int, default=2, help="corpus units, ~27M tokens each at scale 1 (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each (default 2); the best of each counts")
    parser.add_argument("--workers", type=int, default=2, help="--workers of every run (default 2)")
    add_tokenizer_argument(parser)
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the results go")
    parser.add_argument("--work", type=Path, default=HERE / "work", help="scratch space, logs and Prefect's home")
    args = parser.parse_args(argv)

    work, out = args.work.absolute(), args.out.absolute()
    env = work_env(work, "warm")
    spec = CorpusSpec(scale=args.scale)
    _, units = build(spec, args.units, tokenizer=args.tokenizer == "bench")
    tokenizer = tokenizer_for(args.tokenizer, spec)
    scratch, logs = work / "object-storage", work / "logs"
    shutil.rmtree(scratch, ignore_errors=True)
    data = scratch / "data"
    data.mkdir(parents=True)
    logs.mkdir(parents=True, exist_ok=True)
    for unit in units:
        os.link(unit, data / unit.name)
    report = {"command": " ".join(["python", "benchmarks/object_storage.py", *sys.argv[1:]]), "machine": machine(),
              "scale": args.scale, "units": args.units, "workers": args.workers, "tokenizer": str(tokenizer),
              "runs": {"local": [], "bucket": []}}
    warm_up_prefect(env, work, tokenizer)
    try:
        with moto_server(logs) as endpoint:
            bucket_env = {**env, **S3_ENV, "AWS_ENDPOINT_URL": endpoint}
            for repeat in range(args.repeats):
                for name in ("local", "bucket"):
                    cache = str(scratch / f"cache-{repeat}") if name == "local" else f"s3://{BUCKET}/cache-{repeat}"
                    print(f"{name} {repeat + 1} ...", end=" ", flush=True)
                    run = timed_run(f"{name}-{repeat}", data, tokenizer, cache, args.workers,
                                    bucket_env if name == "bucket" else env, logs, endpoint)
                    report["runs"][name].append(run)
                    print(f"{run['seconds']:.1f} s, {run['tokens_per_second']:,} tokens/s", flush=True)
    finally:
        stop_server(env)
    write_report(report, out)


def write_report(report: dict, out: Path) -> None:
    runs = report["runs"]
    best = {name: max(r["tokens_per_second"] for r in found) for name, found in runs.items()}
    ratio = best["bucket"] / best["local"]
    report["bucket_vs_local"] = round(ratio, 4)
    report["identical"] = all(r["digests"] == runs["local"][0]["digests"] for r in runs["local"] + runs["bucket"])
    report["target"] = {"name": f"a run to a bucket keeps >= {TARGET:.0%} of a local run's throughput",
                        "ok": ratio >= TARGET, "detail": f"{ratio:.1%} ({best['bucket']:,} against {best['local']:,} "
                                                         "tokens/s, the best of each)"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "object_storage.json").write_text(json.dumps(report, indent=2) + "\n")
    git = report["machine"]["git"]
    lines = [f"# Object storage: `{report['command']}`", "",
             f"{report['units']} units at scale {report['scale']}, {report['workers']} workers, on "
             f"{report['machine']['cores']} cores ({report['machine']['cpu']}); commit {git['commit'][:12]}"
             f"{' (dirty)' if git['dirty'] else ''}; a warm embedded Prefect server; moto's S3 server on 127.0.0.1.",
             "", "| run | cache root | seconds | tokens/s | slices | peak anon MiB |", "|---|---|---|---|---|---|"]
    for name, found in runs.items():
        for k, run in enumerate(found):
            lines.append(f"| {name} {k + 1} | `{run['cache'].rsplit('/', 1)[0]}` | {run['seconds']} | "
                         f"{run['tokens_per_second']:,} | {run['slices']} | {run['peak_anon_mib']} |")
    lines += ["", f"Target: {report['target']['name']}: **{'met' if report['target']['ok'] else 'missed'}**, "
                  f"{report['target']['detail']}. Every run's data files have the same digests: "
                  f"{report['identical']}.", ""]
    (out / "object_storage.md").write_text("\n".join(lines))
    print(f"bucket/local throughput: {ratio:.1%} (target >= {TARGET:.0%})")


if __name__ == "__main__":
    main()
