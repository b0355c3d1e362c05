"""Trained turns: where each trained assistant turn lies in the rendered conversation.

The definition (README "Loss masks", FORMAT.md): a trained assistant turn is what the template renders for
that message inside the whole conversation, from the end of the generation prompt through the end-of-turn
token: its content, its reasoning block where the template renders one, and its tool calls. Role headers,
other messages and what follows the end-of-turn token are not trained. A turn the template rewrites in
history is trained as rendered there.

How it is found, in one render per row whatever the number of turns:
1. the conversation is rendered with every field that probing showed safe (content, reasoning, tool-call
   names, ids, string arguments) wrapped in private-use marker characters, as Twins of marked and plain text
   (`pairs.py`), so that without the markers the render is exactly the plain one (the row's text); it tells
   where every message's fields are, even when the template moves, trims or drops them. Where a template
   reads a field in a way Twins do not follow, the row is rendered twice, plain and marked, and the two must
   agree once the markers are removed.
2. A turn starts after the generation prompt's header that precedes its first field (matched by whole
   tokens of the generation prompt, so a start never falls inside a token), or, for templates without a
   generation prompt, after the text a prompt ends with after the previous message's role.
3. It ends after the first end-of-turn token that follows its last field; failing that, after the first
   special token before the next message (templates whose next role token ends a turn); failing that, at
   the end of the text, with the tokenizer's EOS appended and trained.

A row whose render changes when marked (a template that inspects the text itself) takes the exact path:
one prefix render per trained turn, with the same start and end rules. `{% generation %}` templates use
transformers' own generation spans.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Literal

from sft_tokenize.chat.anchors import Anchors, Evidence, finds_in_constants
from sft_tokenize.chat.facts import agree
from sft_tokenize.chat.markers import MARK_BASE, MARK_SPLIT, mark
from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.chat.pairs import Twin, swapped
from sft_tokenize.chat.skeleton import Shape, Skeleton, SkeletonMismatch, Skeletons, learn, shape_of
from sft_tokenize.chat.template import ChatTemplate
from sft_tokenize.errors import BadRow
from sft_tokenize.sources.conversations import Conversation

# How trained character spans become trained tokens: "spans", a token holding any character of a span is
# trained (encoding/token_mask.py; transformers' return_assistant_tokens_mask does the same for generation
# blocks); "text", a plain-text row: encoded with the tokenizer's own special tokens, EOS appended, all trained.
TokenRule = Literal["spans", "text"]


@dataclass(frozen=True)
class Rendered:
    """One row to encode: its text, trained character spans, and whether EOS is appended and trained."""

    text: str
    regions: list[tuple[int, int]]
    append_eos: bool = False
    token_rule: TokenRule = "spans"
    exact: bool = False  # found by the exact path
    expanded: bool = False  # an extra row made by --reasoning-turns expand
    fields: tuple[tuple[int, int, int], ...] = ()  # (message, start, end) of each marked field in `text`
    filled: bool = False  # made from a skeleton (skeleton.py)
    checked: bool = False  # and compared with its full render


class TurnFinder:
    """Finds the trained character spans of a conversation for one template and one training mode."""

    def __init__(self, template: ChatTemplate, masks: MaskSettings):
        self.template = template
        self.masks = masks
        self._tail_ends = {role: template.boundaries(tail) for role, tail in template.prompt_tails.items()}
        # Rows of a shape already rendered are filled in (skeleton.py), where the template reads fields as Twins.
        usable = masks.skeletons and template.compiled_for_twins is not None and not template.has_generation_blocks
        self.skeletons = Skeletons(getattr(template.tokenizer, "name_or_path", "")) if usable else None

    def targets(self, conv: Conversation) -> list[int]:
        """Indices of the assistant messages whose turns are trained: as --train-on says, except a message
        whose own `weight` says otherwise (Conversation.trained)."""
        assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        if self.masks.train_on == "last_assistant":
            chosen = assistant[-1:]
        elif self.masks.train_on == "completion":
            chosen = [i for i in assistant if i >= completion_start(conv)]
        else:
            chosen = assistant
        if not conv.trained:
            return chosen
        wanted = [i for i in assistant if conv.trained[i] or (conv.trained[i] is None and i in chosen)]
        if self.masks.train_on == "completion" and wanted != chosen:
            # The completion is trained as one span, tool replies included: a weight that trains a prompt
            # message or leaves out one inside the completion cannot be honoured there.
            differs = next(i for i in assistant if (i in wanted) != (i in chosen))
            raise BadRow("weight_in_completion", f"messages[{differs}].weight is {int(differs in wanted)}, which "
                                                 "--train-on completion cannot honour (it trains the completion as "
                                                 "one span): use all_assistant or last_assistant")
        return wanted

    def find(self, conv: Conversation, targets: list[int], fields: bool = False) -> list[Rendered]:
        """The rows this conversation becomes: one, or with --reasoning-turns expand one more per turn whose
        reasoning the template drops in history. `fields`: each row says where its fields are (a row filled
        from a skeleton does not)."""
        conv = self.template.prepare(conv)
        if self.template.has_generation_blocks:
            return [self._generation_spans(conv, targets)]
        # The skeletons are a cache in front of the turn locator: a known shape is filled, any other row located
        # (and learned from, where that is exact).
        shape = None
        skeletons = self.skeletons
        if skeletons is not None and not skeletons.dropped and not fields and not conv.image_grids:
            shape = shape_of(conv.messages, conv.tools, self.template.markable, (tuple(targets), conv.completion_start))
            found = skeletons.find(shape) if shape is not None else None
            if found is not None:
                return [self._filled(conv, targets, shape, *found)]
        return self._located(conv, targets, shape)

    def _located(self, conv: Conversation, targets: list[int], shape: Shape | None = None) -> list[Rendered]:
        """The rows of a prepared conversation as `--render full` finds them (see `find`), learning a skeleton
        from the render where `shape` is given and that is exact."""
        evidence = Evidence() if shape is not None and self.skeletons.learning() else None
        located = self._by_markers(conv, targets, evidence)
        if located is None:
            return [self._by_prefixes(conv, targets)]
        main, stripped = located
        if evidence is not None and not stripped:
            self._learn(shape, evidence, main)
        if self.masks.reasoning_turns != "expand" or not stripped:
            return [main]
        rows, expanded = [], set()
        for i in stripped:
            found = self._by_markers(Conversation(conv.messages[: i + 1], conv.tools, conv.completion_start), [i])
            if found is None or found[1]:  # the template drops this turn's reasoning even when it is last
                continue
            rows.append(replace(found[0], expanded=True))
            expanded.add(i)
        kept = [i for i in targets if i not in expanded]
        if kept:
            rows.append(main if kept == targets else self._by_markers(conv, kept)[0])
        return rows

    def whole(self, conv: Conversation, with_fields: bool = False) -> Rendered:
        """The conversation trained on every token (train_on all), with its fields located on request."""
        if False in conv.trained:
            excluded = conv.trained.index(False)
            raise BadRow("weight_in_train_all", f"messages[{excluded}].weight is 0, which --train-on all cannot "
                                                "honour (it trains every token): use all_assistant")
        conv = self.template.prepare(conv)
        text = self.template.render(conv.messages, conv.tools)
        located = self._by_markers(conv, []) if with_fields else None
        return Rendered(text, [(0, len(text))], fields=located[0].fields if located else ())

    def _filled(self, conv: Conversation, targets: list[int], shape: Shape, skeleton: Skeleton,
                check: bool) -> Rendered:
        """The row from a skeleton of its shape; with `check`, compared with what `--render full` makes of it.
        A difference drops the template's skeletons and raises (the caller renders its rows again in full)."""
        text, regions = skeleton.fill(shape.cores)
        row = Rendered(text, regions, skeleton.append_eos, filled=True, checked=check)
        if check:
            full = self._located(conv, targets)
            if len(full) != 1 or (full[0].text, full[0].regions, full[0].append_eos, full[0].token_rule) != (
                    text, regions, row.append_eos, row.token_rule):
                self.skeletons.drop()
                raise SkeletonMismatch(
                    f"the chat template of {self.skeletons.name or 'the tokenizer'} renders a row "
                    f"({text[:60]!r}...) otherwise than its learned skeleton")
        return row

    def _learn(self, shape: Shape, evidence: Evidence, row: Rendered) -> None:
        """Keep a skeleton of the row's render, where its premises hold (skeleton.py): one render of Twins with
        nothing poisoned, turn finding that read constant text only, and how each header that reached into a
        field agrees with it recorded as a fact."""
        if evidence.marked_text is None or not finds_in_constants(evidence.twice, evidence.positions,
                                                                  evidence.searched):
            return
        starts = {position: fid for fid, position in evidence.opened.items()}
        trace = evidence.trace
        for position, rest in evidence.reach:  # the turn's start depends on how the field there begins: a fact
            if position not in starts or list(evidence.opened.values()).count(position) > 1:
                return
            trace.append(((starts[position], ()), "agree", (rest,), agree(rest, shape.values[starts[position]])))
        skeleton = learn(shape, evidence.kinds, evidence.marked_text, trace, row.regions, row.append_eos)
        if skeleton is not None:
            self.skeletons.keep(shape, skeleton)

    # -- the two-render path ---------------------------------------------------------------------------------

    def _by_markers(self, conv: Conversation, targets: list[int],
                    evidence: Evidence | None = None) -> tuple[Rendered, list[int]] | None:
        """(the row, targets whose reasoning the template dropped), or None when marking changes the render.
        `evidence`: receives what learning a skeleton from this render needs (see `_learn`)."""
        template = self.template
        if any(type(message.get("content")) is list for message in conv.messages):
            # Content parts (an image row's messages) are not marked, so a turn of them has no anchor and the
            # search between its neighbours' anchors could take another turn's header: prefix rendering decides.
            return None
        blank = any(_blank_reply(message) for message in conv.messages)
        marked = mark(conv.messages, template.markable, empty=blank, twin=Twin.of_field)
        if marked is None or not marked.owners:
            template.render(conv.messages, conv.tools)  # the template's own error, if it has one, is the row's
            return None
        trace = evidence.trace if evidence is not None else None
        marked_text = template.render_marked(marked, conv.tools, trace)
        plain_text = None
        if marked_text is None:  # the template reads a field in a way Twins cannot follow: render twice
            plain_text = template.render(conv.messages, conv.tools)
            marked_text = template.render(swapped(marked.messages, "marked"), conv.tools)
        pieces = MARK_SPLIT.split(marked_text)  # text, mark, text, ..., text
        text = "".join(pieces[0::2])
        if plain_text is not None and text != plain_text:
            return None  # marking changed the render
        # Each field's first rendering locates it: a template may copy a field into a later message (gpt-oss
        # repeats a tool call's name in the tool reply's header), and that copy belongs to the later message.
        opened: dict[int, int] = {}
        closed: dict[int, int] = {}
        fields_marked = len(marked.owners)
        positions = list(accumulate(map(len, pieces[0:-1:2])))  # of every marker, in the plain text
        twice = False  # a field renders more than once
        for position, found in zip(positions, pieces[1::2], strict=True):
            code = ord(found) - MARK_BASE
            fid = code >> 1
            if fid >= fields_marked:
                return None  # the data itself holds marker characters
            if not code & 1:
                twice = twice or fid in opened
                opened.setdefault(fid, position)
            elif fid not in closed and position >= opened.get(fid, -1):
                closed[fid] = position
        fields = []  # (message, start, end) of every rendered field
        for fid in sorted(opened.keys() | closed.keys()):
            start, end = opened.get(fid, closed.get(fid)), closed.get(fid, opened.get(fid))
            fields.append((marked.owners[fid], start, end))
        owned: dict[int, set[str]] = {}
        for owner, kind in zip(marked.owners, marked.kinds, strict=True):
            owned.setdefault(owner, set()).add(kind)
        rendered: dict[int, set[str]] = {}
        for fid in opened.keys() | closed.keys():
            rendered.setdefault(marked.owners[fid], set()).add(marked.kinds[fid])
        anchors = Anchors(fields)
        stripped, regions, append_eos = [], [], False
        reach = evidence.reach if evidence is not None else None  # headers read into a field
        searched: list[tuple[int, int]] = evidence.searched if evidence is not None else []
        for i in targets:
            kinds = rendered.get(i, set())
            self._check_rendered(conv.messages[i], i, owned.get(i, set()), kinds)
            if "reasoning" in owned.get(i, ()) and "reasoning" not in kinds:
                stripped.append(i)
            if kinds:
                first, last = anchors.extent(i)
                gap_start, previous = anchors.before(first, i)
                header = self._header_end(text, gap_start, first, conv, previous, reach)
                start = first if header is None else gap_start + header
                bound = anchors.after(last, i, len(text))
                searched += [(gap_start, first), (last, bound)]
                end, eos = self._turn_end(text, last, bound)
                regions.append((start, max(end, start)))
                append_eos = append_eos or eos
                continue
            # None of its fields renders (an empty turn whose reasoning the template drops, or whose empty
            # content it writes nothing for): the turn is its header's, between the fields around it.
            previous = next((k for k in range(i - 1, -1, -1) if anchors.has(k)), None)
            gap_start = anchors.extent(previous)[1] if previous is not None else 0
            bound = anchors.after(gap_start, -1 if previous is None else previous, len(text))
            header = self._header_end(text, gap_start, bound, conv, previous, reach)
            searched.append((gap_start, bound))
            if header is None:
                continue  # the template does not render this message: nothing of it to train
            start = gap_start + header
            end, eos = self._turn_end(text, start, bound)
            if end > start or eos:
                regions.append((start, end))
                append_eos = append_eos or eos
        if self.masks.train_on == "completion" and regions:
            if completion_start(conv) != targets[0]:
                return None  # the completion opens with a non-assistant message: prefix rendering decides
            regions = [(regions[0][0], regions[-1][1])]
        if evidence is not None and plain_text is None:  # one render of Twins: what a skeleton can be learned from
            evidence.marked_text, evidence.kinds, evidence.opened = marked_text, marked.kinds, opened
            evidence.twice, evidence.positions = twice, positions
        return Rendered(text, regions, append_eos, fields=tuple(fields)), stripped

    @staticmethod
    def _check_rendered(message: dict, i: int, owned: set[str], rendered: set[str]) -> None:
        """A template that drops an assistant field would train a bare end-of-turn token: say so instead."""
        if message.get("tool_calls") and not rendered & {"tool_name", "tool_arguments", "tool_id"}:
            raise BadRow("template_dropped_field", f"the chat template does not render messages[{i}].tool_calls")
        if "content" in owned and "content" not in rendered and (message.get("content") or "").strip():
            raise BadRow("template_dropped_field", f"the chat template does not render messages[{i}].content")

    def _header_end(self, text: str, gap_start: int, gap_end: int, conv: Conversation,
                    previous: int | None, reach: list[tuple[int, str]] | None = None) -> int | None:
        """Where the header before a turn's first field ends, as an offset from `gap_start` (None if no header
        is there): the header lies in the text between the field before (at gap_start) and the turn's first
        field (at gap_end). Where the header's text still agrees at gap_end, what it agrees with is the field's:
        (gap_end, the rest of the header) goes to `reach`."""
        template = self.template
        gap = text[gap_start:gap_end]
        if template.generation_prompt:  # the longest run of its first tokens, which may reach into the field
            header, ends = template.generation_prompt, template.generation_prompt_ends
            for end in reversed(ends):
                found = gap.rfind(header[:end])
                if found >= 0:
                    agreed = _agreeing_length(header, text, gap_start + found)
                    inside = len(gap) - found  # of the header, what the gap holds
                    if reach is not None and inside <= agreed < len(header):
                        reach.append((gap_end, header[inside:]))
                    return found + ends[bisect.bisect_right(ends, agreed) - 1]  # ends ascend; ends[k] <= agreed
            return None
        # No generation prompt: the longest run of the last tokens of what a prompt ends with after that role.
        role = conv.messages[previous]["role"] if previous is not None else "user"
        role = role if template.prompt_tails.get(role) else "user"
        tail = template.prompt_tails[role]
        for start in [0, *self._tail_ends[role][:-1]]:
            found = gap.rfind(tail[start:])
            if found >= 0:
                return found + len(tail) - start
        return None

    def _turn_end(self, text: str, last: int, bound: int) -> tuple[int, bool]:
        """(end of the turn, whether EOS must be appended): see the module docstring, step 3."""
        template = self.template
        if template.end_of_turn_pattern:
            found = template.end_of_turn_pattern.search(text, last, bound)
            if found:
                return found.end(), False
        if template.special:
            found = template.special.search(text, last, bound)
            if found:
                return found.end(), False
        if bound == len(text):
            return len(text), True
        return last, False

    # -- the exact path and generation blocks ------------------------------------------------------------------

    def _by_prefixes(self, conv: Conversation, targets: list[int]) -> Rendered:
        """One prefix render per trained turn: start where the prompt before it stops agreeing with the
        text (never inside a token of the generation prompt), end as the two-render path does."""
        template = self.template
        messages, tools = conv.messages, conv.tools
        text = template.render(messages, tools)
        generation, ends = template.generation_prompt, template.generation_prompt_ends
        regions, append_eos = [], False
        for i in targets:
            prompt = template.render(messages[:i], tools, add_generation_prompt=True) if i else ""
            start = len(os.path.commonprefix([prompt, text]))
            header_at = len(prompt) - len(generation)
            if generation and start > header_at and prompt.endswith(generation):
                start = header_at + max([0] + [e for e in ends if e <= start - header_at])
            # The turn's own render, where it agrees with the text, bounds the search for its end.
            agreed = len(os.path.commonprefix([template.render(messages[: i + 1], tools), text]))
            end, eos = self._turn_end(text, start, agreed if agreed > start else len(text))
            if end <= start and not eos:
                end = agreed  # no end-of-turn token before the next message: the turn is what it rendered
            regions.append((start, end))
            append_eos = append_eos or eos
        if self.masks.train_on == "completion" and regions:
            first = completion_start(conv)
            prompt = template.render(messages[:first], tools, add_generation_prompt=True) if first else ""
            regions = [(len(os.path.commonprefix([prompt, text])), regions[-1][1])]
        return Rendered(text, regions, append_eos, exact=True)

    def _generation_spans(self, conv: Conversation, targets: list[int]) -> Rendered:
        text, spans = self.template.render_generation(conv.messages, conv.tools)
        assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        if len(spans) == len(assistant):
            spans = [span for span, i in zip(spans, assistant, strict=True) if i in targets]
        elif conv.trained:  # which span is whose is unknown: a message's weight cannot be honoured
            raise BadRow("weight_unplaceable", f"the chat template's generation blocks ({len(spans)}) do not match "
                                               f"the {len(assistant)} assistant messages, so their weights cannot "
                                               "be honoured")
        elif self.masks.train_on == "last_assistant":
            spans = spans[-1:]
        return Rendered(text, [tuple(s) for s in spans])


def _agreeing_length(prefix: str, text: str, at: int) -> int:
    """len(os.path.commonprefix([prefix, text[at:at + len(prefix)]])), at once in the usual case."""
    if text.startswith(prefix, at):
        return len(prefix)
    return len(os.path.commonprefix([prefix, text[at:at + len(prefix)]]))


def _blank_reply(message: dict) -> bool:
    """Whether a message is an assistant reply with blank content. Its turn may be nothing else where the
    template drops its reasoning or tool calls, so the row's blank fields are marked: that turn is then
    located by its body, and the turn after it starts after it."""
    content = message.get("content")
    return message.get("role") == "assistant" and isinstance(content, str) and (not content or content.isspace())


def completion_start(conv: Conversation) -> int:
    """Index of the completion's first message; for chat data, what follows the last user turn."""
    if conv.completion_start is not None:
        return conv.completion_start
    users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
    return users[-1] + 1 if users else 0

