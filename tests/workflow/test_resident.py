"""The resident process (sft_tokenize/flows/resident.py): after a run that leaves the embedded server up, the next
`sft-tokenize run` of that environment runs in a process whose imports are done, and a user sees the same
command: its output, its error lines and exit codes, Ctrl-C. It ends with the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.caches import contents, staged_shards
from support.cli import TIMEOUT, cli, environment, error_line, run_args
from support.data import example_rows, write_jsonl
from support.paths import BIN, EXAMPLE_DATA
from support.servers import running

from sft_tokenize.flows.resident_processes import _home_of, residents

pytestmark = pytest.mark.skipif(os.uname().sysname != "Linux", reason="the resident process is Linux's")

IDLE = ["--server-idle", "120"]


def start(args: list[str], home: Path, trace: Path, **extra: str) -> subprocess.Popen:
    trace.unlink(missing_ok=True)
    return subprocess.Popen([str(BIN / "sft-tokenize"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True,
                            env=environment(home, SFT_TOKENIZE_TRACE=str(trace), **extra))


def finished(process: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def ran_in(trace: Path) -> set[int]:
    """The processes that wrote the run's timeline: the command's own, or a resident's."""
    return {json.loads(line)["pid"] for line in trace.read_text().splitlines()}


def ready_resident(home: Path, timeout: float = 120) -> int:
    """The pid of the resident process beside the embedded server of `home`, once it is ready."""
    deadline = time.monotonic() + timeout
    while not (ready := [pid for pid, listening in residents(str(home)) if listening]):
        assert time.monotonic() < deadline, f"no resident process ready for {home}: {residents(str(home))}"
        time.sleep(0.05)
    (pid,) = ready
    return pid


def interrupted_run(home: Path, trace: Path, cache_root: Path, long_input: Path, signum: int) -> tuple[int, str]:
    """A run long enough to be stopped, in the ready resident, sent `signum` once it has a finished shard."""
    resident = ready_resident(home)
    run = start(run_args([long_input], cache_root, *IDLE), home, trace)
    deadline = time.monotonic() + TIMEOUT
    while not staged_shards(cache_root):
        assert run.poll() is None and time.monotonic() < deadline, run.stderr.read()
        time.sleep(0.02)
    run.send_signal(signum)
    code, _, err = finished(run)
    assert ran_in(trace) == {resident}
    deadline = time.monotonic() + 60
    while running(resident):  # it stops its run as the command's own process would, and exits
        assert time.monotonic() < deadline, f"the resident {resident} did not stop"
        time.sleep(0.05)
    assert not [p for p in cache_root.iterdir() if not p.name.startswith(".")]  # nothing published
    return code, err


def test_runs_after_a_warm_one_run_in_a_resident_alike_and_it_ends_with_the_server(tmp_path, prefect_home):
    trace = tmp_path / "trace.jsonl"
    first = start(run_args([EXAMPLE_DATA], tmp_path / "first", "-q", *IDLE), prefect_home, trace)
    code, out, err = finished(first)
    assert code == 0, err
    assert ran_in(trace) == {first.pid}  # no resident yet: the command ran in its own process
    server = json.loads((prefect_home / "sft-tokenize-server.json").read_text())["pid"]
    try:
        # The same run into another cache root, in the resident: the same cache, the same output. It serves one
        # command; the run's exit starts the next resident.
        resident = ready_resident(prefect_home)
        second = start(run_args([EXAMPLE_DATA], tmp_path / "second", "-q", *IDLE), prefect_home, trace)
        code, out2, err2 = finished(second)
        assert code == 0, err2
        assert [line.rsplit(" ", 1)[0] for line in err2.splitlines()] == \
            [line.rsplit(" ", 1)[0] for line in err.splitlines()]  # the progress bar's last state, less its time
        assert ran_in(trace) == {resident}
        first_cache, second_cache = Path(out.splitlines()[-1]), Path(out2.splitlines()[-1])
        assert second_cache.parent == tmp_path / "second" and second_cache.name == first_cache.name
        assert contents(second_cache) == contents(first_cache)
        # The resident kept an encode pool ready for the job of the run before: this small run's batches were
        # encoded by its processes (the first run's, in its own process, by the slices' threads).
        pools = [json.loads((cache / "manifest.json").read_text())["timings"]["encode_processes"]
                 for cache in (first_cache, second_cache)]
        assert pools == [0, len(os.sched_getaffinity(0))]
        assert ready_resident(prefect_home) != resident
        status = cli("server", "status", home=prefect_home)
        assert f"resident process: pid {ready_resident(prefect_home)} (ready)\n" in status.stdout, status.stdout

        # Bad input: its one line on the command's stderr and exit 2.
        resident = ready_resident(prefect_home)
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "narrator", "content": "x"}]}])
        rejected = start(run_args([bad], tmp_path / "third", *IDLE), prefect_home, trace)
        code, out3, err3 = finished(rejected)
        assert (code, out3) == (2, "")
        assert f"{bad}:1: messages[0] has unknown role 'narrator'" in error_line(err3)
        assert ran_in(trace) == {resident}

        # Ctrl-C is passed on: the run stops as it would in the command's own process. A command that is killed
        # outright passes nothing on: its resident stops the run by itself.
        long_input = write_jsonl(tmp_path / "long.jsonl", example_rows() * 8)
        code, err4 = interrupted_run(prefect_home, trace, tmp_path / "interrupted", long_input, signal.SIGINT)
        assert code == 130, err4
        assert "interrupted (SIGINT)" in error_line(err4)
        code, _ = interrupted_run(prefect_home, trace, tmp_path / "killed", long_input, signal.SIGKILL)
        assert code == -signal.SIGKILL

        # Another environment is another resident's: this command runs in its own process.
        elsewhere = start(run_args([EXAMPLE_DATA], tmp_path / "elsewhere", "-q", *IDLE), prefect_home, trace,
                          SFT_TOKENIZE_TEST_OTHER="1")
        code, _, err5 = finished(elsewhere)
        assert code == 0, err5
        assert ran_in(trace) == {elsewhere.pid}

        # The second command again, a cache hit (its resident got ready while the command above ran): the
        # resident's ready pool, which no run took, does not hold up its exit.
        resident = ready_resident(prefect_home)
        hit = start(run_args([EXAMPLE_DATA], tmp_path / "second", "-q", *IDLE), prefect_home, trace)
        code, out_hit, err_hit = finished(hit, timeout=60)  # a hit takes a second
        assert (code, out_hit.splitlines()[-1]) == (0, str(second_cache)), err_hit
        assert ran_in(trace) == {resident}

        # `server stop` ends the server, and the residents with it.
        assert [ready for _, ready in residents(str(prefect_home))]
        assert cli("server", "stop", home=prefect_home).returncode == 0
        deadline = time.monotonic() + 30
        while residents(str(prefect_home)):
            assert time.monotonic() < deadline, residents(str(prefect_home))
            time.sleep(0.1)
    finally:
        for pid in [server, *(pid for pid, _ in residents(str(prefect_home)))]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_sft_tokenize_resident_0_keeps_every_run_in_its_own_process(tmp_path, prefect_home):
    trace = tmp_path / "trace.jsonl"
    try:
        for name in ("first", "second"):
            run = start(run_args([EXAMPLE_DATA], tmp_path / name, "-q", "--server-idle", "60"), prefect_home,
                        trace, SFT_TOKENIZE_RESIDENT="0")
            code, _, err = finished(run)
            assert code == 0, err
            assert ran_in(trace) == {run.pid}
        assert residents(str(prefect_home)) == []
        assert "resident process: none\n" in cli("server", "status", home=prefect_home).stdout
    finally:
        cli("server", "stop", "--force", home=prefect_home)


def test_a_residents_home_is_its_prefect_home_or_the_default_one():
    """residents(home) matches a resident by the PREFECT_HOME its environment gives Prefect, ~/.prefect if unset."""
    assert _home_of(b"HOME=/u\0PREFECT_HOME=/data/ph\0") == "/data/ph"
    assert _home_of(b"HOME=/u\0LANG=C\0") == "/u/.prefect"
    assert _home_of(b"LANG=C\0") is None
