"""Content keys: what a slice's shard is stored under in the shard store (store.py).

A key hashes the tokenization fingerprint (everything that changes how a row is tokenized: tokenizer files,
chat template, options, format version; not the sources' names or mtimes) with what the slice reads:

    local JSONL   a digest of the part's byte range itself: a file that only grew keeps its earlier keys,
                  and a file whose mtime changed but whose bytes did not keeps all of them
    local other   a digest of the whole file, with the part's row-group or row range
    remote        the object's URL and identity (size, ETag or version id), with the range; hashing would
                  mean downloading every object at every plan

Hashing is xxh3-128, which streams at memory speed (several GB/s), far below what tokenizing the same bytes
costs; the key itself is a SHA-256 of those digests, so the same bytes under another name share a shard.

A plan remembers the digests it computed in a digest book (`.shards/.digests`), each under its file's
stat (device, inode, size, mtime_ns, ctime_ns), as git's index remembers a file's hash: the next plan reads
only the files whose stat changed, so a nightly run on a grown corpus reads the new bytes, not all of them.
Any write changes a file's ctime, which user space cannot set back; a file changed within `RACY_NS` of
being hashed could have changed again unseen, so its digest is not trusted until it is hashed later. A
shard is stored only if its slice still hashes to its key after tokenizing (shard.py), without the book.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sft_tokenize.files import REQUEST_TIMEOUT, atomic_write, file_digest
from sft_tokenize.fingerprint import fingerprint
from sft_tokenize.sources.formats.table import FORMATS
from sft_tokenize.sources.records import Part, Slice, file_identity, filesystem, is_local

KEY_DIGITS = 32
RACY_NS = 2 * 10**9  # a file changed this close before its hashing is hashed again by the next plan


def _stat(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_book(book: Path) -> dict[str, dict]:
    try:
        entries = json.loads(book.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: every file is hashed, as without a book
        return {}
    return entries if isinstance(entries, dict) else {}


class Digests:
    """What parts read, as content, for one plan: digests of local byte ranges and remote identities, each
    computed once. With a `book`, local digests are also remembered across plans (module docstring)."""

    def __init__(self, book: Path | None = None):
        self.book = book
        self._remembered = _read_book(book) if book else {}
        self._entries: dict[str, dict] = {}  # path -> {"stat", "hashed_at_ns", "spans": {"start-stop": digest}}
        self._remote: dict[str, list] = {}

    def local(self, path: str, start: int = 0, stop: int | None = None) -> str:
        """The xxh3-128 of bytes [start, stop) of a local file (to its end without stop)."""
        stat = _stat(path)
        entry = self._entries.get(path)
        if entry is None or entry["stat"] != stat:
            old = self._remembered.get(path)
            if old is not None and old.get("stat") == stat and stat[4] + RACY_NS < old.get("hashed_at_ns", 0):
                entry = old
            else:
                entry = {"stat": stat, "hashed_at_ns": time.time_ns(), "spans": {}}
            self._entries[path] = entry
        span = f"{start}-{'' if stop is None else stop}"
        if span not in entry["spans"]:
            digest = file_digest(path, start, stop)
            if _stat(path) != stat:  # written to while being hashed: not remembered (the shard check sees it)
                return digest
            entry["spans"][span] = digest
        return entry["spans"][span]

    def remote(self, url: str, fs: Any, path: str) -> list:
        if url not in self._remote:
            self._remote[url] = [url, *file_identity(fs, path, fs.info(path))]  # ("remote", size, ETag...)
        return self._remote[url]

    def save(self) -> None:
        """Add this plan's digests to the book, dropping files that no longer exist (atomic; a run that
        loses a concurrent writer's entries only hashes those files again)."""
        if self.book is None or not self._entries:
            return
        entries = {**_read_book(self.book), **self._entries}
        entries = {path: entry for path, entry in entries.items() if os.path.exists(path)}
        _write_book(self.book, entries)


def _write_book(book: Path, entries: dict) -> None:
    book.parent.mkdir(parents=True, exist_ok=True)
    # Not durable: a book lost in a crash only means hashing those files again.
    atomic_write(book, json.dumps(entries, separators=(",", ":")), durable=False)


def forget(book: Path, path: str) -> None:
    """Drop a file's remembered digests (its slice no longer hashed to its key)."""
    entries = _read_book(book)
    if entries.pop(path, None) is not None:
        _write_book(book, entries)


def part_identity(part: Part, storage_options: dict | None = None, digests: Digests | None = None,
                  timeout: float = REQUEST_TIMEOUT) -> list[Any]:
    """What a part reads, as content: see the module's docstring."""
    digests = Digests() if digests is None else digests
    fs, path = filesystem(part.url, storage_options, timeout)
    if not is_local(fs):
        return [part.kind, part.start, part.stop, *digests.remote(part.url, fs, path)]
    if FORMATS[part.kind].byte_ranges:
        return [part.kind, part.stop - part.start, digests.local(path, part.start, part.stop)]
    return [part.kind, part.start, part.stop, digests.local(path)]


def slice_key(slice_: Slice, tokenization: str, storage_options: dict | None = None,
              digests: Digests | None = None, timeout: float = REQUEST_TIMEOUT) -> str:
    """The key of the shard this slice's rows tokenize into, for this tokenization fingerprint."""
    digests = Digests() if digests is None else digests
    parts = [part_identity(part, storage_options, digests, timeout) for part in slice_.parts]
    return fingerprint({"tokenization": tokenization, "parts": parts}, digits=KEY_DIGITS)
