"""Content keys: what a slice's shard is stored under in the shard store (store.py).

A key hashes the tokenization fingerprint (everything that changes how a row is tokenized: tokenizer files,
chat template, options, format version; not the sources' names or mtimes) with what the slice reads:

    local JSONL   a digest of the part's byte range itself: a file that only grew keeps its earlier keys,
                  and a file whose mtime changed but whose bytes did not keeps all of them
    local other   a digest of the whole file, with the part's row-group or row range
    remote        the object's URL and identity (size, ETag or version id), with the range; hashing would
                  mean downloading every object at every plan

Hashing is xxh3-128, which streams at memory speed (tens of GB/s), far below what tokenizing the same bytes
costs; the key itself is a SHA-256 of those digests, so the same bytes under another name share a shard.
"""

from __future__ import annotations

import os
from typing import Any

import xxhash

from .fingerprint import fingerprint
from .sources import Part, Slice, _identity, _is_local, filesystem

HASH_CHUNK_BYTES = 1 << 20
KEY_DIGITS = 32


def _digest(path: str, start: int = 0, stop: int | None = None) -> str:
    """xxh3-128 of bytes [start, stop) of a local file (to its end without stop), through one bounded buffer."""
    digest = xxhash.xxh3_128()
    buffer = memoryview(bytearray(HASH_CHUNK_BYTES))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        remaining = (os.fstat(f.fileno()).st_size if stop is None else stop) - start
        while remaining > 0:
            got = f.readinto(buffer[:min(remaining, HASH_CHUNK_BYTES)])
            if not got:
                break
            digest.update(buffer[:got])
            remaining -= got
    return digest.hexdigest()


def part_identity(part: Part, storage_options: dict | None = None, memo: dict | None = None) -> list[Any]:
    """What a part reads, as content: see the module's docstring. `memo` caches whole-file digests and
    remote identities by URL within one plan."""
    memo = {} if memo is None else memo
    fs, path = filesystem(part.url, storage_options)
    if not _is_local(fs):
        if part.url not in memo:
            memo[part.url] = [part.url, *_identity(fs, path, fs.info(path))]  # ("remote", size, ETag...)
        return [part.kind, part.start, part.stop, *memo[part.url]]
    if part.kind == "jsonl":
        return [part.kind, part.stop - part.start, _digest(path, part.start, part.stop)]
    if part.url not in memo:
        memo[part.url] = _digest(path)
    return [part.kind, part.start, part.stop, memo[part.url]]


def slice_key(slice_: Slice, tokenization: str, storage_options: dict | None = None, memo: dict | None = None) -> str:
    """The key of the shard this slice's rows tokenize into, for this tokenization fingerprint."""
    memo = {} if memo is None else memo
    parts = [part_identity(part, storage_options, memo) for part in slice_.parts]
    return fingerprint({"tokenization": tokenization, "parts": parts}, digits=KEY_DIGITS)
