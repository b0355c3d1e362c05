"""Slices tokenized ahead of their tasks (build/ahead.py): each slice tokenized once, its outcome handed to the
slice's task as it is (rows, or its error once: a retry tokenizes it again), the threads stopped at the first claim."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from support.data import example_rows, write_jsonl
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.build import ahead, shard
from sft_tokenize.build.options import TokenizeOptions
from sft_tokenize.build.plan import plan_slices
from sft_tokenize.errors import BadInput
from sft_tokenize.flows.api import tokenizes_ahead
from sft_tokenize.flows.run_options import TokenizeRun


def four_slices(tmp_path: Path, rows: list | None = None):
    source = write_jsonl(tmp_path / "rows.jsonl", rows or example_rows())
    return plan_slices(TokenizeOptions(sources=[str(source)], tokenizer=str(EXAMPLE_TOKENIZER),
                                       cache_dir=str(tmp_path / "cache"), shard_size="100KB"))


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def counting(calls: list, fail: set[int] = frozenset()):
    def tokenize(job, slice_):
        calls.append(slice_.index)
        if slice_.index in fail:
            raise RuntimeError(f"slice {slice_.index} failed here")
        return shard.tokenize_slice(job, slice_)
    return tokenize


def test_slices_tokenized_ahead_are_found_by_their_tasks_and_none_twice(tmp_path):
    plan = four_slices(tmp_path)
    every = [s.index for s in plan.slices]
    assert len(every) >= 3
    calls: list[int] = []
    with ahead.Ahead(plan.job, plan.slices, 2, counting(calls)) as early:
        for thread in early.threads:
            thread.join()  # every slice done before any task claims one
        assert sorted(ahead.tokenized_ahead(plan.job, plan.slices)) == every
        rows = [shard.tokenize_slice(plan.job, s) for s in plan.slices]  # what the tasks call
    assert sorted(calls) == every  # each slice once, by the threads
    assert sum(rows) == len(example_rows())
    assert len(list(Path(plan.job.store).glob("*.arrow"))) == len(every)
    assert not ahead._aheads  # gone with its run


def test_a_task_waits_for_its_slice_in_flight_and_the_threads_stop_at_the_first_claim(tmp_path):
    plan = four_slices(tmp_path)
    calls: list[int] = []
    release = threading.Event()
    tokenize = counting(calls)

    def held(job, slice_):
        if slice_.index == 0:
            release.wait(30)
        return tokenize(job, slice_)

    with ahead.Ahead(plan.job, plan.slices, 1, held) as early:
        wait_until(lambda: early.outcomes)  # slice 0 taken
        claim = threading.Thread(target=lambda: claimed.append(ahead.claimed(plan.job, plan.slices[0])))
        claimed: list = []
        claim.start()
        wait_until(lambda: not early.taking)  # the claim stopped the threads taking more
        release.set()
        claim.join(30)
        rest = [shard.tokenize_slice(plan.job, s) for s in plan.slices[1:]]  # the tasks tokenize the others
    assert claimed and claimed[0] > 0
    assert calls == [0] and ahead.tokenized_ahead(plan.job, plan.slices) == set()
    assert len(list(Path(plan.job.store).glob("*.arrow"))) == len(plan.slices) == len(rest) + 1


def test_a_slice_that_failed_ahead_fails_its_task_with_that_error_once_and_a_retry_tokenizes_it(tmp_path):
    plan = four_slices(tmp_path)
    calls: list[int] = []
    with ahead.Ahead(plan.job, plan.slices, 2, counting(calls, fail={1})) as early:
        for thread in early.threads:
            thread.join()
        with pytest.raises(RuntimeError, match="slice 1 failed here") as first:
            shard.tokenize_slice(plan.job, plan.slices[1])  # the task's first attempt
        assert first.value is not None and calls.count(1) == 1  # not tokenized again for it
        assert shard.tokenize_slice(plan.job, plan.slices[1]) > 0  # its retry tokenizes it
    assert 1 not in ahead.tokenized_ahead(plan.job, plan.slices)


def test_a_bad_row_found_ahead_is_the_tasks_error_naming_its_line(tmp_path):
    rows = example_rows() + ["{not json"]
    plan = four_slices(tmp_path, rows)
    last = plan.slices[-1]
    with ahead.Ahead(plan.job, plan.slices, 2, shard.tokenize_slice) as early:
        for thread in early.threads:
            thread.join()
        with pytest.raises(BadInput, match=rf"rows.jsonl:{len(rows)}: ") as raised:
            shard.tokenize_slice(plan.job, last)
    assert "not json" in str(raised.value) or "JSON" in str(raised.value)
    assert not list(Path(plan.job.store).glob(f"{last.key}.arrow*"))


def test_a_run_that_ends_before_its_tasks_stops_its_slices_in_flight(tmp_path):
    plan = four_slices(tmp_path)
    started = threading.Event()

    def endless(job, slice_):
        from sft_tokenize.build.stopping import raise_if_stopping

        started.set()
        while True:
            raise_if_stopping()

    early = ahead.Ahead(plan.job, plan.slices, 1, endless)
    early.start()
    assert started.wait(30)
    early.close()  # returns: the slice saw its stop
    assert not any(thread.is_alive() for thread in early.threads)
    from sft_tokenize.build.stopping import raise_if_stopping

    raise_if_stopping()  # the rest of the process was not stopped


@pytest.mark.parametrize(("settings", "expected"), [
    ({}, True), ({"runner": "dask"}, False), ({"runner": "ray"}, False), ({"runner": "processes"}, False),
    ({"force": True}, False), ({"remote_root": "s3://bucket/root"}, False)])
def test_only_the_threads_runners_local_runs_tokenize_ahead(tmp_path, settings, expected):
    base = {"sources": ["x.jsonl"], "tokenizer": str(EXAMPLE_TOKENIZER), "cache_dir": str(tmp_path)}
    if "remote_root" in settings:
        base["cache_dir"] = settings.pop("remote_root")
    assert tokenizes_ahead(TokenizeRun(**base, **settings)) is expected


def test_a_shard_removed_after_it_was_tokenized_ahead_is_tokenized_again_by_its_task(tmp_path):
    """A gc between the slice's end and the run's lease removes its shard: the task finds none and tokenizes it."""
    plan = four_slices(tmp_path)
    calls: list[int] = []
    with ahead.Ahead(plan.job, plan.slices[:1], 1, counting(calls)) as early:
        for thread in early.threads:
            thread.join()
        plan.job.shard_path(plan.slices[0]).unlink()
        assert shard.tokenize_slice(plan.job, plan.slices[0]) > 0
    assert calls == [0] and plan.job.shard_path(plan.slices[0]).exists()
