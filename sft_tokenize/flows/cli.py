"""`sft-tokenize`: run the tokenize_dataset flow on Prefect's embedded server, inspect or pack a published cache.

    sft-tokenize run data/*.jsonl --tokenizer Qwen/Qwen2.5-0.5B-Instruct --cache-dir /data/cache
    sft-tokenize run s3://bucket/sft/ --tokenizer /nfs/tok --cache-dir /nfs/c --runner dask --dask-address tcp://h:8786
    sft-tokenize inspect /data/cache/data-3f2a9c1d0b7e4f65 [--json]
    sft-tokenize pack /data/cache/data-3f2a9c1d0b7e4f65 --length 4096 --data-parallel 8
    sft-tokenize gc /data/cache [--keep N]
    sft-tokenize server status|stop [--force]

stdout carries only the result (the cache path or the packing index path as its last line, or the inspect
table), so scripts can read it; the progress bar and Prefect's run logs go to stderr. Exit codes: 0 success,
2 bad usage or bad input (one line saying what and where), 1 any other failure (run the same command again
to resume).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import warnings

from sft_tokenize.build.timeline import mark
from sft_tokenize.errors import BadInput, CacheError
from sft_tokenize.flows.arguments import EXIT_BAD_INPUT, PROG, SERVER_IDLE_ENV, build_parser, options_from, run_settings
from sft_tokenize.flows.console import CONSOLE_ENV, ProgressBar, progress_console
from sft_tokenize.format.layout import SHARD_STORE, is_mixture

EXIT_OK, EXIT_FAILED = 0, 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def keep_torch_out() -> None:
    """transformers imports torch wherever it is installed (its rope utilities, which AutoTokenizer's config
    import reaches), though tokenizing never uses it: over a second and ~190 MB of a run's process. An entry of
    None in sys.modules makes `import torch` fail and its find_spec answer None, so transformers and datasets
    take torch as absent. Only in the `run` command's own process: a training script that imports sft_tokenize
    keeps its torch."""
    sys.modules.setdefault("torch", None)


def run(args: argparse.Namespace) -> int:
    from sft_tokenize.flows.interrupts import EXIT_CODES, raise_on_sigterm, signal_of

    keep_torch_out()
    raise_on_sigterm()
    try:
        return _run(args)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (flows.interrupts.Terminated)
        signum = signal_of(interrupt)
        store = os.path.join(args.cache_dir or "CACHE_DIR", SHARD_STORE)
        return _fail(f"interrupted ({signum.name}); the finished slices stay in the shard store under {store}: run "
                     "the same command again to resume", EXIT_CODES[signum])


def _run(args: argparse.Namespace) -> int:
    from sft_tokenize.flows.api import RunFailed, run_recipe, run_tokenize

    settings = options_from(args)
    if settings["runner"] == "dask" and not args.verbose:
        # A temporary cluster's scheduler runs in this process: a notice per worker and connection is noise here.
        logging.getLogger("distributed").setLevel(logging.WARNING)
    try:
        bar = lambda: ProgressBar(progress_console())  # noqa: E731
        if args.recipe:
            overrides = {key: settings[key] for key in ("tokenizer", "cache_dir") if settings[key]}
            cache_path = run_recipe(args.recipe, run_settings(settings), overrides, progress=bar)
        else:
            cache_path = run_tokenize(settings, progress=bar)
    except BadInput as error:
        return _fail(str(error), EXIT_BAD_INPUT)
    except RunFailed as error:
        return _fail(str(error), EXIT_FAILED)
    print(cache_path)
    return EXIT_OK


def inspect(args: argparse.Namespace) -> int:
    from sft_tokenize.flows.report import fingerprint_inputs, mixture_summary, packing_summary, summary, text_table
    from sft_tokenize.read.cache import read_manifest, verify_cache
    from sft_tokenize.read.mixture_index import check_sources, load_mixture
    from sft_tokenize.read.packing_index import list_indexes

    if is_mixture(args.cache):  # a mixture index: its per-source summary
        try:
            index = load_mixture(args.cache)
            check_sources(index)  # a summary of sources that are gone would look healthy
            meta = index.meta
        except CacheError as error:
            return _fail(str(error), EXIT_BAD_INPUT)
        print(json.dumps(meta, indent=2) if args.as_json else text_table(mixture_summary(meta)))
        return EXIT_OK
    try:
        manifest = read_manifest(args.cache)
        indexes = list_indexes(args.cache, args.index_dir)
        unverified = verify_cache(args.cache) if args.verify else []
    except CacheError as error:
        return _fail(str(error), EXIT_BAD_INPUT)
    if unverified:  # the table below is stdout's result; this is a note about how far it was checked
        print(f"{PROG}: note: {len(unverified)} of {len(manifest['files'])} data files have no recorded digest "
              f"(published before manifests kept them, and their shards' sidecars are gone), {unverified[0]} "
              "first: only their sizes were checked", file=sys.stderr)
    if args.row or args.sample:
        return show_rows(args, manifest)
    if args.as_json:
        packing = {"packing": [{**i.meta, "path": str(i.path), "build": i.build} for i in indexes]} if indexes else {}
        print(json.dumps({**manifest, **packing}, indent=2))
    else:
        checked, files = len(manifest["files"]) - len(unverified), len(manifest["files"])
        verified = [("verified", f"every byte of {checked} data files matches its recorded digest" if checked == files
                     else f"{checked} of {files} data files: every byte matches its recorded digest; the others "
                          "have none, only their sizes were checked")] if args.verify else []
        print(text_table(summary(manifest, os.path.abspath(args.cache)) + verified + fingerprint_inputs(manifest)))
        for index in indexes:
            print("\n" + text_table(packing_summary(index.meta, index.build, index.path)))
    return EXIT_OK


def pack(args: argparse.Namespace) -> int:
    from sft_tokenize.flows.report import packing_summary, text_table
    from sft_tokenize.read.packing_index import PackOptions, pack_cache

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

    from sft_tokenize.encoding.tokenizer import load_tokenizer
    from sft_tokenize.flows.report import show_row
    from sft_tokenize.read.cache import open_cache

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
        print(show_row(tokenizer, row["input_ids"], row["loss_mask"], colour, row.get("image_sizes"),
                       (manifest.get("images") or {}).get("image_token_ids")))
    return EXIT_OK


def gc(args: argparse.Namespace) -> int:
    from sft_tokenize.build.store import collect_garbage

    root = os.path.abspath(args.cache_dir)
    if not os.path.isdir(root):
        return _fail(f"{root}: no such cache directory", EXIT_BAD_INPUT)
    done = collect_garbage(root, args.keep)
    for name in done.removed:
        print(f"removed {os.path.join(root, name)}")
    for name, index in done.held.items():
        print(f"kept {os.path.join(root, name)}: the mixture index {index} reads it")
    print(f"kept {len(done.kept)} versions and {done.shards_kept} shards; removed {len(done.removed)} versions and "
          f"{done.shards_removed} shards, {done.bytes_freed:,} bytes freed; {done.live_builds} running builds")
    return EXIT_OK


def server(args: argparse.Namespace) -> int:
    """`server status` / `server stop`: the embedded Prefect server of this PREFECT_HOME."""
    from sft_tokenize.flows.embedded_server import ServerInUse, server_status, stop_server

    if args.action == "status":
        for name, value in server_status():
            print(f"{name}: {value}")
        return EXIT_OK
    try:
        print(stop_server(force=args.force))
    except ServerInUse as error:
        return _fail(str(error), EXIT_FAILED)
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
        # An unusable PREFECT_HOME is reported in one line (flows/api.py), not as Prefect's import warning.
        warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory")
        if args.command == "run":  # inherited by process-pool workers, which print their own logs
            os.environ[CONSOLE_ENV] = "quiet" if args.quiet else "verbose" if args.verbose else "plain"
            os.environ[SERVER_IDLE_ENV] = str(args.server_idle)  # read by flows.embedded_server.EmbeddedServer
        mark("imports")
        code = {"run": run, "inspect": inspect, "pack": pack, "gc": gc, "server": server}[args.command](args)
        sys.stdout.flush()
        mark("exit")
        return code
    except BrokenPipeError:
        # The reader of stdout left (`sft-tokenize inspect ... | head`): stop quietly, as a shell tool does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def console_main() -> None:
    """The `sft-tokenize` command. A run that published its cache ends at once: Prefect's logs and events sent,
    the embedded server left (atexit), and no interpreter teardown after that (joining Prefect's service threads
    and freeing every module took ~0.4 s of every run)."""
    code = main()
    if code == EXIT_OK and "prefect" in sys.modules:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
