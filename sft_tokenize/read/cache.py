"""The trainer's side: open a published cache memory-mapped, checked against its manifest.

    cache = open_cache("/data/cache/ultrachat-3f2a9c1d0b7e4f65")
    len(cache), cache[0]["input_ids"], cache.lengths   # lengths from the Arrow list offsets
    cache.packed(4096, data_parallel=8)                 # packed sequences over a global packing index
    open_cache("s3://bucket/caches/ultrachat-3f2a9c1d0b7e4f65")   # copied to this machine once, then the same

The cache pickles as its path, so every dataloader worker maps the same files instead of copying rows.
See FORMAT.md for the layout.

What opening checks (cheap, every time): the manifest's keys, that state.json lists the manifest's data files,
that each is there at its recorded size, that Arrow can read each, and the row count. It does not read the
bytes: a data file changed in place at the same size opens. `verify_digests` (`sft-tokenize inspect --verify`)
reads every byte and compares each data file with the digest recorded when its shard was written.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sft_tokenize.errors import CacheError
from sft_tokenize.files import REQUEST_TIMEOUT, file_digest
from sft_tokenize.format.layout import SHARD_STORE, SIDECAR_SUFFIX
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.read.numpy_views import numpy_of
from sft_tokenize.read.remote_cache import cache_location
from sft_tokenize.read.tokenizer_check import TokenizerMismatch, mismatch_message, tokenizer_differences

LENGTH_CHUNK_ROWS = 1 << 20


class TokenizedCache(Sequence):
    """A map-style dataset over a published cache, memory-mapped: a row is read (and copied) when indexed."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()
        self.manifest = read_manifest(self.path)
        tables = []
        for entry in self.manifest["files"]:
            try:
                tables.append(pa.ipc.open_stream(pa.memory_map(str(self.path / entry["name"]))).read_all())
            except pa.ArrowInvalid as error:
                raise CacheError(f"{self.path / entry['name']}: unreadable Arrow data ({error})") from None
        self.table = pa.concat_tables(tables) if tables else None
        if len(self) != self.manifest["rows"]:
            raise CacheError(f"{self.path}: {len(self)} rows on disk, the manifest says {self.manifest['rows']}")
        self.columns = self.table.column_names if self.table is not None else []

    def __len__(self) -> int:
        return 0 if self.table is None else self.table.num_rows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        """One row's columns as writable numpy arrays of their own (a copy of this row only), which
        `torch.as_tensor` and the default collate take without a "not writable" warning; the mapped
        cache itself is never written through them."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for a cache of {len(self)} rows")
        index %= len(self)
        return {name: np.array(self.table.column(name)[index].values) for name in self.columns}

    @cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per row, from the list offsets only, a chunk at a time: no row is materialized."""
        out = np.empty(len(self), dtype=np.int32)
        column = self.table.column("input_ids") if self.table is not None else None
        for start in range(0, len(self), LENGTH_CHUNK_ROWS):
            chunk = column.slice(start, LENGTH_CHUNK_ROWS)
            out[start:start + len(chunk)] = numpy_of(pc.list_value_length(chunk))
        return out

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def caches(self) -> list[TokenizedCache]:
        """The caches whose rows these are (a mixture has several): this one."""
        return [self]

    def locate(self, row: int) -> tuple[int, int]:
        """(which of `caches`, which row of it) holds row `row`."""
        return 0, row

    def packed(self, length: int, data_parallel: int = 1, algorithm: str = "bfd", index_dir: str | None = None):
        """Packed sequences of at most `length` tokens over the cache's global packing index, which is built
        and published beside the cache first if it is missing (see packing_index.py)."""
        from sft_tokenize.read.packed_sequences import packed_sequences

        return packed_sequences(self, {"length": length, "data_parallel": data_parallel, "algorithm": algorithm,
                                       "index_dir": index_dir})

    def __reduce__(self):
        return open_cache, (str(self.path),)

    def __repr__(self) -> str:
        return f"TokenizedCache({str(self.path)!r}, rows={len(self)})"


def open_cache(path: str | Path, local_dir: str | Path | None = None,
               storage_options: dict | None = None, tokenizer: Any = None,
               request_timeout: float = REQUEST_TIMEOUT) -> TokenizedCache:
    """The published cache at `path`, memory-mapped. Refused (CacheError naming the file) if its manifest or
    state.json is missing or incomplete, if a data file is missing, has another size than the manifest says or
    is not readable Arrow, or if the row count differs. The data files' bytes are not read: for that, see
    `verify_digests`.

    `path` may be a version's URL on object storage (`s3://bucket/root/<name>-<fingerprint>`): it is copied into
    `local_dir` first, once per machine, its shards checked against their digests (remote_cache.materialize,
    which `storage_options` and `request_timeout` are for), and the local copy is opened.

    `tokenizer` (the trainer's tokenizer, or its directory): a TokenizerMismatch warning names what differs from
    the tokenizer files and chat template the cache was built with (read/tokenizer_check.py)."""
    cache = TokenizedCache(cache_location(path, local_dir, storage_options, request_timeout))
    if tokenizer is not None:
        differences = tokenizer_differences(cache.manifest, tokenizer)
        if differences:
            warnings.warn(mismatch_message(cache.path, differences), TokenizerMismatch, stacklevel=2)
    return cache


def _recorded_digest(path: Path, manifest: dict, k: int) -> str | None:
    """Data file k's digest: the manifest's, or (a cache published before the manifest kept them) the sidecar's
    of its shard in the store beside the cache, if the sidecar is still there and of the same size."""
    entry = manifest["files"][k]
    if "digest" in entry:
        return entry["digest"]
    written = [shard for shard in manifest["shards"] if shard.get("rows")]  # a data file per non-empty shard
    if len(written) != len(manifest["files"]) or "key" not in written[k]:
        return None
    try:
        sidecar = json.loads((path.parent / SHARD_STORE / f"{written[k]['key']}{SIDECAR_SUFFIX}").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(sidecar, dict) or sidecar.get("bytes") != entry["bytes"]:
        return None
    return sidecar.get("digest")


def verify_digests(path: str | Path) -> list[str]:
    """Every data file of the cache at `path` read whole and compared with the xxh3-128 digest recorded when its
    shard was written (after `open_cache`'s checks). Raises CacheError naming the first file that differs;
    returns the data files with no recorded digest to compare with (only their sizes were checked)."""
    path = Path(path).absolute()
    manifest = read_manifest(path)
    unverified = []
    for k, entry in enumerate(manifest["files"]):
        expected = _recorded_digest(path, manifest, k)
        if expected is None:
            unverified.append(entry["name"])
        elif file_digest(str(path / entry["name"])) != expected:
            raise CacheError(f"{path / entry['name']}: its bytes do not match the digest recorded when it was "
                             "written (its size does): the cache is corrupt; rebuild it with `sft-tokenize run ... "
                             "--force`")
    return unverified
