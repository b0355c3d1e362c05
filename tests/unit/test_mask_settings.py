"""The mask options travel as one frozen value: built once from the Job, given as it is to the encoder and the
turn finder, and the key a process keeps its encoder under."""

from __future__ import annotations

import json
import pickle
from dataclasses import FrozenInstanceError, fields, replace

import pytest
from support.data import example_rows
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build import workers
from sft_tokenize.build.options import MASKS, TokenizeOptions, declared
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.tokenizer import load_tokenizer


def test_every_mask_option_the_slices_read_is_a_mask_setting():
    mask_options = {name for name, _, option in declared() if option.section == MASKS and option.job}
    assert mask_options == {f.name for f in fields(MaskSettings)} - {"skeletons"}


def test_a_jobs_mask_settings_are_its_options(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in example_rows()[:4]))
    options = TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER), cache_dir=str(tmp_path / "c"),
                              train_on="last_assistant", max_length=300, truncation="drop",
                              template_kwargs={"enable_thinking": False}, reasoning_turns="expand",
                              special_text="keep", render="full")
    job = plan_slices(options).job
    assert job.masks == MaskSettings("last_assistant", 300, "drop", {"enable_thinking": False}, "expand", "keep",
                                     skeletons=False)
    assert job.masks is job.masks  # made once
    assert replace(job, render="skeleton").masks.skeletons
    encoder = workers.encoder_for(job)
    assert encoder.masks is job.masks and encoder.turns.masks is job.masks  # given as it is
    assert workers.encoder_for(replace(job)) is encoder  # equal settings: the same encoder
    assert workers.encoder_for(replace(job, train_on="all_assistant")) is not encoder


def test_mask_settings_are_frozen_hashable_and_travel_between_processes():
    kwargs = {"enable_thinking": False, "tools": [{"name": "x"}]}
    settings = MaskSettings(template_kwargs=kwargs)
    kwargs["tools"].append("changed")  # the caller's dict is not the settings'
    assert settings.template_kwargs == {"enable_thinking": False, "tools": [{"name": "x"}]}
    with pytest.raises(FrozenInstanceError):
        settings.train_on = "all"
    same = MaskSettings(template_kwargs={"tools": [{"name": "x"}], "enable_thinking": False})
    assert same == settings and hash(same) == hash(settings) and len({settings, same}) == 1
    assert MaskSettings(template_kwargs={"enable_thinking": True}) != settings
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_the_encoder_and_the_turn_finder_read_the_settings_they_are_given():
    tokenizer = load_tokenizer(EXAMPLE_TOKENIZER)
    settings = MaskSettings("last_assistant", skeletons=False)
    encoder = ChatEncoder(tokenizer, settings)
    assert encoder.turns.masks is settings and encoder.turns.skeletons is None
