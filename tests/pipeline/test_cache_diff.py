"""`diff_caches` / `sft-tokenize diff` between two caches, and `open_cache(path, tokenizer=...)`'s warning when the
trainer's tokenizer or chat template is not the cache's."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
from support.caches import EXAMPLE_SLICES
from support.cli import cli
from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.cache_diff import diff_caches
from sft_tokenize.read.tokenizer_check import TokenizerMismatch


@pytest.fixture(scope="module")
def last_turns(example_cache) -> Path:
    """The example again, training only each conversation's last assistant turn, beside the example cache."""
    return Path(run_locally(TokenizeOptions(**EXAMPLE_SLICES, cache_dir=str(example_cache.parent),
                                            train_on="last_assistant")))


def test_a_cache_against_itself_differs_in_nothing(example_cache):
    result = diff_caches(example_cache, example_cache)
    assert result.differs == [] and (result.added, result.removed, result.changed, result.trained_delta) == (0, 0, 0, 0)


def test_a_mask_mode_change_is_rows_changed_in_place_with_their_trained_tokens(example_cache, last_turns):
    result = diff_caches(example_cache, last_turns)
    assert [key for key, _, _ in result.differs] == ["train_on"]
    assert result.matched_by == "position" and result.added == result.removed == 0
    old, new = open_cache(example_cache), open_cache(last_turns)
    changed = [i for i in range(len(old)) if old[i]["loss_mask"].tolist() != new[i]["loss_mask"].tolist()]
    assert result.changed == len(changed) > 0
    assert result.trained_delta == new.manifest["trained_tokens"] - old.manifest["trained_tokens"] < 0
    deltas = [b - a for _, a, b in result.changed_rows]
    assert sorted(deltas, key=abs, reverse=True) == deltas
    row, a, b = result.changed_rows[0]
    assert (a, b) == (int(old[row]["loss_mask"].sum()), int(new[row]["loss_mask"].sum()))


def test_other_sources_match_rows_by_content(example_cache, tmp_path):
    first_file = Path(run_locally(TokenizeOptions(sources=[str(EXAMPLE_DATA / "chat-00000.jsonl")],
                                                  tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path))))
    result = diff_caches(first_file, example_cache)
    assert result.matched_by == "content" and [key for key, _, _ in result.differs] == ["sources"]
    assert result.removed == 0 and result.added == len(open_cache(example_cache)) - len(open_cache(first_file)) > 0


def test_the_command_names_what_differs_and_shows_a_changed_row(example_cache, last_turns, cli_home):
    done = cli("diff", str(example_cache), str(last_turns), "--rows", "1", home=cli_home)
    assert done.returncode == 0, done.stderr
    assert "differs: train_on" in done.stdout and "all_assistant → last_assistant" in done.stdout
    assert done.stdout.count("── row ") == 2 and "[[" in done.stdout  # the row as OLD and as NEW, trained marked


def test_open_cache_warns_when_the_tokenizer_or_its_template_is_not_the_caches(example_cache, tmp_path):
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenizerMismatch)
        open_cache(example_cache, tokenizer=AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER)))
        open_cache(example_cache, tokenizer=str(EXAMPLE_TOKENIZER))
    edited = Path(shutil.copytree(EXAMPLE_TOKENIZER, tmp_path / "tokenizer"))
    with (edited / "chat_template.jinja").open("a") as f:
        f.write("{# trains the prompt too #}")
    with pytest.warns(TokenizerMismatch, match=r"chat_template\.jinja differ"):
        open_cache(example_cache, tokenizer=AutoTokenizer.from_pretrained(str(edited)))
    hub_style = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    hub_style.name_or_path = "someone/model"  # not a directory here: only its template can be compared
    hub_style.chat_template += "{# edited #}"
    with pytest.warns(TokenizerMismatch, match="chat template differs"):
        open_cache(example_cache, tokenizer=hub_style)
