"""tokenize_slices: one task for a group of slices, each still tokenized into its own shard.

A Prefect task run costs the run's process and the server tens of milliseconds whatever it does (its states go
to the server as events, each written to the database; its tag's concurrency slot, its result, its logs). A run
of thousands of slices therefore runs a task per group of slices instead (docs/scale-out.md, "Orchestration").
A group's slices are tokenized one after the other, each into its own shard in the store (reused when finished),
so a retried group redoes only the slices whose shards are missing. A slice that fails does not stop the others
of its group: the group then fails with GroupFailed naming each failed slice and its error, and the flow reports
them slice by slice.

Groups are content-defined: a group ends after a slice whose content key hashes below 1 / size, so a slice added
or changed disturbs only the group it lands in, and groups stay put as the data grows; a group
is also cut at MAX_GROUP_FACTOR times its average size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from prefect import task

from sft_tokenize.build import shard
from sft_tokenize.build.job import Job
from sft_tokenize.build.stopping import Stopped
from sft_tokenize.sources.records import Slice
from sft_tokenize.tasks import GROUP_ABOVE, GROUP_SIZE
from sft_tokenize.tasks.tokenize_slice import NOT_RETRIED, TASK_SETTINGS

GROUPS_PER_WORKER = 4  # smaller groups rather than fewer groups than this many per worker
GROUP_BYTES = 256 * 10**6  # a group reads at most about this much input: the default slice is a task of its own
MAX_GROUP_FACTOR = 4  # a group is cut after this many times its average size whatever the hashes say


@dataclass(frozen=True)
class SliceGroup:
    """Consecutive slices that one task run tokenizes, each into its own shard."""

    slices: tuple[Slice, ...]

    @property
    def name(self) -> str:
        first, last = self.slices[0].index, self.slices[-1].index
        return f"tokenize-{first:05d}" if first == last else f"tokenize-{first:05d}-{last:05d}"

    @property
    def key(self) -> str:
        """The group's cache key: its slices' content keys, in order."""
        return hashlib.blake2b("\n".join(s.key for s in self.slices).encode(), digest_size=16).hexdigest()


class GroupFailed(RuntimeError):
    """Slices of a group that failed: `failures` maps each one's index to its error, `rows` each finished one's
    index to its row count. Rebuilt from its message alone (Prefect's JSON record of a failure keeps only the
    type and the message), it knows neither: each slice of the group then counts as failed with it."""

    def __init__(self, failures: dict[int, BaseException] | str, rows: dict[int, int] | None = None) -> None:
        if isinstance(failures, str):
            super().__init__(failures)
            self.failures, self.rows = {}, {}
            return
        super().__init__(failures, rows)
        self.failures, self.rows = failures, rows or {}

    def __str__(self) -> str:
        if not self.failures:
            return str(self.args[0]) if self.args else ""
        return "; ".join(f"tokenize-{i:05d}: {type(e).__name__}: {e}" for i, e in sorted(self.failures.items()))


def group_size(slices: int, workers: int, per_task: int | None = None, slice_bytes: float = 0) -> int:
    """Slices per task on average: `per_task` if given; else 1 up to GROUP_ABOVE slices, then the largest power of two
    up to GROUP_SIZE that keeps a group's input within GROUP_BYTES (for slices of `slice_bytes` on average: large
    slices amortize their task already) and still leaves GROUPS_PER_WORKER groups per worker."""
    if per_task is not None:
        return per_task
    if slices <= GROUP_ABOVE:
        return 1
    size = GROUP_SIZE
    while size > 1 and (slices / size < GROUPS_PER_WORKER * workers or size * slice_bytes > GROUP_BYTES):
        size //= 2
    return size


def _ends_group(slice_: Slice, size: int) -> bool:
    draw = int.from_bytes(hashlib.blake2b(slice_.key.encode(), digest_size=8).digest(), "big") / 2**64
    return draw < 1 / size


def group_slices(slices: list[Slice], size: int) -> list[SliceGroup]:
    """The slices, in order, cut into content-defined groups of `size` on average (1: a group per slice)."""
    groups: list[SliceGroup] = []
    members: list[Slice] = []
    for slice_ in slices:
        members.append(slice_)
        if size <= 1 or _ends_group(slice_, size) or len(members) >= MAX_GROUP_FACTOR * size:
            groups.append(SliceGroup(tuple(members)))
            members = []
    if members:
        groups.append(SliceGroup(tuple(members)))
    return groups


def group_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """The group's slices' content keys: the same for every flow run."""
    return parameters["group"].key


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Retry unless every failed slice failed in a way that retrying cannot help (NOT_RETRIED)."""
    error = state.result(raise_on_failure=False)
    if isinstance(error, GroupFailed) and error.failures:
        return not all(isinstance(e, NOT_RETRIED) for e in error.failures.values())
    return not isinstance(error, NOT_RETRIED)


@task(
    name="tokenize_slices",
    task_run_name="{group.name}",
    retry_condition_fn=worth_retrying,
    cache_key_fn=group_cache_key,
    **TASK_SETTINGS,
)
def tokenize_slices(job: Job, group: SliceGroup) -> list[int]:
    """Tokenize each slice of the group into its own shard (reusing finished ones); return their row counts, in
    order. Raise GroupFailed naming every slice that failed, once the others are done; an interrupt at once."""
    rows: dict[int, int] = {}
    failures: dict[int, BaseException] = {}
    for slice_ in group.slices:
        try:
            rows[slice_.index] = shard.tokenize_slice(job, slice_)
        except Stopped:
            raise
        except Exception as error:  # noqa: BLE001 - the group goes on; each failure is raised below
            failures[slice_.index] = error
    if failures:
        raise GroupFailed(failures, rows)
    return [rows[s.index] for s in group.slices]
