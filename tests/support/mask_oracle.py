"""The loss-mask definition, computed the slow and obvious way, for tests to compare against.

For assistant message i, with prompt = apply_chat_template(messages[:i], add_generation_prompt=True) and
turn = apply_chat_template(messages[:i+1]) as text: the trained characters start where `turn` stops
agreeing with `prompt` and end after the first special token that follows; trained tokens are the tokens
of the whole conversation holding a character of that span. Only transformers' own API is used.
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
        mask = [int(any(s < b and e > a for a, b in spans)) for s, e in encoded["offset_mapping"]]
    if max_length is not None and len(ids) > max_length:
        if truncation == "drop":
            return "too_long"
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            return "truncated_away"
    if not any(mask):
        return "no_trained_tokens"
    return ids, mask


def turn_oracle(tokenizer, messages, tools, end_of_turn: list[str], train_on: str = "all_assistant"):
    """The trained-turn definition for any template, computed without the encoder's markers, as
    (input_ids, loss_mask), for train_on all_assistant or last_assistant:

    - where an assistant message's fields render: the first and last character that change when each of its
      texts is wrapped in a snowman (a diff of two renders); the empty content of a reply without tool
      calls is where a snowman put in its place is inserted, with what the template writes around a
      content (a third render), so that an empty turn whose reasoning the template drops is still found;
    - the turn starts where apply_chat_template(messages[:i], add_generation_prompt=True) stops agreeing with
      the whole conversation, moved back to a token boundary of the generation prompt; for a template without
      a generation prompt, after the longest end of that prompt found before the turn's fields;
    - it ends after the first of the family's end-of-turn tokens (from its documentation) after the fields
      and before the next message's; with none there, at its last field, or, after the conversation's last
      message, at the end of the text with EOS appended and trained;
    - a token holding any character of a turn is trained.

    Texts are rendered by transformers' renderer as given: apply_chat_template would drop `content: None`,
    which DeepSeek-V3's template needs to render a tool call.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    def chat_text(tokenizer, messages, add_generation_prompt=False, tools=None):
        if not messages:
            return ""
        rendered, _ = render_jinja_template([messages], tools=tools, chat_template=tokenizer.chat_template,
                                            add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map)
        return rendered[0]

    text = chat_text(tokenizer, messages, tools=tools)
    generation = chat_text(tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=True)[
        len(chat_text(tokenizer, [{"role": "user", "content": "x"}])):]
    generation_ends = sorted({end for _, end in tokenizer(generation, add_special_tokens=False,
                                                           return_offsets_mapping=True)["offset_mapping"]})
    eot = re.compile("|".join(map(re.escape, end_of_turn)))
    def fields(i):
        """(first, last) character of message i's rendered texts, or None if nothing of it renders."""
        changed = [dict(m) for m in messages]
        changed[i] = _snowman(messages[i])
        other = chat_text(tokenizer, changed, tools=tools)
        first = len(os.path.commonprefix([text, other]))
        found = [] if first == len(text) else [
            (first, len(text) - len(os.path.commonprefix([text[::-1], other[::-1]])))]
        content = messages[i].get("content")
        if isinstance(content, str) and not content.strip() and not messages[i].get("tool_calls"):
            changed[i] = {**messages[i], "content": "☃"}
            other = chat_text(tokenizer, changed, tools=tools)
            at = len(os.path.commonprefix([text, other]))
            if not (other.endswith(text[at:]) and "☃" in other[at:len(other) - len(text) + at]):
                # Not an insertion of the snowman (and what the template writes around a content, as GLM-4.5's
                # newline): the empty content's place cannot be read.
                raise AssertionError(f"messages[{i}]: the template renders an empty content elsewhere")
            found.append((at, at))
        return (min(a for a, _ in found), max(b for _, b in found)) if found else None

    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    targets = assistant[-1:] if train_on == "last_assistant" else assistant
    spans, append_eos = [], False
    for i in targets:
        located = fields(i)
        if located is None:
            continue
        first, last = located
        following = fields(i + 1) if i + 1 < len(messages) else None
        prompt = chat_text(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        if generation:
            start = len(os.path.commonprefix([prompt, text]))
            header_at = len(prompt) - len(generation)
            if start > header_at:
                start = header_at + max([0] + [e for e in generation_ends if e <= start - header_at])
        else:  # the template may have moved earlier messages (a system message into the last user turn)
            k = next(k for k in range(len(prompt), -1, -1) if text.rfind(prompt[len(prompt) - k:], 0, first) >= 0)
            start = text.rfind(prompt[len(prompt) - k:], 0, first) + k
        found = eot.search(text, last, following[0] if following else len(text))
        if found:
            spans.append((start, found.end()))
        elif following:
            spans.append((start, last))
        else:
            spans.append((start, len(text)))
            append_eos = True
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [int(any(s < b and e > a for a, b in spans)) for s, e in encoded["offset_mapping"]]
    if append_eos:
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
    return ids, mask


def _snowman(message: dict) -> dict:
    """The message with each of its texts wrapped in snowmen (tool-call arguments' string values included)."""
    def wrap(value):
        return f"☃{value}☃" if isinstance(value, str) and value.strip() else value

    changed = {key: wrap(value) if key in ("content", "reasoning_content", "thinking", "reasoning") else value
               for key, value in message.items()}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call["function"])
            arguments = function.get("arguments")
            if isinstance(arguments, dict):
                function["arguments"] = {key: wrap(value) for key, value in arguments.items()}
            elif isinstance(arguments, str):
                function["arguments"] = wrap(arguments)
            calls.append({**call, "function": function})
        changed["tool_calls"] = calls
    return changed


def image_oracle(processor, messages, replacements: list[str], vision_tokens: list[str], end_of_turn: list[str]):
    """The loss-mask definition for an image row (every assistant turn trained), computed without the
    encoder's markers or image runs, as (input_ids, loss_mask):

    - the text is `processor.apply_chat_template(messages, tokenize=False)`, where each image is the
      processor's `image_token`; the k-th becomes `replacements[k]` (what the processor's
      `replace_image_token` puts there for that image), as the processor does before it tokenizes;
    - an assistant turn starts where the prompt before it (`add_generation_prompt=True`) stops agreeing
      with the text, moved back to a token boundary of the generation prompt, and ends after the first
      end-of-turn token after that;
    - a token is trained when it holds a character of a turn outside every replacement, and is not one of
      `vision_tokens`.
    """
    tokenizer = processor.tokenizer

    def render(part, add_generation_prompt=False):
        return processor.apply_chat_template(part, tokenize=False, add_generation_prompt=add_generation_prompt)

    text = render(messages)
    one = [{"role": "user", "content": "x"}]
    generation = render(one, True)[len(render(one)):]
    generation_ends = sorted({end for _, end in tokenizer(generation, add_special_tokens=False,
                                                           return_offsets_mapping=True)["offset_mapping"]})
    eot = re.compile("|".join(map(re.escape, end_of_turn)))
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], True)
        start = len(os.path.commonprefix([prompt, text]))
        header_at = len(prompt) - len(generation)
        if start > header_at:
            start = header_at + max([0] + [e for e in generation_ends if e <= start - header_at])
        spans.append((start, eot.search(text, start).end()))
    # The images' replacements, and the turns moved with them.
    pieces, images, position, shift, moves = [], [], 0, 0, []
    at = [m.start() for m in re.finditer(re.escape(processor.image_token), text)]
    assert len(at) == len(replacements), (len(at), len(replacements))
    for start, replacement in zip(at, replacements, strict=True):
        pieces += [text[position:start], replacement]
        images.append((start + shift, start + shift + len(replacement)))
        shift += len(replacement) - len(processor.image_token)
        moves.append((start, shift))
        position = start + len(processor.image_token)
    pieces.append(text[position:])
    expanded = "".join(pieces)

    def moved(p):
        return p + next((s for start, s in reversed(moves) if start < p), 0)

    spans = [(moved(a), moved(b)) for a, b in spans]
    encoded = tokenizer(expanded, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    vision = set(tokenizer.convert_tokens_to_ids(vision_tokens))
    trained = {c for a, b in spans for c in range(a, b)} - {c for a, b in images for c in range(a, b)}
    mask = [int(not trained.isdisjoint(range(s, e)) and t not in vision)
            for t, (s, e) in zip(ids, encoded["offset_mapping"], strict=True)]
    return ids, mask


def trained_runs(tokenizer, row) -> list[str]:
    """The decoded runs of 1s in an encoded row's loss mask."""
    runs, current = [], []
    for token, trained in zip(row.input_ids.tolist(), row.loss_mask.tolist(), strict=True):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]
