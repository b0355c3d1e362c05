"""The files that record a PREFECT_HOME's shared embedded server, and who uses it.

Every run on one PREFECT_HOME, and the server's own process (server/server_process.py), agree through three files:

    sft-tokenize-server.lock   an flock held while a run joins or leaves (guards the two files below), and by
                               a server that ends itself until its process is gone: no second server ever
                               opens the database while the first still writes to it
    sft-tokenize-server.json   the server's pid, start time, port and URL; its idle time ("idle", seconds) and,
                               while no run uses it, since when ("idle_since", wall clock)
    sft-tokenize-server.lease  every run using the server holds a shared flock on it; the run that leaves
                               last (no other holds it) leaves the server idle, or stops it

and one more, written by `sft-tokenize server stop` before it stops a server that runs still use (--force):

    sft-tokenize-server.stopped  the stopped server's pid and start time, and the pid of the command that stopped
                                 it: a run using that server ends at once, saying so, rather than blaming a kill

Every run writes its own idle time into the .json when it joins and when it leaves (the last writer wins), and
the last to leave also writes "idle_since". The kernel drops a lease when its process dies, however it dies, so
the leases are always the runs alive now. A server is named by its pid and start time together: the same pid
with another start time is another process, and the server it recorded is gone. Whether a recorded server answers
and how it is stopped are here too: a run and `server status`/`stop` (server/server_commands.py) both ask.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sft_tokenize.files import atomic_write

if TYPE_CHECKING:
    import httpx

SERVER_IDLE_ENV = "SFT_TOKENIZE_SERVER_IDLE"  # the default of --server-idle (the test suite sets 0)
DEFAULT_SERVER_IDLE = 300  # seconds a server stays up once its last run has left
SERVER_APP = "prefect.server.api.server:create_app"  # what the server's process serves, under uvicorn
SHUTDOWN_TIMEOUT = 30.0  # a server that ends itself is killed by itself after this


def server_paths(home: Path) -> tuple[Path, Path, Path]:
    """The lock, the state file and the lease file of a PREFECT_HOME's shared server."""
    return (home / "sft-tokenize-server.lock", home / "sft-tokenize-server.json",
            home / "sft-tokenize-server.lease")


def stopped_path(home: Path) -> Path:
    """The record of a server that `server stop --force` stopped under its runs."""
    return home / "sft-tokenize-server.stopped"


def stopped_by_command(home: Path, pid: int, started: int | None) -> int | None:
    """The pid of the `server stop --force` that stopped the server (`pid`, `started`), or None if none did."""
    try:
        record = json.loads(stopped_path(home).read_text())
        return int(record["by"]) if (record["pid"], record["started"]) == (pid, started) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def start_time(pid: int) -> int | None:
    """When the live process `pid` started (clock ticks since boot), or None if it is gone or a zombie.

    With the pid, this names one process for good (a pid is reused, its start time is not). The command line would
    not do: it reads empty until the child's exec completes, some time after Popen returns."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def is_running(pid: int, started: int | None) -> bool:
    """The process recorded as (`pid`, `started`) is still running (a server that died at once has no start)."""
    return started is not None and start_time(pid) == started


def recorded_server(state_path: Path) -> dict | None:
    """The server recorded in `state_path`, if its process still runs."""
    try:
        state = json.loads(state_path.read_text())
        return state if is_running(state["pid"], state["started"]) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(state_path: Path, state: dict) -> None:
    # Not durable: the record describes a running process, which a crash of the machine ends too.
    atomic_write(state_path, json.dumps(state), durable=False)


def count_leases(lease_path: Path) -> int:
    """How many runs hold a lease now: the shared flocks on the lease file (/proc/locks), waiters not counted."""
    try:
        info = os.stat(lease_path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return 0
    ident = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    return sum(1 for fields in map(str.split, lines) if fields[1:2] == ["FLOCK"] and fields[3:4] == ["READ"]
               and fields[5:6] == [ident])


def local_client() -> httpx.Client:
    """A client for the embedded server, which answers plain HTTP on 127.0.0.1: no TLS, so no CA bundle to load
    (~15 ms of a core for each client otherwise)."""
    import httpx  # here: every command imports this module, and most never ask a server anything

    return httpx.Client(verify=False)


def answers(url: str, client: httpx.Client, timeout: float = 2) -> bool:
    """The server at `url` answers its health check within `timeout` seconds."""
    import httpx

    try:
        return client.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def terminate(pid: int, started: int | None, stop: int = signal.SIGTERM, timeout: float = 10) -> None:
    """Signal the process (`pid`, `started`) and wait until it is gone, killing it after `timeout` seconds."""
    if not is_running(pid, started):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, stop)
    deadline = time.monotonic() + timeout
    while is_running(pid, started):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.05)
