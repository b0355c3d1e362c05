"""A byte-level BPE that merges a space or a newline with the text after it, as the tokenizers of Qwen and GPT-4
do: the example BPE behind Qwen2's pre-tokenizer split (a space or newline run joins the word after it), with
the merges that make " H", " .", " 中" and "\\n\\n" one token each, so that a template's separator and the first
characters of an answer share a token."""

from __future__ import annotations

import json
from pathlib import Path

from support.paths import EXAMPLE_TOKENIZER

# Qwen2's pre-tokenizer pattern (its tokenizer.json).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Merges of the example BPE's own tokens, after all of its merges: "Ġ" is a space, "Ċ" a newline, "ä¸Ńæĸ" the
# bytes of "中" and the first two of "文".
EDGE_MERGES = (("Ġ", "H"), ("Ġ", "."), ("Ġ", "ä¸Ńæĸ"), ("Ċ", "Ċ"))
CONTROL = ("<|im_start|>", "<|im_end|>", "<|assistant|>", "<|end|>")


def build_edge_merging_tokenizer(out_dir: Path, template: str, eos_token: str = "<|im_end|>",
                                 special: tuple[str, ...] = ()) -> Path:
    """The tokenizer (see the module docstring) with `template` as its chat template and `special` control tokens
    besides its own, saved as a fast tokenizer."""
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((EXAMPLE_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, merges = config["model"]["vocab"], config["model"]["merges"]
    for left, right in EDGE_MERGES:
        assert left in vocab and right in vocab and left + right not in vocab
        vocab[left + right] = len(vocab)
        merges.append([left, right])
    config["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    base = out_dir / "base"
    base.mkdir(exist_ok=True)
    for name in ("tokenizer_config.json",):
        (base / name).write_bytes((EXAMPLE_TOKENIZER / name).read_bytes())
    (base / "tokenizer.json").write_text(json.dumps(config), encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_special_tokens({"additional_special_tokens": [*CONTROL, *special]})
    tokenizer.eos_token = eos_token
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
