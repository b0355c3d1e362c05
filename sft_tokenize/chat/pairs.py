"""One render for two: marked field values that carry their unmarked twins.

Locating turns needs the conversation rendered twice, as it is and with its fields wrapped in markers, and
the marked render must equal the plain one once the markers are removed (`turns.py`). A `Twin` is a field's
marked text and its plain text together. The template sees the plain text wherever it looks (truth, length,
comparisons, `in`, `startswith`, hashing), so it takes the branches the plain render takes, and the string
operations templates apply to fields (`+`, `~`, slices, strip, split, replace, trim, tojson) are done on both texts,
each result kept only if removing the markers from the marked result gives the plain result. So one render
gives both texts, and they agree by construction.

Anything else that would read the marked text (`str()`, iteration, an index, `%`, `format`, a filter or
test not listed here) raises `Diverged`, and the row is rendered twice as before. A `Twin` is not a `str`,
so code that expects one fails loudly rather than reading the markers. Text that holds characters of the
markers' range (a field's, any other variable's, the template's own) is rendered twice too: one render could
not tell them apart.

A render can also be traced (`render_twins(..., trace=[])`): every fact the template learned about a field's
text (its truth, length, comparisons, `in`, what a strip removed, how many pieces a split gave) is recorded with
the field and the operations that led to the value it asked about (a Twin's `origin`). Another row whose fields
give the same facts takes the same branches, which `skeleton.py` relies on. What is recorded is an allow-list:
the facts and steps `facts.py` replays, with arguments it replays exactly. Any other read (a hash, a field used
as a key, text joined to a `Markup`, a global or filter that reads outside the row, a piece of text that left the
Twins) poisons the trace: that render is not learned.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Mapping, MappingView, Set
from typing import Any

from sft_tokenize.chat import facts
from sft_tokenize.chat.facts import FIELD_REF, replayable, trimmed
from sft_tokenize.chat.markers import MARKS, holds_marks


class Diverged(Exception):
    """The marked render could differ from the plain one: render the row twice instead."""


_state = threading.local()  # set on any divergence, in case code between here and the render swallows it
_state.trace = None


def _diverge(*_: Any, **__: Any):
    _state.diverged = True
    raise Diverged


POISON = ("poison",)  # a trace entry: the render read a field in a way another row's fields cannot replay


def _observe(twin: Twin, op: str, args: tuple, result: Any) -> Any:
    """Record, in a traced render, that the template learned `result` from `op(twin's value, *args)`."""
    trace = getattr(_state, "trace", None)
    if trace is not None:
        if op not in facts.FACTS:  # no replay: nothing another row could be checked against
            trace.append(POISON)
            return result
        refs = []
        for arg in args:
            if type(arg) is Twin:
                if arg.origin is None:
                    trace.append(POISON)
                    return result
                arg = (FIELD_REF, arg.origin)
            elif not replayable(arg):
                trace.append(POISON)
                return result
            refs.append(arg)
        trace.append(POISON if twin.origin is None else (twin.origin, op, tuple(refs), result))
    return result


def _poison() -> None:
    trace = getattr(_state, "trace", None)
    if trace is not None:
        trace.append(POISON)


poison = _poison  # a read the trace cannot replay (the environment's, e.g. a field used as a key)

def strftime_now(format: Any) -> str:
    """transformers' `strftime_now` global, reading `clock`. In a traced render, the text it gave is a fact (a
    skeleton holds it as constant text, so a later row whose clock gives other text is rendered in full)."""
    if type(format) is Twin:
        _poison()
        format = format.plain
    text = facts.clock().strftime(format)
    trace = getattr(_state, "trace", None)
    if trace is not None:
        trace.append((None, "strftime_now", (format,), text) if type(format) is str else POISON)
    return text


def outside(function: Callable) -> Callable:
    """A global or filter whose result depends on something outside the row (randomness): calling it in a traced
    render poisons the trace."""
    def called(*args, **kwargs):
        _poison()
        return function(*args, **kwargs)

    for attribute in ("jinja_pass_arg",):
        if hasattr(function, attribute):
            setattr(called, attribute, getattr(function, attribute))
    return called


def _plain(value: Any) -> Any:
    return value.plain if type(value) is Twin else value


def _derived(marked: str, plain: str, origin: tuple | None = None) -> str | Twin:
    """The result of an operation done on both texts: a Twin (from `origin`, when it can be replayed), or plain
    text once the markers are gone (which a traced render cannot follow)."""
    if marked == plain:
        _poison()
        return plain
    if MARKS.sub("", marked) != plain:
        _diverge()
    return Twin(marked, plain, origin)


def _then(twin: Twin, *step: Any) -> tuple | None:
    """The origin of a value made from `twin` by one more operation (None, and the trace poisoned, where the
    operation's arguments would not replay)."""
    if step[0] not in facts.STEPS or not all(replayable(arg) for arg in step[1:]):
        _poison()
        return None
    return None if twin.origin is None else (twin.origin[0], (*twin.origin[1], step))


class Twin:
    """A field's text with markers (`marked`) and without (`plain`, derived from `marked` when not given);
    see the module docstring. `origin`: (field id, operations) that made it from a field's text, where known."""

    __slots__ = ("marked", "_plain", "origin")

    def __init__(self, marked: str, plain: str | None = None, origin: tuple | None = None):
        self.marked, self._plain, self.origin = marked, plain, origin

    @classmethod
    def of_field(cls, marked: str, plain: str, fid: int) -> Twin:
        return cls(marked, plain, (fid, ()))

    @property
    def plain(self) -> str:
        if self._plain is None:
            self._plain = MARKS.sub("", self.marked)
        return self._plain

    # What the template sees is the plain text.
    def __bool__(self) -> bool:
        return _observe(self, "bool", (), bool(self.plain))

    def __len__(self) -> int:
        return _observe(self, "len", (), len(self.plain))

    def __hash__(self) -> int:
        _poison()
        return hash(self.plain)

    def __eq__(self, other: Any) -> bool:
        return _observe(self, "eq", (other,), self.plain == _plain(other))

    def __ne__(self, other: Any) -> bool:
        return _observe(self, "ne", (other,), self.plain != _plain(other))

    def __lt__(self, other: Any) -> bool:
        return _observe(self, "lt", (other,), self.plain < _plain(other))

    def __le__(self, other: Any) -> bool:
        return _observe(self, "le", (other,), self.plain <= _plain(other))

    def __gt__(self, other: Any) -> bool:
        return _observe(self, "gt", (other,), self.plain > _plain(other))

    def __ge__(self, other: Any) -> bool:
        return _observe(self, "ge", (other,), self.plain >= _plain(other))

    def __contains__(self, item: Any) -> bool:
        return _observe(self, "contains", (item,), _plain(item) in (self._plain or self.plain))

    def startswith(self, *args: Any) -> bool:
        return _observe(self, "startswith", args, self.plain.startswith(*args))

    def endswith(self, *args: Any) -> bool:
        return _observe(self, "endswith", args, self.plain.endswith(*args))

    # Text made from it is made from both (the marked text, which gives the plain one).
    def __add__(self, other: Any) -> Twin:
        if type(other) is Twin:
            return Twin(self.marked + other.marked)
        if type(other) is str:
            return Twin(self.marked + _unmarked(other), None, _then(self, "add", other))
        if isinstance(other, str):  # a Markup: escapes the field's text, which no slot of a skeleton does
            _poison()
            return _derived(self.marked + _unmarked(other), self.plain + other)
        return NotImplemented

    def __radd__(self, other: Any) -> Twin:
        if type(other) is str:
            return Twin(_unmarked(other) + self.marked, None, _then(self, "radd", other))
        if isinstance(other, str):
            _poison()
            return _derived(_unmarked(other) + self.marked, other + self.plain)
        return NotImplemented

    def strip(self, chars: str | None = None) -> Twin:
        return self._trimmed("strip", chars, self.marked.strip(chars), self.plain.strip(chars))

    def lstrip(self, chars: str | None = None) -> Twin:
        return self._trimmed("lstrip", chars, self.marked.lstrip(chars), self.plain.lstrip(chars))

    def rstrip(self, chars: str | None = None) -> Twin:
        return self._trimmed("rstrip", chars, self.marked.rstrip(chars), self.plain.rstrip(chars))

    def _trimmed(self, method: str, chars: str | None, marked: str, plain: str) -> Twin:
        """A strip's results agree when both texts lost as many characters: stripping stops at a marker (if
        `chars` holds none), so the marked text lost only characters the plain one lost too."""
        if len(self.marked) - len(marked) != len(self.plain) - len(plain) or (chars and holds_marks(chars)):
            _diverge()
        if chars is not None and type(chars) is not str:
            _poison()
        _observe(self, method, (chars,), trimmed(self.plain, method, chars))
        return Twin(marked, plain, _then(self, method, chars))

    def split(self, sep: str | None = None, maxsplit: int = -1) -> list:
        return self._split("split", sep, maxsplit)

    def rsplit(self, sep: str | None = None, maxsplit: int = -1) -> list:
        return self._split("rsplit", sep, maxsplit)

    def _split(self, method: str, sep: Any, maxsplit: Any) -> list:
        if type(sep) is Twin:
            _diverge()
        marked = getattr(self.marked, method)(sep, maxsplit)
        plain = getattr(self.plain, method)(sep, maxsplit)
        if len(marked) != len(plain):
            _diverge()
        _observe(self, method, (sep, maxsplit), len(plain))
        return [_derived(m, p, _then(self, method, sep, maxsplit, k, len(plain)))
                for k, (m, p) in enumerate(zip(marked, plain, strict=True))]

    def replace(self, old: str, new: Any, count: int = -1) -> str | Twin:
        if type(old) is Twin or type(new) is Twin:
            _diverge()
        _observe(self, "count", (old,), self.plain.count(old) if old else -1)
        return _derived(self.marked.replace(old, _marked(new), count), self.plain.replace(old, _plain(new), count),
                        _then(self, "replace", old, new, count))

    def __getitem__(self, key: Any) -> str | Twin:
        """A slice of the plain text, with the markers inside it and at its two ends (an index diverges)."""
        if type(key) is not slice or key.step not in (None, 1):
            _diverge()
        start, stop, _ = key.indices(len(self.plain))
        _observe(self, "slice", (key.start, key.stop), (start, stop))
        if stop <= start:
            _poison()
            return ""
        # Where each marker sits in the plain text, counted in plain characters before it.
        at = [found.start() - k for k, found in enumerate(MARKS.finditer(self.marked))]
        return _derived(self.marked[start + bisect.bisect_left(at, start):stop + bisect.bisect_right(at, stop)],
                        self.plain[start:stop], _then(self, "slice", key.start, key.stop))

    # Whatever else would read the marked text.
    __str__ = __repr__ = __format__ = __iter__ = __reversed__ = _diverge
    __mod__ = __rmod__ = __mul__ = __rmul__ = _diverge


TEXT = (str, Twin)  # what the `string` test accepts
METHODS = frozenset({"startswith", "endswith", "strip", "lstrip", "rstrip", "split", "rsplit", "replace"})
_STR_ATTRIBUTES = frozenset(dir(str))


def _marked(value: Any) -> Any:
    return value.marked if type(value) is Twin else value


def _unmarked(text: str) -> str:
    """Text joined to a marked text, which must hold no marker-range character: the template's own (a string
    literal may spell one as an escape, which the source check does not see) or a variable's."""
    if holds_marks(text):
        _diverge()
    return text


def twin_attribute(twin: Twin, attribute: str, undefined: Callable[..., Any]) -> Any:
    """What `twin.attribute` is in a template: one of METHODS, undefined as on a str, or a divergence."""
    if attribute in METHODS:
        return getattr(twin, attribute)
    if attribute in _STR_ATTRIBUTES:
        _diverge()
    return undefined(obj=twin, name=attribute)


def output(value: Any) -> str | Twin:
    """Jinja's `str()` of an output: a Twin stays one, so the pieces can be joined twice."""
    return value if type(value) is Twin else str(value)


def concat(pieces: Iterable[str | Twin]) -> str | Twin:
    """Jinja's `concat` of outputs: a Twin when any piece is one."""
    items = list(pieces)
    try:
        return "".join(items)
    except TypeError:
        pass
    _unmarked("".join([piece for piece in items if type(piece) is not Twin]))
    return Twin("".join([piece.marked if type(piece) is Twin else piece for piece in items]))


def str_join(values: Iterable[Any]) -> str | Twin:
    """Jinja's `~`."""
    return concat(map(output, values))


def holds_twin(value: Any, depth: int = 16) -> bool:
    """Whether a Twin is in the value or its containers (a container nested deeper than `depth` counts as
    holding one). Exact types first: an ABC check costs more."""
    kind = type(value)
    if kind is Twin:
        return True
    if kind is str:
        return False
    if kind is dict or (kind is not list and kind is not tuple and isinstance(value, Mapping)):
        return not depth or any(holds_twin(k, depth - 1) or holds_twin(v, depth - 1) for k, v in value.items())
    if kind is list or kind is tuple or isinstance(value, Set | MappingView):
        return not depth or any(holds_twin(v, depth - 1) for v in value)
    return False


def swapped(value: Any, side: str, depth: int = 8) -> Any:
    """A copy of the value with every Twin replaced by one of its texts (`marked` or `plain`)."""
    if type(value) is Twin:
        return getattr(value, side)
    if depth and isinstance(value, dict):
        return {swapped(k, side, depth - 1): swapped(v, side, depth - 1) for k, v in value.items()}
    if depth and isinstance(value, list | tuple):
        return type(value)(swapped(v, side, depth - 1) for v in value)
    return value


# Filters that read a Twin only through what it offers (len, truth, the environment's own getattr and tests)
# or that fail on it (through str()); every other filter given a Twin diverges.
SAFE_FILTERS = frozenset({"length", "count", "default", "d", "items", "map", "select", "reject", "selectattr",
                          "rejectattr", "attr", "first", "last", "list", "join", "safe", "reverse", "batch"})


def twin_filters(filters: dict[str, Callable]) -> dict[str, Callable]:
    """The environment's filters, made to handle Twins (trim, string, tojson) or to diverge on them."""
    out = {}
    for name, function in filters.items():
        out[name] = function if name in SAFE_FILTERS else _guarded(function)
    trim, tojson = filters["trim"], filters.get("tojson")
    out["trim"] = lambda value, chars=None: value.strip(chars) if type(value) is Twin else trim(value, chars)
    string = filters["string"]
    out["string"] = lambda value: value if type(value) is Twin else string(value)
    if tojson is not None:
        def twin_tojson(value, *args, **kwargs):
            if not holds_twin(value):
                return tojson(value, *args, **kwargs)
            _poison()  # escaping: a field's JSON text is not the field's text
            return _derived(tojson(swapped(value, "marked"), *args, **kwargs),
                            tojson(swapped(value, "plain"), *args, **kwargs))
        out["tojson"] = twin_tojson
    return out


def is_text(value: Any) -> bool:
    """The `string` test: a str, or a Twin (whose text is one)."""
    return isinstance(value, TEXT)


def twin_tests(tests: dict[str, Callable]) -> dict[str, Callable]:
    """The environment's tests: `string` and `iterable` hold for a Twin as for a str; `sameas` diverges."""
    iterable = tests["iterable"]
    return {**tests, "string": is_text,
            "iterable": lambda value: type(value) is Twin or iterable(value),
            "sameas": _guarded(tests["sameas"])}


def _guarded(function: Callable) -> Callable:
    def guarded(*args, **kwargs):
        if holds_twin(args) or holds_twin(kwargs):
            _diverge()
        return function(*args, **kwargs)

    for attribute in ("jinja_pass_arg",):  # keep @pass_context / @pass_environment working
        if hasattr(function, attribute):
            setattr(guarded, attribute, getattr(function, attribute))
    return guarded


def render_twins(template, variables: dict[str, Any], trace: list | None = None) -> str | None:
    """The marked text of one render of a template compiled for Twins (without its markers, it is the plain
    render), or None if it diverged or failed (the caller renders twice, and meets the template's own error
    there). The Twins' own plain texts must hold no marker-range character (`marks.Marked.marker_text`);
    any other text that reaches the output is checked on its way in. `trace`: a list that receives what the
    template learned about the fields (see the module docstring)."""
    _state.diverged = False
    _state.trace = trace
    try:
        result = concat(template.root_render_func(template.new_context(variables)))
    except Exception:
        return None
    finally:
        _state.trace = None
    if _state.diverged:
        return None
    if type(result) is Twin:
        return result.marked
    return None if holds_marks(result) else result  # no field was rendered, but the template wrote a marker
