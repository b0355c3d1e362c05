"""Vision families: how a model's processor turns one image into tokens, one small contract per family.

Chat code never branches on the model: it asks the run's `VisionFamily` for

    image_marker         the text the chat template emits for one image
    grid(header)         the image's grid, from its header and the processor's own resize rule (no pixels decoded)
    expand(grid)         the token ids the processor puts where the marker was
    margins              text the processor adds around the image's special tokens, which tokenizes together
                         with the neighbouring text ("" for Qwen, "\\n\\n" each side for Gemma 3): a caller that
                         tokenizes the rendered text whole substitutes `margins[0] + <the run> + margins[1]`
    vision_token_ids     the ids never trained
    config_fingerprint() what of the configuration changes the rows (for the cache key)
    pixels(images, grids) the processor's pixels at collate time, checked against the stored grids

Each family mirrors its processor in transformers 5 (`processing_<model>.py`, `image_processing_pil_<model>.py`),
read from the processor's configuration (`preprocessor_config.json`, merged with `processor_config.json`).
Qwen2-VL, Qwen2.5-VL and Qwen3-VL share one class: they differ in patch size and pixel limits only.
transformers is imported only when `pixels` runs, so tokenizing never loads it.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sft_tokenize.errors import BadInput, BadRow
from sft_tokenize.format.pixels import pixel_inputs
from sft_tokenize.sources.images import ImageHeader

# The EXIF and colour policy of transformers' load_image, which every family's pixels go through.
EXIF_POLICY = "exif_transpose"
COLOR_POLICY = "RGB"
_META_KEYS = ("image_processor_type", "processor_class", "auto_map", "_processor_class")


def processor_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """One flat dict: `preprocessor_config.json`'s keys, or `processor_config.json`'s with its nested
    `image_processor` section lifted to the top (its processor-level keys, such as `image_seq_length`, kept)."""
    flat = {k: v for k, v in config.items() if k not in ("image_processor", "video_processor", "feature_extractor")}
    nested = config.get("image_processor")
    if isinstance(nested, Mapping):
        flat = {**flat, **nested, **{k: flat[k] for k in ("processor_class",) if k in flat}}
    return flat


def _base_name(class_name: str | None) -> str:
    """An image processor class's name without its backend suffix: ...ImageProcessorFast/Pil -> ...ImageProcessor."""
    name = class_name or ""
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    return name


def _ids(tokenizer: Any, text: str) -> list[int]:
    """The text's ids, from the tokenizer's backend (a prepared tokenizer, prepared.py, has only that)."""
    return list(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def _one_token(tokenizer: Any, token: str, family: str) -> int:
    """The id of a token that must encode as itself, alone: an added (special) token of the tokenizer."""
    ids = _ids(tokenizer, token)
    if len(ids) != 1:
        raise BadInput(f"the tokenizer has no {token!r} token (it encodes as {len(ids)} tokens): a {family} "
                       "processor needs it; use the model's own tokenizer (or --processor's)")
    return int(ids[0])


class VisionFamily(ABC):
    """One processor family's image rule; instances are small, picklable, and hold no tokenizer."""

    name: str
    settings_json: str  # the image processor's configuration, as from_pretrained would read it
    image_marker: str
    margins: tuple[str, str] = ("", "")
    margin_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # the margins tokenized on their own
    vision_token_ids: frozenset[int]
    processor_classes: ClassVar[tuple[str, ...]] = ()  # the `processor_class` values it serves
    image_processor_classes: ClassVar[tuple[str, ...]] = ()  # and image processor classes, without backend suffix
    pil_class: ClassVar[str]  # the transformers class that makes pixels
    probe_grid: ClassVar[tuple[int, ...]] = (1, 2, 2)  # any grid: its run shows the run's first and last ids

    @classmethod
    @abstractmethod
    def from_config(cls, processor_config: Mapping[str, Any], tokenizer: Any) -> VisionFamily: ...

    @abstractmethod
    def grid(self, header: ImageHeader, index: int | None = None) -> tuple[int, ...]:
        """The image's grid as the processor computes it; a BadRow saying "image <index>" if it refuses it."""

    @abstractmethod
    def run(self, grid: Sequence[int]) -> list[int]:
        """The special-token ids one image becomes, between the margins."""

    @abstractmethod
    def config_fingerprint(self) -> dict[str, Any]: ...

    @abstractmethod
    def run_text(self, grid: Sequence[int]) -> str:
        """The text that replaces the marker before tokenizing (margins, then the run's tokens), as the processor
        writes it: it tokenizes to the margins' ids, wherever they merge with the text around, and `run`."""

    def expand(self, grid: Sequence[int]) -> list[int]:
        """The ids that replace the marker, margins tokenized on their own (exact when they are empty)."""
        return [*self.margin_ids[0], *self.run(grid), *self.margin_ids[1]]

    def pixel_rows(self, grid: Sequence[int]) -> int | None:
        """The rows of `pixel_values` one image of this grid makes (its patches), as SkyRL's reader stores them
        (`--extra-column pixel_values`); None for a family whose pixels are whole images, not patch rows."""
        return None

    def pixels(self, images: Sequence[Any], grids: Sequence[Sequence[int]],
               names: Sequence[str] | None = None) -> dict[str, Any]:
        """The processor's inputs for these images (numpy; encoded bytes or decoded), made as a trainer's collator
        makes them (`format.pixels.pixel_inputs`, which both use); each image's grid must equal the stored one, or
        a CacheError names the image and both grids."""
        record = {"family": self.name, "pil_class": self.pil_class, "settings": json.loads(self.settings_json)}
        return pixel_inputs(record, images, grids, names)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 index: int | None = None) -> tuple[int, int]:
    """Qwen2-VL's resize rule (image_processing_pil_qwen2_vl.smart_resize), line for line: both sides a multiple
    of `factor`, the area within [min_pixels, max_pixels], the aspect ratio kept as closely as it can be."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise BadRow("image_aspect", f"{'' if index is None else f'image {index}: '}a {width}x{height} image has "
                                     f"aspect ratio {ratio:.0f}, over the 200 this processor accepts")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _refuse_no_resize(settings: Mapping[str, Any], family: str) -> None:
    if settings.get("do_resize") is False:
        raise BadInput(f"processor config: do_resize is false; a {family} processor is supported with its resize "
                       "on only (the grid is computed from the resize rule)")


@dataclass(frozen=True)
class QwenVL(VisionFamily):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `<|vision_start|>` + N × `<|image_pad|>` + `<|vision_end|>`, where
    N = prod(grid_thw) / merge_size², grid_thw = (1, h / patch, w / patch) after smart_resize."""

    name: str
    settings_json: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_token: str
    vision_start: str
    vision_end: str
    vision_start_id: int
    image_id: int
    vision_end_id: int
    image_marker: str = ""
    vision_token_ids: frozenset[int] = frozenset()

    processor_classes: ClassVar[tuple[str, ...]] = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
    image_processor_classes: ClassVar[tuple[str, ...]] = ("Qwen2VLImageProcessor",)
    pil_class: ClassVar[str] = "Qwen2VLImageProcessorPil"
    # The class defaults of Qwen2VLImageProcessorPil, used where a configuration leaves them out.
    DEFAULTS: ClassVar[dict[str, int]] = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                                          "shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    NAMES: ClassVar[dict[str, str]] = {"Qwen2VLProcessor": "qwen2_vl", "Qwen2_5_VLProcessor": "qwen2_5_vl",
                                       "Qwen3VLProcessor": "qwen3_vl"}

    @classmethod
    def from_config(cls, processor_config: Mapping[str, Any], tokenizer: Any) -> QwenVL:
        settings = processor_settings(processor_config)
        _refuse_no_resize(settings, "Qwen-VL")
        # As Qwen2VLImageProcessorPil.__init__: size, or the class's, with min_pixels / max_pixels over its edges.
        size = settings.get("size")
        size = dict(size) if isinstance(size, Mapping) else size if size is not None else {
            "shortest_edge": cls.DEFAULTS["shortest_edge"], "longest_edge": cls.DEFAULTS["longest_edge"]}
        if not isinstance(size, dict):
            raise BadInput(f"processor config: size must be {{shortest_edge, longest_edge}}, not {size!r}")
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if settings.get(key) is not None:
                size[edge] = settings[key]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise BadInput(f"processor config: size must hold shortest_edge and longest_edge (or set min_pixels "
                           f"and max_pixels), not {size!r}")
        min_pixels, max_pixels = size["shortest_edge"], size["longest_edge"]
        ints = {key: settings[key] if settings.get(key) is not None else cls.DEFAULTS[key]
                for key in ("patch_size", "merge_size", "temporal_patch_size")}
        for key, value in (*ints.items(), ("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if not isinstance(value, int) or value < 1:
                raise BadInput(f"processor config: {key} must be a positive integer, not {value!r}")
        if min_pixels > max_pixels:
            raise BadInput(f"processor config: min_pixels {min_pixels} is over max_pixels {max_pixels}")
        # The processors take these from the tokenizer when it names them, as Qwen2VLProcessor.__init__ does.
        image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        start = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        end = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        ids = [_one_token(tokenizer, token, "Qwen-VL") for token in (start, image_token, end)]
        name = cls.NAMES.get(settings.get("processor_class", ""), "qwen2_vl")
        return cls(name=name, settings_json=json.dumps(settings, sort_keys=True), **ints, min_pixels=min_pixels,
                   max_pixels=max_pixels, image_token=image_token, vision_start=start, vision_end=end,
                   vision_start_id=ids[0], image_id=ids[1],
                   vision_end_id=ids[2], image_marker=start + image_token + end, vision_token_ids=frozenset(ids))

    def grid(self, header: ImageHeader, index: int | None = None) -> tuple[int, int, int]:
        height, width = smart_resize(header.height, header.width, self.patch_size * self.merge_size,
                                     self.min_pixels, self.max_pixels, index)
        return (1, height // self.patch_size, width // self.patch_size)

    def tokens(self, grid: Sequence[int]) -> int:
        return math.prod(grid) // self.merge_size ** 2

    def pixel_rows(self, grid: Sequence[int]) -> int:
        return math.prod(grid)

    def run(self, grid: Sequence[int]) -> list[int]:
        return [self.vision_start_id] + [self.image_id] * self.tokens(grid) + [self.vision_end_id]

    def run_text(self, grid: Sequence[int]) -> str:
        return self.vision_start + self.image_token * self.tokens(grid) + self.vision_end

    def config_fingerprint(self) -> dict[str, Any]:
        return {"family": self.name, "class": self.pil_class, "patch_size": self.patch_size,
                "merge_size": self.merge_size, "temporal_patch_size": self.temporal_patch_size,
                "min_pixels": self.min_pixels, "max_pixels": self.max_pixels,
                "image_token_ids": [self.vision_start_id, self.image_id, self.vision_end_id],
                "resize": "smart_resize", "exif": EXIF_POLICY, "color": COLOR_POLICY}


@dataclass(frozen=True)
class Gemma3(VisionFamily):
    """Gemma 3: every image is resized to one fixed size and becomes `image_seq_length` soft tokens; the boi
    token the template emits becomes `\\n\\n<start_of_image>` + soft tokens + `<end_of_image>\\n\\n`. The grid
    is (1, height, width) of the pixels the processor makes (one image, no pan-and-scan crops)."""

    name: str
    settings_json: str
    height: int
    width: int
    image_seq_length: int
    boi: str
    soft: str
    eoi: str
    boi_id: int
    soft_id: int
    eoi_id: int
    margin_ids: tuple[tuple[int, ...], tuple[int, ...]]
    image_marker: str = "<start_of_image>"
    margins: tuple[str, str] = ("\n\n", "\n\n")
    vision_token_ids: frozenset[int] = frozenset()

    processor_classes: ClassVar[tuple[str, ...]] = ("Gemma3Processor",)
    image_processor_classes: ClassVar[tuple[str, ...]] = ("Gemma3ImageProcessor",)
    pil_class: ClassVar[str] = "Gemma3ImageProcessorPil"
    DEFAULT_SIZE: ClassVar[int] = 224  # Gemma3ImageProcessorPil's class default; published configs say 896
    DEFAULT_SEQ_LENGTH: ClassVar[int] = 256  # Gemma3Processor's image_seq_length default

    @classmethod
    def from_config(cls, processor_config: Mapping[str, Any], tokenizer: Any) -> Gemma3:
        settings = processor_settings(processor_config)
        _refuse_no_resize(settings, "Gemma 3")
        if settings.get("do_pan_and_scan"):
            raise BadInput("processor config: do_pan_and_scan is on; Gemma 3 is supported with pan-and-scan off "
                           "(its default): set do_pan_and_scan to false or null in preprocessor_config.json")
        size = settings.get("size") or {"height": cls.DEFAULT_SIZE, "width": cls.DEFAULT_SIZE}
        if not isinstance(size, Mapping) or not all(isinstance(size.get(k), int) for k in ("height", "width")):
            raise BadInput(f"processor config: a Gemma 3 size must be {{height, width}}, not {size!r}")
        seq = settings.get("image_seq_length") or settings.get("mm_tokens_per_image") or cls.DEFAULT_SEQ_LENGTH
        if not isinstance(seq, int) or seq < 1:
            raise BadInput(f"processor config: image_seq_length must be a positive integer, not {seq!r}")
        boi = getattr(tokenizer, "boi_token", None) or "<start_of_image>"
        eoi = getattr(tokenizer, "eoi_token", None) or "<end_of_image>"
        soft = getattr(tokenizer, "image_token", None) or "<image_soft_token>"
        ids = [_one_token(tokenizer, token, "Gemma 3") for token in (boi, soft, eoi)]
        margins = tuple(tuple(_ids(tokenizer, text)) for text in cls.margins)
        return cls(name="gemma3", settings_json=json.dumps(settings, sort_keys=True), height=size["height"],
                   width=size["width"], image_seq_length=seq, boi=boi, soft=soft, eoi=eoi, boi_id=ids[0],
                   soft_id=ids[1], eoi_id=ids[2],
                   margin_ids=margins, image_marker=boi, vision_token_ids=frozenset(ids))

    def grid(self, header: ImageHeader, index: int | None = None) -> tuple[int, int, int]:
        return (1, self.height, self.width)

    def run(self, grid: Sequence[int]) -> list[int]:
        return [self.boi_id] + [self.soft_id] * self.image_seq_length + [self.eoi_id]

    def run_text(self, grid: Sequence[int]) -> str:
        return self.margins[0] + self.boi + self.soft * self.image_seq_length + self.eoi + self.margins[1]

    def config_fingerprint(self) -> dict[str, Any]:
        return {"family": self.name, "class": self.pil_class, "size": [self.height, self.width],
                "image_seq_length": self.image_seq_length, "image_token_ids": [self.boi_id, self.soft_id, self.eoi_id],
                "margin_ids": [list(m) for m in self.margin_ids], "resize": "fixed", "pan_and_scan": False,
                "exif": EXIF_POLICY, "color": COLOR_POLICY}


FAMILIES: tuple[type[VisionFamily], ...] = (QwenVL, Gemma3)


def family_for(processor_config: Mapping[str, Any]) -> type[VisionFamily]:
    """The family serving a processor: by its `processor_class`, else by its image processor's class."""
    settings = processor_settings(processor_config)
    processor_class = settings.get("processor_class")
    image_class = _base_name(settings.get("image_processor_type"))
    for family in FAMILIES:
        if processor_class in family.processor_classes:
            return family
    for family in FAMILIES:
        if not processor_class and image_class in family.image_processor_classes:
            return family
    named = " / ".join(repr(v) for v in (processor_class, settings.get("image_processor_type")) if v) or "none named"
    supported = ", ".join(name for family in FAMILIES for name in family.processor_classes)
    raise BadInput(f"processor {named} is not supported for image rows: supported are {supported}")


def load_family(processor_config: Mapping[str, Any], tokenizer: Any) -> VisionFamily:
    """The run's vision family, read from its processor's configuration and checked against its tokenizer."""
    return family_for(processor_config).from_config(processor_config, tokenizer)
