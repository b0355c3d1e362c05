"""How rows are chosen (the same rule for every unit: rows, tokens, trained tokens). A source's amount is its
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

import math
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.errors import BadInput
from sft_tokenize.files import human_size
from sft_tokenize.read.cache import TokenizedCache
from sft_tokenize.read.length_costs import row_tokens
from sft_tokenize.read.mixture_options import MixtureOptions, MixtureSettings, MixtureSource

INDEX_BYTES_PER_ROW = 16  # on disk: an int64 in sources.npy and one in rows.npy
# Memory while an index is built, per row: its arrays, the interleaving's keys and sort (87 measured, 20M rows).
INDEX_BUILD_BYTES_PER_ROW = 96
# A weighted source whose achieved share of the weighted sources' total misses its weight by more than this
# (absolute: 0.05 is five points) is warned about: the budget is too small for its rows.
SHARE_TOLERANCE = 0.05


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
        caps = {"caps": self.spec.caps} if self.spec.caps else {}  # an index without caps keeps its key
        return {"name": self.name, "cache": self.cache.path.name, "fingerprint": self.cache.manifest["fingerprint"],
                "rows": len(self.cache), "amount": dict([self.spec.amount]), **caps}


def trained_lengths(cache: TokenizedCache) -> np.ndarray:
    """Trained tokens per row (loss_mask 1, or a label other than -100), a chunk of rows at a time."""
    if cache.table is None:
        return np.empty(0, dtype=np.int64)
    return row_tokens(cache.table, ()).trained


def row_units(cache: TokenizedCache, unit: str) -> np.ndarray:
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
        for i, (target, _) in weighted_targets(sources, left, options).items():
            chosen[i] = _rows_for_units(sources[i].units, target, options.seed, i)
    return chosen


def _cap(source: SourceRows, budget: int | None) -> tuple[float, str | None]:
    """The most units `source`'s caps let its weight take, and the cap that says so ((inf, None): no cap)."""
    allowed = [(value * (float(source.units.sum()) if cap == "max_epochs" else float(budget or 0)), cap)
               for cap, value in source.spec.caps.items()]
    return min(allowed, default=(math.inf, None))


def weighted_targets(sources: list[SourceRows], left: float, options: MixtureOptions
                     ) -> dict[int, tuple[float, str | None]]:
    """Per weighted source, the units it takes of what the budget leaves (`left`) and the cap that bounds it, if
    any. Weights share `left`; a source whose share passes one of its caps takes its cap instead, and the
    weights of the sources not yet capped share what is still left, until no share passes a cap. Where every
    source is capped, part of the budget stays unfilled (`share_warnings` says so)."""
    free = [i for i, s in enumerate(sources) if s.spec.weight is not None]
    limit = {i: _cap(sources[i], options.budget) for i in free}
    out: dict[int, tuple[float, str | None]] = {}
    while free:
        weights = sum(sources[i].spec.weight for i in free)
        share = {i: left * sources[i].spec.weight / weights for i in free}
        over = [i for i in free if share[i] > limit[i][0]]
        if not over:
            out.update({i: (share[i], None) for i in free})
            break
        for i in over:
            out[i] = limit[i]
            left -= limit[i][0]
            free.remove(i)
    return dict(sorted(out.items()))


def _absolute(sources: list[SourceRows], chosen: list[np.ndarray]) -> int:
    """The units the sources asked for by absolute amounts (epochs, rows, tokens) took."""
    return sum(int(s.units[rows].sum()) for s, rows in zip(sources, chosen, strict=True) if s.spec.weight is None)


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
    for i, (target, _) in weighted_targets(sources, left, options).items() if left > 0 else ():
        planned.append((f"source {sources[i].name}", _asked("weight", sources[i].spec.weight),
                        _about(sources[i].units, target)))
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
            f"({human_size(total * INDEX_BYTES_PER_ROW)} on disk, {human_size(total * INDEX_BUILD_BYTES_PER_ROW)} "
            f"of memory to build it{its})")
    if total > options.max_index_rows:
        raise BadInput(f"{what}, over the bound of {options.max_index_rows:,} rows (the mixture's max_index_rows: "
                       "raise it if you mean it)")
    memory = _available_memory()
    if memory is not None and total * INDEX_BUILD_BYTES_PER_ROW > memory:
        raise BadInput(f"{what}, more than the {human_size(memory)} of memory available")
    existing = next((p for p in (index_root, *index_root.parents) if p.exists()), None) if index_root else None
    if existing is not None and total * INDEX_BYTES_PER_ROW > shutil.disk_usage(existing).free:
        raise BadInput(f"{what}, more than the {human_size(shutil.disk_usage(existing).free)} free under {existing}")


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


def _planned(sources: list[SourceRows], chosen: list[np.ndarray], options: MixtureOptions
             ) -> dict[int, tuple[float, str | None]]:
    """weighted_targets as choose_rows met them (what the budget left after the absolute amounts)."""
    if not any(s.spec.weight is not None for s in sources):
        return {}
    return weighted_targets(sources, (options.budget or 0) - _absolute(sources, chosen), options)


def source_summary(sources: list[SourceRows], chosen: list[np.ndarray], options: MixtureOptions) -> list[dict]:
    """Per source: what was asked (and its caps: which one bounded it, and the share planned after the caps),
    what was achieved (rows, tokens, trained tokens, share, epochs)."""
    unit = options.unit
    total = sum(int(s.units[rows].sum()) for s, rows in zip(sources, chosen, strict=True))
    planned = _planned(sources, chosen, options)
    out = []
    for i, (source, rows) in enumerate(zip(sources, chosen, strict=True)):
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
        if source.spec.caps:
            target, cap = planned[i]
            out[-1]["caps"] = {**source.spec.caps, "capped_by": cap,
                               "planned_share": round(target / options.budget, 6) if options.budget else 0.0}
    return out


def share_warnings(sources: list[SourceRows], chosen: list[np.ndarray], options: MixtureOptions) -> list[str]:
    """One line per weighted source whose share of the weighted sources' total misses its planned share (its
    weight, or what its caps left it) by more than SHARE_TOLERANCE: rows are whole, and each weighted source
    takes at least one. And one line if the caps left part of the budget unfilled."""
    planned = _planned(sources, chosen, options)
    achieved = {i: int(sources[i].units[chosen[i]].sum()) for i in planned}
    total, planned_total = sum(achieved.values()), sum(target for target, _ in planned.values())
    warnings = []
    left = (options.budget or 0) - _absolute(sources, chosen)
    if planned and planned_total < left * (1 - 1e-9):
        capped = ", ".join(f"{sources[i].name} ({cap} {sources[i].spec.caps[cap]:g})" for i, (_, cap) in
                           planned.items())
        warnings.append(f"every weighted source is capped ({capped}): they take {planned_total:,.0f} of the "
                        f"{left:,.0f} {options.unit} the budget leaves them; the mixture is that much smaller")
    for i in planned if total else []:
        share, weight = achieved[i] / total, planned[i][0] / planned_total if planned_total else 0.0
        if abs(share - weight) > SHARE_TOLERANCE:
            capped = any(cap for _, cap in planned.values())
            asked = f"planned {weight:.1%} after the caps" if capped else f"asked weight {sources[i].spec.weight:g}"
            warnings.append(
                f"source {sources[i].name}: {asked}, achieved {share:.1%} of the weighted sources' "
                f"{options.unit} ({achieved[i]:,} of {total:,}), more than {SHARE_TOLERANCE * 100:g} points off: "
                f"the budget ({options.budget:,} {options.unit}) is small against whole rows of up to "
                f"{int(sources[i].units.max()):,}; a larger budget comes closer")
    return warnings
