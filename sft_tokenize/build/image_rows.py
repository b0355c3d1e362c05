"""An image row's images, read while its slice is tokenized: loaded, their grids taken from their headers, and
stored beside the row's tokens (FORMAT.md, "Image rows").

The grid of each image comes from its header and the processor's resize rule (encoding/vision.py), so no pixel
is decoded here; the encoder needs only the grids. The images are stored as their original encoded bytes
(`--images embed`), or as their location, content hash and size (`--images reference`; an image that has no
location, inline bytes or a data URI, is embedded). A row made of a prefix of its conversation
(--reasoning-turns expand) stores the images its tokens show.

With `--extra-column pixel_values` (Qwen-VL) the images are also decoded, here, and made into the processor's
float32 `pixel_values`, one patch a row, as SkyRL's reader wants them in the cache. They are made while the
slice is read, so that an image whose pixels do not decode is a bad row naming its line; the slice counts them
among the bytes it holds, so a batch in flight holds a writer batch's worth of pixels, not a slice's.

The image files a slice reads are found only while it is read, so they cannot be hashed into its key up front
as its input file is: the shard's sidecar lists them with their identities instead, and a shard (or a
published cache) one of whose image files changed since is stale.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sft_tokenize.build.stopping import interruptible
from sft_tokenize.encoding.chat_encoder import EncodedBatch
from sft_tokenize.encoding.image_runs import ImageRuns
from sft_tokenize.errors import BadRow, one_line
from sft_tokenize.format.pixels import decoded_image
from sft_tokenize.sources.conversations import Conversation
from sft_tokenize.sources.images import LoadedImage, load_images

Stored = list[dict]  # one row's images as the writer stores them


def pixel_bytes(row: Stored) -> int:
    """The bytes of one row's stored images' pixel_values (none without `--extra-column pixel_values`)."""
    return sum(image["pixels"].nbytes for image in row if "pixels" in image)


def held_bytes(row: Stored) -> int:
    """What one row's stored images hold in memory until written: their encoded bytes (embed) and pixels."""
    return sum(len(image["bytes"] or b"") for image in row) + pixel_bytes(row)


class ImageRows:
    """A job's image rows: their images loaded (`load`), then matched to the rows the encoder kept (`rows`)."""

    def __init__(self, runs: ImageRuns, mode: str, max_bytes: int, storage_options: dict | None,
                 pixels: bool = False, timeout: float | None = None) -> None:
        self.runs, self.mode, self.max_bytes, self.storage_options = runs, mode, max_bytes, storage_options
        self.timeout = timeout  # seconds a remote image's connection and each of its reads may wait
        self.pixels = pixels  # each stored image also holds its pixel_values rows, under "pixels"
        self.files: dict[str, tuple] = {}  # each image file read, by URL: its identity when it was read

    def load(self, example: Conversation | str) -> tuple[Conversation | str, Stored]:
        """The example with its images' grids (ready to encode), and its images as stored; a BadRow saying
        "image N" for an image that is missing, corrupt, over the byte limit or of an unsupported kind."""
        if isinstance(example, str) or not example.image_refs:
            return example, []
        def load() -> list[LoadedImage]:
            return load_images(example.image_refs, self.max_bytes, storage_options=self.storage_options,
                               timeout=self.timeout)

        # A remote read waits on the network: a stop (Ctrl-C, SIGTERM) must not wait for it.
        remote = any(ref.url is not None and "://" in ref.url and not ref.url.startswith("file://")
                     for ref in example.image_refs)
        loaded = interruptible(load) if remote else load()
        grids = tuple(self.runs.vision.grid(image.header, k) for k, image in enumerate(loaded, start=1))
        stored = []
        for image, grid in zip(loaded, grids, strict=True):
            if image.identity:
                self.files[image.ref.url] = image.identity
            url = image.ref.url if image.ref.url and not image.ref.url.startswith("data:") else None
            stored.append({"bytes": None if self.mode == "reference" and url else image.data,
                           "path": url or image.ref.name, "hash": image.digest, "size": len(image.data),
                           "image_grid_thw": list(grid), "image_sizes": [image.header.height, image.header.width]})
        if self.pixels:
            self._add_pixels([image.data for image in loaded], grids, stored)
        return replace(example, image_grids=grids, image_refs=()), stored

    def _add_pixels(self, data: list[bytes], grids: tuple[tuple[int, ...], ...], stored: Stored) -> None:
        pictures = []
        for k, encoded in enumerate(data, start=1):
            try:
                pictures.append(decoded_image(encoded))
            except Exception as error:  # a header that reads well over pixels that do not (a truncated file)
                raise BadRow("image_corrupt", f"image {k}: its pixels cannot be decoded: {one_line(error, 200)}") \
                    from None
        vision = self.runs.vision
        values = vision.pixels(pictures, grids)["pixel_values"].astype(np.float32, copy=False)
        ends = np.cumsum([vision.pixel_rows(grid) for grid in grids])
        for image, rows in zip(stored, np.split(values, ends[:-1]), strict=True):
            image["pixels"] = rows

    def rows(self, batch: EncodedBatch, stored: list[Stored]) -> list[Stored]:
        """Each kept row's images, in row order: its example's first ones, as many as its tokens show."""
        first = self.runs.run_bounds[0]
        out: list[Stored] = [[] for _ in range(batch.rows)]
        for outcome, origin in zip(batch.outcomes, batch.origins, strict=True):
            if isinstance(outcome, int) and stored[origin]:
                ids = batch.input_ids[batch.offsets[outcome]:batch.offsets[outcome + 1]]
                out[outcome] = stored[origin][:int(np.count_nonzero(ids == first))]
        return out

    def file_list(self) -> list[list]:
        """The image files read, `[url, *identity]` sorted by URL: the shard's sidecar keeps them, so that a
        file changed since makes the shard stale (FORMAT.md, "Image rows")."""
        return [[url, *self.files[url]] for url in sorted(self.files)]

    def tokens(self, batch: EncodedBatch) -> int:
        """The batch's vision tokens."""
        return int(np.count_nonzero(self.runs.vision_mask(batch.input_ids)))
