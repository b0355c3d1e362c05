"""What gc may call its own under a cache root that other people's files share (a bucket prefix, a directory).

A folder is a version this tool wrote when its manifest says so in full: a cache format version this tool knows,
a `name` and a `fingerprint` that together are the folder's name, and data files named as `datasets` names them
(each with a content key on a remote root). Its files are then exactly the metadata this tool writes and those
data files: a folder holding anything else is not removed (someone put a file of their own into it). In the shard
store, an object is this tool's when its name is a content key and a suffix the store uses. Anything else is left
alone, whatever it looks like.
"""

from __future__ import annotations

import re
from typing import Any

from sft_tokenize.build.keys import KEY_DIGITS
from sft_tokenize.format import CACHE_FORMAT_VERSION
from sft_tokenize.format.layout import (
    DATASET_INFO,
    IMAGE_FILES,
    MANIFEST,
    SHARD_SUFFIX,
    SIDECAR_SUFFIX,
    STATE,
    data_file,
)

_KEY = re.compile(rf"[0-9a-f]{{{KEY_DIGITS}}}")
FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_SUFFIXES = f"{re.escape(SHARD_SUFFIX)}|{re.escape(SIDECAR_SUFFIX)}"
_TEMPORARY = re.compile(rf"([0-9a-f]{{{KEY_DIGITS}}})({_SUFFIXES})\.tmp-[0-9a-f]+")
METADATA = (MANIFEST, STATE, DATASET_INFO, IMAGE_FILES)


def is_key(name: str) -> bool:
    """`name` is a content key (a shard's, and a slice's Prefect task result's name)."""
    return bool(_KEY.fullmatch(name))


def store_key(name: str, temporary: bool = False) -> str | None:
    """The content key of a shard store entry named `name` (`<key>.arrow`, `<key>.json`, and with `temporary` a
    shard being written, `<key>.arrow.tmp-<id>`, `<key>.json.tmp-<id>`), or None: not this tool's."""
    if temporary and (match := _TEMPORARY.fullmatch(name)):
        return match.group(1)
    for suffix in (SHARD_SUFFIX, SIDECAR_SUFFIX):
        if name.endswith(suffix) and _KEY.fullmatch(name[:-len(suffix)]):
            return name[:-len(suffix)]
    return None


def not_a_version(folder: str, manifest: Any, remote: bool) -> str | None:
    """Why the folder named `folder` holding this manifest is not a version this tool wrote, or None if it is."""
    if not isinstance(manifest, dict):
        return f"its {MANIFEST} is not an object"
    version = manifest.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= CACHE_FORMAT_VERSION:
        return f"its {MANIFEST} has no cache format version this tool knows"
    name, fingerprint = manifest.get("name"), manifest.get("fingerprint")
    if not isinstance(name, str) or not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint) \
            or folder != f"{name}-{fingerprint}":
        return f"its {MANIFEST} does not name it (<name>-<fingerprint>)"
    files = manifest.get("files")
    if not isinstance(files, list) or not isinstance(manifest.get("shards"), list):
        return f"its {MANIFEST} lists no data files"
    for k, entry in enumerate(files):
        if not isinstance(entry, dict) or entry.get("name") != data_file(k, len(files)) or (
                remote and not _KEY.fullmatch(str(entry.get("key")))):
            return f"its {MANIFEST} lists a data file this tool does not write"
    return None


def version_files(manifest: dict, remote: bool) -> set[str]:
    """The names of every file a version of this manifest may hold (a remote version holds no data files)."""
    return set(METADATA) | (set() if remote else {entry["name"] for entry in manifest["files"]})


def foreign_files(held: list[str], manifest: dict, remote: bool) -> list[str]:
    """Of the relative paths a version's folder holds, those this tool did not write, sorted."""
    own = version_files(manifest, remote)
    return sorted(path for path in held if path not in own)
