"""A new PREFECT_HOME's database starts as a copy of the template this Prefect made once, or is made from the schema
this package ships for these migrations (server/server_process.py, server/prefect_migrations.py): each used only when
made by this very Prefect, never over a database that is there."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
from support.cli import environment

from sft_tokenize.server import prefect_migrations
from sft_tokenize.server.prefect_migrations import create_from_schema, migrate_sqlite, migrations_key
from sft_tokenize.server.server_process import (
    BOOT_RECORD,
    TEMPLATE_DATABASE,
    TEMPLATE_RECORD,
    _database_facts,
    _this_prefect,
    seed_database,
    template_dir,
)

MARK = "sft-tokenize-test-template"


def _mark(database: Path) -> None:
    """A row no boot writes (revision and block types unchanged): a database that has it was copied from this one."""
    with closing(sqlite3.connect(database)) as db, db:
        db.execute("INSERT INTO configuration (id, key, value) VALUES (?, ?, ?)", (MARK, MARK, "{}"))


def _marked(database: Path) -> bool:
    with closing(sqlite3.connect(database)) as db:
        return db.execute("SELECT count(*) FROM configuration WHERE key = ?", (MARK,)).fetchone()[0] == 1


@pytest.fixture
def template(tmp_path, monkeypatch, migrated_prefect_home) -> Path:
    """This Prefect's template in a fresh user cache: a migrated database, recorded as a boot would record it."""
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(tmp_path / "user-cache"))
    directory = template_dir()
    directory.mkdir(parents=True)
    with closing(sqlite3.connect(migrated_prefect_home / "prefect.db")) as source, \
            closing(sqlite3.connect(directory / TEMPLATE_DATABASE)) as target:
        source.backup(target)
    _mark(directory / TEMPLATE_DATABASE)
    (directory / TEMPLATE_RECORD).write_text(json.dumps({**_this_prefect(),
                                                         **_database_facts(directory / TEMPLATE_DATABASE)}))
    return directory


def test_a_missing_database_is_a_copy_of_this_prefects_template(template, tmp_path):
    database = tmp_path / "home" / "prefect.db"
    assert not seed_database(database)  # in a directory that is not there: Prefect's boot says it cannot open it
    database.parent.mkdir()
    assert seed_database(database)
    assert database.read_bytes() == (template / TEMPLATE_DATABASE).read_bytes()
    assert sorted(p.name for p in database.parent.iterdir()) == ["prefect.db"]  # no temporary copy left


@pytest.mark.parametrize("present", ["prefect.db", "prefect.db-wal", "prefect.db-journal"])
def test_a_database_that_is_there_is_left_alone(template, tmp_path, present):
    home = tmp_path / "home"
    home.mkdir()
    (home / present).write_bytes(b"the user's")
    assert not seed_database(home / "prefect.db")
    assert sorted(p.name for p in home.iterdir()) == [present]
    assert (home / present).read_bytes() == b"the user's"


@pytest.mark.parametrize("change", [{"prefect": "3.0.0"}, {"collections": []}, {"revision": "0123456789ab"},
                                    {"block_types": 1}])
def test_a_template_made_by_another_prefect_is_not_used(template, tmp_path, change):
    record = json.loads((template / TEMPLATE_RECORD).read_text())
    (template / TEMPLATE_RECORD).write_text(json.dumps({**record, **change}))
    database = tmp_path / "home" / "prefect.db"
    database.parent.mkdir()
    assert not seed_database(database)
    assert not database.exists()


def test_a_damaged_template_is_not_used(template, tmp_path):
    (template / TEMPLATE_DATABASE).write_bytes(b"not a database")
    (tmp_path / "home").mkdir()
    assert not seed_database(tmp_path / "home" / "prefect.db")
    assert not (tmp_path / "home" / "prefect.db").exists()


BOOT = """
import sys
from sft_tokenize.server.embedded_server import EmbeddedServer
server = EmbeddedServer(idle=float(sys.argv[1]))
server.start()
server.wait_until_ready()
server.release()
"""


def _boot(home: Path, user_cache: Path, idle: float = 0) -> None:
    """The embedded server of a run on `home`, booted until it answers, then left: stopped, or idle for `idle` s."""
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", BOOT, str(idle)],
                          env=environment(home, SFT_TOKENIZE_HOME=str(user_cache)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _boot_record(home: Path, timeout: float = 60.0) -> dict:
    """The boot record of `home`'s server, once written (a database made from the schema is recorded only after its
    block types are registered, when no run uses the server any more)."""
    deadline = time.monotonic() + timeout
    while not (home / BOOT_RECORD).exists():
        assert time.monotonic() < deadline, f"no {BOOT_RECORD} after {timeout:.0f} s"
        time.sleep(0.2)
    return json.loads((home / BOOT_RECORD).read_text())


def test_a_fresh_home_is_made_from_the_schema_and_its_block_types_registered_after_the_run(tmp_path, server_home):
    user_cache = tmp_path / "user-cache"
    _boot(server_home, user_cache, idle=60)  # registered once idle (a server stopped at once boots in full next)
    try:
        record = _boot_record(server_home)
    finally:
        subprocess.run([str(Path(sys.executable).parent / "sft-tokenize"), "server", "stop"],
                       env=environment(server_home), capture_output=True, timeout=120)
    assert record == {**_this_prefect(), "database": str((server_home / "prefect.db").resolve()),
                      **_database_facts(server_home / "prefect.db")}
    assert record["block_types"] > 0  # registered, as a full boot leaves it
    log = (server_home / "embedded-server.log").read_text()
    assert "not registered" not in log and "migrating" not in log
    assert not (user_cache / "prefect-databases").exists()  # no template: the schema serves every fresh home


def test_a_database_prefect_made_boots_in_full_once_and_is_recorded(tmp_path, migrated_prefect_home):
    """A PREFECT_HOME that plain Prefect used before: its first boot migrates the database and registers the block
    types, as Prefect's own boot does, and is recorded for the next boot on it to skip both; with no idle time the
    run stops the server as soon as it answers, so the record is written by then."""
    home = Path(shutil.copytree(migrated_prefect_home, tmp_path / "home"))
    assert not (home / BOOT_RECORD).exists()
    _boot(home, tmp_path / "user-cache")
    assert json.loads((home / BOOT_RECORD).read_text()) == {
        **_this_prefect(), "database": str((home / "prefect.db").resolve()), **_database_facts(home / "prefect.db")}
    assert _database_facts(home / "prefect.db")["block_types"] > 0  # registered by that boot


def test_the_template_is_a_migrated_registered_database_and_fresh_homes_copy_it(tmp_path, monkeypatch, server_home):
    user_cache = tmp_path / "user-cache"
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(user_cache))
    made = subprocess.run([sys.executable, "-c", "from sft_tokenize.server import server_process as s; "
                           "s.make_template(s._database_file())"],
                          env=environment(server_home, SFT_TOKENIZE_HOME=str(user_cache)), capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0 and "Prefect's own engine" not in made.stderr, made.stderr[-3000:]  # synchronous
    template = template_dir()
    record = json.loads((template / TEMPLATE_RECORD).read_text())
    assert record == {**_this_prefect(), **_database_facts(template / TEMPLATE_DATABASE)}
    assert record["block_types"] > 0  # migrated and registered, as a full boot leaves it
    with closing(sqlite3.connect(template / TEMPLATE_DATABASE)) as db:  # nothing served yet when it was taken
        assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)
    _mark(template / TEMPLATE_DATABASE)

    _boot(tmp_path / "second", user_cache)
    assert _marked(tmp_path / "second" / "prefect.db")
    # Recorded as a full boot's database at once: the next boot on it skips the migrations and the block-type check.
    boot = json.loads((tmp_path / "second" / BOOT_RECORD).read_text())
    assert (boot["revision"], boot["block_types"]) == (record["revision"], record["block_types"])
    # A template another Prefect made is not copied (test_a_template_made_by_another_prefect_is_not_used): the boot
    # then makes the database from the schema (test_a_fresh_home_is_made_from_the_schema_…).


def _contents(database: Path) -> dict[str, object]:
    """Every schema object and every table's rows. A table's constraints are compared as a set: Alembic's batch
    migrations, Prefect's own included, rebuild a table with its foreign keys in an order that varies by run."""
    with closing(sqlite3.connect(database)) as db:
        objects = db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
        contents: dict[str, object] = {}
        for kind, name, table, sql in objects.fetchall():
            contents[f"{kind} {name} on {table}"] = sorted(re.split(r",\s*\n", (sql or "").removesuffix("\n)")))
            if kind == "table":
                contents[f"rows of {name}"] = sorted(map(repr, db.execute(f'SELECT * FROM "{name}"')))
    return contents


@pytest.mark.slow  # migrates a new database (~3 s)
def test_the_synchronous_migration_leaves_what_prefects_own_upgrade_leaves(tmp_path, migrated_prefect_home):
    database = tmp_path / "prefect.db"
    revision = migrate_sqlite(database)
    assert revision == _database_facts(migrated_prefect_home / "prefect.db")["revision"]
    ours, prefects = _contents(database), _contents(migrated_prefect_home / "prefect.db")
    assert len(ours) > 100 and ours.keys() == prefects.keys()
    assert [name for name in ours if ours[name] != prefects[name]] == []


def test_the_shipped_schema_is_the_one_this_prefects_migrations_build(tmp_path, migrated_prefect_home):
    header = prefect_migrations.SCHEMA.read_text()[:2000]
    assert f"-- migrations: {migrations_key()}\n" in header, (
        "prefect_schema.sql is not this Prefect's: fresh homes migrate (~2 s of each first boot) until "
        "`python -m sft_tokenize.server.prefect_migrations` writes it again")
    database = tmp_path / "prefect.db"
    assert create_from_schema(database)
    ours, prefects = _contents(database), _contents(migrated_prefect_home / "prefect.db")
    assert len(ours) > 100 and ours.keys() == prefects.keys()
    assert [name for name in ours if ours[name] != prefects[name]] == []


def test_a_schema_made_for_other_migrations_is_not_used(tmp_path, monkeypatch):
    schema = tmp_path / "prefect_schema.sql"
    schema.write_text(prefect_migrations.SCHEMA.read_text().replace(f"-- migrations: {migrations_key()}",
                                                                   "-- migrations: 0123456789abcdef"))
    monkeypatch.setattr(prefect_migrations, "SCHEMA", schema)
    assert not create_from_schema(tmp_path / "prefect.db")
    assert not (tmp_path / "prefect.db").exists()
