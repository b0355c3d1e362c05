"""The embedded Prefect server's own process (`python -m sft_tokenize.server.server_process`, launched by
server/embedded_server.py, or the CLI's process forked to be it, server/server_fork.py): Prefect's app under uvicorn
(behind busy_retry.py), a thread that ends it once no run has held a lease for its idle time, and the record that
lets a boot on a known database skip its migrations and block checks (see server_state.py's docstring for the
protocol, docs/performance.md for the figures).

A new PREFECT_HOME's database is never migrated on the clock if it can be helped. Creating and migrating Prefect's
SQLite database (about a hundred Alembic migrations) and registering its block types took ~11 s on two busy cores
as Prefect's boot does it (~3.5 s as prefect_migrations.py does it), and every fresh PREFECT_HOME paid it. So a new
database is, in this order:

- a copy of this Prefect's template (below), migrated and registered;
- else made from the schema this package ships for these migrations (prefect_migrations.py, ~10 ms). Its block
  types are registered once no run uses the server any more (before it idles or ends), so that no run waits for
  them; the boot is recorded only then. Nothing a run does needs them on the server (a block saved by a client,
  like the results storage of runners.py, registers its own type);
- else migrated here, and the first server on the machine to do so snapshots it, migrated and registered but
  before it has served anything, into this user's cache (files.py's `user_cache()`):

    <user cache>/prefect-databases/prefect-<version>-<key>/
        prefect.db       the snapshot (SQLite's backup API: one consistent file)
        template.json    written last: the Prefect version, its collections, the Alembic revision, the block types

`<key>` hashes the Prefect version and its collections (which decide the block types); a template whose
template.json, or whose own revision and block types, do not match this Prefect is never used. A later server
whose PREFECT_HOME has no database (nor any journal of one) copies the template in under a temporary name and
links it into place, so an existing database is never overwritten. The copy (like the database the template was
made from) is what a full boot of this Prefect leaves, so it is recorded as such and the boot skips the migrations
and the block-type check. Only the default kind of database, a local SQLite file, is seeded.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prefect.context import refresh_global_settings_context
from prefect.settings import get_current_settings

from sft_tokenize.files import atomic_path, atomic_write, is_locked, temp_path
from sft_tokenize.server import busy_retry
from sft_tokenize.server.prefect_migrations import create_from_schema, migrate_sqlite
from sft_tokenize.server.server_state import SHUTDOWN_TIMEOUT, recorded_server, server_paths, write_state
from sft_tokenize.startup_gc import pause_collector, resume_collector

BOOT_RECORD = "sft-tokenize-server-boot.json"
DATABASE_TEMPLATES = "prefect-databases"  # under the user cache
TEMPLATE_DATABASE, TEMPLATE_RECORD = "prefect.db", "template.json"
# What a boot on the database that a full boot of this Prefect left behind can skip (see _boot_facts).
KNOWN_DATABASE = {"PREFECT_API_DATABASE_MIGRATE_ON_START": "false", "PREFECT_API_BLOCKS_REGISTER_ON_START": "false",
                  "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}


def _database_file() -> Path | None:
    """The configured database's file, if it is a local SQLite file (the default); None for any other database."""
    url = get_current_settings().server.database.connection_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else str(url or "")
    prefix = "sqlite+aiosqlite:///"
    if not url.startswith(prefix) or ":memory:" in url or "?" in url:
        return None
    return Path(url.removeprefix(prefix)).resolve()


def _this_prefect() -> dict:
    """This Prefect's version and its collections: what decides a database's migrations and block types."""
    from importlib.metadata import entry_points

    import prefect

    collections = sorted(f"{point.dist.name}=={point.dist.version}"
                         for point in entry_points(group="prefect.collections") if point.dist)
    return {"prefect": prefect.__version__, "collections": collections}


def _database_facts(path: Path) -> dict | None:
    """The Alembic revision and the number of block types of the SQLite database at `path`, None if it cannot be
    read as one."""
    if not path.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=5)) as db:
            ((revision,),) = db.execute("SELECT version_num FROM alembic_version").fetchall()
            (block_types,) = db.execute("SELECT count(*) FROM block_type").fetchone()
    except (sqlite3.Error, ValueError):
        return None
    return {"revision": revision, "block_types": block_types}


def _boot_facts() -> dict | None:
    """What a full boot leaves behind, read in a few milliseconds: this Prefect and its collections, the SQLite
    file, its Alembic revision and its number of block types. None for a database that is not a local SQLite file
    (or cannot be read): its server always boots in full."""
    path = _database_file()
    facts = _database_facts(path) if path is not None else None
    return None if facts is None else {**_this_prefect(), "database": str(path), **facts}


def template_dir() -> Path:
    """Where this Prefect's database template is kept (see the module docstring)."""
    from sft_tokenize.files import user_cache
    from sft_tokenize.fingerprint import fingerprint

    this = _this_prefect()
    return user_cache() / DATABASE_TEMPLATES / f"prefect-{this['prefect']}-{fingerprint(this)[:16]}"


def _journals(database: Path) -> list[Path]:
    return [database, *(database.with_name(database.name + suffix) for suffix in ("-wal", "-shm", "-journal"))]


def seed_database(database: Path) -> bool:
    """Copy this Prefect's template into `database` if no database (nor a journal of one) is there and a template
    made by this very Prefect is; whether it did. Never replaces a file: the copy is linked into place."""
    if any(os.path.lexists(path) for path in _journals(database)):
        return False
    template = template_dir()
    try:
        recorded = json.loads((template / TEMPLATE_RECORD).read_text())
    except (OSError, ValueError):
        return False
    expected = {**_this_prefect(), **(_database_facts(template / TEMPLATE_DATABASE) or {"revision": None})}
    if recorded != expected:  # another Prefect's (or a damaged) template
        return False
    return _new_file(database, lambda copy: shutil.copyfile(template / TEMPLATE_DATABASE, copy).exists())


def _new_file(database: Path, make: Callable[[Path], bool]) -> bool:
    """`make(path)` a database under a temporary name and link it into place as `database` if it made one; whether
    it did. Never replaces a file: the link fails if a database appeared meanwhile, and that one is kept. A
    directory that is not there is not made: Prefect's own boot then says it cannot open the database."""
    made = temp_path(database)
    try:
        if not make(made):
            return False
        os.link(made, database)
    except (OSError, sqlite3.Error):
        return False
    finally:
        made.unlink(missing_ok=True)
    return True


def _register_blocks() -> None:
    """Register the block types of this Prefect and its collections in the configured database, as a boot does."""
    import asyncio

    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration

    async def register() -> None:
        async with await provide_database_interface().session() as session:
            await run_block_auto_registration(session=session)

    asyncio.run(register())


def make_template(database: Path) -> None:
    """Create and migrate `database` (prefect_migrations.py) and register the block types, as Prefect's own boot
    would, then keep a snapshot of it as this Prefect's template (best effort: without one, the next fresh home
    only boots slower)."""
    import asyncio

    from prefect.server.database import provide_database_interface

    try:
        migrate_sqlite(database)  # Prefect's migrations, without an async round trip per statement
    except Exception as error:  # noqa: BLE001 - Prefect's own way, from a new file, is always right
        print(f"migrating with Prefect's own engine: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        for path in _journals(database):
            path.unlink(missing_ok=True)
        asyncio.run(provide_database_interface().create_db())
    _register_blocks()
    template = template_dir()
    try:
        template.mkdir(parents=True, exist_ok=True)
        with atomic_path(template / TEMPLATE_DATABASE, durable=False) as copy, \
                contextlib.closing(sqlite3.connect(database)) as source, \
                contextlib.closing(sqlite3.connect(copy)) as target:
            source.backup(target)
            target.execute("PRAGMA journal_mode=DELETE")  # one file, read without a -wal or -shm beside it
        facts = _database_facts(template / TEMPLATE_DATABASE)
        if facts is not None:
            atomic_write(template / TEMPLATE_RECORD, json.dumps({**_this_prefect(), **facts}), durable=False)
    except (OSError, sqlite3.Error) as error:
        print(f"no database template kept in {template}: {type(error).__name__}: {error}", file=sys.stderr,
              flush=True)


def _new_database(record: Path) -> bool:
    """A PREFECT_HOME with no database yet gets a copy of the template, or one made from the shipped schema, or
    makes the template (module docstring); whether its block types are still to be registered. Either way its boot
    skips the migrations and the block-type check. A database that is then the one a full boot of this Prefect
    leaves is recorded as such (`record`); one made from the schema is recorded once its block types are in."""
    database = _database_file()
    if database is None or any(os.path.lexists(path) for path in _journals(database)):
        return False
    if not seed_database(database):
        if _new_file(database, create_from_schema):
            _skip_boot_checks()
            return True
        make_template(database)
    _record(record)
    return False


def _skip_boot_checks() -> None:
    """This boot skips the migrations and the block-type check, unless the user set either."""
    for name, value in KNOWN_DATABASE.items():
        os.environ.setdefault(name, value)
    refresh_global_settings_context()


def _register_blocks_and_record(record: Path) -> None:
    """The block types of a database made from the schema, then the record that its later boots skip both checks
    (best effort: without it the next boot is a full one, which registers them)."""
    try:
        _register_blocks()
    except Exception as error:  # noqa: BLE001 - never the end of the thread that ends the server
        print(f"block types not registered: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return
    _record(record)


def _boot_in_full(record: Path) -> bool:
    """Whether this server must migrate its database and check its block types (it is not the database that the
    last full boot recorded); if not, the settings that skip both, unless the user set them."""
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = None
    if known is None or _boot_facts() != known:
        return True
    _skip_boot_checks()
    return False


def _record_boot(record: Path) -> None:
    """After a full boot that migrated and registered: what the next boot checks."""
    settings = get_current_settings().server
    if settings.database.migrate_on_start and settings.register_blocks_on_start:
        _record(record)


def _record(record: Path) -> None:
    """The facts of this database, the one a full boot of this Prefect leaves, for the next boot to check (best
    effort: a boot that is not recorded is only done in full again)."""
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
    pause_collector()  # until it serves, uvicorn's import included (a forked server is paused already)
    import threading

    import uvicorn

    home = Path(get_current_settings().home)
    lock_path, state_path, lease_path = server_paths(home)
    blocks_pending = False
    try:
        blocks_pending = _new_database(home / BOOT_RECORD)
    except Exception as error:  # noqa: BLE001 - Prefect's own boot creates whatever is missing
        print(f"database not seeded: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    try:
        in_full = not blocks_pending and _boot_in_full(home / BOOT_RECORD)
    except Exception:  # noqa: BLE001 - whatever the record says, a full boot is correct
        in_full = True

    class Server(uvicorn.Server):
        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets=sockets)
            resume_collector()
            if in_full and self.started:  # recorded now: a run with no idle time stops the server once it answers
                _record_boot(home / BOOT_RECORD)

    server = Server(uvicorn.Config(busy_retry.create_app, factory=True, host="127.0.0.1", port=port, log_level="error",
                                   lifespan="on"))

    def end() -> None:
        server.should_exit = True
        time.sleep(SHUTDOWN_TIMEOUT)  # a shutdown that hangs is cut short
        os._exit(0)

    def end_when_unused() -> None:
        nonlocal blocks_pending
        while not server.should_exit:
            time.sleep(1)
            try:
                lock = open(lock_path, "a")  # noqa: SIM115 - kept locked until this process is gone, if it ends
            except OSError as error:  # PREFECT_HOME moved or deleted: no run can find this server any more
                print(f"{lock_path}: {error.strerror}: ending", file=sys.stderr, flush=True)
                end()
            fcntl.flock(lock, fcntl.LOCK_EX)
            if is_locked(lease_path):  # some run holds a lease
                _in_use(state_path)
                lock.close()
                continue
            if blocks_pending and server.started:  # outside the join lock: a run may join meanwhile
                lock.close()
                _register_blocks_and_record(home / BOOT_RECORD)
                blocks_pending = False
                continue
            if _idling(state_path):
                lock.close()
                continue
            with contextlib.suppress(OSError, ValueError):
                if json.loads(state_path.read_text())["pid"] == os.getpid():
                    state_path.unlink()
            # The join lock stays held while this server shuts down, so that no run launches another server on
            # the same database meanwhile (it would migrate it while this one still writes to it). The kernel
            # drops it when this process exits.
            end()

    threading.Thread(target=end_when_unused, daemon=True).start()
    server.run()


if __name__ == "__main__":
    serve(int(sys.argv[sys.argv.index("--port") + 1]))
