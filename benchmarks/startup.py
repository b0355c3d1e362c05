"""Start-up benchmark: how long `sft-tokenize run` takes to reach its first slice, to publish and to exit.

    python benchmarks/startup.py                      # both tokenizers x both inputs, 3 repeats, medians
    python benchmarks/startup.py --repeats 1 --tokenizers qwen --data short
    python benchmarks/startup.py --project-cmd ../before/.venv/bin/sft-tokenize --name startup-before

For each tokenizer (the bundled example's, `examples/tokenizer`, and Qwen's real 151k one, see
build_inputs.py) and each input (the bundled example data, `examples/data`, 240 conversations, and the
short-turn corpus at 1/8 of a unit, 4,000 conversations, ~3.5M Qwen tokens), one repeat runs, in this order:

    cold   a fresh, empty PREFECT_HOME and SFT_TOKENIZE_HOME and a fresh cache: a user's first run, nothing
           prepared (the run creates Prefect's database and prepares the tokenizer on the clock)
    hit    the same command again: a cache hit
    warm   a fresh cache on the same homes (the database made, the tokenizer prepared), with the embedded server
           already up: an untimed run on the example data with `--server-idle 60` leaves it running, and the
           timed run passes `--server-idle 60` too and runs in its own process (no `--resident`);
           `sft-tokenize server stop` ends it afterwards. A CLI without `--server-idle` gets the same run
           without it (no server is left running: the row says so)

Every run gets SFT_TOKENIZE_TRACE=FILE; the CLI appends one JSON line per event, `{"event": NAME, "t": SECONDS}`,
t counted from its process's start (interpreter start included): imports, planned, tokenizer, encoder,
server, flow, first_slice, published, exit. Events a CLI does not write are shown as "—", so the script runs
against code from before the trace (`--project-cmd` points at another checkout's `sft-tokenize`). The wall
time is also measured from outside (subprocess start to exit), and the peak PSS and anonymous RAM of the process
tree, the embedded server included even when the run found it up (measure.py). Medians over `--repeats`; results
go to `--out` as NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from build_inputs import EXAMPLE_TOKENIZER, CorpusSpec, build, qwen_tokenizer  # noqa: E402
from measure import TRACE_VARIABLE, measure, read_trace  # noqa: E402
from run import ENV, ad_hoc_environment, machine, server_pids, wait_for_resident  # noqa: E402

EVENTS = ("imports", "planned", "encoding", "server", "flow", "first_slice", "published", "exit")
MODES = ("cold", "hit", "warm")
MODE_LABELS = {"cold": "cold, fresh Prefect home", "hit": "cache hit", "warm": "cold, server warm"}
SERVER_IDLE = "60"
MISSING = "—"


def project_command(args: argparse.Namespace) -> list[str]:
    if args.project_cmd:
        return shlex.split(args.project_cmd)
    script = Path(sys.executable).with_name("sft-tokenize")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sft_tokenize.cli.main"]


def capabilities(project: list[str], env: dict[str, str], cwd: Path) -> dict[str, bool]:
    """Which of the newer CLI features this command has: `run --server-idle` and `server stop`."""
    def output(*words: str) -> tuple[int, str]:
        done = subprocess.run([*project, *words], env={**os.environ, **env}, cwd=cwd, capture_output=True,
                              text=True, timeout=120)
        return done.returncode, done.stdout + done.stderr

    _, run_help = output("run", "--help")
    code, _ = output("server", "stop", "--help")
    return {"server_idle": "--server-idle" in run_help, "server_stop": code == 0}


def timed_run(command: list[str], env: dict[str, str], cwd: Path, trace: Path, log: Path) -> dict:
    trace.unlink(missing_ok=True)
    measured = measure(command, env={**env, TRACE_VARIABLE: str(trace)}, cwd=cwd, log=log, others=server_pids(env))
    lines = measured.stdout.strip().splitlines()
    return {"wall": round(measured.seconds, 3), "peak_anon_mib": round(measured.peak_anon_mib, 1),
            "peak_pss_mib": round(measured.peak_pss_mib, 1),
            "events": read_trace(trace), "cache": lines[-1] if lines else ""}


def stop_server(project: list[str], env: dict[str, str], cwd: Path, log: Path) -> str:
    """`sft-tokenize server stop` on this home; what it said (tolerates a CLI without it)."""
    try:
        done = subprocess.run([*project, "server", "stop"], env={**os.environ, **env}, cwd=cwd, capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"failed: {error}"
    log.write_text(f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return "stopped" if done.returncode == 0 else f"exit {done.returncode}"


def one_repeat(repeat: int, tokenizer: tuple[str, Path], data: tuple[str, Path], args: argparse.Namespace,
               project: list[str], features: dict[str, bool], env: dict[str, str]) -> list[dict]:
    """The cold, hit and warm runs of one tokenizer on one input, in a scratch directory removed after."""
    (tok_name, tok_dir), (data_name, source) = tokenizer, data
    scratch = args.work / f"r{repeat}-{tok_name}-{data_name}"
    shutil.rmtree(scratch, ignore_errors=True)
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    homes = {"PREFECT_HOME": scratch / "prefect-home", "SFT_TOKENIZE_HOME": scratch / "sft-home"}
    for home in homes.values():  # empty: as on a machine where neither was used yet
        home.mkdir(parents=True)
    run_env = {**env, **{k: str(v) for k, v in homes.items()}}
    stem = f"r{repeat}-{tok_name}-{data_name}"

    def command(cache: Path, source: Path = source, extra: tuple[str, ...] = ()) -> list[str]:
        return [*project, "run", str(source), "--tokenizer", str(tok_dir), "--cache-dir", str(cache),
                "--workers", str(args.workers), *extra, *shlex.split(args.project_args)]

    runs = []

    def record(mode: str, result: dict, **extra) -> None:
        row = {"repeat": repeat, "tokenizer": tok_name, "data": data_name, "mode": mode, **result, **extra}
        runs.append(row)
        events = ", ".join(f"{k} {v:.2f}" for k, v in row["events"].items()) or "no trace events"
        print(f"  {stem} {mode}: {row['wall']:.2f} s wall ({events})", flush=True)

    try:
        if "cold" in args.modes or "hit" in args.modes:
            cold = timed_run(command(scratch / "cache"), run_env, scratch, scratch / "trace-cold.jsonl",
                             logs / f"{stem}-cold.log")
            manifest = json.loads((Path(cold["cache"]) / "manifest.json").read_text())
            sizes = {"rows": manifest.get("rows"), "tokens": manifest.get("tokens")}
            if "cold" in args.modes:
                record("cold", cold, **sizes)
            if "hit" in args.modes:
                hit = timed_run(command(scratch / "cache"), run_env, scratch, scratch / "trace-hit.jsonl",
                                logs / f"{stem}-hit.log")
                if hit["cache"] != cold["cache"]:
                    raise RuntimeError(f"the cache hit printed {hit['cache']!r}, not {cold['cache']!r}")
                record("hit", hit, **sizes)
        if "warm" in args.modes:
            idle = ("--server-idle", SERVER_IDLE) if features["server_idle"] else ()
            if idle:  # leave the server up, untimed
                measure(command(scratch / "cache-prime", ROOT / "examples" / "data", idle), env=run_env, cwd=scratch,
                        log=logs / f"{stem}-prime.log")
                wait_for_resident(run_env)
            warm = timed_run(command(scratch / "cache-warm", extra=idle), run_env, scratch,
                             scratch / "trace-warm.jsonl", logs / f"{stem}-warm.log")
            manifest = json.loads((Path(warm["cache"]) / "manifest.json").read_text())
            record("warm", warm, rows=manifest.get("rows"), tokens=manifest.get("tokens"),
                   server_warm=bool(idle))
    finally:
        if features["server_stop"]:
            stop_server(project, run_env, scratch, logs / f"{stem}-server-stop.log")
        shutil.rmtree(scratch, ignore_errors=True)
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """Medians per (tokenizer, data, mode), in the order first seen; an event missing in every run is None."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["tokenizer"], run["data"], run["mode"]), []).append(run)
    rows = []
    for (tokenizer, data, mode), members in groups.items():
        names = list(EVENTS) + sorted({e for r in members for e in r["events"]} - set(EVENTS))
        events = {}
        for name in names:
            values = [r["events"][name] for r in members if name in r["events"]]
            events[name] = round(statistics.median(values), 3) if values else None
        rows.append({"tokenizer": tokenizer, "data": data, "mode": mode, "repeats": len(members),
                     "wall": round(statistics.median(r["wall"] for r in members), 3),
                     "walls": [r["wall"] for r in members],
                     "peak_anon_mib": round(statistics.median(r["peak_anon_mib"] for r in members), 1),
                     "peak_pss_mib": round(statistics.median(r.get("peak_pss_mib", 0) for r in members), 1),
                     "rows": members[0].get("rows"), "tokens": members[0].get("tokens"),
                     "server_warm": members[0].get("server_warm"), "events": events})
    return rows


def event_columns(summary: list[dict]) -> list[str]:
    """EVENTS in their order, and any other event the CLI wrote placed where it happens: before the first
    column that comes later in the run (with the most events) where it occurs."""
    columns = list(EVENTS)
    extra = {e for row in summary for e, t in row["events"].items() if t is not None} - set(EVENTS)
    for name in sorted(extra):
        row = max((r["events"] for r in summary if r["events"].get(name) is not None),
                  key=lambda events: sum(t is not None for t in events.values()))
        later = [i for i, c in enumerate(columns) if row.get(c) is not None and row[c] > row[name]]
        columns.insert(later[0] if later else len(columns), name)
    return columns


def markdown(report: dict) -> str:
    m = report["machine"]
    features = report["features"]
    summary = report["summary"]
    columns = event_columns(summary)
    git = m.get("git") or {}
    lines = [
        "# Start-up: process start to first slice, publish and exit", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB, load average at start "
        f"{', '.join(map(str, m['load_average_at_start']))}; sft-tokenize {m['libraries']['sft-tokenize']}, prefect "
        f"{m['libraries']['prefect']}. Command: `{report['command']}`; project command `{report['project_cmd']}` "
        f"(`run --server-idle`: {'yes' if features['server_idle'] else 'no'}, `server stop`: "
        f"{'yes' if features['server_stop'] else 'no'}). Workers {report['workers']}, medians of "
        f"{report['repeats']} repeat(s). Measured at commit `{(git.get('commit') or 'unknown')[:12]}`"
        f"{' with uncommitted changes' if git.get('dirty') else ' (clean tree)'}.", "",
        "Event columns: seconds from the CLI process's start (its own start time, interpreter included) to each "
        f"`{TRACE_VARIABLE}` event, {MISSING} where the CLI wrote none. `wall`: subprocess start to exit, from "
        "outside.", "",
        "| tokenizer | data | run | " + " | ".join(columns) + " | wall s | peak PSS MiB | peak anon MiB |",
        "|---|---|---|" + "---:|" * (len(columns) + 3),
    ]
    for row in summary:
        data = f"{row['data']} ({row['rows']:,} rows, {row['tokens'] / 1e6:.2f}M tokens)" if row["tokens"] else \
            row["data"]
        label = MODE_LABELS[row["mode"]]
        if row["mode"] == "warm" and not row["server_warm"]:
            label = "cold, home reused (no `--server-idle`: server not warm)"
        cells = [MISSING if row["events"].get(name) is None else f"{row['events'][name]:.2f}" for name in columns]
        lines.append(f"| {row['tokenizer']} | {data} | {label} | " + " | ".join(cells) +
                     f" | {row['wall']:.2f} | {row.get('peak_pss_mib', 0):,.0f} | {row['peak_anon_mib']:,.0f} |")
    lines += ["", f"Tokenizers: {', '.join(f'{k} `{v}`' for k, v in report['tokenizers'].items())}. "
                  f"Inputs: {', '.join(f'{k} `{v}`' for k, v in report['inputs'].items())}. Cold runs start on empty "
                  "PREFECT_HOME and SFT_TOKENIZE_HOME directories: nothing is prepared before their clock."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case; medians reported (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="--workers of every run (default 2)")
    parser.add_argument("--tokenizers", default="example,qwen", help="subset of example,qwen (default both)")
    parser.add_argument("--data", default="example,short",
                        help="subset of example (examples/data) and short (the short corpus, 1/8 unit: ~3.5M "
                             "tokens) (default both)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)} (default all)")
    parser.add_argument("--project-cmd", default="", metavar="CMD",
                        help="the sft-tokenize command to time, e.g. another checkout's .venv/bin/sft-tokenize "
                             "(default this environment's)")
    parser.add_argument("--project-args", default="", metavar="ARGS", help="extra flags for every `run`")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where NAME.json and NAME.md go "
                                                                           "(default benchmarks/results)")
    parser.add_argument("--name", default="startup", help="the results' file name (default startup)")
    parser.add_argument("--work", type=Path, default=HERE / "work" / "startup",
                        help="scratch: Prefect homes, caches, logs (default benchmarks/work/startup)")
    args = parser.parse_args(argv)
    for name, allowed in (("tokenizers", ("example", "qwen")), ("data", ("example", "short")), ("modes", MODES)):
        chosen = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        if not chosen or set(chosen) - set(allowed):
            parser.error(f"--{name}: choose from {', '.join(allowed)}")
        setattr(args, name, chosen)
    if args.repeats < 1 or args.workers < 1:
        parser.error("--repeats and --workers must be positive")
    args.work, args.out = args.work.absolute(), args.out.absolute()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the current case's server, cleans up
    ad_hoc_environment()
    os.environ.pop(TRACE_VARIABLE, None)
    env = dict(ENV)
    project = project_command(args)
    args.work.mkdir(parents=True, exist_ok=True)
    features = capabilities(project, env, args.work)

    tokenizers = {"example": EXAMPLE_TOKENIZER}
    if "qwen" in args.tokenizers:
        tokenizers["qwen"] = qwen_tokenizer()
    tokenizers = {k: v for k, v in tokenizers.items() if k in args.tokenizers}
    inputs = {"example": ROOT / "examples" / "data"}
    if "short" in args.data:
        inputs["short"] = build(CorpusSpec.of("short", 0.125), 1, tokenizer=False)[1][0]
    inputs = {k: v for k, v in inputs.items() if k in args.data}

    print(f"`run --server-idle`: {features['server_idle']}, `server stop`: {features['server_stop']}", flush=True)

    report = {"command": shlex.join(["python", "benchmarks/startup.py", *(sys.argv[1:] if argv is None else argv)]),
              "project_cmd": shlex.join(project), "machine": machine(), "features": features,
              "workers": args.workers, "repeats": args.repeats,
              "tokenizers": {k: str(v) for k, v in tokenizers.items()},
              "inputs": {k: str(v) for k, v in inputs.items()}, "runs": [], "summary": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
        for tokenizer in tokenizers.items():
            for data in inputs.items():
                report["runs"] += one_repeat(repeat, tokenizer, data, args, project, features, env)
        report["summary"] = summarize(report["runs"])
        (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        (args.out / f"{args.name}.md").write_text(markdown(report))
    print()
    print(markdown(report))
    print(f"wrote {args.out / (args.name + '.json')}, {args.out / (args.name + '.md')}")


if __name__ == "__main__":
    main()
