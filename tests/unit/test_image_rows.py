"""Image rows encoded against the real processors, Qwen2.5-VL's and Gemma 3's (built offline, PIL backend).

A property test: 500 generated conversations per family (seeded), images placed at random in every role
and position (first, middle and last part; one or several per message; over several turns), messages
without images as strings or as text parts, as sources give them. Every row's input_ids equal
`processor.apply_chat_template(..., tokenize=True, return_dict=True)`, its grids the processor's, and its
loss mask equals `image_oracle`'s, computed from the processor's rendered text by prefix renders (no marker,
no image run of the encoder's). A cut by max_length inside an image's run drops the row; an image row
without a processor is a row error."""

from __future__ import annotations

import random

import numpy as np
from support.mask_oracle import image_oracle

from sft_tokenize.chat.mask_settings import MaskSettings
from sft_tokenize.encoding.chat_encoder import ChatEncoder
from sft_tokenize.errors import BadRow
from sft_tokenize.sources.conversations import Conversation
from sft_tokenize.sources.images import load_images, normalize_images

CONVERSATIONS = 500
WORDS = "the cat sat on a mat and looked at what was there Über naïve 12 34 ,".split()
# Per family: its tokens that end a turn, its vision tokens, and whether its template renders a system
# message's image parts (Gemma 3's reads only the first part's text).
END_OF_TURN = {"qwen2.5-vl": ["<|im_end|>"], "gemma3": ["<end_of_turn>"]}
VISION_TOKENS = {"qwen2.5-vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
                 "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]}
SYSTEM_IMAGES = {"qwen2.5-vl": True, "gemma3": False}
# Small images of every kind the processors treat apart: the large ones cost seconds of pixels and add no case.
SMALL = ("tiny", "photo", "exif6", "png-exif8", "rgba", "gray", "cmyk", "palette")


def conversations(image_files, name: str, count: int = CONVERSATIONS, seed: int = 0) -> list[list[dict]]:
    """Chats of 1 to 4 exchanges, some with a system message; each message a string or 1 to 4 parts, any of
    them an image (a path), at most 6 images a chat."""
    rng = random.Random(seed)
    names = [n for n in SMALL if n in image_files]

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))

    def content(role: str, budget: list[int]) -> str | list[dict]:
        images = role != "system" or SYSTEM_IMAGES[name]
        if rng.random() < 0.3 or not (images or rng.random() < 0.5):
            return text()
        parts = []
        for _ in range(rng.randint(1, 4)):
            if images and budget[0] and rng.random() < 0.45:
                parts.append({"type": "image", "path": str(image_files[rng.choice(names)])})
                budget[0] -= 1
            else:
                parts.append({"type": "text", "text": text()})
        if not images:
            parts = parts[:1]  # a system message of Gemma 3's template: its first part's text
        return parts

    out = []
    for _ in range(count):
        budget = [rng.randint(0, 6)]
        messages = [{"role": "system", "content": content("system", budget)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 4)):
            for role in ("user", "assistant"):
                messages.append({"role": role, "content": content(role, budget)})
        out.append(messages)
    return out


def image_positions(chats: list[list[dict]], role: str) -> set[str]:
    """Where images stand in `role`'s messages: first, middle or last part, several in one message, and in
    two messages of the same chat."""
    seen = set()
    for chat in chats:
        with_images = 0
        for message in chat:
            parts = message["content"] if message["role"] == role and isinstance(message["content"], list) else []
            at = [k for k, p in enumerate(parts) if p["type"] == "image"]
            with_images += bool(at)
            seen |= {"first" for k in at if k == 0 and len(parts) > 1}
            seen |= {"last" for k in at if k == len(parts) - 1 and len(parts) > 1}
            seen |= {"middle" for k in at if 0 < k < len(parts) - 1}
            seen |= {"alone"} if len(parts) == 1 and at else set()
            seen |= {"several"} if len(at) > 1 else set()
        seen |= {"two messages"} if with_images > 1 else set()
    return seen


def image_row(messages: list[dict], vision) -> Conversation:
    """The conversation as the encoder takes it: payload-less image parts and each image's grid from its header."""
    normalized, refs = normalize_images(messages)
    grids = tuple(vision.grid(image.header, k) for k, image in enumerate(load_images(refs), start=1))
    bare = [m if isinstance(m["content"], str) else
            {**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
            for m in normalized]
    return Conversation(bare, image_grids=grids)


def replacements(processor, messages: list[dict], made: dict) -> list[str]:
    """What the processor puts where each image of the chat stands (`replace_image_token`), one image at a time."""
    from transformers.image_utils import load_image

    out = []
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part["type"] == "image":
                if part["path"] not in made:
                    inputs = processor.image_processor(images=[load_image(part["path"])])
                    made[part["path"]] = processor.replace_image_token(inputs, 0)
                out.append(made[part["path"]])
    return out


def test_image_rows_equal_the_processors_and_train_what_the_definition_trains(vision_family, image_files):
    name, tokenizer, processor, vision = vision_family
    chats = conversations(image_files, name)
    rows = [image_row(messages, vision) for messages in chats]
    assert {len(r.image_grids) for r in rows} >= set(range(7))
    everywhere = {"first", "middle", "last", "alone", "several"}
    assert image_positions(chats, "user") == image_positions(chats, "assistant") == everywhere | {"two messages"}
    assert image_positions(chats, "system") == (everywhere if SYSTEM_IMAGES[name] else set())
    results = ChatEncoder(tokenizer, vision=vision).encode_batch(rows).results()
    vision_ids = np.array(sorted(vision.vision_token_ids))
    made: dict[str, str] = {}
    for k, (messages, row, got) in enumerate(zip(chats, rows, results, strict=True)):
        assert not isinstance(got, (str, BadRow)), f"{name} row {k}: {got}"
        ids, mask = image_oracle(processor, messages, replacements(processor, messages, made),
                                 VISION_TOKENS[name], END_OF_TURN[name])
        assert got.input_ids.tolist() == ids, f"{name} row {k}"
        assert got.loss_mask.tolist() == mask, f"{name} row {k}: {messages}"
        assert not got.loss_mask[np.isin(got.input_ids, vision_ids)].any(), f"{name} row {k}: a vision token trained"
        # The processor's own ids and grids.
        want = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
        assert got.input_ids.tolist() == list(want["input_ids"][0]), f"{name} row {k}"
        if name == "qwen2.5-vl" and row.image_grids:
            assert [tuple(g) for g in want["image_grid_thw"].tolist()] == list(row.image_grids), f"row {k}"
        elif name == "gemma3":
            assert len(want.get("pixel_values", [])) == len(row.image_grids), f"row {k}"


def test_a_cut_inside_an_image_run_drops_the_row_and_a_cut_after_it_truncates(vision_family, image_files):
    name, tokenizer, _, vision = vision_family
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image", "path": str(image_files["photo"])}]},
                {"role": "assistant", "content": "A pattern of stripes, in three colours."}]
    row = image_row(messages, vision)
    whole = ChatEncoder(tokenizer, vision=vision).encode_batch([row]).row(0)
    ids = whole.input_ids.tolist()
    first, last = ids.index(vision.run(row.image_grids[0])[0]), len(ids) - 1 - ids[::-1].index(
        vision.run(row.image_grids[0])[-1])
    inside = ChatEncoder(tokenizer, MaskSettings(max_length=(first + last) // 2), vision=vision).encode_batch([row])
    assert inside.outcomes == ["image_truncated"]
    after = ChatEncoder(tokenizer, MaskSettings(max_length=len(ids) - 2), vision=vision).encode_batch([row])
    assert after.row(0).input_ids.tolist() == ids[:len(ids) - 2]


def test_an_image_row_without_a_processor_is_a_row_error(vision_family, image_files):
    _, tokenizer, _, vision = vision_family
    row = image_row([{"role": "user", "content": [{"type": "image", "path": str(image_files["tiny"])}]},
                     {"role": "assistant", "content": "Small."}], vision)
    (got,) = ChatEncoder(tokenizer).encode_batch([row]).results()
    assert isinstance(got, BadRow) and got.reason == "image_without_processor"


def test_two_assistant_turns_that_open_with_an_image_are_both_trained(vision_family, image_files):
    """Messages with images are parts, the others strings (as sources give them): each turn's text is trained,
    though no message but the system's has a string to locate it by."""
    name, tokenizer, processor, vision = vision_family
    image = {"type": "image", "path": str(image_files["photo"])}
    messages = [{"role": "system", "content": "Describe what you are shown."},
                {"role": "user", "content": [image, {"type": "text", "text": "And this?"}]},
                {"role": "assistant", "content": [image, {"type": "text", "text": "The first answer."}]},
                {"role": "user", "content": [{"type": "text", "text": "Again?"}, image]},
                {"role": "assistant", "content": [image, {"type": "text", "text": "The second answer."}]}]
    (got,) = ChatEncoder(tokenizer, vision=vision).encode_batch([image_row(messages, vision)]).results()
    trained = tokenizer.decode(got.input_ids[got.loss_mask == 1].tolist())
    assert "The first answer." in trained and "The second answer." in trained, trained
