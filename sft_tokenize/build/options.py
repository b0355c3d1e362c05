"""The options of one tokenization run: what the CLI, the flow's typed form and the data plane share."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sft_tokenize.read.layouts import Layout

Format = Literal["auto", "chat", "alpaca", "prompt-completion", "text"]
TrainOn = Literal["all_assistant", "last_assistant", "completion", "all"]
Truncation = Literal["truncate", "drop"]
OnBadRow = Literal["raise", "skip"]
ExtraColumn = Literal["labels", "attention_mask"]
ReasoningTurns = Literal["as-rendered", "expand"]
SpecialText = Literal["literal", "error", "keep"]
Encoder = Literal["auto", "hf", "fastokens"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(size: int | str) -> int:
    """'256MB' → 256_000_000, '1GiB' → 2**30, 4096 → 4096."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"not a size: {size!r} (examples: 64MB, 1GiB, 500000)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    binary = "i" in unit
    prefix = unit[:1] if unit[:1] in "kmgt" else ""
    scale = 1024 ** ("kmgt".index(prefix) + 1) if binary and prefix else _UNITS[prefix]
    return int(number * scale)


class TokenizeOptions(BaseModel):
    """Everything that decides what a run reads and writes. Shown as the flow's form in the Prefect UI."""

    model_config = ConfigDict(extra="forbid")

    sources: list[str] = Field(
        description="Files, globs, directories, fsspec URLs, or hub:NAME for a Hugging Face hub dataset."
    )
    tokenizer: str = Field(description="A local tokenizer directory or a Hugging Face hub model name.")
    cache_dir: str = Field(description="The cache root; published caches and staging live under it.")
    name: str | None = Field(None, description="Cache name; defaults to the first source's stem.")
    format: Format = "auto"
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Column names by role, e.g. {'messages': 'conversations', 'completion': 'response'}.",
    )
    train_on: TrainOn = "all_assistant"
    max_length: int | None = Field(None, gt=0)
    truncation: Truncation = "truncate"
    chat_template: str | None = Field(None, description="A .jinja file or template text overriding the tokenizer's.")
    template_kwargs: dict = Field(
        default_factory=dict,
        description="Extra variables for the chat template, e.g. {'enable_thinking': false} or a fixed date_string.",
    )
    reasoning_turns: ReasoningTurns = Field(
        "as-rendered",
        description="'expand': one more row per assistant turn whose reasoning the template drops in history.",
    )
    special_text: SpecialText = Field(
        "literal",
        description="A control token's text inside a message: 'literal' encodes it as plain text, 'error' rejects "
                    "the row, 'keep' encodes it as the control token (as apply_chat_template does).",
    )
    encoder: Encoder = Field(
        "auto",
        description="Who turns text into ids: 'hf' (tokenizers), 'fastokens' (faster, where it gives the same ids "
                    "and its tokens can be placed in the text), 'auto' (fastokens if installed and exact, else hf). "
                    "Output is identical, so it is not part of the cache's fingerprint.",
    )
    tokenizer_revision: str | None = None
    split: str = Field("train", description="Split of a hub dataset or of a saved DatasetDict.")
    subset: str | None = Field(None, description="Config (subset) of a hub dataset.")
    revision: str | None = Field(None, description="Revision of a hub dataset.")
    extra_columns: list[ExtraColumn] = Field(default_factory=list)
    layout: Layout = Field("skyrl", description="The trainer whose columns the cache holds: skyrl (input_ids, "
                           "loss_mask), trl (input_ids, labels), axolotl or llama-factory (input_ids, "
                           "attention_mask, labels).")
    on_bad_row: OnBadRow = "raise"
    shard_size: str = Field("256MB", description="Input bytes per slice (one task and one shard each).")
    max_row_bytes: str = Field(
        "2MB", description="Largest JSON line read: a longer one is a bad row (row_too_large), never decoded. "
        "Each MB of a row in flight costs a worker about 180 MB while it is tokenized.")
    writer_batch_rows: int = Field(1000, gt=0)
    writer_batch_bytes: str = "64MB"
    trust_remote_code: bool = False
    storage_options: dict = Field(default_factory=dict, description="fsspec options for remote sources.")

    @field_validator("name")
    @classmethod
    def _name_stays_inside_the_cache_root(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
            raise ValueError(
                f"cache name {name!r} must be letters, digits, '.', '_' or '-' and start with a letter or "
                "digit (no path separators)"
            )
        return name

    @field_validator("shard_size", "writer_batch_bytes", "max_row_bytes")
    @classmethod
    def _is_a_size(cls, size: str) -> str:
        if parse_size(size) <= 0:
            raise ValueError(f"size must be positive: {size!r}")
        return size

    @property
    def cache_root(self) -> Path:
        return Path(os.path.abspath(Path(self.cache_dir).expanduser()))  # normalised: no `in/../caches`
