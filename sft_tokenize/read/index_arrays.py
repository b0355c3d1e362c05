"""An index's arrays beside the caches (packing and mixture indexes): written as int64 .npy files with their
records, memory-mapped and checked against them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.errors import CacheError


def write_npy(path: Path, array: np.ndarray) -> dict[str, Any]:
    """An index array as int64 little-endian .npy; its record (bytes, sha256) for the index's metadata."""
    np.save(path, np.ascontiguousarray(array, dtype="<i8"), allow_pickle=False)
    return {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def mapped_arrays(path: Path, names: tuple[str, ...], recorded: dict[str, Any]) -> dict[str, np.ndarray]:
    """An index's arrays memory-mapped, each checked against its recorded size; CacheError if one is not."""
    arrays = {}
    for name in names:
        file = path / name
        size = file.stat().st_size if file.exists() else None
        if size != recorded[name]["bytes"]:
            raise CacheError(f"{file}: {'missing' if size is None else f'{size} bytes'}, the index says "
                             f"{recorded[name]['bytes']} bytes")
        arrays[name] = np.load(file, mmap_mode="r", allow_pickle=False)
    return arrays
