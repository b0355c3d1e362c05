"""The differential test of skeletons, with no sampling: on every reference template (9 older families, 25 current
ones), both train-on modes that locate turns and both special-text modes that encode rows, generated conversations
whose fields are built to make templates branch are encoded with every filled row checked against its full render
(`SAMPLE_EVERY` = 1), and the batch is compared with the same rows encoded with every row rendered in full."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from support.data import COLUMNS
from support.families import FAMILIES, MODERN_FAMILIES

from sft_tokenize.chat import skeleton
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.encoding.tokenizer import load_tokenizer
from sft_tokenize.sources.conversations import to_example

ROWS_PER_CASE = 160  # x 34 templates x 2 train-on modes x 2 special-text modes = 21,760 rows
ALL_TEMPLATES = [("old", family) for family in sorted(FAMILIES)] + [("modern", f) for f in sorted(MODERN_FAMILIES)]

WORDS = ["weather", "Paris", "the", "answer", "is", "42", "ok", "Ωmega", "日本語", "🚀", "naïve", "x"]
NUMBERS = [0, 1, -1, 1.0, -0.0, 0.0, 1.5, 1e300, 5e-324, 12345678901234567890, float("nan"), float("inf"),
           float("-inf"), True, False, None]


def _text(rng: random.Random, specials: list[str]) -> str:
    """A field's text made to make templates branch: words, padding, blank, multi-line, reasoning markers,
    header and control text, long."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    kind = rng.randrange(28)  # an edge one time in three
    if kind == 0:
        return f"  {words}\n"
    if kind == 1:
        return "\n" + words
    if kind == 2:
        return f"line one\n\n{words}\nline three"
    if kind == 3:
        return f"<think>\n{words}\n</think>\n\n{words}"
    if kind == 4:
        return f"{words}</think>tail"
    if kind == 5:
        return f"{words} {rng.choice(specials)} {words}" if specials else words
    if kind == 6:
        return f"{words} assistant\n user: [INST] <start_of_turn>model\n"
    if kind == 7:
        return (words + " ") * 100
    if kind == 8:
        return "\u00a0" + words + "\u2028"
    if kind == 9:
        return words + " \t "
    return words


def _arguments(rng: random.Random) -> str:
    return json.dumps({"city": rng.choice(WORDS), "days": rng.choice(NUMBERS), "when": [rng.choice(NUMBERS)]})


TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "number",
                                                                                          "default": 1.0}},
                   "required": ["city"]}}}]


def _row(rng: random.Random, specials: list[str]) -> dict:
    """A conversation of one of a few shapes (so that skeletons are learned and filled), with other texts."""
    shape = rng.randrange(6)
    messages: list[dict] = []
    if shape in (1, 4):
        messages.append({"role": "system", "content": _text(rng, specials)})
    turns = 1 if shape in (0, 1) else 2 if shape in (2, 5) else 3
    for k in range(turns):
        messages.append({"role": "user", "content": _text(rng, specials)})
        reply: dict = {"role": "assistant", "content": _text(rng, specials)}
        if shape == 4 and k == turns - 1:
            reply["reasoning_content"] = _text(rng, specials)
        if shape == 5 and k == 0:
            reply = {"role": "assistant", "content": "", "tool_calls": [
                {"id": "abc123xyz", "type": "function", "function": {"name": "get_time",
                                                                     "arguments": _arguments(rng)}}]}
            messages += [reply, {"role": "tool", "tool_call_id": "abc123xyz", "name": "get_time",
                                 "content": _text(rng, specials)}]
            continue
        messages.append(reply)
    if shape == 3 and rng.random() < 0.5:  # a turn repeated whole
        messages += messages[-2:]
    row: dict = {"messages": messages}
    if shape == 5:
        tools = json.loads(json.dumps(TOOLS))
        tools[0]["function"]["parameters"]["properties"]["days"]["default"] = rng.choice(NUMBERS)
        row["tools"] = tools
    return row


def corpus(seed: int, specials: list[str]) -> list:
    rng = random.Random(seed)
    return [to_example(_row(rng, specials), COLUMNS) for _ in range(ROWS_PER_CASE)]


@pytest.fixture(scope="module")
def tokenizers(family_tokenizer, modern_tokenizers):
    def get(kind: str, family: str):
        return load_tokenizer(family_tokenizer(family)) if kind == "old" else modern_tokenizers(family)

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "family"), ALL_TEMPLATES)
def test_every_filled_row_is_its_full_render(tokenizers, kind, family, monkeypatch):
    monkeypatch.setattr(skeleton, "SAMPLE_EVERY", 1)  # every filled row is also rendered in full and compared
    tokenizer = tokenizers(kind, family)
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special})
    filled = rows = 0
    for k, (train_on, special_text) in enumerate([(t, s) for t in ("all_assistant", "last_assistant")
                                                 for s in ("literal", "keep")]):
        examples = corpus(k, specials)
        want = ChatEncoder(tokenizer, MaskSettings(train_on=train_on, special_text=special_text, skeletons=False))
        got = ChatEncoder(tokenizer, MaskSettings(train_on=train_on, special_text=special_text)).encode_batch(examples)
        assert got.skeleton_mismatches == 0, f"{family} {train_on} {special_text}: a fill differed"
        want = want.encode_batch(examples)
        assert [str(o) for o in want.outcomes] == [str(o) for o in got.outcomes]
        assert np.array_equal(want.offsets, got.offsets)
        assert np.array_equal(want.input_ids, got.input_ids) and np.array_equal(want.loss_mask, got.loss_mask)
        assert got.rows_checked == got.rows_filled
        filled, rows = filled + got.rows_filled, rows + len(examples)
    assert rows == 4 * ROWS_PER_CASE
    if family not in ("glm-4.5", "smollm3"):  # which read fields in ways a trace does not replay
        assert filled > rows // 8, f"{family}: {filled} of {rows} rows filled"
