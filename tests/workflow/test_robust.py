"""`sft-tokenize` never fails for reasons of its own, each case through the CLI in subprocesses: many runs at once
on a loaded machine, an unreachable API, compressed inputs, a 50 MB row, SIGINT and SIGTERM, a closed pipe.

Runs that can share a PREFECT_HOME do, and run side by side: they share one embedded server, as users' runs do.
"""

from __future__ import annotations

import bz2
import csv
import functools
import gzip
import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import psutil
import pytest
from support.caches import staged_shards
from support.cli import cli, environment, error_line, free_port, run_args
from support.data import example_rows, write_jsonl
from support.paths import BIN, EXAMPLE_DATA, EXAMPLE_TOKENIZER
from support.runs import Background
from support.servers import running, servers_of

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.read.cache import open_cache, read_manifest
from sft_tokenize.server import server_fork

TIMEOUT = 600
# These runs keep Prefect's default start-up timeout of the embedded server: the CLI's own floor is what they test.
DEFAULTS = {"startup_timeout": None}
RUN = {**DEFAULTS, "timeout": TIMEOUT}  # a CLI run to its end


@pytest.fixture
def start(launch):
    """`sft-tokenize` in the background (conftest's `launch`), with Prefect's default start-up timeout."""
    return functools.partial(launch, **DEFAULTS)


def cache_rows(path: Path) -> list[tuple[list[int], list[int]]]:
    table = datasets.load_from_disk(str(path))
    return list(zip(table["input_ids"], table["loss_mask"], strict=True))


# -- 1. many runs at once on a loaded machine; an API that does not answer -------------------------------------


def test_eight_runs_at_once_beside_a_cpu_burner_all_succeed(tmp_path, start):
    home = tmp_path / "fresh-prefect-home"  # not even migrated: the first server does it while the others wait
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        shared = [start(run_args([EXAMPLE_DATA], tmp_path / "shared", "-q"), home, f"shared-{i}") for i in range(4)]
        own = [start(run_args([EXAMPLE_DATA], tmp_path / f"own-{i}", "-q"), home, f"own-{i}") for i in range(4)]
        codes = [run.wait() for run in shared + own]
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert codes == [0] * 8, [run.stderr for run in shared + own]
    paths = {run.stdout.splitlines()[-1] for run in shared}
    assert len(paths) == 1
    (path,) = paths
    assert [p for p in (tmp_path / "shared").iterdir() if not p.name.startswith(".")] == [Path(path)]
    assert len(open_cache(path)) == 240
    for i, run in enumerate(own):
        assert Path(run.stdout.splitlines()[-1]).parent == tmp_path / f"own-{i}"
    # The last run to leave stopped the server they shared.
    assert not (home / "sft-tokenize-server.json").exists()
    assert servers_of(home) == []


def test_a_server_just_launched_is_the_one_the_next_run_joins(server_home):
    """The next run must recognise the server that the previous one launched a moment ago, while its process may
    still be exec'ing (it once launched a second server on the same database, which failed migrating it)."""
    from sft_tokenize.server.embedded_server import EmbeddedServer

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        for _ in range(40):
            first, second = EmbeddedServer(), EmbeddedServer()
            first.start()
            second.start()
            try:
                assert (second.pid, second.url) == (first.pid, first.url)
            finally:
                second.release()
                first.release()  # the last to leave, before the server answered: killed at once
            assert not running(first.pid)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_only_the_recorded_process_itself_counts_as_the_running_server(tmp_path):
    """A recorded server is joined only if its pid still names the process that was launched (same start time);
    one that is gone, died before its start was read, or whose pid now names another process is replaced."""
    from prefect.settings import PREFECT_HOME, temporary_settings

    from sft_tokenize.server.embedded_server import EmbeddedServer
    from sft_tokenize.server.server_state import start_time

    with temporary_settings(updates={PREFECT_HOME: tmp_path}):
        server = EmbeddedServer()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = os.getpid()
    for pid, started, joined in ((me, start_time(me), True), (me, start_time(me) - 1, False), (me, None, False),
                                 (gone.pid, None, False), (gone.pid, start_time(me), False)):
        server.state_path.write_text(json.dumps({"pid": pid, "started": started, "port": 1, "url": "http://x/api"}))
        assert (server._read_state() is not None) is joined, (pid, started)


def test_a_server_that_ends_itself_keeps_new_runs_out_until_it_is_gone(server_home):
    """A server that finds no run left holds the join lock until its process has exited: a run arriving meanwhile
    waits, rather than launching a second server on the database that the first still writes to."""
    import fcntl

    from sft_tokenize.server.embedded_server import EmbeddedServer
    from sft_tokenize.server.server_state import start_time

    server = EmbeddedServer()
    server.start()
    server.wait_until_ready()
    lease, server._lease = server._lease, None
    lease.close()  # as if this run were killed: the server is left with no lease, and ends itself
    seen_held = False
    with open(server.lock_path, "a") as lock:
        deadline = time.monotonic() + 60
        while start_time(server.pid) is not None and time.monotonic() < deadline:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                seen_held = True
            else:
                fcntl.flock(lock, fcntl.LOCK_UN)
                assert not seen_held or start_time(server.pid) is None, "the lock was free while the server lived"
            time.sleep(0.01)
    server.process.wait(timeout=30)
    assert seen_held and server.process.returncode == 0
    assert not server.state_path.exists()


def test_a_server_whose_home_is_moved_away_ends_instead_of_serving_on(server_home, tmp_path):
    """A PREFECT_HOME moved or deleted under its server (a temporary directory cleaned up) leaves no run able to
    find that server: it ends, where its idle thread used to die on the missing lock file and leave it serving."""
    from sft_tokenize.server.embedded_server import EmbeddedServer
    from sft_tokenize.server.server_state import start_time

    server = EmbeddedServer()
    server.start()
    server.wait_until_ready()
    server_home.rename(tmp_path / "moved")
    server.process.wait(timeout=60)
    assert server.process.returncode == 0 and start_time(server.pid) is None


def test_a_server_whose_runs_were_all_killed_exits_by_itself(tmp_path, prefect_home, start, long_input):
    run = start(run_args([long_input], tmp_path / "cache"), prefect_home, "killed")
    state = prefect_home / "sft-tokenize-server.json"
    deadline = time.monotonic() + TIMEOUT
    while not (state.exists() and list((tmp_path / "cache" / ".shards").glob("*.json"))):
        assert run.process.poll() is None and time.monotonic() < deadline, run.stderr
        time.sleep(0.05)
    server = json.loads(state.read_text())["pid"]
    assert running(server)
    os.killpg(run.process.pid, signal.SIGKILL)  # as `kill -9 -PGID` or the OOM killer: the CLI cannot leave
    run.process.wait()
    deadline = time.monotonic() + 15
    while running(server):
        assert time.monotonic() < deadline, "the server outlived every run that used it"
        time.sleep(0.1)
    assert not state.exists()


def server_facts(home: Path) -> dict[str, str]:
    """`sft-tokenize server status`, one `name: value` per line."""
    status = cli("server", "status", home=home, **RUN)
    assert status.returncode == 0 and status.stderr == "", status.stderr
    return dict(line.split(": ", 1) for line in status.stdout.splitlines())


def flow_runs_of(url: str) -> list[str]:
    import httpx

    return [run["state_type"] for run in httpx.post(f"{url}/flow_runs/filter", json={}, timeout=30).json()]


def test_a_warm_server_serves_the_next_run_until_server_stop_stops_it(tmp_path, prefect_home):
    """After its last run, the server idles for --server-idle seconds: the next run uses it (no second boot);
    `server status` reports it, `server stop` refuses while a run holds a lease, and stops it once none does."""
    import fcntl

    trace = tmp_path / "trace.jsonl"
    launched = time.clock_gettime(time.CLOCK_BOOTTIME)
    first = cli(*run_args([EXAMPLE_DATA], tmp_path / "cache", "-q", "--server-idle", "120"), home=prefect_home,
                env={"SFT_TOKENIZE_TRACE": str(trace), "SFT_TOKENIZE_EARLY_SERVER": "1"}, **RUN)
    assert first.returncode == 0, first.stderr
    state_path = prefect_home / "sft-tokenize-server.json"
    state = json.loads(state_path.read_text())
    pid = state["pid"]
    try:
        assert running(pid) and state["idle"] == 120
        # The CLI forked it at its start (server_fork.fork_early), before the run had even planned: its process
        # began before `launched` (before the CLI's own start) plus the time the run took to plan.
        planned = next(event["t"] for event in map(json.loads, trace.read_text().splitlines())
                       if event["event"] == "planned")
        assert state["started"] / os.sysconf("SC_CLK_TCK") < launched + planned
        # Its environment is the one the run's process began with, not the server's own, yet its command line is
        # the server's and it holds none of the run's files.
        server = psutil.Process(pid)
        assert "PREFECT__SERVER_FINAL" not in server.environ()
        assert f"-m sft_tokenize.server.server_process prefect.server.api.server:create_app --port {state['port']}" in \
            " ".join(server.cmdline())
        assert {Path(file.path).name for file in server.open_files()}.isdisjoint({
            "sft-tokenize-server.lock", "sft-tokenize-server.lease", *os.listdir(EXAMPLE_DATA)})
        facts = server_facts(prefect_home)
        assert (facts["embedded server"], facts["pid"], facts["url"], facts["runs using it"]) == \
            ("running", str(pid), state["url"], "0")
        assert facts["idle time"].endswith(" s left of 120 s") and facts["log"] == str(prefect_home /
                                                                                       "embedded-server.log")

        second = cli(*run_args([EXAMPLE_DATA], tmp_path / "cache", "-q", "--force", "--server-idle", "120"),
                     home=prefect_home, **RUN)
        assert second.returncode == 0, second.stderr
        assert json.loads(state_path.read_text())["pid"] == pid
        assert (prefect_home / "embedded-server.log").read_text().count("--- embedded server on port") == 1
        assert flow_runs_of(state["url"]) == ["COMPLETED", "COMPLETED"]  # both recorded by the server it kept

        with open(prefect_home / "sft-tokenize-server.lease", "a") as lease:  # as a run holds it
            fcntl.flock(lease, fcntl.LOCK_SH)
            facts = server_facts(prefect_home)
            assert (facts["runs using it"], facts["idle time"]) == ("1", "in use")
            refused = cli("server", "stop", home=prefect_home, **RUN)
            assert refused.returncode == 1 and refused.stdout == ""
            assert f"the embedded server (pid {pid}) is in use by 1 run" in error_line(refused.stderr)
            assert running(pid)
        stopped = cli("server", "stop", home=prefect_home, **RUN)
        assert (stopped.returncode, stopped.stderr) == (0, "")
        assert stopped.stdout.startswith(f"stopped the embedded server (pid {pid})")
        assert not running(pid) and not state_path.exists()
        assert server_facts(prefect_home)["embedded server"] == "not running"
        assert cli("server", "stop", home=prefect_home, **RUN).stdout == "no embedded server is running\n"
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def test_server_idle_0_stops_the_server_with_its_run_and_an_idle_server_ends_by_itself(tmp_path, prefect_home):
    state_path = prefect_home / "sft-tokenize-server.json"
    args = run_args([EXAMPLE_DATA], tmp_path / "cache", "-q", "--force")
    # The option wins over the variable.
    at_once = cli(*args, "--server-idle", "0", home=prefect_home, env={"SFT_TOKENIZE_SERVER_IDLE": "300"}, **RUN)
    assert at_once.returncode == 0, at_once.stderr
    assert servers_of(prefect_home) == [] and not state_path.exists()

    idling = cli(*args, "--server-idle", "2", home=prefect_home, **RUN)
    left = time.monotonic()
    assert idling.returncode == 0, idling.stderr
    pid = json.loads(state_path.read_text())["pid"]
    try:
        assert running(pid)
        while running(pid):
            assert time.monotonic() - left < 30, "the idle server did not end by itself"
            time.sleep(0.1)
        assert time.monotonic() - left > 1.5 and not state_path.exists()
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    with closing(sqlite3.connect(prefect_home / "prefect.db")) as db:  # the second server recorded its run
        assert [state for (state,) in db.execute("SELECT state_type FROM flow_run")] == ["COMPLETED", "COMPLETED"]

    # A cache hit with no server up: the server process forked at its start (server_fork.fork_early) was ended with
    # it, and none launched.
    hit = cli(*run_args([EXAMPLE_DATA], tmp_path / "cache", "-q"), home=prefect_home,
              env={"SFT_TOKENIZE_EARLY_SERVER": "1"}, **RUN)
    assert hit.returncode == 0, hit.stderr
    assert not [process for process in psutil.process_iter(["cmdline"])
                if str(tmp_path / "cache") in " ".join(process.info["cmdline"] or [])]
    assert servers_of(prefect_home) == [] and not state_path.exists()


def test_a_server_process_forked_early_exits_by_itself_when_its_run_is_killed_first(server_home):
    """The run killed before it launched its server or ended the early process: it reads no order and exits."""
    script = ("import os, signal; from sft_tokenize.server import server_fork; server_fork.fork_early(); "
              "print(server_fork._early.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    env = {**os.environ, "PREFECT_HOME": str(server_home), "SFT_TOKENIZE_EARLY_SERVER": "1"}
    env.pop("PREFECT_API_URL", None)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    early = int(killed.stdout)
    deadline = time.monotonic() + 120
    while running(early):
        assert time.monotonic() < deadline, "the early server process outlived its run"
        time.sleep(0.1)
    assert not (server_home / "sft-tokenize-server.json").exists()


@pytest.mark.parametrize(("cpus", "setting", "forked"), [({0, 1}, "", True), ({0}, "", False), ({0}, "1", True),
                                                      ({0, 1}, "0", False)])
def test_the_early_server_process_is_forked_only_on_a_spare_core_unless_the_setting_decides(
        tmp_path, cpus, setting, forked):
    """One CPU (taskset, a Slurm allocation) has no core to spare for it: the run's own would pay its imports."""
    script = (f"import os; os.sched_setaffinity(0, {cpus!r}); from sft_tokenize.server import server_fork; "
              "server_fork.spare_core = lambda cpus, load: cpus >= 2; server_fork.fork_early(); "
              "print(server_fork._early is not None)")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "SFT_TOKENIZE_EARLY_SERVER": setting}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(forked), done.stderr


def test_a_busy_machine_spares_no_core():
    assert server_fork.spare_core(2, 1.7) and server_fork.spare_core(8, 6.5)
    assert not server_fork.spare_core(2, 2.0) and not server_fork.spare_core(2, 4.5)
    assert not server_fork.spare_core(1, 0.0)


def test_an_unreachable_api_url_is_one_line_and_exit_1(tmp_path, cli_home):
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    started = time.monotonic()
    result = subprocess.run([str(BIN / "sft-tokenize"), *run_args([EXAMPLE_DATA], tmp_path / "cache")],
                            capture_output=True, text=True, timeout=120,
                            env=environment(cli_home, url, **DEFAULTS))
    assert time.monotonic() - started < 30
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [error_line(result.stderr)]
    assert url in result.stderr and "PREFECT_API_URL" in result.stderr


# -- 2. compressed inputs -------------------------------------------------------------------------------------


def alpaca_csv() -> bytes:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["instruction", "output"])
    for row in example_rows()[:60]:
        writer.writerow([row["messages"][0]["content"], row["messages"][1]["content"]])
    return text.getvalue().encode()


def test_compressed_inputs_give_the_uncompressed_files_rows(tmp_path, prefect_home, start, api_url):
    from backports import zstd

    plain = EXAMPLE_DATA / "chat-00001.jsonl"
    data = plain.read_bytes()
    rows = [json.loads(line) for line in data.splitlines()]
    d = tmp_path / "data"
    d.mkdir()
    chat = [plain]
    for name, packed in [("c.jsonl.gz", gzip.compress(data)), ("c.jsonl.zst", zstd.compress(data)),
                         ("c.json.gz", gzip.compress(json.dumps(rows).encode())), ("c.jsonl.bz2", bz2.compress(data))]:
        (d / name).write_bytes(packed)
        chat.append(d / name)
    (d / "a.csv").write_bytes(alpaca_csv())
    (d / "a.csv.gz").write_bytes(gzip.compress(alpaca_csv()))
    truncated = d / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress(data)[:-3000])

    # On the run's shared server: the reading is the subject, not the server.
    chats = start(run_args(chat, tmp_path / "chats", "-q"), prefect_home, "chats", api_url)
    csvs = start(run_args([d / "a.csv", d / "a.csv.gz"], tmp_path / "csvs", "-q"), prefect_home, "csvs", api_url)
    broken = start(run_args([truncated], tmp_path / "broken", "-q"), prefect_home, "broken", api_url)
    assert chats.wait() == 0, chats.stderr
    assert csvs.wait() == 0, csvs.stderr
    assert broken.wait() == 2

    last = error_line(broken.stderr)
    assert f"{truncated}: truncated or corrupt gzip archive" in last
    assert not [p for p in (tmp_path / "broken").iterdir() if not p.name.startswith(".")]  # nothing published

    got = cache_rows(Path(chats.stdout.splitlines()[-1]))
    assert len(got) == 5 * len(rows)
    blocks = [got[k * len(rows):(k + 1) * len(rows)] for k in range(5)]
    assert all(block == blocks[0] for block in blocks[1:])  # each compressed file as the plain one
    manifest = read_manifest(chats.stdout.splitlines()[-1])
    # A compressed file is one piece, read whole by its slice; the plain file is cut into byte ranges.
    parts = [part for shard in manifest["shards"] for part in shard["slice"]]
    assert [part[2:] for part in parts if part[0].startswith(str(d))] == [[0, -1]] * 4
    assert len([part for part in parts if part[0] == str(plain)]) > 1
    csv_rows = cache_rows(Path(csvs.stdout.splitlines()[-1]))
    assert len(csv_rows) == 120 and csv_rows[:60] == csv_rows[60:]


# -- 3. a 50 MB row ---------------------------------------------------------------------------------------------


def anonymous_bytes(processes: list[psutil.Process]) -> int:
    total = 0
    for process in processes:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)
    return total


def test_a_50_mb_row_is_refused_or_counted_without_exhausting_memory(tmp_path, prefect_home, start, api_url):
    rows = example_rows()[:100]
    huge = {"messages": [{"role": "user", "content": "Repeat after me."},
                         {"role": "assistant", "content": "word " * 10_000_000}]}  # 50 MB
    source = write_jsonl(tmp_path / "huge.jsonl", rows[:50] + [huge] + rows[50:])
    # On the run's shared server: the row is the subject, not the server (whose memory the tree then leaves out).
    skipping = start(run_args([source], tmp_path / "skip", "--on-bad-row", "skip", "--max-length", "512"), prefect_home,
                     "skip", api_url)
    raising = start(run_args([source], tmp_path / "raise"), prefect_home, "raise", api_url)
    peak = 0
    while skipping.process.poll() is None:
        peak = max(peak, anonymous_bytes(skipping.tree()))
        time.sleep(0.05)
    assert skipping.wait() == 0, skipping.stderr
    print(f"peak anonymous memory of the run's process tree: {peak / 2**20:.0f} MiB")
    assert peak < 1.5 * 2**30, f"peak anonymous memory {peak / 2**20:.0f} MiB"
    manifest = read_manifest(skipping.stdout.splitlines()[-1])
    assert manifest["rows"] == 100 and manifest["dropped"] == {"row_too_large": 1}
    assert manifest["lengths"]["max"] <= 512

    assert raising.wait() == 2
    size = len(json.dumps(huge, ensure_ascii=False).encode())
    assert f"{source}:51: the row is {size:,} bytes, over the 2,000,000-byte limit (--max-row-bytes" \
        in error_line(raising.stderr)


# -- 4. SIGINT and SIGTERM ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_input(tmp_path_factory) -> Path:
    """The example rows 8 times over: 1,920 rows in 28 slices of 100KB, long enough to be interrupted."""
    return write_jsonl(tmp_path_factory.mktemp("long") / "long.jsonl", example_rows() * 8)


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory, long_input) -> list:
    """A clean run of the plain pipeline, in this process."""
    path = run_locally(TokenizeOptions(sources=[str(long_input)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path_factory.mktemp("reference"))))
    return cache_rows(path)


@dataclass
class Interrupted:
    name: str
    signum: signal.Signals
    home: Path
    cache_root: Path
    args: list[str]
    run: Background
    tree: list[psutil.Process] = field(default_factory=list)
    kept: dict[str, tuple[int, int]] = field(default_factory=dict)
    signalled: float = 0.0
    stopped: float = 0.0


def test_sigint_and_sigterm_stop_the_run_and_the_same_command_resumes(tmp_path, cli_homes, start,
                                                                     long_input, long_reference):
    """Ctrl-C on the threads runner (its encode pool), `kill PID` on the processes runner: the two runs side by
    side, each with its own PREFECT_HOME so that each run's process tree holds its own embedded server. (Either
    signal takes the same path in every runner: flows/interrupts.py.)"""
    cases = []
    for runner, signum in (("threads", signal.SIGINT), ("processes", signal.SIGTERM)):
        name = f"{runner}-{signum.name}"
        home = cli_homes(f"{name}-home")
        cache_root = tmp_path / name / "cache"
        pool = ["--encode-processes", "2"] if runner == "threads" else []  # the input is below the default's
        args = run_args([long_input], cache_root, "--runner", runner, *pool)
        cases.append(Interrupted(name, signum, home, cache_root, args, start(args, home, name)))

    waiting = list(cases)
    deadline = time.monotonic() + TIMEOUT
    while waiting or not all(case.stopped for case in cases):  # each run is interrupted once a shard is finished
        for case in cases:
            if case not in waiting and not case.stopped and case.run.process.poll() is not None:
                case.stopped = time.monotonic()
        for case in list(waiting):
            assert case.run.process.poll() is None, f"{case.name} ended before it was interrupted: {case.run.stderr}"
            if staged_shards(case.cache_root):
                case.tree, case.kept = case.run.tree(), staged_shards(case.cache_root)
                if case.signum == signal.SIGINT:
                    os.killpg(case.run.process.pid, case.signum)  # Ctrl-C: the terminal signals the whole group
                else:
                    case.run.process.send_signal(case.signum)  # `kill PID`
                case.signalled = time.monotonic()
                waiting.remove(case)
        assert time.monotonic() < deadline
        time.sleep(0.05)

    for case in cases:
        stopped_after = case.stopped - case.signalled
        print(f"{case.name}: stopped {stopped_after:.1f} s after the signal")
        assert case.run.wait() == 128 + case.signum, f"{case.name}: {case.run.stderr}"
        assert stopped_after < 30, f"{case.name} took {stopped_after:.1f} s to stop"
        last = error_line(case.run.stderr)
        assert f"interrupted ({case.signum.name})" in last and "run the same command again to resume" in last
        time.sleep(0.5)
        assert [p.pid for p in case.tree if running(p.pid)] == [], f"{case.name}: processes left"
        # The CLI and its server, and the workers: the processes runner's, or the threads runner's encode pool.
        assert len(case.tree) >= 4, case.tree
        now = staged_shards(case.cache_root)
        assert {shard: now.get(shard) for shard in case.kept} == case.kept  # finished shards stay, untouched
        assert not list((case.cache_root / ".shards").glob("*.tmp-*"))  # nothing half-written is left
        assert not [p for p in case.cache_root.iterdir() if not p.name.startswith(".")]  # nothing published

    reruns = [(case, start(case.args, case.home, f"{case.name}-again")) for case in cases]
    for case, rerun in reruns:
        assert rerun.wait() == 0, rerun.stderr
        assert "already in the shard store)" in rerun.stderr and "(0 already in the shard store)" not in rerun.stderr
        path = Path(rerun.stdout.splitlines()[-1])
        assert cache_rows(path) == long_reference, case.name
        # The shards finished before the signal became the cache's files: the same inodes, not rewritten.
        assert {inode for inode, _ in case.kept.values()} <= {p.stat().st_ino for p in path.glob("data-*.arrow")}, \
            case.name


# -- 5. a closed pipe -----------------------------------------------------------------------------------------


def test_output_to_a_closed_pipe_is_no_traceback(tmp_path, cli_home):
    path = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA / "chat-00001.jsonl")],
                                       tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path / "cache")))
    env = environment(cli_home, **DEFAULTS)
    commands = [["inspect", str(path)], ["inspect", str(path), "--json"], ["--help"],
                run_args([EXAMPLE_DATA / "chat-00001.jsonl"], tmp_path / "cache")]  # a cache hit prints its path
    commands[-1] = [arg for arg in commands[-1] if arg not in ("--shard-size", "100KB", "--workers", "2")]
    for args in commands:
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first line, as `| head -0` or a closed pager
        result = subprocess.run([str(BIN / "sft-tokenize"), *args], stdout=write_end, stderr=subprocess.PIPE,
                                text=True, env=env, timeout=120)
        os.close(write_end)
        # 128 + SIGPIPE, as a shell tool whose reader left; argparse's help ignores a failed write itself.
        assert result.returncode == (0 if args == ["--help"] else 141), (args, result.stderr)
        assert result.stderr == "", (args, result.stderr)

    head = subprocess.run(f"'{BIN / 'sft-tokenize'}' inspect '{path}' --json | head -n 2", shell=True,
                          capture_output=True, text=True, env=env, timeout=120)
    assert head.stdout.splitlines() == ["{", f'  "format_version": {read_manifest(path)["format_version"]},']
    assert head.stderr == ""


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_lines_over_the_limit_are_never_decoded_wherever_the_chunks_end(tmp_path, monkeypatch, chunk):
    from sft_tokenize.errors import BadRow
    from sft_tokenize.sources import readers as source_formats
    from sft_tokenize.sources import resolve as sources
    from sft_tokenize.sources import slicing
    from sft_tokenize.sources.formats import jsonl_reader

    monkeypatch.setattr(jsonl_reader, "READ_CHUNK_BYTES", chunk)
    lines = ['{"text": "a"}', '{"text": "' + "b" * 30 + '"}', "", '{"text": "' + "c" * 7 + '"}',
             '{"text": "' + "d" * 40 + '"}', '{"text": "e"}']
    limit = len(lines[3])  # a line of exactly the limit is read; one byte more is not
    for tail in ("\n", ""):  # with and without a final newline
        path = tmp_path / f"rows{len(tail)}.jsonl"
        path.write_text("\n".join(lines) + tail)
        (source,) = sources.resolve([str(path)])
        (slice_,) = slicing.cut_slices([source], source.size)
        rows, where = [], []
        for batch, locate, _ in source_formats.read_slice(slice_, ["text"], max_row_bytes=limit):
            rows += batch
            where += [locate(i) for i in range(len(batch))]
        assert [row.reason if isinstance(row, BadRow) else row["text"] for row in rows] == \
            ["a", "row_too_large", "c" * 7, "row_too_large", "e"]
        assert where == [f"{path}:{n}" for n in (1, 2, 4, 5, 6)]
        assert f"the row is {len(lines[1]):,} bytes, over the {limit:,}-byte limit" in rows[1].detail
