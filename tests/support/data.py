"""Rows the tests write and read: the bundled example's conversations, JSONL files of any rows, and a few
conversations that exercise what templates differ on (system turns, reasoning, tool calls, content parts)."""

from __future__ import annotations

import json
from pathlib import Path

from sft_tokenize.sources.conversations import ColumnMap
from support.paths import EXAMPLE_DATA


def write_jsonl(path: Path, rows) -> Path:
    """One JSON object a line (a string row is written as it is, to write broken lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


def example_rows() -> list[dict]:
    """The bundled example's rows, file by file in name order."""
    rows = []
    for path in sorted(EXAMPLE_DATA.glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return rows


# -- conversations in the plain message format -------------------------------------------------------------

def msg(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [msg("user", "What is two plus two?"), msg("assistant", "Four.")],
    [msg("system", "You are terse."), msg("user", "Name a color."), msg("assistant", "Blue."),
     msg("user", "Another one?"), msg("assistant", "Red, or perhaps green.")],
    [msg("user", "Say nothing."), msg("assistant", "")],
    [msg("user", "日本語で答えて 🚀"), msg("assistant", "はい、もちろんです。Ωmega café naïve"),
     msg("user", "Дата?"), msg("assistant", "中文字符 and emoji 🚀🚀")],
    [msg("user", "First."), msg("assistant", "One."), msg("user", "Second."), msg("assistant", "Two."),
     msg("user", "Third."), msg("assistant", "Three, and a much longer answer that runs on for a while.")],
    # Content with surrounding whitespace: templates that trim it take the exact path.
    [msg("user", "  padded question  "), msg("assistant", " leading space and trailing newline\n")],
    # Ends with a user turn: nothing after the last user message to train in completion mode.
    [msg("user", "Hello"), msg("assistant", "Hi there."), msg("user", "Bye")],
]


# -- conversations with what current templates read: reasoning, tools, content parts -------------------------

COLUMNS = ColumnMap("chat", {"messages": "messages", "tools": "tools"})
TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def call(arguments, call_id="abc123xyz"):
    return {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}


def tool_chat(arguments, city, hour):
    return {"tools": [TOOL], "messages": [
        {"role": "user", "content": f"Time in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call(arguments)]},
        {"role": "tool", "tool_call_id": "abc123xyz", "name": "get_time", "content": hour},
        {"role": "assistant", "content": f"It is {hour} in {city}."}]}


ROWS = {
    "system_three_turns": {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a fruit"},
        {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another"},
        {"role": "assistant", "content": "Pear."}]},
    "reasoning_field": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add two and two.", "content": "Four."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "reasoning_content": "Add three and three.", "content": "Six."}]},
    "reasoning_inline": {"messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd two.\n</think>\n\nFour."},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nAdd three.\n</think>\n\nSix."}]},
    "tools_object": tool_chat({"city": "Oslo"}, "Oslo", "10:00"),
    "tools_string": tool_chat('{"city": "Oslo"}', "Oslo", "10:00"),
    "content_parts": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "yes"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]}]},
}
