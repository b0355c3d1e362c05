"""What a mixture is made of: its sources, each with a weight or an absolute amount, and how it counts,
sizes and orders them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sft_tokenize.format.layout import MIXTURES

Unit = Literal["rows", "tokens", "trained_tokens"]
AMOUNTS = ("weight", "epochs", "rows", "tokens")
CAPS = ("max_epochs", "max_share")  # limits on what a weight takes; the rest goes to the other weighted sources
# The largest index built unless `max_index_rows` says otherwise: a typo (`rows: 1000000000`, `epochs: 1e9`) is
# refused, naming its source, instead of filling the memory or the disk. 100M rows are 1.6 GB on disk.
MAX_INDEX_ROWS = 100_000_000


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
    max_epochs: float | None = Field(None, gt=0, allow_inf_nan=False, description="With a weight: the most epochs "
                                     "of this source the weight may take; what it cannot take goes to the other "
                                     "weighted sources, by their weights.")
    max_share: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="With a weight: the largest "
                                    "share of the budget (in the mixture's unit) this source may take; the rest goes "
                                    "to the other weighted sources, by their weights.")

    @model_validator(mode="after")
    def _one_amount(self) -> MixtureSource:
        given = [key for key in AMOUNTS if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"source {self.name or self.cache}: give exactly one of {', '.join(AMOUNTS)} "
                             f"({'none' if not given else ', '.join(given)} given)")
        if self.caps and self.weight is None:
            raise ValueError(f"source {self.name or self.cache}: {', '.join(self.caps)} limits what a weight takes; "
                             f"this source asks for {given[0]}, an absolute amount")
        return self

    @property
    def caps(self) -> dict[str, float]:
        """The caps given (max_epochs, max_share)."""
        return {key: getattr(self, key) for key in CAPS if getattr(self, key) is not None}

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
    index_dir: str | None = Field(None, description=f"Where to write the index (default: <cache root>/{MIXTURES}).")
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
