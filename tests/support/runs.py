"""A CLI run in the background, as an operator's terminal or a scheduler starts one: in its own session, so
that its process group holds everything it starts (an embedded server, worker processes), which can then be
paused, stepped, killed as one, and checked to be gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from support import lanes
from support.cli import TIMEOUT, environment
from support.paths import BIN


class Background:
    """`sft-tokenize` running in its own session (its process group holds any embedded server and workers),
    its output in files so that a long run never blocks on a full pipe."""

    def __init__(self, args: list[str], home: Path, logs: Path, api_url: str | None = None, **env):
        """`env`: more of `support.cli.environment`'s arguments (its startup_timeout, variables)."""
        lanes.require("cli", "`sft-tokenize` in the background")
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = logs / "stdout", logs / "stderr"
        with self.stdout_path.open("w") as out, self.stderr_path.open("w") as err:
            self.process = subprocess.Popen([str(BIN / "sft-tokenize"), *args], stdout=out, stderr=err,
                                            stdin=subprocess.DEVNULL, env=environment(home, api_url, **env),
                                            start_new_session=True)
        self.group = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait(self, timeout: float = TIMEOUT) -> int:
        return self.process.wait(timeout=timeout)

    def ended_within(self, timeout: float, since: str) -> int:
        """The exit code, once the run ends; killed and failed if it is still running `timeout` seconds on."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout:g} s after {since}:\n{self.stderr}")

    def tree(self) -> list[psutil.Process]:
        """The CLI and every process under it, while it runs."""
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 180) -> None:
        """Poll `condition`; fail if the run ends first or the time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the run ended (exit {self.process.returncode}) before {what}:\n{self.stderr}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"timed out waiting for {what}:\n{self.stderr}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the whole process group, as an OOM killer or `kill -9 -PGID` would; nothing may survive it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.group, signal.SIGKILL)
        self.process.wait(timeout=30)
        assert_group_gone(self.group)

    def pause(self) -> None:
        """SIGSTOP the process group and wait until the CLI has stopped (a system call in flight finishes first)."""
        os.killpg(self.group, signal.SIGSTOP)
        cli_process = psutil.Process(self.process.pid)
        while cli_process.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
            time.sleep(0.0005)

    def step_until(self, condition: Callable[[], bool], what: str) -> None:
        """Let a paused run go on a millisecond at a time until `condition` holds, and leave it paused there."""
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the run ended before {what}:\n{self.stderr}")
            os.killpg(self.group, signal.SIGCONT)
            time.sleep(0.001)
            self.pause()

    def finish(self) -> int:
        code = self.process.wait(timeout=TIMEOUT)
        assert_group_gone(self.group)
        return code


def assert_group_gone(group: int, timeout: float = 15) -> None:
    """No live process is left in the CLI's process group (no embedded server, no worker)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for process in psutil.process_iter(["pid", "status", "cmdline"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(process.info)
        if not left:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes left behind by sft-tokenize: {left}")
        time.sleep(0.1)
