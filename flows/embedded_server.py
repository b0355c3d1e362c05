"""The embedded Prefect server of ad-hoc runs: one per PREFECT_HOME, shared by every run on it.

With no API URL configured, Prefect would start a temporary server inside each run once its flow begins:
it imports the whole server package into the flow's process (about 2.5 s and 75 MiB, for a class that
only launches a subprocess), then waits for that subprocess to boot (seconds; far more on a loaded
machine), and every run boots its own server on the same SQLite database. Runs started together on a
busy machine then time out one after another.

Instead, the CLI launches Prefect's own server app (`prefect.server.api.server:create_app` under uvicorn,
ephemeral mode, no UI; `python -m sft_tokenize.flows.server_process` adds only the lease check below) once per
PREFECT_HOME and lets every run on that home use it:

    sft-tokenize-server.lock   an flock held while a run joins or leaves (guards the two files below), and by
                               a server that ends itself until its process is gone: no second server ever
                               opens the database while the first still writes to it
    sft-tokenize-server.json   the server's pid, start time, port and URL; its idle time ("idle", seconds) and,
                               while no run uses it, since when ("idle_since", wall clock)
    sft-tokenize-server.lease  every run using the server holds a shared flock on it; the run that leaves
                               last (its exclusive flock succeeds) leaves the server idle, or stops it

A warm server: once its last run has left, the server stays up for an idle time (`run --server-idle SECONDS`,
default 300, or SFT_TOKENIZE_SERVER_IDLE), so that run, inspect, edit, run pays the boot once; a run that joins
meanwhile uses it. The idle time reaches the server through the .json: every run writes its own there when it
joins and when it leaves (the last writer wins), and the last to leave also writes "idle_since". The server
itself checks every second, under the join lock, whether some run holds a lease; once none has for "idle"
seconds it ends (no .json of its own, or idle 0: at once). With idle 0 the last run to leave stops the server
itself, as does the last run of a server that never answered it (bad input found while it booted) whatever the
idle time: it is killed at once, before it creates or migrates its database. An idle server is a process of
about 175 MiB (215 MiB after a full boot, below). `sft-tokenize server status` reports it, `sft-tokenize server
stop` stops it (refused while runs use it, unless --force).

The kernel drops a lease when its process dies, however it dies, and the server checks every second that some
run still holds one: a server whose runs were all killed (SIGKILL, the OOM killer) exits by itself, after its idle
time. A server whose process is gone (the same pid with another start time is another process) is replaced by the
next run. The first run launches the server as soon as it knows there is work, so the server boots while this process
loads the tokenizer and cuts the slices, and waits for it up to STARTUP_TIMEOUT seconds (longer if Prefect's own
setting says so), failing at once if the server process exits. The server runs in its own session, so Ctrl-C
in one run's terminal does not stop the server under another run.

Its boot (Prefect 3.9, two cores, a migrated database: 2.65 s to /health, of which 1.8 s is importing prefect and
its server and 0.25 s building the app, which no setting avoids) is cut to 2.25 s where an ad-hoc run loses
nothing. The launched server runs without the automations' triggers and actions (about 0.2 s: ReactiveTriggers,
Actions, the proactive-triggers service) and without telemetry; the perpetual services of a full server (scheduler,
late runs, foreman, pause expirations, cancellation cleanup, repossessor) do not run in an ephemeral server and are
disabled explicitly. It keeps what run records, retries, artifacts, logs, events and the UI read: the task run
recorder, the event persister, the event distributor, the log endpoints, the docket worker. The migrations (0.08
s) and the block-type registration check (0.18 s, and 30 MiB: it imports the Prefect collections, dask and ray) run
only when this server's database is not the one a full boot left: sft-tokenize-server-boot.json records, after a
full boot, this Prefect's version and collections, the SQLite file, its Alembic revision and its number of block
types, all read again in a few milliseconds before the next boot (never skipped for a database other than a local
SQLite file). What the user sets in the environment or the profile wins over these defaults.

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
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_UI_URL,
    get_current_settings,
    temporary_settings,
)

SERVER_APP = "prefect.server.api.server:create_app"
# Prefect's default (20 s) is too short for a boot beside a training job, a pip install or other runs.
STARTUP_TIMEOUT = 180.0
API_CHECK_TIMEOUT = 10.0
SHUTDOWN_TIMEOUT = 30.0  # a server that ends itself is killed by itself after this
# Services that an ad-hoc run does not use. The first does run in an ephemeral server (0.2 s of its boot); the
# perpetual ones do not (Prefect 3.9) and are disabled should a later Prefect run them there.
SERVER_CUTS = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "TRIGGERS", "SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "REPOSSESSOR")}
SERVER_CUTS["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"


class ServerUnavailable(RuntimeError):
    """No Prefect API answers: the embedded server could not start, or PREFECT_API_URL is not reachable."""


def server_paths(home: Path) -> tuple[Path, Path, Path]:
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


def _health(url: str, client: httpx.Client, timeout: float = 2) -> bool:
    try:
        return client.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def recorded_server(state_path: Path) -> dict | None:
    """The server recorded in `state_path`, if its process still runs."""
    try:
        state = json.loads(state_path.read_text())
        return state if _running(state["pid"], state["started"]) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(state_path: Path, state: dict) -> None:
    tmp = state_path.with_name(f"{state_path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, state_path)


def _leases(lease_path: Path) -> int:
    """How many runs hold a lease now: the shared flocks on the lease file (/proc/locks), waiters not counted."""
    try:
        info = os.stat(lease_path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return 0
    ident = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    return sum(1 for fields in map(str.split, lines) if fields[1:2] == ["FLOCK"] and fields[3:4] == ["READ"]
               and fields[5:6] == [ident])


def _terminate(pid: int, started: int | None, stop: int = signal.SIGTERM, timeout: float = 10) -> None:
    """Signal the process (`pid`, `started`) and wait until it is gone, killing it after `timeout` seconds."""
    if not _running(pid, started):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, stop)
    deadline = time.monotonic() + timeout
    while _running(pid, started):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.05)


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

    def __init__(self, idle: float | None = None) -> None:
        """`idle`: seconds the server stays up once this run leaves it last (default SFT_TOKENIZE_SERVER_IDLE, the
        CLI's --server-idle, or 300)."""
        if idle is None:
            from sft_tokenize.flows.arguments import DEFAULT_SERVER_IDLE, SERVER_IDLE_ENV

            try:
                idle = float(os.environ.get(SERVER_IDLE_ENV) or DEFAULT_SERVER_IDLE)
            except ValueError:
                idle = DEFAULT_SERVER_IDLE
        self.idle = idle
        home = get_current_settings().home
        self.lock_path, self.state_path, self.lease_path = server_paths(home)
        self.log_path = Path(home) / "embedded-server.log"
        self.pid, self.started = 0, None
        self.url: str | None = None
        self.process: subprocess.Popen | None = None  # set when this run launched the server
        self.answered = False  # this run has seen it answer
        self._lease = None
        self._settings = None

    @staticmethod
    def needed() -> bool:
        """No server is configured and Prefect may start one (it would start its own otherwise)."""
        settings = get_current_settings()
        return not settings.api.url and settings.server.ephemeral.enabled

    def _read_state(self) -> dict | None:
        return recorded_server(self.state_path)

    def _own_state(self) -> dict | None:
        """The recorded server, if it is still the one this run joined."""
        state = self._read_state()
        return state if state is not None and (state["pid"], state["started"]) == (self.pid, self.started) else None

    def _launch(self) -> dict:
        port = _free_port()
        env = {**SERVER_CUTS, **os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
        with self._open_log(port) as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sft_tokenize.flows.server_process", SERVER_APP, "--port", str(port)],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return {"pid": self.process.pid, "started": _start_time(self.process.pid), "port": port,
                "url": f"http://127.0.0.1:{port}/api"}

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
            # In use again; the run that joined or left last sets how long it idles once no run uses it.
            state = {key: value for key, value in state.items() if key != "idle_since"}
            write_state(self.state_path, {**state, "idle": self.idle})
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
        updates = {PREFECT_API_URL: self.url, PREFECT_UI_URL: ""}
        if get_current_settings().flows.model_fields_set.isdisjoint({"heartbeat_frequency"}):
            # Heartbeats let a worker's server mark a crashed deployment run; this server has no automations to
            # read them, and Prefect's heartbeat thread sleeps in whole seconds, so the flow's end waited up to 1 s
            # for it to notice the stop.
            updates[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
        # Kept: a context manager that is garbage-collected is exited, and its settings with it.
        self._settings = temporary_settings(updates=updates)
        self._settings.__enter__()
        return self.url

    def _answers(self) -> bool:
        """The server has booted: this run saw it answer, or it answers now (a warm server this run joined)."""
        if not self.answered and self.url is not None:
            with httpx.Client() as client:
                self.answered = _health(self.url, client, timeout=1)
        return self.answered

    def release(self) -> None:
        """Leave the server; the last run to leave leaves it idle (stops it if idle is 0 or it never answered)."""
        if self._lease is None:
            return
        with _locked(self.lock_path):
            fcntl.flock(self._lease, fcntl.LOCK_UN)
            try:
                fcntl.flock(self._lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                last = False  # other runs still use it
            else:
                last = True
            state = self._own_state()
            if last and (self.idle <= 0 or not self._answers()):
                self._stop()
                if state is not None:
                    self.state_path.unlink(missing_ok=True)
            elif state is not None:
                write_state(self.state_path, {**state, "idle": self.idle, **({"idle_since": time.time()} if last
                                                                               else {})})
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
        _terminate(self.pid, self.started, stop)


class ServerInUse(RuntimeError):
    """`server stop` without --force while runs use the server."""


def _seconds(value: float) -> str:
    return f"{max(0, round(value))} s"


def server_status() -> list[tuple[str, str]]:
    """`sft-tokenize server status`: the facts about this PREFECT_HOME's embedded server, one per line."""
    home = Path(get_current_settings().home)
    _, state_path, lease_path = server_paths(home)
    where = [("PREFECT_HOME", str(home)), ("log", str(home / "embedded-server.log"))]
    state = recorded_server(state_path)
    if state is None:
        return [("embedded server", "not running"), *where]
    with httpx.Client() as client:
        answering = _health(state["url"], client, timeout=1)
    runs, idle = _leases(lease_path), float(state.get("idle", 0))
    if runs:
        left = "in use"
    elif idle <= 0:
        left = "none: stopping"
    else:
        left = f"{_seconds(idle - (time.time() - state.get('idle_since', time.time())))} left of {_seconds(idle)}"
    uptime = float(Path("/proc/uptime").read_text().split()[0]) - state["started"] / os.sysconf("SC_CLK_TCK")
    return [("embedded server", "running" if answering else "running, starting (not answering yet)"),
            ("pid", str(state["pid"])), ("url", state["url"]), ("uptime", _seconds(uptime)),
            ("runs using it", str(runs)), ("idle time", left), *where]


def stop_server(force: bool = False) -> str:
    """`sft-tokenize server stop`: stop this PREFECT_HOME's embedded server and wait until its process is gone.
    Refused (ServerInUse) while runs use it, unless `force` (those runs then fail)."""
    home = Path(get_current_settings().home)
    lock_path, state_path, lease_path = server_paths(home)
    if not state_path.exists():
        return "no embedded server is running"
    with _locked(lock_path):  # no run joins meanwhile; a server ending itself holds it until it is gone
        state = recorded_server(state_path)
        if state is None:
            return "no embedded server is running"
        with open(lease_path, "a") as lease:
            try:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
                runs = 0
            except BlockingIOError:
                runs = max(1, _leases(lease_path))
            if runs and not force:
                raise ServerInUse(f"the embedded server (pid {state['pid']}) is in use by "
                                  f"{'1 run: let it' if runs == 1 else f'{runs} runs: let them'} finish, or pass "
                                  "--force (they fail)")
            _terminate(state["pid"], state["started"], timeout=SHUTDOWN_TIMEOUT)
            state_path.unlink(missing_ok=True)
    used = "" if not runs else "; 1 run was using it" if runs == 1 else f"; {runs} runs were using it"
    return f"stopped the embedded server (pid {state['pid']}) of PREFECT_HOME {home}{used}"
