"""A mixture index over published caches: which rows of which source, in which order, for a token budget.

    mixture = mix_caches(MixtureOptions(sources=[MixtureSource(cache=a, weight=0.6),
                                                 MixtureSource(cache=b, weight=0.4),
                                                 MixtureSource(cache=c, epochs=3)],
                                        unit="trained_tokens", budget=50_000_000))
    rows = open_mixture(mixture.path)        # rows as open_cache gives them, source after source interleaved

Each source is a cache of its own (re-weighting never re-tokenizes). The index is two arrays, `sources.npy`
and `rows.npy` (entry i is row rows[i] of source sources[i]), and `mixture.json`, which records per source
what was asked and what was achieved. It is named by a hash of everything that decides it (the caches'
fingerprints and row counts, the amounts, the unit, the budget, the seed, the order, the index version), so
the same description always maps to the same bytes, and written atomically under `<cache root>/.mixtures/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.errors import CacheError
from sft_tokenize.files import built_directory, locked
from sft_tokenize.format.layout import (
    BUILDING_SUFFIX,
    INDEX_BUILD,
    LOCK_SUFFIX,
    MIXTURE_INDEX,
    MIXTURES,
    STALE_SUFFIX,
    beside,
    is_mixture,
)
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.read.cache import open_cache
from sft_tokenize.read.index_arrays import mapped_arrays, write_npy
from sft_tokenize.read.mixture_options import MixtureOptions
from sft_tokenize.read.mixture_selection import (
    SourceRows,
    check_index_size,
    choose_rows,
    interleave,
    planned_rows,
    row_units,
    share_warnings,
    source_summary,
)
from sft_tokenize.version import __version__

logger = logging.getLogger("sft_tokenize")

MIXTURE_VERSION = 1
MIXTURE_FILES = ("sources.npy", "rows.npy")


def mixture_key(sources: list[SourceRows], options: MixtureOptions) -> str:
    described = {"version": MIXTURE_VERSION, "sources": [s.identity() for s in sources], "unit": options.unit,
                 "budget": options.budget, "seed": options.seed, "order": options.order}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class MixtureIndex:
    """A published mixture index: its arrays memory-mapped and its description."""

    path: Path
    meta: dict[str, Any]
    sources: np.ndarray
    rows: np.ndarray
    built_now: bool = False

    def __len__(self) -> int:
        return len(self.rows)


def _open_sources(options: MixtureOptions) -> list[SourceRows]:
    opened = []
    for spec in options.sources:
        cache = open_cache(spec.cache)
        opened.append(SourceRows(spec, cache, row_units(cache, options.unit)))
    return opened


def _index_root(sources: list[SourceRows], options: MixtureOptions) -> Path:
    if options.index_dir:
        return Path(options.index_dir).expanduser().absolute()
    return sources[0].cache.path.parent / MIXTURES


def load_mixture(path: str | Path) -> MixtureIndex:
    """The index at `path`, checked against its record and its source caches; CacheError if not."""
    path = Path(path).absolute()
    try:
        meta = json.loads((path / MIXTURE_INDEX).read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise CacheError(f"{path}: not a mixture index ({MIXTURE_INDEX} is missing)") from None
    except ValueError as error:
        raise CacheError(f"{path}: unreadable mixture index metadata ({error})") from None
    if meta.get("mixture_version") != MIXTURE_VERSION:
        raise CacheError(f"{path}: mixture index version {meta.get('mixture_version')}, expected {MIXTURE_VERSION}")
    arrays = mapped_arrays(path, MIXTURE_FILES, meta["files"])
    return MixtureIndex(path, meta, arrays["sources.npy"], arrays["rows.npy"])


def check_sources(index: MixtureIndex) -> None:
    """Each source cache the index reads is there, published, and the one it was built from; CacheError naming
    the index and the source if not."""
    for cache, recorded in zip(index.meta["source_caches"], index.meta["sources"], strict=True):
        try:
            fingerprint = read_manifest(cache)["fingerprint"]
        except CacheError as error:
            raise CacheError(f"{index.path}: source {recorded['name']} is unreadable: {error}; build it and "
                             "mix again (run the recipe again)") from None
        if fingerprint != recorded["fingerprint"]:
            raise CacheError(f"{index.path}: source {recorded['name']} was {recorded['fingerprint']}, {cache} is "
                             f"now {fingerprint}: mix again")


def mix_caches(options: MixtureOptions) -> MixtureIndex:
    """The mixture index for these options: the published one if its key is there, else built and published
    (one build per key at a time; a concurrent build waits, then reuses it)."""
    sources = _open_sources(options)
    key = mixture_key(sources, options)
    target = _index_root(sources, options) / key
    if is_mixture(target):
        return _said(load_mixture(target))
    check_index_size(planned_rows(sources, options), options, target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(beside(target, LOCK_SUFFIX)):
        if is_mixture(target):
            return _said(load_mixture(target))
        started = time.perf_counter()
        chosen = choose_rows(sources, options)
        source_ids, rows = interleave(sources, chosen, options)
        with built_directory(target, beside(target, BUILDING_SUFFIX, hidden=True),
                             beside(target, STALE_SUFFIX, hidden=True)) as building:
            files = {"sources.npy": write_npy(building / "sources.npy", source_ids),
                     "rows.npy": write_npy(building / "rows.npy", rows)}
            meta = {"mixture_version": MIXTURE_VERSION, "key": key, "unit": options.unit, "budget": options.budget,
                    "seed": options.seed, "order": options.order, "rows": int(len(rows)),
                    "sources": source_summary(sources, chosen, options),
                    "warnings": share_warnings(sources, chosen, options),
                    "source_caches": [str(s.cache.path) for s in sources], "files": files}
            (building / MIXTURE_INDEX).write_text(json.dumps(meta, indent=2) + "\n")
            build = {"seconds": round(time.perf_counter() - started, 3), "tool_version": __version__}
            (building / INDEX_BUILD).write_text(json.dumps(build, indent=2) + "\n")
    index = load_mixture(target)
    index.built_now = True
    return _said(index)


def _said(index: MixtureIndex) -> MixtureIndex:
    """The index, its warnings logged (a found index's too: the run that asked for it is told again)."""
    for warning in index.meta.get("warnings", []):  # an index older than its warnings has none
        logger.warning("mixture %s: %s", index.meta["key"], warning)
    return index
