"""File mechanisms the build and read sides share: an advisory lock across processes, and fsync by path.

Neutral ground: it imports nothing of the project, so the read side (the packing index) can lock and make
durable what it writes without loading the build side.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("sft_tokenize")


@contextlib.contextmanager
def locked(lock_file: Path, waiting: str | None = None, shared: bool = False) -> Iterator[None]:
    """An advisory lock (flock) across processes, exclusive or shared; says `waiting` if it has to wait."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                logger.warning(waiting)
            fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path: what a rename publishes must be on disk first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
