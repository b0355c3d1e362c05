"""The resident process: `sft-tokenize run` with its imports already done.

Importing Prefect, datasets and transformers takes ~2.5 s of one core, every run, before any row is read: with a
warm server that is most of a small run. A run that leaves the embedded server up (`--server-idle` above 0) also
starts a resident process beside it, with the same environment. The resident imports what a run imports, then
waits; the next `sft-tokenize run` of this user with that environment and these installed files hands it its
arguments, working directory, environment and its stdin, stdout and stderr (the descriptors themselves, over a
Unix socket), and the resident forks a child that runs the command as this process would have. The command waits,
passes Ctrl-C and SIGTERM on to the child, and exits with the child's exit code. Nothing else differs: the child
reads the same files, joins the same server, writes the same cache and prints the same lines.

When it is not used: no resident for this environment (the command runs in its own process, as before), one still
importing (the command waits for it, which is never longer than importing itself), SFT_TOKENIZE_RESIDENT=0, or not
Linux. The resident ends with the server it was started beside (`sft-tokenize server stop` ends both), after the
children it forked. It forks only while it runs a single thread, and serves only its own user (SO_PEERCRED).

This module is the `sft-tokenize` entry point (console_main): it imports nothing beyond the standard library
until it knows where the command runs.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

RESIDENT_ENV = "SFT_TOKENIZE_RESIDENT"  # 0: never use or start a resident process
_in_child = False  # this process is a resident's child: it runs a command, it starts no resident
_command_env: dict[str, str] | None = None  # the command's environment as it started (a run changes its own)
READY_TIMEOUT = 60.0  # how long a command waits for a resident that is still importing
# Read by the command at run time only (the child gets the command's own environment), so they may differ
# between the resident and the command it serves.
RUNTIME_VARIABLES = frozenset({"SFT_TOKENIZE_CONSOLE", "SFT_TOKENIZE_SERVER_IDLE", "SFT_TOKENIZE_TRACE",
                               "TRANSFORMERS_NO_ADVISORY_WARNINGS", "PREFECT_SERVER_ANALYTICS_ENABLED",
                               "PWD", "OLDPWD", "_", "SHLVL", "COLUMNS", "LINES"})


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get(RESIDENT_ENV, "1") != "0"


def _code_stamp(paths: list[str]) -> list:
    """What changes when packages are installed or removed (a site-packages directory's mtime) or this project's
    code is edited (an editable install's files)."""
    stamp = []
    for entry in paths:
        try:
            stamp.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            continue
    here = Path(__file__).resolve().parent.parent
    stamp.append(max((p.stat().st_mtime_ns for p in here.rglob("*.py")), default=0))
    return stamp


def resident_key(environ: Mapping[str, str], paths: list[str]) -> str:
    """Which resident may run a command: the same interpreter, import path, installed files and environment
    (what the imports read of it is fixed when they run), and the same user."""
    environment = sorted((k, v) for k, v in environ.items() if k not in RUNTIME_VARIABLES)
    described = [os.getuid(), sys.executable, sys.version, paths, environment, _code_stamp(paths)]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32]


def _address(key: str) -> str:
    # An abstract socket (Linux): no file to clean up after a killed resident; SO_PEERCRED keeps other users out.
    return f"\0sft-tokenize-resident-{os.getuid()}-{key}"


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], list(fds))


def _receive(sock: socket.socket, fds: int = 0) -> tuple[dict, list[int]]:
    """One message (and up to `fds` descriptors sent with it); EOFError if the other side closed first."""
    head, received, _, _ = socket.recv_fds(sock, 4, fds)
    if len(head) < 4:
        raise EOFError
    (size,) = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return json.loads(data), received


# The command's side.

def run_in_resident(argv: list[str]) -> int | None:
    """Run the command `argv` in a resident process and return its exit code; None if no resident can run it
    (the caller runs it itself). Ctrl-C, SIGTERM and SIGHUP sent to this process are passed on to the child."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_address(resident_key(os.environ, sys.path)))
        sock.settimeout(READY_TIMEOUT)
        _receive(sock)  # the resident is ready: its imports are done
        from sft_tokenize.build.timeline import TRACE_ENV, process_start

        started = process_start() if os.environ.get(TRACE_ENV) else 0.0
        _send(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask(),
                     "started": started}, [0, 1, 2])
        child = _receive(sock)[0]["pid"]
    except (OSError, EOFError, ValueError, KeyError):
        sock.close()
        return None
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: _pass_on(child, signum))
    sock.settimeout(None)
    try:
        return int(_receive(sock)[0]["exit"])
    except (OSError, EOFError, ValueError, KeyError):
        print("sft-tokenize: error: the resident process ended before the run did; run the same command again "
              f"(or with {RESIDENT_ENV}=0)", file=sys.stderr)
        return 1


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pass_on(child: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signum)


def _start_beside_server() -> None:
    """At the exit of a run made in its own process: if it left the embedded server up, start the resident."""
    if "prefect" not in sys.modules:  # a cache hit, or a run that ended before it needed a server
        return
    from sft_tokenize.flows.embedded_server import idle_server

    with contextlib.suppress(Exception):  # best effort: the next run simply runs in its own process
        if server := idle_server():
            start_resident(server)


def start_resident(server: dict) -> None:
    """Start this environment's resident process beside the embedded server `server` (its state record), unless
    one is up already: it ends with that server."""
    if _in_child or _command_env is None or not enabled():
        return
    # Bound here, before this command exits: the next one connects at once, and waits while the resident imports.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_address(resident_key(_command_env, sys.path)))
        listener.listen(16)
    except OSError:  # one is up (or importing)
        listener.close()
        return
    code = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
            "from sft_tokenize.flows.resident import serve; serve(*json.loads(sys.argv[2]))")
    with listener, contextlib.suppress(OSError):
        subprocess.Popen([sys.executable, "-c", code, json.dumps(sys.path), json.dumps([listener.fileno(), server])],
                         env=_command_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=[listener.fileno()])


def console_main() -> None:
    """The `sft-tokenize` command: `run` in this user's resident process when one fits, else in this process."""
    global _command_env
    _command_env = dict(os.environ)
    if len(sys.argv) > 1 and sys.argv[1] == "run" and enabled():
        code = run_in_resident(sys.argv)
        if code is not None:
            sys.exit(code)
        atexit.register(_start_beside_server)  # run after the server is left (atexit runs the last-registered first)
    from sft_tokenize.flows.cli import console_main

    console_main()


# The resident's side.

def _preload() -> None:
    """What a run imports, so that its child does not: the run's own modules, Prefect's engines and what they
    import on first use, datasets' writer, transformers' template compiler and the tokenizer libraries."""
    import importlib

    from sft_tokenize.flows.cli import keep_torch_out, process_environment

    process_environment()
    keep_torch_out()
    for name in ("sft_tokenize.flows.api", "sft_tokenize.flows.tokenize_dataset", "sft_tokenize.flows.embedded_server",
                 "sft_tokenize.flows.interrupts", "sft_tokenize.build.workers", "sft_tokenize.build.shard",
                 "sft_tokenize.build.shard_writer", "sft_tokenize.build.publish", "datasets.arrow_writer",
                 "prefect.flow_engine", "prefect.task_engine", "fastapi.encoders", "transformers",
                 "transformers.utils.chat_template_utils", "tokenizers", "fastokens"):
        try:
            importlib.import_module(name)
        except ImportError:
            if not name.startswith("fastokens"):  # an optional extra
                raise


def serve(listening: int, server: dict) -> None:
    """The resident process, on the socket `listening` that its command bound (a command that connects meanwhile
    waits): import, then fork a child per command until the server `server` (its state record) is gone and no
    child runs."""
    from sft_tokenize.flows.server_state import is_running

    listener = socket.socket(fileno=listening)
    _preload()
    # A fork copies only the thread that calls it: a lock another Python thread held would stay held in the child.
    # (Native pools started by the imports, OpenBLAS's and jemalloc's, have fork handlers of their own.)
    if threading.active_count() != 1:
        return
    import gc

    gc.freeze()  # what the imports made stays shared with the children, not copied by their collections
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_read, selectors.EVENT_READ, "reap")
    children: dict[int, socket.socket] = {}
    while children or is_running(server["pid"], server["started"]):
        for event, _ in selector.select(timeout=1.0):
            if event.data == "accept":
                _accept(listener, selector, children, (listener, wake_read, wake_write))
            elif event.data == "reap":
                while os.read(wake_read, 512) == 512:
                    pass
            else:  # a command's connection: it closed (killed) while its child runs
                selector.unregister(event.fileobj)
                _pass_on(event.data, signal.SIGTERM)
        _reap(children, selector)


def _accept(listener: socket.socket, selector: selectors.BaseSelector, children: dict[int, socket.socket],
            own: tuple) -> None:
    conn, _ = listener.accept()
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    if uid != os.getuid():
        conn.close()
        return
    try:
        conn.settimeout(10)
        _send(conn, {"ready": True})
        request, fds = _receive(conn, 3)
    except (OSError, EOFError, ValueError):  # the command gave up waiting
        conn.close()
        return
    pid = os.fork()
    if pid == 0:  # the child keeps only its command's connection and descriptors
        for resource in (*own, selector, *children.values()):
            os.close(resource) if isinstance(resource, int) else resource.close()
        _run_child(conn, request, fds)
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"pid": pid})
    except OSError:
        _pass_on(pid, signal.SIGTERM)
    children[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            _send(conn, {"exit": code if code >= 0 else 128 - code})
        with contextlib.suppress(KeyError, ValueError):  # unregistered when the command closed it
            selector.unregister(conn)
        conn.close()


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> NoReturn:
    """In the forked child: become the command (its descriptors, directory, environment, arguments) and run it."""
    global _in_child
    _in_child = True
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
    conn.close()
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    # The streams over the command's descriptors, buffered as the interpreter would have made them there.
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stdout = open(1, "w", encoding=sys.stdout.encoding, closefd=False,  # noqa: SIM115
                      buffering=1 if os.isatty(1) else -1)
    sys.stderr = open(2, "w", encoding=sys.stderr.encoding, errors="backslashreplace", closefd=False,  # noqa: SIM115
                      buffering=1)
    code = 1
    try:
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        from sft_tokenize.build.timeline import count_from
        from sft_tokenize.flows.cli import console_main

        count_from(request["started"])
        console_main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - a bug: its traceback, as the command's own process would print it
        import traceback

        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)

