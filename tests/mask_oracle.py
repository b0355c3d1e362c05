"""The loss-mask definition, computed the slow and obvious way, for tests to compare against.

For assistant message i, with prompt = apply_chat_template(messages[:i], add_generation_prompt=True) and
turn = apply_chat_template(messages[:i+1]) as text: the trained characters start where `turn` stops
agreeing with `prompt` and end after the first special token that follows; trained tokens are the tokens
of the whole conversation that start inside that span. Only transformers' own API is used.
"""

from __future__ import annotations

import os
import re


def chat_text(tokenizer, messages, add_generation_prompt=False, tools=None) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def oracle(tokenizer, messages, train_on="all_assistant", completion_start=None, max_length=None,
           truncation="truncate", tools=None):
    """(input_ids, loss_mask) as lists, or the drop reason."""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    special = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    text = chat_text(tokenizer, messages, tools=tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    assert ids == list(out["input_ids"] if hasattr(out, "keys") else out)
    starts = [start for start, _ in encoded["offset_mapping"]]
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "all":
        mask = [1] * len(ids)
    else:
        if train_on == "completion":
            if completion_start is None:
                users = [i for i, m in enumerate(messages) if m["role"] == "user"]
                completion_start = users[-1] + 1 if users else 0
            targets = [i for i in assistant if i >= completion_start]
        elif train_on == "last_assistant":
            targets = assistant[-1:]
        else:
            targets = assistant
        if not targets:
            return "no_assistant_turn"
        spans = []
        for i in targets:
            prompt = chat_text(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
            turn = chat_text(tokenizer, messages[: i + 1], tools=tools)
            start = len(os.path.commonprefix([prompt, turn]))
            found = special.search(turn, start)
            end = found.end() if found else len(turn)
            assert text.startswith(turn[:end])
            spans.append((start, end))
        if train_on == "completion":
            prompt = chat_text(tokenizer, messages[:completion_start], add_generation_prompt=True, tools=tools)
            spans = [(len(os.path.commonprefix([prompt, text])), spans[-1][1])]
        mask = [int(any(a <= s < b for a, b in spans)) for s in starts]
    if max_length is not None and len(ids) > max_length:
        if truncation == "drop":
            return "too_long"
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            return "truncated_away"
    if not any(mask):
        return "no_trained_tokens"
    return ids, mask
