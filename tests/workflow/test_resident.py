"""The resident process (sft_tokenize/cli/resident.py), on request only: after a `run --resident` that leaves the
embedded server up, the next `sft-tokenize run --resident` of that environment runs in a process whose imports
are done, and a user sees the same command: its output, its error lines and exit codes, Ctrl-C. It ends with
the server, is one per PREFECT_HOME, and neither side talks to another user."""

from __future__ import annotations

import contextlib
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

from sft_tokenize.cli.resident import RECORD
from sft_tokenize.server.resident_processes import _home_of, resident_processes, residents, socket_name

pytestmark = pytest.mark.skipif(os.uname().sysname != "Linux", reason="the resident process is Linux's")

IDLE = ["--server-idle", "120", "--resident"]


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


def bound_residents(home: Path, timeout: float = 60) -> list[int]:
    """The pids of the resident processes of `home` that hold its name, once one does (one started at a command's
    exit binds it a moment later)."""
    deadline = time.monotonic() + timeout
    while not (bound := [found["pid"] for found in resident_processes(home) if found["bound"]]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return bound


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
        line = next(line for line in status.stdout.splitlines() if line.startswith("resident process:"))
        assert line.startswith(f"resident process: pid {ready_resident(prefect_home)} (ready, "), status.stdout
        assert 50 <= int(line.split(", ")[1].split()[0].replace(",", "")) <= 1500, line  # MiB of PSS, pool included

        # Bad input: its one line on the command's stderr and exit 2.
        resident = ready_resident(prefect_home)
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "narrator", "content": "x"}]}])
        rejected = start(run_args([bad], tmp_path / "third", *IDLE), prefect_home, trace)
        code, out3, err3 = finished(rejected)
        assert (code, out3) == (2, "")
        assert f"{bad}:1: messages[0] has unknown role 'narrator'" in error_line(err3)
        assert ran_in(trace) == {resident}

        # The served command's exit started the next resident, still importing. A command that finds it so waits
        # only when the last resident's times say it is ready sooner than the command's own imports would be.
        (importing,) = bound_residents(prefect_home)
        (prefect_home / RECORD).write_text(json.dumps({"prepared_after": 100, "ready_after": 1}))
        waited = start(run_args([EXAMPLE_DATA], tmp_path / "waited", "-q", *IDLE), prefect_home, trace)
        assert finished(waited)[0] == 0
        assert ran_in(trace) == {importing}
        (importing,) = bound_residents(prefect_home)
        (prefect_home / RECORD).write_text(json.dumps({"prepared_after": 0.1, "ready_after": 100}))
        alone = start(run_args([EXAMPLE_DATA], tmp_path / "alone", "-q", *IDLE), prefect_home, trace)
        assert finished(alone)[0] == 0
        assert ran_in(trace) == {alone.pid}
        assert [found["pid"] for found in resident_processes(prefect_home)] == [importing]  # kept: the same key

        # Ctrl-C is passed on: the run stops as it would in the command's own process. A command that is killed
        # outright passes nothing on: its resident stops the run by itself.
        long_input = write_jsonl(tmp_path / "long.jsonl", example_rows() * 8)
        code, err4 = interrupted_run(prefect_home, trace, tmp_path / "interrupted", long_input, signal.SIGINT)
        assert code == 130, err4
        assert "interrupted (SIGINT)" in error_line(err4)
        code, _ = interrupted_run(prefect_home, trace, tmp_path / "killed", long_input, signal.SIGKILL)
        assert code == -signal.SIGKILL

        # The second command again, a cache hit: the resident's ready pool, which no run took, does not hold up
        # its exit. A variable no import reads (here one the test makes up) does not keep a command from it.
        resident = ready_resident(prefect_home)
        hit = start(run_args([EXAMPLE_DATA], tmp_path / "second", "-q", *IDLE), prefect_home, trace,
                    UNRELATED_TO_A_RUN="1")
        code, out_hit, err_hit = finished(hit, timeout=60)  # a hit takes a second
        assert (code, out_hit.splitlines()[-1]) == (0, str(second_cache)), err_hit
        assert ran_in(trace) == {resident}

        # Another environment (a variable Prefect or the tokenizer libraries read as they are imported) is not
        # this resident's: the command runs in its own process, and its exit replaces the resident with its
        # environment's, the only one of this PREFECT_HOME.
        older = ready_resident(prefect_home)
        elsewhere = start(run_args([EXAMPLE_DATA], tmp_path / "elsewhere", "-q", *IDLE), prefect_home, trace,
                          PREFECT_LOGGING_LEVEL="WARNING")
        code, _, err5 = finished(elsewhere)
        assert code == 0, err5
        assert ran_in(trace) == {elsewhere.pid}
        newer = ready_resident(prefect_home)
        assert newer != older and not running(older)

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


def test_a_run_without_resident_runs_in_its_own_process_and_leaves_none(tmp_path, prefect_home):
    trace = tmp_path / "trace.jsonl"
    try:
        for name in ("first", "second"):
            run = start(run_args([EXAMPLE_DATA], tmp_path / name, "-q", "--server-idle", "60"), prefect_home, trace)
            code, _, err = finished(run)
            assert code == 0, err
            assert ran_in(trace) == {run.pid}
            time.sleep(1)  # a resident would be bound by now: its starter binds its name before it exits
            assert residents(str(prefect_home)) == []
        assert "resident process: none\n" in cli("server", "status", home=prefect_home).stdout
    finally:
        cli("server", "stop", "--force", home=prefect_home)


def _as_nobody(job) -> tuple[int, int]:
    """Fork a child that becomes user nobody and runs `job(write)`, `write` a pipe's end; its pid and the read end."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            job(write)
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another user needs root")
def test_a_name_squatted_by_another_user_gets_no_command(tmp_path, prefect_home):
    """Another user binds the resident's name first: the command checks the peer's uid and sends it nothing (not
    its arguments, environment or descriptors), runs in its own process and succeeds."""
    import socket

    def squat(write: int) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + socket_name(0, str(prefect_home)))
        listener.listen(8)
        os.write(write, b"L")
        listener.settimeout(TIMEOUT)
        for _ in range(2):
            conn, _ = listener.accept()
            hello = json.dumps({"pid": os.getpid(), "key": ""}).encode()  # as a resident's first message
            with contextlib.suppress(OSError):
                conn.sendall(len(hello).to_bytes(4, "big") + hello)
            conn.settimeout(30)
            got = b""
            with contextlib.suppress(OSError):  # reset: the command closed with the hello unread
                got = conn.recv(1 << 16)
            os.write(write, b"C" + str(len(got)).encode() + b";")
        time.sleep(TIMEOUT)  # the name stays taken until the test ends

    squatter, read = _as_nobody(squat)
    trace = tmp_path / "trace.jsonl"
    try:
        assert os.read(read, 1) == b"L"
        for name in ("first", "second"):
            run = start(run_args([EXAMPLE_DATA], tmp_path / name, "-q", *IDLE), prefect_home, trace)
            code, out, err = finished(run)
            assert code == 0, err
            assert ran_in(trace) == {run.pid}
        heard = b""
        while heard.count(b";") < 2 and (more := os.read(read, 64)):
            heard += more
        assert heard == b"C0;C0;"  # connected twice, received nothing either time
        assert residents(str(prefect_home)) == []  # its name is taken: no resident of root's starts
    finally:
        os.kill(squatter, signal.SIGKILL)
        os.waitpid(squatter, 0)
        os.close(read)
        cli("server", "stop", "--force", home=prefect_home)


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another user needs root")
def test_a_resident_serves_no_other_user(tmp_path, prefect_home):
    """Another user connecting to a ready resident hears nothing from it, and its request is not run."""
    import socket

    trace = tmp_path / "trace.jsonl"
    first = start(run_args([EXAMPLE_DATA], tmp_path / "first", "-q", *IDLE), prefect_home, trace)
    assert finished(first)[0] == 0
    server = json.loads((prefect_home / "sft-tokenize-server.json").read_text())["pid"]
    try:
        resident = ready_resident(prefect_home)

        def intrude(write: int) -> None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect("\0" + socket_name(0, str(prefect_home)))
            conn.settimeout(30)
            data = json.dumps({"argv": ["sft-tokenize", "run", "--help"], "cwd": "/", "env": {}, "umask": 18,
                               "started": 0}).encode()
            with contextlib.suppress(OSError):
                socket.send_fds(conn, [len(data).to_bytes(4, "big") + data], [0, 1, 2])
            got = b""
            with contextlib.suppress(OSError):
                got = conn.recv(1 << 16)
            os.write(write, str(len(got)).encode() + b";")

        intruder, read = _as_nobody(intrude)
        heard = b""
        while not heard.endswith(b";") and (more := os.read(read, 64)):
            heard += more
        os.waitpid(intruder, 0)
        os.close(read)
        assert heard == b"0;"  # closed without a word
        assert ready_resident(prefect_home) == resident  # still waiting for its own user's command
        served = start(run_args([EXAMPLE_DATA], tmp_path / "second", "-q", *IDLE), prefect_home, trace)
        assert finished(served)[0] == 0
        assert ran_in(trace) == {resident}
    finally:
        for pid in [server, *(pid for pid, _ in residents(str(prefect_home)))]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_residents_home_is_its_prefect_home_or_the_default_one():
    """residents(home) matches a resident by the PREFECT_HOME its environment gives Prefect, ~/.prefect if unset."""
    assert _home_of(b"HOME=/u\0PREFECT_HOME=/data/ph\0") == "/data/ph"
    assert _home_of(b"HOME=/u\0LANG=C\0") == "/u/.prefect"
    assert _home_of(b"LANG=C\0") is None


def test_only_a_run_that_asks_goes_to_a_resident(monkeypatch):
    """`run --resident` or SFT_TOKENIZE_RESIDENT=1 asks; a `--resident` after `--`, another command, or a path
    that is one of the command's own descriptors does not go."""
    from sft_tokenize.cli.resident import _hands_over, requested

    monkeypatch.delenv("SFT_TOKENIZE_RESIDENT", raising=False)
    assert requested(["sft-tokenize", "run", "a.jsonl", "--resident"])
    assert not requested(["sft-tokenize", "run", "a.jsonl"])
    assert not requested(["sft-tokenize", "run", "--", "--resident"])
    assert not requested(["sft-tokenize", "inspect", "--resident"])
    monkeypatch.setenv("SFT_TOKENIZE_RESIDENT", "1")
    assert requested(["sft-tokenize", "run", "a.jsonl"])
    assert not _hands_over(["sft-tokenize", "run", "--recipe", "/dev/fd/63", "--resident"])
    assert _hands_over(["sft-tokenize", "run", "a.jsonl", "--resident"])
