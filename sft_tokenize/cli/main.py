"""`sft-tokenize`: run the tokenize_dataset flow on Prefect's embedded server, inspect or pack a published cache.

    sft-tokenize run data/*.jsonl --tokenizer Qwen/Qwen2.5-0.5B-Instruct --cache-dir /data/cache
    sft-tokenize run s3://bucket/sft/ --tokenizer /nfs/tok --cache-dir /nfs/c --runner dask --dask-address tcp://h:8786
    sft-tokenize inspect /data/cache/data-3f2a9c1d0b7e4f65 [--json]
    sft-tokenize pack /data/cache/data-3f2a9c1d0b7e4f65 --length 4096 --data-parallel 8
    sft-tokenize gc /data/cache [--keep N]
    sft-tokenize pull s3://bucket/caches/data-3f2a9c1d0b7e4f65 /data/local-caches
    sft-tokenize server status|stop [--force]
    sft-tokenize export /data/cache/data-3f2a9c1d0b7e4f65 --to megatron|mds|litdata OUT [--pack-length N]
    sft-tokenize diff /data/cache/data-3f2a9c1d0b7e4f65 /data/cache/data-9b1c04e2a7d35f10 [--rows K] [--json]
    sft-tokenize verify /data/cache/data-3f2a9c1d0b7e4f65 --trainer trl|axolotl [--batches N]
    sft-tokenize verify /data/cache/data-3f2a9c1d0b7e4f65 --trainer megatron|mds|litdata --export OUT

stdout carries only the result (the cache path or the packing index path as its last line, or the inspect
table), so scripts can read it; the progress bar and Prefect's run logs go to stderr. An error is one line on
stderr and an exit code, by one policy for every subcommand (ERRORS): 0 success, 2 bad usage or bad input (one
line saying what and where), 1 any other failure (run the same command again to resume), 130/143 interrupted.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable

from sft_tokenize.build.timeline import mark
from sft_tokenize.cli.arguments import EXIT_BAD_INPUT, PROG, build_parser, options_from, run_settings
from sft_tokenize.errors import BadInput, CacheError, Failed, first_line
from sft_tokenize.flows.console import CONSOLE_ENV, ProgressBar, progress_console
from sft_tokenize.format.layout import SHARD_STORE, is_mixture
from sft_tokenize.server.server_state import SERVER_IDLE_ENV

EXIT_OK, EXIT_FAILED = 0, 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


def keep_torch_out() -> None:
    """transformers imports torch wherever it is installed (its rope utilities, which AutoTokenizer's config
    import reaches), though tokenizing never uses it: over a second and ~190 MB of a run's process. An entry of
    None in sys.modules makes `import torch` fail and its find_spec answer None, so transformers and datasets
    take torch as absent. Only in the `run` command's own process: a training script that imports sft_tokenize
    keeps its torch."""
    sys.modules.setdefault("torch", None)


def process_environment() -> None:
    """Before transformers and prefect are imported (here, or in the resident process: cli/resident.py)."""
    # No "PyTorch was not found" advisory, no telemetry noise.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # An unusable PREFECT_HOME is reported in one line (flows/api.py), not as Prefect's import warning.
    warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory")


def run(args: argparse.Namespace) -> int:
    from sft_tokenize.flows.api import run_recipe, run_tokenize
    from sft_tokenize.flows.interrupts import raise_on_sigterm

    keep_torch_out()
    raise_on_sigterm()
    settings = options_from(args)
    if args.plan_only:
        return plan_only(args, settings)
    if settings["runner"] == "dask" and not args.verbose:
        # A temporary cluster's scheduler runs in this process: a notice per worker and connection is noise here.
        logging.getLogger("distributed").setLevel(logging.WARNING)
    bar = lambda: ProgressBar(progress_console())  # noqa: E731
    if args.recipe:
        overrides = {key: settings[key] for key in ("tokenizer", "cache_dir") if settings[key]}
        cache_path = run_recipe(args.recipe, run_settings(settings), overrides, progress=bar, cli_process=True)
    else:
        cache_path = run_tokenize(settings, progress=bar, cli_process=True)
    print(cache_path)
    return EXIT_OK


def plan_only(args: argparse.Namespace, settings: dict) -> int:
    """`run --plan-only`: each run's plan and estimate (a recipe's sources one after another), nothing written."""
    from sft_tokenize.flows.api import plan_runs
    from sft_tokenize.flows.report import plan_summary, text_table

    overrides = {key: settings[key] for key in ("tokenizer", "cache_dir") if settings[key]}
    from sft_tokenize.encoding.cores import available_cores

    workers = settings.get("workers") or available_cores()  # as the run counts them (run_options.worker_count)
    for k, (cache_path, found) in enumerate(plan_runs(settings, workers, args.recipe, overrides)):
        print(("\n" if k else "") + text_table(plan_summary(cache_path, found, workers)))
    return EXIT_OK


def inspect(args: argparse.Namespace) -> int:
    from sft_tokenize.files import is_remote
    from sft_tokenize.flows.report import fingerprint_inputs, mixture_summary, packing_summary, summary, text_table
    from sft_tokenize.read.cache import read_manifest, verify_digests
    from sft_tokenize.read.mixture_index import check_sources, load_mixture
    from sft_tokenize.read.packing_index import list_indexes
    from sft_tokenize.read.remote_cache import materialize, remote_manifest

    if is_remote(args.cache):
        if not (args.lengths or args.row or args.sample or args.verify):  # the manifest says it all: no download
            manifest = remote_manifest(args.cache, args.storage_options, args.request_timeout)
            print(json.dumps(manifest, indent=2) if args.as_json
                  else text_table(summary(manifest, args.cache.rstrip("/")) + fingerprint_inputs(manifest)))
            return EXIT_OK
        args.cache = str(materialize(args.cache, storage_options=args.storage_options,
                                     request_timeout=args.request_timeout))
    if args.lengths:
        return show_lengths(args)
    if is_mixture(args.cache):  # a mixture index: its per-source summary
        index = load_mixture(args.cache)
        check_sources(index)  # a summary of sources that are gone would look healthy
        meta = index.meta
        print(json.dumps(meta, indent=2) if args.as_json else text_table(mixture_summary(meta)))
        return EXIT_OK
    manifest = read_manifest(args.cache)
    indexes = list_indexes(args.cache, args.index_dir)
    unverified = verify_digests(args.cache) if args.verify else []
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


VERIFY_SAMPLE = 1000  # rows `verify` checks without --sample or --all


def verify(args: argparse.Namespace) -> int:
    """`verify CACHE [--sample N | --all]`: rows tokenized again in full and compared; exit 2 on a difference.
    With --trainer, the trainer's own data path over the cache instead."""
    from sft_tokenize.build.verify import SHOWN, verify_cache

    if args.trainer:
        return verify_trainer_command(args)
    if args.all and args.sample:
        raise BadInput("--sample and --all: give one")
    result = verify_cache(args.cache, None if args.all else args.sample or VERIFY_SAMPLE, args.tokenizer,
                          args.chat_template, args.seed)
    for row, where, what in result.differences[:SHOWN]:
        print(f"{PROG}: row {row} ({where}): {what}", file=sys.stderr)
    print(f"rows checked: {result.rows_checked:,} in {result.seconds:.1f} s; "
          + ("every column equal to the full render's" if result.ok
             else f"{len(result.differences)} rows differ"))
    return EXIT_OK if result.ok else EXIT_BAD_INPUT


def pull(args: argparse.Namespace) -> int:
    """`pull URL DIR`: a remote cache version copied into the local cache root DIR; prints its local path."""
    from sft_tokenize.files import is_remote
    from sft_tokenize.read.remote_cache import materialize

    if not is_remote(args.url):
        raise BadInput(f"{args.url}: not a URL of object storage (s3://, gs://, …): a local cache is opened where "
                       "it is")
    print(materialize(args.url, args.local_dir, args.storage_options, args.request_timeout))
    return EXIT_OK


def show_lengths(args: argparse.Namespace) -> int:
    """`inspect --lengths`: what each max_length and packing length would cost the cache or mixture."""
    from sft_tokenize.flows.length_report import cache_costs, mixture_text_report, text_report

    costs = cache_costs(args.cache, args.at)
    if args.as_json:
        print(json.dumps(costs, indent=2))
    else:
        print(mixture_text_report(costs) if "sources" in costs else text_report(costs))
    return EXIT_OK


def pack(args: argparse.Namespace) -> int:
    from sft_tokenize.flows.report import packing_summary, text_table
    from sft_tokenize.read.packing_index import PackOptions, pack_cache
    from sft_tokenize.read.remote_cache import cache_location

    options = PackOptions(length=args.length, data_parallel=args.data_parallel, algorithm=args.algorithm,
                          index_dir=args.index_dir)
    # A cache on object storage is packed where it is read: in its local copy, beside which the index is kept
    index = pack_cache(cache_location(args.cache, storage_options=args.storage_options,
                                      request_timeout=args.request_timeout), options)
    print(text_table([("built", "now" if index.built_now else "earlier: reused")]
                     + packing_summary(index.meta, index.build, index.path)))
    print(index.path)
    return EXIT_OK


def export(args: argparse.Namespace) -> int:
    from sft_tokenize.export import export_cache

    record = export_cache(args.cache, args.to, args.out, pack_length=args.pack_length,
                          pad_to_multiple_of=args.pad_to_multiple_of, pad_id=args.pad_id,
                          storage_options=args.storage_options, request_timeout=args.request_timeout)
    reused = " (reused: already exported)" if record.get("reused") else ""
    print(f"{record['target']}: {record['rows']} rows, {record['tokens']} tokens, digest {record['digest']}{reused}",
          file=sys.stderr)
    print(args.out)
    return EXIT_OK


def diff(args: argparse.Namespace) -> int:
    from sft_tokenize.flows.report import text_table
    from sft_tokenize.read.cache import open_cache
    from sft_tokenize.read.cache_diff import diff_caches

    old, new = (open_cache(path, storage_options=args.storage_options, request_timeout=args.request_timeout)
                for path in (args.old, args.new))
    result = diff_caches(old, new)
    if args.as_json:
        print(json.dumps({**vars(result), "old": str(result.old), "new": str(result.new),
                          "trained_delta": result.trained_delta}, default=str, indent=2))
        return EXIT_OK
    print(text_table([("old", str(result.old)), ("new", str(result.new))]
                     + [(f"differs: {key}", f"{a} → {b}") for key, a, b in result.differs]
                     + [("rows", f"{result.rows_old:,} → {result.rows_new:,} (matched by {result.matched_by})"),
                        ("added", f"{result.added:,}"), ("removed", f"{result.removed:,}"),
                        ("changed", f"{result.changed:,}"),
                        ("trained tokens", f"{result.trained_old:,} → {result.trained_new:,} "
                                           f"({result.trained_delta:+,})")]
                     + [(f"row {row}", f"{a:,} → {b:,} trained ({b - a:+,})") for row, a, b in result.changed_rows]))
    if args.rows and result.changed_rows:
        _show_changed_rows(old, new, [row for row, _, _ in result.changed_rows[:args.rows]])
    return EXIT_OK


def _show_changed_rows(old, new, rows: list[int]) -> None:
    """Each row as OLD and as NEW, each decoded by its own cache's tokenizer where it is here."""
    from sft_tokenize.encoding.tokenizer import load_tokenizer
    from sft_tokenize.flows.report import show_row

    colour = sys.stdout.isatty()
    for row in rows:
        for label, cache in (("old", old), ("new", new)):
            directory = cache.manifest.get("tokenizer")
            item = cache[row]
            print(f"── row {row}, {label}: {len(item['input_ids']):,} tokens, {int(item['loss_mask'].sum()):,} trained "
                  f"({'green' if colour else '[[…]]'}) ──")
            if directory and os.path.isdir(directory):
                print(show_row(load_tokenizer(directory), item["input_ids"], item["loss_mask"], colour))
            else:
                print(f"(its tokenizer {directory or '(not recorded)'} is not on this machine: ids "
                      f"{item['input_ids'][:16].tolist()}…)")


def verify_trainer_command(args: argparse.Namespace) -> int:
    """`verify CACHE --trainer NAME [--batches N]`: the trainer's own data path over the cache, checked."""
    from sft_tokenize.consumers.verify_trainer import verify_trainer
    from sft_tokenize.read.cache import open_cache

    cache = open_cache(args.cache, storage_options=args.storage_options, request_timeout=args.request_timeout)
    check = verify_trainer(cache, args.trainer, args.batches, batch_size=args.batch_size, tokenizer=args.tokenizer,
                           export=args.export)
    if args.export:
        print(f"{check.trainer}: {check.rows:,} rows of {args.export}, {check.tokens:,} tokens: its reader gives back "
              f"the cache's ids and loss masks exactly ({check.trained:,} trained tokens)")
    else:
        print(f"{check.trainer}: {check.batches} batches, {check.rows:,} rows, {check.tokens:,} tokens: the "
              f"{check.trained:,} tokens it trains are exactly the cache's loss mask")
    return EXIT_OK


def show_rows(args: argparse.Namespace, manifest: dict) -> int:
    """`inspect --row N` / `--sample K`: rows decoded with their trained tokens highlighted."""
    import random

    from sft_tokenize.encoding.tokenizer import fetch_tokenizer, load_tokenizer
    from sft_tokenize.files import is_remote
    from sft_tokenize.flows.report import show_row
    from sft_tokenize.read.cache import open_cache

    cache = open_cache(args.cache)
    bad = [n for n in args.row if not 0 <= n < len(cache)]
    if bad:
        raise BadInput(f"{args.cache}: no row {bad[0]}: the cache has {len(cache):,} rows (0 to {len(cache) - 1})")
    tokenizer_dir = args.tokenizer or manifest.get("tokenizer")
    if tokenizer_dir and is_remote(tokenizer_dir):  # built with a tokenizer on object storage: this machine's copy
        tokenizer_dir = str(fetch_tokenizer(tokenizer_dir, args.storage_options))
    if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
        raise BadInput(f"{args.cache}: the tokenizer it was built with ({tokenizer_dir or 'not recorded'}) is not "
                       "here: pass --tokenizer DIR")
    tokenizer = load_tokenizer(tokenizer_dir)
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
    from sft_tokenize.build.remote_root import probe_root, split_url
    from sft_tokenize.build.remote_store import collect_remote_garbage
    from sft_tokenize.build.store import collect_garbage

    protocol, root = split_url(args.cache_dir)
    if protocol:
        # a bad URL or credentials: one line, before anything is removed
        probe_root(root, args.storage_options, args.request_timeout)
        done = collect_remote_garbage(root, args.keep, args.grace, args.storage_options, timeout=args.request_timeout)
    else:
        root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(root):
            raise BadInput(f"{root}: no such cache directory")
        done = collect_garbage(root, args.keep)
    for name in done.removed:
        print(f"removed {root}/{name}")
    for name, foreign in done.left.items():
        what = "objects" if protocol else "files"
        print(f"left {root}/{name}: it holds {what} sft-tokenize did not write ({', '.join(foreign)}); "
              f"move them out and gc again to remove it")
    for lease, age in sorted(done.ignored_leases.items()):
        print(f"ignored and removed the lease {lease}: last written {age:,.0f} s ago, longer than --grace "
              f"{args.grace:g} s, so its build was taken for a dead one")
    for name, index in done.held.items():
        print(f"kept {root}/{name}: the mixture index {index} reads it")
    aborted = f", {done.uploads_aborted} incomplete uploads aborted" if protocol else ""
    print(f"kept {len(done.kept)} versions and {done.shards_kept} shards; removed {len(done.removed)} versions and "
          f"{done.shards_removed} shards and {done.results_removed} task results, {done.bytes_freed:,} bytes freed"
          f"{aborted}; {done.live_builds} running builds")
    return EXIT_OK


def server(args: argparse.Namespace) -> int:
    """`server status` / `server stop`: the embedded Prefect server of this PREFECT_HOME."""
    from sft_tokenize.server.server_commands import server_status, stop_server

    if args.action == "status":
        for name, value in server_status():
            print(f"{name}: {value}")
        return EXIT_OK
    print(stop_server(force=args.force))
    return EXIT_OK


SUBCOMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": run, "inspect": inspect, "pack": pack, "pull": pull, "gc": gc, "server": server, "export": export,
    "diff": diff, "verify": verify}


def _interrupted(interrupt: BaseException, args: argparse.Namespace | None) -> str:
    from sft_tokenize.flows.interrupts import signal_of

    line = f"interrupted ({signal_of(interrupt).name})"
    if args is not None and args.command == "run":
        line += (f"; the finished slices stay in the shard store under "
                 f"{os.path.join(args.cache_dir or 'CACHE_DIR', SHARD_STORE)}: run the same command again to resume")
    return line


def _signal_code(interrupt: BaseException) -> int:
    from sft_tokenize.flows.interrupts import EXIT_CODES, signal_of

    return EXIT_CODES[signal_of(interrupt)]


def _said(error: BaseException, args: argparse.Namespace | None) -> str:
    return first_line(error)


def _on_path(error: BaseException, args: argparse.Namespace | None) -> str:
    """An OSError as the path it concerns and what the system said of it."""
    assert isinstance(error, OSError)
    if error.filename is None or not error.strerror:
        return f"{type(error).__name__}: {first_line(error)}"
    return f"{error.filename}: {error.strerror}"


def _stdout_gone(error: BaseException, args: argparse.Namespace | None) -> None:
    # The reader of stdout left (`sft-tokenize inspect ... | head`): stop quietly, as a shell tool does.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# The error policy of every subcommand: each kind of error a command can end with, its exit code and its one
# line on stderr (None: no line). The first kind that matches wins; an error of no kind here is a bug, and
# keeps its traceback.
ERRORS: tuple[tuple[type[BaseException], int | Callable[[BaseException], int],
                    Callable[[BaseException, argparse.Namespace | None], str | None]], ...] = (
    (KeyboardInterrupt, _signal_code, _interrupted),  # Ctrl-C, or SIGTERM during a run (interrupts.Terminated)
    (BadInput, EXIT_BAD_INPUT, _said),  # the input, the tokenizer or an option: its message names the file, row
    (CacheError, EXIT_BAD_INPUT, _said),  # a cache or index missing, corrupt or not what it was built from
    (Failed, EXIT_FAILED, _said),  # a run's failed slices, a lost server, a server still in use
    (BrokenPipeError, EXIT_BROKEN_PIPE, _stdout_gone),
    (PermissionError, EXIT_BAD_INPUT, _on_path),  # a path given that cannot be written, as a run's check says
    (OSError, EXIT_FAILED, _on_path),  # a file system that failed under the command
)


def exit_for(error: BaseException, args: argparse.Namespace | None) -> int:
    """Report `error` by the policy (its one line on stderr) and return its exit code; re-raise an error the
    policy does not name."""
    for kind, code, line in ERRORS:
        if isinstance(error, kind):
            said = line(error, args)
            if said is not None:
                print(f"{PROG}: error: {said}", file=sys.stderr)
            return code(error) if callable(code) else code
    raise error


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help, or bad usage (exit 2)
            sys.stdout.flush()
            return int(exit_.code or 0)
        process_environment()
        if args.command == "run":  # inherited by process-pool workers, which print their own logs
            os.environ[CONSOLE_ENV] = "quiet" if args.quiet else "verbose" if args.verbose else "plain"
            os.environ[SERVER_IDLE_ENV] = str(args.server_idle)  # read by server.embedded_server.EmbeddedServer
        mark("imports")
        code = SUBCOMMANDS[args.command](args)
        sys.stdout.flush()
        mark("exit")
        return code
    except BaseException as error:  # noqa: BLE001 - the policy reports what it names and re-raises the rest
        return exit_for(error, args)


def console_main(ended: Callable[[int], None] | None = None) -> None:
    """The `sft-tokenize` command. A run that published its cache ends at once: Prefect's logs and events sent,
    the embedded server left (atexit), and no interpreter teardown after that (joining Prefect's service threads
    and freeing every module took ~0.4 s of every run). `ended`, if given, hears the exit code then (a resident
    process tells the command it runs: cli/resident.py)."""
    code = main()
    if code == EXIT_OK and "prefect" in sys.modules:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if ended is not None:
            ended(code)
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
