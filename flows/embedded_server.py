"""The embedded Prefect server of ad-hoc runs: one per PREFECT_HOME, shared by every run on it.

With no API URL configured, Prefect would start a temporary server inside each run once its flow begins:
it imports the whole server package into the flow's process (about 2.5 s and 75 MiB, for a class that
only launches a subprocess), then waits for that subprocess to boot (seconds; far more on a loaded
machine), and every run boots its own server on the same SQLite database. Runs started together on a
busy machine then time out one after another.

Instead, the CLI launches Prefect's own server app (`prefect.server.api.server:create_app` under uvicorn,
ephemeral mode, no UI; `python -m flows.embedded_server` adds only the lease check below) once per
PREFECT_HOME and lets every run on that home use it:

    sft-tokenize-server.lock   an flock held while a run joins or leaves (guards the two files below), and by
                               a server that ends itself until its process is gone: no second server ever
                               opens the database while the first still writes to it
    sft-tokenize-server.json   the server's pid, start time, port and URL
    sft-tokenize-server.lease  every run using the server holds a shared flock on it; the run that leaves
                               last (its exclusive flock succeeds) stops the server and removes the .json

The kernel drops a lease when its process dies, however it dies, and the server checks every second that some
run still holds one: a server whose runs were all killed (SIGKILL, the OOM killer) exits by itself. A server
whose process is gone (the same pid with another start time is another process) is replaced by the next run.
The first run launches the server as soon as it knows there is work, so the server boots while this process
loads the tokenizer and cuts the slices, and waits for it up to STARTUP_TIMEOUT seconds (longer if Prefect's own
setting says so), failing at once if the server process exits. The server runs in its own session, so Ctrl-C
in one run's terminal does not stop the server under another run.

The server's own output (its services complain when they are stopped mid-flush, e.g. `task_run_recorder - Error
flushing ... CancelledError`) goes to PREFECT_HOME/embedded-server.log, not to any run's stderr: a successful
run prints only its progress and run log. A server that fails to start is reported with its last error line.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prefect.context import refresh_global_settings_context
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, get_current_settings, temporary_settings

SERVER_APP = "prefect.server.api.server:create_app"
# Prefect's default (20 s) is too short for a boot beside a training job, a pip install or other runs.
STARTUP_TIMEOUT = 180.0
API_CHECK_TIMEOUT = 10.0
SHUTDOWN_TIMEOUT = 30.0  # a server that ends itself is killed by itself after this


class ServerUnavailable(RuntimeError):
    """No Prefect API answers: the embedded server could not start, or PREFECT_API_URL is not reachable."""


def _paths(home: Path) -> tuple[Path, Path, Path]:
    """The lock, the state file and the lease file of a PREFECT_HOME's shared server."""
    return (home / "sft-tokenize-server.lock", home / "sft-tokenize-server.json",
            home / "sft-tokenize-server.lease")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_time(pid: int) -> int | None:
    """When the live process `pid` started (clock ticks since boot), or None if it is gone or a zombie.

    With the pid, this names one process for good (a pid is reused, its start time is not). The command line would
    not do: it reads empty until the child's exec completes, some time after Popen returns."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _running(pid: int, started: int | None) -> bool:
    """The process recorded as (`pid`, `started`) is still running (a server that died at once has no start)."""
    return started is not None and _start_time(pid) == started


def _health(url: str, client: httpx.Client) -> bool:
    try:
        return client.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def check_api_reachable(url: str, timeout: float = API_CHECK_TIMEOUT) -> None:
    """A configured PREFECT_API_URL answers within `timeout` seconds, or ServerUnavailable says so in one line
    (Prefect's client would otherwise retry for minutes and print its tracebacks)."""
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while True:
            try:
                response = client.get(f"{url.rstrip('/')}/health", timeout=max(1.0, min(5.0, timeout / 2)))
                if response.status_code == 200:
                    return
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as error:
                problem = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no answer'}"
            if time.monotonic() >= deadline:
                raise ServerUnavailable(f"the Prefect API at {url} (PREFECT_API_URL) does not answer within "
                                        f"{timeout:.0f} s ({problem}); start it or unset PREFECT_API_URL")
            time.sleep(0.5)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class EmbeddedServer:
    """The shared Prefect API on 127.0.0.1 of every ad-hoc run on this PREFECT_HOME."""

    def __init__(self) -> None:
        home = get_current_settings().home
        self.lock_path, self.state_path, self.lease_path = _paths(home)
        self.log_path = Path(home) / "embedded-server.log"
        self.pid, self.started = 0, None
        self.url: str | None = None
        self.process: subprocess.Popen | None = None  # set when this run launched the server
        self.answered = False  # this run has seen it answer
        self._lease = None

    @staticmethod
    def needed() -> bool:
        """No server is configured and Prefect may start one (it would start its own otherwise)."""
        settings = get_current_settings()
        return not settings.api.url and settings.server.ephemeral.enabled

    def _read_state(self) -> dict | None:
        try:
            state = json.loads(self.state_path.read_text())
            return state if _running(state["pid"], state["started"]) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _launch(self) -> dict:
        port = _free_port()
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
        with self._open_log(port) as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flows.embedded_server", SERVER_APP, "--port", str(port)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        state = {"pid": self.process.pid, "started": _start_time(self.process.pid), "port": port,
                 "url": f"http://127.0.0.1:{port}/api"}
        tmp = self.state_path.with_name(f"{self.state_path.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)
        return state

    def _open_log(self, port: int):
        """PREFECT_HOME/embedded-server.log, appended to (a temporary file if PREFECT_HOME is not writable)."""
        try:
            log = self.log_path.open("ab")  # noqa: SIM115 - closed by _launch()
        except OSError:
            log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by _launch() once the server has it
                prefix="prefect-embedded-server-", suffix=".log", delete=False)
            self.log_path = Path(log.name)
        log.write(f"--- embedded server on port {port}, launched by pid {os.getpid()}\n".encode())
        log.flush()
        return log

    def last_error(self) -> str:
        """The last line of the server's log that is not a traceback frame: the error it died of."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            text = line.strip()
            if text and not line.startswith(" ") and "Traceback" not in text and "Background on this error" not in \
                    text and "startup failed" not in text:
                return text
        return ""

    def start(self) -> None:
        """Join the shared server, launching it if no live one is recorded; it is left at exit (atexit runs
        after Prefect has sent its last logs and events, which drain in threading's exit hooks)."""
        if self._lease is not None:
            return
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.lock_path):
            self._lease = open(self.lease_path, "a")  # noqa: SIM115 - held until release()
            fcntl.flock(self._lease, fcntl.LOCK_SH)
            state = self._read_state() or self._launch()
        self.pid, self.started, self.url = state["pid"], state["started"], state["url"]
        atexit.register(self.release)

    def _alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return _running(self.pid, self.started)

    def wait_until_ready(self) -> None:
        timeout = max(STARTUP_TIMEOUT, get_current_settings().server.ephemeral.startup_timeout_seconds)
        deadline = time.monotonic() + timeout
        with httpx.Client() as client:
            while not _health(self.url, client):
                if not self._alive():
                    code = f" with code {self.process.returncode}" if self.process is not None else ""
                    raise ServerUnavailable(f"the embedded Prefect server (pid {self.pid}) exited{code} while "
                                            f"starting: {self.last_error()} (its log: {self.log_path}); run the "
                                            "same command again")
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"the embedded Prefect server did not answer on {self.url} within "
                                            f"{timeout:.0f} s (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS; its "
                                            f"log: {self.log_path})")
                time.sleep(0.1)
        self.answered = True

    def use(self) -> str:
        """Join the server, wait until it answers, and point this process's Prefect at it for the rest of the
        process's life (with no UI URL: this server serves no UI). Not only for the flow: logs and events
        still drain at exit, and a run interrupted mid-flow has process-pool messages in flight; with no API
        URL left, Prefect would boot a server of its own for them."""
        self.start()
        self.wait_until_ready()
        # Threads that Prefect starts without this context (the process pool's event forwarding) read the
        # global settings, which come from the environment: without this, each would boot a server of its own.
        os.environ["PREFECT_API_URL"] = self.url
        refresh_global_settings_context()
        temporary_settings(updates={PREFECT_API_URL: self.url, PREFECT_UI_URL: ""}).__enter__()
        return self.url

    def release(self) -> None:
        """Leave the server; the last run to leave stops it."""
        if self._lease is None:
            return
        with _locked(self.lock_path):
            fcntl.flock(self._lease, fcntl.LOCK_UN)
            try:
                fcntl.flock(self._lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # other runs still use it
            else:
                self._stop()
                self.state_path.unlink(missing_ok=True)
            self._lease.close()
            self._lease = None

    def _stop(self) -> None:
        # No run uses it. One that never answered this run (bad input found while it booted) is killed at once:
        # stopped gracefully, it would first finish booting and create its database.
        stop = signal.SIGTERM if self.answered else signal.SIGKILL
        if self.process is not None:
            self.process.send_signal(stop)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            return
        if not self._alive():
            return
        os.kill(self.pid, stop)
        deadline = time.monotonic() + 10
        while self._alive():
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)


def serve(port: int) -> None:
    """The server process: Prefect's app under uvicorn, and a thread that ends it once no run holds a lease."""
    import threading

    import uvicorn

    lock_path, state_path, lease_path = _paths(get_current_settings().home)
    server = uvicorn.Server(uvicorn.Config(SERVER_APP, factory=True, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="on"))

    def end_when_unused() -> None:
        while not server.should_exit:
            time.sleep(1)
            lock = open(lock_path, "a")  # noqa: SIM115 - kept locked until this process is gone, if it ends
            fcntl.flock(lock, fcntl.LOCK_EX)
            with open(lease_path, "a") as lease:
                try:
                    fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    lock.close()  # a run uses this server
                    continue
            with contextlib.suppress(OSError, ValueError):
                if json.loads(state_path.read_text())["pid"] == os.getpid():
                    state_path.unlink()
            # The join lock stays held while this server shuts down, so that no run launches another server on
            # the same database meanwhile (it would migrate it while this one still writes to it). The kernel
            # drops it when this process exits; a shutdown that hangs is cut short.
            server.should_exit = True
            time.sleep(SHUTDOWN_TIMEOUT)
            os._exit(0)

    threading.Thread(target=end_when_unused, daemon=True).start()
    server.run()


if __name__ == "__main__":
    serve(int(sys.argv[sys.argv.index("--port") + 1]))
