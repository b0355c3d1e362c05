"""A real `prefect server start` on a free loopback port, as a team runs one: for the tests whose runs talk to
a server (PREFECT_API_URL) instead of starting Prefect's embedded one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.cli import environment, free_port
from support.paths import BIN


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to a process started in its own session (a server or serve.py shuts down gracefully on it), then
    SIGKILL to whatever is left of its process group."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def start_server(home: Path, port: int, **env: str) -> subprocess.Popen | None:
    """`prefect server start` on the port with PREFECT_HOME=home, once /api/health answers; None if it did not
    come up (its output is in home/server.log)."""
    with (home / "server.log").open("w") as log:
        process = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
                                    "--no-ui"], env=environment(home, startup_timeout=None, **env), stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2):
                return process
        except OSError:
            time.sleep(0.2)
    stop(process)
    return None


@contextlib.contextmanager
def prefect_server(home: Path, **env: str) -> Iterator[str]:
    """A Prefect server with its database in `home`, running while the block runs; yields its API URL."""
    home.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # another process may bind the free port first
        port = free_port()
        if process := start_server(home, port, **env):
            break
    else:
        pytest.fail(f"the Prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
    try:
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop(process)
