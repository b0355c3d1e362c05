"""Vision-language tokenizers and processors built offline for the image-row tests: the example BPE with a
family's vision tokens and chat template, and the family's real HF processor (PIL image backend) over it.

Qwen2.5-VL's processor also holds a video processor, which needs torchvision; the tests build it with none
(they pass no video): only transformers' constructor check that the argument is a video processor class is
skipped, every line of the processor's own code runs.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from support.families import build_modern_tokenizer
from support.paths import EXAMPLE_TOKENIZER

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

# Small limits keep the runs short: 4 to 64 merged patches of 28 x 28 pixels.
QWEN_CONFIG = {"processor_class": "Qwen2_5_VLProcessor", "image_processor_type": "Qwen2VLImageProcessor",
               "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64, "patch_size": 14, "merge_size": 2,
               "temporal_patch_size": 2}
GEMMA_CONFIG = {"processor_class": "Gemma3Processor", "image_processor_type": "Gemma3ImageProcessor",
                "size": {"height": 112, "width": 112}, "image_seq_length": 16, "do_pan_and_scan": None,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2}
GEMMA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


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


def _save_config(out_dir: Path, config: dict) -> None:
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def qwen_vl(out_dir: Path):
    """(tokenizer, Qwen2_5_VLProcessor, processor config) for Qwen2.5-VL; `out_dir` becomes a processor
    directory (`--processor`): the tokenizer's files and preprocessor_config.json."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]})
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    _save_config(out_dir, QWEN_CONFIG)
    with _without_a_video_processor():
        processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_dict(QWEN_CONFIG),
                                        tokenizer=tokenizer, video_processor=None, chat_template=QWEN_VL_TEMPLATE)
    return tokenizer, processor, QWEN_CONFIG


def gemma3(out_dir: Path):
    """(tokenizer, Gemma3Processor, processor config) for Gemma 3, with its published chat template; `out_dir`
    becomes a processor directory, as for qwen_vl."""
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(build_modern_tokenizer("gemma3", out_dir)),
                                              extra_special_tokens=GEMMA_TOKENS)
    tokenizer.save_pretrained(str(out_dir))
    _save_config(out_dir, GEMMA_CONFIG)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_dict(GEMMA_CONFIG), tokenizer=tokenizer,
                                image_seq_length=GEMMA_CONFIG["image_seq_length"],
                                chat_template=tokenizer.chat_template)
    return tokenizer, processor, GEMMA_CONFIG
