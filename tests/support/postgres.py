"""A throwaway PostgreSQL for the Prefect servers that tests and benchmarks run on it, as a team's server runs on
one: Debian's `postgresql` package's binaries (`apt-get install postgresql`; .ci/run installs it), a new cluster
in a temporary directory, listening on a free loopback port only (no Unix socket), trust authentication for its
`postgres` role, stopped and deleted afterwards. Each Prefect server gets a database of its own in it
(`database(name)`).

PostgreSQL refuses to run as root: as root (CI), the cluster is owned by and runs as the package's `postgres`
user. `fast=True` turns off what makes commits durable (fsync, synchronous commit, full-page writes), for tests;
benchmarks keep PostgreSQL's defaults.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from support.cli import free_port

INSTALL = "apt-get install postgresql (Debian's package)"
NOT_DURABLE = ("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")


def bindir() -> Path | None:
    """The newest installed PostgreSQL's binaries (Debian keeps each major version in /usr/lib/postgresql/N/bin),
    or those on PATH; None if there are none."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parent.parent.name))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("postgres")
    return Path(on_path).parent if on_path else None


class Postgres:
    """A running cluster: `url` of its `postgres` database, `database(name)` a new database's Prefect URL."""

    def __init__(self, binaries: Path, port: int, process: subprocess.Popen, directory: Path, user: str | None):
        self.binaries, self.port, self.process, self.directory, self.user = binaries, port, process, directory, user

    def _run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.binaries / command[0]), "-h", "127.0.0.1", "-p", str(self.port),
                               "-U", "postgres", *command[1:]], capture_output=True, text=True, timeout=60,
                              check=True)

    def database(self, name: str) -> str:
        """A new, empty database `name`: its SQLAlchemy URL for Prefect (PREFECT_API_DATABASE_CONNECTION_URL)."""
        self._run("createdb", name)
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{name}"

    def size(self, name: str) -> int:
        """The database's size on disk, in bytes (pg_database_size)."""
        result = self._run("psql", "-d", name, "-tAc", f"select pg_database_size('{name}')")
        return int(result.stdout.strip())


def _as_owner(user: str | None) -> dict:
    return {"user": user, "group": pwd.getpwnam(user).pw_gid} if user else {}


def _wait_ready(binaries: Path, port: int, process: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        ready = subprocess.run([str(binaries / "pg_isready"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres"],
                               capture_output=True)
        if ready.returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"PostgreSQL did not start on 127.0.0.1:{port}:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """A fast shutdown (SIGINT: roll back open transactions, then exit), SIGKILL after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
    if process.poll() is None:
        process.kill()
    process.wait()


@contextlib.contextmanager
def postgres(fast: bool = False) -> Iterator[Postgres]:
    """A new PostgreSQL cluster on a free loopback port while the block runs; raises RuntimeError naming the
    package to install if there is no PostgreSQL."""
    binaries = bindir()
    if binaries is None:
        raise RuntimeError(f"no PostgreSQL server binaries: {INSTALL}")
    user = "postgres" if os.geteuid() == 0 else None  # initdb and postgres refuse to run as root
    directory = Path(tempfile.mkdtemp(prefix="sft-tokenize-postgres-"))
    try:
        if user:
            os.chown(directory, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
        data, log = directory / "data", directory / "postgres.log"
        subprocess.run([str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                        "--no-sync"], capture_output=True, text=True, timeout=120, check=True, **_as_owner(user))
        for _ in range(3):  # another process may bind the free port first
            port = free_port()
            with log.open("w") as out:
                process = subprocess.Popen(
                    [str(binaries / "postgres"), "-D", str(data), "-p", str(port), "-c", "listen_addresses=127.0.0.1",
                     "-c", "unix_socket_directories=", "-c", "max_connections=200", *(NOT_DURABLE if fast else ())],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    **_as_owner(user))
            try:
                _wait_ready(binaries, port, process, log)
                break
            except RuntimeError:
                _stop(process)
        else:
            raise RuntimeError(f"PostgreSQL did not start:\n{log.read_text()[-3000:]}")
        try:
            yield Postgres(binaries, port, process, directory, user)
        finally:
            _stop(process)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
