"""Image parts and vision families, checked against the real HF image processors (PIL backend) on images made
here with Pillow: every header grid equals the processor's `image_grid_thw` (or Gemma 3's fixed pixels), the
collate-time pixels equal the processor's, the input shapes normalize alike, and each bad input says "image N"."""

from __future__ import annotations

import io
import pickle
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image
from support.images import encoded, sample_images
from support.paths import EXAMPLE_TOKENIZER

from sft_tokenize.encoding.vision import Gemma3, QwenVL, family_for, load_family, processor_settings
from sft_tokenize.errors import BadInput, BadRow, CacheError
from sft_tokenize.sources.images import ImageRef, content_hash, load_images, normalize_images, read_header

QWEN_CONFIGS = {
    # Qwen2VLImageProcessorPil's class defaults: max 28*28*1280 pixels
    "qwen2-default": {"processor_class": "Qwen2VLProcessor", "image_processor_type": "Qwen2VLImageProcessor"},
    # small limits, as a user sets them to bound the image tokens
    "qwen2.5-small": {"processor_class": "Qwen2_5_VLProcessor", "image_processor_type": "Qwen2VLImageProcessor",
                      "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64, "patch_size": 14, "merge_size": 2},
    # Qwen3-VL's published preprocessor_config.json: patch 16, size edges instead of min/max pixels
    "qwen3": {"processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
              "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2,
              "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}
GEMMA_CONFIG = {"processor_class": "Gemma3Processor", "image_processor_type": "Gemma3ImageProcessor",
                "size": {"height": 896, "width": 896}, "image_seq_length": 256, "do_pan_and_scan": None,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2}
@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    return sample_images()


@pytest.fixture(scope="module")
def loaded(images) -> dict[str, Image.Image]:
    """Each image as transformers loads it: opened, EXIF orientation applied, RGB."""
    from transformers.image_utils import load_image

    return {name: load_image(Image.open(io.BytesIO(data))) for name, data in images.items()}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER), extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    return tok


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """Without Gemma's named tokens, so Qwen reads the default `<|image_pad|>` as Qwen2VLProcessor does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    return tok


@pytest.fixture(scope="module")
def qwen_processors() -> dict:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return {name: Qwen2VLImageProcessorPil.from_dict(config) for name, config in QWEN_CONFIGS.items()}


# -- grids ---------------------------------------------------------------------------------------------------

def test_the_header_is_the_displayed_size_transformers_loads(images, loaded):
    for name, data in images.items():
        header = read_header(data)
        assert (header.width, header.height) == loaded[name].size, name
    assert read_header(images["exif6"]).orientation == 6
    assert read_header(images["exif6"]).stored_size == (64, 32)
    assert read_header(images["png-exif8-after-pixels"]).orientation == 8
    assert read_header(images["cmyk"]).format == "JPEG"
    assert read_header(images["webp-exif5"]).orientation == 5


def test_reading_a_header_decodes_no_pixels(images):
    allocated = Image.core.get_stats()["new_count"]  # PIL counts every image memory it allocates
    header = read_header(images["huge"])
    assert (header.width, header.height) == (4000, 3000)
    assert Image.core.get_stats()["new_count"] == allocated
    for name, data in images.items():  # every format, but a PNG whose metadata follows its pixels
        read_header(data)
        assert Image.core.get_stats()["new_count"] == allocated + (name == "png-exif8-after-pixels"), name
        allocated = Image.core.get_stats()["new_count"]
    with Image.open(io.BytesIO(images["huge"])) as image:
        image.load()
    assert Image.core.get_stats()["new_count"] == allocated + 1  # and the counter does see a decode


@pytest.mark.parametrize("config", list(QWEN_CONFIGS))
def test_qwen_grids_equal_the_image_processors(config, images, loaded, qwen_processors, qwen_tokenizer):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    family = load_family(QWEN_CONFIGS[config], qwen_tokenizer)
    processor = qwen_processors[config]
    for name, data in images.items():
        grid = family.grid(read_header(data))
        if name == "huge" and family.max_pixels > 4000 * 3000:
            # 12 M pixels kept whole would cost a second of patching: the processor's own count and resize rule
            width, height = loaded[name].size
            assert grid[1] * grid[2] == processor.get_number_of_image_patches(height, width)
            assert (grid[1] * 16, grid[2] * 16) == smart_resize(height, width, 32, 65536, 16777216)
            continue
        expected = processor(images=[loaded[name]])["image_grid_thw"][0]
        assert grid == tuple(int(v) for v in expected), (config, name)
        assert family.expand(grid) == ([family.vision_start_id] + [family.image_id] * (int(np.prod(expected)) // 4)
                                       + [family.vision_end_id])


def test_qwen_reads_its_configuration_as_the_processor_does(qwen_tokenizer, qwen_processors):
    qwen3 = load_family(QWEN_CONFIGS["qwen3"], qwen_tokenizer)
    assert (qwen3.name, qwen3.patch_size, qwen3.min_pixels, qwen3.max_pixels) == ("qwen3_vl", 16, 65536, 16777216)
    default = load_family(QWEN_CONFIGS["qwen2-default"], qwen_tokenizer)
    size = qwen_processors["qwen2-default"].size
    assert (default.min_pixels, default.max_pixels) == (size["shortest_edge"], size["longest_edge"])
    assert default.image_marker == "<|vision_start|><|image_pad|><|vision_end|>"
    fingerprint = default.config_fingerprint()
    assert fingerprint["image_token_ids"] == [default.vision_start_id, default.image_id, default.vision_end_id]
    assert fingerprint != load_family(QWEN_CONFIGS["qwen2.5-small"], qwen_tokenizer).config_fingerprint()
    nested = {"processor_class": "Qwen2_5_VLProcessor", "image_processor": {"min_pixels": 100, "max_pixels": 5000}}
    assert processor_settings(nested)["max_pixels"] == 5000 and family_for(nested) is QwenVL
    assert pickle.loads(pickle.dumps(default)) == default  # families travel to the encode processes


def test_an_aspect_ratio_over_200_is_refused_as_the_processor_refuses_it(qwen_tokenizer, qwen_processors):
    from transformers.image_utils import load_image

    data = encoded(Image.new("RGB", (2010, 10)), "PNG")
    with pytest.raises(ValueError, match="aspect ratio"):
        qwen_processors["qwen2-default"](images=[load_image(Image.open(io.BytesIO(data)))])
    family = load_family(QWEN_CONFIGS["qwen2-default"], qwen_tokenizer)
    with pytest.raises(BadRow, match=r"^image 3: a 2010x10 image has aspect ratio 201, over the 200") as caught:
        family.grid(read_header(data, 3), 3)
    assert caught.value.reason == "image_aspect"


def test_gemma3_gives_its_fixed_count_as_its_processor(images, loaded, tokenizer):
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    family = load_family(GEMMA_CONFIG, tokenizer)
    assert isinstance(family, Gemma3) and family.image_marker == "<start_of_image>"
    assert pickle.loads(pickle.dumps(family)) == family
    image_processor = Gemma3ImageProcessorPil.from_dict(GEMMA_CONFIG)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=256)
    for name in ("tiny", "wide", "exif6", "huge"):
        grid = family.grid(read_header(images[name]))
        out = image_processor(images=[loaded[name]], return_tensors="np")
        assert grid == (1 + int(out["num_crops"][0]), *out["pixel_values"].shape[-2:]) == (1, 896, 896)
    # What Gemma3Processor puts in place of the boi token, tokenized (the text is the marker alone).
    ids = processor(text=[family.image_marker], images=[[loaded["tiny"]]])["input_ids"][0]
    assert family.expand(grid) == list(ids)
    assert family.expand(grid).count(tokenizer.image_token_id) == 256


def test_gemma3_with_pan_and_scan_on_is_refused(tokenizer):
    with pytest.raises(BadInput, match="do_pan_and_scan is on"):
        load_family({**GEMMA_CONFIG, "do_pan_and_scan": True}, tokenizer)


def test_an_unsupported_processor_or_tokenizer_is_named(qwen_tokenizer):
    with pytest.raises(BadInput, match=r"processor 'LlavaProcessor' / 'CLIPImageProcessor' is not supported.*"
                                       r"Qwen2_5_VLProcessor.*Gemma3Processor"):
        family_for({"processor_class": "LlavaProcessor", "image_processor_type": "CLIPImageProcessor"})
    assert family_for({"image_processor_type": "Gemma3ImageProcessorFast"}) is Gemma3
    with pytest.raises(BadInput, match="the tokenizer has no '<start_of_image>' token"):
        load_family(GEMMA_CONFIG, qwen_tokenizer)


# -- collate-time pixels -------------------------------------------------------------------------------------

def test_collate_pixels_equal_the_processors(images, loaded, qwen_tokenizer, tokenizer, qwen_processors):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    names = ["exif6", "png-exif8-after-pixels", "rgba", "gray", "cmyk", "palette", "tiny"]
    family = load_family(QWEN_CONFIGS["qwen2.5-small"], qwen_tokenizer)
    grids = [family.grid(read_header(images[n])) for n in names]
    made = family.pixels([images[n] for n in names], grids)
    expected = qwen_processors["qwen2.5-small"](images=[loaded[n] for n in names], return_tensors="np")
    assert np.array_equal(made["pixel_values"], expected["pixel_values"])
    assert np.array_equal(made["image_grid_thw"], expected["image_grid_thw"])

    gemma = load_family(GEMMA_CONFIG, tokenizer)
    made = gemma.pixels([images["exif6"], images["cmyk"]], [gemma.grid(read_header(images["exif6"]))] * 2)
    expected = Gemma3ImageProcessorPil.from_dict(GEMMA_CONFIG)(images=[loaded["exif6"], loaded["cmyk"]],
                                                               return_tensors="np")
    assert np.array_equal(made["pixel_values"], expected["pixel_values"])


def test_collate_refuses_a_grid_the_processor_no_longer_makes(images, qwen_tokenizer):
    stored = load_family(QWEN_CONFIGS["qwen2-default"], qwen_tokenizer)
    now = load_family(QWEN_CONFIGS["qwen2.5-small"], qwen_tokenizer)
    grids = [stored.grid(read_header(images[n])) for n in ("tiny", "photo")]
    with pytest.raises(CacheError, match=r"^row 7 image 2: the processor makes grid \(1, 12, 18\) but the cache "
                                         r"holds \(1, 14, 22\)"):
        now.pixels([images["tiny"], images["photo"]], grids, names=["row 7 image 1", "row 7 image 2"])
    truncated = images["photo"][: len(images["photo"]) // 2]  # its header reads; its pixels do not
    assert read_header(truncated) == read_header(images["photo"])
    with pytest.raises(CacheError, match=r"^image 1: the image cannot be decoded: .*truncated"):
        now.pixels([truncated], grids[1:])


# -- input shapes ----------------------------------------------------------------------------------------------

@pytest.fixture()
def image_dir(tmp_path, images):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "cat.png").write_bytes(images["rgba"])
    (tmp_path / "imgs" / "dog.jpg").write_bytes(images["photo"])
    return tmp_path


def test_the_input_shapes_normalize_alike(image_dir, images):
    base = str(image_dir)
    expected_refs = [ImageRef(url=str(image_dir / "imgs" / "cat.png")), ImageRef(data=images["photo"])]
    data_uri = "data:image/jpeg;base64," + __import__("base64").b64encode(images["photo"]).decode()
    dog_cell = {"bytes": images["photo"], "path": "dog.jpg"}

    def chat(first: dict, second: dict) -> list[dict]:
        return [{"role": "user", "content": [first, {"type": "text", "text": "Compare"}, second]},
                {"role": "assistant", "content": "Same size."}]

    shapes = {
        "image": (chat({"type": "image", "image": "imgs/cat.png"}, {"type": "image", "image": images["photo"]}),
                  None),
        "openai": (chat({"type": "image_url", "image_url": {"url": "imgs/cat.png"}},
                        {"type": "image_url", "image_url": data_uri}), None),
        "datasets": (chat({"type": "image", "image": {"bytes": None, "path": "imgs/cat.png"}},
                          {"type": "image", "image": dog_cell}), None),
        "placeholders": ([{"role": "user", "content": "<image>Compare<image>"},
                          {"role": "assistant", "content": "Same size."}], ["imgs/cat.png", dog_cell]),
        "payload-less parts": (chat({"type": "image"}, {"type": "image"}),
                               [{"bytes": None, "path": "imgs/cat.png"}, images["photo"]]),
    }
    results = {name: normalize_images(messages, extra, base=base) for name, (messages, extra) in shapes.items()}
    first_messages, first_refs = results["image"]
    assert first_refs == expected_refs
    assert first_messages[0]["content"] == [{"type": "image", "image": expected_refs[0]},
                                            {"type": "text", "text": "Compare"},
                                            {"type": "image", "image": expected_refs[1]}]
    for name, (messages, refs) in results.items():
        assert (messages, refs) == (first_messages, first_refs), name
    loaded_images = load_images(first_refs, max_bytes=1 << 20)
    assert [image.digest for image in loaded_images] == [content_hash(images["rgba"]), content_hash(images["photo"])]
    assert loaded_images[0].header.width == 45


def test_text_only_messages_stay_as_they_are():
    messages = [{"role": "user", "content": "a <image> in code"}, {"role": "assistant",
                                                                    "content": [{"type": "text", "text": "ok"}]}]
    out, refs = normalize_images(messages)  # no images column: the placeholder is text
    assert refs == [] and all(a is b for a, b in zip(out, messages, strict=True))


def test_an_fsspec_url_loads_through_fsspec(images):
    import fsspec

    with fsspec.open("memory://sft-tokenize-test/cat.png", "wb") as f:
        f.write(images["rgba"])
    _, refs = normalize_images([{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}],
                               base="memory://sft-tokenize-test")
    assert refs == [ImageRef(url="memory://sft-tokenize-test/cat.png")]
    assert load_images(refs)[0].data == images["rgba"]


# -- bad input ---------------------------------------------------------------------------------------------------

def _bad(tmp_path, images, case: str) -> BadRow:
    ok = {"type": "image", "image": images["tiny"]}
    with pytest.raises(BadRow) as caught:
        if case == "missing file":
            _, refs = normalize_images([{"role": "user", "content": [ok, {"type": "image", "image": "no.png"}]}],
                                       base=str(tmp_path))
            load_images(refs)
        elif case == "corrupt bytes":
            load_images([ImageRef(data=images["tiny"]), ImageRef(data=images["photo"][:40] + b"\0" * 9)])
        elif case == "not an image":
            load_images([ImageRef(data=images["tiny"]), ImageRef(data=b"GIF? no, plain text")])
        elif case == "unsupported scheme":
            normalize_images([{"role": "user", "content": [ok, {"type": "image_url",
                                                                "image_url": {"url": "ftp2://host/a.png"}}]}])
        elif case == "over max bytes":
            load_images([ImageRef(data=images["tiny"]), ImageRef(data=images["photo"])], max_bytes=1000)
        elif case == "file over max bytes":
            (tmp_path / "big.jpg").write_bytes(images["photo"])
            load_images([ImageRef(data=images["tiny"]), ImageRef(url=str(tmp_path / "big.jpg"))], max_bytes=1000)
        elif case == "fewer images than placeholders":
            normalize_images([{"role": "user", "content": "<image> and <image>"}], [images["tiny"]])
        elif case == "more images than placeholders":
            normalize_images([{"role": "user", "content": "<image> only"}], [images["tiny"], images["tiny"]])
    return caught.value


@pytest.mark.parametrize("case, reason, message", [
    ("missing file", "image_missing", r"^image 2: /.+/no\.png: file not found$"),
    ("corrupt bytes", "image_corrupt", r"^image 2: "),
    ("not an image", "image_corrupt", r"^image 2: not an image PIL can read"),
    ("unsupported scheme", "image_url_scheme", r"^image 2: unsupported URL scheme 'ftp2' in 'ftp2://host/a\.png'"),
    ("over max bytes", "image_too_large", r"^image 2: .*is [\d,]+ bytes, over the 1,000-byte limit"),
    ("file over max bytes", "image_too_large", r"^image 2: /.+big\.jpg is [\d,]+ bytes, over the 1,000-byte"),
    ("fewer images than placeholders", "image_count", r"^image 2: has no entry in images"),
    ("more images than placeholders", "image_count", r"^image 2: has no placeholder: the row has 2 images"),
])
def test_each_bad_input_says_which_image_and_what(tmp_path, images, case, reason, message):
    error = _bad(tmp_path, images, case)
    assert error.reason == reason
    assert __import__("re").search(message, str(error)), str(error)
    assert "\n" not in str(error)
    assert str(error.at("data.jsonl line 3")).startswith("data.jsonl line 3: image 2: ")


def test_tokenizing_code_imports_neither_transformers_nor_pil_until_it_reads_a_header():
    code = ("import sys\n"
            "import sft_tokenize.encoding.vision, sft_tokenize.sources.images as i\n"
            "before = {m.split('.')[0] for m in sys.modules}\n"
            "i.normalize_images([{'role': 'user', 'content': [{'type': 'image', 'image': b'x'}]}])\n"
            "print(sorted(before & {'PIL', 'transformers', 'torch', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_png_chunk_helper_moves_exif_after_the_pixels(images):
    data = images["png-exif8-after-pixels"]
    kinds = []
    offset = 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kinds.append(data[offset + 4:offset + 8])
        assert zlib.crc32(data[offset + 4:offset + 8 + length]) == struct.unpack(">I", data[offset + 8 + length:
                                                                                           offset + 12 + length])[0]
        offset += 12 + length
    assert kinds.index(b"eXIf") > kinds.index(b"IDAT")
    with Image.open(io.BytesIO(data)) as image:
        assert "exif" not in image.info  # so the header reader has to find it itself
