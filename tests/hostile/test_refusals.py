"""Input the CLI must refuse before Prefect starts, each run as a user runs it: missing, empty, corrupt or
unknown files, tokenizers it cannot use, options that leave no room; and what it must not trust: cache names
that leave the cache root, tokenizer code, chat templates that reach for Python. Every case is one clear line
and exit 2, with no Prefect server started and nothing published."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.bad_input import assert_refused_before_prefect_started, file_with
from support.cli import cli
from support.data import example_rows
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

# -- bad input, found before Prefect starts ---------------------------------------------------------------


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
def refusals(cli_homes) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every input that the CLI must refuse before Prefect starts, each run in its own directory: (directory,
    result) by case. The runs are independent processes of a few seconds each, so they run one per core."""
    setups = {**{case: setup for case, (setup, _) in FILE_ERRORS.items()}, **UNTRUSTED}
    directories = {case: cli_homes(case) for case in setups}

    def run(case: str) -> tuple[Path, subprocess.CompletedProcess]:
        d = directories[case]
        args = setups[case](d)
        # The later of a repeated option wins: a case may name its own tokenizer or cache dir.
        return d, cli("run", args[0], "--tokenizer", str(EXAMPLE_TOKENIZER), "--cache-dir", str(d / "cache"),
                      *args[1:], home=d / "prefect-home")

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        return dict(zip(setups, pool.map(run, setups), strict=True))


@pytest.mark.parametrize("case", FILE_ERRORS)
def test_bad_input_is_named_before_prefect_starts(refusals, case):
    d, result = refusals[case]
    assert_refused_before_prefect_started(d, result, FILE_ERRORS[case][1].format(d=d))


# -- trust --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["name-with-parent", "absolute-name"])
def test_a_cache_name_cannot_leave_the_cache_root(refusals, case):
    d, result = refusals[case]
    assert_refused_before_prefect_started(d, result, "--name: cache name ", "must be letters, digits")
    assert not list(d.parent.glob("escaped*")) and not list(d.rglob("escaped*"))


def test_tokenizer_code_does_not_run_unless_trusted(refusals):
    d, result = refusals["custom-tokenizer-code"]
    assert_refused_before_prefect_started(d, result, f"cannot load a tokenizer from {d}/custom-tokenizer",
                                          "contains custom code")
    assert not (d / MARKER).exists()


def test_a_chat_template_cannot_reach_python(refusals):
    d, result = refusals["hostile-chat-template"]
    assert_refused_before_prefect_started(d, result, f"{d}/hostile.jinja: the chat template fails on an empty "
                                          "exchange", "SecurityError", "is unsafe")
    assert not (d / MARKER).exists()
