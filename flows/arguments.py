"""`sft-tokenize`'s command line: its arguments, checked as they are parsed, and the flow options they make.

A usage error is one line on stderr with exit code 2, as every other bad input is (cli.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from sft_tokenize.encoding.pool import POOL_MIN_BYTES
from sft_tokenize.read.layouts import LAYOUTS

PROG = "sft-tokenize"
EXIT_BAD_INPUT = 2
SERVER_IDLE_ENV = "SFT_TOKENIZE_SERVER_IDLE"  # the default of --server-idle (the test suite sets 0)
DEFAULT_SERVER_IDLE = 300


def _column(spec: str) -> tuple[str, str]:
    role, sep, name = spec.partition("=")
    if not sep or not role or not name:
        raise argparse.ArgumentTypeError(f"expected ROLE=NAME (e.g. completion=response), got {spec!r}")
    return role, name


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg} at character {error.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"anon\": true}}', got {text!r}")
    return value


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error is one line, as every other error is, pointing at --help instead of printing the usage."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=PROG, description="Tokenize SFT datasets into a memory-mapped Arrow cache.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="tokenize sources into a cache (resumes a failed or interrupted run)",
                              description="Tokenize sources into a cache; prints the cache path as the last line.")
    run.add_argument("sources", nargs="+", metavar="SOURCE",
                     help="files, globs, directories, fsspec URLs, or hub:NAME for a Hugging Face hub dataset")
    run.add_argument("--tokenizer", required=True, metavar="PATH_OR_NAME",
                     help="a local tokenizer directory or a Hugging Face hub model name")
    run.add_argument("--cache-dir", required=True, metavar="DIR", help="the cache root (caches and staging)")
    run.add_argument("--name", help="cache name (default: the first source's stem)")
    run.add_argument("--format", default="auto", choices=["auto", "chat", "alpaca", "prompt-completion", "text"])
    run.add_argument("--messages-column", metavar="COL", help="the column holding the conversations")
    run.add_argument("--column", action="append", type=_column, default=[], metavar="ROLE=NAME",
                     help="the column of a role (messages, system, tools, instruction, input, output, prompt, "
                          "completion, text); repeatable")
    run.add_argument("--train-on", default="all_assistant",
                     choices=["all_assistant", "last_assistant", "completion", "all"],
                     help="which tokens the loss mask trains on (default all_assistant)")
    run.add_argument("--max-length", type=_positive, metavar="N", help="longest row in tokens")
    run.add_argument("--truncation", default="truncate", choices=["truncate", "drop"],
                     help="what happens to a row longer than --max-length (default truncate)")
    run.add_argument("--chat-template", metavar="FILE", help="a .jinja file overriding the tokenizer's template")
    run.add_argument("--template-kwargs", type=_json_object, default={}, metavar="JSON",
                     help='variables for the chat template, a JSON object (e.g. \'{"enable_thinking": false}\')')
    run.add_argument("--reasoning-turns", default="as-rendered", choices=["as-rendered", "expand"],
                     help="expand: one more row per assistant turn whose reasoning the template drops in history, "
                          "so every turn's reasoning is trained (default as-rendered)")
    run.add_argument("--special-text", default="literal", choices=["literal", "error", "keep"],
                     help="a control token's text inside a message: encode it as plain text (default), reject "
                          "the row, or keep it as the control token")
    run.add_argument("--encoder", default="auto", choices=["auto", "hf", "fastokens"],
                     help="who turns text into ids: hf (tokenizers), fastokens (the fast extra; refused, and said "
                          "so, where it is not exact), auto (fastokens where exact, default); the bytes are the same")
    run.add_argument("--extra-column", action="append", default=[], choices=["labels", "attention_mask"],
                     help="also store this column; repeatable")
    run.add_argument("--layout", default="skyrl", choices=list(LAYOUTS),
                     help="store the columns this trainer reads (default skyrl); see docs/trainers.md")
    run.add_argument("--split", default="train", help="split of a hub dataset or of a saved DatasetDict")
    run.add_argument("--subset", help="config (subset) of a hub dataset")
    run.add_argument("--on-bad-row", default="raise", choices=["raise", "skip"],
                     help="stop at the first malformed row (default), or skip and count it")
    run.add_argument("--shard-size", default="256MB", metavar="SIZE", help="input bytes per slice (default 256MB)")
    run.add_argument("--max-row-bytes", default="2MB", metavar="SIZE",
                     help="largest JSON line read (default 2MB); a longer row is a bad row (row_too_large)")
    run.add_argument("--storage-options", type=_json_object, default={}, metavar="JSON",
                     help='fsspec options for remote sources, a JSON object (e.g. \'{"anon": true}\'); prefer '
                          "credentials from the environment: these are stored with the run's parameters")
    run.add_argument("--runner", default="threads", choices=["threads", "processes", "dask", "ray"],
                     help="threads (default), processes, or a Dask or Ray cluster whose workers share the cache dir")
    run.add_argument("--dask-address", metavar="tcp://HOST:PORT",
                     help="--runner dask: a running scheduler (default: a temporary cluster on this machine)")
    run.add_argument("--ray-address", metavar="HOST:PORT",
                     help="--runner ray: a running cluster (default: a temporary local instance)")
    run.add_argument("--workers", type=_positive, metavar="N",
                     help="slices tokenized at once (default: cores); on a cluster, at least as many slices are cut")
    run.add_argument("--encode-processes", type=int, metavar="N",
                     help="--runner threads: processes that render, mask and encode the batches (default: one per "
                          f"core when {POOL_MIN_BYTES // 10**6} MB or more is to be tokenized, else 0: the slices' "
                          "threads do it)")
    run.add_argument("--retries", type=int, default=None, metavar="N", help="retries of a failed slice (default 2)")
    run.add_argument("--force", action="store_true", help="rebuild: delete the cache and its shards in the store first")
    run.add_argument("--keep-versions", type=_positive, metavar="N",
                     help="after publishing, keep the newest N versions of this name (see gc)")
    run.add_argument("--server-idle", type=_seconds, default=os.environ.get(SERVER_IDLE_ENV, str(DEFAULT_SERVER_IDLE)),
                     metavar="SECONDS",
                     help="how long the embedded Prefect server stays up once its last run leaves, for the next run "
                          f"(default {DEFAULT_SERVER_IDLE}, or ${SERVER_IDLE_ENV}; 0: it stops with the last run)")
    noise = run.add_mutually_exclusive_group()
    noise.add_argument("-q", "--quiet", action="store_true", help="no Prefect run logs on stderr")
    noise.add_argument("-v", "--verbose", action="store_true", help="Prefect run logs with tracebacks")

    inspect = commands.add_parser("inspect", help="summarize a published cache",
                                  description="Summarize a published cache from its manifest, and its packing indexes.")
    inspect.add_argument("cache", metavar="CACHE")
    inspect.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    inspect.add_argument("--row", type=int, action="append", default=[], metavar="N",
                         help="print row N decoded, its trained tokens highlighted (green, or [[…]] when piped); "
                              "repeatable; rows count from 0")
    inspect.add_argument("--sample", type=_positive, metavar="K", help="print K rows drawn at random (seed 0)")
    inspect.add_argument("--tokenizer", metavar="DIR",
                         help="the tokenizer to decode rows with (default: the one the cache was built with)")
    inspect.add_argument("--index-dir", metavar="DIR", help="also look for packing indexes written there")

    pack = commands.add_parser("pack", help="plan packed sequences over a whole cache (a global packing index)",
                               description="Build the global packing index of a published cache beside it; "
                                           "prints the index path as the last line.")
    pack.add_argument("cache", metavar="CACHE")
    pack.add_argument("--length", required=True, type=_positive, metavar="N", help="tokens per packed sequence")
    pack.add_argument("--data-parallel", type=_positive, default=1, metavar="R",
                      help="data-parallel ranks: each gets as many bins, near-equal tokens per step (default 1)")
    pack.add_argument("--algorithm", default="bfd", choices=["bfd", "ffd"],
                      help="best-fit (default) or first-fit decreasing")
    pack.add_argument("--index-dir", metavar="DIR",
                      help="write the index under DIR instead of beside the cache (for a read-only cache root)")

    gc = commands.add_parser("gc", help="remove old versions and the shards no cache or running build uses",
                             description="Keep the newest N versions of each cache name; remove the others and "
                                         "every stored shard that no kept version and no running build uses.")
    gc.add_argument("cache_dir", metavar="CACHE_DIR")
    gc.add_argument("--keep", type=_positive, default=1, metavar="N", help="versions kept per name (default 1)")

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


def options_from(args: argparse.Namespace) -> dict[str, Any]:
    columns = dict(args.column)
    if args.messages_column:
        columns["messages"] = args.messages_column
    options = {
        "sources": args.sources, "tokenizer": args.tokenizer, "cache_dir": args.cache_dir, "name": args.name,
        "format": args.format, "columns": columns, "train_on": args.train_on, "max_length": args.max_length,
        "truncation": args.truncation, "chat_template": args.chat_template, "extra_columns": args.extra_column,
        "template_kwargs": args.template_kwargs, "reasoning_turns": args.reasoning_turns,
        "special_text": args.special_text, "encoder": args.encoder,
        "layout": args.layout,
        "split": args.split, "subset": args.subset, "on_bad_row": args.on_bad_row, "shard_size": args.shard_size,
        "max_row_bytes": args.max_row_bytes,
        "storage_options": args.storage_options, "runner": args.runner, "dask_address": args.dask_address,
        "ray_address": args.ray_address, "workers": args.workers, "encode_processes": args.encode_processes,
        "force": args.force,
        "keep_versions": args.keep_versions,
    }
    if args.retries is not None:
        options["retries"] = args.retries
    return options
