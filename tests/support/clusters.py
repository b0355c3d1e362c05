"""Cluster processes for the tests: started each in its own process group (and, on request, its own working and
temporary directories, as on machines of their own), stopped by group, and checked to leave nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from support.cli import environment

# Ray clusters check a token. Ray reads its auth mode and token once a process, so every Ray head a test process
# starts, and that process as their driver, share this one (not ~/.ray's); set before Ray's first import.
RAY_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}


def cluster_env(home: Path, **extra: str) -> dict[str, str]:
    """The cluster processes' environment: no Prefect settings of this test session (a task gets the flow's
    settings with the task), their own PREFECT_HOME, no network for Hugging Face or Ray's usage stats."""
    return environment(home, startup_timeout=None, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", **extra)


@contextmanager
def started(*commands: list[str], env: dict[str, str], logs: Path, grace: float = 10,
            places: list[Path] | None = None) -> Iterator[None]:
    """Run each command in its own process group; on exit stop every group (SIGTERM, then SIGKILL after
    `grace` seconds) and check that no process they started is left running. With `places`, command i runs in
    places[i] with its own TMPDIR and SFT_TOKENIZE_HOME there, as on a machine of its own."""
    logs.mkdir(parents=True, exist_ok=True)
    processes = []
    try:
        for i, command in enumerate(commands):
            own, cwd = dict(env), None
            if places:
                cwd = places[i]
                (cwd / "tmp").mkdir(parents=True, exist_ok=True)
                own.update(TMPDIR=str(cwd / "tmp"), SFT_TOKENIZE_HOME=str(cwd / "home"))
            with open(logs / f"{Path(command[0]).name}-{i}.log", "wb") as log:
                processes.append(subprocess.Popen(command, env=own, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        yield
    finally:
        # Ray's workers start sessions of their own: collect every descendant before the groups go.
        tree = [psutil.Process(p.pid) for p in processes if p.poll() is None]
        tree += [child for parent in list(tree) for child in safe_children(parent)]
        for process in processes:
            with_group(process.pid, signal.SIGTERM)
        gone, alive = psutil.wait_procs(tree, timeout=grace)
        for process in alive:
            with_group(process.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.NoSuchProcess):  # the group's SIGKILL may have ended it already
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"still running after stop: {[p.cmdline() for p in left]}"
        for process in processes:
            process.wait(timeout=10)


def safe_children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def with_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)  # each command leads its own group


def wait_for_port(port: int, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    pytest.fail(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")
