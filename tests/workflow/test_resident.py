"""The resident process (sft_tokenize/flows/resident.py): after a run that leaves the embedded server up, the next
`sft-tokenize run` of that environment runs in a child of a process that has done its imports, and a user sees
the same command: its output, its error lines and exit codes, Ctrl-C. It ends with the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from support.caches import contents, staged_shards
from support.cli import TIMEOUT, cli, environment, error_line, run_args
from support.data import example_rows, write_jsonl
from support.paths import BIN, EXAMPLE_DATA
from support.servers import running

pytestmark = pytest.mark.skipif(os.uname().sysname != "Linux", reason="the resident process is Linux's")

IDLE = ["--server-idle", "120"]


def start(args: list[str], home: Path, trace: Path, **extra: str) -> subprocess.Popen:
    trace.unlink(missing_ok=True)
    return subprocess.Popen([str(BIN / "sft-tokenize"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True,
                            env=environment(home, SFT_TOKENIZE_TRACE=str(trace), **extra))


def finished(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=TIMEOUT)
    return process.returncode, out, err


def ran_in(trace: Path) -> set[int]:
    """The processes that wrote the run's timeline: the command's own, or a resident's child."""
    return {json.loads(line)["pid"] for line in trace.read_text().splitlines()}


def residents_of(home: Path) -> list[psutil.Process]:
    """The resident processes started beside the embedded server of `home`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "sft_tokenize.flows.resident import serve" in " ".join(process.info["cmdline"] or []) and \
                    process.environ().get("PREFECT_HOME") == str(home):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def resident_of(home: Path, timeout: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while not (found := residents_of(home)):
        assert time.monotonic() < deadline, f"no resident process for {home}"
        time.sleep(0.1)
    return found[0]


def test_runs_after_a_warm_one_run_in_the_resident_alike_and_it_ends_with_the_server(tmp_path, prefect_home):
    trace = tmp_path / "trace.jsonl"
    first = start(run_args([EXAMPLE_DATA], tmp_path / "first", "-q", *IDLE), prefect_home, trace)
    code, out, err = finished(first)
    assert code == 0, err
    assert ran_in(trace) == {first.pid}  # no resident yet: the command ran in its own process
    server = json.loads((prefect_home / "sft-tokenize-server.json").read_text())["pid"]
    resident = resident_of(prefect_home)
    try:
        # The same run into another cache root, in a child of the resident: the same cache, the same output.
        second = start(run_args([EXAMPLE_DATA], tmp_path / "second", "-q", *IDLE), prefect_home, trace)
        code, out2, err2 = finished(second)
        assert code == 0, err2
        assert [line.rsplit(" ", 1)[0] for line in err2.splitlines()] == \
            [line.rsplit(" ", 1)[0] for line in err.splitlines()]  # the progress bar's last state, less its time
        child = ran_in(trace)
        assert len(child) == 1 and second.pid not in child
        assert not running(child.pop())  # the child is reaped once its exit code is passed on
        first_cache, second_cache = Path(out.splitlines()[-1]), Path(out2.splitlines()[-1])
        assert second_cache.parent == tmp_path / "second" and second_cache.name == first_cache.name
        assert contents(second_cache) == contents(first_cache)

        # Bad input: its one line on the command's stderr and exit 2.
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "narrator", "content": "x"}]}])
        rejected = start(run_args([bad], tmp_path / "third", *IDLE), prefect_home, trace)
        code, out3, err3 = finished(rejected)
        assert (code, out3) == (2, "")
        assert f"{bad}:1: messages[0] has unknown role 'narrator'" in error_line(err3)
        assert rejected.pid not in ran_in(trace)

        # Ctrl-C reaches the child: the run stops as it would in the command's own process.
        long_input = write_jsonl(tmp_path / "long.jsonl", example_rows() * 8)
        cache_root = tmp_path / "interrupted"
        stopped = start(run_args([long_input], cache_root, *IDLE), prefect_home, trace)
        deadline = time.monotonic() + TIMEOUT
        while not staged_shards(cache_root):
            assert stopped.poll() is None and time.monotonic() < deadline, stopped.stderr.read()
            time.sleep(0.02)
        stopped.send_signal(signal.SIGINT)
        code, _, err4 = finished(stopped)
        assert code == 130, err4
        assert "interrupted (SIGINT)" in error_line(err4) and stopped.pid not in ran_in(trace)
        assert not [p for p in cache_root.iterdir() if not p.name.startswith(".")]  # nothing published

        # Another environment is another resident's: this command runs in its own process.
        elsewhere = start(run_args([EXAMPLE_DATA], tmp_path / "elsewhere", "-q", *IDLE), prefect_home, trace,
                          SFT_TOKENIZE_TEST_OTHER="1")
        code, _, err5 = finished(elsewhere)
        assert code == 0, err5
        assert ran_in(trace) == {elsewhere.pid}
        assert resident.is_running()

        # `server stop` ends the server, and the resident with it.
        assert cli("server", "stop", home=prefect_home).returncode == 0
        resident.wait(timeout=30)
    finally:
        for pid in (server, resident.pid):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        for other in residents_of(prefect_home):  # the other environment's
            other.kill()


def test_sft_tokenize_resident_0_keeps_every_run_in_its_own_process(tmp_path, prefect_home):
    trace = tmp_path / "trace.jsonl"
    try:
        for name in ("first", "second"):
            run = start(run_args([EXAMPLE_DATA], tmp_path / name, "-q", "--server-idle", "60"), prefect_home,
                        trace, SFT_TOKENIZE_RESIDENT="0")
            code, _, err = finished(run)
            assert code == 0, err
            assert ran_in(trace) == {run.pid}
        assert residents_of(prefect_home) == []
    finally:
        cli("server", "stop", "--force", home=prefect_home)
