"""`sft_tokenize.tokenize()` given what a Python user gives it: misspelt options, loaded tokenizer and processor
objects, sources that are not a list of paths. Each is refused in one line naming what is expected, or
accepted and keyed by content; none ends in a bare assertion or builds a cache that ignores an option."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_TOKENIZER
from support.vision import gemma3, qwen_vl

from sft_tokenize import BadInput, tokenize
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.files import user_cache


@pytest.fixture
def rows(tmp_path) -> Path:
    return write_jsonl(tmp_path / "rows.jsonl", example_rows()[:8])


@pytest.mark.parametrize("option, closest", [
    ({"max_lenght": 4096}, "max_length"),
    ({"max-length": 10}, "max_length"),
    ({"trainon": "last_assistant"}, "train_on"),
    ({"worker": 2}, "workers"),  # a run option (the flow's), not a tokenizing one
])
def test_an_unknown_option_is_a_type_error_naming_the_closest_known_one(rows, tmp_path, option, closest):
    [name] = option
    with pytest.raises(TypeError) as raised:
        tokenize(rows, tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=tmp_path / "caches", **option)
    assert str(raised.value) == f"tokenize() got an unknown option {name!r} (did you mean {closest!r}?)"
    assert not (tmp_path / "caches").exists()  # refused before anything was planned


def test_every_option_a_run_takes_is_known_to_tokenize():
    from sft_tokenize.flows.api import _PASSED, RUN_OPTIONS
    from sft_tokenize.flows.tokenize_dataset import TokenizeRun

    assert set(RUN_OPTIONS) == set(TokenizeRun.model_fields) - set(TokenizeOptions.model_fields)
    assert set(_PASSED) <= set(TokenizeOptions.model_fields)


@pytest.mark.parametrize("sources, error, expected", [
    ([], BadInput, "tokenize(): sources is an empty list; expected a path, a glob, hub:NAME or a list of them"),
    (5, TypeError, "tokenize(): sources is int 5; expected a path, a glob, hub:NAME or a list of them"),
    ({"train": "a.jsonl"}, TypeError, "tokenize(): sources is dict {'train': 'a.jsonl'}; expected a path, a glob, "
                                      "hub:NAME or a list of them"),
    ({"a.jsonl", "b.jsonl"}, TypeError, "tokenize(): sources is set"),
    (["a.jsonl", 3], TypeError, "tokenize(): sources[1] is int 3; expected a path, a glob or hub:NAME"),
])
def test_sources_that_are_not_paths_are_one_line_saying_what_is_expected(tmp_path, sources, error, expected):
    with pytest.raises(error) as raised:
        tokenize(sources, tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=tmp_path / "caches")
    assert str(raised.value).startswith(expected) and "\n" not in str(raised.value)


def test_a_tokenizer_that_is_neither_a_path_nor_a_loaded_one_says_what_to_pass(rows, tmp_path):
    with pytest.raises(TypeError, match=r"^tokenize\(\): tokenizer is int 7; expected its directory, a hub name, "
                                        r"or a loaded transformers tokenizer$"):
        tokenize(rows, tokenizer=7, cache_dir=tmp_path / "caches")


def test_a_loaded_tokenizer_runs_as_its_files_do(rows, tmp_path):
    from transformers import AutoTokenizer

    from sft_tokenize.encoding.tokenizer import saved_pretrained

    loaded = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    saved = saved_pretrained(loaded)
    assert saved.parent.name == "saved" and (saved / "tokenizer.json").is_file()
    built = run_locally(TokenizeOptions(sources=[str(rows)], tokenizer=str(saved), cache_dir=str(tmp_path / "c")))
    # Loaded again, the same files: the same directory, so the same fingerprint (a cache hit, no flow run).
    again = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    assert saved_pretrained(again) == saved
    assert tokenize(rows, tokenizer=again, cache_dir=tmp_path / "c") == built
    # An edited template is other files: another directory and another cache, never the stale one.
    again.chat_template = again.chat_template.replace("<|im_start|>", "<|im_start|> ")
    edited = saved_pretrained(again)
    assert edited != saved
    plan = plan_slices(TokenizeOptions(sources=[str(rows)], tokenizer=str(edited), cache_dir=str(tmp_path / "c")),
                       content_keys=False)
    assert not plan.cached and plan.cache_path != built


def test_a_loaded_processor_runs_as_its_files_do(rows, tmp_path):
    from sft_tokenize.encoding.tokenizer import saved_pretrained

    (tmp_path / "gemma3").mkdir()
    _, processor, _ = gemma3(tmp_path / "gemma3")
    saved = saved_pretrained(processor, "processor")
    assert (saved / "processor_config.json").is_file() and (saved / "tokenizer.json").is_file()
    built = run_locally(TokenizeOptions(sources=[str(rows)], processor=str(saved), cache_dir=str(tmp_path / "c")))
    assert tokenize(rows, processor=processor, cache_dir=tmp_path / "c") == built


def test_a_processor_that_cannot_save_itself_is_one_line_saying_what_to_pass(rows, tmp_path):
    (tmp_path / "qwen").mkdir()
    _, processor, _ = qwen_vl(tmp_path / "qwen")  # built without a video processor (it needs torch): it cannot save
    with pytest.raises(BadInput, match=r"^the processor passed could not be saved by its save_pretrained "
                                       r"\(AttributeError: .*\): pass its directory or hub name instead$"):
        tokenize(rows, processor=processor, cache_dir=tmp_path / "caches")
    assert not list((user_cache() / "saved").glob(".saving-*"))  # nothing half-saved left behind
