"""The CLI's console: Prefect's run logs, in the CLI's process and in its process-pool workers, and the progress
bar drawn among them.

The CLI picks a mode and exports it in SFT_TOKENIZE_CONSOLE, so spawned workers (which print their own
task-run logs) follow it too. Without the variable (a deployment run, a test) nothing changes.

    plain    run logs on stderr, one line each: tracebacks stay in the Prefect API, where the UI shows them, and
             Prefect's lines that repeat a failure the CLI reports (a failed slice, the run's error) are left out
    verbose  run logs with tracebacks
    quiet    no run logs on the console
"""

from __future__ import annotations

import logging
import os

CONSOLE_ENV = "SFT_TOKENIZE_CONSOLE"


class _CliConsoleFilter(logging.Filter):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "prefect" and record.levelno < logging.WARNING:
            return False  # the embedded server's "Starting temporary server ..." notices
        if self.mode != "verbose" and _repeats_a_failure(record):
            return False
        if self.mode != "verbose":
            # The console handler sits on the root logger, so the API handler has already sent the traceback.
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _repeats_a_failure(record: logging.LogRecord) -> bool:
    """Prefect's own lines about a failure the CLI reports anyway: a task run's end and its last failed attempt
    (the flow logs one line per failed slice) and the flow run's exception and end (the CLI's error line says
    it). The retry notices stay; the Prefect API keeps every line."""
    if record.name not in ("prefect.task_runs", "prefect.flow_runs"):
        return False
    message = str(record.msg)
    if message.startswith("Finished in state Failed"):
        return True
    if record.name == "prefect.flow_runs":
        return message.startswith("Encountered exception during execution")
    return message.startswith("Task run failed with") and "will start" not in message


def prefect_console_handler():
    from prefect.logging.handlers import PrefectConsoleHandler

    return next((h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)), None)


def configure_console(worker: bool = False):
    """Apply the CLI's console mode to Prefect's console handler; returns that handler's rich console
    (or None). A worker stays quiet unless verbose: the CLI's own process reports every slice."""
    mode = os.environ.get(CONSOLE_ENV)
    handler = prefect_console_handler()
    if not mode or handler is None:
        return None
    if any(isinstance(f, _CliConsoleFilter) for f in handler.filters):
        return handler.console
    handler.addFilter(_CliConsoleFilter(mode))
    if mode == "quiet" or (worker and mode != "verbose"):
        handler.setLevel(logging.CRITICAL + 1)
    return handler.console


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
