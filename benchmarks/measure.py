"""Run one command as a subprocess and measure it: wall seconds and the peak memory of its process tree.

Memory is sampled every 50 ms by a thread over the subprocess, all its descendants and any other process the
caller names (a server the command talks to but did not start), two ways, each with its own peak:

- `RssAnon` (/proc/<pid>/status) summed: anonymous pages only. File-backed pages (a memory-mapped Arrow file,
  the page cache) do not count; copy-on-write pages a forked child still shares with its parent count once per
  process.
- PSS (`Pss` of /proc/<pid>/smaps_rollup, what psutil's memory_full_info().pss reads) summed: every resident
  page, anonymous or file-backed, divided among the processes that map it, so a page shared after a fork, or a
  library every process maps, counts once in the sum. The sum is what the tree costs the machine.

Also `read_trace()`: the events a CLI run wrote to its SFT_TOKENIZE_TRACE file, and `git_state()`: the commit
a result was measured at, and whether the tree had uncommitted changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

# Seconds between two samples. The smoke test of the scripts (tests/workflow/test_benchmarks.py), which measures
# nothing, samples every half second: reading every process's PSS 20 times a second was most of a script's own CPU.
SAMPLE_SECONDS = float(os.environ.get("SFT_TOKENIZE_BENCH_SAMPLE_SECONDS") or 0.05)
TRACE_VARIABLE = "SFT_TOKENIZE_TRACE"  # the CLI appends {"event": NAME, "t": SECONDS} lines to this file


def _proc_bytes(path: str, key: bytes) -> int:
    """A `KEY: N kB` line of a /proc file, in bytes; 0 if the process is gone or is a zombie (no such line)."""
    try:
        with open(path, "rb") as lines:
            for line in lines:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def rss_anon_bytes(pid: int) -> int:
    """RssAnon of one process, 0 if it is gone."""
    return _proc_bytes(f"/proc/{pid}/status", b"RssAnon:")


def pss_bytes(pid: int) -> int:
    """PSS of one process (every resident page divided among the processes mapping it), 0 if it is gone."""
    return _proc_bytes(f"/proc/{pid}/smaps_rollup", b"Pss:")


def tree_pids(root: psutil.Process, others: Iterable[int] = ()) -> list[int]:
    """`root`, its descendants, and the processes `others` with theirs, each once."""
    pids: list[int] = []
    for process in (root, *(psutil.Process(pid) for pid in others if psutil.pid_exists(pid))):
        try:
            pids += [process.pid] + [child.pid for child in process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return list(dict.fromkeys(pids))


def tree_rss_anon(root: psutil.Process) -> dict[int, int]:
    """RssAnon bytes of every process of the tree under (and including) `root`, by pid."""
    return {pid: rss_anon_bytes(pid) for pid in tree_pids(root)}


def describe(pid: int) -> str:
    """A short name for a process of the tree: its command line, trimmed."""
    try:
        words = psutil.Process(pid).cmdline()
    except psutil.Error:
        return "?"
    return " ".join(Path(words[0]).name if i == 0 else word for i, word in enumerate(words[:4]))[:100]


class PeakTreeMemory:
    """A thread that samples the tree under `pid` (and under the pids `others()` returns at each sample) until
    stopped and keeps the peak of each sum, RssAnon and PSS."""

    def __init__(self, pid: int, interval: float = SAMPLE_SECONDS, others: Callable[[], Iterable[int]] | None = None):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.others = others or (lambda: ())
        self.peak = self.peak_pss = 0
        self.peak_processes: list[tuple[str, int]] = []  # (command, RssAnon bytes) at the peak, largest first
        self.peak_pss_processes: list[tuple[str, int]] = []  # (command, PSS bytes) at the PSS peak
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pids = tree_pids(self.root, self.others())
            except psutil.Error:
                pids = []
            for reader, attribute in ((rss_anon_bytes, "peak"), (pss_bytes, "peak_pss")):
                usage = {pid: reader(pid) for pid in pids}
                if sum(usage.values()) > getattr(self, attribute):
                    setattr(self, attribute, sum(usage.values()))
                    setattr(self, f"{attribute}_processes",
                            sorted(((describe(pid), size) for pid, size in usage.items() if size),
                                   key=lambda item: -item[1]))
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakTreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Measured:
    seconds: float
    peak_anon_bytes: int
    stdout: str
    stderr: str
    samples: int
    peak_processes: list[tuple[str, int]]
    peak_pss_bytes: int = 0
    peak_pss_processes: list[tuple[str, int]] | None = None

    @property
    def peak_anon_mib(self) -> float:
        return self.peak_anon_bytes / 2**20

    @property
    def peak_pss_mib(self) -> float:
        return self.peak_pss_bytes / 2**20


def measure(command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
            log: Path | None = None, others: Callable[[], Iterable[int]] | None = None) -> Measured:
    """Run `command` to completion, sampling its tree's memory (and that of the processes `others()` names, with
    their descendants); raise with its stderr if it fails."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, cwd=cwd)
    with PeakTreeMemory(process.pid, others=others) as memory:
        stdout, stderr = process.communicate()
        seconds = time.perf_counter() - started
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(command)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    if process.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited with {process.returncode}:\n{tail}")
    return Measured(seconds, memory.peak, stdout, stderr, memory.samples, memory.peak_processes, memory.peak_pss,
                    memory.peak_pss_processes)


def end_process(process: subprocess.Popen, seconds: float = 30) -> None:
    """Terminate a server the benchmark started, killing it if it has not ended within `seconds`."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(command: list[str], url: str, log: Path, timeout: float,
            env: dict[str, str] | None = None) -> Iterator[None]:
    """Run the server `command` (its output to `log`) until the block ends; the block starts once `url` answers.
    Exits naming the log if the server ends first or does not answer within `timeout` seconds."""
    with log.open("wb") as stream:
        server = subprocess.Popen(command, env=env, stdout=stream, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):  # refused, or an error status (HTTPError)
                urllib.request.urlopen(url, timeout=2)
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{Path(command[0]).name} did not answer on {url} (log: {log})")
            time.sleep(0.3)
        yield
    finally:
        end_process(server)


def git_state(root: Path) -> dict:
    """The commit of the checkout at `root` and whether its tracked files differed from it (`dirty`), with the
    differing paths; what a result file records, so that its figures can be traced to the code they measured."""
    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", str(root), *words], capture_output=True, text=True, check=True).stdout

    try:
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
        # The last commit that changed what a run executes (not benchmarks/): two results with the same one
        # measured the same project code, whatever the benchmark scripts' commits.
        code = git("log", "-1", "--format=%H", "--", "sft_tokenize", "flows", "tasks", "pyproject.toml").strip()
        return {"commit": git("rev-parse", "HEAD").strip(), "branch": git("rev-parse", "--abbrev-ref", "HEAD").strip(),
                "dirty": bool(changed), "changed": changed[:20], "project_code_commit": code}
    except (OSError, subprocess.CalledProcessError) as error:
        return {"commit": None, "dirty": None, "error": str(error)[:200]}


def read_trace(path: Path) -> dict[str, float]:
    """event -> t (the first of each name), from the JSON lines the CLI appended; {} if none."""
    events: dict[str, float] = {}
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            events.setdefault(str(record["event"]), float(record["t"]))
        except (ValueError, KeyError, TypeError):
            continue
    return events
