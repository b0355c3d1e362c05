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
naming the key (`gold.yaml: sources[1].weight: ...`), raised before anything runs: a key given twice, a file
that is not UTF-8 and an amount too large for an index among them. A recipe file's relative paths are
relative to its directory, wherever it is run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import default_name
from sft_tokenize.errors import BadInput
from sft_tokenize.format.layout import MIXTURES
from sft_tokenize.read.mixture_options import AMOUNTS, CAPS, MixtureOptions, MixtureSettings, MixtureSource
from sft_tokenize.read.mixture_selection import check_index_size, least_rows

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
                                          "(weight, epochs, rows or tokens), and with a weight its caps "
                                          "(max_epochs, max_share).")
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
        mixture = self.mixture_options([""] * len(self.sources))
        # What the amounts alone say of the index's size: a typo is refused now, not after every source ran.
        shared = self.source_options(0)
        if shared.remote_root:
            raise ValueError(f"cache_dir: {shared.remote_root}: a recipe's mixture index is built beside local caches; "
                             "build it under a local cache_dir (a bucket takes single runs: `sft-tokenize run`)")
        root = shared.cache_root / MIXTURES
        check_index_size(least_rows(mixture, shared.max_length), mixture,
                         Path(os.path.abspath(mixture.index_dir)) if mixture.index_dir else root, at_least=True)
        return self

    def _own(self, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Source i's own options and its amount (with its caps)."""
        own = dict(self.sources[i])
        amount = {key: own.pop(key) for key in AMOUNTS + CAPS if key in own}
        unknown = sorted(set(own) - set(SOURCE_KEYS))
        if unknown:
            where = "shared option: it goes at the recipe's top" if unknown[0] in SHARED_KEYS else "source key"
            raise ValueError(f"sources[{i}].{unknown[0]}: not a {where}")
        if "sources" not in own:
            raise ValueError(f"sources[{i}].sources: missing (the files, globs or hub:NAME it reads)")
        if len(set(amount) & set(AMOUNTS)) != 1:
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
        specs = []
        for i, cache in enumerate(caches):
            name = self.source_name(i)
            try:
                specs.append(MixtureSource(cache=cache, name=name, **self._own(i)[1]))
            except ValidationError as error:
                where, message = _message(error)
                raise ValueError(f"sources[{i}] ({name}): {where}: {message}") from None
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


# A recipe saved in another encoding starts with its byte-order mark (the longer UTF-32 marks first: they begin
# with UTF-16's).
_BYTE_ORDER_MARKS = ((b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"), (b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"),
                     (b"\xfe\xff", "UTF-16 (big-endian)"), (b"\xff\xfe", "UTF-16 (little-endian)"))


def _recipe_text(path: Path) -> str:
    """The recipe file's text: UTF-8 (a UTF-8 byte-order mark is allowed); BadInput naming what it is if not."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise BadInput(f"{path}: cannot read the recipe ({error.strerror})") from None
    for mark, encoding in _BYTE_ORDER_MARKS:
        if data.startswith(mark):
            raise BadInput(f"{path}: the recipe is {encoding} text (it starts with that byte-order mark); save it "
                           "as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise BadInput(f"{path}, line {line}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset "
                       f"{error.start}); save the recipe as UTF-8") from None
    if "\x00" in text:  # valid UTF-8, but no YAML holds a NUL: UTF-16 or UTF-32 saved without a byte-order mark
        raise BadInput(f"{path}: not UTF-8 text (a NUL byte at offset {data.index(0)}: UTF-16 or UTF-32 without a "
                       "byte-order mark?); save the recipe as UTF-8")
    return text.removeprefix("\ufeff")


class DuplicateKey(Exception):
    """A mapping of the recipe gives a key twice (YAML would keep the last one without a word)."""

    def __init__(self, key: Any, line: int, first: int):
        self.key, self.line, self.first = key, line, first
        super().__init__(f"line {line}: {key}: given twice (first on line {first}); give each key once")


def _loader() -> type:
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        """YAML's safe loader, refusing a mapping that gives a key twice (`<<` merges may still be overridden)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                    try:
                        if key in seen:
                            raise DuplicateKey(key, line, seen[key])
                        seen[key] = line
                    except TypeError:  # an unhashable key: the base loader says so
                        continue
            return super().construct_mapping(node, deep=deep)

    return RecipeLoader


def read_recipe_file(path: str | Path) -> Any:
    """The parsed YAML (or JSON) of a recipe file; BadInput naming the file and the line if it is not one."""
    import yaml

    path = Path(path)
    text = _recipe_text(path)
    try:
        return yaml.load(text, Loader=_loader())  # a SafeLoader subclass: plain data only
    except DuplicateKey as error:
        raise BadInput(f"{path}, {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f", line {mark.line + 1}" if mark else ""
        raise BadInput(f"{path}{line}: not YAML ({getattr(error, 'problem', None) or error})") from None


def _is_relative_path(value: Any) -> bool:
    """A relative local path (not ~, a URL or hub:NAME)."""
    return (isinstance(value, str) and bool(value) and not os.path.isabs(value) and not value.startswith(("~", "hub:"))
            and "://" not in value)


def _model_path(value: Any, base: Path) -> Any:
    """A tokenizer or processor: a path when it names one beside the recipe or looks like one (as
    encoding/tokenizer.py tells them), else a hub name, left as it is."""
    if not _is_relative_path(value):
        return value
    beside = os.path.normpath(base / value)
    return beside if os.path.exists(beside) or value.startswith(".") or value.count("/") > 1 else value


def relative_to(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """`raw` with its relative paths made absolute against `base` (the recipe file's directory), as compose
    files resolve theirs: the recipe means the same files from whatever directory it is run."""
    def path(value: Any) -> Any:
        return os.path.normpath(base / value) if _is_relative_path(value) else value

    out = dict(raw)
    for key in ("cache_dir", "image_root"):
        if key in out:
            out[key] = path(out[key])
    for key in ("tokenizer", "processor"):
        if key in out:
            out[key] = _model_path(out[key], base)
    template = out.get("chat_template")
    if isinstance(template, str) and "{" not in template:  # a file's path, not the template's text
        out["chat_template"] = path(template)
    if isinstance(out.get("mixture"), dict) and "index_dir" in out["mixture"]:
        out["mixture"] = {**out["mixture"], "index_dir": path(out["mixture"]["index_dir"])}
    if isinstance(out.get("sources"), list):
        out["sources"] = [_source_relative_to(source, path) for source in out["sources"]]
    return out


def _source_relative_to(source: Any, path: Callable[[Any], Any]) -> Any:
    if not isinstance(source, dict) or not isinstance(source.get("sources"), list) or not source["sources"]:
        return source
    named = {} if "name" in source or not isinstance(source["sources"][0], str) else {
        "name": default_name(source["sources"][0])}  # the name its spec gave (`.` is not its directory's name)
    return {**source, **named, "sources": [path(spec) for spec in source["sources"]]}


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """The recipe in a YAML (or JSON) file, `overrides` (e.g. the command line's --cache-dir) on top."""
    path = Path(path)
    raw = read_recipe_file(path)
    if isinstance(raw, dict):  # the command line's overrides are relative to where it runs, not to the recipe
        raw = {**relative_to(raw, Path(os.path.abspath(path)).parent), **(overrides or {})}
    return check_recipe(raw, where=str(path))
