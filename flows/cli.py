"""`sft-tokenize`: run the tokenize_dataset flow on Prefect's embedded server, inspect or pack a published cache.

    sft-tokenize run data/*.jsonl --tokenizer Qwen/Qwen2.5-0.5B-Instruct --cache-dir /data/cache
    sft-tokenize run s3://bucket/sft/ --tokenizer /nfs/tok --cache-dir /nfs/c --runner dask --dask-address tcp://h:8786
    sft-tokenize inspect /data/cache/data-3f2a9c1d0b7e4f65 [--json]
    sft-tokenize pack /data/cache/data-3f2a9c1d0b7e4f65 --length 4096 --data-parallel 8
    sft-tokenize gc /data/cache [--keep N]

stdout carries only the result (the cache path or the packing index path as its last line, or the inspect
table), so scripts can read it; the progress bar and Prefect's run logs go to stderr. Exit codes: 0 success,
2 bad usage or bad input (one line saying what and where), 1 any other failure (run the same command again
to resume).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from flows.console import CONSOLE_ENV, configure_console
from sft_cache.encode_pool import POOL_MIN_BYTES
from sft_cache.errors import BadInput, CacheError
from sft_cache.layouts import LAYOUTS

PROG = "sft-tokenize"
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


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
                     help="store the columns this trainer reads (default skyrl: input_ids, loss_mask); see README")
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


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _as_option_error(error: dict) -> str:
    """A pydantic error as the option the user typed: `--shard-size: not a size: 'lots' ...`."""
    option = "--" + str(error["loc"][0]).replace("_", "-") if error["loc"] else "options"
    return f"{option}: {error['msg'].removeprefix('Value error, ')}"


def prefect_home_problem() -> str | None:
    """Why the embedded server could not keep its database in PREFECT_HOME, or None if it can."""
    import tempfile

    from prefect.settings import get_current_settings

    home = Path(get_current_settings().home).expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=home):
            pass
    except OSError as error:
        return (f"PREFECT_HOME {os.path.abspath(home)}: Prefect's embedded server cannot keep its database there "
                f"({error.strerror}); point PREFECT_HOME at a writable directory, or PREFECT_API_URL at a server")
    return None


def progress_console():
    """Prefect's console, so log lines print above the progress bar instead of through it."""
    from rich.console import Console
    from rich.theme import Theme

    console = configure_console()
    if console is None:
        return Console(stderr=True)
    console.push_theme(Theme())  # Prefect's console theme lacks rich's default styles, which the bar needs
    return console


class ProgressBar:
    """Slices finished and rows so far, drawn on stderr once the flow has planned its slices."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("slices"),
                                 TextColumn("{task.fields[rows]:,} rows"), TimeElapsedColumn(), console=console)
        self.task_id = None

    def update(self, finished: int, total: int, rows: int) -> None:
        if self.task_id is None:
            self.progress.start()
            self.task_id = self.progress.add_task("tokenizing", total=total, rows=0)
        self.progress.update(self.task_id, total=total, completed=finished, rows=rows)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.task_id is not None:
            self.progress.stop()


def run(args: argparse.Namespace) -> int:
    from flows.interrupts import EXIT_CODES, raise_on_sigterm, signal_of

    raise_on_sigterm()
    try:
        return _run(args)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (flows.interrupts.Terminated)
        signum = signal_of(interrupt)
        return _fail(f"interrupted ({signum.name}); the finished slices stay in the shard store under "
                     f"{os.path.join(args.cache_dir, '.shards')}: run the same command again to resume",
                     EXIT_CODES[signum])


def _run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from flows.cluster import require_extra
    from sft_cache.options import TokenizeOptions
    from sft_cache.plan import plan_slices

    settings = options_from(args)
    try:
        # The data plane's options alone, before Prefect is even imported: a bad value, bad input and a cache hit
        # are settled in well under a second.
        checked = TokenizeOptions(**{k: v for k, v in settings.items() if k in TokenizeOptions.model_fields})
    except ValidationError as error:
        return _fail("; ".join(map(_as_option_error, error.errors())), EXIT_BAD_INPUT)
    server = None

    def start_server() -> None:  # only when there is work: a cache hit needs no Prefect at all
        nonlocal server
        from flows.embedded_server import EmbeddedServer

        if EmbeddedServer.needed():
            if problem := prefect_home_problem():
                raise BadInput(problem)
            server = EmbeddedServer()
            server.start()

    try:
        # Checked before the flow starts: bad input fails at once, and a cache hit needs no flow. When there is
        # work, the shared server is joined (started if need be: it boots in its own process) while this one
        # cuts the slices.
        require_extra(settings["runner"])
        plan = plan_slices(checked, on_work=start_server, content_keys=False)  # the flow hashes the inputs
    except BadInput as error:
        return _fail(str(error), EXIT_BAD_INPUT)
    if plan.cached and not settings["force"]:
        print(plan.cache_path)
        return EXIT_OK
    from prefect.exceptions import TerminationSignal
    from prefect.settings import get_current_settings

    from flows.embedded_server import EmbeddedServer, ServerUnavailable, check_api_reachable
    from flows.interrupts import Terminated
    from flows.tokenize_dataset import TokenizeRun, first_line, on_progress, tokenize_dataset

    try:
        options = TokenizeRun(**settings)
    except ValidationError as error:
        return _fail("; ".join(map(_as_option_error, error.errors())), EXIT_BAD_INPUT)
    if server is None and EmbeddedServer.needed():  # --force of a published cache: the plan did no work
        server = EmbeddedServer()
    if server is None:
        try:
            check_api_reachable(str(get_current_settings().api.url))
        except ServerUnavailable as error:
            return _fail(str(error), EXIT_FAILED)
    if options.runner == "dask" and not args.verbose:
        # A temporary cluster's scheduler runs in this process: a notice per worker and connection is noise here.
        logging.getLogger("distributed").setLevel(logging.WARNING)
    try:
        if server:
            server.use()
        # The bar closes, showing its last state, before an error is reported below it.
        with ProgressBar(progress_console()) as bar, on_progress(bar.update):
            cache_path = tokenize_dataset(options)
    except BadInput as error:
        return _fail(str(error), EXIT_BAD_INPUT)
    except TerminationSignal as signal_:  # Prefect's SIGTERM bridge, if it did not hand the signal back
        raise Terminated() from signal_
    except Exception as error:  # noqa: BLE001 - any other failure: one line here, details in the Prefect logs
        return _fail(f"{type(error).__name__}: {first_line(error)}", EXIT_FAILED)
    print(cache_path)
    return EXIT_OK


def inspect(args: argparse.Namespace) -> int:
    from flows.report import fingerprint_inputs, packing_summary, summary, text_table
    from sft_cache.packing import list_indexes
    from sft_cache.reader import read_manifest

    try:
        manifest = read_manifest(args.cache)
        indexes = list_indexes(args.cache, args.index_dir)
    except CacheError as error:
        return _fail(str(error), EXIT_BAD_INPUT)
    if args.row or args.sample:
        return show_rows(args, manifest)
    if args.json:
        packing = {"packing": [{**i.meta, "path": str(i.path), "build": i.build} for i in indexes]} if indexes else {}
        print(json.dumps({**manifest, **packing}, indent=2))
    else:
        print(text_table(summary(manifest, os.path.abspath(args.cache)) + fingerprint_inputs(manifest)))
        for index in indexes:
            print("\n" + text_table(packing_summary(index.meta, index.build, index.path)))
    return EXIT_OK


def pack(args: argparse.Namespace) -> int:
    from flows.report import packing_summary, text_table
    from sft_cache.packing import PackOptions, pack_cache

    options = PackOptions(length=args.length, data_parallel=args.data_parallel, algorithm=args.algorithm,
                          index_dir=args.index_dir)
    try:
        index = pack_cache(args.cache, options)
    except (BadInput, CacheError) as error:
        return _fail(str(error), EXIT_BAD_INPUT)
    print(text_table([("built", "now" if index.built_now else "earlier: reused")]
                     + packing_summary(index.meta, index.build, index.path)))
    print(index.path)
    return EXIT_OK


def show_rows(args: argparse.Namespace, manifest: dict) -> int:
    """`inspect --row N` / `--sample K`: rows decoded with their trained tokens highlighted."""
    import random

    from flows.report import show_row
    from sft_cache.chat import load_tokenizer
    from sft_cache.reader import open_cache

    cache = open_cache(args.cache)
    bad = [n for n in args.row if not 0 <= n < len(cache)]
    if bad:
        return _fail(f"{args.cache}: no row {bad[0]}: the cache has {len(cache):,} rows (0 to {len(cache) - 1})",
                     EXIT_BAD_INPUT)
    tokenizer_dir = args.tokenizer or manifest.get("tokenizer")
    if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
        return _fail(f"{args.cache}: the tokenizer it was built with ({tokenizer_dir or 'not recorded'}) is not "
                     "here: pass --tokenizer DIR", EXIT_BAD_INPUT)
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except BadInput as error:
        return _fail(str(error), EXIT_BAD_INPUT)
    rows = list(args.row)
    if args.sample:
        rows += sorted(random.Random(0).sample(range(len(cache)), min(args.sample, len(cache))))
    colour = sys.stdout.isatty()
    for n in rows:
        row = cache[n]
        trained = int(row["loss_mask"].sum())
        print(f"── row {n}: {len(row['input_ids']):,} tokens, {trained:,} trained "
              f"({'green' if colour else '[[…]]'}) ──")
        print(show_row(tokenizer, row["input_ids"], row["loss_mask"], colour))
    return EXIT_OK


def gc(args: argparse.Namespace) -> int:
    from sft_cache.store import collect_garbage

    root = os.path.abspath(args.cache_dir)
    if not os.path.isdir(root):
        return _fail(f"{root}: no such cache directory", EXIT_BAD_INPUT)
    done = collect_garbage(root, args.keep)
    for name in done.removed:
        print(f"removed {os.path.join(root, name)}")
    print(f"kept {len(done.kept)} versions and {done.shards_kept} shards; removed {len(done.removed)} versions and "
          f"{done.shards_removed} shards, {done.bytes_freed:,} bytes freed; {done.live_builds} running builds")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help, or bad usage (exit 2)
            sys.stdout.flush()
            return int(exit_.code or 0)
        # Before transformers and prefect are imported: no "PyTorch was not found" advisory, no telemetry noise.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # An unusable PREFECT_HOME is reported in one line by `prefect_home_problem`, not as Prefect's import warning.
        warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory")
        if args.command == "run":  # inherited by process-pool workers, which print their own logs
            os.environ[CONSOLE_ENV] = "quiet" if args.quiet else "verbose" if args.verbose else "plain"
        code = {"run": run, "inspect": inspect, "pack": pack, "gc": gc}[args.command](args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader of stdout left (`sft-tokenize inspect ... | head`): stop quietly, as a shell tool does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
