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
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Mapping, MappingView, Set
from typing import Any

from sft_tokenize.chat.markers import MARKS, holds_marks


class Diverged(Exception):
    """The marked render could differ from the plain one: render the row twice instead."""


_state = threading.local()  # set on any divergence, in case code between here and the render swallows it


def _diverge(*_: Any, **__: Any):
    _state.diverged = True
    raise Diverged


def _plain(value: Any) -> Any:
    return value.plain if type(value) is Twin else value


def _derived(marked: str, plain: str) -> str | Twin:
    """The result of an operation done on both texts: a Twin, or plain text once the markers are gone."""
    if marked == plain:
        return plain
    if MARKS.sub("", marked) != plain:
        _diverge()
    return Twin(marked, plain)


class Twin:
    """A field's text with markers (`marked`) and without (`plain`, derived from `marked` when not given);
    see the module docstring."""

    __slots__ = ("marked", "_plain")

    def __init__(self, marked: str, plain: str | None = None):
        self.marked, self._plain = marked, plain

    @property
    def plain(self) -> str:
        if self._plain is None:
            self._plain = MARKS.sub("", self.marked)
        return self._plain

    # What the template sees is the plain text.
    def __bool__(self) -> bool:
        return bool(self.plain)

    def __len__(self) -> int:
        return len(self.plain)

    def __hash__(self) -> int:
        return hash(self.plain)

    def __eq__(self, other: Any) -> bool:
        return self.plain == _plain(other)

    def __ne__(self, other: Any) -> bool:
        return self.plain != _plain(other)

    def __lt__(self, other: Any) -> bool:
        return self.plain < _plain(other)

    def __le__(self, other: Any) -> bool:
        return self.plain <= _plain(other)

    def __gt__(self, other: Any) -> bool:
        return self.plain > _plain(other)

    def __ge__(self, other: Any) -> bool:
        return self.plain >= _plain(other)

    def __contains__(self, item: Any) -> bool:
        return (item.plain if type(item) is Twin else item) in (self._plain or self.plain)

    def startswith(self, *args: Any) -> bool:
        return self.plain.startswith(*args)

    def endswith(self, *args: Any) -> bool:
        return self.plain.endswith(*args)

    # Text made from it is made from both (the marked text, which gives the plain one).
    def __add__(self, other: Any) -> Twin:
        if type(other) is Twin:
            return Twin(self.marked + other.marked)
        if isinstance(other, str):
            return Twin(self.marked + _unmarked(other))
        return NotImplemented

    def __radd__(self, other: Any) -> Twin:
        if isinstance(other, str):
            return Twin(_unmarked(other) + self.marked)
        return NotImplemented

    def strip(self, chars: str | None = None) -> Twin:
        return self._trimmed(chars, self.marked.strip(chars), self.plain.strip(chars))

    def lstrip(self, chars: str | None = None) -> Twin:
        return self._trimmed(chars, self.marked.lstrip(chars), self.plain.lstrip(chars))

    def rstrip(self, chars: str | None = None) -> Twin:
        return self._trimmed(chars, self.marked.rstrip(chars), self.plain.rstrip(chars))

    def _trimmed(self, chars: str | None, marked: str, plain: str) -> Twin:
        """A strip's results agree when both texts lost as many characters: stripping stops at a marker (if
        `chars` holds none), so the marked text lost only characters the plain one lost too."""
        if len(self.marked) - len(marked) != len(self.plain) - len(plain) or (chars and holds_marks(chars)):
            _diverge()
        return Twin(marked, plain)

    def split(self, sep: str | None = None, maxsplit: int = -1) -> list:
        return _pieces(self.marked.split(sep, maxsplit), self.plain.split(sep, maxsplit))

    def rsplit(self, sep: str | None = None, maxsplit: int = -1) -> list:
        return _pieces(self.marked.rsplit(sep, maxsplit), self.plain.rsplit(sep, maxsplit))

    def replace(self, old: str, new: Any, count: int = -1) -> str | Twin:
        if type(old) is Twin:
            _diverge()
        return _derived(self.marked.replace(old, _marked(new), count), self.plain.replace(old, _plain(new), count))

    def __getitem__(self, key: Any) -> str | Twin:
        """A slice of the plain text, with the markers inside it and at its two ends (an index diverges)."""
        if type(key) is not slice or key.step not in (None, 1):
            _diverge()
        start, stop, _ = key.indices(len(self.plain))
        if stop <= start:
            return ""
        # Where each marker sits in the plain text, counted in plain characters before it.
        at = [found.start() - k for k, found in enumerate(MARKS.finditer(self.marked))]
        return _derived(self.marked[start + bisect.bisect_left(at, start):stop + bisect.bisect_right(at, stop)],
                        self.plain[start:stop])

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


def _pieces(marked: list[str], plain: list[str]) -> list:
    if len(marked) != len(plain):
        _diverge()
    return [_derived(m, p) for m, p in zip(marked, plain, strict=True)]


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


def render_twins(template, variables: dict[str, Any]) -> str | None:
    """The marked text of one render of a template compiled for Twins (without its markers, it is the plain
    render), or None if it diverged or failed (the caller renders twice, and meets the template's own error
    there). The Twins' own plain texts must hold no marker-range character (`marks.Marked.marker_text`);
    any other text that reaches the output is checked on its way in."""
    _state.diverged = False
    try:
        result = concat(template.root_render_func(template.new_context(variables)))
    except Exception:
        return None
    if _state.diverged:
        return None
    if type(result) is Twin:
        return result.marked
    return None if holds_marks(result) else result  # no field was rendered, but the template wrote a marker
