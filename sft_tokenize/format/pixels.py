"""An image's pixels as a cache's `images` record says to make them: the processor's own PIL image processor,
its grids checked against the stored ones. The build makes them for `--extra-column pixel_values`, a trainer's
collator at training time: both the same way."""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sft_tokenize.errors import CacheError, one_line

# Each PIL image processor class: how its output gives the grids the cache stores (as VisionFamily.grid returns).
PIL_CLASSES = ("Qwen2VLImageProcessorPil", "Gemma3ImageProcessorPil")


@functools.lru_cache(maxsize=8)
def _image_processor(class_name: str, settings_json: str) -> Any:
    """The HF image processor (PIL backend), built once per process for each configuration."""
    import transformers

    return getattr(transformers, class_name).from_dict(json.loads(settings_json))


def decoded_image(data: bytes) -> Any:
    """The image as transformers' load_image makes it from a file: EXIF orientation applied, converted to RGB."""
    from PIL import Image
    from transformers.image_utils import load_image

    return load_image(Image.open(io.BytesIO(data)))


def made_grids(pil_class: str, output: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """The grids an image processor's output holds, one per image, in the form the cache stores them."""
    if pil_class == "Qwen2VLImageProcessorPil":
        return [tuple(int(v) for v in row) for row in output["image_grid_thw"]]
    if pil_class == "Gemma3ImageProcessorPil":
        crops = [int(n) for n in output["num_crops"]]
        return [(1 + n, *(int(v) for v in pixels.shape[-2:]))
                for n, pixels in zip(crops, output["pixel_values"], strict=True)]
    raise CacheError(f"image processor {pil_class!r} is not one this version reads (it reads "
                     f"{', '.join(PIL_CLASSES)}): the cache was built by another version of sft-tokenize")


def pixel_inputs(record: Mapping[str, Any], images: Sequence[Any], grids: Sequence[Sequence[int]],
                 names: Sequence[str] | None = None) -> dict[str, Any]:
    """The image processor's output (numpy) for these images (encoded bytes, or as `decoded_image` made them),
    as the manifest's `images` record (`pil_class`, `settings`) configures it; each image's grid must equal the
    stored one, or a CacheError names the image and both grids."""
    def where(k: int) -> str:
        return names[k] if names else f"image {k + 1}"

    pictures = []
    for k, data in enumerate(images):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            pictures.append(data)
            continue
        try:
            pictures.append(decoded_image(data))
        except Exception as error:  # a header that read well over pixels that do not (a truncated file)
            raise CacheError(f"{where(k)}: the image cannot be decoded: {one_line(error, 200)}") from None
    pil_class = record["pil_class"]
    processor = _image_processor(pil_class, json.dumps(record["settings"], sort_keys=True))
    output = processor(images=pictures, return_tensors="np")
    for k, (made, stored) in enumerate(zip(made_grids(pil_class, output), grids, strict=True)):
        if tuple(made) != tuple(int(v) for v in stored):
            raise CacheError(f"{where(k)}: the processor makes grid {tuple(made)} but the cache holds "
                             f"{tuple(int(v) for v in stored)}: the cache was built with another processor "
                             "configuration; rebuild it with this one")
    return dict(output)
