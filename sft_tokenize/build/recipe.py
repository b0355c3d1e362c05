"""A recipe: several datasets, each read its own way, tokenized into a cache each and mixed by one index.

    tokenizer: Qwen/Qwen2.5-0.5B-Instruct      # shared: any run option that is not a source's own
    cache_dir: /data/cache
    max_length: 4096
    mixture: {unit: trained_tokens, budget: 20000000, seed: 0}
    sources:
      - name: chat
        sources: [data/chat/*.jsonl]
        weight: 0.6
      - name: alpaca
        sources: [data/alpaca.parquet]
        format: alpaca
        system_prompt: You are a careful assistant.
        weight: 0.4
      - name: gold
        sources: [data/gold.json]
        epochs: 3

Each source is an ordinary run with its own options and its own content-addressed cache (versions, gc and
resumption as for any run), so a changed weight re-tokenizes nothing and a grown source rebuilds alone; the
mixture index (read/mixture_index.py) is then built over the published caches. A bad recipe is one error
naming the key (`gold.yaml: sources[1].weight: ...`), raised before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import default_name
from sft_tokenize.errors import BadInput
from sft_tokenize.read.mixture_index import AMOUNTS, MixtureOptions, MixtureSettings, MixtureSource

# What each source decides for itself; every other run option is the recipe's, shared by its sources.
SOURCE_KEYS = ("sources", "name", "format", "columns", "system_prompt", "train_on", "template_kwargs", "split",
               "subset", "revision", "storage_options", "on_bad_row", "reasoning_turns")
SHARED_KEYS = tuple(name for name in TokenizeOptions.model_fields if name not in SOURCE_KEYS)


def _message(error: ValidationError) -> tuple[str, str]:
    first = error.errors()[0]
    return ".".join(map(str, first["loc"])), first["msg"].removeprefix("Value error, ")


class Recipe(BaseModel):
    """A recipe's shared run options, its sources and its mixture, checked as a whole before anything runs."""

    model_config = ConfigDict(extra="allow")  # the shared run options: checked against TokenizeOptions

    sources: list[dict[str, Any]] = Field(min_length=1, description="Each source: its own options (sources, "
                                          "format, columns, system_prompt, train_on, ...) and one amount "
                                          "(weight, epochs, rows or tokens).")
    mixture: MixtureSettings = Field(default_factory=MixtureSettings)

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        unknown = sorted(set(self.model_extra or {}) - set(SHARED_KEYS))
        if unknown:
            raise ValueError(f"{unknown[0]}: not a recipe key (a source's own options go under sources:)")
        names = [self.source_name(i) for i in range(len(self.sources))]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"sources: two sources are named {name!r}; give each its own name")
        self.mixture_options([""] * len(self.sources))
        return self

    def _own(self, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Source i's own options and its amount."""
        own = dict(self.sources[i])
        amount = {key: own.pop(key) for key in AMOUNTS if key in own}
        unknown = sorted(set(own) - set(SOURCE_KEYS))
        if unknown:
            where = "shared option: it goes at the recipe's top" if unknown[0] in SHARED_KEYS else "source key"
            raise ValueError(f"sources[{i}].{unknown[0]}: not a {where}")
        if "sources" not in own:
            raise ValueError(f"sources[{i}].sources: missing (the files, globs or hub:NAME it reads)")
        if len(amount) != 1:
            raise ValueError(f"sources[{i}]: give exactly one of {', '.join(AMOUNTS)}")
        return own, amount

    def source_options(self, i: int) -> TokenizeOptions:
        """Source i's run: the shared options, its own on top (template kwargs merged, its own winning)."""
        own, _ = self._own(i)
        shared = dict(self.model_extra or {})
        kwargs = {**shared.pop("template_kwargs", {}), **own.pop("template_kwargs", {})}
        try:
            return TokenizeOptions(**shared, **own, template_kwargs=kwargs)
        except ValidationError as error:
            where, message = _message(error)
            raise ValueError(f"sources[{i}].{where}: {message}") from None

    def source_name(self, i: int) -> str:
        options = self.source_options(i)
        return options.name or default_name(options.sources[0])

    def runs(self) -> list[TokenizeOptions]:
        """Every source's run, named (its cache's name) so that each source keeps its own cache."""
        return [self.source_options(i).model_copy(update={"name": self.source_name(i)})
                for i in range(len(self.sources))]

    def check_sources(self, where: str = "recipe") -> None:
        """Every source's inputs resolved (a glob matching nothing, a missing file), before any source runs."""
        from sft_tokenize.sources.resolve import resolve

        for i, options in enumerate(self.runs()):
            try:
                resolve(options.sources, split=options.split, subset=options.subset, revision=options.revision,
                        storage_options=options.storage_options, cache_root=str(options.cache_root))
            except BadInput as error:
                raise BadInput(f"{where}: sources[{i}] ({options.name}): {error}") from None

    def mixture_options(self, caches: list[str]) -> MixtureOptions:
        """The mixture of these published caches (one per source, in order)."""
        specs = [MixtureSource(cache=cache, name=self.source_name(i), **self._own(i)[1])
                 for i, cache in enumerate(caches)]
        try:
            return MixtureOptions(sources=specs, **self.mixture.model_dump())
        except ValidationError as error:
            where, message = _message(error)
            raise ValueError(f"mixture: {message}" if not where else f"mixture.{where}: {message}") from None


def check_recipe(raw: Any, where: str = "recipe") -> Recipe:
    """`raw` (a parsed YAML mapping) as a Recipe; BadInput naming `where` and the key if it is not one."""
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: a recipe is a mapping of shared options with a sources: list")
    try:
        return Recipe(**raw)
    except ValidationError as error:
        key, message = _message(error)
        # A field's error names its key here; the recipe's own checks name theirs in the message.
        raise BadInput(f"{where}: {key + ': ' if key else ''}{message}") from None


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """The recipe in a YAML (or JSON) file, `overrides` (e.g. the command line's --cache-dir) on top."""
    import yaml

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise BadInput(f"{path}: cannot read the recipe ({error.strerror})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark else ""
        raise BadInput(f"{path}{line}: not YAML ({getattr(error, 'problem', None) or error})") from None
    if isinstance(raw, dict):
        raw = {**raw, **(overrides or {})}
    return check_recipe(raw, where=str(path))
