"""The manifest check: what makes a directory a published cache, for every reader and for the build side's
"is it published already?". It is the on-disk format (FORMAT.md, "manifest.json"), so it lives beside the
spec and imports neither side: read/ and build/ both use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sft_tokenize.errors import CacheError
from sft_tokenize.format.layout import MANIFEST, STATE


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a published cache, after checking every data file is there at its recorded size."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        raise CacheError(f"{path}: not a published cache (a file: a cache is a directory holding {MANIFEST})")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        state = json.loads((path / STATE).read_text())
    except FileNotFoundError as error:
        raise CacheError(f"{path}: not a published cache ({Path(error.filename).name} is missing)") from None
    except (OSError, ValueError) as error:
        raise CacheError(f"{path}: unreadable cache metadata ({error})") from None
    _check_shape(path, manifest, state)
    listed = [entry["filename"] for entry in state["_data_files"]]
    if listed != [f["name"] for f in manifest["files"]]:
        raise CacheError(f"{path}: {STATE} and {MANIFEST} list different data files")
    for entry in manifest["files"]:
        file = path / entry["name"]
        size = file.stat().st_size if file.exists() else None
        if size != entry["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise CacheError(f"{file}: {found}, the manifest says {entry['bytes']} bytes: the cache is corrupt; "
                             "rebuild it with `sft-tokenize run ... --force`")
    return manifest


# What a manifest must hold, by type, for anything to read it (see FORMAT.md).
MANIFEST_KEYS = {"name": str, "fingerprint": str, "fingerprint_inputs": dict, "rows": int, "tokens": int,
                 "trained_tokens": int, "dropped": dict, "lengths": dict, "files": list, "shards": list}


def _check_shape(path: Path, manifest: Any, state: Any) -> None:
    """A manifest.json or state.json that parses but is not one (`{}`, `[1]`) is a corrupt cache, named."""
    def corrupt(what: str) -> CacheError:
        return CacheError(f"{path}: {what}: the cache is corrupt; rebuild it with `sft-tokenize run ... --force`")

    if not isinstance(manifest, dict):
        raise corrupt(f"{MANIFEST} holds a JSON {type(manifest).__name__}, not an object")
    missing = [key for key, kind in MANIFEST_KEYS.items() if not isinstance(manifest.get(key), kind)]
    if missing:
        raise corrupt(f"{MANIFEST} lacks {', '.join(missing)} (or has the wrong type)")
    if not all(isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("bytes"), int)
               for f in manifest["files"]):
        raise corrupt(f"{MANIFEST} lists a data file without a name and a size")
    if not isinstance(state, dict) or not isinstance(state.get("_data_files"), list) or not all(
            isinstance(entry, dict) and "filename" in entry for entry in state["_data_files"]):
        raise corrupt(f"{STATE} does not list the data files")
