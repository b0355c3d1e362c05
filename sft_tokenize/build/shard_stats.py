"""A shard's statistics, recorded in its sidecar: rows, tokens, drops by reason, lengths, images."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from sft_tokenize.encoding.chat_encoder import EncodedBatch


@dataclass
class ShardStats:
    trains_every_token: bool = False  # train_on all: a wholly trained row is the point, not a warning sign
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    rows_exact: int = 0  # rows whose mask took the exact (prefix-rendering) path
    rows_expanded: int = 0  # extra rows made by --reasoning-turns expand
    rows_special_text: int = 0  # rows with a control token's text inside a message, encoded as plain text
    rows_all_trained: int = 0  # rows whose every token is trained: almost always a broken template
    tokens_straddling: int = 0  # trained tokens holding untrained characters too (encoding/token_mask.py)
    rows_filled: int = 0  # rows filled from a skeleton (chat/skeleton.py) rather than rendered
    rows_checked: int = 0  # of those, rows also rendered in full and compared
    skeleton_mismatches: int = 0  # fills that differed from their full render (rendered in full instead)
    max_buffered_rows: int = 0
    images: int = 0  # images stored in the rows
    image_tokens: int = 0  # vision tokens in the rows
    image_bytes: int = 0  # encoded image bytes stored (embed) or referenced
    pixel_bytes: int = 0  # float32 pixel_values stored (--extra-column pixel_values)
    image_files: list[list] = field(default_factory=list)  # [url, *identity] of each image file read
    dropped: Counter = field(default_factory=Counter)
    lengths: Counter = field(default_factory=Counter)

    def add(self, batch: EncodedBatch) -> None:
        self.rows += batch.rows
        self.rows_exact += batch.rows_exact
        self.rows_expanded += batch.rows_expanded
        self.rows_special_text += batch.rows_special_text
        self.tokens_straddling += batch.tokens_straddling
        self.rows_filled += batch.rows_filled
        self.rows_checked += batch.rows_checked
        self.skeleton_mismatches += batch.skeleton_mismatches
        self.tokens += len(batch.input_ids)
        self.trained_tokens += int(batch.loss_mask.sum(dtype=np.int64))
        if batch.rows and not self.trains_every_token:  # every kept row has a token
            trained = np.add.reduceat(batch.loss_mask, batch.offsets[:-1], dtype=np.int64)
            self.rows_all_trained += int(np.count_nonzero(trained == np.diff(batch.offsets)))
        values, counts = np.unique(np.diff(batch.offsets), return_counts=True)
        self.lengths.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))

    def as_json(self) -> dict:
        values = sorted(self.lengths)
        return {"rows": self.rows, "tokens": self.tokens, "trained_tokens": self.trained_tokens,
                "rows_exact": self.rows_exact, "rows_expanded": self.rows_expanded,
                "rows_special_text": self.rows_special_text, "rows_all_trained": self.rows_all_trained,
                "tokens_straddling": self.tokens_straddling,
                "rows_filled": self.rows_filled, "rows_checked": self.rows_checked,
                "skeleton_mismatches": self.skeleton_mismatches,
                "max_buffered_rows": self.max_buffered_rows,
                **({"images": self.images, "image_tokens": self.image_tokens, "image_bytes": self.image_bytes}
                   if self.images else {}),
                **({"pixel_bytes": self.pixel_bytes} if self.pixel_bytes else {}),
                **({"image_files": self.image_files} if self.image_files else {}),
                "dropped": dict(sorted(self.dropped.items())),
                "lengths": {"values": values, "counts": [self.lengths[v] for v in values]}}
