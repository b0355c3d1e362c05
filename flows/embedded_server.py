"""The embedded Prefect server of an ad-hoc run, started by the CLI as soon as it knows there is work.

With no API URL configured, Prefect starts a temporary server itself once the flow begins: it first imports
the whole server package into the flow's process (about 2.5 s and 75 MiB, for a class that only launches a
subprocess), then waits for that subprocess to boot (about 5 s). The CLI launches the same subprocess with
Prefect's own command line (uvicorn serving `prefect.server.api.server:create_app`, ephemeral mode, no UI),
lets it boot while this process loads the tokenizer and cuts the slices, and points the flow at it with
PREFECT_API_URL. Process-pool and cluster workers inherit that URL, as they would Prefect's own server's.

The server's own logs (its services complain when they are stopped mid-flush, e.g. `task_run_recorder - Error
flushing ... CancelledError`) go to PREFECT_HOME/embedded-server.log, not to the run's stderr: a successful
run prints only its progress and run log. A server that fails to start is reported with its last error line.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import prefect
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, get_current_settings, temporary_settings


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedServer:
    """A temporary Prefect API on 127.0.0.1 for this process's flow runs."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @staticmethod
    def needed() -> bool:
        """No server is configured and Prefect may start one (it would start its own otherwise)."""
        settings = get_current_settings()
        return not settings.api.url and settings.server.ephemeral.enabled

    def start(self) -> None:
        """Launch it (once); it boots in its own process and is stopped at exit, as Prefect stops its own:
        after Prefect has sent its last logs and events (they drain in threading's exit hooks, before atexit's)."""
        if self.process is not None:
            return
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               **get_current_settings().to_environment_variables(exclude_unset=True)}
        log = self._open_log()
        with log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
                 "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                 "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        atexit.register(self.stop)

    def _open_log(self):
        """PREFECT_HOME/embedded-server.log, appended to (a temporary file if PREFECT_HOME is not writable)."""
        try:
            home = Path(get_current_settings().home).expanduser()
            home.mkdir(parents=True, exist_ok=True)
            log = (home / "embedded-server.log").open("ab")  # noqa: SIM115 - closed by start()
        except OSError:
            log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by start() once the server has it
                prefix="prefect-embedded-server-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        log.write(f"--- embedded server on port {self.port}, pid {os.getpid()}\n".encode())
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

    def wait_until_ready(self) -> None:
        timeout = get_current_settings().server.ephemeral.startup_timeout_seconds
        deadline = time.monotonic() + timeout
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the embedded Prefect server exited with code {self.process.returncode} "
                                       f"while starting: {self.last_error()} (its log: {self.log_path})")
                try:
                    if client.get(f"{self.url}/health", timeout=1).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"the embedded Prefect server did not answer on {self.url} within {timeout} s "
                           f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS; its log: {self.log_path})")

    @contextmanager
    def serving(self) -> Iterator[str]:
        """Start it if need be, wait until it answers, and point this process's Prefect at it for the block
        (with no UI URL: this server serves no UI)."""
        self.start()
        self.wait_until_ready()
        with temporary_settings(updates={PREFECT_API_URL: self.url, PREFECT_UI_URL: ""}):
            yield self.url

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
