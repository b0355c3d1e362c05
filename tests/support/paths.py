"""Where the suite finds the project, its bundled example and the installed commands (the reference chat
templates: support/reference_templates.py)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DATA = ROOT / "examples" / "data"
EXAMPLE_TOKENIZER = ROOT / "examples" / "tokenizer"
# The virtualenv's scripts: sft-tokenize, prefect.
BIN = Path(sys.executable).parent
