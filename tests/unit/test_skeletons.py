"""Skeletons (sft_tokenize/chat/skeleton.py): rows filled in from a learned render give exactly the ids and masks of
rows rendered in full, on every reference template, with contents chosen to make templates branch; a skeleton made
wrong is caught by the guard rail, and its batch rendered in full."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from support.data import COLUMNS, CONVERSATIONS, ROWS
from support.families import FAMILIES, MODERN_FAMILIES

from sft_tokenize.chat import facts, skeleton
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.sources.conversations import to_example

# What a field's text can be, to make a template branch or trim: ordinary, padded, empty, blank, multi-line,
# reasoning written inline, the template's own markup, and text with characters of several scripts.
EDITS = (
    lambda text: text,
    lambda text: text.upper() + " and more words here",
    lambda text: f"  {text}\n",
    lambda text: "",
    lambda text: "   \n",
    lambda text: f"line one\n\n{text}\nline three",
    lambda text: f"<think>\nreasoning {text}\n</think>\n\n{text}",
    lambda text: f"{text}</think>tail",
    lambda text: f"<tool_response>{text}</tool_response>",
    lambda text: f"Ωmega {text} 🚀 ",
    lambda text: "\n" + text,
    lambda text: text + " [INST] <start_of_turn>",
)


def _edited(row: dict, rng: random.Random, edits: tuple) -> dict:
    """A row of the same shape with other field texts."""
    row = copy.deepcopy(row)
    for message in row["messages"]:
        if isinstance(message.get("content"), str):
            message["content"] = rng.choice(edits)(message["content"])
        if isinstance(message.get("reasoning_content"), str):
            message["reasoning_content"] = rng.choice(edits)(message["reasoning_content"])
    return row


def corpus(seed: int = 0, copies: int = 8, edits: tuple = EDITS) -> list:
    """Every test conversation, then `copies` variants of each: the same shapes, other texts."""
    rng = random.Random(seed)
    base = [{"messages": messages} for messages in CONVERSATIONS] + list(ROWS.values())
    rows = base + [_edited(row, rng, edits) for _ in range(copies) for row in base]
    return [to_example(row, COLUMNS) for row in rows]


REWORDED = EDITS[:2]  # the usual dataset: other words in the same places


def encoded(tokenizer, examples, **options):
    encoder = ChatEncoder(tokenizer, MaskSettings(**options))
    return encoder, encoder.encode_batch(examples)


def assert_same(want, got) -> None:
    assert [str(o) for o in want.outcomes] == [str(o) for o in got.outcomes]
    assert np.array_equal(want.offsets, got.offsets)
    assert np.array_equal(want.input_ids, got.input_ids)
    assert np.array_equal(want.loss_mask, got.loss_mask)


ALL_TEMPLATES = [("old", family) for family in sorted(FAMILIES)] + [("modern", f) for f in sorted(MODERN_FAMILIES)]


@pytest.fixture(scope="module")
def tokenizers(family_tokenizer, modern_tokenizers):
    def get(kind: str, family: str):
        return load_tokenizer(family_tokenizer(family)) if kind == "old" else modern_tokenizers(family)

    return get


@pytest.mark.parametrize("train_on", ["all_assistant", "last_assistant"])
@pytest.mark.parametrize(("kind", "family"), ALL_TEMPLATES)
def test_filled_rows_equal_full_renders(tokenizers, kind, family, train_on, monkeypatch):
    tokenizer = tokenizers(kind, family)
    examples = corpus()
    _, want = encoded(tokenizer, examples, train_on=train_on, skeletons=False)
    monkeypatch.setattr(skeleton, "SAMPLE_EVERY", 10**9)  # only the first fill of a skeleton is checked in full
    _, got = encoded(tokenizer, examples, train_on=train_on)
    assert_same(want, got)


def test_most_templates_fill_in(tokenizers):
    """The skeleton path is not a corner case: on reworded rows it carries most rows on most reference templates,
    exactly."""
    examples = corpus(copies=6, edits=REWORDED)
    filling = {}
    for kind, family in ALL_TEMPLATES:
        tokenizer = tokenizers(kind, family)
        _, want = encoded(tokenizer, examples, skeletons=False)
        encoder, got = encoded(tokenizer, examples)
        assert_same(want, got)
        filling[family] = encoder.turns.skeletons.filled if encoder.turns.skeletons else 0
    most = [family for family, filled in filling.items() if filled > len(examples) // 2]
    assert len(most) >= 25, f"rows filled in of {len(examples)}: {filling}"


def _ignoring_facts(monkeypatch) -> None:
    """Skeletons that no longer check what the template learned about each field."""
    monkeypatch.setattr(facts, "compiled", lambda recorded: lambda values: True)


def test_a_skeleton_made_wrong_is_caught_by_the_guard_rail(tokenizers, monkeypatch):
    """Qwen3 renders an assistant turn in history with `</think>` in it otherwise: a skeleton that ignores that fact
    fills the row in wrong, and the first fill (checked against a full render) makes the batch render in full."""
    tokenizer = tokenizers("modern", "qwen3")
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]}
    thinking = copy.deepcopy(plain)
    thinking["messages"][1]["content"] = "Wave.</think>\n\nHello."  # in history, Qwen3 keeps what follows
    examples = [to_example(row, COLUMNS) for row in (plain, thinking)]
    _, want = encoded(tokenizer, examples, skeletons=False)
    _ignoring_facts(monkeypatch)
    _, caught = encoded(tokenizer, examples)
    assert caught.skeleton_mismatches == 1
    assert_same(want, caught)
    # Without the guard rail the wrong skeleton's row differs from the full render: the comparison above has teeth.
    monkeypatch.setattr(skeleton.Skeletons, "find", _unchecked(skeleton.Skeletons.find))
    _, got = encoded(tokenizer, examples)
    assert not np.array_equal(want.input_ids, got.input_ids) or not np.array_equal(want.loss_mask, got.loss_mask)


def _unchecked(find):
    def unchecked(self, shape):
        found = find(self, shape)
        return None if found is None else (found[0], False)

    return unchecked


def test_a_corrupted_constant_is_caught(tokenizers):
    tokenizer = tokenizers("modern", "qwen2.5")
    examples = corpus(copies=2)
    encoder = ChatEncoder(tokenizer)
    encoder.encode_batch(examples[:len(examples) // 3])  # learn the shapes
    for known in encoder.turns.skeletons._by_key.values():
        for k, learned in enumerate(known):
            known[k] = skeleton.Skeleton(("X", *learned.constants[1:]), learned.slots, learned.facts, learned.regions,
                                         learned.append_eos)
    encoder.turns.skeletons._uses.clear()  # every skeleton's next fill is a first one again
    batch = encoder.encode_batch(examples)
    assert batch.skeleton_mismatches == 1
    assert_same(ChatEncoder(tokenizer, MaskSettings(skeletons=False)).encode_batch(examples), batch)


def test_rows_with_marker_characters_take_the_full_render(tokenizers):
    """A field holding characters of the markers' range is never keyed as a shape."""
    tokenizer = tokenizers("modern", "qwen2.5")
    row = {"messages": [{"role": "user", "content": "a\U000f1000b"}, {"role": "assistant", "content": "x\U000f1001"}]}
    examples = [to_example(row, COLUMNS)] * 3
    _, want = encoded(tokenizer, examples, skeletons=False)
    encoder, got = encoded(tokenizer, examples)
    assert_same(want, got)
    assert encoder.turns.skeletons.filled == 0
