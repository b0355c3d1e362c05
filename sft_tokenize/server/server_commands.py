"""`sft-tokenize server status` and `server stop`: the embedded server of this PREFECT_HOME, from the files that
record it (server/server_state.py).

Both read only those files, /proc and the server's health check, so neither imports Prefect when the environment
names PREFECT_HOME (which Prefect's settings take before any file or profile): the command then costs 0.6 s of CPU
against 1.6 s with Prefect's import (a busy two-core machine, alternated). Without it, the home is Prefect's own
setting.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sft_tokenize.errors import Failed
from sft_tokenize.files import is_locked, locked
from sft_tokenize.server.resident_processes import prefect_home, resident_processes, tree_pss
from sft_tokenize.server.server_state import (
    SHUTDOWN_TIMEOUT,
    answers,
    count_leases,
    local_client,
    recorded_server,
    server_paths,
    stopped_path,
    terminate,
    write_state,
)


class ServerInUse(Failed):
    """`server stop` without --force while runs use the server."""


def _home() -> Path:
    """The PREFECT_HOME Prefect would use: the environment's (read as the resident's finder reads it), else
    Prefect's setting."""
    if os.environ.get("PREFECT_HOME"):
        return Path(prefect_home(os.environ))
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home)


def _seconds(value: float) -> str:
    return f"{max(0, round(value))} s"


def server_status() -> list[tuple[str, str]]:
    """`sft-tokenize server status`: the facts about this PREFECT_HOME's embedded server, one per line."""
    home = _home()
    _, state_path, lease_path = server_paths(home)
    where = [("PREFECT_HOME", str(home)), ("log", str(home / "embedded-server.log"))]
    state = recorded_server(state_path)
    if state is None:
        return [("embedded server", "not running"), *where]
    with local_client() as client:
        answering = answers(state["url"], client, timeout=1)
    runs, idle = count_leases(lease_path), float(state.get("idle", 0))
    if runs:
        left = "in use"
    elif idle <= 0:
        left = "none: stopping"
    else:
        left = f"{_seconds(idle - (time.time() - state.get('idle_since', time.time())))} left of {_seconds(idle)}"
    uptime = float(Path("/proc/uptime").read_text().split()[0]) - state["started"] / os.sysconf("SC_CLK_TCK")
    waiting = ", ".join(f"pid {found['pid']} ({'ready' if found['ready'] else 'importing'}, "
                        f"{tree_pss(found['pid']) / 2**20:,.0f} MiB PSS)"
                        for found in resident_processes(home))
    return [("embedded server", "running" if answering else "running, starting (not answering yet)"),
            ("pid", str(state["pid"])), ("url", state["url"]), ("uptime", _seconds(uptime)),
            ("runs using it", str(runs)), ("idle time", left), ("resident process", waiting or "none"), *where]


def stop_server(force: bool = False) -> str:
    """`sft-tokenize server stop`: stop this PREFECT_HOME's embedded server and wait until its process is gone.
    Refused (ServerInUse) while runs use it, unless `force` (those runs then fail)."""
    home = _home()
    lock_path, state_path, lease_path = server_paths(home)
    if not state_path.exists():
        return "no embedded server is running"
    with locked(lock_path):  # no run joins meanwhile; a server ending itself holds it until it is gone
        state = recorded_server(state_path)
        if state is None:
            return "no embedded server is running"
        runs = max(1, count_leases(lease_path)) if is_locked(lease_path) else 0
        if runs and not force:
            raise ServerInUse(f"the embedded server (pid {state['pid']}) is in use by "
                              f"{'1 run: let it' if runs == 1 else f'{runs} runs: let them'} finish, or pass "
                              "--force (they fail)")
        if runs:  # read by those runs' watch threads: they end at once, saying who stopped their server
            write_state(stopped_path(home), {"pid": state["pid"], "started": state["started"], "by": os.getpid()})
        terminate(state["pid"], state["started"], timeout=SHUTDOWN_TIMEOUT)
        state_path.unlink(missing_ok=True)
    used = "" if not runs else "; 1 run was using it" if runs == 1 else f"; {runs} runs were using it"
    return f"stopped the embedded server (pid {state['pid']}) of PREFECT_HOME {home}{used}"
