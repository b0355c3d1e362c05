"""What changed between two caches (two versions of one name, or any two): `sft-tokenize diff OLD NEW`.

    d = diff_caches(old_path, new_path)
    d.differs        # the fingerprint inputs that differ: [(input, old, new)], a tokenizer's files one by one
    d.added, d.removed, d.changed, d.trained_delta, d.changed_rows   # rows, and trained tokens per row

Rows are matched by position when both caches were built from the same sources (same files, sizes and mtimes:
row i of each is the same input row, however differently it was tokenized or masked), and by content (token ids
and mask) otherwise: a row then is unchanged, added or removed, never "changed". Per row, only a 64-bit digest of
its ids and mask and its trained-token count are kept; rows are read a batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from sft_tokenize.read.cache import TokenizedCache, open_cache
from sft_tokenize.read.row_batches import row_batches


def row_digests(cache: TokenizedCache) -> tuple[np.ndarray, np.ndarray]:
    """Each row's 64-bit digest of its ids and mask, and its trained tokens."""
    digests = np.empty(len(cache), dtype=np.uint64)
    trained = np.empty(len(cache), dtype=np.int64)
    for batch in row_batches(cache):
        offsets, ids, mask = batch.offsets, batch.input_ids, batch.loss_mask
        for i in range(len(batch)):
            a, b = int(offsets[i]), int(offsets[i + 1])
            digest = xxhash.xxh3_64(ids[a:b])
            digest.update(mask[a:b])
            digests[batch.first + i] = digest.intdigest()
        trained[batch.first:batch.first + len(batch)] = np.add.reduceat(mask.astype(np.int64), offsets[:-1]) \
            if len(mask) else 0
    return digests, trained


def input_differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(input, old value, new value) for each fingerprint input that differs; the tokenizer's files one by one."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if key == "tokenizer_files" and isinstance(a, dict) and isinstance(b, dict):
            out += [(f"tokenizer file {name}", (a.get(name) or "absent")[:12], (b.get(name) or "absent")[:12])
                    for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
        else:
            out.append((key, a, b))
    return out


@dataclass
class CacheDiff:
    old: Path
    new: Path
    differs: list[tuple[str, Any, Any]]
    matched_by: str  # "position" or "content"
    rows_old: int
    rows_new: int
    added: int
    removed: int
    changed: int
    trained_old: int
    trained_new: int
    # rows changed in place (position matching), most trained tokens gained or lost first: (row, old, new)
    changed_rows: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def trained_delta(self) -> int:
        return self.trained_new - self.trained_old


def diff_caches(old: str | Path | TokenizedCache, new: str | Path | TokenizedCache, top: int = 10) -> CacheDiff:
    """The rows added, removed and changed from `old` to `new`, the trained tokens gained or lost (in all and per
    changed row, the `top` largest), and the fingerprint inputs that differ."""
    old = old if isinstance(old, TokenizedCache) else open_cache(old)
    new = new if isinstance(new, TokenizedCache) else open_cache(new)
    inputs_old, inputs_new = old.manifest["fingerprint_inputs"], new.manifest["fingerprint_inputs"]
    digests_old, trained_old = row_digests(old)
    digests_new, trained_new = row_digests(new)
    by_position = inputs_old.get("sources") == inputs_new.get("sources")
    common = min(len(old), len(new))
    changed_rows: list[tuple[int, int, int]] = []
    if by_position:
        changed = np.flatnonzero(digests_old[:common] != digests_new[:common])
        delta = trained_new[changed] - trained_old[changed]
        order = changed[np.argsort(-np.abs(delta), kind="stable")][:top]
        changed_rows = [(int(i), int(trained_old[i]), int(trained_new[i])) for i in order]
        added, removed, n_changed = len(new) - common, len(old) - common, len(changed)
    else:
        kept = np.isin(digests_new, digests_old)
        added, n_changed = int((~kept).sum()), 0
        removed = int((~np.isin(digests_old, digests_new)).sum())
    return CacheDiff(old.path, new.path, input_differences(inputs_old, inputs_new),
                     "position" if by_position else "content", len(old), len(new), added, removed, n_changed,
                     int(trained_old.sum()), int(trained_new.sum()), changed_rows)
