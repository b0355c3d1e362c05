"""The embedded Prefect server SIGKILLed, or stopped by `sft-tokenize server stop --force`, under a run while a
slice is still tokenizing: the run ends within seconds with one line saying what happened to the server (exit 1),
no traceback, no Prefect talk and no hang; the finished shards stay, and the same command starts a fresh server,
reuses them and publishes the cache a clean build gives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.caches import assert_no_partial_shard, contents, staged_shards
from support.cli import TIMEOUT, assert_clean_error, cli, environment, run_args
from support.data import example_rows, write_jsonl
from support.faults import FAULT_FILE_ENV
from support.paths import BIN, EXAMPLE_TOKENIZER
from support.runs import assert_group_gone

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.build.timeline import TRACE_ENV

HELD = 3  # the slice that is still tokenizing when the server dies
SLICES = 7  # the example rows twice over, in slices of 100KB
ENDS_WITHIN = 60  # seconds from the kill to the run's exit: a run that waits on a dead server fails this


def stop_by_kill(prefect_home: Path, server: int) -> None:
    os.kill(server, signal.SIGKILL)


def stop_by_command(prefect_home: Path, server: int) -> None:
    stopped = cli("server", "stop", "--force", home=prefect_home)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"stopped the embedded server (pid {server})")


STOPS = {  # how the server is stopped under the run, and what the run's line says
    "sigkill": (stop_by_kill, "went away during the run (killed, or out of memory"),
    "server-stop-force": (stop_by_command, "was stopped during the run by `sft-tokenize server stop --force`"),
}


def _server_joined(trace: Path) -> bool:
    return trace.exists() and any(json.loads(line)["event"] == "server" for line in trace.read_text().splitlines())


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> tuple[Path, Path]:
    """The input every case runs on, and the cache a clean build of it gives."""
    root = tmp_path_factory.mktemp("many")
    data = write_jsonl(root / "many.jsonl", example_rows() * 2)
    return data, run_locally(TokenizeOptions(sources=[str(data)], tokenizer=str(EXAMPLE_TOKENIZER),
                                             cache_dir=str(root / "reference"), shard_size="100KB"))


@pytest.mark.parametrize("stop", STOPS)
def test_a_lost_embedded_server_ends_the_run_in_one_line_and_the_same_command_resumes(tmp_path, prefect_home, stop,
                                                                                     many):
    data, reference = many
    cache_root = tmp_path / "cache"
    args = run_args([data], cache_root)
    faults = tmp_path / "faults"
    faults.write_text(f"hold:{HELD}")  # slice 3 tokenizes until the run stops it
    trace = tmp_path / "trace.jsonl"  # its "server" event: the server answered and the flow starts
    logs = {name: tmp_path / name for name in ("stdout", "stderr")}
    with logs["stdout"].open("w") as out, logs["stderr"].open("w") as err:
        run = subprocess.Popen([str(BIN / "sft-tokenize"), *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                               env=environment(prefect_home, **{FAULT_FILE_ENV: str(faults), TRACE_ENV: str(trace)}),
                               start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        # Every slice but the held one, some perhaps tokenized while the server booted: the server is stopped
        # under the flow, not under its boot.
        while len(staged_shards(cache_root)) < SLICES - 1 or not _server_joined(trace):
            assert run.poll() is None, logs["stderr"].read_text()
            assert time.monotonic() < deadline, logs["stderr"].read_text()
            time.sleep(0.05)
        server = json.loads((prefect_home / "sft-tokenize-server.json").read_text())["pid"]
        STOPS[stop][0](prefect_home, server)
        killed = time.monotonic()
        code = run.wait(timeout=ENDS_WITHIN)
        assert time.monotonic() - killed < ENDS_WITHIN
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert_group_gone(run.pid)
    result = SimpleNamespace(returncode=code, stdout=logs["stdout"].read_text(), stderr=logs["stderr"].read_text())
    # Nothing but the run's log lines before it: no Prefect example code, no state of a flow it could not end.
    assert "Finished in state Running()" not in result.stderr and "```" not in result.stderr, result.stderr
    assert all(line.startswith(("tokenizing ", "sft-tokenize: error: ")) or line[:2].isdigit()
               for line in result.stderr.strip().splitlines()), result.stderr
    assert_clean_error(result, 1, f"the embedded Prefect server (pid {server}) {STOPS[stop][1]}",
                       "run the same command again")
    kept = staged_shards(cache_root)
    assert len(kept) == SLICES - 1
    assert_no_partial_shard(cache_root)
    assert not list((cache_root / ".shards").glob("*.tmp-*"))  # the held slice stopped and left nothing

    faults.unlink()
    resumed = cli(*args, home=prefect_home)
    assert resumed.returncode == 0, resumed.stderr
    assert f"tokenizing {SLICES} slices ({SLICES - 1} already in the shard store)" in resumed.stderr
    cache_path = Path(resumed.stdout.splitlines()[-1])
    assert cache_path.name == reference.name
    assert contents(cache_path) == contents(reference)
