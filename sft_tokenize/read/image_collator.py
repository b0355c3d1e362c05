"""Image rows at training time: the cache keeps each image's encoded file and its grid; the pixels are made here,
a batch at a time, by the processor's own PIL image processor, so that the cache never holds float pixels.

    collator = ImageCollator(cache_path, pad_token_id=tokenizer.pad_token_id)
    DataLoader(open_cache(cache_path), batch_size=8, collate_fn=collator)
    SFTTrainer(..., data_collator=collator, args=SFTConfig(dataset_kwargs={"skip_prepare_dataset": True},
                                                           remove_unused_columns=False))

The manifest's `images` record says how: the family, the PIL image processor class and its settings, and
`image_token_ids`, the family's vision token ids in run order (the run's opening id, the id repeated once per
image feature, which the model replaces by the image's features, and the closing id). Every image's grid is
made again and must equal the stored one: a processor configured otherwise would silently misalign the rows'
vision tokens with the features, so it is refused with a CacheError naming the image.

What a batch holds beside input_ids, attention_mask and labels, per family, as its processor returns it
(transformers 5): Qwen2/2.5/3-VL `pixel_values`, `image_grid_thw` and `mm_token_type_ids` (1 on the image
feature tokens: `get_rope_index` builds the 3D positions from it); Gemma 3 `pixel_values` and `token_type_ids`
(1 on the soft tokens: the bidirectional attention inside an image). A text-only batch has no pixel keys.

In reference mode the images are read from where the cache says they are, under the same image access policy
the build applied (`files.image_access_refusal`): by default the one the manifest records with the roots the
build resolved paths against, so a cache whose rows name other files or URLs is refused, naming the image.

transformers, torch, PIL and fsspec are imported inside the functions: importing the read side loads none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sft_tokenize.errors import CacheError, one_line
from sft_tokenize.files import IMAGE_ACCESS, REMOTE_TIMEOUT, image_access_refusal, network_failure, with_timeouts
from sft_tokenize.format.manifest import read_manifest
from sft_tokenize.format.pixels import pixel_inputs
from sft_tokenize.read.layouts import IGNORE_INDEX

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
GEMMA_FAMILIES = ("gemma3",)
# The processors' defaults, where a configuration leaves a value out.
QWEN_MERGE_SIZE = 2
GEMMA_IMAGE_SEQ_LENGTH = 256


def image_bytes(entry: Mapping[str, Any], where: str, storage_options: Mapping[str, Any] | None = None,
                access: tuple[str, Sequence[str]] | None = None, timeout: float | None = REMOTE_TIMEOUT) -> bytes:
    """One `images` cell's encoded file: its bytes (embed mode), or read from its path (reference mode) and
    checked against the size and xxh3-128 hash the cache recorded, since the file may have changed since.
    `access`: (policy, roots) a path must pass (files.image_access_refusal) before it is opened; `timeout`:
    how long a remote one's connection and each read may wait."""
    import xxhash

    data = entry.get("bytes")
    path = entry.get("path")
    if data is None:
        if not path:
            raise CacheError(f"{where}: the cache holds neither the image's bytes nor its path: the cache is corrupt")
        if access is not None and (refused := image_access_refusal(path, access[1], access[0])):
            why, allowed_by = refused
            raise CacheError(f"{where}: {why}; the collator reads it only with image_access={allowed_by}")
        import fsspec

        try:
            with fsspec.open(path, "rb", **with_timeouts(path, dict(storage_options or {}), timeout)) as file:
                data = file.read()
        except Exception as error:
            if (failure := network_failure(error)) == "no answer" and timeout:
                failure += f" within {timeout:g} s (image_timeout)"
            raise CacheError(f"{where}: {path} cannot be read: {failure or one_line(error, 200)}") from None
    data = bytes(data)
    what = path or "the embedded image"
    size = entry.get("size")
    if size is not None and len(data) != int(size):
        raise CacheError(f"{where}: {what} is {len(data):,} bytes, the cache recorded {int(size):,}: the image "
                         "changed since the cache was built; rebuild the cache or restore the image")
    digest = entry.get("hash")
    if digest and xxhash.xxh3_128(data).hexdigest() != digest:
        raise CacheError(f"{where}: {what} does not hash to {digest}, as the cache recorded: the image changed "
                         "since the cache was built; rebuild the cache or restore the image")
    return data


def images_record(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The `images` record of a cache's manifest (a cache path), or the record itself, checked for what the
    collator reads."""
    if isinstance(source, Mapping):
        record, where = dict(source), "the images record"
    else:
        record, where = read_manifest(source).get("images"), str(source)
        if not isinstance(record, dict):
            raise CacheError(f"{where}: the cache has no image rows (its manifest holds no images record: it was "
                             "built without --processor)")
    missing = [key for key in ("family", "pil_class", "settings", "image_token_ids") if key not in record]
    if missing:
        raise CacheError(f"{where}: the images record lacks {', '.join(missing)}: the cache is corrupt")
    if record["family"] not in QWEN_FAMILIES + GEMMA_FAMILIES:
        raise CacheError(f"{where}: image family {record['family']!r} is not one this version reads "
                         f"({', '.join(QWEN_FAMILIES + GEMMA_FAMILIES)})")
    if len(record["image_token_ids"]) != 3:
        raise CacheError(f"{where}: image_token_ids must be the run's opening, feature and closing ids, not "
                         f"{record['image_token_ids']!r}: the cache is corrupt")
    return record


class ImageCollator:
    """Rows of a cache with image columns -> a padded batch of torch tensors with the pixels the model needs.

    `source` is a cache's path (its manifest's images record is read) or that record itself. Picklable: it
    holds the record and a few ints, so DataLoader workers each build their own image processor.

    `image_access` and `image_roots`: the policy (files.IMAGE_ACCESS) a referenced image's path must pass, and the
    directories (or URLs) it must lie under; by default the record's (`root` and none for a cache that records
    none: built before the policy, its referenced images need image_roots or a wider image_access).
    `image_timeout`: how long a remote image's connection and each of its reads may wait."""

    def __init__(self, source: str | Path | Mapping[str, Any], pad_token_id: int, *,
                 storage_options: Mapping[str, Any] | None = None, image_access: str | None = None,
                 image_roots: Sequence[str] | None = None, image_timeout: float = REMOTE_TIMEOUT) -> None:
        self.record = images_record(source)
        self.pad_token_id = int(pad_token_id)
        self.storage_options = dict(storage_options or {})
        self.image_timeout = image_timeout
        access = image_access or self.record.get("access", "root")
        if access not in IMAGE_ACCESS:
            raise ValueError(f"image_access must be one of {', '.join(IMAGE_ACCESS)}, not {access!r}")
        self.access = (access, [str(root) for root in (image_roots if image_roots is not None
                                                         else self.record.get("roots", []))])
        self.qwen = self.record["family"] in QWEN_FAMILIES
        self.feature_id = int(self.record["image_token_ids"][1])
        settings = self.record["settings"]
        self.merge_size = int(settings.get("merge_size") or QWEN_MERGE_SIZE)
        self.image_seq_length = int(settings.get("image_seq_length") or settings.get("mm_tokens_per_image")
                                    or GEMMA_IMAGE_SEQ_LENGTH)

    def _features(self, grid: Sequence[int]) -> int:
        """How many feature tokens the model replaces by this image's features."""
        return int(np.prod(grid)) // self.merge_size ** 2 if self.qwen else self.image_seq_length

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        import torch

        ids = [np.asarray(row["input_ids"], dtype=np.int64) for row in rows]
        labels = [self._labels(row, row_ids, k) for k, (row, row_ids) in enumerate(zip(rows, ids, strict=True))]
        width = max(len(row_ids) for row_ids in ids)
        batch_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        batch_labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        attention = np.zeros((len(rows), width), dtype=np.int64)
        for k, (row_ids, row_labels) in enumerate(zip(ids, labels, strict=True)):
            batch_ids[k, :len(row_ids)] = row_ids
            batch_labels[k, :len(row_ids)] = row_labels
            attention[k, :len(row_ids)] = 1
        types = ((batch_ids == self.feature_id) & (attention == 1)).astype(np.int64)

        encoded, grids, names = [], [], []
        for k, (row, row_ids) in enumerate(zip(rows, ids, strict=True)):
            cells = list(row.get("images") or [])
            row_grids = [tuple(int(v) for v in grid) for grid in row.get("image_grid_thw") or []]
            if len(cells) != len(row_grids):
                raise CacheError(f"batch row {k}: {len(cells)} images but {len(row_grids)} grids: the cache is "
                                 "corrupt")
            features = int((row_ids == self.feature_id).sum())
            if features != sum(self._features(grid) for grid in row_grids):
                raise CacheError(f"batch row {k}: {features} image feature tokens for images whose grids make "
                                 f"{sum(self._features(grid) for grid in row_grids)}: the cache is corrupt")
            for j, cell in enumerate(cells):
                names.append(f"batch row {k} image {j + 1}" + (f" ({cell['path']})" if cell.get("path") else ""))
                encoded.append(image_bytes(cell, names[-1], self.storage_options, self.access, self.image_timeout))
            grids += row_grids

        batch = {"input_ids": torch.from_numpy(batch_ids), "attention_mask": torch.from_numpy(attention),
                 "labels": torch.from_numpy(batch_labels),
                 ("mm_token_type_ids" if self.qwen else "token_type_ids"): torch.from_numpy(types)}
        if encoded:
            made = pixel_inputs(self.record, encoded, grids, names)
            batch["pixel_values"] = torch.from_numpy(np.ascontiguousarray(made["pixel_values"]))
            if self.qwen:
                batch["image_grid_thw"] = torch.tensor(grids, dtype=torch.int64)
        return batch

    @staticmethod
    def _labels(row: Mapping[str, Any], ids: np.ndarray, k: int) -> np.ndarray:
        """The row's labels as stored (layout trl), else its ids with -100 where loss_mask is 0."""
        if row.get("labels") is not None:
            labels = np.asarray(row["labels"], dtype=np.int64)
        elif row.get("loss_mask") is not None:
            labels = np.where(np.asarray(row["loss_mask"]) == 1, ids, IGNORE_INDEX)
        else:
            raise CacheError(f"batch row {k}: neither labels nor loss_mask: the cache's layout has no loss mask")
        if len(labels) != len(ids):
            raise CacheError(f"batch row {k}: {len(labels)} labels for {len(ids)} input_ids: the cache is corrupt")
        return labels
