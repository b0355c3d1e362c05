"""How a run's rows become loss masks: the mask options as one frozen value.

Built once from the Job (`Job.masks`, from the Job's fields of the same names), given as it is to the encoder
(`encoding/chat_encoder.py`) and the turn finder (`chat/turns.py`), and part of the key under which a process
keeps its encoder. A new mask option is declared in the option table (`build/options.py`), added here, and read
where it is used.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class MaskSettings:
    """The mask options of a run (docs/masks.md). `skeletons`: rows of a shape already rendered are filled in
    (`--render skeleton`), else every row is rendered (`--render full`)."""

    train_on: str = "all_assistant"
    max_length: int | None = None
    truncation: str = "truncate"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # a copy of its own, never changed
    reasoning_turns: str = "as-rendered"
    special_text: str = "literal"
    skeletons: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "template_kwargs", copy.deepcopy(dict(self.template_kwargs or {})))

    @property
    def key(self) -> str:
        """The settings as canonical JSON: equal settings, equal keys."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), default=str)

    def __hash__(self) -> int:
        return hash(self.key)
