"""The resident process: `sft-tokenize run` with its imports already done, on request (`run --resident`, or
SFT_TOKENIZE_RESIDENT=1; Linux).

Importing Prefect, datasets and transformers takes ~2.5 s of one core, every run, before any row is read: with a
warm server that is most of a small run. A run that asks for the resident and leaves the embedded server up
(`--server-idle` above 0) also starts, as it exits, a resident process beside it with its environment. The
resident imports what a run imports, prepares the last run's tokenizer and starts the encode pool its job would
use (workers.start_early), then waits for one command: the next `sft-tokenize run --resident` of this user,
PREFECT_HOME and run-relevant environment (resident_key) hands it its arguments, working directory, environment
and its stdin, stdout and stderr (the descriptors themselves, over a Unix socket), and the resident runs the
command as that process would have, then exits. The command waits, passes Ctrl-C, SIGTERM and SIGHUP on to it,
and exits with its exit code; the resident reads the same files, joins the same server, writes the same cache and
prints the same lines. Each run it serves starts the next resident as it exits, so a resident serves one run and
holds nothing of another.

Bounds: one resident per user and PREFECT_HOME (its abstract socket's name says both; a new one replaces an older
one of another environment). Both sides check the other's uid (SO_PEERCRED) before either sends anything: a name
bound by another user gets no command, and a resident runs none of another user's. A command that finds this
environment's resident still importing waits for it only when it expects it ready sooner than its own imports
would be (the last resident's times, recorded in PREFECT_HOME). An unused resident ends with the server it was
started beside (`sft-tokenize server stop` ends both).

This module is the `sft-tokenize` entry point (console_main): until it knows where the command runs it imports
only the standard library and a few small modules of this package (where the variables it reads are declared,
resident_socket.py, where the two sides meet, and resident_processes.py).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import itertools
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from sft_tokenize.build.timeline import TRACE_ENV, count_from, process_start
from sft_tokenize.cli.resident_socket import (
    RESIDENT_ENV,
    peer_credentials,
    receive_message,
    resident_address,
    resident_key,
    send_message,
)
from sft_tokenize.server.resident_processes import (
    SERVE,
    bound_sockets,
    prefect_home,
    resident_processes,
)
from sft_tokenize.server.server_state import is_running
from sft_tokenize.startup_gc import pause_collector

RESIDENT_FLAG = "--resident"
RECORD = "sft-tokenize-resident.json"  # in PREFECT_HOME: how long the last resident took to prepare and get ready
_command_env: dict[str, str] | None = None  # the command's environment as it started (a run changes its own)
_prepared: list[tuple] = []  # in a resident: the encodings it prepared for its command (workers.process_encoding)
_pooled: list[tuple] = []  # in a resident: the jobs whose encode pools it started, with their process counts
READY_TIMEOUT = 10.0  # a resident listens only once its imports are done: it answers at once
REPLACE_TIMEOUT = 5.0  # for an older resident to leave its name to a new one


def requested(argv: list[str]) -> bool:
    """Whether the command `argv` asks for the resident: `run --resident`, or `run` with SFT_TOKENIZE_RESIDENT=1
    (Linux only)."""
    if sys.platform != "linux" or len(argv) < 2 or argv[1] != "run":
        return False
    options = argv[2:argv.index("--")] if "--" in argv else argv[2:]
    return RESIDENT_FLAG in options or os.environ.get(RESIDENT_ENV) == "1"


def _hands_over(argv: list[str]) -> bool:
    """Whether the command can run elsewhere: not with a descriptor of its own as a path (`--recipe <(…)`), which
    only its own process can open (the resident gets its stdin, stdout and stderr only)."""
    return not any(argument.startswith(("/dev/fd/", "/proc/self/fd/")) for argument in argv)


def _age(pid: int) -> float:
    """Seconds since process `pid` started."""
    with open(f"/proc/{pid}/stat") as stat:
        ticks = int(stat.read().rpartition(")")[2].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


# The command's side.

def run_in_resident(argv: list[str]) -> int | None:
    """Run the command `argv` in this environment's resident process and return its exit code; None if none is
    ready for it (the caller runs it itself). Ctrl-C, SIGTERM and SIGHUP sent to this process are passed on to the
    resident."""
    key = resident_key(os.environ, sys.path)
    connected = _connect(key)
    if connected is None:
        return None
    sock, resident = connected
    try:
        started = process_start() if os.environ.get(TRACE_ENV) else 0.0
        send_message(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask(),
                            "started": started}, [0, 1, 2])
        receive_message(sock)  # taken: from here on the command is the resident's
    except (OSError, EOFError, ValueError, KeyError):
        sock.close()
        return None
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: _pass_on(resident, signum))
    sock.settimeout(None)
    try:
        return int(receive_message(sock)[0]["exit"])
    except (OSError, EOFError, ValueError, KeyError):
        print("sft-tokenize: error: the resident process ended before the run did; run the same command again "
              f"(or without {RESIDENT_FLAG})", file=sys.stderr)
        return 1


def _connect(key: str) -> tuple[socket.socket, int] | None:
    """A connection to this user's resident of this PREFECT_HOME, once it is ready, and its pid; None if there is
    none, it serves another environment (`key`), its name is another user's, or it is still importing and would
    not be ready before this process's own imports are done. Nothing is sent before the peer's uid is checked."""
    address = resident_address(os.environ)
    if address is None:
        return None
    deadline = None
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)  # refused at once unless one listens
            break
        except ConnectionRefusedError:
            sock.close()
            if deadline is None:
                deadline = _ready_by(address, key) or 0.0
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
        except OSError:
            sock.close()
            return None
    try:
        pid, uid = peer_credentials(sock)
        if uid != os.getuid():  # a name bound by another user: it learns nothing, not even this command
            raise PermissionError(f"the resident socket is held by uid {uid}")
        sock.settimeout(READY_TIMEOUT)
        if receive_message(sock)[0].get("key") != key:  # another environment's (a new run's exit replaces it)
            raise LookupError
    except (OSError, EOFError, ValueError, LookupError):
        sock.close()
        return None
    return sock, pid


def _ready_by(address: str, key: str) -> float | None:
    """When (time.monotonic) to stop waiting for this environment's resident that holds `address` but does not
    listen yet (importing); None if there is none or it would not be ready sooner than this process's imports.
    It waits when the resident's expected time left (the last resident's time to ready, in PREFECT_HOME, less its
    age) is under 80 % of the time the last one took to import and prepare, which this process would spend."""
    if not bound_sockets(address[1:]):
        return None
    home = prefect_home(os.environ)
    try:
        record = json.loads((Path(home) / RECORD).read_text())
        importing = [found["pid"] for found in resident_processes(home)
                     if found["bound"] and not found["ready"] and found["key"] == key]
        if not importing:
            return None
        left = float(record["ready_after"]) - _age(importing[0])
        own = float(record["prepared_after"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if left >= 0.8 * own:
        return None
    return time.monotonic() + max(left, 0.0) + 0.25 * own


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pass_on(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _start_beside_server() -> None:
    """At the exit of a run made in its own process: if it left the embedded server up, start the resident."""
    if "prefect" not in sys.modules:  # a cache hit, or a run that ended before it needed a server
        return
    from sft_tokenize.build.workers import encodings_made, next_pools
    from sft_tokenize.server.embedded_server import idle_server

    with contextlib.suppress(Exception):  # best effort: the next run simply runs in its own process
        if server := idle_server():  # the command's tokenizers and pool, or (a cache hit) this resident's
            pools = next_pools()
            start_resident(server, encodings_made() or _prepared, _pooled if pools is None else pools)


def start_resident(server: dict, encodings: list[tuple] = (), pools: list[tuple] = ()) -> None:
    """Start this environment's resident process beside the embedded server `server` (its state record), unless
    this environment's is up already; an older one of another environment in this PREFECT_HOME is ended first.
    It ends with that server. It prepares the tokenizers of `encodings` (the arguments of
    workers.process_encoding) for the next run, and starts the encode pools of `pools` (workers.next_pools)."""
    if _command_env is None or sys.platform != "linux" or (address := resident_address(_command_env)) is None:
        return
    key = resident_key(_command_env, sys.path)
    # Bound here, so that no second resident of this home starts; it listens once its imports are done.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            listener.bind(address)
        except OSError:  # one is up (or importing): this environment's stays, another's is replaced
            if not _replace(address, key):
                listener.close()
                return
            listener.bind(address)
    except OSError:
        listener.close()
        return
    code = f"import json, sys; sys.path[:] = json.loads(sys.argv[1]); {SERVE}(*json.loads(sys.argv[2]))"
    # A job is a dataclass of plain values (pickled as Prefect passes it to a task), sent as this process's own.
    jobs = [[base64.b64encode(pickle.dumps(job)).decode(), processes] for job, processes in pools]
    arguments = json.dumps([listener.fileno(), server, list(encodings), jobs])
    with listener, contextlib.suppress(OSError):  # its key last: what it serves, for resident_processes
        subprocess.Popen([sys.executable, "-c", code, json.dumps(sys.path), arguments, key],
                         env=_command_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=[listener.fileno()])


def _replace(address: str, key: str) -> bool:
    """End the resident that holds `address` if it is this user's and serves another environment than `key`, and
    wait until the name is free; False if the name stays taken (this environment's resident, another user's
    socket)."""
    holders = [found for found in resident_processes(prefect_home(_command_env)) if found["bound"]]
    if not holders or any(found["key"] == key for found in holders):
        return False
    for found in holders:
        _pass_on(found["pid"], signal.SIGTERM)
    deadline = time.monotonic() + REPLACE_TIMEOUT
    while bound_sockets(address[1:]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def console_main() -> None:
    """The `sft-tokenize` command: in this process; `run --resident` in this user's resident process when one
    fits."""
    global _command_env
    _command_env = dict(os.environ)
    if sys.argv[1:2] == ["run"]:  # until its flow starts (flows/api.py), and in the early server until it serves
        pause_collector()
    if requested(sys.argv):
        try:
            code = run_in_resident(sys.argv) if _hands_over(sys.argv) else None
        except KeyboardInterrupt:  # Ctrl-C before a resident took the command: nothing ran
            print("sft-tokenize: error: interrupted (SIGINT)", file=sys.stderr)
            code = 130
        if code is not None:
            sys.exit(code)
        atexit.register(_start_beside_server)  # run after the server is left (atexit runs the last-registered first)
    from sft_tokenize.server.server_fork import fork_early, wants_early_server

    if wants_early_server(sys.argv):  # before this process's own imports (server/server_fork.py)
        fork_early()
    from sft_tokenize.cli.main import console_main

    console_main()


# The resident's side.

def _preload() -> None:
    """What a run imports, so that its command does not (api.RUN_MODULES)."""
    from sft_tokenize.cli.main import keep_torch_out, process_environment
    from sft_tokenize.flows.api import import_run_modules

    process_environment()
    keep_torch_out()
    import_run_modules()


def serve(bound: int, server: dict, encodings: list[list], pools: list[list] = ()) -> None:
    """The resident process, on the socket `bound` that its command bound: import, prepare the tokenizers of
    `encodings` (the last run's, most likely the next one's), start the encode pools of `pools` (the last run's,
    if it had one: the next run of that job encodes with it, whatever its size), listen, and run the first
    command that hands itself over (then exit). Until one does, it exits as soon as it could serve none: the
    server `server` (its state record) gone, its code edited or a package installed."""
    os.environ.pop(TRACE_ENV, None)  # the run that started it traced itself; the next command brings its own
    key = resident_key(os.environ, sys.path)
    taken = threading.Event()

    def watch() -> None:
        for check in itertools.count(1):
            if taken.wait(0.25):
                return
            if not is_running(server["pid"], server["started"]) or \
                    check % 8 == 0 and resident_key(os.environ, sys.path) != key:
                os._exit(0)  # nothing to clean up: an abstract socket goes with its process

    threading.Thread(target=watch, name="resident-watch", daemon=True).start()
    # Below the priority of the command that ran before it (a cache hit at once after a run would otherwise share
    # the cores with it); its own command runs in the main thread, at the process's priority.
    prepared = []
    preparing = threading.Thread(target=lambda: prepared.append(_prepare(encodings, pools)), name="resident-prepare")
    preparing.start()
    preparing.join()
    if not prepared:  # its imports failed: a command in its own process says why
        return
    prepared_after = time.clock_gettime(time.CLOCK_BOOTTIME) - process_start()
    from sft_tokenize.build.workers import start_early

    # From this thread, at the process's priority: the pool's processes would inherit the preparing thread's.
    pooled = prepared[0]
    for job, processes in pooled:
        with contextlib.suppress(Exception):  # a tokenizer gone or changed: the run starts its own pool
            start_early(job, processes)
    _pooled[:] = pooled
    listener = socket.socket(fileno=bound)
    listener.listen(8)
    _record(prepared_after)
    while True:
        conn, _ = listener.accept()
        request = _take(conn, key)
        if request is not None:
            taken.set()
            listener.close()  # one command: the address is free for the resident its exit starts
            try:
                send_message(conn, {"taken": True})
            except OSError:  # the command left before it was taken: it runs in its own process
                os._exit(0)
            _run_command(conn, *request)
        conn.close()


def _record(prepared_after: float) -> None:
    """Write down how long this resident took to import and prepare, and to get ready (its pools started), for a
    command that finds the next one importing (_ready_by)."""
    home = prefect_home(os.environ)
    times = {"prepared_after": round(prepared_after, 3),
             "ready_after": round(time.clock_gettime(time.CLOCK_BOOTTIME) - process_start(), 3)}
    with contextlib.suppress(OSError, TypeError):
        temporary = Path(home) / f".{RECORD}.{os.getpid()}"
        temporary.write_text(json.dumps(times))
        temporary.replace(Path(home) / RECORD)


def _prepare(encodings: list[list], pools: list[list]) -> list[tuple]:
    """Import, and prepare the tokenizers of `encodings` and the encoders of `pools` (jobs as start_resident sent
    them); return the pools' jobs, with their process counts."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread's (Linux)
    _preload()
    from sft_tokenize.build.workers import prepare_encodings

    try:
        pooled = [(pickle.loads(base64.b64decode(job)), processes) for job, processes in pools]
    except Exception:  # noqa: BLE001 - a job this code cannot read: the next run starts its own pool
        pooled = []
    prepare_encodings([tuple(arguments) for arguments in encodings], pooled)
    return pooled


def _take(conn: socket.socket, key: str) -> tuple[dict, list[int]] | None:
    """A command's request and descriptors, if the peer is this user and hands one over (a peer that closes
    first, or sends something else, hands none). The peer hears this resident's `key` first: a command of
    another environment closes."""
    if peer_credentials(conn)[1] != os.getuid():
        return None
    try:
        conn.settimeout(READY_TIMEOUT)
        send_message(conn, {"pid": os.getpid(), "key": key})
        request, fds = receive_message(conn, 3)
    except (OSError, EOFError, ValueError):
        return None
    if len(fds) != 3 or not {"argv", "cwd", "env", "umask", "started"} <= request.keys():
        for fd in fds:
            os.close(fd)
        return None
    return request, fds


def _run_command(conn: socket.socket, request: dict, fds: list[int]) -> NoReturn:
    """Become the command (its descriptors, directory, environment, arguments), run it, and tell it how it ended."""
    global _command_env

    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    # The streams over the command's descriptors, buffered as the interpreter would have made them there.
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # noqa: SIM115 - the process's own stream
    sys.stdout = open(1, "w", encoding=sys.stdout.encoding, closefd=False,  # noqa: SIM115
                      buffering=1 if os.isatty(1) else -1)
    sys.stderr = open(2, "w", encoding=sys.stderr.encoding, errors="backslashreplace", closefd=False,  # noqa: SIM115
                      buffering=1)
    conn.settimeout(None)

    reported = threading.Event()

    def report(code: int) -> None:
        reported.set()  # the command exits on reading it: its connection closing is no longer news
        with contextlib.suppress(OSError):
            send_message(conn, {"exit": code})

    def watch() -> None:  # the command was killed (SIGKILL: it passed nothing on): stop as SIGTERM stops a run
        with contextlib.suppress(OSError):
            if not conn.recv(1) and not reported.is_set():
                os.kill(os.getpid(), signal.SIGTERM)

    code = 1
    try:
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        _command_env = dict(request["env"])
        from sft_tokenize.build.workers import encodings_made

        _prepared[:] = encodings_made(forget=True)
        from sft_tokenize.cli.main import console_main

        count_from(request["started"])
        threading.Thread(target=watch, name="resident-command", daemon=True).start()
        atexit.register(_start_beside_server)  # the next run's resident, as the command's own process would
        console_main(ended=report)  # a run that published its cache ends there
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - a bug: its traceback, as the command's own process would print it
        import traceback

        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    report(code)
    os._exit(code)
