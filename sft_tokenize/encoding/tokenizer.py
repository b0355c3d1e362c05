"""The tokenizer a run names: found (a local directory, its files fetched from the hub, or copied from object
storage), loaded as a fast
`transformers` tokenizer, with the user's chat-template override read from a file or taken as text.

Finding and loading a tokenizer is one job, encoding with it (chat_encoder.py) another: the planner resolves the
tokenizer's directory to hash its files into the fingerprint, and a worker loads it only when no prepared entry
(prepared.py) holds what encoding reads.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sft_tokenize.errors import BadInput, one_line
from sft_tokenize.files import is_remote, user_cache
from sft_tokenize.format.layout import TOKENIZER_COPIES

# Files that make up a tokenizer; hashed into the fingerprint and fetched from the hub.
TOKENIZER_FILE_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py")
# A processor's own files beside them (the later one's keys win, as AutoProcessor reads them).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def fetch_tokenizer(url: str, storage_options: dict | None = None) -> Path:
    """A tokenizer directory on object storage (`s3://bucket/tokenizers/qwen`) copied into this user's cache, once
    per machine and version of its files: the copy is named by the URL and the files' identities (size and ETag),
    so an edited file gives a new copy, and a worker that shares only the bucket fetches its own."""
    from sft_tokenize.sources.records import file_identity, filesystem

    try:
        fs, path = filesystem(url, storage_options)
        files = sorted((info["name"], file_identity(fs, info["name"], info)) for info in fs.ls(path, detail=True)
                       if info["type"] == "file" and any(fnmatch.fnmatch(info["name"].rsplit("/", 1)[-1], pattern)
                                                        for pattern in TOKENIZER_FILE_PATTERNS))
    except FileNotFoundError:
        raise BadInput(f"tokenizer {url}: not found (no such bucket or directory)") from None
    except Exception as error:  # noqa: BLE001 - a bad URL, denied credentials: one line each
        raise BadInput(f"tokenizer {url}: cannot list its files ({type(error).__name__}: {one_line(error)})") from None
    if not files:
        raise BadInput(f"tokenizer {url}: no tokenizer files there (tokenizer.json, tokenizer_config.json, ...)")
    readable = "".join(c if c.isalnum() or c in "._-" else "-" for c in url.split("://", 1)[-1])[-60:].strip("-.")
    key = hashlib.sha256(json.dumps([url, files], default=str).encode()).hexdigest()[:16]
    copy = user_cache() / TOKENIZER_COPIES / f"{readable}-{key}"
    if copy.is_dir():
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{copy.name}.", dir=copy.parent))
    try:
        for name, _ in files:
            fs.get_file(name, str(partial / name.rsplit("/", 1)[-1]))
        os.rename(partial, copy)  # whole or not at all; another process's equal copy may have got there first
    except OSError as error:
        if not copy.is_dir():
            raise BadInput(f"tokenizer {url}: cannot copy its files ({one_line(error)})") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return copy


def resolve_tokenizer(name_or_path: str, revision: str | None = None, what: str = "tokenizer",
                      storage_options: dict | None = None) -> Path:
    """A local directory holding the tokenizer's (or processor's) files: the path itself, a hub snapshot, or a
    copy of a directory on object storage."""
    if is_remote(name_or_path):
        return fetch_tokenizer(name_or_path, storage_options)
    path = Path(os.path.abspath(Path(name_or_path).expanduser()))
    flag = f"--{what}"
    if path.is_dir():
        return path
    if path.is_file():
        holding = "tokenizer.json and tokenizer_config.json" if what == "tokenizer" else "preprocessor_config.json"
        raise BadInput(f"{path}: {flag} takes the {what}'s directory (the one holding {holding}), not a file: "
                       f"try {path.parent}")
    looks_local = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1 or path.exists()
    if looks_local:
        raise BadInput(f"{what} directory not found: {path}")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(name_or_path, revision=revision, allow_patterns=list(TOKENIZER_FILE_PATTERNS))
    except Exception as error:  # offline, unknown repo, gated: all end the same way for the user
        raise BadInput(
            f"{what} {name_or_path!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(error).__name__}: {one_line(error)})"
        ) from None
    return Path(local)


def saved_pretrained(loaded: Any, what: str = "tokenizer") -> Path:
    """A loaded transformers tokenizer or processor as a directory of its files, kept in this user's cache under
    the hash of their content (`saved/<sha256>/`): the same tokenizer, loaded twice, is one directory, so a run
    given the object is keyed by its files as a run given a path is, and an edited one (a new chat template)
    is another directory. Recomputable, so nothing is fsynced."""
    from sft_tokenize.files import user_cache

    root = user_cache() / "saved"
    root.mkdir(parents=True, exist_ok=True)
    saving = Path(tempfile.mkdtemp(prefix=".saving-", dir=root))
    try:
        try:
            loaded.save_pretrained(str(saving))
        except Exception as error:  # noqa: BLE001 - a half-built object (a processor without its parts)
            raise BadInput(f"the {what} passed could not be saved by its save_pretrained ({type(error).__name__}: "
                           f"{one_line(error)}): pass its directory or hub name instead") from None
        digest = hashlib.sha256()
        for file in sorted(path for path in saving.rglob("*") if path.is_file()):
            digest.update(f"{file.relative_to(saving).as_posix()}\0{file.stat().st_size}\0".encode())
            digest.update(file.read_bytes())
        target = root / digest.hexdigest()
        if not target.is_dir():
            try:
                os.rename(saving, target)
            except OSError as error:  # another process saved the same content first: use its directory
                if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        return target
    finally:
        shutil.rmtree(saving, ignore_errors=True)


def read_processor_config(directory: Path) -> dict:
    """A processor's configuration as AutoProcessor reads it: processor_config.json (the processor's own keys,
    its image processor's nested) under preprocessor_config.json (the image processor's)."""
    config: dict = {}
    found = False
    for name in PROCESSOR_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise BadInput(f"{path}: not a readable JSON object ({one_line(error)})") from None
        if not isinstance(value, dict):
            raise BadInput(f"{path}: holds {type(value).__name__}, not a JSON object")
        config.update(value)
        found = True
    if not found:
        raise BadInput(f"{directory}: no {' or '.join(PROCESSOR_FILES)}: --processor takes a vision-language "
                       "model's processor directory (AutoProcessor's files)")
    return config


def read_chat_template(template: str | None) -> str | None:
    """The override given by the user: a path to a .jinja file, or the template text itself."""
    if template is None:
        return None
    if "{" not in template:
        path = Path(os.path.abspath(Path(template).expanduser()))
        if not path.is_file():
            raise BadInput(f"chat template file not found: {path}")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise BadInput(f"{path}: the chat template is not UTF-8 text (byte {error.start + 1} is "
                           f"0x{error.object[error.start]:02x})") from None
    return template


def load_tokenizer(tokenizer_dir: str | Path, chat_template: str | None = None, trust_remote_code: bool = False):
    """A fast `transformers` tokenizer from a local directory, with an optional chat-template override."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code)
    except Exception as error:
        raise BadInput(f"cannot load a tokenizer from {tokenizer_dir}: {one_line(error)}") from None
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise BadInput(f"{tokenizer_dir}: a fast (Rust) tokenizer with a tokenizer.json is required")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
