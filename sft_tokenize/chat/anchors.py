"""Where a render's fields are, for the turn finder (`turns.py`): the anchors its searches run between, and what
a render tells about learning a skeleton from it (`skeleton.py`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Evidence:
    """What a render of Twins tells about learning a skeleton from it, gathered while its turns are located."""

    trace: list = field(default_factory=list)  # what the template learned about the fields (pairs.py)
    reach: list[tuple[int, str]] = field(default_factory=list)  # (field start, header text read into it)
    searched: list[tuple[int, int]] = field(default_factory=list)  # stretches searched for headers and ends
    marked_text: str | None = None  # set when the row was located from one render of Twins
    kinds: list[str] = field(default_factory=list)
    opened: dict[int, int] = field(default_factory=dict)  # field id -> where its first rendering opens
    twice: bool = False  # a field renders more than once
    positions: list[int] = field(default_factory=list)  # of every marker


class Anchors:
    """The rendered fields' start and end positions in the text, sorted, with the message each belongs to."""

    def __init__(self, fields: list[tuple[int, int, int]]):
        points = sorted((position, owner) for owner, start, end in fields for position in (start, end))
        self.positions = [position for position, _ in points]
        self.owners = [owner for _, owner in points]
        self.extents: dict[int, tuple[int, int]] = {}
        for owner, start, end in fields:
            low, high = self.extents.get(owner, (start, end))
            self.extents[owner] = (min(low, start), max(high, end))

    def has(self, message: int) -> bool:
        """Whether any field of the message renders."""
        return message in self.extents

    def extent(self, message: int) -> tuple[int, int]:
        """(first, last) position of the message's fields."""
        return self.extents[message]

    def before(self, position: int, message: int) -> tuple[int, int | None]:
        """(position, message) of the last anchor of another message at or before `position`, or (0, None)."""
        k = bisect.bisect_right(self.positions, position) - 1
        while k >= 0 and self.owners[k] == message:
            k -= 1
        return (self.positions[k], self.owners[k]) if k >= 0 else (0, None)

    def after(self, position: int, message: int, default: int) -> int:
        """The first anchor of another message at or after `position`, or `default`."""
        k = bisect.bisect_left(self.positions, position)
        while k < len(self.positions) and self.owners[k] == message:
            k += 1
        return self.positions[k] if k < len(self.positions) else default


def finds_in_constants(twice: bool, positions: list[int], stretches: list[tuple[int, int]]) -> bool:
    """Whether turn finding read constant text only (a skeleton's premise): no field rendered `twice`, and no
    marker (at sorted `positions`) strictly inside a stretch searched for a header or an end of turn."""
    if twice:
        return False
    for start, end in stretches:
        k = bisect.bisect_right(positions, start)
        if k < len(positions) and positions[k] < end:
            return False
    return True
