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

How rows are chosen (the same rule for every unit: rows, tokens, trained tokens). A source's amount is its
weight's share of what the budget leaves after the absolute amounts (`epochs`, `rows`, `tokens`). Its rows
are taken in seeded whole epochs (a permutation per epoch) plus a prefix of one more, until the amount is
reached: a source asked for 2.5 epochs has every row 2 or 3 times, half of them 3 times; a token amount is
reached within one row. The order merges the sources by how far each has got through its own amount
(the fraction of it before the row), which is what always picking the source furthest behind does: every
prefix of the index keeps the ratios, so a run stopped early still saw them. `order="shuffle"` is a seeded
permutation of the same entries instead. See FORMAT.md, "Mixture index".

An index takes 16 bytes a row on disk and about 96 in memory while it is built: amounts that would make it
larger than `max_index_rows` (or than the memory and disk at hand) are refused before it is built, naming the
source. Whole rows can miss small budgets' weights: the index records a warning for each weighted source
more than SHARE_TOLERANCE off its weight.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sft_tokenize import __version__
from sft_tokenize.errors import BadInput, CacheError
from sft_tokenize.files import built_directory, locked
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.read.cache import TokenizedCache, open_cache
from sft_tokenize.read.packing_index import mapped_arrays, write_npy

logger = logging.getLogger("sft_tokenize")

MIXTURE_VERSION = 1
MIXTURE_FILES = ("sources.npy", "rows.npy")
Unit = Literal["rows", "tokens", "trained_tokens"]
AMOUNTS = ("weight", "epochs", "rows", "tokens")
SUM_CHUNK_ROWS = 65_536
# The largest index built unless `max_index_rows` says otherwise: a typo (`rows: 1000000000`, `epochs: 1e9`) is
# refused, naming its source, instead of filling the memory or the disk. 100M rows are 1.6 GB on disk.
MAX_INDEX_ROWS = 100_000_000
INDEX_BYTES_PER_ROW = 16  # on disk: an int64 in sources.npy and one in rows.npy
# Memory while an index is built, per row: its arrays, the interleaving's keys and sort (87 measured, 20M rows).
INDEX_BUILD_BYTES_PER_ROW = 96
# A weighted source whose achieved share of the weighted sources' total misses its weight by more than this
# (absolute: 0.05 is five points) is warned about: the budget is too small for its rows.
SHARE_TOLERANCE = 0.05


class MixtureSource(BaseModel):
    """One source of a mixture: a published cache and how much of it, as a weight or an absolute amount."""

    model_config = ConfigDict(extra="forbid")

    cache: str = Field(description="The source's published cache (a directory `load_from_disk` opens).")
    name: str | None = Field(None, description="What the summary calls it (default: the cache's name).")
    weight: float | None = Field(None, gt=0, allow_inf_nan=False, description="Its share of what the budget "
                                 "leaves after the absolute amounts, relative to the other weights.")
    epochs: float | None = Field(None, gt=0, allow_inf_nan=False, description="Every row this many times (2.5: "
                                 "each row 2 or 3 times, half of them 3).")
    rows: int | None = Field(None, gt=0, description="This many rows (more than it holds: whole epochs and a "
                             "prefix of one more).")
    tokens: int | None = Field(None, gt=0, description="This many tokens of the mixture's unit (input tokens "
                               "when the unit is rows).")

    @model_validator(mode="after")
    def _one_amount(self) -> MixtureSource:
        given = [key for key in AMOUNTS if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"source {self.name or self.cache}: give exactly one of {', '.join(AMOUNTS)} "
                             f"({'none' if not given else ', '.join(given)} given)")
        return self

    @property
    def amount(self) -> tuple[str, float]:
        return next((key, getattr(self, key)) for key in AMOUNTS if getattr(self, key) is not None)


class MixtureSettings(BaseModel):
    """How a mixture counts, sizes and orders its sources (a recipe's `mixture:`)."""

    model_config = ConfigDict(extra="forbid")

    unit: Unit = Field("trained_tokens", description="What weights and token amounts count: rows, tokens or "
                       "trained_tokens (tokens whose loss mask is 1).")
    budget: int | None = Field(None, gt=0, description="The mixture's size in its unit; needed when a source "
                               "has a weight.")
    seed: int = Field(0, description="Seeds each source's epoch permutations (and the shuffle).")
    order: Literal["interleave", "shuffle"] = Field("interleave", description="interleave: the source furthest "
                                                    "behind its amount comes next, so every prefix keeps the "
                                                    "ratios; shuffle: a seeded permutation of the same rows.")
    index_dir: str | None = Field(None, description="Where to write the index (default: <cache root>/.mixtures).")
    max_index_rows: int = Field(MAX_INDEX_ROWS, gt=0, description="The largest index built, in rows (16 bytes "
                                "each on disk, about 96 in memory while it is built): amounts that would take more "
                                "are refused before the index is built.")


class MixtureOptions(MixtureSettings):
    """A mixture: its sources and amounts, and its settings."""

    sources: list[MixtureSource] = Field(min_length=1)

    @model_validator(mode="after")
    def _weights_share_a_budget(self) -> MixtureOptions:
        weights = [s.weight for s in self.sources if s.weight is not None]
        if weights and self.budget is None:
            raise ValueError("budget: a source has a weight, so the mixture needs a budget (in its unit, "
                             f"{self.unit}) to share")
        # Weights are shares of what the budget leaves; shares that do not add up to 1 are a typo, not a ratio.
        if weights and abs(sum(weights) - 1) > 1e-6:
            raise ValueError(f"weights: they add up to {sum(weights):g}; they are shares of the budget (after "
                             "the absolute amounts) and must add up to 1")
        return self


@dataclass
class SourceRows:
    """A source's cache and its rows' sizes in the mixture's unit (int64, one per row)."""

    spec: MixtureSource
    cache: TokenizedCache
    units: np.ndarray

    @cached_property
    def tokens(self) -> np.ndarray:
        """Input tokens per row (int64)."""
        return self.cache.lengths.astype(np.int64)

    @property
    def name(self) -> str:
        return self.spec.name or self.cache.path.name

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "cache": self.cache.path.name, "fingerprint": self.cache.manifest["fingerprint"],
                "rows": len(self.cache), "amount": dict([self.spec.amount])}


def trained_lengths(cache: TokenizedCache) -> np.ndarray:
    """Trained tokens per row (loss_mask 1, or a label other than -100), a chunk of rows at a time."""
    name = "loss_mask" if "loss_mask" in cache.columns else "labels"
    out = np.empty(len(cache), dtype=np.int64)
    if cache.table is None:
        return out
    column = cache.table.column(name)
    for start in range(0, len(cache), SUM_CHUNK_ROWS):
        chunk = column.slice(start, SUM_CHUNK_ROWS).combine_chunks()
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        hits = np.concatenate([[0], np.cumsum(values == 1 if name == "loss_mask" else values != -100)])
        offsets = pc.list_value_length(chunk).to_numpy().cumsum()
        ends = hits[offsets]
        out[start:start + len(chunk)] = np.diff(np.concatenate([[0], ends]))
    return out


def _units(cache: TokenizedCache, unit: str) -> np.ndarray:
    if unit == "rows":
        return np.ones(len(cache), dtype=np.int64)
    if unit == "tokens":
        return cache.lengths.astype(np.int64)
    return trained_lengths(cache)


def _epochs(n: int, seed: int, source: int, rows: int) -> np.ndarray:
    """`rows` rows of a source of n: whole seeded permutations, then a prefix of the next."""
    whole, rest = divmod(rows, n)
    perms = [np.random.default_rng([seed, source, e]).permutation(n) for e in range(whole + (rest > 0))]
    return np.concatenate(perms)[:rows] if perms else np.empty(0, dtype=np.int64)


def _rows_for_units(units: np.ndarray, target: float, seed: int, source: int) -> np.ndarray:
    """The fewest rows, in seeded epochs, whose units reach `target` (or all of one epoch, if every row is 0)."""
    n, total = len(units), int(units.sum())
    if total == 0:
        return _epochs(n, seed, source, n)
    whole = int(target // total)
    order = _epochs(n, seed, source, (whole + 1) * n)
    reached = np.cumsum(units[order])
    return order[:int(np.searchsorted(reached, target, side="left")) + 1]


def choose_rows(sources: list[SourceRows], options: MixtureOptions) -> list[np.ndarray]:
    """Per source, its rows in the order it gives them (see the module's docstring for the rule)."""
    chosen: list[np.ndarray | None] = [None] * len(sources)
    absolute = 0
    for i, source in enumerate(sources):
        kind, amount = source.spec.amount
        n = len(source.units)
        if n == 0:
            raise BadInput(f"source {source.name}: its cache has no rows")
        if kind == "epochs":
            chosen[i] = _epochs(n, options.seed, i, int(round(amount * n)))
        elif kind == "rows":
            chosen[i] = _epochs(n, options.seed, i, int(amount))
        elif kind == "tokens":
            units = source.units if options.unit != "rows" else source.tokens
            chosen[i] = _rows_for_units(units, amount, options.seed, i)
        if chosen[i] is not None:
            absolute += int(source.units[chosen[i]].sum())
    weighted = [i for i, s in enumerate(sources) if s.spec.weight is not None]
    if weighted:
        left = options.budget - absolute
        if left <= 0:
            raise BadInput(f"budget: {options.budget} {options.unit}, but the absolute amounts already take "
                           f"{absolute}; nothing is left for the weighted sources")
        total_weight = sum(sources[i].spec.weight for i in weighted)
        for i in weighted:
            chosen[i] = _rows_for_units(sources[i].units, left * sources[i].spec.weight / total_weight,
                                        options.seed, i)
    return chosen


def _asked(kind: str, amount: float) -> str:
    return f"{kind} {amount:,}" if isinstance(amount, int) else f"{kind} {amount:g}"


def _about(units: np.ndarray, target: float) -> int:
    """About how many rows, taken in epochs, reach `target` units (one epoch if no row holds any)."""
    n, total = len(units), float(units.sum())
    return n if total == 0 else math.ceil(target * n / total)


def planned_rows(sources: list[SourceRows], options: MixtureOptions) -> list[tuple[str, str, int]]:
    """Per source, about how many rows choose_rows will take for it, from its rows' units alone (no row chosen):
    (name, what it asks, rows)."""
    planned, absolute = [], 0.0
    for source in sources:
        kind, amount = source.spec.amount
        n, total = len(source.units), float(source.units.sum())
        if kind == "epochs":
            rows, units = round(amount * n), amount * total
        elif kind == "rows":
            rows, units = int(amount), amount / max(n, 1) * total
        elif kind == "tokens":
            rows = _about(source.units if options.unit != "rows" else source.tokens, amount)
            units = amount if options.unit != "rows" else rows
        else:
            continue
        planned.append((f"source {source.name}", _asked(kind, amount), rows))
        absolute += units
    left = (options.budget or 0) - absolute  # a budget the absolute amounts use up: choose_rows says so
    for source in sources:
        if source.spec.weight is not None and left > 0:
            planned.append((f"source {source.name}", _asked("weight", source.spec.weight),
                            _about(source.units, left * source.spec.weight)))
    return planned


def least_rows(options: MixtureOptions, max_length: int | None = None) -> list[tuple[str, str, int]]:
    """What the amounts alone say of the index's size, before any source's cache exists: at least these rows
    (name, what it asks, rows). Every source holds a row, and no row holds more than `max_length` tokens."""
    least = []
    for source in options.sources:
        kind, amount = source.amount
        if kind in ("epochs", "rows"):
            least.append((f"source {source.name or source.cache}", _asked(kind, amount), round(amount)))
        elif kind == "tokens" and max_length:
            least.append((f"source {source.name or source.cache}", _asked(kind, amount),
                          math.ceil(amount / max_length)))
    weighted = [s for s in options.sources if s.weight is not None]
    if weighted and options.budget and (options.unit == "rows" or max_length):
        per_row = 1 if options.unit == "rows" else max_length
        least.append((f"the weighted sources {', '.join(s.name or s.cache for s in weighted)}",
                      f"budget {options.budget:,} {options.unit}",
                      math.ceil(options.budget / per_row)))
    return least


def _size(count: int) -> str:
    for scale, unit in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB")):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count / 10**3:,.0f} kB" if count >= 10**3 else f"{count} bytes"


def _available_memory() -> int | None:
    """The memory this machine can give without swapping (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_index_size(planned: list[tuple[str, str, int]], options: MixtureSettings, index_root: Path | None,
                     at_least: bool = False) -> None:
    """BadInput naming the largest source, if the index of these planned rows (`planned_rows`, or `least_rows`
    with `at_least`) would be over `options.max_index_rows`, the memory at hand or the disk under `index_root`."""
    total = sum(rows for _, _, rows in planned)
    if not planned or total == 0:
        return
    name, asked, rows = max(planned, key=lambda entry: entry[2])
    its = "" if rows == total else f", {rows:,} of them its own"
    what = (f"{name} ({asked}) would make a mixture index of {'at least' if at_least else 'about'} {total:,} rows "
            f"({_size(total * INDEX_BYTES_PER_ROW)} on disk, {_size(total * INDEX_BUILD_BYTES_PER_ROW)} of memory "
            f"to build it{its})")
    if total > options.max_index_rows:
        raise BadInput(f"{what}, over the bound of {options.max_index_rows:,} rows (the mixture's max_index_rows: "
                       "raise it if you mean it)")
    memory = _available_memory()
    if memory is not None and total * INDEX_BUILD_BYTES_PER_ROW > memory:
        raise BadInput(f"{what}, more than the {_size(memory)} of memory available")
    existing = next((p for p in (index_root, *index_root.parents) if p.exists()), None) if index_root else None
    if existing is not None and total * INDEX_BYTES_PER_ROW > shutil.disk_usage(existing).free:
        raise BadInput(f"{what}, more than the {_size(shutil.disk_usage(existing).free)} free under {existing}")


def interleave(sources: list[SourceRows], chosen: list[np.ndarray], options: MixtureOptions
               ) -> tuple[np.ndarray, np.ndarray]:
    """(sources, rows) of the whole index: merged by each row's place in its source's amount, or shuffled."""
    keys, ids = [], []
    for i, (source, rows) in enumerate(zip(sources, chosen, strict=True)):
        units = source.units[rows].astype(np.float64)
        done = units.sum()
        before = np.cumsum(units) - units
        # Rows of no units (nothing trained) take the place of the row before them; an all-empty source
        # spreads its rows evenly instead.
        keys.append(before / done if done else np.arange(len(rows)) / max(len(rows), 1))
        ids.append(np.full(len(rows), i, dtype=np.int64))
    key, source_ids, rows = np.concatenate(keys), np.concatenate(ids), np.concatenate(chosen)
    if options.order == "shuffle":
        order = np.random.default_rng([options.seed, len(sources)]).permutation(len(key))
    else:
        order = np.lexsort((source_ids, key))  # ties: the source listed first
    return source_ids[order], rows[order]


def _summary(sources: list[SourceRows], chosen: list[np.ndarray], unit: str) -> list[dict]:
    """Per source: what was asked, what was achieved (rows, tokens, trained tokens, share, epochs)."""
    total = sum(int(s.units[rows].sum()) for s, rows in zip(sources, chosen, strict=True))
    out = []
    for source, rows in zip(sources, chosen, strict=True):
        kind, amount = source.spec.amount
        achieved = int(source.units[rows].sum())
        seen = np.bincount(rows, minlength=len(source.cache))
        trained = source.units if unit == "trained_tokens" else trained_lengths(source.cache)
        out.append({
            "name": source.name, "cache": source.cache.path.name, "fingerprint": source.cache.manifest["fingerprint"],
            "asked": {kind: amount},
            "rows": int(len(rows)), "tokens": int(source.cache.lengths[rows].astype(np.int64).sum()),
            "trained_tokens": int(trained[rows].sum()),
            "share": round(achieved / total, 6) if total else 0.0,
            "epochs": round(len(rows) / len(source.cache), 6),
            "times_seen": {"min": int(seen.min()), "max": int(seen.max())},
        })
    return out


def share_warnings(sources: list[SourceRows], chosen: list[np.ndarray], options: MixtureOptions) -> list[str]:
    """One line per weighted source whose share of the weighted sources' total misses its weight by more than
    SHARE_TOLERANCE: rows are whole, and each weighted source takes at least one."""
    weighted = [i for i, source in enumerate(sources) if source.spec.weight is not None]
    achieved = {i: int(sources[i].units[chosen[i]].sum()) for i in weighted}
    total = sum(achieved.values())
    warnings = []
    for i in weighted if total else []:
        share, weight = achieved[i] / total, sources[i].spec.weight
        if abs(share - weight) > SHARE_TOLERANCE:
            warnings.append(
                f"source {sources[i].name}: asked weight {weight:g}, achieved {share:.1%} of the weighted sources' "
                f"{options.unit} ({achieved[i]:,} of {total:,}), more than {SHARE_TOLERANCE * 100:g} points off: "
                f"the budget ({options.budget:,} {options.unit}) is small against whole rows of up to "
                f"{int(sources[i].units.max()):,}; a larger budget comes closer")
    return warnings


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
        opened.append(SourceRows(spec, cache, _units(cache, options.unit)))
    return opened


def _index_root(sources: list[SourceRows], options: MixtureOptions) -> Path:
    if options.index_dir:
        return Path(options.index_dir).expanduser().absolute()
    return sources[0].cache.path.parent / ".mixtures"


def load_mixture(path: str | Path) -> MixtureIndex:
    """The index at `path`, checked against its record and its source caches; CacheError if not."""
    path = Path(path).absolute()
    try:
        meta = json.loads((path / "mixture.json").read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise CacheError(f"{path}: not a mixture index (mixture.json is missing)") from None
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
    if (target / "mixture.json").is_file():
        return _said(load_mixture(target))
    check_index_size(planned_rows(sources, options), options, target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.with_name(f"{key}.lock")):
        if (target / "mixture.json").is_file():
            return _said(load_mixture(target))
        started = time.perf_counter()
        chosen = choose_rows(sources, options)
        source_ids, rows = interleave(sources, chosen, options)
        with built_directory(target, target.with_name(f".{key}.building"),
                             target.with_name(f".{key}.stale")) as building:
            files = {"sources.npy": write_npy(building / "sources.npy", source_ids),
                     "rows.npy": write_npy(building / "rows.npy", rows)}
            meta = {"mixture_version": MIXTURE_VERSION, "key": key, "unit": options.unit, "budget": options.budget,
                    "seed": options.seed, "order": options.order, "rows": int(len(rows)),
                    "sources": _summary(sources, chosen, options.unit),
                    "warnings": share_warnings(sources, chosen, options),
                    "source_caches": [str(s.cache.path) for s in sources], "files": files}
            (building / "mixture.json").write_text(json.dumps(meta, indent=2) + "\n")
            build = {"seconds": round(time.perf_counter() - started, 3), "tool_version": __version__}
            (building / "build.json").write_text(json.dumps(build, indent=2) + "\n")
    index = load_mixture(target)
    index.built_now = True
    return _said(index)


def _said(index: MixtureIndex) -> MixtureIndex:
    """The index, its warnings logged (a found index's too: the run that asked for it is told again)."""
    for warning in index.meta.get("warnings", []):  # an index older than its warnings has none
        logger.warning("mixture %s: %s", index.meta["key"], warning)
    return index


class MixedRows(Sequence):
    """The rows of a mixture index, as `open_cache` gives them, in the index's order; pickles as its path."""

    def __init__(self, path: str | Path):
        self.index = load_mixture(path)
        self.path = self.index.path
        check_sources(self.index)
        self.caches = [open_cache(p) for p in self.index.meta["source_caches"]]
        columns = [tuple(c.columns) for c in self.caches]
        if len(set(columns)) > 1:
            raise CacheError(f"{self.path}: the sources' caches have different columns ({columns})")
        self.columns = list(columns[0])

    def __len__(self) -> int:
        return len(self.index)

    @property
    def fingerprint(self) -> str:
        return self.index.meta["key"]

    def locate(self, i: int) -> tuple[int, int]:
        """(which of `caches`, which row of it) holds row `i` of the mixture."""
        return int(self.index.sources[i]), int(self.index.rows[i])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for a mixture of {len(self)} rows")
        source, row = self.locate(i % len(self))
        return self.caches[source][row]

    # Packed sequences of the mixed rows over their own packing index, built beside the mixture if missing.
    packed = TokenizedCache.packed

    @cached_property
    def lengths(self) -> np.ndarray:
        out = np.empty(len(self), dtype=np.int32)
        for s, cache in enumerate(self.caches):
            mine = self.index.sources == s
            out[mine] = cache.lengths[self.index.rows[mine]]
        return out

    def __reduce__(self):
        return open_mixture, (str(self.path),)

    def __repr__(self) -> str:
        return f"MixedRows({str(self.path)!r}, rows={len(self)}, sources={len(self.caches)})"


def open_mixture(path: str | Path) -> MixedRows:
    """The rows of the mixture index at `path` (a directory holding mixture.json)."""
    return MixedRows(path)


def mixture_dataset(path: str | Path, work_dir: str | Path | None = None):
    """The mixture as one `datasets.Dataset` without copying a row: the sources' work views concatenated and
    selected through an indices mapping (what `Dataset.select` keeps), for TRL and axolotl."""
    from datasets import concatenate_datasets, load_from_disk

    from sft_tokenize.read.trainers import work_view

    mixed = open_mixture(path)
    views = [load_from_disk(str(work_view(c.path, None if work_dir is None else Path(work_dir) / c.path.name)))
             for c in mixed.caches]
    starts = np.cumsum([0] + [len(c) for c in mixed.caches])[:-1]
    return concatenate_datasets(views).select(starts[np.asarray(mixed.index.sources)] + np.asarray(mixed.index.rows))
