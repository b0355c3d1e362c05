"""The embedded Prefect server of ad-hoc runs: one per PREFECT_HOME, shared by every run on it.

With no API URL configured, Prefect would start a temporary server inside each run once its flow begins:
it imports the whole server package into the flow's process (about 2.5 s and 75 MiB, for a class that
only launches a subprocess), then waits for that subprocess to boot (seconds; far more on a loaded
machine), and every run boots its own server on the same SQLite database. Runs started together on a
busy machine then time out one after another.

Instead, the CLI launches Prefect's own server app (`prefect.server.api.server:create_app` under uvicorn,
ephemeral mode, no UI; `python -m sft_tokenize.server.server_process` adds only the idle end) once per
PREFECT_HOME and lets every run on that home use it. The CLI's process forks it rather than start a new
interpreter, which would import Prefect again (server/server_fork.py). This module launches it, joins it, waits for
it and leaves it; server/server_state.py holds the files that record it and the runs using it (lock, state, lease).

A warm server: once its last run has left, the server stays up for an idle time (`run --server-idle SECONDS`,
default 300, or SFT_TOKENIZE_SERVER_IDLE), so that run, inspect, edit, run pays the boot once; a run that joins
meanwhile uses it. The server checks every second, under the join lock, whether some run holds a lease; once
none has for its idle time it ends (no record of its own, or idle 0: at once). With idle 0 the last run to
leave stops the server itself, as does the last run of a server that never answered it (bad input found while
it booted) whatever the idle time: it is killed at once, before it creates or migrates its database. A server
whose runs were all killed exits by itself after its idle time; one whose process is gone is replaced by the
next run. `sft-tokenize server status` reports it, `sft-tokenize server stop` stops it (refused while runs use
it, unless --force).

A server that dies under a run (killed, out of memory) is noticed within a second by the run's watch thread, as is
`server stop --force`, which records the stop (server/server_state.py) before it signals the server: Prefect's client
stops retrying and drops the logs and events it can no longer send, logging stops (the flow engine's crash report
and its unrecordable final state would follow the run's line), and the flow is unwound with ServerLost as Ctrl-C
unwinds it (its slices stop, flows/interrupts.py). The run ends with one line saying what happened to the server
(exit 1); its finished shards stay, and the same command starts a fresh server and resumes.

The first run launches the server as soon as it knows there is work, so the server boots while this process
loads the tokenizer and cuts the slices, and waits for it up to STARTUP_TIMEOUT seconds (longer if Prefect's own
setting says so), failing at once if the server process exits. The server runs in its own session, so Ctrl-C
in one run's terminal does not stop the server under another run. What its boot leaves out (SERVER_CUTS and the
known-database record) and what that saves is in docs/performance.md ("The embedded server's boot").

The server's own output (its services complain when they are stopped mid-flush, e.g. `task_run_recorder - Error
flushing ... CancelledError`) goes to PREFECT_HOME/embedded-server.log, not to any run's stderr: a successful run
prints only its progress and run log. A server that fails to start is reported with its last error line.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import prefect.context
from prefect.context import refresh_global_settings_context
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_UI_URL,
    get_current_settings,
    temporary_settings,
)

from sft_tokenize.errors import first_line
from sft_tokenize.files import is_locked, locked
from sft_tokenize.server.server_fork import ForkedServer, single_threaded, take_early
from sft_tokenize.server.server_state import (
    DEFAULT_SERVER_IDLE,
    SERVER_APP,
    SERVER_IDLE_ENV,
    answers,
    is_running,
    local_client,
    recorded_server,
    server_paths,
    start_time,
    stopped_by_command,
    terminate,
    write_state,
)

# Prefect's default (20 s) is too short for a boot beside a training job, a pip install or other runs.
STARTUP_TIMEOUT = 180.0
API_CHECK_TIMEOUT = 10.0
# Services that an ad-hoc run does not use. The first does run in an ephemeral server (0.2 s of its boot); the
# perpetual ones do not (Prefect 3.9) and are disabled should a later Prefect run them there.
SERVER_CUTS = {f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in (
    "TRIGGERS", "SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "REPOSSESSOR")}
SERVER_CUTS["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"


WATCH_INTERVAL = 0.5  # seconds between the watch thread's looks at the server's process
LOST_SIGNAL = signal.SIGUSR1  # how the watch thread reaches the main thread (a signal wakes a blocking wait)


class ServerUnavailable(RuntimeError):
    """No Prefect API answers: the embedded server could not start, or PREFECT_API_URL is not reachable."""


class ServerLost(KeyboardInterrupt):
    """The embedded server's process died under this run. Raised in the main thread while it runs Prefect's code, a
    KeyboardInterrupt so that the flow unwinds as on Ctrl-C: workers stopped, finished shards kept."""


def _drop_undeliverable() -> None:
    """Empty the queues of Prefect's log and event senders: with the server gone they would retry each item at
    exit, for minutes, printing each one."""
    from prefect._internal.concurrency.services import _QueueServiceBase
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in list(_QueueServiceBase._instances.values()):
        if isinstance(service, (EventsWorker, APILogWorker)):
            while True:
                try:
                    if service._queue.get_nowait() is None:  # the stop sentinel stays: the sender ends on it
                        service._queue.put_nowait(None)
                        break
                except queue.Empty:
                    break
                service._queue.task_done()


def _in_flow(frame) -> bool:
    """The main thread is in Prefect's flow engine (or the flow it called): not yet out of the run, nor at exit."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "prefect.flow_engine":
            return True
        frame = frame.f_back
    return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_api_reachable(url: str, timeout: float = API_CHECK_TIMEOUT) -> None:
    """A configured PREFECT_API_URL answers within `timeout` seconds, or ServerUnavailable says so in one line
    (Prefect's client would otherwise retry for minutes and print its tracebacks)."""
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:  # a team's server, maybe over TLS: verified
        while True:
            try:
                response = client.get(f"{url.rstrip('/')}/health", timeout=max(1.0, min(5.0, timeout / 2)))
                if response.status_code == 200:
                    return
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as error:
                problem = f"{type(error).__name__}: {first_line(error) or 'no answer'}"
            if time.monotonic() >= deadline:
                raise ServerUnavailable(f"the Prefect API at {url} (PREFECT_API_URL) does not answer within "
                                        f"{timeout:.0f} s ({problem}); start it or unset PREFECT_API_URL")
            time.sleep(0.5)


class EmbeddedServer:
    """The shared Prefect API on 127.0.0.1 of every ad-hoc run on this PREFECT_HOME."""

    def __init__(self, idle: float | None = None, fork: bool = False) -> None:
        """`idle`: seconds the server stays up once this run leaves it last (default SFT_TOKENIZE_SERVER_IDLE, the
        CLI's --server-idle, or 300). `fork`: this process is the CLI's, small and ours, and a server it launches
        may be forked from it while it runs one thread (not a caller's process: the server would keep a copy of
        whatever it holds)."""
        if idle is None:
            try:
                idle = float(os.environ.get(SERVER_IDLE_ENV) or DEFAULT_SERVER_IDLE)
            except ValueError:
                idle = DEFAULT_SERVER_IDLE
        self.idle = idle
        self.fork = fork
        home = get_current_settings().home
        self.home = Path(home)
        self.lock_path, self.state_path, self.lease_path = server_paths(home)
        self.log_path = Path(home) / "embedded-server.log"
        self.pid, self.started = 0, None
        self.url: str | None = None
        self.process: subprocess.Popen | ForkedServer | None = None  # set when this run launched the server
        self.answered = False  # this run has seen it answer
        self._lease: contextlib.ExitStack | None = None  # this run's shared flock on the lease file, while it uses
        self._settings = None
        self.lost: str | None = None  # why this run failed, once its server's process is gone

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
        command = [sys.executable, "-m", "sft_tokenize.server.server_process", SERVER_APP, "--port", str(port)]
        with self._open_log(port) as log:  # the child keeps its own copy of the descriptor
            early = take_early() if self.fork else None
            self.process = early.serve(command, env, log.name) if early is not None else None
            if self.process is None and self.fork and single_threaded():
                self.process = ForkedServer.fork(command, env, log.fileno())
            elif self.process is None:
                self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        return {"pid": self.process.pid, "started": start_time(self.process.pid), "port": port,
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
        with locked(self.lock_path):
            self._lease = contextlib.ExitStack()  # held until release()
            self._lease.enter_context(locked(self.lease_path, shared=True))
            state = self._read_state() or self._launch()
            # In use again; the run that joined or left last sets how long it idles once no run uses it.
            state = {key: value for key, value in state.items() if key != "idle_since"}
            write_state(self.state_path, {**state, "idle": self.idle})
        self.pid, self.started, self.url = state["pid"], state["started"], state["url"]
        atexit.register(self.release)

    def _alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return is_running(self.pid, self.started)

    def wait_until_ready(self) -> None:
        timeout = max(STARTUP_TIMEOUT, get_current_settings().server.ephemeral.startup_timeout_seconds)
        deadline = time.monotonic() + timeout
        with local_client() as client:
            while not answers(self.url, client):
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
        settings = self._settings.__enter__()
        self._watch([settings, prefect.context.GLOBAL_SETTINGS_CONTEXT.settings])
        return self.url

    def _watch(self, settings: list) -> None:
        """Watch the server's process while this run uses it (see the module's docstring). From the main thread
        only: it alone can take a signal handler, and a run in another thread fails as Prefect's client does."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_lost_signal(signum, frame) -> None:
            if self.lost and _in_flow(frame):  # out of the flow (reporting the error, exiting) it is ignored
                raise ServerLost(self.lost)

        signal.signal(LOST_SIGNAL, on_lost_signal)

        def watch() -> None:
            stopped_by = None
            while self._lease is not None and self._alive():
                # `server stop --force` records the stop before it signals the server, which then takes seconds to
                # shut down: the run ends at once instead of talking to a server on its way out.
                if (stopped_by := stopped_by_command(self.home, self.pid, self.started)) is not None:
                    break
                time.sleep(WATCH_INTERVAL)
            if self._lease is None:  # this run left the server: it ended as it does, not under the run
                return
            if stopped_by is None:  # gone before this thread saw the record
                stopped_by = stopped_by_command(self.home, self.pid, self.started)
            what = (f"was stopped during the run by `sft-tokenize server stop --force` (pid {stopped_by})"
                    if stopped_by is not None else
                    f"went away during the run (killed, or out of memory; its log: {self.log_path})")
            self.lost = (f"the embedded Prefect server (pid {self.pid}) {what}; the finished slices stay in the shard "
                         "store: run the same command again to resume on a fresh server")
            for each in settings:  # every call to the dead server now fails at once instead of backing off
                each.client.max_retries = 0
                each.logging.to_api.enabled = False
                each.internal.logging_level = "CRITICAL"  # Prefect's services' own logger reads only this
            # Each undeliverable log batch and event would print its complaint after the run's one line, and the
            # flow engine its crash and a final state it could not record ("Finished in state Running()"): the
            # run's one line says what happened, so nothing is logged until the flow has unwound (run_tokenize
            # turns logging back on, for a process that goes on after the run).
            logging.raiseExceptions = False
            for name in ("prefect.events.clients", "EventsWorker", "APILogWorker"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
            logging.disable(logging.CRITICAL)
            _drop_undeliverable()
            threading._register_atexit(_drop_undeliverable)  # what is queued meanwhile, before Prefect drains it
            while self._lease is not None:  # until the main thread is out of Prefect's code, whatever it waits on
                signal.pthread_kill(threading.main_thread().ident, LOST_SIGNAL)
                time.sleep(1)

        threading.Thread(target=watch, name="embedded-server-watch", daemon=True).start()

    def _answers(self) -> bool:
        """The server has booted: this run saw it answer, or it answers now (a warm server this run joined)."""
        if not self.answered and self.url is not None:
            with local_client() as client:
                self.answered = answers(self.url, client, timeout=1)
        return self.answered

    def release(self) -> None:
        """Leave the server; the last run to leave leaves it idle (stops it if idle is 0 or it never answered)."""
        if self._lease is None:
            return
        with locked(self.lock_path):
            # Under the join lock no run joins meanwhile: a lease still held after this run's is dropped is
            # another run's.
            self._lease.close()
            self._lease = None
            last = not is_locked(self.lease_path)
            state = self._own_state()
            if last and (self.idle <= 0 or not self._answers()):
                self._stop()
                if state is not None:
                    self.state_path.unlink(missing_ok=True)
            elif state is not None:
                write_state(self.state_path, {**state, "idle": self.idle, **({"idle_since": time.time()} if last
                                                                               else {})})

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
        terminate(self.pid, self.started, stop)


def idle_server() -> dict | None:
    """The embedded server of this PREFECT_HOME, if it is up and this process's runs use it (its Prefect points
    at it, or at no server): its pid and start."""
    settings = get_current_settings()
    state = recorded_server(server_paths(Path(settings.home))[1])
    if state is None or settings.api.url not in (None, state["url"]):
        return None
    return {"pid": state["pid"], "started": state["started"]}
