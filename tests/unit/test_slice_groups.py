"""Slices grouped into tasks past a threshold: groups cut by content stay put as the data grows, and there are
still enough of them for every worker."""

from __future__ import annotations

import hashlib

from sft_tokenize.sources.records import Slice
from sft_tokenize.tasks import GROUP_ABOVE, GROUP_SIZE
from sft_tokenize.tasks.tokenize_slices import GroupFailed, group_size, group_slices


def slices(names: list[str]) -> list[Slice]:
    return [Slice(i, (), 1, hashlib.sha256(name.encode()).hexdigest()) for i, name in enumerate(names)]


def keys(groups) -> list[tuple[str, ...]]:
    return [tuple(s.key for s in g.slices) for g in groups]


def test_groups_cover_every_slice_in_order_and_average_the_size():
    plan = slices([f"slice-{i}" for i in range(4000)])
    groups = group_slices(plan, 16)
    assert [s for g in groups for s in g.slices] == plan
    assert 4000 / 16 * 0.8 < len(groups) < 4000 / 16 * 1.2
    assert max(len(g.slices) for g in groups) <= 4 * 16
    assert groups[0].name == f"tokenize-00000-{groups[0].slices[-1].index:05d}"


def test_a_slice_added_in_the_middle_changes_only_the_group_it_lands_in():
    names = [f"slice-{i}" for i in range(2000)]
    before = keys(group_slices(slices(names), 16))
    after = keys(group_slices(slices(names[:1000] + ["new"] + names[1000:]), 16))
    changed_before = [g for g in before if g not in after]
    changed_after = [g for g in after if g not in before]
    assert len(changed_before) == 1 and len(changed_after) == 1
    new_key = hashlib.sha256(b"new").hexdigest()
    assert new_key in changed_after[0]
    # Appending (a grown dataset) keeps every group but the last.
    grown = keys(group_slices(slices(names + [f"more-{i}" for i in range(500)]), 16))
    assert grown[:len(before) - 1] == before[:-1]


def test_group_size_is_one_up_to_the_threshold_then_leaves_every_worker_tasks():
    assert group_size(GROUP_ABOVE, 2) == 1
    assert group_size(10_000, 2) == GROUP_SIZE
    assert group_size(10_000, 1024) == 2  # 10,000 / 4 is under 4 groups for each of 1,024 workers
    assert group_size(GROUP_ABOVE + 1, 64) == 1
    assert group_size(10, 2, per_task=4) == 4 and group_size(10_000, 2, per_task=1) == 1


def test_large_slices_are_a_task_each_small_ones_share_one():
    assert group_size(10_000, 2, slice_bytes=256 * 10**6) == 1  # the default slice size
    assert group_size(10_000, 2, slice_bytes=32 * 10**6) == 8  # 8 x 32 MB = 256 MB a task
    assert group_size(10_000, 2, slice_bytes=1_000) == GROUP_SIZE


def test_a_group_failure_rebuilt_from_its_message_alone_still_names_it():
    error = GroupFailed({3: RuntimeError("disk"), 5: ValueError("row")}, {4: 10})
    assert str(error) == "tokenize-00003: RuntimeError: disk; tokenize-00005: ValueError: row"
    rebuilt = GroupFailed(str(error))
    assert rebuilt.failures == {} and str(rebuilt) == str(error)
