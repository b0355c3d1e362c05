"""Input a user should not have given: rows that are wrong in each way the reader names, files written line by
line with such a row in them, and what every refusal before Prefect starts must look like."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

from support.caches import published_caches
from support.cli import assert_rejected, cli, run_args
from support.data import example_rows

BAD_LINE = '{"messages": [{"role": "user", "content": "hi"}'


def file_with(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


ROW_ERRORS = {  # a row that is wrong, and how the error says so
    "malformed-json": ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON: Expecting"),
    "not-utf8": ('{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"),
                 "not valid UTF-8 (byte 0xe9 at column 47)"),
    "messages-not-a-list": ('{"messages": "hello"}', "'messages' is a string that is not the JSON of a message list"),
    "no-role": ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}',
                "messages[0] has no 'role'"),
    "no-content": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}',
                   "messages[1] has no 'content'"),
    "content-not-text": ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
                         '{"url": "x.png"}}]}, {"role": "assistant", "content": "yo"}]}',
                         "messages[0].content[0] is a part of type 'image_url': only text parts"),
    "unknown-role": ('{"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
                     "messages[0] has unknown role 'narrator' (known: system, user, assistant, tool, developer, "
                     "function, ipython)"),
    "lone-surrogate": ('{"messages": [{"role": "user", "content": "\\ud83d"}, {"role": "assistant", "content": "yo"}]}',
                       "a lone surrogate \\ud83d in a string"),
    "deep-nesting": ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON: nested too deeply"),
}
NO_ASSISTANT = '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}'


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def with_a_bad_row(path: Path, bad: str | bytes) -> Path:
    """Three good rows with the bad one on line 3."""
    good = [json.dumps(row) for row in example_rows()[:3]]
    return write_lines(path, good[:2] + [bad] + good[2:])


def built_skipping(data: Path, cache_root: Path, home: Path, api_url: str) -> tuple[Path, dict]:
    """`sft-tokenize run --on-bad-row skip` that succeeds: the cache's path and its manifest."""
    result = cli(*run_args([data], cache_root, "--on-bad-row", "skip"), home=home, api_url=api_url)
    assert result.returncode == 0, result.stderr
    cache_path = Path(result.stdout.splitlines()[-1])
    return cache_path, json.loads((cache_path / "manifest.json").read_text())


def flow_runs_in(home: Path) -> int:
    """The flow runs recorded in the database of this PREFECT_HOME: none without a database, or with one whose
    tables were not made yet (an embedded server booting beside a run that was refused, stopped with it)."""
    database = home / "prefect.db"
    if not database.exists():
        return 0
    with closing(sqlite3.connect(database)) as db:
        try:
            return db.execute("SELECT count(*) FROM flow_run").fetchone()[0]
        except sqlite3.OperationalError as error:
            if "no such table" in str(error):
                return 0
            raise


def assert_refused_before_prefect_started(d: Path, result: subprocess.CompletedProcess, *expected: str) -> None:
    """What a refused run (the `sft-tokenize run` of directory d: d/prefect-home, d/cache) leaves a user: one clean
    line and exit 2, no flow run, nothing published or staged. The embedded server boots while the run plans, so
    on a slow machine it may have made its database before the refusal: whether prefect.db exists is no part of
    the promise."""
    assert_rejected(result, *expected)
    assert flow_runs_in(d / "prefect-home") == 0
    assert published_caches(d / "cache") == []
    assert not list((d / "cache").glob(".staging/*"))
