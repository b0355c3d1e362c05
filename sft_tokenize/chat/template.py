"""A chat template as the encoder uses it: rendered exactly as `apply_chat_template` renders it, and probed
once for the few facts that locating trained turns needs.

Probing renders small made-up conversations (never user data) and learns, with no per-family code:
- the generation prompt (what `add_generation_prompt=True` appends) and the text a prompt ends with after
  each role, which mark where a trained turn starts;
- the tokens that end an assistant turn (the special tokens a final assistant turn is followed by);
- which message fields can carry position markers without changing the render (see `turns.py`);
- whether tool-call arguments must be a mapping or a JSON string, and whether reasoning fields render;
- which of the roles `developer`, `function` and `ipython` it has as roles of its own (see `prepare`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from sft_tokenize.chat import hf_jinja, pairs
from sft_tokenize.chat.environment import compile_template
from sft_tokenize.chat.markers import MARK_BASE, MARKS, Marked, holds_marks, mark
from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.sources.conversations import OTHER_ROLES, REASONING_FIELDS, ROLES, Conversation

logger = logging.getLogger("sft_tokenize")

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# What marking can wrap. Each kind is used only where probing showed the template renders it unchanged.
FIELD_KINDS = ("content", "reasoning", "tool_name", "tool_arguments", "tool_id")
PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PROBE_CALL_ID = "call12345"  # nine alphanumerics, as Mistral's templates require
# What a role of OTHER_ROLES is given as where the template has no such role of its own.
ROLE_STANDS_FOR = {"developer": "system", "function": "tool", "ipython": "tool"}


def _probe_call(arguments: Any) -> dict:
    return {"id": PROBE_CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _owner(marked: Marked, character: str) -> int | None:
    """The message whose field a marker character belongs to (None for a character no field was given)."""
    fid = (ord(character) - MARK_BASE) // 2
    return marked.owners[fid] if fid < len(marked.owners) else None


def special_pattern(tokenizer) -> re.Pattern | None:
    """A regex for the tokenizer's special (control) tokens, longest first."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def token_boundaries(backend, text: str) -> list[int]:
    """Character positions in `text` where one of its tokens ends (ascending, ending at len(text))."""
    if not text:
        return []
    encoding = backend.encode(text, add_special_tokens=False)
    return sorted({end for _, end in encoding.offsets if end > 0} | {len(text)})


class ChatTemplate:
    """One chat template with its render arguments, compiled once; see the module docstring."""

    def __init__(self, source: str, tokenizer, template_kwargs: Mapping[str, Any] | None = None):
        self.source = source
        self.kwargs = {**tokenizer.special_tokens_map, **(template_kwargs or {})}
        environment = hf_jinja.new_environment()
        try:
            self.compiled = compile_template(environment, source)
            # A template that writes characters of the markers' range would diverge on every row: skip Twins.
            self.compiled_for_twins = None if holds_marks(source) else compile_template(environment, source, True)
        except Exception as error:  # jinja2.TemplateSyntaxError and friends
            line = getattr(error, "lineno", None)
            raise BadInput(f"the chat template does not compile{f' (line {line})' if line else ''}: "
                           f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
        self.tokenizer = tokenizer
        # Token boundaries of the template's own text, by text: what it learned with HF's tokenizer, handed to the
        # encode pool's processes (prepared.TokenizerParts) so that they need not build that tokenizer.
        self.learned_boundaries: dict[str, list[int]] = {}
        self.special = special_pattern(tokenizer)
        self.eos_token: str | None = tokenizer.eos_token
        self.has_generation_blocks = bool(GENERATION_BLOCK.search(source))
        self._learn()

    # -- rendering -------------------------------------------------------------------------------------------

    def render(self, messages: Sequence[dict], tools: list | None = None, add_generation_prompt: bool = False) -> str:
        """`apply_chat_template(..., tokenize=False)`. Messages are plain data (from JSON or Arrow), with
        reasoning aliased as transformers aliases it, so the compiled template is called directly."""
        return self.compiled.render(messages=messages, tools=tools, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.kwargs)

    def render_marked(self, marked: Marked, tools: list | None = None, trace: list | None = None) -> str | None:
        """The marked text, in one render of messages whose marked fields are Twins (the text is the marked
        text without its markers), or None where the two could differ (the caller then renders twice): the
        template reads a field in a way Twins do not follow, or text the render meets (the template's, a
        field's, any variable's) holds characters of the markers' range. `trace`: see `pairs.render_twins`."""
        if self.compiled_for_twins is None or marked.marker_text:
            return None
        return pairs.render_twins(self.compiled_for_twins, dict(
            messages=marked.messages, tools=tools, documents=None, add_generation_prompt=False, **self.kwargs),
            trace)

    def render_generation(self, messages: Sequence[dict], tools: list | None = None) -> tuple[str, list]:
        """The text and the character spans of its `{% generation %}` blocks, as transformers records them."""
        return hf_jinja.render_with_generation_spans(self.compiled, messages, tools, **self.kwargs)

    def _try(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False) -> str | None:
        try:
            return self.render(messages, tools, add_generation_prompt)
        except Exception:
            return None

    # -- probing ---------------------------------------------------------------------------------------------

    def _learn(self) -> None:
        user = {"role": "user", "content": "What is the weather in Paris?"}
        reply = {"role": "assistant", "content": "It is sunny."}
        self.null_content, self.arguments_as = self._learn_tool_shape(user)
        call = _probe_call({"city": "Paris"} if self.arguments_as == "mapping" else '{"city": "Paris"}')
        calling = {"role": "assistant", "content": self.null_content, "tool_calls": [call]}
        result = {"role": "tool", "content": "Sunny, 22 C.", "tool_call_id": PROBE_CALL_ID, "name": "get_weather"}
        thinking = {"role": "assistant", "content": "It is sunny.",
                    **dict.fromkeys(REASONING_FIELDS, "The user wants the weather.")}
        probes = {
            "chat": ([user, reply], None),
            "tools": ([user, calling, result, reply], [PROBE_TOOL]),
            "call_last": ([user, calling], [PROBE_TOOL]),
            "reasoning": ([user, thinking], None),
        }
        rendered = {name: self._try(messages, tools) for name, (messages, tools) in probes.items()}
        self.renders_reasoning = bool(rendered["reasoning"]) and "The user wants the weather." in rendered["reasoning"]

        self.renders_tool = bool(rendered["tools"]) and "Sunny, 22 C." in rendered["tools"]
        self.own_roles = frozenset(role for role in OTHER_ROLES if self._has_own_role(role, user, reply, calling))
        self.markable = frozenset(kind for kind in FIELD_KINDS if self._marks_cleanly(probes, rendered, kind))
        # The generation prompt: what add_generation_prompt appends to a conversation ending in a user turn.
        plain = self._try([user]) or ""
        prompt = self._try([user], add_generation_prompt=True) or ""
        self.generation_prompt = prompt[len(plain):] if prompt.startswith(plain) else ""
        self.generation_prompt_ends = self.boundaries(self.generation_prompt)
        self.history_header = self._history_header(user, reply)
        # Without a generation prompt (Phi-4, Mistral), a turn starts where the prompt after its previous
        # message ends: learned per role of that message.
        self.prompt_tails = {"user": self._prompt_tail([user], 0)}
        self.prompt_tails["tool"] = self._prompt_tail([user, calling, result], 2, [PROBE_TOOL])
        # End-of-turn tokens: the special tokens a final assistant turn is followed by, and EOS.
        ends = {self.eos_token} if self.eos_token else set()
        for name in ("chat", "call_last", "reasoning"):
            ends |= self._trailing_specials(*probes[name])
        self.end_of_turn = tuple(sorted(ends, key=len, reverse=True))
        self.end_of_turn_pattern = re.compile("|".join(map(re.escape, self.end_of_turn))) if ends else None

    def _history_header(self, user: dict, reply: dict) -> str | None:
        """What an assistant turn in history is headed with: the text between the user turn before it and its
        content, with a user turn after it (None where the render does not show it plainly)."""
        plain = self._try([user])
        text = self._try([user, reply, {"role": "user", "content": "And tomorrow?"}])
        if not plain or not text or not text.startswith(plain):
            return None
        at = text.find(reply["content"], len(plain))
        return text[len(plain):at] if at >= 0 else None

    def header_difference(self, name: str) -> str | None:
        """One line saying what an assistant turn in history is headed with beyond the generation prompt (a
        role separator the prompt leaves out), which is trained as the start of every assistant turn; None when
        the generation prompt heads it as a turn in history is headed. `name`: the tokenizer it is used with."""
        header, prompt = self.history_header, self.generation_prompt
        if not prompt or header is None:
            return None
        extra = header[len(os.path.commonprefix([prompt, header])):]
        if not extra:
            return None
        return (f"the chat template used with {name} starts an assistant turn in history with {header!r}, its "
                f"generation prompt with {prompt!r}: {extra!r} is trained at the start of every assistant turn, as "
                "the model's own output; if the model should not learn to write it, pass --chat-template a template "
                "whose generation prompt ends as its turns in history start")

    def warn_header_difference(self, name: str) -> None:
        """Log `header_difference` as a warning, if there is one (a run's encoder says it once)."""
        if difference := self.header_difference(name):
            logger.warning("%s", difference)

    def _learn_tool_shape(self, user: dict) -> tuple[Any, str | None]:
        """(content of a tool-call turn without text, form of its arguments) that renders the call as JSON:
        content None where the template takes it (as apply_chat_template passes JSON null), else an empty
        string; arguments as a mapping where the template renders one, else as a JSON string."""
        question = user["content"]
        for content in (None, ""):
            for style, arguments in (("mapping", {"zq_key": "zq_value"}), ("string", '{"zq_key": "zq_value"}')):
                calling = {"role": "assistant", "content": content, "tool_calls": [_probe_call(arguments)]}
                result = {"role": "tool", "content": "zq_result", "tool_call_id": PROBE_CALL_ID, "name": "get_weather"}
                text = self._try([user, calling, result, {"role": "assistant", "content": "Done."}], [PROBE_TOOL])
                after = (text or "").partition(question)[2]
                if ("zq_value" in after and "get_weather" in after and "None" not in after
                        and "'zq_key'" not in after and '\\"zq_key\\"' not in after):
                    return content, style
        return "", None

    def _has_own_role(self, role: str, user: dict, reply: dict, calling: dict) -> bool:
        """True if the template renders a `role` message's content, and otherwise than it renders a role it
        cannot know (a template that writes any role's name as a header has no `developer` of its own)."""
        def text_as(name: str) -> str | None:
            message = {"role": name, "content": "Qx9 probe text."}
            if ROLE_STANDS_FOR[role] == "system":
                return self._try([message, user, reply])
            message |= {"tool_call_id": PROBE_CALL_ID, "name": "get_weather"}
            return self._try([user, calling, message, reply], [PROBE_TOOL])

        text, unknown = text_as(role), text_as("zqrole")
        return (text is not None and "Qx9 probe text." in text
                and (unknown is None or text != unknown.replace("zqrole", role)))

    def _marks_cleanly(self, probes: dict, rendered: dict, kind: str) -> bool:
        """True if wrapping `kind` fields in markers renders the same text plus markers, and shows them."""
        seen = False
        for name, (messages, tools) in probes.items():
            if rendered[name] is None:
                continue
            marked = mark(messages, frozenset([kind]))
            text = self._try(marked.messages, tools)
            if text is None or MARKS.sub("", text) != rendered[name]:
                return False
            seen = seen or bool(MARKS.search(text))
        return seen

    def _prompt_tail(self, messages: list[dict], last: int, tools: list | None = None) -> str:
        """The text a generation prompt ends with after message `last`: from its last marker to the end."""
        marked = mark(messages, frozenset(["content"]))
        text = self._try(marked.messages, tools, add_generation_prompt=True) if marked else None
        if not text:
            return ""
        ends = [m.end() for m in MARKS.finditer(text) if _owner(marked, m.group()) == last]
        return MARKS.sub("", text[ends[-1]:]) if ends else ""

    def _trailing_specials(self, messages: list[dict], tools: list | None) -> set[str]:
        """The last special token after a final assistant turn's last marker (what ends that turn)."""
        if self.special is None:
            return set()
        marked = mark(messages, self.markable)
        text = self._try(marked.messages, tools) if marked else None
        found = list(MARKS.finditer(text or ""))
        if not found or _owner(marked, found[-1].group()) != len(messages) - 1:
            return set()
        specials = self.special.findall(text, found[-1].end())
        return set(specials[-1:])

    # -- rows ------------------------------------------------------------------------------------------------

    def prepare(self, conversation: Conversation) -> Conversation:
        """The conversation in the shapes this template reads: reasoning under each of its names (as
        apply_chat_template passes it), tool-call arguments as the template renders them, and an inline
        `<think>…</think>` moved to the reasoning field when the template renders one, and a `developer`,
        `function` or `ipython` message given as a system message or a tool reply where the template has no such
        role of its own (probed, not told by the template's name: gpt-oss has a developer role)."""
        reasoning = self.renders_reasoning
        if all([len(m) == 2 and type(content := m.get("content")) is str and m.get("role") in ROLES
                and (not reasoning or m["role"] != "assistant" or "</think>" not in content)
                for m in conversation.messages]):
            return conversation  # roles and their texts, as the template reads them already
        messages = []
        for index, message in enumerate(conversation.messages):
            if message.get("role") in ROLE_STANDS_FOR and message["role"] not in self.own_roles:
                message = {**message, "role": self._role_for(message["role"], index)}
            if len(message) == 2 and type(content := message.get("content")) is str and "role" in message and (
                    message["role"] != "assistant" or not self.renders_reasoning or "</think>" not in content):
                messages.append(message)  # a role and its text, as the template reads them already
                continue
            reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {**message, **dict.fromkeys(REASONING_FIELDS, reasoning)}
            if message.get("role") == "assistant":
                message = self._prepare_assistant(message, index)
            messages.append(message)
        return replace(conversation, messages=messages)

    def _role_for(self, role: str, index: int) -> str:
        """The role a message of `role` is given as, where the template has no such role of its own."""
        stands_for = ROLE_STANDS_FOR[role]
        if stands_for == "tool" and not self.renders_tool:
            raise BadRow("role_not_rendered", f"messages[{index}] has role {role!r}, which this chat template renders "
                                              "neither as a role of its own nor as a tool reply")
        return stands_for

    def _prepare_assistant(self, message: dict, index: int) -> dict:
        content = message.get("content")
        if content is None and self.null_content is not None:
            message = {**message, "content": self.null_content}
        if (self.renders_reasoning and isinstance(content, str) and "</think>" in content
                and not any(key in message for key in REASONING_FIELDS)):
            head, _, rest = content.partition("</think>")
            if head.lstrip().startswith("<think>"):
                reasoning = head.lstrip()[len("<think>"):].strip("\n")
                message = {**message, "content": rest.lstrip("\n"), **dict.fromkeys(REASONING_FIELDS, reasoning)}
        if message.get("tool_calls") and self.arguments_as:
            message = {**message, "tool_calls": [self._prepare_call(call, index, k)
                                                 for k, call in enumerate(message["tool_calls"])]}
        return message

    def _prepare_call(self, call: dict, index: int, k: int) -> dict:
        function = call.get("function")
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if self.arguments_as == "mapping" and isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as error:
                raise BadRow("bad_tool_call", f"messages[{index}].tool_calls[{k}].function.arguments is not valid "
                                              f"JSON ({error}); this chat template needs an object") from None
            if not isinstance(arguments, dict):
                raise BadRow("bad_tool_call", f"messages[{index}].tool_calls[{k}].function.arguments must be a "
                                              "JSON object for this chat template")
        elif self.arguments_as == "string" and isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        else:
            return call
        return {**call, "function": {**function, "arguments": arguments}}

    @property
    def backend(self):
        return self.tokenizer.backend_tokenizer

    def boundaries(self, text: str) -> list[int]:
        """token_boundaries of the template's own text, from what the tokenizer was given learned if it has it."""
        known = getattr(self.tokenizer, "known_boundaries", {}).get(text)
        ends = list(known) if known is not None else token_boundaries(self.backend, text)
        self.learned_boundaries[text] = ends
        return ends

    def overhead(self) -> int:
        """Tokens the template adds around an empty exchange: max_length must leave room past it."""
        empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        return len(self.backend.encode(self.render(empty), add_special_tokens=False).ids)
