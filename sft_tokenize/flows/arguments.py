"""`sft-tokenize`'s command line: its arguments, checked as they are parsed, and the flow options they make.

A usage error is one line on stderr with exit code 2, as every other bad input is (cli.py).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Literal, get_args, get_origin

from sft_tokenize.build.options import INPUT, MASKS, OUTPUT, SLICES, declared, positive_int
from sft_tokenize.encoding.pool import POOL_MIN_BYTES

PROG = "sft-tokenize"
EXIT_BAD_INPUT = 2
SERVER_IDLE_ENV = "SFT_TOKENIZE_SERVER_IDLE"  # the default of --server-idle (the test suite sets 0)
DEFAULT_SERVER_IDLE = 300
VERSIONS = "versions, the server and logs"
SECTIONS = (INPUT, MASKS, OUTPUT, SLICES, VERSIONS)  # of `sft-tokenize run --help`, in this order


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


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


def _choices(annotation: Any) -> list[str] | None:
    """The values of a Literal option (or of each item of a list of them)."""
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    return list(get_args(annotation)) if get_origin(annotation) is Literal else None


def _shown_default(default: Any) -> bool:
    return default not in (None, False, "", [], {})


def add_tokenize_options(sections: dict[str, argparse._ArgumentGroup]) -> None:
    """Every flag of a tokenization option, as the option table (build/options.py) declares it: the same help
    text as the flow's form, its default and whether it repeats said as a command line says them."""
    for name, info, option in declared():
        if option.section is None:
            continue
        group = sections[option.section]
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        text = info.description or ""
        if option.repeat:
            text += "; repeatable"
        elif _shown_default(default):
            text += f" (default {default})"
        if option.positional:
            group.add_argument(name, nargs="*", metavar=option.metavar, help=text + " (or --recipe)")
            continue
        if name == "columns":  # the command line's shorthand for the most common mapping
            group.add_argument("--messages-column", metavar="COL",
                               help="the column holding the conversations (--column messages=COL)")
        settings: dict[str, Any] = {"dest": name, "help": text, "metavar": option.metavar, "type": option.parse,
                                    "choices": _choices(info.annotation)}
        if option.repeat:
            settings.update(action="append", default=[])
        else:
            settings["default"] = default
        group.add_argument(option.flag or "--" + name.replace("_", "-"),
                           **{key: value for key, value in settings.items() if value is not None})


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description="Tokenize SFT datasets into a memory-mapped Arrow cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="tokenize sources into a cache (resumes a failed or interrupted run)",
                              description="Tokenize sources into a cache; prints the cache path as the last line.")
    sections = {title: run.add_argument_group(title) for title in SECTIONS}
    add_tokenize_options(sections)
    sections[INPUT].add_argument("--recipe", metavar="FILE",
                                 help="a YAML recipe: several sources, each with its own options, tokenized into a "
                                      "cache each and mixed by a mixture index (docs/mixtures.md); prints the "
                                      "index's path. --tokenizer and --cache-dir, if given, override the recipe's")
    # How the flow runs, not what it builds: the runner, the workers, retries and the versions kept are
    # TokenizeRun's fields, in the Prefect layer that the command line does not import before it has parsed
    # (a bad flag or a cache hit settle without Prefect); --server-idle, -q and -v are the command line's own.
    slices, versions = sections[SLICES], sections[VERSIONS]
    slices.add_argument("--runner", default="threads", choices=["threads", "processes", "dask", "ray"],
                        help="threads (default), processes, or a Dask or Ray cluster whose workers share the cache "
                             "dir")
    slices.add_argument("--dask-address", metavar="tcp://HOST:PORT",
                        help="--runner dask: a running scheduler (default: a temporary cluster on this machine)")
    slices.add_argument("--ray-address", metavar="HOST:PORT",
                        help="--runner ray: a running cluster (default: a temporary local instance)")
    slices.add_argument("--workers", type=positive_int, metavar="N",
                        help="slices tokenized at once (default: cores); on a cluster, at least as many slices are "
                             "cut")
    slices.add_argument("--encode-processes", type=int, metavar="N",
                        help="--runner threads: processes that render, mask and encode the batches (default: one "
                             f"per core when {POOL_MIN_BYTES // 10**6} MB or more is to be tokenized, else 0: the "
                             "slices' threads do it)")
    slices.add_argument("--retries", type=int, default=None, metavar="N", help="retries of a failed slice (default 2)")
    versions.add_argument("--force", action="store_true",
                          help="rebuild: delete the cache and its shards in the store first")
    versions.add_argument("--keep-versions", type=positive_int, metavar="N",
                          help="after publishing, keep the newest N versions of this name (see gc)")
    versions.add_argument("--server-idle", type=_seconds, metavar="SECONDS",
                          default=os.environ.get(SERVER_IDLE_ENV, str(DEFAULT_SERVER_IDLE)),
                          help="how long the embedded Prefect server stays up once its last run leaves, for the next "
                               f"run (default {DEFAULT_SERVER_IDLE}, or ${SERVER_IDLE_ENV}; 0: it stops with the "
                               "last run)")
    noise = versions.add_mutually_exclusive_group()
    noise.add_argument("-q", "--quiet", action="store_true", help="no Prefect run logs on stderr")
    noise.add_argument("-v", "--verbose", action="store_true", help="Prefect run logs with tracebacks")

    inspect = commands.add_parser("inspect", help="summarize a published cache or a mixture index",
                                  description="Summarize a published cache from its manifest, and its packing indexes; "
                                              "or a mixture index: per source, what was asked and achieved.")
    inspect.add_argument("cache", metavar="CACHE_OR_MIXTURE")
    inspect.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    inspect.add_argument("--row", type=int, action="append", default=[], metavar="N",
                         help="print row N decoded, its trained tokens highlighted (green, or [[…]] when piped); "
                              "repeatable; rows count from 0")
    inspect.add_argument("--sample", type=positive_int, metavar="K", help="print K rows drawn at random (seed 0)")
    inspect.add_argument("--tokenizer", metavar="DIR",
                         help="the tokenizer to decode rows with (default: the one the cache was built with)")
    inspect.add_argument("--index-dir", metavar="DIR", help="also look for packing indexes written there")
    inspect.add_argument("--verify", action="store_true",
                         help="read every data file whole and compare it with the digest recorded when it was "
                              "written (without it, only the files' sizes are checked)")

    pack = commands.add_parser("pack", help="plan packed sequences over a whole cache (a global packing index)",
                               description="Build the global packing index of a published cache beside it; "
                                           "prints the index path as the last line.")
    pack.add_argument("cache", metavar="CACHE_OR_MIXTURE")
    pack.add_argument("--length", required=True, type=positive_int, metavar="N", help="tokens per packed sequence")
    pack.add_argument("--data-parallel", type=positive_int, default=1, metavar="R",
                      help="data-parallel ranks: each gets as many bins, near-equal tokens per step (default 1)")
    pack.add_argument("--algorithm", default="bfd", choices=["bfd", "ffd"],
                      help="best-fit (default) or first-fit decreasing")
    pack.add_argument("--index-dir", metavar="DIR",
                      help="write the index under DIR instead of beside the cache (for a read-only cache root)")

    gc = commands.add_parser("gc", help="remove old versions and the shards no cache or running build uses",
                             description="Keep the newest N versions of each cache name; remove the others and "
                                         "every stored shard that no kept version and no running build uses.")
    gc.add_argument("cache_dir", metavar="CACHE_DIR")
    gc.add_argument("--keep", type=positive_int, default=1, metavar="N", help="versions kept per name (default 1)")

    server = commands.add_parser("server", help="the embedded Prefect server that runs share: status, stop",
                                 description="The embedded Prefect server of this PREFECT_HOME, which ad-hoc runs "
                                             "share and which stays up for --server-idle seconds after the last.")
    actions = server.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("status", help="whether it runs, its pid, URL, uptime, runs using it, idle time left, log",
                       description="One line per fact; exit 0 whether it runs or not.")
    stop = actions.add_parser("stop", help="stop it (refused while runs use it, unless --force)",
                              description="Stop the server and wait until its process is gone.")
    stop.add_argument("--force", action="store_true", help="stop it even while runs use it (they fail)")
    return parser


# The flags that say how a run runs (TokenizeRun's own fields), not what it builds.
RUN_KEYS = ("runner", "dask_address", "ray_address", "workers", "encode_processes", "force", "keep_versions")


def options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The flow's options (TokenizeRun's fields) that `sft-tokenize run`'s arguments give."""
    options = {name: getattr(args, name) for name, _, option in declared() if option.section is not None}
    options["columns"] = dict(options["columns"])  # given as ROLE=NAME pairs
    if args.messages_column:
        options["columns"]["messages"] = args.messages_column
    options |= {key: getattr(args, key) for key in RUN_KEYS}
    if args.retries is not None:
        options["retries"] = args.retries
    return options


def run_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Of a run's options, those that say how it runs: what every source of a recipe is run with."""
    return {key: options[key] for key in (*RUN_KEYS, "retries") if key in options}
