"""Hostile input found at plan time, before Prefect starts: odd files in directories, FIFOs, dangling links,
broken lines, broken templates and tokenizers, unreachable remote files, a PREFECT_HOME that cannot be. Each is
one line on stderr and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pytest
from support.bad_input import ROW_ERRORS, assert_refused_before_prefect_started, file_with, write_lines
from support.cli import cli, free_port
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER


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


def _only_row_too_large(d: Path) -> list[str]:
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 3000}]}
    write_lines(d / "huge.jsonl", [json.dumps(row)])  # 3,087 bytes
    return [str(d / "huge.jsonl"), "--max-row-bytes", "1KB"]


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
    "only-row-over-max-row-bytes": (_only_row_too_large, "{d}/huge.jsonl:1: the row is 3,087 bytes, over the "
                                                         "1,000-byte limit (--max-row-bytes"),
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
    "https-unreachable": (_closed_port_url,
                          "/data.jsonl: connection refused; check that the endpoint is up and reachable from here"),
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
def plan_time_errors(cli_homes) -> dict[str, tuple[Path, subprocess.CompletedProcess, float]]:
    """Each case's CLI run in its own directory, two at a time: (directory, result, seconds) by case."""
    homes = {case: cli_homes(case) for case in PLAN_TIME_ERRORS}  # made here: pytest's mktemp is not thread-safe

    def run(case: str) -> tuple[Path, subprocess.CompletedProcess, float]:
        d = homes[case]
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
