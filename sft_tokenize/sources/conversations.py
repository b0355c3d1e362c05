"""Dataset formats: which columns a row needs and how a row becomes a conversation (or plain text).

chat               messages: [{role, content}, ...], optional `system` and `tools` columns; either may be
                   the JSON text of its list (a CSV cell, a string column of Parquet)
alpaca             instruction, optional input, output, and LLaMA-Factory's optional system and history
                   ([[instruction, output], ...]: the earlier turns)
prompt-completion  prompt + completion (or response); each a string or a list of messages
text               text
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.sources.images import IMAGE_PART_TYPES, ImageRef, normalize_images

ROLES = ("system", "user", "assistant", "tool")
# Roles read as they are and given to the template, which maps them to one of ROLES where it has no such role
# of its own (ChatTemplate.prepare): OpenAI's `developer` (its name for system) and legacy `function` (a
# function's result), Llama's `ipython` (a tool's result).
OTHER_ROLES = ("developer", "function", "ipython")
# Names a message's reasoning comes under; chat templates read one or another.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# ShareGPT-style data (`conversations` of {from, value}) uses other names for the same roles.
# Its `function_call` turns are assistant tool calls whose value is the JSON of {name, arguments} (or a list of
# them), as LLaMA-Factory defines the format: read as tool_calls.
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "function_call": "assistant",
                "observation": "tool"}
# What a message's `weight` may be (OpenAI's fine-tuning format): 0, not trained; 1, trained.
WEIGHTS = {0: False, 1: True}

# Column roles and the names tried, in order, when the user did not name the column.
DEFAULT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages", "conversations", "conversation"),
    "system": ("system",),
    "tools": ("tools",),
    "instruction": ("instruction",),
    "input": ("input",),
    "output": ("output",),
    "history": ("history",),
    "prompt": ("prompt",),
    "completion": ("completion", "response"),
    "text": ("text",),
    "images": ("images",),  # the images of `<image>` placeholders and payload-less image parts (image rows)
}
REQUIRED = {
    "chat": ("messages",),
    "alpaca": ("instruction", "output"),
    "prompt-completion": ("prompt", "completion"),
    "text": ("text",),
}
OPTIONAL = {"chat": ("system", "tools", "images"), "alpaca": ("input", "system", "history"),
            "prompt-completion": ("system", "tools", "images"), "text": ()}


@dataclass(frozen=True)
class ColumnMap:
    """The resolved format and the actual column name of each role it uses."""

    format: str
    columns: dict[str, str]

    @property
    def names(self) -> list[str]:
        return sorted(set(self.columns.values()))


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    # Index of the first message of the completion (prompt-completion data); None for chat rows.
    completion_start: int | None = None
    # Image rows: each image's grid, in the order the conversation shows them (its messages hold payload-less
    # {"type": "image"} parts, which the template renders as the vision family's marker).
    image_grids: tuple[tuple[int, ...], ...] = ()
    # Image rows as read, before their images are loaded: where each image's bytes are, in that order.
    image_refs: tuple[ImageRef, ...] = ()
    # Per message, whether its author asked for it to be trained (a `weight` of 1: True, of 0: False) or left
    # it to --train-on (None); empty when no message says. It overrides --train-on for that message.
    trained: tuple[bool | None, ...] = ()


def resolve_columns(fmt: str, user_columns: Mapping[str, str], available: Iterable[str], where: str,
                    schemaless: bool = False) -> ColumnMap:
    """Pick the format (for `auto`) and the column of every role, or say clearly why not.

    `available` are the columns of a file with a schema, or of the first row of one without (JSON lines):
    there an optional column (system, tools) is read on every row that has it, whatever the first row holds."""
    available = list(available)
    unknown = set(user_columns) - set(DEFAULT_COLUMNS)
    if unknown:
        raise BadInput(f"unknown column role(s) {sorted(unknown)}; known: {sorted(DEFAULT_COLUMNS)}")

    def column_for(role: str) -> str | None:
        if role in user_columns:
            return user_columns[role] if user_columns[role] in available else None
        return next((name for name in DEFAULT_COLUMNS[role] if name in available), None)

    if fmt == "auto":
        fmt = next((f for f, roles in REQUIRED.items() if all(column_for(r) for r in roles)), None)
        if fmt is None:
            raise BadInput(
                f"{where}: cannot tell the format from the columns {available}: expected `messages` (chat), "
                "`instruction`+`output` (alpaca), `prompt`+`completion` (prompt-completion) or `text`; "
                "pass --format and name the columns (e.g. --messages-column)"
            )
    missing = [role for role in REQUIRED[fmt] if not column_for(role)]
    if missing:
        wanted = ", ".join(repr(user_columns.get(r, DEFAULT_COLUMNS[r][0])) for r in missing)
        raise BadInput(f"{where}: missing column {wanted} for format {fmt} (columns: {', '.join(available)})")
    columns = {role: column_for(role) for role in REQUIRED[fmt]}
    for role in OPTIONAL[fmt]:
        name = column_for(role) or (user_columns.get(role, DEFAULT_COLUMNS[role][0]) if schemaless else None)
        if name:
            columns[role] = name
    return ColumnMap(fmt, columns)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _text(value: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """Message text: a string, or OpenAI-style parts whose text parts are joined with newlines. With `images`
    (a run with a processor), parts that hold an image stay parts: text and image parts, in order."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if images and kind in IMAGE_PART_TYPES:
                return [_part(p, f"{where}[{j}]") for j, p in enumerate(value)]
            if kind != "text" or not isinstance(part.get("text"), str):
                got = f"a part of type {kind!r}" if kind else _type_name(part)
                hint = "; image rows are tokenized with --processor" if kind in IMAGE_PART_TYPES else ""
                raise BadRow("bad_message", f"{where}[{k}] is {got}: only text parts "
                                            f"({{'type': 'text', 'text': ...}}) are tokenized{hint}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRow("bad_message", f"{where} must be a string or a list of text parts, got {_type_name(value)}")


def _part(part: Any, where: str) -> dict[str, Any]:
    """A part of an image row's message: an image part as it is (images.normalize_images reads it), or text."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in IMAGE_PART_TYPES:
        return dict(part)
    if kind != "text" or not isinstance(part.get("text"), str):
        got = f"a part of type {kind!r}" if kind else _type_name(part)
        raise BadRow("bad_message", f"{where} is {got}: only text and image parts are tokenized")
    return {"type": "text", "text": part["text"]}


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI-style tool calls: [{id?, type: function, function: {name, arguments}}]; a flat {name, arguments}
    is accepted too. Arguments stay an object or a JSON string: the chat template decides which it needs."""
    if not isinstance(raw, list):
        raise BadRow("bad_tool_call", f"{where} must be a list, got {_type_name(raw)}")
    calls = []
    for k, call in enumerate(raw):
        if not isinstance(call, Mapping):
            raise BadRow("bad_tool_call", f"{where}[{k}] must be an object, got {_type_name(call)}")
        function = call.get("function", call if "name" in call else None)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise BadRow("bad_tool_call", f"{where}[{k}] needs function.name as a string")
        arguments = function.get("arguments", {})
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, Mapping | str):
            raise BadRow("bad_tool_call", f"{where}[{k}].function.arguments must be an object or a JSON string, "
                                          f"got {_type_name(arguments)}")
        out = {key: value for key, value in call.items() if value is not None and key not in ("name", "arguments")}
        out["type"] = call.get("type") or "function"
        out["function"] = {**{key: value for key, value in function.items() if value is not None},
                           "arguments": dict(arguments) if isinstance(arguments, Mapping) else arguments}
        calls.append(out)
    return calls


def _function_call(value: Any, where: str) -> list[dict[str, Any]]:
    """A ShareGPT `function_call` turn's value (or a legacy OpenAI message's `function_call`): one call
    {name, arguments} or a list of them, as an object or its JSON text; as tool_calls."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise BadRow("bad_tool_call", f"{where} is not the JSON of a function call ({error})") from None
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(call, Mapping) and "name" in call for call in calls):
        raise BadRow("bad_tool_call", f"{where} must be a function call {{\"name\": ..., \"arguments\": ...}} "
                                      f"or a list of them, got {_type_name(value)}")
    return _tool_calls(calls, where)


def _message(raw: Any, index: int, images: bool = False) -> dict[str, Any]:
    if type(raw) is dict and len(raw) == 2 and raw.get("role") in ROLES and type(raw.get("content")) is str:
        return dict(raw)  # {role, content}, as most messages are: already what the checks below would return
    if not isinstance(raw, Mapping):
        raise BadRow("bad_message", f"messages[{index}] must be an object, got {_type_name(raw)}")
    message = dict(raw)
    text_field = "content"
    if "role" not in message and "from" in message:  # ShareGPT
        message["role"] = message.pop("from")
        if "value" in message:
            message["content"] = message.pop("value")
            text_field = "value"
    role = message.get("role")
    if role is None:
        raise BadRow("bad_message", f"messages[{index}] has no 'role'")
    if not isinstance(role, str):
        raise BadRow("bad_message", f"messages[{index}].role must be a string, got {_type_name(role)}")
    if role == "function_call":  # ShareGPT's tool-call turn: its value is the call, not text to train
        message["tool_calls"] = _function_call(message.pop("content", None), f"messages[{index}].{text_field}")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES and role not in OTHER_ROLES:
        raise BadRow("unknown_role", f"messages[{index}] has unknown role {role!r} "
                                     f"(known: {', '.join(ROLES + OTHER_ROLES)})")
    # A key whose value is null is not passed on (Arrow and Parquet rows carry every column of the schema).
    # `weight` is read by _weight: it says whether to train the message, which is not the template's to see.
    message = {key: value for key, value in message.items() if value is not None and key != "weight"}
    message["role"] = role
    if "function_call" in message:  # OpenAI's legacy form of one tool call
        if message.get("tool_calls"):
            raise BadRow("bad_tool_call", f"messages[{index}] has both tool_calls and the legacy function_call")
        message["tool_calls"] = _function_call(message.pop("function_call"), f"messages[{index}].function_call")
    if message.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(message["tool_calls"], f"messages[{index}].tool_calls")
    if "content" in message:
        message["content"] = _text(message["content"], f"messages[{index}].content", images)
    elif message.get("tool_calls"):
        message["content"] = None  # a tool-call turn without text; the chat template's probe decides its form
    else:
        has = ", ".join(repr(key) for key in message if key != "role") or "nothing but its role"
        raise BadRow("bad_message", f"messages[{index}] has no 'content' (and no tool_calls or function_call), which "
                                    f"{'an' if role[0] in 'aeiou' else 'a'} {role} message needs: it has only {has}")
    for key in REASONING_FIELDS:
        if key in message and not isinstance(message[key], str):
            raise BadRow("bad_message", f"messages[{index}].{key} must be a string, got {_type_name(message[key])}")
    return message


def _weight(raw: Any, message: dict[str, Any], index: int) -> bool | None:
    """A message's `weight` as whether to train it (None: as --train-on says). Only an assistant message is
    trained: a weight of 0 elsewhere says what is true anyway, and a weight of 1 there cannot be honoured."""
    weight = raw.get("weight") if isinstance(raw, Mapping) else None
    if weight is None:
        return None
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight not in WEIGHTS:
        raise BadRow("bad_weight", f"messages[{index}].weight must be 0 (not trained) or 1 (trained), got {weight!r}")
    if message["role"] != "assistant":
        if weight:
            raise BadRow("bad_weight", f"messages[{index}].weight is 1 on a {message['role']} message: only "
                                       "assistant messages are trained")
        return None
    return WEIGHTS[weight]


def _from_json_text(raw: Any, column: str, reason: str, what: str) -> Any:
    """A CSV cell or a string column holding a list as its JSON text (what its writer meant): the list."""
    if not isinstance(raw, str):
        return raw
    try:
        value = json.loads(raw)
    except ValueError as error:
        raise BadRow(reason, f"{column!r} is a string that is not the JSON of {what} ({error})") from None
    if not isinstance(value, list):
        raise BadRow(reason, f"{column!r} holds JSON text of {_type_name(value)}, not {what}")
    return value


def _messages(raw: Any, column: str, images: bool = False) -> tuple[list[dict[str, Any]], list[bool | None]]:
    """The messages, and whether each is to be trained by its own `weight` (None: as --train-on says)."""
    raw = _from_json_text(raw, column, "bad_messages", "a message list")
    if not isinstance(raw, list):
        raise BadRow("bad_messages", f"{column!r} must be a list of messages, got {_type_name(raw)}")
    if not raw:
        raise BadRow("bad_messages", f"{column!r} is an empty list")
    if (plain := _plain_messages(raw)) is not None:
        return plain, [None] * len(plain)
    messages = [_message(m, i, images) for i, m in enumerate(raw)]
    return messages, [_weight(m, message, i) for i, (m, message) in enumerate(zip(raw, messages, strict=True))]


def _plain_messages(raw: list) -> list[dict[str, Any]] | None:
    """Copies of the messages if every one is {role, content} with a known role and a string, as most are (what
    _message returns of each, and none has a weight); None otherwise."""
    messages = []
    for m in raw:
        if type(m) is not dict or len(m) != 2 or type(m.get("content")) is not str or m.get("role") not in ROLES:
            return None
        messages.append(m.copy())
    return messages


def _trained(*flags: list[bool | None]) -> tuple[bool | None, ...]:
    """Conversation.trained of messages in these groups: empty where no message has a weight."""
    if all(group.count(None) == len(group) for group in flags):  # none has a weight, as in most rows
        return ()
    return tuple(flag for group in flags for flag in group)


def _history(raw: Any, column: str) -> list[dict[str, Any]]:
    """LLaMA-Factory's alpaca `history`: [[instruction, output], ...], the turns before the row's own."""
    raw = _from_json_text(raw, column, "bad_field", "a list of [instruction, output] pairs")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRow("bad_field", f"{column!r} must be a list of [instruction, output] pairs, got {_type_name(raw)}")
    turns = []
    for k, pair in enumerate(raw):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            got = f"{len(pair)} items" if isinstance(pair, list | tuple) else _type_name(pair)
            raise BadRow("bad_field", f"{column}[{k}] must be [instruction, output], two strings, got {got}")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns


def _string(row: Mapping[str, Any], column: str, optional: bool = False) -> str:
    value = row.get(column)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise BadRow("bad_field", f"{column!r} must be a string, got {_type_name(value)}")
    return value


def _turns(value: Any, role: str, column: str, images: bool = False) -> tuple[list[dict[str, Any]], list[bool | None]]:
    """A prompt or completion: a string (one message of `role`) or a list of messages; as _messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}], [None]
    return _messages(value, column, images)


def _with_images(conv: Conversation, row: Mapping[str, Any], columns: dict[str, str], base: str | None,
                 access: str | None) -> Conversation:
    """An image row: its image parts payload-less (the template renders each as its marker) and their
    ImageRefs in order; a row without images is returned as it is."""
    images = row.get(columns["images"]) if "images" in columns else None
    if images is not None and not isinstance(images, list):
        raise BadRow("image_count", f"{columns['images']!r} must be a list of images, got {_type_name(images)}")
    messages, refs = normalize_images(conv.messages, images, base=base, access=access)
    if not refs:
        return conv
    bare = [message if not isinstance(message.get("content"), list) else
            {**message, "content": [{"type": "image"} if part.get("type") == "image" else part
                                    for part in message["content"]]}
            for message in messages]
    return replace(conv, messages=bare, image_refs=tuple(refs))


def to_example(row: Mapping[str, Any], columns: ColumnMap, system_prompt: str | None = None, *,
               images: bool = False, image_base: str | None = None,
               image_access: str | None = None) -> Conversation | str:
    """One source row as a Conversation (or a str for text data); raises BadRow saying what is wrong.

    `system_prompt`, if given, is the system message of a conversation that has none of its own (neither a
    system column's value nor a leading system message). With `images` (a run with a processor), a row's image
    parts (and `<image>` placeholders with an images column) are read, relative paths against `image_base`, and
    their locations checked against the image access policy `image_access` (files.IMAGE_ACCESS)."""
    c = columns.columns
    if columns.format == "text":
        return _string(row, c["text"])
    system = (_string(row, c["system"], optional=True) if "system" in c else "") or system_prompt
    head = [{"role": "system", "content": system}] if system else []
    if columns.format == "alpaca":
        instruction = _string(row, c["instruction"])
        extra = _string(row, c["input"], optional=True) if "input" in c else ""
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        history = _history(row.get(c["history"]), c["history"]) if "history" in c else []
        messages = [*head, *history, {"role": "user", "content": prompt},
                    {"role": "assistant", "content": _string(row, c["output"])}]
        return Conversation(messages, completion_start=len(messages) - 1)

    tools = _from_json_text(row.get(c["tools"]), c["tools"], "bad_field", "a list of tools") if "tools" in c else None
    if tools is not None and not isinstance(tools, list):
        raise BadRow("bad_field", f"{c['tools']!r} must be a list, got {_type_name(tools)}")
    if columns.format == "chat":
        messages, weights = _messages(row.get(c["messages"]), c["messages"], images)
        if head and messages[0]["role"] in ("system", "developer"):
            head = []  # the conversation's own system message wins
        conv = Conversation(head + messages, tools or None, trained=_trained([None] * len(head), weights))
    else:
        prompt, prompt_weights = _turns(row.get(c["prompt"]), "user", c["prompt"], images)
        completion, completion_weights = _turns(row.get(c["completion"]), "assistant", c["completion"], images)
        conv = Conversation(head + prompt + completion, tools or None, completion_start=len(head) + len(prompt),
                            trained=_trained([None] * len(head), prompt_weights, completion_weights))
    return _with_images(conv, row, c, image_base, image_access) if images else conv
