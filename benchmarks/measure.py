"""Run one command as a subprocess and measure it: wall seconds and the peak anonymous RAM of its process tree.

Memory is the sum of `RssAnon` (/proc/<pid>/status) over the subprocess and all its descendants, sampled
every 50 ms by a thread; the peak of that sum is reported. File-backed pages (a memory-mapped Arrow file,
the page cache) are not anonymous and do not count; copy-on-write pages a forked child shares with its
parent count once per process, as RssAnon does.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

SAMPLE_SECONDS = 0.05


def rss_anon_bytes(pid: int) -> int:
    """RssAnon of one process, 0 if it is gone or is a zombie (no such line)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def tree_rss_anon(root: psutil.Process) -> dict[int, int]:
    """RssAnon bytes of every process of the tree under (and including) `root`, by pid."""
    try:
        pids = [root.pid] + [child.pid for child in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    return {pid: rss_anon_bytes(pid) for pid in pids}


def describe(pid: int) -> str:
    """A short name for a process of the tree: its command line, trimmed."""
    try:
        words = psutil.Process(pid).cmdline()
    except psutil.Error:
        return "?"
    return " ".join(Path(words[0]).name if i == 0 else word for i, word in enumerate(words[:4]))[:100]


class PeakTreeMemory:
    """A thread that samples the tree under `pid` until stopped and keeps the peak of the sum."""

    def __init__(self, pid: int, interval: float = SAMPLE_SECONDS):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.peak_processes: list[tuple[str, int]] = []  # (command, RssAnon bytes) at the peak, largest first
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            usage = tree_rss_anon(self.root)
            if sum(usage.values()) > self.peak:
                self.peak = sum(usage.values())
                self.peak_processes = sorted(((describe(pid), size) for pid, size in usage.items() if size),
                                             key=lambda item: -item[1])
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

    @property
    def peak_anon_mib(self) -> float:
        return self.peak_anon_bytes / 2**20


def measure(command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
            log: Path | None = None) -> Measured:
    """Run `command` to completion, sampling its tree's memory; raise with its stderr if it fails."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, cwd=cwd)
    with PeakTreeMemory(process.pid) as memory:
        stdout, stderr = process.communicate()
        seconds = time.perf_counter() - started
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {' '.join(command)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    if process.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited with {process.returncode}:\n{tail}")
    return Measured(seconds, memory.peak, stdout, stderr, memory.samples, memory.peak_processes)
