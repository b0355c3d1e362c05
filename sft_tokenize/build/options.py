"""The options of one tokenization run, each declared once: what the CLI, the flow's typed form and the data
plane share.

TokenizeOptions is the table. Each field says, in one place, the option's type, default and help text (its
pydantic description: the Prefect UI form and `sft-tokenize run --help` show the same words), its checks
(pydantic constraints and validators) and, in an `Option` beside its type, what pydantic does not hold: where
`--help` lists it and how the flag is parsed, whether it changes the cache's rows (the fingerprint hashes it)
and whether the slices read it (a field of the Job). The command line (cli/arguments.py), the fingerprint
(plan.py) and the Job (job.py) are derived from it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from sft_tokenize.build.remote_root import remote_url, split_url, working_dir
from sft_tokenize.files import IMAGE_ACCESS, REMOTE_TIMEOUT, REQUEST_TIMEOUT
from sft_tokenize.flags import Flag, json_object, positive_int, positive_seconds, role_column
from sft_tokenize.flags import declared as declared_in
from sft_tokenize.read.layouts import Layout

Format = Literal["auto", "chat", "alpaca", "prompt-completion", "text"]
TrainOn = Literal["all_assistant", "last_assistant", "completion", "all"]
Truncation = Literal["truncate", "drop"]
OnBadRow = Literal["raise", "skip"]
ExtraColumn = Literal["labels", "attention_mask", "pixel_values"]
ReasoningTurns = Literal["as-rendered", "expand"]
SpecialText = Literal["literal", "error", "keep"]
Encoder = Literal["auto", "hf", "fastokens"]
Render = Literal["skeleton", "full"]
ImagesMode = Literal["embed", "reference"]
ImageAccess = Literal[IMAGE_ACCESS]  # type: ignore[valid-type]  # the read side's collator checks the same values

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(size: int | str) -> int:
    """'256MB' → 256_000_000, '1GiB' → 2**30, 4096 → 4096."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"not a size: {size!r} (examples: 64MB, 1GiB, 500000)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    binary = "i" in unit
    prefix = unit[:1] if unit[:1] in "kmgt" else ""
    scale = 1024 ** ("kmgt".index(prefix) + 1) if binary and prefix else _UNITS[prefix]
    return int(number * scale)


def sorted_tuple(values: list[str]) -> tuple[str, ...]:
    """A set of names in one order, whatever order they were given in."""
    return tuple(sorted(values))


# The sections of `sft-tokenize run --help` (and of docs/cli.md).
INPUT = "input"
MASKS = "loss masks and templates"
OUTPUT = "output"
SLICES = "slices, runners and retries"
VERSIONS = "versions, the server and logs"


# --request-timeout's text: the run's option and each reading command's flag (cli/arguments.py) say this
REQUEST_TIMEOUT_HELP = ("how long a request to object storage or an http(s) server (the cache root, a remote source, "
                        "a cache version read from a bucket) may wait to connect and for each answer; one that gets "
                        "none, or is refused, fails (on object storage after one more try) in one line naming the "
                        "endpoint (in a run, its slice fails)")


@dataclass(frozen=True)
class Option(Flag):
    """What an option's pydantic field does not say: its flag (Flag), and what the cache makes of it."""

    # "value": the fingerprint hashes the option's value (as the Job holds it) under its name; "resolved": it
    # hashes what the plan resolves from it (the files read, their columns, the tokenizer's files, the template's
    # text); None: the option does not change the cache's rows.
    fingerprint: Literal["value", "resolved"] | None = None
    only_with: str | None = None  # hashed as None unless this other option is set: without it the option never acts
    # Hashed only when set: an option added after caches were built keeps their fingerprints while unset.
    hashed_when_set: bool = False
    job: bool | Callable[[Any], Any] = False  # the slices read it: True as given, or the value this makes of it


class TokenizeOptions(BaseModel):
    """Everything that decides what a run reads and writes. Shown as the flow's form in the Prefect UI.

    The order of the fingerprinted options is the order of the fingerprint's inputs in every manifest."""

    model_config = ConfigDict(extra="forbid")

    sources: Annotated[list[str], Option(INPUT, metavar="SOURCE", positional=True, fingerprint="resolved",
                                               cli_note=" (or --recipe)")] = Field(
        min_length=1, description="files, globs, directories, fsspec URLs, or hub:NAME for a Hugging Face hub dataset")
    tokenizer: Annotated[str | None, Option(INPUT, metavar="PATH_OR_NAME", fingerprint="resolved")] = Field(
        None, description="a local tokenizer directory, a Hugging Face hub model name, or a directory's URL on "
                          "object storage (copied once per machine) (default: the processor's)")
    processor: Annotated[str | None, Option(INPUT, metavar="PATH_OR_NAME", fingerprint="resolved")] = Field(
        None, description="a vision-language model's processor (a directory or hub name holding its "
                          "preprocessor_config.json): rows with images are tokenized by its image rule; see "
                          "docs/images.md")
    images: Annotated[ImagesMode, Option(OUTPUT, fingerprint="value", only_with="processor", hashed_when_set=True,
                                         job=True)] = Field(
        "embed", description="how image rows keep their images: embed (the original encoded bytes) or reference "
                             "(path or URL, content hash and size: for images already on shared storage)")
    image_root: Annotated[str | None, Option(INPUT, metavar="DIR", fingerprint="value", only_with="processor",
                                             hashed_when_set=True, job=True)] = Field(
        None, description="where relative image paths resolve (default: the directory of the file naming them)")
    image_access: Annotated[ImageAccess, Option(INPUT, fingerprint="value", only_with="processor",
                                                hashed_when_set=True, job=True)] = Field(
        "root", description="which image locations a row may name: root (relative paths that stay inside the image "
                            "root), local (any local file: absolute paths, ~, ../), root+urls or local+urls (URLs "
                            "too: http(s), s3, gs, hf, ...); see docs/images.md")
    image_timeout: Annotated[float, Option(INPUT, metavar="SECONDS", parse=positive_seconds, job=True)] = Field(
        REMOTE_TIMEOUT, gt=0, description="how long a remote image's connect and each of its reads may wait before "
                                          "the row is a bad row (image_unreadable)")
    max_image_bytes: Annotated[str, Option(INPUT, metavar="SIZE", fingerprint="value", only_with="processor",
                                           hashed_when_set=True, job=parse_size)] = Field(
        "50MB", description="largest image file read: a larger one is a bad row (image_too_large), never decoded")
    cache_dir: Annotated[str, Option(OUTPUT, metavar="DIR")] = Field(
        description="the cache root: published caches, their versions, staging and the shard store live under it; "
                    "a path, or an fsspec URL (s3://bucket/prefix, gs://...) whose credentials are --storage-options "
                    "and the environment's")
    name: Annotated[str | None, Option(OUTPUT)] = Field(
        None, description="cache name (default: the first source's stem): letters, digits, '.', '_' or '-'")
    format: Annotated[Format, Option(INPUT, fingerprint="resolved")] = Field(
        "auto", description="the rows' format; auto: told by the columns of the first file")
    columns: Annotated[dict[str, str], Option(INPUT, metavar="ROLE=NAME", flag="--column", parse=role_column,
                                              repeat=True, fingerprint="resolved")] = Field(
        default_factory=dict,
        description="the column of a role (messages, system, tools, instruction, input, output, history, prompt, "
                    "completion, text) where it is not the role's usual name, e.g. completion=response")
    split: Annotated[str, Option(INPUT, fingerprint="resolved")] = Field(
        "train", description="split of a hub dataset or of a saved DatasetDict")
    subset: Annotated[str | None, Option(INPUT, fingerprint="resolved")] = Field(
        None, description="config (subset) of a hub dataset")
    revision: Annotated[str | None, Option(fingerprint="resolved")] = Field(
        None, description="revision of a hub dataset")
    tokenizer_revision: Annotated[str | None, Option(fingerprint="resolved")] = Field(
        None, description="revision of a hub tokenizer")
    system_prompt: Annotated[str | None, Option(INPUT, metavar="TEXT", fingerprint="value", hashed_when_set=True,
                                                job=True)] = Field(
        None, description="a system message for the conversations that have none (a recipe's per-source prompt)")
    chat_template: Annotated[str | None, Option(MASKS, metavar="FILE", fingerprint="resolved")] = Field(
        None, description="a .jinja file (or the template's text) overriding the tokenizer's chat template")
    template_kwargs: Annotated[dict, Option(MASKS, metavar="JSON", parse=json_object, fingerprint="value",
                                            job=True)] = Field(
        default_factory=dict,
        description='variables for the chat template, a JSON object (e.g. \'{"enable_thinking": false}\' or a '
                    "fixed date_string)")
    reasoning_turns: Annotated[ReasoningTurns, Option(MASKS, fingerprint="value", job=True)] = Field(
        "as-rendered", description="expand: one more row per assistant turn whose reasoning the template drops in "
                                   "history, so every turn's reasoning is trained")
    special_text: Annotated[SpecialText, Option(MASKS, fingerprint="value", job=True)] = Field(
        "literal", description="a control token's text inside a message: literal encodes it as plain text, error "
                               "rejects the row, keep encodes it as the control token, as apply_chat_template does")
    train_on: Annotated[TrainOn, Option(MASKS, fingerprint="value", job=True)] = Field(
        "all_assistant", description="which tokens the loss mask trains on; see docs/masks.md")
    max_length: Annotated[int | None, Option(MASKS, metavar="N", parse=positive_int, fingerprint="value",
                                             job=True)] = Field(
        None, gt=0, description="longest row in tokens (default: no limit)")
    truncation: Annotated[Truncation, Option(MASKS, fingerprint="value", only_with="max_length", job=True)] = Field(
        "truncate", description="what happens to a row longer than the maximum length: truncated or dropped")
    extra_columns: Annotated[list[ExtraColumn], Option(OUTPUT, flag="--extra-column", repeat=True,
                                                       fingerprint="value", job=sorted_tuple)] = Field(
        default_factory=list,
        description="also store this column: labels, attention_mask, or pixel_values (image rows, Qwen-VL: float32, "
                    "as SkyRL's reader wants them; ~18 KiB per image token, see docs/images.md)")
    layout: Annotated[Layout, Option(OUTPUT, fingerprint="value", job=True)] = Field(
        "skyrl", description="the trainer whose columns the cache holds: skyrl (input_ids, loss_mask), trl "
                             "(input_ids, labels), axolotl or llama-factory (input_ids, attention_mask, labels); "
                             "see docs/trainers.md")
    encoder: Annotated[Encoder, Option(OUTPUT, job=True)] = Field(
        "auto", description="who turns text into ids: hf (tokenizers), fastokens (the fast extra; refused, and said "
                            "so, where its ids could differ), auto (fastokens where exact, else hf); the cache's "
                            "bytes are the same, so it is not in the fingerprint")
    render: Annotated[Render, Option(OUTPUT, job=True)] = Field(
        "skeleton", description="how rows reach the chat template: skeleton (a row whose shape was rendered before "
                                "is filled in where that is exact, with samples checked against a full render; see "
                                "docs/masks.md), full (every row rendered). The bytes are meant to be the same, but "
                                "full is fingerprinted apart: a --render full run never returns a skeleton-built cache "
                                "(sft-tokenize verify re-checks one)")
    # A skip run may hold fewer rows than a raise run would refuse to publish: never the same cache.
    on_bad_row: Annotated[OnBadRow, Option(INPUT, fingerprint="value", job=True)] = Field(
        "raise", description="raise: stop at the first malformed row; skip: skip it and count it")
    max_row_bytes: Annotated[str, Option(INPUT, metavar="SIZE", fingerprint="value", job=parse_size)] = Field(
        "2MB", description="largest JSON line read: a longer one is a bad row (row_too_large), never decoded; each "
                           "MB of a row in flight costs a worker about 180 MB while it is tokenized")
    storage_options: Annotated[dict, Option(INPUT, metavar="JSON", parse=json_object, job=True)] = Field(
        default_factory=dict,
        description='fsspec options for remote sources, a JSON object (e.g. \'{"anon": true}\'); prefer '
                    "credentials from the environment: these are stored with the run's parameters")
    request_timeout: Annotated[float, Option(OUTPUT, metavar="SECONDS", parse=positive_seconds, job=True)] = Field(
        REQUEST_TIMEOUT, gt=0, description=REQUEST_TIMEOUT_HELP)
    shard_size: Annotated[str, Option(SLICES, metavar="SIZE")] = Field(
        "256MB", description="input bytes per slice (one shard each, and one task each unless a run of many slices "
                          "groups them: --slices-per-task)")
    writer_batch_rows: Annotated[int, Option(job=True)] = Field(
        1000, gt=0, description="rows per record batch written to a shard, at most")
    # A slice's thread holds about three of these of image bytes (the batch buffered, the next one loading, its
    # Arrow copy): a slice of fewer images holds less, so 64MB let a worker's memory grow with the slice's size
    # (11 % from the image benchmark's 1x to 4x). Text rows, 5-9 bytes a token, mostly reach the 1,000 rows first.
    writer_batch_bytes: Annotated[str, Option(job=parse_size)] = Field(
        "16MB", description="bytes per record batch written to a shard, at most")
    trust_remote_code: Annotated[bool, Option(job=True)] = Field(
        False, description="let a hub tokenizer run its own code (transformers' trust_remote_code)")

    @field_validator("name")
    @classmethod
    def _name_stays_inside_the_cache_root(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
            raise ValueError(
                f"cache name {name!r} must be letters, digits, '.', '_' or '-' and start with a letter or "
                "digit (no path separators)"
            )
        return name

    @model_validator(mode="after")
    def _a_tokenizer_or_a_processor(self) -> TokenizeOptions:
        if self.tokenizer is None:
            if self.processor is None:
                raise ValueError("give a tokenizer (--tokenizer), or a processor (--processor) whose tokenizer it is")
            self.tokenizer = self.processor
        return self

    @model_validator(mode="after")
    def _pixels_need_a_processor(self) -> TokenizeOptions:
        if "pixel_values" in self.extra_columns and self.processor is None:
            raise ValueError("--extra-column pixel_values needs --processor: pixels are made by the processor's "
                             "image processor")
        return self

    @field_validator("shard_size", "writer_batch_bytes", "max_row_bytes", "max_image_bytes")
    @classmethod
    def _is_a_size(cls, size: str) -> str:
        if parse_size(size) <= 0:
            raise ValueError(f"size must be positive: {size!r}")
        return size

    @property
    def remote_root(self) -> str | None:
        """The URL of a cache root on object storage (remote_root.py), or None for a local one."""
        return remote_url(self.cache_dir)

    @property
    def cache_root(self) -> Path:
        """The local root: the directory itself, or for a remote root this machine's working directory for it."""
        protocol, local = split_url(self.cache_dir)
        if protocol:
            return working_dir(local)
        return Path(os.path.abspath(Path(local).expanduser()))  # normalised: no `in/../caches`


def declared(model: type[BaseModel] = TokenizeOptions) -> Iterator[tuple[str, FieldInfo, Option]]:
    """Each option of `model` in table order: its name, its pydantic field and its Option."""
    for name, info, option in declared_in(model):
        if isinstance(option, Option):
            yield name, info, option


def _as_the_job_holds_it(option: Option, value: Any) -> Any:
    return option.job(value) if callable(option.job) else value


def job_options() -> Iterator[tuple[str, Any, Any]]:
    """The Job's option fields: each option the slices read, its type there and its default there."""
    for name, info, option in declared():
        if option.job:
            default = _as_the_job_holds_it(option, info.get_default(call_default_factory=True))
            kind = info.annotation if option.job is True else option.job.__annotations__["return"]
            yield name, kind, default


def job_values(options: TokenizeOptions) -> dict[str, Any]:
    """The Job's option fields for this run."""
    return {name: _as_the_job_holds_it(option, getattr(options, name))
            for name, _, option in declared() if option.job}


def hashed_values(options: TokenizeOptions) -> dict[str, Any]:
    """The options the fingerprint hashes by value, by name, in table order (the plan adds what it resolves)."""
    hashed = {}
    for name, _, option in declared():
        if option.fingerprint == "value":
            value = _as_the_job_holds_it(option, getattr(options, name))
            if option.only_with is not None and not getattr(options, option.only_with):
                value = None
            if option.hashed_when_set and value is None:
                continue
            hashed[name] = list(value) if isinstance(value, tuple) else value  # as JSON holds it
    return hashed
