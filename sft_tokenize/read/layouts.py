"""Cache layouts: the columns a trainer reads, and only those, so it neither ignores nor chokes on one.

Every column is derived from an encoded batch's flat arrays (token ids and the 0/1 loss mask of all its
rows, end to end) in one vectorised step inside the shard writer: no second pass over the cache.

    skyrl          input_ids, loss_mask               SkyRL's pretokenized store (the default)
    trl            input_ids, labels                  TRL's SFTTrainer uses `labels` as given
    axolotl        input_ids, attention_mask, labels  exactly what axolotl's collators accept
    llama-factory  input_ids, attention_mask, labels  what LLaMA-Factory's `tokenized_path` data holds
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np

Layout = Literal["skyrl", "trl", "axolotl", "llama-factory"]
IGNORE_INDEX = -100  # the label of a token that is not trained (PyTorch's cross-entropy default)

LAYOUTS: dict[str, tuple[str, ...]] = {
    "skyrl": ("input_ids", "loss_mask"),
    "trl": ("input_ids", "labels"),
    "axolotl": ("input_ids", "attention_mask", "labels"),
    "llama-factory": ("input_ids", "attention_mask", "labels"),
}
COLUMN_TYPES = {"input_ids": "int32", "loss_mask": "int8", "labels": "int32", "attention_mask": "int8"}


def layout_columns(layout: str, extra_columns: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The layout's columns, then any `--extra-column` it lacks (labels before attention_mask)."""
    own = LAYOUTS[layout]
    return own + tuple(name for name in ("labels", "attention_mask") if name in extra_columns and name not in own)


def column_values(name: str, input_ids: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """One column's flat values for a batch, from its flat token ids and 0/1 loss mask."""
    import numpy as np  # here: the command line reads the layouts' names before it knows it will write a column

    if name == "input_ids":
        return input_ids
    if name == "loss_mask":
        return loss_mask
    if name == "labels":
        return np.where(loss_mask == 1, input_ids, np.int32(IGNORE_INDEX)).astype(np.int32, copy=False)
    if name == "attention_mask":
        return np.ones(len(input_ids), dtype=np.int8)
    raise ValueError(f"unknown cache column {name!r}")
