"""Runs killed mid-way or while publishing, and a worker process killed under a run: the same command resumes,
reuses every finished shard and publishes the cache a clean run gives. The first run that is killed starts its
own embedded server, which must die with it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.caches import (
    assert_no_partial_shard,
    assert_readable_whole,
    contents,
    held,
    published_inodes,
    someone_waits_for,
    staged_shards,
)
from support.cli import assert_clean_error, cli, environment, run_args
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.protocol import run_locally
from sft_tokenize.errors import CacheError
from sft_tokenize.read.cache import open_cache


@pytest.fixture(scope="module")
def many_rows(tmp_path_factory) -> Path:
    """The example rows four times over: 960 rows, 14 slices of 100KB, a few seconds of tokenizing."""
    rows = example_rows()
    return write_jsonl(tmp_path_factory.mktemp("many") / "many.jsonl", rows * 4)


@pytest.fixture(scope="module")
def many_rows_reference(tmp_path_factory, many_rows) -> Path:
    """The same input tokenized by the plain pipeline, in one process, without Prefect: a clean run."""
    cache_dir = tmp_path_factory.mktemp("reference")
    return run_locally(TokenizeOptions(sources=[str(many_rows)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(cache_dir), shard_size="100KB"))


def test_killed_runs_resume_and_publish_the_clean_runs_cache(tmp_path, prefect_home, api_url, launch, many_rows,
                                                             many_rows_reference):
    cache_root = tmp_path / "cache"
    cache_path = cache_root / many_rows_reference.name  # same inputs, same fingerprint, same name
    staging = cache_root / ".staging"
    rows = len(open_cache(many_rows_reference))
    args = run_args([many_rows], cache_root)

    first = launch(args, prefect_home, "first")
    first.wait_until(lambda: len(staged_shards(cache_root)) >= 3, "three shards finished")
    first.kill()
    kept = staged_shards(cache_root)
    assert 3 <= len(kept) < 14
    assert_no_partial_shard(cache_root)

    # The same command resumes (on the module's server: the embedded one has shown it dies with its run). It is
    # held at the door of the publish (this test holds the publish lock, as a concurrent run would), then let in
    # a millisecond at a time and killed with its cache half-built.
    fingerprint = cache_path.name.rsplit("-", 1)[1]
    with held(staging / f"{fingerprint}.lock"):
        second = launch(args, prefect_home, "second", api_url=api_url)
        second.wait_until(lambda: someone_waits_for(staging / f"{fingerprint}.lock"), "the publish")
        second.pause()
    second.step_until(lambda: any(staging.glob("*.publish-*")), "a half-built cache")
    second.kill()
    assert f"tokenizing 14 slices ({len(kept)} already in the shard store)" in second.stderr
    assert not cache_path.exists()  # a reader sees no cache, not a half-built one
    with pytest.raises(CacheError, match="not a published cache"):
        open_cache(cache_path)
    assert_no_partial_shard(cache_root)

    third = launch(args, prefect_home, "third", api_url=api_url)
    while third.process.poll() is None:
        assert_readable_whole(cache_path, rows)
        time.sleep(0.02)
    assert third.finish() == 0, third.stderr
    assert third.stdout.splitlines()[-1] == str(cache_path)
    assert "tokenizing 14 slices (14 already in the shard store)" in third.stderr  # only the publish was redone
    assert contents(cache_path) == contents(many_rows_reference)
    # Shards finished before the first kill were never rewritten: they are the published data files.
    assert set(kept.values()) <= set(published_inodes(cache_path).values())
    assert [p.name for p in staging.iterdir() if p.is_dir()] == []  # no shard, no half-built cache left behind


def test_a_killed_worker_process_fails_the_run_and_the_same_command_resumes(tmp_path, api_url, launch, many_rows,
                                                                            many_rows_reference):
    cache_root = tmp_path / "cache"
    args = run_args([many_rows], cache_root, "--runner", "processes")
    run = launch(args, tmp_path / "home", "first", api_url=api_url)
    run.wait_until(lambda: len(staged_shards(cache_root)) >= 2, "two shards finished")
    workers = [p for p in psutil.Process(run.process.pid).children(recursive=True)
               if any("spawn_main" in part for part in p.cmdline())]
    assert len(workers) == 2
    workers[0].kill()
    run.finish()
    assert_clean_error(run, 1, "SlicesFailed", "BrokenProcessPool",
                       "run the same command again to tokenize only these")
    kept = staged_shards(cache_root)
    assert_no_partial_shard(cache_root)

    resumed = cli(*args, home=tmp_path / "home", api_url=api_url)
    assert resumed.returncode == 0, resumed.stderr
    assert f"tokenizing 14 slices ({len(kept)} already in the shard store)" in resumed.stderr
    cache_path = Path(resumed.stdout.splitlines()[-1])
    assert contents(cache_path) == contents(many_rows_reference)
    assert set(kept.values()) <= set(published_inodes(cache_path).values())


# A process-pool worker killed at the one moment it holds the lock of the queue that carries its logs and events
# to the run (the moment is rare in the test above, where the kill lands anywhere; here it is made certain).
KILLED_WHILE_SENDING_A_LOG = """
import os, signal
from prefect import flow, task
from prefect.logging import handlers
from sft_tokenize.flows.runners import started_task_runner

@task
def die_while_sending_a_log() -> None:
    handlers._api_log_sink.args[0]._wlock.acquire()  # the worker's queue to the run, as its log sender takes it
    os.kill(os.getpid(), signal.SIGKILL)

@flow
def one_worker_killed() -> None:
    with started_task_runner("processes", 1) as runner:
        future = runner.submit(die_while_sending_a_log, {})
        try:
            future.result()
        except Exception as error:
            print(type(error).__name__, flush=True)

one_worker_killed()
"""


def test_a_worker_killed_holding_the_lock_of_its_messages_to_the_run_does_not_keep_the_run_from_ending(
        tmp_path, api_url):
    ended = subprocess.run([sys.executable, "-c", KILLED_WHILE_SENDING_A_LOG], capture_output=True, text=True,
                           env=environment(tmp_path / "home", api_url), timeout=120)
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.split() == ["BrokenProcessPool"], ended.stderr
