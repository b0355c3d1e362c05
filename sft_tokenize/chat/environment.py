"""transformers' sandboxed Jinja environment, with exact shortcuts for what chat templates do most.

A template renders one row at a time, so the cost of Jinja's generic paths is paid per message: every
`message.role` goes through the sandbox's `getattr`, every `content.split(...)` through its `call`, every
`ns.x` through `Namespace.__getattribute__`. Two layers take the common cases off those paths:

- the environment (`_fast_sandbox`) decides whether an attribute is safe once per (type, name) pair and
  reads a dict's key at once, as the sandbox ends up doing after `getattr()` fails on a dict;
- the code generator (`FastCodeGenerator`) writes those cases into the compiled template itself, guarded by
  the exact type (or identity) of the value, so they cost no call into the environment: a dict's key
  (`message.role`, `message['role']`), a loop's counters (`loop.index0`, `loop.last`), a namespace's
  attribute (`ns.x`), a safe method of a str (`content.startswith(...)`), the `string` test, and
  `namespace(...)` itself; loops step through a generator. Any other type, or a name a dict or str holds as
  a method, takes the environment's path as before.

Each shortcut returns what the sandbox returns for that case (the same value, or the same Undefined), so
the same templates render the same text, errors included (tests/unit/test_environment.py checks every reference
template against transformers' own renderer).
"""

from __future__ import annotations

import itertools
import logging

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.runtime import LoopContext, missing
from jinja2.tests import test_string
from jinja2.utils import Namespace

from sft_tokenize.chat import pairs

logger = logging.getLogger("sft_tokenize")

_DICT_ATTRIBUTES = frozenset(dir(dict))
_WRAPPED = ("format", "format_map")  # the sandbox hands these out wrapped
# LoopContext's public values (its methods `cycle` and `changed` take the environment's path).
_LOOP_VALUES = frozenset({"index0", "index", "first", "last", "length", "revindex", "revindex0", "depth", "depth0",
                          "previtem", "nextitem"})
# A str's methods that the sandbox calls as they are: every public one but the wrapped two.
_STR_METHODS = frozenset(name for name in dir(str) if not name.startswith("_")) - set(_WRAPPED)
# Namespace keeps its attributes in this private dict; without it (another jinja), `ns.x` takes the usual path.
_NAMESPACE_ATTRS = "_Namespace__attrs"
_HAS_NAMESPACE_ATTRS = isinstance(getattr(Namespace(), _NAMESPACE_ATTRS, None), dict)


class _NoNamespace:
    """Stands for the namespace class where the environment's reads attributes its own way: no value is one."""


class _Loop(LoopContext):
    """jinja's loop context, stepped by a generator instead of a `__next__` call per item: the same items and
    counters, and `loop.last` still peeks ahead through `_after`."""

    def __iter__(self):
        iterator = self._iterator
        while True:
            item = self._after
            if item is missing:
                item = next(iterator, missing)
                if item is missing:
                    return
            else:
                self._after = missing
            self.index0 += 1
            self._before, self._current = self._current, item
            yield item, self


def _fast_sandbox(environment, for_twins: bool = False):
    """An overlay of transformers' sandboxed environment that reads attributes by the shortcuts in the module
    docstring and compiles templates with `FastCodeGenerator`.
    `for_twins`: the environment also renders `pairs.Twin` values (see pairs.py)."""
    overlay = environment.overlay()
    checked: dict[tuple[type, str], bool] = {}
    base_getattr, base_getitem, base_is_safe = overlay.getattr, overlay.getitem, overlay.is_safe_attribute
    undefined = overlay.undefined
    Twin = pairs.Twin

    def getattr_(obj, attribute):
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            return obj[attribute] if attribute in obj else undefined(obj=obj, name=attribute)
        if for_twins and type(obj) is Twin:
            return pairs.twin_attribute(obj, attribute, undefined)
        if checked.get((type(obj), attribute)) and attribute not in _WRAPPED:
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return base_getattr(obj, attribute)

    def getitem(obj, argument):  # a Twin key finds what its plain text finds, which no trace replays
        if type(argument) is Twin:
            pairs.poison()
        try:
            return obj[argument]
        except (TypeError, LookupError):
            return base_getitem(obj, argument.plain if type(argument) is Twin else argument)

    def is_safe_attribute(obj, attribute, value):
        key = (type(obj), attribute)
        if key not in checked:
            checked[key] = base_is_safe(obj, attribute, value)
        return checked[key]

    overlay.getattr, overlay.is_safe_attribute = getattr_, is_safe_attribute
    overlay.globals = _row_globals(environment.globals)
    overlay.filters = {**overlay.filters, **{name: pairs.outside(overlay.filters[name])
                                             for name in _OUTSIDE_FILTERS if name in overlay.filters}}
    overlay.code_generator_class = TwinCodeGenerator if for_twins else FastCodeGenerator
    if for_twins:
        overlay.getitem, overlay.concat = getitem, pairs.concat
        overlay.filters, overlay.tests = pairs.twin_filters(overlay.filters), pairs.twin_tests(overlay.tests)
    return overlay


# Globals whose result is a function of their arguments (and the row): every other global is taken to read
# something outside the row, and a traced render that calls it is not learned (pairs.outside). `strftime_now`
# reads the clock: its text is a fact of the trace (pairs.strftime_now).
_ROW_GLOBALS = frozenset({"range", "dict", "namespace", "cycler", "joiner", "raise_exception"})
_OUTSIDE_FILTERS = ("random",)


def _row_globals(globals_: dict) -> dict:
    """The environment's globals, as a new dict (the base environment's may be shared between templates)."""
    out = {}
    for name, value in globals_.items():
        if name == "strftime_now":
            out[name] = pairs.strftime_now
        elif name in _ROW_GLOBALS or not callable(value):
            out[name] = value
        else:
            out[name] = pairs.outside(value)
    return out


def compile_template(environment, source: str, for_twins: bool = False):
    """The template compiled in `_fast_sandbox(environment, for_twins)`. With `for_twins`, its output and `~`
    keep Twins (jinja's generated code calls `str` and `str_join` from its own namespace)."""
    overlay = _fast_sandbox(environment, for_twins)
    try:
        compiled = overlay.from_string(source)
    except SyntaxError as error:  # Python's, not the template's: code this generator wrote badly
        logger.warning("the chat template renders through jinja's own compiled code, slower: the fast code "
                       "generator wrote invalid Python for it (%s)", error)
        overlay.code_generator_class = CodeGenerator
        compiled = overlay.from_string(source)
    namespace = compiled.root_render_func.__globals__  # the generated module's, shared by its blocks and macros
    namespace_class = environment.globals.get("namespace")  # transformers' is a subclass of jinja's
    plain_reads = (_HAS_NAMESPACE_ATTRS and isinstance(namespace_class, type) and issubclass(namespace_class, Namespace)
                   and namespace_class.__getattribute__ is Namespace.__getattribute__)
    namespace["_Namespace"] = namespace_class if plain_reads else _NoNamespace
    namespace["LoopContext"] = _Loop
    namespace["_Str"] = str  # the pairs' template has its own `str` (below)
    namespace["_Text"] = pairs.TEXT if for_twins else str
    if for_twins:
        namespace["str"], namespace["str_join"], namespace["_Twin"] = pairs.output, pairs.str_join, pairs.Twin
    return compiled


class FastCodeGenerator(CodeGenerator):
    """Jinja's code generator, writing the shortcuts of the module docstring inline. Each site keeps the value
    it tests in its own local (`_fj<n>`), so nested sites never share one."""

    _sites = itertools.count()
    twin_methods: frozenset[str] = frozenset()  # methods called directly on a Twin too (TwinCodeGenerator)

    def _local(self) -> str:
        return f"_fj{next(self._sites)}"

    @optimizeconst
    def visit_Getattr(self, node: nodes.Getattr, frame: Frame) -> None:
        name = node.attr
        if self.environment.is_async or name.startswith("_") or name in _DICT_ATTRIBUTES:
            return super().visit_Getattr(node, frame)
        value, kind, attrs = self._local(), self._local(), self._local()
        # a dict: its key, or the Undefined the sandbox gives for a missing one
        self.write(f"(({value}[{name!r}] if {name!r} in {value} else environment.undefined(obj={value}, "
                   f"name={name!r})) if ({kind} := type({value} := ")
        self.visit(node.node, frame)
        self.write(")) is dict else ")
        if name in _LOOP_VALUES:
            self.write(f"{value}.{name} if {kind} is LoopContext else ")
        self.write(f"({attrs}[{name!r}] if {name!r} in ({attrs} := object.__getattribute__({value}, "
                   f"{_NAMESPACE_ATTRS!r})) else environment.getattr({value}, {name!r})) if {kind} is _Namespace else ")
        self.write(f"environment.getattr({value}, {name!r}))")

    @optimizeconst
    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        key = node.arg
        if self.environment.is_async or not (isinstance(key, nodes.Const) and type(key.value) is str):
            return super().visit_Getitem(node, frame)
        value = self._local()
        self.write(f"({value}[{key.value!r}] if type({value} := ")
        self.visit(node.node, frame)
        self.write(f") is dict and {key.value!r} in {value} else environment.getitem({value}, {key.value!r}))")

    @optimizeconst
    def visit_Test(self, node: nodes.Test, frame: Frame) -> None:
        test = self.environment.tests.get(node.name)
        if (self.environment.is_async or node.args or node.kwargs or node.dyn_args or node.dyn_kwargs
                or test not in (test_string, pairs.is_text)):
            return super().visit_Test(node, frame)
        self.write("isinstance(")  # `is string`: a str (or a Twin, whose text is one)
        self.visit(node.node, frame)
        self.write(", _Text)")

    @optimizeconst
    def visit_Call(self, node: nodes.Call, frame: Frame, forward_caller: bool = False) -> None:
        target = node.node
        if self.environment.is_async or forward_caller or node.dyn_args or node.dyn_kwargs:
            return super().visit_Call(node, frame, forward_caller=forward_caller)
        if isinstance(target, nodes.Getattr) and target.attr in _STR_METHODS:
            return self._str_method(node, target, frame)
        if isinstance(target, nodes.Name) and target.name == "namespace":
            value = self._local()
            self.write(f"({value}(*()")
            self.signature(node, frame)
            self.write(f") if ({value} := ")
            self.visit(target, frame)
            self.write(f") is _Namespace else environment.call(context, {value}")
            self.signature(node, frame, self._call_extra(frame))
            self.write("))")
            return None
        return super().visit_Call(node, frame, forward_caller=forward_caller)

    def _str_method(self, node: nodes.Call, target: nodes.Getattr, frame: Frame) -> None:
        method, value, kind = target.attr, self._local(), self._local()
        # The method is looked up before the arguments are evaluated, as in the environment's path.
        self.write(f"({value}.{method}(*()")
        self.signature(node, frame)
        self.write(f") if ({kind} := type({value} := ")
        self.visit(target.node, frame)
        self.write(")) is _Str")
        if method in self.twin_methods:
            self.write(f" or {kind} is _Twin")
        self.write(f" else environment.call(context, environment.getattr({value}, {method!r})")
        self.signature(node, frame, self._call_extra(frame))
        self.write("))")

    @staticmethod
    def _call_extra(frame: Frame) -> dict[str, str] | None:
        """The keyword arguments jinja passes `environment.call` inside loops and blocks."""
        extra = {**({"_loop_vars": "_loop_vars"} if frame.loop_frame else {}),
                 **({"_block_vars": "_block_vars"} if frame.block_frame else {})}
        return extra or None


class TwinCodeGenerator(FastCodeGenerator):
    """For templates rendered with Twins: the methods a Twin does on both texts are called on it directly."""

    twin_methods = pairs.METHODS

