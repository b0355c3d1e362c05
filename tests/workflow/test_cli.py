"""`sft-tokenize` in a subprocess, as a user runs it: each run on its own embedded Prefect server and
PREFECT_HOME. stdout carries only the result; exit 0 success, 2 bad usage or input, 1 other failures."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import pytest
from datasets import load_from_disk
from support.caches import EXAMPLE_SLICES, staged_slices
from support.cli import NOISE, assert_clean_error, cli, environment, run_args
from support.data import example_rows, write_jsonl
from support.faults import FAULT_FILE_ENV
from support.paths import BIN, EXAMPLE_DATA, EXAMPLE_TOKENIZER
from support.servers import servers_of

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.cli.main import ERRORS
from sft_tokenize.errors import BadInput, CacheError, Failed
from sft_tokenize.server.server_state import server_paths, start_time

# A test that uses prefect_home starts Prefect's embedded server in its subprocess: about ten seconds on two cores.


def run_example(tmp_path: Path, home: Path, *extra: str, sources: list[str] | None = None,
                env: dict[str, str] | None = None, api_url: str | None = None) -> subprocess.CompletedProcess:
    """`sft-tokenize run` on the bundled example (two files, four slices) into tmp_path/cache; on the server at
    `api_url` if given, else on the embedded one."""
    return cli(*run_args(sources or [EXAMPLE_DATA], tmp_path / "cache", *extra), home=home, env=env, api_url=api_url)


def flow_run_states(home: Path) -> list[str]:
    """The state of every flow run in the database of this PREFECT_HOME."""
    with closing(sqlite3.connect(home / "prefect.db")) as db:
        return [state for (state,) in db.execute("SELECT state_type FROM flow_run")]


def test_run_prints_the_cache_path_last_and_inspect_summarizes_it(tmp_path, prefect_home):
    result = run_example(tmp_path, prefect_home)
    assert result.returncode == 0, result.stderr
    assert not [noise for noise in NOISE if noise in result.stderr], result.stderr
    assert "4/4 slices" in result.stderr and "240 rows" in result.stderr  # the progress bar's final state
    cache_path = Path(result.stdout.splitlines()[-1])
    assert result.stdout == f"{cache_path}\n"
    # The run went through the embedded server, on this PREFECT_HOME's database, and the server left with the CLI.
    assert flow_run_states(prefect_home) == ["COMPLETED"]
    assert servers_of(prefect_home) == []
    assert cache_path.parent == tmp_path / "cache" and (cache_path / "manifest.json").is_file()

    table = cli("inspect", str(cache_path), home=prefect_home)
    assert table.returncode == 0, table.stderr
    summary = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table.stdout.splitlines())
    assert summary["rows"] == "240" and summary["dropped rows"] == "none" and "p90" in summary["lengths"]
    assert str(EXAMPLE_DATA / "chat-00001.jsonl") in table.stdout

    manifest = json.loads(cli("inspect", str(cache_path), "--json", home=prefect_home).stdout)
    assert manifest["rows"] == 240 and manifest["name"] == "data"

    # A row decoded, its trained tokens in [[…]] when the output is not a terminal: exactly the assistant turns.
    shown = cli("inspect", str(cache_path), "--row", "0", home=prefect_home)
    assert shown.returncode == 0, shown.stderr
    header, text = shown.stdout.rstrip("\n").split("\n", 1)
    first = example_rows()[0]["messages"]
    assert header.startswith("── row 0: ") and "trained" in header
    trained = re.findall(r"\[\[(.*?)\]\]", text, flags=re.S)
    assert trained == [m["content"] + "<|im_end|>" for m in first if m["role"] == "assistant"]
    assert cli("inspect", str(cache_path), "--row", "240", home=prefect_home).returncode == 2

    flow_runs = (prefect_home / "prefect.db").stat().st_mtime_ns
    again = run_example(tmp_path, prefect_home)  # a cache hit is found before Prefect starts
    assert again.returncode == 0 and again.stdout == result.stdout, again.stderr
    assert "tokenizing" not in again.stderr and (prefect_home / "prefect.db").stat().st_mtime_ns == flow_runs


def test_malformed_jsonl_line_exits_2_naming_the_file_and_line(tmp_path, prefect_home, api_url):
    rows = [json.dumps(row) for row in example_rows()[:5]]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:3] + ['{"messages": [{"role": "user", "content": "hi"'] + rows[3:])
    result = run_example(tmp_path, prefect_home, sources=[str(bad)], api_url=api_url)
    assert_clean_error(result, 2, f"{bad}:4:", "not valid JSON")
    assert "Retry" not in result.stderr  # bad data fails the same way every time: no retries


def test_missing_file_exits_2_naming_it(tmp_path, prefect_home):
    missing = tmp_path / "nowhere.jsonl"
    assert_clean_error(run_example(tmp_path, prefect_home, sources=[str(missing)]), 2, str(missing))
    assert not (prefect_home / "prefect.db").exists()  # rejected before Prefect started


@pytest.mark.usefixtures("cli_home")  # sft-tokenize in a subprocess
@pytest.mark.parametrize("args", [
    ["run", str(EXAMPLE_DATA), "--cache-dir", "x"],  # no --tokenizer
    ["run", str(EXAMPLE_DATA), "--tokenizer", "t", "--cache-dir", "x", "--runner", "gpus"],
    ["run", str(EXAMPLE_DATA), "--tokenizer", "t", "--cache-dir", "x", "--workers", "0"],
    ["run", str(EXAMPLE_DATA), "--tokenizer", "t", "--cache-dir", "x", "--shard-size", "lots"],
    ["run", str(EXAMPLE_DATA), "--tokenizer", "t", "--cache-dir", "x", "--column", "messages"],
    ["inspect"],
    ["tokenize"],
])
def test_bad_usage_exits_2(tmp_path, args):
    home = tmp_path / "prefect-home"
    result = cli(*args, home=home)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert not (home / "prefect.db").exists()  # rejected before any Prefect server started


def test_failed_slice_exits_1_and_the_same_command_resumes(tmp_path, prefect_home, api_url):
    fault_file = tmp_path / "faults"
    fault_file.write_text("1")
    failed = run_example(tmp_path, prefect_home, "--retries", "0", env={FAULT_FILE_ENV: str(fault_file)},
                         api_url=api_url)
    assert_clean_error(failed, 1, "SlicesFailed", "1 of 4 slices failed", "tokenize-00001", "injected fault")
    staged = staged_slices(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(tmp_path / "cache")))
    assert sorted(staged) == [0, 2, 3]

    fault_file.unlink()
    resumed = run_example(tmp_path, prefect_home, env={FAULT_FILE_ENV: str(fault_file)}, api_url=api_url)
    assert resumed.returncode == 0, resumed.stderr
    assert "tokenizing 4 slices (3 already in the shard store)" in resumed.stderr
    published = sorted(Path(resumed.stdout.splitlines()[-1]).glob("data-*.arrow"))
    for index in (0, 2, 3):  # the published files are the staged shards (hard links), untouched by the rerun
        stat = published[index].stat()
        assert (stat.st_ino, stat.st_mtime_ns) == staged[index]


def test_slices_tokenized_while_the_server_boots_are_found_by_the_flows_tasks(tmp_path, prefect_home):
    """The run's process tokenizes slices as soon as its plan exists (build/ahead.py); the flow still runs a task per
    slice, each of which finds its shard: every slice tokenized once (the timeline marks each start), some before
    the server answered, and every one a completed task run of the flow. A run that finds the server up does not."""
    trace = tmp_path / "trace.jsonl"
    result = run_example(tmp_path, prefect_home, "--server-idle", "60", env={"SFT_TOKENIZE_TRACE": str(trace)})
    assert result.returncode == 0, result.stderr
    # Right after it, the server is up: nothing to overlap, the flow's tasks tokenize every slice.
    again = cli(*run_args([EXAMPLE_DATA], tmp_path / "again", "--server-idle", "0"), home=prefect_home)
    assert again.returncode == 0, again.stderr
    timings = json.loads((Path(again.stdout.splitlines()[-1]) / "manifest.json").read_text())["timings"]
    assert timings["tokenized_ahead"] == 0
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    server = next(event["t"] for event in events if event["event"] == "server")
    starts = [event["t"] for event in events if event["event"] == "first_slice"]
    assert len(starts) == 4 and min(starts) < server
    with closing(sqlite3.connect(prefect_home / "prefect.db")) as db:
        tasks = sorted(db.execute("SELECT name, state_type FROM task_run WHERE name LIKE 'tokenize-%'"))
    assert tasks == sorted([(f"tokenize-{i:05d}", "COMPLETED") for i in range(4)] * 2)  # both runs' flows
    manifest = json.loads((Path(result.stdout.splitlines()[-1]) / "manifest.json").read_text())
    assert manifest["timings"]["tokenized_ahead"] >= 1
    assert "(0 slices reused, 4 tokenized)" in result.stderr


# `sft-tokenize run` in a subprocess that says, on its last stderr line, which of these modules it had loaded.
PROBE = ("import json, sys\nfrom sft_tokenize.cli.main import main\ncode = main(sys.argv[1:])\n"
         "print(json.dumps(sorted(m for m in ('torch', 'prefect', 'transformers', "
         "'transformers.models.auto.tokenization_auto') if sys.modules.get(m))), file=sys.stderr)\nsys.exit(code)\n")


def probed_run(tmp_path: Path, home: Path, api_url: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    result = subprocess.run([sys.executable, "-c", PROBE, "run", str(EXAMPLE_DATA), "--tokenizer",
                             str(EXAMPLE_TOKENIZER), "--cache-dir", str(tmp_path / "cache"), "--workers", "2", *extra],
                            capture_output=True, text=True, timeout=300,
                            env=environment(home, api_url, SFT_TOKENIZE_HOME=str(tmp_path / "sft-home")))
    assert result.returncode == 0, result.stderr
    return result, json.loads(result.stderr.strip().splitlines()[-1])


def test_a_run_loads_no_torch_a_later_one_no_transformers_and_a_cache_hit_no_prefect(tmp_path, prefect_home, api_url):
    # What the run's own process imports: the server is the run's shared one, as a team's (no embedded boot).
    first, loaded = probed_run(tmp_path, prefect_home, api_url)
    assert "torch" not in loaded and "transformers.models.auto.tokenization_auto" in loaded, loaded
    prepared = list((tmp_path / "sft-home" / "tokenizers").iterdir())
    assert len(prepared) == 1 and (prepared[0] / "prepared.json").is_file()
    cache = Path(first.stdout.splitlines()[-1])
    ids = load_from_disk(str(cache))["input_ids"]

    rebuilt, loaded = probed_run(tmp_path, prefect_home, api_url, "--force")  # tokenized again, from the prepared entry
    assert rebuilt.stdout == first.stdout and "tokenizing" in rebuilt.stderr
    assert loaded == ["prefect"], loaded  # no transformers: chat/hf_jinja.py
    assert load_from_disk(str(cache))["input_ids"] == ids

    hit, loaded = probed_run(tmp_path, prefect_home, api_url)
    assert hit.stdout == first.stdout and loaded == [], loaded


def test_the_cli_takes_the_encoder_flag(tmp_path, cli_home, api_url):
    """`sft-tokenize run --encoder fastokens` in a subprocess gives the cache HF's tokenizers give."""
    done = cli("run", str(EXAMPLE_DATA), "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(tmp_path / "fast"),
               "--encoder", "fastokens", "--shard-size", "100KB", home=cli_home, api_url=api_url)
    assert done.returncode == 0, done.stderr
    fast = Path(done.stdout.strip().splitlines()[-1])
    hf = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                     cache_dir=str(tmp_path / "hf"), shard_size="100KB", encoder="hf"))
    assert fast.name == hf.name
    pairs = list(zip(sorted(hf.glob("*.arrow")), sorted(fast.glob("*.arrow")), strict=True))
    assert len(pairs) >= 2
    for want, got in pairs:
        assert want.read_bytes() == got.read_bytes()


def policy_code(kind: type[BaseException]) -> int:
    """The exit code the CLI's error policy gives an error of `kind`."""
    return next(code for named, code, _ in ERRORS if issubclass(kind, named))


def one_error_line(result: subprocess.CompletedProcess, code: int, *expected: str) -> str:
    """`result` exited `code` with nothing on stdout and exactly one line on stderr, holding each of `expected`."""
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sft-tokenize: error: "), result.stderr
    assert all(text in lines[0] for text in expected), lines[0]
    return lines[0]


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]  # root's writes ignore a mode


def _nobody_runs_the_cli() -> bool:
    """Whether the user nobody can run this checkout's command line (CI's clone may sit where only root reaches)."""
    try:
        probe = subprocess.run([*AS_NOBODY, str(BIN / "python"), "-c", "import sft_tokenize.cli.main"],
                               capture_output=True, cwd="/", timeout=120)
    except OSError:  # no setpriv
        return False
    return probe.returncode == 0


@pytest.mark.parametrize("how", ["read-only", "store-is-a-file"])
def test_gc_of_a_cache_root_it_cannot_write_is_one_line_naming_the_path(tmp_path, how, cli_home):
    """A read-only root (chmod; run as nobody when this is root, whose writes chmod does not stop), and a root whose
    shard store is a file, which stops root too."""
    as_user: list[str] = []
    if how == "store-is-a-file":
        root = tmp_path / "caches"
        root.mkdir()
        (root / ".shards").write_text("not a directory")
        expected = (str(root / ".shards"), policy_code(FileExistsError))
    else:
        if os.geteuid() == 0:
            if not _nobody_runs_the_cli():
                pytest.skip("as root, a read-only mode is tested as the user nobody, who cannot reach this checkout")
            as_user = AS_NOBODY
        # A folder every user may traverse (pytest's own tmp_path is its owner's only).
        outer = Path(tempfile.mkdtemp(prefix="gc-read-only-"))
        outer.chmod(0o755)
        root = outer / "caches"
        root.mkdir()
        root.chmod(0o555)
        expected = (str(root / ".shards"), policy_code(PermissionError))
    try:
        result = subprocess.run([*as_user, str(BIN / "sft-tokenize"), "gc", str(root)], capture_output=True, text=True,
                                env=environment(cli_home), stdin=subprocess.DEVNULL, timeout=300)
        one_error_line(result, expected[1], expected[0])
    finally:
        if how == "read-only":
            root.chmod(0o755)
            shutil.rmtree(root.parent)


@pytest.fixture
def server_in_use(tmp_path):
    """A PREFECT_HOME whose recorded server is this process, with one run's lease held: `server stop` refuses."""
    home = tmp_path / "home"
    home.mkdir()
    _, state_path, lease_path = server_paths(home)
    state_path.write_text(json.dumps({"pid": os.getpid(), "started": start_time(os.getpid()), "port": 1,
                                      "url": "http://127.0.0.1:1/api"}))
    with open(lease_path, "w") as lease:
        fcntl.flock(lease, fcntl.LOCK_SH)
        yield home


ERROR_PATHS = {  # each subcommand with a bad argument: (argv, the error kind, what its line names)
    "run": (["run", "{tmp}/nowhere.jsonl", "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", "{tmp}/c"],
            BadInput, "{tmp}/nowhere.jsonl"),
    "inspect": (["inspect", "{tmp}/not-a-cache"], CacheError, "{tmp}/not-a-cache"),
    "pack": (["pack", "{tmp}/not-a-cache", "--length", "64"], CacheError, "{tmp}/not-a-cache"),
    "gc": (["gc", "{tmp}/root"], FileExistsError, "{tmp}/root/.shards"),  # its shard store is a file
    "server": (["server", "stop"], Failed, "in use by 1 run"),
}


@pytest.mark.parametrize("command", ERROR_PATHS)
def test_every_subcommand_ends_an_error_by_the_one_policy(tmp_path, command, request, cli_home):
    """Whatever the subcommand, an error is one line on stderr and the exit code the policy's table gives its kind."""
    argv, kind, named = ERROR_PATHS[command]
    home = request.getfixturevalue("server_in_use") if command == "server" else cli_home
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / ".shards").write_text("not a directory")
    result = cli(*(arg.format(tmp=tmp_path) for arg in argv), home=home)
    one_error_line(result, policy_code(kind), named.format(tmp=tmp_path))
    assert {kind for kind, _, _ in ERRORS} >= {BadInput, CacheError, Failed, KeyboardInterrupt, OSError}
