"""transformers' Jinja environment for chat templates, run from transformers' own source without importing it.

`import transformers` scans its model folders and pulls in the hub client: ~0.35 s of a core, most of what a
run right after another spends before its first slice, and again in every encode-pool process. What a chat
template needs from it is two functions of `transformers/utils/chat_template_utils.py` that use only jinja2
and the standard library: the environment templates compile in (`_cached_compile_jinja_template`) and the
render that records `{% generation %}` spans (`_render_with_assistant_indices`).

So their code is read from the installed file and run as it is, with that module's absolute imports: the text
renders with transformers' code, whatever its version. Every global name the two functions read is checked
first (`symtable`); if the file, a function or a name is not as expected, transformers is imported instead.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import logging
import symtable
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("sft_tokenize")

SOURCE = ("utils", "chat_template_utils.py")
COMPILE, RENDER_GENERATION = "_cached_compile_jinja_template", "_render_with_assistant_indices"
# The one name the two functions read from a relative import: jinja2 is a dependency of this package.
STANDING_IN = {"is_jinja_available": lambda: True}


def compile_template(source: str):
    """`source` compiled as transformers compiles a chat template (a jinja2 Template)."""
    return _functions()[COMPILE](source)


def new_environment():
    """A new Jinja environment, configured as transformers configures the one each chat template compiles in."""
    return compile_template("").environment


def render_with_generation_spans(compiled, messages, tools, **kwargs) -> tuple[str, list]:
    """The text and the character spans of its `{% generation %}` blocks, as transformers records them."""
    return _functions()[RENDER_GENERATION](compiled, messages, tools, None, False, **kwargs)


@functools.cache
def _functions() -> dict[str, Callable[..., Any]]:
    try:
        return _from_source()
    except Exception as error:  # another layout of transformers: its own import gives the same functions
        logger.debug("chat templates: transformers imported (%s)", error)
    from transformers.utils import chat_template_utils as module

    return {COMPILE: module._compile_jinja_template, RENDER_GENERATION: module._render_with_assistant_indices}


def _from_source() -> dict[str, Callable[..., Any]]:
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise ImportError("transformers is not installed")
    path = Path(spec.origin).parent.joinpath(*SOURCE)
    tree = ast.parse(path.read_bytes(), str(path))
    kept = [node for node in tree.body if _kept(node)]
    defined = {node.name for node in kept if isinstance(node, ast.FunctionDef)}
    if defined != {COMPILE, RENDER_GENERATION}:
        raise LookupError(f"{path} defines {sorted(defined)}")
    module = ast.Module(kept, type_ignores=[])
    namespace: dict[str, Any] = {"__name__": "transformers.utils.chat_template_utils", **STANDING_IN}
    # Compiled from the tree, so that a traceback names the installed file's own lines.
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - transformers' own code, installed
    missing = _globals_read(ast.unparse(module)) - namespace.keys() - set(dir(builtins))
    if missing:
        raise NameError(f"{path}: the chat template functions read {sorted(missing)}")
    return {name: namespace[name] for name in defined}


def _kept(node: ast.stmt) -> bool:
    """The module's absolute imports, its `if is_jinja_available():` import block, and the two functions."""
    if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
        return True
    if isinstance(node, ast.If):
        return ast.unparse(node.test) == "is_jinja_available()"
    return isinstance(node, ast.FunctionDef) and node.name in (COMPILE, RENDER_GENERATION)


def _globals_read(source: str) -> set[str]:
    """Every global name a function of `source` (or a function or class inside one) reads."""
    names: set[str] = set()
    tables = list(symtable.symtable(source, "<transformers>", "exec").get_children())
    while tables:
        table = tables.pop()
        names |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
        tables.extend(table.get_children())
    return names
