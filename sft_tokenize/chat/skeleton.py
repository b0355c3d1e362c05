"""Skeletons: a template's render of one conversation shape, learned once, filled with each row's fields.

Most rows of a dataset share a handful of shapes: the same roles in the same order, the same keys, the same
tools. A chat template renders every row of a shape the same way around its fields, unless it looks at a
field's text and branches on it. So the first row of a shape is rendered with its fields marked and the render
traced (`pairs.py`): the output splits into constant text and field slots, the trained spans are known offsets
from them, and the trace lists every fact the template learned about a field (`'</think>' in content`, what a
strip removed, whether a field is empty). A later row of that shape whose fields give the same facts takes the
same branches, so its text is the constants with its fields in the slots and its trained spans are the same
offsets: no Jinja, no marker search.

A shape is learned only where that is exact by construction (docs/masks.md, "Skeletons"), each premise
enforced by refusing to learn:
(a) the render is a function of the key and the recorded facts: a global or filter outside the environment's
    allow-list poisons the trace, and the clock's text is a fact (environment.py, pairs.strftime_now);
(b) every read and transform of a field is a recorded fact with a replay (facts.py), or poisons the trace;
(c) equal keys mean equal values outside the fields: `_frozen` keys each by type and exact value;
(d) turn finding reads constant text only (turns.finds_in_constants), every field reaches the output whole
    (the text between its markers is the field's text), and no trained span starts or ends inside a field.

The guard rail: the first row filled from each skeleton, and each later fill with probability 1/`SAMPLE_EVERY`
(a generator seeded per run), are also located as `--render full` locates them and must agree. A difference
raises `SkeletonMismatch` after `Skeletons.drop`: the encoder renders the batch again in full
(ChatEncoder.encode_batch), and a slice with rows filled before is tokenized again (build/shard.py).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import orjson

from sft_tokenize.chat import facts
from sft_tokenize.chat.markers import MARK_BASE, MARK_LIMIT, MARK_SPLIT, holds_marks, with_fields
from sft_tokenize.chat.pairs import POISON

SAMPLE_EVERY = 64  # one filled row in this many is rendered in full too, and compared
MAX_PER_SHAPE = 8  # skeletons kept for one shape (rows whose fields take other branches)
MAX_SKELETONS = 4096  # in all, per template: a dataset whose every row is its own shape stops learning


_ROLE_CONTENT = ("role", "content")


class SkeletonMismatch(RuntimeError):
    """A skeleton's text or trained spans differ from the full render of a row: never written, always raised.
    `row`: the row's index in the batch the encoder was given, once known (its reader names it)."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message, row)  # both in args: the exception crosses an encode pool's pipe

    @property
    def row(self) -> int | None:
        return self.args[1]

    def __str__(self) -> str:
        return self.args[0]


class _Miss(Exception):
    """A row's fields do not give a skeleton's facts."""


@dataclass(frozen=True)
class Shape:
    """What a row is keyed by, and its fields' texts (in the order `markers.mark` numbers them)."""

    key: tuple
    values: list[str]
    kinds: list[str]
    empty: bool  # blank assistant replies are marked too (see turns._blank_reply)
    cores: list[str]  # each value without its surrounding whitespace: what its slot holds


_SCALARS = (type(None), bool, int)


def _exact(value: Any, depth: int = 32) -> Any:
    """A value as a key part that tells apart every value a template can: types exactly (1, 1.0 and true), floats
    by their repr (NaN, -0.0, inf), mappings with their keys in order; raises _Miss for a type it does not know
    or text that could hold marker characters."""
    kind = type(value)
    if kind is str:
        if holds_marks(value):
            raise _Miss
        return value
    if kind in _SCALARS:
        return (kind, value)
    if kind is float:
        return (float, repr(value))
    if not depth:
        raise _Miss
    if kind is dict:
        return (dict, tuple((_exact(k, depth - 1), _exact(v, depth - 1)) for k, v in value.items()))
    if kind is list or kind is tuple:
        return (kind, tuple(_exact(v, depth - 1) for v in value))
    raise _Miss


def _frozen(value: Any) -> Any:
    """A value that is not a field, as a key part (see `_exact`). Containers are dumped by orjson, which writes
    every finite float exactly (-0.0, 1.0) and refuses subclasses of JSON types here; where it wrote a null,
    which may have been NaN or an infinity, the walk of `_exact` keys them instead."""
    kind = type(value)
    if kind is str or kind is float or kind in _SCALARS:
        return _exact(value)
    try:
        dumped = orjson.dumps(value, option=orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATETIME
                              | orjson.OPT_PASSTHROUGH_DATACLASS)
    except TypeError:
        raise _Miss from None
    if b"\xf3" in dumped:  # the UTF-8 lead byte of the markers' plane
        raise _Miss
    if b"null" in dumped:  # orjson writes NaN and the infinities as null too: the walk tells them apart
        return _exact(value)
    return (kind, dumped)


class _Slot:
    """Where a field is, in a message copied for its key (shape_of), with its tag: what of the field the key holds
    (0, or its surrounding whitespace)."""

    __slots__ = ("tag",)

    def __init__(self, tag: Any):
        self.tag = tag


def _part(name: str, value: Any) -> tuple:
    return (name, "slot", value.tag) if type(value) is _Slot else (name, _frozen(value))


def _message_key(tagged: dict, calls: bool) -> tuple:
    """A message copied with its fields as `_Slot`s (`with_fields`), as a key part; `calls`: its tool calls were
    walked (each call's id and its function's name and arguments are slots)."""
    parts = []
    for name, value in tagged.items():
        if name == "tool_calls" and calls:
            parts.append((name, tuple(tuple((key, tuple(_part(k, v) for k, v in item.items())) if key == "function"
                                            else _part(key, item) for key, item in call.items()) for call in value)))
        else:
            parts.append(_part(name, value))
    return tuple(parts)


def _blank(role: Any, content: Any) -> bool:
    """turns._blank_reply, on a message's role and content."""
    return role == "assistant" and type(content) is str and (not content or content.isspace())


def shape_of(messages: list[dict], tools: Any, kinds: frozenset[str], extra: tuple) -> Shape | None:
    """The row's shape (keyed with `extra` too), walking its messages as `markers.mark` does (same fields, same
    order), or None when a skeleton cannot stand for it."""
    if tools is None and "content" in kinds:
        simple = _simple_shape(messages, extra)
        if simple is not False:
            return simple
    empty = any(_blank(m.get("role"), m.get("content")) for m in messages if type(m) is dict)
    values: list[str] = []
    field_kinds: list[str] = []
    cores: list[str] = []

    def field(text: Any, kind: str) -> Any:
        if type(text) is not str or kind not in kinds:
            return _frozen(text)
        core = text.strip()
        if not (core or empty):
            return _frozen(text)
        if holds_marks(text):
            raise _Miss
        values.append(text)
        field_kinds.append(kind)
        cores.append(core)
        if len(core) == len(text):
            return 0
        if not core:
            return (1, text)
        return (2, text[: len(text) - len(text.lstrip())], text[len(text.rstrip()):])

    try:
        key: list[Any] = [_frozen(tools), empty, extra]
        for message in messages:
            if type(message) is not dict:
                return None
            calls = message.get("tool_calls") or []
            if type(calls) is not list or not all(type(c) is dict and type(c.get("function")) is dict for c in calls):
                return None
            # The names of its keys, its calls' and their functions' (a field's value or its absence is a
            # template's to tell apart), then every value with each field as its slot's tag (`field`).
            layout = (tuple(message), tuple((tuple(call), tuple(call["function"])) for call in calls))
            tagged = with_fields(message, lambda text, kind: _Slot(field(text, kind)))
            key.append((layout, _message_key(tagged, bool(calls))))
    except _Miss:
        return None
    if MARK_BASE + 2 * len(values) > MARK_LIMIT:
        return None
    return Shape(tuple(key), values, field_kinds, empty, cores)


def _simple_shape(messages: list[dict], extra: tuple) -> Shape | None | bool:
    """shape_of for the usual row, every message {role, content} with text and no tools, in a few passes over
    lists; False for any other row (the general walk decides), None where no skeleton can stand for it."""
    if not all([type(m) is dict and len(m) == 2 and tuple(m) == _ROLE_CONTENT for m in messages]):
        return False
    roles = [m["role"] for m in messages]
    values = [m["content"] for m in messages]
    if not all([type(r) is str and type(c) is str for r, c in zip(roles, values, strict=True)]):
        return False
    joined = "\0".join(roles) + "\0" + "\0".join(values)
    if holds_marks(joined):  # O(1) for ASCII text: the markers' plane is not ASCII
        return None
    empty = any([_blank(r, c) for r, c in zip(roles, values, strict=True)])
    cores = [c.strip() for c in values]
    tags = []
    for value, core in zip(values, cores, strict=True):
        tags.append(value if not (core or empty) else 0 if len(core) == len(value) else (1, value) if not core
                    else (2, value[: len(value) - len(value.lstrip())], value[len(value.rstrip()):]))
    if not empty and not all(cores):  # a blank text is not a field here: the template sees it as it is
        kept = [k for k, core in enumerate(cores) if core]
        values, cores = [values[k] for k in kept], [cores[k] for k in kept]
    if MARK_BASE + 2 * len(values) > MARK_LIMIT:
        return None
    return Shape(("simple", tuple(roles), tuple(tags), empty, extra), values, ["content"] * len(values), empty, cores)


@dataclass(frozen=True)
class Skeleton:
    """Constant text around field slots, the facts a row must give, and the trained spans as offsets."""

    constants: tuple[str, ...]  # len(slots) + 1
    slots: tuple[int, ...]  # field ids, in the order they appear
    facts: tuple[tuple, ...]  # (origin, fact, args, result)
    regions: tuple[tuple[int, int, int, int], ...]  # (slots before, constant chars before) of start, then end
    append_eos: bool
    holds: Callable[[list[str]], bool] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "holds", facts.compiled(self.facts))

    def fill(self, cores: list[str]) -> tuple[str, list[tuple[int, int]]]:
        """The row's text from its fields' cores, and its trained spans."""
        constants = self.constants
        filled = [cores[fid] for fid in self.slots]
        parts = [constants[0]]
        for k, core in enumerate(filled):
            parts.append(core)
            parts.append(constants[k + 1])
        before = list(accumulate(map(len, filled), initial=0))
        return "".join(parts), [(c0 + before[s0], c1 + before[s1]) for s0, c0, s1, c1 in self.regions]


def learn(shape: Shape, marked_kinds: list[str], marked_text: str, trace: list,
          regions: list[tuple[int, int]], append_eos: bool) -> Skeleton | None:
    """The skeleton of a marked render of `shape`'s row with its trace and trained spans, or None where it
    would not be exact (see the module docstring)."""
    if POISON in trace or marked_kinds != shape.kinds or any(f[1] == "agree" and f[3] < 0 for f in trace):
        return None
    cores = shape.cores
    pieces = MARK_SPLIT.split(marked_text)  # text, mark, text, mark, ..., text
    constants, slots = [pieces[0]], []
    starts: list[int] = [0]  # where each constant begins in the plain text
    k, position = 1, len(pieces[0])
    while k < len(pieces):
        code = ord(pieces[k]) - MARK_BASE
        fid = code >> 1
        # An opening marker, the field's whole text, its closing marker; nothing else between.
        if (code & 1 or fid >= len(cores) or k + 2 >= len(pieces) or pieces[k + 1] != cores[fid]
                or ord(pieces[k + 2]) != MARK_BASE + 2 * fid + 1):
            return None
        slots.append(fid)
        position += len(cores[fid])
        starts.append(position)
        constants.append(pieces[k + 3])
        position += len(pieces[k + 3])
        k += 4
    lengths = [len(cores[fid]) for fid in slots]
    before = list(accumulate(lengths, initial=0))

    def offset(point: int) -> tuple[int, int] | None:
        for s, start in enumerate(starts):  # constant s spans [start, start + len(constants[s])]
            if start <= point <= start + len(constants[s]):
                return s, point - before[s]
        return None  # inside a field's text

    mapped = []
    for begin, end in regions:
        a, b = offset(begin), offset(end)
        if a is None or b is None:
            return None
        mapped.append((*a, *b))
    recorded: dict[tuple, Any] = {}
    for origin, fact, args, result in trace:
        try:
            recorded.setdefault((origin, fact, args), result)
        except TypeError:  # an unhashable argument (a list compared with a field): not kept as a fact
            return None
    return Skeleton(tuple(constants), tuple(slots), tuple((*key, result) for key, result in recorded.items()),
                    tuple(mapped), append_eos)


class Skeletons:
    """One template's learned skeletons, by shape; shared by the threads of a process.

    A filled row is checked against a full render the first time its skeleton is used, and otherwise with
    probability 1/SAMPLE_EVERY, drawn from a generator seeded per run (`reset`). A mismatch `drop`s every
    skeleton for good: the rest of the run renders in full."""

    def __init__(self, name: str, seed: int | None = None):
        self.name = name
        self._lock = threading.Lock()
        self.reset(seed)

    def reset(self, seed: int | None = None) -> None:
        """Forget what was learned (a new run), and sample checks from `seed` (None: from the OS)."""
        with self._lock:
            self._by_key: dict[tuple, list[Skeleton]] = {}
            self._count = 0
            self._uses: dict[int, int] = {}
            self._random = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
            self.filled = 0
            self.checked = 0
            self.mismatches = 0
            self.dropped = False

    def find(self, shape: Shape) -> tuple[Skeleton, bool] | None:
        """A skeleton whose facts the row gives, and whether this row must be checked against a full render."""
        for skeleton in self._by_key.get(shape.key, ()):
            if skeleton.holds(shape.values):
                with self._lock:
                    uses = self._uses.get(id(skeleton), 0)
                    self._uses[id(skeleton)] = uses + 1
                    self.filled += 1
                    check = uses == 0 or self._random.random() * SAMPLE_EVERY < 1
                    self.checked += check
                return skeleton, check
        return None

    def keep(self, shape: Shape, skeleton: Skeleton) -> None:
        with self._lock:
            if self.dropped:
                return
            known = self._by_key.setdefault(shape.key, [])
            if self._count < MAX_SKELETONS and len(known) < MAX_PER_SHAPE:
                known.append(skeleton)
                self._count += 1

    def drop(self) -> None:
        """A fill differed from the full render: no skeleton of this template is used or learned again."""
        with self._lock:
            self.dropped = True
            self.mismatches += 1
            self._by_key = {}
            self._count = MAX_SKELETONS

    def learning(self) -> bool:
        return self._count < MAX_SKELETONS
