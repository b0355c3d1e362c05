"""`sft-tokenize` under hostile conditions, each through the CLI in a subprocess as a user runs it: messy data,
untrusted names, tokenizers and templates, a run killed mid-way or while publishing, a worker process killed,
a full disk, two runs at once, a corrupt cache. Every case ends in one clear error line or a correct cache.

Most runs talk to one Prefect server started for this module (PREFECT_API_URL, as with a team server): it
saves the embedded server's start-up, ten seconds a run. The first run that is killed starts its own embedded
server, which must die with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import EXAMPLE_DATA, EXAMPLE_TOKENIZER, example_rows, write_jsonl
from sft_tokenize.tasks.tokenize_slice import FAULT_FILE_ENV

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import run_locally
from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import open_cache

BIN = Path(sys.executable).parent
NOISE = ("Traceback", "PyTorch was not found", "Starting temporary server")
TIMEOUT = 300


# -- running the CLI ------------------------------------------------------------------------------------------


def environment(home: Path, api_url: str | None = None) -> dict[str, str]:
    """This process's environment without Prefect settings: the CLI uses `api_url`, or starts its embedded server."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != FAULT_FILE_ENV}
    environ.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="90")
    if api_url:
        environ["PREFECT_API_URL"] = api_url
    return environ


def cli(*args: str, home: Path, api_url: str | None = None, preexec: Callable[[], None] | None = None,
        env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Run the CLI; `env` adds variables to its environment (None removes one)."""
    environ = {k: v for k, v in {**environment(home, api_url), **(env or {})}.items() if v is not None}
    return subprocess.run([str(BIN / "sft-tokenize"), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env=environ, preexec_fn=preexec, timeout=TIMEOUT)


class Background:
    """`sft-tokenize` running in its own session (its process group holds any embedded server and workers),
    its output in files so that a long run never blocks on a full pipe."""

    def __init__(self, args: list[str], home: Path, logs: Path, api_url: str | None = None):
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = logs / "stdout", logs / "stderr"
        with self.stdout_path.open("w") as out, self.stderr_path.open("w") as err:
            self.process = subprocess.Popen([str(BIN / "sft-tokenize"), *args], stdout=out, stderr=err,
                                            stdin=subprocess.DEVNULL, env=environment(home, api_url),
                                            start_new_session=True)
        self.group = self.process.pid

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
        """Poll `condition`; fail if the run ends first or the time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the run ended (exit {self.process.returncode}) before {what}:\n{self.stderr}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"timed out waiting for {what}:\n{self.stderr}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the whole process group, as an OOM killer or `kill -9 -PGID` would; nothing may survive it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.group, signal.SIGKILL)
        self.process.wait(timeout=30)
        assert_group_gone(self.group)

    def pause(self) -> None:
        """SIGSTOP the process group and wait until the CLI has stopped (a system call in flight finishes first)."""
        os.killpg(self.group, signal.SIGSTOP)
        cli_process = psutil.Process(self.process.pid)
        while cli_process.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
            time.sleep(0.0005)

    def step_until(self, condition: Callable[[], bool], what: str) -> None:
        """Let a paused run go on a millisecond at a time until `condition` holds, and leave it paused there."""
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the run ended before {what}:\n{self.stderr}")
            os.killpg(self.group, signal.SIGCONT)
            time.sleep(0.001)
            self.pause()

    def finish(self) -> int:
        code = self.process.wait(timeout=TIMEOUT)
        assert_group_gone(self.group)
        return code


def assert_group_gone(group: int, timeout: float = 15) -> None:
    """No live process is left in the CLI's process group (no embedded server, no worker)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for process in psutil.process_iter(["pid", "status", "cmdline"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(process.info)
        if not left:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes left behind by sft-tokenize: {left}")
        time.sleep(0.1)


def assert_clean_error(code: int, stdout: str, stderr: str, expected_code: int, *expected: str) -> str:
    """The exit code, nothing on stdout, no traceback or start-up noise, and a last stderr line saying it all."""
    assert code == expected_code, stderr
    assert stdout == ""
    assert not [noise for noise in NOISE if noise in stderr], stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("sft-tokenize: error: "), stderr
    for text in expected:
        assert text in last
    return last


def assert_rejected(result: subprocess.CompletedProcess, *expected: str) -> str:
    return assert_clean_error(result.returncode, result.stdout, result.stderr, 2, *expected)


# -- what is on disk ------------------------------------------------------------------------------------------


def published_caches(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.iterdir() if not p.name.startswith(".")) if cache_root.is_dir() else []


def staged_shards(cache_root: Path) -> dict[str, tuple[int, int]]:
    """The finished shards in the shard store (a sidecar matching the shard's size), by key: (inode, mtime_ns)."""
    finished = {}
    for sidecar in (cache_root / ".shards").glob("*.json"):
        shard = sidecar.with_suffix(".arrow")
        if shard.exists() and json.loads(sidecar.read_text())["bytes"] == shard.stat().st_size:
            finished[shard.name] = (shard.stat().st_ino, shard.stat().st_mtime_ns)
    return finished


def assert_no_partial_shard(cache_root: Path) -> None:
    """Every file under a shard's name is a whole Arrow stream, and a shard with a sidecar holds its rows."""
    for shard in (cache_root / ".shards").glob("*.arrow"):
        table = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all()
        sidecar = shard.with_suffix(".json")
        if sidecar.exists():
            assert table.num_rows == json.loads(sidecar.read_text())["rows"], shard


def contents(cache_path: Path) -> dict:
    """A cache as a comparable value: the bytes of its data files and metadata, its manifest less the timings
    and the record of its build (when, how many slices it reused)."""
    manifest = json.loads((cache_path / "manifest.json").read_text())
    del manifest["timings"], manifest["build"]
    for shard in manifest["shards"]:
        del shard["seconds"]
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(cache_path.iterdir())
               if p.name != "manifest.json"}
    return {"files": digests, "manifest": manifest}


def published_inodes(cache_path: Path) -> dict[int, tuple[int, int]]:
    return {int(p.name[5:10]): (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache_path.glob("data-*.arrow")}


@contextlib.contextmanager
def held(lock_file: Path) -> Iterator[None]:
    """Hold an advisory lock of the cache format (flock), as another run would."""
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def someone_waits_for(lock_file: Path) -> bool:
    """A process is blocked waiting for this flock (the kernel lists waiters as `->` in /proc/locks)."""
    st = lock_file.stat()
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return any("->" in line and file_id in line for line in Path("/proc/locks").read_text().splitlines())


def assert_readable_whole(cache_path: Path, rows: int) -> None:
    """If the cache's directory exists at all, it is the whole cache."""
    if cache_path.exists():
        assert len(open_cache(cache_path)) == rows


# -- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture
def launch(tmp_path) -> Iterator[Callable[..., Background]]:
    """Start `sft-tokenize run` in the background (logs under tmp_path/NAME); whatever a test leaves running,
    stopped or not, is killed when it ends."""
    runs: list[Background] = []

    def start(args: list[str], home: Path, name: str, api_url: str | None = None) -> Background:
        runs.append(Background(args, home, tmp_path / name, api_url))
        return runs[-1]

    yield start
    for run in runs:
        if run.process.poll() is None:
            run.kill()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def api_url(tmp_path_factory, migrated_prefect_home):
    """One Prefect server for the module's runs whose CLI is not killed; yields its API URL."""
    home = Path(shutil.copytree(migrated_prefect_home, tmp_path_factory.mktemp("server") / "home"))
    port = free_port()
    log = (home / "server.log").open("w")
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env={**environment(home), "PREFECT_UI_ENABLED": "false"}, stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the Prefect server did not start: {(home / 'server.log').read_text()}")
                time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def many_rows(tmp_path_factory) -> Path:
    """The example rows four times over: 960 rows, 14 slices of 100KB, a few seconds of tokenizing."""
    rows = example_rows()
    return write_jsonl(tmp_path_factory.mktemp("many") / "many.jsonl", rows * 4)


@pytest.fixture(scope="module")
def many_rows_reference(tmp_path_factory, many_rows) -> Path:
    """The same input tokenized by the plain pipeline, in one process, without Prefect: a clean run."""
    cache_dir = tmp_path_factory.mktemp("reference")
    return run_locally(TokenizeOptions(sources=[str(many_rows)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(cache_dir), shard_size="100KB"))


def run_args(sources: list[Path | str], cache_root: Path, *extra: str) -> list[str]:
    return ["run", *map(str, sources), "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(cache_root),
            "--shard-size", "100KB", "--workers", "2", *extra]


# -- 1. bad input found before Prefect starts ------------------------------------------------------------------


def file_with(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _json_object(d: Path) -> list[str]:
    """One conversation as a pretty-printed JSON object, not an array of them."""
    return [file_with(d / "conversations.json", json.dumps({"messages": example_rows()[0]["messages"]}, indent=2))]


def _truncated_parquet(d: Path) -> list[str]:
    pq.write_table(pa.Table.from_pylist(example_rows()), d / "rows.parquet")
    data = (d / "rows.parquet").read_bytes()
    (d / "rows.parquet").write_bytes(data[: len(data) // 2])
    return [str(d / "rows.parquet")]


def _tokenizer_without_template(d: Path) -> list[str]:
    shutil.copytree(EXAMPLE_TOKENIZER, d / "bare", ignore=shutil.ignore_patterns("*.jinja"))
    return [str(EXAMPLE_DATA), "--tokenizer", str(d / "bare")]


FILE_ERRORS = {
    "missing-file": (lambda d: [str(d / "nowhere.jsonl")], "no such file: {d}/nowhere.jsonl"),
    "empty-file": (lambda d: [file_with(d / "empty.jsonl", "")], "{d}/empty.jsonl: the file is empty"),
    "unknown-extension": (lambda d: [file_with(d / "rows.txt", "hi")], "{d}/rows.txt: unknown file format '.txt'"),
    "json-not-an-array": (_json_object, "{d}/conversations.json: a .json file must hold an array of objects"),
    "corrupt-parquet": (_truncated_parquet, "{d}/rows.parquet: not a readable Parquet file"),
    "no-tokenizer": (lambda d: [str(EXAMPLE_DATA), "--tokenizer", str(d / "no-tokenizer")],
                     "tokenizer directory not found: {d}/no-tokenizer"),
    "no-chat-template": (_tokenizer_without_template, "tokenizer {d}/bare has no chat template, which chat data needs"),
    "max-length-below-template": (lambda d: [str(EXAMPLE_DATA), "--max-length", "5"],
                                  "--max-length 5 leaves no room for content: the chat template alone takes"),
    "cache-dir-is-a-file": (lambda d: [str(EXAMPLE_DATA), "--cache-dir", file_with(d / "file", "x")],
                            "cache dir {d}/file exists and is not a directory"),
}


def _custom_code_tokenizer(d: Path) -> list[str]:
    """A tokenizer whose config asks for its own Python class; the module leaves a marker if it is imported."""
    tokenizer = Path(shutil.copytree(EXAMPLE_TOKENIZER, d / "custom-tokenizer"))
    (tokenizer / "custom_tokenizer.py").write_text(
        f"open({str(d / MARKER)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="CustomTokenizer",
                  auto_map={"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]})
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    return [str(EXAMPLE_DATA), "--tokenizer", str(tokenizer)]


def _hostile_template(d: Path) -> list[str]:
    """A chat template that runs a shell command if Jinja lets it reach Python's internals."""
    (d / "hostile.jinja").write_text(f"{{{{ cycler.__init__.__globals__.os.system('touch {d / MARKER}') }}}}")
    # --max-length makes the plan render the template once, before any row is read.
    return [str(EXAMPLE_DATA), "--chat-template", str(d / "hostile.jinja"), "--max-length", "512"]


MARKER = "untrusted-code-ran"  # a file that exists only if untrusted code ran
UNTRUSTED = {
    "name-with-parent": lambda d: [str(EXAMPLE_DATA), "--name", "../escaped"],
    "absolute-name": lambda d: [str(EXAMPLE_DATA), "--name", f"{d}/escaped"],
    "custom-tokenizer-code": _custom_code_tokenizer,
    "hostile-chat-template": _hostile_template,
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every input that the CLI must refuse before Prefect starts, each run in its own directory: (directory,
    result) by case. The runs are independent processes of a few seconds each, so they run one per core."""
    setups = {**{case: setup for case, (setup, _) in FILE_ERRORS.items()}, **UNTRUSTED}
    directories = {case: tmp_path_factory.mktemp(case) for case in setups}

    def run(case: str) -> tuple[Path, subprocess.CompletedProcess]:
        d = directories[case]
        args = setups[case](d)
        # The later of a repeated option wins: a case may name its own tokenizer or cache dir.
        return d, cli("run", args[0], "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(d / "cache"),
                      *args[1:], home=d / "prefect-home")

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        return dict(zip(setups, pool.map(run, setups), strict=True))


def assert_refused_before_prefect_started(d: Path, result: subprocess.CompletedProcess, *expected: str) -> None:
    assert_rejected(result, *expected)
    assert not (d / "prefect-home" / "prefect.db").exists()  # no Prefect server was started
    assert published_caches(d / "cache") == []
    assert not list((d / "cache").glob(".staging/*"))


@pytest.mark.slow
@pytest.mark.parametrize("case", FILE_ERRORS)
def test_bad_input_is_named_before_prefect_starts(refusals, case):
    d, result = refusals[case]
    assert_refused_before_prefect_started(d, result, FILE_ERRORS[case][1].format(d=d))


# -- 1. bad rows, found while tokenizing ------------------------------------------------------------------------

ROW_ERRORS = {  # a row that is wrong, and how the error says so
    "malformed-json": ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON: Expecting"),
    "not-utf8": ('{"messages": [{"role": "user", "content": "caf\xe9"}]}'.encode("latin-1"),
                 "not valid UTF-8 (byte 0xe9 at column 47)"),
    "messages-not-a-list": ('{"messages": "hello"}', "'messages' must be a list of messages, got str"),
    "no-role": ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}',
                "messages[0] has no 'role'"),
    "no-content": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}',
                   "messages[1] has no 'content'"),
    "content-not-text": ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
                         '{"url": "x.png"}}]}, {"role": "assistant", "content": "yo"}]}',
                         "messages[0].content[0] is a part of type 'image_url': only text parts"),
    "unknown-role": ('{"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
                     "messages[0] has unknown role 'narrator' (known: system, user, assistant, tool)"),
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


def other_formats_with_a_bad_row_2(data: Path) -> list[Path]:
    """A JSON array and a Parquet file whose second row has a message without a role."""
    rows = example_rows()[:3]
    rows[1] = {"messages": [{"role": None, "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (data / "bad-item.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), data / "bad-row.parquet")
    return [data / "bad-item.json", data / "bad-row.parquet"]


@pytest.fixture(scope="module")
def bad_rows_run(tmp_path_factory, api_url):
    """One run over a file per kind of bad row, and one with a row that has no assistant turn. Every line is its
    own slice, so every bad row fails its own slice and is reported, and the other slices finish."""
    data = tmp_path_factory.mktemp("bad-rows")
    files = [with_a_bad_row(data / f"{case}.jsonl", bad) for case, (bad, _) in ROW_ERRORS.items()]
    files.append(with_a_bad_row(data / "no-assistant-row.jsonl", NO_ASSISTANT))
    files += other_formats_with_a_bad_row_2(data)
    cache_root = data / "cache"
    result = cli(*run_args(files, cache_root, "--shard-size", "1"), home=data / "prefect-home", api_url=api_url)
    return result, data, cache_root


@pytest.mark.slow
@pytest.mark.parametrize("case", ROW_ERRORS)
def test_each_bad_row_is_named_by_file_and_line(bad_rows_run, case):
    result, data, _ = bad_rows_run
    assert f"failed: BadInput: {data}/{case}.jsonl:3: {ROW_ERRORS[case][1]}" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("where", ["bad-item.json: item 2", "bad-row.parquet: row 2"])
def test_rows_are_counted_from_1_in_every_format_as_lines_are(bad_rows_run, where):
    result, data, _ = bad_rows_run
    assert f"failed: BadInput: {data}/{where}: messages[0] has no 'role'" in result.stderr


@pytest.mark.slow
def test_bad_rows_exit_2_publish_nothing_and_keep_the_good_slices(bad_rows_run):
    result, data, cache_root = bad_rows_run
    first, (_, detail) = next(iter(ROW_ERRORS.items()))
    last = assert_rejected(result)
    assert last.startswith(f"sft-tokenize: error: {data}/{first}.jsonl:3: {detail}")
    assert "Retry" not in result.stderr  # a bad row fails the same way every time
    assert published_caches(cache_root) == []
    # The other slices, kept for a rerun: the same three good lines in every file are one shard each (content
    # addressed), and the row without an assistant turn is the fourth.
    assert len(staged_shards(cache_root)) == 4
    assert not list(cache_root.glob(".shards/*.tmp-*"))


@pytest.mark.slow
def test_a_row_without_an_assistant_turn_is_a_counted_drop_not_an_error(bad_rows_run):
    result, data, cache_root = bad_rows_run
    assert "no-assistant-row.jsonl" not in result.stderr
    # Its four lines are four slices: three good rows (shards shared with the other files' same lines) and the
    # row without an assistant turn, a shard of no row that counts the drop.
    sidecars = [json.loads(p.read_text()) for p in cache_root.glob(".shards/*.json")]
    assert sorted(meta["rows"] for meta in sidecars) == [0, 1, 1, 1]
    assert [meta["dropped"] for meta in sidecars if meta["dropped"]] == [{"no_assistant_turn": 1}]


def built_skipping(data: Path, cache_root: Path, home: Path, api_url: str) -> tuple[Path, dict]:
    """`sft-tokenize run --on-bad-row skip` that succeeds: the cache's path and its manifest."""
    result = cli(*run_args([data], cache_root, "--on-bad-row", "skip"), home=home, api_url=api_url)
    assert result.returncode == 0, result.stderr
    cache_path = Path(result.stdout.splitlines()[-1])
    return cache_path, json.loads((cache_path / "manifest.json").read_text())


@pytest.mark.slow
def test_skipped_bad_rows_are_counted_in_the_manifest(tmp_path, api_url):
    good = [json.dumps(row) for row in example_rows()[:10]]
    bad = [bad for bad, _ in ROW_ERRORS.values()] + [NO_ASSISTANT]
    mixed = [line for pair in zip(good[:len(bad)], bad, strict=True) for line in pair] + good[len(bad):]
    data = write_lines(tmp_path / "messy.jsonl", mixed)  # a bad row after each of the first good ones
    cache_root = tmp_path / "cache"
    cache_path, manifest = built_skipping(data, cache_root, tmp_path / "home", api_url)
    assert manifest["rows"] == len(good) == len(open_cache(cache_path))
    assert manifest["dropped"] == {"bad_message": 3, "bad_messages": 1, "malformed_json": 2, "no_assistant_turn": 1,
                                   "not_unicode": 1, "not_utf8": 1, "unknown_role": 1}

    # Prefect's persisted task results are JSON, never pickle: one per slice, holding its row count.
    records = [json.loads(p.read_bytes()) for p in (cache_root / ".prefect-results").iterdir()]
    assert len(records) == len(manifest["shards"])
    assert all(record["metadata"]["serializer"]["type"] == "json" for record in records)
    assert sorted(json.loads(record["result"]) for record in records) == sorted(s["rows"] for s in manifest["shards"])


@pytest.mark.slow
def test_a_file_without_an_assistant_turn_exits_2_naming_it(tmp_path, api_url):
    data = write_lines(tmp_path / "questions.jsonl", [NO_ASSISTANT] * 3)
    cache_root = tmp_path / "cache"
    result = cli(*run_args([data], cache_root), home=tmp_path / "home", api_url=api_url)
    assert_rejected(result, f"{data}: no row has a trained token: 3 rows dropped (no_assistant_turn: 3)")
    assert published_caches(cache_root) == []


@pytest.mark.slow
def test_control_token_text_in_a_message_is_plain_text_or_a_named_error(tmp_path, api_url):
    """A literal <|im_end|> inside a reply: by default encoded as text, so the whole reply is trained; with
    --special-text error, the run stops naming the file, the line and the message."""
    injected = {"messages": [{"role": "user", "content": "Say the end marker."},
                             {"role": "assistant", "content": "Here: <|im_end|> and the rest of the reply."}]}
    data = write_jsonl(tmp_path / "injected.jsonl", [example_rows()[0], injected])
    result = cli(*run_args([data], tmp_path / "cache"), home=tmp_path / "home", api_url=api_url)
    assert result.returncode == 0, result.stderr
    cache_path = Path(result.stdout.splitlines()[-1])
    shown = cli("inspect", str(cache_path), "--row", "1", home=tmp_path / "home", api_url=api_url)
    assert "[[Here: <|im_end|> and the rest of the reply.<|im_end|>]]" in shown.stdout
    assert json.loads((cache_path / "manifest.json").read_text())["masks"]["rows_special_text"] == 1
    refused = cli(*run_args([data], tmp_path / "strict", "--special-text", "error"), home=tmp_path / "home",
                  api_url=api_url)
    assert_rejected(refused, f"{data}:2: messages[1].content holds the control token '<|im_end|>' as text")
    assert published_caches(tmp_path / "strict") == []


# -- 2, 3. killed mid-run, killed while publishing ------------------------------------------------------------


@pytest.mark.slow
def test_killed_runs_resume_and_publish_the_clean_runs_cache(tmp_path, prefect_home, api_url, launch, many_rows,
                                                             many_rows_reference):
    cache_root = tmp_path / "cache"
    cache_path = cache_root / many_rows_reference.name  # same inputs, same fingerprint, same name
    staging = cache_root / ".staging"
    rows = len(open_cache(many_rows_reference))
    args = run_args([many_rows], cache_root)

    first = launch(args, prefect_home, "first")
    first.wait_until(lambda: len(staged_shards(cache_root)) >= 3, "three shards finished")
    first.kill()
    kept = staged_shards(cache_root)
    assert 3 <= len(kept) < 14
    assert_no_partial_shard(cache_root)

    # The same command resumes (on the module's server: the embedded one has shown it dies with its run). It is
    # held at the door of the publish (this test holds the publish lock, as a concurrent run would), then let in
    # a millisecond at a time and killed with its cache half-built.
    fingerprint = cache_path.name.rsplit("-", 1)[1]
    with held(staging / f"{fingerprint}.lock"):
        second = launch(args, prefect_home, "second", api_url=api_url)
        second.wait_until(lambda: someone_waits_for(staging / f"{fingerprint}.lock"), "the publish")
        second.pause()
    second.step_until(lambda: any(staging.glob("*.publish-*")), "a half-built cache")
    second.kill()
    assert f"tokenizing 14 slices ({len(kept)} already in the shard store)" in second.stderr
    assert not cache_path.exists()  # a reader sees no cache, not a half-built one
    with pytest.raises(CacheError, match="not a published cache"):
        open_cache(cache_path)
    assert_no_partial_shard(cache_root)

    third = launch(args, prefect_home, "third", api_url=api_url)
    while third.process.poll() is None:
        assert_readable_whole(cache_path, rows)
        time.sleep(0.02)
    assert third.finish() == 0, third.stderr
    assert third.stdout.splitlines()[-1] == str(cache_path)
    assert "tokenizing 14 slices (14 already in the shard store)" in third.stderr  # only the publish was redone
    assert contents(cache_path) == contents(many_rows_reference)
    # Shards finished before the first kill were never rewritten: they are the published data files.
    assert set(kept.values()) <= set(published_inodes(cache_path).values())
    assert [p.name for p in staging.iterdir() if p.is_dir()] == []  # no shard, no half-built cache left behind


@pytest.mark.slow
def test_a_killed_worker_process_fails_the_run_and_the_same_command_resumes(tmp_path, api_url, launch, many_rows,
                                                                            many_rows_reference):
    cache_root = tmp_path / "cache"
    args = run_args([many_rows], cache_root, "--runner", "processes")
    run = launch(args, tmp_path / "home", "first", api_url=api_url)
    run.wait_until(lambda: len(staged_shards(cache_root)) >= 2, "two shards finished")
    workers = [p for p in psutil.Process(run.process.pid).children(recursive=True)
               if any("spawn_main" in part for part in p.cmdline())]
    assert len(workers) == 2
    workers[0].kill()
    code = run.finish()
    assert_clean_error(code, run.stdout, run.stderr, 1, "SlicesFailed", "BrokenProcessPool",
                       "run again to tokenize only the failed slices")
    kept = staged_shards(cache_root)
    assert_no_partial_shard(cache_root)

    resumed = cli(*args, home=tmp_path / "home", api_url=api_url)
    assert resumed.returncode == 0, resumed.stderr
    assert f"tokenizing 14 slices ({len(kept)} already in the shard store)" in resumed.stderr
    cache_path = Path(resumed.stdout.splitlines()[-1])
    assert contents(cache_path) == contents(many_rows_reference)
    assert set(kept.values()) <= set(published_inodes(cache_path).values())


# -- 4. disk full ---------------------------------------------------------------------------------------------

FREE_BYTES = 60_000  # a 32 KB shard fits, an 85 KB one does not


@pytest.fixture
def small_disk(tmp_path):
    """A directory with about FREE_BYTES left: a small tmpfs topped up with a ballast file. Yields the
    directory, a file size limit to apply to the CLI instead where mounting is not permitted (else None),
    and a function that gives the space back."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    if not mounted:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (FREE_BYTES, FREE_BYTES))

        yield mount, limit, lambda: None
        return
    try:
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        ballast = mount / "ballast"
        ballast.write_bytes(b"\0" * (free - FREE_BYTES))
        yield mount, None, ballast.unlink
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_fails_the_shard_clearly_and_the_run_resumes_after_space_returns(tmp_path, api_url, small_disk):
    disk, limit, make_room = small_disk
    cache_root = disk / "cache"
    # One worker: the slices are written one after another, so each meets the same free space.
    args = run_args([EXAMPLE_DATA], cache_root, "--workers", "1")
    full = cli(*args, home=tmp_path / "home", api_url=api_url, preexec=limit)
    assert_clean_error(full.returncode, full.stdout, full.stderr, 1, "SlicesFailed", "3 of 4 slices failed",
                       "tokenize-00000: OutOfSpace: ", "cannot write the shard (",
                       "run the same command again: finished shards are kept")
    assert "No space left on device" in full.stderr or "File too large" in full.stderr
    kept = staged_shards(cache_root)
    assert len(kept) == 1  # slice 3's, the one small enough
    assert not list(cache_root.glob(".shards/*.tmp-*"))
    assert published_caches(cache_root) == []

    make_room()
    resumed = cli(*args, home=tmp_path / "home", api_url=api_url)
    assert resumed.returncode == 0, resumed.stderr
    assert "tokenizing 4 slices (1 already in the shard store)" in resumed.stderr
    cache_path = Path(resumed.stdout.splitlines()[-1])
    assert len(open_cache(cache_path)) == 240
    assert [published_inodes(cache_path)[3]] == list(kept.values())


# -- 5. concurrent runs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_concurrent_runs_share_one_cache_and_leave_others_alone(tmp_path, api_url, launch):
    cache_root = tmp_path / "cache"
    other = EXAMPLE_DATA / "chat-00001.jsonl"
    runs = [launch(run_args(sources, cache_root), tmp_path / f"home-{k}", f"run-{k}", api_url=api_url)
            for k, sources in enumerate([[EXAMPLE_DATA], [EXAMPLE_DATA], [other]])]
    for run in runs:
        assert run.finish() == 0, run.stderr
    same, twin, different = (Path(run.stdout.splitlines()[-1]) for run in runs)
    assert same == twin
    assert published_caches(cache_root) == sorted([same.name, different.name])
    assert len(open_cache(same)) == 240
    assert len(open_cache(different)) == len(other.read_text().splitlines())
    assert sorted(p.name for p in (cache_root / ".staging").iterdir()) == sorted(
        f"{path.name.rsplit('-', 1)[1]}{suffix}" for path in (same, different) for suffix in (".lock", ".run.lock"))


# -- 6. a corrupt cache ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_truncated_cache_is_refused_and_rebuilt(tmp_path, api_url):
    cache_root = tmp_path / "cache"
    cache_path = run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA)], tokenizer=str(EXAMPLE_TOKENIZER),
                                             cache_dir=str(cache_root), shard_size="100KB"))
    intact = contents(cache_path)
    victim = sorted(cache_path.glob("data-*.arrow"))[1]
    victim.write_bytes(victim.read_bytes()[:-1000])  # in place: the store's link to this shard is truncated too

    with pytest.raises(CacheError, match=f"{victim}: .* bytes, the manifest says .* bytes: the cache is corrupt"):
        open_cache(cache_path)
    inspected = cli("inspect", str(cache_path), home=tmp_path / "home")
    assert_rejected(inspected, str(victim), "the cache is corrupt")

    rebuilt = cli(*run_args([EXAMPLE_DATA], cache_root), home=tmp_path / "home", api_url=api_url)
    assert rebuilt.returncode == 0, rebuilt.stderr
    # Only the truncated shard is tokenized again: the store's size check refuses it like the cache's does.
    assert "tokenizing 4 slices (3 already in the shard store)" in rebuilt.stderr
    assert rebuilt.stdout.splitlines()[-1] == str(cache_path)
    assert contents(cache_path) == intact
    assert published_caches(cache_root) == [cache_path.name] and not list(cache_root.glob(".staging/*.corrupt-*"))


# -- 7. trust -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["name-with-parent", "absolute-name"])
def test_a_cache_name_cannot_leave_the_cache_root(refusals, case):
    d, result = refusals[case]
    assert_refused_before_prefect_started(d, result, "--name: cache name ", "must be letters, digits")
    assert not list(d.parent.glob("escaped*")) and not list(d.rglob("escaped*"))


@pytest.mark.slow
def test_tokenizer_code_does_not_run_unless_trusted(refusals):
    d, result = refusals["custom-tokenizer-code"]
    assert_refused_before_prefect_started(d, result, f"cannot load a tokenizer from {d}/custom-tokenizer",
                                          "contains custom code")
    assert not (d / MARKER).exists()


@pytest.mark.slow
def test_a_chat_template_cannot_reach_python(refusals):
    d, result = refusals["hostile-chat-template"]
    assert_refused_before_prefect_started(d, result, f"{d}/hostile.jinja: the chat template fails on an empty "
                                          "exchange", "SecurityError", "is unsafe")
    assert not (d / MARKER).exists()


# -- 8. hostile input, found at plan time: one line, exit 2, no Prefect ------------------------------------------


def _directory(d: Path, **entries: str | Callable[[Path], object]) -> Path:
    """d/in with a good JSONL file `a.jsonl`, and each entry: text, or a function that makes it at its path."""
    (d / "in").mkdir()
    write_jsonl(d / "in" / "a.jsonl", example_rows()[:3])
    for name, make in entries.items():
        path = d / "in" / name
        make(path) if callable(make) else path.write_text(make)
    return d / "in"


def _dangling_link(path: Path) -> None:
    path.symlink_to(path.parent.parent / "gone.jsonl")


def _glob_of_directories(d: Path) -> list[str]:
    for name in ("a.jsonl", "b.jsonl"):  # directories named like data files, each holding one
        write_jsonl(d / "in" / name / "rows.jsonl", example_rows()[:2])
    return [str(d / "in" / "*.jsonl")]


def _empty_split(d: Path) -> list[str]:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(example_rows()[:2]),
                          "test": datasets.Dataset.from_list([])}).save_to_disk(str(d / "saved"))
    return [str(d / "saved"), "--split", "test"]


def _arrow_without_batches(d: Path) -> list[str]:
    schema = pa.Table.from_pylist(example_rows()[:1]).schema
    with pa.OSFile(str(d / "empty.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema):
        pass
    return [str(d / "empty.arrow")]


def _jsonl_lines(path: Path, first: str) -> list[str]:
    write_lines(path, [first] + [json.dumps(row) for row in example_rows()[:2]])
    return [str(path)]


def _ragged_csv(d: Path) -> list[str]:
    file_with(d / "rows.csv", "prompt,completion\nhi,yo\nhow are you,fine,thanks\nbye,ciao\n")
    return [str(d / "rows.csv")]


def _manifest(d: Path, manifest: object) -> list[str]:
    (d / "cache-dir").mkdir()
    (d / "cache-dir" / "manifest.json").write_text(json.dumps(manifest))
    (d / "cache-dir" / "state.json").write_text(json.dumps({"_data_files": []}))
    return ["inspect", str(d / "cache-dir")]


def _template(d: Path, name: str, text: str | bytes) -> list[str]:
    (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return [str(EXAMPLE_DATA), "--chat-template", str(d / name)]


def _tokenizer_copy(d: Path, change: Callable[[Path], object]) -> list[str]:
    tokenizer = Path(shutil.copytree(EXAMPLE_TOKENIZER, d / "tok"))
    change(tokenizer)
    return [str(EXAMPLE_DATA), "--tokenizer", str(tokenizer)]


def _named_templates(tokenizer: Path) -> None:
    """The chat template as a list of named templates in tokenizer_config.json, as some hub models ship it."""
    template = (tokenizer / "chat_template.jinja").read_text()
    (tokenizer / "chat_template.jinja").unlink()
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": template}, {"name": "tool_use", "template": template}]
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))


def _closed_port_url(d: Path) -> list[str]:
    return [f"https://127.0.0.1:{free_port()}/data.jsonl"]


NO_AWS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None, "AWS_PROFILE": None,
          "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": "/dev/null",
          "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
BAD_LINE = '{"messages": [{"role": "user", "content": "hi"}'
# case: (its arguments, made in its own directory d; the one line it must print), all before Prefect starts.
PLAN_TIME_ERRORS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "unknown-file-in-a-directory": (lambda d: [str(_directory(d, **{"rows.txt": "hi"}))],
                                    "{d}/in/rows.txt: unknown file format '.txt'"),
    # Root reads any file whatever its mode, so the unreadable files are a link to nowhere and a FIFO.
    "dangling-symlink-in-a-directory": (lambda d: [str(_directory(d, **{"b.jsonl": _dangling_link}))],
                                        "{d}/in/b.jsonl: a symbolic link to {d}/gone.jsonl, which does not exist"),
    "fifo-in-a-directory": (lambda d: [str(_directory(d, **{"b.jsonl": os.mkfifo}))],
                            "{d}/in/b.jsonl: a FIFO, not a regular file"),
    "fifo-named-as-a-source": (lambda d: [str(_directory(d, **{"b.jsonl": os.mkfifo}) / "b.jsonl")],
                               "{d}/in/b.jsonl: a FIFO, not a regular file"),
    "glob-matching-only-directories": (_glob_of_directories, "{d}/in/*.jsonl matches only directories ({d}/in/a.jsonl"),
    "empty-datasetdict-split": (_empty_split, "{d}/saved: the saved dataset has no rows (split 'test' lists no data"),
    "arrow-stream-without-batches": (_arrow_without_batches, "{d}/empty.arrow: the Arrow file has no rows"),
    "bad-line-1": (lambda d: _jsonl_lines(d / "rows.jsonl", BAD_LINE), "{d}/rows.jsonl:1: not valid JSON: Expecting"),
    "bom-and-bad-line-1": (lambda d: _jsonl_lines(d / "rows.jsonl", "\ufeff" + BAD_LINE),
                           "{d}/rows.jsonl:1: not valid JSON: Expecting"),
    "lone-surrogate-on-line-1": (lambda d: _jsonl_lines(d / "rows.jsonl", ROW_ERRORS["lone-surrogate"][0]),
                                 "{d}/rows.jsonl:1: a lone surrogate \\ud83d in a string"),
    "deep-nesting-on-line-1": (lambda d: _jsonl_lines(d / "rows.jsonl", ROW_ERRORS["deep-nesting"][0]),
                               "{d}/rows.jsonl:1: not valid JSON: nested too deeply"),
    "literal-name-with-brackets": (lambda d: _jsonl_lines(d / "data[1].jsonl", BAD_LINE),
                                   "{d}/data[1].jsonl:1: not valid JSON"),
    "ragged-csv": (_ragged_csv, "{d}/rows.csv:3: 3 fields where the header has 2"),
    "manifest-is-an-empty-object": (lambda d: _manifest(d, {}), "{d}/cache-dir: manifest.json lacks name, fingerprint"),
    "manifest-is-a-list": (lambda d: _manifest(d, [1]),
                           "{d}/cache-dir: manifest.json holds a JSON list, not an object"),
    "inspect-a-file": (lambda d: ["inspect", file_with(d / "data.jsonl", "{}")],
                       "{d}/data.jsonl: not a published cache (a file: a cache is a directory"),
    "template-not-utf8": (lambda d: _template(d, "latin1.jinja", b"{{ 'caf\xe9' }}"),
                          "{d}/latin1.jinja: the chat template is not UTF-8 text (byte 8 is 0xe9)"),
    "template-syntax-error": (lambda d: _template(d, "broken.jinja", "{% for m in messages %}\n{{ m.content }}"),
                              "{d}/broken.jinja: the chat template is not valid Jinja (line 2 of the template): "
                              "Unexpected end of template"),
    "tokenizer-template-syntax-error": (
        lambda d: _tokenizer_copy(d, lambda t: (t / "chat_template.jinja").write_text("{{ messages[0 }}")),
        "{d}/tok/chat_template.jinja: the chat template is not valid Jinja (line 1 of the template)"),
    "named-chat-templates": (lambda d: _tokenizer_copy(d, _named_templates),
                             "{d}/tok/tokenizer_config.json: the tokenizer has named chat templates (default, "
                             "tool_use), and one template is used for every row"),
    "s3-without-credentials": (lambda d: ["s3://sft-tokenize-no-such-bucket/data.jsonl"],
                               "s3://sft-tokenize-no-such-bucket/data.jsonl: cannot read it (NoCredentialsError"),
    "https-unreachable": (_closed_port_url, "/data.jsonl: cannot read it (ClientConnectorError: Cannot connect"),
    "unwritable-prefect-home": (lambda d: [file_with(d / "not-a-directory", "x") and str(EXAMPLE_DATA)],
                                "PREFECT_HOME {d}/not-a-directory/home: Prefect's embedded server cannot keep its "
                                "database there (Not a directory)"),
    "tokenizer-message-in-full": (lambda d: _tokenizer_copy(d, lambda t: (t / "tokenizer.json").unlink()),
                                  "Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` library "
                                  "serialization file, (2) a slow tokenizer instance to convert"),
    "tokenizer-file-for-a-directory": (lambda d: [str(EXAMPLE_DATA), "--tokenizer",
                                                  file_with(d / "tokenizer.json", "{}")],
                                       "{d}/tokenizer.json: --tokenizer takes the tokenizer's directory (the one "
                                       "holding tokenizer.json and tokenizer_config.json), not a file: try {d}"),
    "bad-flag-value": (lambda d: [str(EXAMPLE_DATA), "--max-length", "many"],
                       "argument --max-length: expected a whole number, got 'many' (see `sft-tokenize run --help`)"),
    "unnormalised-path": (lambda d: [str(d / "sub" / ".." / "nowhere.jsonl")], "no such file: {d}/nowhere.jsonl"),
}
# A tokenizer fails to load while the embedded server boots (they overlap): with a server URL set, none starts.
PLAN_TIME_ENV = {"s3-without-credentials": NO_AWS, "tokenizer-message-in-full": {"PREFECT_API_URL": "http://127.0.0.1:9/api"}}


@pytest.fixture(scope="module")
def plan_time_errors(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess, float]]:
    """Each case's CLI run in its own directory, two at a time: (directory, result, seconds) by case."""
    def run(case: str) -> tuple[Path, subprocess.CompletedProcess, float]:
        d = tmp_path_factory.mktemp(case)
        args = PLAN_TIME_ERRORS[case][0](d)
        if args[0] != "inspect":
            args = ["run", args[0], "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(d / "cache"), *args[1:]]
        home = d / "not-a-directory" / "home" if case == "unwritable-prefect-home" else d / "prefect-home"
        started = time.monotonic()
        result = cli(*args, home=home, env=PLAN_TIME_ENV.get(case))
        return d, result, time.monotonic() - started

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        return dict(zip(PLAN_TIME_ERRORS, pool.map(run, PLAN_TIME_ERRORS), strict=True))


@pytest.mark.parametrize("case", PLAN_TIME_ERRORS)
def test_hostile_input_is_one_line_before_prefect_starts(plan_time_errors, case):
    d, result, seconds = plan_time_errors[case]
    assert_refused_before_prefect_started(d, result, PLAN_TIME_ERRORS[case][1].format(d=d))
    assert len(result.stderr.splitlines()) == 1, result.stderr  # the error line and nothing else


# -- 9. hostile input that must be read right: whole directories, skips that stay skips, odd names --------------


def _snapshot(d: Path) -> tuple[Path, int]:
    """A Hugging Face snapshot directory: links into blobs/, one real file beside them, a README, a nested
    directory. The JSONL and the JSON array start with a byte order mark. Returns it and its row count."""
    rows = example_rows()
    (d / "blobs").mkdir()
    (d / "blobs" / "1f0c").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows[:5]).encode())
    (d / "blobs" / "9a2e").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows[5:8]).encode())
    write_jsonl(d / "blobs" / "77b3", rows[8:10])
    snapshot = d / "snapshot"
    (snapshot / "more").mkdir(parents=True)
    (snapshot / "a.jsonl").symlink_to("../blobs/1f0c")
    (snapshot / "b.json").symlink_to("../blobs/9a2e")
    write_jsonl(snapshot / "c[1].jsonl", rows[10:13])  # a real file, its name a glob pattern
    (snapshot / "more" / "d.jsonl").symlink_to("../../blobs/77b3")
    (snapshot / "README.md").write_text("# a dataset card\n")
    (snapshot / ".gitattributes").write_text("*.jsonl filter=lfs\n")
    return snapshot, 13


@pytest.mark.slow
def test_a_directory_of_links_is_read_whole_its_cache_inside_never_read_and_its_glob_gives_the_same_cache(
        tmp_path, api_url):
    snapshot, rows = _snapshot(tmp_path)
    cache_root = snapshot / "cache"  # inside the input directory
    args = ("--name", "snap", "--tokenizer", str(EXAMPLE_TOKENIZER), "--shard-size", "1KB", "--workers", "2")
    first = cli("run", str(snapshot), "--cache-dir", str(snapshot / "more" / ".." / "cache"), *args,
                home=tmp_path / "home", api_url=api_url)
    assert first.returncode == 0, first.stderr
    cache_path = Path(first.stdout.splitlines()[-1])
    assert cache_path.parent == cache_root  # printed normalised, without more/..
    assert len(open_cache(cache_path)) == rows  # every row of every file: links, BOMs, the nested one
    manifest = json.loads((cache_path / "manifest.json").read_text())
    assert [Path(url).name for url, *_ in manifest["fingerprint_inputs"]["sources"]] == [
        "a.jsonl", "b.json", "c[1].jsonl", "d.jsonl"]
    assert manifest["fingerprint_inputs"]["ignored_files"] == [str(snapshot / "README.md")]
    assert f"not data, not read: {snapshot / 'README.md'}" in first.stderr

    # The published cache and its staging under the input directory are not input: the same run is a cache
    # hit, and so are the same files named by globs (the README, matched by no glob, is not an input either).
    again = cli("run", str(snapshot), "--cache-dir", str(cache_root), *args, home=tmp_path / "home")
    globbed = cli("run", str(snapshot / "*.json*"), str(snapshot / "more" / "*"), "--cache-dir", str(cache_root),
                  *args, home=tmp_path / "home")
    for hit in (again, globbed):
        assert hit.returncode == 0, hit.stderr
        assert hit.stdout.splitlines() == [str(cache_path)] and hit.stderr == ""
    assert published_caches(cache_root) == [cache_path.name]


@pytest.mark.slow
def test_a_skip_built_cache_is_not_served_to_a_raise_run(tmp_path, api_url):
    good = [json.dumps(row) for row in example_rows()[:6]]
    lines = [BAD_LINE, good[0], ROW_ERRORS["lone-surrogate"][0], good[1], ROW_ERRORS["deep-nesting"][0], *good[2:]]
    data = write_lines(tmp_path / "messy.jsonl", lines)
    cache_root = tmp_path / "cache"
    cache_path, manifest = built_skipping(data, cache_root, tmp_path / "home", api_url)
    assert manifest["rows"] == len(good) == len(open_cache(cache_path))
    assert manifest["dropped"] == {"malformed_json": 2, "not_unicode": 1}  # the bad line 1 is skipped like any
    assert manifest["fingerprint_inputs"]["on_bad_row"] == "skip"

    raised = cli(*run_args([data], cache_root), home=tmp_path / "home", api_url=api_url)
    assert_rejected(raised, f"{data}:1: not valid JSON: Expecting")
    assert len(raised.stderr.splitlines()) == 1, raised.stderr
    assert published_caches(cache_root) == [cache_path.name]


@pytest.mark.slow
def test_a_240_character_file_name_gives_a_cache_named_by_its_first_100(tmp_path, api_url):
    data = write_jsonl(tmp_path / ("r" * 234 + ".jsonl"), example_rows()[:3])
    result = cli(*run_args([data], tmp_path / "cache", "--force"), home=tmp_path / "home", api_url=api_url)
    assert result.returncode == 0, result.stderr
    cache_path = Path(result.stdout.splitlines()[-1])
    assert cache_path.name.startswith("r" * 100 + "-") and len(cache_path.name) == 117
    assert len(open_cache(cache_path)) == 3


@pytest.mark.slow
@pytest.mark.parametrize(("manifest", "force"), [({}, False), ([1], True)])
def test_a_corrupt_manifest_is_rebuilt_by_run_and_by_run_force(tmp_path, api_url, manifest, force):
    cache_root = tmp_path / "cache"
    data = write_jsonl(tmp_path / "rows.jsonl", example_rows()[:4])
    cache_path = run_locally(TokenizeOptions(sources=[str(data)], tokenizer=str(EXAMPLE_TOKENIZER),
                                             cache_dir=str(cache_root)))
    intact = [open_cache(cache_path)[i]["input_ids"].tolist() for i in range(4)]
    (cache_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CacheError, match="manifest.json .* the cache is corrupt"):
        open_cache(cache_path)
    rebuilt = cli(*run_args([data], cache_root, *(["--force"] if force else [])), home=tmp_path / "home",
                  api_url=api_url)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert rebuilt.stdout.splitlines()[-1] == str(cache_path)
    assert [open_cache(cache_path)[i]["input_ids"].tolist() for i in range(4)] == intact


# -- 10. noise: a run's stderr is its progress and its log, nothing of the embedded server's ------------------------


@pytest.mark.slow
def test_a_quiet_run_of_many_slices_on_the_embedded_server_prints_only_its_progress(tmp_path, prefect_home):
    result = cli(*run_args([EXAMPLE_DATA], tmp_path / "cache", "--shard-size", "15KB", "-q"), home=prefect_home)
    assert result.returncode == 0, result.stderr
    assert len(open_cache(Path(result.stdout.splitlines()[-1]))) == 240
    lines = result.stderr.strip().splitlines()
    assert len(lines) <= 1 and all("slices" in line for line in lines), result.stderr  # 22/22 slices, 240 rows
    assert (prefect_home / "embedded-server.log").exists()  # where the server's own logs went


@pytest.mark.slow
def test_an_embedded_server_that_cannot_start_says_why_in_one_line(tmp_path, prefect_home):
    database = tmp_path / "no-such-dir" / "prefect.db"
    result = cli(*run_args([EXAMPLE_DATA], tmp_path / "cache"), home=prefect_home,
                 env={"PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database}"})
    last = assert_clean_error(result.returncode, result.stdout, result.stderr, 1,
                              "the embedded Prefect server (pid ", ") exited with code",
                              "unable to open database file",
                              f"(its log: {prefect_home / 'embedded-server.log'})")
    assert result.stderr.strip().splitlines() == [last]
    assert published_caches(tmp_path / "cache") == []
