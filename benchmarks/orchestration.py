"""Orchestration at scale: ten thousand slices, and eight runs at once, on a Prefect server on PostgreSQL.

    python benchmarks/orchestration.py                          # 10,000 slices, then 8 runs of 1,250 at once
    python benchmarks/orchestration.py --slices 600 --concurrent 2 --out /tmp/orch   # a quick check

What a slice costs the orchestration, not the tokenizer: the bundled example's rows, each about 1.4 kB, make a
JSONL file cut by `--shard-size 1KB` into about one slice per row, so the tokenizing is a few milliseconds a slice
and the rest is the flow's own work. A PostgreSQL cluster (Debian's `postgresql` package; tests/support/postgres.py,
with PostgreSQL's durable defaults) and `prefect server start` on it run on 127.0.0.1; every `sft-tokenize run`
talks to that server (PREFECT_API_URL), on the threads runner with 2 workers, as a subprocess whose CPU time is
counted (its children's rusage). The server's CPU is its process's (psutil). Steps:

    base        a run of 2 slices: the fixed cost of a run, subtracted from the others
    big         one run of --slices slices
    per-task    one run of --per-task-slices slices with --slices-per-task 1 (a task per slice), for comparison
    concurrent  --concurrent runs at once, --slices / --concurrent slices each, into one cache root

Each run must exit 0 and publish a cache whose manifest names one shard per slice; nothing may be left under the
root's .staging; no run's log may hold "database is locked". Per slice: (CPU of the step - CPU of as many base
runs) / (slices - 2 × runs). Results go to --out as orchestration.json and orchestration.md, with the database's
size (pg_database_size) after each step. A step's server CPU runs until the server is idle again (it writes the
runs' last events after they end).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

from run import machine  # noqa: E402
from support.postgres import postgres  # noqa: E402
from support.servers import prefect_server  # noqa: E402

EXAMPLE = ROOT / "examples"
SHARD_SIZE = "1KB"
WORKERS = 2


def example_rows() -> list[str]:
    return [line for path in sorted((EXAMPLE / "data").glob("*.jsonl")) for line in path.read_text().splitlines()]


def write_input(path: Path, slices: int, seed: int) -> Path:
    """A JSONL file of about `slices` one-row slices at SHARD_SIZE: the example's rows in turn, each made unique by
    its run's seed and its line number (so that no two runs' slices share a shard)."""
    rows, lines = example_rows(), []
    # Rows under SHARD_SIZE join the next one's slice: 720 example lines make 645 slices.
    count = round(slices * 720 / 645)
    for i in range(count):
        row = json.loads(rows[i % len(rows)])
        row["messages"][0]["content"] = f"[{seed}:{i}] " + row["messages"][0]["content"]
        lines.append(json.dumps(row, ensure_ascii=False))
    path.mkdir(parents=True, exist_ok=True)
    (path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return path


def run_command(data: Path, cache: Path, extra: list[str]) -> list[str]:
    return [str(Path(sys.executable).with_name("sft-tokenize")), "run", str(data), "--tokenizer",
            str(EXAMPLE / "tokenizer"), "--cache-dir", str(cache), "--shard-size", SHARD_SIZE, "--workers",
            str(WORKERS), "--encode-processes", "0", *extra]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(process: psutil.Process) -> float:
    """A process's CPU seconds with its live children's."""
    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            times = each.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def server_process(api: str) -> psutil.Process:
    port = int(api.rsplit(":", 1)[1].split("/")[0])
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            return psutil.Process(connection.pid)
    raise RuntimeError(f"no process listens on {api}")


def settle(server: psutil.Process, idle: float = 0.05, longest: float = 120) -> None:
    """Wait until the server spends under `idle` of a core over a second (its queued events written)."""
    deadline = time.monotonic() + longest
    while time.monotonic() < deadline:
        before = process_cpu(server)
        time.sleep(1)
        if process_cpu(server) - before < idle:
            return


def check_published(cache: Path, log: str) -> int:
    """The number of shards of the one cache published under `cache`, which must be whole."""
    [version] = [p for p in cache.iterdir() if (p / "manifest.json").is_file()]
    manifest = json.loads((version / "manifest.json").read_text())
    data_files = sorted(version.glob("data-*.arrow"))
    assert len(data_files) == len(manifest["files"]) == len(manifest["shards"]), version
    staging = cache / ".staging"
    assert not staging.exists() or not any(staging.iterdir()), f"left in {staging}: {list(staging.iterdir())}"
    assert "database is locked" not in log
    return len(manifest["shards"])


def step(name: str, inputs: list[Path], scratch: Path, env: dict, server: psutil.Process, extra: list[str] = ()
         ) -> dict:
    """Run one `sft-tokenize run` per input at once, each into its own cache root; their wall, CPU and slices."""
    cpu_before, server_before, started = children_cpu(), process_cpu(server), time.monotonic()
    logs = [scratch / f"{name}-{i}.log" for i in range(len(inputs))]
    caches = [scratch / f"{name}-cache-{i}" for i in range(len(inputs))]
    processes = []
    for data, cache, log in zip(inputs, caches, logs, strict=True):
        with log.open("w") as out:
            processes.append(subprocess.Popen(run_command(data, cache, list(extra)), env=env, cwd=scratch,
                                              stdout=out, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in processes]
    wall = time.monotonic() - started
    run_cpu = children_cpu() - cpu_before
    settle(server)  # the server writes the runs' last events after they end: that is the step's too
    server_cpu = process_cpu(server) - server_before
    texts = [log.read_text() for log in logs]
    for code, text, log in zip(codes, texts, logs, strict=True):
        if code:
            raise SystemExit(f"{name}: a run failed (exit {code}), {log}:\n{text[-3000:]}")
    slices = sum(check_published(cache, text) for cache, text in zip(caches, texts, strict=True))
    return {"runs": len(inputs), "slices": slices, "wall_seconds": round(wall, 2), "run_cpu_seconds": round(run_cpu, 2),
            "server_cpu_seconds": round(server_cpu, 2)}


def per_slice(result: dict, base: dict) -> None:
    """The step's CPU per slice beyond what as many 2-slice runs cost, in milliseconds."""
    runs, extra_slices = result["runs"], result["slices"] - base["slices"] * result["runs"]
    for side in ("run", "server"):
        spent = result[f"{side}_cpu_seconds"] - runs * base[f"{side}_cpu_seconds"]
        result[f"{side}_ms_per_slice"] = round(1000 * spent / extra_slices, 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slices", type=int, default=10_000, help="slices of the big run (default 10,000)")
    parser.add_argument("--concurrent", type=int, default=8, help="runs at once (default 8)")
    parser.add_argument("--per-task-slices", type=int, default=1_000,
                        help="slices of the run with a task per slice (default 1,000; 0 skips it)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the results go")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="sft-tokenize-orchestration-"))
    report: dict = {"command": " ".join(["python", "benchmarks/orchestration.py", *sys.argv[1:]]),
                    "machine": machine(), "shard_size": SHARD_SIZE, "workers": WORKERS, "steps": {}}
    try:
        with postgres() as cluster:
            database = "prefect"
            url = cluster.database(database)
            home = scratch / "server-home"
            home.mkdir()
            with prefect_server(home, PREFECT_API_DATABASE_CONNECTION_URL=url) as api:
                server = server_process(api)
                env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(scratch / "client-home"),
                       "SFT_TOKENIZE_RESIDENT": "0", "SFT_TOKENIZE_HOME": str(scratch / "sft-home"),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
                plan: list[tuple[str, list[Path], list[str]]] = [
                    ("warm-up", [write_input(scratch / "in-warm", 2, 0)], []),
                    ("base", [write_input(scratch / "in-base", 2, 1)], []),
                    ("big", [write_input(scratch / "in-big", args.slices, 2)], []),
                ]
                if args.per_task_slices:
                    plan.append(("per-task", [write_input(scratch / "in-per-task", args.per_task_slices, 3)],
                                 ["--slices-per-task", "1"]))
                plan.append(("concurrent", [write_input(scratch / f"in-c{i}", args.slices // args.concurrent, 10 + i)
                                            for i in range(args.concurrent)], []))
                for name, inputs, extra in plan:
                    print(f"{name}: {len(inputs)} run(s) ...", end=" ", flush=True)
                    result = step(name, inputs, scratch, env, server, extra)
                    result["database_bytes"] = cluster.size(database)
                    if name not in ("warm-up", "base"):
                        per_slice(result, report["steps"]["base"])
                    if name != "warm-up":
                        report["steps"][name] = result
                    print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_report(report, args.out)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "orchestration.json").write_text(json.dumps(report, indent=2) + "\n")
    git = report["machine"]["git"]
    dirty = " (uncommitted changes)" if git.get("dirty") else ""
    lines = ["# Orchestration at scale: a Prefect server on PostgreSQL", "",
             f"`{report['command']}` at {git.get('commit', '?')[:10]}{dirty};"
             f" {report['machine']['cores']} cores, load {report['machine']['load_average_at_start']}; threads runner,"
             f" {report['workers']} workers, --shard-size {report['shard_size']} (one example row a slice).", "",
             "| step | runs | slices | wall s | run CPU s | server CPU s | run ms/slice | server ms/slice | database |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in report["steps"].items():
        lines.append(f"| {name} | {r['runs']} | {r['slices']:,} | {r['wall_seconds']} | {r['run_cpu_seconds']} | "
                     f"{r['server_cpu_seconds']} | {r.get('run_ms_per_slice', '')} | "
                     f"{r.get('server_ms_per_slice', '')} | {r['database_bytes'] / 2**20:.1f} MiB |")
    lines += ["", "Every run exited 0 and published a whole cache (a shard per slice, nothing left in .staging); "
              "no log held \"database is locked\". Per slice: beyond as many 2-slice runs (the base step)."]
    (out / "orchestration.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
