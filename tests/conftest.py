"""Fixtures shared by the suite: the bundled example, tokenizers for real chat-template families."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DATA = ROOT / "examples" / "data"
EXAMPLE_TOKENIZER = ROOT / "examples" / "tokenizer"
# Real chat templates of several model families, kept beside the project (not copied into it).
TEMPLATES = Path(os.environ.get("SFT_CHAT_TEMPLATES", ROOT.parent / "shared" / "chat_templates"))

# For each template family: its special tokens and the tokens its template reads.
FAMILIES: dict[str, dict] = {
    "chatml": {"special": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"},
    "qwen2.5-instruct": {"special": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"},
    "llama-3-instruct": {"special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                         "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral-instruct": {"special": ["<s>", "</s>"], "bos_token": "<s>", "eos_token": "</s>"},
    "gemma-it": {"special": ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "bos_token": "<bos>",
                 "eos_token": "<eos>"},
    "phi-3": {"special": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "eos_token": "<|endoftext|>"},
    "llama-2-chat": {"special": ["<s>", "</s>"], "bos_token": "<s>", "eos_token": "</s>"},
    "zephyr": {"special": ["<|system|>", "<|user|>", "<|assistant|>", "</s>"], "eos_token": "</s>"},
    "granite-3.0-instruct": {"special": ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"],
                             "eos_token": "<|end_of_text|>"},
}


def read_template(family: str) -> str:
    """A template as its source repository says to load it: the indentation and line breaks that lay it
    out for reading are removed (its string literals spell newlines as \\n, so they are kept)."""
    return (TEMPLATES / f"{family}.jinja").read_text().replace("    ", "").replace("\n", "")


def build_family_tokenizer(family: str, out_dir: Path) -> Path:
    """The example BPE with a real family's chat template and special tokens, saved as a fast tokenizer."""
    from transformers import AutoTokenizer

    spec = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": spec["special"]})
    for key in ("bos_token", "eos_token"):
        if key in spec:
            setattr(tokenizer, key, spec[key])
    tokenizer.chat_template = read_template(family)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def family_tokenizer(tmp_path_factory):
    """family name → directory of a tokenizer with that family's template (built once per session)."""
    if not TEMPLATES.is_dir():
        pytest.fail(f"chat templates not found at {TEMPLATES} (set SFT_CHAT_TEMPLATES)")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_family_tokenizer(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


def example_rows() -> list[dict]:
    rows = []
    for path in sorted(EXAMPLE_DATA.glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return rows


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One Prefect test server (SQLite in a temp dir) for the tests that run flows, with its own PREFECT_HOME.

    Requested by those tests only: the rest of the suite never starts a server."""
    from prefect.settings import PREFECT_HOME, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    home = tmp_path_factory.mktemp("prefect-home")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PREFECT_HOME", str(home))
        env.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        env.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        with temporary_settings(updates={PREFECT_HOME: home}), prefect_test_harness():
            yield home
