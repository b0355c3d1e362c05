"""A run as a function: what `sft-tokenize run` and `sft_tokenize.tokenize()` share.

    from sft_tokenize import tokenize
    path = tokenize(["data/*.jsonl"], tokenizer="Qwen/Qwen2.5-0.5B-Instruct", cache_dir="/data/cache",
                    max_length=4096)

The options are checked and the plan is cut before Prefect is imported, so bad input fails at once and a
cache hit returns its path without Prefect. When there is work, the shared embedded server is joined
(started if need be, in its own process, while the slices are cut) unless PREFECT_API_URL names a server,
and the tokenize_dataset flow builds the cache. On the threads runner, this process tokenizes slices into the
shard store while it waits for the server (build/ahead.py): the flow's tasks find them there.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from sft_tokenize.build.stopping import in_background
from sft_tokenize.build.timeline import mark
from sft_tokenize.errors import BadInput, Failed, first_line
from sft_tokenize.files import write_problem
from sft_tokenize.flows.run_options import RUN_OPTIONS  # tokenize()'s options beyond TokenizeOptions
from sft_tokenize.startup_gc import resume_collector

# What a run imports after its plan: its flow's modules, Prefect's engines and what they import on first use,
# and the tokenizer libraries (fastokens is an optional extra). Not transformers: see chat/hf_jinja.py.
RUN_MODULES = ("sft_tokenize.flows.tokenize_dataset", "sft_tokenize.server.embedded_server",
               "sft_tokenize.flows.interrupts", "sft_tokenize.build.workers", "sft_tokenize.build.shard",
               "sft_tokenize.build.shard_writer", "sft_tokenize.build.publish", "prefect.flow_engine",
               "prefect.task_engine", "fastapi.encoders", "tokenizers", "fastokens")


def import_run_modules() -> None:
    for name in RUN_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            if not name.startswith("fastokens"):
                raise


@contextmanager
def _importing_run_modules() -> Iterator[None]:
    """While the body waits (a first run, for its server's boot), this process imports what its flow and slices will
    (~1 s of a core on a first run). Joined when the
    body ends, so that no two threads ever import at once; an import that fails fails again where it is needed."""
    def run() -> None:
        with suppress(Exception):
            import_run_modules()

    with in_background(run, "run-imports"):
        yield


class RunFailed(Failed):
    """The flow failed (a slice's error after its retries, a lost server): the finished shards stay."""


def _as_option_error(error: dict) -> str:
    """A pydantic error as the option the user typed: `--shard-size: not a size: 'lots' ...`."""
    option = "--" + str(error["loc"][0]).replace("_", "-") if error["loc"] else "options"
    return f"{option}: {error['msg'].removeprefix('Value error, ')}"


def _checked(model: type, settings: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    try:
        return model(**{k: v for k, v in settings.items() if k in model.model_fields})
    except ValidationError as error:
        raise BadInput("; ".join(map(_as_option_error, error.errors()))) from None


def prefect_home_problem() -> str | None:
    """Why the embedded server could not keep its database in PREFECT_HOME, or None if it can."""
    from prefect.settings import get_current_settings

    home = Path(get_current_settings().home).expanduser()
    problem = write_problem(home)
    if problem is None:
        return None
    return (f"PREFECT_HOME {os.path.abspath(home)}: Prefect's embedded server cannot keep its database there "
            f"({problem}); point PREFECT_API_URL at a server or PREFECT_HOME at a writable directory")


def _location(cache: str) -> Path | str:
    """A published cache's directory, or its URL on a remote cache root."""
    return cache if "://" in cache else Path(cache)


def run_tokenize(settings: dict[str, Any], progress: Callable[[Any], Any] | None = None,
                 cli_process: bool = False) -> Path | str:
    """Build (or find) the cache that `settings` (the flow's TokenizeRun fields) describe; return its path.

    `progress`, if given, is a context manager factory whose value takes the flow's progress updates (the
    CLI's bar). `cli_process`: this is the CLI's own process, which an embedded server may be forked from
    (EmbeddedServer's `fork`). Raises BadInput for bad options or input, RunFailed when the flow fails,
    KeyboardInterrupt (flows.interrupts.Terminated for SIGTERM) when the run is stopped.
    """
    from sft_tokenize.build.options import TokenizeOptions
    from sft_tokenize.build.plan import check_writable, plan_slices
    from sft_tokenize.build.workers import close_early, encoding_early, ready_processes, start_early
    from sft_tokenize.flows.cluster import require_extra
    from sft_tokenize.flows.run_options import TokenizeRun
    from sft_tokenize.server.server_fork import discard_early, go_early

    # The data plane's options alone, before Prefect is even imported: a bad value, bad input and a cache hit
    # are settled in well under a second.
    checked = _checked(TokenizeOptions, settings)
    try:
        run: TokenizeRun | None = _checked(TokenizeRun, settings)
    except BadInput:
        run = None  # said once the plan is checked, as ever: a cache hit needs none of the run's options
    ahead = run is not None and tokenizes_ahead(run)
    server = None

    def start_server() -> None:  # only when there is work: a cache hit needs no Prefect at all
        nonlocal server
        go_early()  # before this process imports Prefect: the early server process imports the server's meanwhile
        from sft_tokenize.server.embedded_server import EmbeddedServer

        if EmbeddedServer.needed():
            if problem := prefect_home_problem():
                raise BadInput(problem)
            server = EmbeddedServer(fork=cli_process)
            server.start()
        discard_early()  # launched as the server, or not needed (none to launch, or one up already)

    # Checked before the flow starts: bad input fails at once, and a cache hit needs no flow. When there is
    # work, the shared server is joined (started if need be: it boots in its own process) while this one cuts
    # the slices, as the flow will cut them (its worker count) and, to tokenize them ahead, keyed by content.
    require_extra(settings.get("runner", "threads"))
    plan = plan_slices(checked, min_slices=run.worker_count if run else 1, on_work=start_server, content_keys=ahead)
    if plan.cached and not settings.get("force"):
        discard_early()
        return plan.url or plan.cache_path
    if plan.cached:  # --force of a published cache: the plan did not check the root it will write under
        check_writable(checked.cache_root)
    options = run or _checked(TokenizeRun, settings)
    from sft_tokenize.build import shard
    from sft_tokenize.build.ahead import Ahead

    def tokenize_slice(job: Any, slice_: Any) -> int:  # what the tasks call, looked up as they look it up
        return shard.tokenize_slice(job, slice_)

    try:
        # The threads runner's encode pool, if the input may need one, starts now: its processes build their
        # encoder while the flow starts. The flow takes it if it wants as many processes; else it is closed below.
        processes = options.encode_process_count(sum(s.nbytes for s in plan.slices), ready_processes(plan.job))
        start_early(plan.job, processes)
        with ExitStack() as stack:
            # While a server this run launched boots, the slices are tokenized, and found by the tasks. A server that
            # is up already (a run right after another) leaves nothing to overlap: tokenizing here would only take
            # the cores and this process's GIL from the flow's start.
            if ahead and not plan.cached and server is not None and server.process is not None:
                stack.enter_context(encoding_early(plan.job, processes))
                stack.enter_context(Ahead(plan.job, plan.slices, options.worker_count, tokenize_slice))
            return _run_flow(options, server, progress, cli_process)
    finally:
        close_early()  # a pool the flow did not take (its slices were in the store already)
        # Its watch thread silenced the flow's unwinding (embedded_server.py). A process that goes on after the
        # run gets its logging back; the command's stays off, as a task the flow left behind (one not yet started,
        # or a slice still tokenizing) logs its end after the run's one line.
        if server is not None and server.lost and not cli_process:
            logging.disable(logging.NOTSET)


def tokenizes_ahead(options: Any) -> bool:
    """Whether a run tokenizes slices in its own process while its server boots (build/ahead.py): the threads
    runner's, on a local root, unless it deletes the plan's shards first (--force)."""
    return options.runner == "threads" and not options.remote_root and not options.force


def _run_flow(options: Any, server: Any, progress: Callable[[Any], Any] | None, cli_process: bool) -> Path | str:
    """The tokenize_dataset flow on the joined server (`server`: the embedded one, None for PREFECT_API_URL's)."""
    from prefect.exceptions import TerminationSignal
    from prefect.settings import get_current_settings

    from sft_tokenize.flows.interrupts import Terminated
    from sft_tokenize.flows.tokenize_dataset import on_progress, tokenize_dataset
    from sft_tokenize.server.embedded_server import EmbeddedServer, ServerLost, ServerUnavailable, check_api_reachable

    if server is None and EmbeddedServer.needed():  # --force of a published cache: the plan did no work
        server = EmbeddedServer(fork=cli_process)
    if server is None:
        try:
            check_api_reachable(str(get_current_settings().api.url))
        except ServerUnavailable as error:
            raise RunFailed(str(error)) from None
    try:
        if server:
            with _importing_run_modules():
                server.use()
        else:
            import_run_modules()  # what the flow imports on first use, before the collector resumes
        resume_collector()
        mark("server")
        if progress is None:
            return _location(tokenize_dataset(options))
        # The bar closes, showing its last state, before an error is reported below it.
        with progress() as bar, on_progress(bar.update):
            return _location(tokenize_dataset(options))
    except BadInput:
        raise
    except ServerLost as lost:  # the embedded server's process died under the run
        raise RunFailed(str(lost)) from None
    except TerminationSignal as signal_:  # Prefect's SIGTERM bridge, if it did not hand the signal back
        raise Terminated() from signal_
    except Exception as error:  # noqa: BLE001 - any other failure: one line, details in the Prefect logs
        if server is not None and server.lost:  # what the calls to the lost server raised
            raise RunFailed(server.lost) from None
        raise RunFailed(f"{type(error).__name__}: {first_line(error)}") from error


_PASSED = ("sources", "tokenizer", "cache_dir")  # tokenize()'s own parameters


def check_option_names(options: dict[str, Any], caller: str = "tokenize()") -> None:
    """TypeError naming an option no run has, and the known one closest to it: a misspelt option would
    otherwise be dropped, and the cache built without it."""
    import difflib

    from sft_tokenize.build.options import TokenizeOptions

    known = sorted((set(TokenizeOptions.model_fields) | set(RUN_OPTIONS)) - set(_PASSED))
    for name in options:
        if name not in known:
            close = difflib.get_close_matches(name.replace("-", "_").lower(), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "the options are listed in docs/cli.md"
            raise TypeError(f"{caller} got an unknown option {name!r} ({hint})")


def _source_list(sources: Any) -> list[str]:
    """`sources` as the run's list of specs; one line saying what is expected if it is not one."""
    expected = "a path, a glob, hub:NAME or a list of them"
    if isinstance(sources, (str, os.PathLike)):
        return [os.fspath(sources)]
    # A dict would give its keys and a set an order that changes between processes (and with it the rows' order).
    if isinstance(sources, (dict, set, frozenset, bytes)) or not hasattr(sources, "__iter__"):
        raise TypeError(f"tokenize(): sources is {type(sources).__name__} {_shown(sources)}; expected {expected}")
    specs = list(sources)
    if not specs:
        raise BadInput(f"tokenize(): sources is an empty {type(sources).__name__}; expected {expected}")
    for i, spec in enumerate(specs):
        if not isinstance(spec, (str, os.PathLike)):
            raise TypeError(f"tokenize(): sources[{i}] is {type(spec).__name__} {_shown(spec)}; expected a path, "
                            "a glob or hub:NAME")
    return [os.fspath(spec) for spec in specs]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _model_path(value: Any, what: str) -> str | None:
    """A tokenizer or processor given as a path or hub name, or as a loaded transformers object (saved by the
    content of its files, see saved_pretrained); one line saying what to pass if it is neither."""
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value is None else os.fspath(value)
    if callable(getattr(value, "save_pretrained", None)):
        from sft_tokenize.encoding.tokenizer import saved_pretrained

        return str(saved_pretrained(value, what))
    raise TypeError(f"tokenize(): {what} is {type(value).__name__} {_shown(value)}; expected its directory, a hub "
                    f"name, or a loaded transformers {what}")


def tokenize(sources: str | os.PathLike | list[str | os.PathLike], *, tokenizer: Any = None,
             cache_dir: str | os.PathLike, **options: Any) -> Path | str:
    """Tokenize `sources` into a published cache under `cache_dir`, as `sft-tokenize run` does, and return its path
    (with `cache_dir` a bucket's URL, `s3://bucket/prefix`, the version's URL: open_cache and for_trl take it).

    `tokenizer` (and `processor`) is a directory, a hub model name, or a loaded transformers tokenizer (processor):
    an object is saved under the user's cache, in a directory named by its files' content, and runs as that
    path does (the same content, the same cache). `options` are the run's options by their flow-parameter names
    (the command line's flags with `_` for `-`: `max_length=4096`, `train_on="last_assistant"`,
    `runner="dask"`, `workers=8`, ...; docs/cli.md lists them); an unknown one is a TypeError naming the
    closest known. A second call with the same inputs is a cache hit: it returns the same path without Prefect.
    Raises sft_tokenize.BadInput (bad options or input: the message names the file, row and problem) or
    RunFailed (the flow failed; the finished slices stay, and calling again resumes).
    """
    check_option_names(options)
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"tokenize(): cache_dir is {type(cache_dir).__name__} {_shown(cache_dir)}; expected a "
                        "directory's path")
    settings = {"sources": _source_list(sources), "tokenizer": _model_path(tokenizer, "tokenizer"),
                "cache_dir": os.fspath(cache_dir), **options}
    if "processor" in options:
        settings["processor"] = _model_path(options["processor"], "processor")
    return run_tokenize(settings)


def run_recipe(recipe_file: str | os.PathLike, run_settings: dict[str, Any] | None = None,
               overrides: dict[str, Any] | None = None, progress: Callable[[Any], Any] | None = None,
               cli_process: bool = False) -> Path:
    """Build every source's cache of a recipe (each an ordinary run, so a cached source costs a plan), then the
    mixture index over them; return the index's path.

    `overrides` replace the recipe's shared options (the command line's --tokenizer, --cache-dir);
    `run_settings` say how the runs run (runner, workers, retries, force, ...). Every source's options are
    checked and its inputs resolved before the first source runs: a bad recipe fails before any work."""
    from sft_tokenize.build.recipe import load_recipe
    from sft_tokenize.read.mixture_index import mix_caches

    recipe = load_recipe(recipe_file, overrides)
    recipe.check_sources(os.fspath(recipe_file))
    runs = recipe.runs()
    caches = [run_tokenize({**options.model_dump(), **(run_settings or {})}, progress, cli_process)
              for options in runs]
    return mix_caches(recipe.mixture_options([str(path) for path in caches])).path


def plan_runs(settings: dict[str, Any], workers: int, recipe_file: str | os.PathLike | None = None,
              overrides: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any] | None]]:
    """A dry run of the run `settings` describe, or of each source of a recipe: per run its cache's path and the
    dry run's report (None when the cache is published). Nothing is written under the cache root; no Prefect."""
    from sft_tokenize.build.dry_run import dry_run
    from sft_tokenize.build.plan import plan_slices
    from sft_tokenize.build.recipe import load_recipe
    from sft_tokenize.flows.run_options import TokenizeRun

    runs = load_recipe(recipe_file, overrides).runs() if recipe_file else [_checked(TokenizeRun, settings)]
    out = []
    for options in runs:
        # the slices the run would cut: every worker gets one (a recipe's sources run with the settings' workers)
        plan = plan_slices(options, dry=True, min_slices=getattr(options, "worker_count", workers))
        out.append((plan.location, None if plan.cached else dry_run(plan.job, plan.slices, workers)))
    return out
