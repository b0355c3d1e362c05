"""Ctrl-C, SIGTERM and SIGHUP: stop a run within seconds, keep the finished shards, leave no worker behind.

The CLI turns SIGTERM into `Terminated` and SIGHUP into `HungUp`, KeyboardInterrupts, so every signal unwinds
the main thread the same way (Prefect marks the flow run Crashed on the way out). While slices run,
`stopping_workers` turns that unwinding into a stop of the workers before the task runner waits for them:
threads see the data plane's stop flag at their next batch and remove their temporary shard; process-pool
workers (which ignore SIGINT, so a terminal's Ctrl-C reaches only the CLI's handling) are terminated, and the
temporary shards they were writing are removed while this run still holds the fingerprint's build lock.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sft_tokenize.build.stopping import request_stop

if TYPE_CHECKING:
    from prefect.task_runners import TaskRunner

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + the signal, as a shell says


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt."""

    signum = signal.SIGTERM


class HungUp(Terminated):
    """SIGHUP (the terminal closed, an ssh session dropped): stopped as SIGTERM stops a run."""

    signum = signal.SIGHUP


def _raise_terminated(signum, frame) -> None:
    raise HungUp() if signum == signal.SIGHUP else Terminated()


def raise_on_sigterm() -> None:
    """Unwind on SIGTERM and SIGHUP instead of dying mid-write (Prefect's own handler defers to this one); a
    SIGHUP ignored by whoever started the process (`nohup`) stays ignored."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _raise_terminated)


def ignore_sigint() -> None:
    """In a worker process: a terminal's Ctrl-C reaches the whole process group; the CLI stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def signal_of(interrupt: BaseException) -> signal.Signals:
    if isinstance(interrupt, Terminated):
        return interrupt.signum
    return signal.SIGTERM if getattr(interrupt, "signal", None) == signal.SIGTERM else signal.SIGINT


def _terminate_processes(runner: TaskRunner, grace: float = 3.0) -> None:
    executor = getattr(runner, "_executor", None)
    processes = list((getattr(executor, "_processes", None) or {}).values())
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(grace)
        if process.is_alive():
            process.kill()
            process.join()


@contextmanager
def stopping_workers(runner: TaskRunner, shards: list[Path]) -> Iterator[None]:
    """Around the slices' submission and wait: on Ctrl-C or SIGTERM, stop the workers first, then remove what
    they were writing: the temporary files of this run's `shards` (the store is shared with other runs)."""
    from prefect.exceptions import TerminationSignal
    from prefect.task_runners import ProcessPoolTaskRunner

    try:
        yield
    except (KeyboardInterrupt, TerminationSignal):
        request_stop()
        if isinstance(runner, ProcessPoolTaskRunner):
            _terminate_processes(runner)
            for shard in shards:
                for partial in shard.parent.glob(f"{shard.name}.tmp-*"):
                    partial.unlink(missing_ok=True)
        raise
