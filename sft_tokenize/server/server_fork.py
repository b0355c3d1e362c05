"""The embedded server's process forked from the CLI's instead of started anew (server/embedded_server.py decides).

A first run launches its server as soon as it knows there is work, by which time its own process has imported
Prefect. A new interpreter for the server would import Prefect again, ~0.9 s of CPU on a first run whose two cores
are busy until its first slice (the server booting in one process, the tokenizer loading in the other); a fork
starts with it imported. Only the CLI's own process is forked (a caller's process of the Python API may hold
anything, which the server would keep a copy of for its idle time), and only while it runs one Python thread, so
that no lock another thread holds is copied held; otherwise the server is started as a new process, the same way
the resident process and every test of the API start it.

The forked process is then made what the new process would have been: its own session, the log as its output,
the server's environment and settings, default signal handlers, and its command line shown as the new process's
would be (setproctitle). None of the run's files stays open in it: the run's locks above all, whose shared lease
would otherwise count as a run using the server for as long as the server lives.

The CLI's `run` forks that process earlier still, before its own imports (`fork_early`, from cli/resident.py's
entry point), when no server is configured, none is up on the PREFECT_HOME its environment names and a core is
spare (`spare_core`; SFT_TOKENIZE_EARLY_SERVER=1 or 0 decides instead): a first run's
server is then ready once its own boot is done, not once the run has planned and imported Prefect and the server
has booted after that (0.4–0.8 s of the bundled example's first run on two cores, docs/performance.md). The early
process is in a session of its own at once (a Ctrl-C reaches only the run), holds none of the run's descriptors,
and imports Prefect while the run plans; once the run knows it has work (`go_early`: its cache is missing), the
server's own modules, while the run imports Prefect in turn. The run then hands it the server's command line,
environment and log (`take_early`), or ends it (`discard_early`: a cache hit, a server already up, an error, the
run's exit), so a run that ends before it has work costs the early process's import of Prefect (~1 s of CPU), not
the server's (~3 s). A run killed before either leaves it nothing to read: it exits once its imports are done.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn


def single_threaded() -> bool:
    """This process runs no Python thread but this one, so none holds a lock its fork would copy held. (Native
    threads of pyarrow's allocator or numpy's BLAS may run: they handle a fork, as the encode pool's forks do.)"""
    return threading.active_count() == 1


class ForkedServer:
    """The server's process forked from this one (`serve_forked`), with what EmbeddedServer uses of
    subprocess.Popen."""

    def __init__(self, pid: int):
        """`pid`: this process's child that serves."""
        self.returncode: int | None = None
        self.pid = pid

    @classmethod
    def fork(cls, command: list[str], env: dict[str, str], log: int) -> ForkedServer:
        """`command`: the server process's command line (what a new process would run); `env`: its environment;
        `log`: the descriptor of its output."""
        pid = os.fork()
        if pid == 0:
            serve_forked(command, env, log)
        return cls(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: Popen takes it as 0 too
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def serve_forked(command: list[str], env: dict[str, str], log: int) -> NoReturn:
    """In the child just forked: become the process `command` would start (module docstring), then serve. Never
    returns: the run's atexit handlers and open files are not the server's."""
    code = 1
    try:
        from setproctitle import setproctitle

        if os.getsid(0) != os.getpid():  # an early process has its own session already
            os.setsid()  # Ctrl-C in the run's terminal does not reach it
        setproctitle(" ".join(command))  # what `ps` shows, and what finds it among processes
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        _silence_descriptors(null, keep={0, 1, 2})
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
        from sft_tokenize.server.server_process import serve

        serve(int(command[command.index("--port") + 1]))
        code = 0
    except SystemExit as exit_:  # uvicorn's, when the app does not start: what the interpreter makes of it
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - its log says why; the run sees it exit
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _silence_descriptors(null: int, keep: set[int]) -> None:
    """Point every descriptor of this process but `keep` at `null` (/dev/null's): the run's, which a forked server
    must not hold. Pointed rather than closed: a Python object of the run still holding a number would otherwise
    write to whatever file came to reuse it."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd != null and fd not in keep:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)


class EarlyServer:
    """The server's process forked at the CLI's start, importing Prefect's server until the run launches its server
    (`serve`) or has none to launch (`discard`); see the module docstring."""

    def __init__(self) -> None:
        read, self._orders = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._orders)
            _import_then_serve(read)
        os.close(read)
        self.going = False

    def go(self) -> None:
        """The run has work: import the server's own modules now (see _import_then_serve)."""
        if not self.going:
            self.going = True
            with contextlib.suppress(OSError):
                os.write(self._orders, GO)

    def serve(self, command: list[str], env: dict[str, str], log_path: str) -> ForkedServer | None:
        """Hand the early process the server's command line, environment and log (what ForkedServer gets); None if
        it is gone (the caller starts the server another way)."""
        self.go()
        order = json.dumps({"command": command, "env": env, "log": log_path}).encode()
        try:
            with os.fdopen(self._orders, "wb") as orders:
                orders.write(order)
        except OSError:
            self.discard()
            return None
        return ForkedServer(self.pid)

    def discard(self) -> None:
        """End it and reap it (no server is launched by this run)."""
        with contextlib.suppress(OSError):
            os.close(self._orders)
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


GO = b"\n"  # the first byte an early process reads: the run has work


def _import_then_serve(orders: int) -> NoReturn:
    """The early process: import Prefect while the run plans; once the run has work (GO), the server's own modules;
    then serve as the order read from `orders` says. Exits as soon as it finds `orders` closed unread, so that a
    run that ends before it has work (bad input, a cache hit) costs at most Prefect's import, not the server's."""
    code = 1
    try:
        os.setsid()
        _silence_descriptors(os.open(os.devnull, os.O_RDWR), keep={orders})  # the run's stdio, pipes and locks
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # as cli/main.py's process_environment
        with contextlib.suppress(Exception):  # one that fails fails again in serve_forked, which logs it
            import prefect  # noqa: F401
        if os.read(orders, len(GO)) == GO:
            with contextlib.suppress(Exception):
                import prefect.server.api.server  # noqa: F401
                import uvicorn  # noqa: F401

                import sft_tokenize.server.server_process  # noqa: F401
        with os.fdopen(orders, "rb") as pipe:
            order = pipe.read()
        if not order:
            code = 0
        else:
            order = json.loads(order)
            serve_forked(order["command"], order["env"], os.open(order["log"], os.O_WRONLY | os.O_APPEND))
    finally:
        os._exit(code)


_early: EarlyServer | None = None  # this process's early server process, until taken or discarded


def wants_early_server(argv: list[str]) -> bool:
    """Whether the command line `argv` may launch a server: a `run` that is not --help or --plan-only (which
    argparse also takes abbreviated)."""
    return argv[1:2] == ["run"] and not any(arg in ("-h", "--help") or arg.startswith("--plan") for arg in argv)


EARLY_SERVER_ENV = "SFT_TOKENIZE_EARLY_SERVER"  # 1: always fork it early; 0: never; unset: on a spare core


def spare_core(cpus: int, load: float) -> bool:
    """Whether a core may sit idle while this run plans: `cpus` this process may run on, `load` the last minute's
    average of runnable tasks. The early process imports Prefect once more (~1 s of CPU that a server forked later
    inherits from the run), a gain only on a core nothing else wants; on one core, or a machine whose cores were
    all busy (a test suite's), it would take the run's. The average also counts runs that just ended (a user's
    first runs one after another push it to ~1.7 on two cores), so only cores all busy count as none spare."""
    return cpus >= 2 and load < cpus


def _server_up() -> bool:
    """A live server is recorded on the PREFECT_HOME the environment names (a guess without Prefect's settings)."""
    from sft_tokenize.server.resident_processes import prefect_home
    from sft_tokenize.server.server_state import is_running, recorded_server, server_paths

    home = prefect_home(os.environ)
    state = recorded_server(server_paths(Path(home))[1]) if home else None
    return state is not None and is_running(state["pid"], state.get("started"))


def fork_early() -> None:
    """Fork the early server process if this run may launch a server: none configured (PREFECT_API_URL) and none
    up (_server_up; the run decides with Prefect's settings, and discards the process if the guess was wrong), on
    a spare core unless SFT_TOKENIZE_EARLY_SERVER says otherwise."""
    global _early
    choice = os.environ.get(EARLY_SERVER_ENV, "")
    if _early is not None or choice == "0" or os.environ.get("PREFECT_API_URL") or not single_threaded():
        return
    if not hasattr(os, "sched_getaffinity"):  # not Linux, whose /proc the early process reads (its descriptors)
        return
    if choice != "1" and not spare_core(len(os.sched_getaffinity(0)), os.getloadavg()[0]):
        return
    if _server_up():
        return
    _early = EarlyServer()
    atexit.register(discard_early)


def go_early() -> None:
    """This run has work (its cache is missing): the early server process, if any, goes on to the server's imports,
    unless a server came up while this run planned (a run started beside it launched one), which it will join."""
    if _early is not None:
        if _server_up():
            discard_early()
        else:
            _early.go()


def take_early() -> EarlyServer | None:
    """The early server process, for the run to launch its server with; None if there is none (any more)."""
    global _early
    early, _early = _early, None
    return early


def discard_early() -> None:
    if (early := take_early()) is not None:
        early.discard()
