"""Running `sft-tokenize` the way a user does, in a subprocess: the environment it gets (no Prefect settings of
this test session, a PREFECT_HOME of its own, a server or none), the command itself, and what a clean error
looks like."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from support import lanes
from support.faults import FAULT_FILE_ENV
from support.paths import BIN, EXAMPLE_TOKENIZER

TIMEOUT = 300  # seconds for one CLI run on a busy 2-core machine, embedded server included
# What a clean error never shows on stderr: a traceback, the embedded server's or transformers' start-up talk.
NOISE = ("Traceback", "PyTorch was not found", "Starting temporary server", "BrokenPipeError")


def environment(home: Path, api_url: str | None = None, *, startup_timeout: int | None = 90,
                **extra: str | None) -> dict[str, str]:
    """This process's environment without its Prefect settings or a fault file, with PREFECT_HOME=home and the
    server at `api_url`, or none (the CLI then starts its embedded one); `extra` on top, None removing a variable.

    A busy 2-core machine can take longer than Prefect's default 20 s to start the embedded server, hence
    `startup_timeout`; None keeps Prefect's default. The early server (server/server_fork.py) is forked only where
    a test asks for it (SFT_TOKENIZE_EARLY_SERVER=1): left to the machine's load, whether a run forks it would
    differ from one run of the suite to the next, and a run refused while it plans would boot one for nothing."""
    environ: dict[str, str | None] = {k: v for k, v in os.environ.items()
                                      if not k.startswith("PREFECT_") and k != FAULT_FILE_ENV}
    environ.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", SFT_TOKENIZE_EARLY_SERVER="0")
    if startup_timeout is not None:
        environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = str(startup_timeout)
    if api_url:
        environ["PREFECT_API_URL"] = api_url
    environ.update(extra)
    return {k: v for k, v in environ.items() if v is not None}


def client_env(api_url: str, home: Path, **extra: str | None) -> dict[str, str]:
    """The environment of a Prefect client of the server at `api_url` (`prefect deploy`, a worker, serve.py)."""
    return environment(home, api_url, startup_timeout=None, TRANSFORMERS_NO_ADVISORY_WARNINGS="1", **extra)


def cli(*args: str, home: Path, api_url: str | None = None, env: dict[str, str | None] | None = None,
        preexec: Callable[[], None] | None = None, timeout: float = TIMEOUT,
        startup_timeout: int | None = 90) -> subprocess.CompletedProcess:
    """Run `sft-tokenize ARGS` to its end; `env` adds variables to `environment(home, api_url)` (None removes one)."""
    lanes.require("cli", f"`sft-tokenize {args[0] if args else ''}` in a subprocess")
    return subprocess.run([str(BIN / "sft-tokenize"), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env=environment(home, api_url, startup_timeout=startup_timeout, **(env or {})),
                          preexec_fn=preexec, timeout=timeout)


def run_args(sources: list[Path | str], cache_root: Path, *extra: str) -> list[str]:
    """`run` of `sources` with the example tokenizer, slices of 100KB (the example's 240 rows are four) and
    two workers; `extra` after them, where a repeated option wins."""
    return ["run", *map(str, sources), "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(cache_root),
            "--shard-size", "100KB", "--workers", "2", *extra]


def error_line(stderr: str) -> str:
    """The CLI's last stderr line, after checking that nothing on stderr is a traceback or start-up noise."""
    assert not [noise for noise in NOISE if noise in stderr], stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("sft-tokenize: error: "), stderr
    return last


def assert_clean_error(result, code: int, *expected: str) -> str:
    """`result` (a finished run: returncode, stdout, stderr) exited `code`, printed nothing on stdout and no noise,
    and its last stderr line holds each of `expected`; returns that line."""
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    last = error_line(result.stderr)
    for text in expected:
        assert text in last, last
    return last


def assert_rejected(result, *expected: str) -> str:
    """A usage or input error: exit 2, one clean line."""
    return assert_clean_error(result, 2, *expected)


def free_port() -> int:
    """A loopback port free now (another process may take it before it is used)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
