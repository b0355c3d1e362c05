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
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import NoReturn


def single_threaded() -> bool:
    """This process runs no Python thread but this one, so none holds a lock its fork would copy held. (Native
    threads of pyarrow's allocator or numpy's BLAS may run: they handle a fork, as the encode pool's forks do.)"""
    return threading.active_count() == 1


class ForkedServer:
    """The server's process forked from this one (`serve_forked`), with what EmbeddedServer uses of
    subprocess.Popen."""

    def __init__(self, command: list[str], env: dict[str, str], log: int):
        """`command`: the server process's command line (what a new process would run); `env`: its environment;
        `log`: the descriptor of its output."""
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            serve_forked(command, env, log)

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

        os.setsid()  # Ctrl-C in the run's terminal does not reach it
        setproctitle(" ".join(command))  # what `ps` shows, and what finds it among processes
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        # The run's other descriptors are pointed at /dev/null rather than closed: a Python object of the run still
        # holding a number would otherwise write to whatever file came to reuse it.
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2 and fd != null:
                with contextlib.suppress(OSError):
                    os.dup2(null, fd)
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
