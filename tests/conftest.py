"""Fixtures shared by the suite: the bundled example, tokenizers for real chat-template families, a migrated
Prefect home for the CLI's subprocesses."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The CLI's runs stop their embedded server as they leave (`--server-idle 0`): none outlives its test, nor the suite.
# The tests of the warm server pass --server-idle themselves, and stop what they start.
os.environ["SFT_TOKENIZE_SERVER_IDLE"] = "0"
# Prepared tokenizers (sft_tokenize/encoding/prepared.py) in one directory of this test run, not in the user's cache.
if "SFT_TOKENIZE_HOME" not in os.environ:
    os.environ["SFT_TOKENIZE_HOME"] = tempfile.mkdtemp(prefix="sft-tokenize-home-")
    atexit.register(shutil.rmtree, os.environ["SFT_TOKENIZE_HOME"], True)

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


@pytest.fixture(scope="session")
def migrated_prefect_home(tmp_path_factory) -> Path:
    """A PREFECT_HOME whose database is migrated once, copied wherever a run or a server needs one: migrating a
    new database takes several seconds of every first run."""
    home = tmp_path_factory.mktemp("prefect-home-template")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"],
                   env={**environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                   check=True, capture_output=True, timeout=300)
    return home


@pytest.fixture
def prefect_home(tmp_path, migrated_prefect_home) -> Path:
    return Path(shutil.copytree(migrated_prefect_home, tmp_path / "prefect-home"))


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


def _built_once(tmp_path_factory, build):
    """family name → directory of a tokenizer made by build(family, directory), built once per session."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="session")
def family_tokenizer(tmp_path_factory):
    """family name → directory of a tokenizer with that family's template (built once per session)."""
    if not TEMPLATES.is_dir():
        pytest.fail(f"chat templates not found at {TEMPLATES} (set SFT_CHAT_TEMPLATES)")
    return _built_once(tmp_path_factory, build_family_tokenizer)


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


# -- current templates (shared/chat_templates/modern/, byte for byte as published) --------------------------
# For each: its special tokens, its ordinary added tokens, BOS/EOS (SOURCES.md beside the templates), and the
# tokens that end an assistant turn, which the tests' own definition of a trained turn uses.
_QWEN = {"special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
         "added": ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
         "eos_token": "<|im_end|>", "end_of_turn": ["<|im_end|>"]}
_DEEPSEEK = {"special": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
             "added": ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"] + [
                 f"<｜tool▁{name}｜>" for name in ("calls▁begin", "calls▁end", "call▁begin", "call▁end",
                                                  "outputs▁begin", "outputs▁end", "output▁begin", "output▁end", "sep")],
             "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
             "end_of_turn": ["<｜end▁of▁sentence｜>"]}
_LLAMA3 = {"special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"],
           "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "end_of_turn": ["<|eot_id|>", "<|eom_id|>"]}
_MISTRAL = {"special": ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                        "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[ARGS]",
                        "[CALL_ID]"], "bos_token": "<s>", "eos_token": "</s>", "end_of_turn": ["</s>"]}
_GEMMA = {"special": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                      "<end_of_image>"], "bos_token": "<bos>", "eos_token": "<eos>", "end_of_turn": ["<end_of_turn>"]}
_KIMI = {"special": ["[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                     "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                     "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>"],
         "added": ["<think>", "</think>"],
         "bos_token": "[BOS]", "eos_token": "[EOS]", "end_of_turn": ["<|im_end|>"]}
MODERN_FAMILIES: dict[str, dict] = {
    "qwen3": _QWEN, "qwen3-coder": _QWEN, "qwen2.5": _QWEN, "qwq-32b": _QWEN,
    "deepseek-r1": _DEEPSEEK, "deepseek-v3": _DEEPSEEK, "deepseek-v3.1": _DEEPSEEK,
    "gpt-oss": {"special": ["<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                            "<|return|>", "<|call|>"], "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                "end_of_turn": ["<|end|>", "<|return|>", "<|call|>"]},
    "llama3.1": _LLAMA3, "llama3.2": _LLAMA3, "llama3.3": _LLAMA3,
    "llama4": {"special": ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
                           "<|eom|>", "<|python_start|>", "<|python_end|>", "<|image|>", "<|finetune_right_pad|>"],
               "bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "end_of_turn": ["<|eot|>", "<|eom|>"]},
    "gemma2": _GEMMA, "gemma3": _GEMMA,
    "mistral-nemo-v3": _MISTRAL, "mistral-small-2501-v7": _MISTRAL, "mistral-small-3.1-v7": _MISTRAL,
    "phi-4": {"special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_sep|>", "<|dummy_85|>"],
              "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "end_of_turn": ["<|im_end|>"]},
    "smollm3": {"special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                "added": ["<think>", "</think>", "<tool_call>", "</tool_call>"], "eos_token": "<|im_end|>",
                "end_of_turn": ["<|im_end|>"]},
    "glm-4.5": {"special": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                            "<|endoftext|>"],
                "added": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                          "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>", "/nothink"],
                "eos_token": "<|endoftext|>", "end_of_turn": ["<|user|>", "<|observation|>", "<|endoftext|>"]},
    "kimi-k2": _KIMI, "kimi-k2-thinking": _KIMI,
    "granite-3.3": {"special": ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>",
                                "<|start_of_cite|>", "<|end_of_cite|>", "<|start_of_plugin|>", "<|end_of_plugin|>"],
                    "bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>", "end_of_turn": ["<|end_of_text|>"]},
    "olmo2": {"special": ["<|pad|>", "<|endoftext|>"], "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "end_of_turn": ["<|endoftext|>"]},
    "command-r": {"special": ["<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                              "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<PAD>"],
                  "bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>",
                  "end_of_turn": ["<|END_OF_TURN_TOKEN|>"]},
}


def build_modern_tokenizer(family: str, out_dir: Path, template: str | None = None) -> Path:
    """The example BPE with a current family's control tokens and its template as published."""
    from transformers import AutoTokenizer

    spec = MODERN_FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": spec["special"]})
    tokenizer.add_tokens(spec.get("added", []))
    for key in ("bos_token", "eos_token"):
        if key in spec:
            setattr(tokenizer, key, spec[key])
    tokenizer.chat_template = template or (TEMPLATES / "modern" / f"{family}.jinja").read_text()
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def modern_tokenizer(tmp_path_factory):
    """family name → directory of a tokenizer with that family's current template (built once per session)."""
    if not (TEMPLATES / "modern").is_dir():
        pytest.fail(f"chat templates not found at {TEMPLATES / 'modern'} (set SFT_CHAT_TEMPLATES)")
    return _built_once(tmp_path_factory, build_modern_tokenizer)


@pytest.fixture(scope="session")
def modern_tokenizers(modern_tokenizer):
    """family name → that family's tokenizer, loaded (once per session)."""
    from sft_tokenize.encoding.chat_encoder import load_tokenizer

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_tokenizer(modern_tokenizer(family))
        return loaded[family]

    return get
