"""Where the suite finds the project, its bundled example, the chat templates and the installed commands."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DATA = ROOT / "examples" / "data"
EXAMPLE_TOKENIZER = ROOT / "examples" / "tokenizer"
# Real chat templates of several model families, kept beside the project (not copied into it).
TEMPLATES = Path(os.environ.get("SFT_CHAT_TEMPLATES", ROOT.parent / "shared" / "chat_templates"))
# The virtualenv's scripts: sft-tokenize, prefect.
BIN = Path(sys.executable).parent
