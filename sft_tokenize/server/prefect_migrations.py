"""A new Prefect SQLite database: made from the schema this package ships when it is this Prefect's, else migrated by
Prefect's own Alembic scripts over a synchronous connection.

Prefect creates its database by running its Alembic migrations (over a hundred) through its async engine: each of
their ~34,000 statements, most of them the table reflection that SQLite's batch migrations need, is a round trip to
aiosqlite's thread, ~5 s of a fresh PREFECT_HOME's first boot on 2 cores. The same scripts, run by Alembic with the
options Prefect's `_migrations/env.py` gives it, over a pysqlite connection set up by Prefect's own connection hooks,
take ~2.4 s and leave the same tables, indexes and rows (tests/workflow/test_database_template.py compares them with
Prefect's `prefect server database upgrade`). Whatever goes wrong here, the caller falls back to Prefect's own
`create_db` on a new file.

Even so, migrating is most of a user's first boot. The schema those scripts build is a function of the scripts, so
`prefect_schema.sql` beside this module holds it, as SQLite's own dump of a database `migrate_sqlite` made, headed
by a hash of the scripts (`migrations_key`): a new database made from it takes ~10 ms. It is used only while that
hash is the installed Prefect's; otherwise databases are migrated as above. After a Prefect upgrade that changes its
migrations, `python -m sft_tokenize.server.prefect_migrations` writes it again (a test fails until then). Block types
are not in it: they depend on the installed collections, and server_process.py registers them once the first run
is over.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import warnings
from contextlib import closing
from pathlib import Path

SCHEMA = Path(__file__).with_name("prefect_schema.sql")


def _migrations_dir() -> Path:
    from prefect.server.database import provide_database_interface

    return Path(provide_database_interface().orm.versions_dir)


def migrations_key() -> str:
    """A hash of this Prefect's SQLite migration scripts and of the Alembic environment that runs them."""
    versions = _migrations_dir()
    digest = hashlib.sha256()
    for path in [versions.parents[1] / "env.py", *sorted(versions.glob("*.py"))]:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:32]


def create_from_schema(database: Path) -> bool:
    """Make the new SQLite file `database` from the shipped schema if it is this Prefect's; whether it did."""
    try:
        script = SCHEMA.read_text()
    except OSError:
        return False
    made_for = re.search(r"^-- migrations: (\w+)$", script, re.MULTILINE)
    if made_for is None or made_for[1] != migrations_key():
        return False
    with closing(sqlite3.connect(database)) as db:
        db.executescript(script)
    return True


def write_schema(path: Path = SCHEMA) -> str:
    """Write this Prefect's schema, as `migrate_sqlite` builds it, to `path`; its Alembic revision."""
    import tempfile

    import prefect

    with tempfile.TemporaryDirectory() as scratch:
        database = Path(scratch) / "prefect.db"
        revision = migrate_sqlite(database)
        with closing(sqlite3.connect(database)) as db:
            dump = "\n".join(db.iterdump())
    header = (f"-- Prefect's SQLite schema as its migrations build it: made by `python -m {__spec__.name}`,\n"
              f"-- read by {Path(__file__).name} while the hash of the migrations below is the installed Prefect's.\n"
              f"-- migrations: {migrations_key()}\n-- revision: {revision}\n-- prefect: {prefect.__version__}\n")
    path.write_text(header + dump + "\n")
    return revision


def migrate_sqlite(database: Path) -> str:
    """Migrate the SQLite file `database` (Prefect's configured database, new or partly migrated) to this Prefect's
    head revision; the revision. Raises if the database does not end at the head."""
    import sqlalchemy as sa
    from alembic.runtime.environment import EnvironmentContext
    from alembic.script import ScriptDirectory
    from prefect.server.database import provide_database_interface
    from prefect.server.database.alembic_commands import alembic_config
    from prefect.server.database.configurations import SQLITE_BEGIN_MODE

    db = provide_database_interface()
    engine = sa.create_engine(f"sqlite:///{database}", poolclass=sa.pool.NullPool)

    def no_implicit_begin(connection, record) -> None:  # Prefect's hook does this for aiosqlite connections only
        connection.isolation_level = None  # transactions are the BEGIN IMMEDIATE its "begin" hook emits

    sa.event.listen(engine, "connect", no_implicit_begin)
    sa.event.listen(engine, "connect", db.database_config.setup_sqlite)
    sa.event.listen(engine, "begin", db.database_config.begin_sqlite_stmt)
    config = alembic_config()
    script = ScriptDirectory(ScriptDirectory.from_config(config).dir, version_locations=[db.orm.versions_dir])
    head = script.get_current_head()
    upgrade = lambda revision, _: script._upgrade_revs(head, revision)  # noqa: E731 - as alembic.command.upgrade
    token = SQLITE_BEGIN_MODE.set("IMMEDIATE")
    try:
        with warnings.catch_warnings(), engine.connect() as connection, \
                EnvironmentContext(config, script, fn=upgrade, destination_rev=head) as context:
            warnings.filterwarnings("ignore", message="Skipped unsupported reflection of expression-based index")
            # As env.py's do_run_migrations: one transaction per migration, batch mode, foreign keys off meanwhile
            context.configure(connection=connection, target_metadata=db.Base.metadata, include_schemas=True,
                              render_as_batch=True, transaction_per_migration=True,
                              template_args={"dialect": "sqlite"})
            context.execute("COMMIT")
            context.execute("PRAGMA foreign_keys=OFF")
            context.execute("BEGIN IMMEDIATE")
            with context.begin_transaction():
                context.run_migrations()
            context.execute("END")
            context.execute("PRAGMA foreign_keys=ON")
            revision = context.get_context().get_current_revision()
    finally:
        SQLITE_BEGIN_MODE.reset(token)
        engine.dispose()
    if revision != head:
        raise RuntimeError(f"migrated to {revision}, not this Prefect's head {head}")
    return revision


if __name__ == "__main__":
    print(f"{SCHEMA}: revision {write_schema()}")
