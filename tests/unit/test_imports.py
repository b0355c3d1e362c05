"""The package's shape holds: the read side loads nothing of the build side, the data plane no Prefect, and no
two modules import each other in a circle. Each check imports in a fresh interpreter, as a trainer would."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sft_tokenize"
DATA_PLANE = ("sources", "chat", "encoding", "build", "read", "format")
ON_DISK = ("errors", "files")  # the neutral modules both sides may use


def modules(subpackage: str | None = None) -> list[str]:
    root = PACKAGE / subpackage if subpackage else PACKAGE
    return sorted("sft_tokenize." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
                  for p in root.rglob("*.py"))


def loaded_after_importing(names: list[str]) -> set[str]:
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_the_read_side_loads_no_build_code_no_prefect_no_jinja_and_no_tokenizers():
    loaded = loaded_after_importing(modules("read"))
    ours = {m for m in loaded if m.startswith("sft_tokenize.")}
    allowed = ("sft_tokenize.read", "sft_tokenize.format") + tuple(f"sft_tokenize.{m}" for m in ON_DISK)
    assert {m for m in ours if not m.startswith(allowed)} == set()
    assert {m.split(".")[0] for m in loaded} & {"prefect", "jinja2", "tokenizers", "transformers", "torch"} == set()


def test_the_public_api_for_reading_loads_the_read_side_only():
    loaded = loaded_after_importing(["sft_tokenize"])
    assert {m for m in loaded if m.startswith("sft_tokenize.")} == set()
    code = ("import sys, sft_tokenize as s\n"
            "s.open_cache, s.packed_sequences, s.for_trl, s.PackOptions\n"
            "print(sorted(m for m in sys.modules if m.startswith('sft_tokenize.') and '.read' not in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert all(name.split(".")[1] in ("format", *ON_DISK) for name in eval(out))


@pytest.mark.parametrize("subpackage", DATA_PLANE)
def test_the_data_plane_imports_no_prefect(subpackage):
    loaded = loaded_after_importing(modules(subpackage))
    assert not {m for m in loaded if m == "prefect" or m.startswith("prefect.")}
    assert not {m for m in loaded if m.startswith(("sft_tokenize.flows", "sft_tokenize.tasks"))}


def _statements(tree: ast.Module, top_level: bool) -> list[ast.stmt]:
    """Every statement (top_level: only those run at import, less `if TYPE_CHECKING:` blocks)."""
    if not top_level:
        return list(ast.walk(tree))
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def _imported(module: str, tree: ast.Module, top_level: bool = False) -> set[str]:
    """The project modules `module` imports: at import time (top_level), or anywhere in its code."""
    is_package = (PACKAGE.joinpath(*module.split(".")[1:]) / "__init__.py").exists()
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in _statements(tree, top_level):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in set(modules())}


def _source(module: str) -> ast.Module:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    return ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())


def test_the_read_side_never_names_the_build_side_even_inside_a_function():
    for module in modules("read"):
        named = _imported(module, _source(module))
        assert not {m for m in named if m.startswith(("sft_tokenize.build", "sft_tokenize.chat",
                                                      "sft_tokenize.encoding", "sft_tokenize.sources"))}, module


def test_a_checkout_is_one_package_whose_flows_are_real_modules():
    """No folder of the repository imports as a subpackage, and the deployment entrypoints at the top name the
    package's own flow objects (not a second copy of their module)."""
    code = ("import importlib, sys\n"
            "for name in ('sft_tokenize.tests', 'sft_tokenize.benchmarks', 'sft_tokenize.sft_tokenize'):\n"
            "    try: importlib.import_module(name)\n"
            "    except ModuleNotFoundError: pass\n"
            "    else: sys.exit(name + ' imported')\n"
            "from prefect.flows import load_flow_from_entrypoint\n"
            "from sft_tokenize.flows import tokenize_dataset, tokenize_recipe\n"
            "for module in (tokenize_dataset, tokenize_recipe):\n"
            "    name = module.__name__.rpartition('.')[2]\n"
            "    assert load_flow_from_entrypoint(f'flows/{name}.py:{name}') is getattr(module, name), name\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    for module in ("flows/cli.py", "flows/tokenize_dataset.py", "tasks/tokenize_slice.py"):
        assert (PACKAGE / module).is_file()  # what an editor or a type checker resolves `sft_tokenize.<module>` to


def test_the_on_disk_format_depends_on_neither_side():
    loaded = loaded_after_importing(modules("format"))
    allowed = ("sft_tokenize.format",) + tuple(f"sft_tokenize.{m}" for m in ON_DISK)
    assert {m for m in loaded if m.startswith("sft_tokenize.") and not m.startswith(allowed)} == set()


def test_no_import_circle_among_the_packages_modules():
    """At import time; an import inside a function (a method reaching a sibling module) runs after both loaded."""
    graph = {module: _imported(module, _source(module), top_level=True) - {module} for module in modules()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, trail: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle.extend(trail[trail.index(nxt):] + [node, nxt] if nxt in trail else [node, nxt])
                return True
            if nxt not in state and visit(nxt, trail + [node]):
                return True
        state[node] = 2
        return False

    assert not any(visit(m, []) for m in graph if m not in state), " -> ".join(cycle)
