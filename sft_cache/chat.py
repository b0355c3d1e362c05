"""Chat tokenization with loss masks, for any chat template.

A trained turn is what the template renders for an assistant message after the generation prompt: the
content and the end-of-turn token (the first special token after the content), not the role header and
not what follows the end-of-turn token. The definition, and the test oracle, is incremental prefix
rendering: for assistant message i, with

    prompt = render(messages[:i], add_generation_prompt=True)
    turn   = render(messages[:i+1])

the trained text starts where `turn` stops agreeing with `prompt` (their common prefix; for most templates
all of `prompt`) and ends after the first special token that follows. Rendering every prefix costs
O(turns²) renders per row, so the fast path renders a row twice instead: once as is, and once with each
trained content wrapped in private-use marker characters, which locate the contents in the text. The fast
path is taken only when its checks hold (the marked render is the real render plus markers, the text
around each content is the template's learned header and end-of-turn) and the first rows of every encoder
are cross-checked against the exact path; anything else takes the exact path, so the result is the same.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BadInput, BadRow, one_line
from .formats import Conversation

MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers copies each into the others
# Files that make up a tokenizer; hashed into the fingerprint and fetched from the hub.
TOKENIZER_FILE_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py")


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, same length, 0/1


@dataclass(frozen=True)
class EncodedBatch:
    """The kept rows of a batch, concatenated (numpy, no per-row objects), and what became of each example."""

    input_ids: np.ndarray  # int32, every kept row back to back
    loss_mask: np.ndarray  # int8
    offsets: np.ndarray  # int64, kept rows + 1: row k is [offsets[k], offsets[k+1])
    outcomes: list  # per example: its kept row's number, a drop reason (str), or the BadRow it raised

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def row(self, k: int) -> Encoded:
        a, b = self.offsets[k], self.offsets[k + 1]
        return Encoded(self.input_ids[a:b], self.loss_mask[a:b])

    def results(self) -> list[Encoded | str | BadRow]:
        """Per example: an Encoded row, a drop reason, or a BadRow."""
        return [self.row(o) if isinstance(o, int) else o for o in self.outcomes]


def resolve_tokenizer(name_or_path: str, revision: str | None = None) -> Path:
    """A local directory holding the tokenizer's files: the path itself, or a hub snapshot of them."""
    path = Path(os.path.abspath(Path(name_or_path).expanduser()))
    if path.is_dir():
        return path
    if path.is_file():
        raise BadInput(f"{path}: --tokenizer takes the tokenizer's directory (the one holding tokenizer.json and "
                       f"tokenizer_config.json), not a file: try {path.parent}")
    looks_local = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1 or path.exists()
    if looks_local:
        raise BadInput(f"tokenizer directory not found: {path}")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(name_or_path, revision=revision, allow_patterns=list(TOKENIZER_FILE_PATTERNS))
    except Exception as error:  # offline, unknown repo, gated: all end the same way for the user
        raise BadInput(
            f"tokenizer {name_or_path!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(error).__name__}: {one_line(error)})"
        ) from None
    return Path(local)


def read_chat_template(template: str | None) -> str | None:
    """The override given by the user: a path to a .jinja file, or the template text itself."""
    if template is None:
        return None
    if "{" not in template:
        path = Path(os.path.abspath(Path(template).expanduser()))
        if not path.is_file():
            raise BadInput(f"chat template file not found: {path}")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise BadInput(f"{path}: the chat template is not UTF-8 text (byte {error.start + 1} is "
                           f"0x{error.object[error.start]:02x})") from None
    return template


def load_tokenizer(tokenizer_dir: str | Path, chat_template: str | None = None, trust_remote_code: bool = False):
    """A fast `transformers` tokenizer from a local directory, with an optional chat-template override."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code)
    except Exception as error:
        raise BadInput(f"cannot load a tokenizer from {tokenizer_dir}: {one_line(error)}") from None
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise BadInput(f"{tokenizer_dir}: a fast (Rust) tokenizer with a tokenizer.json is required")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _first_special_end(text: str, special: re.Pattern | None) -> int:
    """End of the first special token in `text`, or len(text) if it has none."""
    match = special.search(text) if special else None
    return match.end() if match else len(text)


class ChatEncoder:
    """Turns conversations (or plain text) into input_ids and a loss mask, a batch at a time."""

    def __init__(self, tokenizer, train_on: str = "all_assistant", max_length: int | None = None,
                 truncation: str = "truncate", verify_rows: int = 2):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.template: str | None = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        self.template_kwargs = dict(tokenizer.special_tokens_map)
        self.train_on = train_on
        self.max_length = max_length
        self.truncation = truncation
        self.eos_id: int | None = tokenizer.eos_token_id
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                          reverse=True)
        self.special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.verify_rows = verify_rows  # rows still to cross-check between the fast and the exact path
        self.rows_fast = self.rows_exact = 0
        self._shape = self._learn_shape() if self.template else None

    @property
    def fast_path_enabled(self) -> bool:
        return self._shape is not None

    # -- rendering -------------------------------------------------------------------------------------------

    def render(self, messages: Sequence[dict], tools: list | None = None, add_generation_prompt: bool = False) -> str:
        """The template rendered as `apply_chat_template` renders it, in transformers' immutable sandbox.

        Rows decoded from JSON or Arrow hold plain data, so the compiled template is called directly: transformers'
        `render_jinja_template` would first deep-copy every message to strip rich objects, which costs twice the
        render itself. Messages with reasoning fields (which transformers aliases) and tools given as anything but
        JSON objects take transformers' own path."""
        from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

        plain = (tools is None or all(type(tool) is dict for tool in tools)) and not any(
            key in message for message in messages for key in REASONING_FIELDS)
        if plain:
            return _compile_jinja_template(self.template).render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **self.template_kwargs)
        rendered, _ = render_jinja_template([list(messages)], tools=tools, chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        return rendered[0]

    def _learn_shape(self) -> tuple[str, str, str] | None:
        """(generation prompt, text between it and the content, trained text after the content), or None
        when the template cannot be probed and every row takes the exact path."""
        user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
        try:
            prompt = self.render([user], add_generation_prompt=True)
            bare = self.render([user])
            full = self.render([user, reply])
        except Exception:
            return None
        start = len(os.path.commonprefix([prompt, full]))
        if not full.startswith(bare) or start < len(bare) or full.count("Hello") != 1:
            return None
        before, found, after = full[start:].partition("Hello")
        if not found:
            return None
        return full[len(bare):start], before, after[:_first_special_end(after, self.special)]

    def template_overhead(self) -> int:
        """Tokens the template adds around an empty exchange: max_length must leave room past it."""
        empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        return len(self.backend.encode(self.render(empty), add_special_tokens=False).ids)

    # -- trained character regions ---------------------------------------------------------------------------

    def _targets(self, conv: Conversation) -> list[int]:
        """Indices of the assistant messages whose turns are trained."""
        assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        if self.train_on == "last_assistant":
            return assistant[-1:]
        if self.train_on == "completion":
            return [i for i in assistant if i >= self._completion_start(conv)]
        return assistant

    @staticmethod
    def _completion_start(conv: Conversation) -> int:
        """Index of the completion's first message; for chat data, what follows the last user turn."""
        if conv.completion_start is not None:
            return conv.completion_start
        users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
        return users[-1] + 1 if users else 0

    def exact_regions(self, conv: Conversation, targets: list[int]) -> tuple[str, list[tuple[int, int]]]:
        """The definition itself: one prefix render per trained turn."""
        messages, tools = conv.messages, conv.tools
        text = self.render(messages, tools)
        regions = []
        for i in targets:
            prompt = self.render(messages[:i], tools, add_generation_prompt=True) if i else ""
            turn = self.render(messages[: i + 1], tools)
            start = len(os.path.commonprefix([prompt, turn]))
            end = start + _first_special_end(turn[start:], self.special)
            if not text.startswith(turn[:end]):
                raise ValueError(f"the chat template renders messages[:{i + 1}] differently inside the whole "
                                 "conversation, so its turns cannot be masked")
            regions.append((start, end))
        if self.train_on == "completion":
            first = self._completion_start(conv)
            prompt = self.render(messages[:first], tools, add_generation_prompt=True) if first else ""
            regions = [(len(os.path.commonprefix([prompt, text])), regions[-1][1])]
        return text, regions

    def fast_regions(self, conv: Conversation, targets: list[int]) -> tuple[str, list[tuple[int, int]]] | None:
        """Two renders and string checks; None when any check fails."""
        if self._shape is None:
            return None
        gen_prompt, before, trained_after = self._shape
        marked = list(conv.messages)
        for i in targets:
            content = marked[i].get("content")
            if not isinstance(content, str) or MARK_OPEN in content or MARK_CLOSE in content or (
                    self.special and self.special.search(content)):
                return None
            marked[i] = {**marked[i], "content": MARK_OPEN + content + MARK_CLOSE}
        marked_text = self.render(marked, conv.tools)
        pieces = re.split(f"([{MARK_OPEN}{MARK_CLOSE}])", marked_text)
        if pieces[1::2] != [MARK_OPEN, MARK_CLOSE] * len(targets):
            return None
        spans, position = [], 0
        for k, piece in enumerate(pieces[0::2]):
            if k % 2 == 1:
                spans.append((position, position + len(piece)))
            position += len(piece)
        text = "".join(pieces[0::2])
        if text != self.render(conv.messages, conv.tools):
            return None
        regions = []
        for start, end in spans:
            head = start - len(before)
            if not (text[:head].endswith(gen_prompt) and text[head:start] == before
                    and text.startswith(trained_after, end)):
                return None
            regions.append((head, end + len(trained_after)))
        if self.train_on == "completion":
            if self._completion_start(conv) != targets[0]:
                return None  # the completion opens with a non-assistant message
            regions = [(regions[0][0], regions[-1][1])]
        return text, regions

    # -- tokens ----------------------------------------------------------------------------------------------

    @staticmethod
    def _first_token_at_or_after(enc, position: int, n_tokens: int, n_chars: int) -> int:
        """Index of the first token starting at or after `position` (enc.offsets would build every offset)."""
        while position < n_chars:
            token = enc.char_to_token(position)
            if token is not None:
                return token if enc.token_to_chars(token)[0] >= position else token + 1
            position += 1
        return n_tokens

    def _regions(self, conv: Conversation, targets: list[int]) -> tuple[str, list[tuple[int, int]]]:
        found = self.fast_regions(conv, targets)
        if found is not None and self.verify_rows > 0:
            self.verify_rows -= 1
            if found != self.exact_regions(conv, targets):
                self._shape = None  # the template is not what the fast path assumes: stay exact
                found = None
        if found is None:
            self.rows_exact += 1
            return self.exact_regions(conv, targets)
        self.rows_fast += 1
        return found

    def encode_batch(self, examples: Sequence[Conversation | str]) -> EncodedBatch:
        """Render and mask every example, then one tokenizer call for the whole batch."""
        outcomes: list[int | str | BadRow | None] = [None] * len(examples)
        texts: list[str] = []
        plans: list[tuple[int, list[tuple[int, int]] | None]] = []  # (example, trained char spans or None)
        for index, example in enumerate(examples):
            if isinstance(example, str):
                if self.train_on != "all":
                    outcomes[index] = BadRow("text_needs_train_on_all",
                                             "text rows train on every token: use train_on='all'")
                    continue
                texts.append(example)
                plans.append((index, None))
                continue
            if self.template is None:
                raise BadInput("the tokenizer has no chat template: pass --chat-template FILE, or use text data")
            try:
                if self.train_on == "all":
                    text = self.render(example.messages, example.tools)
                    regions = [(0, len(text))]
                else:
                    targets = self._targets(example)
                    if not targets:
                        outcomes[index] = "no_assistant_turn"
                        continue
                    text, regions = self._regions(example, targets)
            except Exception as error:  # the template raised (e.g. roles must alternate)
                outcomes[index] = BadRow("template_error", f"chat template failed: {error}")
                continue
            texts.append(text)
            plans.append((index, regions))
        encodings = self._encode(texts, [regions is None for _, regions in plans])

        ids_lists = [enc.ids for enc in encodings]
        for (_, regions), ids in zip(plans, ids_lists, strict=True):
            if regions is None and self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
                ids.append(self.eos_id)  # plain text: BOS as the tokenizer adds it, then EOS
        lengths = np.fromiter(map(len, ids_lists), dtype=np.int64, count=len(ids_lists))
        starts = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        input_ids = np.fromiter(chain.from_iterable(ids_lists), dtype=np.int32, count=int(starts[-1]))
        loss_mask = np.zeros(len(input_ids), dtype=np.int8)
        for (_, regions), enc, text, offset, length in zip(plans, encodings, texts, starts[:-1], lengths, strict=True):
            if regions is None:
                loss_mask[offset:offset + length] = 1
                continue
            for begin, end in regions:
                first = self._first_token_at_or_after(enc, begin, int(length), len(text))
                stop = self._first_token_at_or_after(enc, end, int(length), len(text))
                loss_mask[offset + first:offset + stop] = 1
        return self._apply_max_length(outcomes, [index for index, _ in plans], input_ids, loss_mask, starts)

    def _apply_max_length(self, outcomes, indices, input_ids, loss_mask, starts) -> EncodedBatch:
        """Truncate or drop rows over max_length, drop rows left with no trained token."""
        lengths = np.diff(starts)
        keep = lengths if self.max_length is None else np.minimum(lengths, self.max_length)
        trained_before = np.concatenate([[0], np.cumsum(loss_mask, dtype=np.int64)])
        trained = trained_before[starts[:-1] + keep] - trained_before[starts[:-1]]
        kept_offsets = [0]
        selection = np.zeros(len(input_ids), dtype=bool)
        for row, index in enumerate(indices):
            if keep[row] < lengths[row] and self.truncation == "drop":
                outcomes[index] = "too_long"
            elif trained[row] == 0:
                outcomes[index] = "truncated_away" if keep[row] < lengths[row] else "no_trained_tokens"
            else:
                outcomes[index] = len(kept_offsets) - 1
                selection[starts[row]:starts[row] + keep[row]] = True
                kept_offsets.append(kept_offsets[-1] + int(keep[row]))
        if not selection.all():
            input_ids, loss_mask = input_ids[selection], loss_mask[selection]
        return EncodedBatch(input_ids, loss_mask, np.array(kept_offsets, dtype=np.int64), outcomes)

    def _encode(self, texts: list[str], is_text: list[bool]) -> list[Any]:
        if not texts:
            return []
        if all(is_text):
            return self.backend.encode_batch(texts, add_special_tokens=True)
        if not any(is_text):  # rendered chats carry their own special tokens, as in apply_chat_template
            return self.backend.encode_batch(texts, add_special_tokens=False)
        return [self.backend.encode(t, add_special_tokens=flag) for t, flag in zip(texts, is_text, strict=True)]
