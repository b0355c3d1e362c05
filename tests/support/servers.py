"""A real `prefect server start` on a free loopback port, as a team runs one: for the tests whose runs talk to
a server (PREFECT_API_URL) instead of starting Prefect's embedded one. The servers still running on a Prefect
home. And a server that accepts and never answers, for the tests of remote reads that would hang."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sft_tokenize.files import locked
from support import lanes
from support.cli import environment, free_port
from support.paths import BIN


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def servers_of(home: Path) -> list[int]:
    """The live processes running a Prefect server with this PREFECT_HOME."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "prefect.server.api.server:create_app" in " ".join(process.info["cmdline"] or []) \
                    and process.environ().get("PREFECT_HOME") == str(home) and running(process.pid):
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


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
    lanes.require("server", "`prefect server start`")
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
    process, url = _started_server(home, **env)
    try:
        yield url
    finally:
        stop(process)


def _started_server(home: Path, **env: str) -> tuple[subprocess.Popen, str]:
    """start_server on a free port, tried again on another if it did not come up; the process and its API URL."""
    for _ in range(3):  # another process may bind the free port first
        port = free_port()
        if process := start_server(home, port, **env):
            return process, f"http://127.0.0.1:{port}/api"
    pytest.fail(f"the Prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")


SHARED_SERVER = "prefect-server.json"  # in the run's shared directory: the one server the whole run's workers use


@contextlib.contextmanager
def shared_prefect_server(shared: Path, template: Path) -> Iterator[str]:
    """One Prefect server for the whole test run, whichever pytest-xdist worker asks first: its home is a copy of
    `template` in `shared` (the directory the workers' temporary directories are in); later callers find its
    record there. It outlives the block: `stop_shared_server(shared)` ends it once the run ends. The services no
    CLI run uses (the scheduler, late runs, triggers…) are off, as on the embedded server: idle, they took a
    twentieth of a core for the whole run."""
    from sft_tokenize.server.embedded_server import SERVER_CUTS

    record = shared / SHARED_SERVER
    with locked(shared / (SHARED_SERVER + ".lock")):
        found = json.loads(record.read_text()) if record.exists() else None
        if found is None or not running(found["pid"]):
            home = shared / f"prefect-server-{uuid.uuid4().hex[:8]}"
            shutil.copytree(template, home)
            process, url = _started_server(home, **SERVER_CUTS)
            found = {"pid": process.pid, "url": url}
            record.write_text(json.dumps(found))
    yield found["url"]


def stop_shared_server(shared: Path) -> None:
    """SIGTERM, then SIGKILL, to the shared server's process group, if one was started in `shared`."""
    record = shared / SHARED_SERVER
    if not record.exists():
        return
    pid = json.loads(record.read_text())["pid"]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
    record.unlink()


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (what a hung HTTP server
    looks like to its client): `url(path)` names it, `accepted` counts its connections."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._socket.settimeout(0.05)  # accept() wakes to see `close`: closing a socket does not wake it
        self.port = self._socket.getsockname()[1]
        self._held: list = []
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            self._held.append(connection)

    @property
    def accepted(self) -> int:
        return len(self._held)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        self._socket.close()
        for connection in self._held:
            connection.close()


@contextlib.contextmanager
def silent_server() -> Iterator[SilentServer]:
    """A SilentServer for the block, closed after it."""
    server = SilentServer()
    try:
        yield server
    finally:
        server.close()
