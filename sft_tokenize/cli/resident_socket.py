"""Where a command and its resident process meet (cli/resident.py): which resident may run which command (its
key), the abstract socket's address, the credentials of the process at the other end, and the messages they send,
length-prefixed JSON with descriptors beside them.

Imported by the `sft-tokenize` entry point before it knows where the command runs: the standard library and a
few small modules of this package only (where the variables it reads are declared, and resident_processes.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import socket
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

from sft_tokenize.build.timeline import TRACE_ENV
from sft_tokenize.flows.console import CONSOLE_ENV
from sft_tokenize.server.resident_processes import prefect_home, socket_name
from sft_tokenize.server.server_state import SERVER_IDLE_ENV

RESIDENT_ENV = "SFT_TOKENIZE_RESIDENT"  # 1: every `run` asks for the resident, as --resident does
# The variables a resident's imports read, fixed once they ran (Prefect's settings, the hub's and the tokenizer
# libraries' variables, the interpreter's, the C libraries'): a resident serves only a command whose values are
# the same. A command brings every other variable with it (the resident takes on its whole environment).
RUN_RELEVANT_PREFIXES = ("PREFECT_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "DATASETS_",
                         "FASTOKENS", "SFT_TOKENIZE_", "PYTHON", "LD_", "LC_", "RAYON_", "OMP_", "MKL_", "OPENBLAS_",
                         "ARROW_", "MALLOC_", "XDG_", "DASK_", "RAY_")
RUN_RELEVANT_NAMES = frozenset({"HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "USER"})
# Of those, the ones read at run time only (or set by the run itself: cli.process_environment).
RUNTIME_VARIABLES = frozenset({RESIDENT_ENV, CONSOLE_ENV, SERVER_IDLE_ENV, TRACE_ENV,
                               "TRANSFORMERS_NO_ADVISORY_WARNINGS", "PREFECT_SERVER_ANALYTICS_ENABLED"})
# Read from the working directory as Prefect's settings are imported.
DIRECTORY_SETTINGS = ("prefect.toml", "pyproject.toml", ".env")
# Limits a run inherits from its caller (ulimit): a resident serves only a command that has the same.
LIMITS = tuple(getattr(resource, name) for name in ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_RSS", "RLIMIT_CPU",
                                                     "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC",
                                                     "RLIMIT_STACK", "RLIMIT_MEMLOCK") if hasattr(resource, name))


def _run_relevant(name: str) -> bool:
    return name not in RUNTIME_VARIABLES and (name in RUN_RELEVANT_NAMES or name.startswith(RUN_RELEVANT_PREFIXES))


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


def _process_state() -> list:
    """What a process inherits from its caller and a run's process would run under: its nice value, CPU
    affinity, limits and control groups (a Slurm job's memory limit and accounting), the settings files of its
    working directory."""
    pid = os.getpid()
    try:
        groups = Path("/proc/self/cgroup").read_text()
    except OSError:
        groups = ""
    files = []
    for name in DIRECTORY_SETTINGS:
        with contextlib.suppress(OSError):
            stat = os.stat(name)
            files.append((os.path.abspath(name), stat.st_mtime_ns, stat.st_size))
    return [os.getpriority(os.PRIO_PROCESS, pid), sorted(os.sched_getaffinity(pid)),
            [resource.getrlimit(limit) for limit in LIMITS], groups, files]


def resident_key(environ: Mapping[str, str], paths: list[str]) -> str:
    """Which resident may run a command: the same user, interpreter, import path, installed files, run-relevant
    variables (what the imports read of them is fixed when they run) and process state (_process_state)."""
    environment = sorted((k, v) for k, v in environ.items() if _run_relevant(k))
    described = [os.getuid(), sys.executable, sys.version, paths, environment, _code_stamp(paths), _process_state()]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32]


def resident_address(environ: Mapping[str, str]) -> str | None:
    # An abstract socket (Linux): no file to clean up after a killed resident. Anyone can bind a name there, so
    # each side checks the other's uid (SO_PEERCRED) before it sends anything.
    home = prefect_home(environ)
    return None if home is None else "\0" + socket_name(os.getuid(), home)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of `sock`, as the kernel recorded them."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def send_message(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], list(fds))


def receive_message(sock: socket.socket, fds: int = 0) -> tuple[dict, list[int]]:
    """One message (and up to `fds` descriptors sent with it); EOFError if the other side closed first."""
    head, received, _, _ = socket.recv_fds(sock, 4, fds)
    head += _exactly(sock, 4 - len(head)) if head else b""
    if not head:
        raise EOFError
    (size,) = struct.unpack("!I", head)
    return json.loads(_exactly(sock, size)), received


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data
