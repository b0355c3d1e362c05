"""Finding a PREFECT_HOME's resident process (cli/resident.py) from /proc, for the command that hands itself to
it or replaces it, `sft-tokenize server status`, tests and benchmarks. A light module: the resident's entry point
and the embedded server's status both import it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

SERVE = "from sft_tokenize.cli.resident import serve; serve"  # in a resident's command line
SOCKET_PREFIX = "sft-tokenize-resident-"  # its abstract socket's name, after the leading NUL


def _home_of(environ: bytes) -> str | None:
    """The PREFECT_HOME a process's environment (/proc/PID/environ) gives Prefect: its own, or ~/.prefect."""
    variables = dict(entry.partition(b"=")[::2] for entry in environ.split(b"\0") if entry)
    return prefect_home({k.decode(errors="replace"): v.decode(errors="replace") for k, v in variables.items()})


def prefect_home(environ: Mapping[str, str]) -> str | None:
    """The PREFECT_HOME the environment `environ` gives Prefect: its own, or ~/.prefect."""
    home = environ.get("PREFECT_HOME") or (environ["HOME"] + "/.prefect" if "HOME" in environ else None)
    return os.path.abspath(os.path.expanduser(home)) if home else None


def socket_name(uid: int, home: str) -> str:
    """The abstract socket name (after its leading NUL) of user `uid`'s resident of PREFECT_HOME `home`: one per
    user and home."""
    return f"{SOCKET_PREFIX}{uid}-{hashlib.sha256(home.encode()).hexdigest()[:24]}"


def bound_sockets(name: str | None = None) -> dict[str, bool]:
    """The inodes (as /proc/PID/fd shows them: socket:[N]) of the bound resident sockets, `name`'s only if given,
    each with whether it listens."""
    found = {}
    with contextlib.suppress(OSError), open("/proc/net/unix") as table:
        for fields in map(str.split, list(table)[1:]):
            if len(fields) >= 8 and fields[7].startswith("@" + (name or SOCKET_PREFIX)) and \
                    (name is None or fields[7] == "@" + name):
                found[f"socket:[{fields[6]}]"] = bool(int(fields[3], 16) & 0x10000)  # __SO_ACCEPTCON
    return found


def _uid_of(pid: int | str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise OSError(f"no Uid of {pid}")


def resident_processes(home: str | os.PathLike, uid: int | None = None) -> list[dict]:
    """This user's (`uid`'s) resident processes beside the embedded server of PREFECT_HOME `home` (set in their
    environment, or the default ~/.prefect): each as {"pid", "ready" (listening), "bound" (holding the home's
    socket name), "key" (what it serves: resident_socket.resident_key)}."""
    uid = os.getuid() if uid is None else uid
    wanted = os.path.abspath(os.path.expanduser(os.fspath(home)))
    sockets = bound_sockets()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if not any(SERVE.encode() in part for part in command) or _uid_of(pid) != uid or \
                    _home_of(Path(f"/proc/{pid}/environ").read_bytes()) != wanted:
                continue
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")} & sockets.keys()
            found.append({"pid": int(pid), "ready": any(sockets[inode] for inode in held), "bound": bool(held),
                          "key": command[-2].decode(errors="replace") if len(command) >= 2 else ""})
    return found


def residents(home: str | os.PathLike) -> list[tuple[int, bool]]:
    """This user's resident processes beside the embedded server of PREFECT_HOME `home`, each with whether it is
    ready (listening)."""
    return [(found["pid"], found["ready"]) for found in resident_processes(home)]


def tree_pss(pid: int) -> int:
    """The PSS in bytes of process `pid` and its descendants (a resident and its encode pool), 0 if it is gone."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    pending += map(int, Path(f"/proc/{current}/task/{task}/children").read_text().split())
    return total
