"""Incremental rebuild benchmark: what a 1 % growth of the corpus costs against a cold run.

    python benchmarks/incremental.py                            # 8 units (~219M tokens), grown by 1 %
    python benchmarks/incremental.py --server                   # the same against a running Prefect server
    python benchmarks/incremental.py --scale 0.05 --units 2 --verify --out /tmp/incremental   # a small run

On the benchmark corpus (build_inputs.py; the sweep's units, linked into a scratch directory), as a user
runs it, each step a timed `sft-tokenize run` subprocess, on Prefect's embedded server (an ad-hoc run), or
with --server against a `prefect server start` that this script starts first, untimed (where the nightly
deployment runs: its runs never boot a server):

    cold         every slice tokenized
    hit          the same command again: a cache hit
    grown        a new file of `growth` × the corpus's conversations (new ones, from another seed) added,
                 or (`--grow append`) the same rows appended to the last file
    verify       (--verify) the grown corpus built from scratch into another cache root: its tokens and
                 masks must equal the incremental build's

Target: grown ≤ 5 % of cold. The grown run pays what any run pays (interpreter start, Prefect's embedded
server, loading and checking the tokenizer) plus hashing and tokenizing only the new files' slices (the
others' digests are in the digest book); on a small corpus that fixed part dominates, so the ratio is only
meaningful at the real size. Results go to --out as incremental.json
and incremental.md (incremental-server.* with --server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from build_inputs import CorpusSpec, add_tokenizer_argument, build, generator, tokenizer_for  # noqa: E402
from measure import free_port, measure, serving  # noqa: E402
from run import ENV, PREFECT_MODES, machine, project_command, stop_server, warm_up_prefect, work_env  # noqa: E402

TARGET = 0.05
GROWTH_SEED = 900_000  # far from the corpus's own unit seeds, so the new conversations are new


def grow(data: Path, spec: CorpusSpec, units: list[Path], growth: float, how: str) -> int:
    """Add `growth` × the corpus's rows as new conversations; returns how many."""
    rows = max(1, round(growth * spec.rows_per_unit * len(units)))
    gen = generator(spec)
    new = gen.conversations(GROWTH_SEED, rows, turns=spec.turns, sentences=spec.sentences)
    if how == "file":
        gen.write_jsonl(data / "chat-99999-growth.jsonl", new)
    else:
        extra = data / ".growth.jsonl"
        gen.write_jsonl(extra, new)
        with (data / units[-1].name).open("ab") as out:
            out.write(extra.read_bytes())
        extra.unlink()
    return rows


@contextlib.contextmanager
def prefect_server(home: Path, logs: Path) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1 with its own PREFECT_HOME, until it answers; its API URL."""
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}, **ENV, "PREFECT_HOME": str(home)}
    url = f"http://127.0.0.1:{port}/api"
    command = [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
               str(port)]
    with serving(command, f"{url}/health", logs / "prefect-server.log", timeout=180, env=env):
        yield url


def timed_run(name: str, data: Path, tokenizer: Path, cache: Path, workers: int, env: dict, logs: Path) -> dict:
    command = project_command([data], tokenizer, cache, workers, ["--name", "bench"])
    run = measure(command, env=env, cwd=ROOT, log=logs / f"incremental-{name}.log")
    cache_path = Path(run.stdout.strip().splitlines()[-1])
    manifest = json.loads((cache_path / "manifest.json").read_text())
    return {"seconds": round(run.seconds, 2), "peak_anon_mib": round(run.peak_anon_mib, 1), "cache": str(cache_path),
            "rows": manifest["rows"], "tokens": manifest["tokens"], "slices": len(manifest["shards"]),
            "build": manifest.get("build"), "timings": manifest.get("timings")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="rows per unit multiplier (default 1)")
    parser.add_argument("--units", type=int, default=8, help="corpus units, ~27M tokens each at scale 1 (default 8)")
    parser.add_argument("--growth", type=float, default=0.01, help="growth as a share of the rows (default 0.01)")
    parser.add_argument("--grow", choices=["file", "append"], default="file",
                        help="add a new file (default) or append to the last one")
    parser.add_argument("--workers", type=int, default=2, help="--workers of every run (default 2)")
    add_tokenizer_argument(parser)
    parser.add_argument("--verify", action="store_true", help="also build the grown corpus from scratch and compare")
    parser.add_argument("--server", action="store_true",
                        help="run against a `prefect server start` (started first, untimed), not the embedded one")
    parser.add_argument("--prefect", choices=PREFECT_MODES, default="fresh",
                        help="the embedded server: fresh, each run boots it (default); warm, the runs find it up")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the results go")
    parser.add_argument("--work", type=Path, default=HERE / "work", help="scratch space, logs and Prefect's home")
    args = parser.parse_args(argv)

    work, out = args.work.absolute(), args.out.absolute()
    env = work_env(work, args.prefect)
    spec = CorpusSpec(scale=args.scale)
    _, units = build(spec, args.units, tokenizer=args.tokenizer == "bench")
    tokenizer = tokenizer_for(args.tokenizer, spec)
    scratch, logs = work / "incremental", work / "logs"
    shutil.rmtree(scratch, ignore_errors=True)
    data = scratch / "data"
    data.mkdir(parents=True)
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.server:
            env["PREFECT_API_URL"] = stack.enter_context(prefect_server(work / "prefect-server-home", logs))
        else:
            warm_up_prefect(env, work, tokenizer)
        report = run_steps(args, spec, units, tokenizer, data, scratch, logs, env)
        stop_server(env)
    write_report(report, args, out)


def run_steps(args: argparse.Namespace, spec: CorpusSpec, units: list[Path], tokenizer: Path, data: Path,
              scratch: Path, logs: Path, env: dict[str, str]) -> dict:
    for unit in units:  # linked, not copied; the file appended to (--grow append) is a copy
        if args.grow == "append" and unit == units[-1]:
            shutil.copyfile(unit, data / unit.name)
        else:
            os.link(unit, data / unit.name)

    report = {"command": " ".join(["python", "benchmarks/incremental.py", *sys.argv[1:]]),
              "machine": machine(), "scale": args.scale, "units": args.units, "growth": args.growth,
              "grow": args.grow, "workers": args.workers, "tokenizer": str(tokenizer),
              "prefect": "server" if args.server else f"embedded, {args.prefect}",
              "runs": {}}
    runs = report["runs"]
    for step in ("cold", "hit", "grown"):
        if step == "grown":
            started = time.monotonic()
            report["rows_added"] = grow(data, spec, units, args.growth, args.grow)
            print(f"added {report['rows_added']} conversations in {time.monotonic() - started:.1f} s", flush=True)
        print(f"{step} ...", end=" ", flush=True)
        runs[step] = timed_run(step, data, tokenizer, scratch / "cache", args.workers, env, logs)
        print(f"{runs[step]['seconds']:.1f} s, {runs[step]['slices']} slices, build {runs[step]['build']}", flush=True)
    if args.verify:
        from pipelines import cache_digest

        print("verify (from scratch) ...", end=" ", flush=True)
        runs["scratch"] = timed_run("scratch", data, tokenizer, scratch / "scratch-cache", args.workers, env, logs)
        report["identical_to_scratch"] = (cache_digest(Path(runs["grown"]["cache"]))
                                          == cache_digest(Path(runs["scratch"]["cache"])))
        print(f"{runs['scratch']['seconds']:.1f} s, identical: {report['identical_to_scratch']}", flush=True)
    return report


def write_report(report: dict, args: argparse.Namespace, out: Path) -> None:
    runs = report["runs"]
    ratio = runs["grown"]["seconds"] / runs["cold"]["seconds"]
    report["grown_vs_cold"] = round(ratio, 4)
    report["target"] = {"name": f"a {args.growth:.0%} growth costs <= {TARGET:.0%} of a cold run",
                        "ok": ratio <= TARGET, "detail": f"{ratio:.1%} ({runs['grown']['seconds']:.1f} s against "
                                                        f"{runs['cold']['seconds']:.1f} s)"}
    out.mkdir(parents=True, exist_ok=True)
    name = "incremental-server" if args.server else "incremental-warm" if args.prefect == "warm" else "incremental"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Incremental rebuild: `{report['command']}`", "",
             f"{args.units} units at scale {args.scale}, {args.workers} workers, grown by {args.growth:.0%} "
             f"({report['rows_added']} conversations, as a {'new file' if args.grow == 'file' else 'tail'}) on "
             f"{report['machine']['cores']} cores ({report['machine']['cpu']}), Prefect: "
             f"{'a running `prefect server start`' if args.server else 'the embedded server'}. Measured at commit "
             f"`{(report['machine']['git'].get('commit') or 'unknown')[:12]}`"
             f"{' with uncommitted changes' if report['machine']['git'].get('dirty') else ' (clean tree)'}.", "",
             "| run | wall s | plan s | tokenize s | tokens | slices | tokenized | reused |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for step, run in runs.items():
        build_info, timings = run["build"] or {}, run["timings"] or {}
        if step == "hit":  # the cache that was hit: its build and timings are the cold run's
            build_info, timings = {}, {}
        lines.append(f"| {step} | {run['seconds']:.1f} | {timings.get('plan_seconds', '')} | "
                     f"{timings.get('tokenize_seconds', '')} | {run['tokens']:,} | {run['slices']} | "
                     f"{build_info.get('slices_tokenized', '')} | {build_info.get('slices_reused', '')} |")
    lines += ["", f"{'PASS' if report['target']['ok'] else 'MISS'}: {report['target']['name']}: "
                  f"{report['target']['detail']}"]
    if "identical_to_scratch" in report:
        lines.append(f"identical to a build from scratch: {report['identical_to_scratch']}")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
