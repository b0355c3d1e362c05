"""Inputs of the image-row benchmark (images.py), built offline and reproducibly under benchmarks/data/.

    processor_dir()  a Qwen2.5-VL processor directory: Qwen's real 151k tokenizer (build_inputs.qwen_tokenizer(),
                     which already holds <|vision_start|>, <|image_pad|>, <|vision_end|>) with the Qwen2.5-VL chat
                     template, and preprocessor_config.json with Qwen2.5-VL's published defaults
    load_processor() that directory as a transformers Qwen2_5_VLProcessor (PIL image backend, no video processor)
    build_corpus()   a pool of seeded synthetic JPEGs and units of JSONL image-chat rows naming them

The Qwen2.5-VL processor also holds a video processor, which needs torchvision (not loadable here): it is built
with none (the corpus has no video); only transformers' check that the argument is a video processor class is
skipped while it is constructed, every line of the processor's own code runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from build_inputs import DATA, CorpusSpec, _write_atomically, generator, qwen_tokenizer

# Qwen2-VL's and Qwen2.5-VL's published chat template (chat_template.json of Qwen/Qwen2.5-VL-7B-Instruct).
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")

# preprocessor_config.json of Qwen/Qwen2.5-VL-7B-Instruct: the real limits (4 to 16,384 merged 28 x 28 patches).
QWEN_VL_CONFIG = {"processor_class": "Qwen2_5_VLProcessor", "image_processor_type": "Qwen2VLImageProcessor",
                  "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2,
                  "temporal_patch_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711]}
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

# Image shapes (width, height) and their weights: camera and screen sizes, a fifth of them portrait.
IMAGE_SHAPES = {(640, 480): 25, (1024, 768): 20, (1280, 720): 20, (1920, 1080): 15, (720, 1280): 10, (768, 1024): 10}


@dataclass(frozen=True)
class ImageCorpusSpec:
    """Everything that decides the bytes of the image-chat corpus."""

    rows: int = 400  # rows per unit (one JSONL file each)
    pool: int = 300  # distinct images, reused across rows and units
    exchanges: tuple[int, int] = (2, 6)  # user/assistant exchanges per row
    sentences: tuple[int, int] = (1, 4)  # sentences per message
    two_images: float = 0.5  # share of rows with two images (the others have one)
    quality: int = 85  # JPEG quality
    image_seed: int = 11
    corpus_seed: int = 2000
    version: int = 1  # bump when the bytes generated for the same parameters change

    @property
    def key(self) -> str:
        values = {k: v for k, v in asdict(self).items() if k != "rows"}
        return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def directory(self) -> Path:
        return DATA / f"images-{self.key}"

    def unit_path(self, unit: int) -> Path:
        return self.directory / f"chat-rows{self.rows}-{unit:05d}.jsonl"


# -- the processor -----------------------------------------------------------------------------------------------


def processor_dir() -> Path:
    """A processor directory for `--processor`: the Qwen tokenizer's files, with the Qwen-VL chat template, and
    Qwen2.5-VL's preprocessor_config.json (built once, reused)."""
    tokenizer_dir = qwen_tokenizer(check=False)
    digest = hashlib.sha256((tokenizer_dir.name + QWEN_VL_TEMPLATE + json.dumps(QWEN_VL_CONFIG)).encode())
    out = DATA / f"processor-qwen2.5-vl-{digest.hexdigest()[:12]}"
    if (out / "preprocessor_config.json").exists():
        return out

    def write(tmp: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        missing = [t for t in VISION_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
        if missing:
            raise RuntimeError(f"{tokenizer_dir}: the tokenizer lacks the vision tokens {missing}")
        tokenizer.chat_template = QWEN_VL_TEMPLATE
        tokenizer.save_pretrained(str(tmp))
        (tmp / "preprocessor_config.json").write_text(json.dumps(QWEN_VL_CONFIG, indent=2) + "\n")

    shutil.rmtree(out.with_name(f".{out.name}.tmp"), ignore_errors=True)
    _write_atomically(out, write)
    return out


@contextlib.contextmanager
def _without_a_video_processor():
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def allowing_none(self, name, argument):
        if name == "video_processor" and argument is None:
            return None
        return check(self, name, argument)

    ProcessorMixin.check_argument_for_proper_class = allowing_none
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def load_processor(directory: Path):
    """The directory as a Qwen2_5_VLProcessor: its tokenizer and a Qwen2VLImageProcessorPil from its config."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    config = json.loads((directory / "preprocessor_config.json").read_text())
    with _without_a_video_processor():
        return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_dict(config), tokenizer=tokenizer,
                                   video_processor=None, chat_template=tokenizer.chat_template)


# -- the corpus --------------------------------------------------------------------------------------------------


def draw_image(rng: random.Random, width: int, height: int, quality: int) -> bytes:
    """A photo-like JPEG: a two-colour gradient, a few blurred shapes, and noise of a random strength."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    generator_ = np.random.default_rng(rng.randrange(2**32))
    a, b = (np.array([rng.randrange(256) for _ in range(3)], dtype=np.float32) for _ in range(2))
    angle = rng.random() * np.pi
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    t = (np.cos(angle) * xs / width + np.sin(angle) * ys / height)
    t = (t - t.min()) / max(1e-6, float(t.max() - t.min()))
    pixels = a + (b - a) * t[..., None]
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(6, 30)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randint(20, width // 3), y0 + rng.randint(20, height // 3)
        colour = tuple(rng.randrange(256) for _ in range(3))
        shape = rng.choice((draw.ellipse, draw.rectangle, draw.line))
        shape([x0, y0, x1, y1], fill=colour, **({"width": rng.randint(2, 12)} if shape == draw.line else {}))
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 2.5)))
    noisy = np.asarray(image, dtype=np.float32)
    noisy += generator_.normal(0, rng.uniform(1.5, 6), size=(height, width, 1))  # luminance grain
    out = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def build_pool(spec: ImageCorpusSpec) -> list[str]:
    """The image pool: `spec.pool` JPEGs under images/, their paths relative to the corpus directory."""
    shapes, weights = list(IMAGE_SHAPES), list(IMAGE_SHAPES.values())
    names = [f"images/img-{k:04d}.jpg" for k in range(spec.pool)]
    missing = [k for k, name in enumerate(names) if not (spec.directory / name).exists()]
    if missing:
        started = time.monotonic()
        (spec.directory / "images").mkdir(parents=True, exist_ok=True)
        for k in missing:
            rng = random.Random(spec.image_seed * 1_000_003 + k)
            width, height = rng.choices(shapes, weights)[0]
            data = draw_image(rng, width, height, spec.quality)
            _write_atomically(spec.directory / names[k], lambda tmp, data=data: tmp.write_bytes(data))
        print(f"drew {len(missing)} images in {time.monotonic() - started:.1f} s under {spec.directory}", flush=True)
    return names


def chat_row(rng: random.Random, text, spec: ImageCorpusSpec, images: list[str]) -> dict:
    """One row: an optional system message, then 2-6 exchanges; the images go into user turns (the first one
    into the first turn, a second into a random user turn), each before that turn's text."""
    exchanges = rng.randint(*spec.exchanges)
    chosen = [rng.choice(images) for _ in range(2 if rng.random() < spec.two_images else 1)]
    where = [0] + [rng.randrange(exchanges) for _ in chosen[1:]]
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": text.paragraph(rng, 1)})
    for turn in range(exchanges):
        parts = [{"type": "image", "image": name} for name, at in zip(chosen, where, strict=True) if at == turn]
        parts.append({"type": "text", "text": text.paragraph(rng, rng.randint(*spec.sentences))})
        messages.append({"role": "user", "content": parts})
        messages.append({"role": "assistant", "content": text.paragraph(rng, rng.randint(*spec.sentences))})
    return {"messages": messages}


def build_corpus(spec: ImageCorpusSpec, units: int) -> list[Path]:
    """Units 0..units-1 of the corpus (one JSONL file each, seed corpus_seed + unit), and the image pool."""
    images = build_pool(spec)
    paths = [spec.unit_path(unit) for unit in range(units)]
    missing = [unit for unit, path in enumerate(paths) if not path.exists()]
    if missing:
        text = generator(CorpusSpec.of("short"))  # the examples' generator over the benchmark lexicon
        for unit in missing:
            rng = random.Random(spec.corpus_seed + unit)
            rows = [chat_row(rng, text, spec, images) for _ in range(spec.rows)]
            _write_atomically(paths[unit], lambda tmp, rows=rows: text.write_jsonl(tmp, rows))
    return paths
