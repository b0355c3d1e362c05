"""The vocabulary of facts a traced render records about a field, and their replays.

A traced render (`pairs.py`) records each thing the template learned about a field's text: a *fact*, the
result of one of `FACTS` applied to a value made from the field by *steps* (`STEPS`), with arguments that are
plain values (`replayable`) or another field's value. `compiled` turns a skeleton's facts into one function
that replays them on another row's fields (`skeleton.py`): the row is filled only if every fact gives the same
result. A fact with no replay here cannot be recorded (the tracer poisons the trace instead), and the clock's
text (`strftime_now`) is the one fact about the world rather than a field.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from os.path import commonprefix
from typing import Any

FIELD_REF = object()  # tags a traced argument that is another field's value: (FIELD_REF, origin)

# What `strftime_now` reads: the time now. Replaceable (tests set a clock that crosses midnight).
clock: Callable[[], datetime] = datetime.now


class Unreplayable(Exception):
    """A step cannot be replayed on a row's field (a split gave another number of pieces)."""


_PLAIN_ARGUMENTS = (str, int, bool, type(None))  # the argument types a replay compares exactly (no subclass)


def replayable(value: Any) -> bool:
    """Whether an argument of a recorded fact or step means on another row what it meant here: a str, int, bool or
    None of exactly that type (a `Markup` or a float is not), or a tuple of them."""
    kind = type(value)
    if kind is tuple:
        return all(type(item) in _PLAIN_ARGUMENTS for item in value)
    return kind in _PLAIN_ARGUMENTS


def trimmed(text: str, method: str, chars: str | None) -> tuple[int, int]:
    """How many characters `text.<method>(chars)` removes at its start and at its end."""
    left = len(text) - len(text.lstrip(chars)) if method != "rstrip" else 0
    right = len(text) - len(text.rstrip(chars)) if method != "lstrip" else 0
    return (left, right) if left < len(text) else (left, 0)


def agree(rest: str, value: str) -> int:
    """How many characters of `rest` (a header's text past the constant text) the field's text begins with, or
    -1 where all of the field's text agrees (the text after it, another row's, would decide)."""
    core = value.strip()
    n = len(commonprefix([rest, core]))
    return n if n < len(core) or n == len(rest) else -1


def _is_ref(arg: Any) -> bool:
    return type(arg) is tuple and len(arg) == 2 and arg[0] is FIELD_REF


def _strftime(format: str) -> str:
    return clock().strftime(format)


def _piece(pieces: list[str], index: int, count: int) -> str:
    if len(pieces) != count:
        raise Unreplayable
    return pieces[index]


# The transforms a value's origin may go through, replayed by `compiled`: `+` a text (either side), a strip,
# the k-th of n pieces of a split, a replace, a slice.
STEPS = frozenset({"add", "radd", "strip", "lstrip", "rstrip", "split", "rsplit", "replace", "slice"})
# The facts about the world, not a field (origin None).
WORLD = frozenset({"strftime_now"})

FACTS = {  # each fact (pairs._observe) as an expression of the replayed value v and its arguments
    "bool": "bool({v})", "len": "len({v})", "eq": "({v} == {a0})", "ne": "({v} != {a0})", "lt": "({v} < {a0})",
    "le": "({v} <= {a0})", "gt": "({v} > {a0})", "ge": "({v} >= {a0})", "contains": "({a0} in {v})",
    "startswith": "{v}.startswith({args})", "endswith": "{v}.endswith({args})",
    "strip": "_trimmed({v}, 'strip', {a0})", "lstrip": "_trimmed({v}, 'lstrip', {a0})",
    "rstrip": "_trimmed({v}, 'rstrip', {a0})", "split": "len({v}.split({a0}, {a1}))",
    "rsplit": "len({v}.rsplit({a0}, {a1}))", "count": "({v}.count({a0}) if {a0} else -1)",
    "slice": "slice({a0}, {a1}).indices(len({v}))[:2]", "agree": "_agree({a0}, {v})",
}


def compiled(facts: tuple[tuple, ...]) -> Callable[[list[str]], bool]:
    """One function that checks every fact on a row's field texts: a skeleton is tried on most rows, so its
    facts are Python expressions, not a loop over them."""
    constants: dict[str, Any] = {"_Miss": Unreplayable, "_piece": _piece, "_trimmed": trimmed, "_agree": agree,
                                 "_strftime": _strftime}

    def constant(value: Any) -> str:
        name = f"_c{len(constants)}"
        constants[name] = value
        return name

    def value_of(origin: tuple) -> str:
        fid, steps = origin
        text = f"v[{fid}]"
        for step in steps:
            name, args = step[0], [constant(a) for a in step[1:]]
            if name == "add":
                text = f"({text} + {args[0]})"
            elif name == "radd":
                text = f"({args[0]} + {text})"
            elif name in ("strip", "lstrip", "rstrip"):
                text = f"{text}.{name}({args[0]})"
            elif name in ("split", "rsplit"):
                text = f"_piece({text}.{name}({args[0]}, {args[1]}), {step[3]}, {step[4]})"
            elif name == "replace":
                text = f"{text}.replace({args[0]}, {args[1]}, {args[2]})"
            elif name == "slice":
                text = f"{text}[{args[0]}:{args[1]}]"
            else:  # not one of STEPS
                raise ValueError(f"no replay for {name!r}")
        return text

    checks = []
    for origin, fact, args, result in facts:
        if origin is None:  # a fact about the world, not a field: the clock
            if fact not in WORLD:
                raise ValueError(f"no replay for {fact!r}")
            checks.append(f"        if _strftime({constant(args[0])}) != {constant(result)}:\n            return False")
            continue
        value = value_of(origin)
        a = [value_of(arg[1]) if _is_ref(arg) else constant(arg) for arg in args]
        expression = FACTS[fact].format(v=value, a0=a[0] if a else "", a1=a[1] if len(a) > 1 else "",
                                        args=", ".join(a))
        checks.append(f"        if {expression} != {constant(result)}:\n            return False")
    body = "".join(check + "\n" for check in checks)
    source = f"def holds(v):\n    try:\n{body}        return True\n    except _Miss:\n        return False\n"
    exec(compile(source, "<skeleton facts>", "exec"), constants)  # it names only v and registered constants
    return constants["holds"]


