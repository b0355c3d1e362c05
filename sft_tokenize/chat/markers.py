"""Position markers: message fields wrapped in characters that real text never holds.

Rendering a conversation with its fields wrapped shows where the template put each of them (`turns.py`).
A field can be wrapped as marked text (a str) or as a `Twin` that also carries the plain text (`pairs.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sft_tokenize.sources.conversations import REASONING_FIELDS

# Markers are characters of Unicode's plane-15 private use area: field k opens with MARK_BASE + 2k and closes
# with MARK_BASE + 2k + 1 (above U+F0000-F0001, which transformers' sanitize_control_tokens uses). Real text
# never holds them; a row that does takes the exact path.
MARK_BASE = 0xF1000
MARK_LIMIT = 0xFFFFE
MARKS = re.compile("[\U000f1000-\U000ffffd]")
MARK_SPLIT = re.compile(f"({MARKS.pattern})")  # split() keeps each marker between the text around it
NO_REASONING_KEYS = frozenset({"role", "content", "tool_calls", "name", "tool_call_id"})  # keys of most messages


def holds_marks(text: str) -> bool:
    """Whether the text holds a character of the markers' range (ASCII text, the usual case, is not scanned:
    isascii() is O(1) in CPython)."""
    return not text.isascii() and MARKS.search(text) is not None


@dataclass
class Marked:
    """A conversation's messages with chosen fields wrapped in markers, and which message owns each field."""

    messages: list[dict[str, Any]]
    owners: list[int] = field(default_factory=list)  # field id -> message index
    kinds: list[str] = field(default_factory=list)  # field id -> kind
    marker_text: bool = False  # a marked field's own text holds characters of the markers' range


def _wrap(text: str, core: str, fid: int) -> str:
    """Markers inside the text's surrounding whitespace (`core` is the text stripped), so that templates that
    trim it trim the same."""
    opening, closing = chr(MARK_BASE + 2 * fid), chr(MARK_BASE + 2 * fid + 1)
    if len(core) == len(text):
        return f"{opening}{text}{closing}"
    if not core:
        return f"{text}{opening}{closing}"
    head = text[: len(text) - len(text.lstrip())]
    tail = text[len(text.rstrip()):]
    return f"{head}{opening}{core}{closing}{tail}"


def with_fields(message: dict[str, Any], visit: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of the message with each of its fields replaced by `visit(value, kind)`, visited in the order fields
    are numbered: content, reasoning (one field, under each of its names the message has), then each tool call's
    id, name and arguments. The one walk of a message's fields: `mark` wraps them, `skeleton.shape_of` keys them."""
    out = dict(message)
    if "content" in message:
        out["content"] = visit(message["content"], "content")
    if message.get("role") == "assistant" and not NO_REASONING_KEYS.issuperset(message):
        reasoning = next((message[key] for key in REASONING_FIELDS if isinstance(message.get(key), str)), None)
        if reasoning is not None:
            visited = visit(reasoning, "reasoning")
            for key in REASONING_FIELDS:
                if key in message:
                    out[key] = visited
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            call = dict(call)
            if "id" in call:
                call["id"] = visit(call["id"], "tool_id")
            function = dict(call.get("function") or {})
            function["name"] = visit(function.get("name"), "tool_name")
            function["arguments"] = visit(function.get("arguments"), "tool_arguments")
            call["function"] = function
            calls.append(call)
        out["tool_calls"] = calls
    return out


def mark(messages: Sequence[dict[str, Any]], kinds: frozenset[str], empty: bool = False,
         twin: Callable[[str, str, int], Any] | None = None) -> Marked | None:
    """Wrap every field of `kinds` in markers (None if the conversation has more fields than markers): each
    becomes its marked text, or `twin(marked, plain, field id)` (see `pairs.Twin`).

    Blank text is marked only with `empty`: templates often branch on whether a field is empty, which marking
    would change, so it is asked for only where a turn would have nothing else to locate it by."""
    out = Marked([])
    owners, field_kinds = out.owners, out.kinds

    def wrap(text: Any, index: int, kind: str) -> Any:
        if type(text) is not str or kind not in kinds:
            return text
        core = text.strip()
        if not (core or empty):
            return text
        fid = len(owners)
        owners.append(index)
        field_kinds.append(kind)
        if holds_marks(text):
            out.marker_text = True
        return twin(_wrap(text, core, fid), text, fid) if twin else _wrap(text, core, fid)

    for index, message in enumerate(messages):
        out.messages.append(with_fields(message, lambda value, kind, index=index: wrap(value, index, kind)))
    return out if MARK_BASE + 2 * len(out.owners) <= MARK_LIMIT else None
