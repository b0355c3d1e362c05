"""The package's shape holds: its modules in layers with no import against them and no circle (imports inside
functions count), the read side loading nothing of the build side, the data plane no Prefect. The loading checks
import in a fresh interpreter, as a trainer would."""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sft_tokenize.read.cache import open_cache

PACKAGE = Path(__file__).resolve().parents[2] / "sft_tokenize"
DATA_PLANE = ("sources", "chat", "encoding", "build", "read", "export", "consumers", "format")
# the base layer, which every layer may use
BASE = ("errors", "files", "remote_requests", "fingerprint", "version", "format", "flags", "startup_gc")


def modules(subpackage: str | None = None) -> list[str]:
    root = PACKAGE / subpackage if subpackage else PACKAGE
    return sorted(".".join(("sft_tokenize", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
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
    allowed = ("sft_tokenize.read",) + tuple(f"sft_tokenize.{m}" for m in BASE)
    assert {m for m in ours if not m.startswith(allowed)} == set()
    assert {m.split(".")[0] for m in loaded} & {"prefect", "jinja2", "tokenizers", "transformers", "torch"} == set()


def test_an_export_loads_the_read_side_only_no_build_code_no_prefect_no_jinja_and_no_tokenizers():
    loaded = loaded_after_importing(modules("export"))
    ours = {m for m in loaded if m.startswith("sft_tokenize.")}
    allowed = ("sft_tokenize.read", "sft_tokenize.export") + tuple(f"sft_tokenize.{m}" for m in BASE)
    assert {m for m in ours if not m.startswith(allowed)} == set()
    assert {m.split(".")[0] for m in loaded} & {"prefect", "jinja2", "tokenizers", "transformers", "torch"} == set()


def test_the_public_api_for_reading_loads_the_read_side_only():
    loaded = loaded_after_importing(["sft_tokenize"])
    assert {m for m in loaded if m.startswith("sft_tokenize.")} == {"sft_tokenize.version"}
    code = ("import sys, sft_tokenize as s\n"
            "s.open_cache, s.packed_sequences, s.for_trl, s.PackOptions\n"
            "print(sorted(m for m in sys.modules if m.startswith('sft_tokenize.') and '.read' not in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert all(name.split(".")[1] in BASE for name in eval(out))


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
    known = set(modules())
    return {name for name in found if name in known}


def _source(module: str) -> ast.Module:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    return ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())


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
    for module in ("cli/main.py", "flows/tokenize_dataset.py", "tasks/tokenize_slice.py"):
        assert (PACKAGE / module).is_file()  # what an editor or a type checker resolves `sft_tokenize.<module>` to


def test_the_on_disk_format_depends_on_neither_side():
    loaded = loaded_after_importing(modules("format"))
    allowed = tuple(f"sft_tokenize.{m}" for m in BASE)
    assert {m for m in loaded if m.startswith("sft_tokenize.") and not m.startswith(allowed)} == set()


# The layers, lowest first, and what each may import besides itself. Every import counts: at the top, inside a
# function, under `if TYPE_CHECKING:`. read sits beside build: it imports the base only (a trainer loads nothing
# else), while build may use what read defines of a cache (its layouts, the mixtures a recipe asks for).
LAYERS = {
    "base": (),  # BASE
    "server": ("base",),  # the embedded Prefect server: the flows start it, the command line shows and stops it
    "sources": ("base",),
    "chat": ("base", "sources"),
    "encoding": ("base", "sources", "chat"),
    "read": ("base",),
    "export": ("base", "read"),  # a published cache in another trainer's format: it reads caches only
    "consumers": ("base", "read"),  # the trainers' own data paths run over a cache (verify --trainer)
    "build": ("base", "sources", "chat", "encoding", "read"),
    "tasks": ("base", "sources", "chat", "encoding", "read", "build"),
    "flows": ("base", "server", "sources", "chat", "encoding", "read", "export", "consumers", "build", "tasks"),
    # sft_tokenize/__init__.py
    "api": ("base", "server", "sources", "chat", "encoding", "read", "export", "consumers", "build", "tasks", "flows"),
    # the command line, on top: nothing of the package imports it
    "cli": ("base", "server", "sources", "chat", "encoding", "read", "export", "consumers", "build", "tasks", "flows",
            "api"),
}
# The only imports allowed against the layers or around a circle, each with why. (importer, imported): why.
BACK_EDGES = {
    ("sft_tokenize.read.cache", "sft_tokenize.read.packed_sequences"):
        "TokenizedCache.packed() is public API: the cache packs itself through packed_sequences, which opens caches",
}


def layer(module: str) -> str:
    part = module.split(".")[1] if "." in module else "api"
    return "base" if part in BASE else part


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package's modules it imports anywhere in its code."""
    return {module: _imported(module, _source(module)) - {module} for module in modules()}


def test_every_module_belongs_to_a_layer():
    assert {m: layer(m) for m in modules() if layer(m) not in LAYERS} == {}


def test_no_module_imports_from_a_layer_above_its_own():
    upward = sorted(f"{module} -> {name} ({layer(module)} imports {layer(name)})"
                    for module, names in import_graph().items() for name in names
                    if layer(name) != layer(module) and layer(name) not in LAYERS[layer(module)]
                    and (module, name) not in BACK_EDGES)
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_import_circle_among_the_packages_modules():
    """Counting every import, inside functions too: a circle is a pair of modules that cannot be understood,
    tested or moved one without the other."""
    graph = {module: {n for n in names if (module, n) not in BACK_EDGES} for module, names in import_graph().items()}
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


def test_each_allowed_back_edge_is_still_an_import():
    """An allowance outlives its reason unnoticed: each must name an import that exists."""
    graph = import_graph()
    assert [edge for edge in BACK_EDGES if edge[1] not in graph.get(edge[0], ())] == []


def test_the_modules_a_run_imports_ahead_are_real_modules():
    """A first run imports api.RUN_MODULES while its server boots, and a resident process before its command,
    both ignoring failures: a misspelt or moved name would only make runs slower, so it is caught here."""
    from sft_tokenize.flows.api import RUN_MODULES

    installed = [name for name in RUN_MODULES if name != "fastokens" or _installed("fastokens")]
    assert set(installed) <= loaded_after_importing(installed)


def test_a_run_that_writes_and_publishes_shards_loads_neither_datasets_nor_pandas(tmp_path):
    """The shards and dataset_info.json are written with pyarrow alone: datasets and the pandas it imports cost a
    first run ~1 s of CPU (tests/unit/test_shard_schema.py checks that the bytes are datasets')."""
    from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER

    code = ("import json, sys\nfrom sft_tokenize.build.options import TokenizeOptions\n"
            "from sft_tokenize.build.protocol import run_locally\n"
            f"run_locally(TokenizeOptions(sources=[{str(EXAMPLE_DATA)!r}], tokenizer={str(EXAMPLE_TOKENIZER)!r}, "
            f"cache_dir={str(tmp_path)!r}))\n"
            "print(json.dumps(sorted(m for m in ('datasets', 'pandas') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []
    assert any(path.name.startswith("data-") for path in tmp_path.iterdir())


def test_a_runs_length_report_and_a_trainers_batches_load_no_pandas(example_cache):
    """pyarrow's `to_numpy` imports pandas (~0.2 s) even for a view: the report a run writes after publishing and
    a trainer's batches read the cache's columns as views of their buffers instead (read/numpy_views.py)."""
    code = ("import json, sys\nfrom sft_tokenize.flows.length_report import cache_costs\n"
            "from sft_tokenize.read.cache import open_cache\nfrom sft_tokenize.read.row_batches import row_batches\n"
            f"report = cache_costs({str(example_cache)!r})\ncache = open_cache({str(example_cache)!r})\n"
            "batch = next(iter(row_batches(cache, 8)))\n"
            "print(json.dumps([report['tokens'], int(cache.lengths.sum()), 'pandas' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    tokens, lengths, pandas = json.loads(out.strip().splitlines()[-1])
    cache = open_cache(example_cache)
    expected = sum(len(row["input_ids"]) for row in cache)
    assert (tokens, lengths, pandas) == (expected, expected, False)


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_no_private_name_crosses_a_module():
    """A name another module imports is a seam, and public: an underscore name stays in its own module."""
    crossing = sorted(f"{module} imports {node.module}.{alias.name}" for module in modules()
                      for node in ast.walk(_source(module)) if isinstance(node, ast.ImportFrom)
                      and (node.module or "").startswith("sft_tokenize") for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__"))
    assert crossing == []


def test_the_command_line_reads_its_options_without_the_encoder_numpy_or_pyarrow():
    """Every command parses its arguments first (`--help`, a usage error, `server status` end there): the options'
    declarations load neither the encoder nor the array libraries (0.18 s of CPU against 0.55 s with them)."""
    loaded = loaded_after_importing(["sft_tokenize.cli.main"])
    heavy = {"numpy", "pyarrow", "jinja2", "tokenizers", "prefect", "fsspec"}
    assert {m.split(".")[0] for m in loaded} & heavy == set()
    ours = {m for m in loaded if m.startswith(("sft_tokenize.encoding.", "sft_tokenize.chat."))}
    assert ours <= {"sft_tokenize.encoding.cores"}


SERVER_COMMANDS = """
import json, sys
from sft_tokenize.cli.main import main
codes = [main(["server", "status"]), main(["server", "stop"])]
print(json.dumps({"codes": codes, "prefect": sorted(m for m in sys.modules if m.split(".")[0] == "prefect")}))
"""


@pytest.mark.parametrize("named", [True, False])
def test_server_status_and_stop_import_prefect_only_for_a_home_the_environment_leaves_unnamed(tmp_path, named):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["HOME"] = str(tmp_path)  # Prefect's default home: ~/.prefect
    if named:
        env["PREFECT_HOME"] = "~/elsewhere"  # expanded, as Prefect's setting expands it
    done = subprocess.run([sys.executable, "-c", SERVER_COMMANDS], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    result = json.loads(lines[-1])
    assert result["codes"] == [0, 0] and bool(result["prefect"]) is not named
    home = tmp_path / ("elsewhere" if named else ".prefect")
    assert f"PREFECT_HOME: {home}" in lines and "no embedded server is running" in lines
