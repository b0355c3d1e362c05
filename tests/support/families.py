"""Tokenizers for real chat-template families: the example BPE given a family's template and control tokens,
so that masks are checked against the templates models ship with, without downloading a model."""

from __future__ import annotations

import json
from pathlib import Path

from support.paths import EXAMPLE_DATA, EXAMPLE_TOKENIZER
from support.reference_templates import template as reference_template

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
    return reference_template(family).replace("    ", "").replace("\n", "")


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


# -- current templates (modern/ in support/reference_templates.json, byte for byte as published) -------------------
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
    tokenizer.chat_template = template or reference_template(f"modern/{family}")
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def qwen3_with_generation_blocks() -> str:
    """Qwen3's template with each assistant turn's own output inside {% generation %} (its header outside)."""
    source = reference_template("modern/qwen3")
    branch = "{%- if loop.index0 > ns.last_query_index %}"
    turn_end = "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    assert source.count(branch) == 1 and source.count(turn_end) == 1
    source = source.replace("'<|im_start|>' + message.role + '\\n<think>\\n'", "'<think>\\n'")
    source = source.replace("'<|im_start|>' + message.role + '\\n' + content", "content")
    source = source.replace(branch, "{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}" + branch)
    return source.replace(turn_end, "        {{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n"
                                    "    {%- elif message.role == \"tool\" %}")


def build_metaspace_tokenizer(out_dir: Path) -> Path:
    """A SentencePiece-style tokenizer (BPE behind a Metaspace pre-tokenizer): no byte-level positions."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    rows = [json.loads(line) for line in (EXAMPLE_DATA / "chat-00000.jsonl").open()]
    corpus = [m["content"] for row in rows for m in row["messages"] if isinstance(m.get("content"), str)]
    special = ["<|im_start|>", "<|im_end|>", "<unk>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = (EXAMPLE_TOKENIZER / "chat_template.jinja").read_text()
    fast.save_pretrained(str(out_dir))
    return out_dir


def build_swallowing_sep_tokenizer(out_dir: Path) -> Path:
    """The example tokenizer with an added token `<sep>` that swallows the spaces around it (lstrip, rstrip): its
    ids cover fewer bytes than the text, so the fast encoder cannot place a row holding it."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    base.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    base.save_pretrained(str(out_dir))
    return out_dir


def build_large_vocab_tokenizer(out_dir: Path, size: int = 150_000) -> Path:
    """The example BPE grown to `size` tokens (a Qwen-sized vocabulary) by merges of its own tokens: a tokenizer
    whose fast encoder takes seconds to build, as real ones do."""
    import random
    import shutil

    shutil.copytree(EXAMPLE_TOKENIZER, out_dir, dirs_exist_ok=True)
    config = json.loads((EXAMPLE_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, merges = config["model"]["vocab"], config["model"]["merges"]
    # Parts of at most 8 characters make tokens of at most 16: drawn from all tokens, most pairs were longer and
    # drawn again (8M draws, 8 s).
    parts, rng = [token for token in vocab if len(token) <= 8], random.Random(0)
    while len(vocab) < size:
        left, right = rng.choice(parts), rng.choice(parts)
        if (token := left + right) not in vocab:
            vocab[token] = len(vocab)
            merges.append([left, right])
            if len(token) <= 8:
                parts.append(token)
    (out_dir / "tokenizer.json").write_text(json.dumps(config), encoding="utf-8")
    return out_dir
