"""A new PREFECT_HOME's database starts as a copy of the template this Prefect made once (flows/server_process.py):
used only when made by this very Prefect, never over a database that is there."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from support.cli import environment

from sft_tokenize.flows.prefect_migrations import migrate_sqlite
from sft_tokenize.flows.server_process import (
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
    assert not seed_database(database)
    assert not database.exists()


def test_a_damaged_template_is_not_used(template, tmp_path):
    (template / TEMPLATE_DATABASE).write_bytes(b"not a database")
    assert not seed_database(tmp_path / "home" / "prefect.db")
    assert not (tmp_path / "home" / "prefect.db").exists()


BOOT = """
from sft_tokenize.flows.embedded_server import EmbeddedServer
server = EmbeddedServer(idle=0)
server.start()
server.wait_until_ready()
server.release()
"""


def _boot(home: Path, user_cache: Path) -> None:
    """The embedded server of a run on `home`, booted until it answers, then stopped."""
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", BOOT], env=environment(home, SFT_TOKENIZE_HOME=str(user_cache)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_first_fresh_home_makes_the_template_and_the_next_ones_copy_it(tmp_path, monkeypatch, server_home):
    user_cache = tmp_path / "user-cache"
    monkeypatch.setenv("SFT_TOKENIZE_HOME", str(user_cache))
    _boot(server_home, user_cache)  # the embedded servers of three fresh homes
    assert "Prefect's own engine" not in (server_home / "embedded-server.log").read_text()  # migrated synchronously
    template = template_dir()
    record = json.loads((template / TEMPLATE_RECORD).read_text())
    assert record == {**_this_prefect(), **_database_facts(template / TEMPLATE_DATABASE)}
    assert record["block_types"] > 0  # migrated and registered, as a full boot leaves it
    with closing(sqlite3.connect(template / TEMPLATE_DATABASE)) as db:  # nothing served yet when it was taken
        assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)
    _mark(template / TEMPLATE_DATABASE)

    _boot(tmp_path / "second", user_cache)
    assert _marked(tmp_path / "second" / "prefect.db")
    # Recorded as a full boot's database: the next boot on it skips the migrations and the block-type check.
    boot = json.loads((tmp_path / "second" / "sft-tokenize-server-boot.json").read_text())
    assert (boot["revision"], boot["block_types"]) == (record["revision"], record["block_types"])

    (template / TEMPLATE_RECORD).write_text(json.dumps({**record, "prefect": "3.0.0"}))  # as another Prefect's
    _boot(tmp_path / "third", user_cache)
    assert not _marked(tmp_path / "third" / "prefect.db")
    assert _database_facts(tmp_path / "third" / "prefect.db") == {k: record[k] for k in ("revision", "block_types")}


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
