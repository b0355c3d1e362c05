"""Where the suite finds the project, its bundled example and the installed commands (the reference chat
templates: support/reference_templates.py), and how it loads a file that is not in a package as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DATA = ROOT / "examples" / "data"
EXAMPLE_TOKENIZER = ROOT / "examples" / "tokenizer"
# The virtualenv's scripts: sft-tokenize, prefect.
BIN = Path(sys.executable).parent


def file_module(path: Path, name: str) -> ModuleType:
    """The Python file at `path` (a benchmark script, a file of a wheel that cannot be imported whole) loaded as the
    module `name`, registered in sys.modules: dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
