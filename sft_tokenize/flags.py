"""An option declared once: a pydantic field (its name, type, default, checks and the help text the Prefect UI
form shows) with a `Flag` beside its type, which says what the field does not: how the command line gives it.

Both sides' option models use it (build/options.py, read/packing_index.py, flows/run_options.py), and the command
line (cli/arguments.py), its `--help` and the tables of docs/cli.md are made from their declarations, so a flag's
help text, default and choices are those of the field and nowhere else.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Flag:
    """How the command line gives an option."""

    section: str | None = None  # its group in `--help` (and its table in docs/cli.md); None: no flag
    metavar: str | None = None
    flag: str | None = None  # default: --NAME with dashes for underscores
    short: str | None = None  # a one-letter alias, e.g. -q
    parse: Callable[[str], Any] | None = None  # the flag's text to a value (argparse's `type`)
    repeat: bool = False  # the flag is given once per value
    positional: bool = False
    exclusive: str | None = None  # flags of the same name here exclude each other
    cli_note: str | None = None  # words only the command line's help adds (what the flow's form has no use for)


def declared(model: type[BaseModel]) -> Iterator[tuple[str, FieldInfo, Flag]]:
    """Each option of `model` in declaration order: its name, its pydantic field and its Flag (or Option)."""
    for name, info in model.model_fields.items():
        flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if flag is not None:
            yield name, info, flag


def choices(annotation: Any) -> list[str] | None:
    """The values of a Literal option (or of each item of a list of them)."""
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    return list(get_args(annotation)) if get_origin(annotation) is Literal else None


def flag_default(info: FieldInfo) -> Any:
    """The option's default as the command line shows it (None for a required option)."""
    return None if info.is_required() else info.get_default(call_default_factory=True)


def shown_default(default: Any) -> bool:
    """Whether `--help` says the default: not for an option that is off, empty or unset by default."""
    return default not in (None, False, "", [], {})


def help_text(info: FieldInfo, flag: Flag) -> str:
    """The flag's `--help` text: the field's description, then what the command line adds (repeatable, its
    default as declared)."""
    text = info.description or ""
    if flag.cli_note:
        text += flag.cli_note
    if flag.repeat:
        text += "; repeatable"
    elif shown_default(default := flag_default(info)):
        text += f" (default {default})"
    return text


def flag_names(name: str, flag: Flag) -> list[str]:
    if flag.positional:
        return [name]
    return [*([flag.short] if flag.short else []), flag.flag or "--" + name.replace("_", "-")]


# A flag's text to its value: an argparse.ArgumentTypeError becomes a usage error naming the flag.

def role_column(spec: str) -> tuple[str, str]:
    role, sep, name = spec.partition("=")
    if not sep or not role or not name:
        raise argparse.ArgumentTypeError(f"expected ROLE=NAME (e.g. completion=response), got {spec!r}")
    return role, name


def whole_number(text: str, least: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


# The longest sequence a packing length or a cost report's length may ask for (4,194,304 tokens): past any model's
# context, and a bound on what packing allocates per length (read/bin_packing.py keeps a bucket per free space).
MAX_SEQUENCE_TOKENS = 2**22


def sequence_length(text: str) -> int:
    """A length in tokens from the command line: a whole number from 1 to MAX_SEQUENCE_TOKENS."""
    return _at_most(positive_int(text), MAX_SEQUENCE_TOKENS,
                    "tokens is past the longest sequence this tool packs or costs", "ask for a model's context length")


# The most data-parallel ranks packing arranges bins for (1,048,576): past any cluster, and a bound on what packing
# allocates per rank (read/bin_packing.py gives every rank as many bins as the others, empty ones where rows run out).
MAX_DATA_PARALLEL = 2**20


def data_parallel_ranks(text: str) -> int:
    """A number of data-parallel ranks from the command line: a whole number from 1 to MAX_DATA_PARALLEL."""
    return _at_most(positive_int(text), MAX_DATA_PARALLEL, "data-parallel ranks is past the most this tool packs for",
                    "ask for the ranks that train on the cache")


# The most encode processes a run starts (--encode-processes): its pool forks them all at once.
MAX_ENCODE_PROCESSES = 256


def encode_pool_size(text: str) -> int:
    """--encode-processes from the command line: a whole number from 0 to MAX_ENCODE_PROCESSES."""
    return _at_most(whole_number(text), MAX_ENCODE_PROCESSES, "encode processes is past the most a run starts",
                    "the default is one per core")


def _at_most(value: int, most: int, past: str, instead: str) -> int:
    """`value`, or an error saying it is `past` the bound `most` and what to ask `instead`."""
    if value > most:
        raise argparse.ArgumentTypeError(f"{value:,} {past} ({most:,}); {instead}")
    return value


def _seconds(text: str, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not ((value >= 0 if zero else value > 0) and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected {'zero or ' if zero else ''}a positive number of seconds, "
                                         f"got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    return _seconds(text, zero=False)


def non_negative_seconds(text: str) -> float:
    return _seconds(text, zero=True)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg} at character {error.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"anon\": true}}', got {text!r}")
    return value
