"""A run's stderr is its progress and its log, nothing of the embedded server's, and a server that cannot start
says why in one line."""

from __future__ import annotations

from pathlib import Path

from support.caches import published_caches
from support.cli import assert_clean_error, cli, run_args
from support.paths import EXAMPLE_DATA

from sft_tokenize.read.cache import open_cache


def test_a_quiet_run_of_many_slices_on_the_embedded_server_prints_only_its_progress(tmp_path, prefect_home):
    result = cli(*run_args([EXAMPLE_DATA], tmp_path / "cache", "--shard-size", "15KB", "-q"), home=prefect_home)
    assert result.returncode == 0, result.stderr
    assert len(open_cache(Path(result.stdout.splitlines()[-1]))) == 240
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 1 and all("slices" in line for line in lines), result.stderr  # 22/22 slices, 240 rows
    assert (prefect_home / "embedded-server.log").exists()  # where the server's own logs went


def test_an_embedded_server_that_cannot_start_says_why_in_one_line(tmp_path, prefect_home):
    database = tmp_path / "no-such-dir" / "prefect.db"
    # Neither the shipped schema nor a template in the user cache makes a database where its directory is missing.
    result = cli(*run_args([EXAMPLE_DATA], tmp_path / "cache"), home=prefect_home,
                 env={"PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database}",
                      "SFT_TOKENIZE_HOME": str(tmp_path / "user-cache")})
    last = assert_clean_error(result, 1,
                              "the embedded Prefect server (pid ", ") exited with code",
                              "unable to open database file",
                              f"(its log: {prefect_home / 'embedded-server.log'})")
    assert result.stderr.strip().splitlines() == [last]
    assert published_caches(tmp_path / "cache") == []
