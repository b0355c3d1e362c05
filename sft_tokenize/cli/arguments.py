"""`sft-tokenize`'s command line: its arguments, checked as they are parsed, and the flow options they make.

Every flag is a declared option (sft_tokenize/flags.py): the flow's (TokenizeRun, PackOptions) and the command
line's own (the models below), so `--help`, the flow's form and docs/cli.md say the same. A usage error is one
line on stderr with exit code 2, as every other bad input is (cli.py).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Annotated, Any, Literal, get_origin

from pydantic import BaseModel, Field

from sft_tokenize.build.options import INPUT, MASKS, OUTPUT, REQUEST_TIMEOUT_HELP, SLICES, VERSIONS
from sft_tokenize.files import REQUEST_TIMEOUT
from sft_tokenize.flags import (
    Flag,
    choices,
    declared,
    flag_default,
    flag_names,
    help_text,
    json_object,
    non_negative_seconds,
    positive_int,
    positive_seconds,
    sequence_length,
    shown_default,
)
from sft_tokenize.flows.run_options import RUN_OPTIONS, TokenizeRun
from sft_tokenize.read.packing_options import PACK, PackOptions
from sft_tokenize.server.server_state import DEFAULT_SERVER_IDLE, SERVER_IDLE_ENV

PROG = "sft-tokenize"
EXIT_BAD_INPUT = 2
SECTIONS = (INPUT, MASKS, OUTPUT, SLICES, VERSIONS)  # of `sft-tokenize run --help`, in this order
FLAGS = "flags"  # the one group of a command whose flags have no sections


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


class RunCommand(BaseModel):
    """`sft-tokenize run`'s own flags: how the command line reads a run and talks, not options of the flow."""

    recipe: Annotated[str | None, Flag(INPUT, metavar="FILE")] = Field(
        None, description="a YAML recipe: several sources, each with its own options, tokenized into a cache each and "
                          "mixed by a mixture index (docs/mixtures.md); prints the index's path. --tokenizer and "
                          "--cache-dir, if given, override the recipe's")
    plan_only: Annotated[bool, Flag(INPUT)] = Field(
        False, description="print what the run would do and write nothing: its slices and input bytes, whether the "
                           "cache is published and which slices the shard store holds, and the tokens and time "
                           "estimated by tokenizing a sample of the rows; no Prefect")
    messages_column: Annotated[str | None, Flag(INPUT, metavar="COL")] = Field(
        None, description="the column holding the conversations (--column messages=COL)")
    server_idle: Annotated[float, Flag(VERSIONS, metavar="SECONDS", parse=_seconds)] = Field(
        DEFAULT_SERVER_IDLE, description="how long the embedded Prefect server stays up once its last run leaves, "
                                         f"for the next run; 0: it stops with the last run; ${SERVER_IDLE_ENV} "
                                         "sets another default")
    resident: Annotated[bool, Flag(VERSIONS)] = Field(
        False, description="Linux: run in this user's resident process when one is ready (its imports done, the "
                           "last run's tokenizer prepared), and leave one beside the server for the next run; "
                           "what differs then: docs/cli.md; $SFT_TOKENIZE_RESIDENT=1 asks for it on every run")
    quiet: Annotated[bool, Flag(VERSIONS, short="-q", exclusive="noise")] = Field(
        False, description="no Prefect run logs on stderr")
    verbose: Annotated[bool, Flag(VERSIONS, short="-v", exclusive="noise")] = Field(
        False, description="Prefect run logs with tracebacks")


# How a reader's command reaches a cache on object storage: one declaration, for each command that takes a URL.
ReadStorageOptions = Annotated[dict, Flag(FLAGS, metavar="JSON", parse=json_object)]
READ_STORAGE_OPTIONS = Field(
    default_factory=dict, description='fsspec options for a cache URL\'s filesystem, a JSON object (e.g. \'{"profile": '
                                      '"training"}\'); credentials are better taken from the environment (AWS_* '
                                      "variables, a profile)")
# The run's --request-timeout (build/options.py), for each command that reads a URL
ReadRequestTimeout = Annotated[float, Flag(FLAGS, metavar="SECONDS", parse=positive_seconds)]
READ_REQUEST_TIMEOUT = Field(REQUEST_TIMEOUT, gt=0, description=REQUEST_TIMEOUT_HELP)


class InspectCommand(BaseModel):
    """`sft-tokenize inspect`'s flags."""

    cache: Annotated[str, Flag(FLAGS, metavar="CACHE_OR_MIXTURE", positional=True)] = Field(
        description="a published cache directory, a mixture index, or a cache version's URL on object storage (its "
                    "summary is read from the remote manifest; --lengths, --row, --sample and --verify copy it to "
                    "this machine first, as `pull` does to its default directory)")
    as_json: Annotated[bool, Flag(FLAGS, flag="--json")] = Field(
        False, description="print the whole manifest (with --lengths, the lengths report) as JSON")
    lengths: Annotated[bool, Flag(FLAGS)] = Field(
        False, description="histograms of tokens and trained tokens per row, and what each max_length or packing "
                           "length would cost: rows truncated or dropped, tokens and trained tokens lost, packed bins "
                           "and fill, at powers of two from 512 to the longest row (per source too, for a mixture)")
    at: Annotated[list[int], Flag(FLAGS, metavar="N", parse=sequence_length, repeat=True)] = Field(
        default_factory=list, description="with --lengths: also the cost at N tokens")
    row: Annotated[list[int], Flag(FLAGS, metavar="N", parse=int, repeat=True)] = Field(
        default_factory=list, description="print row N decoded, its trained tokens highlighted (green, or [[…]] when "
                                          "piped); rows count from 0")
    sample: Annotated[int | None, Flag(FLAGS, metavar="K", parse=positive_int)] = Field(
        None, description="print K rows drawn at random (seed 0)")
    tokenizer: Annotated[str | None, Flag(FLAGS, metavar="DIR")] = Field(
        None, description="the tokenizer to decode rows with (default: the one the cache was built with)")
    index_dir: Annotated[str | None, Flag(FLAGS, metavar="DIR")] = Field(
        None, description="also look for packing indexes written there")
    verify: Annotated[bool, Flag(FLAGS)] = Field(
        False, description="read every data file whole and compare it with the digest recorded when it was written "
                           "(without it, only the files' sizes are checked)")
    storage_options: ReadStorageOptions = READ_STORAGE_OPTIONS
    request_timeout: ReadRequestTimeout = READ_REQUEST_TIMEOUT


class VerifyCommand(BaseModel):
    """`sft-tokenize verify`'s flags."""

    cache: Annotated[str, Flag(FLAGS, metavar="CACHE", positional=True)] = Field(
        description="a published cache directory (a version on object storage: `pull` it first; with --trainer, "
                    "its URL is copied here first)")
    sample: Annotated[int | None, Flag(FLAGS, metavar="N", parse=positive_int)] = Field(
        None, description="check N rows drawn at random (with each, the rows of its slice before it); the default")
    all: Annotated[bool, Flag(FLAGS)] = Field(False, description="check every row")
    seed: Annotated[int | None, Flag(FLAGS, metavar="N", parse=int)] = Field(
        None, description="the seed of --sample's draw (default: a new one each time)")
    tokenizer: Annotated[str | None, Flag(FLAGS, metavar="DIR")] = Field(
        None, description="where the tokenizer the cache was built with is (default: the path it was built from); "
                          "with --trainer, the one the trainer pads with")
    chat_template: Annotated[str | None, Flag(FLAGS, metavar="FILE")] = Field(
        None, description="the --chat-template file the cache was built with, if it was given one")
    storage_options: ReadStorageOptions = READ_STORAGE_OPTIONS
    request_timeout: ReadRequestTimeout = READ_REQUEST_TIMEOUT


class PullCommand(BaseModel):
    """`sft-tokenize pull`'s flags."""

    url: Annotated[str, Flag(FLAGS, metavar="URL", positional=True)] = Field(
        description="a cache version's URL on object storage, `ROOT/<name>-<fingerprint>` (what `sft-tokenize run "
                    "--cache-dir ROOT` prints)")
    local_dir: Annotated[str, Flag(FLAGS, metavar="DIR", positional=True)] = Field(
        description="the local cache root to copy it into: the version becomes `DIR/<name>-<fingerprint>`, its "
                    "shards `DIR/.shards/<key>.arrow` (shared with the other versions pulled there)")
    storage_options: ReadStorageOptions = READ_STORAGE_OPTIONS
    request_timeout: ReadRequestTimeout = READ_REQUEST_TIMEOUT


class PackCommand(PackOptions):
    """`sft-tokenize pack`'s flags: the cache, then the packing options (PackOptions)."""

    cache: Annotated[str, Flag(PACK, metavar="CACHE_OR_MIXTURE", positional=True)] = Field(
        description="a published cache directory, a mixture index, or a cache version's URL on object storage "
                    "(copied to this machine first, as `pull` does to its default directory, and packed there)")
    storage_options: ReadStorageOptions = READ_STORAGE_OPTIONS
    request_timeout: ReadRequestTimeout = READ_REQUEST_TIMEOUT


class GcCommand(BaseModel):
    """`sft-tokenize gc`'s flags."""

    cache_dir: Annotated[str, Flag(FLAGS, metavar="CACHE_DIR", positional=True)] = Field(
        description="the cache root: a directory, or a URL (s3://bucket/prefix, gs://...)")
    keep: Annotated[int, Flag(FLAGS, metavar="N", parse=positive_int)] = Field(
        1, ge=1, description="versions kept per name")
    grace: Annotated[float, Flag(FLAGS, metavar="SECONDS", parse=non_negative_seconds)] = Field(
        3600.0, ge=0, description="a remote root's leases, unreferenced shards and incomplete uploads younger than "
                                  "this may be a running build's: kept (a build must finish within it)")
    storage_options: ReadStorageOptions = READ_STORAGE_OPTIONS
    request_timeout: ReadRequestTimeout = READ_REQUEST_TIMEOUT


class ExportCommand(BaseModel):
    """`sft-tokenize export`'s flags."""

    cache: Annotated[str, Flag(FLAGS, metavar="CACHE_OR_MIXTURE", positional=True)] = Field(
        description="a published cache directory, a mixture index (its rows in its order), or a cache version's URL "
                    "on object storage (copied to this machine first, as `pull` does to its default directory)")
    to: Annotated[Literal["megatron", "mds", "litdata"], Flag(FLAGS, metavar="TARGET")] = Field(
        description="the format: megatron (Megatron-Core .bin/.idx; with --pack-length, Megatron-Bridge's packed "
                    ".npy too), mds (mosaicml-streaming), litdata (litdata's optimized dataset)")
    out: Annotated[str, Flag(FLAGS, metavar="OUT", positional=True)] = Field(
        description="the export's directory (new, empty, or an earlier export, replaced whole) or an fsspec URL "
                    "(new: objects are never written over)")
    pack_length: Annotated[list[int], Flag(FLAGS, metavar="N", parse=sequence_length, repeat=True)] = Field(
        default_factory=list, description="megatron: also write the cache's packing index for N tokens as "
                                          "Megatron-Bridge's packed SFT file (training_N.npy, N_metadata.jsonl)")
    pad_to_multiple_of: Annotated[int, Flag(FLAGS, metavar="M", parse=positive_int)] = Field(
        1, ge=1, description="with --pack-length: pad each packed row so its inputs are a multiple of M, as "
                             "Megatron-Bridge's pad_seq_to_mult does for context parallelism (M = 2 × its size; "
                             "every N a multiple of M)")
    pad_id: Annotated[int | None, Flag(FLAGS, metavar="ID", parse=int)] = Field(
        None, description="with --pad-to-multiple-of: the id to pad with (default: the EOS id of the tokenizer the "
                          "cache was built with, which Megatron-Bridge's collator takes for padding)")
    storage_options: ReadStorageOptions = Field(
        default_factory=dict, description="fsspec options, a JSON object, for the cache's URL and OUT's filesystem")
    request_timeout: ReadRequestTimeout = READ_REQUEST_TIMEOUT


class DiffCommand(BaseModel):
    """`sft-tokenize diff`'s flags."""

    old: Annotated[str, Flag(FLAGS, metavar="OLD", positional=True)] = Field(
        description="a published cache directory (or a version's URL on object storage, copied here first)")
    new: Annotated[str, Flag(FLAGS, metavar="NEW", positional=True)] = Field(description="the cache to compare it with")
    rows: Annotated[int, Flag(FLAGS, metavar="K", parse=int)] = Field(
        2, ge=0, description="show the K changed rows that gain or lose the most trained tokens, each cache's row "
                             "decoded by its own tokenizer (where it is on this machine), trained tokens marked")
    as_json: Annotated[bool, Flag(FLAGS, flag="--json")] = Field(False, description="print the comparison as JSON")
    storage_options: ReadStorageOptions = READ_STORAGE_OPTIONS
    request_timeout: ReadRequestTimeout = READ_REQUEST_TIMEOUT


class VerifyTrainerFlags(BaseModel):
    """`sft-tokenize verify --trainer`'s flags: a trainer's own data path checked over the cache."""

    trainer: Annotated[Literal["trl", "axolotl", "llamafactory", "skyrl", "megatron", "mds", "litdata"] | None,
                       Flag(FLAGS, metavar="NAME")] = Field(
        None, description="trl, axolotl: build this trainer's own dataset and collator over the cache (from its "
                          "installed package) and check that the tokens it trains are exactly the loss mask's, row by "
                          "row; megatron, mds, litdata: read the export named by --export with the consumer's own "
                          "reader and check its rows against the cache; llamafactory, skyrl: say what to install "
                          "and why their data paths cannot run beside this package")
    export: Annotated[str | None, Flag(FLAGS, metavar="DIR")] = Field(
        None, description="--trainer megatron|mds|litdata: the directory `sft-tokenize export` wrote")
    batches: Annotated[int, Flag(FLAGS, metavar="N", parse=positive_int)] = Field(
        8, description="--trainer: the batches to draw and check (a whole epoch also checks that no row is dropped)")
    batch_size: Annotated[int, Flag(FLAGS, metavar="B", parse=positive_int)] = Field(
        4, description="--trainer: rows per batch")


class ServerStopCommand(BaseModel):
    """`sft-tokenize server stop`'s flags."""

    force: Annotated[bool, Flag(FLAGS)] = Field(False, description="stop it even while runs use it (they fail)")


# Each command's declared flags: the models whose fields they are, in the order `--help` lists them.
COMMANDS: dict[tuple[str, ...], tuple[type[BaseModel], ...]] = {
    ("run",): (TokenizeRun, RunCommand),
    ("inspect",): (InspectCommand,),
    ("pack",): (PackCommand,),
    ("pull",): (PullCommand,),
    ("gc",): (GcCommand,),
    ("export",): (ExportCommand,),
    ("diff",): (DiffCommand,),
    ("verify",): (VerifyCommand, VerifyTrainerFlags),
    ("server", "stop"): (ServerStopCommand,),
}


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error is one line, as every other error is, pointing at --help instead of printing the usage."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if getattr(parsed, "command", None) == "run" and self.prog == PROG:
            # A run reads its sources, tokenizer and cache dir from the command line or from its recipe.
            if parsed.recipe and parsed.sources:
                self.error("run: give SOURCE arguments or --recipe, not both (a recipe lists its sources)")
            missing = [] if parsed.recipe else [label for label, value in (
                ("SOURCE", parsed.sources), ("--tokenizer", parsed.tokenizer or parsed.processor),
                ("--cache-dir", parsed.cache_dir))
                if not value]
            if missing:
                self.error(f"run: the following arguments are required: {', '.join(missing)}")
        return parsed, rest


def add_flags(parser: argparse.ArgumentParser, models: tuple[type[BaseModel], ...],
              sections: dict[str, Any] | None = None, defaults: dict[str, Any] | None = None,
              require: bool = True) -> None:
    """Every declared flag of `models` (sft_tokenize/flags.py), in its section's group (or on `parser`): its help
    text, default and choices those of its declaration. `defaults` replace a declared default where the
    environment sets another; `require=False` leaves a required option's absence to the caller's check."""
    exclusive: dict[str, Any] = {}
    for model in models:
        for name, info, flag in declared(model):
            if flag.section is None:
                continue
            group = (sections or {}).get(flag.section, parser)
            if flag.exclusive:
                if flag.exclusive not in exclusive:
                    exclusive[flag.exclusive] = group.add_mutually_exclusive_group()
                group = exclusive[flag.exclusive]
            default = (defaults or {}).get(name, flag_default(info))
            settings: dict[str, Any] = {"help": help_text(info, flag), "metavar": flag.metavar, "type": flag.parse,
                                        "choices": choices(info.annotation)}
            if flag.positional:
                if get_origin(info.annotation) is list:
                    settings["nargs"] = "*"
                group.add_argument(name, **{k: v for k, v in settings.items() if v is not None})
                continue
            settings["dest"] = name
            if info.annotation in (bool, "bool"):
                settings = {"dest": name, "help": settings["help"], "action": "store_true"}
            elif flag.repeat:
                settings.update(action="append", default=[])
            elif info.is_required() and require:
                settings["required"] = True
            else:
                settings["default"] = default
            group.add_argument(*flag_names(name, flag), **{k: v for k, v in settings.items() if v is not None})


# The commands whose flags are all declared in COMMANDS: name → (`--help`'s line, the command's description).
SIMPLE_COMMANDS = {
    "inspect": ("summarize a published cache or a mixture index",
                "Summarize a published cache from its manifest, and its packing indexes; or a mixture index: per "
                "source, what was asked and achieved."),
    "pack": ("plan packed sequences over a whole cache (a global packing index)",
             "Build the global packing index of a published cache beside it; prints the index path as the last line."),
    "pull": ("copy a cache version from object storage to a local directory",
             "Copy a cache version from object storage into a local cache root, each shard once and checked against "
             "its digest; prints the local cache's path as the last line (datasets.load_from_disk opens it)."),
    "gc": ("remove old versions and the shards no cache or running build uses",
           "Keep the newest N versions of each cache name; remove the others and every stored shard that no kept "
           "version and no running build uses."),
    "export": ("write a published cache in another trainer's format (megatron, mds, litdata)",
               "Write a published cache as Megatron-Core/Megatron-Bridge, mosaicml-streaming (MDS) or litdata files, a "
               "batch of rows at a time, published whole; prints the export's directory as the last line."),
    "diff": ("compare two caches: rows added, removed and changed, trained tokens, what differs in their inputs",
             "Compare two caches (two versions of one name, or any two): the fingerprint inputs that differ, the rows "
             "added, removed and changed, and the trained tokens gained or lost, in all and per row."),
    "verify": ("check a cache: its rows tokenized again in full, or (--trainer) a trainer's own data path",
               "Tokenize rows of a published cache again from its recorded sources, rendering every row in full "
               "(--render full), and compare every column; exit 2 naming the first differing rows and their source "
               "file:line. With --trainer NAME: draw batches from the trainer's own dataset and collator over the "
               "cache and check, token for token, that what it trains is the loss mask; exit 2 naming the first row "
               "that differs."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description="Tokenize SFT datasets into a memory-mapped Arrow cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="tokenize sources into a cache (resumes a failed or interrupted run)",
                              description="Tokenize sources into a cache; prints the cache path as the last line.")
    # How the flow runs (TokenizeRun's own fields) is declared beside what it builds; --recipe, --server-idle, -q
    # and -v are the command line's own (RunCommand).
    add_flags(run, COMMANDS[("run",)], {title: run.add_argument_group(title) for title in SECTIONS},
              defaults={"server_idle": os.environ.get(SERVER_IDLE_ENV, str(DEFAULT_SERVER_IDLE))},
              require=False)  # a recipe may give the sources, the tokenizer and the cache root (parse_known_args)

    for name, (short, description) in SIMPLE_COMMANDS.items():
        add_flags(commands.add_parser(name, help=short, description=description), COMMANDS[(name,)])

    server = commands.add_parser("server", help="the embedded Prefect server that runs share: status, stop",
                                 description="The embedded Prefect server of this PREFECT_HOME, which ad-hoc runs "
                                             "share and which stays up for --server-idle seconds after the last.")
    actions = server.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("status", help="whether it runs, its pid, URL, uptime, runs using it, idle time left, log",
                       description="One line per fact; exit 0 whether it runs or not.")
    stop = actions.add_parser("stop", help="stop it (refused while runs use it, unless --force)",
                              description="Stop the server and wait until its process is gone.")
    add_flags(stop, COMMANDS[("server", "stop")])
    return parser


def options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The flow's options (TokenizeRun's fields) that `sft-tokenize run`'s arguments give."""
    options = {name: getattr(args, name) for name, _, flag in declared(TokenizeRun) if flag.section is not None}
    options["columns"] = dict(options["columns"])  # given as ROLE=NAME pairs
    if args.messages_column:
        options["columns"]["messages"] = args.messages_column
    return options


def run_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Of a run's options, those that say how it runs: what every source of a recipe is run with."""
    return {key: options[key] for key in RUN_OPTIONS if key in options}


# docs/cli.md's flag tables are made from the same declarations, between markers such as
# `<!-- flags: run input -->` and `<!-- /flags -->` (`make cli-docs` writes them; test_options checks them).
_TABLE = re.compile(r"(<!-- flags: (?P<command>[a-z ]+?)(?: / (?P<section>[a-z ,]+?))? -->\n).*?(<!-- /flags -->)",
                    re.DOTALL)


def _markdown(text: str) -> str:
    """Help text as a table cell: docs/PAGE.md becomes a link to the page beside docs/cli.md."""
    return re.sub(r"docs/([a-z-]+\.md)", r"[docs/\1](\1)", text.replace("|", "\\|"))


def flag_table(command: str, section: str | None = None) -> str:
    """The markdown table of `sft-tokenize COMMAND`'s flags (of one section of `run`), from their declarations."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for model in COMMANDS[tuple(command.split())]:
        for name, info, flag in declared(model):
            if flag.section is None or (section is not None and flag.section != section):
                continue
            names = flag_names(name, flag)
            shown = (flag.metavar or name.upper()) + ("..." if get_origin(info.annotation) is list else "") \
                if flag.positional else ", ".join(names) + (f" {flag.metavar}" if flag.metavar else "")
            default = flag_default(info)
            said = "required" if info.is_required() and not flag.positional else \
                f"`{default}`" if shown_default(default) and not flag.repeat else ""
            meaning = (info.description or "") + (flag.cli_note or "")
            if values := choices(info.annotation):
                meaning += "; one of " + ", ".join(f"`{value}`" for value in values)
            if flag.repeat:
                meaning += "; repeatable"
            rows.append(f"| `{shown}` | {said} | {_markdown(meaning)} |")
    return "\n".join(rows) + "\n"


def with_flag_tables(page: str) -> str:
    """`page` (docs/cli.md) with every marked table made again from the declarations."""
    return _TABLE.sub(lambda m: m.group(1) + flag_table(m.group("command"), m.group("section"))
                      + m.group(4), page)
