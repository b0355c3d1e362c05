"""A run's options keep their meaning: the same options give the same fingerprints as the caches already built
(so those stay valid and their shards are reused), the same job, and the command line gives the same options.

The fingerprints are pinned: a change to the option table, the fingerprint inputs or their encoding that
would orphan every existing cache fails here. 5520e34b992e27e9 (defaults) and ede077a963f0babb
(`--max-length 256 --train-on last_assistant`) are the example's tokenization fingerprints in real builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import get_args, get_origin

import pytest
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.job import Job
from sft_tokenize.build.options import TokenizeOptions, declared, job_options
from sft_tokenize.build.plan import Plan, plan_slices
from sft_tokenize.cli.arguments import COMMANDS, SECTIONS, build_parser, options_from, with_flag_tables
from sft_tokenize.fingerprint import fingerprint
from sft_tokenize.flags import declared as declared_in
from sft_tokenize.flows.run_options import TokenizeRun
from sft_tokenize.read.packing_index import PackOptions

# option set → (tokenization fingerprint, cache fingerprint with each source as [file name, kind, size]).
PINNED = {
    "defaults": ("572acbf77d6721d9", "07e285151a35f62e"),
    "max_length_last_assistant": ("46bea1edd52843b0", "18f18108d2e62eb0"),
    "layout_trl": ("f81125cd14ee023e", "a2f98534ec26c590"),
    "column_mapping": ("95c0be05e32f5f09", "b409c2b8ffcd5bee"),
    "prompt_completion": ("02ea127fb9eee2b5", "0bc8620fca5321d8"),
    "text": ("5b129e75db4bb13b", "40b1aec46773c71a"),
    "extra_columns": ("0dcd91751345ac08", "ef51b29a2cb81e59"),
    "chat_template_file": ("9e7e199efeae9883", "7d6c2edb363a2bbc"),
    "template_kwargs": ("b7e6532bc39201c6", "de0f39e287996dc2"),
    "masks_and_bad_rows": ("d66660fc939023b2", "312b1cceca500687"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Small inputs of the other formats and column names, made from the example's first rows."""
    folder = tmp_path_factory.mktemp("inputs")
    rows = [json.loads(line) for line in (EXAMPLE_DATA / "chat-00000.jsonl").read_text().splitlines()[:20]]

    def write(name: str, records: list[dict]) -> None:
        (folder / name).write_text("".join(json.dumps(record) + "\n" for record in records))

    write("conversations.jsonl", [{"conversations": row["messages"]} for row in rows])
    write("prompts.jsonl", [{"prompt": row["messages"][0]["content"], "response": row["messages"][1]["content"]}
                            for row in rows])
    write("text.jsonl", [{"text": row["messages"][1]["content"]} for row in rows])
    template = (EXAMPLE_TOKENIZER / "chat_template.jinja").read_text()
    (folder / "template.jinja").write_text(template.replace("\\n", "\\n\\n", 1))  # one more newline per header
    return folder


def option_sets(folder: Path) -> dict[str, dict]:
    return {
        "defaults": {},
        "max_length_last_assistant": {"max_length": 256, "train_on": "last_assistant"},
        "layout_trl": {"layout": "trl"},
        "column_mapping": {"sources": [str(folder / "conversations.jsonl")], "columns": {"messages": "conversations"}},
        "prompt_completion": {"sources": [str(folder / "prompts.jsonl")], "format": "prompt-completion",
                              "columns": {"completion": "response"}, "train_on": "completion"},
        "text": {"sources": [str(folder / "text.jsonl")], "format": "text", "train_on": "all"},
        "extra_columns": {"extra_columns": ["labels", "attention_mask"]},
        "chat_template_file": {"chat_template": str(folder / "template.jinja")},
        "template_kwargs": {"template_kwargs": {"enable_thinking": False, "date_string": "1 Jan 2025"}},
        "masks_and_bad_rows": {"reasoning_turns": "expand", "special_text": "keep", "on_bad_row": "skip",
                               "max_row_bytes": "1MiB", "max_length": 300, "truncation": "drop"},
    }


def planned(folder: Path, **settings) -> Plan:
    options = TokenizeOptions(**{"sources": [str(EXAMPLE_DATA)], "tokenizer": str(EXAMPLE_TOKENIZER),
                                 "cache_dir": str(folder / "caches"), **settings})
    return plan_slices(options, content_keys=False)


def without_file_identities(plan: Plan) -> str:
    """The cache fingerprint with each source as its file name, kind and size (no directory, no mtime)."""
    hashed = {key: value for key, value in plan.inputs.items() if key != "ignored_files"}
    hashed["sources"] = [[Path(url).name, kind, size] for url, kind, size, *_ in hashed["sources"]]
    return fingerprint(hashed)


@pytest.mark.parametrize("case", list(PINNED))
def test_the_fingerprints_of_an_option_set_are_those_of_the_caches_built_before(inputs, case):
    plan = planned(inputs, **option_sets(inputs)[case])
    # The cache's name carries the fingerprint of exactly what the manifest records as hashed.
    assert plan.cache_path.name.rsplit("-", 1)[1] == plan.job.fingerprint == \
        fingerprint({key: value for key, value in plan.inputs.items() if key != "ignored_files"})
    assert (plan.job.tokenization, without_file_identities(plan)) == PINNED[case]
    # In this order in the manifest's fingerprint_inputs, as in every manifest written before.
    assert list(plan.inputs) == [
        "cache_format_version", "sources", "format", "columns", "tokenizer_files", "chat_template_override",
        "template_kwargs", "reasoning_turns", "special_text", "train_on", "max_length", "truncation",
        "extra_columns", "layout", "on_bad_row", "max_row_bytes", "ignored_files",
    ]


def test_what_does_not_change_the_rows_does_not_change_the_fingerprint(inputs):
    default = planned(inputs)
    other = planned(inputs, encoder="hf", shard_size="1MB", writer_batch_rows=10,
                    writer_batch_bytes="1MB",
                    name="renamed", storage_options={"anon": False},
                    truncation="drop")  # no --max-length: nothing is ever truncated or dropped
    assert other.job.fingerprint == default.job.fingerprint
    assert other.job.tokenization == default.job.tokenization == PINNED["defaults"][0]
    template_text = (inputs / "template.jinja").read_text()
    inline = planned(inputs, chat_template=template_text)  # the template's text, not its file, is hashed
    assert inline.job.tokenization == PINNED["chat_template_file"][0]
    # Every row rendered in full is meant to give the same rows, and is fingerprinted apart so it can be compared.
    full = planned(inputs, render="full")
    assert full.job.fingerprint != default.job.fingerprint and full.inputs["render"] == "full"
    assert "render" not in default.inputs


def test_a_system_prompt_enters_the_fingerprint_only_when_set(inputs):
    default = planned(inputs, system_prompt=None)
    prompted = planned(inputs, system_prompt="Be brief.")
    assert default.job.tokenization == PINNED["defaults"][0] != prompted.job.tokenization
    assert prompted.inputs["system_prompt"] == "Be brief." and "system_prompt" not in default.inputs


def test_the_job_carries_the_options_as_the_slices_use_them(inputs):
    job = planned(inputs, **option_sets(inputs)["masks_and_bad_rows"], encoder="hf", extra_columns=["labels"],
                  writer_batch_rows=10, writer_batch_bytes="1MB", storage_options={"anon": False}).job
    fields = {key: value for key, value in dataclasses.asdict(job).items()
              if key not in ("staging", "store", "tokenizer_dir", "prepared", "fingerprint", "tokenization",
                             "remote_root", "tokenizer_url", "run")}
    assert fields == {
        "chat_template": None,
        "columns": {"format": "chat", "columns": {"messages": "messages", "system": "system", "tools": "tools"}},
        "train_on": "all_assistant", "template_kwargs": {}, "reasoning_turns": "expand", "special_text": "keep",
        "encoder": "hf", "render": "skeleton", "max_length": 300, "truncation": "drop", "on_bad_row": "skip",
        "max_row_bytes": 1 << 20,
        "extra_columns": ("labels",), "layout": "skyrl", "writer_batch_rows": 10, "writer_batch_bytes": 10**6,
        "trust_remote_code": False, "storage_options": {"anon": False}, "request_timeout": 90.0, "system_prompt": None,
        "images": "embed", "image_root": None, "image_access": "root", "image_timeout": 30.0,
        "max_image_bytes": 50 * 10**6, "processor_config": "",
    }
    assert Path(job.tokenizer_dir) == EXAMPLE_TOKENIZER.resolve() and job.tokenizer_url == ""
    assert Path(job.staging).name == job.fingerprint and Path(job.staging).parent.name == ".staging"


def parsed(*argv: str) -> dict:
    return options_from(build_parser().parse_args(["run", *argv]))


def test_the_command_line_gives_the_flow_its_options():
    assert parsed("a.jsonl", "--tokenizer", "t", "--cache-dir", "c") == {
        "sources": ["a.jsonl"], "tokenizer": "t", "cache_dir": "c", "name": None, "format": "auto", "columns": {},
        "processor": None, "images": "embed", "image_root": None, "image_access": "root", "image_timeout": 30.0,
        "max_image_bytes": "50MB",
        "system_prompt": None,
        "train_on": "all_assistant", "max_length": None, "truncation": "truncate", "chat_template": None,
        "extra_columns": [], "template_kwargs": {}, "reasoning_turns": "as-rendered", "special_text": "literal",
        "encoder": "auto", "render": "skeleton", "layout": "skyrl", "split": "train", "subset": None,
        "on_bad_row": "raise",
        "shard_size": "256MB", "max_row_bytes": "2MB", "storage_options": {}, "request_timeout": 90.0,
        "runner": "threads", "dask_address": None, "ray_address": None, "workers": None, "encode_processes": None,
        "slices_per_task": None, "retries": 2, "force": False, "keep_versions": None,
    }
    every_flag = parsed(
        "a.jsonl", "b", "--tokenizer", "t", "--cache-dir", "c", "--name", "n", "--format", "chat",
        "--processor", "p", "--images", "reference", "--image-root", "imgs", "--image-access", "local+urls",
        "--image-timeout", "2.5", "--max-image-bytes", "9MB",
        "--messages-column", "conv", "--column", "system=sys", "--system-prompt", "Be brief.",
        "--train-on", "last_assistant", "--max-length", "256",
        "--truncation", "drop", "--chat-template", "f.jinja", "--template-kwargs", '{"x": 1}',
        "--reasoning-turns", "expand", "--special-text", "keep", "--encoder", "hf", "--render", "full",
        "--extra-column", "labels",
        "--extra-column", "attention_mask", "--layout", "trl", "--split", "test", "--subset", "s",
        "--on-bad-row", "skip", "--shard-size", "1MB", "--max-row-bytes", "1MB", "--storage-options",
        '{"anon": true}', "--request-timeout", "7", "--runner", "dask", "--dask-address", "tcp://h:1",
        "--workers", "3", "--encode-processes", "0", "--slices-per-task", "4", "--retries", "5", "--force",
        "--keep-versions", "2", "--server-idle", "5", "-q")
    assert every_flag == {
        "sources": ["a.jsonl", "b"], "tokenizer": "t", "cache_dir": "c", "name": "n", "format": "chat",
        "processor": "p", "images": "reference", "image_root": "imgs", "image_access": "local+urls",
        "image_timeout": 2.5, "max_image_bytes": "9MB",
        "columns": {"system": "sys", "messages": "conv"}, "system_prompt": "Be brief.",
        "train_on": "last_assistant", "max_length": 256,
        "truncation": "drop", "chat_template": "f.jinja", "extra_columns": ["labels", "attention_mask"],
        "template_kwargs": {"x": 1}, "reasoning_turns": "expand", "special_text": "keep", "encoder": "hf",
        "render": "full", "layout": "trl", "split": "test", "subset": "s", "on_bad_row": "skip", "shard_size": "1MB",
        "max_row_bytes": "1MB", "storage_options": {"anon": True}, "request_timeout": 7.0, "runner": "dask",
        "dask_address": "tcp://h:1", "ray_address": None, "workers": 3, "encode_processes": 0, "slices_per_task": 4,
        "force": True, "keep_versions": 2, "retries": 5,
    }


def test_every_option_is_in_the_table_and_its_flag_says_what_the_flow_form_says():
    assert [name for name, _, _ in declared()] == list(TokenizeOptions.model_fields)
    run = next(action for action in build_parser()._actions if action.dest == "command").choices["run"]
    helps = {action.dest: action.help for action in run._actions}
    flagged = [(name, info) for name, info, option in declared() if option.section is not None]
    assert {name for name, _ in flagged} <= set(helps)
    assert [name for name, info in flagged if not helps[name].startswith(info.description)] == []
    # Only where Python and the flow take an option that has no flag.
    assert [name for name, _, option in declared() if option.section is None] == \
        ["revision", "tokenizer_revision", "writer_batch_rows", "writer_batch_bytes", "trust_remote_code"]


def every_flag() -> list[tuple[tuple[str, ...], argparse.Action]]:
    """Each (command path, action) of the command line, but the subcommand choosers and -h."""
    found = []

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif not isinstance(action, argparse._HelpAction):
                found.append((path, action))

    walk(build_parser(), ())
    return found


def test_every_flag_is_declared_once_and_says_what_its_declaration_says():
    """A flag whose help text, default or choices are not its declaration's (or that has no declaration) fails."""
    flags = every_flag()
    assert {path for path, _ in flags} == set(COMMANDS)
    undeclared, disagree = [], []
    for path, action in flags:
        fields = {name: (info, flag) for model in COMMANDS[path] for name, info, flag in declared_in(model)}
        if action.dest not in fields or fields[action.dest][1].section is None:
            undeclared.append((path, action.option_strings or action.dest))
            continue
        info, flag = fields[action.dest]
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        said = re.findall(r"\(default ([^):]*)\)", action.help)  # a default the help text states as a value
        expected_said = [str(default)] if default not in (None, False, "", [], {}) and not flag.repeat else []
        if not action.help.startswith(info.description) or said != expected_said:
            disagree.append((path, action.dest, action.help))
        if action.choices is not None and list(action.choices) != list(get_args(
                get_args(info.annotation)[0] if get_origin(info.annotation) is list else info.annotation)):
            disagree.append((path, action.dest, action.choices))
        if action.dest != "server_idle" and not flag.positional and action.default != (
                [] if flag.repeat else default if default is not None or info.is_required() else None):
            disagree.append((path, action.dest, action.default))
    assert undeclared == [] and disagree == []


def test_the_flow_form_shows_each_run_option_as_its_flag_does():
    """The tokenize-dataset flow's parameter schema (the Prefect UI form) holds the declarations' texts and
    defaults: the same words as `sft-tokenize run --help`."""
    from sft_tokenize.flows.tokenize_dataset import tokenize_dataset

    schema = tokenize_dataset.parameters.model_dump()
    (ref,) = {schema["properties"]["options"]["$ref"].rsplit("/", 1)[1]}
    form = schema["definitions"][ref]["properties"]
    helps = {action.dest: action.help for path, action in every_flag() if path == ("run",)}
    shown = [(name, form[name].get("description"), form[name].get("default")) for name, info, flag
             in declared_in(TokenizeRun) if flag.section is not None]
    assert [name for name, description, _ in shown if not helps[name].startswith(description)] == []
    assert [(name, default) for name, _, default in shown if "default" in form[name]
            and default != TokenizeRun.model_fields[name].get_default(call_default_factory=True)] == []
    assert form["retries"]["default"] == 2 and "(default 2)" in helps["retries"]
    pack = schema["definitions"]["PackOptions"]["properties"]
    assert [name for name, info, _ in declared_in(PackOptions) if pack[name]["description"] != info.description] == []


def test_the_job_has_a_field_for_each_option_the_slices_read_in_table_order():
    table = [(name, default) for name, _, default in job_options()]
    fields = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
              for f in dataclasses.fields(Job)}
    assert [(name, fields.get(name, "missing")) for name, _ in table] == table
    order = [f.name for f in dataclasses.fields(Job)]
    assert [name for name in order if name in dict(table)] == [name for name, _ in table]


def test_the_command_line_page_shows_the_declared_flags():
    """docs/cli.md's flag tables are made from the declarations (`make cli-docs` writes them again)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert page.count("<!-- flags: ") == len(SECTIONS) + len(COMMANDS) - 1
    assert with_flag_tables(page) == page, "docs/cli.md's flag tables are stale: run `make cli-docs`"


def test_a_ready_pool_encodes_a_run_of_any_size_unless_the_run_says_otherwise():
    """A pool started for the run's job (a resident's) is taken by a small run of the threads runner; an explicit
    --encode-processes and the other runners (their workers are processes) decide as before."""
    run = TokenizeRun(sources=["x.jsonl"], tokenizer="t", cache_dir="c")
    small, large = 10**6, 10**9
    cores = len(os.sched_getaffinity(0))
    assert (run.encode_process_count(small), run.encode_process_count(small, ready=2)) == (0, 2)
    assert run.encode_process_count(large, ready=1) == cores
    assert run.ready_pool_count == cores
    explicit = run.model_copy(update={"encode_processes": 0})
    assert (explicit.encode_process_count(small, ready=2), explicit.ready_pool_count) == (0, 0)
    dask = run.model_copy(update={"runner": "dask"})
    assert (dask.encode_process_count(large, ready=2), dask.ready_pool_count) == (0, 0)
