"""Finding a PREFECT_HOME's resident processes (flows/resident.py) from /proc, for `sft-tokenize server status`,
tests and benchmarks. A light module: the resident's entry point and the embedded server's status both import it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SERVE = "from sft_tokenize.flows.resident import serve; serve"  # in a resident's command line
SOCKET_PREFIX = "sft-tokenize-resident-"  # its abstract socket's name, after the leading NUL


def _home_of(environ: bytes) -> str | None:
    """The PREFECT_HOME a process's environment (/proc/PID/environ) gives Prefect: its own, or ~/.prefect."""
    variables = dict(entry.partition(b"=")[::2] for entry in environ.split(b"\0") if entry)
    home = variables.get(b"PREFECT_HOME") or (variables[b"HOME"] + b"/.prefect" if b"HOME" in variables else None)
    return os.path.abspath(os.path.expanduser(home.decode(errors="replace"))) if home else None


def residents(home: str | os.PathLike) -> list[tuple[int, bool]]:
    """The resident processes of this user beside the embedded server of PREFECT_HOME `home` (set in their
    environment, or the default ~/.prefect), each with whether it is ready (listening)."""
    listening = set()
    with contextlib.suppress(OSError), open("/proc/net/unix") as table:
        for fields in map(str.split, list(table)[1:]):
            if len(fields) >= 8 and fields[7].startswith("@" + SOCKET_PREFIX) and int(fields[3], 16) & 0x10000:
                listening.add(f"socket:[{fields[6]}]")
    wanted = os.path.abspath(os.path.expanduser(os.fspath(home)))
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if SERVE.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes() or \
                    _home_of(Path(f"/proc/{pid}/environ").read_bytes()) != wanted:
                continue
            sockets = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            found.append((int(pid), bool(sockets & listening)))
    return found
