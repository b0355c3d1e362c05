"""The embedded Prefect server's own process (`python -m sft_tokenize.flows.server_process`, launched by
flows/embedded_server.py): Prefect's app under uvicorn, a thread that ends it once no run has held a lease for its
idle time, and the record that lets a boot on a known database skip its migrations and block checks (see
server_state.py's docstring for the protocol, docs/performance.md for the figures)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from pathlib import Path

from prefect.context import refresh_global_settings_context
from prefect.settings import get_current_settings

from sft_tokenize.files import is_locked
from sft_tokenize.flows.embedded_server import SERVER_APP, SHUTDOWN_TIMEOUT
from sft_tokenize.flows.server_state import recorded_server, server_paths, write_state

BOOT_RECORD = "sft-tokenize-server-boot.json"
# What a boot on the database that a full boot of this Prefect left behind can skip (see _boot_facts).
KNOWN_DATABASE = {"PREFECT_API_DATABASE_MIGRATE_ON_START": "false", "PREFECT_API_BLOCKS_REGISTER_ON_START": "false",
                  "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}


def _boot_facts() -> dict | None:
    """What a full boot leaves behind, read in a few milliseconds: this Prefect and its collections, the SQLite
    file, its Alembic revision and its number of block types. None for a database that is not a local SQLite file
    (or cannot be read): its server always boots in full."""
    import sqlite3
    from importlib.metadata import entry_points

    import prefect

    url = get_current_settings().server.database.connection_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else str(url or "")
    prefix = "sqlite+aiosqlite:///"
    if not url.startswith(prefix) or ":memory:" in url or "?" in url:
        return None
    path = Path(url.removeprefix(prefix)).resolve()
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=5)) as db:
            ((revision,),) = db.execute("SELECT version_num FROM alembic_version").fetchall()
            (block_types,) = db.execute("SELECT count(*) FROM block_type").fetchone()
    except (sqlite3.Error, ValueError):
        return None
    collections = sorted(f"{point.dist.name}=={point.dist.version}"
                         for point in entry_points(group="prefect.collections") if point.dist)
    return {"prefect": prefect.__version__, "collections": collections, "database": str(path),
            "revision": revision, "block_types": block_types}


def _boot_in_full(record: Path) -> bool:
    """Whether this server must migrate its database and check its block types (it is not the database that the
    last full boot recorded); if not, the settings that skip both, unless the user set them."""
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = None
    if known is None or _boot_facts() != known:
        return True
    for name, value in KNOWN_DATABASE.items():
        os.environ.setdefault(name, value)
    refresh_global_settings_context()
    return False


def _record_boot(record: Path) -> None:
    """After a full boot that migrated and registered: what the next boot checks (best effort: a boot that is not
    recorded is only done in full again)."""
    settings = get_current_settings().server
    if not (settings.database.migrate_on_start and settings.register_blocks_on_start):
        return
    try:
        if (facts := _boot_facts()) is not None:
            write_state(record, facts)
    except Exception as error:  # noqa: BLE001 - never the end of the thread that ends the server
        print(f"not recorded: {record}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


def _in_use(state_path: Path) -> None:
    """A run uses this server (called under the join lock): its idle time starts again when none does."""
    with contextlib.suppress(Exception):
        state = recorded_server(state_path)
        if state is not None and state["pid"] == os.getpid() and "idle_since" in state:
            del state["idle_since"]
            write_state(state_path, state)


def _idling(state_path: Path) -> bool:
    """This server, which no run uses, is within its idle time (called under the join lock)."""
    try:
        state = recorded_server(state_path)
        if state is None or state["pid"] != os.getpid() or not float(state.get("idle", 0)) > 0:
            return False
        if "idle_since" not in state:  # its runs were killed (none left it): idle from now
            state["idle_since"] = time.time()
            write_state(state_path, state)
        return time.time() - float(state["idle_since"]) < float(state["idle"])
    except Exception as error:  # noqa: BLE001 - the thread that ends this server must not die: it ends now
        print(f"idle time unknown, ending: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return False


def serve(port: int) -> None:
    """The server process: Prefect's app under uvicorn, and a thread that ends it once no run has held a lease for
    its idle time."""
    import threading

    import uvicorn

    home = Path(get_current_settings().home)
    lock_path, state_path, lease_path = server_paths(home)
    try:
        in_full = _boot_in_full(home / BOOT_RECORD)
    except Exception:  # noqa: BLE001 - whatever the record says, a full boot is correct
        in_full = True
    server = uvicorn.Server(uvicorn.Config(SERVER_APP, factory=True, host="127.0.0.1", port=port, log_level="error",
                                           lifespan="on"))

    def end_when_unused() -> None:
        booted = False
        while not server.should_exit:
            time.sleep(1)
            if server.started and not booted:
                booted = True
                if in_full:
                    _record_boot(home / BOOT_RECORD)
            lock = open(lock_path, "a")  # noqa: SIM115 - kept locked until this process is gone, if it ends
            fcntl.flock(lock, fcntl.LOCK_EX)
            if is_locked(lease_path):  # some run holds a lease
                _in_use(state_path)
                lock.close()
                continue
            if _idling(state_path):
                lock.close()
                continue
            with contextlib.suppress(OSError, ValueError):
                if json.loads(state_path.read_text())["pid"] == os.getpid():
                    state_path.unlink()
            # The join lock stays held while this server shuts down, so that no run launches another server on
            # the same database meanwhile (it would migrate it while this one still writes to it). The kernel
            # drops it when this process exits; a shutdown that hangs is cut short.
            server.should_exit = True
            time.sleep(SHUTDOWN_TIMEOUT)
            os._exit(0)

    threading.Thread(target=end_when_unused, daemon=True).start()
    server.run()


if __name__ == "__main__":
    serve(int(sys.argv[sys.argv.index("--port") + 1]))
