"""The cache fingerprint: a hash of everything that changes the cache's bytes, and of nothing else.

Kept apart from the steps it names (as HF datasets keeps its fingerprinting apart from its transforms):
plan.py gathers the inputs, this module only turns them into a stable hash. Inputs are content-aware:
file size and mtime_ns (or ETag / version id), the tokenizer's files, not its name. The slice count and
the runner are not inputs: they do not change the rows. A shard's key (keys.py) hashes the tokenization
inputs (all but the sources) with the bytes its slice reads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def fingerprint(inputs: dict[str, Any], digits: int = 16) -> str:
    """`digits` hex digits (16 by default) of the SHA-256 of the inputs' canonical JSON."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:digits]


def tokenization_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """What changes how a row is tokenized: the cache's inputs without the sources' identity. Together with
    the bytes a slice reads it keys the slice's shard, so versions sharing input bytes share shards."""
    return {key: value for key, value in inputs.items() if key not in ("sources", "ignored_files")}


def hash_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def hash_directory(directory: Path) -> dict[str, str]:
    """SHA-256 of every file directly in `directory` (a tokenizer's files), by name."""
    digests = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digests[path.name] = digest.hexdigest()
    return digests
