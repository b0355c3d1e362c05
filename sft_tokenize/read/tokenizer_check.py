"""Whether a trainer's tokenizer is the one a cache was built with, from what the manifest recorded.

    open_cache(path, tokenizer=tokenizer)      # warns (TokenizerMismatch) naming what differs

The manifest keeps the SHA-256 of every file of the build's tokenizer directory (`fingerprint_inputs.
tokenizer_files`) and of a chat template given apart (`chat_template_override`). A tokenizer loaded from a local
directory is compared file by file; any tokenizer is compared by its chat template's text, where the manifest
holds that template's digest (a `chat_template.jinja` file, or the override). No tokenizer library is imported:
the tokenizer is only read (`name_or_path`, `chat_template`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sft_tokenize.fingerprint import hash_directory, hash_text

TEMPLATE_FILE = "chat_template.jinja"


class TokenizerMismatch(UserWarning):
    """The trainer's tokenizer or chat template is not the one the cache was built with."""


def tokenizer_differences(manifest: dict[str, Any], tokenizer: Any) -> list[str]:
    """What differs between `tokenizer` (a tokenizer object or a tokenizer directory) and the cache's; empty when
    nothing recorded differs."""
    inputs = manifest.get("fingerprint_inputs", {})
    recorded: dict[str, str] = inputs.get("tokenizer_files") or {}
    differences = []
    directory = tokenizer if isinstance(tokenizer, (str, Path)) else getattr(tokenizer, "name_or_path", None)
    if directory and os.path.isdir(directory):
        present = hash_directory(Path(directory))
        changed = sorted(name for name, digest in recorded.items() if present.get(name) != digest)
        if changed:
            differences.append(f"its files {', '.join(changed)} differ from those the cache was built with "
                               f"({manifest.get('tokenizer')})")
    template = None if isinstance(tokenizer, (str, Path)) else getattr(tokenizer, "chat_template", None)
    expected = inputs.get("chat_template_override") or recorded.get(TEMPLATE_FILE)
    if isinstance(template, str) and expected and hash_text(template) != expected and not differences:
        differences.append("its chat template differs from the one the cache was built with")
    return differences


def mismatch_message(path: Path, differences: list[str]) -> str:
    return (f"{path}: the tokenizer given is not the one this cache was built with: {'; '.join(differences)}. The "
            "cache's token ids and loss masks are those of its own tokenizer and template; train with that "
            "tokenizer, or rebuild the cache with yours")
