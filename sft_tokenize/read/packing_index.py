"""A global packing index beside a published cache: which rows go together into sequences of ≤ N tokens.

    index = pack_cache("/data/cache/ultrachat-3f2a9c1d0b7e4f65", length=4096, data_parallel=8)
    index.path, index.meta["efficiency"], index.bin(0)      # row ids of bin 0, longest first

The plan is made once from the cache's row lengths (the Arrow offsets: no row is read), over the whole
cache rather than per batch, and reused by every run and rank. It is keyed by (length, data_parallel,
algorithm), written atomically under `<cache root>/.packing/<cache>/<key>/` (or `index_dir`), and never
touches the published cache. Rows longer than `length` are truncated to their first `length` tokens
(counted in `long_rows`). See FORMAT.md, "Packing index".
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sft_tokenize.errors import BadInput, CacheError
from sft_tokenize.files import built_directory, locked, write_problem
from sft_tokenize.format.layout import (
    BUILDING_SUFFIX,
    INDEX_BUILD,
    LOCK_SUFFIX,
    PACKING,
    PACKING_INDEX,
    STALE_SUFFIX,
    beside,
    is_mixture,
)
from sft_tokenize.read.bin_packing import ALGORITHMS, arrange_for_ranks
from sft_tokenize.read.cache import TokenizedCache, open_cache
from sft_tokenize.read.index_arrays import mapped_arrays, write_npy
from sft_tokenize.read.packing_options import PackOptions
from sft_tokenize.version import __version__

if TYPE_CHECKING:
    from sft_tokenize.read.mixed_rows import MixedRows

INDEX_VERSION = 1
INDEX_FILES = ("bins.npy", "rows.npy")


def open_rows(path: str | Path) -> TokenizedCache | MixedRows:
    """The rows at `path`: a published cache, or a mixture index over several (a directory with mixture.json)."""
    if is_mixture(path):
        from sft_tokenize.read.mixed_rows import open_mixture

        return open_mixture(path)
    return open_cache(path)


def _rows(cache: str | Path | TokenizedCache | MixedRows) -> TokenizedCache | MixedRows:
    return open_rows(cache) if isinstance(cache, (str, Path)) else cache


def index_path(cache_path: str | Path, options: PackOptions) -> Path:
    """`<index root>/<cache name>/<key>`; the index root is `<cache root>/.packing` unless `index_dir` is set."""
    cache_path = Path(cache_path).absolute()
    root = Path(options.index_dir).expanduser().absolute() if options.index_dir else cache_path.parent / PACKING
    return root / cache_path.name / options.key


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _summary(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": int(values.min()), "mean": round(float(values.mean()), 3), "max": int(values.max())}


def _balance(tokens: np.ndarray, ranks: int) -> dict[str, float]:
    """Per step, (most - fewest) / most tokens over the ranks; and the same over each rank's whole epoch."""
    steps = tokens.reshape(-1, ranks)
    most = np.maximum(steps.max(axis=1), 1)
    spread = (steps.max(axis=1) - steps.min(axis=1)) / most
    per_rank = steps.sum(axis=0)
    return {
        "step_spread_max": round(float(spread.max()) if len(spread) else 0.0, 6),
        "step_spread_mean": round(float(spread.mean()) if len(spread) else 0.0, 6),
        "steps_over_1pct": int((spread > 0.01).sum()),
        "rank_spread": round(float((per_rank.max() - per_rank.min()) / max(per_rank.max(), 1)), 6),
    }


def lower_bound_bins(lengths: np.ndarray, capacity: int) -> int:
    """Martello and Toth's L2 bound: no packing of these lengths (each ≤ capacity) into bins of `capacity`
    uses fewer bins. For each a ≤ capacity/2, rows longer than capacity - a, and those longer than capacity/2,
    need a bin each, and the rows of a..capacity/2 fill at best the space those bins leave."""
    half = capacity // 2
    counts = np.bincount(lengths, minlength=capacity + 1).astype(np.int64)
    rows_to = np.cumsum(counts)  # rows of length ≤ v
    tokens_to = np.cumsum(counts * np.arange(capacity + 1))  # their tokens
    a = np.arange(half + 1)
    big = len(lengths) - rows_to[capacity - a]  # longer than capacity - a
    middle = rows_to[capacity - a] - rows_to[half]  # in (capacity/2, capacity - a]
    middle_tokens = tokens_to[capacity - a] - tokens_to[half]
    small_tokens = tokens_to[half] - np.where(a > 0, tokens_to[np.maximum(a - 1, 0)], 0)  # in [a, capacity/2]
    spill = -(-(small_tokens - (middle * capacity - middle_tokens)) // capacity)
    bound = big + middle + np.maximum(spill, 0)
    return int(max(bound.max(initial=0), -(-int(lengths.sum()) // capacity)))


def plan(lengths: np.ndarray, options: PackOptions) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(rows, bins, stats) for these row lengths: bin b holds rows[bins[b]:bins[b + 1]], step-major for ranks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = options.length
    effective = np.minimum(lengths, n)  # the long-row policy: keep the first N tokens
    rows, bins = ALGORITHMS[options.algorithm](effective, n)
    packed_bins = len(bins) - 1
    rows, bins = arrange_for_ranks(effective, rows, bins, options.data_parallel, n)
    counts = np.diff(bins)
    tokens = np.zeros(len(counts), dtype=np.int64)
    filled = counts > 0
    tokens[filled] = np.add.reduceat(effective[rows], bins[:-1][filled]) if len(rows) else 0
    total = int(effective.sum())
    long_rows = lengths > n
    stats = {
        "bins": len(counts),
        "bins_packed": packed_bins,  # before splitting bins to give every rank as many
        "steps": len(counts) // options.data_parallel,
        "rows": int(len(rows)),
        "tokens": total,
        "efficiency": round(total / (len(counts) * n), 6) if len(counts) else 0.0,
        "lower_bound_bins": lower_bound_bins(effective, n),
        "rows_per_bin": _summary(counts),
        "tokens_per_bin": _summary(tokens),
        "long_rows": {"policy": "truncate", "rows": int(long_rows.sum()),
                      "tokens_cut": int((lengths[long_rows] - n).sum())},
        "balance": _balance(tokens, options.data_parallel),
    }
    return rows, bins, stats


@dataclass
class PackingIndex:
    """A published packing index: its arrays memory-mapped, its metadata and build record."""

    path: Path
    meta: dict[str, Any]
    build: dict[str, Any]
    rows: np.ndarray
    bins: np.ndarray
    built_now: bool = False

    def __len__(self) -> int:
        return len(self.bins) - 1

    def bin(self, index: int) -> np.ndarray:
        return self.rows[self.bins[index]:self.bins[index + 1]]


def _cache_identity(cache: TokenizedCache) -> dict[str, Any]:
    return {"name": cache.path.name, "fingerprint": cache.fingerprint, "rows": len(cache),
            "lengths_sha256": _digest(cache.lengths.astype("<i4"))}


def load_index(path: Path, cache: TokenizedCache) -> PackingIndex:
    """The index at `path`, checked against its own record and against this cache; CacheError if not."""
    try:
        meta = json.loads((path / PACKING_INDEX).read_text())
        build = json.loads((path / INDEX_BUILD).read_text())
    except (FileNotFoundError, NotADirectoryError) as error:
        raise CacheError(f"{path}: not a packing index ({Path(error.filename).name} is missing)") from None
    except ValueError as error:
        raise CacheError(f"{path}: unreadable packing index metadata ({error})") from None
    if meta.get("index_version") != INDEX_VERSION:
        raise CacheError(f"{path}: packing index version {meta.get('index_version')}, expected {INDEX_VERSION}")
    if meta["cache"] != _cache_identity(cache):
        raise CacheError(f"{path}: made for another cache ({meta['cache']['fingerprint']}, "
                         f"{meta['cache']['rows']} rows), not {cache.path}")
    arrays = mapped_arrays(path, INDEX_FILES, meta["files"])
    return PackingIndex(path, meta, build, arrays["rows.npy"], arrays["bins.npy"])


def find_index(cache: str | Path | TokenizedCache, options: PackOptions) -> PackingIndex | None:
    """The published index of this cache and key, or None if there is none (or a stale one)."""
    cache = _rows(cache)
    try:
        return load_index(index_path(cache.path, options), cache)
    except CacheError:
        return None


def _writable_dir(path: Path, options: PackOptions) -> None:
    problem = write_problem(path)
    if problem is not None:
        hint = ("choose a writable --index-dir" if options.index_dir else
                "the cache root is read-only: pass --index-dir DIR (index_dir=...) to write the index elsewhere")
        raise BadInput(f"{path}: cannot write a packing index there ({problem}); {hint}")


def pack_cache(cache: str | Path | TokenizedCache, options: PackOptions) -> PackingIndex:
    """The packing index of `cache` for these options: the published one if it is valid, else built and
    published (one build per key at a time; a concurrent run waits, then reuses it)."""
    cache = _rows(cache)
    target = index_path(cache.path, options)
    existing = find_index(cache, options)
    if existing is not None:
        return existing
    _writable_dir(target.parent, options)
    with locked(beside(target, LOCK_SUFFIX)):
        for leftover in target.parent.glob(f".{target.name}.*-*"):  # left by a killed run; none is live
            shutil.rmtree(leftover, ignore_errors=True)
        existing = find_index(cache, options)
        if existing is not None:  # another run published it while this one waited
            return existing
        started = time.perf_counter()
        rows, bins, stats = plan(cache.lengths, options)
        # A stale index at target (another cache under this name, or damaged) is replaced, never served.
        with built_directory(target, beside(target, BUILDING_SUFFIX, hidden=True),
                             beside(target, STALE_SUFFIX, hidden=True)) as building:
            files = {"bins.npy": write_npy(building / "bins.npy", bins),
                     "rows.npy": write_npy(building / "rows.npy", rows)}
            meta = {"index_version": INDEX_VERSION, "key": options.key, "length": options.length,
                    "data_parallel": options.data_parallel, "algorithm": options.algorithm,
                    "cache": _cache_identity(cache), **stats, "files": files}
            (building / PACKING_INDEX).write_text(json.dumps(meta, indent=2) + "\n")
            build = {"seconds": round(time.perf_counter() - started, 3), "tool_version": __version__}
            (building / INDEX_BUILD).write_text(json.dumps(build, indent=2) + "\n")
    index = load_index(target, cache)
    index.built_now = True
    return index


def list_indexes(cache: str | Path | TokenizedCache, index_dir: str | None = None) -> list[PackingIndex]:
    """Every valid index of this cache under its index root (or `index_dir`), by key; the cache is opened
    only if there is an index directory to check."""
    path = Path(cache).absolute() if isinstance(cache, (str, Path)) else cache.path
    parent = index_path(path, PackOptions(length=1, index_dir=index_dir)).parent
    candidates = [p for p in sorted(parent.iterdir()) if p.is_dir() and not p.name.startswith(".")] \
        if parent.is_dir() else []
    if not candidates:
        return []
    cache = _rows(cache)
    found = []
    for candidate in candidates:
        try:
            found.append(load_index(candidate, cache))
        except CacheError:
            continue
    return found
