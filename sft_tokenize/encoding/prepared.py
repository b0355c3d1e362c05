"""A tokenizer prepared once per content: what loading and checking it costs, paid by the first run only.

Loading a 151k-vocabulary tokenizer through transformers (whose import alone takes most of a second) and
checking the fast encoder against `tokenizers` on the hard strings take seconds, and every process of a run
(the planner, each encode-pool process, each worker of the processes runner or a cluster) used to pay them
again, as did every later run. What encoding reads of a tokenizer is plain data, so the first process that
loads a tokenizer keeps it in this user's cache, for every later process on the machine whatever its cache
root ($SFT_TOKENIZE_HOME, else $XDG_CACHE_HOME/sft-tokenize, else ~/.cache/sft-tokenize):

    <that directory>/tokenizers/<key>/
        backend.json      the Rust tokenizer as transformers built it (`backend_tokenizer.to_str()`)
        byte_lengths.npy  each id's length in UTF-8 bytes, when the fast encoder was accepted
        prepared.json     written last (its presence means the rest is complete), once the fast encoder's check
                          has run: the special tokens, the chat template, its verdict (accepted with its NFC
                          flag, or why it was refused)
        boundaries.json   optional, added to by later runs: the token boundaries of chat templates' own text
                          (template.py), by text, so that no later process builds HF's Rust tokenizer (~0.4 s for
                          151k tokens) only to learn them again

The check runs where fastokens' tables are first built: in this process as it first encodes, or, on a run
whose encode pool encodes, in the pool's processes, which report the verdict (a first run builds the tables
once; encoding/pool.py).

`<key>` hashes the SHA-256 of every file of the tokenizer directory (as the fingerprint does) with the
versions of transformers, tokenizers and fastokens and `PREPARED_VERSION`: an edited tokenizer file or an
upgraded library gets a new entry, never a stale one. A later process builds a `PartsTokenizer` (the
attributes `ChatEncoder` reads) from it without transformers' tokenizer classes, and the fast encoder without
checking it again, and only once it is about to encode (`FastEncoder.warm`, in the background); each slice's
first rows are still encoded by both encoders and compared. A damaged or half-written entry is prepared
again; losing the directory costs one slow start, so its files are renamed into place without an fsync.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.encoding.exact import CheckCases, FastEncoder, fast_candidate, log_refusal, rebuilt_encoder
from sft_tokenize.files import atomic_path, atomic_write, user_cache
from sft_tokenize.fingerprint import fingerprint

logger = logging.getLogger("sft_tokenize")

PREPARED_VERSION = 1  # bumped whenever what an entry holds, or how it is read, changes


@dataclass(frozen=True)
class TokenizerParts:
    """What encoding reads of a transformers fast tokenizer, as plain data (picklable, about its JSON's size)."""

    backend_json: str
    chat_template: str | None
    special_tokens_map: dict
    eos_token: str | None
    eos_token_id: int | None
    special_tokens: tuple[str, ...]  # the contents of its added tokens marked special
    fast: tuple[np.ndarray, bool] | None  # the fast encoder's byte lengths and NFC flag, or HF's
    boundaries: dict = field(default_factory=dict)  # token boundaries of template text, by text (template.py)
    check: CheckCases | None = None  # the fast encoder's check, if it is still to run (FastEncoder.cases)

    @classmethod
    def of(cls, tokenizer: Any, fast: FastEncoder | None, boundaries: dict | None = None) -> TokenizerParts:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        fast = fast if fast is not None and not fast.refused else None  # refused by its check: HF's
        checked = (fast.byte_lengths, fast.nfc) if fast else None
        check = fast.cases if fast else None
        known = getattr(tokenizer, "parts", None)  # a PartsTokenizer: its JSON is at hand, not serialized again
        if known is not None:
            return replace(known, chat_template=template, fast=checked, boundaries=boundaries or {}, check=check)
        specials = tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
        backend_json = fast.source if fast and fast.source else tokenizer.backend_tokenizer.to_str()  # same text
        return cls(backend_json, template, dict(tokenizer.special_tokens_map),
                   tokenizer.eos_token, tokenizer.eos_token_id, specials, checked, boundaries or {}, check)


@dataclass(frozen=True)
class _AddedToken:
    content: str
    special: bool = True


class PartsTokenizer:
    """The attributes `ChatEncoder`, `ChatTemplate` and `choose_encoder` read of a transformers tokenizer. HF's
    Rust tokenizer is built at its first use: a process whose rows the fast encoder places may never need it."""

    def __init__(self, parts: TokenizerParts, directory: Path | None = None):
        self.parts = parts
        self.directory = directory  # the prepared entry it was read from or written to (keep_boundaries)
        self.known_boundaries = parts.boundaries
        self._backend = None
        self._building = threading.Lock()  # the slices' threads share it
        self.chat_template = parts.chat_template
        self.special_tokens_map = parts.special_tokens_map
        self.eos_token, self.eos_token_id = parts.eos_token, parts.eos_token_id
        self.added_tokens_decoder = {k: _AddedToken(content) for k, content in enumerate(parts.special_tokens)}

    def build_backend_soon(self) -> None:
        """Build HF's Rust tokenizer in a thread, for a process about to check its fast encoder against it. Not a
        daemon: the interpreter's exit waits for it rather than ending it inside Rust."""
        if self._backend is None:
            threading.Thread(target=lambda: self.backend_tokenizer, name="hf-tokenizer-build").start()

    @property
    def backend_tokenizer(self):
        with self._building:
            if self._backend is None:
                from tokenizers import Tokenizer

                self._backend = Tokenizer.from_str(self.parts.backend_json)
        return self._backend


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def prepared_dir(tokenizer_files: dict[str, str], trust_remote_code: bool) -> Path:
    """Where the tokenizer whose files have these digests is kept prepared, for these library versions."""
    key = fingerprint({"files": tokenizer_files, "trust_remote_code": trust_remote_code,
                       "prepared_version": PREPARED_VERSION,
                       "versions": {name: _version(name) for name in ("transformers", "tokenizers", "fastokens")}})
    return user_cache() / "tokenizers" / key


def prepared_here(directory: str | Path) -> Path:
    """The same prepared tokenizer (its key, the last part of `directory`) in this process's own user cache: a
    worker that shares no disk with the process that named it keeps its own copy."""
    return user_cache() / "tokenizers" / Path(directory).name


def _read(directory: Path) -> tuple[TokenizerParts, dict] | None:
    try:
        meta = json.loads((directory / "prepared.json").read_text())
        backend_json = (directory / "backend.json").read_text(encoding="utf-8")
        lengths = np.load(directory / "byte_lengths.npy") if meta["encoder"].get("accepted") else None
        parts = TokenizerParts(backend_json, meta["chat_template"], meta["special_tokens_map"], meta["eos_token"],
                               meta["eos_token_id"], tuple(meta["special_tokens"]),
                               (lengths, meta["encoder"]["nfc"]) if lengths is not None else None,
                               _read_boundaries(directory))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return parts, meta["encoder"]


def _read_boundaries(directory: Path) -> dict:
    try:
        found = json.loads((directory / "boundaries.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def keep_boundaries(tokenizer: Any, learned: dict[str, list[int]]) -> None:
    """Add the token boundaries a chat template learned (`learned`, by text) to the prepared entry `tokenizer`
    came from, for later processes. Two processes adding at once may drop one's texts: those are learned again."""
    directory = getattr(tokenizer, "directory", None)  # a PartsTokenizer's; none on transformers' tokenizers
    known = getattr(tokenizer, "known_boundaries", None)
    if directory is None or known is None:
        return
    new = {text: ends for text, ends in learned.items() if text not in known}
    if not new:
        return
    known.update(new)
    try:
        atomic_write(directory / "boundaries.json", json.dumps({**_read_boundaries(directory), **new}),
                     durable=False)
    except OSError as error:  # an unwritable home: a later process learns them again
        logger.info("template boundaries not kept in %s: %s", directory, error.strerror)


def _write(directory: Path, parts: TokenizerParts, verdict: dict) -> None:
    """Each file renamed into place, prepared.json last; a concurrent writer of the same entry writes the same.
    Not durable (module doc): an entry a crash damages is prepared again."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / "backend.json", parts.backend_json, durable=False)
        if parts.fast is not None:
            with atomic_path(directory / "byte_lengths.npy", durable=False) as tmp, tmp.open("wb") as stream:
                np.save(stream, parts.fast[0])
        meta = {"prepared_version": PREPARED_VERSION, "chat_template": parts.chat_template,
                "special_tokens_map": parts.special_tokens_map, "eos_token": parts.eos_token,
                "eos_token_id": parts.eos_token_id, "special_tokens": list(parts.special_tokens), "encoder": verdict}
        atomic_write(directory / "prepared.json", json.dumps(meta), durable=False)
    except OSError as error:  # an unwritable home: the next process prepares it again
        logger.info("tokenizer not kept prepared in %s: %s", directory, error.strerror)


def prepared_encoding(directory: Path, load, requested: str) -> tuple[Any, FastEncoder | None]:
    """The tokenizer and the fast encoder (or None for HF's) kept in `directory`, or, the first time, `load()`'s
    tokenizer and the encoder to check against it (FastEncoder.verdict), kept there with the verdict. Requested
    "hf", the check is left for a run that asks for the fast encoder."""
    found = _read(directory)
    if found is not None and (requested == "hf" or "accepted" in found[1]):
        parts, verdict = found
        tokenizer = PartsTokenizer(parts, directory)
        if requested == "hf":
            return tokenizer, None
        if not verdict["accepted"]:
            log_refusal(requested, verdict["refusal"])
            return tokenizer, None
        logger.info("encoder: fastokens (checked when this tokenizer was first prepared)")
        return tokenizer, rebuilt_encoder(parts.backend_json, *parts.fast)
    tokenizer = load()
    # Checked where its tables are built: by this process once it encodes, or by an encode pool's processes
    # (which build them anyway: a first run builds them once). The entry is written with the verdict.
    fast, refusal = fast_candidate(tokenizer, requested)
    parts = TokenizerParts.of(tokenizer, fast)
    if fast is None:
        _write(directory, parts, {} if requested == "hf" else {"accepted": False, "refusal": refusal})
    else:
        def keep(refused: str) -> None:
            verdict = {"accepted": False, "refusal": refused} if refused else {"accepted": True, "nfc": fast.nfc}
            _write(directory, replace(parts, fast=None) if refused else parts, verdict)

        fast.on_verdict = keep
    # From here on this process holds what a later one reads from the entry, not transformers' tokenizer (its
    # Python vocabulary and classes): only the Rust tokenizer it already built is kept.
    prepared = PartsTokenizer(parts, directory)
    prepared._backend = tokenizer.backend_tokenizer
    return prepared, fast
